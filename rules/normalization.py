"""Gradient rules: normalizations (BatchNormalization, LayerNormalization, InstanceNormalization,
GroupNormalization, RMSNormalization, MeanVarianceNormalization, LpNormalization).

Most of them standardise x over some axes, ``xhat = (x - mean) * inv`` with
``inv = 1 / sqrt(var + eps)``, then scale and shift it. With ``g`` the gradient
reaching ``xhat`` the gradient of x is the one formula :func:`_standardize_grad`:

    dx = inv * (g - mean(g) - xhat * mean(g * xhat))

Statistics a forward op exposes (LayerNormalization's Mean and InvStdDev) are
reused; the others are recomputed (a ReduceMean, a Sqrt), which costs far less
than the surrounding elementwise work.
"""
from __future__ import annotations

from typing import Sequence

from onnx import TensorProto

from onnxgrad.ir.builder import Var
from onnxgrad.ir.model import float_bits

from .registry import Node, register

_HALF_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


# -- helpers ------------------------------------------------------------------------------
def _mean(n: Node, x: Var, axes: Sequence[int]) -> Var:
    return n.b.reduce("ReduceMean", x, list(axes), keepdims=True)


def _count(n: Node, x: Var, axes: Sequence[int]) -> Var:
    """The number of elements of x over ``axes``, as a scalar of x's type (a constant when static)."""
    shape = x.shape
    if shape is not None and all(shape[a] is not None for a in axes):
        total = 1
        for a in axes:
            total *= shape[a]
        return n.b.scalar(float(total), x)
    dims = n.op.Gather(n.b.shape_of(x), n.b.ints(axes), axis=0)
    return n.b.cast_like(n.b.reduce("ReduceProd", dims, [0], keepdims=False), x)


def _per_channel(n: Node, p: Var, rank: int) -> Var:
    """A (C,) parameter shaped (C, 1, ..., 1) to broadcast along axis 1 of a rank-``rank`` tensor."""
    return p if rank <= 2 else n.b.unsqueeze(p, list(range(1, rank - 1)))


def _channel_sum(n: Node, v: Var, rank: int) -> Var:
    """Sum over every axis but the channel axis 1: (N, C, ...) -> (C,)."""
    return n.b.sum(v, [0] + list(range(2, rank)), keepdims=False)


def _centered(n: Node, x: Var, axes: Sequence[int]) -> tuple[Var, Var]:
    """(x - mean, biased variance) over ``axes``, recomputed from x."""
    xc = x - _mean(n, x, axes)
    return xc, _mean(n, xc * xc, axes)


def _moments(n: Node, x: Var, axes: Sequence[int], eps: float) -> tuple[Var, Var]:
    """(xhat, inv): x standardised over ``axes`` and 1 / sqrt(var + eps), recomputed from x."""
    xc, var = _centered(n, x, axes)
    inv = 1.0 / n.op.Sqrt(var + eps)
    return xc * inv, inv


def _standardize_grad(n: Node, g: Var, xhat: Var, inv: Var, axes: Sequence[int]) -> Var:
    """dx for xhat = (x - mean(x)) * inv over ``axes``, given g = dL/dxhat.

    dx = inv * (g - mean(g) - xhat * mean(g * xhat))
    """
    return inv * (g - _mean(n, g, axes) - xhat * _mean(n, g * xhat, axes))


def _stash(x: Var, stash_type: int) -> tuple[int | None, int | None]:
    """(compute type, x's type): stage one runs in ``stash_type`` when x is a 16-bit float, else in x's type."""
    if x.dtype in _HALF_TYPES and stash_type not in _HALF_TYPES:
        return stash_type, x.dtype
    return None, None


def _cast(n: Node, v: Var | None, to: int | None) -> Var | None:
    return v if v is None or to is None else n.op.Cast(v, to=to)


# -- BatchNormalization -------------------------------------------------------------------
@register("BatchNormalization")
def batch_normalization_9(n):
    """BatchNormalization-9 (opset 13): training exactly when the optional statistics outputs are there."""
    return _batch_norm(n, training=any(o is not None for o in n.outputs[1:]))


@register("BatchNormalization", since=14)
def batch_normalization(n):
    """BatchNormalization-14/15: the ``training_mode`` attribute. See :func:`_batch_norm`."""
    return _batch_norm(n, training=bool(n.attr("training_mode", 0)))


