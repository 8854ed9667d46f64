"""The fallback for ops without a rule: differentiate the op's ONNX function body.

Many ai.onnx schemas define the op as a function of other ops (Softplus is
``Log(Exp(x) + 1)``; Softmax, Gelu, GroupNormalization build theirs from the
node's attributes and input types). An op with no hand-written rule whose schema
has such a body gets the generic rule :func:`through_body`, so a new ONNX op with
a function body is covered the day onnx ships it:

1. the node alone becomes a small model whose one node is expanded into its body
   (``onnx.inliner``, with the node's attributes, schema defaults filled in, and the
   body converted to the model's opset);
2. :func:`onnxgrad.grad` differentiates that model (the body's ops have rules, or
   fall back to their own bodies);
3. its nodes are spliced into the backward graph under ``<node>/grad/...``: the
   body's forward ops are recomputed there where the backward reads them (the
   model's forward keeps the original node), the seeds are the node's output
   gradients.

A body that uses an op without a rule declines with an :class:`UnsupportedOpError`
naming the original node. Hand-written rules always win: they are shorter and
reuse the op's own outputs.
"""
from __future__ import annotations

import json
from functools import lru_cache

import onnx
import onnx.defs
import onnx.inliner
import onnx.version_converter
from onnx import TensorProto, helper, numpy_helper

from ..errors import OnnxGradError, UnsupportedOpError
from ..ir.builder import Var
from ..ir.graph import dependencies, live_nodes
from ..ir.load import emitted_ir_version
from ..ir.model import TensorInfo, rename_tensors
from ..rules.registry import Node, Rule, get_schema, schema_differentiable_inputs

__all__ = ["has_function_body", "body_rule", "body_model", "through_body"]

_DOMAIN = "onnxgrad.body"       # the body's stand-in domain while the inliner expands it


def has_function_body(schema: onnx.defs.OpSchema | None) -> bool:
    """Whether ``schema`` defines its op as a function of other ops (context-dependent or not); ops with
    subgraph attributes (SequenceMap) are left out: their bodies need the rule's outer-scope handling."""
    if schema is None or schema.domain != "":
        return False
    if any(a.type in (onnx.defs.OpSchema.AttrType.GRAPH, onnx.defs.OpSchema.AttrType.GRAPHS)
           for a in schema.attributes.values()):
        return False
    return bool(_body_versions(schema))


def _body_versions(schema: onnx.defs.OpSchema) -> list[int]:
    if schema.has_function:
        return list(schema.function_opset_versions)
    if schema.has_context_dependent_function:
        return list(schema.context_dependent_function_opset_versions)
    return []


