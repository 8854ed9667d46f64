"""bench/browser_bench.py end to end at tiny sizes and two steps: a row for every model on every backend (onnxgrad's
wasm, native WebGPU and JSEP sessions, TF.js's wasm and webgpu backends, onnxruntime-node and Python), and the
same losses where two sessions train the same artifacts from the same state on the same batches. It times nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import browser_bench  # noqa: E402

pytestmark = [pytest.mark.skipif(browser_bench.missing() is not None,
                                 reason=f"browser bench: {browser_bench.missing()}"), pytest.mark.slow]


def test_tiny_bench_has_a_row_for_every_backend(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "browser_bench.py"), "--sizes", "tiny", "--warmup", "1",
                           "--steps", "2", "--webgpu-warmup", "1", "--webgpu-steps", "2", "--node-steps", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["model"], r["backend"], r["variant"]): r for r in json.loads(out.read_text())["results"]}
    want = {(m, b, v) for m in ("mlp", "cnn") for b, vs in (("wasm", ("wasm", "tfjs-wasm")),
                                                           ("webgpu", ("webgpu", "jsep", "tfjs-webgpu")),
                                                           ("node", ("onnxgrad-node", "python-cpu"))) for v in vs}
    assert set(rows) == want
    for key, r in rows.items():
        run = r["rounds"][0]
        # a configuration either timed its steps or could not train at all (TF.js's wasm backend has no
        # convolution gradient kernel)
        assert r["median_ms"] is not None or "unsupported" in run, (key, run)
        if r["median_ms"] is not None:
            assert len(run["ms"]) == 2 and np.isfinite(run["losses"]).all(), (key, run)
    for m in ("mlp", "cnn"):        # the same artifacts, state and batches: the same losses
        node, python = rows[(m, "node", "onnxgrad-node")]["rounds"][0], rows[(m, "node", "python-cpu")]["rounds"][0]
        np.testing.assert_allclose(node["losses"], python["losses"], rtol=1e-4)
        for v in ("webgpu", "jsep"):
            np.testing.assert_allclose(rows[(m, "webgpu", v)]["rounds"][0]["losses"],
                                       rows[(m, "wasm", "wasm")]["rounds"][0]["losses"], rtol=1e-3)
    assert "| mlp | wasm |" in proc.stdout and "| cnn | cpu |" in proc.stdout