def _batch_norm(n: Node, training: bool):
    """y = scale * xhat + B, xhat = (x - mean) * inv, inv = 1 / sqrt(var + eps), per channel (axis 1).

    inference (mean, var are inputs):
        dx = dy * scale * inv          dB = sum(dy)          dscale = sum(dy * xhat)
        dmean = -dB * scale * inv      dvar = -dscale * scale * inv^2 / 2
    training (mean, var are the batch statistics over every axis but 1, N elements per channel):
        dx = scale * inv * (dy - mean(dy) - xhat * mean(dy * xhat)),  dB, dscale as above;
        input_mean and input_var only feed the running statistics, which carry no gradient.
    """
    x, scale, _, mean, var = n.inputs[:5]
    dy = n.dy
    if dy is None:   # only the running statistics were reached: they carry no gradient
        return None
    if x.rank is None:   # the rank only at run time: the same formulas on [N, C, L] views, dx shaped back
        dx, *rest = _batch_norm_grads(n, n.op.Reshape(x, n.b.ints([0, 0, -1])),
                                      n.op.Reshape(dy, n.b.ints([0, 0, -1])), 3, training)
        return (None if dx is None else n.b.reshape_like(dx, x), *rest)
    return _batch_norm_grads(n, x, dy, x.rank, training)


def _batch_centered(n: Node, x: Var, reduced: list[int]) -> tuple[Var, Var]:
    """(x - batch mean, biased batch variance per channel, shaped to broadcast against x).

    With ``momentum`` 0 the node's running outputs are exactly the batch's mean and variance (running =
    input * momentum + batch * (1 - momentum)), so they are read, not recomputed: :mod:`onnxgrad.training.train_mode`
    gives its training-mode copies momentum 0 and forms PyTorch's running statistics from them."""
    rank = len(reduced) + 1
    outputs = n.outputs[1:3]
    if n.attr("momentum", 0.9) == 0.0 and all(o is not None for o in outputs):
        return x - _per_channel(n, outputs[0], rank), _per_channel(n, outputs[1], rank)
    return _centered(n, x, reduced)


def _batch_norm_grads(n: Node, x: Var, dy: Var, rank: int, training: bool) -> tuple:
    """BatchNormalization's five gradients for x and dy of rank ``rank`` (channels on axis 1)."""
    scale, mean, var = n.inputs[1], n.inputs[3], n.inputs[4]
    eps = n.attr("epsilon", 1e-5)
    reduced = [0] + list(range(2, rank))
    if training:
        # with xc = x - mean: sum(dy * xhat) = inv * sum(dy * xc), so that
        #   dx = k * dy - xc * (k * inv^2 * sum(dy * xc) / N) - k * sum(dy) / N,   k = scale * inv,
        # per-channel factors and four full-size passes, after the two sums dB and dscale need anyway
        xc, batch_var = _batch_centered(n, x, reduced)
        inv = 1.0 / n.op.Sqrt(batch_var + eps)
        sum_dy = n.b.sum(dy, reduced, keepdims=True)
        sum_dy_xc = n.b.sum(dy * xc, reduced, keepdims=True)
        dx = None
        if n.needs(0):
            k = _per_channel(n, scale, rank) * inv
            per_n = 1.0 / _count(n, x, reduced)
            dx = k * dy - xc * (k * inv * inv * sum_dy_xc * per_n) - k * sum_dy * per_n
        dscale = n.b.reshape_like(sum_dy_xc * inv, scale) if n.needs(1) else None
        dB = n.b.reshape_like(sum_dy, scale) if n.needs(2) else None
        return dx, dscale, dB, None, None

    inv = 1.0 / n.op.Sqrt(var + eps)
    k = scale * inv
    dx = dy * _per_channel(n, k, rank) if n.needs(0) else None
    dB = _channel_sum(n, dy, rank) if n.needs(2) or n.needs(3) else None
    dscale = dmean = dvar = None
    if n.needs(1) or n.needs(4):
        dscale = _channel_sum(n, dy * (x - _per_channel(n, mean, rank)), rank) * inv
    if n.needs(3):
        dmean = -dB * k
    if n.needs(4):
        dvar = dscale * k * inv * -0.5
    return dx, (dscale if n.needs(1) else None), (dB if n.needs(2) else None), dmean, dvar


