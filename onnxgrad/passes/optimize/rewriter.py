"""Rewrite rules over an ONNX graph, in onnxscript's rewriter style: pattern, check, replacement.

A :class:`Rewrite` anchors on one op type. Its ``pattern`` looks at the graph around a node of that
type and returns a :class:`Match` (the tensors it found) or None (not this pattern: nothing to say).
Its ``check`` returns None when the replacement applies, else the reason it declines (kept in the
:class:`Report`). Its ``replacement`` emits new nodes through a :class:`~onnxgrad.ir.builder.Builder`
and returns the values that stand for the match's outputs; they take those outputs' names, so
readers are untouched. Nodes that only the replaced ones read are removed afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx import helper

from ...ir import graph as G
from ...ir import model as M
from ...ir.builder import Builder, Var
from ...ir.model import NameScope, TensorInfo, rename_tensors


def batch_target(dim: int | None) -> int:
    """A batch dim in a Reshape's target shape (:meth:`GraphView.batched_shape`'s first): -1 where it is
    symbolic."""
    return -1 if dim is None else dim


class GraphView:
    """Use-def facts about a graph for patterns: producer and readers of a tensor, its static type and
    shape, its value when constant, and a node's attributes."""

    def __init__(self, model: onnx.ModelProto, first: int = 0):
        g = model.graph
        self.model = model
        self.opset = M.opset_of(model)
        self.first = first                                   # where the backward starts in the input
        self.infos, _ = M.tensor_infos(model)
        self.constants = M.constant_values(model, model)     # its value_info: the pass wrote every type
        self.nodes = list(g.node)                            # the working list; written back by apply
        self.forward = {id(n) for n in self.nodes[:first]}   # the forward's nodes, those of its rewrites too
        # replaced nodes by id, kept alive so that no new node takes the id of one gone
        self.removed: dict[int, onnx.NodeProto] = {}
        self._refresh()

    def _refresh(self) -> None:
        g = self.model.graph
        self.producer = {}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        self._index(self.nodes)
        self.outputs = {o.name for o in g.output}

    def _index(self, nodes: Sequence[onnx.NodeProto]) -> None:
        """Record ``nodes`` as the producers of their outputs and readers of their inputs."""
        for node in nodes:
            for o in node.output:
                if o:
                    self.producer[o] = node
            for i in _read(node):
                self.readers.setdefault(i, []).append(node)

    def _forget(self, node: onnx.NodeProto, outputs: Sequence[str]) -> None:
        """Forget ``node`` as a reader of its inputs and as the producer of ``outputs``."""
        for i in _read(node):
            left = [r for r in self.readers[i] if r is not node]
            if left:
                self.readers[i] = left
            else:
                del self.readers[i]
        for o in outputs:
            if o and self.producer.get(o) is node:
                del self.producer[o]

    # -- facts -------------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        return self.infos.get(name) or TensorInfo()

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The static shape of ``name`` (None when some dim is unknown)."""
        info = self.info(name)
        return tuple(info.shape) if info.static else None

    def batched_shape(self, name: str) -> tuple[int | None, ...] | None:
        """The shape of ``name`` where only the first (batch) dim may be unknown, None there (an export's
        dynamic batch axis); None when another dim is unknown."""
        shape = self.info(name).shape
        if shape is None or not shape or None in shape[1:]:
            return None
        return tuple(shape)

    def value(self, name: str) -> np.ndarray | None:
        return self.constants.get(name)

    def is_scalar(self, name: str, value: float) -> bool:
        """Whether ``name`` is a one-element constant equal to ``value``."""
        found = self.value(name)
        return found is not None and found.size == 1 and float(found.reshape(-1)[0]) == value

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        """The node that makes ``name`` when it is an ``op_type`` node of the default domain."""
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def only_reader(self, name: str, op_type: str) -> onnx.NodeProto | None:
        """The single node reading ``name`` when it is an ``op_type`` node and ``name`` is no graph output."""
        readers = self.readers.get(name, [])
        if len(readers) != 1 or name in self.outputs or readers[0].op_type != op_type:
            return None
        return readers[0]

    @staticmethod
    def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
        """The attribute's value, a list for repeated ones and text for strings (exporters write
        ``auto_pad=b"NOTSET"`` explicitly: it compares equal to the default ``"NOTSET"``)."""
        for a in node.attribute:
            if a.name == name:
                value = helper.get_attribute_value(a)
                if a.type == a.STRING:
                    return value.decode()
                if a.type == a.STRINGS:
                    return [v.decode() for v in value]
                return list(value) if isinstance(value, (list, tuple)) or a.type == a.INTS else value
        return default

    @staticmethod
    def attributes(node: onnx.NodeProto) -> dict[str, Any]:
        """Every attribute of ``node`` as :meth:`attr` reads it (text for strings): what emitting the same op
        again takes."""
        return {a.name: GraphView.attr(node, a.name) for a in node.attribute}

    def candidates(self, op_type: str, forward: bool | None = False) -> list[onnx.NodeProto]:
        """The ``op_type`` nodes a rewrite may replace: the backward's, with ``forward`` the forward's, with
        None every one."""
        return [n for n in self.nodes if (forward is None or (id(n) in self.forward) == forward)
                and n.op_type == op_type and n.domain in ("", "ai.onnx")]


@dataclass
class Match:
    """What a pattern found: ``root`` is the node whose ``outputs`` the replacement stands for."""

    root: onnx.NodeProto
    outputs: list[str]
    values: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class Rewrite:
    """One rewrite rule: ``pattern(view, node) -> Match | None``, ``check(view, match) -> reason | None``,
    ``replacement(builder, view, match) -> [Var]`` (one per matched output). A rewrite anchors on the
    backward's nodes, with ``forward`` on the forward's (a forward op computed in a form the backward
    then shares), with ``forward=None`` on any node (an op a runtime lacks, wherever it stands)."""

    name: str
    op_type: str
    pattern: Callable[[GraphView, onnx.NodeProto], Match | None]
    check: Callable[[GraphView, Match], str | None]
    replacement: Callable[[Builder, GraphView, Match], Sequence[Var]]
    doc: str = ""
    forward: bool | None = False


@dataclass
class Report:
    """Which rewrites applied where, and why the others declined."""

    applied: list[tuple[str, str]] = field(default_factory=list)     # (rewrite, node)
    declined: list[tuple[str, str, str]] = field(default_factory=list)  # (rewrite, node, reason)

    def count(self, rewrite: str) -> int:
        return sum(1 for r, _ in self.applied if r == rewrite)

    def counts(self) -> dict[str, int]:
        """How many times each rewrite applied, in the order they first did."""
        out: dict[str, int] = {}
        for r, _ in self.applied:
            out[r] = out.get(r, 0) + 1
        return out

    def reasons(self, rewrite: str) -> list[str]:
        return [why for r, _, why in self.declined if r == rewrite]


def apply(model: onnx.ModelProto, rewrites: Sequence[Rewrite], first: int = 0, copy: bool = True
          ) -> tuple[onnx.ModelProto, Report]:
    """``model`` with each rewrite applied, in order, wherever its pattern matches and its check passes,
    to nodes from index ``first`` on (a ``forward`` rewrite: to those before it; the model's
    ``onnxgrad.forward_nodes`` then counts the forward's nodes as they are); and the report. The model is
    copied (its weights too), or with ``copy=False`` changed in place (a model the caller owns and no
    longer needs as it was)."""
    out = model
    if copy:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    report = Report()
    if not rewrites:
        return out, report
    view = GraphView(out, first)
    g = out.graph
    taken = set(view.producer) | {i.name for i in g.input} | {i.name for i in g.initializer} \
        | {n.name for n in view.nodes}
    names = NameScope(taken)
    targets = {o.name for o in g.output}
    live = {id(n) for n in G.live(view.nodes, targets)[1]}
    dead_before = {id(n) for n in view.nodes if id(n) not in live}
    read_before = set(view.readers)
    changed = False
    for rw in rewrites:
        for node in view.candidates(rw.op_type, rw.forward):
            if id(node) in view.removed:        # replaced by an earlier match
                continue
            match = rw.pattern(view, node)
            if match is None:
                continue
            why = rw.check(view, match)
            if why is not None:
                report.declined.append((rw.name, node.name, why))
                continue
            _replace(view, names, rw, match)
            report.applied.append((rw.name, node.name))
            changed = True
    if changed:
        _sweep(view, targets, dead_before, read_before)
        nodes = view.nodes
        del g.node[:]
        g.node.extend(nodes)
        forward = sum(id(n) in view.forward for n in nodes)       # after the sweep
        if forward != first:
            M.set_metadata(out, {"onnxgrad.forward_nodes": str(forward)})
    return out, report


def _replace(view: GraphView, names: NameScope, rw: Rewrite, match: Match) -> None:
    """Emit the replacement where the root node was, under the root's outputs' names."""
    root = match.root
    scope = root.name.rsplit("/", 1)[0] if "/" in root.name else root.name     # 'conv1/grad/Slice' -> 'conv1/grad'
    b = Builder(view.opset, names, view.infos, f"{scope}/{rw.name}", f"rewrite '{rw.name}' of '{root.name}'",
                view.constants)
    values = list(rw.replacement(b, view, match))
    nodes = view.nodes
    at = next(i for i, n in enumerate(nodes) if n is root)
    in_forward = id(root) in view.forward
    for v, name in zip(values, match.outputs):
        if v.name in b.made and v.name not in b.constant_names:
            rename_tensors(b.nodes, {v.name: name})
        else:
            b.nodes.append(helper.make_node("Identity", [v.name], [name], name=names.fresh(f"{b.prefix}/Identity")))
    root_outputs = list(root.output)
    keep = [o for o in root_outputs if o and o not in match.outputs]
    if keep:        # outputs of the root the replacement does not stand for: the root stays
        del root.output[:]
        root.output.extend(o if o in keep else "" for o in root_outputs)
        at += 1
        view._forget(root, [o for o in root_outputs if o not in keep])
        view._index([root])
    else:
        view.removed[id(root)] = nodes.pop(at)
        view._forget(root, root_outputs)
    if in_forward:                      # the replacement is the forward's
        view.forward.update(id(n) for n in b.nodes)
    nodes[at:at] = b.nodes
    view._index(b.nodes)


def _read(node: onnx.NodeProto) -> set[str]:
    """The tensors ``node`` reads, its subgraphs' outer-scope reads included."""
    read = set(node.input) | (M.subgraph_inputs(node) if M.has_subgraph(node) else set())
    read.discard("")
    return read


def _sweep(view: GraphView, targets: set[str], dead_before: set[int], read_before: set[str]) -> None:
    """Remove the nodes the rewrites left unread (only those: dead code of the input stays), drop
    trailing outputs and initializers nothing reads any more (MaxPool's Indices, shape constants),
    and the value_info of removed tensors."""
    g = view.model.graph
    live_ids = {id(n) for n in G.live(view.nodes, targets)[1]}
    view.nodes = [n for n in view.nodes if id(n) in live_ids or id(n) in dead_before]
    view._refresh()
    for node in view.nodes:
        outs = list(node.output)
        while (len(outs) > 1 and outs[-1] in read_before and outs[-1] not in view.readers
               and outs[-1] not in targets):
            outs.pop()
        if len(outs) != len(node.output):
            del node.output[:]
            node.output.extend(outs)
    view._refresh()
    inputs = {i.name for i in g.input}
    M.keep_only(g.initializer, lambda t: t.name in view.readers or t.name in inputs or t.name in targets
                or t.name not in read_before)
    made = set(view.producer) | inputs | {i.name for i in g.initializer}
    M.keep_only(g.value_info, lambda vi: vi.name in made)
