"""onnxgrad's training against PyTorch's, read against PyTorch's own float32 rounding:
:func:`compare_with_torch`.

Two float32 trainings of one model never agree bit for bit: the sums run in another order, and some tensors
are rounding noise from the start. A parameter whose true gradient is zero (a key bias under softmax, a bias
right before a train-mode BatchNorm) gets a gradient of float32 rounding, which Adam divides by its own
magnitude into a full step of ``±lr`` in a random direction: PyTorch's float32 run and its float64 run differ
there as much as onnxgrad's and PyTorch's do. So every quantity is measured three ways (onnxgrad against
PyTorch float32, onnxgrad against a PyTorch float64 run of the same module, and PyTorch float32 against that
float64 run, the noise floor), and onnxgrad agrees where its distance to float64 is within ``rtol`` or within
``factor`` times PyTorch float32's own. Tensors whose float64 gradient is zero, or where PyTorch's float32 run
itself is further than ``rtol`` from float64, are named apart as noise-only.

Dropout masks are drawn by two different random generators and cannot match: dropout is set to 0 for the
comparison (``nn.Dropout`` layers, and float ``*dropout*`` attributes of modules as transformers' attention
keeps them), and the report says so. A forward that is still random after that is refused.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..errors import OnnxGradError

__all__ = ["compare_with_torch", "CompareReport", "Difference", "CompareError"]

_ZERO_GRADIENT = 1e-9       # a float64 gradient this small against the model's largest is zero (rounding)


class CompareError(OnnxGradError):
    """The comparison cannot be run as asked: torch missing, batches of the wrong form, a random forward."""


@dataclass(frozen=True)
class Difference:
    """One compared quantity: a step's loss, a parameter or a buffer after the steps.

    The relative differences are ``max |a - b|`` over the tensor divided by the largest magnitude of the three
    runs' values.
    """

    name: str
    ours_vs_torch: float        # onnxgrad against PyTorch float32: the naive comparison
    ours_vs_fp64: float         # onnxgrad against PyTorch float64
    torch_vs_fp64: float        # PyTorch float32 against float64 (the larger of two runs): the noise floor
    agrees: bool
    noise_only: str = ""        # why the tensor is rounding noise, or "" where it is not

    def cells(self) -> str:
        return f"{self.ours_vs_torch:15.2e} {self.ours_vs_fp64:14.2e} {self.torch_vs_fp64:16.2e}"


@dataclass
class CompareReport:
    """What :func:`compare_with_torch` found; ``print(report)`` reads as a short table, ``report.agrees`` is
    the verdict."""

    model: str
    optimizer: str
    steps: int
    rtol: float
    factor: float
    losses: list[tuple[float, float, float]]           # per step: onnxgrad, PyTorch float32, PyTorch float64
    loss_differences: list[Difference]
    parameters: list[Difference]
    buffers: list[Difference]
    dropout: list[str] = field(default_factory=list)   # what was set to 0 for the comparison

    @property
    def disagreements(self) -> list[Difference]:
        return [d for d in self.loss_differences + self.parameters + self.buffers if not d.agrees]

    @property
    def agrees(self) -> bool:
        return not self.disagreements

    @property
    def noise_only(self) -> list[Difference]:
        return [d for d in self.parameters + self.buffers if d.noise_only]

    def lines(self, shown: int = 10) -> list[str]:
        out = [f"onnxgrad against PyTorch: {self.model}, {self.optimizer}, {self.steps} step(s)"]
        if self.dropout:
            out.append(f"  dropout set to 0 for the comparison ({_some(self.dropout, 4)}): the masks are drawn by "
                       "different random generators (PyTorch's, onnxruntime's) and could never match")
        out.append("  relative difference: max |a - b| over a tensor / its largest magnitude")
        out.append(f"  {'step':>4} {'loss onnxgrad':>15} {'PyTorch fp32':>15} {'PyTorch fp64':>15}"
                   f" {'ours vs fp64':>13} {'fp32 vs fp64':>13}")
        for k, ((ours, t32, t64), d) in enumerate(zip(self.losses, self.loss_differences)):
            out.append(f"  {k:>4} {ours:15.8g} {t32:15.8g} {t64:15.8g} {d.ours_vs_fp64:13.2e} {d.torch_vs_fp64:13.2e}"
                       + ("" if d.agrees else "  DIFFERS"))
        header = f"  {'':40} {'ours vs fp32':>15} {'ours vs fp64':>14} {'fp32 vs fp64':>16}"
        for what, items in (("parameters", self.parameters), ("buffers", self.buffers)):
            if not items:
                continue
            signal = [d for d in items if not d.noise_only]
            noise = [d for d in items if d.noise_only]
            out.append(f"{what}: {len(items)}; {len(signal)} determined by float32, {len(noise)} noise-only")
            out.append(header + "   (the worst; fp32 vs fp64 is PyTorch's own rounding)")
            for d in sorted(signal, key=lambda d: -d.ours_vs_fp64)[:shown]:
                out.append(f"  {_cut(d.name):40} {d.cells()}" + ("" if d.agrees else "  DIFFERS"))
            if noise:
                out.append(f"  noise-only {what} (a zero float64 gradient, or PyTorch float32 itself further than "
                           f"{self.rtol:g} from float64): their naive difference is rounding, not a disagreement")
                for d in sorted(noise, key=lambda d: -d.ours_vs_torch)[:shown]:
                    out.append(f"  {_cut(d.name):40} {d.cells()}  {d.noise_only}"
                               + ("" if d.agrees else "  DIFFERS"))
                if len(noise) > shown:
                    out.append(f"  ... and {len(noise) - shown} more noise-only {what}")
        naive = max((d.ours_vs_torch for d in self.parameters), default=0.0)
        floor = max((d.torch_vs_fp64 for d in self.parameters), default=0.0)
        out.append(f"naive worst parameter difference (onnxgrad vs PyTorch float32): {naive:.2e}; PyTorch float32 "
                   f"vs float64 on the same model: {floor:.2e}")
        if self.agrees:
            out.append(f"verdict: AGREES: every loss, parameter and buffer is within {self.rtol:g} of PyTorch "
                       f"float64, or within {self.factor:g}x PyTorch float32's own difference from it")
        else:
            bad = self.disagreements
            out.append(f"verdict: DIFFERS: {len(bad)} quantit{'y' if len(bad) == 1 else 'ies'} further from PyTorch "
                       f"float64 than {self.rtol:g} and {self.factor:g}x PyTorch float32's own difference ("
                       + _some([d.name for d in bad], 5) + ")")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def compare_with_torch(module: Any, batches: Iterable[Any], optimizer: Any, *,
                       loss_fn: Callable[[Any, Any], Any] | None = None,
                       torch_optimizer: Callable[[Any], Any] | None = None,
                       steps: int | None = None, rtol: float = 1e-5, factor: float = 10.0,
                       providers: Sequence[Any] | None = None) -> CompareReport:
    """Train copies of ``module`` on ``batches`` in onnxgrad (its :func:`onnxgrad.from_torch` export in a
    :class:`onnxgrad.TrainingSession`), in PyTorch float32 and in PyTorch float64, and compare the three.

    ``batches``: ``(inputs, target)`` pairs, ``inputs`` one tensor or a tuple of the forward's positional
    arguments (torch tensors or numpy arrays), every batch of the first one's shapes. ``optimizer``: an
    onnxgrad optimizer (``onnxgrad.optim.AdamW(lr=1e-3)``); PyTorch's runs use ``torch.optim``'s of the same
    name and hyperparameters, or ``torch_optimizer(params)`` where given. ``loss_fn(output, target)``: a
    PyTorch loss, traced into the exported graph so that both sides compute the same; by default
    cross-entropy for an integer target and mean squared error for a float one, on the output (its ``logits``
    where it has them). The module trains in its own mode (``module.train()`` / ``eval()``); it is left as
    it was. ``steps``: at most this many batches.
    """
    try:
        import torch
    except ImportError:
        raise CompareError('compare_with_torch needs torch: pip install "onnxgrad[torch]"') from None
    from ..training.session import TrainingSession
    from ..training.torch_export import from_torch

    data = [_as_torch(b, torch) for b in batches]
    data = data[:steps] if steps is not None else data
    if not data:
        raise CompareError("compare_with_torch: no batches given")
    shapes = [tuple(t.shape for t in (*x, y)) for x, y in data]
    if any(s != shapes[0] for s in shapes):
        raise CompareError(f"compare_with_torch: every batch must have the first one's shapes {shapes[0]}; "
                           f"batch {next(k for k, s in enumerate(shapes) if s != shapes[0])} has another")
    make_torch = torch_optimizer or _torch_optimizer(optimizer, torch)
    loss_fn = loss_fn or _default_loss

    base = _with_loss(copy.deepcopy(module), loss_fn, torch)
    dropout = _no_dropout(base, torch)
    _refuse_a_random_forward(base, data[0], torch)

    ours_module, t32, t64 = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base).double()
    t32u = _one_ulp_up(copy.deepcopy(base), torch)
    x0, y0 = data[0]
    names = [f"input_{k}" for k in range(len(x0))] + ["target"]
    model = from_torch(ours_module, (*x0, y0), input_names=names, output_names=["loss"])
    session = TrainingSession(model, loss="loss", optimizer=optimizer, providers=providers,
                              train_mode=module.training)
    opt32 = make_torch([p for p in t32.parameters() if p.requires_grad])
    opt64 = make_torch([p for p in t64.parameters() if p.requires_grad])
    opt32u = make_torch([p for p in t32u.parameters() if p.requires_grad])
    grads64: dict[str, float] = {}
    losses, losses_u = [], []
    for x, y in data:
        ours = session.step({n: t.numpy() for n, t in zip(names, (*x, y))})
        l32 = _torch_step(t32, opt32, x, y)
        l32u = _torch_step(t32u, opt32u, x, y)
        l64 = _torch_step(t64, opt64, tuple(_double(t) for t in x), _double(y))
        for name, p in t64.module.named_parameters():
            if p.grad is not None:
                grads64[name] = max(grads64.get(name, 0.0), float(p.grad.abs().max()))
        losses.append((ours, l32, l64))
        losses_u.append(l32u)

    loss_differences = [_difference(f"loss at step {k}", np.float64(a), np.float64(b), np.float64(c), rtol, factor,
                                    np.float64(u)) for k, ((a, b, c), u) in enumerate(zip(losses, losses_u))]
    largest = max(grads64.values(), default=0.0)
    s32, s64, s32u = _state(t32, torch), _state(t64, torch), _state(t32u, torch)
    ours_params = {_strip(n): v for n, v in session.parameters().items()}
    parameters = []
    for name, value in ours_params.items():
        g = grads64.get(name)
        zero = g is not None and g <= _ZERO_GRADIENT * largest
        parameters.append(_difference(name, value, s32[name], s64[name], rtol, factor, s32u[name],
                                      "float64 gradient zero" if zero else ""))
    buffers = [_difference(_strip(n), v, s32[_strip(n)], s64[_strip(n)], rtol, factor, s32u[_strip(n)])
               for n, v in session.buffers().items() if _strip(n) in s32]
    return CompareReport(type(module).__name__, repr(optimizer), len(data), rtol, factor, losses,
                         loss_differences, parameters, buffers, dropout)


# -- the pieces ---------------------------------------------------------------------------------------
def _difference(name: str, ours: np.ndarray, t32: np.ndarray, t64: np.ndarray, rtol: float, factor: float,
                t32u: np.ndarray, zero_gradient: str = "") -> Difference:
    """``t32u``: PyTorch float32 from parameters one ulp away, a second sample of float32's distance from float64
    (rounding that Adam amplifies lands on other elements each time): the floor is the larger of the two."""
    ours, t32, t64, t32u = (np.asarray(a, np.float64) for a in (ours, t32, t64, t32u))
    # the largest magnitude of the three: a tensor float64 keeps at 0 (a zero-gradient bias under weight decay)
    # is measured against the steps float32 took, not against 0
    scale = max([float(np.abs(a).max()) for a in (ours, t32, t64) if a.size] + [1e-30])

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a - b).max()) / scale if a.size else 0.0

    d = Difference(name, rel(ours, t32), rel(ours, t64), max(rel(t32, t64), rel(t32u, t64)), True)
    why = zero_gradient or (f"PyTorch fp32 is {d.torch_vs_fp64:.1e} from fp64" if d.torch_vs_fp64 > rtol else "")
    agrees = d.ours_vs_fp64 <= max(rtol, factor * d.torch_vs_fp64)
    return Difference(name, d.ours_vs_torch, d.ours_vs_fp64, d.torch_vs_fp64, agrees, why)


def _one_ulp_up(model: Any, torch: Any) -> Any:
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
    return model


def _torch_step(model: Any, optimizer: Any, x: tuple, y: Any) -> float:
    optimizer.zero_grad()
    loss = model(*x, y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _with_loss(module: Any, loss_fn: Callable, torch: Any) -> Any:
    """The module followed by the loss: one module whose output is the scalar loss, in the module's mode."""

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = module
            self.training = module.training

        def forward(self, *args):
            return loss_fn(self.module(*args[:-1]), args[-1])

    return WithLoss()


