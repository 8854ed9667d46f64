"""Reading, validating and normalising models before the pass; type and constant lookup."""
from __future__ import annotations

import os
import sys
from typing import Iterable

import numpy as np
import onnx
import onnx.inliner
import onnx.version_converter
from onnx import helper, numpy_helper, shape_inference

from .builder import FLOAT_TYPES, TensorInfo
from .errors import InvalidModelError

MIN_OPSET = 13
# onnxruntime 1.31 loads IR versions up to 13 and ai.onnx opsets up to 26.
RUNTIME_MAX_IR = 13
RUNTIME_MAX_OPSET = 26


def load(model: onnx.ModelProto | str | os.PathLike) -> onnx.ModelProto:
    """The model as a proto (external data loaded from beside a path), validated and at opset >= 13."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise InvalidModelError(f"cannot read model '{path}': no such file")
        try:
            model = onnx.load(path, load_external_data=True)
        except Exception as e:  # protobuf raises a zoo of types for a file that is not a model
            raise InvalidModelError(f"cannot read model '{path}': {type(e).__name__}: {e}") from None
    elif not isinstance(model, onnx.ModelProto):
        raise InvalidModelError(f"expected an onnx.ModelProto or a path, got {type(model).__name__}")
    else:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    if not model.graph.node and not model.graph.output:
        raise InvalidModelError("the model has an empty graph (is this an ONNX model file?)")
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # onnx 1.23's checker refuses ops deprecated after the model's opset (GroupNormalization-18,
        # which exporters still write); runtimes run them, and so do we
        if "is deprecated" not in message:
            raise InvalidModelError(f"the model fails the ONNX checker: {message}") from None
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    version = opset_of(model)
    if version < MIN_OPSET:
        print(f"onnxgrad: upgrading the model from ai.onnx opset {version} to {MIN_OPSET}", file=sys.stderr)
        try:
            model = onnx.version_converter.convert_version(model, MIN_OPSET)
        except Exception as e:
            raise InvalidModelError(
                f"the model uses ai.onnx opset {version}, and onnx's version converter cannot upgrade it to "
                f"{MIN_OPSET}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}; "
                f"re-export it at opset {MIN_OPSET} or newer"
            ) from None
    return model


def opset_of(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return onnx.defs.onnx_opset_version()


def infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference that never fails the pass: without it we work with unknown shapes."""
    try:
        return shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:
        return model


def _info_of(tp: onnx.TypeProto) -> TensorInfo:
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
    for init in g.initializer:
        infos[init.name] = TensorInfo(init.data_type, tuple(init.dims))
        types[init.name] = helper.make_tensor_type_proto(init.data_type, list(init.dims))
    initializers = set(infos)
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        if vi.name in initializers:
            continue
        infos[vi.name] = _info_of(vi.type)
        types[vi.name] = vi.type
    return infos, types


def constant_values(model: onnx.ModelProto, exclude: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """Values known at build time: initializers that are not graph inputs, and Constant nodes."""
    g = model.graph
    exclude = set(exclude) | {i.name for i in g.input}
    out: dict[str, np.ndarray] = {}
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
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def emitted_ir_version(model: onnx.ModelProto) -> int:
    """An IR version the installed runtime loads: no newer than it reads, no older than the opsets need."""
    need = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return max(min(model.ir_version, RUNTIME_MAX_IR), need)
