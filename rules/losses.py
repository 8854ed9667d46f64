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
    """loss = -sum_c w * x reduced:  dx = -w * g, which is 0 but at each target's class: there
    -weight[label] * g, g = dy (none: per target), dy (sum), dy / sum(w) (mean); scattered into zeros."""
    at, picked = _targets(n)
    return (n.op.ScatterElements(n.b.zeros_like(n.inputs[0]), at, -(picked * _loss_seed(n, picked)), axis=1),)


@register("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(n: Node):
    """logp = LogSoftmax(scores, axis=1), loss = -sum_c w * logp reduced:

    dlogp = dlog_prob - w * g   (g as for NegativeLogLikelihoodLoss),
    dscores = dlogp - softmax * sum_c dlogp,  softmax = exp(logp).

    With the loss alone seeded, sum_c dlogp = -weight[label] * g = -h per target, so
    dscores = softmax * h, less h at the target's class: one tensor of the scores' size where the
    class mask would make five (a language model's logits: 100 MB each).
    """
    log_prob = n.expose_output(1, "log_prob")
    softmax = n.op.Exp(log_prob)
    h = None
    if n.dy is not None:
        at, picked = _targets(n)
        h = picked * _loss_seed(n, picked)            # [N, 1, d...]
    dlog_prob = n.dys[1] if len(n.dys) > 1 else None
    if dlog_prob is None:
        return (_minus_at(n, softmax * h, at, h),)
    dlogp = dlog_prob if h is None else _minus_at(n, dlog_prob, at, h)
    return (dlogp - softmax * n.b.sum(dlogp, [1], keepdims=True),)


def _minus_at(n: Node, x: Var, at: Var, h: Var) -> Var:
    """x with h subtracted at the classes ``at`` (one per target, along axis 1)."""
    return n.op.ScatterElements(x, at, n.op.GatherElements(x, at, axis=1) - h, axis=1)


def _loss_seed(n: Node, picked: Var) -> Var:
    """g: the loss seed as it reaches each target, broadcastable to [N, 1, d...] (no bigger than the loss);
    ``picked`` the targets' weights."""
    reduction = n.attr("reduction", "mean")
    if reduction == "none":
        return n.b.unsqueeze(n.dy, [1])
    if reduction == "sum":
        return n.dy
    return n.dy / n.b.sum(picked, None, keepdims=False)


def _targets(n: Node) -> tuple[Var, Var]:
    """Each target's class as an index along axis 1, [N, 1, d...] (0 for an ignored target), and its weight
    of the same shape: weight[label] (1 without weights), 0 for an ignored target."""
    x, labels = n.inputs[:2]
    b = n.b
    weights, ignore = n.input(2), n.attr("ignore_index")
    ignored = None if ignore is None else b.op.Equal(labels, _int_like(b, ignore, labels))
    safe = labels if ignored is None else b.op.Where(ignored, _int_like(b, 0, labels), labels)
    if weights is not None:
        picked = b.op.Gather(weights, safe, axis=0)
    else:
        picked = b.fill(b.ints(labels.shape) if labels.info.static else b.shape_of(labels), 1.0, x)
    if ignored is not None:
        picked = b.op.Where(ignored, b.scalar(0.0, x), picked)
    return b.unsqueeze(safe, [1]), b.unsqueeze(picked, [1])


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
