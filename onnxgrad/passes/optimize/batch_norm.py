"""BatchNormalization in training mode as elementwise ops and reductions, for onnxruntime's CUDA provider.

onnxruntime's CUDA kernel refuses ``BatchNormalization(training_mode=1)`` from opset 14 on ("Training
mode does not support BN opset 14 (or higher) yet"): a session holding one is not built. The same
three outputs from standard ops, which every provider runs:

    mean = ReduceMean(x, every axis but 1)          var = ReduceMean((x - mean)^2)   (biased)
    y = (x - mean) * scale / sqrt(var + eps) + B
    running_mean = input_mean * momentum + mean * (1 - momentum)     (ONNX's formula; likewise the var)

The outputs keep their names, so the gradient rule (which reads the batch statistics) and the running
statistics :mod:`onnxgrad.training.train_mode` forms from them (PyTorch's unbiased update) read them unchanged.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto

from ...ir.builder import Builder, Var
from ...ir.model import FLOAT_TYPES
from .rewriter import GraphView, Match, Rewrite


def _pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """A BatchNormalization in training mode (opset 14 on: the attribute), whatever outputs it has."""
    if view.opset < 14 or not view.attr(node, "training_mode", 0):
        return None
    outputs = list(node.output)
    while outputs and not outputs[-1]:
        outputs.pop()
    return Match(node, outputs, dict(x=node.input[0], scale=node.input[1], bias=node.input[2], mean=node.input[3],
                                     var=node.input[4], epsilon=float(view.attr(node, "epsilon", 1e-5)),
                                     momentum=float(view.attr(node, "momentum", 0.9))))


def _check(view: GraphView, m: Match) -> str | None:
    info = view.info(m.x)
    if info.dtype not in FLOAT_TYPES:
        return "its input is not a float tensor of known type"
    if info.shape is None:
        return "its input's rank is not known"
    if len(info.shape) < 2:
        return "its input has no channel axis"
    if "" in m.outputs:
        return "it leaves its running mean out but not its running variance"
    if any(view.info(t).dtype != info.dtype for t in (m.scale, m.bias, m.mean, m.var)):
        return "its scale, bias or statistics are of another type than its input (BatchNormalization-15)"
    return None


def _replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """y = (x - mean) * scale / sqrt(var + eps) + B over the batch's statistics; the running outputs by ONNX's
    ``input * momentum + batch * (1 - momentum)`` (exactly the batch's when momentum is 0)."""
    dtype = view.info(m.x).dtype
    wide = dtype not in (TensorProto.FLOAT, TensorProto.DOUBLE)   # 16-bit: statistics in float, as PyTorch's

    def read(name: str) -> Var:
        return b.op.Cast(b.var(name), to=TensorProto.FLOAT) if wide else b.var(name)

    def back(v: Var) -> Var:
        return b.op.Cast(v, to=dtype) if wide else v

    x = read(m.x)
    rank = len(view.info(m.x).shape)
    channel_last = list(range(1, rank - 1))        # a [C] vector as [C, 1, ...] broadcasts against [N, C, ...]

    def per_channel(v: Var) -> Var:
        return b.unsqueeze(v, channel_last) if channel_last else v

    axes = [0, *range(2, rank)]
    mean = b.reduce("ReduceMean", x, axes, keepdims=False)                     # [C]
    centered = x - per_channel(mean)
    var = b.reduce("ReduceMean", centered * centered, axes, keepdims=False)    # [C], biased
    k = read(m.scale) / b.op.Sqrt(var + b.scalar(m.epsilon, x))
    outs = [back(centered * per_channel(k) + per_channel(read(m.bias)))]
    stats = [mean, var]
    if m.momentum != 0.0:
        stats = [read(old) * b.scalar(m.momentum, x) + batch * b.scalar(1.0 - m.momentum, x)
                 for old, batch in ((m.mean, mean), (m.var, var))]
    return outs + [back(s) for s in stats[:len(m.outputs) - 1]]


_DOC = "BatchNormalization(training_mode=1) as ReduceMean, Sub, Mul, Sqrt, Div, Add (onnxruntime's CUDA refuses it)"
BATCH_NORM_TRAINING_AS_OPS = Rewrite("batch_norm_training_as_ops", "BatchNormalization", _pattern, _check,
                                     _replacement, _DOC, forward=True)
# the backward's copies (onnxgrad.passes.recompute recomputes normalisations there in inference form; any other)
BATCH_NORM_TRAINING_AS_OPS_BACKWARD = Rewrite("batch_norm_training_as_ops_backward", "BatchNormalization",
                                              _pattern, _check, _replacement, _DOC)
