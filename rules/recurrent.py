"""Gradient rules: recurrent layers (RNN, GRU, LSTM), by backpropagation through time.

The backward graph recomputes every step's gates from X, W, R, B and the hidden
states the forward already produced (its ``Y`` output, exposed on the forward
node when the model dropped it): one Gemm over all time steps at once. Only the
recurrence itself is unrolled over the (static) sequence length: per step a few
elementwise ops and one MatMul with R. The weight gradients are then one Gemm
over all steps each: ``dW = sum_t dA_t' X_t``, ``dR = sum_t dA_t' H_t-1``.

Covered: all directions, layout 0 and 1, every activation the spec lists (with
activation_alpha/beta consumed in the order of the activations, as onnxruntime
does), clip, GRU's linear_before_reset, LSTM peepholes, and ``sequence_lens``
(the state of a batch entry is frozen past its length; its Y there is zero).
Not covered: LSTM ``input_forget=1``, a sequence length unknown when the
gradient is built.

``initial_h``/``initial_c`` are tagged NonDifferentiable by the schemas from
opset 14, but PyTorch's ``h_0``/``c_0`` get gradients, and so do they here
(``beyond_tags``): dH_0 (dC_0) is the carry left over after the first step
the direction processes. ``strict`` tag-following gives them none.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from onnx import TensorProto

from onnxgrad.ir.builder import Var, total

from .registry import Node, register

# Activations whose alpha / beta the spec makes optional, and their defaults (those of the ONNX ops).
# Affine, ScaledTanh and ThresholdedRelu need theirs given: runtimes disagree on the defaults.
_USES = {  # name: (uses alpha, uses beta)
    "relu": (False, False), "tanh": (False, False), "sigmoid": (False, False),
    "affine": (True, True), "leakyrelu": (True, False), "thresholdedrelu": (True, False),
    "scaledtanh": (True, True), "hardsigmoid": (True, True), "elu": (True, False),
    "softsign": (False, False), "softplus": (False, False),
}
_DEFAULTS = {"leakyrelu": (0.01, None), "hardsigmoid": (0.2, 0.5), "elu": (1.0, None)}
# Activations whose derivative is written with their output alone (no pre-activation needed).
_FROM_OUTPUT = {"sigmoid", "tanh", "relu", "affine", "softsign", "softplus"}


class _Act:
    """One activation of a recurrent cell: ``value(z)`` and its derivative ``grad(z, a)`` at ``a = f(z)``."""

    def __init__(self, name: str, alpha: float | None, beta: float | None):
        self.name, self.alpha, self.beta = name, alpha, beta

    @property
    def needs_input(self) -> bool:
        return self.name not in _FROM_OUTPUT

    def value(self, n: Node, z: Var) -> Var:
        op, a, b = n.op, self.alpha, self.beta
        return {
            "sigmoid": lambda: op.Sigmoid(z),
            "tanh": lambda: op.Tanh(z),
            "relu": lambda: op.Relu(z),
            "affine": lambda: z * a + b,
            "leakyrelu": lambda: op.LeakyRelu(z, alpha=a),
            "thresholdedrelu": lambda: op.ThresholdedRelu(z, alpha=a),
            "scaledtanh": lambda: op.Tanh(z * b) * a,
            "hardsigmoid": lambda: op.HardSigmoid(z, alpha=a, beta=b),
            "elu": lambda: op.Elu(z, alpha=a),
            "softsign": lambda: op.Softsign(z),
            "softplus": lambda: op.Softplus(z),
        }[self.name]()

    def grad(self, n: Node, z: Var | None, y: Var) -> Var:
        """f'(z), with y = f(z); z may be None for the activations in _FROM_OUTPUT."""
        op, a, b = n.op, self.alpha, self.beta
        one, zero = 1.0, 0.0
        if self.name == "sigmoid":
            return y * (1.0 - y)
        if self.name == "tanh":
            return 1.0 - y * y
        if self.name == "relu":
            return _where(n, op.Greater(y, n.b.scalar(zero, y)), one, zero, y)
        if self.name == "affine":
            return n.b.fill_like(y, a)
        if self.name == "softsign":                      # 1 / (1 + |z|)^2 = (1 - |y|)^2
            s = 1.0 - op.Abs(y)
            return s * s
        if self.name == "softplus":                      # sigmoid(z) = 1 - exp(-y)
            return 1.0 - op.Exp(-y)
        if self.name == "leakyrelu":
            return _where(n, op.Less(z, n.b.scalar(zero, z)), a, one, y)
        if self.name == "thresholdedrelu":
            return _where(n, op.Greater(z, n.b.scalar(a, z)), one, zero, y)
        if self.name == "scaledtanh":                    # a * b * (1 - tanh(b z)^2)
            t = op.Tanh(z * b)
            return (1.0 - t * t) * (a * b)
        if self.name == "hardsigmoid":                   # a where 0 < a z + b < 1
            u = z * a + b
            inside = op.And(op.Greater(u, n.b.scalar(zero, u)), op.Less(u, n.b.scalar(one, u)))
            return _where(n, inside, a, zero, y)
        if self.name == "elu":                           # 1 for z > 0, else y + alpha
            return op.Where(op.Greater(z, n.b.scalar(zero, z)), n.b.scalar(one, y), y + a)
        raise AssertionError(self.name)


