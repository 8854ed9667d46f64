"""The general tangent rule: the JVP as the transpose of the VJP (the "double-VJP trick").

For a node y = f(x) whose reverse rule gives g(u) = J^T u, a function linear in
the seed u:

    <g(u), v> = <J^T u, v> = <u, J v>   so   J v = d/du <g(u), v>

The node alone becomes a small model; :func:`onnxgrad.grad` builds its reverse
rule with a symbolic seed u (a graph input ``<y>_grad``), we append
s = sum_i sum(g_i * v_i) with the tangents v_i as inputs, and differentiate s
with respect to u by :func:`onnxgrad.grad` again (every reverse rule has its
own reverse rule: the pass is closed under differentiation). The nodes that
compute ds/du are spliced into the model under fresh names, u bound to zeros
(ds/du does not depend on u; the zeros are dropped when nothing reads them).

So every op with a reverse rule has a tangent, exact to rounding, at the price
of a graph about twice the size of a native rule's.
"""
from __future__ import annotations

import json
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import UnusedError
from ..ir import graph as G
from ..ir.builder import Builder, Var
from ..ir.model import TensorInfo, rename_tensors

_SUFFIX_V = "__tangent_in"
_LOSS = "__inner_product"


def transpose_of_vjp(node: onnx.NodeProto, b: Builder, dxs: Sequence[Var | None],
                     types: Mapping[str, onnx.TypeProto], opset: int,
                     strict: bool = False) -> list[Var | None]:
    """The tangents of ``node``'s outputs, J v, from its reverse rule; appended to ``b``."""
    from .autodiff import grad

    tangent_of = {}                              # input name -> tangent (a tensor read twice has one)
    for x, d in zip(node.input, dxs):
        if d is not None and x:
            tangent_of.setdefault(x, d)
    outputs = [o for o in node.output if o and _is_float(b.infos.get(o))]
    one = _single_node_model(node, b, types, set(tangent_of), outputs, opset)
    first = grad(one, wrt=list(tangent_of), of=outputs, allow_unused=True, strict_tags=strict)
    meta = _meta(first)
    seeds, grads = meta["onnxgrad.seeds"], meta["onnxgrad.gradients"]
    v_names = {x: x + _SUFFIX_V for x in tangent_of}
    paired = _with_inner_product(first, grads, v_names, types, b)
    try:
        second = grad(paired, wrt=[seeds[o] for o in outputs], loss=_LOSS, allow_unused=True, strict_tags=strict)
    except UnusedError:                          # pragma: no cover - allow_unused=True never raises it
        return [None] * len(node.output)
    jv = _meta(second)["onnxgrad.gradients"]
    return _splice(node, b, second, outputs, seeds, jv, v_names, tangent_of)


def _is_float(info: TensorInfo | None) -> bool:
    from ..ir.model import is_float

    return is_float(info)


def _meta(model: onnx.ModelProto) -> dict:
    return {p.key: json.loads(p.value) for p in model.metadata_props if p.key.startswith("onnxgrad.")
            and p.key != "onnxgrad.version"}


