"""The grouped view of a backward graph: each forward node's backward nodes as one call of a
model-local function, so a graph viewer shows one node per forward op (as onnxruntime-training's
``XxxGrad`` nodes, but in standard ONNX that every runtime inlines).

The function of forward node ``n`` (op ``Op``) is ``onnxgrad.grad:OpGrad`` with overload ``n``'s name;
its inputs are the tensors its nodes read from outside, its outputs the tensors they make that
anything outside reads. Tensor names are the same inside and outside, so ``x_grad`` reads the same
in both views.
"""
from __future__ import annotations

from typing import Mapping

import onnx

DOMAIN = "onnxgrad.grad"

__all__ = ["DOMAIN", "group_backward"]


def group_backward(
    nodes: list[onnx.NodeProto],
    owners: list[onnx.NodeProto | None],
    outputs: set[str],
    value_info: list[onnx.ValueInfoProto],
    opset: int,
) -> tuple[list[onnx.NodeProto], list[onnx.FunctionProto], list[onnx.ValueInfoProto]]:
    """Replace the nodes of each group (``owners[i]``: the forward node ``nodes[i]`` belongs to, or None)
    by one call; return the new node list, the functions and the value_info left in the graph."""
    groups: dict[int, list[onnx.NodeProto]] = {}
    owner: dict[str, int] = {}                 # tensor -> the group (forward node id) that makes it
    for node, fwd in zip(nodes, owners):
        if fwd is not None:
            groups.setdefault(id(fwd), []).append(node)
            for o in node.output:
                owner[o] = id(fwd)
    # the tensors each group must hand out: read by a node of another group or of none, or graph outputs
    exported: set[str] = {o for o in outputs if o in owner}
    for node, fwd in zip(nodes, owners):
        here = id(fwd) if fwd is not None else None
        for x in node.input:
            if x in owner and owner[x] != here:
                exported.add(x)
    shapes = {vi.name: vi for vi in value_info}
    forward = {id(fwd): fwd for fwd in owners if fwd is not None}
    out_nodes: list[onnx.NodeProto] = []
    functions: list[onnx.FunctionProto] = []
    inside: set[str] = set()
    for node, fwd in zip(nodes, owners):
        if fwd is None:
            out_nodes.append(node)
            continue
        key = id(fwd)
        if key not in groups:                  # already replaced by its call
            continue
        body = groups.pop(key)
        call, fn = _function(forward[key], body, exported, shapes, opset)
        out_nodes.append(call)
        functions.append(fn)
        inside.update(o for n in body for o in n.output if o not in exported)
    return out_nodes, functions, [vi for vi in value_info if vi.name not in inside]


def _function(fwd: onnx.NodeProto, body: list[onnx.NodeProto], exported: set[str],
              shapes: Mapping[str, onnx.ValueInfoProto], opset: int) -> tuple[onnx.NodeProto, onnx.FunctionProto]:
    made = {o for n in body for o in n.output if o}
    inputs = list(dict.fromkeys(x for n in body for x in n.input if x and x not in made))
    outputs = [o for n in body for o in n.output if o in exported]
    name = f"{fwd.op_type}Grad"
    doc = f"gradient of node '{fwd.name}' ({fwd.op_type})"
    fn = onnx.FunctionProto(name=name, domain=DOMAIN, overload=fwd.name, input=inputs, output=outputs,
                            doc_string=doc)
    fn.node.extend(body)
    fn.opset_import.add(domain="", version=opset)
    fn.value_info.extend(shapes[o] for o in made if o in shapes and o not in exported)
    fn.metadata_props.extend(fwd.metadata_props)
    call = onnx.NodeProto(op_type=name, domain=DOMAIN, overload=fwd.name, input=inputs, output=outputs,
                          name=f"{fwd.name}/grad", doc_string=doc)
    call.metadata_props.extend(fwd.metadata_props)
    return call, fn
