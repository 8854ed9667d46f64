"""Shape and data-movement ops. They are linear, so each gradient is the op's transpose.

Reshape-like ops reshape back; Transpose transposes by the inverse permutation;
Concat splits and Split concatenates; Slice pads (interleaving zeros for
strides); Pad slices (and folds reflected/edge/wrapped borders back); Tile and
Expand sum; Gather-like ops scatter-add, Scatter-like ops gather.

Scatter-adds: ScatterND / ScatterElements with ``reduction="add"`` from opset
16; before, where indices may repeat, an exact one-hot contraction (Equal
against a Range, then MatMul or Mul + ReduceSum) instead.

Sizes that are unknown when the gradient is built are read at run time
(``Shape``); the builder's helpers carry a size either as an ``int`` or as a 1-D
int64 tensor ``[size]`` (:data:`onnxgrad.ir.builder.Dim`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from onnx import TensorProto, numpy_helper

from onnxgrad.ir.builder import INT64_MAX, INT64_MIN, Dim, Var
from onnxgrad.ir.model import TensorInfo, torch_padding_idx

from .registry import Node, register


# -- helpers: sizes, shapes, constants ---------------------------------------------------
def _known_axis(n: Node, axis: int, tensors: Sequence[Var]) -> int:
    """axis made non-negative with the first known rank among tensors; as given (ONNX counts it
    from the end) when no rank is known."""
    for t in tensors:
        if t is not None and t.rank is not None:
            return n.b.normalize_axis(axis, t.rank)
    return axis


def _add(n: Node, a: Dim, b: Dim) -> Dim:
    """The sum of two sizes, folded where static."""
    if isinstance(a, Var) or isinstance(b, Var):
        return n.op.Add(n.b.vector([a]), n.b.vector([b]))
    return a + b


def _value(n: Node, x: Var | None) -> np.ndarray | None:
    """x's value when it is a constant known at build time."""
    return None if x is None else n.b.constants.get(x.name)


def _int64(n: Node, x: Var) -> Var:
    return x if x.dtype == TensorProto.INT64 else n.op.Cast(x, to=TensorProto.INT64)


def _nonneg(n: Node, idx: Var, size: Dim, per_column: bool = False) -> Var:
    """Indices with negatives counted from the end (idx + size), int64; in Python when idx is a constant.

    ``size``: an int or a Dim [d], made 0-D so that a 0-D idx stays 0-D (Add would broadcast it to [1]);
    ``per_column``: size is an int64 tensor broadcasting against idx (GatherND: one size per index column).
    """
    value = _value(n, idx)
    if value is not None and (not isinstance(size, Var) or not (value < 0).any()):
        value = value.astype(np.int64)
        return n.b.const(np.where(value < 0, value + (0 if isinstance(size, Var) else size), value))
    shape = idx.shape
    idx = _int64(n, idx)
    if isinstance(size, Var):
        shift = size if per_column else n.b.int_scalar(size)
    else:
        shift = n.b.const(np.array(size, np.int64))
    out = n.op.Where(n.op.Less(idx, n.b.int_scalar(0)), n.op.Add(idx, shift), idx)
    n.b.infos[out.name] = TensorInfo(TensorProto.INT64, shape)
    return out


def _onehot(n: Node, rows: Var, idx: Var, like: Var) -> Var:
    """(rows == idx) as like's float type: the exact matrix of a scatter-add, duplicates included."""
    return n.b.cast_like(n.op.Equal(rows, idx), like)


