"""Training graphs for stock onnxruntime: forward + loss + backward + optimizer update in one model.

:func:`build` turns a model with a scalar loss (or a forward model and a loss
from :mod:`onnxgrad.losses`) into

- ``train``: one run does forward, loss, backward, (accumulation, clipping) and
  the optimizer update. Inputs: the data inputs, ``lr`` (float32 scalar),
  ``step`` (int64 scalar, 1 for the first update), every trainable parameter
  under its own name, and the optimizer state ``<param>.<state>``. Outputs:
  ``loss``, ``finite`` (bool: loss and gradients are all finite), ``grad_norm``
  (global L2 norm of the gradients, before clipping), ``<param>.next``,
  ``<param>.<state>.next`` and ``step.next`` (``step + 1``; ``step`` when a guarded
  update was not applied): feed every ``<name>.next`` back as ``<name>``.
- ``eval``: the forward outputs, with the trainable parameters as inputs.
- ``accumulate`` (``accumulation_steps > 1``): forward + backward of one
  micro-batch, adding its gradients to ``<param>.grad_acc`` (``.next`` out).
  ``train`` then also takes the accumulators and applies their mean with the
  last micro-batch's gradients.

With ``split=True`` the step is also built in two graphs for data parallelism
(:class:`SplitStep`): ``backward`` writes every gradient, weighted by the
micro-batch's sample count, into flat buffers (one per element type), the
workers sum them, and ``update`` divides by the summed count, checks
finiteness, clips and applies the optimizer as ``train`` does.

With ``defaults=True`` (the command line's choice) the parameters and the
initial optimizer state are also stored as initializers of the same names, so
a first step needs only data, ``lr`` and ``step``; and ``guard=True`` makes the
graph itself keep the old values when ``finite`` is false. Every name is also
recorded in the model's metadata (``onnxgrad.training``, JSON) and in the
inputs' and outputs' doc strings. :class:`onnxgrad.TrainingSession` uses the
same builder.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ExportFoldedError, ExportWarning, OnnxGradError, UnknownNameError, arg
from ..ir import graph as G
from ..ir import model as M
from ..ir.builder import Builder, Var
from ..ir.files import HELD, copy_model, is_held, stripped
from ..ir.load import emitted_ir_version, parse
from ..ir.model import NameScope, TensorInfo
from ..passes.autodiff import grad
from ..passes.optimize.broadcast import scalars_at_rank
from ..passes.optimize.guard import guard_as_where
from ..passes.params import ParameterReport, parameters_of, restore_ties
from ..passes.reach import Objective
from ..passes.record import gradient_spec
from .losses import CLASS_TARGETS_KEY
from .optim import AdamW, Optimizer, UpdateContext
from .train_mode import to_eval_mode, to_train_mode

__all__ = ["TrainingSpec", "TrainingArtifacts", "SplitStep", "Bucket", "build", "in_place", "META_KEY"]

META_KEY = "onnxgrad.training"
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6)


@dataclass
class TrainingSpec:
    """The names in the training graphs and the options they were built with (JSON in the metadata)."""

    loss: str
    lr: str
    step: str
    finite: str
    grad_norm: str
    data_inputs: list[str]
    params: dict[str, str]                       # parameter (input) -> updated (output)
    state: dict[str, dict[str, list[str]]]       # parameter -> state -> [input, output]
    accumulators: dict[str, list[str]]           # parameter -> [input, output] (accumulation only)
    frozen: list[str]
    optimizer: dict[str, Any]
    clip_grad_norm: float | None = None
    accumulation_steps: int = 1
    guard: bool = True
    eval_outputs: list[str] = field(default_factory=list)
    buffers: dict[str, list[str]] = field(default_factory=dict)    # running statistic -> [input, output]
    train_mode: bool = False
    grads: dict[str, str] = field(default_factory=dict)            # parameter -> gradient output (keep_grads)
    recompute: bool = False                      # the backward recomputes activations (onnxgrad.passes.recompute)
    # parameter -> state -> factor: the graph holds PyTorch's value times it (optim.Optimizer.state_scale)
    state_scale: dict[str, dict[str, float]] = field(default_factory=dict)
    step_next: str = ""                          # the output to feed back as ``step`` (empty: accumulation)
    target: str = ""                             # the runtime the graphs were written for ("": canonical)
    # target "webgpu": the schedule model's inputs (lr, step) and outputs (inputs of the training model)
    schedule: dict[str, list[str]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TrainingSpec":
        return cls(**json.loads(text))

    @classmethod
    def of(cls, model: onnx.ModelProto) -> "TrainingSpec":
        """The spec stored in a training model built here."""
        for p in model.metadata_props:
            if p.key == META_KEY:
                return cls.from_json(p.value)
        raise OnnxGradError(f"the model has no '{META_KEY}' metadata: it was not built by onnxgrad.artifacts")


@dataclass
class Bucket:
    """One flat gradient buffer of the split step: every gradient of one element type, end to end."""

    name: str                       # output of ``backward``, input of ``update``
    dtype: int                      # TensorProto element type
    size: int                       # elements
    params: dict[str, list[int]]    # parameter -> [offset, elements]
    acc: str = ""                   # the accumulator input of ``backward`` (accumulation_steps > 1)


@dataclass
class SplitStep:
    """The training step in two graphs, for data parallelism: the all-reduce runs between them.

    ``backward``: forward, loss and backward of this worker's (micro-)batch. Inputs: the data, the
    parameters, the running statistics, ``weight`` (float32 scalar: the number of samples of this
    micro-batch) and, with accumulation, each bucket's running sum ``<bucket>.acc``. Outputs: the local
    loss, one flat buffer per bucket holding ``weight * gradient`` of every parameter end to end (plus the
    accumulator), the float32 bucket ending with ``[weight * loss, weight]`` at ``stats``, and the
    running statistics ``<r>.next``. ``update``: reads the buckets summed over the workers, divides by the
    summed weight (the global mean over every sample of every worker and micro-batch), then checks
    finiteness, clips and applies the optimizer as the fused graph does. ``spec`` holds the update graph's
    names, with the backward graph's ``data_inputs`` and ``buffers``.
    """

    backward: onnx.ModelProto
    update: onnx.ModelProto
    spec: TrainingSpec
    weight: str
    buckets: list[Bucket]
    stats: int                      # offset of [weight * loss, weight] in the float32 bucket
    local_loss: str                 # the backward graph's loss output


@dataclass
class TrainingArtifacts:
    train: onnx.ModelProto
    eval: onnx.ModelProto
    accumulate: onnx.ModelProto | None
    loss_model: onnx.ModelProto       # forward + loss, parameters as initializers (inference mode)
    forward: onnx.ModelProto          # forward outputs only, parameters as initializers (inference mode)
    spec: TrainingSpec
    initial_params: dict[str, np.ndarray]
    initial_state: dict[str, dict[str, np.ndarray]]
    report: ParameterReport | None = None          # every float initializer and why it trains or not
    initial_buffers: dict[str, np.ndarray] = field(default_factory=dict)
    split: SplitStep | None = None                 # build(split=True): the step in two graphs (data parallel)
    schedule: onnx.ModelProto | None = None        # target "webgpu": the step's scalars, for the CPU

    def eval_with_loss(self, defaults: bool = False) -> onnx.ModelProto:
        """Forward outputs and the loss, trainable parameters and buffers as inputs (validation loss)."""
        return _params_as_inputs(self.loss_model, list(self.spec.params) + list(self.spec.buffers), defaults)

    def initial_values(self) -> dict[str, np.ndarray]:
        """Every state input of the training graph (parameters, running statistics, optimizer state,
        accumulators, ``lr``, ``step``) with its value before the first step."""
        spec = self.spec
        values: dict[str, np.ndarray] = dict(self.initial_params)
        values.update(self.initial_buffers)
        for p, states in self.initial_state.items():
            for s, v in states.items():
                values[spec.state[p][s][0]] = v
        for p, (i, _) in spec.accumulators.items():
            values[i] = np.zeros(self.initial_params[p].shape, self.initial_params[p].dtype)
        if spec.lr:
            values[spec.lr] = np.array(spec.optimizer["lr"], np.float32)
            graphs = [self.train.graph] + ([self.schedule.graph] if self.schedule is not None else [])
            step = next(i for g in graphs for i in g.input if i.name == spec.step)
            values[spec.step] = np.array(1, helper.tensor_dtype_to_np_dtype(step.type.tensor_type.elem_type))
        return values

    def save_state(self, path: str | os.PathLike) -> None:
        """Write the state file of docs/artifacts.md: every state input's value before the first step (the
        accumulators start from zeros and are left out), the spec, and the fingerprint of the model."""
        from . import state

        accumulators = {i for i, _ in self.spec.accumulators.values()}
        values = {k: v for k, v in self.initial_values().items() if k not in accumulators}
        trained = [*self.spec.params, *self.spec.buffers]
        state.write(path, values, {"training": self.spec.to_json(),
                                   "model_sha256": state.fingerprint(self.loss_model, trained)})


def build(
    model: onnx.ModelProto | str | os.PathLike,
    loss: "str | Callable[[onnx.ModelProto], onnx.ModelProto]" = "loss",
    optimizer: Optimizer | None = None,
    *,
    frozen: Iterable[str] = (),
    trainable: Sequence[str] | None = None,
    clip_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    guard: bool = True,
    defaults: bool = False,
    train_mode: bool = True,
    keep_grads: bool = False,
    strict_tags: bool = False,
    split: bool = False,
    target: str | None = None,
    recompute: bool = False,
) -> TrainingArtifacts:
    """Build the training, eval (and accumulation) models.

    ``loss``: the name of a scalar float output of ``model``, or a loss from
    :mod:`onnxgrad.losses` (``losses.CrossEntropyLoss(output="logits", target="y")``)
    appended to the forward ``model``. Trained: the parameters :func:`onnxgrad.parameters`
    finds (PyTorch's parameters as they appear in the graph), minus ``frozen``; or exactly
    ``trainable``. ``train_mode``: BatchNormalization on batch statistics with its running
    statistics updated, Dropout active, as ``model.train()``; False keeps the exported
    eval-mode graph (frozen-BN fine-tuning). ``defaults``: store the initial values as
    initializers of the same names as the inputs (overridable defaults); without it every
    parameter, buffer and state tensor is a required input and
    :meth:`TrainingArtifacts.initial_values` holds their starting values. ``split``: also build the
    step as two graphs with the gradient reduction between them (:class:`SplitStep`, data parallelism).
    ``target``: the runtime the backward is rewritten for (:func:`onnxgrad.grad`'s; None: the canonical
    adjoints); ``"webgpu"`` rewrites the whole training graph for onnxruntime-web's WebGPU providers
    (:func:`onnxgrad.passes.optimize.webgpu.for_webgpu`: ``step`` int32, class labels int32, the step's float64
    scalars in :attr:`TrainingArtifacts.schedule`). ``recompute``: the backward computes cheap activations again
    rather than keeping them (:func:`onnxgrad.grad`'s; run the models with
    :data:`onnxgrad.passes.recompute.ORT_DISABLED_OPTIMIZERS` off).
    """
    optimizer = optimizer if optimizer is not None else AdamW()
    if not isinstance(optimizer, Optimizer):
        raise OnnxGradError(f"optimizer must be an onnxgrad.optim optimizer, got {type(optimizer).__name__}")
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise OnnxGradError(f"accumulation_steps must be a positive integer, got {accumulation_steps}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise OnnxGradError(f"clip_grad_norm must be positive, got {clip_grad_norm}")
    if target == "webgpu" and split:
        raise OnnxGradError("the webgpu target trains in one process: build it without split (data parallelism "
                            "runs on the cpu and cuda targets)")
    forward_in = to_eval_mode(parse(model))    # loaded and validated once (and not kept: eval mode is a copy)
    if callable(loss):
        loss_model = parse(loss(forward_in.proto))      # the loss's nodes appended, validated
        loss_name = getattr(loss, "name", "loss")
        forward = forward_in
    elif isinstance(loss, str):
        loss_model = forward_in
        loss_name = loss
        forward = None
    else:
        raise OnnxGradError(f"loss must be an output name or a loss from onnxgrad.losses, got {type(loss).__name__}")
    objective = Objective(loss_model, None, loss_name, strict_tags)     # the loss checked: a scalar float output
    frozen = list(dict.fromkeys(frozen))
    report = parameters_of(objective, frozen)
    _say_findings(report, train_mode)
    params = _chosen(report, trainable, frozen) if trainable is not None else report.trainable
    # tensors merged by value get their own again; tied copies are computed from the parameter they copy
    loss_model = loss_model.edited(restore_ties(loss_model.proto, report, ties=trainable is None))
    if forward is not None:
        forward = forward.edited(restore_ties(forward.proto, report, ties=trainable is None))
    if not params:
        left = "; ".join(p.line(None) for p in report.left_out[:5]) + (
            f" and {len(report.left_out) - 5} more" if len(report.left_out) > 5 else "")
        raise OnnxGradError(f"nothing to train: no float initializer of the model is a trainable parameter for "
                            f"loss '{loss_name}'; name the tensors to train with {arg('trainable', '...')}"
                            + (f" (left out: {left})" if left else ""))
    if forward is None:
        forward = G.pruned(loss_model, [o for o in loss_model.output_names if o != loss_name] or [loss_name])
    running: dict[str, str] = {}
    # What is differentiated needs the parameters' types and shapes, not their values (graph analyses read
    # constants of at most 4096 elements): their initializers carry a placeholder (HELD), so that each copy
    # that train mode, the gradient pass and the rewrites make is without the weights. Built field by field,
    # so the weights are not copied either (a 64 MB weight's build peaked at 402 MB). The training graph's
    # inputs take the parameters' values from the loss model (_Builder.initial).
    held = set(params)
    differentiated = loss_model.edited(stripped(loss_model.proto, lambda t: HELD if t.name in held else None))
    if train_mode:
        tm = to_train_mode(differentiated)
        differentiated, running = differentiated.edited(tm.model), tm.running
    gm = grad(differentiated, wrt=params, loss=loss_name, strict_tags=strict_tags, target=target,
              recompute=recompute)
    step_dtype = TensorProto.INT32 if target == "webgpu" else TensorProto.INT64     # WebGPU holds no int64
    art = _Builder(loss_model.proto, forward.proto, gm, loss_name, params, frozen, optimizer, clip_grad_norm,
                   int(accumulation_steps), guard, defaults, running, keep_grads, report, train_mode,
                   step_dtype, target).run(split)
    if target == "cuda":        # the update's guard on the GPU: onnxruntime reads an If's condition on the host
        art.train = guard_as_where(art.train, art.spec.finite)[0]
        if art.split is not None:
            art.split.update = guard_as_where(art.split.update, art.split.spec.finite)[0]
    if target == "webgpu":
        _for_webgpu(art)
    art.spec.target = target or ""
    for m in (art.train, art.eval, art.accumulate, art.schedule):
        if m is not None:
            _set_meta(m, art.spec)
            m.ir_version = emitted_ir_version(m)        # a version every runtime we target loads
    return art


def _for_webgpu(art: TrainingArtifacts) -> None:
    """The training, accumulation and eval graphs rewritten for the WebGPU providers (the gradient already is):
    the training builder's nodes too, labels as int32, no Identity, the step's scalars in the schedule model."""
    from ..passes.optimize import rewrites_for, webgpu

    rewrites = rewrites_for("webgpu")
    spec = art.spec
    art.train, schedule, _, retyped = webgpu.for_webgpu(art.train, rewrites, finite=spec.finite,
                                                         schedule_inputs=[spec.lr, spec.step],
                                                         data_inputs=spec.data_inputs)
    if schedule is not None:
        art.schedule = schedule.model
        spec.schedule = {"inputs": schedule.inputs, "outputs": schedule.outputs}
    if art.accumulate is not None:
        art.accumulate, _, _, _ = webgpu.for_webgpu(art.accumulate, rewrites, finite=spec.finite,
                                                    schedule_inputs=[], data_inputs=retyped)
    art.eval = webgpu.eval_for_webgpu(art.eval, rewrites, data_inputs=spec.data_inputs)


def _say_findings(report: ParameterReport, train_mode: bool) -> None:
    """Before anything is built: refuse what cannot train as PyTorch's ``model.train()`` would, and warn
    about every other thing the exporter did that makes training differ from PyTorch's."""
    refused = [f for f in report.findings if f.refused_in_train_mode and train_mode]
    if refused:
        raise ExportFoldedError("cannot train as PyTorch would: " + "; and ".join(f.message for f in refused))
    for f in report.findings:
        warnings.warn(f"training will differ from PyTorch's: {f.message}", ExportWarning, stacklevel=3)


def _chosen(report: ParameterReport, trainable: Sequence[str], frozen: Sequence[str]) -> list[str]:
    """An explicit list of tensors to train: float initializers, minus the frozen ones."""
    names = list(dict.fromkeys([trainable] if isinstance(trainable, str) else trainable))
    unknown = [n for n in names if n not in report]
    if unknown:
        raise UnknownNameError(f"trainable name(s) {', '.join(map(repr, unknown))} are not float initializers "
                               "of the model")
    return [n for n in names if n not in set(frozen)]


# -- the builder --------------------------------------------------------------------------------
class _Builder:
    def __init__(self, loss_model, forward, gm, loss, params, frozen, optimizer, clip, accumulation, guard,
                 defaults, running, keep_grads, report, train_mode, step_dtype=TensorProto.INT64, target=None):
        self.loss_model, self.forward, self.gm = loss_model, forward, gm
        self.loss, self.params, self.frozen = loss, params, frozen
        self.optimizer, self.clip, self.k = optimizer, clip, accumulation
        self.guard, self.defaults = guard, defaults
        self.running, self.keep_grads, self.report, self.train_mode = running, keep_grads, report, train_mode
        self.step_dtype, self.target = step_dtype, target
        inits = {i.name: i for i in loss_model.graph.initializer}
        self.initial = {p: numpy_helper.to_array(inits[p]) for p in params}
        self.initial_buffers = {r: numpy_helper.to_array(inits[r]) for r in running}
        self.dtypes = {p: inits[p].data_type for p in list(params) + list(running)}
        self.shapes = {p: tuple(inits[p].dims) for p in list(params) + list(running)}
        self.torch_names = {p.name: p.torch_name for p in report} if report is not None else {}
        self.gradients = gradient_spec(gm)["gradients"]
        self.recompute = any(p.key == "onnxgrad.recomputed" for p in gm.metadata_props)
        loss_vi = next(o for o in gm.graph.output if o.name == loss)
        self.loss_dtype = loss_vi.type.tensor_type.elem_type or TensorProto.FLOAT

    def run(self, split: bool = False) -> TrainingArtifacts:
        train, spec = self._model(accumulate=False)
        accumulate = None
        if self.k > 1:
            accumulate, acc_spec = self._model(accumulate=True)
            assert [i for i, _ in acc_spec.accumulators.values()] == [i for i, _ in spec.accumulators.values()]
            spec.accumulators = acc_spec.accumulators
        spec.eval_outputs = [o.name for o in self.forward.graph.output]
        _set_meta(train, spec)
        if accumulate is not None:
            _set_meta(accumulate, spec)
        eval_model = _params_as_inputs(self.forward, list(self.params) + list(self.running), self.defaults)
        _set_meta(eval_model, spec)
        initial_state = {p: self.optimizer.for_param(p, self.torch_names.get(p)).initial_state(v)
                         for p, v in self.initial.items()}
        return TrainingArtifacts(train, eval_model, accumulate, self.loss_model, self.forward, spec,
                                 dict(self.initial), initial_state, self.report, dict(self.initial_buffers),
                                 self._split(spec.eval_outputs) if split else None)

    # One model: the gradient model with parameters as inputs and update nodes appended.
    def _model(self, accumulate: bool) -> tuple[onnx.ModelProto, TrainingSpec]:
        m, e, data_inputs = self._gradient_graph()
        b = e.b
        grads = {p: b.var(self.gradients[p]) for p in self.params}
        acc_names: dict[str, list[str]] = {}
        if self.k > 1:
            sb = b.scoped("train/accumulate", "gradient accumulation over micro-batches")
            accs = {p: e.add_input(f"{p}.grad_acc", self.dtypes[p], self.shapes[p],
                                   f"sum of the gradients of '{p}' over the earlier micro-batches of this update",
                                   np.zeros(self.shapes[p], helper.tensor_dtype_to_np_dtype(self.dtypes[p])))
                    for p in self.params}
            if accumulate:
                grads = {p: sb.var(accs[p].name) + grads[p] for p in self.params}
            else:
                grads = {p: (sb.var(accs[p].name) + grads[p]) * (1.0 / self.k) for p in self.params}
            acc_names = {p: [accs[p].name, ""] for p in self.params}

        sumsq, finite = self._finite(e, grads, b.var(self.loss))
        rb = b.scoped("train/running_statistics", "running statistics after this batch (train mode)")
        for r, new_value in self.running.items():
            value = rb.var(new_value)
            if self.guard:
                value = rb.op.Where(finite, value, rb.var(r))
            e.output(value, f"{r}.next", self.dtypes[r], self.shapes[r],
                     f"running statistic '{r}' after this batch (feed it back as '{r}')")
        lr = step = None
        state_names: dict[str, dict[str, list[str]]] = {}
        if accumulate:
            for p in self.params:
                acc_names[p][1] = f"{acc_names[p][0]}.next"
                total = grads[p]
                if self.guard:
                    total = b.op.Where(finite, total, b.var(acc_names[p][0]))
                e.output(total, acc_names[p][1], self.dtypes[p], self.shapes[p],
                         f"'{acc_names[p][0]}' plus this micro-batch's gradient")
        else:
            lr, step, state_names = self._update(e, grads, sumsq, finite)
        final = e.finish(m)
        spec = TrainingSpec(
            loss=self.loss, lr="" if accumulate else lr.name, step="" if accumulate else step.name,
            step_next="" if accumulate else final[f"{step.name}.next"],
            finite=final["finite"], grad_norm="" if accumulate else final["grad_norm"],
            data_inputs=data_inputs,
            params={p: ("" if accumulate else final[f"{p}.next"]) for p in self.params},
            state={} if accumulate else {p: {s: [i, final[o]] for s, (i, o) in st.items()}
                                         for p, st in state_names.items()},
            accumulators={p: [i, final.get(o, o) if o else ""] for p, (i, o) in acc_names.items()},
            frozen=list(self.frozen), optimizer=self.optimizer.config(), clip_grad_norm=self.clip,
            accumulation_steps=self.k, guard=self.guard,
            buffers={r: [r, final[f"{r}.next"]] for r in self.running}, train_mode=self.train_mode,
            grads={p: final[f"{p}.grad"] for p in self.params if f"{p}.grad" in final}, recompute=self.recompute,
            state_scale={} if accumulate else self._state_scale())
        return m, spec

    # The split step: backward into flat buckets | all-reduce (not here) | update from the reduced buckets.
    def _split(self, eval_outputs: list[str]) -> SplitStep:
        backward, buckets, stats, weight, bspec = self._backward()
        update, spec = self._update_graph(buckets, stats)
        spec.data_inputs, spec.buffers, spec.eval_outputs = bspec["data_inputs"], bspec["buffers"], eval_outputs
        _set_meta(backward, spec)
        _set_meta(update, spec)
        return SplitStep(backward, update, spec, weight, buckets, stats, self.loss)

    def _buckets(self) -> list[tuple[int, list[str]]]:
        """(element type, parameters) per bucket: float32 first (it also carries the loss and the weight)."""
        by_type: dict[int, list[str]] = {TensorProto.FLOAT: []}
        for p in self.params:
            by_type.setdefault(self.dtypes[p], []).append(p)
        return list(by_type.items())

    def _backward(self) -> tuple[onnx.ModelProto, list[Bucket], int, str, dict]:
        m, e, data_inputs = self._gradient_graph()
        m.graph.output[0].doc_string = "the loss of this worker's micro-batch (before the update)"
        b = e.b
        weight = e.add_input("weight", TensorProto.FLOAT, (),
                             "this micro-batch's weight in the global mean: its number of samples (float32 scalar)",
                             np.array(1.0, np.float32))
        bb = b.scoped("train/bucket", "the weighted gradients end to end, one flat buffer per element type")
        buckets, stats = [], 0
        for dtype, params in self._buckets():
            parts, layout, offset = [], {}, 0
            for p in params:
                n = int(np.prod(self.shapes[p], dtype=np.int64))
                parts.append(bb.op.Reshape(b.var(self.gradients[p]), bb.ints([-1])))
                layout[p], offset = [offset, n], offset + n
            if dtype == TensorProto.FLOAT:        # [weight * loss, weight]: the global mean's numerator, denominator
                stats = offset
                parts += [bb.op.Reshape(_as_float(bb, bb.var(self.loss), self.loss_dtype), bb.ints([1])),
                          bb.const(np.ones(1, np.float32))]
                offset += 2
            flat = parts[0] if len(parts) == 1 else bb.op.Concat(*parts, axis=0)
            flat = flat * _cast_to(bb, weight, dtype)
            name = f"grads.{helper.tensor_dtype_to_np_dtype(dtype).name}"
            acc = ""
            if self.k > 1:
                acc = e.add_input(f"{name}.acc", dtype, (offset,),
                                  f"'{name}' summed over the earlier micro-batches of this update",
                                  np.zeros(offset, helper.tensor_dtype_to_np_dtype(dtype))).name
                flat = bb.var(acc) + flat
            e.output(flat, name, dtype, (offset,),
                     f"weight * gradient of {', '.join(params) or 'no parameter'} end to end"
                     + (", then [weight * loss, weight]" if dtype == TensorProto.FLOAT else "")
                     + (f", plus '{acc}'" if acc else "") + ": sum it over the workers, feed it to the update")
            buckets.append(Bucket(name, dtype, offset, layout, acc))
        for r, new_value in self.running.items():
            e.output(b.var(new_value), f"{r}.next", self.dtypes[r], self.shapes[r],
                     f"running statistic '{r}' after this micro-batch (feed it back as '{r}')")
        final = e.finish(m)
        for bucket in buckets:
            bucket.name = final[bucket.name]
        return m, buckets, stats, weight.name, {
            "data_inputs": data_inputs, "buffers": {r: [r, final[f"{r}.next"]] for r in self.running}}

    def _update_graph(self, buckets: list[Bucket], stats: int) -> tuple[onnx.ModelProto, TrainingSpec]:
        inputs = []
        for bucket in buckets:
            vi = helper.make_tensor_value_info(bucket.name, bucket.dtype, [bucket.size])
            vi.doc_string = f"'{bucket.name}' of the backward graph, summed over the workers"
            inputs.append(vi)
        for p in self.params:
            vi = helper.make_tensor_value_info(p, self.dtypes[p], list(self.shapes[p]))
            vi.doc_string = "trainable parameter (current value)"
            inputs.append(vi)
        inits = [numpy_helper.from_array(self.initial[p], p) for p in self.params] if self.defaults else []
        m = helper.make_model(helper.make_graph([], "update", inputs, [], inits),
                              opset_imports=list(self.gm.opset_import))
        names = NameScope({i.name for i in inputs})
        infos = {b_.name: TensorInfo(b_.dtype, (b_.size,)) for b_ in buckets}
        infos.update({p: TensorInfo(self.dtypes[p], self.shapes[p]) for p in self.params})
        b = Builder(M.opset_of(self.gm), names, infos, prefix="train", doc="")
        e = _Emitter(b, names, infos, self.defaults)
        rb = b.scoped("train/reduced", "the global means: the summed buckets over the summed weight")

        def piece(bucket: Bucket, offset: int, n: int, shape: Sequence[int]) -> Var:
            v = rb.op.Reshape(rb.op.Slice(rb.var(bucket.name), rb.ints([offset]), rb.ints([offset + n])),
                              rb.ints(shape))
            infos[v.name] = TensorInfo(bucket.dtype, tuple(shape))
            return v

        total = piece(buckets[0], stats + 1, 1, ())
        loss = piece(buckets[0], stats, 1, ()) / total
        if self.loss_dtype != TensorProto.FLOAT:
            loss = rb.op.Cast(loss, to=self.loss_dtype)
        e.output(loss, self.loss, self.loss_dtype, (), "the mean loss over every worker's samples (before the update)")
        grads = {}
        for bucket in buckets:
            divisor = _cast_to(rb, total, bucket.dtype)
            for p, (offset, n) in bucket.params.items():
                grads[p] = piece(bucket, offset, n, self.shapes[p]) / divisor
        grads = {p: grads[p] for p in self.params}
        sumsq, finite = self._finite(e, grads, loss)
        lr, step, state_names = self._update(e, grads, sumsq, finite)
        final = e.finish(m)
        spec = TrainingSpec(
            loss=final[self.loss], lr=lr.name, step=step.name, step_next=final[f"{step.name}.next"],
            finite=final["finite"], grad_norm=final["grad_norm"],
            data_inputs=[], params={p: final[f"{p}.next"] for p in self.params},
            state={p: {s: [i, final[o]] for s, (i, o) in st.items()} for p, st in state_names.items()},
            accumulators={}, frozen=list(self.frozen), optimizer=self.optimizer.config(), clip_grad_norm=self.clip,
            accumulation_steps=self.k, guard=self.guard, train_mode=self.train_mode,
            grads={p: final[f"{p}.grad"] for p in self.params if f"{p}.grad" in final}, recompute=self.recompute,
            state_scale=self._state_scale())
        return m, spec

    def _gradient_graph(self) -> tuple[onnx.ModelProto, "_Emitter", list[str]]:
        """The gradient model with parameters and running statistics as inputs, the loss its first output
        (gradients stay inside), an emitter to append nodes, inputs and outputs, and its data inputs."""
        held = list(self.params) + list(self.running)
        m = _as_inputs(self.gm, [(self.params, "trainable parameter (current value)"),
                                 (list(self.running), "running statistic (current value)")], self.defaults)
        g = m.graph
        for t in g.initializer:        # the defaults: the values build() held aside
            if is_held(t):
                t.CopyFrom(numpy_helper.from_array(self.initial[t.name], t.name))
        del m.metadata_props[:]         # the gradient model's own keys, but what its nodes and inputs still are
        m.metadata_props.extend(p for p in self.gm.metadata_props if not p.key.startswith("onnxgrad.")
                                or p.key in ("onnxgrad.target", "onnxgrad.rewrites", "onnxgrad.recomputed",
                                             CLASS_TARGETS_KEY))
        taken = ({i.name for i in g.input} | {i.name for i in g.initializer} | {o.name for o in g.output}
                 | {o for n in g.node for o in n.output} | {n.name for n in g.node})
        names = NameScope(taken)
        infos: dict[str, TensorInfo] = {}
        for p in self.params:
            infos[p] = TensorInfo(self.dtypes[p], self.shapes[p])
            infos[self.gradients[p]] = TensorInfo(self.dtypes[p], self.shapes[p])
        infos[self.loss] = TensorInfo(self.loss_dtype, ())
        b = Builder(M.opset_of(m), names, infos, prefix="train", doc="")
        data_inputs = [i.name for i in g.input if i.name not in {x.name for x in g.initializer} | set(held)]
        # outputs: loss first
        del g.output[:]
        g.output.append(helper.make_tensor_value_info(self.loss, self.loss_dtype, []))
        g.output[0].doc_string = "the loss of this batch (before the update)"
        return m, _Emitter(b, names, infos, self.defaults), data_inputs

    def _finite(self, e: "_Emitter", grads: dict[str, Var], loss: Var) -> tuple[Var, Var]:
        """The sum of squares of every gradient and the ``finite`` output (loss and gradients finite)."""
        b = e.b
        nb = b.scoped("train/grad_norm", "global L2 norm of the gradients")
        squares = [nb.reduce("ReduceSumSquare", _as_float(nb, grads[p], self.dtypes[p]), None, keepdims=False)
                   for p in self.params]
        sumsq = squares[0] if len(squares) == 1 else nb.op.Sum(*squares)
        fb = b.scoped("train/finite", "true when the loss and every gradient are finite")
        probe = _as_float(fb, fb.var(loss.name), self.loss_dtype) + sumsq
        finite = fb.op.Not(fb.op.Or(fb.op.IsNaN(probe), fb.op.IsInf(probe)))
        e.output(finite, "finite", TensorProto.BOOL, (),
                 "true when the loss and all gradients are finite; when false, do not use the outputs"
                 + (" (the graph returns the old values)" if self.guard else ""))
        return sumsq, finite

    def _state_scale(self) -> dict[str, dict[str, float]]:
        """How the update graph holds each parameter's optimizer state (:meth:`Optimizer.state_scale`)."""
        scales = {p: self.optimizer.for_param(p, self.torch_names.get(p)).state_scale(self.dtypes[p])
                  for p in self.params}
        return {p: scale for p, scale in scales.items() if scale}

    def _update(self, e: "_Emitter", grads: dict[str, Var], sumsq: Var, finite: Var
                ) -> tuple[Var, Var, dict[str, dict[str, list[str]]]]:
        """The ``grad_norm`` output, clipping, (kept gradients) and the optimizer update of every parameter:
        the inputs ``lr``, ``step`` and the optimizer state, the outputs ``<param>.next`` and the new state."""
        b = e.b
        nb = b.scoped("train/grad_norm", "global L2 norm of the gradients")
        norm = nb.op.Sqrt(sumsq)
        e.output(norm, "grad_norm", TensorProto.FLOAT, (),
                 "global L2 norm of the gradients" + (" (mean over the micro-batches)" if self.k > 1
                                                      else "") + ", before clipping")
        if self.clip is not None:
            cb = b.scoped("train/clip", f"clip the global gradient norm to {self.clip}")
            coef = cb.op.Min(cb.scalar(self.clip, norm) / (norm + CLIP_EPS), cb.scalar(1.0, norm))
            grads = {p: grads[p] * _cast_to(cb, coef, self.dtypes[p]) for p in self.params}
        if self.keep_grads:
            for p in self.params:
                e.output(grads[p], f"{p}.grad", self.dtypes[p], self.shapes[p],
                         f"the gradient the update of '{p}' used (after accumulation and clipping)")

        lr = e.add_input("lr", TensorProto.FLOAT, (), "learning rate of this update (float32 scalar)",
                         np.array(self.optimizer.lr, np.float32))
        step_np = helper.tensor_dtype_to_np_dtype(self.step_dtype)
        step = e.add_input("step", self.step_dtype, (), f"number of this update, 1 for the first ({step_np.name} "
                           "scalar)", np.array(1, step_np))
        ob = b.scoped("train/optimizer", f"{type(self.optimizer).__name__} update")
        ctx = UpdateContext(ob, lr, step)
        first = len(b.nodes)           # the update's nodes: into the guard's If below
        state_names: dict[str, dict[str, list[str]]] = {}
        updated: list[tuple[Var, Var, str, int, tuple, str]] = []     # (new, old, name, dtype, shape, doc)
        states: dict[str, dict[str, Var]] = {}
        for p in self.params:
            optimizer = self.optimizer.for_param(p, self.torch_names.get(p))
            scale = optimizer.state_scale(self.dtypes[p])
            states[p] = {s: e.add_input(f"{p}.{s}", self.dtypes[p], self.shapes[p],
                                        f"optimizer state '{s}' of '{p}'"
                                        + (f", held as PyTorch's value times {scale[s]:g}" if s in scale else ""),
                                        optimizer.initial_state(self.initial[p])[s] if self.defaults else None)
                         for s in optimizer.active_state()}
        for group in self._update_groups():
            new = self._group_update(ob, ctx, group, grads, states) if len(group) > 1 else None
            for p in group:
                if new is None:
                    pb = ob.scoped(f"train/optimizer/{p}", f"{type(self.optimizer).__name__} update of '{p}'")
                    ctx.b = pb
                    optimizer = self.optimizer.for_param(p, self.torch_names.get(p))
                    new_p, new_state = optimizer.update(ctx, pb.var(p), grads[p], states[p])
                else:
                    new_p, new_state = new[p]
                state = states[p]
                updated.append((new_p, ob.var(p), f"{p}.next", self.dtypes[p], self.shapes[p],
                                f"'{p}' after the update"))
                state_names[p] = {}
                for s, v in new_state.items():
                    out = f"{state[s].name}.next"
                    updated.append((v, state[s], out, self.dtypes[p], self.shapes[p],
                                    f"'{state[s].name}' after the update"))
                    state_names[p][s] = [state[s].name, out]
        # the count of applied updates, fed back as the other state is: Adam's bias correction reads it
        sb = b.scoped("train/step", "number of the next update")
        next_step = sb.op.Add(step, sb.const(np.array(1), self.step_dtype))
        updated.append((next_step, step, f"{step.name}.next", self.step_dtype, (),
                        f"'{step.name}' for the next update: one more when this update was applied"))
        new_values = [u[0] for u in updated]
        if self.target in ("cpu", "webgpu"):       # onnxruntime's CPU kernels, wasm's too (webgpu files run there)
            scalars_at_rank(ob, first)
        if self.guard:
            new_values = _guarded(ob, first, finite, [(u[0], u[1], u[3], u[4]) for u in updated])
        for value, (_, _, name, dtype, shape, doc) in zip(new_values, updated):
            e.output(value, name, dtype, shape, doc)
        return lr, step, state_names

    def _update_groups(self) -> list[list[str]]:
        """The parameters updated together: small tensors of one element type and one optimizer configuration
        in one group each (their update is a few kernels over all of them, not a dozen per tensor), every other
        parameter alone. The update is elementwise, so a group's values are each tensor's own."""
        groups: dict[tuple, list[str]] = {}
        alone = []
        for p in self.params:
            if int(np.prod(self.shapes[p], dtype=np.int64)) > FOREACH_MAX_ELEMENTS:
                alone.append([p])
                continue
            optimizer = self.optimizer.for_param(p, self.torch_names.get(p))
            key = (self.dtypes[p], json.dumps(optimizer.config(), sort_keys=True))
            groups.setdefault(key, []).append(p)
        return [*groups.values(), *alone]

    def _group_update(self, ob: Builder, ctx: UpdateContext, group: list[str], grads: dict[str, Var],
                      states: dict[str, dict[str, Var]]) -> dict[str, tuple[Var, dict[str, Var]]]:
        """One update over ``group``'s tensors flattened and concatenated (PyTorch's foreach optimizers), split
        back into each parameter's new value and state."""
        gb = ob.scoped("train/optimizer/foreach", f"{type(self.optimizer).__name__} update of {len(group)} "
                       "small tensors at once")
        ctx.b = gb
        optimizer = self.optimizer.for_param(group[0], self.torch_names.get(group[0]))
        sizes = [int(np.prod(self.shapes[p], dtype=np.int64)) for p in group]

        def flat(values: list[Var]) -> Var:
            """The group's tensors (one per parameter, in order) as one vector; a vector is taken as it is (a
            Reshape is a node to run, about 10 us on onnxruntime's CPU: a third of a small update's nodes)."""
            return gb.op.Concat(*[gb.var(v.name) if len(self.shapes[p]) == 1 else
                                  gb.op.Reshape(gb.var(v.name), gb.ints([-1])) for v, p in zip(values, group)], axis=0)

        names = list(states[group[0]])
        new_p, new_state = optimizer.update(ctx, flat([gb.var(p) for p in group]), flat([grads[p] for p in group]),
                                            {s: flat([states[p][s] for p in group]) for s in names})

        def pieces(v: Var) -> list[Var]:
            parts = gb.op.Split(v, gb.ints(sizes), axis=0, outputs=len(sizes))
            return [part if len(self.shapes[p]) == 1 else gb.op.Reshape(part, gb.ints(list(self.shapes[p])))
                    for part, p in zip(parts, group)]

        split_p = pieces(new_p)
        split_state = {s: pieces(v) for s, v in new_state.items()}
        return {p: (split_p[k], {s: split_state[s][k] for s in split_state}) for k, p in enumerate(group)}


# parameters of at most this many elements are updated together (:meth:`_Builder._update_groups`): below it a
# tensor's update is launch-bound (a dozen kernels each), above it the concatenation's copies would cost more
FOREACH_MAX_ELEMENTS = 1 << 16


def _guarded(b: Builder, first: int, finite: Var, updated: list[tuple[Var, Var, int, tuple]]) -> list[Var]:
    """The update as one ``If(finite)``: the nodes ``b`` emitted from index ``first`` on become its then
    branch, which returns the new values; its else branch returns the old ones, so a non-finite step
    writes back what it read. ``updated``: (new value, old value, element type, shape) per output.

    A Where per output (or one on each gradient) would cost a full pass over every parameter-sized tensor
    (onnxruntime's Where with a scalar condition runs at a third of a Mul's speed: ResNet-18's 11M
    parameters spent 7 ms of a 150 ms step in it); the If costs nothing, and onnxruntime writes the then
    branch's results straight into the If's outputs (the session's parameter buffers, bound in place)."""
    body = b.nodes[first:]
    del b.nodes[first:]
    then_b, else_b = b.subgraph("finite"), b.subgraph("not_finite")
    then_b.nodes, then_b.made = body, {o for n in body for o in n.output}
    then_out, else_out = [], []
    for new, old, dtype, shape in updated:
        v = then_b.var(new.name)
        if v.name not in then_b.made or v.name in {x.name for x in then_out}:
            v = then_b.op.Identity(v)
        then_out.append(v)
        else_out.append(else_b.op.Identity(else_b.var(old.name)))

    def branch(sb: Builder, outs: list[Var], name: str) -> onnx.GraphProto:
        return helper.make_graph(sb.nodes, b.names.fresh(name), [], [
            helper.make_tensor_value_info(v.name, dtype, list(shape))
            for v, (_, _, dtype, shape) in zip(outs, updated)])

    outs = b.emit("If", [finite], outputs=len(updated),
                  then_branch=branch(then_b, then_out, "update"),
                  else_branch=branch(else_b, else_out, "keep_old_values"))
    outs = (outs,) if len(updated) == 1 else outs
    for v, (_, _, dtype, shape) in zip(outs, updated):
        b.infos[v.name] = TensorInfo(dtype, tuple(shape))
    return list(outs)


class _Emitter:
    """One graph under construction: its builder and names, and the inputs, initializers and outputs it gains."""

    def __init__(self, b: Builder, names: NameScope, infos: dict[str, TensorInfo], defaults: bool):
        self.b, self.names, self.infos, self.defaults = b, names, infos, defaults
        self.inputs: list[onnx.ValueInfoProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.outputs: list[tuple[Var, str, int, tuple, str]] = []   # (value, name, dtype, shape, doc)

    def add_input(self, base: str, dtype: int, shape: Sequence[int], doc: str, default: np.ndarray | None) -> Var:
        name = self.names.fresh(base)
        vi = helper.make_tensor_value_info(name, dtype, list(shape))
        vi.doc_string = doc
        self.inputs.append(vi)
        self.infos[name] = TensorInfo(dtype, tuple(shape))
        if default is not None and self.defaults:
            self.inits.append(numpy_helper.from_array(np.asarray(default), name))
        return self.b.var(name)

    def output(self, value: Var, base: str, dtype: int, shape: Sequence[int], doc: str) -> None:
        self.outputs.append((value, base, dtype, tuple(shape), doc))

    def finish(self, m: onnx.ModelProto) -> dict[str, str]:
        """Name the outputs (renaming their producers where we can, so no copy is made), add everything to
        ``m``; returns {base name: output name}."""
        g, b = m.graph, self.b
        final = {base: self.names.fresh(base) for _, base, _, _, _ in self.outputs}
        b.name_all([(value, final[base]) for value, base, _, _, _ in self.outputs])
        for _, base, dtype, shape, doc in self.outputs:
            vi = helper.make_tensor_value_info(final[base], dtype, list(shape))
            vi.doc_string = doc
            g.output.append(vi)
        g.input.extend(self.inputs)
        for t in self.inits:
            g.initializer.add().CopyFrom(t)
        g.node.extend(b.nodes)
        m.ir_version = emitted_ir_version(m)
        return final


# -- graph surgery helpers ----------------------------------------------------------------------------
def _as_float(b: Builder, x: Var, dtype: int) -> Var:
    """x in float32 (norms of float16 gradients overflow in float16)."""
    return x if dtype == TensorProto.FLOAT else b.op.Cast(x, to=TensorProto.FLOAT)


def _cast_to(b: Builder, x: Var, dtype: int) -> Var:
    return x if dtype == TensorProto.FLOAT else b.op.Cast(x, to=dtype)


def _as_inputs(model: onnx.ModelProto, groups: Sequence[tuple[Sequence[str], str]], defaults: bool
               ) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``groups`` ((names, doc string) pairs) are graph
    inputs, after the others; kept as initializers of the same names too (default values) when
    ``defaults``. Without defaults their data is never copied: a large weight copied into a proto and
    deleted from it again is not freed."""
    inits = {t.name: t for t in model.graph.initializer}
    names = [p for ps, _ in groups for p in ps if p in inits]
    m = copy_model(model, skip=() if defaults else set(names))
    have = {i.name for i in m.graph.input}
    for ps, doc in groups:
        for p in ps:
            if p in inits and p not in have:
                vi = m.graph.input.add()
                vi.CopyFrom(helper.make_tensor_value_info(p, inits[p].data_type, list(inits[p].dims)))
                vi.doc_string = doc
    return m


def _params_as_inputs(model: onnx.ModelProto, params: Sequence[str] | dict, defaults: bool) -> onnx.ModelProto:
    return _as_inputs(model, [(list(params), "trainable parameter")], defaults)


# Producers whose kernels read element i of each input before writing element i of the output, so the
# output may share an input's buffer (onnxruntime's own in-place reuse covers these ops).
_ELEMENTWISE = frozenset({"Where", "Add", "Sub", "Mul", "Div"})
_METADATA = frozenset({"Shape", "Size"})      # readers of a tensor's shape, not of its data


def in_place(model: onnx.ModelProto, pairs: dict[str, str], finite: str) -> set[str]:
    """The inputs among ``pairs`` (graph input -> graph output) whose output may be written into the
    input's own buffer (IOBinding both to one OrtValue), so that a step keeps one copy of each tensor.

    A pair qualifies when its output is guarded, so that a failed step writes the old value back, and
    its last writer is elementwise (it reads element i before it writes element i) with every other
    reader of the input before it. Two guards: the update's ``If(finite)`` (:func:`_guarded`), whose
    then branch makes the output with an elementwise node that every other reader of the input in the
    branch leads to, and whose else branch returns the input; or an elementwise producer depending on
    ``finite`` (a ``Where``: the running statistics), every other reader an ancestor of it. Readers
    upstream of ``finite`` (the forward and backward) run before either.
    """
    if not finite:
        return set()
    main = _Nodes(model.graph.node, pairs)
    upstream = {id(n) for n in G.live(main.nodes, [finite])[1]}
    branches: dict[int, tuple[_Nodes, dict[str, onnx.NodeProto]]] = {}   # If -> then's nodes, else's producers
    safe = set()
    for inp, out in pairs.items():
        node = main.producer.get(out)
        if node is None or node.domain not in ("", "ai.onnx") or inp == out:
            continue
        if node.op_type == "If" and list(node.input) == [finite]:
            graphs = {a.name: a.g for a in node.attribute}
            if id(node) not in branches:
                branches[id(node)] = (_Nodes(graphs["then_branch"].node, pairs),
                                      {o: n for n in graphs["else_branch"].node for o in n.output})
            then, otherwise = branches[id(node)]
            k = list(node.output).index(out)
            if (then.written_last(graphs["then_branch"].output[k].name, inp)
                    and _returns(graphs["else_branch"], otherwise, k, inp)
                    and all(id(r) in upstream or r is node for r in main.readers.get(inp, ()))):
                safe.add(inp)
        elif main.written_last(out, inp, finite, upstream):
            safe.add(inp)
    return safe


class _Nodes:
    """A node list's producers, and the readers of the data of the tensors ``names``."""

    def __init__(self, nodes: Iterable[onnx.NodeProto], names: Iterable[str]):
        self.nodes = list(nodes)            # one wrapper per node, alive while their ids are compared
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        self._memo: dict[int, frozenset[int]] = {}      # :meth:`_ancestors` of the nodes many read
        wanted = set(names)
        for n in self.nodes:
            if n.op_type in _METADATA and n.domain in ("", "ai.onnx"):
                continue                      # reads the shape, never the data
            read = set(n.input) | (M.subgraph_inputs(n) if M.has_subgraph(n) else set())
            for name in read & wanted:
                self.readers.setdefault(name, []).append(n)

    def written_last(self, out: str, inp: str, finite: str | None = None, upstream: set[int] = frozenset()) -> bool:
        """Whether ``out`` is made by a node that every other reader of ``inp`` here leads to (those in
        ``upstream`` aside), an elementwise one where it reads ``inp`` itself (it reads element i before it
        writes element i; a node that does not read ``inp``, as the split-back of parameters updated together,
        runs after every reader); with ``finite``, that node must also depend on it."""
        node = self.producer.get(out)
        if node is None or node.domain not in ("", "ai.onnx"):
            return False
        if inp in node.input and node.op_type not in _ELEMENTWISE:
            return False
        unseen = {id(r) for r in self.readers.get(inp, ()) if id(r) not in upstream} - {id(node)}
        if finite is None and not upstream:
            return not unseen - self._ancestors(node)
        seen, guarded, todo = {id(node)}, finite is None, [node]
        while todo and (unseen or not guarded):   # the producer's ancestors here, short of the upstream ones
            n = todo.pop()
            for x in n.input:
                guarded |= x == finite
                p = self.producer.get(x)
                if p is not None and id(p) not in upstream and id(p) not in seen:
                    seen.add(id(p))
                    unseen.discard(id(p))
                    todo.append(p)
        return guarded and not unseen

    def _ancestors(self, node: onnx.NodeProto) -> frozenset[int]:
        """The ids of ``node`` and the nodes here it depends on. Kept for the nodes that many read (the split
        of parameters updated together, shared scalars), so the outputs after them are not walked again."""
        found = self._memo.get(id(node))
        if found is not None:
            return found
        seen, todo = {id(node)}, [node]
        while todo:
            n = todo.pop()
            for x in n.input:
                p = self.producer.get(x)
                if p is None or id(p) in seen:
                    continue
                if len(self.consumers.get(id(p), ())) > 1:
                    seen |= self._ancestors(p)
                else:
                    seen.add(id(p))
                    todo.append(p)
        found = frozenset(seen)
        if len(self.consumers.get(id(node), ())) > 1:
            self._memo[id(node)] = found
        return found

    @cached_property
    def consumers(self) -> dict[int, list[onnx.NodeProto]]:
        """The nodes reading each node's outputs, by the producer's id."""
        out: dict[int, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for x in n.input:
                p = self.producer.get(x)
                if p is not None:
                    out.setdefault(id(p), []).append(n)
        return out


def _returns(g: onnx.GraphProto, made: dict[str, onnx.NodeProto], k: int, inp: str) -> bool:
    """Whether graph ``g``'s output ``k`` is ``inp`` itself (through an Identity); ``made``: g's producers."""
    n = made.get(g.output[k].name)
    return g.output[k].name == inp or (n is not None and n.op_type == "Identity" and list(n.input) == [inp])


def _set_meta(model: onnx.ModelProto, spec: TrainingSpec) -> None:
    M.set_metadata(model, {META_KEY: spec.to_json()})
