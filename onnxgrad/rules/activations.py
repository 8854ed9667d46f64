"""Gradient rules: activations."""
from __future__ import annotations

from ..registry import register


@register("Relu")
def relu(n):
    """d relu(x) = dy * (y > 0)"""
    y = n.outputs[0]
    return (n.op.Where(n.op.Greater(y, n.b.scalar(0.0, y)), n.dy, n.b.scalar(0.0, y)),)


@register("Tanh")
def tanh(n):
    """d tanh(x) = dy * (1 - y^2)"""
    y = n.outputs[0]
    return (n.dy * (1.0 - y * y),)
