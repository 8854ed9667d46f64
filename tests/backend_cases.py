"""onnx's own backend node test cases as gradient checks.

``onnx.backend.test.case.node.collect_testcases()`` generates one small model
per case (the data is not shipped as files). For each case whose op has a
rule we keep the model and its integer inputs (indices, shapes, axes), draw
random float inputs at the case's shapes from a domain that suits the op
(positive for Log, (-1, 1) for Asin, ...), and run the numeric checker on the
gradients of every float output with respect to every differentiable float
input. ``_expanded`` variants (the op written as its function body) are
checked the same way, which exercises the rules of the ops in that body.

Every model runs in onnxruntime, with one declared exception besides the element-type ones
:class:`onnxgrad.tools.check.Runner` declares itself: a case whose forward model onnxruntime cannot run (an op
it has no kernel for at the case's opset, an attribute its kernel rejects) runs in onnx.reference, and
its outcome says so. A gradient graph onnxruntime refuses while it runs the forward is a failure.

Test support: the test suite and ``python -m onnxgrad ops --cases`` (from a source checkout) use it;
the installed package does not ship it.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.ir.load import RUNTIME_MAX_OPSET, load
from onnxgrad.ir.model import FLOAT_TYPES, has_subgraph, opset_of
from onnxgrad.passes.reach import differentiable_positions, rule_of
from onnxgrad.rules.registry import NON_DIFFERENTIABLE, get_rule, get_schema
from onnxgrad.tools.check import (
    Runner,
    RuntimeRefusedError,
    as_float64,
    check,
    gradient_spec,
    is_float_array,
    run_float64,
    to_float64,
)

# Worst relative error accepted, by the precision the gradient graph computes in.
TOLERANCE = {"float64": 1e-5, "float32": 2e-3, "float16": 1e-2, "bfloat16": 5e-2}
# A float16/bfloat16 gradient graph run in its own precision, against the same graph run in float64: each op
# rounds its result to half an ulp (eps / 2 relative), so a few ops in a row stay within a few eps of the
# gradient's largest magnitude. 4 eps: the worst of every low-precision backend case at three seeds is 0.9 eps
# (float16, Attention's expanded body) and 2.2 eps (bfloat16, Attention with a causal mask).
NATIVE_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
NATIVE_ULPS = 4

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
    # near the cases' own (1, 5, 2): the same element count, which the models declare
    "Range": {0: (1.02, 1.1), 2: (2.02, 2.1)},
}
# Ops whose forward is random: central differences of a random function prove nothing.
NAN_INSIDE = ("the forward computes NaN inside and masks it later: reverse mode propagates it (0 * NaN), "
              "as PyTorch's autograd does")
# Low-precision cases whose gradient can be truly beyond the type's range at some inputs ("overflow" outcomes:
# the float64 gradient is finite and larger than the type's largest, the graph's other elements right), with
# the evidence that PyTorch's autograd gives inf there too.
_LINEAR_ATTENTION_FP16 = (
    "beta's gradient is sum over a token's state update of k (v - S^T k) . dS: S and dS grow by exp(decay) per "
    "step, and at inputs uniform in (-2, 2) (seed 276) it reaches 86453 in float64, beyond float16's 65504. "
    "PyTorch 2.13's float16 autograd of the same recurrence gives inf at those elements, computed in float16 "
    "throughout and with float32 inside as the ONNX function body does (its gradient is cast back to float16): "
    "test_linear_attention_fp16_gradient_beyond_float16 checks both. Where the float64 value is within range "
    "(54172 at seed 298) the float16 gradient is finite and within 4 eps of it")
EXPECTED_OVERFLOW = {"test_linear_attention_fp16": _LINEAR_ATTENTION_FP16,
                     "test_linear_attention_fp16_expanded": _LINEAR_ATTENTION_FP16}
RANDOM_OPS = {"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
              "Bernoulli", "Multinomial"}


@dataclass
class BackendCase:
    name: str
    op_type: str
    model: onnx.ModelProto
    inputs: list[np.ndarray]          # values of the graph inputs, in order
    node_inputs: list[str]            # the tested node's input names ("" for an empty optional input)
    node_outputs: list[str]

    @property
    def expanded(self) -> bool:
        return self.name.endswith("_expanded") or "_expanded_" in self.name


@dataclass
class Outcome:
    name: str
    op_type: str
    status: str           # "pass", "fail", "skip" (not checkable), "declined" (the rule refuses, saying why) or
    #                       "overflow" (a low-precision gradient whose true value that precision cannot hold)
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
        out.append(BackendCase(tc.name, node.op_type, tc.model, list(tc.data_sets[0][0]), list(node.input),
                               list(node.output)))
    return tuple(out)


# Deprecated ops onnxgrad.ir.load.load upgrades (onnx's version converter) to ops with a rule.
UPGRADED = {"Scatter": "ScatterElements", "Upsample": "Resize"}


def _rule(op_type: str):
    """The rule that differentiates ``op_type`` once the model is loaded (its upgrade's, if deprecated)."""
    return get_rule(UPGRADED.get(op_type, op_type))


def cases_for_rules() -> list[BackendCase]:
    """The cases of ops that have a (non-stop) gradient rule, deprecated ops upgraded to one included."""
    return [c for c in all_cases() if (r := _rule(c.op_type)) is not None and not r.stop]


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
    node = helper.make_node(UPGRADED.get(case.op_type, case.op_type), list(case.node_inputs), [])
    positions = differentiable_positions(node, opset_of(model), rule_of(node, opset_of(model)))
    names = {case.node_inputs[i] for i in positions if case.node_inputs[i]}
    return [vi.name for vi in model.graph.input
            if vi.name in names and vi.type.tensor_type.elem_type in FLOAT_TYPES]


def cases_with_integer_inputs() -> list[BackendCase]:
    """The cases of :func:`cases_for_rules` with an integer or boolean graph input (shapes, axes, indices)."""
    integral = {TensorProto.BOOL, TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
                TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}
    return [c for c in cases_for_rules()
            if any(vi.type.tensor_type.elem_type in integral for vi in c.model.graph.input)]


def run_case(case: BackendCase, seed: int = 0, integers_fed: bool = False) -> Outcome:
    """Check one backend case; 'skip' says why a case cannot be checked.

    Integer inputs (shapes, axes, indices) become constants, as exporters write them; with
    ``integers_fed`` they stay graph inputs, fed the case's values at run time (the rules see no value).
    Gradients computed in float16/bfloat16 are checked through the same gradient graph
    in float64 (the rules' math, tightly), after a run in the case's own precision that must
    stay within NATIVE_ULPS eps of that float64 run.
    """
    rule = _rule(case.op_type)
    if rule is None or rule.stop:
        return Outcome(case.name, case.op_type, "skip", "no rule")
    if case.op_type in RANDOM_OPS and _is_random(case):
        return Outcome(case.name, case.op_type, "skip", "random forward")
    model = _runtime_opset(load(case.model))       # load upgrades opsets below 13
    control_flow = sorted({n.op_type for n in model.graph.node
                           if has_subgraph(n) and not getattr(get_rule(n.op_type), "subgraphs", False)})
    if control_flow:
        return Outcome(case.name, case.op_type, "skip", f"control flow ({', '.join(control_flow)}) has no rule")
    wrt = _differentiable_inputs(case, model)
    of = _differentiable_outputs(case, model)
    if not wrt or not of:
        return Outcome(case.name, case.op_type, "skip", "no float input or output to differentiate")
    feeds = _inputs(case, model, wrt, np.random.default_rng(seed))
    if not integers_fed:
        model = _integers_as_constants(model, feeds)
    constants = {i.name for i in model.graph.initializer}
    feeds = {k: v for k, v in feeds.items() if k not in constants}
    reference = ""              # why this case runs in onnx.reference, if it does
    try:
        forward = Runner(model)(feeds, of)
    except RuntimeRefusedError as e:
        reference = f"onnxruntime cannot run the forward model: {e.detail[:200]}"
        forward = Runner(model, runtime="reference", reason=reference)(feeds, of)
    if not all(np.isfinite(np.asarray(v, np.float64)).all() for v in forward.values()):
        return Outcome(case.name, case.op_type, "skip", "forward is not finite at the case's inputs")
    disagreement = "" if reference else _runtimes_disagree(model, feeds, forward)
    if disagreement:
        return Outcome(case.name, case.op_type, "skip", disagreement)
    low_precision = {feeds[w].dtype.name for w in wrt} | {_np_name(o) for o in model.graph.output if o.name in of}
    low_precision &= {"float16", "bfloat16"}
    try:
        gm = onnxgrad.grad(model, wrt=wrt, of=of, allow_unused=True)
        declared = {"runtime": "reference", "reason": reference} if reference else {}
        if low_precision:
            seeded = {**feeds, **_seeds(gm, forward, np.random.default_rng(seed))}
            native = Runner(gm, **declared)(seeded)
            exact = Runner(to_float64(gm), **declared)(as_float64(seeded))
            if not all(np.isfinite(np.asarray(v, np.float64)).all() for v in native.values()):
                if _nan_inside(model, feeds):
                    return Outcome(case.name, case.op_type, "skip", NAN_INSIDE)
                overflow = _beyond_range(gm, native, exact)
                if not overflow:
                    return Outcome(case.name, case.op_type, "fail", f"non-finite gradient in {sorted(low_precision)}")
                result = check(model, gm, feeds, rng=seed, max_elements=48, directions=3, analytic_run=run_float64,
                               reference=reference)
                if not result.ok(max(TOLERANCE[p] for p in low_precision)):
                    return Outcome(case.name, case.op_type, "fail", f"errors {result.errors}", result.worst)
                return Outcome(case.name, case.op_type, "overflow", overflow, result.worst)
            eps = max(NATIVE_EPS[p] for p in low_precision)
            off = _native_error(gm, native, exact)
            if off > NATIVE_ULPS * eps:
                return Outcome(case.name, case.op_type, "fail", f"the {sorted(low_precision)} run of the gradient "
                               f"graph is {off / eps:.1f} eps off its float64 run (at most {NATIVE_ULPS})", off)
            result = check(model, gm, feeds, rng=seed, max_elements=48, directions=3, analytic_run=run_float64,
                           reference=reference)
        else:
            result = check(model, gm, feeds, rng=seed, max_elements=48, directions=3, reference=reference)
    except onnxgrad.UnsupportedOpError as e:
        inner = {n.op_type for n in model.graph.node if has_subgraph(n)} if case.expanded else set()
        if set(e.ops) <= {case.op_type} | inner and set(e.ops) <= set(e.reasons):
            # an op's own rule declines this configuration, and says why (for an _expanded case, the rule
            # of the control flow its function body uses)
            return Outcome(case.name, case.op_type, "declined", "; ".join(e.reasons.values()))
        return Outcome(case.name, case.op_type, "fail", f"unsupported: {e}")
    except Exception as e:  # a crash in a rule or a runtime is a failure, with its message
        return Outcome(case.name, case.op_type, "fail", f"{type(e).__name__}: {str(e)[:300]}")
    if any(np.isnan(a).any() for a in result.analytic.values()) and _nan_inside(model, feeds):
        return Outcome(case.name, case.op_type, "skip", NAN_INSIDE)
    # in float64, a low-precision graph still carries its constants rounded to that precision
    precisions = low_precision or {feeds[w].dtype.name for w in wrt}
    tolerance = max(TOLERANCE.get(p, TOLERANCE["float32"]) for p in precisions)
    if not result.ok(tolerance):
        return Outcome(case.name, case.op_type, "fail", f"errors {result.errors}", result.worst)
    return Outcome(case.name, case.op_type, "pass", runtimes(result), result.worst)


def runtimes(result) -> str:
    """Which runtime ran the gradient graph and the float64 forward, with the declared reasons."""
    def one(backend: str, reason: str) -> str:
        return f"{backend} ({reason})" if reason else backend

    return (f"gradients: {one(result.grad_backend, result.grad_reason)}; "
            f"float64 forward: {one(result.backend, result.reason)}")


def _runtimes_disagree(model: onnx.ModelProto, feeds: dict, forward: dict) -> str:
    """Why central differences cannot judge this case, if onnxruntime and onnx.reference compute different
    forwards here and the float64 truth would come from onnx.reference (no float64 kernel in onnxruntime)."""
    truth = Runner(to_float64(model))
    if truth.backend != "reference":
        return ""
    reference = Runner(model, runtime="reference", reason="the forward compared with onnxruntime's")(
        feeds, list(forward))
    for name, value in forward.items():
        a, b = np.asarray(value, np.float64), np.asarray(reference[name], np.float64)
        if a.shape != b.shape or np.max(np.abs(a - b), initial=0.0) > 1e-2 * (1 + np.max(np.abs(a), initial=0.0)):
            diff = np.max(np.abs(a - b)) if a.shape == b.shape else f"shapes {a.shape} and {b.shape}"
            return (f"onnxruntime and onnx.reference disagree on this forward (output '{name}', max difference "
                    f"{diff}); the rule follows onnxruntime and the float64 truth would come from onnx.reference")
    return ""


def _differentiable_outputs(case: BackendCase, model: onnx.ModelProto) -> list[str]:
    """Float outputs, except those the op's schema tags NonDifferentiable (BatchNorm's running stats)."""
    schema = get_schema(case.op_type, opset_of(model))
    params = list(schema.outputs) if schema is not None else []
    stopped = {name for k, name in enumerate(case.node_outputs)
               if params and params[min(k, len(params) - 1)].differentiation_category == NON_DIFFERENTIABLE}
    return [o.name for o in model.graph.output
            if o.type.tensor_type.elem_type in FLOAT_TYPES and o.name not in stopped]


def _inputs(case: BackendCase, model: onnx.ModelProto, wrt: list[str], rng) -> dict[str, np.ndarray]:
    """The case's inputs, floats to differentiate redrawn from the op's smooth domain."""
    domains = DOMAINS.get(case.op_type, {})
    positions = {name: k for k, name in enumerate(case.node_inputs) if name}
    feeds = {}
    for vi, value in zip(model.graph.input, case.inputs):
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        # some cases store inputs as object arrays: give them the declared type
        value = np.asarray(value, helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
        if vi.name in wrt:
            low, high = domains.get(positions.get(vi.name, -1), (-1.5, 1.5))
            value = rng.uniform(low, high, value.shape).astype(value.dtype)
        feeds[vi.name] = value
    return feeds


def _integers_as_constants(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = []
    for vi in m.graph.input:
        value = feeds.get(vi.name)
        if value is not None and value.dtype.kind in "iub":
            m.graph.initializer.append(numpy_helper.from_array(value, vi.name))
        else:
            keep.append(vi)
    del m.graph.input[:]
    m.graph.input.extend(keep)
    return m


def _np_name(vi: onnx.ValueInfoProto) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)).name


def _seeds(gm: onnx.ModelProto, forward: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random seeds (ones could cancel: Softmax's gradient of a seed of ones is zero)."""
    return {seed: rng.uniform(-1.0, 1.0, np.shape(forward[o])).astype(np.asarray(forward[o]).dtype)
            for o, seed in gradient_spec(gm)["seeds"].items()}


def _native_error(gm: onnx.ModelProto, native: dict[str, np.ndarray], exact: dict[str, np.ndarray]) -> float:
    """The worst gradient's distance from its float64 value, relative to that gradient's largest magnitude."""
    worst = 0.0
    for g in gradient_spec(gm)["gradients"].values():
        a, b = np.asarray(native[g], np.float64), np.asarray(exact[g], np.float64)
        scale = np.max(np.abs(b), initial=0.0)
        diff = np.max(np.abs(a - b), initial=0.0)
        worst = max(worst, diff / scale if scale else (np.inf if diff else 0.0))
    return float(worst)


def _beyond_range(gm: onnx.ModelProto, native: dict[str, np.ndarray], exact: dict[str, np.ndarray]) -> str:
    """Why the low-precision gradients are not finite, when the only reason is that their true values are not
    representable there: every non-finite element is one whose float64 value is finite and beyond the type's
    largest (float16: 65504), the rest within NATIVE_ULPS eps of it. '' when any other element is off (a
    gradient graph that overflows on the way to a representable value is a failure)."""
    found = []
    for w, g in gradient_spec(gm)["gradients"].items():
        a, b = np.asarray(native[g]), np.asarray(exact[g], np.float64)
        info = np.finfo(a.dtype) if a.dtype.kind == "f" and a.dtype.itemsize < 4 else None
        bad = ~np.isfinite(a.astype(np.float64))
        if not bad.any():
            continue
        if info is None or not np.isfinite(b).all():
            return ""
        eps = 2.0 ** -(info.nmant)
        if not (np.abs(b[bad]) > float(info.max) * (1 - NATIVE_ULPS * eps)).all():
            return ""
        if np.sign(a[bad].astype(np.float64)).tolist() != np.sign(b[bad]).tolist():
            return ""
        good = a.astype(np.float64)[~bad]
        scale = np.max(np.abs(b), initial=0.0)
        if good.size and np.max(np.abs(good - b[~bad])) > NATIVE_ULPS * eps * scale:
            return ""
        found.append(f"{w}: {int(bad.sum())} of {a.size} elements beyond {a.dtype.name}'s {float(info.max):g} "
                     f"(float64 up to {np.max(np.abs(b[bad])):.6g})")
    return "; ".join(found)


def _nan_inside(model: onnx.ModelProto, feeds: dict) -> bool:
    """Whether some intermediate tensor of the forward is NaN at these inputs."""
    names = [o for node in model.graph.node for o in node.output if o]
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    m.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in names)
    values = Runner(m, runtime="reference", reason="every intermediate tensor of the forward")(feeds)
    return any(is_float_array(v) and np.isnan(np.asarray(v, np.float64)).any() for v in values.values())


def _is_random(case: BackendCase) -> bool:
    if case.op_type != "Dropout":
        return True
    # Dropout is random only in training mode.
    feeds = {vi.name: v for vi, v in zip(case.model.graph.input, case.inputs)}
    mode = case.node_inputs[2] if len(case.node_inputs) > 2 else ""
    return bool(mode) and bool(np.asarray(feeds.get(mode, False)).any())