def _default_loss(output: Any, target: Any) -> Any:
    import torch.nn.functional as F

    if isinstance(output, Mapping):
        output = output["logits"] if "logits" in output else next(iter(output.values()))
    elif isinstance(output, (tuple, list)):
        output = output[0]
    return F.mse_loss(output, target) if target.is_floating_point() else F.cross_entropy(output, target)


def _no_dropout(model: Any, torch: Any) -> list[str]:
    """Dropout set to 0 in place: ``nn.Dropout`` layers, and float attributes named ``*dropout*`` (the
    probability transformers' attention passes to the functional dropout). What was changed, by name."""
    changed = []
    for name, m in model.module.named_modules():
        where = name or type(model.module).__name__
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            changed.append(f"{where!r} p={m.p:g}")
            m.p = 0.0
        for attr, value in list(vars(m).items()):
            if "dropout" in attr and isinstance(value, float) and value > 0:
                changed.append(f"{where!r} {attr}={value:g}")
                setattr(m, attr, 0.0)
    return changed


def _refuse_a_random_forward(model: Any, batch: tuple, torch: Any) -> None:
    """Two forwards under different seeds must give the same loss (on a copy: running statistics move)."""
    probe = copy.deepcopy(model)
    x, y = batch
    values = []
    with torch.no_grad():
        for seed in (1, 2):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                values.append(probe(*x, y))
    if not torch.equal(values[0], values[1]):
        raise CompareError("compare_with_torch: the module's forward is random even with its dropout set to 0 "
                           "(functional dropout with a probability the tool cannot find, or another draw): its "
                           "random numbers cannot match onnxruntime's; turn the randomness off in the module (for "
                           "transformers: every *dropout* value of the config set to 0) and compare again")


