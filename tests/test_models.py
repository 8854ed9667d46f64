"""Whole models: gradients of models exported from PyTorch against PyTorch's autograd,
and the gradient graphs of the eight CNNs shipped with the onnx package.

The models and reference gradients in models/ were written by models/export.py
(which needs torch); these tests need only onnx and onnxruntime.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxgrad
from onnxgrad.tools.check import Runner, check, gradient_spec, random_inputs, to_float64

MODELS = Path(__file__).resolve().parent.parent / "models"
# every exported model is an .onnx with its .npz of PyTorch references (other .onnx files, such as
# the <stem>.grad.onnx the README's first command writes beside a model, are not fixtures)
EXPORTED = sorted(p.stem for p in MODELS.glob("*.npz"))
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
LIGHT_MODELS = sorted(p.stem[len("light_"):] for p in LIGHT.glob("light_*.onnx"))

REL_L2 = 1e-3      # float32 gradient graph vs PyTorch float64 autograd, per tensor


# -- helpers ---------------------------------------------------------------------------
class Exported:
    """One model of models/ with its inputs, seeds (or loss) and PyTorch's gradients."""

    def __init__(self, stem: str):
        self.stem = stem
        self.model = onnx.load(str(MODELS / f"{stem}.onnx"))
        with np.load(MODELS / f"{stem}.npz") as z:
            data = {k: z[k] for k in z.files}
        part = lambda prefix: {k[len(prefix):]: v for k, v in data.items() if k.startswith(prefix)}  # noqa: E731
        self.inputs = part("input/")
        self.outputs = part("output/")
        self.seeds = part("seed/")
        self.grads = part("grad/")
        self.loss = str(data["loss"]) if "loss" in data else None

    def grad_model(self) -> onnx.ModelProto:
        wrt = list(self.grads)
        if self.loss:
            return onnxgrad.grad(self.model, wrt=wrt, loss=self.loss)
        return onnxgrad.grad(self.model, wrt=wrt, of=list(self.seeds))

    def feeds(self, gm: onnx.ModelProto) -> dict[str, np.ndarray]:
        seeds = gradient_spec(gm)["seeds"]
        feeds = dict(self.inputs)
        feeds.update({seeds[o]: v for o, v in self.seeds.items()})
        return feeds


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = _session(model)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def _rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


def _compare(ex: Exported, gm: onnx.ModelProto, values: dict[str, np.ndarray]) -> None:
    names = gradient_spec(gm)["gradients"]
    errors = {}
    for w, ref in ex.grads.items():
        got = values[names[w]]
        assert got.shape == ref.shape, f"{ex.stem}: gradient of '{w}' has shape {got.shape}, PyTorch's {ref.shape}"
        errors[w] = _rel_l2(got, ref)
    bad = {w: f"{e:.2e}" for w, e in errors.items() if not e <= REL_L2}
    assert not bad, f"{ex.stem}: relative L2 error above {REL_L2} (of {len(errors)} tensors): {bad}"


_GRAD_MODELS: dict[str, onnx.ModelProto] = {}


def _grad_model(ex: Exported) -> onnx.ModelProto:
    """Each gradient model is built once per session (several tests read it)."""
    if ex.stem not in _GRAD_MODELS:
        _GRAD_MODELS[ex.stem] = ex.grad_model()
    return _GRAD_MODELS[ex.stem]


