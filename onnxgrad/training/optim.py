"""Optimizers as ONNX graphs: PyTorch's update rules and defaults, in standard ai.onnx ops.

An optimizer here does not run anything: it describes its per-parameter state
and emits, into the training graph, the ops that turn (parameter, gradient,
state) into (new parameter, new state). The learning rate and the step count
are graph inputs, so a scheduler changes the rate without a rebuild::

    opt = optim.AdamW(lr=1e-3, weight_decay=0.01)
    session = TrainingSession(model, loss="loss", optimizer=opt)

Scalar factors that depend on the step (Adam's bias corrections, Adagrad's
decayed rate) are computed once per graph in float64, as PyTorch computes them
in Python floats, then cast to each parameter's type. ``step`` counts updates
from 1, like PyTorch's ``state["step"]`` after its increment.

The update is memory-bound: every op on a parameter-sized tensor is a full pass
over memory, so each formula is arranged for the fewest such ops (every scalar
that can be folded is folded into a 0-d factor shared by all parameters), and
the per-parameter op counts are pinned by tests: SGD 2 (+2 with momentum, +2
nesterov, +1 dampening, +2 weight decay), Adam 10 (+2 L2 penalty), AdamW 11 (12 and
13 for 16-bit parameters, whose moments are kept unscaled: see :class:`Adam`),
Adagrad 7 (+2 weight decay). ``Sum`` of three tensors is no help: onnxruntime
runs it slower than two ``Add``; nor is ``Gemm`` as a fused ``a x + b y`` (a [n, 1]
by [1, 1] product: several times slower than the Mul, Mul, Add it replaces).

An update never guards itself: in a guarded training graph (a non-finite step writes
the old values back, so that the session can update its buffers in place) the
updates of every parameter run inside one ``If`` on the step's finiteness, whose
other branch returns the old values (:mod:`onnxgrad.training.artifacts`), so no full-size
op is spent on the guard.
"""
from __future__ import annotations

import re
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np
from onnx import TensorProto

from ..errors import OnnxGradError
from ..ir.builder import Builder, Var

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Adagrad", "OptimizerError", "OPTIMIZERS", "from_config"]


class OptimizerError(OnnxGradError, ValueError):
    """An optimizer was given an invalid hyperparameter, or a configuration that names no optimizer."""


class UpdateContext:
    """What an update sees besides its tensors: the builder, lr and step, and shared scalars.

    ``lr`` and ``step`` are float64 scalars. ``shared(key, fn, like)`` computes a
    float64 scalar once per graph (``fn()``) and casts it once per element type;
    ``shared_double(key, fn)`` leaves it in float64. Both emit under the optimizer's
    own scope, so the nodes named ``.../<param>/...`` are exactly the per-parameter
    (full-tensor) ops. ``local(v)`` rebinds a tensor to the current parameter's
    builder so its arithmetic is named under that parameter.
    """

    def __init__(self, b: Builder, lr: Var, step: Var):
        self.b = b
        self._root = b               # shared scalars are emitted here, not under the parameter that first needs them
        self.step_int = step
        self._lr_in = lr
        self._lr: Var | None = None
        self._step: Var | None = None
        self._doubles: dict[Any, Var] = {}
        self._cast: dict[tuple[Any, int | None], Var] = {}
        self._first: Var | None = None

    @property
    def lr(self) -> Var:
        """The learning rate as a float64 scalar (emitted only when an update needs it)."""
        if self._lr is None:
            self._lr = self._root.op.Cast(self._lr_in, to=TensorProto.DOUBLE)
        return self._lr

    @property
    def step(self) -> Var:
        """The step count as a float64 scalar (emitted only when an update needs it)."""
        if self._step is None:
            self._step = self._root.op.Cast(self.step_int, to=TensorProto.DOUBLE)
        return self._step

    def double(self, value: float) -> Var:
        return self.b.const(np.array(value, np.float64), TensorProto.DOUBLE)

    def shared_double(self, key: Any, fn: Callable[[], Var]) -> Var:
        """The float64 scalar ``fn()``, built once per graph."""
        if key not in self._doubles:
            current, self.b = self.b, self._root
            try:
                self._doubles[key] = fn()
            finally:
                self.b = current
        return self._doubles[key]

    def shared(self, key: Any, fn: Callable[[], Var], like: Var) -> Var:
        """The float64 scalar ``fn()`` (built once per graph) as a scalar of ``like``'s type."""
        self.shared_double(key, fn)
        dtype = like.dtype
        if (key, dtype) not in self._cast:
            value = self._doubles[key]
            root = self._root
            self._cast[(key, dtype)] = (root.op.Cast(value, to=dtype) if dtype is not None
                                        else root.op.CastLike(value, like))
        return self._cast[(key, dtype)]

    def lr_like(self, like: Var) -> Var:
        if like.dtype is not None and like.dtype == self._lr_in.dtype:
            return self._lr_in                # float32 -> float64 -> float32 would give it back unchanged
        return self.shared("lr", lambda: self.lr, like)

    def local(self, v: Var) -> Var:
        """``v`` seen from the current builder, so ``v * w`` emits under this parameter's node names."""
        return self.b.var(v.name)

    @property
    def first_step(self) -> Var:
        """step == 1 (a boolean scalar)."""
        if self._first is None:
            self._first = self._root.op.Equal(self.step_int, self._root.const(np.array(1), self.step_int.dtype))
        return self._first