# -- Reshape, Flatten, Squeeze, Unsqueeze, Transpose -------------------------------------
@register("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(n: Node):
    """Only the shape changes: dx = Reshape(dy, shape(x))"""
    return (n.b.reshape_like(n.dy, n.inputs[0]),)


@register("Transpose")
def transpose(n: Node):
    """y = transpose(x, perm):  dx = transpose(dy, argsort(perm))   (no perm: reversed axes, its own inverse)"""
    perm = n.attr("perm")
    if perm is None:
        return (n.op.Transpose(n.dy),)
    return (n.op.Transpose(n.dy, perm=[int(i) for i in np.argsort(perm)]),)


# -- Concat, Split -----------------------------------------------------------------------
@register("Concat")
def concat(n: Node):
    """y = concat(x_1..x_k, axis):  dx_i = dy[offset_i : offset_i + size_i] along axis

    One Split when every input needs its gradient, else a Slice per input that does.
    """
    xs = n.inputs
    axis = _known_axis(n, n.attr("axis"), [*xs, n.outputs[0]])
    if len(xs) == 1:
        return (n.dy,)
    sizes = [n.b.dim(x, axis) for x in xs]
    if all(n.needs(i) for i in range(len(xs))):
        return n.op.Split(n.dy, n.b.vector(sizes), axis=axis, outputs=len(xs))
    grads: list[Var | None] = []
    offset: Dim = 0
    for i, size in enumerate(sizes):
        end = _add(n, offset, size)
        if n.needs(i):
            grads.append(n.op.Slice(n.dy, n.b.vector([offset]), n.b.vector([end]), n.b.ints([axis])))
        else:
            grads.append(None)
        offset = end
    return tuple(grads)


@register("Split")
def split(n: Node):
    """y_1..y_k = split(x, axis):  dx = concat(dy_1..dy_k, axis)   (zeros for outputs no gradient reaches)"""
    axis = _known_axis(n, n.attr("axis", 0), [n.inputs[0], *n.outputs])
    parts = [n.dy_or_zeros(i) for i in range(len(n.outputs))]
    return (parts[0] if len(parts) == 1 else n.op.Concat(*parts, axis=axis),)


# -- Slice -------------------------------------------------------------------------------
@register("Slice")
def slice_(n: Node):
    """y = x[starts:ends:steps] on axes:  dx = zeros(x) with dy put back where the slice took it.

    Known bounds and sizes: one Pad for unit steps, after a reversal (Slice with
    step -1) for negative steps, after interleaving |step| - 1 zeros between
    elements (Unsqueeze, Pad, Reshape) for larger steps: no scatter.
    Unit steps with bounds or sizes known only at run time: the same Pad, its
    pads computed in the graph (clamped as Slice clamps).
    Other steps known only at run time: one ScatterND of dy at the flat
    positions the slice takes (the same Slice of a Range; they never repeat).
    """
    x = n.inputs[0]
    r = x.rank
    count = _slice_count(n)
    if n.input(3) is not None:
        axes = n.const_ints(3)
    else:
        axes = list(range(count)) if count is not None else None
    if r is None:
        return (_slice_grad_scatter(n, x),)
    if axes is not None:
        axes = [n.b.normalize_axis(a, r) for a in axes]
    starts, ends, steps = n.const_ints(1), n.const_ints(2), n.const_ints(4)
    if n.input(4) is None and axes is not None:
        steps = [1] * len(axes)
    unit = n.input(4) is None or (steps is not None and all(st == 1 for st in steps))
    if (axes is not None and None not in (starts, ends, steps)
            and all(x.shape[a] is not None for a in axes)):
        return (_slice_grad_static(n, x, axes, starts, ends, steps),)
    if unit and axes is not None:
        return (_slice_grad_pad(n, x, axes),)
    if unit and n.input(3) is not None and n.opset >= 18:
        return (_slice_grad_pad(n, x, n.input(3)),)
    return (_slice_grad_scatter(n, x),)


def _slice_count(n: Node) -> int | None:
    """How many axes are sliced: the length of starts, ends, axes or steps, whichever is known."""
    for i in range(1, 5):
        value = n.const_ints(i)
        if value is not None:
            return len(value)
        x = n.input(i)
        if x is not None and x.shape is not None and x.shape[0] is not None:
            return x.shape[0]
    return None


def _slice_grad_static(n: Node, x: Var, axes: list[int], starts, ends, steps) -> Var:
    r = x.rank
    size: list[Dim] = n.b.dims(x)     # the current gradient's shape, axis by axis
    begin, end = [0] * r, [0] * r
    reverse, strided = [], []
    for a, s, e, st in zip(axes, starts, ends, steps):
        d = x.shape[a]
        taken = range(d)[slice(s, e, st)]      # the indices Slice takes (its clamping is Python's)
        m = len(taken)
        if m == 0:
            return n.b.zeros_like(x)
        lo = min(taken[0], taken[-1])
        stride = abs(st) if m > 1 else 1
        if st < 0 and m > 1:
            reverse.append(a)
        if stride > 1:
            strided.append((a, stride))
        size[a] = m
        begin[a] = lo
        end[a] = d - lo - ((m - 1) * stride + 1)
    g = n.dy
    if reverse:
        k = len(reverse)
        g = n.op.Slice(g, n.b.ints([-1] * k), n.b.ints([INT64_MIN] * k), n.b.ints(reverse), n.b.ints([-1] * k))
    for a, stride in strided:
        g = _interleave_zeros(n, g, a, stride, size)
    if any(begin) or any(end):
        g = n.op.Pad(g, n.b.ints(begin + end))
    return g


def _interleave_zeros(n: Node, g: Var, axis: int, stride: int, size: list[Dim]) -> Var:
    """[a, b, c] -> [a, 0, 0, b, 0, 0, c] along axis (stride 3): Unsqueeze, Pad, Reshape, Slice.

    ``size`` is g's shape; it is updated to the result's.
    """
    r = len(size)
    m = size[axis]
    pads = [0] * (2 * (r + 1))
    pads[r + 1 + axis + 1] = stride - 1
    spread = n.op.Pad(n.b.unsqueeze(g, [axis + 1]), n.b.ints(pads))        # [..., m, stride, ...]
    merged = n.op.Reshape(spread, n.b.vector([0] * axis + [m * stride] + size[axis + 1:]))
    size[axis] = (m - 1) * stride + 1
    return n.op.Slice(merged, n.b.ints([0]), n.b.ints([size[axis]]), n.b.ints([axis]))


def _slice_grad_pad(n: Node, x: Var, axes: list[int] | Var) -> Var:
    """Unit steps: dx = Pad(dy, [s, d - max(e, s)]) with s, e clamped to [0, d] as Slice clamps them.

    ``axes``: the sliced axes, or (opset 18+) the tensor of them, passed on to Pad.
    """
    if isinstance(axes, Var):
        axes = _int64(n, axes)
        d = n.op.Gather(n.b.shape_of(x), axes)
    else:
        d = n.b.vector([n.b.dim(x, a) for a in axes])
    zero = n.b.ints([0])

    def clamp(v: Var) -> Var:
        v = n.op.Where(n.op.Less(v, zero), n.op.Add(v, d), v)
        return n.op.Min(n.op.Max(v, zero), d)

    s = clamp(_int64(n, n.input(1)))
    e = n.op.Max(clamp(_int64(n, n.input(2))), s)
    if isinstance(axes, Var):
        return n.op.Pad(n.dy, n.op.Concat(s, n.op.Sub(d, e), axis=0), None, axes)
    # full-rank pads [begin_0..begin_r-1, end_0..end_r-1]: picked from [s, d - e, 0]
    r, k = x.rank, len(axes)
    pick = [axes.index(a) if a in axes else 2 * k for a in range(r)]
    pick += [k + axes.index(a) if a in axes else 2 * k for a in range(r)]
    pads = n.op.Gather(n.op.Concat(s, n.op.Sub(d, e), zero, axis=0), n.b.ints(pick))
    return n.op.Pad(n.dy, pads)


def _slice_grad_scatter(n: Node, x: Var) -> Var:
    """Any slice: dx = zeros(size(x)) with dy written at Slice(Reshape(Range(size(x)), shape(x))), reshaped."""
    if x.info.static:
        size: Dim = int(np.prod(x.shape, dtype=np.int64))
        shape = n.b.ints(x.shape)
    else:
        size, shape = n.op.Reshape(n.op.Size(x), n.b.ints([1])), n.b.shape_of(x)
    positions = n.op.Reshape(n.b.arange(size), shape)
    taken = n.op.Slice(positions, *n.inputs[1:])
    flat = n.op.ScatterND(n.b.zeros(n.b.vector([size]), x), n.op.Reshape(taken, n.b.ints([-1, 1])),
                          n.op.Reshape(n.dy, n.b.ints([-1])))
    return n.b.reshape_like(flat, x)


# -- Pad ---------------------------------------------------------------------------------
@register("Pad")
def pad(n: Node):
    """y = pad(x, pads):  constant mode: dx = dy[b : -e] (negative pads cropped x: zeros pad those back);
    reflect, edge, wrap: dx folds the border back: each border value's dy is added where it was copied from.
    """
    x = n.inputs[0]
    mode = n.attr("mode", "constant")
    pads = n.const_ints(1)
    if x.rank is None and n.input(3) is None and pads is not None:
        r = len(pads) // 2           # pads has two entries per axis of x
    else:
        r = n.b.rank(x)
    if n.input(3) is not None:
        axes = n.const_ints(3)
    else:
        axes = list(range(r))
    if pads is None or axes is None:
        if mode != "constant":
            return (_pad_grad_border_dynamic(n, x, mode),)
        return (_pad_grad_dynamic(n, x),)
    axes = [n.b.normalize_axis(a, r) for a in axes]
    k = len(axes)
    begin, end = [0] * r, [0] * r
    for a, b, e in zip(axes, pads[:k], pads[k:]):
        begin[a], end[a] = b, e
    if mode == "constant":
        return (_pad_grad_constant(n, begin, end),)
    if any(p < 0 for p in begin + end):
        n.decline(f"Pad mode '{mode}' with negative pads")
    g = n.dy
    for a in range(r):
        if begin[a] or end[a]:
            d = x.shape[a] if x.shape is not None else None
            if d is None:       # the source of each y position computed at run time, then scatter-added
                g = _fold_dynamic(n, g, a, r, n.b.dim(x, a), mode, begin[a], n.b.dim(n.dy, a))
                continue
            source = np.pad(np.arange(d), (begin[a], end[a]), mode=mode)   # y position -> x position
            g = _fold(n, g, a, r, source, d)
    return (g,)


def _pad_grad_constant(n: Node, begin: list[int], end: list[int]) -> Var:
    """dx = dy[max(b, 0) : len - max(e, 0)], then zeros where negative pads had cropped x."""
    r = len(begin)
    cut = [a for a in range(r) if begin[a] > 0 or end[a] > 0]
    g = n.dy
    if cut:
        g = n.op.Slice(g, n.b.ints([max(begin[a], 0) for a in cut]),
                       n.b.ints([-end[a] if end[a] > 0 else INT64_MAX for a in cut]), n.b.ints(cut))
    if any(p < 0 for p in begin + end):
        g = n.op.Pad(g, n.b.ints([max(-p, 0) for p in begin + end]))
    return g


def _pad_grad_dynamic(n: Node, x: Var) -> Var:
    """Constant mode, pads known at run time: Slice dy by max(pads, 0), Pad back max(-pads, 0)."""
    r = x.rank
    axes = n.input(3)
    k: Dim = r
    if axes is not None:
        k = axes.shape[0] if axes.shape is not None and axes.shape[0] is not None else None
        axes = _int64(n, axes)
        if k is None:
            k = n.op.Reshape(n.op.Size(axes), n.b.ints([1]))
    pads = _int64(n, n.input(1))
    zero = n.b.ints([0])
    b = n.op.Max(n.op.Slice(pads, zero, n.b.vector([k])), zero)
    e = n.op.Max(n.op.Slice(pads, n.b.vector([k]), n.b.ints([INT64_MAX])), zero)
    y_size = n.b.shape_of(n.outputs[0])
    on_axes = n.b.ints(range(r)) if axes is None else axes
    if axes is not None:
        y_size = n.op.Gather(y_size, axes)
    g = n.op.Slice(n.dy, b, n.op.Sub(y_size, e), on_axes)
    cropped = n.op.Max(n.op.Neg(pads), zero)
    return n.op.Pad(g, cropped, None, axes) if axes is not None else n.op.Pad(g, cropped)


def _pad_grad_border_dynamic(n: Node, x: Var, mode: str) -> Var:
    """reflect, edge, wrap with pads (or axes) known at run time: every axis of x folded
    (:func:`_fold_dynamic`), each with its begin pad read from the pads tensor (0 off the padded axes)."""
    r = n.b.rank(x)
    pads = _int64(n, n.input(1))
    begin: Var = pads
    if n.input(3) is not None:   # begin pads scattered onto every axis: [0] * r with begin[axes[i]] = pads[i]
        axes = _nonneg(n, _int64(n, n.input(3)), r)
        k = n.op.Reshape(n.op.Size(axes), n.b.ints([1]))
        begin = n.op.ScatterElements(n.b.ints([0] * r), axes, n.op.Slice(pads, n.b.ints([0]), k))
    g = n.dy
    for a in range(r):
        b = n.op.Slice(begin, n.b.ints([a]), n.b.ints([a + 1]))
        g = _fold_dynamic(n, g, a, r, n.b.dim(x, a), mode, b, n.b.dim(n.dy, a))
    return g


def _fold_dynamic(n: Node, g: Var, axis: int, r: int, d: Dim, mode: str, begin: Dim, y_len: Dim) -> Var:
    """dx[i] = sum of g[j] over the j whose source is i, along axis, with the sizes read at run time:
    j - begin is taken back into [0, d) as the mode copied it (edge: clamped; reflect: mirrored with
    period 2(d - 1); wrap: modulo d), then g is scatter-added there."""
    zero, one = n.b.int_scalar(0), n.b.int_scalar(1)
    d0 = n.b.int_scalar(d)
    j = n.op.Sub(n.b.arange(y_len), n.b.int_scalar(begin))
    if mode == "edge":
        src = n.op.Max(n.op.Min(j, n.op.Sub(d0, one)), zero)
    elif mode == "reflect":
        period = n.op.Max(n.op.Mul(n.op.Sub(d0, one), n.b.int_scalar(2)), one)     # d = 1 copies its one value
        m = n.op.Mod(n.op.Abs(j), period)
        src = n.op.Where(n.op.Less(m, d0), m, n.op.Sub(period, m))
    elif mode == "wrap":
        src = n.op.Mod(j, d0)       # fmod=0: the divisor's sign, so negative j wrap to the end
    else:
        n.decline(f"Pad mode '{mode}'")
    n.b.infos[src.name] = TensorInfo(TensorProto.INT64, (None,))
    dims = [d if a == axis else n.b.dim(g, a) for a in range(r)]
    return _index_add(n, dims, axis, src, g, g)


def _fold(n: Node, g: Var, axis: int, r: int, source: np.ndarray, d: int) -> Var:
    """dx[i] = sum of g[j] over the j with source[j] == i, along axis.

    ``source`` splits into runs where it steps by +1 (a slice), -1 (a reversed
    slice) or 0 (a ReduceSum); each run is padded to its place and the runs summed.
    """
    pieces = []
    j = 0
    while j < len(source):
        step = int(source[j + 1] - source[j]) if j + 1 < len(source) else 1
        if step not in (-1, 0, 1):
            step = 1
        k = j + 1
        while k < len(source) and source[k] - source[k - 1] == step:
            k += 1
        lo, hi = int(min(source[j], source[k - 1])), int(max(source[j], source[k - 1])) + 1
        axes = n.b.ints([axis])
        if step == 1:
            piece = n.op.Slice(g, n.b.ints([j]), n.b.ints([k]), axes)
        elif step == -1:
            piece = n.op.Slice(g, n.b.ints([k - 1]), n.b.ints([j - 1 if j > 0 else INT64_MIN]), axes,
                               n.b.ints([-1]))
        else:
            piece = n.b.sum(n.op.Slice(g, n.b.ints([j]), n.b.ints([k]), axes), [axis], keepdims=True)
        if lo > 0 or hi < d:
            pads = [0] * (2 * r)
            pads[axis], pads[r + axis] = lo, d - hi
            piece = n.op.Pad(piece, n.b.ints(pads))
        pieces.append(piece)
        j = k
    return pieces[0] if len(pieces) == 1 else n.op.Sum(*pieces)


# -- Expand, Tile --------------------------------------------------------------------------
@register("Expand")
def expand(n: Node):
    """y = broadcast x to shape:  dx = dy summed over the broadcast axes"""
    return n.b.unbroadcast(n.dy, n.inputs[0]), None


@register("Tile")
def tile(n: Node):
    """y = tile(x, reps), y[.., r_i * d_i + j, ..] = x[.., j, ..]:  dx = sum over r of reshape(dy, [.., r_i, d_i, ..])"""
    x = n.inputs[0]
    reps = n.const_ints(1)
    r = x.rank if x.rank is not None else None if reps is None else len(reps)
    if reps is None:   # [r_0, d_0, r_1, d_1, ...] built in the graph; every r_i summed
        shape = n.b.shape_of(x) if r is None else n.b.vector(n.b.dims(x))
        pairs = n.op.Concat(n.b.unsqueeze(_int64(n, n.input(1)), [1]), n.b.unsqueeze(shape, [1]), axis=1)
        blocks = n.op.Reshape(n.dy, n.op.Reshape(pairs, n.b.ints([-1])))
        if r is None:      # the rank only at run time: the even axes 0, 2, ..., 2r - 2
            axes = n.op.Range(n.b.int_scalar(0), n.op.Size(pairs), n.b.int_scalar(2))
            return n.b.sum(blocks, axes, keepdims=False), None
        return n.b.sum(blocks, list(range(0, 2 * r, 2)), keepdims=False), None
    dims = [n.b.dim(x, i) for i in range(r)]
    parts: list[Dim] = []
    summed = []
    for rep, d in zip(reps, dims):
        if rep != 1:
            summed.append(len(parts))
            parts.append(rep)
        parts.append(d)
    if not summed:
        return n.dy, None
    return n.b.sum(n.op.Reshape(n.dy, n.b.vector(parts)), summed, keepdims=False), None


# -- DepthToSpace, SpaceToDepth ------------------------------------------------------------
@register("DepthToSpace")
def depth_to_space(n: Node):
    """DCR: dx = SpaceToDepth(dy)  (its inverse);
    CRD: y = reshape(transpose(reshape(x, [N, C', b, b, H, W]), [0, 1, 4, 2, 5, 3]), [N, C', H b, W b]),
         dx = the same steps undone.
    """
    b = n.attr("blocksize")
    if n.attr("mode", "DCR") == "DCR":
        return (n.op.SpaceToDepth(n.dy, blocksize=b),)
    x = n.inputs[0]
    dims = n.b.dims(x)
    blocks = n.op.Reshape(n.dy, n.b.vector([0, 0, dims[2], b, dims[3], b]))      # [N, C', H, b, W, b]
    return (n.b.reshape_like(n.op.Transpose(blocks, perm=[0, 1, 3, 5, 2, 4]), x),)


@register("SpaceToDepth")
def space_to_depth(n: Node):
    """dx = DepthToSpace(dy) in the same mode (DCR; opset 28 adds CRD): its inverse"""
    return (n.op.DepthToSpace(n.dy, blocksize=n.attr("blocksize"), mode=n.attr("mode", "DCR")),)


# -- Trilu, ReverseSequence, CenterCropPad: their own transposes ---------------------------
@register("Trilu")
def trilu(n: Node):
    """y = x masked to a triangle:  dx = dy masked the same way"""
    return (n.op.Trilu(n.dy, n.input(1), upper=n.attr("upper", 1)),) + (None,) * (len(n.inputs) - 1)


@register("ReverseSequence", inputs=(0,))
def reverse_sequence(n: Node):
    """A permutation that is its own inverse:  dx = reverse_sequence(dy)"""
    return (n.op.ReverseSequence(n.dy, n.inputs[1], batch_axis=n.attr("batch_axis", 1),
                                 time_axis=n.attr("time_axis", 0)), None)


@register("CenterCropPad")
def center_crop_pad(n: Node):
    """Cropping at offset (d - s) // 2 and padding at (s - d) // 2 are each other's transposes:
    dx = center_crop_pad(dy, shape(x) on the same axes)
    """
    x = n.inputs[0]
    axes = n.attr("axes")
    if x.info.static:
        shape = n.b.ints([x.shape[a] for a in axes] if axes is not None else x.shape)
    else:
        shape = n.b.shape_of(x)
        if axes is not None:
            shape = n.op.Gather(shape, n.b.ints(axes))
    return n.op.CenterCropPad(n.dy, shape, axes=axes), None


# -- Gather, GatherElements, GatherND, Compress: scatter-adds ------------------------------
def _index_add(n: Node, dims: list[Dim], axis: int, idx: Var, upd: Var, like: Var,
               accumulate: bool = True) -> Var:
    """zeros(dims) with upd's slices added at idx along axis: out[.., idx[j], ..] += upd[.., j, ..].

    ``upd`` is shaped dims[:axis] + idx.shape + dims[axis+1:]; ``idx`` is int64, non-negative.
    ``like``: a tensor of the result's element type. ``accumulate=False`` when idx never
    repeats (a plain scatter is exact at every opset).
    """
    r = len(dims)
    if accumulate and n.opset < 16:
        return _index_add_onehot(n, dims, axis, idx, upd, like)
    zeros = n.b.zeros(n.b.vector(dims), like)
    reduction = "add" if accumulate else None
    if axis == 0:
        return n.op.ScatterND(zeros, n.b.unsqueeze(idx, [-1]), upd, reduction=reduction)
    if idx.rank != 1:
        upd = n.op.Reshape(upd, n.b.vector([0] * axis + [-1] + dims[axis + 1:]))
    where = n.op.Expand(n.op.Reshape(idx, n.b.ints([1] * axis + [-1] + [1] * (r - axis - 1))), n.b.shape_of(upd))
    return n.op.ScatterElements(zeros, where, upd, axis=axis, reduction=reduction)


def _index_add_onehot(n: Node, dims: list[Dim], axis: int, idx: Var, upd: Var, like: Var) -> Var:
    """Before opset 16 (no scatter-add): out = onehot[d, K] @ upd as [.., K, rest], onehot = (range(d) == idx)."""
    hot = _onehot(n, n.b.unsqueeze(n.b.arange(dims[axis]), [1]), n.op.Reshape(idx, n.b.ints([1, -1])), like)
    rest = dims[axis + 1:]
    if idx.rank == 1:
        shape = [0, -1]             # a constant shape: onnx's inference keeps the rank (MatMul's grad needs it)
    elif all(isinstance(d, int) for d in rest):
        shape = [-1, n.b.prod(rest)]
    elif idx.info.static:
        shape = [int(np.prod(idx.shape, dtype=np.int64)), -1]
    else:
        shape = [n.op.Reshape(n.op.Size(idx), n.b.ints([1])), -1]
    rows = n.op.Reshape(upd, n.b.vector([0] * axis + shape))                       # [.., K, rest]
    return n.op.Reshape(n.op.MatMul(hot, rows), n.b.vector(dims))                  # [.., d, rest] -> dims


@register("Gather")
def gather(n: Node):
    """y = take(x, idx, axis):  dx = zeros(x) with dx[.., idx[j], ..] += dy[.., j, ..]   (repeats accumulate)

    An ``nn.Embedding(padding_idx=p)`` exported by PyTorch's dynamo exporter (its node metadata records the
    ``aten.embedding`` call): the row p gets no gradient, as in PyTorch (``embedding_backward`` skips it).
    """
    x, idx = n.inputs
    dy = n.dy
    padding = torch_padding_idx(n.proto)
    if padding is not None and n.attr("axis", 0) == 0 and x.rank == 2:      # an embedding table's rows
        hit = n.op.Equal(idx, n.b.const_like(np.asarray(padding), idx))
        dy = n.op.Where(n.b.unsqueeze(hit, [-1]), n.b.scalar(0.0, dy), dy)
    if x.rank is None:
        return _gather_grad_any_rank(n, x, idx, n.attr("axis", 0), dy), None
    axis = n.b.normalize_axis(n.attr("axis", 0), n.b.rank(x))
    dims = n.b.dims(x)
    idx = _nonneg(n, idx, dims[axis])
    return _index_add(n, dims, axis, idx, dy, x, accumulate=not _distinct(n, idx)), None


def _gather_grad_any_rank(n: Node, x: Var, idx: Var, axis: int, dy: Var) -> Var:
    """x of unknown rank: x seen as [A, d, B] (A, B: the products of the dims before and after axis,
    read from Shape(x)), dy as [A, K, B] with K the number of indices; one scatter-add along the middle."""
    shape = n.b.shape_of(x)
    after = n.b.ints([axis + 1 if axis != -1 else INT64_MAX])
    lead = n.b.reduce("ReduceProd", n.op.Slice(shape, n.b.ints([0]), n.b.ints([axis])), None)
    tail = n.b.reduce("ReduceProd", n.op.Slice(shape, after, n.b.ints([INT64_MAX])), None)
    d = n.op.Slice(shape, n.b.ints([axis]), after)
    flat = n.op.Reshape(idx, n.b.ints([-1]))
    n.b.infos[flat.name] = TensorInfo(idx.dtype, (None,))
    flat = _nonneg(n, flat, d)
    upd = n.op.Reshape(dy, n.op.Concat(lead, n.b.ints([-1]), tail, axis=0))
    g = _index_add(n, [lead, d, tail], 1, flat, upd, x, accumulate=not _distinct(n, flat))
    return n.op.Reshape(g, shape)


@register("GatherElements")
def gather_elements(n: Node):
    """y = take_along_axis(x, idx, axis):  dx = scatter_add(zeros(x), idx, dy, axis)

    Before opset 16, unless idx is a constant that writes no place twice:
    dx[.., i, ..] = sum_j dy[.., j, ..] * (idx[.., j, ..] == i), padded to x's shape where idx is
    smaller than x off the axis.
    """
    x, idx = n.inputs
    r = x.rank if x.rank is not None else idx.rank      # GatherElements' operands share their rank
    if r is None:
        return _gather_elements_grad_any_rank(n, x, idx, n.attr("axis", 0)), None
    axis = n.b.normalize_axis(n.attr("axis", 0), r)
    if n.opset >= 16 or _writes_once(_value(n, idx), axis, x.shape):
        reduction = "add" if n.opset >= 16 else None
        return n.op.ScatterElements(n.b.zeros_like(x), idx, n.dy, axis=axis, reduction=reduction), None
    d = n.b.dim(x, axis)
    rows = n.op.Reshape(n.b.arange(d), n.b.ints([1] * (axis + 1) + [-1] + [1] * (r - axis - 1)))
    hot = _onehot(n, n.b.unsqueeze(_nonneg(n, idx, d), [axis + 1]), rows, x)   # idx.shape, d inserted after axis
    g = n.b.sum(n.b.unsqueeze(n.dy, [axis + 1]) * hot, [axis], keepdims=False)    # idx.shape, axis -> d
    same = (x.info.static and idx.info.static
            and all(x.shape[i] == idx.shape[i] for i in range(r) if i != axis))
    if not same:
        grow = n.op.Sub(n.b.shape_of(x), n.b.shape_of(g))
        g = n.op.Pad(g, n.op.Concat(n.b.ints([0] * r), grow, axis=0))
    return g, None


def _gather_elements_grad_any_rank(n: Node, x: Var, idx: Var, axis: int) -> Var:
    """Ranks unknown: from opset 16 one ScatterElements (its axis may count from the end); before, idx and
    dy seen as [A, K, B] (the dims before and after axis multiplied, from Shape(idx)), the one-hot
    contraction dx3[a, i, b] = sum_j dy3[a, j, b] * (idx3[a, j, b] == i), reshaped and padded to x."""
    if n.opset >= 16:
        return n.op.ScatterElements(n.b.zeros_like(x), idx, n.dy, axis=axis, reduction="add")
    b = n.b
    shape = b.shape_of(idx)
    after = b.ints([axis + 1 if axis != -1 else INT64_MAX])
    lead = b.reduce("ReduceProd", n.op.Slice(shape, b.ints([0]), b.ints([axis])), None)
    tail = b.reduce("ReduceProd", n.op.Slice(shape, after, b.ints([INT64_MAX])), None)
    three = n.op.Concat(lead, b.ints([-1]), tail, axis=0)
    d = n.op.Gather(b.shape_of(x), b.ints([axis]))
    idx3 = n.op.Reshape(_int64(n, idx), three)
    idx3 = n.op.Where(n.op.Less(idx3, n.b.int_scalar(0)), n.op.Add(idx3, d), idx3)
    rows = n.op.Reshape(n.b.arange(d), b.ints([1, 1, -1, 1]))
    hot = _onehot(n, b.unsqueeze(idx3, [2]), rows, x)                                 # [A, K, d, B]
    g = b.sum(b.unsqueeze(n.op.Reshape(n.dy, three), [2]) * hot, [1], keepdims=False)  # [A, d, B]
    g = n.op.Reshape(g, n.op.Concat(n.op.Slice(shape, b.ints([0]), b.ints([axis])), d,
                                    n.op.Slice(shape, after, b.ints([INT64_MAX])), axis=0))
    grow = n.op.Sub(b.shape_of(x), b.shape_of(g))
    return n.op.Pad(g, n.op.Concat(n.op.Mul(grow, b.ints([0])), grow, axis=0))


@register("GatherND")
def gather_nd(n: Node):
    """y[b.., q..] = x[b.., idx[b.., q..]]:  dx = zeros(x) with dy scatter-added at idx.

    The k indexed dims (after the batch dims) are flattened with the batch dims
    into rows: row = batch * prod(dims) + sum_j idx_j * stride_j, then one row scatter-add.
    """
    x, idx = n.inputs
    bd = n.attr("batch_dims", 0)
    if idx.shape is None or idx.shape[-1] is None or x.rank is None:
        return _gather_nd_grad_any_shape(n, x, idx, bd), None
    q, k = len(idx.shape), idx.shape[-1]
    dims = n.b.dims(x)
    indexed = dims[bd:bd + k]
    strides = [n.b.prod(indexed[j + 1:]) for j in range(k)]
    value = _value(n, idx)
    if value is not None and all(isinstance(d, int) for d in dims[:bd + k]):
        value = value.astype(np.int64)
        value = np.where(value < 0, value + np.array(indexed, np.int64), value)
        rows = (value * np.array(strides, np.int64)).sum(-1)
        if bd:
            batch = np.arange(n.b.prod(dims[:bd]), dtype=np.int64).reshape(dims[:bd] + [1] * (q - 1 - bd))
            rows = rows + batch * n.b.prod(indexed)
        rows = n.b.const(rows)
        accumulate = not _distinct(n, rows)
    else:
        accumulate = True
        idx = _nonneg(n, idx, n.b.vector(indexed), per_column=True)
        rows = n.b.squeeze(idx, [-1]) if k == 1 else n.b.sum(n.op.Mul(idx, n.b.vector(strides)), [-1], keepdims=False)
        if bd:
            batch = n.op.Reshape(n.b.arange(n.b.prod(dims[:bd])), n.b.vector(dims[:bd] + [1] * (q - 1 - bd)))
            rows = n.op.Add(rows, n.op.Mul(batch, n.b.vector([n.b.prod(indexed)])))
        n.b.infos[rows.name] = TensorInfo(TensorProto.INT64, tuple(idx.shape[:-1]))
    table = [n.b.prod(dims[:bd + k])] + dims[bd + k:]
    return n.op.Reshape(_index_add(n, table, 0, rows, n.dy, x, accumulate), n.b.vector(dims)), None


def _gather_nd_grad_any_shape(n: Node, x: Var, idx: Var, bd: int) -> Var:
    """The index depth k or a rank unknown: x seen as rows [prod(S[:bd+k]), *S[bd+k:]] (S = Shape(x)), each
    index tuple made a row number by strides computed at run time, stride_j = prod(S[bd+j+1:bd+k]) (a
    ReduceProd over a masked [k, k] table), then one row scatter-add of dy and a Reshape to S."""
    b = n.b
    shape, ishape = b.shape_of(x), b.shape_of(idx)
    k = n.op.Slice(ishape, b.ints([-1]), b.ints([INT64_MAX]))                        # [k]
    end = n.op.Add(k, b.ints([bd]))
    indexed = n.op.Slice(shape, b.ints([bd]), end)                                     # S[bd:bd+k]
    cols = n.b.arange(k)
    later = n.op.Greater(b.unsqueeze(cols, [0]), b.unsqueeze(cols, [1]))               # [k, k]: column i after row j
    table = n.op.Where(later, b.unsqueeze(indexed, [0]), b.ints([1]))
    strides = b.reduce("ReduceProd", table, [1], keepdims=False)                       # [k]
    idx = _int64(n, idx)
    idx = n.op.Where(n.op.Less(idx, n.b.int_scalar(0)), n.op.Add(idx, indexed), idx)
    rows = b.sum(n.op.Mul(idx, strides), [-1], keepdims=False)                         # idx.shape[:-1]
    if bd:
        batch = b.reduce("ReduceProd", n.op.Slice(shape, b.ints([0]), b.ints([bd])), None)   # [B]
        ones = n.op.ConstantOfShape(n.op.Sub(n.op.Shape(ishape), b.ints([bd + 1])),
                                    value=numpy_helper.from_array(np.ones(1, np.int64)))
        grid = n.op.Reshape(n.b.arange(batch), n.op.Concat(n.op.Slice(ishape, b.ints([0]), b.ints([bd])), ones,
                                                          axis=0))
        rows = n.op.Add(rows, n.op.Mul(grid, b.reduce("ReduceProd", indexed, None)))
    rows = n.op.Reshape(rows, b.ints([-1]))
    n.b.infos[rows.name] = TensorInfo(TensorProto.INT64, (None,))
    rest = n.op.Slice(shape, end, b.ints([INT64_MAX]))                              # S[bd+k:]
    count = b.reduce("ReduceProd", n.op.Slice(shape, b.ints([0]), end), None)         # [prod(S[:bd+k])]
    upd = n.op.Reshape(n.dy, n.op.Concat(b.ints([-1]), rest, axis=0))                  # [R, *rest]
    if n.opset >= 16:
        zeros = n.b.zeros(n.op.Concat(count, rest, axis=0), x)
        g = n.op.ScatterND(zeros, b.unsqueeze(rows, [-1]), upd, reduction="add")
    else:
        flat = n.op.Reshape(upd, b.ints([0, -1]))                                     # [R, prod(rest)]
        g = _index_add_onehot(n, [count, b.reduce("ReduceProd", rest, None)], 0, rows, flat, x)
    return n.op.Reshape(g, shape)


@register("Compress")
def compress(n: Node):
    """y = compress(x, cond, axis) (flattened x without axis):  dx = zeros(x) with dy put back at nonzero(cond)"""
    x, cond = n.inputs
    value = _value(n, cond)
    if value is not None:
        where = n.b.const(np.nonzero(value)[0].astype(np.int64))
    else:
        where = n.op.Reshape(n.op.NonZero(cond), n.b.ints([-1]))
        n.b.infos[where.name] = TensorInfo(TensorProto.INT64, (None,))
    axis = n.attr("axis")
    if axis is None:
        size: Dim = (int(np.prod(x.shape, dtype=np.int64)) if x.info.static
                     else n.op.Reshape(n.op.Size(x), n.b.ints([1])))
        return n.b.reshape_like(_index_add(n, [size], 0, where, n.dy, x, accumulate=False), x), None
    axis = n.b.normalize_axis(axis, n.b.rank(x))
    return _index_add(n, n.b.dims(x), axis, where, n.dy, x, accumulate=False), None


# -- ScatterElements, ScatterND: gathers -----------------------------------------------------
@register("ScatterElements")
def scatter_elements(n: Node):
    """See :func:`_scatter_grads`; the gather is GatherElements along axis."""
    axis = n.attr("axis", 0)
    return _scatter_grads(
        n,
        gather=lambda t: n.op.GatherElements(t, n.inputs[1], axis=axis),
        scatter=lambda t, u, reduction=None: n.op.ScatterElements(t, n.inputs[1], u, axis=axis, reduction=reduction),
        unique=lambda: _writes_once(_value(n, n.inputs[1]), axis, n.inputs[0].shape),
    )


@register("ScatterND")
def scatter_nd(n: Node):
    """See :func:`_scatter_grads`; the gather is GatherND."""
    return _scatter_grads(
        n,
        gather=lambda t: n.op.GatherND(t, n.inputs[1]),
        scatter=lambda t, u, reduction=None: n.op.ScatterND(t, n.inputs[1], u, reduction=reduction),
        unique=lambda: _writes_once_nd(_value(n, n.inputs[1]), n.inputs[0].shape),
    )


def _scatter_grads(n: Node, gather, scatter, unique):
    """y = scatter(data, idx, upd, reduction):

    none:     d data = dy with the written places zeroed = scatter(dy, idx, 0);  d upd = gather(dy, idx)
              (repeated indices are undefined behaviour in ONNX; the gradient assumes there are none)
    add:      d data = dy;  d upd = gather(dy, idx)
    mul:      d data = dy * P, P = scatter(1, idx, upd, mul);  d upd = gather(dy * data, idx) * (the product
              of the other updates written to the same place: 1 when constant indices never repeat,
              else see :func:`_product_of_others`)
    max, min: dy goes to the values that won, split evenly among ties:
              c = scatter(data == y, idx, upd == gather(y), add);  d data = dy (data == y) / c,
              d upd = gather(dy / c) (upd == gather(y))
    """
    data, _, upd = n.inputs
    dy = n.dy
    reduction = n.attr("reduction", "none")
    d_data = d_upd = None
    if reduction == "none":
        if n.needs(0):
            d_data = scatter(dy, n.b.zeros_like(upd))
        if n.needs(2):
            d_upd = gather(dy)
    elif reduction == "add":
        d_data = dy
        d_upd = gather(dy) if n.needs(2) else None
    elif reduction == "mul":
        if n.needs(0):
            d_data = dy * scatter(n.b.fill_like(data, 1.0), upd, "mul")
        if n.needs(2):
            d_upd = gather(dy * data)
            if not unique():
                d_upd = d_upd * _product_of_others(n, data, upd, gather, scatter)
    elif reduction in ("max", "min"):
        y = n.outputs[0]
        won_data = n.b.cast_like(n.op.Equal(data, y), data)
        won_upd = n.b.cast_like(n.op.Equal(upd, gather(y)), data)
        share = dy / scatter(won_data, won_upd, "add")
        d_data = share * won_data if n.needs(0) else None
        d_upd = gather(share) * won_upd if n.needs(2) else None
    else:
        n.decline(f"reduction '{reduction}'")
    return d_data, None, d_upd


def _product_of_others(n: Node, data: Var, upd: Var, gather, scatter) -> Var:
    """For each update u_k, the product of the other updates written to its place, without dividing by 0:

    with P = the product of the nonzero updates at a place and Z = the number of zero updates there,
    others_k = P / u_k if Z == 0;  P if u_k == 0 and Z == 1;  0 otherwise.
    """
    zero, one = n.b.scalar(0.0, upd), n.b.scalar(1.0, upd)
    is_zero = n.op.Equal(upd, zero)
    nonzero = n.op.Where(is_zero, one, upd)
    p = gather(scatter(n.b.fill_like(data, 1.0), nonzero, "mul"))
    z = gather(scatter(n.b.zeros_like(data), n.b.cast_like(is_zero, upd), "add"))
    when_zero = n.op.Where(n.op.Equal(z, one), p, zero)
    when_nonzero = n.op.Where(n.op.Equal(z, zero), p / nonzero, zero)
    return n.op.Where(is_zero, when_zero, when_nonzero)


def _distinct(n: Node, idx: Var) -> bool:
    """Whether idx is a constant (already non-negative) without repeats: its scatter-add needs no adding."""
    value = _value(n, idx)
    return value is not None and len(np.unique(value)) == value.size


def _writes_once(value: np.ndarray | None, axis: int, shape: tuple | None) -> bool:
    """Whether ScatterElements/GatherElements indices ``value`` along axis address every place at most once."""
    if value is None or shape is None or shape[axis] is None:
        return False
    where = list(np.indices(value.shape))
    where[axis] = value % shape[axis]
    places = np.stack([w.reshape(-1) for w in where], axis=1)
    return len(np.unique(places, axis=0)) == len(places)


def _writes_once_nd(value: np.ndarray | None, shape: tuple | None) -> bool:
    """Whether ScatterND indices ``value`` address every place at most once."""
    if value is None or shape is None:
        return False
    k = value.shape[-1]
    if any(d is None for d in shape[:k]):
        return False
    places = value.reshape(-1, k) % np.array(shape[:k])
    return len(np.unique(places, axis=0)) == len(places)


# -- TensorScatter ---------------------------------------------------------------------------
@register("TensorScatter")
def tensor_scatter(n: Node):
    """present = past with update written at positions p = w[batch] + j (mod max_len if circular) on axis:
    d past = dy where nothing was written, 0 where it was;  d update = dy at p (GatherElements). No scatter.
    """
    past, upd = n.inputs[:2]
    w = n.input(2)
    r = n.b.rank(past)
    axis = n.b.normalize_axis(n.attr("axis", -2), r)
    circular = n.attr("mode", "linear") == "circular"
    along = [1] * axis + [-1] + [1] * (r - axis - 1)
    t = n.op.Reshape(n.b.arange(n.b.dim(past, axis)), n.b.ints(along))        # cache positions
    length = n.b.dim(upd, axis)
    start = n.op.Reshape(_int64(n, w), n.b.ints([-1] + [1] * (r - 1))) if w is not None else n.b.int_scalar(0)
    size = n.b.dim(past, axis)
    d_past = d_upd = None
    if n.needs(0):
        offset = n.op.Sub(t, start)                                           # position within the update
        if circular:
            offset = n.op.Mod(offset, n.b.vector([size]))
        written = n.op.And(n.op.GreaterOrEqual(offset, n.b.int_scalar(0)), n.op.Less(offset, n.b.vector([length])))
        d_past = n.op.Where(written, n.b.scalar(0.0, past), n.dy)
    if n.needs(1):
        p = n.op.Add(start, n.op.Reshape(n.b.arange(length), n.b.ints(along)))
        if circular:
            p = n.op.Mod(p, n.b.vector([size]))
        d_upd = n.op.GatherElements(n.dy, n.op.Expand(p, n.b.shape_of(upd)), axis=axis)
    return (d_past, d_upd, None)[:len(n.inputs)]
