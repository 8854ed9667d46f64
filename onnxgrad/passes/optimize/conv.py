"""Convolution backward rewrites for onnxruntime's CPU kernels.

The canonical rules (:mod:`onnxgrad.rules.nn`) emit the weight gradient as the swapped-role Conv
(batch and channels exchanged; dy as a kernel as large as the image, whose output is the few taps)
and the input gradient as a ConvTranspose. onnxruntime's CPU Conv is an im2col + Gemm built for
small kernels and many output channels, the opposite shape, and its ConvTranspose is a Gemm +
col2im. ``bench/bench_rewrites.py`` measures each replacement against the canonical form.
"""
from __future__ import annotations

import numpy as np
import onnx

from ...ir.builder import Builder, Var
from ...ir.model import FLOAT_TYPES
from .rewriter import GraphView, Match, Rewrite, batch_target

_PATCH_MAX_ELEMENTS = 1 << 25     # the patches hold taps copies of x: above this, keep the Conv form
_PATCH_MAX_TAPS = 9               # larger kernels (ResNet's 7x7 stem) measured faster as the Conv form
_NOMINAL_BATCH = 32               # a batch axis left symbolic (an export's dynamic axis) counts as this many


def _is_swap(node: onnx.NodeProto | None, rank: int) -> bool:
    return node is not None and GraphView.attr(node, "perm") == [1, 0, *range(2, 2 + rank)]


def _cropped(view: GraphView, back: onnx.NodeProto, rank: int) -> onnx.NodeProto:
    """The weight gradient's last node: the Slice from 0 to the kernel on the spatial axes that reads the
    transposed-back Conv output ``back`` (its only reader), or ``back`` itself."""
    crop = view.only_reader(back.output[0], "Slice")
    if crop is None or len(crop.input) >= 5:
        return back
    starts, axes = view.value(crop.input[1]), view.value(crop.input[3]) if len(crop.input) > 3 else None
    if starts is not None and not starts.any() and axes is not None and list(axes) == list(range(2, 2 + rank)):
        return crop
    return back


# -- weight gradient: patches from a one-hot grouped Conv, then one Gemm --------------------------
def _weight_grad_pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """dW = Transpose(Conv(Transpose(x), Transpose(dy), strides=d, dilations=s, pads)) [then Slice to
    the kernel]: the canonical weight gradient (:func:`onnxgrad.rules.nn._filter_grad`, group 1)."""
    if len(node.input) != 2 or view.attr(node, "group", 1) != 1:
        return None
    tx, tdy = view.made_by(node.input[0], "Transpose"), view.made_by(node.input[1], "Transpose")
    if tx is None or tdy is None:
        return None
    rank = len(view.attr(tx, "perm", [])) - 2
    back = view.only_reader(node.output[0], "Transpose")
    if rank < 1 or not all(_is_swap(t, rank) for t in (tx, tdy, back)):
        return None
    final = _cropped(view, back, rank)
    return Match(final, [final.output[0]], dict(
        conv=node, x=tx.input[0], dy=tdy.input[0], rank=rank,
        strides=view.attr(node, "dilations", [1] * rank), dilations=view.attr(node, "strides", [1] * rank),
        pads=view.attr(node, "pads", [0] * (2 * rank))))


def _weight_grad_check(view: GraphView, m: Match) -> str | None:
    xs, ys, ws = view.batched_shape(m.x), view.batched_shape(m.dy), view.shape(m.outputs[0])
    if xs is None or ys is None or ws is None:
        return "x, dy and dW need static shapes (but for the batch axis)"
    if view.info(m.x).dtype not in FLOAT_TYPES:
        return "x is not a float tensor of known type"
    return _patches_check(m, xs, ys, list(ws[2:]))


