"""Gradient checks for the normalization rules (rules/normalization.py)."""
import numpy as np
import onnx
import pytest

import harness
import onnxgrad
from harness import Case, randn, run_case
from onnxgrad.tools.check import Runner, check, run_float64


def _gn(groups, **attrs):
    return {"num_groups": groups, "stash_type": 11, **attrs}


def _bn_inputs(*shape):
    c = shape[1]
    return [randn(*shape), randn(c), randn(c), randn(c), randn(c, low=0.5, high=2.0)]


CASES = [
    # BatchNormalization, inference: gradients for x, scale, B, mean and var
    Case("BatchNormalization", _bn_inputs(2, 3, 4), opset=15, id="inference-3d"),
    Case("BatchNormalization", _bn_inputs(3, 2), opset=14, id="inference-2d"),
    Case("BatchNormalization", _bn_inputs(2, 2, 2, 3), {"epsilon": 1e-3}, opset=13, id="inference-opset13"),
    Case("BatchNormalization", _bn_inputs(2, 3, 4), opset=15, unknown_shapes=True, id="inference-dynamic"),
    Case("BatchNormalization", _bn_inputs(2, 3, 4), opset=15, wrt=[0], id="inference-x-only"),
    Case("BatchNormalization", _bn_inputs(2, 3, 4), opset=15, wrt=[4], id="inference-var-only"),
    # LayerNormalization (opset 17)
    Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(4)], id="last-axis"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(3, 4), randn(3, 4)], {"axis": 1}, id="axis1"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(1, 4)], {"axis": -2, "epsilon": 1e-3},
         id="axis-2-broadcast-params"),
    Case("LayerNormalization", [randn(3, 5), randn(5)], id="no-bias"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(4)], outputs=3, id="mean-invstd-outputs"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(3, 4), randn(4)], {"axis": -2}, outputs=3,
         id="mean-invstd-outputs-axis-2"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(4)], unknown_shapes=True, id="dynamic"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(3, 4), randn(4)], {"axis": -2}, outputs=3,
         unknown_shapes=True, id="dynamic-outputs"),
    # InstanceNormalization
    Case("InstanceNormalization", [randn(2, 3, 4), randn(3), randn(3)], id="3d"),
    Case("InstanceNormalization", [randn(2, 2, 2, 3), randn(2), randn(2)], {"epsilon": 1e-3}, id="4d"),
    Case("InstanceNormalization", [randn(2, 3, 4), randn(3), randn(3)], unknown_shapes=True, id="dynamic"),
    Case("InstanceNormalization", [randn(2, 3, 2, 2), randn(3), randn(3)], opset=22, id="opset22"),
    # GroupNormalization (opset 21: (C,) parameters). stash_type=11 (double): with the default
    # stash_type=1 the float64 forward model that central differences run computes in float32.
    Case("GroupNormalization", [randn(2, 4, 3), randn(4), randn(4)], _gn(2), opset=21, id="3d"),
    Case("GroupNormalization", [randn(2, 6, 2, 2), randn(6), randn(6)], _gn(3, epsilon=1e-3), opset=21, id="4d"),
    Case("GroupNormalization", [randn(2, 4, 3), randn(4), randn(4)], _gn(1), opset=21, id="one-group"),
    Case("GroupNormalization", [randn(2, 4, 3), randn(4), randn(4)], _gn(4), opset=21, id="group-per-channel"),
    Case("GroupNormalization", [randn(3, 8), randn(8), randn(8)], _gn(2), opset=21, id="2d"),
    Case("GroupNormalization", [randn(2, 4, 3), randn(4), randn(4)], _gn(2), opset=21, unknown_shapes=True,
         id="dynamic"),
    # RMSNormalization (opset 23)
    Case("RMSNormalization", [randn(2, 3, 4), randn(4)], opset=23, id="last-axis"),
    Case("RMSNormalization", [randn(2, 3, 4), randn(3, 4)], {"axis": 1, "epsilon": 1e-3}, opset=23, id="axis1"),
    Case("RMSNormalization", [randn(2, 3, 4), randn(4)], {"axis": -2}, opset=23, id="axis-2-broadcast"),
    Case("RMSNormalization", [randn(2, 3, 4), randn(4)], opset=23, unknown_shapes=True, id="dynamic"),
    # LpNormalization
    Case("LpNormalization", [randn(3, 4)], id="p2"),
    Case("LpNormalization", [randn(3, 4)], {"p": 1}, id="p1"),
    Case("LpNormalization", [randn(3, 4, 2)], {"p": 2, "axis": 1}, opset=18, id="p2-axis1-opset18"),
    Case("LpNormalization", [randn(3, 4)], {"p": 1, "axis": 0}, opset=13, id="p1-axis0-opset13"),
    Case("LpNormalization", [randn(2, 3, 4)], {"axis": -2}, opset=22, id="p2-opset22"),
    Case("LpNormalization", [randn(2, 3, 4)], {"p": 1}, opset=22, unknown_shapes=True, id="p1-dynamic"),
    # the newest opset onnxruntime loads
    Case("BatchNormalization", _bn_inputs(2, 3, 4), opset=26, id="inference-opset26"),
    Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(4)], {"axis": -1}, opset=26, id="opset26"),
    Case("GroupNormalization", [randn(2, 4, 3), randn(4), randn(4)], _gn(2), opset=26, id="opset26"),
    Case("RMSNormalization", [randn(2, 3, 4), randn(4)], opset=26, id="opset26"),
]

