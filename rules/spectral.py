"""Gradient rules: Fourier transforms (DFT, STFT).

Both are linear in their signal: along the transformed axis ``Y = A X`` with
``A = F``, ``F[k, m] = exp(-2 pi i k m / N)``, or ``A = F^H / N`` for the inverse.
Complex tensors are real pairs (a last axis of 2), so the gradient is the real
adjoint, ``dX = A^H dY``; as A is symmetric, ``A^H dY = conj(A conj(dY))``: the
same DFT applied to the conjugated seed, conjugated back. A one-sided spectrum
keeps the first N // 2 + 1 entries of Y, so its seed is zero-padded back to N
first; a real input keeps the real part of the result.

The schemas tag these inputs NonDifferentiable (DFT's input, STFT's signal and
window), but PyTorch's torch.fft and torch.stft differentiate them, and so do we
(``beyond_tags``).
"""
from __future__ import annotations

import numpy as np

from onnxgrad.ir.builder import Var

from .registry import Node, register


def _conj(n: Node, v: Var) -> Var:
    """Complex conjugate of a [..., 2] tensor (real, imaginary)."""
    return v * n.b.const_like(np.array([1.0, -1.0]), v)


def _fit(n: Node, v: Var, axis: int, rank: int, have: int, want: int) -> Var:
    """v, of length ``have`` along ``axis``, cut or zero-padded at the end to length ``want``."""
    if want == have:
        return v
    if want < have:
        return n.op.Slice(v, n.b.ints([0]), n.b.ints([want]), n.b.ints([axis]))
    pads = [0] * (2 * rank)
    pads[rank + axis] = want - have
    return n.op.Pad(v, n.b.ints(pads))


def _full_dft(n: Node, v: Var, axis: int, inverse: int) -> Var:
    """DFT of a complex tensor along ``axis`` at its own length, two-sided (emitted in the model's opset's form)."""
    if n.opset < 20:
        return n.op.DFT(v, axis=axis, inverse=inverse)
    return n.op.DFT(v, None, n.b.const(np.array(axis, np.int64)), inverse=inverse)