def _patches_check(m: Match, xs: tuple, ys: tuple, kernel: list[int]) -> str | None:
    """Why the patches of x (``xs``) for a ``kernel`` are not the weight gradient's form, if they are not: a
    kernel of more taps than :data:`_PATCH_MAX_TAPS`, patches not of dy's (``ys``) positions, or too many."""
    taps = int(np.prod(kernel))
    if taps > _PATCH_MAX_TAPS:
        return f"a {'x'.join(map(str, kernel))} kernel: the swapped-role Conv is faster above {_PATCH_MAX_TAPS} taps"
    rank = m.rank
    for i in range(rank):
        extent = (kernel[i] - 1) * m.dilations[i] + 1
        out = (xs[2 + i] + m.pads[i] + m.pads[rank + i] - extent) // m.strides[i] + 1
        if out != ys[2 + i]:
            return f"the patches' size {out} along spatial axis {i} is not dy's {ys[2 + i]}"
    if (xs[0] or _NOMINAL_BATCH) * xs[1] * taps * int(np.prod(ys[2:])) > _PATCH_MAX_ELEMENTS:
        return (f"the patches would exceed {_PATCH_MAX_ELEMENTS} elements"
                + ("" if xs[0] else f" at a batch of {_NOMINAL_BATCH} (the batch axis is symbolic)"))
    return None


def _onehot(c: int, kernel: list[int]) -> np.ndarray:
    """The kernel [C*K, 1, *k] of the patches Conv: for each channel, one one-hot kernel per tap."""
    taps = int(np.prod(kernel))
    return np.tile(np.eye(taps).reshape(taps, 1, *kernel), (c, 1) + (1,) * len(kernel))


def _patches(b: Builder, view: GraphView, x: str, c: int, kernel: list[int], strides: list[int],
             dilations: list[int], pads: list[int]) -> Var:
    """im2col of x, [N, C*K, *O]: one Conv of x with the one-hot kernel, group = C. The forward's own
    patches of x (:data:`CONV_FORWARD_PATCHES`), where they are there, are read instead."""
    rank = len(kernel)
    for node in view.readers.get(x, []):
        if (node.op_type == "Conv" and node.input[0] == x and len(node.input) == 2
                and view.attr(node, "group", 1) == c and view.attr(node, "auto_pad", "NOTSET") == "NOTSET"
                and view.attr(node, "strides", [1] * rank) == list(strides)
                and view.attr(node, "dilations", [1] * rank) == list(dilations)
                and view.attr(node, "pads", [0] * (2 * rank)) == list(pads)):
            w = view.value(node.input[1])
            if w is not None and w.shape == (c * int(np.prod(kernel)), 1, *kernel) and (w == _onehot(c, kernel)).all():
                return b.var(node.output[0])
    return b.op.Conv(b.var(x), b.const(_onehot(c, kernel), b.var(x).dtype), group=c, strides=strides,
                     dilations=dilations, pads=pads)


def _weight_grad_replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """dW[m, c, k] = sum_{b, o} dy[b, m, o] * patches[b, c*K + k, o]: the patches (im2col) from one Conv
    of x with a constant one-hot kernel per tap, group = C (or the forward's, :func:`_patches`); then one
    Gemm over (batch, position), or batched MatMuls and a sum over the batch when the positions alone are
    many (no transposes of the patches)."""
    dy = b.var(m.dy)
    (n, c, *_), (_, out_ch, *o) = view.batched_shape(m.x), view.batched_shape(m.dy)
    kernel = view.shape(m.outputs[0])[2:]
    taps, positions, batch = int(np.prod(kernel)), int(np.prod(o)), batch_target(n)
    patches = _patches(b, view, m.x, c, kernel, m.strides, m.dilations, m.pads)              # [N, C*K, *O]
    if n == 1:
        dw = b.op.Gemm(b.op.Reshape(dy, b.ints([out_ch, positions])),
                       b.op.Reshape(patches, b.ints([c * taps, positions])), transB=1)
    elif positions >= 2 * out_ch:
        # patches[b] @ dy[b]^T, not dy[b] @ patches[b]^T: onnxruntime packs the right-hand operand, here the
        # smaller one (the product alone: ResNet's layer1 0.87x, bench_step's CNN conv1 0.88x and conv2 0.95x)
        per_image = b.op.MatMul(b.op.Reshape(patches, b.ints([batch, c * taps, positions])),
                                b.op.Transpose(b.op.Reshape(dy, b.ints([batch, out_ch, positions])),
                                               perm=[0, 2, 1]))                             # [N, C*K, M]
        dw = b.op.Transpose(b.sum(per_image, [0], keepdims=False), perm=[1, 0])
    else:
        rows = b.op.Transpose(b.op.Reshape(dy, b.ints([batch, out_ch, positions])), perm=[1, 0, 2])
        cols = b.op.Transpose(b.op.Reshape(patches, b.ints([batch, c * taps, positions])), perm=[1, 0, 2])
        dw = b.op.Gemm(b.op.Reshape(rows, b.ints([out_ch, -1])), b.op.Reshape(cols, b.ints([c * taps, -1])),
                       transB=1)                                                              # [M, C*K]
    return [b.op.Reshape(dw, b.ints([out_ch, c, *kernel]))]


