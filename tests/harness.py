"""The table-driven gradient check every rule test uses.

A :class:`Case` is one op with concrete inputs and attributes. ``run_declared``
builds a one-node model (float inputs become graph inputs, the others
initializers, i.e. constants known when the gradient is built), builds its
gradient graph, and requires that

1. the gradient model passes ``onnx.checker.check_model(full_check=True)``;
2. its gradients, run in onnxruntime in float32, match central differences of
   the float64 forward model (relative error ``tol32``);
3. the same gradient graph in float64 matches them tightly (``tol64``).

Every model runs in onnxruntime. onnx.reference runs one only where that is
declared with its reason: by the element type, automatically
(:class:`onnxgrad.tools.check.Runner`: float64 kernels onnxruntime lacks), or by the
case's ``reference`` field, which must name why onnxruntime cannot run the
case's forward op (the harness checks that it indeed cannot). Which runtime ran
each gradient graph is recorded (``RUNS``) and summed up at the end of a session.

Test data comes from :func:`rng`: while a test runs, a generator seeded from
the test's id; at import (the case tables), one seeded from the calling
module's name. A file run alone sees the data it sees in the whole suite.
"""
from __future__ import annotations

import sys
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.tools.check import CheckResult, Runner, RuntimeRefusedError, check, gradient_spec, run_float64

_MODULE_RNGS: dict[str, np.random.Generator] = {}
_TEST_RNG: list[np.random.Generator] = []


def _seed(key: str) -> int:
    return zlib.crc32(key.encode())


def rng() -> np.random.Generator:
    """The generator for test data: the running test's own, else the calling module's (see the module doc)."""
    if _TEST_RNG:
        return _TEST_RNG[-1]
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    if module not in _MODULE_RNGS:
        _MODULE_RNGS[module] = np.random.default_rng(_seed(module))
    return _MODULE_RNGS[module]


@contextmanager
def seeded(test_id: str):
    """Data drawn inside a test comes from a generator seeded from its id (conftest's autouse fixture)."""
    _TEST_RNG.append(np.random.default_rng(_seed(test_id)))
    try:
        yield
    finally:
        _TEST_RNG.pop()


def randn(*shape: int, low: float | None = None, high: float | None = None) -> np.ndarray:
    """float32 test data: N(0, 1), or uniform in [low, high)."""
    if low is not None:
        return rng().uniform(low, high, shape).astype(np.float32)
    return rng().standard_normal(shape).astype(np.float32)


def distinct(*shape: int, scale: float = 1.0) -> np.ndarray:
    """float32 values all at least 0.05 apart (no ties, for Max/MaxPool/TopK), shuffled."""
    n = int(np.prod(shape))
    return (rng().permutation(n).astype(np.float32) * 0.1 - 0.05 * n).reshape(shape) * scale


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
    reference: str = ""                      # why onnx.reference runs this case: what onnxruntime refuses

    def __str__(self) -> str:
        return f"{self.op}-{self.id}" if self.id else self.op


def make_model(nodes, inputs, outputs, inits=(), opset: int = 17, name: str = "m") -> onnx.ModelProto:
    """A model of these nodes at ``opset``, with an IR version onnxruntime loads."""
    g = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = onnxgrad.ir.load.emitted_ir_version(m)
    return m


def case_runner(case: Case, model: onnx.ModelProto) -> Runner:
    """A runner for the case's model: onnxruntime, or onnx.reference where the case declares why."""
    return Runner(model, runtime="reference", reason=case.reference) if case.reference else Runner(model)


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
    model = make_model([node], graph_inputs, [helper.make_empty_tensor_value_info(o) for o in outs], inits,
                       opset=case.opset, name="case")
    model = onnx.shape_inference.infer_shapes(model)
    # declare outputs with their inferred types so the pass knows which are float; where
    # inference cannot tell (shapes only known at run time), run the model once to see
    inferred = {vi.name: vi for vi in model.graph.value_info if vi.type.tensor_type.HasField("shape")}
    missing = [o for o in outs if o not in inferred]
    values = case_runner(case, model)(feeds) if missing else {}
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


# (case or model, runtime of the float32 gradient graph, of the float64 one, reason): every check of this process
RUNS: list[tuple[str, str, str, str]] = []


