"""Gradient rules: activations. Where the formula allows, a rule reuses the forward output y.

Hardmax is piecewise constant: it is a stop op (see ``stop.py``).
"""
from __future__ import annotations

import math

import numpy as np

from onnxgrad.ir.builder import Var

from .registry import Node, register


def _positive(n: Node, x: Var) -> Var:
    """The mask x > 0."""
    return n.op.Greater(x, n.b.scalar(0.0, x))


def _softmax_axes(n: Node) -> list[int]:
    """The axes one softmax normalises over.

    From opset 13, one axis (default -1). Before, the input was coerced to 2-D
    around ``axis`` (default 1): the normalisation runs over all axes from it on.
    (The pass upgrades models older than opset 13, so rules see 13+ in practice.)
    """
    if n.opset >= 13:
        return [n.attr("axis", -1)]
    axis = n.attr("axis", 1)
    rank = n.inputs[0].rank
    if rank is None:
        n.decline(f"{n.proto.op_type} before opset 13 needs the input's rank")
    axis = axis + rank if axis < 0 else axis
    return list(range(axis, rank))


# -- rules ----------------------------------------------------------------------------------
@register("Relu")
def relu(n):
    """d relu(x) = dy * (y > 0)"""
    y = n.outputs[0]
    return (n.op.Where(_positive(n, y), n.dy, n.b.scalar(0.0, y)),)


@register("Tanh")
def tanh(n):
    """d tanh(x) = dy * (1 - y^2)"""
    y = n.outputs[0]
    return (n.dy * (1.0 - y * y),)


@register("Sigmoid")
def sigmoid(n):
    """d sigmoid(x) = dy * y * (1 - y)"""
    y = n.outputs[0]
    return (n.dy * (y * (1.0 - y)),)


@register("LeakyRelu")
def leaky_relu(n):
    """d leaky_relu(x) = dy if x > 0 else alpha * dy   (alpha = 0.01)"""
    x = n.inputs[0]
    alpha = n.attr("alpha", 0.01)
    return (n.op.Where(_positive(n, x), n.dy, n.dy * alpha),)


@register("PRelu", broadcast=True)
def prelu(n):
    """d prelu(x, s) = (dy if x > 0 else dy * s,  0 if x > 0 else dy * x)
    (s broadcast to x, summed back by the pass)"""
    x, slope = n.inputs
    positive = _positive(n, x)
    zero = n.b.scalar(0.0, x)
    dx = n.op.Where(positive, n.dy, n.dy * slope) if n.needs(0) else None
    dslope = n.op.Where(positive, zero, n.dy * x) if n.needs(1) else None
    return dx, dslope


@register("ThresholdedRelu")
def thresholded_relu(n):
    """d thresholded_relu(x) = dy * (x > alpha)   (alpha = 1)"""
    x = n.inputs[0]
    above = n.op.Greater(x, n.b.scalar(n.attr("alpha", 1.0), x))
    return (n.op.Where(above, n.dy, n.b.scalar(0.0, x)),)


@register("Elu")
def elu(n):
    """d elu(x) = dy if x > 0 else dy * (y + alpha)   (alpha = 1; y + alpha = alpha * exp(x) there)"""
    x, y = n.inputs[0], n.outputs[0]
    alpha = n.attr("alpha", 1.0)
    return (n.op.Where(_positive(n, x), n.dy, n.dy * (y + alpha)),)


@register("Selu")
def selu(n):
    """d selu(x) = dy * gamma if x > 0 else dy * (y + gamma * alpha)
    (y + gamma * alpha = gamma * alpha * exp(x) there)"""
    x, y = n.inputs[0], n.outputs[0]
    alpha = n.attr("alpha", 1.67326319217681884765625)
    gamma = n.attr("gamma", 1.05070102214813232421875)
    return (n.dy * n.op.Where(_positive(n, x), n.b.scalar(gamma, y), y + gamma * alpha),)


@register("Celu")
def celu(n):
    """d celu(x) = dy if x > 0 else dy * (y / alpha + 1)   (y / alpha + 1 = exp(x / alpha) there; alpha = 1)"""
    x, y = n.inputs[0], n.outputs[0]
    alpha = n.attr("alpha", 1.0)
    return (n.op.Where(_positive(n, x), n.dy, n.dy * (y * (1.0 / alpha) + 1.0)),)


@register("Softplus")
def softplus(n):
    """d log(1 + exp(x)) = dy * sigmoid(x)"""
    return (n.dy * n.op.Sigmoid(n.inputs[0]),)


@register("Softsign")
def softsign(n):
    """d x / (1 + |x|) = dy / (1 + |x|)^2"""
    x = n.inputs[0]
    denom = 1.0 + n.op.Abs(x)
    return (n.dy / (denom * denom),)


@register("HardSigmoid")
def hard_sigmoid(n):
    """d max(0, min(1, alpha * x + beta)) = dy * alpha where 0 < y < 1, else 0   (alpha = 0.2, beta = 0.5)"""
    y = n.outputs[0]
    alpha = n.attr("alpha", 0.2)
    inside = n.op.And(n.op.Greater(y, n.b.scalar(0.0, y)), n.op.Less(y, n.b.scalar(1.0, y)))
    return (n.op.Where(inside, n.dy * alpha, n.b.scalar(0.0, y)),)


