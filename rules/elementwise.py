"""Arithmetic and elementwise math. Broadcasting is undone by the pass (``broadcast=True``)."""
from __future__ import annotations

import math

from onnxgrad.ir.builder import Var

from .registry import Node, register


# -- arithmetic ---------------------------------------------------------------------------
@register("Add", broadcast=True)
def add(n):
    """d(x + y) = (dy, dy)"""
    return n.dy, n.dy


@register("Sub", broadcast=True)
def sub(n):
    """d(x - y) = (dy, -dy)"""
    return n.dy, -n.dy


@register("Mul", broadcast=True)
def mul(n):
    """d(x * y) = (dy * y, dy * x)"""
    x, y = n.inputs
    return n.dy * y, n.dy * x


@register("Div", broadcast=True)
def div(n):
    """d(x / y) = (dy / y, -dy * z / y)  with z = x / y"""
    _, y = n.inputs
    z = n.outputs[0]
    dx = n.dy / y
    return dx, (-dx * z if n.needs(1) else None)


@register("Neg")
def neg(n):
    """d(-x) = -dy"""
    return (-n.dy,)


@register("Pow", broadcast=True)
def pow_(n):
    """d(x ^ p) = (dy * p * x^(p-1), dy * z * log(x))  with z = x ^ p

    The base's gradient holds for any real base when p is an integer; the
    exponent's needs x > 0 (log x), as in PyTorch. A constant exponent
    is folded: p - 1 is computed here, and x^2 becomes 2 * x.
    """
    x, p = n.inputs
    z = n.outputs[0]
    dx = dp = None
    if n.needs(0):
        c = n.const_value(1)
        if c is not None and c.size == 1 and float(c.reshape(-1)[0]) == 2.0:
            dx = n.dy * (x * 2.0)
        elif c is not None and c.size == 1:
            power = float(c.reshape(-1)[0])
            dx = n.dy * (power * n.op.Pow(x, n.b.scalar(power - 1.0, x)))
        else:
            p_x = n.b.cast_like(p, x)
            dx = n.dy * (p_x * n.op.Pow(x, p_x - 1.0))
    if n.needs(1):
        dp = n.b.cast_like(n.dy * z * n.op.Log(x), p)
    return dx, dp


@register("Sum", broadcast=True)
def sum_(n):
    """d(x0 + x1 + ...) = dy for every input"""
    return tuple(n.dy for _ in n.inputs)


@register("Mean", broadcast=True)
def mean(n):
    """d((x0 + ... + x_{k-1}) / k) = dy / k for every input"""
    g = n.dy * (1.0 / len(n.inputs))
    return tuple(g for _ in n.inputs)


def _extremum(n: Node):
    """d max(x0, x1, ...) (or min) = dy * [x_i == y] / #{j : x_j == y}

    Ties split the gradient evenly among the inputs that reach the extremum, like
    PyTorch's ``maximum``/``amax``; elsewhere the one extreme input gets dy.
    """
    if len(n.inputs) == 1:
        return (n.dy,)
    y = n.outputs[0]
    hits = [n.b.cast_like(n.op.Equal(x, y), n.dy) for x in n.inputs]
    share = n.dy / n.op.Sum(*hits)
    return tuple(share * hit if n.needs(i) else None for i, hit in enumerate(hits))


@register("Max", broadcast=True)
def max_(n):
    """d max(x0, x1, ...) = dy * [x_i == y] / (number of inputs equal to y)"""
    return _extremum(n)


@register("Min", broadcast=True)
def min_(n):
    """d min(x0, x1, ...) = dy * [x_i == y] / (number of inputs equal to y)"""
    return _extremum(n)


@register("Mod", broadcast=True, beyond_tags=(1,))
def mod(n):
    """z = x - y * q,  q = trunc(x / y) (fmod=1) or floor(x / y) (fmod=0);  d z = (dy, -dy * q)

    Float Mod is fmod=1 up to opset 27 (torch.fmod); opset 28 also allows fmod=0 on floats
    (torch.remainder); integer Mod has no gradient. The schema tags the divisor
    NonDifferentiable, but PyTorch differentiates it (``-grad * self.div(other, rounding_mode=...)``),
    and so do we: q is read off the forward's own result, round((x - z) / y), so it is the
    quotient the forward used, whichever rounding.
    """
    x, y = n.inputs
    d_divisor = None
    if n.needs(1):
        quotient = n.op.Round((x - n.outputs[0]) / y)
        d_divisor = -n.dy * quotient
    return n.dy, d_divisor