# Training mode: the running statistics (outputs 1, 2) carry no gradient, so only Y is seeded.
TRAINING = [
    Case("BatchNormalization", _bn_inputs(3, 2, 4), {"training_mode": 1}, opset=15, outputs=3, id="training-3d"),
    Case("BatchNormalization", _bn_inputs(4, 3), {"training_mode": 1, "momentum": 0.8}, opset=14, outputs=3,
         id="training-2d"),
    Case("BatchNormalization", _bn_inputs(2, 2, 2, 3), {"training_mode": 1, "epsilon": 1e-3}, opset=15,
         outputs=3, id="training-4d"),
    Case("BatchNormalization", _bn_inputs(3, 2, 4), {"training_mode": 1}, opset=15, outputs=3,
         unknown_shapes=True, id="training-dynamic"),
    # BatchNormalization-9 trains when its optional outputs are there (onnxruntime: batch statistics;
    # onnx.reference cannot produce those outputs, so this case runs on onnxruntime only)
    Case("BatchNormalization", _bn_inputs(3, 2, 4), {"momentum": 0.9}, opset=13, outputs=5, id="training-opset13"),
    # momentum 0 (as onnxgrad.training.train_mode emits): the running outputs are the batch statistics, and the
    # rule reads them instead of recomputing them
    Case("BatchNormalization", _bn_inputs(2, 2, 2, 3), {"training_mode": 1, "momentum": 0.0}, opset=15,
         outputs=3, id="training-momentum0-4d"),
    Case("BatchNormalization", _bn_inputs(4, 3), {"training_mode": 1, "momentum": 0.0}, opset=14, outputs=3,
         id="training-momentum0-2d"),
    Case("BatchNormalization", _bn_inputs(3, 2, 4), {"training_mode": 1, "momentum": 0.0}, opset=15, outputs=3,
         unknown_shapes=True, id="training-momentum0-dynamic"),
    Case("BatchNormalization", _bn_inputs(3, 2, 4), {"momentum": 0.0}, opset=13, outputs=5,
         id="training-momentum0-opset13"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rule(case):
    run_case(case)


@pytest.mark.parametrize("case", TRAINING, ids=str)
def test_batch_norm_training(case, monkeypatch):
    if case.opset < 14:
        # harness.case_model types the outputs inference leaves out by a run in onnx.reference,
        # which cannot produce BatchNormalization-9's training outputs; onnxruntime can
        monkeypatch.setattr(harness, "Runner", lambda model, prefer=None: Runner(model))
    run_case(case, of=["y0"])


# GroupNormalization-18 ((G,) parameters): onnx 1.23's checker calls the op deprecated, but
# exporters still write it and runtimes run it, so onnxgrad loads such models (model.load).
GROUP_NORM_18 = [
    Case("GroupNormalization", [randn(2, 4, 3), randn(2), randn(2)], {"num_groups": 2}, opset=18, id="3d"),
    Case("GroupNormalization", [randn(2, 6, 2, 2), randn(3), randn(3)], {"num_groups": 3, "epsilon": 1e-3},
         opset=18, id="4d"),
    Case("GroupNormalization", [randn(2, 4, 3), randn(2), randn(2)], {"num_groups": 2}, opset=18,
         unknown_shapes=True, id="dynamic"),
]


@pytest.mark.parametrize("case", GROUP_NORM_18, ids=str)
def test_group_norm_18(case):
    model, feeds, wrt = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])   # accepted although onnx's checker calls the op deprecated
    r32 = check(model, gm, feeds)
    assert r32.ok(case.tol32), r32.errors
    r64 = check(model, gm, feeds, analytic_run=run_float64)
    assert r64.ok(case.tol64), r64.errors