def _adjoint(n: Node, dy: Var, axis: int, rank: int, length: int | None, onesided: bool, inverse: int) -> Var:
    """A^H dY = conj(A conj(dY)), the seed of a one-sided spectrum first zero-padded to ``length``."""
    if onesided:
        dy = _fit(n, dy, axis, rank, length // 2 + 1, length)
    return _conj(n, _full_dft(n, _conj(n, dy), axis, inverse))


def _real_part(n: Node, v: Var) -> Var:
    return n.op.Slice(v, n.b.ints([0]), n.b.ints([1]), n.b.ints([-1]))


def _const_int(n: Node, i: int, what: str) -> int | None:
    """Input i's constant scalar value, None when absent; declines when it is known only at run time."""
    if n.input(i) is None:
        return None
    value = n.const_ints(i)
    if value is None:
        n.decline(f"{n.proto.op_type}'s {what} must be a constant when the gradient is built")
    return value[0]


@register("DFT", beyond_tags=(0,))
def dft_17(n):
    """DFT-17: the axis is an attribute (default 1). See :func:`dft`."""
    return _dft(n, n.attr("axis", 1))


@register("DFT", beyond_tags=(0,), since=20)
def dft(n):
    """DFT-20: the axis is an optional input (default -2). Known only at run time, it is one of the
    signal's axes: the gradient along each is built and the one the axis names is taken (Where)."""
    if n.input(2) is not None and n.const_ints(2) is None:
        return _dft_any_axis(n)
    given = _const_int(n, 2, "axis")
    return _dft(n, -2 if given is None else given)


def _dft_any_axis(n: Node):
    x = n.inputs[0]
    if x.shape is None or any(d is None for d in x.shape):
        n.decline("DFT with an axis known only at run time needs its input's shape known when the gradient "
                  "is built")
    rank = len(x.shape)
    axis = n.op.Reshape(n.inputs[2], n.b.ints([]))
    rank_like = n.b.const(np.array(rank, np.int64))
    axis = n.op.Where(n.op.Less(axis, n.b.const(np.array(0, np.int64))), axis + rank_like, axis)
    y = n.outputs[0].shape
    candidates = [k for k in range(rank - 1)       # the last axis holds the (real, imaginary) pair
                  if y is None or None in y or _dft_shape(n, x.shape, k) == tuple(y)]
    if not candidates:
        n.decline("no axis of DFT's input gives its output's shape")
    dx = None
    for k in candidates:
        along = _dft(n, k)[0]
        dx = along if dx is None else n.op.Where(n.op.Equal(axis, n.b.const(np.array(k, np.int64))), along, dx)
    return dx, None, None


def _dft_shape(n: Node, shape: tuple, axis: int) -> tuple:
    """DFT's output shape along ``axis`` (complex pairs; one-sided keeps N // 2 + 1, the inverse real
    one-sided N = dft_length or 2 (len - 1))."""
    inverse, onesided = n.attr("inverse", 0), bool(n.attr("onesided", 0))
    given = n.const_ints(1) if n.input(1) is not None else None
    out = list(shape[:-1]) + [2]
    if inverse and onesided:
        out[axis], out[-1] = (given[0] if given else 2 * (shape[axis] - 1)), 1
    else:
        length = given[0] if given else shape[axis]
        out[axis] = length // 2 + 1 if onesided else length
    return tuple(out)


def _dft(n: Node, axis: int):
    """Y = A X_N along the axis: X cut or zero-padded to N = dft_length, A = F (or F^H / N, inverse);
    onesided keeps N // 2 + 1 outputs.

    dX = conj(A conj(dY)) (onesided seeds zero-padded to N), cut or padded back to X's length,
    its real part for a real X.
    """
    x = n.inputs[0]
    if x.shape is None or x.shape[-1] is None:
        n.decline("DFT needs its input's rank and last axis (real 1 or complex 2) known")
    rank = len(x.shape)
    inverse, onesided = n.attr("inverse", 0), bool(n.attr("onesided", 0))
    axis = axis + rank if axis < 0 else axis
    have = x.shape[axis]
    length = _const_int(n, 1, "dft_length")
    if inverse and onesided:
        return _irfft_grad(n, axis, rank, have, length), None, None
    if length is None:
        length = have
    if (onesided or length != have) and (length is None or have is None):
        n.decline("DFT needs the signal length along its axis known when the gradient is built")
    dx = _adjoint(n, n.dy, axis, rank, length, onesided, inverse)
    if length != have:
        dx = _fit(n, dx, axis, rank, length, have)
    return (_real_part(n, dx) if x.shape[-1] == 1 else dx), None, None


def _irfft_grad(n: Node, axis: int, rank: int, have: int | None, length: int | None) -> Var:
    """IRFFT, y = irfft(X, N) (X one-sided, y real; N = dft_length, default 2 (len(X) - 1)):
    y[t] = (1/N) sum_k c_k Re(X[k] exp(2 pi i k t / N)) over k <= N // 2, c_k = 2 except c_0 = 1 and,
    N even, c_{N/2} = 1 (the imaginary parts of X[0] and X[N/2] are ignored). So
    dX[k] = c_k / N * rfft(dy)[k] (real part: sum_t dy cos, imaginary: -sum_t dy sin), cut or
    zero-padded back to X's length (complex: the schema refuses a real IRFFT input).
    """
    if have is None:
        n.decline("IRFFT needs the spectrum's length along its axis known when the gradient is built")
    if length is None:
        length = 2 * (have - 1)
    kept = length // 2 + 1
    weights = np.full(kept, 2.0)
    weights[0] = 1.0
    if length % 2 == 0:
        weights[-1] = 1.0
    shape = [1] * rank
    shape[axis] = kept
    dy = n.dy
    size = n.b.const(np.array(length, np.int64))
    if n.opset < 20:
        spectrum = n.op.DFT(dy, size, axis=axis, onesided=1)
    else:
        spectrum = n.op.DFT(dy, size, n.b.const(np.array(axis, np.int64)), onesided=1)
    dx = spectrum * n.b.const_like(weights.reshape(shape) / length, dy)
    return _fit(n, dx, axis, rank, kept, have)


@register("STFT", beyond_tags=(0, 2))
def stft(n):
    """Y[b, f] = DFT(U[b, f]),  U[b, f, m] = w[m] Z[b, f, m],  Z[b, f, m] = S[b, f s + m] (frames of step s).

    dU = conj(DFT(conj(dY))) (onesided seeds zero-padded to N); dw[m] = sum_{b, f} dU[b, f, m] . Z[b, f, m]
    (real and imaginary parts), dZ = w dU, and dS[b, t] = sum of dZ[b, f, m] over the frames with f s + m = t.
    """
    signal = n.inputs[0]
    window = n.input(2)
    if signal.shape is None or None in signal.shape[1:]:
        n.decline("STFT needs the signal's length and its last axis (real 1 or complex 2) known")
    _, total, parts = signal.shape
    step = _const_int(n, 1, "frame_step")
    length = _const_int(n, 3, "frame_length")
    if length is None:
        if window is not None and (window.shape is None or window.shape[0] is None):
            n.decline("STFT needs its frame length known when the gradient is built")
        length = window.shape[0] if window is not None else total
    frames = (total - length) // step + 1
    du = _adjoint(n, n.dy, 2, 4, length, bool(n.attr("onesided", 1)), 0)                   # (B, F, N, 2)
    if parts == 1:
        du = _real_part(n, du)
    starts = np.arange(frames)[:, None] * step + np.arange(length)[None, :]                  # (F, N)
    dsignal = dwindow = None
    if window is not None and n.needs(2):
        z = n.op.Gather(signal, n.b.const(starts), axis=1)                                   # (B, F, N, C)
        dwindow = n.b.sum(du * z, [0, 1, 3], keepdims=False)
    if n.needs(0):
        dz = du if window is None else du * n.b.unsqueeze(window, [1])
        rows = n.op.Reshape(n.op.Transpose(dz, perm=[1, 2, 0, 3]), n.b.ints([frames * length, -1, parts]))
        zeros = n.b.zeros_like(n.op.Transpose(signal, perm=[1, 0, 2]))                          # (T, B, C)
        summed = n.op.ScatterND(zeros, n.b.const(starts.reshape(-1, 1)), rows, reduction="add")
        dsignal = n.op.Transpose(summed, perm=[1, 0, 2])
    return dsignal, None, dwindow, None
