"""onnx's own backend node test cases as gradient checks.

``onnx.backend.test.case.node.collect_testcases()`` generates one small model
per case (the data is not shipped as files). For each case whose op has a
rule we keep the model and its integer inputs (indices, shapes, axes), draw
random float inputs at the case's shapes from a domain that suits the op
(positive for Log, (-1, 1) for Asin, ...), and run the numeric checker on the
gradients of every float output with respect to every differentiable float
input. ``_expanded`` variants (the op written as its function body) are
checked the same way, which exercises the rules of the ops in that body.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .builder import FLOAT_TYPES
from .check import Runner, check
from .model import RUNTIME_MAX_OPSET, has_subgraph, load, opset_of
from .registry import get_rule, get_schema

# Worst relative error accepted, by the precision the gradient graph computes in.
TOLERANCE = {"float64": 1e-5, "float32": 2e-3, "float16": 1e-2, "bfloat16": 5e-2}

# Input domains where an op is smooth: (low, high) for uniform draws, per op and input position.
_POSITIVE = (0.5, 2.0)
DOMAINS: dict[str, dict[int, tuple[float, float]]] = {
    "Log": {0: _POSITIVE}, "Sqrt": {0: _POSITIVE}, "Reciprocal": {0: _POSITIVE},
    "Pow": {0: _POSITIVE}, "Div": {1: _POSITIVE}, "Mod": {1: _POSITIVE},
    "Asin": {0: (-0.9, 0.9)}, "Acos": {0: (-0.9, 0.9)}, "Atanh": {0: (-0.9, 0.9)},
    "Acosh": {0: (1.2, 3.0)}, "Tan": {0: (-1.2, 1.2)},
    "ReduceLogSum": {0: _POSITIVE}, "ReduceL2": {0: _POSITIVE}, "ReduceL1": {0: _POSITIVE},
    "ReduceProd": {0: _POSITIVE}, "LpPool": {0: _POSITIVE}, "GlobalLpPool": {0: _POSITIVE},
    "LpNormalization": {0: _POSITIVE}, "Det": {},
}
# Ops whose forward is random: central differences of a random function prove nothing.
RANDOM_OPS = {"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
              "Bernoulli", "Multinomial"}


@dataclass
class BackendCase:
    name: str
    op_type: str
    model: onnx.ModelProto
    inputs: list[np.ndarray]          # values of the graph inputs, in order
    node_inputs: list[str]            # the tested node's input names ("" for an empty optional input)

    @property
    def expanded(self) -> bool:
        return self.name.endswith("_expanded") or "_expanded_" in self.name


@dataclass
class Outcome:
    name: str
    op_type: str
    status: str           # "pass", "fail" or "skip"
    detail: str = ""
    worst: float = 0.0


@lru_cache(maxsize=1)
def all_cases() -> tuple[BackendCase, ...]:
    """Every node test case of the installed onnx, tagged with the op it tests."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        raw = collect_testcases(None)
    by_name = {tc.name: tc for tc in raw}
    out = []
    for tc in raw:
        if not tc.data_sets:
            continue
        base = by_name.get(tc.name.split("_expanded")[0], tc)
        node = base.model.graph.node[0]
        if node.domain not in ("", "ai.onnx"):
            continue
        out.append(BackendCase(tc.name, node.op_type, tc.model, list(tc.data_sets[0][0]), list(node.input)))
    return tuple(out)


def cases_for_rules() -> list[BackendCase]:
    """The cases of ops that have a (non-stop) gradient rule."""
    return [c for c in all_cases() if (r := get_rule(c.op_type)) is not None and not r.stop]


def _runtime_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """Declare opset 26 when every op in the model has the same schema there: onnxruntime 1.31 loads it."""
    version = opset_of(model)
    if version <= RUNTIME_MAX_OPSET:
        return model
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            return model
        now, then = get_schema(node.op_type, version), get_schema(node.op_type, RUNTIME_MAX_OPSET)
        if now is None or then is None or now.since_version != then.since_version:
            return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = RUNTIME_MAX_OPSET
    m.ir_version = min(m.ir_version, helper.find_min_ir_version_for(list(m.opset_import), True))
    return m


def _differentiable_inputs(case: BackendCase, model: onnx.ModelProto) -> list[str]:
    """Float graph inputs that feed positions the op's rule differentiates (expanded cases share the names)."""
    rule = get_rule(case.op_type)
    schema = get_schema(case.op_type, opset_of(model))
    positions = rule.differentiable_inputs(schema, len(case.node_inputs))
    names = {case.node_inputs[i] for i in positions if case.node_inputs[i]}
    return [vi.name for vi in model.graph.input
            if vi.name in names and vi.type.tensor_type.elem_type in FLOAT_TYPES]


def run_case(case: BackendCase, seed: int = 0) -> Outcome:
    """Check one backend case; 'skip' says why a case cannot be checked."""
    import onnxgrad

    rule = get_rule(case.op_type)
    if rule is None or rule.stop:
        return Outcome(case.name, case.op_type, "skip", "no rule")
    if case.op_type in RANDOM_OPS and _is_random(case):
        return Outcome(case.name, case.op_type, "skip", "random forward")
    model = _runtime_opset(load(case.model))       # load upgrades opsets below 13
    control_flow = sorted({n.op_type for n in model.graph.node if has_subgraph(n)})
    if control_flow:
        return Outcome(case.name, case.op_type, "skip", f"control flow ({', '.join(control_flow)}) has no rule")
    wrt = _differentiable_inputs(case, model)
    floats_out = [o.name for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    if not wrt or not floats_out:
        return Outcome(case.name, case.op_type, "skip", "no float input or output to differentiate")
    rng = np.random.default_rng(seed)
    domains = DOMAINS.get(case.op_type, {})
    feeds = {}
    for k, (vi, value) in enumerate(zip(model.graph.input, case.inputs)):
        # some cases store inputs as object arrays: give them the declared type
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        value = np.asarray(value, helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
        if vi.name in wrt:
            low, high = domains.get(k, (-1.5, 1.5))
            value = rng.uniform(low, high, value.shape).astype(value.dtype)
        feeds[vi.name] = value
    forward = Runner(model)(feeds, floats_out)
    if not all(np.isfinite(v).all() for v in forward.values()):
        return Outcome(case.name, case.op_type, "skip", "forward is not finite at the case's inputs")
    try:
        gm = onnxgrad.grad(model, wrt=wrt, of=floats_out, allow_unused=True)
        result = check(model, gm, feeds, rng=seed, max_elements=48, directions=3)
    except onnxgrad.UnsupportedOpError as e:
        return Outcome(case.name, case.op_type, "fail", f"unsupported: {e}")
    except Exception as e:  # a crash in a rule or a runtime is a failure, with its message
        return Outcome(case.name, case.op_type, "fail", f"{type(e).__name__}: {str(e)[:300]}")
    tolerance = max(TOLERANCE.get(feeds[w].dtype.name, TOLERANCE["float32"]) for w in wrt)
    if not result.ok(tolerance):
        return Outcome(case.name, case.op_type, "fail", f"errors {result.errors}", result.worst)
    return Outcome(case.name, case.op_type, "pass", result.backend, result.worst)


def _is_random(case: BackendCase) -> bool:
    if case.op_type != "Dropout":
        return True
    # Dropout is random only in training mode.
    feeds = {vi.name: v for vi, v in zip(case.model.graph.input, case.inputs)}
    mode = case.node_inputs[2] if len(case.node_inputs) > 2 else ""
    return bool(mode) and bool(np.asarray(feeds.get(mode, False)).any())
