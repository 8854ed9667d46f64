"""Every forward-mode rule on the reverse rules' case tables and on onnx's backend node cases (issue #14).

(a) Every ``Case`` in a module-level table of ``tests/test_rules_*.py`` (``CASES``, ``MATMUL``, ``PAD``,
    ...) becomes its one-node model (``harness.case_model``); ``jvp`` builds its tangent graph, which
    must pass onnx's full check, and the tangents, computed in float64 (``check.run_float64``), must
    match float64 central differences of the forward along a random direction (``check_jvp``) to the
    case's ``tol64``. Each op goes through its native tangent rule or the fallback (the transpose of
    its reverse rule), whichever the pass picks. A few tables need the treatment their reverse tests
    give them (see ``_special``): declared shapes, a numpy truth where no runtime computes the float64
    forward, a Jacobian against the forward for ops linear in x that no runtime runs in float64.
(b) Every case of ``backend_cases`` (tests/backend_cases.py) whose op has a tangent (native or fallback), prepared as
    ``backend_cases.run_case`` prepares it (integer inputs as constants, floats from a smooth domain),
    checked the same way. Cases that cannot be checked are skipped with the reason.
"""
from __future__ import annotations

import importlib
import pathlib

import backend_cases as BC
import numpy as np
import onnx
import pytest
from onnx.reference.op_run import OpRun

import harness
from harness import Case, case_model
from onnxgrad.errors import UnsupportedOpError
from onnxgrad.passes.forward import jvp
from onnxgrad.rules.registry import get_rule
from onnxgrad.rules.tangents import get_tangent_rule
from onnxgrad.tools import check as C
from onnxgrad.tools.check.jvp import check_jvp

_TESTS = pathlib.Path(__file__).parent


# -- float64 runs ---------------------------------------------------------------------------------
class GatherElements(OpRun):
    """onnx.reference's GatherElements uses np.choose, which refuses more than 64 entries along the axis."""

    op_domain = ""

    def _run(self, data, indices, axis=0):
        indices = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, indices, axis=axis),)


class _Runner(C.Runner):
    def _use_reference(self, reason: str) -> None:
        from onnx.reference import ReferenceEvaluator

        self._sess = ReferenceEvaluator(self.model, new_ops=[*C._corrected_kernels(), GatherElements])
        self.backend, self.reason = "reference", reason


def run_float64(model: onnx.ModelProto, feeds, reference: str = "") -> dict:
    """check.run_float64, with a GatherElements that onnx.reference runs at any size (MaxRoiPool's tangent);
    ``reference``: the declared reason to run in onnx.reference."""
    declared = {"runtime": "reference", "reason": reference} if reference else {}
    return _Runner(C.to_float64(model), **declared)(C.as_float64(feeds))


