"""The model every pass shares: :class:`ParsedModel`, a loaded model and its facts, each computed once.

What the passes ask of a graph lives here: tensor types and shapes (:class:`TensorInfo`, :func:`tensor_infos`,
shape inference that never fails a pass: :func:`infer`), the opset, the values known at build time
(:func:`constant_values`), subgraphs and their reads of outer tensors, the names a model uses
(:class:`NameScope`) and small edits (:func:`rename_tensors`, :func:`keep_only`, :func:`set_metadata`).
Reading and validating a model is :mod:`onnxgrad.ir.load`.
"""
from __future__ import annotations

import math
import re
from functools import cached_property
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from .files import skeleton

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)


def float_bits(dtype: int | None) -> int:
    """Bits of a float element type (0 when unknown: nothing is narrower)."""
    return 8 * helper.tensor_dtype_to_np_dtype(dtype).itemsize if dtype else 0


class TensorInfo:
    """What is statically known about a tensor: element type and shape (dims may be None)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: int | None = None, shape: tuple[int | None, ...] | None = None):
        self.dtype = dtype
        self.shape = shape

    @property
    def static(self) -> bool:
        return self.shape is not None and None not in self.shape


class NameScope:
    """Hands out names unique in the model: ``fresh('x_grad')`` gives ``x_grad`` or ``x_grad_1``, ..."""

    def __init__(self, taken: Iterable[str] = ()):
        self.taken = set(taken)
        self._next: dict[str, int] = {}

    def fresh(self, base: str) -> str:
        if base not in self.taken:
            self.taken.add(base)
            return base
        i = self._next.get(base, 1)
        while f"{base}_{i}" in self.taken:
            i += 1
        self._next[base] = i + 1
        name = f"{base}_{i}"
        self.taken.add(name)
        return name


WITH_BODIES = frozenset({"If", "Loop", "Scan", "SequenceMap"})    # the ai.onnx ops with subgraph attributes


def rename_tensors(nodes: list[onnx.NodeProto], renames: dict[str, str]) -> None:
    """Rename tensors where they are made and where they are read (one sweep; subgraphs' outer reads too)."""
    if not renames:
        return
    for node in nodes:
        for k, x in enumerate(node.input):
            if x in renames:
                node.input[k] = renames[x]
        for k, y in enumerate(node.output):
            if y in renames:
                node.output[k] = renames[y]
        if node.op_type not in WITH_BODIES and node.domain in ("", "ai.onnx"):
            continue
        for a in node.attribute:            # If/Loop/Scan bodies reading the renamed tensors
            for sg in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                rename_tensors(sg.node, renames)
                for o in sg.output:
                    if o.name in renames:
                        o.name = renames[o.name]


class ParsedModel:
    """A loaded, validated model (:func:`onnxgrad.ir.load.parse` makes one) and its facts, computed on first
    use. A pass that is handed one reads its facts instead of computing them again from the proto; an edit
    that keeps every tensor's type (tied parameters restored, weights held aside) is :meth:`edited`."""

    def __init__(self, proto: onnx.ModelProto):
        self.proto = proto

    def edited(self, proto: onnx.ModelProto) -> "ParsedModel":
        """The parsed model of an edit of this one (tied parameters restored, weights held aside, train mode):
        the opset is this one's; the other facts are found again, on first use."""
        out = ParsedModel(proto)
        out.__dict__["opset"] = self.opset
        return out

    @property
    def graph(self) -> onnx.GraphProto:
        return self.proto.graph

    @cached_property
    def opset(self) -> int:
        """The ai.onnx opset the model imports."""
        return opset_of(self.proto)

    @cached_property
    def inferred(self) -> onnx.ModelProto:
        """The model with ONNX shape inference's types and shapes (:func:`onnxgrad.ir.model.infer`)."""
        return infer(self.proto)

    @cached_property
    def _infos_and_types(self) -> tuple[dict[str, TensorInfo], dict[str, onnx.TypeProto]]:
        return tensor_infos(self.inferred)

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Every tensor's element type and shape, as far as they are known."""
        return self._infos_and_types[0]

    @property
    def types(self) -> dict[str, onnx.TypeProto]:
        """Every tensor's TypeProto (sequences and optionals included)."""
        return self._infos_and_types[1]

    @cached_property
    def nodes(self) -> list[onnx.NodeProto]:
        """The graph's nodes in order (one Python wrapper each, kept: a pass may key facts by ``id``)."""
        return list(self.graph.node)

    def name_nodes(self) -> None:
        """Give each unnamed node the name ``<op>_<index>``: what a pass that writes a model (its backward
        nodes, its errors, a viewer) calls it. Only on a model the pass owns: the caller's keeps its own."""
        for i, node in enumerate(self.nodes):
            if not node.name:
                node.name = f"{node.op_type}_{i}"

    @cached_property
    def producer(self) -> dict[str, onnx.NodeProto]:
        """The node that makes each tensor."""
        return {o: node for node in self.nodes for o in node.output if o}

    @cached_property
    def initializers(self) -> dict[str, onnx.TensorProto]:
        """The initializers by name (their data may be held aside: :mod:`onnxgrad.ir.files`)."""
        return {i.name: i for i in self.graph.initializer}

    @cached_property
    def known(self) -> set[str]:
        """Every tensor of the main graph: inputs, initializers and node outputs."""
        return {i.name for i in self.graph.input} | set(self.initializers) | set(self.producer)

    @cached_property
    def outer_reads(self) -> dict[int, frozenset[str]]:
        """The nodes with subgraphs (If, Loop, Scan bodies), by ``id``, and the outer-scope tensors their
        subgraphs read."""
        return {id(node): frozenset(subgraph_inputs(node)) for node in self.nodes
                if node.attribute and has_subgraph(node)}

    @cached_property
    def defined(self) -> set[str]:
        """Every name the graph and the subgraphs in it define (a fresh name is none of them)."""
        return defined_names(self.graph)

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.graph.output]

    @cached_property
    def constants(self) -> dict[str, np.ndarray]:
        """The values known at build time (:func:`constant_values`)."""
        return constant_values(self.proto, self.inferred)

    def constants_without(self, variables: Iterable[str]) -> dict[str, np.ndarray]:
        """The values known at build time when ``variables`` are not (what a pass differentiates is no
        constant, nor what is computed from it)."""
        return constant_values(self.proto, self.inferred, variables)