@register("Clip", beyond_tags=(1, 2))
def clip(n):
    """d clip(x, lo, hi) = (dy [lo <= x <= hi],  sum dy [x < lo < hi],  sum dy [x > hi or hi < lo])

    torch.clamp's convention with tensor bounds: at a tie x keeps dy; when lo > hi the
    output is hi everywhere, so hi takes dy. Without hi, lo takes dy where x < lo; without
    lo, hi takes it where x > hi. The bounds (scalars in the spec) are tagged
    NonDifferentiable, but PyTorch differentiates them: their gradients are summed back
    to their own shape.
    """
    x = n.inputs[0]
    lo, hi = n.input(1), n.input(2)
    zero = n.b.scalar(0.0, n.dy)

    def masked(cond: Var) -> Var:
        return n.op.Where(cond, n.dy, zero)

    inside = None
    if lo is not None:
        inside = n.op.GreaterOrEqual(x, lo)
    if hi is not None:
        below = n.op.LessOrEqual(x, hi)
        inside = below if inside is None else n.op.And(inside, below)
    dx = n.dy if inside is None else masked(inside)
    dlo = dhi = None
    if n.needs(1):
        under = n.op.Less(x, lo)
        dlo = n.b.unbroadcast(masked(under if hi is None else n.op.And(under, n.op.Less(lo, hi))), lo)
    if n.needs(2):
        over = n.op.Greater(x, hi)
        dhi = n.b.unbroadcast(masked(over if lo is None else n.op.Or(over, n.op.Less(hi, lo))), hi)
    return dx, dlo, dhi


@register("Where", broadcast=True)
def where(n):
    """d where(c, x, y) = (None, dy * c, dy * !c)"""
    c = n.inputs[0]
    zero = n.b.scalar(0.0, n.dy)
    dx = n.op.Where(c, n.dy, zero) if n.needs(1) else None
    dy = n.op.Where(c, zero, n.dy) if n.needs(2) else None
    return None, dx, dy


# -- type and identity -----------------------------------------------------------------------
@register("Cast")
def cast(n):
    """d cast(x) = cast(dy) back to x's type (a cast to a non-float type carries no gradient: the pass stops there)"""
    return (n.b.cast_like(n.dy, n.inputs[0]),)


@register("CastLike")
def cast_like(n):
    """d castlike(x, t) = (cast(dy) back to x's type, None)"""
    return n.b.cast_like(n.dy, n.inputs[0]), None


@register("Identity")
def identity(n):
    """d x = dy"""
    return (n.dy,)


# -- unary math ----------------------------------------------------------------------------
@register("Sqrt")
def sqrt(n):
    """d sqrt(x) = dy / (2 y)"""
    y = n.outputs[0]
    return (n.dy / (2.0 * y),)


@register("Reciprocal")
def reciprocal(n):
    """d (1 / x) = -dy * y^2"""
    y = n.outputs[0]
    return (-n.dy * (y * y),)


@register("Exp")
def exp(n):
    """d exp(x) = dy * y"""
    return (n.dy * n.outputs[0],)


@register("Log")
def log(n):
    """d log(x) = dy / x"""
    return (n.dy / n.inputs[0],)


@register("Abs")
def abs_(n):
    """d |x| = dy * sign(x)"""
    return (n.dy * n.op.Sign(n.inputs[0]),)


@register("Erf")
def erf(n):
    """d erf(x) = dy * 2 / sqrt(pi) * exp(-x^2) = dy * exp(log(2 / sqrt(pi)) - x^2)  (one op fewer)"""
    x = n.inputs[0]
    return (n.dy * n.op.Exp(math.log(2.0 / math.sqrt(math.pi)) - x * x),)


@register("Sin")
def sin(n):
    """d sin(x) = dy * cos(x)"""
    return (n.dy * n.op.Cos(n.inputs[0]),)


@register("Cos")
def cos(n):
    """d cos(x) = -dy * sin(x)"""
    return (-n.dy * n.op.Sin(n.inputs[0]),)


@register("Tan")
def tan(n):
    """d tan(x) = dy * (1 + y^2)"""
    y = n.outputs[0]
    return (n.dy * (1.0 + y * y),)


@register("Asin")
def asin(n):
    """d asin(x) = dy / sqrt(1 - x^2)"""
    x = n.inputs[0]
    return (n.dy / n.op.Sqrt(1.0 - x * x),)


@register("Acos")
def acos(n):
    """d acos(x) = -dy / sqrt(1 - x^2)"""
    x = n.inputs[0]
    return (-n.dy / n.op.Sqrt(1.0 - x * x),)


@register("Atan")
def atan(n):
    """d atan(x) = dy / (1 + x^2)"""
    x = n.inputs[0]
    return (n.dy / (1.0 + x * x),)


@register("Sinh")
def sinh(n):
    """d sinh(x) = dy * cosh(x)"""
    return (n.dy * n.op.Cosh(n.inputs[0]),)