# MeanVarianceNormalization: onnx's function body adds a float32 epsilon constant, so neither
# onnxruntime (no float64 kernel) nor onnx.reference runs the float64 forward model the harness
# differentiates numerically. The reference here is central differences of a float64 numpy MVN.
def _mvn(x, axes):
    xc = x - x.mean(axis=axes, keepdims=True)
    return xc / (np.sqrt((xc * xc).mean(axis=axes, keepdims=True)) + 1e-9)


MVN = [
    (randn(2, 3, 2, 2), None, 13),
    (randn(2, 3, 2, 2), None, 18),
    (randn(3, 5), [1], 13),
    (randn(2, 3, 4), [0, -1], 18),
]


@pytest.mark.parametrize("x, axes, opset", MVN, ids=["default-axes", "default-axes-opset18", "axes1",
                                                     "negative-axis"])
@pytest.mark.parametrize("unknown_shapes", [False, True], ids=["static", "dynamic"])
def test_mean_variance_normalization(x, axes, opset, unknown_shapes):
    attrs = {} if axes is None else {"axes": axes}
    case = Case("MeanVarianceNormalization", [x], attrs, opset=opset, unknown_shapes=unknown_shapes)
    model, feeds, _ = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=["x0"], of=["y0"])
    # with the default axes, onnx 1.23's strict shape inference fails on the forward node itself
    # (the function body's Constant<value_ints=@axes> gets no value), so full_check only with axes
    onnx.checker.check_model(gm, full_check=axes is not None)
    seed = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    dx = Runner(gm)({"x0": x, "y0_grad": seed}, ["x0_grad"])["x0_grad"]

    ax = tuple(a % x.ndim for a in (axes or [0, 2, 3]))
    x64, s64 = x.astype(np.float64), seed.astype(np.float64)
    numeric = np.zeros_like(x64)
    for j in range(x.size):
        e = np.zeros_like(x64)
        e.flat[j] = 1e-6
        numeric.flat[j] = np.sum(s64 * (_mvn(x64 + e, ax) - _mvn(x64 - e, ax))) / 2e-6
    err = np.max(np.abs(dx - numeric)) / np.max(np.abs(numeric))
    assert err < 2e-3, err


# float16 inputs: stage one (the statistics and dx) runs in the stash type, float32; the
# gradients must match those of the same model in float32 to float16 precision.
HALF = [
    Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(4)], outputs=3, id="layer-norm"),
    Case("RMSNormalization", [randn(2, 3, 4), randn(4)], opset=23, id="rms-norm"),
    Case("GroupNormalization", [randn(2, 4, 3), randn(4), randn(4)], {"num_groups": 2}, opset=21, id="group-norm"),
]