class Optimizer:
    """Base of the optimizers: hyperparameters, state layout, and the update emitted per parameter."""

    state_names: ClassVar[tuple[str, ...]] = ()
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, param_groups: Sequence[Mapping[str, Any]] | None = None, **hyper: Any):
        self.hyper = {**self.defaults, **hyper}
        for k in hyper:
            if k not in self.defaults:
                raise OptimizerError(f"{type(self).__name__} has no option '{k}' "
                                     f"(options: {', '.join(self.defaults)})")
        self._validate()
        self.param_groups = [self._group(g) for g in (param_groups or [])]
        self._for: dict[tuple, Optimizer] = {}

    def _group(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """A parameter group as PyTorch writes them, with ``params`` a regex or a list of names."""
        group = dict(group)
        if "params" not in group:
            raise OptimizerError("a parameter group needs 'params': a regular expression or a list of names")
        params = group.pop("params")
        if isinstance(params, str):
            try:
                re.compile(params)
            except re.error as e:
                raise OptimizerError(f"parameter group pattern {params!r} is not a regular expression: {e}") from None
        elif isinstance(params, (list, tuple)) and all(isinstance(p, str) for p in params):
            params = list(params)
        else:
            raise OptimizerError("a parameter group's 'params' must be a regular expression or a list of names")
        if "lr" in group:
            raise OptimizerError("per-group learning rates are not supported: the learning rate is one graph input "
                                 "(set TrainingSession.lr); groups may change the other options")
        type(self)(**{**self.hyper, **group})          # validates the overrides
        return {"params": params, **group}

    def for_param(self, name: str, torch_name: str | None = None) -> "Optimizer":
        """The optimizer of one parameter: this one, or the first group whose ``params`` match its
        initializer name or PyTorch name (a regex is searched for, a list is matched exactly)."""
        for k, group in enumerate(self.param_groups):
            pattern = group["params"]
            names = [n for n in (name, torch_name) if n]
            if isinstance(pattern, str):
                hit = any(re.search(pattern, n) for n in names)
            else:
                hit = any(n in pattern for n in names)
            if hit:
                if k not in self._for:
                    overrides = {key: v for key, v in group.items() if key != "params"}
                    self._for[k] = type(self)(**{**self.hyper, **overrides})
                return self._for[k]
        return self

    def __getattr__(self, name: str) -> Any:
        hyper = self.__dict__.get("hyper")
        if hyper is not None and name in hyper:
            return hyper[name]
        raise AttributeError(name)

    @property
    def lr(self) -> float:
        return float(self.hyper["lr"])

    def _validate(self) -> None:
        if not self.lr >= 0.0:
            raise OptimizerError(f"invalid learning rate {self.lr}")
        if not self.hyper.get("weight_decay", 0.0) >= 0.0:
            raise OptimizerError(f"invalid weight_decay {self.hyper['weight_decay']}")

    def active_state(self) -> tuple[str, ...]:
        """The state tensors kept per parameter under these hyperparameters."""
        return self.state_names

    def state_scale(self, dtype: int | None) -> dict[str, float]:
        """How the training graph holds the state of a parameter of element type ``dtype``: ``{state name:
        factor}``, the graph's tensor being PyTorch's value times the factor (a state not named: as it is).
        A scale that saves a full-size op per update is a representation, not a change of meaning:
        ``TrainingSession.optimizer_state()`` and checkpoints give and take PyTorch's values."""
        return {}

    def initial_state(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """State of one parameter before the first update (zeros unless the optimizer says otherwise).
        ``np.zeros``, not ``zeros_like``: the allocator's zeroed pages take no memory until the first
        update writes them (``zeros_like`` writes every zero up front)."""
        return {k: np.zeros(value.shape, value.dtype) for k in self.active_state()}

    def update(self, ctx: UpdateContext, p: Var, g: Var, state: dict[str, Var]) -> tuple[Var, dict[str, Var]]:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """JSON-able description, for checkpoints and model metadata (``from_config`` reads it back)."""
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.hyper.items()}
        config = {"type": type(self).__name__, **hyper}
        if self.param_groups:
            config["param_groups"] = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
                                      for g in self.param_groups]
        return config

    def __repr__(self) -> str:
        groups = f", param_groups={self.param_groups!r}" if self.param_groups else ""
        return f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in self.hyper.items()) + groups + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Optimizer) and self.config() == other.config()


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, as ``torch.optim.SGD``::

        g = g + weight_decay * p
        buf = g  (first step),  momentum * buf + (1 - dampening) * g  (later)
        g = g + momentum * buf  (nesterov),  buf  (otherwise)
        p = p - lr * g
    """

    state_names = ("momentum_buffer",)
    defaults = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, param_groups: Sequence[Mapping[str, Any]] | None = None):
        super().__init__(param_groups, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                         weight_decay=weight_decay)

    def _validate(self) -> None:
        super()._validate()
        if not self.momentum >= 0.0:
            raise OptimizerError(f"invalid momentum {self.momentum}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise OptimizerError("nesterov momentum requires a momentum and zero dampening")

    def active_state(self) -> tuple[str, ...]:
        return self.state_names if self.momentum else ()

    def update(self, ctx, p, g, state):
        p, g = ctx.local(p), ctx.local(g)
        if self.weight_decay:
            g = g + self.weight_decay * p
        new_state = {}
        if self.momentum:
            buf = ctx.local(state["momentum_buffer"])
            # buf starts at zero, so momentum * buf + g is g exactly on the first step (PyTorch: buf = g)
            if self.dampening:                     # ... and the first step takes g undamped
                undamped = ctx.shared(("sgd_undamped", self.dampening), lambda: ctx.b.op.Where(
                    ctx.first_step, ctx.double(1.0), ctx.double(1.0 - self.dampening)), p)
                buf = buf * self.momentum + g * undamped
            else:
                buf = buf * self.momentum + g
            new_state["momentum_buffer"] = buf
            g = g + buf * self.momentum if self.nesterov else buf
        return p - g * ctx.lr_like(p), new_state


class Adam(Optimizer):
    """Adam, as ``torch.optim.Adam`` (L2 penalty added to the gradient)::

        g = g + weight_decay * p
        m = lerp(m, g, 1 - beta1);   v = beta2 v + (1 - beta2) g^2
        p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    computed with the bias corrections folded into two shared scalars (one
    full-tensor Div fewer per parameter; the same value up to rounding)::

        p = p - step_size * m / (sqrt(v) + eps_hat),
        step_size = lr sqrt(1 - beta2^t) / (1 - beta1^t),   eps_hat = eps sqrt(1 - beta2^t)

    ``lerp`` is PyTorch's: ``m + w (g - m)`` for ``w < 0.5``, else ``g - (1 - w) (g - m)``. The quotient
    ``m / (sqrt(v) + eps_hat)`` is taken before the step size multiplies it, as PyTorch's ``addcdiv_`` does:
    ``m * step_size`` first would be one more parameter-sized temporary alive while ``v`` is updated (a
    64 MB weight trained with AdamW: a loop's peak 476 MB instead of 412), and a float16 product that
    underflows.

    For float32 and float64 parameters the graph holds the moments scaled (:meth:`state_scale`),
    ``M = m / (1 - beta1)`` and ``V = v / (1 - beta2)``, which takes the constant weights off the
    gradient: two full-size ops fewer per parameter (AdamW 11 instead of 13), the same values up to
    rounding::

        M = beta1 M + g,   V = beta2 V + g^2,   p = p - step_size' * M / (sqrt(V) + eps_hat'),
        step_size' = step_size (1 - beta1) / sqrt(1 - beta2),   eps_hat' = eps_hat / sqrt(1 - beta2)

    16-bit parameters keep PyTorch's moments as they are: ``V`` would overflow float16 (the largest
    value 65504) at a thousandth of the squared gradients ``v`` can hold.
    """

    state_names = ("exp_avg", "exp_avg_sq")
    defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    decoupled = False

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, param_groups: Sequence[Mapping[str, Any]] | None = None):
        super().__init__(param_groups, lr=lr, betas=tuple(float(b) for b in betas), eps=eps,
                         weight_decay=weight_decay)

    def _validate(self) -> None:
        super()._validate()
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise OptimizerError(f"invalid betas {self.betas}: each must be in [0, 1)")
        if not self.eps >= 0.0:
            raise OptimizerError(f"invalid eps {self.eps}")

    def state_scale(self, dtype: int | None) -> dict[str, float]:
        if dtype not in (TensorProto.FLOAT, TensorProto.DOUBLE):
            return {}
        beta1, beta2 = self.betas
        return {"exp_avg": 1.0 / (1.0 - beta1), "exp_avg_sq": 1.0 / (1.0 - beta2)}

    def update(self, ctx, p, g, state):
        beta1, beta2 = self.betas
        scaled = bool(self.state_scale(p.dtype))
        p, g = ctx.local(p), ctx.local(g)
        m, v = ctx.local(state["exp_avg"]), ctx.local(state["exp_avg_sq"])
        if self.weight_decay and self.decoupled:
            p = p * ctx.shared(("decay", self.weight_decay), lambda: 1.0 - ctx.lr * ctx.double(self.weight_decay), p)
        elif self.weight_decay:
            g = g + p * self.weight_decay
        if scaled:                          # M = m / (1 - beta1), V = v / (1 - beta2)
            m = m * beta1 + g
            v = v * beta2 + g * g
        else:
            m = m + (g - m) * (1.0 - beta1) if 1.0 - beta1 < 0.5 else g - (g - m) * beta1
            v = v * beta2 + (g * (1.0 - beta2)) * g
        # the scaled moments give m = (1 - beta1) M and sqrt(v) = sqrt(1 - beta2) sqrt(V): both constants
        # go into the shared scalars
        unscale_m, unscale_v = ((1.0 - beta1), np.sqrt(1.0 - beta2)) if scaled else (1.0, 1.0)

        def step_size_fn() -> Var:
            size = ctx.lr * self._bias2_sqrt(ctx) / (1.0 - ctx.b.op.Pow(ctx.double(beta1), ctx.step))
            return size * (unscale_m / unscale_v) if scaled else size
        step_size = ctx.shared(("adam_step_size", beta1, beta2, scaled), step_size_fn, p)
        denom = ctx.b.op.Sqrt(v)
        if self.eps:
            denom = denom + ctx.shared(("adam_eps", self.eps, beta2, scaled),
                                       lambda: self._bias2_sqrt(ctx) * ctx.double(self.eps / unscale_v), p)
        return p - (m / denom) * step_size, {"exp_avg": m, "exp_avg_sq": v}

    def _bias2_sqrt(self, ctx: UpdateContext) -> Var:
        """sqrt(1 - beta2^t), a float64 scalar built once per graph."""
        beta2 = self.betas[1]
        return ctx.shared_double(("adam_bias2_sqrt", beta2),
                                 lambda: ctx.b.op.Sqrt(1.0 - ctx.b.op.Pow(ctx.double(beta2), ctx.step)))


class AdamW(Adam):
    """AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay ``p = p * (1 - lr * weight_decay)`` first."""

    defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    decoupled = True

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, param_groups: Sequence[Mapping[str, Any]] | None = None):
        super().__init__(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, param_groups=param_groups)


class Adagrad(Optimizer):
    """Adagrad, as ``torch.optim.Adagrad``::

        g = g + weight_decay * p
        clr = lr / (1 + (t - 1) lr_decay)
        sum = sum + g^2  (sum starts at initial_accumulator_value)
        p = p - clr * g / (sqrt(sum) + eps)
    """

    state_names = ("sum",)
    defaults = {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10}

    def __init__(self, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                 param_groups: Sequence[Mapping[str, Any]] | None = None):
        super().__init__(param_groups, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                         initial_accumulator_value=initial_accumulator_value, eps=eps)

    def _validate(self) -> None:
        super()._validate()
        if not self.lr_decay >= 0.0:
            raise OptimizerError(f"invalid lr_decay {self.lr_decay}")
        if not self.initial_accumulator_value >= 0.0:
            raise OptimizerError(f"invalid initial_accumulator_value {self.initial_accumulator_value}")
        if not self.eps >= 0.0:
            raise OptimizerError(f"invalid eps {self.eps}")

    def initial_state(self, value: np.ndarray) -> dict[str, np.ndarray]:
        if not self.initial_accumulator_value:
            return super().initial_state(value)
        return {"sum": np.full_like(value, self.initial_accumulator_value)}

    def update(self, ctx, p, g, state):
        p, g = ctx.local(p), ctx.local(g)
        if self.weight_decay:
            g = g + self.weight_decay * p
        clr = (ctx.shared(("adagrad_clr", self.lr_decay),
                          lambda: ctx.lr / (1.0 + (ctx.step - 1.0) * ctx.double(self.lr_decay)), p)
               if self.lr_decay else ctx.lr_like(p))
        total = ctx.local(state["sum"]) + g * g
        std = ctx.b.op.Sqrt(total)
        if self.eps:
            std = std + self.eps
        return p - (g / std) * clr, {"sum": total}


OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "adagrad": Adagrad}


def from_config(config: dict[str, Any]) -> Optimizer:
    """The optimizer an ``Optimizer.config()`` describes."""
    config = dict(config)
    kind = config.pop("type", None)
    cls = {c.__name__: c for c in OPTIMIZERS.values()}.get(kind)
    if cls is None:
        raise OptimizerError(f"unknown optimizer type {kind!r}")
    if "betas" in config:
        config["betas"] = tuple(config["betas"])
    return cls(**config)
