"""Training in a real browser: Chromium (headless, WebGPU on SwiftShader's software adapter) runs the JavaScript
session on onnxruntime-web 1.30, on wasm and on WebGPU through both bundles (JSEP and the native provider), and
every step must equal Python's on the same files: losses within 1e-5 relative, parameters within 1e-4, every node
of the training model placed on the WebGPU provider. The LSTM's canonical artifacts show what this catches: JSEP
trains them silently wrong. Skipped with one line where Chromium, Playwright or js/node_modules is missing."""
from __future__ import annotations

import base64

import browser_support as B
import numpy as np
import onnx
import pytest
from artifacts_loop import train_job
from train_fixtures import write_job

from onnxgrad.passes.optimize import TARGETS
from onnxgrad.training import state

STEPS = 3
MODELS = ["bn_cnn", "dw_cnn", "lstm12", "gpt", "mlp"]
pytestmark = [pytest.mark.skipif(B.missing() is not None, reason=f"browser tests: {B.missing()}"), pytest.mark.slow]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("browser")
    for name in MODELS:
        write_job(out, name, STEPS)
    wide = out / "wide"                 # the webgpu target less its Concat and Split trees
    wide.mkdir()
    with pytest.MonkeyPatch.context() as m:
        m.setitem(TARGETS, "webgpu", tuple(r for r in TARGETS["webgpu"] if r not in ("concat_tree", "split_tree")))
        write_job(wide, "lstm12", STEPS)
    return out


@pytest.fixture(scope="module")
def page(folder):
    with B.served(folder) as url, B.chromium() as browser:
        page = browser.new_page()
        lines: list[str] = []
        page.on("console", lambda m: lines.append(m.text))
        page.goto(url + "/tests/browser/harness.html")
        page.wait_for_function("window.ready === true")
        page.console_lines = lines
        yield page


def browser_run(page, folder, config, name, fixture=None):
    bundle, ep = B.CONFIGS[config]
    schedule = (folder / f"{name}.schedule.onnx").exists()
    result = page.evaluate("c => window.train(c)", {"bundle": bundle, "ep": ep, "name": fixture or name,
                                                    "steps": STEPS, "schedule": schedule})
    path = folder / f"{name}.{config}.checkpoint.safetensors"
    path.write_bytes(base64.b64decode(result["checkpoint"]))
    return result["losses"], state.read(path), result["ms"]


def worst(held, want, params):
    return max(float(np.max(np.abs(held.tensors[p] - want[p]) / (1e-4 + 1e-4 * np.abs(want[p])))) for p in params)


@pytest.mark.parametrize("config", list(B.CONFIGS))
@pytest.mark.parametrize("name", MODELS)
def test_the_browser_trains_as_python_does(page, folder, config, name):
    want_losses, want = train_job(folder, name)
    losses, held, ms = browser_run(page, folder, config, name)
    print(f"{name} {config}: {ms:.1f} ms/step ({B.adapter(page) if config != 'wasm' else 'wasm'})")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for p in held.training["params"]:
        np.testing.assert_allclose(held.tensors[p], want[p], rtol=1e-4, atol=1e-4, err_msg=p)
    assert int(held.tensors[held.training["step"]]) == STEPS + 1


@pytest.mark.parametrize("config", ["jsep", "webgpu"])
@pytest.mark.parametrize("name", MODELS)
def test_every_training_node_runs_on_webgpu(page, config, name):
    bundle, ep = B.CONFIGS[config]
    page.console_lines.clear()
    page.evaluate("c => window.placements(c)", {"bundle": bundle, "ep": ep, "name": name})
    placed = B.placed(page.console_lines)
    assert placed and set(placed) <= {"JsExecutionProvider", "WebGpuExecutionProvider"}, placed


@pytest.mark.parametrize("config", ["jsep", "webgpu"])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_a_nan_batch_is_refused_on_the_gpu(page, config, name):
    # the finiteness check (|x| < FLT_MAX) and softmax's NaN rows (not x == x) rely on NaN comparisons on the GPU
    bundle, ep = B.CONFIGS[config]
    r = page.evaluate("c => window.nanStep(c)", {"bundle": bundle, "ep": ep, "name": name})
    assert r["refused"] == "NonFiniteError" and r["unchanged"], r
    assert r["stepCount"] == 1 and np.isfinite(r["loss"])


@pytest.mark.parametrize("config", ["jsep", "webgpu"])
def test_the_state_stays_on_the_gpu_without_a_leak(page, config):
    # 1000 steps: each step's state outputs are new GPU buffers; the ones they replace are disposed, and release()
    # frees the last set
    bundle, _ = B.CONFIGS[config]
    r = page.evaluate("c => window.leak(c)", {"bundle": bundle, "name": "mlp", "steps": 1000})
    assert r["afterSteps"] == r["held"] * (1000 - 1)          # the first step replaced the file's CPU tensors
    assert r["afterRelease"] == r["held"] * 1000
    assert np.isfinite(r["loss"]) and r["loss"] < 0.5          # one batch, 1000 AdamW steps: it is learnt


def test_jsep_trains_wide_concats_and_splits_silently_wrong(page, folder):
    # what the Concat and Split trees are for, and proof that the comparison above can fail: without them the LSTM
    # gradient concatenates and splits its 12 time steps in single nodes, which JSEP computes wrong, no error raised
    wide = folder / "wide"
    onnx_ops = onnx.load(wide / "lstm12.train.onnx").graph.node
    assert max(len(n.input) for n in onnx_ops if n.op_type == "Concat") >= 8
    want_losses, want = train_job(wide, "lstm12")
    losses, held, _ = browser_run(page, wide, "jsep", "lstm12", fixture="wide/lstm12")
    assert np.allclose(losses[0], want_losses[0], rtol=1e-5)             # the forward is right
    assert worst(held, want, held.training["params"]) > 1                # the update is not
