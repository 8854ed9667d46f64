"""TrainingSession, the training artifacts and the optimizers: PyTorch trajectories, checkpoints, NaN handling, CLI."""
import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from safetensors.numpy import load_file

import onnxgrad
from mlp_batches import DATA, assert_unchanged, batch, poisoned
from onnxgrad import TrainingSession, losses, optim
from onnxgrad.tools.cli import main as cli_main
from onnxgrad.training import artifacts, state
from onnxgrad.training.session import CheckpointMismatchError, CorruptCheckpointError, NonFiniteError, NonFiniteWarning

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "models" / "training"
RUNS = json.loads((FIXTURES / "runs.json").read_text())["runs"]
F = TensorProto.FLOAT


def mlp_model():
    return onnx.load(FIXTURES / "mlp.onnx")


def ce(**options):
    return losses.CrossEntropyLoss(output="logits", target="y", **options)


def session(optimizer=None, **kw):
    return TrainingSession(mlp_model(), loss=ce(), optimizer=optimizer or optim.AdamW(lr=1e-2), **kw)


# -- agreement with PyTorch (models/training/make_fixtures.py) ----------------------------------------
@pytest.mark.parametrize("run", sorted(RUNS))
def test_trajectory_matches_pytorch(run):
    cfg = RUNS[run]
    options, training = dict(cfg["options"]), cfg["training"]
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    k = training.get("accumulation", 1)
    s = TrainingSession(mlp_model(), loss=ce(label_smoothing=training.get("label_smoothing", 0.0)),
                        optimizer=getattr(optim, cfg["optimizer"])(**options),
                        clip_grad_norm=training.get("clip_grad_norm"), accumulation_steps=k)
    got = []
    for step in range(len(DATA["x"])):
        if "gamma" in training:                      # a schedule: lr is a graph input, no rebuild
            s.lr = options["lr"] * training["gamma"] ** step
        for x, y in zip(np.split(DATA["x"][step], k), np.split(DATA["y"][step], k)):
            loss = s.step({"x": x, "y": y})
            assert isinstance(loss, float)
            got.append(loss)
        if "clip_grad_norm" in training and step == 0:
            assert s.last_grad_norm > training["clip_grad_norm"]     # the clipping was active
    assert s.step_count == len(DATA["x"])
    np.testing.assert_allclose(got, DATA[f"{run}/losses"], rtol=0, atol=2e-6)
    params = s.parameters()
    assert sorted(params) == sorted(n for n in ("0.weight", "0.bias", "2.weight", "2.bias"))
    for name, value in params.items():
        np.testing.assert_allclose(value, DATA[f"{run}/{name}"], rtol=0, atol=2e-6, err_msg=name)


# -- the optimizer graphs: ops per parameter (the update is memory-bound: each is a full pass) ------------
UPDATE_OPS = [
    (optim.SGD(lr=0.1), "Mul Sub"),
    (optim.SGD(lr=0.1, momentum=0.9), "Mul Add Mul Sub"),
    (optim.SGD(lr=0.1, momentum=0.9, dampening=0.3), "Mul Mul Add Mul Sub"),
    (optim.SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01), "Mul Add Mul Add Mul Add Mul Sub"),
    # the moments held scaled (optim.Adam): M = beta1 M + g, V = beta2 V + g g
    (optim.Adam(), "Mul Add Mul Mul Add Sqrt Add Div Mul Sub"),
    (optim.Adam(eps=0.0), "Mul Add Mul Mul Add Sqrt Div Mul Sub"),
    (optim.Adam(weight_decay=0.01), "Mul Add Mul Add Mul Mul Add Sqrt Add Div Mul Sub"),
    (optim.AdamW(), "Mul Mul Add Mul Mul Add Sqrt Add Div Mul Sub"),
    (optim.Adagrad(), "Mul Add Sqrt Add Div Mul Sub"),
    (optim.Adagrad(lr_decay=0.05, weight_decay=1e-3), "Mul Add Mul Add Sqrt Add Div Mul Sub"),
]


@pytest.mark.parametrize("optimizer, ops", UPDATE_OPS, ids=[repr(o) for o, _ in UPDATE_OPS])
def test_update_ops_per_parameter(optimizer, ops):
    """Scalars (bias corrections, decay, damping) are folded into 0-d factors shared by all parameters:
    per parameter only the full-tensor passes of the formula remain (no Cast, Expand or Where)."""
    art = artifacts.build(mlp_model(), ce(), optimizer, guard=False)
    alone = [p for p in art.spec.params if any(n.name.startswith(f"train/optimizer/{p}/") for n in art.train.graph.node)]
    for p in alone:
        got = [n.op_type for n in art.train.graph.node
               if n.name.startswith(f"train/optimizer/{p}/") and n.op_type != "Constant"]
        assert got == ops.split(), p
    # the small parameters are updated together, with the same passes over their concatenation
    together = [n.op_type for n in art.train.graph.node if n.name.startswith("train/optimizer/foreach/")
                and n.op_type not in ("Constant", "Concat", "Reshape", "Split")]
    assert together == (ops.split() if len(alone) < len(art.spec.params) else [])
    assert len(alone) < len(art.spec.params)
    shared = [n.op_type for n in art.train.graph.node
              if n.name.startswith("train/optimizer/") and n.name.count("/") == 2 and n.op_type != "Constant"]
    assert len(shared) <= 16, shared            # the step's scalars, once per graph


