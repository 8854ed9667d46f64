"""Tangents of softmax, pooling, normalization, dropout and the cross-entropy loss."""
from __future__ import annotations

from onnx import TensorProto

from onnxgrad.ir.builder import Var, total
from onnxgrad.ir.model import TensorInfo, float_bits

from .base import TNode, defjvp, linear_tangent


def _axis(t: TNode, default: int) -> int:
    return int(t.attr("axis", default))


@defjvp("Softmax")
def softmax(t: TNode):
    """d softmax(x) = y * (dx - sum(y * dx, axis))"""
    if t.opset < 13:
        return NotImplemented           # softmax over a 2-D coercion: the fallback handles it
    y = t.outputs[0]
    return y * (t.dx - t.b.sum(y * t.dx, [_axis(t, -1)]))


@defjvp("LogSoftmax")
def log_softmax(t: TNode):
    """d log_softmax(x) = dx - sum(exp(y) * dx, axis)"""
    if t.opset < 13:
        return NotImplemented
    y = t.outputs[0]
    return t.dx - t.b.sum(t.op.Exp(y) * t.dx, [_axis(t, -1)])


@defjvp("MaxPool")
def max_pool(t: TNode):
    """y[o] = x.flat[i(o)], i(o) the argmax of window o (the Indices output):  dy[o] = dx.flat[i(o)]"""
    if t.attr("storage_order", 0) == 1:
        return NotImplemented           # column-major indices: the fallback recomputes row-major ones
    indices = t.expose_output(1, "indices")
    if indices.dtype is None:
        t.b.infos[indices.name] = TensorInfo(TensorProto.INT64, None)
    flat = t.op.Reshape(t.dx, t.b.ints([-1]))
    return t.op.Gather(flat, indices, axis=0), None


def _per_channel(t: TNode, p: Var, rank: int) -> Var:
    """A per-channel vector [C] shaped [C, 1, ..., 1] to broadcast against [N, C, d1, ...]."""
    return t.b.unsqueeze(p, list(range(1, rank - 1))) if rank > 2 else p


@defjvp("BatchNormalization")
def batch_normalization(t: TNode):
    """inference: y = s * xh + b,  xh = (x - m) * r,  r = (v + eps)^-1/2:
    d y = s * r * (dx - dm) + ds * xh + db - s * xh * r^2 * dv / 2   (per channel, axis 1)
    """
    training = int(t.attr("training_mode", 0))
    if training or any(o for o in t.proto.output[1:]):
        return NotImplemented           # batch statistics: the fallback transposes the reverse rule
    x, s, _, m, v = t.inputs[:5]
    if x.rank is None:
        return NotImplemented
    dx, ds, db, dm, dv = (t.tangent(i) for i in range(5))
    ch = lambda p: _per_channel(t, p, x.rank)  # noqa: E731
    r = ch(t.op.Reciprocal(t.op.Sqrt(v + float(t.attr("epsilon", 1e-5)))))
    xh = (x - ch(m)) * r
    sc = ch(s)
    centred = total(dx, -ch(dm) if dm is not None else None)
    terms = [sc * r * centred if centred is not None else None,
             ch(ds) * xh if ds is not None else None,
             -(sc * xh * (r * r) * ch(dv * 0.5)) if dv is not None else None]
    out = total(*terms, t.like_output(ch(db)) if db is not None else None)
    return t.like_output(out)


