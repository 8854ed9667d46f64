"""Stop ops: gradients through them are zero, silently; shape-only paths do not disturb the data path."""
import numpy as np
import onnx
import onnx.defs
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from harness import make_model, randn
from onnxgrad.rules.registry import DIFFERENTIABLE, all_rules, get_schema
from onnxgrad.tools.check import Runner, check

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=18):
    return make_model(nodes, inputs, outputs, inits, opset)


def _vi(name, shape, dtype=F32):
    return helper.make_tensor_value_info(name, dtype, shape)


# The stop entries of rules/stop.py.
STOPS = ["Floor", "Ceil", "Round", "Sign", "Hardmax", "ArgMax", "ArgMin", "NonZero", "IsNaN", "IsInf",
         "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
         "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "Shape", "Size", "Constant",
         "ConstantOfShape", "EyeLike", "HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix",
         "OneHot", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
         "Multinomial"]
# Stop entries that contradict a Differentiable schema tag, each because the op is piecewise constant.
PIECEWISE_CONSTANT_BUT_TAGGED = {"Hardmax"}


@pytest.mark.parametrize("op", STOPS)
def test_stop_entry_agrees_with_the_schema(op):
    rule = all_rules().get(op)
    assert rule is not None and rule.stop and rule.doc, f"{op}: a stop entry that says why"
    schema = get_schema(op, 26)
    tagged = [p.name for p in schema.inputs if p.differentiation_category == DIFFERENTIABLE]
    assert bool(tagged) == (op in PIECEWISE_CONSTANT_BUT_TAGGED), f"{op}: the schema tags {tagged} Differentiable"


def test_range_is_not_a_stop():
    """Range's start and delta have gradients (sum(dy), sum(dy * i)); see test_rules_elementwise."""
    assert not all_rules()["Range"].stop


def test_only_through_floor_gives_zeros():
    """x reaches y only through Floor and Sign: its gradient is zeros, not an error; w's is Floor(x)."""
    x = np.array([[0.3, 1.6, -2.4], [2.2, -0.7, 3.5]], np.float32)
    m = _model(
        [helper.make_node("Floor", ["x"], ["f"]),
         helper.make_node("Mul", ["f", "w"], ["fw"]),
         helper.make_node("Sign", ["x"], ["s"]),
         helper.make_node("Add", ["fw", "s"], ["y"])],
        [_vi("x", [2, 3]), _vi("w", [3])], [_vi("y", [2, 3])])
    gm = onnxgrad.grad(m, wrt=["x", "w"], of=["y"])
    onnx.checker.check_model(gm, full_check=True)
    w = randn(3)
    r = check(m, gm, {"x": x, "w": w})
    assert r.ok(1e-6), r.errors
    np.testing.assert_array_equal(r.analytic["x"], np.zeros((2, 3)))
    dy = randn(2, 3)
    out = Runner(gm)({"x": x, "w": w, "y_grad": dy})
    np.testing.assert_array_equal(out["x_grad"], np.zeros((2, 3), np.float32))
    np.testing.assert_allclose(out["w_grad"], (np.floor(x) * dy).sum(0), rtol=1e-6)


def test_argmax_and_comparisons_stop_silently():
    """y = x * Cast(x > 0) + Cast(ArgMax(x)): only the Mul's direct path carries a gradient."""
    x = np.array([[0.3, 1.6, -2.4], [2.2, -0.7, 3.5]], np.float32)
    m = _model(
        [helper.make_node("Greater", ["x", "zero"], ["pos"]),
         helper.make_node("Cast", ["pos"], ["posf"], to=F32),
         helper.make_node("Mul", ["x", "posf"], ["relu"]),
         helper.make_node("ArgMax", ["x"], ["i"], axis=1),
         helper.make_node("Cast", ["i"], ["if"], to=F32),
         helper.make_node("Add", ["relu", "if"], ["y"])],
        [_vi("x", [2, 3])], [_vi("y", [2, 3])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    gm = onnxgrad.grad(m, wrt=["x"], of=["y"])
    r = check(m, gm, {"x": x})
    assert r.ok(1e-6), r.errors
    dy = randn(2, 3)
    np.testing.assert_allclose(Runner(gm)({"x": x, "y_grad": dy})["x_grad"], dy * (x > 0))


def test_hardmax_stops():
    x = np.array([[0.3, 1.6, -2.4], [2.2, -0.7, 3.5]], np.float32)
    m = _model([helper.make_node("Hardmax", ["x"], ["h"]), helper.make_node("Add", ["h", "x"], ["y"])],
               [_vi("x", [2, 3])], [_vi("y", [2, 3])])
    gm = onnxgrad.grad(m, wrt=["x"], of=["y"])
    r = check(m, gm, {"x": x})
    assert r.ok(1e-6), r.errors


def test_shape_dependent_values_keep_the_data_path():
    """y = x * ConstantOfShape(Shape(x), 2) + Cast(Size(x)) * Sin(x): Shape and Size stop; dy/dx = 2 + 6 cos(x)."""
    x = randn(2, 3)
    m = _model(
        [helper.make_node("Shape", ["x"], ["shape"]),
         helper.make_node("ConstantOfShape", ["shape"], ["two"],
                          value=numpy_helper.from_array(np.array([2.0], np.float32))),
         helper.make_node("Mul", ["x", "two"], ["a"]),
         helper.make_node("Size", ["x"], ["n"]),
         helper.make_node("Cast", ["n"], ["nf"], to=F32),
         helper.make_node("Sin", ["x"], ["s"]),
         helper.make_node("Mul", ["nf", "s"], ["b"]),
         helper.make_node("Add", ["a", "b"], ["y"])],
        [_vi("x", ["N", 3])], [_vi("y", ["N", 3])])
    gm = onnxgrad.grad(m, wrt=["x"], of=["y"])
    onnx.checker.check_model(gm, full_check=True)
    r = check(m, gm, {"x": x})
    assert r.ok(1e-5), r.errors
    np.testing.assert_allclose(r.analytic["x"], r.numeric["x"], rtol=1e-5)


@pytest.mark.skipif(any(onnxgrad.rules.registry.get_rule(op) is None for op in ("Reshape",)),
                    reason="needs the Reshape rule (rules/shape.py)")
def test_shape_dependent_reshape_differentiates_the_data_path():
    """Reshape(x, Concat(Shape(x)[:1], [-1])) * w: the shape computation stops, the data flows."""
    x, w = randn(2, 3, 2), randn(6)
    m = _model(
        [helper.make_node("Shape", ["x"], ["shape"], end=1),
         helper.make_node("Concat", ["shape", "minus1"], ["target"], axis=0),
         helper.make_node("Reshape", ["x", "target"], ["flat"]),
         helper.make_node("Mul", ["flat", "w"], ["y"])],
        [_vi("x", ["N", 3, 2]), _vi("w", [6])], [_vi("y", ["N", 6])],
        [numpy_helper.from_array(np.array([-1], np.int64), "minus1")])
    gm = onnxgrad.grad(m, wrt=["x", "w"], of=["y"])
    onnx.checker.check_model(gm, full_check=True)
    r = check(m, gm, {"x": x, "w": w})
    assert r.ok(1e-5), r.errors