def linear_loss_model(shape=(3, 4)):
    """loss = sum(w * x): the gradient of w is x, so the optimizer sees the gradients the test chooses."""
    rng = np.random.default_rng(7)
    w = onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Mul", ["w", "x"], ["wx"]),
         onnx.helper.make_node("ReduceSum", ["wx"], ["loss"], keepdims=0)],
        "linear", [onnx.helper.make_tensor_value_info("x", F, list(shape))],
        [onnx.helper.make_tensor_value_info("loss", F, [])], [w])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def torch_adam_reference(p, grads, lr, betas, eps, weight_decay, decoupled):
    """torch.optim.Adam/AdamW's single-tensor update, step by step: float32 tensors, Python-float scalars."""
    f32 = np.float32
    beta1, beta2 = betas
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        if decoupled:
            p = p * f32(1 - lr * weight_decay)
        elif weight_decay:
            g = g + f32(weight_decay) * p
        w = f32(1 - beta1)                                   # torch.lerp(m, g, w)
        m = m + w * (g - m) if w < 0.5 else g - (g - m) * (f32(1) - w)
        v = v * f32(beta2) + f32(1 - beta2) * g * g
        step_size = lr / (1 - beta1 ** t)
        denom = np.sqrt(v) / f32((1 - beta2 ** t) ** 0.5) + f32(eps)
        p = p + f32(-step_size) * m / denom
    return p, m, v


@pytest.mark.parametrize("optimizer", [optim.Adam(lr=0.1, betas=(0.3, 0.9), weight_decay=0.1),
                                       optim.Adam(lr=0.05, betas=(0.5, 0.99), eps=1e-3),
                                       optim.AdamW(lr=0.1, betas=(0.6, 0.95), weight_decay=0.2)], ids=repr)
def test_adam_matches_pytorch_formulas_on_both_lerp_branches(optimizer):
    """Folded bias corrections (step_size and eps scaled by sqrt(1 - beta2^t)) give PyTorch's values."""
    model = linear_loss_model()
    s = TrainingSession(model, loss="loss", optimizer=optimizer)
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(6)]
    for g in grads:
        s.step({"x": g})
    p0 = onnx.numpy_helper.to_array(model.graph.initializer[0])
    lr = float(np.float32(optimizer.lr))                     # the graph's lr is a float32 input
    p, m, v = torch_adam_reference(p0, grads, lr, optimizer.betas, optimizer.eps, optimizer.weight_decay,
                                   isinstance(optimizer, optim.AdamW))
    np.testing.assert_allclose(s.parameters()["w"], p, rtol=0, atol=1e-6)
    state = s.optimizer_state()["w"]
    np.testing.assert_allclose(state["exp_avg"], m, rtol=0, atol=1e-6)
    np.testing.assert_allclose(state["exp_avg_sq"], v, rtol=0, atol=1e-6)


def test_adam_holds_its_moments_scaled_for_float32_and_as_they_are_for_16_bit_parameters():
    """M = m / (1 - beta1), V = v / (1 - beta2): two full-size ops fewer, recorded in the spec (and the state
    inputs' doc strings); float16 moments as PyTorch's (V would overflow float16 a thousand times sooner)."""
    opt = optim.AdamW(betas=(0.8, 0.99))
    assert opt.state_scale(onnx.TensorProto.FLOAT) == pytest.approx({"exp_avg": 5.0, "exp_avg_sq": 100.0})
    assert opt.state_scale(onnx.TensorProto.FLOAT16) == {} and optim.SGD(momentum=0.9).state_scale(F) == {}
    art = artifacts.build(linear_loss_model(), "loss", opt, guard=False)
    assert art.spec.state_scale == {"w": opt.state_scale(F)}
    assert "times 100" in next(i.doc_string for i in art.train.graph.input if i.name == "w.exp_avg_sq")
    half = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Mul", ["w", "x"], ["wx"]),
         onnx.helper.make_node("ReduceSum", ["wx"], ["loss"], keepdims=0)], "half",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT16, [3, 4])],
        [onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT16, [])],
        [onnx.numpy_helper.from_array(np.ones((3, 4), np.float16), "w")]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    art = artifacts.build(half, "loss", opt, guard=False)
    assert art.spec.state_scale == {}
    assert [n.op_type for n in art.train.graph.node if n.name.startswith("train/optimizer/w/")
            and n.op_type != "Constant"] == "Mul Sub Mul Add Mul Mul Mul Add Sqrt Add Div Mul Sub".split()


# -- the session ----------------------------------------------------------------------------------------
def numpy_forward(params, x):
    h = np.maximum(x @ params["0.weight"].T + params["0.bias"], 0)
    return h @ params["2.weight"].T + params["2.bias"]


def test_eval_parameters_and_export_use_the_current_weights(tmp_path):
    s = session()
    for step in range(3):
        s.step(batch(step))
    params = s.parameters()
    out = s.eval({"x": DATA["x"][0]})
    assert list(out) == ["logits"]
    np.testing.assert_allclose(out["logits"], numpy_forward(params, DATA["x"][0]), rtol=1e-5, atol=1e-6)
    with_loss = s.eval(batch(0))                 # the target given: the loss comes too
    assert set(with_loss) == {"logits", "loss"}
    assert list(s.eval(batch(0), outputs=["loss"])) == ["loss"]
    with pytest.raises(onnxgrad.UnknownNameError, match="not an output"):
        s.eval({"x": DATA["x"][0]}, outputs=["loss"])
    path = tmp_path / "trained.onnx"
    s.export(path)
    exported = onnx.load(path)
    onnx.checker.check_model(exported, full_check=True)
    assert [i.name for i in exported.graph.input] == ["x"] and [o.name for o in exported.graph.output] == ["logits"]
    inits = {i.name: numpy_helper.to_array(i) for i in exported.graph.initializer}
    for name, value in params.items():
        np.testing.assert_array_equal(inits[name], value)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": DATA["x"][1]})[0], s.eval({"x": DATA["x"][1]})["logits"],
                               rtol=1e-6, atol=1e-7)


