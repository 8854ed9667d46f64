"""The step's scalars as a model of their own: what a training graph computes from ``lr`` and ``step`` alone.

An optimizer's step-dependent factors (Adam's bias corrections, Adagrad's decayed rate, SGD's first step) are
computed in float64, as PyTorch computes them in Python floats, then cast to each parameter's type
(:mod:`onnxgrad.training.optim`). A GPU without float64 (WebGPU) cannot run them, and float32 would change the
update: 1 - 0.999 ** t loses four digits to cancellation. :func:`split_schedule` moves every node that depends on
the given inputs and on nothing computed by the rest of the graph into a second model, run on the CPU before each
step; its outputs, the few scalars the step reads, become inputs of the training graph under the same names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import onnx
from onnx import helper

from ...ir import model as M
from ...ir.load import emitted_ir_version

__all__ = ["Schedule", "split_schedule"]


@dataclass
class Schedule:
    """The schedule model, and its inputs (``lr``, ``step``) and outputs (inputs of the training graph)."""

    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str] = field(default_factory=list)


def split_schedule(model: onnx.ModelProto, inputs: Sequence[str]) -> tuple[onnx.ModelProto, Schedule | None]:
    """``model`` without the nodes computed from ``inputs`` (graph inputs) and constants alone, and those nodes as
    a :class:`Schedule` whose outputs are the values the rest of the graph reads (None when no node moves). A node
    making a graph output stays. ``model`` is changed in place."""
    g = model.graph
    constants = {t.name for t in g.initializer} | {n.output[0] for n in g.node if _is_constant(n)}
    derived = set(inputs)
    moved: list[onnx.NodeProto] = []
    graph_outputs = {o.name for o in g.output}
    for node in g.node:
        read = [x for x in node.input if x]
        if (read and not M.has_subgraph(node) and all(x in derived or x in constants for x in read)
                and any(x in derived for x in read) and not set(node.output) & graph_outputs):
            moved.append(node)
            derived.update(o for o in node.output if o)
    if not moved:
        return model, None
    ids = {id(n) for n in moved}
    kept = [n for n in g.node if id(n) not in ids]
    read_by_kept = {x for n in kept for x in [*n.input, *M.subgraph_inputs(n)]}
    made = [o for n in moved for o in n.output if o]
    outputs = [o for o in made if o in read_by_kept]
    infos, types = M.tensor_infos(M.infer(model))
    needed = {x for n in moved for x in n.input}
    schedule_inputs = [i for i in g.input if i.name in inputs and i.name in needed]
    constant_nodes = [n for n in g.node if _is_constant(n) and n.output[0] in needed]
    initializers = [t for t in g.initializer if t.name in needed]
    schedule = helper.make_model(
        helper.make_graph([*constant_nodes, *moved], f"{g.name}_schedule", list(schedule_inputs),
                          [_typed(o, types, "a scalar of the step, computed from " + " and ".join(inputs))
                           for o in outputs], initializers),
        opset_imports=list(model.opset_import))
    schedule.ir_version = emitted_ir_version(schedule)
    del g.node[:]
    g.node.extend(kept)
    g.input.extend(_typed(o, types, "computed by the schedule model from " + " and ".join(inputs)) for o in outputs)
    still_read = {x for n in kept for x in [*n.input, *M.subgraph_inputs(n)]} | graph_outputs
    M.keep_only(g.input, lambda i: i.name not in inputs or i.name in still_read)
    M.keep_only(g.initializer, lambda t: t.name in still_read)
    M.keep_only(g.node, lambda n: not _is_constant(n) or n.output[0] in still_read)
    made_here = {o for n in g.node for o in n.output}
    M.keep_only(g.value_info, lambda vi: vi.name in made_here)
    return model, Schedule(schedule, [i.name for i in schedule_inputs], outputs)


def _is_constant(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx") and not node.input


def _typed(name: str, types: dict[str, onnx.TypeProto], doc: str) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto(name=name, doc_string=doc)
    vi.type.CopyFrom(types[name])
    return vi
