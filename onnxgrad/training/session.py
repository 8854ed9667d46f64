"""Training with stock onnxruntime: one run per step does forward, loss, backward and the update.

>>> from onnxgrad import TrainingSession, losses, optim
>>> s = TrainingSession(model, loss=losses.CrossEntropyLoss(output="logits", target="y"),
...                     optimizer=optim.AdamW(lr=1e-3))
>>> loss = s.step({"x": x, "y": y})      # a Python float
>>> s.eval({"x": x})                      # {"logits": array}
>>> s.save("ckpt.onnxgrad"); s = TrainingSession.load("ckpt.onnxgrad")
>>> s.export("trained.onnx")

The graphs come from :mod:`onnxgrad.training.artifacts`. Parameters, optimizer state and
running statistics live on the session's device as OrtValues, one buffer each:
a step binds each as an input and its ``.next`` output to the same buffer, so
the update is written in place (the graphs are guarded: a step whose loss or
gradients are not finite writes the old values back; :func:`onnxgrad.training.artifacts.in_place`
checks that the update is the buffer's last reader). Weights never travel to
the host between steps. A tensor that fails the check (and the accumulators,
the data-parallel running statistics) keeps a spare buffer the step writes,
then the two swap. A step whose loss or gradients are not finite is never
applied: it raises :class:`NonFiniteError` (``on_nonfinite="raise"``) or is
counted in ``skipped_steps`` and warned about (``"skip"``).

With ``data_parallel=True`` and more than one worker, a step runs the split
graphs (:class:`onnxgrad.training.artifacts.SplitStep`): backward into flat gradient
buckets, their sum over the workers (:mod:`onnxgrad.training.distributed`), then the
update, so every worker clips, checks finiteness and updates alike. One
worker keeps the fused single-run step.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import FeedConversionWarning, OnnxGradError, UnknownNameError
from ..ir.files import NO_DATA, runnable, save_model, stripped
from ..passes.optimize import provider_name, target_for
from ..passes.recompute import ORT_DISABLED_OPTIMIZERS
from ..runtime import onnxruntime
from . import artifacts as A
from . import distributed as D
from . import feeds as F
from . import losses as L
from . import state as S
from . import torch_module
from .optim import Optimizer, from_config

__all__ = ["TrainingSession", "CheckpointError", "CorruptCheckpointError", "CheckpointMismatchError",
           "NonFiniteError", "NonFiniteWarning", "DeviceError", "DeviceFallbackWarning", "StepReadbackError"]

# the checkpoint errors are the state file's (onnxgrad.training.state), exported here as before
CheckpointError, CorruptCheckpointError, CheckpointMismatchError = (S.CheckpointError, S.CorruptCheckpointError,
                                                                   S.CheckpointMismatchError)


class NonFiniteError(OnnxGradError):
    """A step produced a NaN or infinite loss or gradient; its update was not applied."""


class NonFiniteWarning(UserWarning):
    """A step produced a NaN or infinite loss or gradient and was skipped (``on_nonfinite="skip"``)."""


class DeviceError(OnnxGradError):
    """The session cannot run on the device its providers ask for (a CUDA session that cannot be built)."""


class DeviceFallbackWarning(UserWarning):
    """The default providers asked for CUDA and the session could not be built there: it trains on the CPU."""


class StepReadbackError(OnnxGradError):
    """The scalars a step read back contradict each other (``finite`` against the loss and gradient norm it
    is computed from): the runtime returned something the graph did not compute."""


_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")

# onnxruntime's constant folding turns a ConstantOfShape of a constant shape into an initializer the session holds
# for its whole life: the zeros an embedding's gradient is scattered into are a copy of the table (BERT's 31 MB,
# GPT-2's 51 MB). Above this size a constant is made again each step (a fill, which the step's copy of the folded
# one cost as well): BERT's step peak 444 -> 414 MB, GPT-2's 725 -> 691 MB, no step slower (bench/README.md)
FOLDED_CONSTANT_LIMIT = ("optimization.constant_folding_max_output_size_in_bytes", str(1 << 20))


def default_providers() -> list[str]:
    """CUDA first when this onnxruntime has it (onnxruntime-gpu), then CPU."""
    ort = onnxruntime("training")
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def float32_providers(providers: Sequence[Any]) -> list[Any]:
    """``providers`` with onnxruntime's CUDA provider computing float32 in float32: its default is TF32 for
    Conv and MatMul (10-bit mantissas), which put a BatchNorm ResNet's training 4.7e-3 off the CPU's after
    5 steps and 2.3e-7 with ``use_tf32=0`` (bench/gpu_bisect.py on an H200). PyTorch's float32 matmuls are
    exact by default too. A ``use_tf32`` the caller gives is kept: ``("CUDAExecutionProvider",
    {"use_tf32": "1"})`` trades those digits for speed."""
    out = []
    for p in providers:
        if provider_name(p) == "CUDAExecutionProvider":
            options = dict(p[1]) if isinstance(p, (tuple, list)) and len(p) > 1 else {}
            options.setdefault("use_tf32", "0")
            p = ("CUDAExecutionProvider", options)
        out.append(p)
    return out


class TrainingSession:
    """Train an ONNX model with onnxruntime.

    ``model``: a model with a scalar loss output (``loss`` names it), or a forward
    model and a loss from :mod:`onnxgrad.losses` as ``loss``. ``optimizer``: from
    :mod:`onnxgrad.optim` (default ``AdamW()``; ``param_groups`` set options per name
    pattern). Trained: PyTorch's parameters as they appear in the graph
    (:func:`onnxgrad.parameters` says which and why), minus ``frozen``; or exactly
    ``trainable``. ``train_mode`` (default True): ``step`` trains as ``model.train()``
    does (BatchNormalization on batch statistics, running statistics updated, Dropout
    active) while ``eval`` and ``export`` use inference mode; False keeps the exported
    eval-mode graph (frozen-BN fine-tuning). ``keep_grads``: keep the last update's
    gradients for :meth:`grads`. ``clip_grad_norm``: clip the global gradient norm (as
    ``torch.nn.utils.clip_grad_norm_``). ``accumulation_steps=k``: each ``step``
    call is one micro-batch and every k-th applies the mean of their gradients.
    ``on_nonfinite``: "raise" or "skip". ``providers``: onnxruntime execution
    providers (default: CUDA when available, else CPU); the backward is rewritten for the first
    one (:mod:`onnxgrad.passes.optimize`). ``session_options``: the ``onnxruntime.SessionOptions`` of its
    sessions; the session turns their memory pattern off (``enable_mem_pattern``: with it, onnxruntime
    held a step's activations twice) and keeps onnxruntime from folding constants over 1 MiB into tensors
    it holds (:data:`FOLDED_CONSTANT_LIMIT`, unless the options set that limit). ``recompute``: the backward
    computes cheap activations again (ReLUs, batch-norm outputs, GELUs) instead of keeping them from the
    forward (:mod:`onnxgrad.passes.recompute`): less is held from the forward into the backward, for a
    little more time; a step's peak falls only where it lies there (bench/README.md's measurements).
    Checkpoints keep the setting. ``module``: the ``torch.nn.Module`` the model was exported from
    (:func:`onnxgrad.from_torch`), trained in place as ``torch.optim`` trains it: the session updates the module's
    own parameters and running statistics (CPU sessions), so the weights are held once and ``module`` is the
    trained model after every step (:mod:`onnxgrad.training.torch_module`).

    ``lr`` (the learning rate of the next steps; a scheduler sets it), ``step_count``
    (updates applied), ``skipped_steps`` and ``last_grad_norm`` are plain attributes;
    ``device`` says where parameters and optimizer state live.

    ``data_parallel``: this process is one worker of a data-parallel job (``True``: torch.distributed
    under ``torchrun`` or an existing process group, MPI under ``mpiexec``; or ``"torch"``, ``"mpi"``). Every
    worker starts from rank 0's weights; ``step(feeds)`` takes this worker's shard; the gradients are
    averaged over every sample of every worker (each shard weighted by its size, so uneven shards give the
    global batch's mean) and of the ``accumulation_steps`` micro-batches, reduced once per update; the loss
    an update returns is that global mean. ``save`` writes on rank 0 only; ``rank``, ``world_size``.
    """

    def __init__(
        self,
        model: onnx.ModelProto | str | os.PathLike,
        loss: str | Callable[[onnx.ModelProto], onnx.ModelProto] = "loss",
        optimizer: Optimizer | None = None,
        providers: Sequence[Any] | None = None,
        frozen: Iterable[str] = (),
        *,
        trainable: Sequence[str] | None = None,
        train_mode: bool = True,
        keep_grads: bool = False,
        clip_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        on_nonfinite: str = "raise",
        session_options: Any = None,
        strict_tags: bool = False,
        data_parallel: "bool | str | D.Engine" = False,
        recompute: bool = False,
        module: Any = None,
    ):
        ort = onnxruntime("TrainingSession")

        if on_nonfinite not in ("raise", "skip"):
            raise OnnxGradError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self._ort = ort
        self._providers = list(providers) if providers is not None else default_providers()
        if module is not None and provider_name(self._providers[0]) != "CPUExecutionProvider":
            raise OnnxGradError(f"module= trains the module's CPU tensors in place, in a CPU session, and this "
                                f"session would run on {provider_name(self._providers[0])}"
                                f"{'' if providers else ' (the default where it is available)'}: pass "
                                "providers=['CPUExecutionProvider'], or leave module= out and copy "
                                "session.parameters() into the module")
        self._options = session_options
        self._engine: D.Engine | None = None
        if data_parallel is not False:
            cuda = provider_name(self._providers[0]) == "CUDAExecutionProvider"
            self._engine = D.engine(data_parallel, "cuda" if cuda else "cpu")
            if providers is None and cuda:      # one GPU per worker on its machine
                self._providers[0] = ("CUDAExecutionProvider", {"device_id": self._engine.local_rank})
            if session_options is None and not cuda and self._engine.local_world_size > 1:
                self._options = ort.SessionOptions()       # share the machine's cores among its workers
                self._options.log_severity_level = 3
                self._options.intra_op_num_threads = max(1, (os.cpu_count() or 1) // self._engine.local_world_size)
        self._providers = float32_providers(self._providers)
        self.rank = self._engine.rank if self._engine else 0
        self.world_size = self._engine.world_size if self._engine else 1
        target = target_for(self._providers)
        self.artifacts = A.build(model, loss, optimizer, frozen=frozen, trainable=trainable,
                                 clip_grad_norm=clip_grad_norm, accumulation_steps=accumulation_steps, guard=True,
                                 defaults=False, train_mode=train_mode, keep_grads=keep_grads,
                                 strict_tags=strict_tags, split=self.world_size > 1, target=target,
                                 recompute=recompute)
        self._explicit = trainable is not None
        self._class_targets = L.class_targets(self.artifacts.loss_model)   # labels checked before each run
        self._strict_tags = strict_tags
        self._split = self.artifacts.split
        spec = self._split.spec if self._split else self.artifacts.spec
        self.spec = spec
        self.optimizer = from_config(spec.optimizer)
        self.lr = self.optimizer.lr
        self.step_count = 0          # updates applied
        self.skipped_steps = 0       # updates not applied (non-finite, on_nonfinite="skip")
        self.last_grad_norm = float("nan")
        self._micro = 0              # micro-batches accumulated towards the next update
        self._poisoned = False       # a non-finite micro-batch in this accumulation window

        train = self._split.update if self._split else self.artifacts.train      # the graph that updates
        self._train = self._device_session(train, explicit=providers is not None)
        self.device, self.device_id = _device_of(self._train)
        self._accumulate = (self._session(self.artifacts.accumulate) if self.artifacts.accumulate
                            and not self._split else None)
        self._backward = self._session(self._split.backward) if self._split else None
        self._evals: dict[bool, Any] = {}

        # device buffers: the current values, and a spare set the step writes for what is not updated in place
        self._inplace = self._in_place()
        self._sets: list[dict[str, Any]] = [{}, {}]     # a step reads one set and writes the other ...
        self._parity = 0                                   # (which set holds the current values)
        self._bindings: list[Any] | None = None            # one prebuilt IOBinding per parity
        self._layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        art = self.artifacts
        values = {**art.initial_params, **art.initial_buffers}
        self._link = None if module is None else torch_module.link(module, values, art.initial_buffers)
        self._linked = {}                              # name -> the buffer that is the module's tensor
        for p, states in art.initial_state.items():
            for s, v in states.items():
                values[spec.state[p][s][0]] = v
        for name, v in values.items():
            if self._link and name in self._link.arrays and name in self._inplace:
                self._linked[name] = self._sets[0][name] = ort.OrtValue.ortvalue_from_numpy(self._link.arrays[name])
            else:
                self._sets[0][name] = self._adopt(v)
            # ... and for the tensors updated in place, both sets hold the one buffer
            self._sets[1][name] = self._sets[0][name] if name in self._inplace else self._empty_like(v)
            self._layout[name] = (tuple(v.shape), np.dtype(v.dtype))
        del values
        # the session's copies are its device buffers: the numpy starting values and the trained tensors'
        # data in the loss and forward models go (save, export and parameters() read the buffers)
        art.initial_params, art.initial_buffers, art.initial_state = {}, {}, {}
        art.loss_model = _without_data(art.loss_model, self._layout)
        art.forward = _without_data(art.forward, self._layout)
        if spec.accumulation_steps > 1:
            self._acc_zero = {i: self._zeros(p) for p, (i, _) in spec.accumulators.items()}
            self._acc_bufs = [{i: self._empty(p) for p, (i, _) in spec.accumulators.items()} for _ in range(2)]
            self._acc_parity = 0
        self._acc_valid = False
        self._grad_bufs = {p: self._empty(p) for p in spec.grads}
        # the step's data inputs as the graph that reads them declares them (the backward's, data parallel)
        self._declared = F.declared_inputs(self._split.backward if self._split else self.artifacts.train,
                                           spec.data_inputs)
        self._converted: set[str] = set()      # inputs whose lossless conversion was said
        if self._split:
            self._split_buffers()
        if self.world_size > 1:            # every worker starts from rank 0's weights, as DDP does
            self._engine.broadcast([self._sets[0][n] for n in sorted(self._sets[0])])
            self._to_module()
        inits = {x.name for x in self.artifacts.loss_model.graph.initializer}
        self._loss_inputs = [i.name for i in self.artifacts.loss_model.graph.input if i.name not in inits]
        _release_freed_memory()

    # -- running --------------------------------------------------------------------------------------
    def step(self, feeds: Mapping[str, Any], lr: float | None = None, *,
             samples: float | None = None) -> float:
        """One micro-batch: forward, loss, backward and (every ``accumulation_steps``-th call) the update.

        Returns the loss of this batch (computed with the weights before the update); data parallel, an
        update returns the mean loss over every worker's samples of its micro-batches.
        ``lr`` overrides the session's learning rate ``self.lr`` for this step. ``samples`` (data
        parallel): this shard's weight in the global mean, by default its number of samples (the
        leading dimension of its first batched input); give the count the loss averages over when it
        is another (tokens that are not padding). One worker ignores it.

        ``feeds`` hold numpy arrays, or batches already on the device: ``onnxruntime.OrtValue``s and DLPack
        tensors (torch, CuPy: anything with ``__dlpack__``), bound where they lie with no copy through the
        host. Before the run each is checked against its input (:mod:`onnxgrad.training.feeds`): rank, fixed
        sizes and the sizes the inputs share (the batch) must fit, or :class:`~onnxgrad.FeedError` names every
        input that does not. The element type must be the input's, but for a host array that converts with no
        value changed (int32 labels to int64: converted, one :class:`~onnxgrad.FeedConversionWarning` per
        input); float64 images for a float32 model are refused, as PyTorch refuses them, not rounded. The step
        reads back three scalars (loss, the finiteness verdict, the gradient norm); parameters and optimizer
        state stay on the device.
        """
        spec = self.spec
        rate = self.lr if lr is None else lr
        if not isinstance(rate, (int, float, np.floating, np.integer)) or not math.isfinite(rate) or rate < 0:
            raise OnnxGradError(f"step: the learning rate must be a finite number >= 0, got {rate!r}; "
                                "nothing was changed")
        data = self._data(feeds, self._declared, "step")
        if self._link is not None:
            self._link.check()
        if self._split:
            return self._split_step(data, rate, samples)
        if self._micro < spec.accumulation_steps - 1:
            return self._accumulate_step(data)
        # a poisoned window (a non-finite micro-batch, on_nonfinite="skip") is not applied: the outputs
        # updated in place go to scratch buffers
        io_ = self._train_binding(discard=self._poisoned)
        self._bind_data(io_, data)
        io_.bind_cpu_input(spec.lr, np.array(rate, np.float32))
        io_.bind_cpu_input(spec.step, np.array(self.step_count + 1, np.int64))
        if spec.accumulation_steps > 1:
            for name, ov in self._acc_source().items():
                io_.bind_ortvalue_input(name, ov)
        loss, finite, self.last_grad_norm = self._run_step(self._train, io_, (spec.loss, spec.finite, spec.grad_norm))
        poisoned, self._poisoned, self._micro, self._acc_valid = self._poisoned, False, 0, False
        if finite and not poisoned:
            self._parity = 1 - self._parity       # the outputs become the current values
            self.step_count += 1
            self._to_module(batches=1)
            return loss
        self._not_finite(loss, "the update was not applied")
        return loss

    # -- data parallel: backward | all-reduce | update --------------------------------------------------
    def _split_buffers(self) -> None:
        """The buckets: ``_reduced`` (the update's input, summed in place), and for accumulation two
        running sums and a zero one."""
        sp = self._split
        zeros = {b.name: np.zeros(b.size, helper.tensor_dtype_to_np_dtype(b.dtype)) for b in sp.buckets}
        self._reduced = {n: self._empty_like(z) for n, z in zeros.items()}
        if self.spec.accumulation_steps > 1:
            self._bucket_zero = {n: self._device_value(z) for n, z in zeros.items()}
            self._bucket_sums = [{n: self._empty_like(z) for n, z in zeros.items()} for _ in range(2)]

    def _split_step(self, data: dict[str, np.ndarray], rate: float, samples: float | None) -> float:
        sp, spec = self._split, self.spec
        weight = self._samples(data) if samples is None else samples
        if not isinstance(weight, (int, float, np.floating, np.integer)) or not weight >= 0:
            raise OnnxGradError(f"step: samples must be a number >= 0, got {samples!r}; nothing was changed")
        last = self._micro == spec.accumulation_steps - 1
        io_ = self._bind_batch(self._backward, data)
        io_.bind_cpu_input(sp.weight, np.array(weight, np.float32))
        sums = None
        if spec.accumulation_steps > 1:
            src = self._bucket_sums[self._acc_parity] if self._micro else self._bucket_zero
            sums = self._reduced if last else self._bucket_sums[1 - self._acc_parity]
            for b in sp.buckets:
                io_.bind_ortvalue_input(b.acc, src[b.name])
        for b in sp.buckets:
            io_.bind_ortvalue_output(b.name, (sums or self._reduced)[b.name])
        (loss,) = self._run_step(self._backward, io_, (sp.local_loss,))
        if not last:
            self._micro += 1
            self._acc_parity = 1 - self._acc_parity
            if math.isfinite(loss):       # this micro-batch's running statistics become the current ones
                for name in spec.buffers:
                    self._sets[0][name], self._sets[1][name] = self._sets[1][name], self._sets[0][name]
                if spec.buffers:
                    self._bindings = None
                self._to_module(batches=1)
            return loss
        self._engine.all_reduce(list(self._reduced.values()))          # the sum over the workers, in place
        io_ = self._train_binding()
        io_.bind_cpu_input(spec.lr, np.array(rate, np.float32))
        io_.bind_cpu_input(spec.step, np.array(self.step_count + 1, np.int64))
        loss, finite, self.last_grad_norm = self._run_step(self._train, io_, (spec.loss, spec.finite, spec.grad_norm))
        self._micro = 0
        if finite:     # the same on every worker: it reads the same sums
            spare = self._sets[1 - self._parity]          # this update's running statistics
            floats = [spare[n] for n in spec.buffers if np.dtype(self._layout[n][1]).kind == "f"]
            if floats:
                self._engine.all_reduce(floats, average=True)
            self._parity = 1 - self._parity
            self.step_count += 1
            self._to_module(batches=1)
            return loss
        self._not_finite(loss, "the update was not applied on any worker")
        return loss

    def _samples(self, data: dict[str, np.ndarray]) -> int:
        """The leading dimension of the first batched data input: this shard's number of samples."""
        for name in self.spec.data_inputs:
            shape = _shape(data[name])
            if shape:
                return int(shape[0])
        raise OnnxGradError("step: no input has a batch dimension to count this shard's samples; "
                            "pass samples= (this shard's weight in the global mean)")

    def barrier(self) -> None:
        """Data parallel: return when every worker has reached it (after rank 0's :meth:`save`, say)."""
        if self._engine is not None:
            self._engine.barrier()

    @property
    def _cur(self) -> dict[str, Any]:
        return self._sets[self._parity]

    def _set_current(self, name: str, values: np.ndarray) -> None:
        """Give a tensor new values (restore, load_parameters): the module's memory where it is the current
        buffer (``module=``: a linked tensor is updated in place, so both sets always hold that one buffer),
        else a new buffer, and the prebuilt bindings are rebuilt."""
        if name in self._linked:
            np.copyto(self._link.arrays[name], values)
            return
        value = self._device_value(values)
        self._sets[self._parity][name] = value
        if name in self._inplace:
            self._sets[1 - self._parity][name] = value
        self._bindings = None

    def _to_module(self, batches: int = 0) -> None:
        """``module=``: the current values the step wrote outside the module's memory copied there (a tensor
        not updated in place), and ``batches`` more counted by its batch norms."""
        if self._link is None:
            return
        for name, array in self._link.arrays.items():
            current = self._cur[name]
            if current is not self._linked.get(name):
                np.copyto(array, current.numpy())
        self._link.count_batches(batches)

    def _train_outputs(self) -> dict[str, str]:
        """Input -> output names of what the graph that updates writes."""
        outputs = self._outputs()
        if self._split:           # the update graph: buckets in; running statistics are the backward's
            outputs = {i: o for i, o in outputs.items() if i not in self.spec.buffers}
        return outputs

    def _in_place(self) -> set[str]:
        """The tensors every graph that writes them can update in their own buffer."""
        train = self._split.update if self._split else self.artifacts.train
        names = A.in_place(train, self._train_outputs(), self.spec.finite)
        if self._accumulate_model() is not None:     # it writes the running statistics too
            buffers = {r: o for r, (_, o) in self.spec.buffers.items()}
            names -= set(buffers) - A.in_place(self.artifacts.accumulate, buffers, self.spec.finite)
        return names

    def _accumulate_model(self) -> onnx.ModelProto | None:
        return self.artifacts.accumulate if not self._split else None

    def _train_binding(self, discard: bool = False):
        """The IOBinding reading the current set and writing the other (or in place), with the loss scalars
        bound; ``discard``: one whose in-place outputs go to scratch buffers, so that nothing changes."""
        if self._bindings is None or discard:
            spec, outputs = self.spec, self._train_outputs()
            bindings = []
            for k in (0, 1):
                if discard and k != self._parity:
                    bindings.append(None)
                    continue
                io_ = self._train.io_binding()
                for name, ov in self._sets[k].items():
                    if not (self._split and name in spec.buffers):
                        io_.bind_ortvalue_input(name, ov)
                for inp, out in outputs.items():
                    scratch = discard and inp in self._inplace
                    io_.bind_ortvalue_output(out, self._empty(inp) if scratch else self._sets[1 - k][inp])
                for name, ov in (self._reduced.items() if self._split else ()):
                    io_.bind_ortvalue_input(name, ov)
                for p, out in spec.grads.items():
                    io_.bind_ortvalue_output(out, self._grad_bufs[p])
                bindings.append(io_)      # the scalars are bound by _run_step, last
            if discard:
                return bindings[self._parity]
            self._bindings = bindings
        return self._bindings[self._parity]

    def _bind_batch(self, session, data: dict[str, np.ndarray]):
        """An IOBinding of ``session`` reading the batch and the parameters, writing the running statistics
        into the spare set of buffers (what the backward-only runs share)."""
        spec = self.spec
        io_ = session.io_binding()
        self._bind_data(io_, data)
        for name in spec.params:
            io_.bind_ortvalue_input(name, self._cur[name])
        spare = self._sets[1 - self._parity]
        for name, (i, o) in spec.buffers.items():
            io_.bind_ortvalue_input(i, self._cur[name])
            io_.bind_ortvalue_output(o, spare[name])
        return io_

    def _accumulate_step(self, data: dict[str, np.ndarray]) -> float:
        """A micro-batch that only adds its gradients to the accumulators (no update)."""
        spec = self.spec
        io_ = self._bind_batch(self._accumulate, data)
        src = self._acc_source()
        dst = self._acc_bufs[1 - self._acc_parity]
        for i, o in spec.accumulators.values():
            io_.bind_ortvalue_input(i, src[i])
            io_.bind_ortvalue_output(o, dst[i])
        loss, finite = self._run_step(self._accumulate, io_, (spec.loss, spec.finite))
        if finite:
            self._acc_parity = 1 - self._acc_parity
            self._acc_valid = True
            for name in spec.buffers:      # this micro-batch's running statistics become the current ones
                self._sets[0][name], self._sets[1][name] = self._sets[1][name], self._sets[0][name]
            if spec.buffers:
                self._bindings = None
            self._to_module(batches=1)
        elif self.on_nonfinite == "raise":
            self._not_finite(loss, "this micro-batch was not accumulated")
        else:
            self._poisoned = True     # the update that ends this window will be skipped
        self._micro += 1
        return loss

    def _run_step(self, session, io_, scalars: Sequence[str]) -> list:
        """Run ``io_`` and read back the step's ``scalars`` (loss[, finite[, grad_norm]]): floats and the
        verdict, which :func:`_verdict` cross-checks against the loss and gradient norm.

        The scalars are bound last and afresh before every run, to the host by device, not to buffers of
        the session's: onnxruntime allocates each run's values and copies them there itself, so a value
        is one this run wrote; one it did not write cannot be read (no stale or uninitialised memory).
        The outputs are synchronised before they are read. (On CUDA the canonical guard ``If(finite)`` reads
        its condition on the host, through a copy onnxruntime makes inside the run, which is also the
        ``finite`` output: it read unwritten memory in some processes. The "cuda" target guards on the
        device instead: :mod:`onnxgrad.passes.optimize.guard`.)

        Once read, the scalars are let go at once (bound again, empty): onnxruntime allocated them in its arena,
        and held until the next step's bindings they split the blocks a step's tensors are placed in, so
        that the arena grew as the steps went (BERT's peak 338 MB for three steps, 369 from the fourth on;
        338 for every step with them let go)."""
        for name in scalars:
            io_.bind_output(name, "cpu")
        session.run_with_iobinding(io_)
        io_.synchronize_outputs()
        outputs = io_.get_outputs()[-len(scalars):]
        for name, v in zip(scalars, outputs):
            if not v.has_value():
                raise StepReadbackError(f"step {self.step_count + 1}: onnxruntime returned no value for '{name}'")
        values = [v.numpy().reshape(()).item() for v in outputs]
        del outputs
        for name in scalars:
            io_.bind_output(name, "cpu")
        loss = float(values[0])
        if len(scalars) == 1:
            return [loss]
        grad_norm = float(values[2]) if len(scalars) > 2 else None
        return [loss, _verdict(loss, bool(values[1]), grad_norm, self.step_count + 1)] + \
            ([grad_norm] if grad_norm is not None else [])

    def _bind_data(self, io_, data: Mapping[str, Any]) -> None:
        """Bind the batch: host arrays by their memory, OrtValues (those DLPack made too) where they are. A
        batch on the GPU is waited for (``synchronize_inputs``: the device finishes what its producer
        queued, a torch or CuPy stream the session's own does not follow)."""
        on_device = False
        for name, value in data.items():
            if isinstance(value, np.ndarray):
                io_.bind_cpu_input(name, value)
            else:
                io_.bind_ortvalue_input(name, value)
                on_device |= value.device_name().lower() != "cpu"
        if on_device:
            io_.synchronize_inputs()

    def _acc_source(self) -> dict[str, Any]:
        return self._acc_bufs[self._acc_parity] if self._acc_valid else self._acc_zero

    def _not_finite(self, loss: float, what: str) -> None:
        msg = (f"step {self.step_count + 1}: non-finite loss or gradient (loss {loss}, gradient norm "
               f"{self.last_grad_norm}); {what}")
        if self.on_nonfinite == "raise":
            raise NonFiniteError(msg + "; parameters and optimizer state are unchanged")
        self.skipped_steps += 1
        if self.rank == 0:               # data parallel: every worker skips, rank 0 says so
            warnings.warn(msg + " (skipped)", NonFiniteWarning, stacklevel=3)

    def eval(self, feeds: Mapping[str, Any], outputs: Sequence[str] | None = None, *,
             device_outputs: bool = False) -> dict[str, Any]:
        """Forward only, with the current weights: ``{output name: array}``.

        When ``feeds`` also hold the loss's inputs (the target), the loss is among the outputs. Feeds may be
        numpy arrays, ``onnxruntime.OrtValue``s or DLPack tensors (torch, CuPy), as for :meth:`step`.
        ``device_outputs=True``: the outputs stay on the session's device, as ``OrtValue``s (read one
        with ``.numpy()``, or hand it to torch with ``torch.from_dlpack``).
        """
        sess, inputs, params, all_outputs = self._eval_session(all(n in feeds for n in self._loss_inputs))
        data = self._data(feeds, inputs, "eval", known=set(self._loss_inputs))
        names = list(outputs) if outputs is not None else all_outputs
        unknown = [n for n in names if n not in all_outputs]
        if unknown:
            raise UnknownNameError(f"eval: {', '.join(map(repr, unknown))} not an output here "
                                   f"(outputs: {', '.join(all_outputs)})")
        io_ = sess.io_binding()
        self._bind_data(io_, data)
        cur = self._cur
        for name in params:
            io_.bind_ortvalue_input(name, cur[name])
        device, device_id = (self.device, self.device_id) if device_outputs else ("cpu", 0)
        for name in names:
            io_.bind_output(name, device, device_id)
        sess.run_with_iobinding(io_)
        io_.synchronize_outputs()
        if device_outputs:
            return dict(zip(names, io_.get_outputs()))
        return {name: np.array(v.numpy()) for name, v in zip(names, io_.get_outputs())}

    # -- weights ----------------------------------------------------------------------------------------
    def parameters(self) -> dict[str, np.ndarray]:
        """``{initializer name: array}``: the trainable parameters' current values and the frozen ones."""
        out = {}
        for init in self.artifacts.loss_model.graph.initializer:
            if init.name in self.spec.params:
                out[init.name] = np.array(self._cur[init.name].numpy())
            elif init.name in self.spec.frozen:
                out[init.name] = numpy_helper.to_array(init).copy()
        return out

    def buffers(self) -> dict[str, np.ndarray]:
        """``{initializer name: array}``: the running statistics train mode updates (empty otherwise)."""
        return {name: np.array(self._cur[name].numpy()) for name in self.spec.buffers}

    def grads(self) -> dict[str, np.ndarray]:
        """The gradients the last update used, ``{parameter: array}`` (needs ``keep_grads=True``)."""
        if not self.spec.grads:
            raise OnnxGradError("grads() needs a session built with keep_grads=True")
        return {p: np.array(v.numpy()) for p, v in self._grad_bufs.items()}

    def optimizer_state(self) -> dict[str, dict[str, np.ndarray]]:
        """``{parameter: {state name: array}}``, e.g. ``{"W": {"exp_avg": ..., "exp_avg_sq": ...}}``: PyTorch's
        values (the graph may hold them scaled: ``TrainingSpec.state_scale``)."""
        state: dict[str, dict[str, np.ndarray]] = {}
        for p, st in self.spec.state.items():
            state[p] = {}
            for s, (i, _) in st.items():
                held = self._cur[i].numpy()
                value = _rescaled(held, self._state_scale(p, s), None)
                state[p][s] = np.array(value) if value is held else value     # a copy, never the buffer
        return state

    def _state_scale(self, param: str, state: str) -> float | None:
        """The factor this graph holds the state at (None: PyTorch's value)."""
        return self.spec.state_scale.get(param, {}).get(state)

    def load_parameters(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite some trainable parameters (shapes and types must match)."""
        for name, v in values.items():
            if name not in self.spec.params:
                raise UnknownNameError(f"'{name}' is not a trainable parameter of this session")
            self._set_current(name, self._checked(name, v))
        self._to_module()

    def export(self, path: str | os.PathLike) -> None:
        """Write the forward model with the current weights (an inference model), atomically."""
        save_model(self.exported_model(), os.fspath(path))

    def exported_model(self) -> onnx.ModelProto:
        """The forward model with the current weights and running statistics; each initializer keeps its
        metadata (from_torch's requires_grad mark), so the export trains again as this session did."""
        m = onnx.ModelProto()
        m.CopyFrom(self.artifacts.forward)
        values = {**self.parameters(), **self.buffers()}
        for init in m.graph.initializer:
            if init.name in self.spec.params or init.name in self.spec.buffers:
                kept = list(init.metadata_props)
                init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
                init.metadata_props.extend(kept)
        return m

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write a checkpoint to ``path``, atomically: the state file of docs/artifacts.md (safetensors: weights,
        running statistics, optimizer state, ``lr`` and ``step`` by the training model's input names; the training
        spec) with this session's counters and options and its model, so that :meth:`load` needs nothing else and
        the JavaScript session (or any safetensors reader) can continue from it.

        The file is written beside ``path`` under a temporary name, flushed to disk
        and renamed over ``path``: a crash mid-save leaves the previous file intact.
        Data parallel: every worker holds the same state and rank 0 alone writes (the others return;
        :meth:`barrier` before another worker reads it); between the micro-batches of an update the
        workers' partial sums differ, so saving there is refused.
        """
        if self._split and self._micro:
            raise CheckpointError(f"save: {self._micro} of {self.spec.accumulation_steps} micro-batches of this "
                                  "update are accumulated and each worker's partial sum is its own; save after "
                                  "the update (when step_count changes)")
        if self.rank != 0:
            return
        spec = self.spec
        names = [*spec.params, *spec.buffers, *(i for st in spec.state.values() for i, _ in st.values())]
        tensors = {name: self._cur[name].numpy() for name in names}
        metadata = {}
        if spec.accumulation_steps > 1 and self._acc_valid:
            src = self._acc_bufs[self._acc_parity]
            tensors.update({i: src[i].numpy() for i, _ in spec.accumulators.values()})
            metadata["accumulated"] = str(self._micro)
        tensors[S.LR] = np.array(self.lr, np.float32)          # as the training model's inputs take them
        tensors[S.STEP] = np.array(self.step_count + 1, np.int64)
        model_bytes = self._stripped_model().SerializeToString()
        tensors[S.MODEL_TENSOR] = np.frombuffer(model_bytes, np.uint8)
        options = {
            "lr": self.lr,                  # exactly (the tensor holds what the model reads: float32)
            "skipped_steps": self.skipped_steps,
            "poisoned": self._poisoned,
            "loss": spec.loss,
            "frozen": spec.frozen,
            "trainable": list(spec.params),
            "train_mode": spec.train_mode,
            "keep_grads": bool(spec.grads),
            "strict_tags": self._strict_tags,
            "recompute": spec.recompute,
            "clip_grad_norm": spec.clip_grad_norm,
            "accumulation_steps": spec.accumulation_steps,
            "on_nonfinite": self.on_nonfinite,
            "optimizer": spec.optimizer,
        }
        S.write(path, tensors, {**metadata, "training": spec.to_json(), "session": json.dumps(options),
                                "model_sha256": S.fingerprint(self._stripped_model(), ())})

    @classmethod
    def load(cls, path: str | os.PathLike, providers: Sequence[Any] | None = None,
             session_options: Any = None, data_parallel: "bool | str | D.Engine" = False) -> "TrainingSession":
        """A session rebuilt from a checkpoint written by :meth:`save` (or by an earlier onnxgrad), ready to
        continue training (``data_parallel``: on every worker, from the file rank 0 wrote)."""
        state = S.read(path)
        model_bytes, options = state.model, state.session
        if model_bytes is None or not options:
            raise CheckpointError(f"'{os.fspath(path)}' holds the state but not the model (the command line and the "
                                  "JavaScript session write such files): build the session from the model and "
                                  "restore it, TrainingSession(model, loss=..., optimizer=...).restore(path)")
        model = onnx.ModelProto()
        try:
            model.ParseFromString(model_bytes)
            held = [*state.training["params"], *state.training.get("buffers", {})]
            _fill_initializers(model, {n: state.tensors[n] for n in held})
            optimizer = from_config(options["optimizer"])
        except CheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"checkpoint '{os.fspath(path)}': cannot rebuild its model: "
                                         f"{type(e).__name__}: {e}") from None
        s = cls(model, loss=options["loss"], optimizer=optimizer, providers=providers, frozen=options["frozen"],
                trainable=options.get("trainable"), train_mode=options.get("train_mode", False),
                keep_grads=options.get("keep_grads", False), clip_grad_norm=options["clip_grad_norm"],
                accumulation_steps=options["accumulation_steps"], on_nonfinite=options["on_nonfinite"],
                session_options=session_options, strict_tags=options.get("strict_tags", False),
                data_parallel=data_parallel, recompute=options.get("recompute", False))
        s._restore(state, os.fspath(path))
        return s

    def restore(self, path: str | os.PathLike) -> None:
        """Load a state file of this same model and optimizer into this session: a checkpoint of
        :meth:`save`, the command line's initial state, or a checkpoint of the JavaScript session."""
        self._restore(S.read(path), os.fspath(path))

    def _restore(self, state: S.State, path: str) -> None:
        spec, training, options = self.spec, state.training, state.session
        problems = []
        if state.metadata.get("model_sha256", "") != S.fingerprint(self._stripped_model(), ()):
            problems.append("it was saved from a different model (graph or frozen weights differ)")
        kind = training.get("optimizer", {}).get("type")
        if kind != spec.optimizer["type"]:
            problems.append(f"its optimizer is {kind}, this session's is {spec.optimizer['type']}")
        accumulated = int(state.metadata.get("accumulated", options.get("micro", 0)))
        if training.get("accumulation_steps", 1) != spec.accumulation_steps:
            problems.append(f"it accumulates over {training.get('accumulation_steps', 1)} micro-batches, "
                            f"this session over {spec.accumulation_steps}")
        elif self._split and accumulated:
            problems.append(f"it was saved after {accumulated} micro-batches of an update, and a "
                            "data-parallel session resumes at an update boundary")
        saved_state = {i: (p, s) for p, st in training.get("state", {}).items() for s, (i, _) in st.items()}
        saved_scale = training.get("state_scale", {})
        accumulators = {i for i, _ in spec.accumulators.values()}
        values: dict[str, np.ndarray] = {}
        accs: dict[str, np.ndarray] = {}
        for name, a in state.tensors.items():
            if name in (S.MODEL_TENSOR, S.LR, S.STEP):
                continue
            if name in saved_state:
                p, s = saved_state[name]
                mine = spec.state.get(p, {}).get(s)
                if mine is None:
                    problems.append(f"it holds state '{s}' of '{p}', unknown here")
                else:
                    values[mine[0]] = _rescaled(a, saved_scale.get(p, {}).get(s), self._state_scale(p, s))
            elif name in accumulators:
                accs[name] = a
            elif name in self._cur:
                values[name] = a
            else:
                problems.append(f"it holds '{name}', which this session does not train")
        missing = [n for n in self._cur if n not in values]
        if missing:
            problems.append(f"it lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        for name, a in values.items():
            ref = self._layout[name]
            if tuple(a.shape) != ref[0] or a.dtype != ref[1]:
                problems.append(f"'{name}' is {a.dtype}{list(a.shape)} there, {ref[1]}{list(ref[0])} here")
        if problems:
            raise CheckpointMismatchError(f"checkpoint '{path}' does not fit this session: " + "; ".join(problems))
        for name, a in values.items():
            self._set_current(name, a)
        self._to_module()
        self.step_count = int(state.tensors[S.STEP]) - 1
        lr = state.tensors[S.LR]           # what the model reads; the Python float it was, while it still is
        self.lr = options["lr"] if "lr" in options and np.float32(options["lr"]) == lr else float(lr)
        self.skipped_steps = int(options.get("skipped_steps", 0))
        self._micro = accumulated if accs else 0
        self._poisoned = bool(options.get("poisoned", False))
        if spec.accumulation_steps > 1:
            self._acc_parity, self._acc_valid = 0, bool(accs)
            for name, a in accs.items():
                self._acc_bufs[0][name] = self._device_value(a)

    # -- helpers ------------------------------------------------------------------------------------------
    def _device_session(self, model: onnx.ModelProto, explicit: bool):
        """The session of the graph that updates, on the device the first provider names. A GPU session that
        cannot be built, or that onnxruntime builds without the GPU provider (it falls back to the CPU with
        a logged warning), raises :class:`DeviceError` when the providers were the caller's; with the
        default providers the session trains on the CPU and :class:`DeviceFallbackWarning` says why."""
        first = provider_name(self._providers[0])
        try:
            sess = self._session(model)
        except Exception as e:
            if first not in _GPU_PROVIDERS:
                raise
            sess, reason = None, f"building the session failed: {type(e).__name__}: {e}"
        else:
            used = sess.get_providers()
            if first not in _GPU_PROVIDERS or used[:1] == [first]:
                return sess
            reason = (f"onnxruntime built the session without {first} (it runs {', '.join(used)}; this "
                      f"onnxruntime offers {', '.join(self._ort.get_available_providers())})")
        if explicit or self._engine is not None:      # data parallel: the workers' collectives are the GPU's
            raise DeviceError(f"{first}: {reason}. Fix the CUDA install (pip install \"onnxgrad[cuda]\", a "
                              "visible GPU, the CUDA and cuDNN libraries onnxruntime-gpu names), or pass "
                              "providers=['CPUExecutionProvider'] to train on the CPU") from None
        warnings.warn(f"training on the CPU, not on the GPU: {first}: {reason}. Pass providers= to choose "
                      "(an explicit CUDA provider raises instead of falling back)", DeviceFallbackWarning,
                      stacklevel=3)
        self._providers = ["CPUExecutionProvider"]
        return self._session(model)

    def _session(self, model: onnx.ModelProto):
        ort = self._ort
        opts = self._options
        if opts is None:
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
        # onnxruntime's memory pattern places a run's intermediates in one block planned from the first
        # run, allocated beside the blocks that first run left in the arena: a training step then holds
        # its activations twice (ResNet-18: 420 MB peak with it, 321 MB without, the step as fast)
        opts.enable_mem_pattern = False
        key, limit = FOLDED_CONSTANT_LIMIT
        try:
            opts.get_session_config_entry(key)          # the caller's own limit stays
        except RuntimeError:
            opts.add_session_config_entry(key, limit)
        # onnxruntime's common-subexpression elimination would merge recomputed activations back into
        # the forward nodes they copy (onnxgrad.passes.recompute)
        disabled = list(ORT_DISABLED_OPTIMIZERS) if self.spec.recompute else None
        with runnable(model, by_path=True) as source:     # by path: onnxruntime keeps no copy of the bytes
            return ort.InferenceSession(source, opts, providers=self._providers, disabled_optimizers=disabled)

    def _eval_session(self, with_loss: bool) -> tuple[Any, dict[str, F.Declared], list[str], list[str]]:
        """(session, its data inputs as declared, its parameter inputs, its outputs), built on first use."""
        if with_loss not in self._evals:
            model = self.artifacts.eval_with_loss() if with_loss else self.artifacts.eval
            sess = self._session(model)
            names = [i.name for i in sess.get_inputs()]
            held = set(self.spec.params) | set(self.spec.buffers)
            self._evals[with_loss] = (sess, F.declared_inputs(model, [n for n in names if n not in held]),
                                      [n for n in names if n in held], [o.name for o in sess.get_outputs()])
        return self._evals[with_loss]

    def _outputs(self) -> dict[str, str]:
        """Input -> output names of everything the train graph updates."""
        out = dict(self.spec.params)
        out.update({name: o for name, (_, o) in self.spec.buffers.items()})
        for st in self.spec.state.values():
            out.update({i: o for i, o in st.values()})
        return out

    def _device_value(self, arr: np.ndarray):
        """A buffer of the session's own holding ``arr``'s values (a copy: the caller's array is never
        written by the updates)."""
        arr = np.array(arr, copy=True, order="C")
        return self._ort.OrtValue.ortvalue_from_numpy(arr, self.device, self.device_id)

    def _adopt(self, arr: np.ndarray):
        """A buffer holding ``arr``, an array the artifacts made and hand over to the session: on the CPU
        its memory itself when it is writable and its own (optimizer state fresh from ``np.zeros``, whose
        pages take memory only when the first update writes them), else a copy."""
        if self.device == "cpu" and arr.flags.writeable and arr.flags.c_contiguous and arr.flags.owndata:
            return self._ort.OrtValue.ortvalue_from_numpy(arr, self.device, self.device_id)
        return self._device_value(arr)

    def _empty(self, name: str):
        """An uninitialised device buffer of the shape and type of the held tensor ``name``."""
        shape, dtype = self._layout[name]
        return self._ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, self.device_id)

    def _zeros(self, name: str):
        shape, dtype = self._layout[name]
        return self._device_value(np.zeros(shape, dtype))

    def _empty_like(self, arr: np.ndarray):
        return self._ort.OrtValue.ortvalue_from_shape_and_type(list(arr.shape), arr.dtype, self.device,
                                                               self.device_id)

    def _dtype_of(self, output: str, model: onnx.ModelProto | None = None) -> np.dtype:
        for o in (model or self._split and self._split.update or self.artifacts.train).graph.output:
            if o.name == output:
                return np.dtype(helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type))
        return np.dtype(np.float32)

    def _checked(self, name: str, v: np.ndarray) -> np.ndarray:
        shape, dtype = self._layout[name]
        v = np.asarray(v)
        if v.shape != shape:
            raise OnnxGradError(f"'{name}' has shape {list(shape)}, got {list(v.shape)}")
        return v.astype(dtype, copy=False)

    def _data(self, feeds: Mapping[str, Any], declared: Mapping[str, F.Declared], what: str,
              known: set[str] | None = None) -> dict[str, Any]:
        """The batch for a run of a graph whose data inputs are ``declared``: every name known, none missing,
        each value fitting its input (:func:`onnxgrad.training.feeds.check`), host arrays converted where no
        value changes (said once per input), labels in range."""
        names = list(declared)
        known = set(known or ()) | set(names) | set(self.spec.data_inputs)
        unknown = [k for k in feeds if k not in known]
        if unknown:
            verb, it = ("is not an input", "it") if len(unknown) == 1 else ("are not inputs", "them")
            raise UnknownNameError(f"{what}: {', '.join(map(repr, unknown))} {verb} of the model (its inputs: "
                                   f"{', '.join(sorted(known))}); remove {it} or correct the name")
        missing = [n for n in names if n not in feeds]
        if missing:
            raise UnknownNameError(f"{what}: missing input(s) {', '.join(map(repr, missing))}: the model needs "
                                   f"{', '.join(names)}")
        out = {n: self._taken(n, feeds[n]) for n in names}
        for name, dtype in F.check(out, declared, what).items():
            if name not in self._converted:
                self._converted.add(name)
                warnings.warn(f"{what}: '{name}' is {out[name].dtype} and the model takes {dtype}: converted, "
                              f"no value changes; pass {dtype} to spare the copy (said once)",
                              FeedConversionWarning, stacklevel=3)
            out[name] = out[name].astype(dtype)
        L.check_labels(self._class_targets, out, what)
        return out

    def _taken(self, name: str, value: Any) -> Any:
        """A contiguous host array of ``value``, or an OrtValue where the value is one or is a DLPack tensor (a
        torch or CuPy tensor): taken where it lies, never through the host."""
        if _is_device_value(value, self._ort):
            return self._device_input(name, value)
        return np.ascontiguousarray(value)

    def _device_input(self, name: str, value: Any):
        """``value``, an OrtValue, or a DLPack tensor wrapped as one without a copy, on the host or this session's
        device (its shape and type are checked with the rest of the batch)."""
        ort = self._ort
        if not isinstance(value, ort.OrtValue):
            if not hasattr(ort.OrtValue, "from_dlpack"):
                raise OnnxGradError(f"input '{name}': this onnxruntime ({ort.__version__}) cannot take a DLPack "
                                    f"tensor ({type(value).__name__}); pass an onnxruntime.OrtValue or a numpy array")
            try:
                value = ort.OrtValue.from_dlpack(value)
            except Exception as e:
                raise OnnxGradError(f"input '{name}': onnxruntime cannot take this {type(value).__name__} through "
                                    f"DLPack ({type(e).__name__}: {e}); pass a contiguous tensor of a numeric type "
                                    "(torch: .detach().contiguous()), or a numpy array") from None
        where = value.device_name().lower()
        if where != "cpu" and where != self.device:
            raise OnnxGradError(f"input '{name}' is on {where} and this session runs on {self.device}; "
                                "pass it on the host or on the session's device")
        return value

    def _stripped_model(self) -> onnx.ModelProto:
        """The loss model with the trained tensors' data left out (they are stored as arrays)."""
        return self.artifacts.loss_model      # the session dropped their data when it was built

    def __repr__(self) -> str:
        return (f"TrainingSession({len(self.spec.params)} parameters, {type(self.optimizer).__name__}, "
                f"lr={self.lr}, step_count={self.step_count}, device={self.device})")


def _release_freed_memory() -> None:
    """Give the memory building the session freed back to the operating system (glibc's ``malloc_trim``).

    Building copies the model's protos and weights several times; glibc keeps the freed blocks
    (protobuf's arenas, numpy temporaries under its mmap threshold) in the process's heap, where the
    training loop's onnxruntime and device buffers do not reuse them: ResNet-18's process held 217 MB
    above its start after building, 44 MB (its weights) once trimmed. A no-op off glibc."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):        # musl and other C libraries: nothing to trim
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _rescaled(value: np.ndarray, held_at: float | None, wanted: float | None) -> np.ndarray:
    """``value``, a state tensor held at scale ``held_at`` (None: PyTorch's value), at scale ``wanted``;
    ``value`` itself when the scales agree (a checkpoint of this configuration resumes bit for bit)."""
    if held_at == wanted:
        return value
    if held_at is not None:
        value = value / value.dtype.type(held_at)
    return value if wanted is None else value * value.dtype.type(wanted)


def _without_data(model: onnx.ModelProto, held: Mapping[str, Any]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``held`` (the session's buffers hold them) keep their
    names, types and shapes but no data, built field by field. Clearing the fields in place is not enough:
    protobuf (upb) keeps a message's bytes in its arena until the whole message goes, so ResNet-18's
    loss and forward models went on holding 85 MB of weights that no one could read."""
    return stripped(model, lambda t: NO_DATA if t.name in held else None)


# -- files ----------------------------------------------------------------------------------------------
def _verdict(loss: float, finite: bool, grad_norm: float | None, step: int) -> bool:
    """Whether a step's loss and gradients are finite: the graph's ``finite`` output, which it computes as
    ``isfinite(loss + sum of squared gradients)``, checked against the loss and ``grad_norm`` (the square
    root of that sum) it came with. They agree but where ``loss + grad_norm**2`` overflows (finite parts,
    a non-finite sum); any other disagreement means a value read back is not the run's, and raises
    :class:`StepReadbackError` rather than apply or refuse a step on it. Without ``grad_norm`` (an
    accumulating micro-batch) only a finite verdict on a non-finite loss is a contradiction."""
    from_values = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
    if finite == from_values or (not finite and grad_norm is None):
        return finite
    if not finite and abs(loss) + grad_norm ** 2 > _OVERFLOW:
        return False
    raise StepReadbackError(
        f"step {step}: the step's scalars contradict each other: finite={finite} with loss {loss}"
        + (f" and gradient norm {grad_norm}" if grad_norm is not None else "")
        + "; the runtime returned a value the graph did not compute, so whether the update was applied is "
        "unknown: restore the last checkpoint (or rebuild the session) and report this with your onnxruntime "
        "version and providers")


_OVERFLOW = 1e38        # float32's largest is 3.4e38: a finite loss + sum of squares at least this large may not be


def _is_device_value(value: Any, ort: Any) -> bool:
    """An OrtValue, or a tensor of another library through DLPack (a numpy array has ``__dlpack__`` too: it
    stays on the array path, as do Python numbers and lists)."""
    if isinstance(value, ort.OrtValue):
        return True
    return (not isinstance(value, (np.ndarray, np.generic)) and hasattr(value, "__dlpack__")
            and hasattr(value, "__dlpack_device__"))


def _shape(value: Any) -> tuple[int, ...]:
    """The shape of a host array or an OrtValue."""
    return tuple(value.shape()) if callable(getattr(value, "shape", None)) else tuple(np.shape(value))


def _device_of(sess: Any) -> tuple[str, int]:
    """Where the session's first execution provider keeps tensors: ("cuda", id) or ("cpu", 0)."""
    used = sess.get_providers()
    if used and used[0] in _GPU_PROVIDERS:
        options = sess.get_provider_options().get(used[0], {})
        return "cuda", int(options.get("device_id", 0) or 0)
    return "cpu", 0


def _fill_initializers(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> None:
    present = {i.name for i in model.graph.initializer}
    missing = [n for n in values if n not in present]
    if missing:
        raise CorruptCheckpointError(f"checkpoint holds parameters its model does not have: {', '.join(missing)}")
    for init in model.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(np.asarray(values[init.name]), init.name))