def _value_info(name: str, like: str, b: Builder, types: Mapping[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    tp = types.get(like)
    if tp is not None and tp.HasField("tensor_type") and tp.tensor_type.elem_type:
        vi = onnx.ValueInfoProto(name=name)
        vi.type.CopyFrom(tp)
        return vi
    info = b.infos.get(like) or TensorInfo()
    shape = list(info.shape) if info.shape is not None else None
    return helper.make_tensor_value_info(name, info.dtype or TensorProto.FLOAT, shape)


def _single_node_model(node: onnx.NodeProto, b: Builder, types: Mapping[str, onnx.TypeProto],
                       tangent_inputs: set[str], outputs: list[str], opset: int) -> onnx.ModelProto:
    """``node`` alone: inputs with tangents and unknown values are graph inputs, known constants initializers."""
    inputs, inits, seen = [], [], set()
    for x in node.input:
        if not x or x in seen:
            continue
        seen.add(x)
        value = b.constants.get(x) if x not in tangent_inputs else None
        if value is not None:
            inits.append(numpy_helper.from_array(np.asarray(value), x))
        else:
            inputs.append(_value_info(x, x, b, types))
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    outs = [_value_info(o, o, b, types) for o in outputs]
    g = helper.make_graph([copy], f"{node.name}_alone", inputs, outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    from ..ir.load import emitted_ir_version

    m.ir_version = emitted_ir_version(m)
    return m


def _with_inner_product(first: onnx.ModelProto, grads: dict, v_names: dict, types, b: Builder) -> onnx.ModelProto:
    """``first`` with inputs v and the output s = sum_i sum(g_i * v_i)."""
    m = onnx.ModelProto()
    m.CopyFrom(first)
    g = m.graph
    parts = []
    for x, v in v_names.items():
        g.input.append(_value_info(v, x, b, types))
        prod, part = f"{v}__prod", f"{v}__sum"
        g.node.append(helper.make_node("Mul", [grads[x], v], [prod], name=prod))
        g.node.append(helper.make_node("ReduceSum", [prod], [part], name=part, keepdims=0))
        parts.append(part)
    g.node.append(helper.make_node("Sum", parts, [_LOSS], name=_LOSS))
    dtype = (b.infos.get(next(iter(v_names))) or TensorInfo()).dtype or TensorProto.FLOAT
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(_LOSS, dtype, []))
    return m


def _splice(node: onnx.NodeProto, b: Builder, second: onnx.ModelProto, outputs: list[str], seeds: dict,
            jv: dict, v_names: dict, tangent_of: dict) -> list[Var | None]:
    """Copy the nodes computing ds/du into ``b`` under fresh names; return the output tangents."""
    nodes = list(second.graph.node)
    alone, rest = nodes[0], nodes[1:]
    _adopt_exposed_outputs(node, alone, rest, b)
    targets = [jv[seeds[o]] for o in outputs]
    live = G.live_nodes(rest, targets)
    v_inputs = {v for v in v_names.values()}
    renames: dict[str, str] = {v: tangent_of[x].name for x, v in v_names.items()}
    zeros: dict[str, Var] = {}
    outer = set(node.input) | set(node.output)
    for n in live:
        n.name = b.names.fresh(f"{b.prefix}/{n.name}")
        n.doc_string = b.doc
        for y in n.output:
            if y and y not in outer:
                renames[y] = b.names.fresh(f"{b.prefix}/{y.split('/')[-1]}")
    reads = {x for n in live for x in n.input}
    made = {y for n in live for y in n.output}
    for init in second.graph.initializer:       # constants the pass keeps as initializers: Constants here
        if init.name in reads and init.name not in made and init.name not in outer:
            renames[init.name] = b.const(numpy_helper.to_array(init)).name
    for o in outputs:
        u = seeds[o]
        if u in reads:
            zeros[u] = b.zeros_like(b.var(o))
            renames[u] = zeros[u].name
    rename_tensors(live, renames)
    b.nodes.extend(live)
    tangents: list[Var | None] = []
    for o in node.output:
        if o not in outputs:
            tangents.append(None)
            continue
        target = jv[seeds[o]]
        if not G.dependencies(live, [renames.get(target, target)]) & {renames[v] for v in v_inputs}:
            tangents.append(None)                # this output does not depend on the given tangents
            continue
        name = renames.get(target, target)
        b.infos[name] = b.infos.get(o) or TensorInfo()
        tangents.append(b.var(name))
    return tangents


def _adopt_exposed_outputs(node: onnx.NodeProto, alone: onnx.NodeProto, rest: list[onnx.NodeProto],
                           b: Builder) -> None:
    """Outputs the reverse rule asked of the forward node (a mask, saved statistics) are named on the
    model's node too; the spliced nodes read them under that name."""
    renames = {}
    for k, y in enumerate(alone.output):
        had = node.output[k] if k < len(node.output) else ""
        if y and not had:
            while len(node.output) <= k:
                node.output.append("")
            node.output[k] = b.names.fresh(f"{node.name}/{y.split('/')[-1]}")
            renames[y] = node.output[k]
            b.infos[node.output[k]] = TensorInfo()
    rename_tensors(rest, renames)
