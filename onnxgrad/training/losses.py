"""Loss functions appended to a forward model, with PyTorch's semantics and defaults.

Each function takes a forward model, reads one of its outputs (the
predictions), adds a graph input for the target and a graph output for the
loss (a scalar unless ``reduction="none"``), and returns the new model::

    m = losses.cross_entropy(model, output="logits", target="y")   # adds input y (int64), output "loss"
    gm = onnxgrad.grad(m, loss="loss")

The classes (:class:`CrossEntropyLoss`, ...) hold the same options and are
callables ``model -> model``: pass one as ``TrainingSession(model, loss=...)``.
Only standard ai.onnx ops are emitted; class weights and ``pos_weight`` become
Constant nodes (not initializers), so they are never mistaken for parameters.

===================  ===========================================================================
function             loss (before reduction), PyTorch's ``torch.nn.functional`` counterpart
===================  ===========================================================================
``mse_loss``         (x - t)^2                                              ``mse_loss``
``l1_loss``          |x - t|                                                ``l1_loss``
``cross_entropy``    -w[t] log_softmax(x)[t]  (class indices), or
                     -sum_c w_c t_c log_softmax(x)_c  (probabilities)       ``cross_entropy``
``nll_loss``         -w[t] x[t]  (x: log-probabilities)                     ``nll_loss``
``binary_cross_entropy_with_logits``
                     w ((1 - t) x + (1 + (p - 1) t) softplus(-x))           ``binary_cross_entropy_with_logits``
===================  ===========================================================================
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import OnnxGradError, UnknownNameError, arg, spelt
from ..ir import model as M
from ..ir.builder import Builder, Var
from ..ir.load import emitted_ir_version, load
from ..ir.model import NameScope, TensorInfo

__all__ = [
    "Loss",
    "MSELoss",
    "L1Loss",
    "CrossEntropyLoss",
    "NLLLoss",
    "BCEWithLogitsLoss",
    "mse_loss",
    "l1_loss",
    "cross_entropy",
    "nll_loss",
    "binary_cross_entropy_with_logits",
    "LOSSES",
    "LOSS_CLASSES",
    "ClassTarget",
    "LabelError",
    "class_targets",
    "check_labels",
]

REDUCTIONS = ("mean", "sum", "none")
ModelLike = Union[onnx.ModelProto, str, os.PathLike]


CLASS_TARGETS_KEY = "onnxgrad.class_targets"    # model metadata: the inputs that hold class indices (JSON list)


class LossError(OnnxGradError):
    """A loss cannot be appended: bad option, or predictions of a shape or type the loss cannot take."""


class LabelError(OnnxGradError):
    """A class label given to a loss is outside ``[0, C)`` and is not its ``ignore_index``."""


@dataclass(frozen=True)
class ClassTarget:
    """An input of class indices that a loss reads: every label must be in ``[0, classes)`` or ``ignore_index``.

    ``classes`` is None when the predictions' class dimension is not fixed in the model; then only
    negative labels can be told apart from valid ones before a run."""

    target: str
    classes: int | None
    ignore_index: int
    kind: str           # the loss function: cross_entropy, nll_loss
    output: str         # the predictions it reads

    def check(self, labels: np.ndarray, what: str = "") -> None:
        """Raise :class:`LabelError` naming the first label out of bounds, its position and C, as PyTorch's
        "Target 7 is out of bounds." does (an onnxruntime run would fail with "Out of range" or give NaN)."""
        labels = np.asarray(labels)
        if labels.dtype.kind not in "iu":
            return
        bad = (labels < 0) if self.classes is None else ((labels < 0) | (labels >= self.classes))
        bad &= labels != self.ignore_index
        if not bad.any():
            return
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        value = int(labels[where])
        count = int(bad.sum())
        bounds = f"[0, {self.classes})" if self.classes is not None else "[0, C)"
        classes = f"{self.classes} classes" if self.classes is not None else "the classes"
        raise LabelError(f"{what + ': ' if what else ''}target {value} is out of bounds: the label at position "
                         f"{list(where)} of '{self.target}'"
                         + (f" (and {count - 1} more label(s) there)" if count > 1 else "")
                         + f" is neither in {bounds} ({self.kind} over {classes} of '{self.output}') nor "
                         f"ignore_index ({self.ignore_index}); fix the labels, or the model's number of classes")


def class_targets(model: onnx.ModelProto) -> list[ClassTarget]:
    """The class-index inputs that the losses appended by this module to ``model`` read (its metadata)."""
    for p in model.metadata_props:
        if p.key == CLASS_TARGETS_KEY:
            return [ClassTarget(**entry) for entry in json.loads(p.value)]
    return []


def check_labels(targets: Sequence[ClassTarget], feeds: Mapping[str, Any], what: str = "") -> None:
    """Check the labels among ``feeds`` (host arrays) against the losses' class counts before a run."""
    for t in targets:
        if t.target in feeds:
            t.check(np.asarray(feeds[t.target]), what)


