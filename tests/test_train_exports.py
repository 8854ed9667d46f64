"""Every exported model a user trains, trained: the models of models/ and the exporters' default exports of
models/trains/, each through ``TrainingSession`` with onnxgrad's default parameter policy, against PyTorch's
own trajectory in train mode (``models/export_training.py`` wrote them; these tests need no torch), or
refused/warned before the first step with the way out where the export cannot train as PyTorch would.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad import TrainingSession, losses, optim
from onnxgrad.tools.cli import main as cli_main

MODELS = Path(__file__).resolve().parent.parent / "models"
TRAINS = MODELS / "trains"
EVERY_MODEL = sorted([p for p in MODELS.glob("*.onnx") if not p.name.endswith(".grad.onnx")]
                     + list(TRAINS.glob("*.onnx")))
TRAJECTORIES = sorted(p.stem for p in TRAINS.glob("*.npz"))
OPTIMIZERS = {"sgd": lambda: optim.SGD(lr=0.05, momentum=0.9),
              "adamw": lambda: optim.AdamW(lr=0.01, weight_decay=0.01)}

# the exports that cannot train as PyTorch's model.train() would: what onnxgrad says, before the first step
REFUSED = {"cnn_dynamo": "folded BatchNorm 'bn', 'block.bn1', 'block.bn2'",     # dynamo optimize=True
           "cnn_legacy_eval": "by constant folding"}                             # TorchScript TrainingMode.EVAL
WARNED = {"scaled_dynamo": "exp(logit_scale) folded into the constant 'exp'"}


def _model_path(stem: str) -> Path:
    return TRAINS / f"{stem}.onnx" if (TRAINS / f"{stem}.onnx").exists() else MODELS / f"{stem}.onnx"


def _trained(stem: str):
    """The session after the reference's steps, its losses, and the reference."""
    with np.load(TRAINS / f"{stem}.npz") as z:
        ref = {k: z[k] for k in z.files}
    model = onnx.load(str(_model_path(stem)))
    feeds = {k[len("input/"):]: v for k, v in ref.items() if k.startswith("input/")}
    if "target" in ref:
        model = losses.mse_loss(model, output=str(ref["output"]), target="target")
        feeds["target"] = ref["target"].astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", onnxgrad.ExportWarning)        # these train as PyTorch does: no warning
        s = TrainingSession(model, loss="loss", optimizer=OPTIMIZERS[str(ref["optimizer"])]())
    got = np.array([s.step(feeds) for _ in range(len(ref["losses"]))])
    return s, got, ref


