"""Reductions (Reduce*), scans (CumSum, CumProd) and TopK.

A reduction's gradient is written against the reduced output kept as
``keepdims=1`` (``keep(dy)``, ``keep(y)``), which broadcasts against X, so a seed
is only expanded to X's shape where the formula does not already multiply it
by something X-shaped (ReduceSum, ReduceMean, ReduceLogSum).
"""
from __future__ import annotations

from onnxgrad.ir.builder import Var

from .registry import Node, register


class _Reduction:
    """How a Reduce* node groups X's elements, and the same grouping applied to other tensors.

    ``kind``: "axes" (a static list), "all" (no axes), "none" (no axes and
    noop_with_empty_axes: every group is one element, the op is elementwise) or
    "dynamic" (axes computed at run time, handed to every op as they are).
    """

    def __init__(self, n: Node):
        self.n = n
        self.x = n.inputs[0]
        self.keepdims = bool(n.attr("keepdims", 1))
        op = n.proto.op_type
        axes_as_input = n.opset >= (13 if op == "ReduceSum" else 18)
        self.noop = bool(n.attr("noop_with_empty_axes", 0)) if axes_as_input else False
        self.axes: list[int] | Var | None = None
        if axes_as_input:
            if n.input(1) is not None:
                values = n.const_ints(1)
                self.axes = values if values is not None else n.input(1)
        else:
            self.axes = n.attr("axes")
        if isinstance(self.axes, Var):
            self.kind = "dynamic"
        elif self.axes:
            self.kind = "axes"
            self.axes = list(self.axes)
        else:
            self.kind = "none" if self.noop else "all"

    def keep(self, v: Var) -> Var:
        """A reduced tensor (y or dy) with the reduced axes back as 1s (a scalar stays one: it broadcasts)."""
        if self.keepdims or self.kind in ("all", "none"):
            return v
        if self.kind == "axes":
            return self.n.b.unsqueeze(v, self.axes)
        return self.n.op.Unsqueeze(v, self.axes)   # run-time axes; empty axes leave v as is

    def total(self, op: str, t: Var) -> Var:
        """``op`` (ReduceSum, ReduceProd) of X-shaped t over the same groups, keepdims=1."""
        if self.kind == "none":
            return t
        if self.kind == "dynamic":
            return self.n.b.emit(op, [t, self.axes], keepdims=1, noop_with_empty_axes=int(self.noop))
        return self.n.b.reduce(op, t, self.axes if self.kind == "axes" else None, keepdims=True)

    def expand(self, t: Var) -> Var:
        """t (keepdims-shaped) broadcast to X's shape."""
        if self.kind == "none":
            return t
        x = self.x
        shape = self.n.b.ints(x.shape) if x.info.static else self.n.b.shape_of(x)
        return self.n.op.Expand(t, shape)

    def count(self, like: Var) -> Var | float:
        """Elements per group: a number when X's reduced dims are known, else Size(X) / Size(y)."""
        if self.kind == "none":
            return 1.0
        shape = self.x.shape
        if shape is not None and self.kind != "dynamic":
            dims = shape if self.kind == "all" else [shape[a] for a in self.axes]
            if all(d is not None for d in dims):
                return float(self.n.b.prod(dims))
        size_x = _float_like(self.n, self.n.op.Size(self.x), like)
        size_y = _float_like(self.n, self.n.op.Size(self.n.outputs[0]), like)
        return size_x / size_y


def _float_like(n: Node, mask: Var, like: Var) -> Var:
    """A boolean mask (or a count) as a number of like's type."""
    return n.b.cast_like(mask, like)


def _zero(n: Node, like: Var) -> Var:
    return n.b.scalar(0.0, like)


@register("ReduceSum")
def reduce_sum(n: Node):
    """y = sum_g x:  dx = dy broadcast over the group"""
    r = _Reduction(n)
    return (r.expand(r.keep(n.dy)),)


@register("ReduceMean")
def reduce_mean(n: Node):
    """y = sum_g x / |g|:  dx = dy / |g| broadcast over the group"""
    r = _Reduction(n)
    dy = r.keep(n.dy)
    count = r.count(dy)
    return (r.expand(dy if isinstance(count, float) and count == 1.0 else dy / count),)


@register("ReduceMax", "ReduceMin")
def reduce_extremum(n: Node):
    """y = max_g x (min_g x):  dx = dy * [x == y] / #{x == y}

    Ties share the gradient evenly, as torch.amax/amin do (for a tie of two this is
    also what central differences give).
    """
    r = _Reduction(n)
    if r.kind == "none":
        return (n.dy,)
    x = n.inputs[0]
    hit = _float_like(n, n.op.Equal(x, r.keep(n.outputs[0])), x)
    return (hit * (r.keep(n.dy) / r.total("ReduceSum", hit)),)