@defjvp("LayerNormalization")
def layer_normalization(t: TNode):
    """y = xh * s + b,  xh = (x - mu) * r,  mu, r = the Mean and InvStdDev over axes a..rank-1:
    d xh = r * (dx - mean(dx) - xh * mean(xh * dx));   d y = d xh * s + xh * ds + db
    d mu = mean(dx);   d r = -r^2 * mean(xh * dx)
    mu and r are the node's Mean and InvStdDev outputs, unless they are stored in fewer bits than x (a float64
    x with the default float32 stash_type: y is computed from statistics in x's precision, the outputs are
    rounded): then they are computed again from x, r = (mean((x - mu)^2) + epsilon)^-1/2.
    """
    x, s = t.inputs[:2]
    if x.rank is None:
        return NotImplemented
    dx, ds, db = t.tangent(0), t.tangent(1), t.tangent(2)
    wanted = [k < len(t.proto.output) and bool(t.proto.output[k]) for k in range(3)]
    axes = list(range(_axis(t, -1) % x.rank, x.rank))
    stash = int(t.attr("stash_type", TensorProto.FLOAT))
    if float_bits(stash) < float_bits(x.dtype):
        mu = t.b.reduce("ReduceMean", x, axes)
        centred = x - mu
        r = t.op.Reciprocal(t.op.Sqrt(t.b.reduce("ReduceMean", centred * centred, axes) + t.attr("epsilon", 1e-5)))
        stats = [t.outputs[k] if wanted[k] else None for k in (1, 2)]
    else:
        stats = []
        for k, hint in ((1, "Mean"), (2, "InvStdDev")):
            v = t.expose_output(k, hint)
            if v.dtype is None:
                t.b.infos[v.name] = TensorInfo(stash, None)
            stats.append(v)
        mu, r = (t.b.cast_like(v, x) for v in stats)
    xh = (x - mu) * r
    dy = d_mu = d_r = None
    if dx is not None:
        d_mu = t.b.reduce("ReduceMean", dx, axes)
        xh_dx = t.b.reduce("ReduceMean", xh * dx, axes)
        dy = (r * (dx - d_mu - xh * xh_dx)) * s
        d_r = -(r * r) * xh_dx
    dy = total(dy, xh * ds if ds is not None else None, t.like_output(db) if db is not None else None)
    tangents = [t.like_output(dy) if dy is not None else None]
    for k, d in ((1, d_mu), (2, d_r)):
        tangents.append(t.b.cast_like(d, stats[k - 1]) if wanted[k] and d is not None else None)
    return tangents


@defjvp("Dropout")
def dropout(t: TNode):
    """inference (training_mode absent or false): d y = dx"""
    flag = t.const_value(2) if t.input(2) is not None else None
    if t.input(2) is not None and (flag is None or bool(flag.reshape(-1)[0])):
        return NotImplemented           # training: the fallback scales by the forward's mask
    return t.dx, None


@defjvp("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(t: TNode):
    """loss = NLL(log_softmax(s, axis=1), labels, w): linear in log_prob, so
    d log_prob = ds - sum(exp(log_prob) * ds, axis=1);   d loss = NLL(d log_prob, labels, w)  (same attributes)
    """
    had_log_prob = len(t.proto.output) > 1 and bool(t.proto.output[1])
    log_prob = t.expose_output(1, "log_prob", like=t.inputs[0])
    d_log_prob = t.dx - t.b.sum(t.op.Exp(log_prob) * t.dx, [1])
    args = [d_log_prob, t.inputs[1]] + ([t.input(2)] if t.input(2) is not None else [])
    d_loss = t.b.emit("NegativeLogLikelihoodLoss", args)
    t.b.nodes[-1].attribute.extend(a for a in t.proto.attribute if a.name in ("reduction", "ignore_index"))
    return d_loss, (d_log_prob if had_log_prob else None)


@defjvp("RoiAlign")
def roi_align(t: TNode):
    """mode avg: linear in X (the bilinear sampling weights depend on the rois alone):
    d RoiAlign(X, rois, batch) = RoiAlign(dX, rois, batch). (Below opset 16 the reverse rule's dense
    form has MatMuls of unknown rank that the fallback could not differentiate.)"""
    if t.attr("mode", "avg") != "avg":
        return NotImplemented           # max of samples: the fallback transposes the reverse rule
    return linear_tangent(t)


@defjvp("ReduceL2")
def reduce_l2(t: TNode):
    """y = sqrt(sum_g x^2):  dy = sum_g(x * dx) / y   (0 where y == 0, as torch.norm's jvp; the fallback's
    double VJP differentiates the reverse rule's masked division and gives 0 * (1/0) = NaN there)"""
    from ..reduce import _Reduction

    r = _Reduction(t)
    x, y = t.inputs[0], t.outputs[0]
    prod = x * t.dx
    if r.kind == "none":
        s = prod
    elif r.kind == "dynamic":
        s = t.b.emit("ReduceSum", [prod, r.axes], keepdims=int(r.keepdims), noop_with_empty_axes=int(r.noop))
    else:
        s = t.b.reduce("ReduceSum", prod, r.axes if r.kind == "axes" else None, keepdims=r.keepdims)
    zero, one = t.b.scalar(0.0, y), t.b.scalar(1.0, y)
    at_zero = t.op.Equal(y, zero)
    return t.op.Where(at_zero, zero, s / t.op.Where(at_zero, one, y))
