"""One registry of gradient rules, keyed by ai.onnx op type.

A rule is a function ``rule(n: Node) -> gradients`` that returns one entry per
input of the forward node: a :class:`Var` (the gradient of that input), or
``None`` (no gradient). Registration carries the metadata the pass needs::

    @register("Mul", broadcast=True)
    def mul(n):
        \"\"\"d(x*y) = (dy*y, dy*x)\"\"\"
        x, y = n.inputs
        return n.dy * y, n.dy * x

- ``broadcast``: the op broadcasts its inputs numpy-style; the pass sums each
  returned gradient back to its input's shape (one ``unbroadcast``).
- ``inputs``: which input positions the rule differentiates. Default: those
  the op schema tags Differentiable (the schema is the source of truth); ops
  whose schemas are untagged must say.
- ``beyond_tags``: float input positions the schema tags NonDifferentiable
  although the function has a derivative that PyTorch computes (Clip's bounds,
  GridSample's grid, the recurrent ops' initial states, ...). They carry
  gradients by default; ``strict=True`` follows the tags alone.
- ``inputs_from``: every input from this position on (variadic inputs of untagged schemas: Loop, Scan).
- ``subgraphs``: the rule differentiates a node with subgraphs (If, Loop, Scan): it also gets the
  gradients of the outer-scope tensors the bodies read (``n.outer_needed``) and returns them in
  ``n.outer_grads``.
- ``stop``: the op's derivative is zero or undefined everywhere it matters
  (Floor, Sign, ArgMax, ...): gradients stop here, silently.
- ``since``: the first ai.onnx opset the rule serves (ONNX's own ``since_version``): an op whose
  meaning changed registers one rule per version range, and a model at opset v gets the rule with
  the largest ``since`` <= v (``@register("DFT", since=20)`` beside ``@register("DFT")``).

:func:`override` replaces or removes an op's rules for the duration of a ``with`` block (tests of
the checker and of the function-body fallback use it). An op with no rule whose schema has a function
body is differentiated through that body (:mod:`onnxgrad.passes.function_body`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import onnx
import onnx.defs
from onnx import helper

from onnxgrad.ir.builder import Builder, Var
from onnxgrad.ir.model import TensorInfo

Gradients = Sequence["Var | None"] | "Var | None"

DIFFERENTIABLE = onnx.defs.OpSchema.DifferentiationCategory.Differentiable
NON_DIFFERENTIABLE = onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable


@dataclass
class Rule:
    op_type: str
    fn: Callable[["Node"], Gradients] | None
    broadcast: bool = False
    inputs: tuple[int, ...] | None = None
    stop: bool = False
    doc: str = ""
    beyond_tags: tuple[int, ...] = ()
    zero_derivative: bool = False
    inputs_from: int | None = None
    subgraphs: bool = False
    since: int = 1                  # first ai.onnx opset this rule serves
    via_body: bool = False          # the generic rule that differentiates the op's function body

    def differentiable_inputs(self, schema: onnx.defs.OpSchema | None, n_inputs: int,
                              strict: bool = False) -> tuple[int, ...]:
        """Positions this rule gives gradients for: its own list, else the schema's Differentiable tags,
        plus the positions it differentiates beyond the tags (as PyTorch does) unless ``strict``."""
        if self.stop:
            return ()
        if self.inputs_from is not None:
            own = tuple(range(self.inputs_from, n_inputs))
        elif self.inputs is not None:
            own = tuple(i for i in self.inputs if i < n_inputs)
        else:
            own = schema_differentiable_inputs(schema, n_inputs)
            if own is None:
                raise ValueError(f"rule for untagged op {self.op_type} must list its inputs")
        if strict:
            return own
        return tuple(sorted(set(own) | {i for i in self.beyond_tags if i < n_inputs}))


_RULES: dict[str, list[Rule]] = {}       # op type -> its rules, by ``since`` ascending


def _add(rule: Rule) -> None:
    """Register ``rule``, replacing one of the same op and ``since``."""
    rules = [r for r in _RULES.get(rule.op_type, []) if r.since != rule.since] + [rule]
    _RULES[rule.op_type] = sorted(rules, key=lambda r: r.since)


def _make(op: str, fn: Callable[["Node"], Gradients], broadcast: bool = False, inputs: Sequence[int] | None = None,
          beyond_tags: Sequence[int] = (), inputs_from: int | None = None, subgraphs: bool = False,
          since: int = 1) -> Rule:
    return Rule(op, fn, broadcast, tuple(inputs) if inputs is not None else None, doc=(fn.__doc__ or "").strip(),
                beyond_tags=tuple(beyond_tags), inputs_from=inputs_from, subgraphs=subgraphs, since=since)


def register(*op_types: str, broadcast: bool = False, inputs: Sequence[int] | None = None,
             beyond_tags: Sequence[int] = (), inputs_from: int | None = None, subgraphs: bool = False,
             since: int = 1):
    """Decorator: register ``fn`` as the gradient rule of ``op_types`` from opset ``since`` on."""

    def deco(fn: Callable[["Node"], Gradients]):
        for op in op_types:
            _add(_make(op, fn, broadcast, inputs, beyond_tags, inputs_from, subgraphs, since))
        return fn

    return deco


def register_stop(*op_types: str, why: str = "zero derivative", zero_derivative: bool = False) -> None:
    """Mark ops whose gradient is zero (or undefined) everywhere: they stop gradients.

    ``zero_derivative``: the derivative exists and is zero (Floor, Sign, ...), so a tensor reaching
    the outputs only through such ops has a gradient of zeros, as in PyTorch; otherwise (integer or
    boolean results, random draws, shapes) the op cuts the path and such a tensor has no gradient.
    """
    for op in op_types:
        _add(Rule(op, None, stop=True, doc=why, zero_derivative=zero_derivative))


@contextmanager
def override(op_type: str, fn: Callable[["Node"], Gradients] | None = None, **options: Any) -> Iterator[Rule | None]:
    """Replace ``op_type``'s gradient rules by ``fn`` (with :func:`register`'s ``options``), or remove
    them (``fn=None``), until the ``with`` block ends; yields the rule in effect inside it.

    Without a rule, an op whose schema has a function body is differentiated through that body::

        with registry.override("Softplus", None):
            onnxgrad.grad(model)           # Softplus through Log(Exp(x) + 1)
    """
    saved = _RULES.pop(op_type, None)
    rule = None
    if fn is not None:
        rule = _make(op_type, fn, **options)
        _RULES[op_type] = [rule]
    try:
        yield rule
    finally:
        if saved is None:
            _RULES.pop(op_type, None)
        else:
            _RULES[op_type] = saved


def get_rule(op_type: str, opset: int | None = None) -> Rule | None:
    """The hand-written rule of ``op_type`` at ``opset`` (the newest one when no opset is given)."""
    rules = _RULES.get(op_type)
    if not rules:
        return None
    if opset is None:
        return rules[-1]
    for rule in reversed(rules):
        if rule.since <= opset:
            return rule
    return None


def all_rules() -> dict[str, Rule]:
    """Every op's newest hand-written rule."""
    return {op: rules[-1] for op, rules in _RULES.items() if rules}