def test_model_with_its_own_loss_output():
    m = losses.cross_entropy(mlp_model(), "logits", "y")
    a = TrainingSession(m, loss="loss", optimizer=optim.SGD(lr=0.1))
    b = TrainingSession(mlp_model(), loss=ce(), optimizer=optim.SGD(lr=0.1))
    for step in range(2):
        assert a.step(batch(step)) == b.step(batch(step))
    assert list(a.eval({"x": DATA["x"][0]})) == ["logits"]
    assert [o.name for o in a.exported_model().graph.output] == ["logits"]


def test_learning_rate_is_an_input_and_step_count_is_kept():
    s = session(optim.SGD(lr=0.5))
    before = s.parameters()
    s.step(batch(0), lr=0.0)                      # a zero rate: weights unchanged, the step still counts
    assert s.step_count == 1
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, before[name])
    s.lr = 0.1
    s.step(batch(1))
    assert any(not np.array_equal(v, before[k]) for k, v in s.parameters().items())


def test_sgd_step_is_p_minus_lr_times_gradient():
    s = session(optim.SGD(lr=0.25))
    gm = onnxgrad.grad(losses.cross_entropy(mlp_model(), "logits", "y"), loss="loss")
    sess = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    grads = dict(zip(names, sess.run(None, batch(0))))
    before = s.parameters()
    s.step(batch(0))
    for name, value in s.parameters().items():
        np.testing.assert_allclose(value, before[name] - 0.25 * grads[f"{name}_grad"], rtol=0, atol=1e-7)


def test_frozen_parameters_stay_constant():
    s = session(optim.SGD(lr=0.1, momentum=0.9), frozen=["0.weight"])
    start = s.parameters()
    for step in range(3):
        s.step(batch(step))
    after = s.parameters()
    np.testing.assert_array_equal(after["0.weight"], start["0.weight"])
    assert not np.array_equal(after["0.bias"], start["0.bias"])
    assert "0.weight" not in s.spec.params and "0.weight" not in [i.name for i in s.artifacts.train.graph.input]


def test_optimizer_state_layout():
    s = session(optim.Adam())
    state = s.optimizer_state()
    assert set(state) == set(s.spec.params)
    assert set(state["0.weight"]) == {"exp_avg", "exp_avg_sq"}
    assert session(optim.SGD(lr=0.1)).optimizer_state() == {p: {} for p in s.spec.params}


def test_parameters_are_not_copied_to_the_host_between_steps():
    """Weights go in as bound OrtValues and the update is written back into the same ones (in place)."""
    s = session(optim.SGD(lr=0.1, momentum=0.9))
    cur = {k: (v, v.data_ptr()) for k, v in s._cur.items()}
    start = s.parameters()
    s.step(batch(0))
    s.step(batch(1))
    assert all(s._cur[k] is v and v.data_ptr() == ptr for k, (v, ptr) in cur.items())
    assert all(not np.array_equal(v, start[k]) for k, v in s.parameters().items())


def test_feed_names_are_checked():
    """The shapes and types of the feeds: tests/test_feeds.py."""
    s = session()
    with pytest.raises(onnxgrad.UnknownNameError, match=r"^step: missing input\(s\) 'y': the model needs x, y$"):
        s.step({"x": DATA["x"][0]})
    with pytest.raises(onnxgrad.UnknownNameError, match=r"^step: 'z' is not an input of the model \(its inputs: "
                       r"x, y\); remove it or correct the name$"):
        s.step({**batch(0), "z": DATA["x"][0]})
    assert s.step_count == 0


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_class_labels_out_of_range_are_refused_before_the_run(accumulation_steps, tmp_path):
    """A label outside [0, C) would give onnxruntime's "Out of range" (or a NaN gradient on another provider):
    step and eval say which label, where, and C, and change nothing."""
    s = session(accumulation_steps=accumulation_steps)
    start = s.parameters()
    y = np.array(DATA["y"][0][:2])
    y[1] = 7
    with pytest.raises(losses.LabelError, match=r"^step: target 7 is out of bounds: the label at position \[1\] of "
                       r"'y' is neither in \[0, 3\) \(cross_entropy over 3 classes of 'logits'\) nor ignore_index"):
        s.step({"x": DATA["x"][0][:2], "y": y})
    with pytest.raises(losses.LabelError, match=r"^eval: target 7 is out of bounds"):
        s.eval({"x": DATA["x"][0][:2], "y": y})
    y[1] = -100                                     # ignore_index counts for nothing, as in PyTorch
    for _ in range(accumulation_steps):
        s.step({"x": DATA["x"][0][:2], "y": y})
    assert s.step_count == 1 and all(np.isfinite(v).all() for v in s.parameters().values())
    assert any(not np.array_equal(v, start[k]) for k, v in s.parameters().items())
    s.save(tmp_path / "ckpt.npz")                   # a resumed session checks as well
    y[0] = 3
    with pytest.raises(losses.LabelError, match=r"^step: target 3 is out of bounds: the label at position \[0\]"):
        TrainingSession.load(tmp_path / "ckpt.npz").step({"x": DATA["x"][0][:2], "y": y})


