import pytest

from harness import Case, randn, run_case

CASES = [
    Case("Add", [randn(3, 4), randn(3, 4)], id="same"),
    Case("Add", [randn(2, 3, 4), randn(4)], id="bcast-trailing"),
    Case("Sub", [randn(3, 1), randn(1, 4)], id="bcast-both"),
    Case("Mul", [randn(2, 3, 4), randn(3, 1)], id="bcast-mid"),
    Case("Div", [randn(2, 3), randn(3, low=0.5, high=2)], id="bcast"),
    Case("Mul", [randn(2, 3, 4), randn(3, 1)], unknown_shapes=True, id="dynamic"),
    Case("Tanh", [randn(3, 4)]),
    Case("Relu", [randn(3, 4)]),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rule(case):
    run_case(case)
