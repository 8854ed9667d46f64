"""Walks over a graph's nodes: which tensors and nodes some targets depend on.

- :func:`dependencies` / :func:`live_nodes` / :func:`live` (both): every tensor (node) some targets depend
  on, through any input (subgraphs' outer reads included): one reverse walk.
- :func:`pruned`: the model computing only some of its outputs.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import onnx

from . import model as M

__all__ = ["dependencies", "live_nodes", "live", "pruned"]


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


def pruned(model: M.ParsedModel, outputs: Sequence[str]) -> M.ParsedModel:
    """The model computing only ``outputs``: unneeded nodes, inputs and initializers dropped."""
    m = onnx.ModelProto()
    m.CopyFrom(model.proto)
    g = m.graph
    nodes = list(g.node)            # one wrapper per node, alive while their ids are compared
    needed, kept = live(nodes, outputs)
    ids = {id(n) for n in kept}
    for i in reversed(range(len(nodes))):
        if id(nodes[i]) not in ids:
            del g.node[i]
    wanted = set(outputs)
    M.keep_only(g.output, lambda o: o.name in wanted)
    M.keep_only(g.input, lambda i: i.name in needed)
    M.keep_only(g.initializer, lambda t: t.name in needed)
    return model.edited(m)


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
