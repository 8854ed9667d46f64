"""A torch module trained in place by a session: ``TrainingSession(from_torch(net, x), ..., module=net)``.

``torch.optim`` updates the module's own tensors, so a PyTorch step holds the weights once and ``net`` is the
trained model after it. A session given ``module=`` does the same on the CPU: each parameter and running
statistic it trains is bound to the memory of the module's tensor of that name (the names :func:`from_torch`
keeps), so the update writes there, and the copy the session would hold beside the module's is never made.
A tensor the step writes elsewhere (one that is not updated in place: a spare buffer's turn) is copied back
after the step; the batch norms' ``num_batches_tracked`` count the batches whose running statistics the
session applied, as ``model.train()`` counts its forwards. A tensor the module replaced since (``module.to()``,
``p.data = ...``) is found before the next step, which raises.

The link is checked before the first step, or refused with the way out: every trained tensor must be the
module's, on the CPU, contiguous, of the same type, shape and values (a module changed since its export, or
another module, is not taken for it), and no two of them one tensor.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import OnnxGradError

__all__ = ["ModuleLink", "link"]

_WAY_OUT = "or leave module= out and copy session.parameters() into the module yourself"


class ModuleLink:
    """``arrays``: session tensor name -> the module tensor's memory as a numpy array; ``batch_counts``: the
    ``num_batches_tracked`` of the batch norms whose running statistics the session trains; ``tensors``: name
    -> the module's tensor, whose memory :meth:`check` finds still there."""

    def __init__(self, arrays: dict[str, np.ndarray], batch_counts: list[np.ndarray], tensors: dict[str, Any]):
        self.arrays = arrays
        self.batch_counts = batch_counts
        self.tensors = tensors
        self._addresses = {name: t.data_ptr() for name, t in tensors.items()}

    def check(self) -> None:
        """Raise before a step when a module tensor no longer has the memory the session trains: replaced
        since the build (``module.to(...)``, ``module.half()``, ``p.data = ...``), so that the session's
        updates would no longer reach the module."""
        for name, t in self.tensors.items():
            if t.data_ptr() != self._addresses[name]:
                raise OnnxGradError(f"module=: the module's '{name}' was replaced since the session was built "
                                    f"(module.to(), .half(), p.data = ...), so the session's updates would not "
                                    f"reach it; nothing was changed: build the session again from the module as "
                                    f"it is now (write into the tensors in place, load_state_dict, to keep them)")

    def count_batches(self, batches: int) -> None:
        for count in self.batch_counts:
            count += batches


def link(module: Any, values: Mapping[str, np.ndarray], running: Iterable[str]) -> ModuleLink:
    """The link of the session tensors ``values`` (name -> starting value) to ``module``'s tensors of those
    names; ``running``: the names among them that are running statistics."""
    if not (hasattr(module, "named_parameters") and hasattr(module, "named_buffers")):
        raise OnnxGradError(f"module= takes the torch.nn.Module the model was exported from, got "
                            f"{type(module).__name__}: pass that module, {_WAY_OUT}")
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    arrays: dict[str, np.ndarray] = {}
    holders: dict[int, str] = {}
    for name, value in values.items():
        t = tensors.get(name)
        if t is None:
            raise OnnxGradError(f"module=: the session trains '{name}', which the module has no parameter or buffer "
                                f"named; pass the module from_torch exported this model from, {_WAY_OUT}")
        where = f"module=: the module's '{name}'"
        if t.device.type != "cpu" or t.is_sparse:
            raise OnnxGradError(f"{where} is on {t.device}; a session shares CPU tensors only: move the module "
                                f"to the CPU (module.cpu()), {_WAY_OUT}")
        if not t.is_contiguous():
            raise OnnxGradError(f"{where} is not contiguous, so its memory cannot be the session's; make it "
                                f"contiguous (p.data = p.data.contiguous()), {_WAY_OUT}")
        try:
            array = t.detach().numpy()
        except (TypeError, RuntimeError) as e:      # a type numpy has not (bfloat16)
            raise OnnxGradError(f"{where} cannot be shared with the session ({e}); {_WAY_OUT}") from None
        if array.dtype != value.dtype or array.shape != value.shape:
            raise OnnxGradError(f"{where} is {array.dtype}{list(array.shape)}, the model's {value.dtype}"
                                f"{list(value.shape)}: pass the module the model was exported from, {_WAY_OUT}")
        if not np.array_equal(array, value, equal_nan=array.dtype.kind in "fc"):
            raise OnnxGradError(f"{where} holds other values than the model's (the module changed since the "
                                f"export, or another module): export it again (from_torch), {_WAY_OUT}")
        first = holders.setdefault(t.data_ptr(), name)
        if first != name:
            raise OnnxGradError(f"module=: '{first}' and '{name}' are one tensor in the module (tied) but two in "
                                f"the model, which trains them apart; export with from_torch, which keeps a tied "
                                f"tensor one, {_WAY_OUT}")
        arrays[name] = array
    return ModuleLink(arrays, _batch_counts(module, set(running)), {name: tensors[name] for name in arrays})


def _batch_counts(module: Any, running: set[str]) -> list[np.ndarray]:
    counts = []
    for prefix, m in module.named_modules():
        count = getattr(m, "num_batches_tracked", None)
        mean = f"{prefix}.running_mean" if prefix else "running_mean"
        if count is not None and hasattr(count, "numpy") and mean in running and count.device.type == "cpu":
            counts.append(count.numpy())
    return counts