def value_info_like(name: str, like: str, types: dict[str, onnx.TypeProto], infos: dict[str, TensorInfo],
                    doc: str = "") -> onnx.ValueInfoProto:
    """A graph input or output named ``name`` with the type (and shape, where known) of tensor ``like``."""
    tp = types.get(like)
    if tp is not None and tp.WhichOneof("value") in ("tensor_type", "sequence_type", "optional_type"):
        vi = onnx.ValueInfoProto(name=name, doc_string=doc)
        vi.type.CopyFrom(tp)
        return vi
    dtype = (infos.get(like) or TensorInfo()).dtype or onnx.TensorProto.FLOAT
    return helper.make_tensor_value_info(name, dtype, None, doc_string=doc)


def add_value_infos(graph: onnx.GraphProto, typed: Iterable[tuple[str, onnx.TypeProto]]) -> None:
    """Append a value_info entry ``(name, type)`` for each pair, in one parse.

    The entries are written in protobuf's wire format and merged into the graph at once: a
    gradient graph has a value_info entry per tensor, and adding tens of thousands one by one
    (``graph.value_info.add``) costs more than the rest of the shape work.
    """
    fields: dict[int, bytes] = {}          # the serialized type field, per TypeProto (few distinct)
    chunks = []
    for name, tp in typed:
        type_field = fields.get(id(tp))
        if type_field is None:
            body = tp.SerializeToString()
            type_field = fields[id(tp)] = b"\x12" + _varint(len(body)) + body       # field 2: type
        name_bytes = name.encode()
        entry = b"\x0a" + _varint(len(name_bytes)) + name_bytes + type_field    # field 1: name
        chunks.append(b"\x6a" + _varint(len(entry)) + entry)               # GraphProto field 13: value_info
    graph.MergeFromString(b"".join(chunks))