@pytest.mark.parametrize("make, error, words", [
    (lambda: TrainingSession(mlp_model(), loss="nope"), onnxgrad.UnknownNameError, "not an output"),
    (lambda: TrainingSession(mlp_model(), loss=ce(), frozen=["W"]), onnxgrad.UnknownNameError, "not float"),
    (lambda: TrainingSession(mlp_model(), loss=ce(), frozen=["0.weight", "0.bias", "2.weight", "2.bias"]),
     onnxgrad.OnnxGradError, "nothing to train"),
    (lambda: TrainingSession(mlp_model(), loss=ce(), on_nonfinite="ignore"), onnxgrad.OnnxGradError, "on_nonfinite"),
    (lambda: TrainingSession(mlp_model(), loss=ce(), accumulation_steps=0), onnxgrad.OnnxGradError, "positive"),
    (lambda: optim.SGD(lr=-1), optim.OptimizerError, "learning rate"),
    (lambda: optim.SGD(nesterov=True), optim.OptimizerError, "nesterov"),
    (lambda: optim.Adam(betas=(0.9, 1.0)), optim.OptimizerError, "betas"),
    (lambda: optim.from_config({"type": "Lion"}), optim.OptimizerError, "unknown optimizer"),
])
def test_user_errors(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_optimizer_config_round_trips():
    for opt in (optim.SGD(lr=0.1, momentum=0.9, nesterov=True), optim.Adam(betas=(0.8, 0.9)), optim.AdamW(),
                optim.Adagrad(lr_decay=0.1, initial_accumulator_value=0.5)):
        assert optim.from_config(json.loads(json.dumps(opt.config()))) == opt
    assert optim.AdamW().weight_decay == 0.01 and optim.Adam().weight_decay == 0.0
    assert optim.SGD().lr == 1e-3 and optim.Adagrad().lr == 1e-2 and optim.Adagrad().eps == 1e-10


def test_double_precision_model_trains():
    m = mlp_model()
    for init in m.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    del m.graph.value_info[:]
    s = TrainingSession(m, loss=losses.MSELoss(output="logits", target="t"), optimizer=optim.Adam(lr=1e-2))
    t = np.eye(3)[DATA["y"][0]]
    first = s.step({"x": DATA["x"][0], "t": t})
    for _ in range(20):
        last = s.step({"x": DATA["x"][0], "t": t})
    assert last < first
    assert s.parameters()["0.weight"].dtype == np.float64


# -- NaN / Inf -------------------------------------------------------------------------------------------
def test_nonfinite_step_raises_and_applies_nothing():
    s = session(optim.Adam(lr=1e-2))
    s.step(batch(0))
    before, state = s.parameters(), s.optimizer_state()
    with pytest.raises(NonFiniteError, match="not applied"):
        s.step(poisoned())
    assert s.step_count == 1
    assert_unchanged(s, before, state)
    s.step(batch(1))
    assert s.step_count == 2 and all(np.isfinite(v).all() for v in s.parameters().values())


def test_nonfinite_step_can_be_skipped():
    s = session(optim.SGD(lr=0.1, momentum=0.9), on_nonfinite="skip")
    reference = session(optim.SGD(lr=0.1, momentum=0.9))
    s.step(batch(0))
    reference.step(batch(0))
    with pytest.warns(NonFiniteWarning, match="skipped"):
        loss = s.step(poisoned())
    assert np.isnan(loss) and s.skipped_steps == 1 and s.step_count == 1
    s.step(batch(1))
    reference.step(batch(1))
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, reference.parameters()[name])


def test_nonfinite_micro_batch_skips_the_whole_accumulated_update():
    s = session(optim.SGD(lr=0.1), accumulation_steps=2, on_nonfinite="skip")
    before = s.parameters()
    with pytest.warns(NonFiniteWarning):
        s.step(poisoned())
        s.step(batch(1))
    assert s.step_count == 0 and s.skipped_steps == 1
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, before[name])
    # the next window starts clean
    s.step(batch(0))
    s.step(batch(1))
    assert s.step_count == 1
    strict = session(optim.SGD(lr=0.1), accumulation_steps=2)
    with pytest.raises(NonFiniteError, match="not accumulated"):
        strict.step(poisoned())


# -- checkpoints -----------------------------------------------------------------------------------------
def trained(optimizer=None, steps=3, **kw):
    s = session(optimizer or optim.AdamW(lr=1e-2), **kw)
    for step in range(steps):
        s.step(batch(step))
    return s


@pytest.mark.parametrize("optimizer", [optim.AdamW(lr=1e-2), optim.SGD(lr=0.1, momentum=0.9, dampening=0.1),
                                       optim.Adagrad(lr=0.1, lr_decay=0.01)], ids=lambda o: type(o).__name__)
def test_resume_gives_bitwise_identical_steps(tmp_path, optimizer):
    s = trained(optimizer)
    s.lr = 0.02
    path = tmp_path / "ckpt.onnxgrad"
    s.save(path)
    expected_losses = [s.step(batch(step)) for step in (3, 4)]
    expected = s.parameters()
    r = TrainingSession.load(path)
    assert r.step_count == 3 and r.lr == 0.02 and r.optimizer == s.optimizer
    assert [r.step(batch(step)) for step in (3, 4)] == expected_losses
    for name, value in r.parameters().items():
        np.testing.assert_array_equal(value, expected[name])


