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
from artifacts_loop import train_job
from train_fixtures import write_job

from onnxgrad import TrainingSession, optim
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


SESSIONS = {          # the jobs a Python session also trains, for checkpoints both ways
    "mlp": lambda: TrainingSession(ROOT / "models" / "mlp_ce_dynamo.onnx", loss="loss", optimizer=optim.AdamW(lr=0.01),
                                   providers=["CPUExecutionProvider"]),
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Build each fixture with the CLI (webgpu target), write the manifest, run js/'s tests (`npm test`)."""
    folder = tmp_path_factory.mktemp("js")
    manifest: dict = {"models": {}}
    cases = {}
    for name in ("mlp", "bn_cnn", "lstm12"):
        batches = write_job(folder, name, STEPS)
        session = SESSIONS.get(name)
        cases[name] = (None, None, batches, session)
        entry = {"train": f"{name}.train.onnx", "eval": f"{name}.eval.onnx", "state": f"{name}.state.safetensors",
                 "schedule": f"{name}.schedule.onnx", "steps": STEPS}
        if session is not None:                       # a Python session's checkpoint after 2 steps, for JS
            s = session()
            for b in batches[:2]:
                s.step(b)
            s.save(folder / f"{name}.py_checkpoint.safetensors")
            entry.update(python_checkpoint=f"{name}.py_checkpoint.safetensors", python_checkpoint_steps=2)
        manifest["models"][name] = entry
    write_job(folder, "mlp", 1, extra=("--accumulation-steps", "2"), stem="mlp_accumulating")
    manifest["refused"] = {"mlp_accumulating": "accumulate"}     # what the JS session does not run, and why
    (folder / "manifest.json").write_text(json.dumps(manifest))
    tests = sorted(str(p.relative_to(JS)) for p in (JS / "test").glob("*.test.js"))     # not their helpers
    r = subprocess.run([NODE, "--test", *tests], cwd=JS, env={**os.environ, "ONNXGRAD_JS_FIXTURES": str(folder)},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "# skipped 0" in r.stdout, r.stdout[-2000:]
    return folder, cases


@pytest.mark.parametrize("name", ["mlp", "bn_cnn", "lstm12"])
def test_node_trains_as_python_does(ran, name):
    folder, _ = ran
    want_losses, want = train_job(folder, name)
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
    want_losses, _ = train_job(folder, "mlp")
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
    folder, _ = ran
    _, want = train_job(folder, "mlp", steps=4)
    checkpoint = state.read(folder / "mlp.js_checkpoint.safetensors")
    params = checkpoint.training["params"]
    assert any(not np.allclose(checkpoint.tensors[p], want[p], rtol=1e-4, atol=1e-6) for p in params)
