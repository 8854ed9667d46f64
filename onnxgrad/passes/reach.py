"""Which tensors a gradient reaches and through which inputs: facts of a forward graph and the rules that
several passes need, each computed in one place.

- :func:`rule_of`: a node's gradient rule at the model's opset (hand-written, else through the op's
  function body).
- :func:`differentiable_positions`: which inputs of a node can carry a gradient
  (the rule's registration, else the schema's tags, else every input).
- :class:`Objective`: what a pass differentiates (a loss, or seeded outputs) and its gradient reach.
- :func:`gradient_reach`: every tensor from which a *differentiable* path reaches
  the targets: through differentiable input positions, float tensors only, never
  through an op that cuts gradients (integer or boolean results, random draws). A
  tensor outside it has no gradient (``UnusedError``, not trained); one reaching the
  targets only through zero-derivative ops (Floor, Sign) has a gradient of zeros.

The reverse pass (:mod:`onnxgrad.passes.autodiff`), the parameter policy (:mod:`onnxgrad.passes.params`),
forward mode and the training artifacts all ask these functions.
"""
from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Sequence

import onnx

from ..errors import NonFloatError, UnknownNameError
from ..ir import model as M
from ..ir.model import WITH_BODIES, ParsedModel, TensorInfo
from ..rules.registry import Rule, get_rule, get_schema, schema_differentiable_inputs
from .function_body import body_rule

__all__ = ["rule_of", "why_no_rule", "differentiable_positions", "gradient_reach", "NodeFacts", "node_facts",
           "Objective"]

_STANDARD = ("", "ai.onnx")


def rule_of(node: onnx.NodeProto, opset: int | None = None) -> Rule | None:
    """The gradient rule of a standard op at ``opset``: its hand-written rule for that opset, else, for an
    op whose schema has a function body, the generic rule that differentiates the body
    (:mod:`onnxgrad.passes.function_body`); a node with subgraphs only if its rule differentiates them (If, Loop,
    Scan). None for the rest (no rule). Without ``opset``: the newest hand-written rule."""
    if node.domain not in _STANDARD:
        return None
    rule = get_rule(node.op_type, opset)
    if node.attribute and M.has_subgraph(node):
        return rule if rule is not None and rule.subgraphs else None
    if rule is None and opset is not None:
        rule = body_rule(node.op_type, opset)
    return rule


def why_no_rule(node: onnx.NodeProto) -> str | None:
    """The reason a node has no gradient rule, where there is one to give (custom domain, control flow)."""
    if node.domain not in _STANDARD:
        return f"custom domain '{node.domain}'"
    if M.has_subgraph(node) and rule_of(node) is None:
        return "control flow with subgraphs"
    return None


def differentiable_positions(node: onnx.NodeProto, opset: int, strict: bool = False,
                             cache: dict | None = None) -> tuple[int, ...]:
    """Input positions of ``node`` that can carry a gradient.

    A rule's registration decides (the schema's Differentiable tags, plus the inputs PyTorch
    differentiates beyond them unless ``strict``); an op without a rule counts every input
    of a tagged schema's Differentiable ones, or all of them, so that the pass reports it as
    unsupported rather than silently cutting the path.
    """
    key = (node.domain, node.op_type, len(node.input), bool(node.attribute) and M.has_subgraph(node), strict)
    if cache is not None and key in cache:         # asked of every node, several times per pass
        return cache[key]
    rule = rule_of(node, opset)
    n = len(node.input)
    schema = get_schema(node.op_type, opset) if node.domain in _STANDARD else None
    if rule is not None:
        positions = rule.differentiable_inputs(schema, n, strict=strict)
    else:
        tagged = schema_differentiable_inputs(schema, n)
        positions = tagged if tagged is not None else tuple(range(n))
    if cache is not None:
        cache[key] = positions
    return positions


def gradient_reach(nodes: Sequence[onnx.NodeProto], targets: Iterable[str], opset: int,
                   infos: Mapping[str, TensorInfo] | None = None, strict: bool = False,
                   cache: dict | None = None) -> set[str]:
    """Every tensor with a differentiable path to the targets (the targets included).

    A node passes its outputs' reach to the inputs at its differentiable positions when one
    of its float outputs is reached and it is not a stop-gradient op; nodes with subgraphs
    pass it to every input and outer-scope read (the pass refuses them with a clear error).
    """
    infos = infos or {}
    cache = {} if cache is None else cache
    reach = {t for t in targets if M.is_float(infos.get(t))}      # float tensors only, so an output
    facts: dict[tuple, tuple[str, Sequence[int]]] = {}               # in reach is a float one
    for node in reversed(nodes):
        if reach.isdisjoint(node.output):
            continue
        op, domain, inputs = node.op_type, node.domain, node.input
        if (op in WITH_BODIES or domain not in _STANDARD) and M.has_subgraph(node):
            reach.update(x for x in inputs if x and M.is_float(infos.get(x)))
            reach |= {x for x in M.subgraph_inputs(node) if M.is_float(infos.get(x))}
            continue
        key = (domain, op, len(inputs))
        fact = facts.get(key)
        if fact is None:                # the same for every node of this op: looked up once
            rule = rule_of(node, opset)
            if rule is not None and rule.stop:   # zero_derivative: a gradient of zeros (PyTorch's floor, sign)
                fact = ("zeros", range(len(inputs))) if rule.zero_derivative else ("stop", ())
            else:
                fact = ("", differentiable_positions(node, opset, strict, cache))
            facts[key] = fact
        for i in fact[1]:
            x = inputs[i]
            if x and x not in reach and M.is_float(infos.get(x)):
                reach.add(x)
    return reach


