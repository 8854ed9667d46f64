"""Rewrites for onnxruntime-web's WebGPU providers: every node on the GPU, every value right.

Measured in Chromium with onnxruntime-web 1.30, through the ``ort.all`` bundle's JSEP provider and the
``ort.webgpu`` bundle's native one: first on one-node models against onnxruntime's CPU provider (a probe of an
earlier session, not kept), then on whole training graphs by ``tests/test_browser.py``, which trains five model
families on both and reads every node's placement from onnxruntime's verbose log. What the providers lack or get
wrong, and the standard ops written here instead:

- variadic ``Sum`` and ``Mean`` run on the CPU in both, ``Max``/``Min`` in JSEP: trees of ``Add``, and
  ``Where(a > b, a, b)``;
- a node binding more than eight tensors (WebGPU's guaranteed storage buffers per shader) is computed WRONG
  by JSEP without a word (a ``Concat`` of 8 inputs, a ``Split`` into 8 outputs: an unrolled LSTM's time steps)
  and refused by the native provider: trees of at most seven;
- ``Conv`` without an explicit ``dilations`` fails in JSEP: the defaults written out;
- ``MaxPool`` with its ``Indices`` output fails in both: the 2x2 pool's gradient from four strided compares
  (:mod:`onnxgrad.passes.optimize.pool`'s, with float masks: ``And``/``Or`` run on the CPU in JSEP);
- ``SoftmaxCrossEntropyLoss`` and ``NegativeLogLikelihoodLoss`` run as their function bodies, whose
  ``LogSoftmax`` runs on the CPU: written with ``ReduceMax``, ``Exp``, ``ReduceSum``, ``Log``;
- ``ScatterElements`` runs on the CPU in JSEP: with constant indices, a ``ScatterND`` at the coordinates
  computed here; with one index per row (the loss gradients' scatter at the targets' classes), a ``Where`` of
  the class compare; an embedding's gradient (a ``ScatterND`` at int64 indices, which must stay int64 there) as
  one-hot rows and a ``MatMul``;
- the training step's finiteness check (``IsNaN``, ``IsInf``, ``Or`` run on the CPU): ``|x| < FLT_MAX``; any
  other ``IsNaN`` (softmax's gradient on fully masked rows): ``not (x == x)``. Both rely on IEEE comparisons
  with NaN, which WGSL leaves to the implementation: checked on SwiftShader;
- nothing of int64 runs on the GPU (arithmetic, comparisons, ``Where``, ``Cast``, ``Unsqueeze``): class labels
  are fed as int32 (:func:`labels_as_int32`), the step count is int32 and the step's float64 scalars move to a
  schedule model computed on the CPU (:mod:`onnxgrad.passes.optimize.schedule`; the JavaScript session evaluates
  its few scalar ops itself);
- ``Identity`` runs on the CPU in JSEP: readers read its input (:func:`without_identities`);
- ``And`` and ``Or`` of masks (Clip's gradient) run on the CPU: products and sums of 0/1 floats;
- a forward ``LSTM`` (on the CPU in JSEP) unrolled into per-step ops (GRU and RNN are not yet).

Train-mode ``BatchNormalization`` (refused by both) is :mod:`onnxgrad.passes.optimize.batch_norm`'s.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...ir import model as M
from ...ir.builder import Builder, Var
from ...ir.model import FLOAT_TYPES
from .conv import CONV_TRANSPOSE_SYMMETRIC
from .guard import guard_as_where
from .pool import first_maximum_taps, max_pool_taps_check, max_pool_taps_pattern
from .rewriter import GraphView, Match, Report, Rewrite, apply
from .schedule import Schedule, split_schedule

__all__ = ["WEBGPU_REWRITES", "MAX_BINDINGS", "eval_for_webgpu", "for_webgpu", "integer_constants_folded",
           "labels_as_int32", "static_shapes_folded", "without_identities"]

MAX_BINDINGS = 8      # WebGPU's guaranteed maxStorageBuffersPerShaderStage: a node's inputs and outputs together
FLT_MAX = float(np.finfo(np.float32).max)


# -- variadic elementwise ops ------------------------------------------------------------------------------
def _variadic(view: GraphView, node: onnx.NodeProto) -> Match | None:
    inputs = [x for x in node.input if x]
    return Match(node, [node.output[0]], dict(inputs=inputs, op=node.op_type))


def _float_check(view: GraphView, m: Match) -> str | None:
    if any(view.info(x).dtype not in FLOAT_TYPES for x in m.inputs):
        return "an input is not a float tensor of known type"
    return None


def _tree(b: Builder, values: Sequence[Var], combine) -> Var:
    """``combine`` folded over ``values`` as a balanced tree (fewer dependent steps than a chain)."""
    values = list(values)
    while len(values) > 1:
        values = [combine(values[k], values[k + 1]) if k + 1 < len(values) else values[k]
                  for k in range(0, len(values), 2)]
    return values[0]


def _sum_as_adds(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """Sum(x1..xn) = x1 + ... + xn;  Mean = Sum / n  (the same broadcasting as Add's)."""
    total = _tree(b, [b.var(x) for x in m.inputs], lambda u, v: u + v)
    if m.op == "Mean" and len(m.inputs) > 1:
        total = total * b.scalar(1.0 / len(m.inputs), total)
    return [total]


def _larger(b: Builder, u: Var, v: Var) -> Var:
    return b.op.Where(b.op.Greater(u, v), u, v)


def _smaller(b: Builder, u: Var, v: Var) -> Var:
    return b.op.Where(b.op.Less(u, v), u, v)


def _max_min_as_where(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """Max(a, b) = Where(a > b, a, b), Min(a, b) = Where(a < b, a, b), over a tree for more inputs."""
    pick = _larger if m.op == "Max" else _smaller
    return [_tree(b, [b.var(x) for x in m.inputs], lambda u, v: pick(b, u, v))]


SUM_AS_ADDS = Rewrite("sum_as_adds", "Sum", _variadic, _float_check, _sum_as_adds,
                      "Sum as a tree of Add (the WebGPU providers run Sum on the CPU)", forward=None)
MEAN_AS_ADDS = Rewrite("mean_as_adds", "Mean", _variadic, _float_check, _sum_as_adds,
                       "Mean as a tree of Add times 1/n (the WebGPU providers run Mean on the CPU)", forward=None)
MAX_AS_WHERE = Rewrite("max_as_where", "Max", _variadic, _float_check, _max_min_as_where,
                       "Max as Where(a > b, a, b) (JSEP runs Max on the CPU)", forward=None)
MIN_AS_WHERE = Rewrite("min_as_where", "Min", _variadic, _float_check, _max_min_as_where,
                       "Min as Where(a < b, a, b) (JSEP runs Min on the CPU)", forward=None)


# -- nodes binding too many tensors ------------------------------------------------------------------------
_FAN = MAX_BINDINGS - 1       # inputs of a Concat, outputs of a Split: one binding is the other side


def _wide_concat(view: GraphView, node: onnx.NodeProto) -> Match | None:
    if len(node.input) <= _FAN:
        return None
    return Match(node, [node.output[0]], dict(inputs=list(node.input), axis=int(view.attr(node, "axis"))))


def _concat(b: Builder, parts: list[Var], axis: int) -> Var:
    """Concat(x1..xn) = Concat(Concat(x1..x7), Concat(x8..x14), ...), each node binding at most eight tensors
    (:data:`MAX_BINDINGS`)."""
    while len(parts) > _FAN:
        parts = [b.op.Concat(*parts[k:k + _FAN], axis=axis) if len(parts[k:k + _FAN]) > 1 else parts[k]
                 for k in range(0, len(parts), _FAN)]
    return b.op.Concat(*parts, axis=axis) if len(parts) > 1 else parts[0]


def _concat_tree(b: Builder, view: GraphView, m: Match) -> list[Var]:
    return [_concat(b, [b.var(x) for x in m.inputs], m.axis)]


def _wide_split(view: GraphView, node: onnx.NodeProto) -> Match | None:
    outputs = list(node.output)
    if len(outputs) <= _FAN:
        return None
    return Match(node, outputs, dict(x=node.input[0], axis=int(view.attr(node, "axis", 0)),
                                     split=node.input[1] if len(node.input) > 1 and node.input[1] else None,
                                     legacy=view.attr(node, "split")))


def _split_sizes(view: GraphView, m: Match) -> list[int] | None:
    if m.split is not None:
        value = view.value(m.split)
        return None if value is None else [int(v) for v in value.reshape(-1)]
    if m.legacy is not None:
        return [int(v) for v in m.legacy]
    shape = view.shape(m.x)
    n = len(m.outputs)
    if shape is None:
        return None
    dim = shape[m.axis]
    if dim % n == 0:
        return [dim // n] * n
    chunk = -(-dim // n)                 # opset 18's num_outputs: equal chunks, the last one smaller
    return [chunk] * (n - 1) + [dim - chunk * (n - 1)]


def _split_check(view: GraphView, m: Match) -> str | None:
    if _split_sizes(view, m) is None:
        return "its split sizes are not known when the graph is built"
    return None


def _split_tree(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """Split into n parts = Split into at most seven groups of consecutive parts, each group split again."""
    sizes = _split_sizes(view, m)

    def split(x: Var, sizes: list[int]) -> list[Var]:
        if len(sizes) == 1:
            return [x]
        if len(sizes) <= _FAN:
            return list(b.op.Split(x, b.ints(sizes), axis=m.axis, outputs=len(sizes)))
        per = -(-len(sizes) // _FAN)
        groups = [sizes[k:k + per] for k in range(0, len(sizes), per)]
        pieces = split(x, [sum(g) for g in groups])
        return [part for piece, g in zip(pieces, groups) for part in split(piece, g)]

    return split(b.var(m.x), sizes)


CONCAT_TREE = Rewrite("concat_tree", "Concat", _wide_concat, lambda view, m: None, _concat_tree,
                      f"Concat of more than {_FAN} inputs as a tree (JSEP computes a wider one wrong)", forward=None)
SPLIT_TREE = Rewrite("split_tree", "Split", _wide_split, _split_check, _split_tree,
                     f"Split into more than {_FAN} outputs as a tree (JSEP computes a wider one wrong)", forward=None)


# -- convolutions: the attributes JSEP needs written out -------------------------------------------------------
def _implicit_conv(view: GraphView, node: onnx.NodeProto) -> Match | None:
    if view.attr(node, "dilations") is not None and view.attr(node, "strides") is not None:
        return None
    return Match(node, list(node.output), dict(node=node))


def _conv_check(view: GraphView, m: Match) -> str | None:
    if view.info(m.node.input[1]).shape is None:
        return "its weight's rank is not known"
    return None


def _explicit_conv(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """The same Conv/ConvTranspose with ``dilations`` and ``strides`` written out (ones: the defaults)."""
    node = m.node
    spatial = len(view.info(node.input[1]).shape) - 2
    attrs = view.attributes(node)
    attrs.setdefault("dilations", [1] * spatial)
    attrs.setdefault("strides", [1] * spatial)
    out = b.emit(node.op_type, [b.var(x) if x else None for x in node.input], **attrs)
    return [out]


CONV_EXPLICIT = Rewrite("conv_explicit_attributes", "Conv", _implicit_conv, _conv_check, _explicit_conv,
                        "Conv with dilations and strides written out (JSEP's Conv fails without them)", forward=None)
CONV_TRANSPOSE_EXPLICIT = Rewrite("conv_transpose_explicit_attributes", "ConvTranspose", _implicit_conv, _conv_check,
                                  _explicit_conv, "ConvTranspose with dilations and strides written out", forward=None)


# -- MaxPool's gradient without the Indices output -------------------------------------------------------------
MAX_POOL_TAPS_FLOAT = Rewrite("max_pool_taps_float", "ScatterElements", max_pool_taps_pattern, max_pool_taps_check,
                              first_maximum_taps, "2x2 MaxPool's scatter at the Indices as its taps compared with "
                              "y, float masks (the WebGPU providers fail MaxPool's Indices; JSEP runs And/Or on the "
                              "CPU)")


# -- the loss ops -----------------------------------------------------------------------------------------------
def _loss(view: GraphView, node: onnx.NodeProto) -> Match | None:
    return Match(node, [o for o in node.output if o], dict(
        x=node.input[0], labels=node.input[1], weights=node.input[2] if len(node.input) > 2 and node.input[2] else None,
        reduction=view.attr(node, "reduction", "mean"), ignore_index=view.attr(node, "ignore_index"),
        softmax=node.op_type == "SoftmaxCrossEntropyLoss", outputs=list(node.output)))


def _loss_check(view: GraphView, m: Match) -> str | None:
    x = view.info(m.x)
    if x.dtype not in FLOAT_TYPES or x.shape is None or len(x.shape) < 2 or x.shape[1] is None:
        return "its scores' type, rank or number of classes is not known"
    return None


def _loss_as_ops(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """logp = x - max - log(sum(exp(x - max)))  (SoftmaxCrossEntropyLoss; NegativeLogLikelihoodLoss reads x as
    logp);  loss = -sum_c w logp reduced, w the target's class weight (0 where ignored), as in rules.losses."""
    from ...rules.losses import target_weights

    x = b.var(m.x)
    logp = x
    if m.softmax:
        shifted = x - b.reduce("ReduceMax", x, [1], keepdims=True)
        logp = shifted - b.op.Log(b.sum(b.op.Exp(shifted), [1], keepdims=True))
    w = target_weights(b, x, b.var(m.labels), b.var(m.weights) if m.weights else None, m.ignore_index)
    per_target = -b.sum(w * logp, [1], keepdims=False)                   # [N, d...]
    if m.reduction == "none":
        loss = per_target
    elif m.reduction == "sum":
        loss = b.sum(per_target, None, keepdims=False)
    else:
        loss = b.sum(per_target, None, keepdims=False) / b.sum(w, None, keepdims=False)
    outs = [loss]
    if len(m.outputs) > 1 and m.outputs[1]:
        outs.append(logp)
    return outs


SOFTMAX_CROSS_ENTROPY_AS_OPS = Rewrite(
    "softmax_cross_entropy_as_ops", "SoftmaxCrossEntropyLoss", _loss, _loss_check, _loss_as_ops,
    "SoftmaxCrossEntropyLoss as ReduceMax, Exp, ReduceSum, Log and a class mask (LogSoftmax runs on the CPU)",
    forward=None)
NLL_AS_OPS = Rewrite("nll_loss_as_ops", "NegativeLogLikelihoodLoss", _loss, _loss_check, _loss_as_ops,
                     "NegativeLogLikelihoodLoss as a class mask and a ReduceSum", forward=None)


# -- ScatterElements at constant indices -----------------------------------------------------------------------
def _scatter_elements(view: GraphView, node: onnx.NodeProto) -> Match | None:
    return Match(node, [node.output[0]], dict(data=node.input[0], indices=node.input[1], updates=node.input[2],
                                              axis=int(view.attr(node, "axis", 0)),
                                              reduction=view.attr(node, "reduction", "none")))


def _constant_indices(view: GraphView, name: str) -> np.ndarray | None:
    """``name``'s value when it is known when the graph is built: a constant, or a constant expanded to the
    static shape the Expand makes (a gradient's indices broadcast over the updates)."""
    value = view.value(name)
    expand = view.made_by(name, "Expand") if value is None else None
    if expand is not None and view.value(expand.input[0]) is not None and view.shape(name) is not None:
        value = np.broadcast_to(view.value(expand.input[0]), view.shape(name))
    return value


def _scatter_check(view: GraphView, m: Match) -> str | None:
    if _constant_indices(view, m.indices) is None:
        return "its indices are computed at run time"
    if view.shape(m.data) is None:
        return "its data's shape is not static"
    if m.reduction not in ("none", "add"):
        return f"its reduction is {m.reduction}"
    return None


def _scatter_as_nd(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """ScatterElements(data, idx, upd, axis) = ScatterND(data, coords, upd): coords[i] is i with its ``axis``
    coordinate replaced by idx[i], computed here from the constant indices."""
    idx = _constant_indices(view, m.indices).astype(np.int64)
    rank = idx.ndim
    axis = m.axis % rank
    dim = view.shape(m.data)[axis]
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in idx.shape], indexing="ij"), axis=-1)
    grid[..., axis] = np.where(idx < 0, idx + dim, idx)
    coords = b.const(grid.astype(np.int64))
    return [b.op.ScatterND(b.var(m.data), coords, b.var(m.updates), reduction=m.reduction)]


SCATTER_ELEMENTS_AS_ND = Rewrite("scatter_elements_as_nd", "ScatterElements", _scatter_elements, _scatter_check,
                                 _scatter_as_nd, "ScatterElements at constant indices (or a constant expanded) as "
                                 "ScatterND (JSEP runs ScatterElements on the CPU)", forward=None)


# -- ScatterElements of one index per row (a loss's gradient at each target's class) --------------------------------
def _one_per_row_check(view: GraphView, m: Match) -> str | None:
    data, indices = view.shape(m.data), view.shape(m.indices)
    if data is None or indices is None or len(indices) != len(data):
        return "its shapes are not static"
    axis = m.axis % len(data)
    if indices[axis] != 1:
        return "it scatters more than one element per row"
    if any(i != d for k, (i, d) in enumerate(zip(indices, data)) if k != axis):
        return "its indices cover part of the data's rows (a Where would broadcast them over every row)"
    if m.reduction not in ("none", "add"):
        return f"its reduction is {m.reduction}"
    return None


def _one_per_row_as_where(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """ScatterElements(data, idx, upd, axis), idx of extent 1 on ``axis``: Where(idx == j, upd, data) at every
    position j of ``axis`` (the class mask the loss gradients were written with before they scattered)."""
    rank = len(view.shape(m.data))
    axis = m.axis % rank
    positions = [1] * rank
    positions[axis] = view.shape(m.data)[axis]
    index_type = helper.tensor_dtype_to_np_dtype(view.info(m.indices).dtype or TensorProto.INT64)
    ids = b.const(np.arange(positions[axis], dtype=index_type).reshape(positions))
    data, updates = b.var(m.data), b.var(m.updates)
    hit = b.op.Equal(b.var(m.indices), ids)
    return [b.op.Where(hit, data + updates if m.reduction == "add" else updates, data)]


ONE_PER_ROW_SCATTER_AS_WHERE = Rewrite(
    "one_per_row_scatter_as_where", "ScatterElements", _scatter_elements, _one_per_row_check, _one_per_row_as_where,
    "ScatterElements of one element per row (the loss gradients' at the targets' classes) as a Where of the "
    "class compare (JSEP runs ScatterElements on the CPU)", forward=None)


# -- a mask unsqueezed: the comparison made on the unsqueezed operand ---------------------------------------------
_COMPARE_OPS = ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")


def _unsqueezed_compare(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """Unsqueeze(cmp(a, c), axes), c a one-element constant (an embedding's padding mask)."""
    compare = next((view.made_by(node.input[0], op) for op in _COMPARE_OPS if view.made_by(node.input[0], op)), None)
    if compare is None or len(node.input) < 2:
        return None
    for k in (0, 1):
        c = view.value(compare.input[1 - k])
        if c is not None and c.size == 1:
            return Match(node, [node.output[0]], dict(op=compare.op_type, a=compare.input[k], c=compare.input[1 - k],
                                                      axes=node.input[1], constant_first=k == 1))
    return None


def _compare_unsqueezed(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """Unsqueeze(cmp(a, c)) = cmp(Unsqueeze(a), c) for a one-element c: the boolean Unsqueeze (on the CPU in JSEP)
    becomes one of ``a``'s type (int32 for ids fed as such, :func:`labels_as_int32`)."""
    a = b.op.Unsqueeze(b.var(m.a), b.var(m.axes))
    operands = (b.var(m.c), a) if m.constant_first else (a, b.var(m.c))
    return [b.emit(m.op, list(operands))]


UNSQUEEZED_COMPARE = Rewrite("compare_unsqueezed", "Unsqueeze", _unsqueezed_compare, lambda view, m: None,
                             _compare_unsqueezed, "an unsqueezed comparison with a constant as the comparison of the "
                             "unsqueezed operand (JSEP unsqueezes booleans on the CPU)", forward=None)


# -- a scatter-add along the first axis (an embedding's gradient) --------------------------------------------------
def _row_scatter(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """ScatterND(zeros, Unsqueeze(idx, [-1]), upd): rows of upd added at idx (Gather's gradient along axis 0)."""
    unsqueeze = view.made_by(node.input[1], "Unsqueeze")
    zeros = view.made_by(node.input[0], "ConstantOfShape")
    if unsqueeze is None or zeros is None or view.attr(node, "reduction", "none") not in ("none", "add"):
        return None
    axes = view.value(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else view.attr(unsqueeze, "axes")
    fill = next((numpy_helper.to_array(a.t) for a in zeros.attribute if a.name == "value"), np.zeros(1))
    if axes is None or list(np.asarray(axes).reshape(-1)) != [-1] or np.any(fill != 0):
        return None
    return Match(node, [node.output[0]], dict(idx=unsqueeze.input[0], upd=node.input[2], out=node.output[0]))


def _row_scatter_check(view: GraphView, m: Match) -> str | None:
    out, idx = view.shape(m.out), view.shape(m.idx)
    if out is None or idx is None or view.info(m.upd).dtype not in FLOAT_TYPES:
        return "its shapes are not static or its updates are not floats"
    return None


def _row_scatter_as_matmul(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """out[i] = sum_j [idx_j == i] upd_j = onehot(idx)^T @ upd: the int64 indices a ScatterND needs become a
    comparison, which computes in int32 (:func:`labels_as_int32`), and a MatMul."""
    dims = view.shape(m.out)
    rows, count = dims[0], int(np.prod(view.shape(m.idx), dtype=np.int64))
    per_row = int(np.prod(dims[1:], dtype=np.int64))
    hit = b.op.Equal(b.const(np.arange(rows, dtype=np.int64).reshape(rows, 1)),
                     b.op.Reshape(b.var(m.idx), b.const(np.array([1, count], np.int64))))
    upd = b.var(m.upd)
    hot = b.op.Cast(hit, to=view.info(m.upd).dtype)                                           # [rows, count]
    flat = b.op.Reshape(upd, b.const(np.array([count, per_row], np.int64)))                  # [count, rest]
    return [b.op.Reshape(b.op.MatMul(hot, flat), b.const(np.array(dims, np.int64)))]


ROW_SCATTER_AS_MATMUL = Rewrite("row_scatter_as_matmul", "ScatterND", _row_scatter, _row_scatter_check,
                                _row_scatter_as_matmul, "an embedding's gradient (rows scattered at int64 indices, "
                                "which the WebGPU providers compute on the CPU) as one-hot rows and a MatMul",
                                forward=None)


# -- LSTM's forward (JSEP runs LSTM on the CPU) -----------------------------------------------------------------
def _lstm(view: GraphView, node: onnx.NodeProto) -> Match | None:
    return Match(node, list(node.output), dict(node=node, inputs=list(node.input) + [""] * (8 - len(node.input))))


def _lstm_check(view: GraphView, m: Match) -> str | None:
    node, (x, w, _, _, lens, _, _, peep) = m.node, m.inputs
    plain = (view.attr(node, "direction", "forward") == "forward" and not view.attr(node, "activations")
             and view.attr(node, "clip") is None and not view.attr(node, "input_forget", 0)
             and not view.attr(node, "layout", 0) and not lens and not peep)
    if not plain:
        return "only a forward LSTM with the default activations, no clip, peepholes or sequence lengths"
    if view.shape(x) is None or view.shape(w) is None:
        return "its input's or weights' shape is not static"
    return None


def _lstm_as_ops(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """ONNX's LSTM unrolled over its T steps (gates i, o, f, c in W's order):
    g = x_t W^T + h R^T + Wb + Rb;  c = sigmoid(f) c + sigmoid(i) tanh(c~);  h = sigmoid(o) tanh(c)."""
    x, w, r, bias, _, h0, c0, _ = m.inputs
    steps, batch, features = view.shape(x)
    hidden = view.shape(w)[1] // 4
    weights = b.op.Transpose(b.squeeze(b.var(w), [0]), perm=[1, 0])                     # [I, 4H]
    recurrent = b.op.Transpose(b.squeeze(b.var(r), [0]), perm=[1, 0])                   # [H, 4H]
    inputs = b.op.MatMul(b.op.Reshape(b.var(x), b.ints([steps * batch, features])), weights)
    if bias:
        wb, rb = b.op.Split(b.squeeze(b.var(bias), [0]), b.ints([4 * hidden, 4 * hidden]), axis=0, outputs=2)
        inputs = inputs + (wb + rb)
    inputs = b.op.Reshape(inputs, b.ints([steps, batch, 4 * hidden]))
    h = b.squeeze(b.var(h0), [0]) if h0 else None
    c = b.squeeze(b.var(c0), [0]) if c0 else None
    hs = []
    for t in range(steps):
        gates = b.op.Gather(inputs, b.const(np.array(t, np.int64)), axis=0)             # [B, 4H]
        if h is not None:
            gates = gates + b.op.MatMul(h, recurrent)
        i, o, f, g = b.op.Split(gates, b.ints([hidden] * 4), axis=1, outputs=4)
        new = b.op.Sigmoid(i) * b.op.Tanh(g)
        c = new if c is None else b.op.Sigmoid(f) * c + new
        h = b.op.Sigmoid(o) * b.op.Tanh(c)
        hs.append(h)
    y = _concat(b, [b.unsqueeze(v, [0, 1]) for v in hs], 0)                              # [T, 1, B, H]
    outs = [y, b.unsqueeze(h, [0]), b.unsqueeze(c, [0])]
    return outs[:len(m.outputs)]


LSTM_AS_OPS = Rewrite("lstm_as_ops", "LSTM", _lstm, _lstm_check, _lstm_as_ops,
                      "a forward LSTM unrolled into MatMul, Sigmoid and Tanh per step (JSEP runs LSTM on the CPU)",
                      forward=None)


# -- the training step's finiteness check -----------------------------------------------------------------------
def _finite_check(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """Not(Or(IsNaN(x), IsInf(x)))."""
    either = view.made_by(node.input[0], "Or")
    if either is None:
        return None
    nan, inf = view.made_by(either.input[0], "IsNaN"), view.made_by(either.input[1], "IsInf")
    if nan is None or inf is None or nan.input[0] != inf.input[0]:
        return None
    return Match(node, [node.output[0]], dict(x=nan.input[0]))


def _finite_as_compare(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """isfinite(x) = |x| < FLT_MAX  (false for NaN and for either infinity)."""
    x = b.var(m.x)
    return [b.op.Less(b.op.Abs(x), b.scalar(FLT_MAX, x))]


FINITE_AS_COMPARE = Rewrite("finite_as_compare", "Not", _finite_check,
                            lambda view, m: None if view.info(m.x).dtype == TensorProto.FLOAT else "not float32",
                            _finite_as_compare, "isfinite as |x| < FLT_MAX (IsNaN, IsInf, Or run on the CPU)",
                            forward=None)

def _logic(view: GraphView, node: onnx.NodeProto) -> Match | None:
    return Match(node, [node.output[0]], dict(a=node.input[0], b=node.input[1], op=node.op_type))


def _logic_as_arithmetic(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """a and b = [a] * [b] > 0,  a or b = [a] + [b] > 0  ([.]: 1.0 for true, 0.0 for false)."""
    a, c = (b.op.Cast(b.var(x), to=TensorProto.FLOAT) for x in (m.a, m.b))
    both = a * c if m.op == "And" else a + c
    return [b.op.Greater(both, b.scalar(0.0, both))]


AND_AS_ARITHMETIC = Rewrite("and_as_arithmetic", "And", _logic, lambda view, m: None, _logic_as_arithmetic,
                            "And of masks as a product of 0/1 floats (JSEP runs And on the CPU)", forward=None)
OR_AS_ARITHMETIC = Rewrite("or_as_arithmetic", "Or", _logic, lambda view, m: None, _logic_as_arithmetic,
                           "Or of masks as a sum of 0/1 floats (both providers run Or on the CPU)", forward=None)


def _isnan(view: GraphView, node: onnx.NodeProto) -> Match | None:
    return Match(node, [node.output[0]], dict(x=node.input[0]))


def _isnan_as_compare(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """isnan(x) = not (x == x)  (the one value unequal to itself)."""
    x = b.var(m.x)
    return [b.op.Not(b.op.Equal(x, x))]


ISNAN_AS_COMPARE = Rewrite("isnan_as_compare", "IsNaN", _isnan,
                           lambda view, m: None if view.info(m.x).dtype in FLOAT_TYPES else "not a float tensor",
                           _isnan_as_compare, "IsNaN as Not(x == x) (IsNaN runs on the CPU): softmax's gradient "
                           "zeroes the rows of a fully masked attention with it", forward=None)

WEBGPU_REWRITES = (SUM_AS_ADDS, MEAN_AS_ADDS, MAX_AS_WHERE, MIN_AS_WHERE, CONCAT_TREE, SPLIT_TREE,
                   CONV_TRANSPOSE_SYMMETRIC, CONV_EXPLICIT, CONV_TRANSPOSE_EXPLICIT, MAX_POOL_TAPS_FLOAT,
                   SOFTMAX_CROSS_ENTROPY_AS_OPS, NLL_AS_OPS, SCATTER_ELEMENTS_AS_ND, ONE_PER_ROW_SCATTER_AS_WHERE,
                   ROW_SCATTER_AS_MATMUL, FINITE_AS_COMPARE, ISNAN_AS_COMPARE, AND_AS_ARITHMETIC, OR_AS_ARITHMETIC,
                   LSTM_AS_OPS, UNSQUEEZED_COMPARE)


# -- whole-graph passes -------------------------------------------------------------------------------------------
def without_identities(model: onnx.ModelProto) -> int:
    """Remove the main graph's Identity nodes in place: their readers read the input instead, and an Identity
    making a graph output hands that name to its input's producer. An Identity between a graph input (or an
    initializer) and a graph output stays. Returns how many were removed."""
    g = model.graph
    outputs = {o.name for o in g.output}
    sources = {i.name for i in g.input} | {t.name for t in g.initializer}
    removed = 0
    for node in list(g.node):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            continue
        src, dst = node.input[0], node.output[0]
        if dst in outputs:
            if src in sources or src in outputs:
                continue
            renames = {src: dst}            # the producer makes the output's name; its readers read that
        else:
            renames = {dst: src}
        g.node.remove(node)
        M.rename_tensors(list(g.node), renames)
        removed += 1
    return removed


def integer_constants_folded(model: onnx.ModelProto) -> int:
    """Replace, in place, the main graph's nodes that compute integers from constants alone (an exporter's axes
    made by a Reshape of an initializer) by Constants, so that shape inference sees their values. Returns how
    many were folded."""
    g = model.graph
    inputs = {i.name for i in g.input}
    values = {t.name: numpy_helper.to_array(t) for t in g.initializer
              if t.name not in inputs and t.data_type in _INTEGERS and math.prod(t.dims) <= M.SHAPE_DATA_LIMIT}
    opset = M.opset_of(model)
    count = 0
    for k, node in enumerate(g.node):
        if node.op_type == "Constant":
            out = M.folded(node, values, opset)
            if out is not None and all(v.dtype.kind in "iub" for v in out.values()):
                values.update(out)
            continue
        out = M.folded(node, values, opset)
        if out is None or len(out) != 1 or not all(v.dtype.kind in "iub" and v.size <= M.SHAPE_DATA_LIMIT
                                                   for v in out.values()):
            continue
        (name, value), = out.items()
        values[name] = value
        g.node[k].CopyFrom(helper.make_node("Constant", [], [name], name=node.name,
                                            value=numpy_helper.from_array(value)))
        count += 1
    if count:                   # the initializers only the folded nodes read
        read = {x for n in g.node for x in [*n.input, *M.subgraph_inputs(n)]} | {o.name for o in g.output}
        M.keep_only(g.initializer, lambda t: t.name in read or t.name in inputs)
    return count


_INTEGERS = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL})


def static_shapes_folded(model: onnx.ModelProto) -> int:
    """Replace, in place, the main graph's Shape and Size nodes of tensors whose shape is static by Constants (the
    WebGPU providers run Size, and the int64 arithmetic on a shape, on the CPU; onnxruntime folds what a constant
    feeds), and what they computed with integer constants alone. Returns how many were folded.

    Inference without data propagation first, round after round (each round's folded shapes make the next
    one's Reshape targets constants), then once with it if Shape nodes of tensors not yet known remain: the same
    folding as inference with data propagation from the start, at a fraction of its cost on a training graph
    (EfficientNet-B0's: 0.1 s a round against 1.5 s)."""
    integer_constants_folded(model)
    total, rounds = 0, 0
    while any(n.op_type in ("Shape", "Size") for n in model.graph.node):
        rounds += 1
        data_prop = rounds > _FAST_ROUNDS
        folded = _shapes_folded(model, M.tensor_infos(M.infer(model, data_prop=data_prop))[0])
        total += folded
        if folded:        # what the folded shapes alone computed (an exporter's Expand of a shape): constants too
            integer_constants_folded(model)
        if data_prop:
            break
        if not folded:    # nothing more without data propagation: one round with it
            rounds = _FAST_ROUNDS
    return total


_FAST_ROUNDS = 3        # rounds of inference without data propagation before the one with it


def _shapes_folded(model: onnx.ModelProto, infos: dict[str, M.TensorInfo]) -> int:
    """Shape and Size nodes of the tensors ``infos`` knows statically replaced by Constants; how many."""
    folded = 0
    for k, node in enumerate(model.graph.node):
        if node.op_type not in ("Shape", "Size") or node.domain not in ("", "ai.onnx"):
            continue
        info = infos.get(node.input[0])
        if info is None or not info.static:
            continue
        shape = np.array(info.shape, np.int64)
        if node.op_type == "Size":
            value = np.array(int(np.prod(shape)), np.int64)
        else:
            start, end = GraphView.attr(node, "start", 0), GraphView.attr(node, "end")
            value = shape[start:end]
        model.graph.node[k].CopyFrom(helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                                      value=numpy_helper.from_array(value)))
        folded += 1
    return folded


def _with_types(model: onnx.ModelProto) -> None:
    """Record the inferred type of every tensor the graph's value_info lacks."""
    g = model.graph
    known = {vi.name for vi in [*g.value_info, *g.input, *g.output]} | {t.name for t in g.initializer}
    M.add_value_infos(g, [(vi.name, vi.type) for vi in M.infer(model).graph.value_info if vi.name not in known])


# ops that compute in int32 as they do in int64, and the positions of their data inputs (the others are
# shapes or axes, int64 by the schema); comparisons end a region (their output is bool)
_DATA_INPUTS = {"Equal": (0, 1), "Less": (0, 1), "Greater": (0, 1), "LessOrEqual": (0, 1), "GreaterOrEqual": (0, 1),
                "Where": (1, 2), "Add": (0, 1), "Sub": (0, 1), "Mul": (0, 1), "Neg": (0,), "Abs": (0,),
                "Unsqueeze": (0,), "Squeeze": (0,), "Reshape": (0,), "Flatten": (0,), "Expand": (0,), "Cast": (0,),
                "Gather": (0, 1), "GatherElements": (0, 1), "Identity": (0,)}
_COMPARISONS = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"})
_INDICES = {"Gather": 1, "GatherElements": 1}       # int32 indices index as int64 ones do; the output is the data's


def labels_as_int32(model: onnx.ModelProto, inputs: Sequence[str]) -> list[str]:
    """Retype int64 graph inputs to int32 in place where everything they flow into computes in int32 as well
    (class labels: the loss's comparisons, ``Where`` and masks; the WebGPU providers run no int64 op on the GPU).
    Their int64 region becomes int32: the tensors that carry it and the int64 constants it meets. Returns the
    inputs retyped; one whose region reaches an op that needs int64 (a ScatterND's indices, a shape) or a
    computed int64 tensor stays as it is."""
    g = model.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for x in node.input:
            readers.setdefault(x, []).append(node)
    constants = {t.name: t for t in g.initializer}
    constants.update({n.output[0]: n for n in g.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx")})
    infos, _ = M.tensor_infos(M.infer(model))
    retyped = []
    for name in inputs:
        vi = next((i for i in g.input if i.name == name), None)
        if vi is None or vi.type.tensor_type.elem_type != TensorProto.INT64:
            continue
        tensors = _int64_region(name, readers, constants, infos)
        if tensors is None:
            continue
        for value in [*g.input, *g.value_info, *g.output]:
            if value.name in tensors and value.type.tensor_type.elem_type == TensorProto.INT64:
                value.type.tensor_type.elem_type = TensorProto.INT32
        for t in tensors:
            if t in constants:
                _to_int32_constant(constants[t])
            infos[t] = M.TensorInfo(TensorProto.INT32, infos[t].shape if t in infos else None)
        retyped.append(name)
    return retyped


def _int64_region(start: str, readers, constants, infos) -> set[str] | None:
    """The int64 tensors ``start`` flows into through ops that compute in int32 alike, with the int64 constants
    they meet; None when the region reaches anything else."""
    region, todo = {start}, [start]
    while todo:
        x = todo.pop()
        for node in readers.get(x, []):
            positions = _DATA_INPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            if positions is None:
                return None
            at = [k for k, i in enumerate(node.input) if i == x]
            if any(k not in positions for k in at):
                return None                                  # the tensor is a shape or axes there
            if _INDICES.get(node.op_type) in at or node.op_type == "Cast":
                continue                                     # indices, or a Cast reading it: the output is not ours
            for k in positions:
                other = node.input[k] if k < len(node.input) else ""
                if other and other not in region and (infos.get(other) or M.TensorInfo()).dtype == TensorProto.INT64:
                    if other not in constants:
                        return None                          # a computed int64 tensor: not this region's
                    region.add(other)
            if node.op_type in _COMPARISONS:
                continue
            for y in node.output:
                if y and y not in region:
                    region.add(y)
                    todo.append(y)
    return region


def _to_int32_constant(item) -> None:
    if isinstance(item, onnx.TensorProto):
        item.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(item).astype(np.int32), item.name))
        return
    for a in item.attribute:
        if a.name == "value":
            a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.int32), a.t.name))


def for_webgpu(train: onnx.ModelProto, rewrites: Sequence[Rewrite], *, finite: str, schedule_inputs: Sequence[str],
               data_inputs: Sequence[str]) -> tuple[onnx.ModelProto, Schedule | None, Report, list[str]]:
    """A training graph (its gradient already rewritten by ``rewrites``) made to run on the WebGPU providers: the
    update guarded by ``Where``, ``rewrites`` applied to the nodes the training builder added, int64 class labels
    fed as int32, no Identity, and the step's scalars (everything computed from ``schedule_inputs`` alone) moved
    to a schedule model. Returns the graph, the schedule, the report and the data inputs retyped to int32."""
    train, _ = guard_as_where(train, finite)
    static_shapes_folded(train)     # first: without Shape nodes, inference skips data propagation (seconds)
    _with_types(train)          # the builder's nodes carry none: the rewrites' checks read them
    train, report = apply(train, [r for r in rewrites if r.forward is None], first=0, copy=False)
    retyped = labels_as_int32(train, data_inputs)
    without_identities(train)
    train, schedule = split_schedule(train, schedule_inputs)
    return train, schedule, report, retyped


def eval_for_webgpu(model: onnx.ModelProto, rewrites: Sequence[Rewrite], *, data_inputs: Sequence[str]
                    ) -> onnx.ModelProto:
    """An eval (or inference) graph made to run on the WebGPU providers: ``rewrites`` applied to every node,
    int64 class labels fed as int32, no Identity."""
    static_shapes_folded(model)
    _with_types(model)
    model, _ = apply(model, [r for r in rewrites if r.forward is None], first=0, copy=False)
    labels_as_int32(model, data_inputs)
    without_identities(model)
    return model
