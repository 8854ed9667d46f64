"""Linear algebra: MatMul, Gemm, Einsum, Det.

Weight gradients are single matrix products: Gemm with transA/transB where
the operands are 2-D, a flattened ``[rows, k]^T @ [rows, n]`` Gemm for the
usual ``[batch..., k] @ [k, n]`` weight, and one Transpose at most elsewhere.
"""
from __future__ import annotations

import re
import string
from typing import Sequence

import numpy as np
from onnx import TensorProto, numpy_helper

from onnxgrad.ir.builder import INT64_MAX, Var

from .registry import Node, register

# -- Gemm, where onnxruntime takes it ----------------------------------------------------
# onnxruntime 1.32's GemmSumFusion asserts (gemm_sum_fusion.cc:54, "gemm_input_edge.src_arg_index < 2")
# on a Gemm without C that reads output #2 or later of a node and feeds a Sum: the backward of
# Concat(a, b, MatMul(b, W)) (Split -> Gemm -> Sum) is refused at session creation with default
# optimizations. Such operands get MatMul with explicit Transposes instead.
_LATE_OUTPUT = re.compile(r"_out([2-9]|[1-9][0-9]+)(_[0-9]+)?$")


def _late_output(n: Node, x: Var) -> bool:
    """x is output #2 or later of a multi-output node of the backward (named '<node>_out<k>')."""
    return _LATE_OUTPUT.search(x.name) is not None


def _gemm(n: Node, a: Var, b: Var, alpha: float | None = None, transA: int = 0, transB: int = 0) -> Var:
    """alpha * op(a) @ op(b) for 2-D a, b: one Gemm, or MatMul where onnxruntime's Gemm fusion would fail."""
    if not (_late_output(n, a) or _late_output(n, b)):
        return n.op.Gemm(a, b, alpha=alpha, transA=transA or None, transB=transB or None)
    y = n.op.MatMul(n.op.Transpose(a, perm=[1, 0]) if transA else a, n.op.Transpose(b, perm=[1, 0]) if transB else b)
    return y if alpha is None or alpha == 1.0 else y * alpha


# -- MatMul ---------------------------------------------------------------------------
@register("MatMul")
def matmul(n: Node):
    """Y = A @ B (numpy matmul):  dA = dY @ B^T,  dB = A^T @ dY, summed over broadcast batch dims.

    A 1-D A is a row [1, k] and a 1-D B a column [k, 1] whose unit dim is dropped
    from Y, so their gradients are outer products / matrix-vector products. Ranks unknown
    when the gradient is built: the same promotion made at run time (:func:`_matmul_any_rank`).
    """
    a, b = n.inputs
    ra, rb = a.rank, b.rank
    if ra is None or rb is None:
        return _matmul_any_rank(n, a, b, n.dy)
    dy = n.dy
    if ra == 1 and rb == 1:                                   # y = a . b
        return (dy * b if n.needs(0) else None), (dy * a if n.needs(1) else None)
    if ra == 1:
        return _matmul_vector_times_matrix(n, a, b, dy)
    if rb == 1:
        return _matmul_matrix_times_vector(n, a, b, dy)
    da = _matmul_grad_a(n, a, b, dy) if n.needs(0) else None
    db = _matmul_grad_b(n, a, b, dy) if n.needs(1) else None
    return da, db


