"""The checker must be able to fail: wrong rules are caught."""
import pathlib
import subprocess
import sys
from contextlib import ExitStack

import numpy as np
import pytest

import harness
import onnxgrad
import onnxgrad.rules.registry as registry
from harness import Case, case_model, randn, run_case
from onnxgrad.tools.check import Runner, RuntimeRefusedError, to_float64


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


# -- an honest harness: which runtime ran what, and no silent switch --------------------------------------
def _through_1d_resize(n):
    """dX = -dY, right in value, but through a 1-D linear Resize (scale 1): onnx.reference runs it, onnxruntime
    refuses it. A rule that emits what onnxruntime cannot run must fail, however right its math."""
    dy = n.op.Resize(n.dy, None, n.b.const(np.array([1.0], np.float32)), mode="linear")
    return (-dy,)


def test_a_gradient_graph_onnxruntime_refuses_fails(wrong_rule):
    wrong_rule("Neg", _through_1d_resize)
    case = Case("Neg", [randn(5)], opset=18)
    model, feeds, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    seed = {"y0_grad": randn(5)}
    np.testing.assert_allclose(Runner(gm, runtime="reference", reason="to show the math is right")(
        {**feeds, **seed})["x0_grad"], -seed["y0_grad"], rtol=1e-6)
    with pytest.raises(RuntimeRefusedError, match="no silent switch"):
        run_case(case)


def test_a_declared_case_onnxruntime_runs_fails():
    """A reference-runtime declaration that is not needed (onnxruntime runs the forward) is stale."""
    with pytest.raises(AssertionError, match="remove the declaration"):
        run_case(Case("Relu", [randn(3, 4)], reference="no reason at all"))


def test_a_declared_case_runs_in_reference_and_says_why():
    case = Case("LRN", [randn(2, 4, 3, 3)], dict(size=2), reference="onnxruntime's LRN takes an odd size only")
    r = run_case(case)
    assert (r.grad_backend, r.grad_reason) == ("reference", case.reference)


def test_runtimes_are_recorded():
    r = run_case(Case("Tanh", [randn(3, 4)]))           # float64 Tanh: onnxruntime has the kernel
    assert (r.backend, r.grad_backend, r.reason, r.grad_reason) == ("onnxruntime",) * 2 + ("",) * 2
    r = run_case(Case("Conv", [randn(1, 2, 4, 4), randn(3, 2, 3, 3)]))
    assert r.grad_backend == "reference" and "no double CPU kernel for Conv" in r.grad_reason


def test_reference_runtime_needs_a_reason():
    model, _, _ = case_model(Case("Relu", [randn(3)]))
    with pytest.raises(ValueError, match="needs a reason"):
        Runner(model, runtime="reference")
    assert Runner(to_float64(model)).backend == "onnxruntime"           # float64 Relu has a kernel
    assert Runner(to_float64(model), runtime="reference", reason="r").reason == "r"


def test_case_data_is_seeded_per_test_and_per_module():
    """Inside a test, data comes from the test's own generator; at import, from the calling module's, so a
    module's tables do not depend on which modules were imported before it."""
    with harness.seeded("a test"):
        first = randn(4)
    with harness.seeded("a test"):
        assert np.array_equal(randn(4), first)
    script = ("import sys; sys.path.insert(0, 'tests'); {pre}import test_rules_reduce as t; "
              "print(float(sum(abs(x).sum() for c in t.REDUCE for x in c.inputs if x is not None)))")
    runs = [subprocess.run([sys.executable, "-c", script.format(pre=pre)], capture_output=True, text=True,
                           cwd=pathlib.Path(__file__).parent.parent, check=True).stdout
            for pre in ("", "import test_rules_nn; ")]
    assert runs[0] == runs[1] and runs[0].strip()