def _where(n: Node, cond: Var, if_true: float, if_false: float, like: Var) -> Var:
    return n.op.Where(cond, n.b.scalar(if_true, like), n.b.scalar(if_false, like))


def _activations(n: Node, defaults: Sequence[str], directions: int) -> list[list[_Act]]:
    """The cell's activations per direction, alpha/beta consumed in order (those that use them)."""
    names = [s.decode() if isinstance(s, bytes) else s for s in (n.attr("activations") or [])]
    if not names:
        names = list(defaults) * directions
    elif len(names) == len(defaults) and directions == 2:
        names = names * 2
    if len(names) != len(defaults) * directions:
        n.decline(f"expected {len(defaults) * directions} activations, got {len(names)}")
    alphas, betas = list(n.attr("activation_alpha") or []), list(n.attr("activation_beta") or [])
    acts = []
    for name in names:
        key = name.lower()
        if key not in _USES:
            n.decline(f"unknown activation '{name}'")
        uses_alpha, uses_beta = _USES[key]
        default_alpha, default_beta = _DEFAULTS.get(key, (None, None))
        alpha = alphas.pop(0) if uses_alpha and alphas else default_alpha
        beta = betas.pop(0) if uses_beta and betas else default_beta
        if (uses_alpha and alpha is None) or (uses_beta and beta is None):
            n.decline(f"activation '{name}' needs activation_alpha/activation_beta given explicitly")
        acts.append(_Act(key, alpha, beta))
    k = len(defaults)
    return [acts[d * k:(d + 1) * k] for d in range(directions)]