# -- onnx.reference, as the spec says ---------------------------------------------------------
# The numeric checker runs float64 models in onnx.reference wherever onnxruntime has no
# float64 kernel (Conv, LSTM, ...), with the core's corrected kernels (onnxgrad.tools.check.kernels:
# Erf, Gelu, LRN, LayerNormalization, BatchNormalization-9...).
def test_reference_kernels_follow_the_spec():
    """The kernels the numeric checks rely on, in float64, against the formulas of the spec."""
    from onnx import helper

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 6, 3, 3)) * 3
    p = {k: rng.uniform(0.5, 1.5, 6) for k in "sbmv"}
    sq = np.stack([np.sum(x[:, max(0, k - 1):k + 2] ** 2, axis=1) for k in range(6)], axis=1)
    r = lambda t: t.reshape(-1, 1, 1)  # noqa: E731
    cases = [
        (helper.make_node("LRN", ["x"], ["y"], size=3, alpha=0.125, beta=0.75, bias=1.0), {},
         x / (1.0 + 0.125 / 3 * sq) ** 0.75),   # attributes are float32: exact values
        (helper.make_node("Erf", ["x"], ["y"]), {}, np.vectorize(math.erf)(x)),
        (helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=2.0**-16), p,
         r(p["s"]) * (x - r(p["m"])) / np.sqrt(r(p["v"]) + 2.0**-16) + r(p["b"])),
    ]
    for node, params, want in cases:
        inputs = [helper.make_tensor_value_info(k, onnx.TensorProto.DOUBLE, None) for k in ["x", *params]]
        graph = helper.make_graph([node], "t", inputs, [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        got = Runner(model, runtime="reference", reason="the corrected kernels under test")({"x": x, **params})["y"]
        # 1e-7: the core's LRN divides alpha by size in float32 (the attribute's type): 1.7e-8 off
        np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-12, err_msg=node.op_type)


# -- models exported from PyTorch ---------------------------------------------------------
def test_exported_models_present():
    # mlp, mlp_ce, cnn, gpt, gpt_sdpa, lstm, each from both exporters
    families = {s.rsplit("_", 1)[0] for s in EXPORTED}
    assert {"mlp", "mlp_ce", "cnn", "gpt", "gpt_sdpa", "lstm"} <= families
    assert all((MODELS / f"{s}.onnx").exists() for s in EXPORTED)


def _reference64(model: onnx.ModelProto) -> Callable[[dict], dict]:
    """The float64 model in onnx.reference, with the core's exact kernels."""
    return Runner(to_float64(model), runtime="reference", reason="the float64 truth with the corrected kernels")


@pytest.mark.parametrize("stem", EXPORTED)
def test_stored_gradients_are_those_of_the_onnx_model(stem):
    """The reference itself, independently of onnxgrad: PyTorch's gradients (re-keyed to the
    ONNX initializers, folded and re-packed as the exporters did) are directional derivatives
    of the exported float64 ONNX model, by central differences."""
    ex = Exported(stem)
    wrt = list(ex.grads)
    m = onnx.ModelProto()
    m.CopyFrom(ex.model)
    g = m.graph
    for init in list(g.initializer):
        if init.name in ex.grads:
            g.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
            g.initializer.remove(init)
    start = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in ex.model.graph.initializer}
    point = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in ex.inputs.items()}
    point.update({w: start[w] for w in wrt if w in start})
    run = _reference64(m)
    seeds = {k: v.astype(np.float64) for k, v in ex.seeds.items()}

    def objective(values):
        out = run(values)
        return float(np.sum(out[ex.loss])) if ex.loss else float(sum(np.sum(s * out[o]) for o, s in seeds.items()))

    rng = np.random.default_rng(0)
    errors = {}
    for w in wrt:
        u = rng.standard_normal(point[w].shape)
        h = 1e-7 * max(1.0, float(np.max(np.abs(point[w]))))   # small: ReLU and MaxPool kinks
        num = (objective({**point, w: point[w] + h * u}) - objective({**point, w: point[w] - h * u})) / (2 * h)
        an = float(np.sum(ex.grads[w] * u))
        errors[w] = abs(an - num) / (max(abs(an), abs(num)) + 1e-6)
    bad = {w: f"{e:.1e}" for w, e in errors.items() if not e < 1e-5}
    assert not bad, f"{stem}: stored gradients disagree with finite differences: {bad}"


@pytest.mark.parametrize("stem", EXPORTED)
def test_gradients_match_pytorch(stem):
    ex = Exported(stem)
    gm = _grad_model(ex)
    onnx.checker.check_model(gm, full_check=True)
    values = _run(gm, ex.feeds(gm))
    for name, want in ex.outputs.items():     # the forward part is unchanged
        np.testing.assert_allclose(values[name], want, rtol=1e-4, atol=1e-5)
    _compare(ex, gm, values)


@pytest.mark.parametrize("stem", [s for s in EXPORTED if s.startswith("mlp")])
def test_mlp_gradient_in_reference_evaluator(stem):
    ex = Exported(stem)
    gm = _grad_model(ex)
    ref = ReferenceEvaluator(gm)
    names = [o.name for o in gm.graph.output]
    values = dict(zip(names, ref.run(None, ex.feeds(gm))))
    _compare(ex, gm, values)