CONV_WEIGHT_GRAD_PATCHES = Rewrite(
    "conv_weight_grad_patches", "Conv", _weight_grad_pattern, _weight_grad_check, _weight_grad_replacement,
    "the swapped-role Conv of a weight gradient as one-hot-Conv patches and a Gemm")


# -- depthwise weight gradient: the same patches, one batched MatMul per image and channel ----------------
def _depthwise_weight_grad_pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """The canonical weight gradient of a grouped Conv (:func:`onnxgrad.rules.nn._filter_grad`): x as
    ``Reshape(Transpose(Reshape(x, [N, G, Cg, *D]), [Cg, G, N, *D]), [Cg, G*N, *D])``, dy transposed, one
    Conv of group G, transposed back [then cropped]; matched when it is depthwise (a channel per group, and
    per output: checked by :func:`_depthwise_weight_grad_check`)."""
    group = view.attr(node, "group", 1)
    if len(node.input) != 2 or group == 1:
        return None
    joined, tdy = view.made_by(node.input[0], "Reshape"), view.made_by(node.input[1], "Transpose")
    moved = view.made_by(joined.input[0], "Transpose") if joined is not None else None
    split = view.made_by(moved.input[0], "Reshape") if moved is not None else None
    if tdy is None or split is None:
        return None
    rank = len(view.attr(tdy, "perm", [])) - 2
    back = view.only_reader(node.output[0], "Transpose")
    if (rank < 1 or view.attr(moved, "perm") != [2, 1, 0, *range(3, 3 + rank)]
            or not all(_is_swap(t, rank) for t in (tdy, back))):
        return None
    final = _cropped(view, back, rank)
    return Match(final, [final.output[0]], dict(
        conv=node, x=split.input[0], split=split.output[0], dy=tdy.input[0], rank=rank, group=group,
        strides=view.attr(node, "dilations", [1] * rank), dilations=view.attr(node, "strides", [1] * rank),
        pads=view.attr(node, "pads", [0] * (2 * rank))))


def _depthwise_weight_grad_check(view: GraphView, m: Match) -> str | None:
    xs, ys, ws = view.batched_shape(m.x), view.batched_shape(m.dy), view.shape(m.outputs[0])
    split = view.batched_shape(m.split)
    if xs is None or ys is None or ws is None or split is None:
        return "x, dy and dW need static shapes (but for the batch axis)"
    if view.info(m.x).dtype not in FLOAT_TYPES:
        return "x is not a float tensor of known type"
    if not (xs[1] == ys[1] == ws[0] == m.group and ws[1] == 1 and list(split[1:3]) == [m.group, 1]):
        return f"not depthwise: {xs[1]} channels in {m.group} groups, {ys[1]} outputs"
    return _patches_check(m, xs, ys, list(ws[2:]))


def _depthwise_weight_grad_replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """dW[c, k] = sum_{b, o} patches[b, c, k, o] * dy[b, c, o]: the one-hot-Conv patches of x
    (:func:`_patches`, [N, C*K, *O]) by dy, a [K, O] by [O, 1] product per image and channel, summed over
    the images."""
    (n, c, *_), (_, _, *o) = view.batched_shape(m.x), view.batched_shape(m.dy)
    kernel = list(view.shape(m.outputs[0])[2:])
    taps, positions, batch = int(np.prod(kernel)), int(np.prod(o)), batch_target(n)
    patches = _patches(b, view, m.x, c, kernel, m.strides, m.dilations, m.pads)              # [N, C*K, *O]
    per_image = b.op.MatMul(b.op.Reshape(patches, b.ints([batch, c, taps, positions])),
                            b.op.Reshape(b.var(m.dy), b.ints([batch, c, positions, 1])))   # [N, C, K, 1]
    dw = per_image if n == 1 else b.sum(per_image, [0], keepdims=False)
    return [b.op.Reshape(dw, b.ints([c, 1, *kernel]))]