@register("Cosh")
def cosh(n):
    """d cosh(x) = dy * sinh(x)"""
    return (n.dy * n.op.Sinh(n.inputs[0]),)


@register("Asinh")
def asinh(n):
    """d asinh(x) = dy / sqrt(x^2 + 1)"""
    x = n.inputs[0]
    return (n.dy / n.op.Sqrt(x * x + 1.0),)


@register("Acosh")
def acosh(n):
    """d acosh(x) = dy / sqrt(x^2 - 1)"""
    x = n.inputs[0]
    return (n.dy / n.op.Sqrt(x * x - 1.0),)


@register("Atanh")
def atanh(n):
    """d atanh(x) = dy / (1 - x^2)"""
    x = n.inputs[0]
    return (n.dy / (1.0 - x * x),)


# -- generators ------------------------------------------------------------------------------
@register("Range", inputs=(0, 2))
def range_(n):
    """y_i = start + i * delta:  d = (sum(dy), None, sum(dy * i))

    The element count depends on limit only through a ceil, so limit's derivative
    is zero almost everywhere (None).
    """
    y = n.outputs[0]
    dstart = n.b.sum(n.dy, keepdims=False) if n.needs(0) else None
    ddelta = None
    if n.needs(2):
        count = n.b.cast_like(n.op.Size(y), y)
        index = n.op.Range(n.b.scalar(0.0, y), count, n.b.scalar(1.0, y))
        ddelta = n.b.sum(n.dy * index, keepdims=False)
    return dstart, None, ddelta


@register("DequantizeLinear", inputs=(1,))
def dequantize_linear(n):
    """y = (x - zero_point) * scale, scale per tensor, per slice along ``axis``, or per block of ``block_size``:
    d scale = sum of dy * (x - zero_point) over the elements each scale multiplies (x is integer: no gradient)

    x - zero_point is the op itself with a scale of ones, in y's type.
    """
    x, scale = n.inputs[0], n.inputs[1]
    attrs = {k: n.attr(k) for k in ("axis", "block_size", "output_dtype") if n.has_attr(k)}
    centred = n.op.DequantizeLinear(x, n.b.fill_like(scale, 1.0), n.input(2), **attrs)
    prod = n.b.cast_like(n.dy * centred, scale)
    if scale.rank == 0 or scale.shape == (1,) and not n.attr("block_size", 0):
        return (None, n.b.reshape_like(n.b.sum(prod, None, keepdims=False), scale), None)
    rank = x.rank
    if rank is None:
        n.decline("DequantizeLinear with a per-axis or blocked scale needs the rank of x")
    axis = n.attr("axis", 1) % rank
    block = n.attr("block_size", 0)
    if not block:                                       # per axis: scale is [x.shape[axis]]
        return (None, n.b.sum(prod, [k for k in range(rank) if k != axis], keepdims=False), None)
    size = x.shape[axis] if x.shape is not None else None
    if size is None or size % block:
        n.decline("DequantizeLinear with blocks needs x's size along axis known and a multiple of block_size")
    split = n.b.ints([size // block, block])
    if x.info.static:
        dims = n.b.ints(list(x.shape[:axis]) + [size // block, block] + list(x.shape[axis + 1:]))
    else:
        dims = n.op.Concat(n.b.shape_of(x, 0, axis), split, n.b.shape_of(x, axis + 1, rank), axis=0)
    blocks = n.op.Reshape(prod, dims)                   # the blocks along axis split out: [..., D / B, B, ...]
    return (None, n.b.sum(blocks, [axis + 1], keepdims=False), None)


@register("DynamicQuantizeLinear", inputs=(0,))
def dynamic_quantize_linear(n):
    """y_scale = (max(0, max x) - min(0, min x)) / 255 (y and y_zero_point are integers: no gradient):
    dx = d y_scale / 255 * ([x = max x] [max x > 0] / #max - [x = min x] [min x < 0] / #min), ties shared
    evenly as PyTorch's amax/amin"""
    x, ds = n.inputs[0], n.dys[1]
    if ds is None:
        return (None,)
    b, zero = n.b, n.b.scalar(0.0, x)
    parts = []
    for op, keep, sign in (("ReduceMax", "Greater", 1.0), ("ReduceMin", "Less", -1.0)):
        m = b.reduce(op, x, None, keepdims=True)
        at = b.cast_like(n.op.Equal(x, m), x)
        active = b.cast_like(getattr(n.op, keep)(m, zero), x)
        parts.append(at * (active * sign) / b.sum(at, None, keepdims=True))
    return ((parts[0] + parts[1]) * (n.op.Reshape(ds, b.ints([1] * x.rank)) / 255.0),) if x.rank else (
        (parts[0] + parts[1]) * ds / 255.0,)