def _matmul_any_rank(n: Node, a: Var, b: Var, dy: Var):
    """Y = A @ B with a rank unknown at build time. numpy's matmul is the batched product of
    A2 = A as [1, k] if 1-D, B2 = B as [k, 1] if 1-D (the unit dims dropped from Y), so with dY2 = dY
    with those unit dims put back, all three Reshapes to shapes made at run time:
    dA = unbroadcast(dY2 @ B2^T, A2) as A's shape,  dB = unbroadcast(A2^T @ dY2, B2) as B's shape."""
    bb = n.b
    one = bb.ints([1])
    row = _run_time_ones(n, bb.emit("Equal", [bb.emit("Shape", [bb.shape_of(a)]), one]))   # [1] if A is 1-D, else []
    col = _run_time_ones(n, bb.emit("Equal", [bb.emit("Shape", [bb.shape_of(b)]), one]))   # [1] if B is 1-D, else []
    a2 = n.op.Reshape(a, n.op.Concat(row, bb.shape_of(a), axis=0))
    b2 = n.op.Reshape(b, n.op.Concat(bb.shape_of(b), col, axis=0))
    # Y is batch + [m if A is not 1-D] + [n if B is not 1-D]: the row goes before n's place, the column last
    ys = bb.shape_of(dy)
    cut = bb.emit("Shape", [ys]) - bb.emit("Sub", [one, bb.emit("Shape", [col])])
    head = n.op.Slice(ys, bb.ints([0]), cut)
    tail = n.op.Slice(ys, cut, bb.ints([INT64_MAX]))
    dy2 = n.op.Reshape(dy, n.op.Concat(head, row, tail, col, axis=0))
    da = db = None
    if n.needs(0):
        da = n.op.Reshape(bb.unbroadcast(n.op.MatMul(dy2, _swap_last_any_rank(n, b2)), a2), bb.shape_of(a))
    if n.needs(1):
        db = n.op.Reshape(bb.unbroadcast(n.op.MatMul(_swap_last_any_rank(n, a2), dy2), b2), bb.shape_of(b))
    return da, db


def _run_time_ones(n: Node, flag: Var) -> Var:
    """[1] where the 1-element bool ``flag`` holds, [] where not (a dim to insert or not, at run time)."""
    count = n.op.Cast(flag, to=TensorProto.INT64)
    return n.op.ConstantOfShape(count, value=numpy_helper.from_array(np.ones(1, np.int64)))


def _swap_last_any_rank(n: Node, x: Var) -> Var:
    """x^T over the last two axes, x of a rank unknown at build time (at least 2): a [-1, m, k] view
    transposed to [-1, k, m], then x's batch dims + [k, m]."""
    bb = n.b
    batch, m, k = bb.shape_of(x, 0, -2), bb.shape_of(x, -2, -1), bb.shape_of(x, -1)
    x3 = n.op.Reshape(x, n.op.Concat(bb.ints([-1]), m, k, axis=0))
    return n.op.Reshape(n.op.Transpose(x3, perm=[0, 2, 1]), n.op.Concat(batch, k, m, axis=0))


def _swap_last(n: Node, x: Var) -> Var:
    """x^T over the last two axes."""
    r = x.rank
    return n.op.Transpose(x, perm=list(range(r - 2)) + [r - 1, r - 2])


def _matrix_axes(n: Node) -> tuple[int, int]:
    """The product's row and column axes, which no operand broadcasts along."""
    rank = len(_batch_dims(n)) + 2
    return rank - 2, rank - 1


def _matmul_grad_a(n: Node, a: Var, b: Var, dy: Var) -> Var:
    """dA = dY @ B^T (Gemm transB=1 in 2-D), summed over the batch dims A was broadcast along."""
    if a.rank == 2 and b.rank == 2:
        return _gemm(n, dy, b, transB=1)
    da = n.op.MatMul(dy, _swap_last(n, b))
    if b.rank == 2:
        return da                                             # A's batch dims are Y's
    return n.b.unbroadcast(n.b.with_shape(da, _batch_dims(n) + tuple(a.shape[-2:])), a, _matrix_axes(n))


def _matmul_grad_b(n: Node, a: Var, b: Var, dy: Var) -> Var:
    """dB = A^T @ dY; a weight shared by the whole batch gets one Gemm over flattened rows."""
    if a.rank == 2 and b.rank == 2:
        return _gemm(n, a, dy, transA=1)
    if b.rank == 2 or all(d == 1 for d in b.shape[:-2]):
        # dB[k, n] = sum over rows r of A[r, k] dY[r, n], rows = batch dims and m flattened
        rows_a = _flatten_rows(n, a, a.shape[-1] or b.shape[-2], a)
        rows_dy = _flatten_rows(n, dy, b.shape[-1], b)
        db = _gemm(n, rows_a, rows_dy, transA=1)                  # [k, n]
        return db if b.rank == 2 else n.b.reshape_like(db, b)
    db = n.op.MatMul(_swap_last(n, a), dy)
    return n.b.unbroadcast(n.b.with_shape(db, _batch_dims(n) + tuple(b.shape[-2:])), b, _matrix_axes(n))


