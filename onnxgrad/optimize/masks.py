"""Mask rewrites: a gradient let through where a condition holds, zero elsewhere.

The canonical rules write ``Where(mask, dy, 0)`` (ReLU, ThresholdedRelu, Clip, ...), which is
PyTorch's ``threshold_backward``. onnxruntime's CPU Where with a scalar branch is a slow broadcast
kernel; ``dy * Cast(mask)`` gives the same values for finite ``dy`` at the cost of two cheap
elementwise passes. A non-finite ``dy`` where the mask is false becomes NaN instead of 0: only
gradients (nodes after the forward) are rewritten, where that already means a failed step.
"""
from __future__ import annotations

import onnx

from ..builder import FLOAT_TYPES, Builder, Var
from .rewriter import GraphView, Match, Rewrite


def _is_zero(view: GraphView, name: str) -> bool:
    value = view.value(name)
    return value is not None and value.size == 1 and float(value.reshape(-1)[0]) == 0.0


def _pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """Where(mask, a, 0) or Where(mask, 0, a), the zero a scalar constant."""
    mask, first, second = node.input
    if _is_zero(view, second):
        return Match(node, [node.output[0]], dict(mask=mask, a=first, negate=False))
    if _is_zero(view, first):
        return Match(node, [node.output[0]], dict(mask=mask, a=second, negate=True))
    return None


def _check(view: GraphView, m: Match) -> str | None:
    if view.info(m.a).dtype not in FLOAT_TYPES:
        return "the kept branch is not a float tensor of known type"
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
