"""Forward-mode rules: every native tangent rule, and the fallback (the transpose of the reverse rule),
checked against float64 central differences along random directions on tables of cases.

A case builds a one-node model (tests/harness.py), its JVP model, and requires that
1. the JVP model passes ``onnx.checker.check_model(full_check=True)``;
2. its tangents, run in onnxruntime in float32, match the central difference of the float64
   forward model along the same direction (``tol32``);
3. the same tangent graph run in float64 matches it tightly (``tol64``).
"""
from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from harness import Case, case_model, distinct, randn
from onnxgrad.passes.forward import jvp
from onnxgrad.rules.tangents import base as tangent_base
from onnxgrad.rules.tangents import get_tangent_rule
from onnxgrad.tools.check import run_float64
from onnxgrad.tools.check.jvp import check_jvp

I64 = np.int64


def run_jvp_case(case: Case, of: list[str] | None = None) -> dict[str, float]:
    model, feeds, wrt = case_model(case)
    jm = jvp(model, wrt, of=of, allow_unused=True)
    onnx.checker.check_model(jm, full_check=True)
    e32, _ = check_jvp(model, jm, feeds, rng=7)
    assert all(np.isfinite(e) and e <= case.tol32 for e in e32.values()), f"{case}: float32 tangent errors {e32}"
    e64, _ = check_jvp(model, jm, feeds, rng=7, run=run_float64)
    assert all(np.isfinite(e) and e <= case.tol64 for e in e64.values()), f"{case}: float64 tangent errors {e64}"
    return e64


def off_kinks(*shape: int) -> np.ndarray:
    """Distinct values none of which is 0 (Relu, Abs, LeakyRelu have a kink there)."""
    return distinct(*shape) + 0.025


def positive(*shape: int) -> np.ndarray:
    return randn(*shape, low=0.5, high=2.0)


