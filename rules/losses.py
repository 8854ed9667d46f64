"""Losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Both pick one class per target: with ``w[n, c, d...] = weight[c]`` where ``c``
is the target's label (and the target is not ignored), 0 elsewhere,

    loss[n, d...] = -sum_c w[n, c, d...] * logp[n, c, d...]

reduced by none, sum, or mean (the sum divided by ``sum(w)``, the weights of
the targets not ignored, as the ONNX spec says). The labels and weights are
not differentiable.
"""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from onnxgrad.ir.builder import Builder, Var

from .registry import Node, register


@register("NegativeLogLikelihoodLoss")
def nll_loss(n: Node):
    """loss = -sum_c w * x reduced:  dx = -w * g,  g = dy (none: per target), dy (sum), dy / sum(w) (mean)"""
    w = _target_weights(n)
    return (w * -_loss_seed(n, w),)


@register("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(n: Node):
    """logp = LogSoftmax(scores, axis=1), loss = -sum_c w * logp reduced:

    dlogp = dlog_prob - w * g   (g as for NegativeLogLikelihoodLoss),
    dscores = dlogp - softmax * sum_c dlogp,  softmax = exp(logp).
    """
    log_prob = n.expose_output(1, "log_prob")
    dlogp = None
    if n.dy is not None:
        w = _target_weights(n)
        dlogp = w * -_loss_seed(n, w)
    if len(n.dys) > 1 and n.dys[1] is not None:
        dlogp = n.dys[1] if dlogp is None else dlogp + n.dys[1]
    softmax = n.op.Exp(log_prob)
    return (dlogp - softmax * n.b.sum(dlogp, [1], keepdims=True),)


def _loss_seed(n: Node, w: Var) -> Var:
    """g: the loss seed as it reaches each target, broadcastable to [N, C, d...] (no bigger than the loss)."""
    reduction = n.attr("reduction", "mean")
    if reduction == "none":
        return n.b.unsqueeze(n.dy, [1])
    if reduction == "sum":
        return n.dy
    return n.dy / n.b.sum(w, None, keepdims=False)


def _target_weights(n: Node) -> Var:
    """w[n, c, d...] = weight[c] (1 without weights) where c is the target's label and it is not ignored; else 0."""
    x, labels = n.inputs[:2]
    return target_weights(n.b, x, labels, n.input(2), n.attr("ignore_index"))


def target_weights(b: Builder, x: Var, labels: Var, weights: Var | None, ignore: int | None) -> Var:
    """The loss ops' class mask: ``weights[label]`` (1 without weights) at each target's class of the scores
    ``x`` [N, C, d...], 0 at the other classes and for an ignored target (shared with the forward written as
    ops: :mod:`onnxgrad.passes.optimize.webgpu`)."""
    classes = x.shape[1] if x.rank is not None else None
    if ignore is not None and (classes is None or 0 <= ignore < classes):
        # an ignored label that names a class must match none: make it -1
        labels = b.op.Where(b.op.Equal(labels, _int_like(b, ignore, labels)), _int_like(b, -1, labels), labels)
    column = _class_column(b, x)
    hit = b.op.Equal(b.unsqueeze(labels, [1]), _class_ids(b, x, labels, column))   # [N, C, d...]
    w = b.cast_like(hit, x)
    if weights is not None:
        w = w * (weights if x.rank == 2 else b.op.Reshape(weights, column))
    return w


def _class_column(b: Builder, x: Var) -> Var:
    """The shape [C, 1, ..., 1] (C as -1, rank(x) - 1 dims) that puts a [C] vector on axis 1 of x."""
    if x.rank is not None:
        return b.ints([-1] + [1] * (x.rank - 2))
    rank = b.op.Size(b.shape_of(x))
    ones = b.op.ConstantOfShape(b.unsqueeze(rank - 2, [0]), value=numpy_helper.from_array(np.ones(1, np.int64)))
    return b.op.Concat(b.ints([-1]), ones, axis=0)


def _class_ids(b: Builder, x: Var, labels: Var, column: Var) -> Var:
    """0..C-1 along axis 1 of a tensor of x's rank, as labels' integer type."""
    classes = x.shape[1] if x.rank is not None else None
    if classes is not None:      # a constant of that shape: no Reshape at run time
        return _int_like(b, np.arange(classes).reshape([-1] + [1] * (x.rank - 2)), labels)
    count = b.op.Squeeze(b.shape_of(x, 1, 2))
    ids = b.op.Range(b.const(np.array(0, np.int64)), count, b.const(np.array(1, np.int64)))
    return b.cast_like(b.op.Reshape(ids, column), labels)


def _int_like(b: Builder, value, like: Var) -> Var:
    """An integer constant of like's integer type."""
    if like.dtype is not None:
        return b.const(np.asarray(value), like.dtype)
    return b.cast_like(b.const(np.asarray(value, np.int64)), like)