@pytest.mark.parametrize("case", HALF, ids=str)
def test_float16_stash(case):
    model, feeds, wrt = harness.case_model(case)
    of = [o.name for o in model.graph.output]
    gm = onnxgrad.grad(model, wrt=wrt, of=of)
    half = _to_float16(model)
    ghalf = onnxgrad.grad(half, wrt=wrt, of=of)
    onnx.checker.check_model(ghalf, full_check=True)
    rng = np.random.default_rng(0)
    seeds = {f"{o}_grad": rng.standard_normal(v.shape).astype(np.float32)
             for o, v in Runner(model)(feeds).items()}
    names = [f"{w}_grad" for w in wrt]
    want = Runner(gm)({**feeds, **seeds}, names)
    halved = {k: v.astype(np.float16) for k, v in {**feeds, "y0_grad": seeds["y0_grad"]}.items()}
    got = Runner(ghalf)({**seeds, **halved}, names)
    for name in names:
        assert got[name].dtype == np.float16
        err = np.max(np.abs(got[name] - want[name])) / np.max(np.abs(want[name]))
        assert err < 2e-2, (name, err)


def _to_float16(model):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in list(m.graph.input) + [m.graph.output[0]]:  # LayerNormalization's statistics stay float32
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    return m


def test_layer_norm_backward_full_size_passes():
    """dx, dscale and dB of LayerNormalization are the shared standardize formula, 9 full-size elementwise
    ops: xc = x - Mean, xhat = xc * inv, g = dy * scale, g - mean(g), g * xhat, xhat * mean(g * xhat), the
    Sub, inv * (...), and dy * xhat for dscale (the statistics are the forward's outputs, not recomputed)."""
    case = Case("LayerNormalization", [randn(2, 3, 4), randn(4), randn(4)])
    model, feeds, wrt = harness.case_model(case)
    gm = onnx.shape_inference.infer_shapes(onnxgrad.grad(model, wrt=wrt, of=["y0"]))
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in list(gm.graph.value_info) + list(gm.graph.input) + list(gm.graph.output)}
    full = [node.name for node in gm.graph.node
            if node.op_type in ("Add", "Sub", "Mul", "Div") and shapes.get(node.output[0]) == [2, 3, 4]]
    assert len(full) == 9, full
    assert check(model, gm, feeds).ok(1e-3)


def test_batch_norm_training_reads_the_batch_statistics():
    """With momentum 0 the rule takes the mean and variance from the node's running outputs: its
    backward computes no statistic of x again (no ReduceMean), only the two sums dB and dscale."""
    case = next(c for c in TRAINING if c.id == "training-momentum0-4d")
    model, _, _ = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=["x0"], of=["y0"])
    backward = [n.op_type for n in gm.graph.node[len(model.graph.node):]]
    assert "ReduceMean" not in backward and backward.count("ReduceSum") == 2, backward


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_float64_with_float32_statistics_is_exact(axis):
    """float64 x with the default float32 stash_type: onnxruntime normalises in float64 and rounds only the
    Mean/InvStdDev outputs, so the rule recomputes the statistics in float64; from the rounded outputs dx was
    off by about 1e-8 of its size. Checked against float64 central differences in onnxruntime to 1e-8."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4, 5))
    norm = x.shape[axis if axis >= 0 else 3 + axis:]
    scale, bias, seed = rng.standard_normal(norm), rng.standard_normal(norm), rng.standard_normal(x.shape)
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=axis)], "ln64",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, list(x.shape))],
        [numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    gm = onnxgrad.grad(model, wrt=["x", "scale"], of=["y"])
    run = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in run.get_outputs()], run.run(None, {"x": x, "y_grad": seed})))
    forward = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    h, numeric = 1e-6, np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[i] += h
        down[i] -= h
        numeric[i] = ((forward.run(None, {"x": up})[0] - forward.run(None, {"x": down})[0]) * seed).sum() / (2 * h)
    assert np.abs(got["x_grad"] - numeric).max() <= 1e-8 * np.abs(numeric).max()