@register("HardSwish")
def hard_swish(n):
    """d x * hardsigmoid(x) (alpha = 1/6, beta = 1/2) = dy * {0 if x < -3;  x / 3 + 1/2 if -3 <= x <= 3;  1 if x > 3}

    (the kink values follow PyTorch's ``hardswish_backward``)
    """
    x = n.inputs[0]
    zero = n.b.scalar(0.0, x)
    middle = n.op.Where(n.op.Greater(x, n.b.scalar(3.0, x)), n.dy, n.dy * (x * (1.0 / 3.0) + 0.5))
    return (n.op.Where(n.op.Less(x, n.b.scalar(-3.0, x)), zero, middle),)


@register("Mish")
def mish(n):
    """d x * tanh(softplus(x)) = dy * (t + x * sigmoid(x) * (1 - t^2))  with t = tanh(softplus(x))"""
    x = n.inputs[0]
    t = n.op.Tanh(n.op.Softplus(x))
    return (n.dy * (t + x * n.op.Sigmoid(x) * (1.0 - t * t)),)


@register("Swish")
def swish(n):
    """d x * sigmoid(alpha * x) = dy * (s + alpha * y * (1 - s))  with s = sigmoid(alpha * x)   (alpha = 1)"""
    x, y = n.inputs[0], n.outputs[0]
    alpha = n.attr("alpha", 1.0)
    s = n.op.Sigmoid(x * alpha if alpha != 1.0 else x)
    return (n.dy * (s + alpha * y * (1.0 - s)),)


@register("Shrink")
def shrink(n):
    """d shrink(x) = dy * (|x| > lambd)   (lambd = 0.5; the bias shifts y, not its slope)"""
    x = n.inputs[0]
    outside = n.op.Greater(n.op.Abs(x), n.b.scalar(n.attr("lambd", 0.5), x))
    return (n.op.Where(outside, n.dy, n.b.scalar(0.0, x)),)


@register("Gelu")
def gelu(n):
    """approximate="none": d x * Phi(x) = dy * (Phi(x) + x * phi(x)),
    Phi(x) = (1 + erf(x / sqrt 2)) / 2, phi the normal pdf
    approximate="tanh": y = x (1 + t) / 2, t = tanh(u), u = sqrt(2 / pi) (x + 0.044715 x^3):
        d y = dy * ((1 + t) / 2 + x / 2 * (1 - t^2) * sqrt(2 / pi) * (1 + 3 * 0.044715 x^2))
    """
    x = n.inputs[0]
    if n.attr("approximate", "none") == "tanh":
        k = math.sqrt(2.0 / math.pi)
        x2 = x * x
        t = n.op.Tanh(k * x * (1.0 + 0.044715 * x2))
        du = k * (1.0 + 3.0 * 0.044715 * x2)
        return (n.dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du),)
    cdf = 0.5 * (1.0 + n.op.Erf(x * (1.0 / math.sqrt(2.0))))
    pdf = (1.0 / math.sqrt(2.0 * math.pi)) * n.op.Exp(x * x * -0.5)
    return (n.dy * (cdf + x * pdf),)


@register("Softmax")
def softmax(n):
    """d softmax(x) = (dy - sum(dy * y, axis)) * y

    A row of -inf only (a fully masked attention row) makes y NaN; a model that masks such rows afterwards
    (onnx's Attention body: Where(row all -inf, 0, y)) has a zero derivative there, as PyTorch's safe
    softmax in scaled_dot_product_attention. Where the model holds a -inf constant, y's NaN rows are read
    as 0, so their zero seed stays zero (0 * NaN would spread NaN into every gradient reading them).
    """
    y = n.outputs[0]
    if _has_negative_infinity(n):
        y = n.op.Where(n.op.IsNaN(y), n.b.scalar(0.0, y), y)
    return ((n.dy - n.b.sum(n.dy * y, _softmax_axes(n))) * y,)


def _has_negative_infinity(n) -> bool:
    """Whether a constant of the model (a mask's fill) is -inf: only then can a softmax row be all -inf
    without a -inf input at run time."""
    return any(v.dtype.kind == "f" and v.size and np.isneginf(v).any() for v in n.b.constants.values())


@register("LogSoftmax")
def log_softmax(n):
    """d log_softmax(x) = dy - exp(y) * sum(dy, axis)"""
    y = n.outputs[0]
    return (n.dy - n.op.Exp(y) * n.b.sum(n.dy, _softmax_axes(n)),)


@register("Dropout", inputs=(0,))  # as tagged from opset 13; Dropout-12's schema is untagged
def dropout(n):
    """inference: d x = dy;  training: d x = dy * mask / (1 - ratio)   (ratio = 0.5; mask: the forward's output 1)

    ratio and training_mode are NonDifferentiable. A run-time training_mode picks
    between the two with Where; the mask is exposed on the forward node when the
    model did not keep it.
    """
    training = n.input(2)
    flag = n.const_ints(2)
    if training is None or (flag is not None and not flag[0]):
        return (n.dy,)
    mask = n.expose_output(1, "mask")
    ratio = n.input(1)
    ratio_value = n.const_value(1)
    if ratio is None or ratio_value is not None:
        r = 0.5 if ratio is None else float(ratio_value.reshape(-1)[0])
        scale = n.b.scalar(1.0 / (1.0 - r) if r < 1.0 else 0.0, n.dy)  # ratio 1 drops every element
    else:
        scale = 1.0 / (1.0 - n.b.cast_like(ratio, n.dy))
    dx = n.op.Where(mask, n.dy * scale, n.b.scalar(0.0, n.dy))
    if flag is None:
        dx = n.op.Where(training, dx, n.dy)
    return (dx,)