def check_gradients(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str], of: list[str], *,
                    tol32: float = 2e-3, tol64: float = 1e-5, max_elements: int = 80, reference: str = "",
                    allow_unused: bool = False, name: str = "") -> CheckResult:
    """The three checks of the module doc on a built model; onnx.reference only where ``reference`` says why."""
    name = name or model.graph.name
    gm = onnxgrad.grad(model, wrt=wrt, of=of, allow_unused=allow_unused)
    onnx.checker.check_model(gm, full_check=True)
    r32 = check(model, gm, feeds, max_elements=max_elements, reference=reference)
    assert r32.grad_backend == "onnxruntime" or reference, f"{name}: float32 gradients ran in {r32.grad_backend}"
    assert r32.ok(tol32), f"{name}: float32 gradient errors {r32.errors}"
    r64 = check(model, gm, feeds, max_elements=max_elements, analytic_run=run_float64, reference=reference)
    assert r64.ok(tol64), f"{name}: float64 gradient errors {r64.errors}"
    RUNS.append((name, r32.grad_backend, r64.grad_backend, reference or r64.grad_reason))
    return r64


def _declare(model: onnx.ModelProto, shapes: dict[str, list]) -> None:
    """Graph inputs and outputs declared with these dims (int, a name, or None for an unknown one)."""
    for vi in list(model.graph.input) + list(model.graph.output):
        if vi.name in shapes:
            vi.CopyFrom(helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type, shapes[vi.name]))


def _check_declaration(case: Case, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """A case declared for onnx.reference is one whose forward onnxruntime refuses: a stale declaration fails."""
    try:
        Runner(model, runtime="onnxruntime")(feeds)
    except RuntimeRefusedError:
        return
    raise AssertionError(f"{case} is declared for onnx.reference ({case.reference}), but onnxruntime runs its "
                         "forward: remove the declaration")


def run_declared(case: Case, *, of: list[str] | None = None, keep: list[int] | None = None,
                 shapes: dict[str, list] | None = None) -> CheckResult:
    """Check one case (the module doc). ``of``: the outputs differentiated (default: the float ones);
    ``keep``: the node's outputs that stay (the others left out, as a node without them); ``shapes``:
    dims to declare graph inputs/outputs with. Outputs that shape inference leaves without a rank
    (run-time axes) are declared with the rank a run gives: onnx's checker needs one."""
    model, feeds, wrt = case_model(case)
    if keep is not None:
        node = model.graph.node[0]
        for i in range(case.outputs):
            if i not in keep:
                node.output[i] = ""
        kept = [o for o in model.graph.output if o.name in set(node.output)]
        del model.graph.output[:]
        model.graph.output.extend(kept)
    shapes = dict(shapes or {})
    if any(not o.type.tensor_type.HasField("shape") for o in model.graph.output if o.name not in shapes):
        values = case_runner(case, model)(feeds)
        shapes.update({o.name: [None] * np.ndim(values[o.name]) for o in model.graph.output
                       if o.name not in shapes and not o.type.tensor_type.HasField("shape")})
    _declare(model, shapes)
    if case.reference:
        _check_declaration(case, model, feeds)
    return check_gradients(model, feeds, wrt, of or float_outputs(model), tol32=case.tol32, tol64=case.tol64,
                           max_elements=case.max_elements, reference=case.reference, name=str(case))


def run_case(case: Case, of: list[str] | None = None) -> CheckResult:
    """``run_declared`` with nothing declared beyond the case itself."""
    return run_declared(case, of=of)


def run_second_order(case: Case) -> None:
    """grad(grad(model)): the first gradient model's gradients (of its forward inputs and of its seed)
    checked against central differences of that model, as run_case checks the first."""
    model, feeds, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    spec = gradient_spec(gm)
    seed = spec["seeds"]["y0"]
    y = case_runner(case, model)(feeds)["y0"]
    feeds = {**feeds, seed: np.random.default_rng(5).standard_normal(y.shape).astype(y.dtype)}
    ggm = onnxgrad.grad(gm, wrt=wrt + [seed], of=list(spec["gradients"].values()), allow_unused=True)
    onnx.checker.check_model(ggm, full_check=True)
    r = check(gm, ggm, feeds, max_elements=case.max_elements, reference=case.reference)
    assert r.grad_backend == "onnxruntime" or case.reference, f"{case}: second-order gradients ran in {r.grad_backend}"
    assert r.ok(case.tol32), f"{case}: second-order gradient errors {r.errors}"