@lru_cache(maxsize=None)
def body_rule(op_type: str, opset: int) -> Rule | None:
    """The generic rule for ``op_type`` at ``opset`` when its schema has a function body, else None.

    It differentiates the inputs the schema tags Differentiable; an untagged schema's float inputs."""
    schema = get_schema(op_type, opset)
    if not has_function_body(schema):
        return None
    inputs = None
    if schema_differentiable_inputs(schema, len(schema.inputs)) is None:
        inputs = tuple(i for i, p in enumerate(schema.inputs) if _can_be_float(schema, p))
        if schema.inputs and schema.inputs[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
            return None             # no untagged variadic op has a body today; its positions would be open-ended
    return Rule(op_type, through_body, inputs=inputs, via_body=True,
                doc=f"through its function body (opset {max(_body_versions(schema))})")


def _can_be_float(schema: onnx.defs.OpSchema, p) -> bool:
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    floats = ("tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)")
    return any(t in floats for t in allowed.get(p.type_str, [p.type_str]))


# -- 1. the body as a model -------------------------------------------------------------------
def _type_proto(info: TensorInfo | None) -> onnx.TypeProto:
    info = info or TensorInfo()
    shape = None if info.shape is None else list(info.shape)
    return helper.make_tensor_type_proto(info.dtype or TensorProto.UNDEFINED, shape)


def _call(node: onnx.NodeProto, schema: onnx.defs.OpSchema) -> onnx.NodeProto:
    """A copy of ``node`` with every attribute that has a schema default set (the inliner substitutes the
    node's attributes into the body, and a body's reference to an attribute left out would drop it)."""
    call = onnx.NodeProto()
    call.CopyFrom(node)
    del call.metadata_props[:]
    have = {a.name for a in call.attribute}
    for name, a in schema.attributes.items():
        if name not in have and a.default_value.type != onnx.AttributeProto.UNDEFINED:
            default = onnx.AttributeProto()
            default.CopyFrom(a.default_value)
            default.name = name
            call.attribute.append(default)
    return call


def _body(call: onnx.NodeProto, schema: onnx.defs.OpSchema, opset: int,
          types: list[onnx.TypeProto]) -> tuple[int, onnx.FunctionProto | None]:
    """The body ONNX defines for the op at ``opset`` (the newest at or below it, else the oldest above
    it), and the opset its ops are written in."""
    versions = _body_versions(schema)
    below = [v for v in versions if v <= opset]
    version = max(below) if below else min(versions)
    if schema.has_function:
        data = schema.get_function_with_opset_version(version)
    else:
        data = schema.get_context_dependent_function_with_opset_version(
            version, call.SerializeToString(), [t.SerializeToString() for t in types])
    return version, (onnx.FunctionProto.FromString(data) if data else None)


def body_model(node: onnx.NodeProto, opset: int, infos: dict[str, TensorInfo], constants: dict,
               wrt: set[str], outputs: list[str]) -> onnx.ModelProto:
    """``node`` alone as a model at ``opset``, expanded into its function body. Inputs with a value known
    at build time and no gradient wanted are initializers (rules see them as constants); raises
    ValueError with the reason when there is no usable body."""
    schema = get_schema(node.op_type, opset)
    call = _call(node, schema)
    types = [_type_proto(infos.get(x)) if x else onnx.TypeProto() for x in node.input]
    if schema.has_context_dependent_function and any(
            x and not t.tensor_type.elem_type for x, t in zip(node.input, types)):
        raise ValueError("its function body depends on its inputs' element types, which are unknown")
    version, body = _body(call, schema, opset, types)
    if body is None or not body.node:
        raise ValueError(f"onnx gives no function body for these attributes and input types at opset {opset}")
    body.domain, body.name = _DOMAIN, node.op_type
    call.domain = _DOMAIN
    inputs, inits, seen = [], [], set()
    for x in node.input:
        if not x or x in seen:
            continue
        seen.add(x)
        if x not in wrt and x in constants:
            inits.append(numpy_helper.from_array(constants[x], x))
        else:
            inputs.append(helper.make_value_info(x, _type_proto(infos.get(x))))
    outs = [helper.make_value_info(y, _type_proto(infos.get(y))) for y in outputs]
    graph = helper.make_graph([call], f"{node.name}_body", inputs, outs, inits)
    model = helper.make_model(graph, functions=[body], opset_imports=[
        helper.make_opsetid("", version), helper.make_opsetid(_DOMAIN, 1)])
    model.ir_version = 10
    try:
        model = onnx.inliner.inline_local_functions(model)
        if version != opset:
            model = _convert(model, opset)
    except Exception as e:     # onnx's inliner and version converter raise bare RuntimeErrors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"its function body is written at opset {version}, and onnx's version converter "
                         f"cannot bring it to opset {opset}: {first}") from None
    try:        # onnx's bodies do not cover every configuration (LayerNormalization's broadcast scale)
        model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)   # outputs typed
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"its function body fails onnx's shape inference here: {first}") from None
    for k, n in enumerate(model.graph.node):
        n.name = f"{n.op_type}_{k}"
    model.ir_version = emitted_ir_version(model)
    return model