@register("ReduceProd")
def reduce_prod(n: Node):
    """y = prod_g x:  dx_j = dy * prod_{i in g, i != j} x_i, exact with zeros in x:

    with p = product of the non-zero x_i and z = number of zeros in the group,
    prod_{i != j} x_i = p / x_j if z == 0;  p if z == 1 and x_j == 0;  0 otherwise.
    (Second derivatives are exact where the group has no zero.)
    """
    r = _Reduction(n)
    if r.kind == "none":
        return (n.dy,)
    x = n.inputs[0]
    zero = _zero(n, x)
    is_zero = n.op.Equal(x, zero)
    x_safe = n.op.Where(is_zero, n.b.scalar(1.0, x), x)
    p = r.total("ReduceProd", x_safe)
    zeros = r.total("ReduceSum", _float_like(n, is_zero, x))
    others = n.op.Where(
        is_zero,
        n.op.Where(n.op.Equal(zeros, n.b.scalar(1.0, x)), p, zero),
        n.op.Where(n.op.Equal(zeros, zero), p / x_safe, zero))
    return (r.keep(n.dy) * others,)


@register("ReduceL1")
def reduce_l1(n: Node):
    """y = sum_g |x|:  dx = dy * sign(x)"""
    r = _Reduction(n)
    return (r.keep(n.dy) * n.op.Sign(n.inputs[0]),)


@register("ReduceL2")
def reduce_l2(n: Node):
    """y = sqrt(sum_g x^2):  dx = dy * x / y   (0 where y == 0, as torch.norm)"""
    r = _Reduction(n)
    x = n.inputs[0]
    y = r.keep(n.outputs[0])
    zero = _zero(n, x)
    scale = n.op.Where(n.op.Equal(y, zero), zero, r.keep(n.dy) / y)
    return (x * scale,)


@register("ReduceLogSum")
def reduce_log_sum(n: Node):
    """y = log(sum_g x):  dx = dy / exp(y) broadcast over the group"""
    r = _Reduction(n)
    return (r.expand(r.keep(n.dy) / n.op.Exp(r.keep(n.outputs[0]))),)


@register("ReduceLogSumExp")
def reduce_log_sum_exp(n: Node):
    """y = log(sum_g exp(x)):  dx = dy * exp(x - y)   (the softmax over the group)"""
    r = _Reduction(n)
    if r.kind == "none":
        return (n.dy,)
    return (r.keep(n.dy) * n.op.Exp(n.inputs[0] - r.keep(n.outputs[0])),)


@register("ReduceSumSquare")
def reduce_sum_square(n: Node):
    """y = sum_g x^2:  dx = 2 x dy"""
    r = _Reduction(n)
    return (n.inputs[0] * (r.keep(n.dy) * 2.0),)


# -- scans ----------------------------------------------------------------------------
@register("CumSum")
def cumsum(n: Node):
    """y_i = sum_{j <= i} x_j along axis:  dx_j = sum_{i >= j} dy_i, the CumSum of dy run the other way"""
    backward = None if _flag(n, "reverse") else 1
    return n.op.CumSum(n.dy, n.inputs[1], exclusive=_flag(n, "exclusive"), reverse=backward), None


@register("CumProd")
def cumprod(n: Node):
    """y_i = prod_{j <= i} x_j along axis:  dx_j = sum_{i >= j} dy_i prod_{k <= i, k != j} x_k, exact with zeros.

    With z the first zero in scan order: for j before z, dx_j = (sum_{i >= j} dy_i y_i) / x_j;
    dx_z = sum_{i >= z} dy_i y'_i with y' the CumProd of x with x_z set to 1; after z, dx_j = 0.
    ``exclusive`` (k < i) and ``reverse`` (scan from the end) carry over to every scan.
    (Second derivatives are exact where the scanned line has no zero.)
    """
    x, axis = n.inputs
    exclusive, reverse = _flag(n, "exclusive"), _flag(n, "reverse")
    backward = None if reverse else 1                     # sums over i at or after j in scan order
    zero = _zero(n, x)
    is_zero = n.op.Equal(x, zero)
    zeros_before = n.op.CumSum(_float_like(n, is_zero, x), axis, exclusive=1, reverse=reverse)
    none_before = n.op.Equal(zeros_before, zero)
    first_zero = n.op.And(is_zero, none_before)
    before_zero = n.op.And(n.op.Not(is_zero), none_before)
    dy, y = n.dy, n.outputs[0]
    x_safe = n.op.Where(before_zero, x, n.b.scalar(1.0, x))
    before = n.op.CumSum(dy * y, axis, exclusive=exclusive, reverse=backward) / x_safe
    y_skip = n.op.CumProd(n.op.Where(first_zero, n.b.scalar(1.0, x), x), axis, exclusive=exclusive, reverse=reverse)
    at = n.op.CumSum(dy * y_skip, axis, exclusive=exclusive, reverse=backward)
    return n.op.Where(before_zero, before, n.op.Where(first_zero, at, zero)), None


def _flag(n: Node, name: str) -> int | None:
    """A 0/1 attribute as it is emitted: 1 or absent."""
    return 1 if int(n.attr(name, 0)) else None


# -- TopK -----------------------------------------------------------------------------
@register("TopK")
def topk(n: Node):
    """values = x[indices] along axis:  dx = dvalues scattered to the indices (they are distinct), 0 elsewhere"""
    x = n.inputs[0]
    indices = n.expose_output(1, "indices")
    dx = n.op.ScatterElements(n.b.zeros_like(x), indices, n.dy, axis=int(n.attr("axis", -1)))
    return dx, None

