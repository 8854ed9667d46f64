"""onnx's own backend node test cases, checked numerically for every op with a rule (issue: every op, proven).

Each case keeps onnx's model and integer inputs, draws float inputs from a
domain where the op is smooth, and compares the gradient graph (onnxruntime,
float32) with float64 central differences (see tests/backend_cases.py).
The cases with integer inputs run twice: those inputs as constants (as exporters write
them), then fed at run time with fresh float inputs (the rules see no value: shapes,
sizes and axes computed in the graph).
"""
import pytest
from backend_cases import cases_for_rules, cases_with_integer_inputs, run_case

CASES = cases_for_rules()
FED = cases_with_integer_inputs()


def _judge(case, outcome):
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    if outcome.status == "declined":
        pytest.xfail(f"the {case.op_type} rule declines this configuration: {outcome.detail}")
    assert outcome.status == "pass", f"{case.name} ({case.op_type}): {outcome.detail}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backend_case(case):
    _judge(case, run_case(case))


@pytest.mark.parametrize("case", FED, ids=lambda c: c.name)
def test_backend_case_integers_fed(case):
    _judge(case, run_case(case, seed=1, integers_fed=True))


def test_suite_is_not_empty():
    ops = {c.op_type for c in CASES}
    assert len(CASES) > 100 and {"Add", "MatMul", "Relu"} <= ops
    assert {"AffineGrid", "Resize", "MaxUnpool"} <= {c.op_type for c in FED}
