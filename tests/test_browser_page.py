"""The digits page (examples/browser) in headless Chromium, as a visitor uses it: train on wasm, the loss falls and
test accuracy passes 0.9, the curve is drawn (a screenshot in the test's folder), a reload resumes from the saved
checkpoint, WebGPU continues the same run, and the downloaded ONNX model classifies the test digits as well in
onnxruntime. Skipped with one line where Chromium, Playwright or js/node_modules is missing."""
from __future__ import annotations

import base64

import browser_support as B
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file

PAGE = "/examples/browser/index.html"
pytestmark = [pytest.mark.skipif(B.missing() is not None, reason=f"browser tests: {B.missing()}"), pytest.mark.slow]


def ready(page) -> str:
    page.wait_for_function("() => window.digits && !/loading/.test(document.getElementById('status').textContent)")
    return page.text_content("#status")


def test_the_digits_page_trains_resumes_and_exports(tmp_path):
    with B.served() as url, B.chromium() as browser:
        page = browser.new_page()
        page.goto(url + PAGE)
        assert ready(page).startswith("ready on wasm")
        page.evaluate("() => window.digits.train(3)")
        losses = page.evaluate("() => window.digits.state.losses")
        accuracy = page.evaluate("() => window.digits.state.accuracy")
        assert len(losses) == 3 * 47 and np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
        assert accuracy >= 0.9, accuracy
        drawn = page.evaluate("""() => { const c = document.getElementById('curve');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }""")
        assert drawn > 500                                                  # the curve, not an empty canvas
        page.screenshot(path=str(tmp_path / "digits.png"))
        print(f"screenshot: {tmp_path / 'digits.png'}; test accuracy {accuracy:.3f} after 141 wasm steps")

        model = page.evaluate("""async () => { const a = document.getElementById('download');
            const b = new Uint8Array(await (await fetch(a.href)).arrayBuffer());
            let s = ''; for (const c of b) s += String.fromCharCode(c); return btoa(s); }""")
        exported = onnx.load_model_from_string(base64.b64decode(model))
        onnx.checker.check_model(exported, full_check=True)
        data = load_file(str(B.ROOT / "examples" / "browser" / "digits.safetensors"))
        x = (data["images"][1504:1792].astype(np.float32) / 16).reshape(9, 32, 1, 8, 8)
        sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
        predicted = np.concatenate([sess.run(None, {"x": xb})[0].argmax(1) for xb in x])
        assert np.mean(predicted == data["labels"][1504:1792]) == pytest.approx(accuracy, abs=1e-9)

        page.reload()                                                       # the checkpoint in localStorage
        assert ready(page) == "resumed at step 141 on wasm"
        page.select_option("#ep", "webgpu")
        page.wait_for_function("() => /ready on webgpu/.test(document.getElementById('status').textContent)")
        assert page.evaluate("() => window.digits.state.session.stepCount") == 141
        page.evaluate("() => window.digits.train(1)")
        assert page.evaluate("() => window.digits.state.session.stepCount") == 188
        assert page.evaluate("() => window.digits.state.accuracy") >= 0.9