@pytest.mark.parametrize("stem", [s for s in EXPORTED if s.startswith(("mlp_", "cnn_"))])
def test_numeric_check(stem):
    """Central differences of the float64 forward model agree with the float32 gradient graph."""
    ex = Exported(stem)
    gm = _grad_model(ex)
    r = check(ex.model, gm, ex.inputs, rng=0, max_elements=16, directions=3)
    assert set(r.errors) == set(ex.grads)
    assert r.ok(2e-3), f"{stem}: numeric check errors {r.errors}"


def test_gradient_of_gradient_mlp():
    """grad(grad(m)): the backward graph is itself differentiable (a Hessian-vector product)."""
    ex = Exported("mlp_legacy")
    gm = _grad_model(ex)
    spec = gradient_spec(gm)
    w = "fc1.weight"
    g = spec["gradients"][w]
    ggm = onnxgrad.grad(gm, wrt=[w], of=[g])
    onnx.checker.check_model(ggm, full_check=True)
    # d/dW1 <v, dL/dW1> against central differences of the gradient model in float32 is
    # too noisy; the float64 numeric checker differentiates the gradient graph itself
    feeds = ex.feeds(gm)
    r = check(gm, ggm, feeds, rng=1, max_elements=0, directions=3)
    assert r.ok(2e-3), f"Hessian-vector product errors {r.errors}"


# -- the eight architectures shipped with onnx ---------------------------------------------
def _light(name: str) -> onnx.ModelProto:
    return onnx.load(str(LIGHT / f"light_{name}.onnx"))


def _weights_of(model: onnx.ModelProto) -> list[str]:
    """Outputs of the float ConstantOfShape nodes: these models' weights."""
    return [n.output[0] for n in model.graph.node
            if n.op_type == "ConstantOfShape" and _float_value(n)]


def _float_value(node: onnx.NodeProto) -> bool:
    for a in node.attribute:
        if a.name == "value":
            return a.t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
    return True


def _data_input(model: onnx.ModelProto) -> str:
    inits = {i.name for i in model.graph.initializer}
    used = {x for n in model.graph.node for x in n.input}
    (name,) = [i.name for i in model.graph.input if i.name not in inits and i.name in used
               and i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    return name


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_gradient_graph(name):
    """w.r.t. the image and every weight: builds, passes the full checker, runs in onnxruntime."""
    model = _light(name)
    data = _data_input(model)
    weights = _weights_of(model)
    assert len(weights) >= 8
    out = model.graph.output[0].name
    gm = onnxgrad.grad(model, wrt=[data] + weights, of=[out])
    onnx.checker.check_model(gm, full_check=True)
    feeds = random_inputs(gm, 0)     # the image and the seed of the output
    values = _run(gm, feeds)
    names = gradient_spec(gm)["gradients"]
    shapes = _run_shapes(model, weights, feeds)
    assert values[names[data]].shape == feeds[data].shape
    for w in weights:
        g = values[names[w]]
        assert g.shape == shapes[w], f"{name}: gradient of '{w}' has shape {g.shape}, the weight {shapes[w]}"
        assert np.all(np.isfinite(g)), f"{name}: gradient of '{w}' is not finite"
    # the weights are constant (0.02), so the logits are equal and the softmax output is flat:
    # the seed still reaches the last layer's weights
    assert any(np.any(values[names[w]] != 0) for w in weights)


def _run_shapes(model: onnx.ModelProto, names: list[str], feeds: dict) -> dict[str, tuple]:
    return {k: v.shape for k, v in _run_outputs(model, names, feeds).items()}


def _randomized(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """The model with its constant weights (ConstantOfShape of 0.02) replaced by random initializers.

    With equal weights every class gets the same logit, the softmax is flat and the
    gradient w.r.t. the image is exactly zero: nothing to check numerically. Weights get
    He initialisation; BN scales and variances U(0.5, 1.5), other 1-D tensors N(0, 0.1^2);
    the last Conv/Gemm is scaled so that the logits have unit spread (a saturated softmax
    has no gradient to check).
    """
    rng = np.random.default_rng(seed)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    shapes = _run_shapes(model, _weights_of(model), random_inputs(model, 0))
    positive = {n.input[i] for n in g.node if n.op_type == "BatchNormalization" for i in (1, 4)}
    keep = []
    for node in g.node:
        out = node.output[0] if node.output else None
        if node.op_type == "ConstantOfShape" and out in shapes:
            shape = shapes[out]
            if len(shape) >= 2:
                value = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:]))
            elif out in positive:
                value = rng.uniform(0.5, 1.5, shape)
            else:
                value = rng.standard_normal(shape) * 0.1
            g.initializer.append(numpy_helper.from_array(value.astype(np.float32), out))
            if m.ir_version < 4:
                g.input.append(onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, list(shape)))
        else:
            keep.append(node)
    del g.node[:]
    g.node.extend(keep)

    last = _layers(m)[-1]
    softmax = [n for n in g.node if n.op_type == "Softmax"]
    logits = softmax[-1].input[0] if softmax else g.output[0].name
    values = _run_outputs(m, [logits], random_inputs(m, 1))[logits]
    factor = 1.0 / float(np.std(values))     # what follows the last layer is positively homogeneous
    inits = {i.name: i for i in g.initializer}
    for name in last.input[1:]:
        t = inits[_source(m, name)]
        t.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(t) * factor).astype(np.float32), t.name))
    return m