class _Recurrence:
    """A recurrent node seen in layout 0 ([seq, batch, ...]) and split by direction.

    Holds what every cell's backward needs: per direction ``d`` the weights
    ``w[d]`` [G*H, I], ``r[d]`` [G*H, H], biases, initial states, the forward
    hidden states ``y[d]`` [T, B, H] and their seeds, the step masks of
    ``sequence_lens`` and the activations; and the helpers to split a
    [T, B, K] tensor into steps and to assemble the input gradients.
    """

    def __init__(self, n: Node, gates: int, default_acts: Sequence[str], has_cell: bool = False):
        self.n, self.b, self.op = n, n.b, n.op
        self.gates = gates
        direction = n.attr("direction", "forward")
        if direction not in ("forward", "reverse", "bidirectional"):
            n.decline(f"unknown direction '{direction}'")
        self.reverse = [False, True] if direction == "bidirectional" else [direction == "reverse"]
        self.D = len(self.reverse)
        self.layout = n.attr("layout", 0)
        x, r = n.inputs[0], n.inputs[2]
        seq_axis = 1 if self.layout else 0
        if x.shape is None or x.shape[seq_axis] is None:
            n.decline("the sequence length must be known when the gradient is built "
                          "(the backward through time is unrolled over it)")
        self.T = int(x.shape[seq_axis])
        hidden = n.attr("hidden_size") or (r.shape[-1] if r.shape is not None else None)
        if hidden is None:
            n.decline("hidden_size is unknown")
        self.H = int(hidden)
        self.acts = _activations(n, default_acts, self.D)
        clip = n.attr("clip")
        self.clip = None if clip is None else float(clip)

        self.x = self._to_layout0(x, [1, 0, 2])                      # [T, B, I]
        self.x2 = self.rows(self.x)                                  # [T*B, I]
        self.w = self._per_direction(n.inputs[1], 0)
        self.r = self._per_direction(r, 0)
        bias = n.input(3)
        self.bias = None if bias is None else self._per_direction(bias, 0)
        self.h0 = self._initial(5)
        self.c0 = self._initial(6) if has_cell else None
        self._masks(n.input(4))

        y = self._to_layout0(n.expose_output(0, "Y", like=x), [1, 2, 0, 3])  # [T, D, B, H]
        self.y = self._per_direction(y, 1)
        dy = n.dys[0]
        if dy is not None:
            dy = self._to_layout0(dy, [1, 2, 0, 3])
            if self.mask is not None:
                dy = dy * self.b.unsqueeze(self.mask, [1])           # Y is zero past a sequence's end
            dy = self._per_direction(dy, 1)
        self.dy = dy
        self.dyh = self._state_seed(1)
        self.dyc = self._state_seed(2) if has_cell else None

    # -- reading the node ---------------------------------------------------------
    def _to_layout0(self, v: Var, perm: list[int]) -> Var:
        """Layout 1 ([batch, seq, ...]) to layout 0; the same permutation maps gradients back."""
        return self.op.Transpose(v, perm=perm) if self.layout else v

    def _initial(self, i: int) -> list[Var] | None:
        v = self.n.input(i)
        return None if v is None else self._per_direction(self._to_layout0(v, [1, 0, 2]), 0)

    def _state_seed(self, i: int) -> list[Var] | None:
        d = self.n.dys[i] if i < len(self.n.dys) else None
        return None if d is None else self._per_direction(self._to_layout0(d, [1, 0, 2]), 0)

    def _per_direction(self, v: Var, axis: int) -> list[Var]:
        """v split along its num_directions axis, that axis removed."""
        if self.D == 1:
            return [self.b.squeeze(v, [axis])]
        parts = self.op.Split(v, self.b.ints([1, 1]), axis=axis, outputs=2)
        return [self.b.squeeze(p, [axis]) for p in parts]

    def _masks(self, seq_lens: Var | None) -> None:
        """With sequence_lens: ``mask`` [T, B, 1] (1 where step t is within the sequence, else 0),
        per step ``masks`` (float) and ``within`` (bool), all [B, 1]; None when every sequence is full."""
        self.mask = self.masks = self.within = self._lens = None
        known = None if seq_lens is None else self.n.const_ints(4)
        if seq_lens is None or (known is not None and all(k == self.T for k in known)):
            return
        self._lens = self.b.unsqueeze(self.op.Cast(seq_lens, to=TensorProto.INT64), [0])               # [1, B] int64
        steps = self.b.const(np.arange(self.T, dtype=np.int64).reshape(self.T, 1))
        within = self.b.unsqueeze(self.op.Less(steps, self._lens), [2])                 # [T, B, 1]
        self.mask = self.op.Where(within, self.b.scalar(1.0, self.x), self.b.scalar(0.0, self.x))
        self.masks = self.steps(self.mask)
        self.within = self.steps(within)

    # -- time steps ---------------------------------------------------------------
    def order(self, d: int) -> list[int]:
        """Time indices in the order direction d processes them."""
        ts = list(range(self.T))
        return ts[::-1] if self.reverse[d] else ts

    def steps(self, v: Var) -> list[Var]:
        """A [T, B, K] tensor as T tensors [B, K]."""
        if self.T == 1:
            return [self.b.squeeze(v, [0])]
        parts = self.op.Split(v, self.b.ints([1] * self.T), axis=0, outputs=self.T)
        return [self.b.squeeze(p, [0]) for p in parts]

    def stack(self, vs: Sequence[Var]) -> Var:
        """T tensors [B, K] as one [T, B, K] tensor."""
        parts = [self.b.unsqueeze(v, [0]) for v in vs]
        return parts[0] if len(parts) == 1 else self.op.Concat(*parts, axis=0)

    def rows(self, v: Var) -> Var:
        """[T, B, K] -> [T*B, K]"""
        return self.op.Flatten(v, axis=2)

    def seq(self, v2: Var, k: int) -> Var:
        """[T*B, K] -> [T, B, K]"""
        return self.op.Reshape(v2, self.b.ints([self.T, -1, k]))

    # -- gates --------------------------------------------------------------------
    def hprev(self, d: int) -> Var:
        """[T, B, H]: the hidden state each step of direction d starts from (Y shifted by one step).

        The first step (and, with sequence_lens, a reverse step right at a sequence's end) starts
        from the initial state."""
        y, T, ints = self.y[d], self.T, self.b.ints
        if self.reverse[d]:
            shifted = self.op.Pad(self.op.Slice(y, ints([1]), ints([T]), ints([0])), ints([0, 0, 0, 1, 0, 0]))
        else:
            shifted = self.op.Pad(self.op.Slice(y, ints([0]), ints([T - 1]), ints([0])), ints([1, 0, 0, 0, 0, 0]))
        if self.h0 is None and self._lens is None:
            return shifted                                   # the zero padding is the initial state
        step = 1 if self.reverse[d] else -1
        prev = np.array([t + step if 0 <= t + step < T else np.iinfo(np.int64).max for t in range(T)])
        if self._lens is None:
            valid = self.b.const((prev < T).reshape(T, 1, 1))
        else:
            valid = self.b.unsqueeze(self.op.Less(self.b.const(prev.reshape(T, 1)), self._lens), [2])
        initial = self.b.scalar(0.0, self.x) if self.h0 is None else self.b.unsqueeze(self.h0[d], [0])
        return self.op.Where(valid, shifted, initial)

    def preact(self, d: int, gates: slice, hp2: Var | None, with_bias: str = "both") -> Var:
        """[T*B, k*H]: X W' (+ H_t-1 R' if hp2) + Wb (+ Rb) for the gates ``gates`` (a slice of gate indices)."""
        H = self.H
        lo, hi = gates.start * H, gates.stop * H
        bias = None
        if self.bias is not None:
            wb, rb = self.biases(d, lo, hi)
            bias = wb + rb if with_bias == "both" else wb
        out = self.op.Gemm(self.x2, self.gate_rows(self.w[d], lo, hi), bias, transB=1)
        if hp2 is not None:
            out = self.op.Gemm(hp2, self.gate_rows(self.r[d], lo, hi), out, transB=1)
        return out

    def gate_rows(self, m: Var, lo: int, hi: int) -> Var:
        if lo == 0 and hi == self.gates * self.H:
            return m
        return self.op.Slice(m, self.b.ints([lo]), self.b.ints([hi]), self.b.ints([0]))

    def biases(self, d: int, lo: int, hi: int) -> tuple[Var, Var]:
        """Wb, Rb of the gate rows lo:hi (B = [Wb, Rb], each G*H long)."""
        gh = self.gates * self.H
        bias, ints = self.bias[d], self.b.ints
        return (self.op.Slice(bias, ints([lo]), ints([hi]), ints([0])),
                self.op.Slice(bias, ints([gh + lo]), ints([gh + hi]), ints([0])))

    def activate(self, act: _Act, z: Var) -> tuple[Var, Var]:
        """a = f(clip(z)) and da/dz (zero where the clip saturates)."""
        if self.clip is None:
            a = act.value(self.n, z)
            return a, act.grad(self.n, z, a)
        lo, hi = self.b.scalar(-self.clip, z), self.b.scalar(self.clip, z)
        zc = self.op.Clip(z, lo, hi)
        a = act.value(self.n, zc)
        inside = self.op.Less(self.op.Abs(z), hi)
        return a, self.op.Where(inside, act.grad(self.n, zc, a), self.b.scalar(0.0, z))

    def split_last(self, v: Var, k: int) -> list[Var]:
        """v [..., k*H] as k tensors [..., H]."""
        return list(self.op.Split(v, self.b.ints([self.H] * k), axis=-1, outputs=k))

    # -- the result ---------------------------------------------------------------
    def weight_grads(self, d: int, da3: Var, da2: Var, hin2: Var) -> tuple[Var | None, Var, Var]:
        """dX_d = dA W, dW = dA' X, dR = dA' H_in, over all steps at once (dA: [T, B, G*H] and [T*B, G*H])."""
        dx = self.op.MatMul(da3, self.w[d]) if self.n.needs(0) else None
        return dx, self.op.Gemm(da2, self.x2, transA=1), self.op.Gemm(da2, hin2, transA=1)

    def bias_grad(self, dwb2: Var, drb2: Var | None = None) -> Var:
        """dB = [sum dA_W, sum dA_R] over all steps and batch entries (dA_R = dA_W unless given)."""
        swb = self.b.sum(dwb2, [0], keepdims=False)
        srb = swb if drb2 is None else self.b.sum(drb2, [0], keepdims=False)
        return self.op.Concat(swb, srb, axis=0)

    def gradients(self, dx: list, dw: list, dr: list, db: list, dh0: list,
                  dc0: list | None = None, dp: list | None = None) -> tuple:
        """One gradient per input of the node, directions stacked, back in the node's layout."""
        n = self.n
        grads: list[Var | None] = [None] * len(n.inputs)
        if n.needs(0):
            grads[0] = self._to_layout0(dx[0] if self.D == 1 else dx[0] + dx[1], [1, 0, 2])
        for i, g in ((1, dw), (2, dr), (3, db), (7, dp)):
            if n.needs(i) and g:
                grads[i] = self._stack_directions(g)
        for i, g in ((5, dh0), (6, dc0)):
            if n.needs(i) and g and all(v is not None for v in g):
                grads[i] = self._to_layout0(self._stack_directions(g), [1, 0, 2])
        return tuple(grads)

    def _stack_directions(self, vs: Sequence[Var]) -> Var:
        parts = [self.b.unsqueeze(v, [0]) for v in vs]
        return parts[0] if len(parts) == 1 else self.op.Concat(*parts, axis=0)