def _as_torch(batch: Any, torch: Any) -> tuple[tuple, Any]:
    try:
        x, y = batch
    except (TypeError, ValueError):
        raise CompareError("compare_with_torch: each batch must be an (inputs, target) pair") from None
    x = x if isinstance(x, (tuple, list)) else (x,)
    return tuple(torch.as_tensor(t) for t in x), torch.as_tensor(y)


def _double(t: Any) -> Any:
    return t.double() if t.is_floating_point() else t


def _state(model: Any, torch: Any) -> dict[str, np.ndarray]:
    return {_strip(k): v.detach().double().numpy() for k, v in model.state_dict().items() if v.is_floating_point()}


def _strip(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


def _torch_optimizer(optimizer: Any, torch: Any) -> Callable[[Any], Any]:
    """torch.optim's optimizer of the same name and hyperparameters as the onnxgrad one."""
    from ..training.optim import Optimizer

    if not isinstance(optimizer, Optimizer):
        raise CompareError(f"compare_with_torch: optimizer must be an onnxgrad optimizer (onnxgrad.optim.AdamW(...)), "
                           f"got {type(optimizer).__name__}")
    kind = getattr(torch.optim, type(optimizer).__name__, None)
    if kind is None or optimizer.param_groups:
        raise CompareError(f"compare_with_torch: no torch.optim optimizer to match {optimizer!r}: pass "
                           "torch_optimizer=lambda params: torch.optim....(params, ...)")
    return lambda params: kind(params, **optimizer.hyper)


def _some(items: Sequence[str], shown: int) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _cut(name: str, width: int = 40) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]