def _matmul_vector_times_matrix(n: Node, a: Var, b: Var, dy: Var):
    """y[..., j] = sum_k a[k] B[..., k, j]:  da = sum over batch of B @ dy,  dB = a (outer) dy."""
    da = db = None
    if n.needs(0):
        if b.rank == 2:
            da = n.op.MatMul(b, dy)
        else:
            col = n.op.MatMul(b, n.b.unsqueeze(dy, [-1]))     # [..., k, 1]
            da = n.b.sum(col, list(range(b.rank - 2)) + [b.rank - 1], keepdims=False)
    if n.needs(1):
        db = n.b.unsqueeze(a, [-1]) * n.b.unsqueeze(dy, [-2])  # [k, 1] * [..., 1, j]
    return da, db


def _matmul_matrix_times_vector(n: Node, a: Var, b: Var, dy: Var):
    """y[..., i] = sum_k A[..., i, k] b[k]:  dA = dy (outer) b,  db = dy @ A over flattened rows."""
    da = db = None
    if n.needs(0):
        da = n.b.unsqueeze(dy, [-1]) * b                      # [..., i, 1] * [k]
    if n.needs(1):
        if a.rank == 2:
            db = n.op.MatMul(dy, a)
        else:
            rows_a = _flatten_rows(n, a, b.shape[0], b)
            db = n.op.MatMul(n.op.Reshape(dy, n.b.ints([-1])), rows_a)
    return da, db


def _flatten_rows(n: Node, x: Var, cols: int | None, cols_of: Var) -> Var:
    """x as a [rows, cols] matrix; ``cols`` is x's last dim (read from ``cols_of``'s last dim if unknown)."""
    if cols is not None:
        shape = n.b.ints([-1, cols])
    else:
        shape = n.op.Concat(n.b.ints([-1]), n.b.shape_of(cols_of, -1), axis=0)
    return n.op.Reshape(x, shape)


def _batch_dims(n: Node) -> tuple[int | None, ...]:
    """Y's batch dims (all but the last two), None where unknown."""
    a, b = n.inputs
    ys = n.outputs[0].shape
    rank = max(a.rank, b.rank)
    if ys is not None and len(ys) == rank:
        return tuple(ys[:-2])
    return (None,) * (rank - 2)


# -- Gemm -----------------------------------------------------------------------------
@register("Gemm")
def gemm(n: Node):
    """Y = alpha * A' @ B' + beta * C  with A' = A^T if transA, B' = B^T if transB:

    dA' = alpha dY B'^T,  dB' = alpha A'^T dY  (each a Gemm with its own transA/transB),
    dC = beta * dY summed to C's shape.
    """
    a, b = n.inputs[:2]
    c = n.input(2)
    alpha = float(n.attr("alpha", 1.0))
    beta = float(n.attr("beta", 1.0))
    ta, tb = int(n.attr("transA", 0)), int(n.attr("transB", 0))
    scale = alpha if alpha != 1.0 else None
    dy = n.dy
    da = db = dc = None
    if n.needs(0):
        if not ta:   # dA = alpha dY B'^T
            da = _gemm(n, dy, b, alpha=scale, transB=1 - tb)
        else:        # dA = (alpha dY B'^T)^T = alpha B' dY^T
            da = _gemm(n, b, dy, alpha=scale, transA=tb, transB=1)
    if n.needs(1):
        if not tb:   # dB = alpha A'^T dY
            db = _gemm(n, a, dy, alpha=scale, transA=1 - ta)
        else:        # dB = (alpha A'^T dY)^T = alpha dY^T A'
            db = _gemm(n, dy, a, alpha=scale, transA=1, transB=ta)
    if c is not None and n.needs(2):
        dc = n.b.unbroadcast(dy, c)
        if beta != 1.0:
            dc = dc * beta
    return (da, db, dc)[:len(n.inputs)]


# -- Einsum ---------------------------------------------------------------------------
@register("Einsum")
def einsum(n: Node):
    """Y = einsum(eq, X_1..X_k):  dX_i = einsum(dY, X_j (j != i) -> terms of X_i).

    Repeated indices of X_i (diagonals) are written back with identity matrices
    (EyeLike) as extra operands; indices only X_i has (summed out) are put back
    with Unsqueeze + Expand; ellipsis dims X_i had as 1 while others broadcast
    them are summed back.
    """
    ranks = [x.rank if x is not None else None for x in n.inputs]
    if any(r is None for r in ranks):
        n.decline("Einsum gradient needs the ranks of all operands (run shape inference)")
    terms, out = _einsum_terms(n, n.attr("equation"), ranks)
    return tuple(_einsum_operand_grad(n, i, terms, out) if n.needs(i) else None
                 for i in range(len(n.inputs)))


