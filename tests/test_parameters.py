"""What gets trained, and how: the parameter policy on real PyTorch exports, train mode against
PyTorch's one-step references, and the trainer habits (parameter groups, gradients, checkpoints).

The references were written by models/export.py with torch (these tests need no torch).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file

import onnxgrad
from onnxgrad import TrainingSession, losses, optim
from onnxgrad.errors import OnnxGradError, UnusedError
from onnxgrad.passes.params import parameters, restore_ties
from onnxgrad.tools.cli import main as cli_main

MODELS = Path(__file__).resolve().parents[1] / "models"
EXPORTED = sorted(p.stem for p in MODELS.glob("*.npz"))
TRAIN_STEPS = sorted(p.stem for p in (MODELS / "train_step").glob("*.npz"))
F = TensorProto.FLOAT


def _fixture(stem: str) -> dict[str, np.ndarray]:
    with np.load(MODELS / f"{stem}.npz") as z:
        return {k: z[k] for k in z.files}


# -- the trainable set equals PyTorch's parameters as they appear in the graph ---------------------------
@pytest.mark.parametrize("stem", EXPORTED)
def test_default_trainable_set_is_pytorchs_parameters(stem):
    model = onnx.load(MODELS / f"{stem}.onnx")
    data = _fixture(stem)
    expected = {k[len("param/"):] for k in data if k.startswith("param/")}
    report = parameters(model, loss=str(data["loss"]) if "loss" in data else None)
    assert set(report.trainable) == expected, "\n".join(report.lines())
    # grad()'s default wrt and a training session's parameters are the same set
    gm = onnxgrad.grad(model, loss=str(data["loss"]) if "loss" in data else None)
    assert set(onnxgrad.tools.check.gradient_spec(gm)["wrt"]) == expected
    # every decision carries a reason; PyTorch names come from the exporter where it recorded them
    assert all(p.reason for p in report)
    if "dynamo" in stem and "cnn_dynamo" != stem:
        for name in expected:
            held = {n.strip() for n in str(data[f"param/{name}"]).split(",")}
            assert report[name].torch_name is not None
            assert set(report[name].torch_name.split(", ")) <= held | {name}, (name, report[name])


def test_buffers_and_exporter_constants_are_left_out_with_reasons():
    bn = parameters(MODELS / "cnn_legacy.onnx")
    assert "running statistic" in bn["bn.running_mean"].reason and not bn["bn.running_var"].trainable
    gpt = parameters(MODELS / "gpt_dynamo.onnx")
    scalars = [p for p in gpt.left_out if p.name.startswith("val_")]
    assert scalars and all(not p.trainable for p in scalars)
    lstm = parameters(MODELS / "lstm_dynamo.onnx")
    zero_state = [p for p in lstm.left_out]
    assert len(zero_state) == 1 and "folded" in zero_state[0].reason   # the LSTM's zero initial state
    text = "\n".join(gpt.lines())
    assert "trainable parameters of" in text and "not trained" in text


def _tiny(nodes, inits, inputs=("x",), output="y", opset=17):
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info(i, F, [2, 3]) for i in inputs],
        [helper.make_tensor_value_info(output, F, [2, 3])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_policy_without_metadata():
    rng = np.random.default_rng(0)
    model = _tiny(
        [helper.make_node("Mul", ["x", "w"], ["a"]),
         helper.make_node("Mul", ["a", "val_3"], ["b"]),          # an exporter scalar (GELU's 0.5)
         helper.make_node("Add", ["b", "mask"], ["c"]),           # an additive mask
         helper.make_node("Mul", ["c", "logit_scale"], ["d"]),    # a learnable temperature
         helper.make_node("Mul", ["d", "keep"], ["y"])],          # a 0/1 mask
        {"w": rng.standard_normal((2, 3)), "val_3": np.array(0.5), "mask": [[0, -np.inf, 0]] * 2,
         "logit_scale": np.array(2.6), "keep": [[1, 0, 1]] * 2})
    report = parameters(model)
    assert report.trainable == ["w", "logit_scale"]
    assert "scalar" in report["val_3"].reason and "mask" in report["mask"].reason
    assert "mask" in report["keep"].reason


def test_a_weight_behind_an_integer_cast_is_not_a_parameter_and_a_cut_wrt_is_unused():
    """One source of truth: the policy and the pass agree on what carries a gradient."""
    model = _tiny(
        [helper.make_node("Cast", ["w"], ["wi"], to=TensorProto.INT64),
         helper.make_node("Cast", ["wi"], ["wf"], to=F),
         helper.make_node("Mul", ["x", "wf"], ["a"]),
         helper.make_node("Mul", ["a", "v"], ["y"])],
        {"w": np.full((2, 3), 2.0), "v": np.arange(6).reshape(2, 3) + 0.5})
    report = parameters(model)
    assert report.trainable == ["v"] and "no differentiable path" in report["w"].reason
    with pytest.raises(UnusedError, match="only through inputs that carry no gradient"):
        onnxgrad.grad(model, wrt=["w"])
    gm = onnxgrad.grad(model, wrt=["w"], allow_unused=True)
    out = ort.InferenceSession(gm.SerializeToString()).run(None, {"x": np.ones((2, 3), np.float32),
                                                                  "y_grad": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(out[1], 0.0)
    with pytest.raises(OnnxGradError, match="nothing to train"):
        TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), frozen=["v"])


def test_folded_copies_that_repeat_a_parameter_are_not_trained_silently():
    """dynamo metadata: a folded Expand of a class token repeats its row: the row trains once and is expanded
    in the graph (its gradient sums every use, as PyTorch's); a row-permuted second copy of a weight would break
    the tie: it is left out with the reason and a warning; a transposed copy is tied back."""
    rng = np.random.default_rng(1)
    token = rng.standard_normal((1, 3))
    weight = rng.standard_normal((3, 3))
    model = _tiny(
        [helper.make_node("Add", ["x", "cls_expanded"], ["a"]),
         helper.make_node("MatMul", ["a", "w_t"], ["b"]),
         helper.make_node("MatMul", ["b", "w_rows"], ["c"]),
         helper.make_node("MatMul", ["c", "w"], ["y"])],
        {"cls_expanded": np.repeat(token, 2, axis=0), "w_t": weight.T, "w_rows": weight[[2, 0, 1]], "w": weight})
    for name, folded in (("cls_expanded", "['cls_token', 'val_4']"), ("w_t", "['w']"), ("w_rows", "['w', 'val_5']")):
        vi = helper.make_tensor_value_info(name, F, [2, 3] if name == "cls_expanded" else [3, 3])
        vi.metadata_props.add(key="pkg.onnxscript.optimizer.folded_from", value=folded)
        model.graph.value_info.append(vi)
    vi = helper.make_tensor_value_info("w", F, [3, 3])
    vi.metadata_props.add(key="pkg.torch.export.graph_signature.InputSpec.kind", value="PARAMETER")
    model.graph.value_info.append(vi)
    model.graph.metadata_props.add(
        key="pkg.torch.export.ExportedProgram.graph_signature",
        value="# inputs\np_cls_token: PARAMETER target='cls_token'\np_w: PARAMETER target='w'\nx: USER_INPUT\n")
    report = parameters(model)
    assert report.trainable == ["w", "cls_expanded.rows"]
    assert report["cls_expanded"].tied_to == "cls_expanded.rows" and report["cls_expanded"].tie_op == "Expand"
    assert report["cls_expanded.rows"].torch_name == "cls_token"
    np.testing.assert_array_equal(numpy_helper.to_array(next(
        i for i in restore_ties(model, report).graph.initializer if i.name == "cls_expanded.rows")),
        token.astype(np.float32))
    assert [f.kind for f in report.findings] == ["copy_left_out"] and "w_rows" in report.findings[0].tensors
    assert "tie holds" in report["w_t"].reason and report["w_t"].tied_to == "w"      # restored as Transpose(w)
    assert "second copy" in report["w_rows"].reason and "break their tie" in report["w_rows"].reason


# -- train mode against PyTorch ---------------------------------------------------------------------------
def _train_step_session(stem: str, train_mode: bool):
    ref = dict(np.load(MODELS / "train_step" / f"{stem}.npz"))
    loss = losses.MSELoss(output=str(ref["output"]), target="t")
    s = TrainingSession(MODELS / f"{stem}.onnx", loss=loss, optimizer=optim.SGD(lr=float(ref["lr"])),
                        train_mode=train_mode, providers=["CPUExecutionProvider"])
    return s, ref


@pytest.mark.parametrize("stem", TRAIN_STEPS)
def test_train_mode_step_matches_pytorch(stem, tmp_path):
    s, ref = _train_step_session(stem, train_mode=True)
    loss = s.step({"x": ref["x"], "t": ref["t"]})
    assert loss == pytest.approx(float(ref["loss_before"]), abs=1e-5)
    s.export(tmp_path / "trained.onnx")
    exported = {i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    for key in ref:
        if key.startswith(("param/", "running/")):
            name = key.split("/", 1)[1]
            np.testing.assert_allclose(exported[name], ref[key], rtol=0, atol=2e-6, err_msg=key)
    assert set(s.buffers()) == {k.split("/", 1)[1] for k in ref if k.startswith("running/")}
    # the exported model is an inference model: BN on the updated running statistics
    graph = onnx.load(tmp_path / "trained.onnx").graph
    assert all(a.i == 0 for n in graph.node if n.op_type == "BatchNormalization"
               for a in n.attribute if a.name == "training_mode")
    out = s.eval({"x": ref["x"]})
    sess = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(out[str(ref["output"])], sess.run(None, {"x": ref["x"]})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stem", TRAIN_STEPS)
def test_eval_mode_step_matches_pytorch(stem, tmp_path):
    s, ref = _train_step_session(stem, train_mode=False)
    loss = s.step({"x": ref["x"], "t": ref["t"]})
    assert loss == pytest.approx(float(ref["eval_loss_before"]), abs=1e-5)
    assert s.buffers() == {}
    params = s.parameters()
    for key in ref:
        if key.startswith("eval_param/"):
            name = key.split("/", 1)[1]
            np.testing.assert_allclose(params[name], ref[key], rtol=0, atol=2e-6, err_msg=key)


def test_train_mode_checkpoint_round_trips_running_statistics(tmp_path):
    s, ref = _train_step_session(TRAIN_STEPS[0], train_mode=True)
    feeds = {"x": ref["x"], "t": ref["t"]}
    s.step(feeds)
    s.save(tmp_path / "ckpt")
    resumed = TrainingSession.load(tmp_path / "ckpt")
    assert resumed.spec.train_mode
    for name, value in s.buffers().items():
        np.testing.assert_array_equal(resumed.buffers()[name], value)
    assert resumed.step(feeds) == s.step(feeds)
    for name, value in s.buffers().items():
        np.testing.assert_array_equal(resumed.buffers()[name], value)


def test_dropout_is_active_in_train_mode_and_off_in_eval(tmp_path):
    model = _tiny([helper.make_node("Mul", ["x", "w"], ["a"]), helper.make_node("Dropout", ["a", "ratio"], ["y"])],
                  {"w": np.arange(1.0, 7.0).reshape(2, 3), "ratio": np.array(0.5)})
    x = np.ones((2, 3), np.float32)
    s = TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), optimizer=optim.SGD(lr=0.0))
    assert s.parameters().keys() == {"w"}
    np.testing.assert_array_equal(s.eval({"x": x})["y"], np.arange(1.0, 7.0).reshape(2, 3))
    losses_seen = {s.step({"x": x, "t": np.zeros((2, 3), np.float32)}) for _ in range(6)}
    assert len(losses_seen) > 1                              # a fresh mask every step
    s.save(tmp_path / "ckpt")                               # a resumed session keeps training in train mode
    resumed = TrainingSession.load(tmp_path / "ckpt")
    assert resumed.spec.train_mode
    assert len({resumed.step({"x": x, "t": np.zeros((2, 3), np.float32)}) for _ in range(6)}) > 1
    frozen = TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), optimizer=optim.SGD(lr=0.0),
                             train_mode=False)
    assert len({frozen.step({"x": x, "t": np.zeros((2, 3), np.float32)}) for _ in range(3)}) == 1


# -- trainer habits ------------------------------------------------------------------------------------------
def _mlp():
    return MODELS / "mlp_dynamo.onnx"


def _mlp_feeds(seed=0):
    data = _fixture("mlp_dynamo")
    rng = np.random.default_rng(seed)
    return {"x": data["input/x"], "target": rng.standard_normal(data["output/y"].shape).astype(np.float32)}


def test_parameter_groups_choose_weight_decay_by_name():
    opt = optim.AdamW(lr=1e-2, weight_decay=0.5, param_groups=[{"params": r"\.bias$", "weight_decay": 0.0}])
    s = TrainingSession(_mlp(), loss=losses.MSELoss(output="y"), optimizer=opt, keep_grads=True)
    plain = TrainingSession(_mlp(), loss=losses.MSELoss(output="y"), optimizer=optim.AdamW(lr=1e-2, weight_decay=0.5))
    nodecay = TrainingSession(_mlp(), loss=losses.MSELoss(output="y"), optimizer=optim.AdamW(lr=1e-2, weight_decay=0))
    for sess in (s, plain, nodecay):
        sess.step(_mlp_feeds())
    got, with_decay, without = s.parameters(), plain.parameters(), nodecay.parameters()
    for name in got:
        want = without[name] if name.endswith(".bias") else with_decay[name]
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert opt.config()["param_groups"] == [{"params": r"\.bias$", "weight_decay": 0.0}]
    assert optim.from_config(opt.config()) == opt
    with pytest.raises(optim.OptimizerError, match="learning rate"):
        optim.SGD(param_groups=[{"params": "bias", "lr": 0.1}])
    with pytest.raises(optim.OptimizerError, match="params"):
        optim.SGD(param_groups=[{"weight_decay": 0.1}])


def test_last_gradients_are_available_when_asked_for():
    s = TrainingSession(_mlp(), loss=losses.MSELoss(output="y"), optimizer=optim.SGD(lr=0.1), keep_grads=True)
    before = s.parameters()
    s.step(_mlp_feeds())
    after, grads = s.parameters(), s.grads()
    for name in before:
        np.testing.assert_allclose(after[name], before[name] - 0.1 * grads[name], rtol=1e-6, atol=1e-7)
    with pytest.raises(OnnxGradError, match="keep_grads"):
        TrainingSession(_mlp(), loss=losses.MSELoss(output="y")).grads()


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -1.0])
def test_invalid_learning_rate_is_refused_before_anything_changes(lr):
    s = TrainingSession(_mlp(), loss=losses.MSELoss(output="y"), optimizer=optim.SGD(lr=0.1))
    before = s.parameters()
    with pytest.raises(OnnxGradError, match="learning rate"):
        s.step(_mlp_feeds(), lr=lr)
    s.lr = lr
    with pytest.raises(OnnxGradError, match="learning rate"):
        s.step(_mlp_feeds())
    assert s.step_count == 0
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, before[name])


def test_rank0_parameter_checkpoint_round_trips(tmp_path):
    model = _tiny([helper.make_node("Mul", ["x", "temperature"], ["y"])], {"temperature": np.array(1.5)})
    s = TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), optimizer=optim.SGD(lr=0.1))
    assert s.parameters()["temperature"].shape == ()
    s.step({"x": np.ones((2, 3), np.float32), "t": np.zeros((2, 3), np.float32)})
    s.save(tmp_path / "ckpt")
    resumed = TrainingSession.load(tmp_path / "ckpt")
    assert resumed.parameters()["temperature"].shape == ()
    assert resumed.parameters()["temperature"] == s.parameters()["temperature"]


def test_saves_follow_the_umask_and_leave_no_temporary_files(tmp_path):
    s = TrainingSession(_mlp(), loss=losses.MSELoss(output="y"), optimizer=optim.SGD(lr=0.1))
    # a temporary file a killed writer left behind (its process id is not running)
    stale = tmp_path / ".ckpt.999999999.abcd.tmp"
    stale.write_bytes(b"partial")
    old = os.umask(0o027)
    try:
        s.save(tmp_path / "ckpt")
        s.export(tmp_path / "model.onnx")
    finally:
        os.umask(old)
    for name in ("ckpt", "model.onnx"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o640, name
    for _ in range(3):
        s.save(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "model.onnx"]


def test_explicit_trainable_list_overrides_the_policy():
    s = TrainingSession(_mlp(), loss=losses.MSELoss(output="y"), trainable=["fc1.weight"])
    assert list(s.spec.params) == ["fc1.weight"]
    with pytest.raises(onnxgrad.UnknownNameError, match="not float initializers"):
        TrainingSession(_mlp(), loss=losses.MSELoss(output="y"), trainable=["nope"])


# -- the command line shows the decision --------------------------------------------------------------------
def test_params_command_lists_trainable_and_left_out(capsys):
    assert cli_main(["params", str(MODELS / "cnn_legacy.onnx")]) == 0
    out = capsys.readouterr().out
    assert "trainable parameters of" in out and "bn.weight" in out
    assert "bn.running_mean: running statistic" in out
    assert cli_main(["params", str(MODELS / "gpt_dynamo.onnx")]) == 0
    out = capsys.readouterr().out
    assert "val_2 (PyTorch 'blocks.0.attn.qkv.weight')" in out


def test_cli_training_artifacts_train_mode_by_default(tmp_path, capsys):
    model = tmp_path / "cnn.onnx"
    model.write_bytes((MODELS / "cnn_legacy.onnx").read_bytes())
    assert cli_main([str(model), "--loss-fn", "mse", "--predictions", "y", "--target", "t",
                     "--optimizer", "sgd", "--lr", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "train mode" in out and "running statistic" in out
    train = onnx.load(tmp_path / "cnn.train.onnx")
    spec = onnxgrad.training.artifacts.TrainingSpec.of(train)
    assert spec.train_mode and set(spec.buffers) == {"bn.running_mean", "bn.running_var",
                                                     "block.bn1.running_mean", "block.bn1.running_var",
                                                     "block.bn2.running_mean", "block.bn2.running_var"}
    ref = dict(np.load(MODELS / "train_step" / "cnn_legacy.npz"))
    feeds = load_file(tmp_path / "cnn.state.safetensors")
    opts = ort.SessionOptions()
    opts.log_severity_level = 2           # warnings would show initializers that are also inputs
    sess = ort.InferenceSession(train.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, {**feeds, "x": ref["x"], "t": ref["t"]})))
    assert float(out["loss"]) == pytest.approx(float(ref["loss_before"]), abs=1e-5)
    for key in ref:
        if key.startswith(("param/", "running/")):
            np.testing.assert_allclose(out[key.split("/", 1)[1] + ".next"], ref[key], rtol=0, atol=2e-6)


def test_exporter_constants_stay_constant_through_training(tmp_path):
    """The attention scale, masks and GELU constants of a dynamo export are not trained (they were)."""
    data = _fixture("gpt_dynamo")
    model = onnx.load(MODELS / "gpt_dynamo.onnx")
    s = TrainingSession(model, loss=losses.MSELoss(output="logits", target="t"), optimizer=optim.AdamW(lr=1e-2))
    feeds = {"idx": data["input/idx"], "pos": data["input/pos"], "t": np.zeros_like(data["output/logits"])}
    for _ in range(3):
        s.step(feeds)
    s.export(tmp_path / "trained.onnx")
    before = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    after = {i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    trained = set(s.spec.params)
    assert trained == {k[len("param/"):] for k in data if k.startswith("param/")}
    for name, value in before.items():
        if name in after and name not in trained:
            np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert any(not np.array_equal(after[n], before[n]) for n in trained)


def test_tanh_gelu_exponent_is_a_constant_not_a_parameter():
    """Pow(x, 3.0) of a tanh-GELU export: the exponent's gradient x^3 ln(x) is NaN for x < 0, so
    training it would refuse every step; it is an exporter constant and is not trained."""
    rng = np.random.default_rng(3)
    model = _tiny([helper.make_node("MatMul", ["x", "w"], ["h"]),
                   helper.make_node("Pow", ["h", "val_7"], ["cube"]),
                   helper.make_node("Mul", ["cube", "val_8"], ["y"])],
                  {"w": rng.standard_normal((3, 3)), "val_7": np.array(3.0), "val_8": np.array(0.044715)})
    s = TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), optimizer=optim.SGD(lr=0.01))
    assert list(s.spec.params) == ["w"]
    x = rng.standard_normal((2, 3)).astype(np.float32)
    for _ in range(3):
        assert np.isfinite(s.step({"x": x, "t": np.zeros((2, 3), np.float32)}))
    assert s.step_count == 3


def _tied_model():
    """Tied embeddings as the dynamo exporter writes them: the table, and its transpose folded for the head."""
    rng = np.random.default_rng(5)
    table = rng.standard_normal((3, 3))
    model = _tiny([helper.make_node("MatMul", ["x", "wte"], ["h"]),
                   helper.make_node("Tanh", ["h"], ["a"]),
                   helper.make_node("MatMul", ["a", "val_9"], ["y"])],
                  {"wte": table, "val_9": table.T})
    vi = helper.make_tensor_value_info("val_9", F, [3, 3])
    vi.metadata_props.add(key="pkg.onnxscript.optimizer.folded_from", value="['wte']")
    model.graph.value_info.append(vi)
    vi = helper.make_tensor_value_info("wte", F, [3, 3])
    vi.metadata_props.add(key="pkg.torch.export.graph_signature.InputSpec.kind", value="PARAMETER")
    model.graph.value_info.append(vi)
    return model, table


def test_tied_copies_are_computed_from_their_parameter():
    """PyTorch trains one tensor for tied weights and sums both uses' gradients: so do we."""
    model, table = _tied_model()
    report = parameters(model)
    assert report.trainable == ["wte"]
    assert report["val_9"].tied_to == "wte" and "tie holds" in report["val_9"].reason
    rng = np.random.default_rng(6)
    x, seed = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    gm = onnxgrad.grad(model)                      # default wrt: the tie is restored
    got = ort.InferenceSession(gm.SerializeToString()).run(
        ["wte_grad"], {"x": x.astype(np.float32), "y_grad": seed.astype(np.float32)})[0]
    h = np.tanh(x @ table)                         # y = tanh(x W) W^T: dW = x^T ((dy W) * (1 - h^2)) + dy^T h
    want = x.T @ ((seed @ table) * (1 - h ** 2)) + seed.T @ h
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    s = TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), optimizer=optim.SGD(lr=0.1))
    s.step({"x": x.astype(np.float32), "t": np.zeros((2, 3), np.float32)})
    exported = s.exported_model()
    sess = ort.InferenceSession(exported.SerializeToString())
    w = s.parameters()["wte"]
    np.testing.assert_allclose(sess.run(None, {"x": x.astype(np.float32)})[0],
                               np.tanh(x @ w) @ w.T, rtol=1e-5, atol=1e-5)


