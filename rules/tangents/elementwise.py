"""Tangents of arithmetic, elementwise math and activations.

Products broadcast by themselves (``dx * w`` has the shape of ``x * w``); a term
that is a bare input tangent is broadcast to the output (:meth:`TNode.like_output`).
"""
from __future__ import annotations

import math

from onnxgrad.ir.builder import total

from .base import TNode, defjvp, deflinear

deflinear("Identity", "Neg", "Sum", "Mean")


@defjvp("Add")
def add(t: TNode):
    """d(x + w) = dx + dw"""
    dx, dw = t.dxs
    if dx is not None and dw is not None:
        return dx + dw
    return t.like_output(dx if dx is not None else dw)


@defjvp("Sub")
def sub(t: TNode):
    """d(x - w) = dx - dw"""
    dx, dw = t.dxs
    if dx is not None and dw is not None:
        return dx - dw
    return t.like_output(dx if dx is not None else -dw)


@defjvp("Mul")
def mul(t: TNode):
    """d(x * w) = dx * w + x * dw"""
    x, w = t.inputs
    dx, dw = t.dxs
    return total(dx * w if dx is not None else None, x * dw if dw is not None else None)


@defjvp("Div")
def div(t: TNode):
    """d(x / w) = (dx - y * dw) / w   with y = x / w"""
    _, w = t.inputs
    dx, dw = t.dxs
    y = t.outputs[0]
    if dw is None:
        return dx / w
    return total(dx, -(y * dw)) / w


@defjvp("Pow")
def pow_(t: TNode):
    """d(x ^ p) = dx * p * x^(p-1) + dp * y * log(x)   with y = x ^ p (x^2: dx * 2x)"""
    x, p = t.inputs
    dx, dp = t.dxs
    y = t.outputs[0]
    base = exponent = None
    if dx is not None:
        c = t.const_value(1)
        if c is not None and c.size == 1:
            power = float(c.reshape(-1)[0])
            base = dx * (x * 2.0) if power == 2.0 else dx * (power * t.op.Pow(x, t.b.scalar(power - 1.0, x)))
        else:
            p_x = t.b.cast_like(p, x)
            base = dx * (p_x * t.op.Pow(x, p_x - 1.0))
    if dp is not None:
        exponent = t.b.cast_like(dp, y) * y * t.op.Log(x)
    return total(base, exponent)


@defjvp("Sqrt")
def sqrt(t: TNode):
    """d sqrt(x) = dx / (2 y)"""
    return t.dx / (t.outputs[0] * 2.0)


@defjvp("Exp")
def exp(t: TNode):
    """d exp(x) = dx * y"""
    return t.dx * t.outputs[0]


@defjvp("Log")
def log(t: TNode):
    """d log(x) = dx / x"""
    return t.dx / t.inputs[0]


@defjvp("Reciprocal")
def reciprocal(t: TNode):
    """d (1 / x) = -dx * y^2"""
    y = t.outputs[0]
    return -(t.dx * (y * y))


@defjvp("Tanh")
def tanh(t: TNode):
    """d tanh(x) = dx * (1 - y^2)"""
    y = t.outputs[0]
    return t.dx * (1.0 - y * y)


@defjvp("Sigmoid")
def sigmoid(t: TNode):
    """d sigmoid(x) = dx * y * (1 - y)"""
    y = t.outputs[0]
    return t.dx * (y * (1.0 - y))


@defjvp("Relu")
def relu(t: TNode):
    """d relu(x) = dx * [y > 0]   (0 at x = 0, as PyTorch and the reverse rule)"""
    y = t.outputs[0]
    zero = t.b.scalar(0.0, y)
    return t.op.Where(t.op.Greater(y, zero), t.dx, zero)


@defjvp("Abs")
def abs_(t: TNode):
    """d |x| = dx * sign(x)"""
    return t.dx * t.op.Sign(t.inputs[0])


@defjvp("Sin")
def sin(t: TNode):
    """d sin(x) = dx * cos(x)"""
    return t.dx * t.op.Cos(t.inputs[0])


@defjvp("Cos")
def cos(t: TNode):
    """d cos(x) = -dx * sin(x)"""
    return -(t.dx * t.op.Sin(t.inputs[0]))


@defjvp("Erf")
def erf(t: TNode):
    """d erf(x) = dx * 2 / sqrt(pi) * exp(-x^2)"""
    x = t.inputs[0]
    return t.dx * t.op.Exp(math.log(2.0 / math.sqrt(math.pi)) - x * x)


@defjvp("Gelu")
def gelu(t: TNode):
    """approximate="none": d x Phi(x) = dx * (Phi(x) + x phi(x)),  phi the normal pdf
    approximate="tanh": y = x (1 + s) / 2, s = tanh(k (x + 0.044715 x^3)), k = sqrt(2 / pi):
        d y = dx * ((1 + s) / 2 + x / 2 * (1 - s^2) * k * (1 + 3 * 0.044715 x^2))
    """
    x = t.inputs[0]
    x2 = x * x
    if t.attr("approximate", "none") == "tanh":
        k = math.sqrt(2.0 / math.pi)
        s = t.op.Tanh(k * x * (1.0 + 0.044715 * x2))
        return t.dx * (0.5 * (1.0 + s) + 0.5 * x * (1.0 - s * s) * (k * (1.0 + 3.0 * 0.044715 * x2)))
    cdf = 0.5 * (1.0 + t.op.Erf(x * (1.0 / math.sqrt(2.0))))
    pdf = t.op.Exp(-0.5 * x2 - 0.5 * math.log(2.0 * math.pi))
    return t.dx * (cdf + x * pdf)


@defjvp("Where")
def where(t: TNode):
    """d where(c, a, b) = where(c, da, db)   (zeros for a missing one)"""
    c = t.inputs[0]
    _, da, db = t.dxs
    zero = t.b.scalar(0.0, t.outputs[0])
    return t.like_output(t.op.Where(c, da if da is not None else zero, db if db is not None else zero))


@defjvp("Cast", "CastLike")
def cast(t: TNode):
    """d cast(x) = cast(dx) to the output's float type (an integer or bool result has no tangent)"""
    y = t.outputs[0]
    return t.b.cast_like(t.dx, y)