NATIVE = [
    # elementwise, with broadcasting both ways and one-sided tangents
    Case("Add", [randn(3, 4), randn(3, 4)], id="same"),
    Case("Add", [randn(3, 1), randn(4)], id="broadcast"),
    Case("Add", [randn(3, 4), randn(4)], wrt=[1], id="only-b"),
    Case("Sub", [randn(2, 3, 4), randn(3, 1)], id="broadcast"),
    Case("Sub", [randn(3, 1), randn(3, 4)], wrt=[1], id="only-b"),
    Case("Mul", [randn(3, 4), randn(4)], id="broadcast"),
    Case("Mul", [randn(3, 4), randn(3, 4)], wrt=[0], id="only-a"),
    Case("Div", [randn(3, 4), positive(3, 4)], id="same"),
    Case("Div", [randn(3, 4), positive(4)], id="broadcast"),
    Case("Div", [randn(3, 1), positive(4)], wrt=[1], id="only-b"),
    Case("Neg", [randn(3, 4)]),
    Case("Pow", [positive(3, 4), randn(3, 4)], id="both"),
    Case("Pow", [randn(3, 4), np.array(2.0, np.float32)], wrt=[0], id="square"),
    Case("Pow", [positive(3, 4), np.array(-1.5, np.float32)], wrt=[0], id="const-exp"),
    Case("Pow", [positive(3, 4), randn(4)], wrt=[1], id="exponent"),
    Case("Sqrt", [positive(3, 4)]),
    Case("Exp", [randn(3, 4)]),
    Case("Log", [positive(3, 4)]),
    Case("Reciprocal", [positive(3, 4)]),
    Case("Tanh", [randn(3, 4)]),
    Case("Sigmoid", [randn(3, 4)]),
    Case("Relu", [off_kinks(3, 4)]),
    Case("Abs", [off_kinks(3, 4)]),
    Case("Sin", [randn(3, 4)]),
    Case("Cos", [randn(3, 4)]),
    Case("Erf", [randn(3, 4)]),
    Case("Gelu", [randn(3, 4)], opset=20, id="exact"),
    Case("Gelu", [randn(3, 4)], {"approximate": "tanh"}, opset=20, id="tanh"),
    Case("Where", [randn(3, 4) > 0, randn(3, 4), randn(4)], id="broadcast"),
    Case("Where", [randn(3, 1) > 0, randn(1, 4), randn(4)], wrt=[1], id="only-a"),
    Case("Cast", [randn(3, 4)], {"to": TensorProto.DOUBLE}, id="to-double"),
    Case("Identity", [randn(3, 4)]),
    Case("Sum", [randn(3, 4), randn(4), randn(3, 1)]),
    Case("Mean", [randn(3, 4), randn(4)]),
    # bilinear
    Case("MatMul", [randn(3, 4), randn(4, 5)], id="2d"),
    Case("MatMul", [randn(2, 3, 4), randn(4, 5)], id="batched-broadcast"),
    Case("MatMul", [randn(4), randn(2, 4, 3)], id="vector"),
    Case("Gemm", [randn(3, 4), randn(5, 4), randn(5)], {"transB": 1}, id="transB-bias"),
    Case("Gemm", [randn(4, 3), randn(4, 5), randn(3, 5)], {"transA": 1, "alpha": 0.5, "beta": 2.0}, id="alpha-beta"),
    Case("Gemm", [randn(3, 4), randn(4, 5)], id="no-bias"),
    Case("Gemm", [randn(3, 4), randn(4, 5), randn(1, 5)], wrt=[2], id="only-bias"),
    Case("Conv", [randn(1, 2, 5, 5), randn(3, 2, 3, 3), randn(3)], {"pads": [1, 1, 1, 1]}, id="2d-bias"),
    Case("Conv", [randn(2, 4, 6), randn(4, 2, 3)], {"group": 2, "strides": [2]}, id="1d-group"),
    Case("Conv", [randn(1, 2, 5, 5), randn(2, 2, 2, 2), randn(2)], {"dilations": [2, 2]}, wrt=[2], id="only-bias"),
    Case("ConvTranspose", [randn(1, 2, 3, 3), randn(2, 3, 2, 2), randn(3)], {"strides": [2, 2]}, id="2d"),
    # linear data movement and sums
    Case("Reshape", [randn(2, 3, 4), np.array([4, -1], I64)]),
    Case("Flatten", [randn(2, 3, 4)], {"axis": 2}),
    Case("Squeeze", [randn(3, 1, 4), np.array([1], I64)]),
    Case("Unsqueeze", [randn(3, 4), np.array([0, 2], I64)]),
    Case("Transpose", [randn(2, 3, 4)], {"perm": [2, 0, 1]}),
    Case("Expand", [randn(3, 1), np.array([2, 3, 4], I64)]),
    Case("Tile", [randn(2, 3), np.array([2, 1], I64)]),
    Case("Slice", [randn(5, 6), np.array([1, 0], I64), np.array([4, 6], I64), np.array([0, 1], I64),
                   np.array([2, 2], I64)], id="steps"),
    Case("Concat", [randn(2, 3), randn(2, 1), randn(2, 2)], {"axis": 1}, id="all"),
    Case("Concat", [randn(2, 3), randn(4, 3)], {"axis": 0}, wrt=[1], id="one"),
    Case("Split", [randn(6, 2), np.array([2, 4], I64)], {"axis": 0}, outputs=2),
    Case("Pad", [randn(2, 3), np.array([0, 1, 1, 0], I64)], {"mode": "reflect"}),
    Case("Gather", [randn(5, 3), np.array([[0, 4], [2, 2]], I64)], {"axis": 0}),
    Case("GatherElements", [randn(3, 4), np.array([[0, 3], [1, 1], [2, 0]], I64)], {"axis": 1}),
    Case("GatherND", [randn(3, 4), np.array([[0, 1], [2, 3]], I64)]),
    Case("Trilu", [randn(4, 4)], {"upper": 0}),
    Case("DepthToSpace", [randn(1, 8, 2, 2)], {"blocksize": 2}),
    Case("SpaceToDepth", [randn(1, 2, 4, 4)], {"blocksize": 2}),
    Case("CumSum", [randn(3, 4), np.array(1, I64)], {"reverse": 1}),
    Case("ReduceSum", [randn(3, 4, 2), np.array([0, 2], I64)], {"keepdims": 0}),
    Case("ReduceMean", [randn(3, 4, 2)], {"axes": [1], "keepdims": 1}, opset=17, id="attr-axes"),
    Case("ReduceMean", [randn(3, 4, 2), np.array([-1], I64)], opset=18, id="input-axes"),
    Case("AveragePool", [randn(1, 2, 5, 5)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                             "count_include_pad": 0}),
    Case("GlobalAveragePool", [randn(2, 3, 4, 4)]),
    Case("NegativeLogLikelihoodLoss", [randn(4, 3), np.array([0, 2, 1, 2], I64)], {"reduction": "mean"}),
    Case("Pad", [randn(2, 3), np.array([1, 0, 0, 2], I64), np.array(1.5, np.float32)], wrt=[0], id="value"),
    Case("ReduceL2", [randn(3, 4), np.array([0], I64)], opset=18, id="axis"),
    Case("ReduceL2", [np.array([[0, 0, 0], [1, -2, 0.5]], np.float32)], {"axes": [1], "keepdims": 0}, opset=13,
         id="zero-row"),
    Case("RoiAlign", [randn(1, 2, 5, 5), np.array([[0.3, 0.7, 3.1, 2.6], [1.2, 0.4, 4.3, 3.9]], np.float32),
                      np.array([0, 0], I64)], {"output_height": 2, "output_width": 2, "sampling_ratio": 2},
         opset=13, wrt=[0]),
    # softmax, pooling, normalization, dropout, loss
    Case("Softmax", [randn(3, 4)], id="last"),
    Case("Softmax", [randn(2, 3, 4)], {"axis": 1}, id="axis1"),
    Case("LogSoftmax", [randn(3, 4)], id="last"),
    Case("LogSoftmax", [randn(2, 3, 4)], {"axis": 0}, id="axis0"),
    Case("MaxPool", [distinct(1, 2, 5, 5)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
         id="2d-pads"),
    Case("MaxPool", [distinct(2, 2, 4, 4)], {"kernel_shape": [2, 2], "strides": [2, 2]}, id="tiles"),
    Case("MaxPool", [distinct(1, 2, 7)], {"kernel_shape": [3], "dilations": [2]}, id="1d-dilated"),
    Case("BatchNormalization", [randn(2, 3, 4, 4), randn(3), randn(3), randn(3), positive(3)], {"epsilon": 1e-3},
         id="all"),
    Case("BatchNormalization", [randn(4, 3), randn(3), randn(3), randn(3), positive(3)], wrt=[0], id="2d-x"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(4)], id="last"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(3, 4), randn(3, 4)], {"axis": 1}, outputs=3, id="stats"),
    Case("LayerNormalization", [randn(2, 4), randn(4)], wrt=[1], id="only-scale"),
    # float64 x, float32 statistics (the default stash_type): exact in float64, to 1e-8
    # (the Mean and InvStdDev outputs, rounded to float32, gave the tangent errors of 8e-8)
    Case("LayerNormalization", [randn(2, 3, 4).astype(np.float64), randn(4).astype(np.float64),
                                randn(4).astype(np.float64)], tol32=1e-8, tol64=1e-8, id="float64-stash-float"),
    Case("LayerNormalization", [randn(2, 3, 4).astype(np.float64), randn(3, 4).astype(np.float64)], {"axis": 1},
         tol32=1e-8, tol64=1e-8, unknown_shapes=True, id="float64-stash-float-dynamic"),
    Case("Dropout", [randn(3, 4)], id="inference"),
    Case("Dropout", [randn(3, 4), np.array(0.3, np.float32), np.array(False)], id="training-off"),
    Case("SoftmaxCrossEntropyLoss", [randn(4, 3), np.array([0, 2, 1, 2], I64)], id="mean"),
    Case("SoftmaxCrossEntropyLoss", [randn(2, 3, 2), np.array([[0, 2], [1, -1]], I64), positive(3)],
         {"reduction": "sum", "ignore_index": -1}, outputs=2, wrt=[0], id="weights-logprob"),
    # unknown dims: the rules that read shapes fall back to run-time ones
    Case("Add", [randn(3, 1), randn(4)], wrt=[0], unknown_shapes=True, id="only-a-dynamic"),
    Case("Gemm", [randn(3, 4), randn(4, 5), randn(5)], wrt=[2], unknown_shapes=True, id="bias-dynamic"),
]