DEPTHWISE_WEIGHT_GRAD_PATCHES = Rewrite(
    "depthwise_weight_grad_patches", "Conv", _depthwise_weight_grad_pattern, _depthwise_weight_grad_check,
    _depthwise_weight_grad_replacement,
    "the grouped swapped-role Conv of a depthwise weight gradient as one-hot-Conv patches and batched MatMuls")


# -- forward: patches and one MatMul, the patches shared with the weight gradient ----------------------
_FORWARD_MAX_POSITIONS = 64     # output positions per image; above, onnxruntime's Conv measured as fast or faster


def _forward_pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """y = Conv(x, w[, b]), group 1, explicit pads, whose weight gradient the backward computes in its
    canonical form (:func:`_weight_grad_pattern` on a Conv reading x swapped, at the same strides,
    dilations and pads): that gradient then reads the forward's patches."""
    if len(node.input) < 2 or view.attr(node, "group", 1) != 1 or view.attr(node, "auto_pad", "NOTSET") != "NOTSET":
        return None
    x = node.input[0]
    rank = len(view.info(node.input[1]).shape or ()) - 2
    if rank < 1:
        return None
    strides, dilations = view.attr(node, "strides", [1] * rank), view.attr(node, "dilations", [1] * rank)
    pads = view.attr(node, "pads", [0] * (2 * rank))
    for swap in view.readers.get(x, []):
        if swap.op_type != "Transpose" or not _is_swap(swap, rank):
            continue
        for reader in view.readers.get(swap.output[0], []):
            grad = _weight_grad_pattern(view, reader) if reader.op_type == "Conv" else None
            if grad is not None and (grad.strides, grad.dilations, grad.pads) == (strides, dilations, pads):
                bias = node.input[2] if len(node.input) > 2 else ""
                return Match(node, [node.output[0]], dict(x=x, w=node.input[1], bias=bias, strides=strides,
                                                          dilations=dilations, pads=pads, grad=grad))
    return None


def _forward_check(view: GraphView, m: Match) -> str | None:
    """Where the weight gradient takes the patches (its own check) and the positions are few."""
    why = _weight_grad_check(view, m.grad)
    if why is not None:
        return f"its weight gradient keeps the swapped-role Conv ({why})"
    positions = int(np.prod(view.batched_shape(m.grad.dy)[2:]))
    if positions > _FORWARD_MAX_POSITIONS:
        return f"{positions} positions per image: the Conv is as fast above {_FORWARD_MAX_POSITIONS}"
    return None


def _forward_replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """y[b] = w as [M, C*K] @ patches[b] as [C*K, L] (+ bias): onnxruntime's Conv with a weight that is an
    input (updated every step) has no fast layout (its NCHWc kernels need a constant weight) and makes im2col
    patches of its own; these come from a Conv with a constant kernel, and the weight gradient reads them
    instead of making them again."""
    (n, c, *_), (out_ch, _, *kernel) = view.batched_shape(m.x), view.shape(m.grad.outputs[0])
    o = view.batched_shape(m.grad.dy)[2:]
    taps, positions, batch = int(np.prod(kernel)), int(np.prod(o)), batch_target(n)
    patches = _patches(b, view, m.x, c, kernel, m.strides, m.dilations, m.pads)
    y = b.op.MatMul(b.op.Reshape(b.var(m.w), b.ints([out_ch, c * taps])),
                    b.op.Reshape(patches, b.ints([batch, c * taps, positions])))             # [N, M, L]
    y = b.op.Reshape(y, b.ints([batch, out_ch, *o]))
    if m.bias:
        y = y + b.op.Reshape(b.var(m.bias), b.ints([out_ch] + [1] * len(o)))
    return [y]


CONV_FORWARD_PATCHES = Rewrite(
    "conv_forward_patches", "Conv", _forward_pattern, _forward_check, _forward_replacement,
    "a forward Conv with few positions per image as one-hot-Conv patches and a MatMul, the patches shared "
    "with its weight gradient", forward=True)