def _seed_at(t: int, carry: Var | None, dy: list[Var] | None) -> Var:
    """dL/dH_t: what flows back from later steps plus Y_t's own seed."""
    return total(carry, None if dy is None else dy[t])


def _masked(rec: _Recurrence, t: int, g: Var | None) -> tuple[Var | None, Var | None]:
    """(m_t g, (1 - m_t) g): the part reaching the cell at step t, and the part passing a frozen state."""
    if g is None or rec.masks is None:
        return g, None
    inside = g * rec.masks[t]
    return inside, g - inside


@register("RNN", inputs=(0, 1, 2, 3), beyond_tags=(5,))
def rnn(n: Node):
    """H_t = f(A_t),  A_t = X_t W' + H_t-1 R' + Wb + Rb.

    dA_t = (dY_t + dH_t) f'(A_t),  dH_t-1 = dA_t R,
    dX_t = dA_t W,  dW = sum_t dA_t' X_t,  dR = sum_t dA_t' H_t-1,  dB = [sum dA, sum dA],
    d initial_h = dH_t-1 of the first step (beyond the schema's tags, as PyTorch's h_0).
    """
    rec = _Recurrence(n, 1, ["Tanh"])
    dx, dw, dr, db, dh0 = [], [], [], [], []
    for d in range(rec.D):
        act, = rec.acts[d]
        hp2 = rec.rows(rec.hprev(d))
        if act.needs_input or rec.clip is not None:
            _, fprime = rec.activate(act, rec.seq(rec.preact(d, slice(0, 1), hp2), rec.H))
        else:
            fprime = act.grad(n, None, rec.y[d])             # f'(A) from H = f(A) itself
        fprime = rec.steps(fprime)
        dy = None if rec.dy is None else rec.steps(rec.dy[d])
        carry = None if rec.dyh is None else rec.dyh[d]
        da = [None] * rec.T
        for t in reversed(rec.order(d)):
            dh, passed = _masked(rec, t, _seed_at(t, carry, dy))
            da[t] = dh * fprime[t]
            carry = total(n.op.MatMul(da[t], rec.r[d]), passed)
        da3 = rec.stack(da)
        da2 = rec.rows(da3)
        x_d, w_d, r_d = rec.weight_grads(d, da3, da2, hp2)
        dx.append(x_d), dw.append(w_d), dr.append(r_d), db.append(rec.bias_grad(da2)), dh0.append(carry)
    return rec.gradients(dx, dw, dr, db, dh0)


