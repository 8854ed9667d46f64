"""Activations: pointwise (kinks avoided), PRelu (broadcast slope), Softmax/LogSoftmax axes, Dropout,
and differentiating a gradient graph a second time."""
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from harness import Case, case_model, make_model, randn, run_case, run_second_order
from onnxgrad.tools.check import Runner, check, to_float64

F32 = TensorProto.FLOAT


def away_from_zero(*shape, low=0.1, high=2.0):
    """Values with |x| in [low, high) and random signs (no kink at 0)."""
    sign = np.where(randn(*shape) >= 0, 1.0, -1.0).astype(np.float32)
    return sign * randn(*shape, low=low, high=high)


def off_kinks(*shape, kinks, scale=3.0, margin=0.05):
    """Uniform values in [-scale, scale) at least ``margin`` away from every kink."""
    x = randn(*shape, low=-scale, high=scale)
    for k in kinks:
        x[np.abs(x - k) < margin] += 2 * margin
    assert all(np.abs(x - k).min() >= margin for k in kinks)
    return x


def needs_rules(*ops):
    missing = [op for op in ops if onnxgrad.rules.registry.get_rule(op) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs the rules of {', '.join(missing)} (other modules)")


CASES = [
    # -- pointwise
    Case("Relu", [away_from_zero(3, 4)], id="opset14", opset=14),
    Case("Tanh", [randn(2, 3)], id="dynamic", unknown_shapes=True),
    Case("Sigmoid", [randn(3, 4)]),
    Case("Sigmoid", [randn(2, 3, 2)], id="dynamic", unknown_shapes=True, opset=13),
    Case("LeakyRelu", [away_from_zero(3, 4)]),
    Case("LeakyRelu", [away_from_zero(3, 4)], attrs={"alpha": 0.2}, id="alpha", opset=16),
    Case("ThresholdedRelu", [off_kinks(3, 4, kinks=[1.0])]),
    Case("ThresholdedRelu", [off_kinks(3, 4, kinks=[0.4])], attrs={"alpha": 0.4}, id="alpha", opset=22),
    Case("Elu", [away_from_zero(3, 4)]),
    Case("Elu", [away_from_zero(3, 4)], attrs={"alpha": 0.5}, id="alpha", opset=22),
    Case("Selu", [away_from_zero(3, 4)]),
    Case("Selu", [away_from_zero(3, 4)], attrs={"alpha": 1.5, "gamma": 2.0}, id="attrs"),
    Case("Celu", [away_from_zero(3, 4)]),
    Case("Celu", [away_from_zero(3, 4)], attrs={"alpha": 2.0}, id="alpha"),
    Case("Softplus", [randn(3, 4) * 3]),
    Case("Softsign", [randn(3, 4) * 3]),
    Case("HardSigmoid", [off_kinks(3, 4, kinks=[-2.5, 2.5], scale=4)]),
    Case("HardSigmoid", [off_kinks(3, 4, kinks=[-1.2, 0.8])], attrs={"alpha": 0.5, "beta": 0.6}, id="attrs",
         opset=22),
    Case("HardSwish", [off_kinks(3, 4, kinks=[-3.0, 3.0], scale=5)]),
    Case("Mish", [randn(3, 4) * 2], opset=18),
    # Shrink: see NUMPY_CASES
    # Swish is ai.onnx from opset 24 (onnx 1.23); onnxruntime 1.31 loads opsets up to 26
    Case("Swish", [randn(3, 4) * 2], opset=24),
    Case("Swish", [randn(3, 4) * 2], attrs={"alpha": 0.5}, id="alpha", opset=24),
    # Gelu "none": see NUMPY_CASES
    Case("Gelu", [randn(3, 4) * 2], attrs={"approximate": "tanh"}, id="tanh", opset=20),
    Case("Gelu", [randn(2, 3)], attrs={"approximate": "tanh"}, id="dynamic", opset=22, unknown_shapes=True),
    # -- PRelu: the slope broadcasts to x (unidirectionally); its gradient is summed back
    Case("PRelu", [away_from_zero(2, 3, 2, 2), randn(3, 1, 1)], id="channel"),
    Case("PRelu", [away_from_zero(2, 3, 4), randn(1)], id="shared"),
    Case("PRelu", [away_from_zero(2, 3, 4), randn(4)], id="last-axis", opset=13),
    Case("PRelu", [away_from_zero(3, 4), randn(3, 4)], id="same", opset=16),
    Case("PRelu", [away_from_zero(2, 3, 2), randn(3, 1)], id="dynamic", unknown_shapes=True),
    # -- Softmax / LogSoftmax: axis semantics of opset 13+ (one axis, default -1)
    Case("Softmax", [randn(2, 3, 4)], opset=13, id="default"),
    Case("Softmax", [randn(2, 3, 4)], attrs={"axis": 0}, opset=13, id="axis0"),
    Case("Softmax", [randn(2, 3, 4)], attrs={"axis": -2}, opset=18, id="axis-neg"),
    Case("Softmax", [randn(2, 3, 4)], attrs={"axis": 1}, opset=18, id="dynamic", unknown_shapes=True),
    Case("Softmax", [randn(5)], opset=21, id="rank1"),
    Case("LogSoftmax", [randn(2, 3, 4)], opset=13, id="default"),
    Case("LogSoftmax", [randn(2, 3, 4)], attrs={"axis": 1}, opset=13, id="axis1"),
    Case("LogSoftmax", [randn(2, 3, 4)], attrs={"axis": -3}, opset=18, id="axis-neg"),
    Case("LogSoftmax", [randn(2, 3, 4)], attrs={"axis": -1}, opset=18, id="dynamic", unknown_shapes=True),
    # opset 11 (2-D coercion around axis, default 1): the pass upgrades the model to opset 13 first
    # (the converted Softmax over axis 1 of a 3-D input is Flatten -> Softmax -> Reshape)
    pytest.param(Case("Softmax", [randn(2, 3, 4)], opset=11, id="opset11-coerced"),
                 marks=needs_rules("Flatten", "Reshape"), id="Softmax-opset11-coerced"),
    Case("LogSoftmax", [randn(2, 3, 4)], attrs={"axis": 2}, opset=11, id="opset11-axis2"),
    # -- Dropout: inference is the identity; training with ratio 0 is too (mask all true)
    Case("Dropout", [randn(3, 4)], opset=13, id="inference"),
    Case("Dropout", [randn(3, 4), np.array(0.5, np.float32), np.array(False)], wrt=[0], id="training-false"),
    Case("Dropout", [randn(3, 4), np.array(0.0, np.float32), np.array(True)], wrt=[0], id="training-ratio0"),
    Case("Dropout", [randn(3, 4), np.array(0.0, np.float32), np.array(True)], wrt=[0], outputs=2,
         id="training-ratio0-mask-kept", opset=22),
    Case("Dropout", [randn(3, 4), np.array(0.5, np.float32), np.array(False)], wrt=[0], dynamic=[2],
         id="runtime-training-false"),
    Case("Dropout", [randn(3, 4), np.array(0.0, np.float32), np.array(True)], wrt=[0], dynamic=[1, 2],
         id="runtime-training-ratio0"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rule(case):
    run_case(case)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_second_order(case):
    run_second_order(case)


# Ops whose float64 forward is not float64 in either runtime, so the harness's central differences
# are off by ~1e-2: onnxruntime's double Shrink rounds to float32 inside; Gelu has no double kernel
# in onnxruntime and onnx.reference runs its function body, whose Erf computes in float32.
# These are checked against central differences of the numpy formula in float64 instead.
_erf = np.vectorize(math.erf)


def _shrink(lambd=0.5, bias=0.0):
    return lambda x: np.where(x < -lambd, x + bias, np.where(x > lambd, x - bias, 0.0))


NUMPY_CASES = [
    (Case("Shrink", [off_kinks(3, 4, kinks=[-0.5, 0.5])]), _shrink()),
    (Case("Shrink", [off_kinks(3, 4, kinks=[-0.7, 0.7])], attrs={"lambd": 0.7, "bias": 0.3}, id="attrs"),
     _shrink(0.7, 0.3)),
    (Case("Gelu", [randn(3, 4) * 2], opset=20), lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
    (Case("Gelu", [randn(2, 3) * 2], opset=22, unknown_shapes=True, id="dynamic"),
     lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
]


@pytest.mark.parametrize("case,f", NUMPY_CASES, ids=[str(c) for c, _ in NUMPY_CASES])
def test_rule_against_numpy(case, f):
    model, feeds, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    onnx.checker.check_model(gm, full_check=True)
    x, dy = feeds["x0"], randn(*feeds["x0"].shape)
    x64, h = x.astype(np.float64), 1e-6
    numeric = dy * (f(x64 + h) - f(x64 - h)) / (2 * h)
    got32 = Runner(gm)({"x0": x, "y0_grad": dy})["x0_grad"]
    got64 = Runner(to_float64(gm))({"x0": x64, "y0_grad": dy.astype(np.float64)})["x0_grad"]
    scale = np.abs(numeric).max()
    assert np.abs(got32 - numeric).max() <= case.tol32 * scale
    assert np.abs(got64 - numeric).max() <= case.tol64 * scale


def test_swish_schema_exists():
    assert onnx.defs.has("Swish") and onnx.defs.get_schema("Swish", 26).since_version == 24


# -- Dropout in training mode: the mask is random per run, so finite differences cannot see it;
#    the gradient must be dy * mask / (1 - ratio) with the mask of the same run.
@pytest.mark.parametrize("keep_mask", [False, True])
@pytest.mark.parametrize("runtime", [False, True])
def test_dropout_training_uses_the_runs_mask(keep_mask, runtime):
    ratio = 0.3
    x = randn(8, 16)
    inits = [numpy_helper.from_array(np.array(ratio, np.float32), "ratio")]
    inputs = [helper.make_tensor_value_info("x", F32, [8, 16])]
    if runtime:
        inputs.append(helper.make_tensor_value_info("training", TensorProto.BOOL, []))
    else:
        inits.append(numpy_helper.from_array(np.array(True), "training"))
    outs = ["y", "mask"] if keep_mask else ["y"]
    m = make_model([helper.make_node("Dropout", ["x", "ratio", "training"], outs, name="drop", seed=7)],
               inputs, [helper.make_tensor_value_info("y", F32, [8, 16])], inits, opset=13)
    gm = onnxgrad.grad(m, wrt=["x"], of=["y"])
    onnx.checker.check_model(gm, full_check=True)
    drop = next(node for node in gm.graph.node if node.op_type == "Dropout")
    assert len(drop.output) == 2 and drop.output[1], "the mask is exposed on the forward node"
    gm.graph.output.append(helper.make_empty_tensor_value_info(drop.output[1]))
    feeds = {"x": x, "y_grad": randn(8, 16)}
    if runtime:
        feeds["training"] = np.array(True)
    out = Runner(gm)(feeds)
    mask = out[drop.output[1]]
    assert mask.dtype == np.bool_ and 0 < mask.mean() < 1, "a real dropout mask"
    np.testing.assert_allclose(out["y"], x * mask / (1 - ratio), rtol=1e-6)
    np.testing.assert_allclose(out["x_grad"], feeds["y_grad"] * mask / (1 - ratio), rtol=1e-6)
    if runtime:  # the same graph in inference mode is the identity
        feeds["training"] = np.array(False)
        np.testing.assert_array_equal(Runner(gm)(feeds)["x_grad"], feeds["y_grad"])


# -- differentiating a gradient graph again: every op a rule emits has a rule (or stops)
def _chain(opset=17):
    """y = Softsign(Elu(Tanh(Sigmoid(x) * w)))"""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Mul", ["s", "w"], ["sw"]),
        helper.make_node("Tanh", ["sw"], ["t"]),
        helper.make_node("Elu", ["t"], ["e"], alpha=0.7),
        helper.make_node("Softsign", ["e"], ["y"]),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", F32, [2, 3]),
                          helper.make_tensor_value_info("w", F32, [3])],
                  [helper.make_tensor_value_info("y", F32, [2, 3])], opset=opset)


def _second_order(model, wrt, of, feeds, tol=1e-4):
    """d/dwrt <v, d<u, of>/dwrt>: grad(grad(model)) checked against central differences of grad(model)."""
    g1 = onnxgrad.grad(model, wrt=wrt, of=of)
    spec = onnxgrad.tools.check.gradient_spec(g1)
    g2 = onnxgrad.grad(g1, wrt=wrt, of=[spec["gradients"][wrt[0]]])
    onnx.checker.check_model(g2, full_check=True)
    out_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    feeds = {**feeds, spec["seeds"][of[0]]: randn(*out_shape)}
    r = check(g1, g2, feeds)
    assert r.ok(tol), r.errors
    return r


def test_second_order_pointwise_chain():
    feeds = {"x": randn(2, 3), "w": randn(3)}
    r = _second_order(_chain(), ["x"], ["y"], feeds)
    assert np.abs(r.analytic["x"]).max() > 1e-3


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_second_order_softmax(op):
    if onnxgrad.rules.registry.get_rule("ReduceSum") is None:
        pytest.skip("needs the ReduceSum rule (rules/reduce.py)")
    m = make_model([helper.make_node(op, ["x"], ["p"], axis=-1), helper.make_node("Sigmoid", ["p"], ["y"])],
               [helper.make_tensor_value_info("x", F32, [2, 4])],
               [helper.make_tensor_value_info("y", F32, [2, 4])], opset=18)
    r = _second_order(m, ["x"], ["y"], {"x": randn(2, 4)})
    assert np.abs(r.analytic["x"]).max() > 1e-3


@pytest.mark.parametrize("op,axis", [("Softmax", None), ("Softmax", -2), ("LogSoftmax", 1), ("LogSoftmax", 0)])
def test_softmax_rules_before_opset_13_coerce_to_2d(op, axis):
    """The rule's own opset < 13 branch (the pass upgrades such models, so it is driven directly here):
    at opset 11 the input is coerced to 2-D around axis (default 1), so the sums run over axis..rank-1."""
    from onnxgrad.ir.builder import Builder
    from onnxgrad.ir.model import NameScope, TensorInfo
    from onnxgrad.rules.registry import Node, get_rule

    attrs = {} if axis is None else {"axis": axis}
    fwd = helper.make_node(op, ["x"], ["y"], name="sm", **attrs)
    infos = {k: TensorInfo(F32, (2, 3, 4)) for k in ("x", "y", "dy")}
    b = Builder(11, NameScope({"x", "y", "dy", "sm"}), infos, "sm/grad")
    (dx,) = get_rule(op).fn(Node(fwd, b, [b.var("dy")], {0}))
    nodes = [fwd] + b.nodes + [helper.make_node("Identity", [dx.name], ["dx"])]
    m = make_model(nodes, [_vi3("x"), _vi3("dy")], [_vi3("dx")], opset=11)
    onnx.checker.check_model(m, full_check=True)

    x, dy = randn(2, 3, 4).astype(np.float64), randn(2, 3, 4).astype(np.float64)
    start = 1 if axis is None else axis % 3

    def f(v):  # the opset-11 definition: flatten to (prod(before), prod(from axis on)), normalise rows
        rows = v.reshape(int(np.prod(v.shape[:start])), -1)
        e = np.exp(rows - rows.max(1, keepdims=True))
        s = e / e.sum(1, keepdims=True)
        return (np.log(s) if op == "LogSoftmax" else s).reshape(v.shape)

    numeric = np.zeros_like(x)
    for j in range(x.size):
        e = np.zeros_like(x)
        e.flat[j] = 1e-6
        numeric.flat[j] = np.sum(dy * (f(x + e) - f(x - e))) / 2e-6
    got = Runner(m)({"x": x.astype(np.float32), "dy": dy.astype(np.float32)})["dx"]
    np.testing.assert_allclose(got, numeric, rtol=1e-4, atol=1e-5)


def _vi3(name):
    return helper.make_tensor_value_info(name, F32, [2, 3, 4])
