"""The function-body fallback: an op without a rule whose ONNX schema has a function body is
differentiated through that body (onnxgrad/passes/function_body.py).

Each case removes the op's hand-written rule (``registry.override(op, None)``) and checks the
gradient the fallback builds against float64 central differences, exactly as the rule's own
tests check the rule.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxgrad
from harness import Case, case_model, randn, run_case
from onnxgrad.errors import UnsupportedOpError
from onnxgrad.passes.reach import rule_of
from onnxgrad.rules import registry
from onnxgrad.tools.coverage import coverage


def _labels(*shape: int, classes: int) -> np.ndarray:
    return np.random.default_rng(3).integers(0, classes, shape).astype(np.int64)


def _gn(groups: int, **kw) -> dict:
    return {"num_groups": groups, "stash_type": 11, **kw}


# ops with a hand rule and a function body, the rule removed: the body must give the same gradient
CASES = [
    Case("Softplus", [randn(3, 4)]),
    Case("Softplus", [randn(3, 4)], opset=14, id="opset14-body-converted-down"),
    Case("HardSigmoid", [randn(3, 4)], {"alpha": 0.3, "beta": 0.4}, opset=18),
    Case("Selu", [randn(3, 4)], opset=18),
    Case("Elu", [randn(3, 4)], {"alpha": 0.7}, opset=18),
    Case("Celu", [randn(3, 4)], {"alpha": 1.5}, id="context-dependent"),
    Case("Mish", [randn(3, 4)], opset=18),
    Case("Swish", [randn(3, 4)], {"alpha": 1.3}, opset=24),
    Case("PRelu", [randn(2, 3, 4), randn(3, 1)], opset=16, id="broadcast"),
    Case("Softmax", [randn(3, 4)], {"axis": 0}, id="body-converted-up"),
    Case("LogSoftmax", [randn(2, 3, 4)], {"axis": 1}, opset=18),
    Case("Gelu", [randn(3, 4)], {"approximate": "tanh"}, opset=20),
    Case("Clip", [randn(3, 4), np.array(-0.5, np.float32), np.array(0.6, np.float32)], wrt=[0], opset=13),
    Case("ReduceL2", [randn(3, 4), np.array([1])], {"keepdims": 0}, opset=18),
    Case("ReduceLogSumExp", [randn(3, 4), np.array([0])], opset=18),
    Case("NegativeLogLikelihoodLoss", [randn(3, 5), _labels(3, classes=5)], {"reduction": "mean"}, wrt=[0]),
    Case("SoftmaxCrossEntropyLoss", [randn(3, 5), _labels(3, classes=5)], {"reduction": "sum"}, wrt=[0]),
    Case("GroupNormalization", [randn(2, 4, 3), randn(4), randn(4)], _gn(2), opset=21),
    Case("RMSNormalization", [randn(2, 3, 4), randn(4)], opset=23),
    Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(4)], id="last-axis"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fallback_matches_central_differences(case):
    with registry.override(case.op, None):
        model, _, _ = case_model(case)
        node = model.graph.node[0]
        assert rule_of(node, case.opset).via_body, "the fallback must be what runs"
        run_case(case)
        gm = onnxgrad.grad(model, wrt=[model.graph.input[0].name], of=["y0"])
    backward = [n for n in gm.graph.node[1:]]
    # named after the forward node, then the body's node: '<node>/grad/<BodyOp>_k/grad/...'
    assert backward and all(n.name.startswith(f"{node.name}/grad/") for n in backward)
    assert case.op not in {n.op_type for n in backward}


def test_a_hand_rule_wins_over_the_body():
    node = onnx.helper.make_node("Softplus", ["x"], ["y"])
    assert not rule_of(node, 17).via_body
    with registry.override("Softplus", None):
        assert rule_of(node, 17).via_body
    assert not rule_of(node, 17).via_body            # restored


def test_checker_catches_a_wrong_rule_inside_the_body():
    """The fallback uses the body's ops' rules: a wrong Exp rule makes Softplus's gradient wrong, and
    the numeric check sees it."""
    with registry.override("Softplus", None), registry.override("Exp", lambda n: (n.dy * 2.0,)):
        with pytest.raises(AssertionError, match="gradient errors"):
            run_case(Case("Softplus", [randn(3, 4)]))


def test_falls_back_recursively():
    """Celu's body uses Elu; without either rule, Elu's own body is differentiated in turn."""
    with registry.override("Celu", None), registry.override("Elu", None):
        run_case(Case("Celu", [randn(3, 4)], {"alpha": 0.8}, opset=18))


def test_a_body_op_without_a_rule_names_the_original_node():
    with registry.override("Softplus", None), registry.override("Log", None):
        model, _, wrt = case_model(Case("Softplus", [randn(3, 4)]))
        with pytest.raises(UnsupportedOpError, match=r"Softplus \(e.g. node 'Softplus_node'\).*body uses Log"):
            onnxgrad.grad(model, wrt=wrt, of=["y0"])


def test_a_body_onnx_cannot_convert_declines_clearly():
    """Softplus's body is written at opset 18; onnx's version converter cannot bring Add to opset 13."""
    with registry.override("Softplus", None):
        model, _, wrt = case_model(Case("Softplus", [randn(3, 4)], opset=13))
        with pytest.raises(UnsupportedOpError, match=r"Softplus_node.*opset 18.*opset 13"):
            onnxgrad.grad(model, wrt=wrt, of=["y0"])


def test_a_body_that_does_not_fit_the_configuration_declines_clearly():
    """onnx's LayerNormalization body flattens the scale to 2-D, so a scale broadcast along the
    normalized axes fails its shape inference: a clear decline, not an invalid graph."""
    case = Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(1, 4)], {"axis": -2})
    with registry.override("LayerNormalization", None):
        model, _, wrt = case_model(case)
        with pytest.raises(UnsupportedOpError, match="LayerNormalization_node.*shape inference"):
            onnxgrad.grad(model, wrt=wrt, of=["y0"])


def test_forward_mode_through_the_body():
    """jvp's transpose-of-VJP fallback reaches the body too."""
    from test_forward_rules import run_jvp_case

    with registry.override("Softplus", None):
        run_jvp_case(Case("Softplus", [randn(3, 4)]))