def _einsum_terms(n: Node, equation: str, ranks: Sequence[int]) -> tuple[list[str], str]:
    """Operand and output subscripts with every '...' spelled out as fresh letters, the output explicit."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    raw = lhs.split(",")
    if len(raw) != len(ranks):
        n.decline(f"Einsum equation '{equation}' names {len(raw)} operands, the node has {len(ranks)}")
    used = set(eq) - set(".,->")
    fresh = [c for c in string.ascii_letters if c not in used]
    ell_ranks = [r - (len(t) - 3) if "..." in t else 0 for t, r in zip(raw, ranks)]
    width = max(ell_ranks, default=0)
    if width > len(fresh):
        n.decline("Einsum: not enough free subscript letters to spell out the ellipsis")
    ell = "".join(fresh[:width])
    terms = [t.replace("...", ell[width - e:]) for t, e in zip(raw, ell_ranks)]
    if arrow:
        out = rhs.replace("...", ell)
    else:  # implicit: ellipsis dims, then the letters seen exactly once, in ASCII order (as numpy)
        letters = "".join(t.replace("...", "") for t in raw)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, out


def _einsum_operand_grad(n: Node, i: int, terms: list[str], out: str) -> Var:
    x = n.inputs[i]
    term = terms[i]
    taken = set("".join(terms) + out)
    spare = [c for c in string.ascii_letters if c not in taken]
    # a repeated letter: the first stays, the others get new names tied to it by an identity matrix
    target, eyes = [], []
    for pos, c in enumerate(term):
        if c in term[:pos]:
            if not spare:
                n.decline("Einsum: not enough free subscript letters for the diagonal")
            new = spare.pop(0)
            eyes.append((c + new, _eye(n, x, pos)))
            target.append(new)
        else:
            target.append(c)
    others = [(terms[j], n.inputs[j]) for j in range(len(terms)) if j != i]
    available = set(out) | set("".join(t for t, _ in others)) | set("".join(t for t, _ in eyes))
    kept = [c for c in target if c in available]
    missing = [pos for pos, c in enumerate(target) if c not in available]
    operands = [(out, n.dy)] + others + eyes
    if len(operands) == 1 and "".join(kept) == out:
        g = n.dy                  # Y = X up to summed-out indices: nothing to contract
    else:
        equation = ",".join(t for t, _ in operands) + "->" + "".join(kept)
        g = n.op.Einsum(*[v for _, v in operands], equation=equation)
    if missing:   # indices only X_i has: dX does not vary along them
        g = n.op.Expand(n.b.unsqueeze(g, missing), _shape(n, x))
    return _einsum_unbroadcast(n, g, i, terms)


def _eye(n: Node, x: Var, pos: int) -> Var:
    """The identity matrix of size x.shape[pos], of x's type."""
    d = x.shape[pos]
    if d is not None:
        square = n.b.ints([d, d])
    else:
        dim = n.b.shape_of(x, pos, pos + 1)
        square = n.op.Concat(dim, dim, axis=0)
    return n.op.EyeLike(n.b.zeros(square, x))


def _shape(n: Node, x: Var) -> Var:
    return n.b.ints(x.shape) if x.info.static else n.b.shape_of(x)


def _einsum_unbroadcast(n: Node, g: Var, i: int, terms: list[str]) -> Var:
    """Sum the dims X_i has as 1 where another operand has the index bigger (einsum broadcasts them:
    ellipsis dims, and the explicit indices our own gradient Einsums contract with broadcast operands)."""
    x = n.inputs[i]
    term = terms[i]
    xs = x.shape
    axes, decidable = [], True
    for pos, c in enumerate(term):
        elsewhere = [n.inputs[j].shape[q] for j, t in enumerate(terms) if j != i
                     for q, cj in enumerate(t) if cj == c]
        if not elsewhere or all(d == 1 for d in elsewhere):
            continue
        if xs[pos] == 1:
            axes.append(pos)
        elif xs[pos] is None:
            decidable = False     # 1 (broadcast) or the full size: only the run time knows
    if not decidable:
        return n.b.unbroadcast(g, x)
    return n.b.sum(g, axes, keepdims=True) if axes else g


