"""The table-driven gradient check every rule test uses.

A :class:`Case` is one op with concrete inputs and attributes. ``run_case``
builds a one-node model (float inputs become graph inputs, the others
initializers, i.e. constants known when the gradient is built), builds its
gradient graph, and requires that

1. the gradient model passes ``onnx.checker.check_model(full_check=True)``;
2. its gradients, run in onnxruntime in float32, match central differences of
   the float64 forward model (relative error ``tol32``);
3. the same gradient graph in float64 matches them tightly (``tol64``);
   it runs in onnxruntime where every op has a float64 kernel and in
   ``onnx.reference`` otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.check import Runner, check, gradient_spec, run_float64

RNG = np.random.default_rng(1234)


def randn(*shape: int, low: float | None = None, high: float | None = None) -> np.ndarray:
    """float32 test data: N(0, 1), or uniform in [low, high)."""
    if low is not None:
        return RNG.uniform(low, high, shape).astype(np.float32)
    return RNG.standard_normal(shape).astype(np.float32)


def distinct(*shape: int, scale: float = 1.0) -> np.ndarray:
    """float32 values all at least 0.05 apart (no ties, for Max/MaxPool/TopK), shuffled."""
    n = int(np.prod(shape))
    return (RNG.permutation(n).astype(np.float32) * 0.1 - 0.05 * n).reshape(shape) * scale


@dataclass
class Case:
    op: str
    inputs: list[Any]                        # arrays (float -> graph input, other -> initializer) or None
    attrs: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    opset: int = 17
    outputs: int = 1
    wrt: list[int] | None = None             # input positions to differentiate (default: float ones)
    dynamic: list[int] = field(default_factory=list)  # non-float inputs fed at run time instead
    unknown_shapes: bool = False             # declare graph inputs with unknown dims
    tol32: float = 2e-3
    tol64: float = 1e-5
    max_elements: int = 80

    def __str__(self) -> str:
        return f"{self.op}-{self.id}" if self.id else self.op


def case_model(case: Case) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[str]]:
    names, graph_inputs, inits, feeds = [], [], [], {}
    wrt_pos = case.wrt if case.wrt is not None else [
        i for i, x in enumerate(case.inputs) if x is not None and np.asarray(x).dtype.kind == "f"]
    for i, x in enumerate(case.inputs):
        if x is None:
            names.append("")
            continue
        name = f"x{i}"
        names.append(name)
        x = np.asarray(x)
        if x.dtype.kind == "f" and i in wrt_pos or i in case.dynamic:
            dtype = helper.np_dtype_to_tensor_dtype(x.dtype)
            shape = [None] * x.ndim if case.unknown_shapes else list(x.shape)
            graph_inputs.append(helper.make_tensor_value_info(name, dtype, shape))
            feeds[name] = x
        else:
            inits.append(numpy_helper.from_array(x, name))
    outs = [f"y{k}" for k in range(case.outputs)]
    node = helper.make_node(case.op, names, outs, name=f"{case.op}_node", **case.attrs)
    graph = helper.make_graph([node], "case", graph_inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    model.ir_version = onnxgrad.model.emitted_ir_version(model)
    model = onnx.shape_inference.infer_shapes(model)
    # declare outputs with their inferred types so the pass knows which are float; where
    # inference cannot tell (shapes only known at run time), run the model once to see
    inferred = {vi.name: vi for vi in model.graph.value_info if vi.type.tensor_type.HasField("shape")}
    missing = [o for o in outs if o not in inferred]
    values = Runner(model)(feeds) if missing else {}
    del model.graph.output[:]
    for o in outs:
        vi = inferred.get(o)
        if vi is None:
            v = np.asarray(values[o])
            dims = [f"{o}_d{k}" for k in range(v.ndim)] if case.unknown_shapes else list(v.shape)
            vi = helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(v.dtype), dims)
        model.graph.output.append(vi)
    del model.graph.value_info[:]
    return model, feeds, [names[i] for i in wrt_pos]


def float_outputs(model: onnx.ModelProto) -> list[str]:
    floats = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16}
    return [o.name for o in model.graph.output if o.type.tensor_type.elem_type in floats]


def run_case(case: Case, of: list[str] | None = None) -> onnxgrad.check.CheckResult:
    model, feeds, wrt = case_model(case)
    of = of or float_outputs(model)
    gm = onnxgrad.grad(model, wrt=wrt, of=of)
    onnx.checker.check_model(gm, full_check=True)
    r32 = check(model, gm, feeds, max_elements=case.max_elements)
    assert r32.ok(case.tol32), f"{case}: float32 gradient errors {r32.errors}"


    r64 = check(model, gm, feeds, max_elements=case.max_elements, analytic_run=run_float64)
    assert r64.ok(case.tol64), f"{case}: float64 gradient errors {r64.errors}"
    return r64


def run_second_order(case: Case) -> None:
    """grad(grad(model)): the first gradient model's gradients (of its forward inputs and of its seed)
    checked against central differences of that model, as run_case checks the first."""
    model, feeds, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    spec = gradient_spec(gm)
    seed = spec["seeds"]["y0"]
    y = Runner(model)(feeds)["y0"]
    feeds = {**feeds, seed: np.random.default_rng(5).standard_normal(y.shape).astype(y.dtype)}
    ggm = onnxgrad.grad(gm, wrt=wrt + [seed], of=list(spec["gradients"].values()), allow_unused=True)
    onnx.checker.check_model(ggm, full_check=True)
    r = check(gm, ggm, feeds, max_elements=case.max_elements)
    assert r.ok(case.tol32), f"{case}: second-order gradient errors {r.errors}"


def make_model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    """A model of these nodes at ``opset``, with an IR version onnxruntime loads."""
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = onnxgrad.model.emitted_ir_version(m)
    return m