def full_check(model: onnx.ModelProto, jm: onnx.ModelProto) -> None:
    """onnx's full check of the JVP model, where the forward model passes it (onnx 1.23's checker calls
    GroupNormalization-18 deprecated, and trips on MeanVarianceNormalization's own function body)."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        return
    onnx.checker.check_model(jm, full_check=True)


def _ok(errors: dict, tol: float) -> bool:
    return bool(errors) and all(np.isfinite(e) and e <= tol for e in errors.values())


def check_tangents(model: onnx.ModelProto, feeds: dict, wrt: list[str], of: list[str] | None, tol: float,
                   seed: int = 7, reference: str = "") -> dict:
    """``reference``: why these models run in onnx.reference (a case's declaration), if they do."""
    jm = jvp(model, wrt, of=of, allow_unused=True)
    full_check(model, jm)
    errors, _ = check_jvp(model, jm, feeds, rng=seed, reference=reference,
                          run=lambda m, f: run_float64(m, f, reference))
    assert _ok(errors, tol), f"float64 tangent errors {errors} (tolerance {tol:g})"
    return errors


# -- (a) the reverse rules' case tables -----------------------------------------------------------
def _tables() -> list[tuple[str, str, Case, object]]:
    """(module, table, case, the table's second element or None) for every Case in a module-level list."""
    out = []
    for path in sorted(_TESTS.glob("test_rules_*.py")):
        module = importlib.import_module(path.stem)
        seen: set[int] = set()
        for table, value in vars(module).items():
            if not isinstance(value, list):
                continue
            for item in value:
                extra = None
                if isinstance(item, tuple) and item and isinstance(item[0], Case):
                    item, extra = item[0], (item[1] if len(item) > 1 else None)
                if isinstance(item, Case) and id(item) not in seen:
                    seen.add(id(item))
                    out.append((path.stem, table, item, extra))
    return out


TABLE_CASES = _tables()


def _table_id(entry) -> str:
    module, table, case, _ = entry
    return f"{module.removeprefix('test_rules_')}.{table}.{case}"


def _declared(case: Case, shapes: dict):
    """test_rules_linalg.DECLARED: inputs and outputs declared with these shapes (as its run_declared)."""
    model, feeds, wrt = case_model(case)
    for vi in list(model.graph.input) + list(model.graph.output):
        if vi.name in shapes:
            tt = vi.type.tensor_type
            tt.ClearField("shape")
            tt.shape.SetInParent()
            for d in shapes[vi.name]:
                dim = tt.shape.dim.add()
                if d is not None:
                    dim.dim_value = d
    return model, feeds, wrt


def _against_numpy(case: Case, f) -> None:
    """test_rules_activations.NUMPY_CASES: no runtime computes these forwards in float64 (onnxruntime's
    double Shrink rounds to float32, Gelu's Erf is float32 in onnx.reference): the truth is f in numpy."""
    model, feeds, wrt = case_model(case)
    jm = jvp(model, wrt)
    onnx.checker.check_model(jm, full_check=True)
    x = feeds["x0"].astype(np.float64)
    v = np.random.default_rng(7).standard_normal(x.shape)
    h = 1e-6
    numeric = (f(x + h * v) - f(x - h * v)) / (2 * h)
    got = run_float64(jm, {"x0": x, "x0_tangent": v})["y0_tangent"]
    err = np.abs(got - numeric).max() / max(np.abs(numeric).max(), C.ABS_FLOOR)
    assert err <= case.tol64, f"float64 tangent error {err} against numpy"


def _linear_in_x(case: Case, forward: str) -> None:
    """test_rules_sampling.JACOBIAN: GridSample with a constant grid is linear in X, so J v = f(v); these
    forwards run in one runtime only, in float32 (opset-16 mode names, cubic border out of bounds)."""
    model, feeds, wrt = case_model(case)
    assert wrt == ["x0"]
    jm = jvp(model, wrt)
    onnx.checker.check_model(jm, full_check=True)
    v = np.random.default_rng(7).standard_normal(feeds["x0"].shape).astype(np.float32)
    declared = {"runtime": "onnxruntime"} if forward == "onnxruntime" else {
        "runtime": "reference", "reason": "the spec's semantics: onnx.reference's forward"}
    want = C.Runner(model, **declared)({**feeds, "x0": v})["y0"]
    got = C.Runner(jm)({**feeds, "x0_tangent": v})["y0_tangent"]
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def _special(module: str, table: str, case: Case, extra) -> bool:
    """Tables whose reverse tests check them another way; True when handled here."""
    if (module, table) == ("test_rules_activations", "NUMPY_CASES"):
        _against_numpy(case, extra)
    elif (module, table) == ("test_rules_sampling", "JACOBIAN"):
        _linear_in_x(case, extra)
    elif (module, table) == ("test_rules_linalg", "DECLARED"):
        model, feeds, wrt = _declared(case, extra)
        check_tangents(model, feeds, wrt, ["y0"], case.tol64)
    elif (module, table) == ("test_rules_shape", "PARTLY_KNOWN"):
        model, feeds, wrt = importlib.import_module(module)._symbolic(case, extra)
        check_tangents(model, feeds, wrt, harness.float_outputs(model), case.tol64)
    elif (module, table) == ("test_rules_normalization", "TRAINING"):
        # the running statistics carry no tangent (nor gradient), in onnxgrad as in PyTorch: Y only
        model, feeds, wrt = case_model(case)
        check_tangents(model, feeds, wrt, ["y0"], case.tol64)
    elif (module, table, str(case)) == ("test_rules_nn", "CASES", "Col2Im-block-shape-at-run-time"):
        # known limit: the tangent transposes the reverse rule, whose Conv then has a kernel made at run time,
        # and Conv's rule needs the kernel's spatial shape: declined, saying so (the reverse rule is checked)
        model, feeds, wrt = case_model(case)
        with pytest.raises(UnsupportedOpError, match="kernel's spatial shape is unknown"):
            jvp(model, wrt=wrt, of=["y0"])
    else:
        return False
    return True


@pytest.mark.parametrize("entry", TABLE_CASES, ids=_table_id)
def test_rule_table_case(entry, monkeypatch):
    module, table, case, extra = entry
    if case.opset < 14 and case.op == "BatchNormalization" and case.outputs > 3:
        # as test_rules_normalization: onnx.reference cannot type BatchNormalization-9's training outputs
        monkeypatch.setattr(harness, "Runner", lambda model, prefer=None: C.Runner(model))
    if _special(module, table, case, extra):
        return
    model, feeds, wrt = case_model(case)
    check_tangents(model, feeds, wrt, None, case.tol64, reference=case.reference)


def test_tables_cover_every_op_of_every_table():
    ops = {case.op for _, _, case, _ in TABLE_CASES}
    assert len(TABLE_CASES) > 800 and len(ops) > 100
    with_tangent = {op for op in ops if get_tangent_rule(op) is not None or get_rule(op) is not None}
    assert with_tangent == ops, f"ops in the tables with no tangent at all: {sorted(ops - with_tangent)}"


# -- (b) onnx's backend node cases ---------------------------------------------------------------
def _has_tangent(op: str) -> bool:
    rule = get_rule(op)
    return get_tangent_rule(op) is not None or (rule is not None and not rule.stop)


# The true tangent is NaN here, as in PyTorch: no rule can do better.
NAN_TANGENT = {
    "test_reduce_l2_empty_set_expanded": "Sqrt(ReduceSumSquare(x)) over an empty set: d sqrt(s) = ds / (2 sqrt(s)) "
                                         "at s = 0 is 0 / 0 (the unexpanded ReduceL2 rule gives 0, as torch.norm)",
}

BACKEND = [c for c in BC.all_cases() if _has_tangent(c.op_type)]


# Cases with more float input elements than this are left out where the op has a smaller case.
LARGE = 50_000


def _input_size(case: BC.BackendCase) -> int:
    return sum(int(np.size(v)) for v in case.inputs if getattr(v, "dtype", None) is not None and v.dtype.kind == "f")


_SMALL_CASE_OPS = {c.op_type for c in BACKEND if _input_size(c) <= LARGE}


def backend_outcome(case: BC.BackendCase, seed: int = 0) -> tuple[str, str]:
    """("pass" | "skip" | "declined" | "fail", detail), the case prepared as backend_cases.run_case does."""
    if case.op_type in BC.RANDOM_OPS and BC._is_random(case):
        return "skip", "random forward"
    model = BC._runtime_opset(BC.load(case.model))
    control_flow = sorted({n.op_type for n in model.graph.node if BC.has_subgraph(n)})
    if control_flow:
        return "skip", f"control flow ({', '.join(control_flow)}) has no rule"
    wrt = BC._differentiable_inputs(case, model)
    of = BC._differentiable_outputs(case, model)
    if not wrt or not of:
        return "skip", "no float input or output to differentiate"
    feeds = BC._inputs(case, model, wrt, np.random.default_rng(seed))
    size = _input_size(case)
    if size > LARGE and case.op_type in _SMALL_CASE_OPS:
        return "skip", (f"{size} float input elements: its float64 forward and tangents run in onnx.reference for "
                        f"seconds; smaller {case.op_type} cases are checked (time bound)")
    model = BC._integers_as_constants(model, feeds)
    constants = {i.name for i in model.graph.initializer}
    feeds = {k: v for k, v in feeds.items() if k not in constants}
    reference = ""              # why this case runs in onnx.reference (its forward refused by onnxruntime)
    try:
        forward = C.Runner(model)(feeds, of)
    except C.RuntimeRefusedError as e:
        reference = f"onnxruntime cannot run the forward model: {e.detail[:200]}"
        forward = C.Runner(model, runtime="reference", reason=reference)(feeds, of)
    if not all(np.isfinite(np.asarray(v, np.float64)).all() for v in forward.values()):
        return "skip", "forward is not finite at the case's inputs"
    declared = {o.name: [d.dim_value if d.HasField("dim_value") else None for d in o.type.tensor_type.shape.dim]
                for o in model.graph.output if o.type.tensor_type.HasField("shape")}
    for name, value in forward.items():
        dims = declared.get(name)
        if dims is not None and (len(dims) != np.ndim(value) or any(
                d is not None and d != n for d, n in zip(dims, np.shape(value)))):
            return "skip", (f"the redrawn inputs give '{name}' the shape {np.shape(value)}, not its declared "
                            f"{dims}: the model does not hold there")
    disagreement = "" if reference else BC._runtimes_disagree(model, feeds, forward)
    if disagreement:
        return "skip", disagreement
    precisions = {feeds[w].dtype.name for w in wrt} | {BC._np_name(o) for o in model.graph.output if o.name in of}
    # float64 tangents of a graph whose constants are rounded to the case's precision
    tolerance = max([BC.TOLERANCE[p] for p in precisions & {"float16", "bfloat16"}] + [BC.TOLERANCE["float64"]])
    try:
        jm = jvp(model, wrt, of=of, allow_unused=True)
        full_check(model, jm)
        errors, _ = check_jvp(model, jm, feeds, rng=seed, reference=reference,
                              run=lambda m, f: run_float64(m, f, reference))
    except UnsupportedOpError as e:
        if set(e.ops) == {case.op_type} and case.op_type in e.reasons:
            return "declined", e.reasons[case.op_type]
        return "fail", f"unsupported: {e}"
    except Exception as e:  # a crash in a rule or a runtime is a failure, with its message
        return "fail", f"{type(e).__name__}: {str(e)[:300]}"
    if any(np.isnan(e) for e in errors.values()) and BC._nan_inside(model, feeds):
        return "skip", BC.NAN_INSIDE
    if any(np.isnan(e) for e in errors.values()) and case.name in NAN_TANGENT:
        return "skip", NAN_TANGENT[case.name]
    if not _ok(errors, tolerance):
        return "fail", f"float64 tangent errors {errors} (tolerance {tolerance:g})"
    return "pass", ""


@pytest.mark.parametrize("case", BACKEND, ids=lambda c: c.name)
def test_backend_case(case):
    status, detail = backend_outcome(case)
    if status == "skip":
        pytest.skip(detail)
    if status == "declined":
        pytest.xfail(f"the {case.op_type} rule declines this configuration: {detail}")
    assert status == "pass", f"{case.name} ({case.op_type}): {detail}"


def test_backend_suite_is_not_empty():
    assert len(BACKEND) > 100 and {"Add", "MatMul", "Relu", "LSTM", "Resize"} <= {c.op_type for c in BACKEND}