@pytest.mark.parametrize("case", NATIVE, ids=str)
def test_native_rule(case):
    assert get_tangent_rule(case.op) is not None, f"{case.op} has no native tangent rule"
    run_jvp_case(case)


def test_every_native_rule_has_cases():
    tested = {c.op for c in NATIVE}
    missing = set(tangent_base.all_tangent_rules()) - tested - {"CastLike", "Compress", "ReverseSequence"}
    assert not missing, f"native tangent rules without a case: {sorted(missing)}"


# ops with a reverse rule only: their tangent is the transpose of the VJP
FALLBACK = [
    Case("Softplus", [randn(3, 4)]),
    Case("LeakyRelu", [off_kinks(3, 4)], {"alpha": 0.2}),
    # float64, the default alpha: the float32 0.01 the forward uses (a float64 0.01 was off by 2e-8)
    Case("LeakyRelu", [-positive(3, 4).astype(np.float64)], tol32=1e-9, tol64=1e-9, id="float64-default-alpha"),
    Case("Elu", [off_kinks(3, 4)]),
    Case("HardSigmoid", [off_kinks(3, 4)]),
    Case("Clip", [off_kinks(3, 4), np.array(-0.3, np.float32), np.array(0.4, np.float32)], wrt=[0]),
    Case("Max", [distinct(3, 4), distinct(4) + 0.025]),
    Case("ReduceMax", [distinct(3, 4)], {"axes": [1]}, opset=13),
    Case("ReduceLogSumExp", [randn(3, 4), np.array([1], I64)], opset=18),
    Case("ReduceL1", [off_kinks(3, 4), np.array([0], I64)], opset=18),
    Case("ReduceSumSquare", [randn(3, 4)], opset=18),
    Case("Einsum", [randn(2, 3), randn(3, 4)], {"equation": "ij,jk->ik"}),
    Case("InstanceNormalization", [randn(2, 3, 5), randn(3), randn(3)]),
    Case("LpNormalization", [randn(3, 4)], {"axis": 1, "p": 2}),
    Case("Resize", [randn(1, 1, 3, 3), np.array([], np.float32), np.array([1, 1, 2, 2], np.float32)],
         {"mode": "linear"}, wrt=[0]),
    Case("LpPool", [randn(1, 2, 4, 4)], {"kernel_shape": [2, 2], "p": 2}),
    Case("PRelu", [off_kinks(3, 4), randn(4)]),
    Case("TopK", [distinct(3, 5), np.array([2], I64)], outputs=2),
    Case("ScatterElements", [randn(3, 3), np.array([[1, 0, 2]], I64), randn(1, 3)], {"axis": 0}, wrt=[0, 2]),
    Case("RMSNormalization", [randn(2, 4), randn(4)], opset=23),
    Case("GroupNormalization", [randn(2, 4, 3), randn(4), randn(4)], {"num_groups": 2}, opset=21),
    Case("LSTM", [randn(2, 1, 3), randn(1, 8, 3), randn(1, 8, 2)], {"hidden_size": 2}, outputs=3),
]