# -- input gradient: ConvTranspose as a Conv with the flipped kernel ------------------------------
_FLIP_MIN_CHANNELS = 16     # below, the ConvTranspose measured faster (weights as inputs, as in a training step)


def _input_grad_pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """dx = ConvTranspose(dy, w), group 1, explicit pads, no output_shape or output padding: the canonical
    input gradient of a Conv (:func:`onnxgrad.rules.nn._window_transpose`), at any stride and dilation."""
    if len(node.input) != 2 or view.attr(node, "group", 1) != 1:
        return None
    if view.attr(node, "auto_pad", "NOTSET") != "NOTSET" or view.attr(node, "output_shape") is not None:
        return None
    output_padding = view.attr(node, "output_padding")
    if output_padding is not None and any(output_padding):
        return None
    return Match(node, [node.output[0]], dict(dy=node.input[0], w=node.input[1]))


def _flip_pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """:func:`_input_grad_pattern` at stride 1 and dilation 1: a stride-1 Conv's input gradient."""
    strides, dilations = view.attr(node, "strides"), view.attr(node, "dilations")
    if any(v is not None and any(s != 1 for s in v) for v in (strides, dilations)):
        return None
    return _input_grad_pattern(view, node)


def _flip_check(view: GraphView, m: Match) -> str | None:
    ws = view.shape(m.w)
    if ws is None:
        return "the kernel's shape is not static"
    if min(ws[:2]) < _FLIP_MIN_CHANNELS:
        return f"fewer than {_FLIP_MIN_CHANNELS} channels: the ConvTranspose is faster"
    rank = len(ws) - 2
    pads = view.attr(m.root, "pads", [0] * (2 * rank))
    if any(k - 1 - p < 0 for k, p in zip(list(ws[2:]) * 2, pads)):
        return "pads larger than the kernel"
    return None


def _flip_replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """ConvTranspose(dy, w) = Conv(dy, w^T reversed along every spatial axis), pads k - 1 - pad. Reversing
    every spatial axis reverses the taps' row-major order: one MatMul by the K x K exchange matrix, twice
    as fast in onnxruntime as a Slice with negative steps (ResNet's 128x128x3x3: 0.30 vs 0.62 ms)."""
    (out_ch, c, *kernel) = view.shape(m.w)
    rank, taps = len(kernel), int(np.prod(kernel))
    pads = view.attr(m.root, "pads", [0] * (2 * rank))
    swapped = b.op.Transpose(b.var(m.w), perm=[1, 0, *range(2, 2 + rank)])
    exchange = b.const(np.eye(taps)[::-1], b.var(m.w).dtype)
    flipped = b.op.Reshape(b.op.MatMul(b.op.Reshape(swapped, b.ints([c * out_ch, taps])), exchange),
                           b.ints([c, out_ch, *kernel]))
    return [b.op.Conv(b.var(m.dy), flipped, pads=[k - 1 - p for k, p in zip(kernel * 2, pads)])]


CONV_INPUT_GRAD_FLIPPED = Rewrite(
    "conv_input_grad_flipped", "ConvTranspose", _flip_pattern, _flip_check, _flip_replacement,
    "a stride-1 ConvTranspose as a Conv with the transposed, reversed kernel")


# -- input gradient: ConvTranspose as one Gemm over every image's positions, then Col2Im ----------------
_COL2IM_MAX_POSITIONS = 64    # dy's positions per image; above, the ConvTranspose measured as fast or faster


def _col2im_check(view: GraphView, m: Match) -> str | None:
    if view.opset < 18:
        return f"Col2Im needs opset 18, the model is at {view.opset}"
    ws, ys, xs = view.shape(m.w), view.info(m.dy).shape, view.info(m.outputs[0]).shape
    if ws is None or ys is None or xs is None or None in ys[1:] or None in xs[1:]:
        return "the kernel, and dy's and dx's channels and spatial dims, need static shapes"
    positions = int(np.prod(ys[2:]))
    if positions > _COL2IM_MAX_POSITIONS:
        return f"{positions} positions per image: the ConvTranspose is as fast above {_COL2IM_MAX_POSITIONS}"
    return None