def _legacy_zip_checkpoint(s: TrainingSession, path, version: int) -> None:
    """What ``TrainingSession.save`` wrote before the state file: a zip of a JSON header, the model and one
    ``.npy`` per array; version 1 held PyTorch's optimizer state values, version 2 the graph's ("state_scale")."""
    arrays = [({"kind": "param", "name": p}, s._cur[p].numpy()) for p in s.spec.params]
    pytorch = s.optimizer_state()
    for p, st in s.spec.state.items():
        for k, (i, _) in st.items():
            arrays.append(({"kind": "state", "param": p, "state": k},
                           pytorch[p][k] if version == 1 else s._cur[i].numpy()))
    model = s._stripped_model().SerializeToString()
    header = {"format": "onnxgrad-checkpoint", "version": version, "step_count": s.step_count, "skipped_steps": 0,
              "lr": s.lr, "micro": 0, "poisoned": False, "loss": s.spec.loss, "optimizer": s.spec.optimizer,
              "frozen": s.spec.frozen, "trainable": list(s.spec.params), "train_mode": s.spec.train_mode,
              "keep_grads": False, "strict_tags": False, "recompute": False, "clip_grad_norm": None,
              "accumulation_steps": 1, "on_nonfinite": "raise", "model_sha256": hashlib.sha256(model).hexdigest(),
              "arrays": [dict(meta, shape=list(a.shape), dtype=a.dtype.str) for meta, a in arrays]}
    if version >= 2:
        header["state_scale"] = s.spec.state_scale
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("header.json", json.dumps(header))
        z.writestr("model.onnx", model)
        for k, (_, a) in enumerate(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, a, allow_pickle=False)
            z.writestr(f"arrays/{k}.npy", buf.getvalue())


@pytest.mark.parametrize("version", [1, 2])
def test_a_checkpoint_of_the_earlier_zip_format_resumes(tmp_path, version):
    """Checkpoints written before the state file (a zip; version 1 holding PyTorch's optimizer state values, 2
    the graph's scaled ones) load and give the same steps (up to the rounding of the scale)."""
    s = trained()
    old = tmp_path / f"v{version}"
    _legacy_zip_checkpoint(s, old, version)
    pytorch = s.optimizer_state()
    r = TrainingSession.load(old)
    assert r.step_count == s.step_count and r.lr == s.lr
    for p, st in r.optimizer_state().items():
        for k, v in st.items():
            np.testing.assert_allclose(v, pytorch[p][k], rtol=1e-6, atol=0, err_msg=f"{p}.{k}")
    np.testing.assert_allclose([r.step(batch(step)) for step in (3, 4)], [s.step(batch(step)) for step in (3, 4)],
                               rtol=1e-6)


def test_a_checkpoint_is_a_safetensors_state_file(tmp_path):
    """The checkpoint is the state file of docs/artifacts.md: any safetensors reader gets every state input of
    the training model by name, lr and step in their canonical types, and the spec that names them."""
    from safetensors.numpy import load_file

    s = trained()
    s.lr = 0.02
    path = tmp_path / "ckpt.safetensors"
    s.save(path)
    tensors = load_file(path)
    spec = s.spec
    state_inputs = [i for st in spec.state.values() for i, _ in st.values()]
    assert set(tensors) == {*spec.params, *state_inputs, "lr", "step", "onnxgrad.model"}
    assert tensors["lr"].dtype == np.float32 and tensors["lr"].shape == () and tensors["lr"] == np.float32(0.02)
    assert tensors["step"].dtype == np.int64 and tensors["step"] == s.step_count + 1
    for name in (*spec.params, *state_inputs):
        np.testing.assert_array_equal(tensors[name], s._cur[name].numpy())
    meta = state.read(path).metadata
    assert meta["format"] == "onnxgrad-state" and meta["version"] == "1"
    assert json.loads(meta["training"])["params"] == spec.params


def test_resume_mid_accumulation(tmp_path):
    s = trained(optim.SGD(lr=0.1, momentum=0.9), steps=3, accumulation_steps=2)   # one micro-batch pending
    path = tmp_path / "ckpt"
    s.save(path)
    s.step(batch(3))
    expected = s.parameters()
    r = TrainingSession.load(path)
    r.step(batch(3))
    assert r.step_count == s.step_count == 2
    for name, value in r.parameters().items():
        np.testing.assert_array_equal(value, expected[name])


def test_restore_into_a_session(tmp_path):
    s = trained()
    path = tmp_path / "ckpt"
    s.save(path)
    fresh = session()
    fresh.restore(path)
    assert fresh.step_count == 3
    for name, value in fresh.parameters().items():
        np.testing.assert_array_equal(value, s.parameters()[name])


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    s = trained()
    path = tmp_path / "ckpt"
    s.save(path)
    saved = path.read_bytes()
    s.step(batch(3))
    real = state.atomic_write

    def half_then_disk_full(target, write):
        def failing(f):
            f.write(b"half a state file")
            raise OSError("disk full")
        real(target, failing)

    monkeypatch.setattr(state, "atomic_write", half_then_disk_full)
    with pytest.raises(OSError, match="disk full"):
        s.save(path)
    assert path.read_bytes() == saved
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]           # the temporary file is gone
    assert TrainingSession.load(path).step_count == 3


def test_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, sys, numpy as np, onnx
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_training import trained
        from onnxgrad.training import state
        s = trained()
        s.save({str(path)!r})
        print("saved", flush=True)
        s.step({{"x": np.ones((16, 8), np.float32), "y": np.zeros(16, np.int64)}})
        real = state.atomic_write
        def dying(target, write):
            def partial(f):
                f.write(b"partial")
                f.flush()
                os._exit(9)             # killed mid-write: no cleanup, no exception handling
            real(target, partial)
        state.atomic_write = dying
        s.save({str(path)!r})
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 9 and "saved" in r.stdout, r.stderr
    leftovers = [f for f in os.listdir(tmp_path) if f != "ckpt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".ckpt.")    # the abandoned temporary file
    s = TrainingSession.load(path)
    assert s.step_count == 3
    expected = trained().parameters()
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, expected[name])


