"""A depthwise convolution on a small image as batched MatMuls, lowered before the gradient (CPU target).

onnxruntime's CPU Conv runs a depthwise convolution (group = channels) whose weight is an input, as in a training
step, as one im2col and Gemm per channel: 1.7 to 8 times PyTorch's at MobileNet's and EfficientNet's shapes, the
most on the small images of the last stages (``[4, 672, 4, 4]`` with a 5x5 kernel: 0.38-0.65 ms against
0.055-0.077; ``[4, 144, 56, 56]``, 3x3: 0.92-0.95 against 0.33; ``python bench/bench_kernels.py depthwise``). On
an image of P <= 64 positions each channel's convolution is a linear map, a [P, O] matrix (O output positions)
that the kernel's taps fill:

    T[c] = sum_k w[c, k] S[k],   y[n, c] = x[n, c] T[c]   (x[n, c] a row of P values, y[n, c] of O)

``S[k]`` (constant, 0/1) marks which input position output position o reads through tap k (padding read as
nothing); the T of every channel is one MatMul of the kernels [C, K] by S [K, P*O], and the convolution one
batched MatMul over the channels: 0.13 ms for the first case above. The model is rewritten before it is
differentiated, so the backward is the MatMuls' own: dx = dy T^T, dT = x^T dy, dw = dT S^T.
"""
from __future__ import annotations

import numpy as np
import onnx

from ...ir.builder import Builder, Var
from ...ir.model import FLOAT_TYPES
from .rewriter import GraphView, Match, Rewrite, batch_target

# the image's positions. At 64 (8x8) the MatMuls' forward alone is a little slower than the Conv (0.32-0.42 ms against
# 0.28) but the step as fast or faster (EfficientNet-B0 57.1 ms at 64, 58.3 at 16, 66.7 without); at 256 (16x16)
# they are 9-17x slower than the Conv
_MAX_POSITIONS = 64


def _pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """y = Conv(x, w[, bias]) with group = channels (w [C, 1, kh, kw]), 2-D, explicit pads."""
    if len(node.input) < 2 or view.attr(node, "auto_pad", "NOTSET") != "NOTSET":
        return None
    ws = view.shape(node.input[1])
    group = view.attr(node, "group", 1)
    if ws is None or len(ws) != 4 or group == 1 or ws[0] != group or ws[1] != 1:
        return None
    bias = node.input[2] if len(node.input) > 2 else ""
    return Match(node, [node.output[0]], dict(x=node.input[0], w=node.input[1], bias=bias))


def _check(view: GraphView, m: Match) -> str | None:
    xs, ys = view.batched_shape(m.x), view.batched_shape(m.outputs[0])
    if xs is None or ys is None:
        return "x and y need static shapes (but for the batch axis)"
    if view.info(m.x).dtype not in FLOAT_TYPES:
        return "x is not a float tensor of known type"
    if xs[2] * xs[3] > _MAX_POSITIONS:
        return f"{xs[2]}x{xs[3]} positions: above {_MAX_POSITIONS} onnxruntime's Conv is faster"
    return None


def tap_matrix(image: tuple[int, int], out: tuple[int, int], kernel: tuple[int, int], strides: list[int],
               dilations: list[int], pads: list[int]) -> np.ndarray:
    """S [K, P, O]: S[k, p, o] = 1 where output position o reads input position p through tap k."""
    (h, w), (oh, ow), (kh, kw) = image, out, kernel
    s = np.zeros((kh * kw, h * w, oh * ow))
    for i in range(oh):
        for j in range(ow):
            for a in range(kh):
                for b in range(kw):
                    r, c = i * strides[0] - pads[0] + a * dilations[0], j * strides[1] - pads[1] + b * dilations[1]
                    if 0 <= r < h and 0 <= c < w:
                        s[a * kw + b, r * w + c, i * ow + j] = 1.0
    return s


def _replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    (n, c, h, w), (_, _, oh, ow) = view.batched_shape(m.x), view.batched_shape(m.outputs[0])
    batch = batch_target(n)
    kernel = tuple(view.shape(m.w)[2:])
    node = m.root
    strides, dilations = view.attr(node, "strides", [1, 1]), view.attr(node, "dilations", [1, 1])
    pads = view.attr(node, "pads", [0, 0, 0, 0])
    x = b.var(m.x)
    taps = b.const(tap_matrix((h, w), (oh, ow), kernel, strides, dilations, pads).reshape(kernel[0] * kernel[1], -1),
                   x.dtype)                                                                   # S [K, P*O]
    per_channel = b.op.Reshape(b.op.MatMul(b.op.Reshape(b.var(m.w), b.ints([c, -1])), taps),
                               b.ints([c, h * w, oh * ow]))                                   # T [C, P, O]
    rows = b.op.Transpose(b.op.Reshape(x, b.ints([batch, c, h * w])), perm=[1, 0, 2])       # [C, N, P]
    y = b.op.Reshape(b.op.Transpose(b.op.MatMul(rows, per_channel), perm=[1, 0, 2]), b.ints([batch, c, oh, ow]))
    if m.bias:
        y = y + b.op.Reshape(b.var(m.bias), b.ints([c, 1, 1]))
    return [y]


DEPTHWISE_CONV_AS_MATMUL = Rewrite(
    "depthwise_conv_as_matmul", "Conv", _pattern, _check, _replacement,
    "a depthwise Conv on an image of at most 64 positions as batched MatMuls by per-channel tap matrices",
    forward=True)