@pytest.mark.parametrize("case", FALLBACK, ids=str)
def test_fallback_transposes_the_reverse_rule(case):
    assert get_tangent_rule(case.op) is None, f"{case.op} has a native rule: this case does not test the fallback"
    run_jvp_case(case)


@pytest.mark.parametrize("case", [
    Case("MaxPool", [distinct(1, 1, 4, 4)], {"kernel_shape": [2, 2], "storage_order": 1}, id="column-major"),
    Case("BatchNormalization", [randn(4, 3, 2), randn(3), randn(3), randn(3), positive(3)],
         {"training_mode": 1}, outputs=3, wrt=[0, 1, 2], opset=15, id="training"),
], ids=str)
def test_native_rule_declines_to_the_fallback(case):
    """Configurations a native rule hands to the fallback (NotImplemented) are still exact.
    (BatchNormalization's running statistics carry no gradient, in its reverse rule as in PyTorch.)"""
    run_jvp_case(case, of=["y0"])


# -- the checker can fail -------------------------------------------------------------------
@pytest.fixture
def wrong_tangent():
    with ExitStack() as stack:
        yield lambda op, fn: stack.enter_context(tangent_base.override(op, fn))


def test_catches_missing_factor(wrong_tangent):
    wrong_tangent("Tanh", lambda t: t.dx * (1.0 - t.outputs[0]))
    with pytest.raises(AssertionError, match="tangent errors"):
        run_jvp_case(Case("Tanh", [randn(3, 4)]))


def test_catches_a_dropped_product_term(wrong_tangent):
    wrong_tangent("Mul", lambda t: t.dxs[0] * t.inputs[1] if t.dxs[0] is not None else t.inputs[0] * t.dxs[1])
    with pytest.raises(AssertionError, match="tangent errors"):
        run_jvp_case(Case("Mul", [randn(3, 4), randn(3, 4)]))


def test_catches_wrong_softmax_axis(wrong_tangent):
    def softmax_wrong_axis(t):
        y = t.outputs[0]
        return y * (t.dx - t.b.sum(y * t.dx, [0]))

    wrong_tangent("Softmax", softmax_wrong_axis)
    with pytest.raises(AssertionError, match="tangent errors"):
        run_jvp_case(Case("Softmax", [randn(3, 4)]))


# -- zero-derivative ops ----------------------------------------------------------------------
def test_zero_derivative_op_gives_no_tangent():
    """y = floor(x) + x: floor has derivative 0, so J v = v, with no node emitted for Floor."""
    from harness import make_model

    nodes = [helper.make_node("Floor", ["x"], ["f"]), helper.make_node("Add", ["f", "x"], ["y"])]
    m = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])])
    jm = jvp(m, ["x"])
    onnx.checker.check_model(jm, full_check=True)
    assert not any(n.name.startswith("node_0") or "Floor" in n.op_type for n in jm.graph.node[2:])
    from onnxgrad.tools.check import Runner

    v = randn(3, 4)
    out = Runner(jm)({"x": randn(3, 4) * 3, "x_tangent": v})
    np.testing.assert_array_equal(out["y_tangent"], v)