# -- LayerNormalization, RMSNormalization -------------------------------------------------
@register("LayerNormalization", inputs=(0, 1, 2))
def layer_normalization(n):
    """y = xhat * scale + B over the axes from ``axis`` on; Mean and InvStdDev are outputs too.

    dB = sum(dy)   dscale = sum(dy * xhat)   (over the axes they are broadcast along)
    dx = inv * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * scale
         + (dMean - dInvStdDev * inv^3 * (x - Mean)) / D       (when the statistics have gradients)
    """
    x, scale = n.inputs[0], n.inputs[1]
    bias = n.input(2)
    rank = n.b.rank(x)
    axes = list(range(n.b.normalize_axis(n.attr("axis", -1), rank), rank))
    stash_type = n.attr("stash_type", 1)
    compute, back = _stash(x, stash_type)
    dy, dmean, dinv = (n.dys + [None, None, None])[:3]
    xs, dys = _cast(n, x, compute), _cast(n, dy, compute)
    if float_bits(stash_type) < float_bits(xs.dtype):
        # statistics stored narrower than x (a float64 x, the default float32 stash_type): y is normalised in
        # x's precision, so they are recomputed in it (the rounded outputs left the gradient off by about 1e-8),
        # as the tangent rule does
        xc, var = _centered(n, xs, axes)
        inv = 1.0 / n.op.Sqrt(var + n.attr("epsilon", 1e-5))
    else:
        mean, inv = n.expose_output(1, "Mean"), n.expose_output(2, "InvStdDev")
        if xs.dtype is None or xs.dtype != stash_type:   # the statistics are of the stash type
            mean, inv = n.b.cast_like(mean, xs), n.b.cast_like(inv, xs)
        xc = xs - mean
    xhat = xc * inv
    dx = dscale = dB = None
    if n.needs(0):
        terms = []
        if dys is not None:
            terms.append(_standardize_grad(n, dys * _cast(n, scale, compute), xhat, inv, axes))
        if dmean is not None or dinv is not None:
            stats = n.b.cast_like(dmean, xs) if dmean is not None else None
            if dinv is not None:
                from_inv = -(n.b.cast_like(dinv, xs) * inv * inv * inv) * xc
                stats = from_inv if stats is None else stats + from_inv
            terms.append(stats / _count(n, xs, axes))
        dx = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        dx = _cast(n, dx, back)
    if dy is not None and n.needs(1):
        dscale = n.b.unbroadcast(n.b.with_shape(_cast(n, dys * xhat, back), x), scale)
    if dy is not None and bias is not None and n.needs(2):
        dB = n.b.unbroadcast(dy, bias)
    return (dx, dscale, dB)[:len(n.inputs)]


@register("RMSNormalization", inputs=(0, 1))
def rms_normalization(n):
    """y = xhat * scale, xhat = x * r, r = 1 / sqrt(mean(x^2) + eps) over the axes from ``axis`` on.

    dscale = sum(dy * xhat)    dx = r * (g - xhat * mean(g * xhat)),  g = dy * scale
    """
    x, scale = n.inputs[:2]
    rank = n.b.rank(x)
    axes = list(range(n.b.normalize_axis(n.attr("axis", -1), rank), rank))
    compute, back = _stash(x, n.attr("stash_type", 1))
    xs, dys = _cast(n, x, compute), _cast(n, n.dy, compute)
    r = 1.0 / n.op.Sqrt(_mean(n, xs * xs, axes) + n.attr("epsilon", 1e-5))
    xhat = xs * r
    dx = dscale = None
    if n.needs(0):
        g = dys * _cast(n, scale, compute)
        dx = _cast(n, r * (g - xhat * _mean(n, g * xhat, axes)), back)
    if n.needs(1):
        dscale = n.b.unbroadcast(n.b.with_shape(_cast(n, dys * xhat, back), x), scale)
    return dx, dscale