class NodeFacts(NamedTuple):
    """What the reverse pass asks of one forward node, found once per node."""
    rule: Rule | None                   # its gradient rule at the model's opset (:func:`rule_of`)
    positions: tuple[int, ...]          # the inputs that can carry a gradient (:func:`differentiable_positions`)
    outer_reads: frozenset[str]         # the outer-scope tensors its subgraphs read (If, Loop, Scan)
    no_rule_reason: str | None          # why it has no rule, where there is a reason to give (:func:`why_no_rule`)


def node_facts(parsed: ParsedModel, strict: bool = False, cache: dict | None = None) -> dict[int, NodeFacts]:
    """Each node's :class:`NodeFacts`, by ``id`` of the node (``parsed.nodes`` keeps the ids alive): what the
    reverse and forward passes ask of every node, looked up once per op (``cache``: shared with
    :func:`gradient_reach`'s lookups of differentiable positions)."""
    cache = {} if cache is None else cache
    by_op: dict[tuple, tuple[Rule | None, tuple[int, ...]]] = {}
    facts: dict[int, NodeFacts] = {}
    for node in parsed.nodes:
        nested = bool(node.attribute) and M.has_subgraph(node)
        key = (node.domain, node.op_type, len(node.input), nested)
        found = by_op.get(key)
        if found is None:           # the same for every node of this op: looked up once
            found = by_op[key] = (rule_of(node, parsed.opset),
                                  differentiable_positions(node, parsed.opset, strict, cache))
        rule, positions = found
        facts[id(node)] = NodeFacts(rule, positions, frozenset(M.subgraph_inputs(node)) if nested else frozenset(),
                                    why_no_rule(node) if rule is None else None)
    return facts


class Objective:
    """What a pass differentiates in a parsed model: the ``loss`` (a scalar float output, seeded with 1) or
    the outputs ``of`` (each seeded), checked against the model; ``targets`` (the differentiated outputs),
    ``reach`` (:func:`gradient_reach` of them) and each node's :class:`NodeFacts` (``facts``, by ``id`` of
    the node). Neither ``loss`` nor ``of``: the single scalar float output is the loss, else every float
    output is seeded. The reverse pass and the parameter policy ask the same one."""

    def __init__(self, parsed: ParsedModel, of: Sequence[str] | None, loss: str | None, strict: bool = False):
        self.parsed = parsed
        self.strict = strict
        self.loss, self.of = self._outputs(of, loss)
        self.targets = {self.loss} if self.loss else set(self.of)
        self.on(parsed)

    def on(self, parsed: ParsedModel) -> None:
        """Take the facts of ``parsed``: this objective's model, or an edit of it that keeps its outputs
        (tied parameters restored)."""
        self.parsed = parsed
        cache: dict = {}
        self.facts = node_facts(parsed, self.strict, cache)
        self.reach = gradient_reach(parsed.nodes, self.targets, parsed.opset, parsed.infos, self.strict, cache)

    @property
    def what(self) -> str:
        """How errors and reasons name it: ``loss 'L'`` or ``outputs 'a', 'b'``."""
        return f"loss '{self.loss}'" if self.loss else "outputs " + ", ".join(f"'{o}'" for o in self.of)

    def _outputs(self, of: Sequence[str] | None, loss: str | None) -> tuple[str | None, list[str]]:
        infos = self.parsed.infos
        if loss is not None and of:
            raise UnknownNameError("give either loss= or of=, not both")
        if loss is not None:
            self._check_output(loss, "loss")
            shape = infos[loss].shape if loss in infos else None
            if shape is not None and any(d != 1 for d in shape):
                raise UnknownNameError(
                    f"loss '{loss}' has shape {list(shape)}, not a scalar; use of=['{loss}'] to seed it")
            return loss, []
        if of:
            for name in of:
                self._check_output(name, "of")
            return None, list(dict.fromkeys(of))
        floats = [o for o in self.parsed.output_names if M.is_float(infos.get(o))]
        if not floats:
            raise UnknownNameError("the model has no floating-point output to differentiate")
        if len(floats) == 1:
            shape = infos.get(floats[0], TensorInfo()).shape
            if shape is not None and all(d == 1 for d in shape):
                return floats[0], []
        return None, floats

    def _check_output(self, name: str, what: str) -> None:
        outputs = self.parsed.output_names
        if name not in outputs:
            raise UnknownNameError(
                f"{what} '{name}' is not an output of the model (outputs: {', '.join(outputs)})")
        if not M.is_float(self.parsed.infos.get(name)):
            raise NonFloatError(f"{what} '{name}' is not a floating-point tensor; only float outputs have gradients")
