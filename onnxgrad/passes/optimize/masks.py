"""Mask rewrites: a gradient let through where a condition holds, zero elsewhere.

The canonical rules write ``Where(mask, dy, 0)`` (ReLU, ThresholdedRelu, Clip, ...), which is
PyTorch's ``threshold_backward``. onnxruntime's CPU Where with a scalar branch is a slow broadcast
kernel; ``dy * Cast(mask)`` gives the same values for finite ``dy`` at the cost of two cheap
elementwise passes. A non-finite ``dy`` where the mask is false becomes NaN instead of 0: only
gradients of the piecewise-linear ops are rewritten, whose kept branch is the incoming gradient, where a
non-finite value already means a failed step; a Where that scrubs NaN on purpose (the safe softmax of
attention's fully masked rows, ``Where(IsNaN(y), 0, y)``) keeps its Where.
"""
from __future__ import annotations

import onnx

from ...ir.builder import Builder, Var
from ...ir.model import FLOAT_TYPES
from .rewriter import GraphView, Match, Rewrite


def _pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """Where(mask, a, 0) or Where(mask, 0, a), the zero a scalar constant."""
    mask, first, second = node.input
    if view.is_scalar(second, 0.0):
        return Match(node, [node.output[0]], dict(mask=mask, a=first, negate=False))
    if view.is_scalar(first, 0.0):
        return Match(node, [node.output[0]], dict(mask=mask, a=second, negate=True))
    return None


# forward ops whose gradient rule masks the incoming gradient: Where(mask, dy, 0) and its scalings
_MASKING_RULES = {"Relu", "PRelu", "ThresholdedRelu", "HardSigmoid", "HardSwish", "Shrink", "Clip", "Where"}


def _forward_op(view: GraphView, node: onnx.NodeProto) -> str | None:
    """The op type of the forward node whose gradient ``node`` belongs to (named ``<forward>/grad/...``)."""
    name = node.name.split("/grad/")[0] if "/grad/" in node.name else None
    forward = next((n for n in view.nodes if id(n) in view.forward and n.name == name), None)
    return forward.op_type if forward is not None else None


def _check(view: GraphView, m: Match) -> str | None:
    if view.info(m.a).dtype not in FLOAT_TYPES:
        return "the kept branch is not a float tensor of known type"
    op = _forward_op(view, m.root)
    if op not in _MASKING_RULES:
        return (f"the Where belongs to the gradient of {op or 'no known forward node'}, not to a rule that masks "
                "the incoming gradient: its zero branch may replace a NaN on purpose, which a product keeps")
    return None


def _replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """Where(mask, a, 0) = a * float(mask);  Where(mask, 0, a) = a * float(not mask)"""
    mask = b.var(m.mask)
    if m.negate:
        mask = b.op.Not(mask)
    a = b.var(m.a)
    return [a * b.op.Cast(mask, to=a.dtype)]


WHERE_ZERO_AS_MUL = Rewrite("where_zero_as_mul", "Where", _pattern, _check, _replacement,
                            "Where(mask, dy, 0) as dy * Cast(mask)")
