"""onnx's own backend node test cases, checked numerically for every op with a rule (issue: every op, proven).

Each case keeps onnx's model and integer inputs, draws float inputs from a
domain where the op is smooth, and compares the gradient graph (onnxruntime,
float32) with float64 central differences (see tests/backend_cases.py).
"""
import pytest
from backend_cases import cases_for_rules, run_case

CASES = cases_for_rules()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backend_case(case):
    outcome = run_case(case)
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    if outcome.status == "declined":
        pytest.xfail(f"the {case.op_type} rule declines this configuration: {outcome.detail}")
    assert outcome.status == "pass", f"{case.name} ({case.op_type}): {outcome.detail}"


def test_suite_is_not_empty():
    ops = {c.op_type for c in CASES}
    assert len(CASES) > 100 and {"Add", "MatMul", "Relu"} <= ops