@register("GRU", inputs=(0, 1, 2, 3), beyond_tags=(5,))
def gru(n: Node):
    """Gates z, r, h:  z = f(Az),  r = f(Ar),  n = g(An),  H_t = (1 - z) n + z H_t-1,  with
    An = X Wh' + (r H_t-1) Rh' + Rbh + Wbh      (linear_before_reset = 0)
    An = X Wh' + r (H_t-1 Rh' + Rbh) + Wbh      (linear_before_reset = 1).

    dAn = dH (1 - z) g',  dAz = dH (H_t-1 - n) f',  and with q = dAn Rh:
    lbr 0:  dAr = q H_t-1 f',        dH_t-1 = dH z + [dAz, dAr] Rzr + q r
    lbr 1:  dAr = dAn (H_t-1 Rh' + Rbh) f',  dH_t-1 = dH z + [dAz, dAr, dAn r] R.
    d initial_h = dH_t-1 of the first step (beyond the schema's tags, as PyTorch's h_0).
    """
    rec = _Recurrence(n, 3, ["Sigmoid", "Tanh"])
    lbr = n.attr("linear_before_reset", 0)
    H = rec.H

    def steps(v2: Var) -> list[Var]:
        return rec.steps(rec.seq(v2, H))

    dx, dw, dr, db, dh0 = [], [], [], [], []
    for d in range(rec.D):
        f, g = rec.acts[d]
        hp2 = rec.rows(rec.hprev(d))
        zr, dzr = rec.activate(f, rec.preact(d, slice(0, 2), hp2))
        z, r = rec.split_last(zr, 2)
        fz, fr = rec.split_last(dzr, 2)
        xh = rec.preact(d, slice(2, 3), None, with_bias="w")          # X Wh' + Wbh
        rh = rec.gate_rows(rec.r[d], 2 * H, 3 * H)
        rbh = None if rec.bias is None else rec.biases(d, 2 * H, 3 * H)[1]
        if lbr:
            hr = n.op.Gemm(hp2, rh, rbh, transB=1)                     # H_t-1 Rh' + Rbh
            an = xh + r * hr
        else:
            rhp = r * hp2
            an = n.op.Gemm(rhp, rh, total(xh, rbh), transB=1)
        new, gn = rec.activate(g, an)
        to_n = (1.0 - z) * gn                                          # dAn = dH to_n
        to_z = (hp2 - new) * fz                                        # dAz = dH to_z
        keep = z                                                       # dH_t-1 = dH keep + ...
        if rec.mask is not None:                                       # a frozen state passes dH whole
            m = rec.rows(rec.mask)
            to_n, to_z = to_n * m, to_z * m
            keep = 1.0 - (1.0 - z) * m
        to_n_s, to_z_s, keep_s, r_s = steps(to_n), steps(to_z), steps(keep), steps(r)
        if lbr:
            to_r_s = steps(to_n * hr * fr)                             # dAr = dH to_r
        else:
            hpf_s = steps(hp2 * fr)
            rzr = rec.gate_rows(rec.r[d], 0, 2 * H)
        dy = None if rec.dy is None else rec.steps(rec.dy[d])
        carry = None if rec.dyh is None else rec.dyh[d]
        da_x, da_h = [None] * rec.T, [None] * rec.T
        for t in reversed(rec.order(d)):
            dh = _seed_at(t, carry, dy)
            dan, daz = dh * to_n_s[t], dh * to_z_s[t]
            if lbr:
                dar = dh * to_r_s[t]
                da_h[t] = n.op.Concat(daz, dar, dan * r_s[t], axis=-1)
                back = n.op.MatMul(da_h[t], rec.r[d])
            else:
                q = n.op.MatMul(dan, rh)
                dar = q * hpf_s[t]
                back = n.op.MatMul(n.op.Concat(daz, dar, axis=-1), rzr) + q * r_s[t]
            da_x[t] = n.op.Concat(daz, dar, dan, axis=-1)
            carry = dh * keep_s[t] + back
        dax3 = rec.stack(da_x)
        dax2 = rec.rows(dax3)
        x_d = n.op.MatMul(dax3, rec.w[d]) if n.needs(0) else None
        w_d = n.op.Gemm(dax2, rec.x2, transA=1)
        if lbr:
            dah2 = rec.rows(rec.stack(da_h))
            r_d = n.op.Gemm(dah2, hp2, transA=1)
            b_d = rec.bias_grad(dax2, dah2)
        else:
            da_zr, da_n = n.op.Split(dax2, n.b.ints([2 * H, H]), axis=-1, outputs=2)
            r_d = n.op.Concat(n.op.Gemm(da_zr, hp2, transA=1), n.op.Gemm(da_n, rhp, transA=1), axis=0)
            b_d = rec.bias_grad(dax2)
        dx.append(x_d), dw.append(w_d), dr.append(r_d), db.append(b_d), dh0.append(carry)
    return rec.gradients(dx, dw, dr, db, dh0)