# -- an op with no hand rule: DynamicQuantizeLinear ------------------------------------------------
def _y_scale(x: np.ndarray) -> float:
    """DynamicQuantizeLinear's y_scale: the float range of x, 0 included, over 255 levels."""
    return (max(0.0, x.max()) - min(0.0, x.min())) / 255.0


@pytest.mark.parametrize("x", [randn(3, 4), randn(3, 4, low=0.2, high=2.0)], ids=["signed", "positive"])
def test_dynamic_quantize_linear_scale(x):
    """Without its hand rule, y_scale's gradient comes from the body (ReduceMax, ReduceMin, Max, Min, Sub,
    Div), and so does the hand rule's. The input is float32 only, so the truth is central differences of
    the formula in numpy float64."""
    case = Case("DynamicQuantizeLinear", [x], outputs=3, opset=21)
    model, feeds, wrt = case_model(case)
    seed = np.float32(1.7)
    x64, numeric, h = x.astype(np.float64), np.zeros(x.shape), 1e-6
    for j in range(x.size):
        up, down = x64.copy(), x64.copy()
        up.flat[j] += h
        down.flat[j] -= h
        numeric.flat[j] = seed * (_y_scale(up) - _y_scale(down)) / (2 * h)
    assert np.abs(numeric).max() > 0

    def gradient() -> np.ndarray:
        gm = onnxgrad.grad(model, wrt=wrt, of=["y1"])
        onnx.checker.check_model(gm, full_check=True)
        session = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return session.run(None, {**feeds, "y1_grad": np.array(seed, np.float32).reshape(())})[names.index("x0_grad")]

    with registry.override("DynamicQuantizeLinear", None):
        assert {r.op_type: r.status for r in coverage()}["DynamicQuantizeLinear"] == "function body"
        np.testing.assert_allclose(gradient(), numeric, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(gradient(), numeric, rtol=1e-4, atol=1e-7)        # the hand rule