def _torch_layout(value: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """An initializer in its PyTorch parameter's layout: as it is, reshaped, or (a folded MatMul weight)
    transposed."""
    if value.shape != reference.shape and value.ndim == 2 and value.T.shape == reference.shape:
        return value.T
    return value.reshape(reference.shape)


def test_every_model_is_trained_or_refused_here():
    """A model added to models/ without a trajectory or an expected refusal fails here."""
    stems = {p.stem for p in EVERY_MODEL}
    assert stems == set(TRAJECTORIES) | set(REFUSED) | set(WARNED), stems ^ (set(TRAJECTORIES) | set(REFUSED)
                                                                              | set(WARNED))


@pytest.mark.parametrize("stem", TRAJECTORIES)
def test_trains_as_pytorch(stem):
    """Losses at every step and the parameters and running statistics after them: PyTorch's (float64) up to
    float32 rounding."""
    s, got, ref = _trained(stem)
    np.testing.assert_allclose(got, ref["losses"], rtol=2e-5, err_msg=f"{stem}: losses")
    params = s.parameters()
    report = s.artifacts.report
    init = {k[len("init/"):]: v for k, v in ref.items() if k.startswith("init/")}
    if init:
        assert set(init) <= set(params), set(init) - set(params)
        for name, want in init.items():
            np.testing.assert_allclose(params[name], want, rtol=1e-4, atol=2e-6, err_msg=f"{stem}: {name}")
    else:       # merged by value: each trained tensor by its PyTorch name, every PyTorch parameter once
        torch_params = {k[len("torch/"):]: v for k, v in ref.items() if k.startswith("torch/")}
        alias = {k[len("alias/"):]: str(v) for k, v in ref.items() if k.startswith("alias/")}
        seen = set()
        for name, value in params.items():
            torch_name = alias.get(report[name].torch_name, report[name].torch_name)
            assert torch_name in torch_params, f"{stem}: '{name}' holds '{torch_name}', not a PyTorch parameter"
            want = torch_params[torch_name]
            np.testing.assert_allclose(_torch_layout(value, want), want, rtol=1e-4, atol=2e-6,
                                       err_msg=f"{stem}: {name} ({torch_name})")
            seen.add(torch_name)
        assert seen == set(torch_params), f"{stem}: PyTorch parameters not trained: {set(torch_params) - seen}"
    running = {k[len("running/"):]: v for k, v in ref.items() if k.startswith("running/")}
    buffers = s.buffers()
    for name, want in running.items():
        np.testing.assert_allclose(buffers[name], want, rtol=1e-4, atol=2e-6, err_msg=f"{stem}: {name}")


def test_default_transformer_export_gets_its_merged_and_dropped_parameters_back():
    """torch.onnx.export(dynamo=True)'s default optimizer merged the LayerNorm weights of 1 and zero biases
    of different modules into one initializer each and dropped a zero bias: each is a tensor of its own
    again, under PyTorch's name, as PyTorch trains them."""
    report = onnxgrad.parameters(str(TRAINS / "encoder_dynamo.onnx"))
    merged = {p.name: p.merged_into for p in report if p.merged_into}
    assert merged == {"layer.norm1.weight": "ln.weight", "layer.norm1.bias": "ln.bias",
                      "layer.norm2.weight": "ln.weight", "layer.norm2.bias": "ln.bias"}, merged
    restored = [p for p in report if p.zeros is not None]
    assert [(p.name, p.zeros, p.trainable) for p in restored] == [("layer.self_attn.out_proj.bias", (16,), True)]
    assert not report.findings


def test_a_tied_head_stays_one_parameter_in_a_default_export():
    """A tie looks like a merge in the graph (one initializer, two names in the signature); the head's values
    are random, not a constant fill or a cloned layer's, so it stays one parameter, as PyTorch's."""
    report = onnxgrad.parameters(str(TRAINS / "tied_lm_dynamo.onnx"))
    assert not [p for p in report if p.merged_into] and not report.findings
    assert "head.weight" in report.trainable and report["val_6"].tied_to == "head.weight"


@pytest.mark.parametrize("stem", sorted(REFUSED))
def test_folded_batch_norm_is_refused_in_train_mode_with_the_way_out(stem):
    model = losses.mse_loss(onnx.load(str(_model_path(stem))), output="y", target="target")
    with pytest.raises(onnxgrad.ExportFoldedError) as e:
        TrainingSession(model, loss="loss", optimizer=optim.SGD(lr=0.1))
    message = str(e.value)
    assert REFUSED[stem].split("'")[0].split()[-1] in message and "onnxgrad.from_torch" in message
    assert "train_mode=False" in message
    with pytest.warns(onnxgrad.ExportWarning, match="statistics frozen"):          # frozen BN: said, not refused
        TrainingSession(model, loss="loss", optimizer=optim.SGD(lr=0.1), train_mode=False)


def test_dynamo_fold_names_every_folded_batch_norm():
    report = onnxgrad.parameters(str(MODELS / "cnn_dynamo.onnx"))
    (finding,) = report.findings
    assert finding.kind == "batchnorm_folded" and finding.refused_in_train_mode
    assert set(finding.tensors) == {"bn", "block.bn1", "block.bn2"}


def test_a_parameter_folded_into_a_function_of_it_is_left_out_with_a_warning():
    """exp(logit_scale) folded to the constant 'exp': training 'exp' would be a different update than
    PyTorch's on logit_scale, so it is not trained, and the session says so before the first step."""
    path = str(TRAINS / "scaled_dynamo.onnx")
    report = onnxgrad.parameters(path)
    assert not report["exp"].trainable and report["exp"].torch_name == "logit_scale"
    assert [f.kind for f in report.findings] == ["not_one_to_one"]
    model = losses.mse_loss(onnx.load(path), output="logits", target="target")
    with pytest.warns(onnxgrad.ExportWarning, match="from_torch.*'logit_scale'"):     # the way out first
        s = TrainingSession(model, loss="loss", optimizer=optim.SGD(lr=0.1))
    assert "exp" not in s.spec.params


def test_torchscript_training_mode_batch_norm_trains_and_evaluates_in_the_right_modes():
    """training=TrainingMode.TRAINING exports BatchNormalization in training mode: step() updates the running
    statistics as PyTorch does (test_trains_as_pytorch), and eval() and export() normalise with them."""
    s, _, ref = _trained("cnn_legacy_training")
    bn = [n for n in s.exported_model().graph.node if n.op_type == "BatchNormalization"]
    assert bn and all(not any(a.name == "training_mode" and a.i for a in n.attribute) for n in bn)
    assert all(len(n.output) == 1 for n in bn)
    x = ref["input/x"]
    other = x.copy()
    other[1:] = 0.0         # the export's batch size is fixed: another batch with the same first sample
    first, again = s.eval({"x": x})["y"][0], s.eval({"x": other})["y"][0]
    np.testing.assert_allclose(first, again, rtol=1e-5, atol=1e-6)     # no batch statistics in inference


def test_cli_trains_the_default_transformer_export_and_refuses_a_folded_one(tmp_path, capsys):
    out = tmp_path / "enc.train.onnx"
    code = cli_main([str(TRAINS / "encoder_dynamo.onnx"), "--loss-fn", "mse", "--target", "target",
                     "--optimizer", "adamw", "--lr", "0.01", "-o", str(out), "-v"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "warning" not in captured.err and "Traceback" not in captured.err
    assert "layer.norm1.weight" in captured.out
    code = cli_main([str(MODELS / "cnn_dynamo.onnx"), "--loss-fn", "mse", "--target", "target",
                     "--optimizer", "sgd", "--lr", "0.1", "-o", str(tmp_path / "cnn.train.onnx")])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot train as PyTorch would") and "--eval-mode" in lines[0]


def test_cli_params_shows_the_findings(capsys):
    assert cli_main(["params", str(TRAINS / "scaled_dynamo.onnx")]) == 0
    out = capsys.readouterr().out
    assert "what the exporter did that training cannot undo: 1" in out and "logit_scale" in out


def test_embedding_padding_row_gets_no_gradient_as_in_pytorch():
    """nn.Embedding(padding_idx=0) exports as a plain Gather; the dynamo exporter's node metadata records the
    aten.embedding call, and the Gather rule gives row 0 no gradient, as PyTorch does (the trajectory test
    above fails without it). The numeric check compares every other row against central differences."""
    from onnxgrad.tools.check import check, random_inputs

    model = onnx.load(str(TRAINS / "encoder_dynamo.onnx"))
    gm = onnxgrad.grad(model, wrt=["emb.weight"], of=["logits"])
    feeds = random_inputs(model, 0)
    feeds["idx"][:, -1] = 0                         # the padding token is read
    result = check(model, gm, feeds, rng=1)
    assert result.ok(1e-4), result.errors
    assert np.all(result.analytic["emb.weight"][0] == 0.0)
    assert np.any(result.analytic["emb.weight"][1:] != 0.0)
