"""One registry of tangent (forward-mode) rules, keyed by ai.onnx op type, after JAX's ``defjvp``/``deflinear``.

A tangent rule turns the tangents of a node's inputs into the tangents of its
outputs: ``rule(t: TNode) -> tangents``, one entry per output (a :class:`Var`, or
``None`` for no tangent; a single Var for single-output ops). It reads like the
formula::

    @defjvp("Exp")
    def exp(t):
        \"\"\"d exp(x) = dx * y\"\"\"
        return t.dx * t.outputs[0]

- ``deflinear(op, ...)``: the op is linear in its differentiable inputs (jointly,
  the others held fixed), so its tangent is the op itself applied to the tangents:
  d Reshape(x, s) = Reshape(dx, s). Missing tangents are zeros.
- A rule may return ``NotImplemented`` for a configuration it does not handle
  natively (MaxPool's column-major indices, BatchNormalization in training mode):
  the pass then uses the general fallback, the transpose of the op's reverse rule
  (:mod:`onnxgrad.passes.tangent_fallback`).

Which inputs carry tangents is :func:`onnxgrad.passes.reach.differentiable_positions`, the
same fact the reverse pass uses.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import onnx

from onnxgrad.ir.builder import Builder, Var

from ..registry import Node

Tangents = "Sequence[Var | None] | Var | None"


class TNode(Node):
    """What a tangent rule sees of one forward node.

    Everything a reverse rule's :class:`~onnxgrad.rules.registry.Node` has (``inputs``,
    ``outputs``, ``op``, ``b``, ``attr``, ``const_value``, ``expose_output``, ...), plus
    ``dxs[i]``: the tangent of input i (None: zero), ``dx`` the first one, and
    ``positions``: the input positions that can carry a tangent.
    """

    def __init__(self, proto: onnx.NodeProto, b: Builder, dxs: Sequence[Var | None], positions: Sequence[int]):
        present = {i for i, d in enumerate(dxs) if d is not None}
        super().__init__(proto, b, [None] * len(proto.output), present)
        self.dxs = [b.var(d.name) if d is not None else None for d in dxs]
        self.positions = tuple(positions)

    @property
    def dx(self) -> Var | None:
        return self.dxs[0] if self.dxs else None

    def tangent(self, i: int) -> Var | None:
        """Tangent of input i (None when it has none or is absent)."""
        return self.dxs[i] if i < len(self.dxs) else None

    def tangent_or_zeros(self, i: int) -> Var:
        """Tangent of input i, zeros of its shape when none reaches it (for formulas that need all)."""
        d = self.tangent(i)
        return d if d is not None else self.b.zeros_like(self.inputs[i])

    def same_op(self, *inputs: Var | None, outputs: int = 1):
        """This node's op with its attributes, on other inputs: the tangent of a linear op."""
        out = self.b.emit(self.proto.op_type, list(inputs), outputs=outputs)
        self.b.nodes[-1].attribute.extend(self.proto.attribute)
        return out

    def like_output(self, t: Var, k: int = 0) -> Var:
        """``t`` broadcast to output k's shape (a tangent must have its primal's shape)."""
        y = self.outputs[k]
        if t.info.static and y.info.static and tuple(t.shape) == tuple(y.shape):
            return t
        shape = self.b.ints(y.shape) if y.info.static else self.b.shape_of(y)
        return self.op.Expand(t, shape)


@dataclass
class TangentRule:
    op_type: str
    fn: Callable[[TNode], Tangents]
    linear: bool = False
    doc: str = ""


_TANGENT_RULES: dict[str, TangentRule] = {}


def defjvp(*op_types: str):
    """Decorator: register ``fn(t: TNode)`` as the tangent rule of ``op_types``."""

    def deco(fn: Callable[[TNode], Tangents]):
        for op in op_types:
            _TANGENT_RULES[op] = TangentRule(op, fn, doc=(fn.__doc__ or "").strip())
        return fn

    return deco


def deflinear(*op_types: str) -> None:
    """Register ops linear in their differentiable inputs: the tangent is the op on the tangents."""
    for op in op_types:
        _TANGENT_RULES[op] = TangentRule(op, linear_tangent, linear=True, doc=linear_tangent.__doc__ or "")


def linear_tangent(t: TNode) -> list[Var | None]:
    """d f(x1, ..., xk; c) = f(dx1, ..., dxk; c) for f linear in x1..xk (zeros for missing dxi)"""
    args = [None if x is None else (t.tangent_or_zeros(i) if i in t.positions else x)
            for i, x in enumerate(t.inputs)]
    outs = [o for o in t.proto.output]
    made = t.same_op(*args, outputs=len(outs))
    made = [made] if len(outs) == 1 else list(made)
    return [m if o else None for m, o in zip(made, outs)]


@contextmanager
def override(op_type: str, fn: Callable[[TNode], Tangents] | None = None) -> Iterator[None]:
    """Replace ``op_type``'s tangent rule by ``fn``, or remove it (``None``: the transpose-of-VJP fallback
    then gives the tangent), until the ``with`` block ends."""
    saved = _TANGENT_RULES.pop(op_type, None)
    if fn is not None:
        _TANGENT_RULES[op_type] = TangentRule(op_type, fn, doc=(fn.__doc__ or "").strip())
    try:
        yield
    finally:
        _TANGENT_RULES.pop(op_type, None)
        if saved is not None:
            _TANGENT_RULES[op_type] = saved


def get_tangent_rule(op_type: str) -> TangentRule | None:
    return _TANGENT_RULES.get(op_type)


def all_tangent_rules() -> dict[str, TangentRule]:
    return dict(_TANGENT_RULES)
