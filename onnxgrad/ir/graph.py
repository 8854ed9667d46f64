"""Walks over a graph's nodes: which tensors and nodes some targets depend on.

- :func:`dependencies` / :func:`live_nodes` / :func:`live` (both): every tensor (node) some targets depend
  on, through any input (subgraphs' outer reads included): one reverse walk.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import onnx

from . import model as M

__all__ = ["dependencies", "live_nodes", "live"]


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