# -- the public functions -----------------------------------------------------------------
def mse_loss(model: ModelLike, output: str | None = None, target: str = "target", *,
             reduction: str = "mean", loss: str = "loss") -> onnx.ModelProto:
    """Mean squared error ``(x - t)^2``; the target has the predictions' shape and type."""
    return _Appender(model, output, target, loss, "mse_loss").same_shape_target().finish(
        lambda a, x, t: a.reduce(_square(x - t), reduction), reduction)


def l1_loss(model: ModelLike, output: str | None = None, target: str = "target", *,
            reduction: str = "mean", loss: str = "loss") -> onnx.ModelProto:
    """Mean absolute error ``|x - t|``; the target has the predictions' shape and type."""
    return _Appender(model, output, target, loss, "l1_loss").same_shape_target().finish(
        lambda a, x, t: a.reduce(a.b.op.Abs(x - t), reduction), reduction)


def cross_entropy(model: ModelLike, output: str | None = None, target: str = "target", *,
                  weight: Sequence[float] | np.ndarray | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, probabilities: bool = False,
                  loss: str = "loss") -> onnx.ModelProto:
    """Cross-entropy of unnormalised logits ``x`` of shape (N, C, d1, ...), as ``torch.nn.functional.cross_entropy``.

    ``probabilities=False``: the target holds class indices, int64 of shape (N, d1, ...);
    ``ignore_index`` entries count for nothing (neither in the sum nor in the mean's
    denominator). ``probabilities=True``: the target holds class probabilities of
    the logits' shape and type. ``weight`` (C,) rescales each class; "mean" divides by
    the summed weights of the counted targets (indices) or by N*d1*... (probabilities).
    ``label_smoothing`` mixes the target with the uniform distribution, as PyTorch does.
    """
    _check_smoothing(label_smoothing)
    a = _Appender(model, output, target, loss, "cross_entropy")
    a.need_class_dim()
    w = a.class_weight(weight)
    if probabilities:
        a.same_shape_target()
        if a.unreduced is not None:
            del a.unreduced[1]

        def build(a: _Appender, x: Var, t: Var) -> Var:
            logp = a.b.op.LogSoftmax(x, axis=1)
            if label_smoothing:
                t = t * (1.0 - label_smoothing) + a.per_class(label_smoothing, x)
            per_class = logp * t if w is None else logp * t * a.along_class_dim(w)
            return a.reduce(-a.b.sum(per_class, [1], keepdims=False), reduction)

        return a.finish(build, reduction)

    a.index_target(ignore_index)

    def build(a: _Appender, x: Var, t: Var) -> Var:
        if not label_smoothing:
            return a.b.op.SoftmaxCrossEntropyLoss(x, t, *_given(w), reduction=reduction, ignore_index=ignore_index)
        logp = a.b.op.LogSoftmax(x, axis=1)
        nll = a.b.op.NegativeLogLikelihoodLoss(logp, t, *_given(w), reduction=reduction, ignore_index=ignore_index)
        return nll * (1.0 - label_smoothing) + _smoothing_term(a, logp, t, w, ignore_index, reduction,
                                                              label_smoothing)

    return a.finish(build, reduction)