def _col2im_replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """ConvTranspose(dy, w) = Col2Im(columns): the columns [C*K, L] of each image are w^T dy, computed
    for every image at once as one Gemm of dy's positions as rows ([N*L, M] by w as [M, C*K]), not as one
    skinny product per image; Col2Im then sums each column into its kernel window."""
    node = m.root
    (out_ch, c, *kernel), (_, _, *o), (_, _, *image) = (view.shape(m.w), view.info(m.dy).shape,
                                                        view.info(m.outputs[0]).shape)
    rank, positions, taps = len(kernel), int(np.prod(o)), int(np.prod(kernel))
    rows = b.op.Transpose(b.op.Reshape(b.var(m.dy), b.ints([0, out_ch, positions])), perm=[0, 2, 1])
    columns = b.op.Gemm(b.op.Reshape(rows, b.ints([-1, out_ch])), b.op.Reshape(b.var(m.w), b.ints([out_ch, -1])))
    columns = b.op.Transpose(b.op.Reshape(columns, b.ints([-1, positions, c * taps])), perm=[0, 2, 1])
    return [b.op.Col2Im(columns, b.ints(image), b.ints(kernel),
                        dilations=view.attr(node, "dilations", [1] * rank),
                        pads=view.attr(node, "pads", [0] * (2 * rank)),
                        strides=view.attr(node, "strides", [1] * rank))]


CONV_INPUT_GRAD_COL2IM = Rewrite(
    "conv_input_grad_col2im", "ConvTranspose", _input_grad_pattern, _col2im_check, _col2im_replacement,
    "a ConvTranspose with few positions per image as one Gemm over all images' positions and a Col2Im")


# -- ConvTranspose with asymmetric pads --------------------------------------------------------------------------
def _asymmetric_transpose(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """A ConvTranspose cropping fewer elements at the end than at the start (an input gradient of a strided
    Conv whose input size the stride does not divide: pads [1, 1, 0, 0])."""
    pads = view.attr(node, "pads")
    if not pads or view.attr(node, "auto_pad", "NOTSET") != "NOTSET" or not asymmetric(pads):
        return None
    return Match(node, list(node.output), dict(node=node, pads=pads))


def asymmetric(pads: list[int]) -> bool:
    """Whether ONNX ``pads`` (every axis' begin, then every axis' end) crop or pad an axis unevenly."""
    return list(pads[:len(pads) // 2]) != list(pads[len(pads) // 2:])


def _transpose_check(view: GraphView, m: Match) -> str | None:
    k = len(m.pads) // 2
    strides = view.attr(m.node, "strides") or [1] * k
    extra = view.attr(m.node, "output_padding") or [0] * k
    for i in range(k):
        more = m.pads[i] - m.pads[i + k] + extra[i]
        if m.pads[i] < m.pads[i + k] or more >= strides[i]:
            return "its pads cannot be written as symmetric pads and an output_padding below the stride"
    return None


def _symmetric_transpose(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """ConvTranspose(pads=[b, e]) = ConvTranspose(pads=[b, b], output_padding=b - e): the same window of the
    full output (output_padding extends it at the end). onnxruntime's CUDA provider hands asymmetric
    pads to the CPU provider (a host round trip inside the step), JSEP computes them wrong."""
    node, k = m.node, len(m.pads) // 2
    attrs = view.attributes(node)
    extra = attrs.get("output_padding") or [0] * k
    attrs["output_padding"] = [extra[i] + m.pads[i] - m.pads[i + k] for i in range(k)]
    attrs["pads"] = list(m.pads[:k]) * 2
    return [b.emit("ConvTranspose", [b.var(x) if x else None for x in node.input], **attrs)]


CONV_TRANSPOSE_SYMMETRIC = Rewrite(
    "conv_transpose_symmetric_pads", "ConvTranspose", _asymmetric_transpose, _transpose_check, _symmetric_transpose,
    "ConvTranspose's asymmetric pads as symmetric ones and output_padding (onnxruntime's CUDA provider runs "
    "asymmetric ones on the CPU, JSEP computes them wrong)", forward=None)
