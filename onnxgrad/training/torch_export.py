"""Export a ``torch.nn.Module`` for training as PyTorch trains it: :func:`from_torch`.

The exporters' defaults suit inference, not training: the dynamo exporter's optimizer (``optimize=True``)
folds BatchNorm into the convolutions and merges parameters that happen to hold equal values, and an
export made after ``model.eval()`` has no Dropout. :func:`from_torch` exports with ``torch.export``
(``dynamo=True``) and no optimizer, so every parameter stays one tensor under its PyTorch name, and with
the module in train mode, so BatchNormalization and Dropout nodes are there for the training session's
train mode (:mod:`onnxgrad.training.train_mode`) and inference (``eval()``, ``export()``) alike. It records what
the graph alone cannot say: which parameters PyTorch does not train (``requires_grad=False``) and the
module's own mode.

What the exporter makes of train mode (torch 2.13): a BatchNorm becomes
``aten._native_batch_norm_legit_functional`` and an ONNX BatchNormalization in its inference form (the
running-statistics updates, outputs of the exported program, are dropped), which the session's train mode
switches to batch statistics and running-statistics updates as it does for any export; a Dropout becomes an
ONNX Dropout with ``training_mode`` true, which the session turns off for ``eval()`` and ``export()``. An
export in eval mode would lose the Dropout nodes and gain nothing.

torch is an optional extra (``pip install "onnxgrad[torch]"``); it is imported here, on the call.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import warnings
from typing import Any, Iterator, Mapping

import onnx

from ..errors import OnnxGradError
from ..ir import model as M
from ..passes.params import FROM_TORCH_KEY, NO_GRADIENT_KEY, REQUIRES_GRAD_KEY

__all__ = ["from_torch", "TorchExportError", "FROM_TORCH_KEY", "TORCH_TRAINING_KEY"]

TORCH_TRAINING_KEY = "onnxgrad.torch_training"      # model metadata: "true" / "false", the module's mode

# exporter options training depends on: the value from_torch uses, and why another value would break training
_FIXED = {
    "dynamo": (True, "the TorchScript exporter folds BatchNorm into convolutions in eval mode and merges "
                     "parameters of equal values"),
    "optimize": (False, "the exporter's optimizer folds BatchNorm into the convolutions and merges parameters "
                        "that hold equal values (zero biases, LayerNorm weights of 1), which then train as one"),
}
# options that have no place here, and what to do instead
_REFUSED = {
    "f": "from_torch returns the model; save it with onnx.save(model, path) (or train it first)",
    "training": "the deprecated TorchScript option; put the module in the mode to train in "
                "(module.train() or module.eval()) before the call",
    "export_params": "training needs the parameters in the model",
    "keep_initializers_as_inputs": "the training session decides which initializers are inputs",
}


class TorchExportError(OnnxGradError):
    """A module cannot be exported for training as given: torch is missing, an option would break
    training, or the module holds a layer whose training onnxgrad cannot reproduce."""


def from_torch(module: Any, args: Any, kwargs: Mapping[str, Any] | None = None, *,
               dynamic_batch: bool = False, **options: Any) -> onnx.ModelProto:
    """Export ``module`` (a ``torch.nn.Module``) called on ``args`` / ``kwargs`` for training.

    The model trains in :class:`onnxgrad.TrainingSession` as PyTorch trains the module: every parameter
    one initializer named as in ``module.named_parameters()``, BatchNormalization unfolded with its
    running statistics, Dropout nodes present (exported in train mode, the module's modes restored
    after), parameters with ``requires_grad=False`` marked so that :func:`onnxgrad.parameters` leaves
    them out. ``train_mode=True`` in the session then steps as ``module.train()``, ``False`` as
    ``module.eval()``; the model's metadata records the module's own mode (``onnxgrad.torch_training``).

    ``dynamic_batch=True``: the first axis of every tensor argument is a dimension named ``batch``.
    ``options`` go to ``torch.onnx.export`` (``dynamic_shapes``, ``opset_version``, ``input_names``, ...)
    except those training depends on: ``dynamo`` and ``optimize`` are set here, and a value that would
    break training is refused with the reason.
    """
    torch = _import_torch()
    if not isinstance(module, torch.nn.Module):
        raise TorchExportError(f"from_torch exports a torch.nn.Module, got {type(module).__name__}")
    _check_options(options)
    if dynamic_batch:
        if "dynamic_shapes" in options or "dynamic_axes" in options:
            raise TorchExportError("dynamic_batch=True builds dynamic_shapes itself: pass either it or "
                                   "dynamic_shapes/dynamic_axes, not both")
        options["dynamic_shapes"] = _batch_shapes(module, args, kwargs, torch)
    _check_batch_norms(module, torch)
    training = module.training
    args = args if isinstance(args, tuple) else (args,)
    options.setdefault("verbose", False)
    with _train_mode(module), _quiet():
        try:
            program = torch.onnx.export(module, args, kwargs=dict(kwargs) if kwargs else None,
                                        **{**options, **{k: v for k, (v, _) in _FIXED.items()}})
        except torch.onnx.OnnxExporterError as e:
            raise TorchExportError(f"from_torch: torch.onnx.export could not export {type(module).__name__}: "
                                   f"{_summary(str(e))}; the module must export with torch.export (see its "
                                   "report in the exception this one chains)") from e
    model = program.model_proto
    _mark_untrained(model, module)
    M.set_metadata(model, {FROM_TORCH_KEY: torch.__version__, TORCH_TRAINING_KEY: "true" if training else "false"})
    gradless = _gradless_missing(model, module, args, kwargs, torch)
    if gradless:
        M.set_metadata(model, {NO_GRADIENT_KEY: json.dumps(gradless)})
    return model


def _import_torch() -> Any:
    """torch, with onnxscript beside it (torch.onnx's dynamo exporter imports it when it exports); what is
    missing is named, with the command that installs both."""
    found, missing = {}, []
    for name in ("torch", "onnxscript"):
        try:
            found[name] = importlib.import_module(name)
        except ImportError as e:
            missing.append(name if e.name in (name, None) else f"{name} (it cannot import {e.name})")
    if missing:
        raise TorchExportError(f"from_torch needs torch and onnxscript (torch.onnx's exporter), and "
                               f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: "
                               f'pip install "onnxgrad[torch]" installs both')
    return found["torch"]


def _summary(report: str) -> str:
    """The exporter's exception summary out of its markdown report, on one line."""
    text = report.split("## Exception summary", 1)[-1].split("(Refer to the full stack trace", 1)[0]
    text = " ".join(text.split())
    return text if len(text) <= 600 else text[:600] + " ..."


def _check_options(options: Mapping[str, Any]) -> None:
    for name, (value, why) in _FIXED.items():
        if name in options and options[name] != value:
            raise TorchExportError(f"from_torch: {name}={options[name]!r} would break training ({why}); "
                                   f"from_torch exports with {name}={value!r}: leave the option out")
    for name, what_to_do in _REFUSED.items():
        if name in options:
            raise TorchExportError(f"from_torch: option {name}= is not taken: {what_to_do}")


def _batch_shapes(module: Any, args: Any, kwargs: Mapping[str, Any] | None, torch: Any) -> dict[str, Any]:
    """``dynamic_shapes`` by forward-argument name: axis 0 of every tensor is ``batch``, nothing else moves."""
    bound = inspect.signature(module.forward).bind(*(args if isinstance(args, tuple) else (args,)),
                                                   **dict(kwargs or {}))
    return {name: _batch_axis(value, torch) for name, value in bound.arguments.items()}


def _batch_axis(value: Any, torch: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {0: "batch"} if value.dim() > 0 else None
    if isinstance(value, (list, tuple)):
        return type(value)(_batch_axis(v, torch) for v in value)
    if isinstance(value, dict):
        return {k: _batch_axis(v, torch) for k, v in value.items()}
    return None


def _check_batch_norms(module: Any, torch: Any) -> None:
    """BatchNorm layers train in the session as ``torch.nn.BatchNorm`` with running statistics and a
    momentum; the others would train differently without a word, so they are refused."""
    norms = [(name, m) for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for name, m in norms:
        if not m.track_running_stats:
            raise TorchExportError(f"from_torch: BatchNorm '{name}' has track_running_stats=False (batch statistics "
                                   "in eval mode too), which an ONNX BatchNormalization cannot express; use "
                                   "track_running_stats=True, or a GroupNorm/InstanceNorm")
        if m.momentum is None:
            raise TorchExportError(f"from_torch: BatchNorm '{name}' has momentum=None (a cumulative average of the "
                                   "running statistics), which onnxgrad's train mode does not reproduce (it updates "
                                   "them with a fixed momentum); give the layer a momentum (PyTorch's default 0.1)")
    modes = {m.training for _, m in norms} | {
        m.training for _, m in module.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)}
    if len(modes) > 1:
        raise TorchExportError("from_torch: the module's BatchNorm and Dropout layers are in different modes (some "
                               "train, some eval); the training session runs all of them in one mode "
                               "(train_mode=True as module.train(), False as module.eval()): call module.train() or "
                               "module.eval() first")


@contextlib.contextmanager
def _train_mode(module: Any) -> Iterator[None]:
    """The module in train mode, and every submodule's own mode back afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter's warning about exporting in train mode (intended here), its progress lines and
    torch's internal deprecation notices."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Exporting a model while it is in training mode")
            # torch.export's own deprecation notice, which no user code causes
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def _mark_untrained(model: onnx.ModelProto, module: Any) -> None:
    """Each initializer holding a parameter PyTorch does not train gets ``onnxgrad.requires_grad=false``."""
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    for init in model.graph.initializer:
        if init.name in frozen:
            M.set_metadata(init, {REQUIRES_GRAD_KEY: "false"})


def _gradless_missing(model: onnx.ModelProto, module: Any, args: tuple, kwargs: Mapping[str, Any] | None,
                      torch: Any) -> list[str]:
    """The module's parameters the graph does not hold that get no gradient in PyTorch either: frozen
    (``requires_grad=False``) or unused by the forward (peft's ``original_module`` beside the copy
    ``modules_to_save`` trains). Training them nowhere is what PyTorch does, so they change nothing; a missing
    parameter that does get a gradient is one the exporter lost. Told by one forward and ``autograd.grad`` on
    the example arguments, run only when a parameter is missing (the module's RNG and buffers are left as
    they were)."""
    held = {init.name for init in model.graph.initializer}
    in_graph = {id(p) for name, p in module.named_parameters(remove_duplicate=False) if name in held}
    missing = [(name, p) for name, p in module.named_parameters() if id(p) not in in_graph]
    trained = [(name, p) for name, p in missing if p.requires_grad]
    grads = _torch_gradients(module, args, kwargs, [p for _, p in trained], torch) if trained else []
    used = {name for (name, _), g in zip(trained, grads) if g is not None}
    return [name for name, _ in missing if name not in used]


def _torch_gradients(module: Any, args: tuple, kwargs: Mapping[str, Any] | None, params: list, torch: Any) -> list:
    """The gradients of the sum of the module's float outputs (in train mode, as exported) with respect to
    ``params``: None for each that the outputs do not depend on."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        with _train_mode(module), torch.random.fork_rng(), torch.enable_grad():
            outputs = module(*args, **dict(kwargs or {}))
            leaves = [t for t in torch.utils._pytree.tree_leaves(outputs)
                      if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
            if not leaves:
                return [None] * len(params)
            return list(torch.autograd.grad(sum(t.sum() for t in leaves), params, allow_unused=True))
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