# -- Det ------------------------------------------------------------------------------
@register("Det")
def det(n: Node):
    """dX = dy * det(X) * inv(X)^T = dy * cof(X),  cof(X)_ij = (-1)^(i+j) det(X without row i, column j).

    The cofactor matrix is exact for singular X too and needs no inverse (ai.onnx
    has none): the M*M minors are gathered at once and go through one Det.
    M unknown when the gradient is built: the same minors, indexed at run time
    (:func:`_cofactors_dynamic`). The gathered minors hold M^2 (M-1)^2 elements per
    matrix, so this is meant for small matrices.
    """
    (x,) = n.inputs
    r = x.rank
    dy = n.b.unsqueeze(n.dy, [-2, -1])                            # [..., 1, 1]
    if r is None or x.shape[-1] is None and x.shape[-2] is None:
        return (dy * _cofactors_dynamic(n, x),)
    m = x.shape[-1] if x.shape[-1] is not None else x.shape[-2]
    if m == 1:                                                    # det([[a]]) = a
        return (dy,)
    flat = n.op.Reshape(x, n.b.ints([0] * (r - 2) + [m * m]))    # [..., M*M]
    idx = np.arange(m * m).reshape(m, m)
    if m == 2:  # the minors are single elements: |cof| = [[d, c], [b, a]]
        minor = n.op.Gather(flat, n.b.const(idx[::-1, ::-1].copy()), axis=r - 2)
    else:       # minors[i, j] = X without row i and column j: [..., M, M, M-1, M-1]
        minors = np.empty((m, m, m - 1, m - 1), np.int64)
        for i in range(m):
            for j in range(m):
                minors[i, j] = np.delete(np.delete(idx, i, axis=0), j, axis=1)
        minor = n.op.Det(n.op.Gather(flat, n.b.const(minors), axis=r - 2))
    sign = (-1.0) ** np.add.outer(np.arange(m), np.arange(m))
    return (dy * (minor * n.b.const_like(sign, x)),)


def _cofactors_dynamic(n: Node, x: Var) -> Var:
    """cof(X) for M (and the batch dims) known only at run time, [..., M, M]: minor (i, j) keeps rows
    a + (a >= i) and columns c + (c >= j) for a, c < M - 1, gathered from X flattened to [..., M*M]
    and put through one Det; the signs (-1)^(i+j) from the parity of i + j. M = 1 is not special:
    the minors are 0 x 0 and their Det is 1."""
    b = n.b
    shape = b.shape_of(x)
    m = n.op.Slice(shape, b.ints([-1]), b.ints([np.iinfo(np.int64).max]))           # [M]
    zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
    size = b.squeeze(m, [0])
    full = n.op.Range(zero, size, one)                                              # i, j < M
    part = n.op.Range(zero, n.op.Sub(size, one), one)                               # a, c < M - 1
    keep = n.op.Add(b.unsqueeze(part, [0]),                                          # [M, M-1]: a + (a >= i)
                    n.op.Cast(n.op.GreaterOrEqual(b.unsqueeze(part, [0]), b.unsqueeze(full, [1])),
                              to=TensorProto.INT64))
    rows = n.op.Mul(b.unsqueeze(keep, [1, 3]), m)                                   # [M, 1, M-1, 1]
    cols = b.unsqueeze(keep, [0, 2])                                                # [1, M, 1, M-1]
    flat = n.op.Reshape(x, n.op.Concat(n.op.Slice(shape, b.ints([0]), b.ints([-2])), n.op.Mul(m, m), axis=0))
    minor = n.op.Det(n.op.Gather(flat, n.op.Add(rows, cols), axis=-1))            # [..., M, M]
    parity = n.op.Mod(n.op.Add(b.unsqueeze(full, [1]), b.unsqueeze(full, [0])), b.const(np.array(2, np.int64)))
    sign = b.cast_like(n.op.Sub(one, n.op.Mul(parity, b.const(np.array(2, np.int64)))), x)
    return minor * sign