def nll_loss(model: ModelLike, output: str | None = None, target: str = "target", *,
             weight: Sequence[float] | np.ndarray | None = None, ignore_index: int = -100,
             reduction: str = "mean", loss: str = "loss") -> onnx.ModelProto:
    """Negative log-likelihood of log-probabilities ``x`` (N, C, d1, ...) at int64 class indices (N, d1, ...)."""
    a = _Appender(model, output, target, loss, "nll_loss")
    a.need_class_dim()
    w = a.class_weight(weight)
    a.index_target(ignore_index)
    return a.finish(lambda a, x, t: a.b.op.NegativeLogLikelihoodLoss(
        x, t, *_given(w), reduction=reduction, ignore_index=ignore_index), reduction)


def binary_cross_entropy_with_logits(model: ModelLike, output: str | None = None, target: str = "target", *,
                                     weight: Sequence[float] | np.ndarray | None = None,
                                     pos_weight: Sequence[float] | np.ndarray | None = None,
                                     reduction: str = "mean", loss: str = "loss") -> onnx.ModelProto:
    """Binary cross-entropy of logits ``x`` against probabilities ``t`` (same shape), computed stably.

    ``-[p t log sigmoid(x) + (1 - t) log(1 - sigmoid(x))] = (1 - t) x + (1 + (p - 1) t) softplus(-x)``;
    ``weight`` and ``pos_weight`` (p) broadcast against x as in PyTorch.
    """
    a = _Appender(model, output, target, loss, "binary_cross_entropy_with_logits").same_shape_target()
    w = a.constant(weight, "weight")
    pw = a.constant(pos_weight, "pos_weight")

    def build(a: _Appender, x: Var, t: Var) -> Var:
        softplus = a.b.op.Softplus(-x)                        # -log sigmoid(x), computed stably
        per_element = (1.0 - t) * x + (softplus if pw is None else ((pw - 1.0) * t + 1.0) * softplus)
        return a.reduce(per_element if w is None else per_element * w, reduction)

    return a.finish(build, reduction)


# -- the same as callables, for TrainingSession(model, loss=...) ------------------------------------
class Loss:
    """A loss with its options, applied to a model by calling it: ``CrossEntropyLoss(output="logits")(model)``."""

    fn: Callable[..., onnx.ModelProto]

    def __init__(self, output: str | None = None, target: str = "target", *, loss: str = "loss", **options: Any):
        self.output = output
        self.target = target
        self.name = loss
        self.options = options

    def __call__(self, model: ModelLike) -> onnx.ModelProto:
        return type(self).fn(model, self.output, self.target, loss=self.name, **self.options)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}(output={self.output!r}, target={self.target!r}{opts})"


class MSELoss(Loss):
    """``mse_loss`` as a callable."""
    fn = staticmethod(mse_loss)


class L1Loss(Loss):
    """``l1_loss`` as a callable."""
    fn = staticmethod(l1_loss)


class CrossEntropyLoss(Loss):
    """``cross_entropy`` as a callable."""
    fn = staticmethod(cross_entropy)


class NLLLoss(Loss):
    """``nll_loss`` as a callable."""
    fn = staticmethod(nll_loss)


class BCEWithLogitsLoss(Loss):
    """``binary_cross_entropy_with_logits`` as a callable."""
    fn = staticmethod(binary_cross_entropy_with_logits)


# Short names, as the command line spells them.
LOSSES: dict[str, Callable[..., onnx.ModelProto]] = {
    "mse": mse_loss,
    "l1": l1_loss,
    "cross_entropy": cross_entropy,
    "nll": nll_loss,
    "bce_with_logits": binary_cross_entropy_with_logits,
}


# -- helpers ----------------------------------------------------------------------------------
def _square(d: Var) -> Var:
    return d * d


def _given(w: Var | None) -> list[Var]:
    """An optional last input: present, or left out (not an empty name)."""
    return [] if w is None else [w]


def _check_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise LossError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def _smoothing_term(a: "_Appender", logp: Var, t: Var, w: Var | None, ignore_index: int, reduction: str,
                    label_smoothing: float) -> Var:
    """PyTorch's ``(eps / C) * smooth`` with ``smooth = -sum_c w_c logp_c`` per counted target, reduced.

    "mean" divides by the summed weights of the counted targets, as the NLL term does.
    """
    b = a.b
    per_class = logp if w is None else logp * a.along_class_dim(w)
    ignored = b.op.Equal(t, b.const(np.array(ignore_index, np.int64)))
    zero = b.scalar(0.0, logp)
    smooth = b.op.Where(ignored, zero, -b.sum(per_class, [1], keepdims=False))
    if reduction == "none":
        total = smooth
    else:
        total = b.sum(smooth, None, keepdims=False)
    if reduction == "mean":
        counted = b.op.Cast(b.op.Not(ignored), to=a.dtype)
        if w is not None:
            safe = b.op.Where(ignored, b.const(np.array(0, np.int64)), t)
            counted = counted * b.op.Gather(w, safe, axis=0)
        total = total / b.sum(counted, None, keepdims=False)
    return total * a.per_class(label_smoothing, logp)