def test_running_statistics_follow_every_micro_batch_of_an_accumulated_update():
    """model.train() updates BN's running statistics on every forward, micro-batches included."""
    ref = dict(np.load(MODELS / "train_step" / "cnn_legacy.npz"))
    halves = [{"x": ref["x"], "t": ref["t"]}, {"x": 2 * ref["x"] + 1, "t": ref["t"]}]   # the input's batch is static
    loss = losses.MSELoss(output="y", target="t")
    accumulated = TrainingSession(MODELS / "cnn_legacy.onnx", loss=loss, optimizer=optim.SGD(lr=0.0),
                                  accumulation_steps=2)
    stepwise = TrainingSession(MODELS / "cnn_legacy.onnx", loss=loss, optimizer=optim.SGD(lr=0.0))
    for feeds in halves:
        accumulated.step(feeds)
        stepwise.step(feeds)
    assert accumulated.step_count == 1 and stepwise.step_count == 2
    for name, value in stepwise.buffers().items():
        np.testing.assert_allclose(accumulated.buffers()[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
        assert not np.array_equal(value, ref[f"running/{name}"])     # two updates, not one


def test_tied_copies_without_metadata_are_found_by_value():
    """TorchScript folds a tied LM head as the embedding's transpose under a generated name."""
    model, table = _tied_model()
    del model.graph.value_info[:]
    model.graph.initializer[1].name = "onnx::MatMul_583"
    model.graph.node[2].input[1] = "onnx::MatMul_583"
    report = parameters(model)
    assert report.trainable == ["wte"]
    assert report["onnx::MatMul_583"].tied_to == "wte" and report["onnx::MatMul_583"].tie_op == "Transpose"


def _bf16(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


@pytest.mark.parametrize("values, repeats", [
    (np.repeat(np.arange(1.0, 4.0)[None], 4, axis=0) * 0.37, True),          # a row expanded (class token)
    (np.arange(1.0, 10.0)[[0, 3, 3, 1, 0, 3, 2, 1, 1]].reshape(3, 3) * 0.37, True),   # a gathered 1-head table
    (np.random.default_rng(0).standard_normal((4, 3)), False),                  # a transposed/sliced weight
    (np.zeros((4, 3)), False),                                                  # a fresh zero bias, re-packed
    (_bf16(np.random.default_rng(1).standard_normal((16, 16))), False),          # bf16 weights
    (np.arange(1.0, 7.0)[np.random.default_rng(2).integers(0, 6, (16, 16))] / 4, True),  # a bf16 1-head table, gathered
])
def test_folded_copies_that_repeat_elements_are_told_from_weights(values, repeats):
    from onnxgrad.passes.params import _repeats_elements

    assert _repeats_elements(numpy_helper.from_array(values.astype(np.float32), "t")) == repeats


def _repeats_by_sorting(values: np.ndarray) -> bool:
    """The definition of params._repeats_elements, every count taken exactly with np.unique."""
    flat = values.reshape(-1)
    if flat.size < 2 or (flat == flat[0]).all():
        return False
    for axis, n in enumerate(values.shape):
        fibres = np.moveaxis(values, axis, -1).reshape(-1, n)
        if n >= 2 and len(fibres) >= 2 and len(np.unique(fibres, axis=0)) <= 0.75 * len(fibres):
            return True
    as32 = flat.astype(np.float32)
    low = not (as32.view(np.uint32) & 0xFFFF).any() or (as32.astype(np.float16).astype(np.float32) == as32).all()
    unique = np.unique(flat).size
    return unique <= flat.size / 2 if not low else flat.size <= 256 and unique <= 0.75 * flat.size


def _rows_repeated(fraction: float, rows: int = 1024, width: int = 4) -> np.ndarray:
    """Random rows, the last ``fraction`` of them copies of earlier ones."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((rows, width))
    copies = int(rows * fraction)
    a[rows - copies:] = a[rng.integers(0, rows - copies, copies)]
    return a


def _signed_zeros() -> np.ndarray:
    a = np.random.default_rng(6).standard_normal((512, 8))
    a[:, :3] = 0.0
    a[::2, :3] = -0.0                       # equal to 0.0, as np.unique counts them
    return a


@pytest.mark.parametrize("values, dtype, repeats", [
    (np.random.default_rng(0).standard_normal((64, 64, 3, 3)) * 0.05, np.float32, False),  # a folded Conv weight
    (np.random.default_rng(1).standard_normal((48, 40)), np.float64, False),
    (np.random.default_rng(2).standard_normal((64, 32)), np.float16, False),       # chance repeats of fp16
    (np.repeat(np.random.default_rng(3).standard_normal((1, 512)), 8, axis=0), np.float32, True),   # expanded
    (np.random.default_rng(4).standard_normal((100, 64))[np.arange(400) % 37], np.float32, True),   # gathered
    (_rows_repeated(0.30), np.float32, True),           # a quarter and more of the rows repeat
    (_rows_repeated(0.20), np.float32, False),          # fewer: the values are three quarters distinct
    (_signed_zeros(), np.float32, True),
    (np.where(np.arange(4096) % 7 == 0, np.nan, np.random.default_rng(7).standard_normal(4096)).reshape(64, 64),
     np.float32, False),
])
def test_repeat_check_of_large_tensors_decides_as_sorting_does(values, dtype, repeats):
    """The hashing shortcut (a lower bound on the distinct values) changes no decision of the exact counts."""
    from onnxgrad.passes.params import _repeats_elements

    values = values.astype(dtype)
    assert _repeats_by_sorting(values) == repeats
    assert _repeats_elements(numpy_helper.from_array(values, "t")) == repeats


def test_a_tensor_shared_by_a_running_statistic_and_a_weight_is_split_apart():
    """Fresh models have equal-valued tensors (zero biases and means) that exporters merge and route
    through Identity nodes; the running statistic gets its own tensor again, so that training the weight
    does not move the running mean, and both train as PyTorch's separate bias and buffer."""
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
         helper.make_node("Identity", ["zeros"], ["mean"], name="copy"),
         helper.make_node("BatchNormalization", ["c", "gamma", "zeros", "mean", "var"], ["y"], name="bn")],
        "merged", [helper.make_tensor_value_info("x", F, [2, 2, 3, 3])],
        [helper.make_tensor_value_info("y", F, [2, 2, 3, 3])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in
         {"w": np.random.default_rng(0).standard_normal((2, 2, 1, 1)), "gamma": np.array([1.5, 0.5]),
          "zeros": np.zeros(2), "var": np.array([1.0, 2.0])}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = parameters(model)
    assert report.trainable == ["w", "gamma", "zeros"]
    split = report["bn.running_mean"]
    assert not split.trainable and split.merged_into == "zeros" and "own tensor again" in split.reason
    s = TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), optimizer=optim.SGD(lr=0.5))
    x = np.random.default_rng(1).standard_normal((2, 2, 3, 3)).astype(np.float32)
    s.step({"x": x, "t": np.zeros((2, 2, 3, 3), np.float32)})
    assert set(s.buffers()) == {"bn.running_mean", "var"}
    # the batch mean moved the running mean (ONNX momentum 0.9: a tenth of it), the gradient moved the bias
    w = numpy_helper.to_array(model.graph.initializer[0]).reshape(2, 2)
    batch_mean = w @ x.mean((0, 2, 3))                 # the 1x1 convolution's output, averaged per channel
    np.testing.assert_allclose(s.buffers()["bn.running_mean"], 0.1 * batch_mean, rtol=1e-5, atol=1e-7)
    assert not np.allclose(s.parameters()["zeros"], 0.0)


def test_a_parameter_recorded_with_requires_grad_false_is_not_trained():
    """onnxgrad.from_torch marks PyTorch's frozen parameters on their initializers; the policy reads the mark
    (this test needs no torch: the mark is written by hand)."""
    from onnxgrad.passes.params import REQUIRES_GRAD_KEY

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("proj.weight", (3, 4)), ("fc.weight", (2, 3)))]
    inits[0].metadata_props.add(key=REQUIRES_GRAD_KEY, value="false")
    inits[1].metadata_props.add(key="pkg.example.note", value="kept")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "proj.weight"], ["h"], transB=1),
         helper.make_node("Gemm", ["h", "fc.weight"], ["y"], transB=1)],
        "frozen_projection", [helper.make_tensor_value_info("x", F, [2, 4])],
        [helper.make_tensor_value_info("y", F, [2, 2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = parameters(model)
    assert report.trainable == ["fc.weight"]
    assert "requires_grad=False" in report["proj.weight"].reason
    s = TrainingSession(model, loss=losses.MSELoss(output="y", target="t"), optimizer=optim.SGD(lr=0.1))
    s.step({"x": rng.standard_normal((2, 4)).astype(np.float32), "t": np.zeros((2, 2), np.float32)})
    assert list(s.spec.params) == ["fc.weight"]
    exported = s.exported_model()
    kept = {i.name: numpy_helper.to_array(i) for i in exported.graph.initializer}
    np.testing.assert_array_equal(kept["proj.weight"], numpy_helper.to_array(inits[0]))
    assert not np.array_equal(kept["fc.weight"], numpy_helper.to_array(inits[1]))
    assert parameters(exported).trainable == ["fc.weight"]          # the marks survive the export
    trained = next(i for i in exported.graph.initializer if i.name == "fc.weight")
    assert [(p.key, p.value) for p in trained.metadata_props] == [("pkg.example.note", "kept")]