def test_corrupt_checkpoints_raise_a_clear_error(tmp_path):
    s = trained()
    path = tmp_path / "ckpt"
    s.save(path)
    data = path.read_bytes()
    truncated = tmp_path / "truncated"
    truncated.write_bytes(data[: len(data) // 2])
    flipped = tmp_path / "flipped"
    damaged = bytearray(data)
    damaged[-100] ^= 0xFF                             # inside the tensors' data (the model, written last)
    flipped.write_bytes(bytes(damaged))
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"not a checkpoint at all")
    other = tmp_path / "other.safetensors"
    foreign_safetensors(other)
    for bad, why in ((truncated, "not a safetensors file"), (flipped, "do not match their checksum"),
                     (foreign, "not a safetensors file"), (other, "not an onnxgrad state file")):
        with pytest.raises(CorruptCheckpointError, match=why):
            TrainingSession.load(bad)
    with pytest.raises(onnxgrad.OnnxGradError, match="no checkpoint"):
        TrainingSession.load(tmp_path / "missing")


def foreign_safetensors(path) -> None:
    """A safetensors file that is not a state file (another program's weights)."""
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(3, np.float32)}, str(path))


def test_mismatched_checkpoint_raises(tmp_path):
    path = tmp_path / "ckpt"
    trained().save(path)
    with pytest.raises(CheckpointMismatchError, match="optimizer"):
        session(optim.SGD(lr=0.1)).restore(path)
    other = mlp_model()
    w = next(i for i in other.graph.initializer if i.name == "0.bias")
    w.CopyFrom(numpy_helper.from_array(np.zeros(16, np.float32), "0.bias"))
    frozen_other = TrainingSession(other, loss=ce(), optimizer=optim.AdamW(lr=1e-2), frozen=["0.bias"])
    with pytest.raises(CheckpointMismatchError, match="different model"):
        frozen_other.restore(path)
    with pytest.raises(CheckpointMismatchError, match="accumulates"):
        session(accumulation_steps=2).restore(path)


