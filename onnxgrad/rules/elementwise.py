"""Arithmetic and elementwise math. Broadcasting is undone by the pass (``broadcast=True``)."""
from __future__ import annotations

from ..registry import register


@register("Add", broadcast=True)
def add(n):
    """d(x + y) = (dy, dy)"""
    return n.dy, n.dy


@register("Sub", broadcast=True)
def sub(n):
    """d(x - y) = (dy, -dy)"""
    return n.dy, -n.dy


@register("Mul", broadcast=True)
def mul(n):
    """d(x * y) = (dy * y, dy * x)"""
    x, y = n.inputs
    return n.dy * y, n.dy * x


@register("Div", broadcast=True)
def div(n):
    """d(x / y) = (dy / y, -dy * z / y)  with z = x / y"""
    _, y = n.inputs
    z = n.outputs[0]
    dx = n.dy / y
    return dx, (-dx * z if n.needs(1) else None)


@register("Neg")
def neg(n):
    """d(-x) = -dy"""
    return (-n.dy,)
