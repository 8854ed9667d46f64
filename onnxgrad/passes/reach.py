"""Which tensors a gradient reaches and through which inputs: facts of a forward graph and the rules that
several passes need, each computed in one place.

- :func:`rule_of`: a node's gradient rule at the model's opset (hand-written, else through the op's
  function body).
- :func:`differentiable_positions`: which inputs of a node can carry a gradient
  (the rule's registration, else the schema's tags, else every input).
- :class:`Objective`: what a pass differentiates (a loss, or seeded outputs) and its gradient reach.
- :func:`node_facts`: each node's rule, differentiable inputs and subgraph reads, found once per op.
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

from ..errors import NonFloatError, UnknownNameError, arg, spelt
from ..ir import model as M
from ..ir.model import WITH_BODIES, ParsedModel, TensorInfo
from ..rules.registry import Rule, get_rule, get_schema, schema_differentiable_inputs
from .function_body import body_rule

__all__ = ["rule_of", "differentiable_positions", "gradient_reach", "NodeFacts", "node_facts",
           "Objective"]

_STANDARD = ("", "ai.onnx")


def rule_of(node: onnx.NodeProto, opset: int | None = None, nested: bool = False) -> Rule | None:
    """The gradient rule of a standard op at ``opset``: its hand-written rule for that opset, else, for an
    op whose schema has a function body, the generic rule that differentiates the body
    (:mod:`onnxgrad.passes.function_body`); a node with subgraphs (``nested``: the parsed model's
    ``outer_reads`` has it) only if its rule differentiates them (If, Loop, Scan). None for the rest (no
    rule). Without ``opset``: the newest hand-written rule."""
    if node.domain not in _STANDARD:
        return None
    rule = get_rule(node.op_type, opset)
    if nested:
        return rule if rule is not None and rule.subgraphs else None
    if rule is None and opset is not None:
        rule = body_rule(node.op_type, opset)
    return rule


def differentiable_positions(node: onnx.NodeProto, opset: int, rule: Rule | None, strict: bool = False
                             ) -> tuple[int, ...]:
    """Input positions of ``node`` that can carry a gradient.

    A rule's registration decides (the schema's Differentiable tags, plus the inputs PyTorch
    differentiates beyond them unless ``strict``); an op without a rule counts every input
    of a tagged schema's Differentiable ones, or all of them, so that the pass reports it as
    unsupported rather than silently cutting the path. ``rule``: the node's :func:`rule_of`.
    """
    n = len(node.input)
    schema = get_schema(node.op_type, opset) if node.domain in _STANDARD else None
    if rule is not None:
        return rule.differentiable_inputs(schema, n, strict=strict)
    tagged = schema_differentiable_inputs(schema, n)
    return tagged if tagged is not None else tuple(range(n))


class NodeFacts(NamedTuple):
    """What the passes ask of one forward node, found once per node."""
    rule: Rule | None                   # its gradient rule at the model's opset (:func:`rule_of`)
    positions: tuple[int, ...]          # the inputs that can carry a gradient (:func:`differentiable_positions`)
    outer_reads: frozenset[str]         # the outer-scope tensors its subgraphs read (If, Loop, Scan)
    no_rule_reason: str | None          # why it has no rule, where there is a reason to give
    nested: bool = False                # it has subgraphs


def node_facts(parsed: ParsedModel, strict: bool = False) -> dict[int, NodeFacts]:
    """Each node's :class:`NodeFacts`, by ``id`` of the node (``parsed.nodes`` keeps the ids alive): the rule
    and differentiable positions looked up once per op, the subgraphs' reads from the parsed model."""
    by_op: dict[tuple, tuple[Rule | None, tuple[int, ...], str | None]] = {}
    facts: dict[int, NodeFacts] = {}
    opset, nested_reads = parsed.opset, parsed.outer_reads
    for node in parsed.nodes:
        reads = nested_reads.get(id(node))
        nested = reads is not None
        key = (node.domain, node.op_type, len(node.input), nested)
        found = by_op.get(key)
        if found is None:           # the same for every node of this op: looked up once
            rule = rule_of(node, opset, nested)
            reason = None
            if node.domain not in _STANDARD:
                reason = f"custom domain '{node.domain}'"
            elif rule is None and nested and rule_of(node, None, nested) is None:
                reason = "control flow with subgraphs"
            found = by_op[key] = (rule, differentiable_positions(node, opset, rule, strict), reason)
        rule, positions, reason = found
        facts[id(node)] = NodeFacts(rule, positions, reads or frozenset(), reason, nested)
    return facts


def gradient_reach(parsed: ParsedModel, facts: Mapping[int, NodeFacts], targets: Iterable[str]) -> set[str]:
    """Every tensor with a differentiable path to the targets (the targets included), from each node's
    :class:`NodeFacts`.

    A node passes its outputs' reach to the inputs at its differentiable positions when one
    of its float outputs is reached and it is not a stop-gradient op; nodes with subgraphs
    pass it to every input and outer-scope read (the pass refuses them with a clear error).
    """
    infos = parsed.infos
    reach = {t for t in targets if M.is_float(infos.get(t))}      # float tensors only, so an output
    for node in reversed(parsed.nodes):                            # in reach is a float one
        if reach.isdisjoint(node.output):
            continue
        fact = facts[id(node)]
        if fact.nested and (node.op_type in WITH_BODIES or node.domain not in _STANDARD):
            reach.update(x for x in node.input if x and M.is_float(infos.get(x)))
            reach |= {x for x in fact.outer_reads if M.is_float(infos.get(x))}
            continue
        rule = fact.rule
        if rule is not None and rule.stop:   # zero_derivative: a gradient of zeros (PyTorch's floor, sign)
            positions = range(len(node.input)) if rule.zero_derivative else ()
        else:
            positions = fact.positions
        for i in positions:
            x = node.input[i]
            if x and x not in reach and M.is_float(infos.get(x)):
                reach.add(x)
    return reach


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
        self.facts = node_facts(parsed, self.strict)
        self.reach = gradient_reach(parsed, self.facts, self.targets)

    @property
    def what(self) -> str:
        """How errors and reasons name it: ``loss 'L'`` or ``outputs 'a', 'b'``."""
        return f"loss '{self.loss}'" if self.loss else "outputs " + ", ".join(f"'{o}'" for o in self.of)

    def _outputs(self, of: Sequence[str] | None, loss: str | None) -> tuple[str | None, list[str]]:
        infos = self.parsed.infos
        if loss is not None and of:
            raise UnknownNameError(f"give either {arg('loss')} or {arg('of')}, not both")
        if loss is not None:
            self._check_output(loss, "loss")
            shape = infos[loss].shape if loss in infos else None
            if shape is not None and any(d != 1 for d in shape):
                raise UnknownNameError(
                    f"loss '{loss}' has shape {list(shape)}, not a scalar; use {arg('of', [loss])} to seed it")
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
            hint = (f"; name the loss output with {arg('loss')}, or append a loss "
                    + spelt("from onnxgrad.losses", "with --loss-fn") if what == "loss" else "")
            raise UnknownNameError(
                f"{what} '{name}' is not an output of the model (outputs: {', '.join(outputs)}){hint}")
        if not M.is_float(self.parsed.infos.get(name)):
            raise NonFloatError(f"{what} '{name}' is not a floating-point tensor; only float outputs have gradients")
