"""The checker must be able to fail: wrong rules are caught."""
from contextlib import ExitStack

import pytest

import onnxgrad.registry as registry
from harness import Case, randn, run_case


@pytest.fixture
def wrong_rule():
    """Replace an op's rule for one test (registry.override)."""
    with ExitStack() as stack:
        yield lambda op, fn, **kw: stack.enter_context(registry.override(op, fn, **kw))


def test_catches_swapped_operands(wrong_rule):
    wrong_rule("Mul", lambda n: (n.dy * n.inputs[0], n.dy * n.inputs[1]), broadcast=True)
    with pytest.raises(AssertionError, match="gradient errors"):
        run_case(Case("Mul", [randn(3, 4), randn(3, 4)]))


def test_catches_missing_factor(wrong_rule):
    wrong_rule("Tanh", lambda n: (n.dy * (1.0 - n.outputs[0]),))
    with pytest.raises(AssertionError, match="gradient errors"):
        run_case(Case("Tanh", [randn(3, 4)]))


def test_catches_wrong_sign_in_one_element(wrong_rule):
    # a gradient wrong in a single element out of 12 still fails
    def relu_off_by_one(n):
        y = n.outputs[0]
        mask = n.op.Greater(y, n.b.scalar(0.0, y))
        g = n.op.Where(mask, n.dy, n.b.scalar(0.0, y))
        import numpy as np
        e = np.zeros((3, 4), np.float32)
        e[1, 2] = 1.0
        return (g + n.b.const(e),)

    wrong_rule("Relu", relu_off_by_one)
    with pytest.raises(AssertionError, match="gradient errors"):
        run_case(Case("Relu", [randn(3, 4)]))


def test_correct_rule_passes():
    r = run_case(Case("Mul", [randn(3, 4), randn(3, 4)]))
    assert r.worst < 1e-6 and set(r.errors) == {"x0", "x1"}
    assert r.numeric["x0"].shape == (3, 4)