def _convert(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """The expanded body, written at another opset than the model's, converted by onnx's version
    converter; converting below opset 15, CastLike first becomes a Cast to the type inference finds."""
    if opset < 15 and any(n.op_type == "CastLike" for n in model.graph.node):
        inferred = onnx.shape_inference.infer_shapes(model)
        dtypes = {vi.name: vi.type.tensor_type.elem_type for vi in
                  list(inferred.graph.value_info) + list(inferred.graph.input)}
        dtypes.update({t.name: t.data_type for t in model.graph.initializer})
        for n in model.graph.node:
            if n.op_type == "CastLike":
                to = dtypes.get(n.input[1])
                if not to:
                    raise ValueError(f"CastLike's target type '{n.input[1]}' is unknown")
                n.op_type = "Cast"
                del n.input[1:]
                n.attribute.append(helper.make_attribute("to", to))
    return onnx.version_converter.convert_version(model, opset)


# -- 2. the generic rule --------------------------------------------------------------------------
def through_body(n: Node):
    """d op(x) = the gradient of its ONNX function body (see the module docstring)."""
    node, b = n.proto, n.b
    wanted = [k for k, x in enumerate(node.input) if x and n.needs(k)]
    wrt = list(dict.fromkeys(node.input[k] for k in wanted))
    outputs = [y for y, d in zip(node.output, n.dys) if y and d is not None]
    try:
        inner = body_model(node, n.opset, b.infos, b.constants, set(wrt), [y for y in node.output if y])
    except ValueError as e:
        n.decline(f"no rule, and {e}")
    try:
        gm = n.differentiate(inner, wrt=wrt, of=outputs, allow_unused=True)
    except UnsupportedOpError as e:
        inner_ops = ", ".join(f"{op} ({e.reasons[op]})" if op in e.reasons else op for op in sorted(e.ops))
        n.decline(f"no rule, and its function body uses {inner_ops}")
    except OnnxGradError as e:
        n.decline(f"no rule, and its function body cannot be differentiated: {e}")
    grads = _splice(n, gm, outputs)
    out: list[Var | None] = [None] * len(node.input)
    for k in wanted:
        x = node.input[k]
        if x in grads:
            out[k] = grads.pop(x)           # an input read twice gets its gradient once
    return out


def _splice(n: Node, gm: onnx.ModelProto, outputs: list[str]) -> dict[str, Var | None]:
    """Copy the nodes of the body's gradient model that compute its gradients into ``n``'s builder under
    fresh names ``<node>/grad/<body node>/...``; returns the gradients by input name (None where the body
    passes no gradient: the input reaches the outputs only through zero-derivative ops or not at all)."""

    b = n.b
    meta = {p.key: json.loads(p.value) for p in gm.metadata_props if p.key in ("onnxgrad.seeds",
                                                                           "onnxgrad.gradients")}
    seeds, gradients = meta["onnxgrad.seeds"], meta["onnxgrad.gradients"]
    renames = {seeds[y]: n.dys[list(n.proto.output).index(y)].name for y in outputs}
    outer = {y for y in n.proto.output if y}
    # the body's node that makes the forward node's outputs is the forward node's: not recomputed
    nodes = [m for m in gm.graph.node if not {y for y in m.output if y} <= outer]
    live = live_nodes(nodes, gradients.values())
    for m in live:
        m.name = b.names.fresh(f"{b.prefix}/{m.name}")
        m.doc_string = b.doc
        del m.metadata_props[:]
        m.metadata_props.extend(b.metadata)
        for y in m.output:
            if y:
                renames[y] = b.names.fresh(f"{b.prefix}/{y.split('/')[-1]}")
    old_outputs = [list(m.output) for m in live]
    reads = {x for m in live for x in m.input}
    for init in gm.graph.initializer:       # the pass's small int64 constants: this scope's constants
        if init.name in reads and init.name not in n.proto.input:
            renames[init.name] = b.const(numpy_helper.to_array(init)).name
    seeded = {seeds[y] for y in outputs}
    result: dict[str, Var | None] = {}
    for x, g in gradients.items():       # None where no seed reaches it (zeros: a zero-derivative path)
        result[x] = b.var(renames.get(g, g)) if dependencies(live, [g]) & seeded else None
    types = {vi.name: vi.type for vi in list(gm.graph.value_info) + list(gm.graph.output)}
    rename_tensors(live, renames)
    for m, old in zip(live, old_outputs):
        for y, was in zip(m.output, old):
            if not y:
                continue
            info = _info(types.get(was))
            if info.dtype is None:          # a tensor onnx's inference did not type: from the op's inputs
                attrs = {a.name: helper.get_attribute_value(a) for a in m.attribute}
                info = TensorInfo(b._out_dtype(m.op_type, list(m.input), attrs), info.shape)
            b.infos[y] = info
            b.made.add(y)
            if m.op_type == "Constant":
                b.constant_names.add(y)
    b.nodes.extend(live)
    return result


def _info(tp: onnx.TypeProto | None) -> TensorInfo:
    if tp is None or not tp.HasField("tensor_type"):
        return TensorInfo()
    t = tp.tensor_type
    shape = None
    if t.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim)
        if None in shape:
            shape = None            # the builder records fully static shapes only
    return TensorInfo(t.elem_type or None, shape)
