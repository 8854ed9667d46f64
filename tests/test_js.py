"""The JavaScript session (js/) on onnxruntime-node against Python, on artifacts the CLI writes: the same losses and
parameters step by step, checkpoints that move between Python and JavaScript both ways and resume exactly, and
the trained inference model it exports. Runs js/'s own tests under node's test runner with the fixtures built
here. Skipped where node or js/node_modules is missing (`cd js && npm ci`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from artifacts_loop import train_steps
from safetensors.numpy import save_file

from onnxgrad import TrainingSession, optim
from onnxgrad.tools.cli import main as cli_main
from onnxgrad.training import state

ROOT = Path(__file__).resolve().parents[1]
JS = ROOT / "js"
NODE = shutil.which("node")
STEPS = 5
pytestmark = [
    pytest.mark.skipif(NODE is None or not (JS / "node_modules" / "onnxruntime-node").is_dir(),
                       reason="needs node and js/node_modules: cd js && npm ci"),
    pytest.mark.slow,
]


def fixtures():
    """name -> (model file, CLI arguments, batches, TrainingSession factory or None)."""
    rng = np.random.default_rng(7)
    bn = dict(np.load(ROOT / "models" / "train_step" / "cnn_bn_dynamo.npz"))
    from test_optimize_webgpu import lstm_model
    return {
        "mlp": (ROOT / "models" / "mlp_ce_dynamo.onnx", ["--loss", "loss", "--optimizer", "adamw", "--lr", "0.01"],
                [{"x": rng.standard_normal((8, 16)).astype(np.float32), "target": rng.integers(0, 4, 8)}
                 for _ in range(STEPS)],
                lambda: TrainingSession(ROOT / "models" / "mlp_ce_dynamo.onnx", loss="loss",
                                        optimizer=optim.AdamW(lr=0.01), providers=["CPUExecutionProvider"])),
        "bn_cnn": (ROOT / "models" / "cnn_bn_dynamo.onnx",
                   ["--loss-fn", "mse", "--target", "t", "--predictions", str(bn["output"]), "--optimizer", "sgd",
                    "--lr", "0.05", "--momentum", "0.9"],
                   [{"x": (bn["x"] + rng.normal(0, 0.5, bn["x"].shape)).astype(np.float32), "t": bn["t"]}
                    for _ in range(STEPS)], None),
        "lstm12": (lstm_model(), ["--loss-fn", "cross_entropy", "--target", "t", "--predictions", "y",
                                  "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9"],
                   [{"x": rng.standard_normal((12, 2, 4)).astype(np.float32), "t": rng.integers(0, 3, 2)}
                    for _ in range(STEPS)], None),
    }


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Build each fixture with the CLI (webgpu target), write the manifest, run `node --test js/test/`."""
    folder = tmp_path_factory.mktemp("js")
    manifest: dict = {"models": {}}
    cases = fixtures()
    for name, (model, args, batches, session) in cases.items():
        path = folder / f"{name}.onnx"
        if isinstance(model, onnx.ModelProto):
            onnx.save(model, path)
        else:
            shutil.copy(model, path)
        assert cli_main([str(path), *args, "--optimize-for", "webgpu", "-o", str(folder / f"{name}.train.onnx")]) == 0
        save_file({f"{k}/{i}": np.ascontiguousarray(v) for k, b in enumerate(batches) for i, v in b.items()},
                  str(folder / f"{name}.batches.safetensors"))
        entry = {"train": f"{name}.train.onnx", "eval": f"{name}.eval.onnx", "state": f"{name}.state.safetensors",
                 "schedule": f"{name}.schedule.onnx", "steps": STEPS}
        if session is not None:                       # a Python session's checkpoint after 2 steps, for JS
            s = session()
            for b in batches[:2]:
                s.step(b)
            s.save(folder / f"{name}.py_checkpoint.safetensors")
            entry.update(python_checkpoint=f"{name}.py_checkpoint.safetensors", python_checkpoint_steps=2)
        manifest["models"][name] = entry
    (folder / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([NODE, "--test", "test/"], cwd=JS, env={**os.environ, "ONNXGRAD_JS_FIXTURES": str(folder)},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "# skipped 0" in r.stdout, r.stdout[-2000:]
    return folder, cases


def python_run(folder: Path, name: str, batches):
    held = state.read(folder / f"{name}.state.safetensors")
    schedule = folder / f"{name}.schedule.onnx"
    return train_steps(onnx.load(folder / f"{name}.train.onnx"), onnx.load(schedule) if schedule.exists() else None,
                       held.tensors, held.training["loss"], batches)


@pytest.mark.parametrize("name", ["mlp", "bn_cnn", "lstm12"])
def test_node_trains_as_python_does(ran, name):
    folder, cases = ran
    batches = cases[name][2]
    want_losses, want = python_run(folder, name, batches)
    got = json.loads((folder / f"{name}.js_result.json").read_text())
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5)
    checkpoint = state.read(folder / f"{name}.js_checkpoint.safetensors")          # Python reads JS's file
    spec = checkpoint.training
    for p in spec["params"]:
        np.testing.assert_allclose(checkpoint.tensors[p], want[p], rtol=1e-4, atol=1e-6, err_msg=p)
    assert int(checkpoint.tensors[spec["step"]]) == STEPS + 1


@pytest.mark.parametrize("name", ["mlp", "bn_cnn", "lstm12"])
def test_the_exported_model_is_the_trained_inference_model(ran, name):
    folder, cases = ran
    exported = onnx.load(folder / f"{name}.js_exported.onnx")
    onnx.checker.check_model(exported, full_check=True)
    batch = cases[name][2][0]
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(batch[i.name]).astype(np.int32 if i.type == "tensor(int32)" else batch[i.name].dtype)
             for i in sess.get_inputs()}
    assert set(feeds) <= set(batch), "the exported model still asks for a trained tensor"
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    evals = json.loads((folder / f"{name}.js_result.json").read_text())["evals"]
    for k, v in got.items():
        np.testing.assert_allclose(np.asarray(v, np.float64).reshape(-1), evals[k], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_goes_python_to_js_and_back(ran):
    folder, cases = ran
    _, _, batches, session = cases["mlp"]
    want_losses, _ = python_run(folder, "mlp", batches)
    resumed = json.loads((folder / "mlp.js_resumed.json").read_text())["losses"]
    np.testing.assert_allclose(resumed, want_losses[2:], rtol=1e-5)          # Python 2 steps, then JS 3
    s = session()                                                             # and JS 5 steps, then Python
    s.restore(folder / "mlp.js_checkpoint.safetensors")
    assert s.step_count == STEPS
    reference = session()
    for b in batches:
        reference.step(b)
    for p, v in reference.parameters().items():
        np.testing.assert_allclose(s.parameters()[p], v, rtol=1e-4, atol=1e-6, err_msg=p)
    assert s.step(batches[0]) == pytest.approx(reference.step(batches[0]), rel=1e-5)


def test_the_checks_can_fail(ran):
    # a checkpoint of another step is told apart: the comparison above is not vacuous
    folder, cases = ran
    _, want = python_run(folder, "mlp", cases["mlp"][2][:4])
    checkpoint = state.read(folder / "mlp.js_checkpoint.safetensors")
    params = checkpoint.training["params"]
    assert any(not np.allclose(checkpoint.tensors[p], want[p], rtol=1e-4, atol=1e-6) for p in params)