def _source(model: onnx.ModelProto, name: str) -> str:
    """The initializer a layer's weight comes from (through Reshape, as in Inception v1)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    while name in producer and producer[name].op_type in ("Reshape", "Identity"):
        name = producer[name].input[0]
    return name


def _layers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type in ("Conv", "Gemm")]


def _run_outputs(model: onnx.ModelProto, names: list[str], feeds: dict) -> dict[str, np.ndarray]:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    return _run(m, feeds)


# The float64 forward runs in onnx.reference (onnxruntime has no float64 Conv), slowly: each
# numeric check below costs 8-15 s on 2 cores (squeezenet, resnet50, alexnet, shufflenet);
# those of the others 20-70 s (reference MaxPool, multi-hundred-MB float64 copies of VGG's
# and ZFNet's FC weights): they run on request only (all six pass: 3.5 min).
NUMERIC_LIGHT = ["squeezenet", "resnet50", "bvlc_alexnet", "shufflenet"]
FIRST_LAYER = {"squeezenet", "bvlc_alexnet", "shufflenet"}     # shallow enough to check the first conv
SLOW = not os.environ.get("ONNXGRAD_SLOW_TESTS")
NUMERIC_LIGHT_PARAMS = [n if n in NUMERIC_LIGHT else pytest.param(n, marks=pytest.mark.skipif(
    SLOW, reason="20-70 s each; set ONNXGRAD_SLOW_TESTS=1")) for n in LIGHT_MODELS]


@pytest.mark.parametrize("name", NUMERIC_LIGHT_PARAMS)
def test_light_model_numeric_check(name):
    """The image, the first (a middle) layer's and the last layer's weights, one random direction each."""
    # at opset 13, as grad() sees it: onnx.reference's Softmax-1/11 ignores the opset < 13
    # semantics (flatten to 2-D from axis), so the original opset 9 model would run wrong there
    model = _randomized(onnxgrad.ir.load.load(_light(name)))
    layers = _layers(model)
    # In the deeper models the first 224x224 conv's weight gradient sums 12k positions
    # after ~60 float32 layers: its error is ~2e-5 of its norm, which a random direction in
    # 9408 dims turns into 2e-3..2e-2 of the directional derivative (Inception v1; ResNet-50:
    # 2.2e-3, since its He-initialised weights are no longer overridden by random graph inputs,
    # as they were while IR-3 models kept their initializers listed as inputs; central
    # differences agree to 4 digits for h = 1e-4..1e-7). A middle layer has no such sums.
    first = layers[0] if name in FIRST_LAYER else layers[len(layers) // 2]
    wrt = [_data_input(model), _source(model, first.input[1]), _source(model, layers[-1].input[1])]
    out = model.graph.output[0].name
    gm = onnxgrad.grad(model, wrt=wrt, of=[out])
    feeds = random_inputs(model, 1)
    r = check(model, gm, feeds, rng=2, max_elements=0, directions=1)
    assert r.ok(2e-3), f"{name}: numeric check errors {r.errors}"
