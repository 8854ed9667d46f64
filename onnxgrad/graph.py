"""Facts about a forward graph that several passes need, each computed in one place.

- :func:`rule_of`: a node's gradient rule at the model's opset (hand-written, else through the op's
  function body).
- :func:`differentiable_positions`: which inputs of a node can carry a gradient
  (the rule's registration, else the schema's tags, else every input).
- :func:`dependencies` / :func:`live_nodes` / :func:`live` (both): every tensor (node) some targets depend
  on, through any input: one reverse walk.
- :func:`gradient_reach`: every tensor from which a *differentiable* path reaches
  the targets: through differentiable input positions, float tensors only, never
  through an op that cuts gradients (integer or boolean results, random draws). A
  tensor outside it has no gradient (``UnusedError``, not trained); one reaching the
  targets only through zero-derivative ops (Floor, Sign) has a gradient of zeros.

The pass (:mod:`onnxgrad.autodiff`), the parameter policy (:mod:`onnxgrad.params`),
the training artifacts and the lowering all ask these functions.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import onnx

from . import model as M
from .builder import WITH_BODIES, TensorInfo
from .function_body import body_rule
from .registry import Rule, get_rule, get_schema, schema_differentiable_inputs

__all__ = ["rule_of", "differentiable_positions", "dependencies", "live_nodes", "live", "gradient_reach"]

_STANDARD = ("", "ai.onnx")


def rule_of(node: onnx.NodeProto, opset: int | None = None) -> Rule | None:
    """The gradient rule of a standard op at ``opset``: its hand-written rule for that opset, else, for an
    op whose schema has a function body, the generic rule that differentiates the body
    (:mod:`onnxgrad.function_body`); a node with subgraphs only if its rule differentiates them (If, Loop,
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


def dependencies(nodes: Sequence[onnx.NodeProto], targets: Iterable[str]) -> set[str]:
    """Every tensor the targets depend on, through any input (subgraphs' outer reads included)."""
    return _reverse_walk(nodes, targets)[0]


def live_nodes(nodes: Sequence[onnx.NodeProto], targets: Iterable[str],
               cut: Iterable[str] = ()) -> list[onnx.NodeProto]:
    """The nodes the targets depend on, in their original order (dead code dropped); the walk
    stops at the tensors in ``cut`` (their producers are not needed)."""
    return _reverse_walk(nodes, targets, set(cut))[1]


def live(nodes: Sequence[onnx.NodeProto], targets: Iterable[str]) -> tuple[set[str], list[onnx.NodeProto]]:
    """:func:`dependencies` and :func:`live_nodes` in one walk."""
    return _reverse_walk(nodes, targets)


def _reverse_walk(nodes: Sequence[onnx.NodeProto], targets: Iterable[str],
                  cut: set[str] = frozenset()) -> tuple[set[str], list]:
    live = set(targets) - cut
    kept = []
    for node in reversed(nodes):                # hot: once per node of every graph the pass writes
        for o in node.output:
            if o in live:
                break
        else:
            continue
        kept.append(node)
        if cut:
            live.update(x for x in node.input if x not in cut)
        else:
            live.update(node.input)
        if node.attribute and M.has_subgraph(node):
            live |= M.subgraph_inputs(node) - cut
    kept.reverse()
    live.discard("")                            # optional inputs left out
    return live, kept


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