def _varint(n: int) -> bytes:
    """Protobuf's base-128 varint encoding of a length."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def set_metadata(model: "onnx.ModelProto | onnx.TensorProto", values: dict[str, str]) -> None:
    """Set these ``metadata_props`` keys of a model (or an initializer), replacing earlier values of the same
    keys, keeping the others."""
    kept = [p for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for k, v in values.items():
        model.metadata_props.add(key=k, value=v)


def set_attribute(node: onnx.NodeProto, name: str, value) -> None:
    """Set one attribute of a node, replacing an earlier value of that name, keeping the others."""
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute(name, value))


def keep_only(field, keep) -> None:
    """Delete, in place, the items of a repeated proto field for which ``keep(item)`` is false.

    In place rather than ``del field[:]; field.extend(kept)``: protobuf (upb) refuses to copy a
    message over 2 GB back into a field, which a large initializer is.
    """
    for i in reversed(range(len(field))):
        if not keep(field[i]):
            del field[i]


def opset_of(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return onnx.defs.onnx_opset_version()


def infer(model: onnx.ModelProto, data_prop: bool | None = None) -> onnx.ModelProto:
    """Shape inference that never fails the pass: without it we work with unknown shapes.

    onnx's inference stops at a Reshape to a shape computed at run time (its rank unknown); the
    ranks (and dims) the graph's declared outputs and shape-preserving ops imply are then recovered
    backwards (:func:`_recover_ranks`) and inference is run again from them. An If whose condition is
    known at build time, with branches of different ranks, leaves its outputs unranked: the shapes
    the taken branch gives are found on a copy of the model (:func:`_specialized_shapes`).
    ``data_prop``: onnx's data propagation on or off; by default on where it can carry a value.
    """
    model = skeleton(model)
    if data_prop is None:       # onnx's data propagation where it can carry a value (it costs seconds)
        data_prop = _propagates_data(model.graph)
    try:
        inferred = shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=data_prop)
    except Exception:
        return model
    for k in range(4):
        recovered = {**_carried_shapes(inferred), **_recover_ranks(inferred)}
        if k == 0:
            recovered.update(_specialized_shapes(model, inferred))
        if not recovered:
            break
        g = inferred.graph
        known = {vi.name: vi for vi in g.value_info}
        for name, tp in recovered.items():
            if name in known:
                known[name].type.CopyFrom(tp)
            else:
                g.value_info.add(name=name).type.CopyFrom(tp)
        try:
            inferred = shape_inference.infer_shapes(inferred, check_type=False, strict_mode=False,
                                                    data_prop=data_prop)
        except Exception:
            break
    return inferred


def _propagates_data(g: onnx.GraphProto, integers: frozenset[str] = frozenset()) -> bool:
    """Whether onnx's data propagation can know a value plain inference does not: one computed from a Shape or
    Size, or from small integer constants by a node other than a Constant (``Concat`` of two constant shapes, a
    Reshape's target). It propagates shapes and axes only (small integer vectors; not through Expand); without
    such a source it adds nothing, and it costs: 1.4 s of the 1.5 s EfficientNet-B0's WebGPU training graph took
    to infer, its optimizer update's thousands of Reshape, Concat and Split nodes the most."""
    known = set(integers) | {t.name for t in g.initializer
                             if t.data_type in _INTEGER_TYPES and math.prod(t.dims) <= SHAPE_DATA_LIMIT}
    for node in g.node:          # every node of a large graph: the cheap tests first (a 10k-node chain: 30 -> 8 ms)
        op = node.op_type
        if op in ("Shape", "Size"):
            return True
        if op == "Constant":
            a = node.attribute[0] if len(node.attribute) == 1 else None
            small = a is not None and a.name == "value" and math.prod(a.t.dims) <= SHAPE_DATA_LIMIT
            if a is not None and (a.name in ("value_int", "value_ints") or (small and a.t.data_type in _INTEGER_TYPES)):
                known.update(node.output)
            continue
        if known and op != "Expand" and _reads_only(node.input, known) and not _makes_floats(node):
            return True
        if has_subgraph(node) and any(_propagates_data(sg, frozenset(known)) for sg in subgraphs(node)):
            return True
    return False


def _reads_only(inputs: Iterable[str], known: set[str]) -> bool:
    """Whether a node with these inputs reads something, and only tensors in ``known`` (optional inputs left out
    aside)."""
    read = False
    for x in inputs:
        if x:
            if x not in known:
                return False
            read = True
    return read


SHAPE_DATA_LIMIT = 64       # elements of an integer value that may be a shape (webgpu's integer_constants_folded too)
_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})


def _makes_floats(node: onnx.NodeProto) -> bool:
    """A Cast to a float type, or a ConstantOfShape of floats (its default): no value data propagation keeps."""
    for a in node.attribute:
        if node.op_type == "Cast" and a.name == "to":
            return a.i in FLOAT_TYPES
        if node.op_type == "ConstantOfShape" and a.name == "value":
            return a.t.data_type in FLOAT_TYPES
    return node.op_type == "ConstantOfShape"