class _Appender:
    """Appends one loss to a copy of the model: target input, loss nodes, loss output."""

    def __init__(self, model: ModelLike, output: str | None, target: str, loss: str, kind: str):
        self.kind = kind
        self.model = load(model)
        g = self.model.graph
        infos, types = M.tensor_infos(M.infer(self.model))
        outputs = [o.name for o in g.output]
        if output is None:
            if len(outputs) != 1:
                raise UnknownNameError(f"{kind}: the model has {len(outputs)} outputs ({', '.join(outputs)}); "
                                       f"name the predictions with {arg('output')}")
            output = outputs[0]
        if output not in outputs:
            raise UnknownNameError(f"{kind}: output '{output}' is not an output of the model "
                                   f"(outputs: {', '.join(outputs)})")
        taken = ({i.name for i in g.input} | {i.name for i in g.initializer} | set(outputs)
                 | {o for n in g.node for o in n.output} | {n.name for n in g.node})
        way_out = {"target": f"choose another with {arg('target')}",
                   # --loss-fn always names its output 'loss'
                   "loss": spelt("choose another with loss=", "rename that tensor of the model (--loss-fn names "
                                 "its output 'loss')")}
        for name, what in ((target, "target"), (loss, "loss")):
            if name in taken:
                raise UnknownNameError(f"{kind}: the {what} name '{name}' is already a tensor of the model; "
                                       + way_out[what])
        if target == loss:
            raise UnknownNameError(f"{kind}: target and loss are both named '{target}'")
        self.x_type = types.get(output)
        info = infos.get(output) or TensorInfo()
        if info.dtype is not None and info.dtype not in M.FLOAT_TYPES:
            raise LossError(f"{kind}: output '{output}' is a {helper.tensor_dtype_to_string(info.dtype)} tensor; "
                            "a loss needs floating-point predictions")
        self.dtype = info.dtype or TensorProto.FLOAT
        infos[output] = TensorInfo(self.dtype, info.shape)
        self.shape = info.shape
        self.output, self.target, self.loss = output, target, loss
        self.b = Builder(M.opset_of(self.model), NameScope(taken | {target, loss}), infos,
                         prefix=f"{loss}/{kind}", doc=f"{kind} of '{output}' against '{target}'")
        self.target_vi: onnx.ValueInfoProto | None = None
        self.unreduced: list | None = None   # dims of the loss under reduction="none"
        self.class_target: ClassTarget | None = None

    # -- the target input ------------------------------------------------------------------
    def same_shape_target(self) -> "_Appender":
        vi = onnx.ValueInfoProto(name=self.target)
        if self.x_type is not None and self.x_type.HasField("tensor_type"):
            vi.type.CopyFrom(self.x_type)
        else:
            vi.CopyFrom(helper.make_tensor_value_info(self.target, self.dtype, None))
        vi.type.tensor_type.elem_type = self.dtype
        self.target_vi = vi
        self.b.infos[self.target] = TensorInfo(self.dtype, self.shape)
        self.unreduced = _dims(vi)
        return self

    def index_target(self, ignore_index: int) -> "_Appender":
        """int64 class indices: the predictions' shape without the class dimension (dim 1); recorded in the
        metadata with C and ``ignore_index``, so that labels can be checked before a run (:func:`check_labels`)."""
        self.class_target = ClassTarget(self.target, self.n_classes(), int(ignore_index), self.kind, self.output)
        vi = helper.make_tensor_value_info(self.target, TensorProto.INT64, None)
        shape = None
        if self.x_type is not None and self.x_type.tensor_type.HasField("shape"):
            dims = list(self.x_type.tensor_type.shape.dim)
            del dims[1]
            for d in dims:
                vi.type.tensor_type.shape.dim.add().CopyFrom(d)
            shape = tuple(self.shape[:1]) + tuple(self.shape[2:])
        self.target_vi = vi
        self.b.infos[self.target] = TensorInfo(TensorProto.INT64, shape)
        self.unreduced = _dims(vi)
        return self

    # -- class dimension and constants ------------------------------------------------------
    def need_class_dim(self) -> None:
        if self.shape is not None and len(self.shape) < 2:
            raise LossError(f"{self.kind}: output '{self.output}' has shape {list(self.shape)}; predictions "
                            "must be (N, C) or (N, C, d1, ...): add a batch dimension")

    def n_classes(self) -> int | None:
        return self.shape[1] if self.shape is not None and len(self.shape) > 1 else None

    def constant(self, value, what: str) -> Var | None:
        if value is None:
            return None
        arr = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(self.dtype))
        return self.b.const(arr, self.dtype)

    def class_weight(self, weight) -> Var | None:
        if weight is None:
            return None
        arr = np.asarray(weight)
        c = self.n_classes()
        if arr.ndim != 1 or (c is not None and arr.shape[0] != c):
            raise LossError(f"{self.kind}: weight must have one entry per class ({c}), got shape {list(arr.shape)}")
        return self.constant(arr, "weight")

    def along_class_dim(self, w: Var) -> Var:
        """The (C,) weight shaped (C, 1, ..., 1) to broadcast over dims 1.. of the predictions."""
        if self.shape is None:
            raise LossError(f"{self.kind}: class weights with probability targets need the rank of "
                            f"'{self.output}'; give the model's output a shape")
        extra = len(self.shape) - 2
        return w if extra == 0 else self.b.unsqueeze(w, list(range(1, 1 + extra)))

    def per_class(self, value: float, like: Var) -> Var:
        """value / C, as a scalar of the predictions' type (C read from the shape at run time if unknown)."""
        c = self.n_classes()
        if c is not None:
            return self.b.scalar(value / c, like)
        c_dyn = self.b.op.Cast(self.b.squeeze(self.b.shape_of(like, 1, 2), [0]), to=self.dtype)
        return self.b.scalar(value, like) / c_dyn

    # -- reduction and the result -------------------------------------------------------------
    def reduce(self, per_element: Var, reduction: str) -> Var:
        if reduction == "none":
            return per_element
        return self.b.reduce("ReduceMean" if reduction == "mean" else "ReduceSum", per_element, None,
                             keepdims=False)

    def finish(self, build: Callable[["_Appender", Var, Var], Var], reduction: str) -> onnx.ModelProto:
        if reduction not in REDUCTIONS:
            raise LossError(f"{self.kind}: reduction must be one of {', '.join(REDUCTIONS)}, got '{reduction}'")
        assert self.target_vi is not None
        b = self.b
        value = build(self, b.var(self.output), b.var(self.target))
        b.name_as(value, self.loss)
        nodes = b.nodes
        g = self.model.graph
        g.node.extend(nodes)
        g.input.append(self.target_vi)
        if reduction == "none":
            vi = helper.make_tensor_value_info(self.loss, self.dtype, None)
            if self.unreduced is not None:
                dims = vi.type.tensor_type.shape.dim
                for d in self.unreduced:
                    dims.add().CopyFrom(d)
            g.output.append(vi)
        else:
            g.output.append(helper.make_tensor_value_info(self.loss, self.dtype, []))
        if self.class_target is not None:
            recorded = [asdict(t) for t in class_targets(self.model)] + [asdict(self.class_target)]
            M.set_metadata(self.model, {CLASS_TARGETS_KEY: json.dumps(recorded)})
        self.model.ir_version = emitted_ir_version(self.model)
        return self.model


def _dims(vi: onnx.ValueInfoProto) -> list | None:
    tt = vi.type.tensor_type
    return list(tt.shape.dim) if tt.HasField("shape") else None


LOSS_CLASSES: dict[str, type[Loss]] = {
    "mse": MSELoss,
    "l1": L1Loss,
    "cross_entropy": CrossEntropyLoss,
    "nll": NLLLoss,
    "bce_with_logits": BCEWithLogitsLoss,
}