# -- the artifacts on their own (what the command line writes) -------------------------------------------------
def run_guarded(train, feeds_per_step, lr, initial):
    """Drive the training model with plain onnxruntime from the initial values, feeding the .next outputs back."""
    spec = artifacts.TrainingSpec.of(train)
    sess = ort.InferenceSession(train.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    carried = {k: v for k, v in initial.items() if k not in (spec.lr, spec.step)}
    results = []
    for step, feeds in enumerate(feeds_per_step, start=1):
        out = dict(zip(names, sess.run(None, {**feeds, spec.lr: np.array(lr, np.float32), spec.step: np.array(step, np.int64),
                                              **carried})))
        carried = {p: out[o] for p, o in spec.params.items()}
        carried.update({i: out[o] for st in spec.state.values() for i, o in st.values()})
        results.append(out)
    return results, carried


def test_training_model_runs_in_plain_onnxruntime_and_matches_the_session():
    art = artifacts.build(mlp_model(), ce(), optim.AdamW(lr=1e-2))
    onnx.checker.check_model(art.train, full_check=True)
    onnx.checker.check_model(art.eval, full_check=True)
    results, carried = run_guarded(art.train, [batch(i) for i in range(3)], 1e-2, art.initial_values())
    s = session(optim.AdamW(lr=1e-2))
    expected = [s.step(batch(i)) for i in range(3)]
    np.testing.assert_allclose([float(r["loss"]) for r in results], expected, rtol=0, atol=1e-6)
    for name, value in s.parameters().items():
        np.testing.assert_allclose(carried[name], value, rtol=0, atol=1e-6)
    # eval model: the parameters are required inputs (no stale defaults), and no initializer is also an input
    ev = ort.InferenceSession(art.eval.SerializeToString(), providers=["CPUExecutionProvider"])
    fed = ev.run(None, {"x": DATA["x"][0], **{p: carried[p] for p in art.spec.params}})[0]
    np.testing.assert_allclose(fed, s.eval({"x": DATA["x"][0]})["logits"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="missing"):
        ev.run(None, {"x": DATA["x"][0]})
    for m in (art.train, art.eval):
        assert not {i.name for i in m.graph.initializer} & {i.name for i in m.graph.input}


@pytest.mark.parametrize("path, predictions, target, data", [
    (FIXTURES / "mlp.onnx", "logits", "y", lambda k: batch(k)),
    (ROOT / "models" / "cnn_bn_dynamo.onnx", "y", "label",      # BatchNormalization: running statistics too
     lambda k: {"x": np.random.default_rng(k).standard_normal((2, 3, 16, 16)).astype(np.float32),
                "label": np.random.default_rng(k).integers(0, 5, 2).astype(np.int64)}),
], ids=["mlp", "cnn_bn"])
def test_written_artifacts_fed_their_next_outputs_back_train_as_the_session(tmp_path, capsys, path, predictions,
                                                                             target, data):
    """The README's loop, word for word: start from model.state.safetensors and feed every ``<name>.next`` output
    back as ``<name>`` (``step`` included: AdamW's bias correction reads it), nothing else."""
    model = tmp_path / "model.onnx"
    onnx.save(onnx.load(path), model)
    assert cli_main([str(model), "--loss-fn", "cross_entropy", "--predictions", predictions, "--target", target,
                     "--optimizer", "adamw", "--lr", "0.01", "--optimize-for", "cpu"]) == 0      # as the session runs
    capsys.readouterr()
    sess = ort.InferenceSession(str(tmp_path / "model.train.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    state = load_file(tmp_path / "model.state.safetensors")
    losses_fed = []
    for k in range(5):
        out = dict(zip(names, sess.run(None, {**data(k), **state})))
        losses_fed.append(float(out["loss"]))
        state.update({name[:-len(".next")]: value for name, value in out.items() if name.endswith(".next")})
    assert int(state["step"]) == 6
    # the written model records its class labels, for a loop of one's own to check a batch before a run
    [labels] = losses.class_targets(onnx.load(tmp_path / "model.train.onnx"))
    assert (labels.target, labels.ignore_index) == (target, -100)
    with pytest.raises(losses.LabelError, match=f"target {labels.classes} is out of bounds"):
        losses.check_labels([labels], {target: np.full(2, labels.classes)})
    s = TrainingSession(onnx.load(path), loss=losses.CrossEntropyLoss(output=predictions, target=target),
                        optimizer=optim.AdamW(lr=0.01))
    expected = [s.step(data(k)) for k in range(5)]
    np.testing.assert_allclose(losses_fed, expected, rtol=0, atol=1e-5)
    for name, value in {**s.parameters(), **s.buffers()}.items():
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_written_accumulation_artifacts_follow_the_readme_loop(tmp_path, capsys):
    """--accumulation-steps 2: the accumulate model on the first micro-batch, the train model on the second,
    every ``.next`` fed back, the sums from zeros again after each update: TrainingSession's updates."""
    model = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), model)
    assert cli_main([str(model), "--loss-fn", "cross_entropy", "--target", "y", "--optimizer", "adamw", "--lr",
                     "0.01", "--accumulation-steps", "2", "--optimize-for", "cpu"]) == 0
    capsys.readouterr()
    runs = {stem: ort.InferenceSession(str(tmp_path / f"mlp.{stem}.onnx"), providers=["CPUExecutionProvider"])
            for stem in ("accumulate", "train")}
    state = load_file(tmp_path / "mlp.state.safetensors")
    spec = artifacts.TrainingSpec.of(onnx.load(tmp_path / "mlp.train.onnx"))
    zeros = {i: np.zeros_like(state[p]) for p, (i, _) in spec.accumulators.items()}     # each update's start
    state.update(zeros)
    for k in range(3):
        for stem, half in (("accumulate", slice(0, 2)), ("train", slice(2, 4))):
            sess = runs[stem]
            feeds = {"x": DATA["x"][k][half], "y": DATA["y"][k][half], **state}
            out = dict(zip([o.name for o in sess.get_outputs()],
                           sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))
            state.update({name[:-len(".next")]: v for name, v in out.items() if name.endswith(".next")})
        state.update(zeros)
    s = session(accumulation_steps=2)
    for k in range(3):
        for half in (slice(0, 2), slice(2, 4)):
            s.step({"x": DATA["x"][k][half], "y": DATA["y"][k][half]})
    assert int(state["step"]) == s.step_count + 1 == 4
    for name, value in s.parameters().items():
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_guarded_training_model_keeps_old_values_on_nan():
    art = artifacts.build(mlp_model(), ce(), optim.SGD(lr=0.1, momentum=0.9))
    results, carried = run_guarded(art.train, [poisoned()], 0.1, art.initial_values())
    assert not bool(results[0]["finite"])
    assert int(results[0][art.spec.step_next]) == 1          # a step not applied is not counted (Adam's bias)
    for p in art.spec.params:
        np.testing.assert_array_equal(carried[p], art.initial_params[p])


def test_training_model_lists_its_inputs_and_outputs():
    art = artifacts.build(mlp_model(), ce(), optim.Adam(), clip_grad_norm=1.0, accumulation_steps=2)
    spec = artifacts.TrainingSpec.of(art.train)
    inputs = [i.name for i in art.train.graph.input]
    outputs = [o.name for o in art.train.graph.output]
    assert inputs[:2] == ["x", "y"] and spec.lr in inputs and spec.step in inputs
    assert outputs[:3] == ["loss", "finite", "grad_norm"]
    for p, out in spec.params.items():
        assert p in inputs and out == f"{p}.next" in outputs
        for s, (i, o) in spec.state[p].items():
            assert i == f"{p}.{s}" and i in inputs and o == f"{i}.next" in outputs
        assert spec.accumulators[p][0] in inputs
        assert spec.accumulators[p][1] in [o.name for o in art.accumulate.graph.output]
    assert all(vi.doc_string for vi in art.train.graph.output)
    onnx.checker.check_model(art.accumulate, full_check=True)
    # the guarded accumulation model keeps the old sums on a non-finite micro-batch
    sess = ort.InferenceSession(art.accumulate.SerializeToString(), providers=["CPUExecutionProvider"])
    acc = {i: np.full(art.initial_params[p].shape, 0.5, np.float32) for p, (i, _) in spec.accumulators.items()}
    params = {p: art.initial_params[p] for p in spec.params}
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**poisoned(), **acc, **params})))
    assert not out["finite"]
    for p, (i, o) in spec.accumulators.items():
        np.testing.assert_array_equal(out[o], acc[i])
    assert spec.clip_grad_norm == 1.0 and spec.accumulation_steps == 2
    assert all(n.domain in ("", "ai.onnx") for n in art.train.graph.node)