# Ops whose first output has the shape of their first input.
_SAME_SHAPE = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "BitwiseNot", "Cast", "CastLike", "Ceil", "Celu",
    "Clip", "Cos", "Cosh", "CumSum", "Dropout", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish",
    "Hardmax", "Identity", "InstanceNormalization", "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Log",
    "LogSoftmax", "LpNormalization", "MeanVarianceNormalization", "Mish", "Neg", "Not", "PRelu", "Reciprocal",
    "Relu", "Round", "RMSNormalization", "Selu", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Softmax", "Softplus",
    "Softsign", "Sqrt", "Swish", "Tan", "Tanh", "ThresholdedRelu", "Trilu", "GroupNormalization",
    "BatchNormalization",
})
# Ops whose output is the broadcast of their inputs.
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Where", "Equal",
                        "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Mod", "BitShift"})


def _shape_of(tp: onnx.TypeProto | None) -> onnx.TensorShapeProto | None:
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return tp.tensor_type.shape


def _carried_shapes(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """The shapes of Loop/Scan state outputs onnx's inference leaves unknown (a carried value may change shape):
    where the initial value and the body's declared output have the same shape, every iteration keeps it."""
    g = model.graph
    if not any(node.op_type in ("Loop", "Scan") for node in g.node):
        return {}
    types = tensor_infos(model)[1]
    found = {}
    for node in g.node:
        if node.op_type not in ("Loop", "Scan") or node.domain not in ("", "ai.onnx"):
            continue
        body = next(a.g for a in node.attribute if a.name == "body")
        if node.op_type == "Loop":
            pairs = zip(node.input[2:], body.output[1:], node.output)
        else:
            m = next(a.i for a in node.attribute if a.name == "num_scan_inputs")
            pairs = zip(node.input[:len(node.input) - m], body.output, node.output)
        for init, declared, out in pairs:
            start, kept = _shape_of(types.get(init)), _shape_of(declared.type)
            if (out and _shape_of(types.get(out)) is None and start is not None and kept is not None
                    and start == kept and all(d.HasField("dim_value") for d in start.dim)):
                found[out] = declared.type
    return found


def _recover_ranks(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Types with a shape for tensors onnx's inference left without one, from what their readers imply:
    a shape-preserving op gives its input its output's shape; a broadcasting op gives an input of
    unknown rank its output's rank when every other input is of lower rank; MatMul gives an operand
    the rank its output and the other operand imply; a Transpose's perm gives its input's rank. Dims not
    implied are left unknown."""
    g = model.graph
    values = list(g.input) + list(g.value_info) + list(g.output)
    shaped = {vi.name for vi in values if vi.type.tensor_type.HasField("shape")}
    shaped.update(init.name for init in g.initializer)
    shaped.add("")                  # an optional output left out
    if all(vi.name in shaped for vi in g.input) and all(shaped.issuperset(n.output) for n in g.node):
        return {}                   # the common case: every tensor a node makes or reads has a shape already
    types: dict[str, onnx.TypeProto] = {}
    for vi in values:
        types.setdefault(vi.name, vi.type)
    for init in g.initializer:
        types[init.name] = helper.make_tensor_type_proto(init.data_type, list(init.dims))
    found: dict[str, onnx.TypeProto] = {}

    def rank(name: str) -> int | None:
        shape = _shape_of(found.get(name) or types.get(name))
        return None if shape is None else len(shape.dim)

    def give(name: str, like: onnx.TypeProto | None, r: int) -> None:
        if not name or rank(name) is not None:
            return
        tp = onnx.TypeProto()
        old = types.get(name)
        elem = old.tensor_type.elem_type if old is not None and old.HasField("tensor_type") else 0
        if like is not None and _shape_of(like) is not None and len(_shape_of(like).dim) == r:
            tp.tensor_type.shape.CopyFrom(_shape_of(like))
        else:
            for _ in range(r):
                tp.tensor_type.shape.dim.add()
        if not elem:
            return      # an element type we do not know: leave it to inference
        tp.tensor_type.elem_type = elem
        found[name] = tp

    for node in reversed(list(g.node)):
        if node.domain not in ("", "ai.onnx") or not node.output or not node.input:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if node.op_type == "Transpose" and perm:
            give(node.input[0], None, len(perm))        # perm names every axis of the input
        out = node.output[0]
        r_out = rank(out)
        if r_out is None:
            continue
        out_tp = found.get(out) or types.get(out)
        if node.op_type in _SAME_SHAPE:
            give(node.input[0], out_tp, r_out)
        elif node.op_type in _BROADCAST:
            inputs = [i for i in node.input if i]
            unknown = {i for i in inputs if rank(i) is None}
            if len(unknown) == 1 and all(rank(i) < r_out for i in inputs if i not in unknown):
                name = unknown.pop()
                exact = all(rank(i) == 0 for i in inputs if i != name)
                give(name, out_tp if exact else None, r_out)
        elif node.op_type == "MatMul" and len(node.input) == 2:
            a, b = node.input
            ra, rb = rank(a), rank(b)
            if ra is None and rb is not None:
                if rb == 1:
                    give(a, None, r_out + 1)
                elif rb < r_out:
                    give(a, None, r_out)
            elif rb is None and ra is not None:
                if ra == 1:
                    give(b, None, r_out + 1)
                elif ra < r_out:
                    give(b, None, r_out)
    return found


# -- Ifs whose condition is known at build time ---------------------------------------------
_FOLD_LIMIT = 4096      # elements: the integer and boolean values folded (shapes, sizes, conditions)
_RANDOM = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
                     "Multinomial", "Dropout"})


def _specialized(model: onnx.ModelProto, inferred: onnx.ModelProto, exclude: Iterable[str] = ()
                 ) -> tuple[onnx.ModelProto | None, dict[str, np.ndarray]]:
    """For a model with an If: a copy in which integer and boolean computations on constants are folded
    into initializers and each If whose condition they decide is replaced by its taken branch (repeatedly:
    a branch may decide the next If), and the values folded for the model's own tensors. The copy
    computes what the model computes, for every value of its graph inputs: only the tensors ``exclude``
    names, graph inputs and float tensors are not taken as constants. The copy is None where no If is
    decided; (None, {}) for a model without an If."""
    g = model.graph
    if not any(n.op_type == "If" and n.domain in ("", "ai.onnx") for n in g.node):
        return None, {}
    exclude = set(exclude) | {i.name for i in g.input}
    values: dict[str, np.ndarray] = {}
    copy = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                           functions=model.functions)
    cg = copy.graph
    cg.name = g.name
    cg.input.extend(g.input)
    cg.output.extend(g.output)
    cg.sparse_initializer.extend(g.sparse_initializer)
    inputs = {i.name for i in g.input}
    for init in g.initializer:          # large ones as inputs of their type: inference needs no value
        small = init.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(init.dims)) <= _FOLD_LIMIT
        if small:
            cg.initializer.append(init)
            if init.name not in exclude and _integral(init.data_type):
                values[init.name] = numpy_helper.to_array(init)
        elif init.name not in inputs:
            cg.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    taken = {i.name for i in cg.input} | defined_names(g)
    shapes = _static_shapes(cg, model, inferred)
    opset = opset_of(model)
    pending = list(reversed(g.node))    # a stack: the next node last
    kept, decided = [], 0
    while pending:
        node = pending.pop()
        cond = values.get(node.input[0]) if node.op_type == "If" and node.input else None
        if cond is not None and cond.size == 1 and node.domain in ("", "ai.onnx"):
            branch = next(a.g for a in node.attribute if a.name == ("then_branch" if cond.item() else "else_branch"))
            pending.extend(reversed(_inlined(branch, node.output, taken)))
            decided += 1
            continue
        folded = _folded(node, values, opset) or _shape_folded(node, shapes)
        if folded is None:
            kept.append(node)
            continue
        values.update(folded)
        cg.initializer.extend(numpy_helper.from_array(v, k) for k, v in folded.items())
    cg.node.extend(kept)
    own = {o for n in g.node for o in n.output if o}
    return copy if decided else None, {k: v for k, v in values.items() if k in own and k not in exclude}


def defined_names(g: onnx.GraphProto) -> set[str]:
    """Every name a graph and the subgraphs in it define."""
    out = {i.name for i in g.input} | {i.name for i in g.initializer}
    for node in g.node:
        out.update(o for o in node.output if o)
        for sg in subgraphs(node):
            out |= defined_names(sg)
    return out


def _integral(dtype: int) -> bool:
    return dtype in (onnx.TensorProto.BOOL, onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32,
                     onnx.TensorProto.INT64, onnx.TensorProto.UINT8, onnx.TensorProto.UINT16,
                     onnx.TensorProto.UINT32, onnx.TensorProto.UINT64)


def _static_shapes(g: onnx.GraphProto, model: onnx.ModelProto, inferred: onnx.ModelProto
                   ) -> dict[str, tuple[int, ...]]:
    """The shapes the graph's inputs and initializers are declared with, where every dim is a number: a
    value fed there has that shape, whatever its values (an initializer that is also an input, a default
    the caller may override, has the input's declared shape); where a Shape or Size reads another tensor,
    also the static shapes ``inferred`` gives the model's tensors (AffineGrid's size = Shape(x) of an
    image of any batch is an int64[4])."""
    shapes = {t.name: tuple(t.dims) for t in g.initializer}
    for vi in g.input:
        shapes.pop(vi.name, None)
        if (dims := _static_dims(vi.type)) is not None:
            shapes[vi.name] = dims
    measured = any(n.op_type in ("Shape", "Size") and n.input[0] not in shapes for n in model.graph.node)
    if measured:
        for vi in inferred.graph.value_info:
            if vi.name not in shapes and (dims := _static_dims(vi.type)) is not None:
                shapes[vi.name] = dims
    return shapes


def _static_dims(tp: onnx.TypeProto) -> tuple[int, ...] | None:
    """A tensor type's dims where every one is a number, else None."""
    shape = _shape_of(tp)
    if shape is None or not all(d.HasField("dim_value") for d in shape.dim):
        return None
    return tuple(d.dim_value for d in shape.dim)


def _shape_folded(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """Shape(x) and Size(x) of a tensor of static declared shape (AffineGrid's body decides its 2-D or 3-D
    branch by Size(size), size an int64[4] graph input): known at build time without x's values."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("Shape", "Size") or node.input[0] not in shapes:
        return None
    shape = shapes[node.input[0]]
    if node.op_type == "Size":
        return {node.output[0]: np.array(int(np.prod(shape)), np.int64)}
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return {node.output[0]: np.array(shape[slice(start, end)], np.int64)}


def folded(node: onnx.NodeProto, values: dict[str, np.ndarray], opset: int) -> dict[str, np.ndarray] | None:
    """The node's outputs when its inputs are among ``values`` (integer or boolean ones: shapes, axes, sizes) and
    so are its outputs; None otherwise."""
    return _folded(node, values, opset)


def _folded(node: onnx.NodeProto, values: dict[str, np.ndarray], opset: int) -> dict[str, np.ndarray] | None:
    """The node's outputs when its inputs are known integer or boolean values and so are its outputs
    (small ones: shapes, sizes, conditions); None otherwise."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM or has_subgraph(node):
        return None
    if node.op_type == "Constant":
        if len(node.attribute) != 1 or node.attribute[0].name not in ("value", "value_int", "value_ints"):
            return None
        v = helper.get_attribute_value(node.attribute[0])
        results = [numpy_helper.to_array(v) if node.attribute[0].name == "value" else np.array(v, np.int64)]
    else:
        inputs = [x for x in node.input if x]
        if not inputs or any(x not in values for x in inputs):
            return None
        from onnx.reference import ReferenceEvaluator

        outs = [o or f"unused_{k}" for k, o in enumerate(node.output)]
        one = helper.make_node(node.op_type, list(node.input), outs)
        one.attribute.extend(node.attribute)
        m = helper.make_model(helper.make_graph(
            [one], "fold", [], [helper.make_empty_tensor_value_info(o) for o in outs],
            [numpy_helper.from_array(values[x], x) for x in dict.fromkeys(inputs)]),
            opset_imports=[helper.make_opsetid("", opset)])
        try:
            results = ReferenceEvaluator(m).run(None, {})
        except Exception:       # an op the reference cannot run here: not folded, nothing lost
            return None
    results = [np.asarray(r) for r in results]
    if any(r.dtype.kind not in "biu" or r.size > _FOLD_LIMIT for r in results):
        return None
    return {o: r for o, r in zip(node.output, results) if o}


def _inlined(branch: onnx.GraphProto, outputs: Iterable[str], taken: set[str]) -> list[onnx.NodeProto]:
    """The nodes of an If's branch that compute its outputs ``outputs`` in the enclosing graph: the names it
    defines made distinct from ``taken`` (which gains them), its initializers as Constants, its outputs
    copied by Identity."""
    env: dict[str, str] = {}

    def fresh(name: str) -> str:
        new, k = name, 0
        while new in taken:
            k += 1
            new = f"{name}_{k}"
        taken.add(new)
        env[name] = new
        return new

    nodes = [helper.make_node("Constant", [], [fresh(t.name)], value=t) for t in branch.initializer]
    for node in branch.node:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        new.input[:] = [env.get(x, x) for x in node.input]
        for sg in subgraphs(new):
            _rename_reads(sg, env)
        new.output[:] = [fresh(o) if o else "" for o in node.output]
        nodes.append(new)
    for out, vi in zip(outputs, branch.output):
        if out:
            nodes.append(helper.make_node("Identity", [env.get(vi.name, vi.name)], [out]))
    return nodes


_FX_NODE_KEY = "pkg.torch.onnx.fx_node"           # the dynamo exporter's record of the FX node a node came from
_EMBEDDING_CALL = re.compile(r"aten\.embedding\.default\]\(args = \(%[\w.]+, %[\w.]+, (-?\d+)")


def torch_padding_idx(node: onnx.NodeProto) -> int | None:
    """The ``padding_idx`` of the ``nn.Embedding`` (``aten.embedding`` call) a Gather was exported from, as the
    dynamo exporter's node metadata records it; None without one. PyTorch gives that row no gradient."""
    for p in node.metadata_props:
        if p.key == _FX_NODE_KEY:
            m = _EMBEDDING_CALL.search(p.value)
            return int(m.group(1)) if m and int(m.group(1)) >= 0 else None
    return None


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs a node holds in its attributes (If's branches, Loop's and Scan's bodies)."""
    return [sg for a in node.attribute for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def _rename_reads(g: onnx.GraphProto, env: dict[str, str]) -> None:
    """Rename, in place, the outer-scope names a subgraph (and those inside it) reads."""
    for node in g.node:
        node.input[:] = [env.get(x, x) for x in node.input]
        for sg in subgraphs(node):
            _rename_reads(sg, env)
    for vi in g.output:
        vi.name = env.get(vi.name, vi.name)


def _specialized_shapes(model: onnx.ModelProto, inferred: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Types with a shape (or more known dims) for the tensors of ``model`` that onnx's inference of it
    left without, found by inferring :func:`_specialized`'s copy, where each If decided at build time is
    its taken branch; the model itself is not changed. The symbols that inference of the copy makes up
    for unknown dims ('unk__3') are dropped: the model's own inference makes up the same names for other
    dims, and onnxruntime takes two dims of one name for equal."""
    copy, _ = _specialized(model, inferred)
    if copy is None:
        return {}
    try:
        found = shape_inference.infer_shapes(copy, check_type=False, strict_mode=False, data_prop=True)
    except Exception:
        return {}
    types = tensor_infos(found)[1]
    g = inferred.graph
    have = {vi.name: vi.type for vi in list(g.value_info) + list(g.output)}
    declared = {d.dim_param for vi in list(model.graph.input) + list(model.graph.output)
                if (s := _shape_of(vi.type)) is not None for d in s.dim if d.dim_param}
    out = {}
    for node in model.graph.node:
        for name in node.output:
            new, old = _shape_of(types.get(name)), _shape_of(have.get(name))
            if new is None or (old is not None and (len(old.dim) != len(new.dim) or _known(old) >= _known(new))):
                continue
            tp = onnx.TypeProto()
            tp.CopyFrom(types[name])
            for d in tp.tensor_type.shape.dim:
                if d.dim_param and d.dim_param not in declared:
                    d.ClearField("dim_param")
            out[name] = tp
    return out


def _known(shape: onnx.TensorShapeProto) -> tuple[int, int]:
    """How much a shape tells: its dims of known value, then its dims known at all (a value or a symbol)."""
    return (sum(d.HasField("dim_value") for d in shape.dim),
            sum(d.HasField("dim_value") or bool(d.dim_param) for d in shape.dim))


class ContainerInfo(TensorInfo):
    """A sequence or optional value: ``dtype`` is its tensors' element type, ``shape`` stays None (it is not
    a tensor), ``elem_shape`` the shape its tensors share where the type says it (dims None where not)."""

    __slots__ = ("kind", "elem_shape")

    def __init__(self, kind: str, dtype: int | None, elem_shape: tuple[int | None, ...] | None = None):
        super().__init__(dtype, None)
        self.kind = kind                    # "sequence" or "optional" (of a tensor)
        self.elem_shape = elem_shape


def container_kind(info: TensorInfo | None) -> str | None:
    """"sequence" or "optional" for a value of that type, None for a tensor (or an unknown type)."""
    return info.kind if isinstance(info, ContainerInfo) else None


def _info_of(tp: onnx.TypeProto) -> TensorInfo:
    kind = tp.WhichOneof("value")
    if kind in ("sequence_type", "optional_type"):
        inner = tp.sequence_type.elem_type if kind == "sequence_type" else tp.optional_type.elem_type
        if not inner.HasField("tensor_type"):      # a sequence of sequences, an optional sequence, a map
            return ContainerInfo(kind.split("_")[0] + "/" + (inner.WhichOneof("value") or "unknown"), None)
        elem = _info_of(inner)
        return ContainerInfo(kind.split("_")[0], elem.dtype, elem.shape)
    if not tp.HasField("tensor_type"):
        return TensorInfo(None, None)
    tt = tp.tensor_type
    dtype = tt.elem_type or None
    if not tt.HasField("shape"):
        return TensorInfo(dtype, None)
    dims = tuple(d.dim_value if d.WhichOneof("value") == "dim_value" else None for d in tt.shape.dim)
    return TensorInfo(dtype, dims)


def tensor_infos(model: onnx.ModelProto) -> tuple[dict[str, TensorInfo], dict[str, onnx.TypeProto]]:
    """Element type and shape of every tensor the (inferred) model knows about, and its TypeProto."""
    g = model.graph
    infos: dict[str, TensorInfo] = {}
    types: dict[str, onnx.TypeProto] = {}
    made: dict[tuple, onnx.TypeProto] = {}       # one (read-only) TypeProto per type and shape
    for init in g.initializer:
        key = (init.data_type, tuple(init.dims))
        infos[init.name] = TensorInfo(*key)
        tp = made.get(key)
        if tp is None:
            tp = made[key] = helper.make_tensor_type_proto(init.data_type, key[1])
        types[init.name] = tp
    initializers = set(infos)
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if vi.name in initializers:
            continue
        infos[vi.name] = _info_of(vi.type)
        types[vi.name] = vi.type
    return infos, types


def constant_values(model: onnx.ModelProto, inferred: onnx.ModelProto, exclude: Iterable[str] = ()
                    ) -> dict[str, np.ndarray]:
    """Values known at build time: initializers that are not graph inputs, and Constant nodes; in a model
    with an If, also the integer and boolean tensors computed from them (:func:`_specialized`), so that
    an If whose condition they decide is seen as its taken branch. ``inferred``: the model with its tensors'
    types (:func:`infer`'s, or a written model's own value_info), which a Shape folded there reads."""
    g = model.graph
    exclude = set(exclude) | {i.name for i in g.input}
    out: dict[str, np.ndarray] = _specialized(model, inferred, exclude)[1]
    for init in g.initializer:
        if init.name not in exclude and init.data_location != onnx.TensorProto.EXTERNAL:
            if int(np.prod(init.dims)) <= 4096:
                out[init.name] = numpy_helper.to_array(init)
    for node in g.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output[0] not in exclude:
            a = node.attribute[0]
            v = helper.get_attribute_value(a)
            if a.name == "value":
                out[node.output[0]] = numpy_helper.to_array(v)
            elif a.name in ("value_int", "value_ints", "value_float", "value_floats"):
                out[node.output[0]] = np.array(v)
    return out


def is_float(info: TensorInfo | None) -> bool:
    """Float tensors carry gradients; unknown types are given the benefit of the doubt."""
    return info is None or info.dtype is None or info.dtype in FLOAT_TYPES


def subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names a node's subgraphs (If/Loop/Scan bodies) read."""
    names: set[str] = set()
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for sg in graphs:
            local = {i.name for i in sg.input} | {i.name for i in sg.initializer}
            for n in sg.node:
                names.update(x for x in n.input if x and x not in local)
                names |= subgraph_inputs(n) - local
                local.update(n.output)
            names.update(o.name for o in sg.output if o.name not in local)
    return names


def has_subgraph(node: onnx.NodeProto) -> bool:
    attrs = node.attribute          # most nodes have none: asked of every node, several times per pass
    return bool(attrs) and any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in attrs)
