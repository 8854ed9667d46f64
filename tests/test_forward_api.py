"""jvp on whole models (the duality <u, J v> = <J^T u, v> with grad), its names, errors and CLI;
forward-over-reverse HVPs against reverse-over-reverse and finite differences; full Jacobians and
Hessians against torch.func (references in models/jacobians/mlp.npz, written by models/export_jacobians.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxgrad
from harness import make_model, randn
from onnxgrad import losses
from onnxgrad.passes.forward import jvp, tangent_spec
from onnxgrad.passes.funcs import hessian, hvp, jacfwd, jacobian, jacobian_spec, jacrev
from onnxgrad.tools.check import Runner, gradient_spec, run_float64
from onnxgrad.tools.check.jvp import check_jvp
from onnxgrad.tools.cli import run_jvp
from test_models import EXPORTED, Exported

MODELS = Path(__file__).resolve().parent.parent / "models"


def _initial(ex: Exported, name: str) -> np.ndarray:
    if name in ex.inputs:
        return ex.inputs[name]
    return next(onnx.numpy_helper.to_array(i) for i in ex.model.graph.initializer if i.name == name)


def _check_graph(m: onnx.ModelProto) -> None:
    onnx.checker.check_model(m, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in m.graph.node)


# -- jvp on every exported model: <u, J v> = <J^T u, v> ------------------------------------------
@pytest.mark.parametrize("stem", EXPORTED)
def test_jvp_is_the_transpose_of_grad(stem):
    ex = Exported(stem)
    of = [ex.loss] if ex.loss else list(ex.seeds)
    wrt = list(ex.grads)
    jm = jvp(ex.model, wrt, of)
    _check_graph(jm)
    spec = tangent_spec(jm)
    rng = np.random.default_rng(3)
    v = {w: rng.standard_normal(_initial(ex, w).shape).astype(np.float32) for w in wrt}
    out = Runner(jm)({**ex.inputs, **{spec["tangent_inputs"][w]: v[w] for w in wrt}})
    assert Runner(jm).backend == "onnxruntime"
    gm = ex.grad_model()
    gs = gradient_spec(gm)
    u = {o: np.ones_like(out[o]) if ex.loss else rng.standard_normal(out[o].shape).astype(np.float32) for o in of}
    feeds = dict(ex.inputs)
    feeds.update({gs["seeds"][o]: u[o] for o in of if o in gs["seeds"]})
    back = Runner(gm)(feeds)
    lhs = sum(float(np.sum(u[o].astype(np.float64) * out[spec["tangents"][o]])) for o in of)
    rhs = sum(float(np.sum(back[gs["gradients"][w]].astype(np.float64) * v[w])) for w in wrt)
    assert abs(lhs - rhs) <= 1e-5 * max(abs(rhs), 1.0), f"{stem}: <u, Jv> = {lhs}, <J^T u, v> = {rhs}"


@pytest.mark.parametrize("stem", ["mlp_dynamo", "cnn_dynamo", "gpt_dynamo", "lstm_dynamo"])
def test_jvp_matches_central_differences_on_models(stem):
    ex = Exported(stem)
    wrt = list(ex.grads)[:3]
    jm = jvp(ex.model, wrt)
    errors, _ = check_jvp(ex.model, jm, ex.inputs, run=run_float64)
    assert all(e <= 1e-5 for e in errors.values()), errors


# -- names, metadata, errors ---------------------------------------------------------------------
def _tiny() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["y"]),
             helper.make_node("ArgMax", ["y"], ["k"], axis=1)]
    W = onnx.numpy_helper.from_array(randn(4, 3), "W")
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                       helper.make_tensor_value_info("k", TensorProto.INT64, [2])], [W])


def test_names_and_metadata():
    jm = jvp(_tiny(), ["x", "W"], ["y"])
    assert [i.name for i in jm.graph.input] == ["x", "x_tangent", "W_tangent"]
    assert [o.name for o in jm.graph.output] == ["y", "k", "y_tangent"]
    assert tangent_spec(jm) == {"tangent_inputs": {"x": "x_tangent", "W": "W_tangent"}, "tangents": {"y": "y_tangent"}}
    assert all(n.name.startswith(("MatMul", "Tanh", "node", "ArgMax")) or "/jvp/" in n.name for n in jm.graph.node)


def test_tangent_at_an_intermediate_tensor_adds_to_the_flow():
    """wrt h (intermediate) and x: y_tangent = tanh'(h) (x_tangent W + h_tangent), as grad's total gradients."""
    jm = jvp(_tiny(), ["x", "h"], ["y"])
    assert jm.graph.initializer[0].name == "W"
    x, vx, vh = randn(2, 4), randn(2, 4), randn(2, 3)
    out = Runner(jm)({"x": x, "x_tangent": vx, "h_tangent": vh})
    W = onnx.numpy_helper.to_array(jm.graph.initializer[0])
    h = x @ W
    np.testing.assert_allclose(out["y_tangent"], (1 - np.tanh(h) ** 2) * (vx @ W + vh), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"wrt": ["nope"]}, onnxgrad.UnknownNameError, "wrt 'nope'"),
    ({"wrt": ["x"], "of": ["h"]}, onnxgrad.UnknownNameError, "not an output"),
    ({"wrt": ["x"], "of": ["k"]}, onnxgrad.NonFloatError, "not a floating-point"),
    ({"wrt": []}, onnxgrad.UnknownNameError, "needs wrt"),
])
def test_user_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        jvp(_tiny(), **kwargs)


def _two_branches() -> onnx.ModelProto:
    """y = tanh(x) [3]; w = floor(z) * z [n, 3] (symbolic n); d = Cast(z) to float64: y alone depends on x,
    and z reaches w and d only."""
    nodes = [helper.make_node("Tanh", ["x"], ["y"]), helper.make_node("Floor", ["z"], ["f"]),
             helper.make_node("Mul", ["f", "z"], ["w"]), helper.make_node("Cast", ["z"], ["d"], to=TensorProto.DOUBLE)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
                              helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3]),
                       helper.make_tensor_value_info("w", TensorProto.FLOAT, ["n", 3]),
                       helper.make_tensor_value_info("d", TensorProto.DOUBLE, ["n", 3])])


def test_unused_directions_and_outputs_follow_torch_func():
    """As torch.func.jvp: an output no direction reaches has zero tangent, of its type and its run-time shape,
    and a direction that reaches no output is fine. allow_unused=False is the strict check."""
    m = _two_branches()
    jm = jvp(m, ["x"])
    _check_graph(jm)
    feeds = {"x": randn(3), "z": randn(5, 3), "x_tangent": randn(3)}
    out = Runner(jm)(feeds)
    np.testing.assert_allclose(out["y_tangent"], (1 - np.tanh(feeds["x"]) ** 2) * feeds["x_tangent"], rtol=1e-5)
    for y, dtype in (("w", np.float32), ("d", np.float64)):
        t = out[f"{y}_tangent"]
        assert t.dtype == dtype and t.shape == (5, 3) and not t.any(), y
    types = {o.name: o.type.tensor_type for o in jm.graph.output}
    assert types["d_tangent"].elem_type == TensorProto.DOUBLE
    assert [d.dim_param or d.dim_value for d in types["w_tangent"].shape.dim] == ["n", 3]
    jz = jvp(m, ["x", "z"], ["y"])                  # z's direction reaches no output through a derivative
    out = Runner(jz)({**feeds, "z_tangent": randn(5, 3)})
    np.testing.assert_allclose(out["y_tangent"], (1 - np.tanh(feeds["x"]) ** 2) * feeds["x_tangent"], rtol=1e-5)
    errors, _ = check_jvp(m, jm, {"x": feeds["x"], "z": feeds["z"]}, run=run_float64)
    assert all(e <= 1e-8 for e in errors.values()), errors
    with pytest.raises(onnxgrad.UnusedError, match="wrt 'z'"):
        jvp(m, ["x", "z"], ["y"], allow_unused=False)
    with pytest.raises(onnxgrad.UnusedError, match="output 'w'"):
        jvp(m, ["x"], allow_unused=False)


def test_unsupported_op():
    custom = make_model([helper.make_node("Foo", ["x"], ["y"], domain="my.domain")],
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    custom.opset_import.add(domain="my.domain", version=1)
    with pytest.raises(onnxgrad.UnsupportedOpError, match="Foo.*custom domain"):
        jvp(custom, ["x"])


def test_cli(tmp_path, capsys):
    src = tmp_path / "tiny.onnx"
    onnx.save(_tiny(), src)
    assert run_jvp([str(src), "--wrt", "x", "W", "--of", "y", "--check"]) == 0
    text = capsys.readouterr().out
    assert "tiny.jvp.onnx" in text and "tangent output y_tangent [2, 3]" in text and "worst relative error" in text
    assert tangent_spec(onnx.load(tmp_path / "tiny.jvp.onnx"))["tangents"] == {"y": "y_tangent"}
    import onnxgrad.tools.cli as cli

    assert cli.main(["jvp", str(src), "--wrt", "nope"]) == 2
    assert "error: wrt 'nope'" in capsys.readouterr().err
    two = tmp_path / "two.onnx"
    onnx.save(_two_branches(), two)
    assert cli.main(["jvp", str(two), "--wrt", "x", "--check"]) == 0      # zeros, as jvp's default
    assert "w_tangent: worst relative error 0.00e+00" in capsys.readouterr().out
    assert cli.main(["jvp", str(two), "--wrt", "x", "z", "--of", "y"]) == 0
    assert "direction input z_tangent [n, 3]" in capsys.readouterr().out
    assert cli.main(["jvp", str(two), "--wrt", "x", "--no-allow-unused"]) == 2
    assert capsys.readouterr().err.startswith("error: output 'w' does not depend on x")


# -- composition ---------------------------------------------------------------------------------
def _mlp_loss() -> tuple[onnx.ModelProto, dict]:
    ex = Exported("mlp_dynamo")
    m = losses.mse_loss(ex.model, output="y", target="t")
    feeds = {"x": ex.inputs["x"], "t": np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)}
    return m, feeds


def test_grad_of_jvp():
    """grad(jvp(m)): the gradient of <w, J v> with respect to the parameters, against differences."""
    m, feeds = _mlp_loss()
    jm = jvp(m, ["fc1.weight"], ["loss"])
    spec = tangent_spec(jm)
    gjm = onnxgrad.grad(jm, wrt=["fc2.weight", "fc1.bias"], loss=spec["tangents"]["loss"])
    _check_graph(gjm)
    feeds[spec["tangent_inputs"]["fc1.weight"]] = randn(32, 16)
    r = onnxgrad.tools.check.check(jm, gjm, feeds)
    assert r.ok(1e-3), r.errors


@pytest.mark.parametrize("stem", ["mlp_dynamo", "gpt_dynamo"])
def test_hvp_forward_over_reverse(stem):
    """hvp = jvp(grad(m)) against grad(grad(m)) (reverse over reverse) and central differences of the gradient."""
    ex = Exported(stem)
    out_name = "y" if stem == "mlp_dynamo" else "logits"
    m = losses.mse_loss(ex.model, output=out_name, target="t")
    shape = ex.outputs[out_name].shape
    feeds = {**ex.inputs, "t": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    wrt = list(ex.grads)[:4]
    wrt = [w for w in wrt if w not in ex.inputs or ex.inputs[w].dtype.kind == "f"]
    hm = hvp(m, wrt, loss="loss")
    _check_graph(hm)
    spec = tangent_spec(hm)
    rng = np.random.default_rng(2)
    v = {w: rng.standard_normal(_initial(ex, w).shape).astype(np.float32) for w in wrt}
    f_feeds = {**feeds, **{spec["tangent_inputs"][w]: v[w] for w in wrt}}
    hv = Runner(hm)(f_feeds)
    names = {p.key: p.value for p in hm.metadata_props}
    hv_names = json.loads(names["onnxgrad.hvp"])
    # reverse over reverse: grad of <grad L, v> with respect to wrt
    gm = onnxgrad.grad(m, wrt=wrt, loss="loss")
    grads = gradient_spec(gm)["gradients"]
    rr = onnxgrad.grad(gm, wrt=wrt, of=[grads[w] for w in wrt])
    rs = gradient_spec(rr)
    r_feeds = {**feeds, **{rs["seeds"][grads[w]]: v[w] for w in wrt}}
    hv_rr = Runner(rr)(r_feeds)
    for w in wrt:
        a, b = hv[hv_names[w]], hv_rr[rs["gradients"][w]]
        assert np.linalg.norm(a - b) <= 1e-4 * max(np.linalg.norm(b), 1e-6), w
    # central differences of the gradient along v (float64)
    g64 = onnxgrad.tools.check.to_float64(gm)
    run = Runner(onnxgrad.tools.check._as_inputs(g64, wrt))
    base = {k: np.asarray(x, np.float64) if x.dtype.kind == "f" else x for k, x in feeds.items()}
    h = 1e-5

    def at(s: float):
        p = dict(base)
        p.update({w: _initial(ex, w).astype(np.float64) + s * h * v[w] for w in wrt})
        return run(p, [grads[w] for w in wrt])

    plus, minus = at(1.0), at(-1.0)
    for w in wrt:
        num = (plus[grads[w]] - minus[grads[w]]) / (2 * h)
        assert np.linalg.norm(hv[hv_names[w]] - num) <= 1e-3 * max(np.linalg.norm(num), 1e-6), w


# -- Jacobians and Hessians against torch.func -------------------------------------------------
@pytest.fixture(scope="module")
def torch_refs() -> dict[str, np.ndarray]:
    with np.load(MODELS / "jacobians" / "mlp.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("build, ref", [(jacrev, "jacrev"), (jacfwd, "jacfwd")])
def test_jacobian_matches_torch_func(build, ref, torch_refs):
    jm = build(MODELS / "mlp_dynamo.onnx", ["x"], ["y"])
    _check_graph(jm)
    assert sum(n.op_type == "Loop" for n in jm.graph.node) == 1
    out = Runner(jm)({"x": torch_refs["input/x"]})
    J = out[jacobian_spec(jm)["y"]["x"]]
    want = torch_refs[f"{ref}/y/x"]
    assert J.shape == want.shape == (8, 4, 8, 16)
    np.testing.assert_allclose(J, want, rtol=1e-4, atol=1e-5)


def test_jacobian_of_several_tensors_both_modes_agree():
    m = losses.mse_loss(MODELS / "mlp_dynamo.onnx", output="y", target="t")
    feeds = {"x": randn(8, 16), "t": randn(8, 4)}
    rev = jacobian(m, ["fc3.bias", "x"], ["y", "loss"], mode="rev")
    fwd = jacobian(m, ["fc3.bias", "x"], ["y", "loss"], mode="fwd")
    a, b = Runner(rev)(feeds), Runner(fwd)(feeds)
    for y, row in jacobian_spec(rev).items():
        for x, name in row.items():
            np.testing.assert_allclose(a[name], b[jacobian_spec(fwd)[y][x]], rtol=1e-4, atol=1e-6)
    assert a[jacobian_spec(rev)["y"]["fc3.bias"]].shape == (8, 4, 4)
    assert a[jacobian_spec(rev)["loss"]["x"]].shape == (8, 16)


def test_hessian_matches_torch_func(torch_refs):
    wrt = ["mlp.fc2.bias", "mlp.fc3.bias"]
    hm = hessian(MODELS / "mlp_ce_dynamo.onnx", wrt, loss="loss")
    _check_graph(hm)
    out = Runner(hm)({"x": torch_refs["ce_input/x"], "target": torch_refs["ce_input/target"]})
    spec = {p.key: p.value for p in hm.metadata_props}
    blocks = json.loads(spec["onnxgrad.hessian"])
    for a in wrt:
        for b in wrt:
            np.testing.assert_allclose(out[blocks[a][b]], torch_refs[f"hessian/{a}/{b}"], rtol=1e-4, atol=1e-6)


def test_unused_tensors_give_zero_blocks_in_the_torch_func_family():
    """y = tanh(a x), c = 2 b, loss = sum(y^2), with b reaching neither y nor the loss: the blocks with b (and
    dc/dx) are zeros of their shapes, as torch.func's; allow_unused=False is the strict check."""
    a = np.array([0.5, -1.0, 2.0], np.float32)
    nodes = [helper.make_node("Mul", ["x", "a"], ["ax"]), helper.make_node("Tanh", ["ax"], ["y"]),
             helper.make_node("Add", ["b", "b"], ["c"]), helper.make_node("Mul", ["y", "y"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    m = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("y", [3]), ("c", [2]),
                                                                                         ("loss", []))],
                   [onnx.numpy_helper.from_array(a, "a"), onnx.numpy_helper.from_array(randn(2), "b")])
    x, v = randn(3), randn(3)
    t = np.tanh(a * x)
    dy_dx = np.diag(a * (1 - t * t))
    d2 = 2 * a * a * (1 - t * t) * (1 - 3 * t * t)              # the Hessian of the loss in x is diagonal
    for build in (jacfwd, jacrev):
        jm = build(m, ["x", "b"], ["y", "c"])
        _check_graph(jm)
        out, spec = Runner(jm)({"x": x}), jacobian_spec(jm)
        np.testing.assert_allclose(out[spec["y"]["x"]], dy_dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out[spec["y"]["b"]], np.zeros((3, 2), np.float32))
        np.testing.assert_array_equal(out[spec["c"]["x"]], np.zeros((2, 3), np.float32))
        np.testing.assert_allclose(out[spec["c"]["b"]], 2 * np.eye(2), rtol=1e-6)
    hm = hvp(m, ["x", "b"], loss="loss")
    _check_graph(hm)
    names = json.loads({p.key: p.value for p in hm.metadata_props}["onnxgrad.hvp"])
    out = Runner(hm)({"x": x, "x_tangent": v, "b_tangent": randn(2)})
    np.testing.assert_allclose(out[names["x"]], d2 * v, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(out[names["b"]], np.zeros(2, np.float32))
    hs = hessian(m, ["x", "b"], loss="loss")
    _check_graph(hs)
    blocks = json.loads({p.key: p.value for p in hs.metadata_props}["onnxgrad.hessian"])
    out = Runner(hs)({"x": x})
    np.testing.assert_allclose(out[blocks["x"]["x"]], np.diag(d2), rtol=1e-4, atol=1e-6)
    for p, q, shape in (("x", "b", (3, 2)), ("b", "x", (2, 3)), ("b", "b", (2, 2))):
        np.testing.assert_array_equal(out[blocks[p][q]], np.zeros(shape, np.float32))
    for strict in (lambda: hvp(m, ["x", "b"], loss="loss", allow_unused=False),
                   lambda: hessian(m, ["x", "b"], loss="loss", allow_unused=False),
                   lambda: jacfwd(m, ["x", "b"], ["y"], allow_unused=False),
                   lambda: jacrev(m, ["x", "b"], ["y"], allow_unused=False)):
        with pytest.raises(onnxgrad.UnusedError, match="'b'"):
            strict()