def beyond_tags_inputs(op_type: str) -> tuple[int, ...]:
    """Input positions of ``op_type`` tagged NonDifferentiable that its rule differentiates (as PyTorch does)."""
    rule = get_rule(op_type)
    return () if rule is None else rule.beyond_tags


def get_schema(op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None


def schema_differentiable_inputs(schema: onnx.defs.OpSchema | None, n_inputs: int) -> tuple[int, ...] | None:
    """Input positions tagged Differentiable (variadic last input repeats), or None if untagged."""
    if schema is None or not schema.inputs:
        return None
    cats = [p.differentiation_category for p in schema.inputs]
    if all(c == onnx.defs.OpSchema.DifferentiationCategory.Unknown for c in cats):
        return None
    out = []
    for i in range(n_inputs):
        c = cats[min(i, len(cats) - 1)]
        if c == DIFFERENTIABLE:
            out.append(i)
    return tuple(out)


def _rebind(d, b: Builder):
    """A gradient bound to the builder of the rule that reads it: a tensor's, or a sequence's, which is not one
    Var and binds itself (:meth:`onnxgrad.rules.sequence.SequenceGrad.bound_to`)."""
    return b.var(d.name) if type(d) is Var else d.bound_to(b)


class Node:
    """What a rule sees of one forward node: its tensors as Vars, the seeds, attributes, and a builder.

    ``n.inputs[i]`` / ``n.outputs[i]``: forward tensors (None for an empty optional input).
    ``n.dy``: gradient of the first output; ``n.dys[i]`` of output i (None when no gradient reaches it).
    ``n.needs(i)``: whether the pass wants the gradient of input i (rules may skip work otherwise).
    ``n.op``: emit any ai.onnx op, e.g. ``n.op.Conv(dy, w, strides=[2, 2])``.
    ``n.b``: the builder, with the helper library (``b.rank(x)``, ``b.dim(x, i)``, ``b.zeros(shape, like)``...).
    ``n.decline(reason)``: this configuration has no gradient here (an UnsupportedOpError saying why).
    ``n.outer_needed`` / ``n.outer_grads``: for If/Loop/Scan, the outer-scope tensors their bodies read
    that need a gradient, and the rule's gradients of them.
    ``n.differentiate(model, wrt=..., of=..., allow_unused=True)``: the reverse pass itself
    (:func:`onnxgrad.grad`), handed to the rules that differentiate a graph of their own (If, Loop and Scan
    bodies, an op's function body): the rules sit below the pass and do not import it.
    """

    def __init__(self, proto: onnx.NodeProto, b: Builder, dys: list[Var | None], needed: set[int],
                 outer_needed: frozenset[str] = frozenset(),
                 differentiate: Callable[..., onnx.ModelProto] | None = None):
        self.proto = proto
        self.differentiate = differentiate
        self.outer_needed = outer_needed     # outer-scope tensors the subgraphs read that need gradients
        self.outer_grads: dict[str, Var] = {}   # their gradients, set by a rule with ``subgraphs``
        self.b = b
        self.op = b.op
        self.opset = b.opset
        self.inputs = [b.var(x) if x else None for x in proto.input]
        self.outputs = [b.var(y) if y else None for y in proto.output]
        self.dys = [_rebind(d, b) if d is not None else None for d in dys]  # bound to this node's builder
        infos = b.infos
        for d, y in zip(self.dys, self.outputs):
            if type(d) is Var and y is not None:
                info = infos.get(d.name)
                if info is None or info.shape is None or None in info.shape:
                    b.with_shape(d, y)              # the gradient of y has y's shape
        self._needed = needed
        self._attrs: dict[str, Any] | None = None        # decoded on first use: most rules read none

    @property
    def name(self) -> str:
        return self.proto.name

    @property
    def attributes(self) -> dict[str, Any]:
        """The node's attributes, decoded."""
        if self._attrs is None:
            self._attrs = {a.name: helper.get_attribute_value(a) for a in self.proto.attribute}
        return self._attrs

    @property
    def dy(self) -> Var | None:
        return self.dys[0]

    def needs(self, i: int) -> bool:
        return i in self._needed

    def attr(self, name: str, default: Any = None) -> Any:
        """Attribute ``name``'s value (``default`` when absent); strings, and lists of them, decoded.
        A float default is rounded to float32, as an ONNX float attribute is and as runtimes read the
        schema's default: LeakyRelu's alpha 0.01 is 0.0099999998 in a float64 model too (a float64
        Python 0.01 put the gradients off by 2e-8 there)."""
        if name not in self.attributes:
            return float(np.float32(default)) if type(default) is float else default
        v = self.attributes[name]
        if isinstance(v, bytes):
            return v.decode()
        if isinstance(v, list) and v and isinstance(v[0], bytes):
            return [s.decode() for s in v]
        return v

    def has_attr(self, name: str) -> bool:
        return name in self.attributes

    def input(self, i: int) -> Var | None:
        """Input i, or None when it is absent or empty."""
        return self.inputs[i] if i < len(self.inputs) else None

    def dy_or_zeros(self, i: int) -> Var:
        """Gradient of output i, zeros when none reaches it (for rules that must combine all outputs)."""
        d = self.dys[i]
        return d if d is not None else self.b.zeros_like(self.outputs[i])

    def const_value(self, i: int) -> np.ndarray | None:
        """The value of input i when it is a constant known at build time (initializer or Constant)."""
        x = self.input(i)
        return None if x is None else self.b.constants.get(x.name)

    def const_ints(self, i: int) -> list[int] | None:
        """Input i's constant value as a list of ints (shapes, axes, pads...), None if not known at build time."""
        value = self.const_value(i)
        return None if value is None else [int(v) for v in value.reshape(-1)]

    def decline(self, reason: str):
        """This rule declines the node's configuration, saying why (:meth:`Builder.decline`)."""
        self.b.decline(reason)

    def expose_output(self, i: int, hint: str, like: Var | None = None) -> Var:
        """Forward output i as a Var, naming it on the forward node if the model left it out.

        For rules that need what a forward op computes but the model did not keep
        (Dropout's mask, a normalization's saved statistics); outputs stay identical.
        The new tensor's element type is ``like``'s, else the input's its schema ties it to.
        """
        outs = self.proto.output
        if i < len(outs) and outs[i]:
            return self.b.var(outs[i])
        while len(outs) <= i:
            outs.append("")
        outs[i] = self.b.names.fresh(f"{self.proto.name}/{hint}")
        self.outputs = [self.b.var(y) if y else None for y in outs]
        dtype = like.dtype if like is not None else self._schema_dtype(i)
        self.b.infos[outs[i]] = TensorInfo(dtype, None)
        return self.b.var(outs[i])

    def _schema_dtype(self, i: int) -> int | None:
        """Element type of output i when the schema gives it the type of an input."""
        schema = get_schema(self.proto.op_type, self.opset)
        if schema is None or not schema.outputs:
            return None
        type_str = schema.outputs[min(i, len(schema.outputs) - 1)].type_str
        for k, p in enumerate(schema.inputs):
            x = self.input(k)
            if p.type_str == type_str and x is not None and x.dtype is not None:
                return x.dtype
        return None