@register("LSTM", inputs=(0, 1, 2, 3, 7), beyond_tags=(5, 6))
def lstm(n: Node):
    """Gates i, o, f, c; peepholes P = [Pi, Po, Pf]; A = X W' + H_t-1 R' + Wb + Rb:
    i = f(Ai + Pi C_t-1),  fg = f(Af + Pf C_t-1),  c = g(Ac),  C_t = fg C_t-1 + i c,
    o = f(Ao + Po C_t),  H_t = o h(C_t).

    dAo = dH h(C_t) f',  dC = dC_t + dH o h'(C_t) + dAo Po,
    dAi = dC c f',  dAf = dC C_t-1 f',  dAc = dC i g',
    dH_t-1 = [dAi, dAo, dAf, dAc] R,  dC_t-1 = dC fg + dAi Pi + dAf Pf,
    dW = sum dA' X,  dR = sum dA' H_t-1,  dB = [sum dA, sum dA],
    dP = sum [dAi C_t-1, dAo C_t, dAf C_t-1],
    d initial_h, d initial_c = dH_t-1, dC_t-1 of the first step (beyond the tags, as PyTorch's h_0, c_0).
    """
    if n.attr("input_forget", 0):
        n.decline("input_forget=1 (coupled input and forget gates) has no gradient rule")
    rec = _Recurrence(n, 4, ["Sigmoid", "Tanh", "Tanh"], has_cell=True)
    H, T = rec.H, rec.T
    peep = n.input(7)
    peepholes = None if peep is None else rec._per_direction(peep, 0)
    dx, dw, dr, db, dh0, dc0, dp = [], [], [], [], [], [], []
    for d in range(rec.D):
        f, g, h = rec.acts[d]
        hp2 = rec.rows(rec.hprev(d))
        a = rec.seq(rec.preact(d, slice(0, 4), hp2), 4 * H)           # [T, B, 4H]
        iof, cand = n.op.Split(a, n.b.ints([3 * H, H]), axis=-1, outputs=2)
        c_s, dc_s = (rec.steps(v) for v in rec.activate(g, cand))
        if peepholes is None:                                          # gates need no cell state: all steps at once
            v, dv = rec.activate(f, iof)
            (i_s, o_s, f_s), (di_s, do_s, df_s) = ([rec.steps(u) for u in rec.split_last(w, 3)] for w in (v, dv))
            p_i = p_o = p_f = None
        else:
            a_i, a_o, a_f = (rec.steps(u) for u in rec.split_last(iof, 3))
            p_i, p_o, p_f = rec.split_last(peepholes[d], 3)
            i_s, di_s, o_s, do_s, f_s, df_s = ([None] * T for _ in range(6))
        # the forward once more, step by step: cell states (and the gates that peep at them)
        c_prev, c_new, hc, dhc = [None] * T, [None] * T, [None] * T, [None] * T
        state = rec.c0[d] if rec.c0 is not None else n.b.zeros_like(c_s[0])
        for t in rec.order(d):
            c_prev[t] = state
            if p_i is not None:
                i_s[t], di_s[t] = rec.activate(f, a_i[t] + p_i * state)
                f_s[t], df_s[t] = rec.activate(f, a_f[t] + p_f * state)
            c_new[t] = f_s[t] * state + i_s[t] * c_s[t]
            if p_o is not None:
                o_s[t], do_s[t] = rec.activate(f, a_o[t] + p_o * c_new[t])
            hc[t] = h.value(n, c_new[t])
            dhc[t] = h.grad(n, c_new[t], hc[t])
            state = c_new[t] if rec.within is None else n.op.Where(rec.within[t], c_new[t], state)
        # backward through time
        dy = None if rec.dy is None else rec.steps(rec.dy[d])
        carry_h = None if rec.dyh is None else rec.dyh[d]
        carry_c = None if rec.dyc is None else rec.dyc[d]
        da = [None] * T
        for t in reversed(rec.order(d)):
            dh, passed_h = _masked(rec, t, _seed_at(t, carry_h, dy))
            dc_in, passed_c = _masked(rec, t, carry_c)
            if dh is None:                                             # only Y_c seeds the last step
                dc = dc_in
                dao = n.b.zeros_like(dc)
            else:
                dao = dh * hc[t] * do_s[t]
                dc = total(dh * o_s[t] * dhc[t], dc_in)
                if p_o is not None:
                    dc = dc + dao * p_o
            dai, daf, dac = dc * c_s[t] * di_s[t], dc * c_prev[t] * df_s[t], dc * i_s[t] * dc_s[t]
            da[t] = n.op.Concat(dai, dao, daf, dac, axis=-1)
            carry_h = total(n.op.MatMul(da[t], rec.r[d]), passed_h)
            carry_c = dc * f_s[t]
            if p_i is not None:
                carry_c = carry_c + dai * p_i + daf * p_f
            carry_c = total(carry_c, passed_c)
        da3 = rec.stack(da)
        da2 = rec.rows(da3)
        x_d, w_d, r_d = rec.weight_grads(d, da3, da2, hp2)
        dx.append(x_d), dw.append(w_d), dr.append(r_d), db.append(rec.bias_grad(da2))
        dh0.append(carry_h), dc0.append(carry_c)
        if peepholes is not None and n.needs(7):
            da_iof = n.op.Slice(da3, n.b.ints([0]), n.b.ints([3 * H]), n.b.ints([-1]))
            cp, cn = rec.stack(c_prev), rec.stack(c_new)
            dp.append(n.b.sum(da_iof * n.op.Concat(cp, cn, cp, axis=-1), [0, 1], keepdims=False))
    return rec.gradients(dx, dw, dr, db, dh0, dc0, dp)