# -- InstanceNormalization, GroupNormalization --------------------------------------------
@register("InstanceNormalization")
def instance_normalization(n):
    """y = scale * xhat + B, x standardised per instance and channel over the spatial axes.

    dB = sum(dy)   dscale = sum(dy * xhat)   dx = inv * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * scale
    """
    x, scale, _ = n.inputs
    dy = n.dy
    rank = n.b.rank(x)
    if rank < 3:
        n.decline("InstanceNormalization of a tensor without spatial axes")
    spatial = list(range(2, rank))
    xhat, inv = _moments(n, x, spatial, n.attr("epsilon", 1e-5))
    dx = _standardize_grad(n, dy * _per_channel(n, scale, rank), xhat, inv, spatial) if n.needs(0) else None
    dscale = _channel_sum(n, dy * xhat, rank) if n.needs(1) else None
    dB = _channel_sum(n, dy, rank) if n.needs(2) else None
    return dx, dscale, dB


@register("GroupNormalization")
def group_normalization(n):
    """x viewed as (N, G, C/G * spatial) is standardised over its last axis; y = scale * xhat + bias.

    scale and bias are per group, shape (G,), at opset 18, and per channel, shape (C,), from 21.
    dbias = sum(dy)   dscale = sum(dy * xhat)   dx = inv * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * scale
    """
    x, scale, _ = n.inputs
    rank = n.b.rank(x)
    groups = n.attr("num_groups")
    compute, back = _stash(x, n.attr("stash_type", 1)) if n.opset >= 21 else (None, None)
    grouped = n.b.ints([0, groups, -1])
    xg = n.op.Reshape(_cast(n, x, compute), grouped)
    xhat, inv = _moments(n, xg, [2], n.attr("epsilon", 1e-5))
    dyg = n.op.Reshape(n.dy, grouped)
    if n.opset < 21:  # per-group parameters: everything in the grouped view
        g = dyg * n.b.unsqueeze(scale, [1])
        dscale = n.b.sum(dyg * xhat, [0, 2], keepdims=False) if n.needs(1) else None
        dbias = n.b.sum(dyg, [0, 2], keepdims=False) if n.needs(2) else None
    else:
        g = n.op.Reshape(_cast(n, n.dy * _per_channel(n, scale, rank), compute), grouped)
        dscale = dbias = None
        if n.needs(1):
            dscale = _channel_sum(n, n.dy * n.b.reshape_like(_cast(n, xhat, back), x), rank)
        if n.needs(2):
            dbias = _channel_sum(n, n.dy, rank)
    dx = None
    if n.needs(0):
        dx = n.b.reshape_like(_cast(n, _standardize_grad(n, g, xhat, inv, [2]), back), x)
    return dx, dscale, dbias


# -- MeanVarianceNormalization, LpNormalization -------------------------------------------
_MVN_EPSILON = 1e-9  # the function body's: y = (x - mean) / (sqrt(var) + 1e-9)


@register("MeanVarianceNormalization")
def mean_variance_normalization(n):
    """y = (x - mean) / s, s = sd + 1e-9, sd = sqrt(mean((x - mean)^2)) over ``axes``.

    dx = (dy - mean(dy) - y * mean(dy * y) * s / sd) / s
    """
    x = n.inputs[0]
    y = n.outputs[0]
    dy = n.dy
    rank = n.b.rank(x)
    axes = [n.b.normalize_axis(a, rank) for a in n.attr("axes", [0, 2, 3])]
    xc = x - _mean(n, x, axes)
    sd = n.op.Sqrt(_mean(n, xc * xc, axes))
    s = sd + _MVN_EPSILON
    return ((dy - _mean(n, dy, axes) - y * _mean(n, dy * y, axes) * (s / sd)) / s,)


@register("LpNormalization")
def lp_normalization(n):
    """y = x / |x|_p along ``axis`` (p = 1, 2).

    dx = (dy - g * sum(dy * y)) / |x|_p,  g = y for p = 2, sign(x) for p = 1
    """
    x = n.inputs[0]
    y = n.outputs[0]
    p = n.attr("p", 2)
    axis = n.attr("axis", -1)
    if p not in (1, 2):
        n.decline(f"LpNormalization with p={p} (the schema allows 1 and 2)")
    norm = n.b.reduce("ReduceL2" if p == 2 else "ReduceL1", x, [axis], keepdims=True)
    g = y if p == 2 else n.op.Sign(x)
    return ((n.dy - g * n.b.sum(n.dy * y, [axis])) / norm,)
