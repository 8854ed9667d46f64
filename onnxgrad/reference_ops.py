"""Corrections to onnx.reference kernels, so the float64 numeric truth is right.

``onnx.reference`` is where the checker evaluates float64 models that onnxruntime
has no kernels for. Some of its kernels are wrong or missing; these replace them
(passed as ``new_ops``, nothing is patched globally). Each says what it fixes.
"""
from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun
from onnx.reference.ops import op_conv_transpose

_erf = np.vectorize(math.erf, otypes=[np.float64])


class Erf(OpRun):
    """onnx.reference's erf is a float32 approximation."""

    op_domain = ""

    def _run(self, x):
        return (_erf(x).astype(x.dtype),)


class Gelu(OpRun):
    """Exact in float64 (onnx.reference's uses its float32 erf)."""

    op_domain = ""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            y = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
        else:
            y = 0.5 * x * (1 + _erf(x / np.sqrt(2)))
        return (y.astype(x.dtype),)


class ConvTranspose(op_conv_transpose.ConvTranspose):
    """onnx.reference splits W by output channels for group > 1; W is split by input channels."""

    op_domain = ""

    def _run(self, X, W, B=None, group=None, **kw):
        run = super()._run
        if not group or group == 1:
            return run(X, W, B, group=1, **kw)
        parts = [run(x, w, None, group=1, **kw)[0]
                 for x, w in zip(np.split(X, group, axis=1), np.split(W, group, axis=0))]
        y = np.concatenate(parts, axis=1)
        if B is not None:
            y = y + B.reshape(1, -1, *[1] * (y.ndim - 2))
        return (y.astype(X.dtype),)


class LRN(OpRun):
    """onnx.reference sums its window over the batch axis (and takes 4-D only)."""

    op_domain = ""

    def _run(self, x, alpha=None, beta=None, bias=None, size=None):
        before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
        square_sum = np.zeros_like(x)
        for c in range(x.shape[1]):
            square_sum[:, c] = np.sum(x[:, max(0, c - before):c + after + 1] ** 2, axis=1)
        return ((x / (bias + alpha / size * square_sum) ** beta).astype(x.dtype),)


class GlobalLpPool(OpRun):
    """Missing from onnx.reference."""

    op_domain = ""

    def _run(self, x, p=None):
        axes = tuple(range(2, x.ndim))
        return ((np.sum(np.abs(x) ** p, axis=axes, keepdims=True) ** (1.0 / p)).astype(x.dtype),)


class MaxRoiPool(OpRun):
    """Missing from onnx.reference; onnxruntime's (Caffe's) bins."""

    op_domain = ""

    def _run(self, x, rois, pooled_shape=None, spatial_scale=None):
        ph, pw = pooled_shape
        scale = 1.0 if spatial_scale is None else spatial_scale
        height, width = x.shape[2:]
        y = np.zeros((rois.shape[0], x.shape[1], ph, pw), x.dtype)

        def rnd(v):
            return int(np.sign(v) * np.floor(abs(v) + 0.5))

        for r, (image, x1, y1, x2, y2) in enumerate(rois):
            sw, sh, ew, eh = (rnd(v * scale) for v in (x1, y1, x2, y2))
            bin_h, bin_w = max(eh - sh + 1, 1) / ph, max(ew - sw + 1, 1) / pw
            for i in range(ph):
                hs = min(max(int(np.floor(i * bin_h)) + sh, 0), height)
                he = min(max(int(np.ceil((i + 1) * bin_h)) + sh, 0), height)
                for j in range(pw):
                    ws = min(max(int(np.floor(j * bin_w)) + sw, 0), width)
                    we = min(max(int(np.ceil((j + 1) * bin_w)) + sw, 0), width)
                    if he > hs and we > ws:
                        y[r, :, i, j] = x[int(image), :, hs:he, ws:we].max(axis=(1, 2))
        return (y,)


KERNELS = [Erf, Gelu, ConvTranspose, LRN, GlobalLpPool, MaxRoiPool]