# -- command line ------------------------------------------------------------------------------------------------
def test_cli_writes_training_and_eval_models(tmp_path, capsys):
    model = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), model)
    rc = cli_main([str(model), "--loss-fn", "cross_entropy", "--target", "y", "--optimizer", "adamw",
                   "--lr", "0.01", "--clip-grad-norm", "5", "-v"])
    out = capsys.readouterr().out
    assert rc == 0
    train = onnx.load(tmp_path / "mlp.train.onnx")
    assert (tmp_path / "mlp.eval.onnx").exists()
    assert "lr: float32 []" in out and "0.weight.next: float32 [16, 8]" in out and "finite: bool []" in out
    spec = artifacts.TrainingSpec.of(train)
    assert spec.optimizer["type"] == "AdamW" and spec.optimizer["lr"] == 0.01
    initial = load_file(tmp_path / "mlp.state.safetensors")
    assert set(initial) == {i.name for i in train.graph.input} - {"x", "y"}
    results, _ = run_guarded(train, [batch(i) for i in range(3)], 0.01, initial)
    s = TrainingSession(mlp_model(), loss=ce(), optimizer=optim.AdamW(lr=0.01), clip_grad_norm=5)
    np.testing.assert_allclose([float(r["loss"]) for r in results], [s.step(batch(i)) for i in range(3)],
                               rtol=0, atol=1e-6)


def test_cli_loss_fn_without_optimizer_writes_the_gradient_model(tmp_path, capsys):
    model = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), model)
    assert cli_main([str(model), "--loss-fn", "mse", "--target", "t"]) == 0
    gm = onnx.load(tmp_path / "mlp.grad.onnx")
    assert [o.name for o in gm.graph.output] == ["logits", "loss", "0.weight_grad", "0.bias_grad",
                                                "2.weight_grad", "2.bias_grad"]


def test_cli_training_flags_and_errors(tmp_path, capsys):
    model = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), model)
    assert cli_main([str(model), "--loss-fn", "cross_entropy", "--target", "y", "--optimizer", "sgd",
                     "--lr", "0.1", "--momentum", "0.9", "--accumulation-steps", "2", "--freeze", "0.bias",
                     "-o", str(tmp_path / "t.train.onnx")]) == 0
    assert (tmp_path / "t.accumulate.onnx").exists()
    spec = artifacts.TrainingSpec.of(onnx.load(tmp_path / "t.train.onnx"))
    assert spec.frozen == ["0.bias"] and spec.optimizer["momentum"] == 0.9 and spec.accumulation_steps == 2
    capsys.readouterr()
    assert cli_main([str(model), "--loss-fn", "cross_entropy", "--optimizer", "sgd", "--betas", "0.9", "0.99"]) == 2
    assert "takes no --betas" in capsys.readouterr().err
    assert cli_main([str(model), "--optimizer", "adam"]) == 2          # no loss output named "loss"
    assert "loss 'loss' is not an output" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "onnxgrad", "--help"], capture_output=True, text=True, timeout=60)
    assert "--optimizer" in r.stdout and "--loss-fn" in r.stdout


# -- devices ---------------------------------------------------------------------------------------------------
def test_default_providers_follow_the_installed_runtime():
    s = session()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert s.device == "cpu" and s._train.get_providers() == ["CPUExecutionProvider"]


# -- the example ---------------------------------------------------------------------------------------------------
def test_digits_example_reaches_95_percent(tmp_path):
    exported = tmp_path / "digits.onnx"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_digits.py"), "--export", str(exported)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("test accuracy: ")]
    assert line, r.stdout
    assert float(line[-1].split(": ")[1]) >= 0.95
    assert "training" in r.stderr           # the tqdm progress bar
    onnx.checker.check_model(onnx.load(exported), full_check=True)


def test_the_build_leaves_the_users_node_names_as_they_were(tmp_path):
    """The passes name unnamed nodes in their own copies only: the loss and eval models (and so the hash a
    checkpoint carries) keep the user's names, here none; the training model names them ``<op>_<index>``."""
    from onnx import helper

    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    art = artifacts.build(m, "loss", optim.SGD(lr=0.1))
    assert [n.name for n in art.loss_model.graph.node] == ["", ""]
    assert [n.name for n in m.graph.node] == ["", ""]
    assert [n.name for n in art.train.graph.node][:2] == ["MatMul_0", "ReduceSum_1"]
    s = TrainingSession(m, loss="loss", optimizer=optim.SGD(lr=0.1))
    s.step({"x": np.ones((4, 3), np.float32)})
    s.save(tmp_path / "ck")
    TrainingSession(m, loss="loss", optimizer=optim.SGD(lr=0.1)).restore(tmp_path / "ck")


def test_the_command_lines_state_file_restores_into_a_session(tmp_path, capsys):
    """The CLI's initial state is a checkpoint at step 0: a session of the same model and optimizer restores it
    (the fingerprints agree), trains from it as from its own start, and TrainingSession.load says what is missing."""
    model = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), model)
    assert cli_main([str(model), "--loss-fn", "cross_entropy", "--target", "y", "--optimizer", "adamw",
                     "--lr", "0.01"]) == 0
    capsys.readouterr()
    s = TrainingSession(mlp_model(), loss=ce(), optimizer=optim.AdamW(lr=0.01))
    s.restore(tmp_path / "mlp.state.safetensors")
    fresh = TrainingSession(mlp_model(), loss=ce(), optimizer=optim.AdamW(lr=0.01))
    assert [s.step(batch(k)) for k in range(2)] == [fresh.step(batch(k)) for k in range(2)]
    with pytest.raises(onnxgrad.OnnxGradError, match=r"holds the state but not the model.*\.restore\(path\)"):
        TrainingSession.load(tmp_path / "mlp.state.safetensors")
    with pytest.raises(CheckpointMismatchError, match="optimizer is AdamW"):
        TrainingSession(mlp_model(), loss=ce(), optimizer=optim.SGD(lr=0.01)).restore(tmp_path / "mlp.state.safetensors")
