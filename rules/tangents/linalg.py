"""Tangents of the bilinear ops: MatMul, Gemm, Conv, ConvTranspose.

Each is linear in each operand, so its tangent is the op itself twice (the
product rule), with the bias term added: JAX's convolution JVP.
"""
from __future__ import annotations

from onnxgrad.ir.builder import total

from .base import TNode, defjvp


@defjvp("MatMul")
def matmul(t: TNode):
    """d(A @ B) = dA @ B + A @ dB"""
    a, b = t.inputs
    da, db = t.dxs
    return total(da @ b if da is not None else None, a @ db if db is not None else None)


@defjvp("Gemm")
def gemm(t: TNode):
    """d(alpha op(A) op(B) + beta C) = Gemm(dA, B) + Gemm(A, dB) + beta dC   (same alpha, transA, transB)"""
    a, b = t.inputs[:2]
    da, db, dc = t.tangent(0), t.tangent(1), t.tangent(2)
    bias = None
    if dc is not None:
        beta = float(t.attr("beta", 1.0))
        bias = t.like_output(dc if beta == 1.0 else dc * beta)
    return total(t.same_op(da, b) if da is not None else None,
                 t.same_op(a, db) if db is not None else None, bias)


@defjvp("Conv", "ConvTranspose")
def conv(t: TNode):
    """d conv(x, w, b) = conv(dx, w) + conv(x, dw) + db   (same attributes; db on the channel axis)"""
    x, w = t.inputs[:2]
    dx, dw, db = t.tangent(0), t.tangent(1), t.tangent(2)
    bias = None
    if db is not None:
        y = t.outputs[0]
        if y.rank is None:
            return NotImplemented
        bias = t.like_output(t.b.unsqueeze(db, [0] + list(range(2, y.rank))))
    return total(t.same_op(dx, w) if dx is not None else None,
                 t.same_op(x, dw) if dw is not None else None, bias)
