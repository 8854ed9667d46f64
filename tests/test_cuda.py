"""Training on onnxruntime's CUDA provider (issue 24): skipped without onnxruntime-gpu and a usable GPU.

The finiteness verdict over fresh processes, a NaN batch refused with the weights unchanged, BatchNormalization
in train mode against the CPU session and PyTorch, no silent change of device, batches already on the GPU (no
host copy of them in onnxruntime's profile). tests/test_training_device.py checks what the CPU can of each.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from mlp_batches import DATA, assert_unchanged, batch, poisoned

ort = pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]


def _cuda_usable() -> bool:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    from onnxgrad.training.session import DeviceError

    try:
        return mlp(providers=CUDA).device == "cuda"
    except DeviceError:
        return False


def mlp(**kw):
    from onnxgrad import TrainingSession, losses, optim

    return TrainingSession(onnx.load(MODELS / "training" / "mlp.onnx"),
                           loss=losses.CrossEntropyLoss(output="logits", target="y"),
                           optimizer=kw.pop("optimizer", None) or optim.AdamW(lr=1e-2), **kw)


pytestmark = pytest.mark.skipif(not _cuda_usable(), reason="needs onnxruntime-gpu and a usable CUDA GPU")


def test_cuda_training_matches_cpu():
    gpu, cpu = mlp(providers=CUDA), mlp(providers=["CPUExecutionProvider"])
    assert gpu.device == "cuda" and all(v.device_name().lower() == "cuda" for v in gpu._cur.values())
    assert not [n for n in gpu.artifacts.train.graph.node if n.op_type == "If"]     # the guard stays on the GPU
    for step in range(5):
        np.testing.assert_allclose(gpu.step(batch(step)), cpu.step(batch(step)), rtol=1e-5)
    assert gpu.step_count == 5
    for name, value in gpu.parameters().items():
        np.testing.assert_allclose(value, cpu.parameters()[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_nan_batch_is_refused_on_cuda_with_the_weights_unchanged(on_nonfinite):
    from onnxgrad.training.session import NonFiniteError, NonFiniteWarning

    s = mlp(providers=CUDA, on_nonfinite=on_nonfinite)
    s.step(batch(0))
    before, state = s.parameters(), s.optimizer_state()
    if on_nonfinite == "raise":
        with pytest.raises(NonFiniteError):
            s.step(poisoned())
    else:
        with pytest.warns(NonFiniteWarning):
            s.step(poisoned())
    assert s.step_count == 1
    assert_unchanged(s, before, state)
    s.step(batch(1))
    assert s.step_count == 2


CHILD = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np
    if {torch}:
        import torch  # noqa: F401   (the verdict must not depend on what the process loaded)
    import onnxruntime as ort
    sys.path.insert(0, {tests!r})
    from test_cuda import mlp, batch, poisoned
    from onnxgrad.training.session import NonFiniteError
    options = ort.SessionOptions()
    options.enable_profiling = {profile}
    s = mlp(providers=["CUDAExecutionProvider", "CPUExecutionProvider"], on_nonfinite={mode!r},
            session_options=options)
    wrong = 0
    for k in range(3):
        try:
            s.step(batch(k))
        except NonFiniteError:
            wrong += 1
    before = s.parameters()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            s.step(poisoned())
            refused = s.skipped_steps == 1
        except NonFiniteError:
            refused = True
    unchanged = all(np.array_equal(v, before[n]) for n, v in s.parameters().items())
    print(json.dumps({{"wrong": wrong + (not refused), "unchanged": unchanged, "device": s.device}}))
""")


def test_the_verdict_is_right_in_every_fresh_process(tmp_path):
    results = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for k in range(12):
        code = CHILD.format(torch=k % 2 == 1, profile=k % 3 == 0, mode=("raise", "skip")[k // 2 % 2],
                            tests=str(ROOT / "tests"))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert all(r["device"] == "cuda" for r in results)
    assert sum(r["wrong"] for r in results) == 0, results
    assert all(r["unchanged"] for r in results), results


# -- BatchNormalization in train mode ------------------------------------------------------------------------
TRAIN_STEPS = sorted(p.stem for p in (MODELS / "train_step").glob("*.npz"))


def bn_session(stem: str, providers: list[str], momentum: float = 0.9):
    from onnxgrad import TrainingSession, losses, optim

    ref = dict(np.load(MODELS / "train_step" / f"{stem}.npz"))
    return TrainingSession(MODELS / f"{stem}.onnx", loss=losses.MSELoss(output=str(ref["output"]), target="t"),
                           optimizer=optim.SGD(lr=float(ref["lr"]), momentum=momentum), providers=providers), ref


@pytest.mark.parametrize("stem", TRAIN_STEPS)
def test_batch_norm_trains_on_cuda_as_on_the_cpu(stem):
    gpu, ref = bn_session(stem, CUDA)
    cpu, _ = bn_session(stem, ["CPUExecutionProvider"])
    assert gpu.device == "cuda" and gpu._train.get_providers()[0] == "CUDAExecutionProvider"
    rng = np.random.default_rng(0)
    for step in range(5):
        x = ref["x"] if step == 0 else (ref["x"] + rng.normal(0, 0.5, ref["x"].shape)).astype(np.float32)
        assert gpu.step({"x": x, "t": ref["t"]}) == pytest.approx(cpu.step({"x": x, "t": ref["t"]}), rel=1e-4)
    for kind in ("parameters", "buffers"):
        got, want = getattr(gpu, kind)(), getattr(cpu, kind)()
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-3, atol=1e-5, err_msg=f"{kind}: {name}")


@pytest.mark.parametrize("stem", TRAIN_STEPS)
def test_batch_norm_train_step_on_cuda_matches_pytorch(stem):
    s, ref = bn_session(stem, CUDA, momentum=0.0)
    assert s.step({"x": ref["x"], "t": ref["t"]}) == pytest.approx(float(ref["loss_before"]), abs=1e-5)
    held = {**s.parameters(), **s.buffers()}
    for key in ref:
        if key.startswith(("param/", "running/")):
            np.testing.assert_allclose(held[key.split("/", 1)[1]], ref[key], rtol=0, atol=1e-5, err_msg=key)


# -- no silent change of device ------------------------------------------------------------------------------
def test_the_default_providers_train_on_cuda_and_say_so():
    s = mlp()
    assert s.device == "cuda" and s._train.get_providers()[0] == "CUDAExecutionProvider"


def test_an_unusable_cuda_device_raises():
    from onnxgrad.training.session import DeviceError

    with pytest.raises(DeviceError):
        mlp(providers=[("CUDAExecutionProvider", {"device_id": 4096}), "CPUExecutionProvider"])


# -- batches already on the GPU ---------------------------------------------------------------------------------
def _on_gpu(feeds: dict[str, np.ndarray]) -> dict:
    return {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", 0) for k, v in feeds.items()}


def test_ortvalue_batches_on_the_gpu_train_as_host_ones():
    s, reference = mlp(providers=CUDA), mlp(providers=CUDA)
    for step in range(3):
        assert s.step(_on_gpu(batch(step))) == pytest.approx(reference.step(batch(step)), rel=1e-6)
    out = s.eval(_on_gpu({"x": DATA["x"][0]}), device_outputs=True)["logits"]
    assert out.device_name().lower() == "cuda"
    np.testing.assert_allclose(out.numpy(), reference.eval({"x": DATA["x"][0]})["logits"], rtol=1e-5, atol=1e-6)


def test_torch_cuda_tensors_train_without_a_host_copy(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "step")
    s, reference = mlp(providers=CUDA, session_options=options), mlp(providers=CUDA)
    for step in range(3):
        feeds = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in batch(step).items()}
        assert s.step(feeds) == pytest.approx(reference.step(batch(step)), rel=1e-6)
    events = json.loads(Path(s._train.end_profiling()).read_text())
    shape = list(DATA["x"][0].shape)
    copies = [e for e in events if e.get("args", {}).get("op_name") == "MemcpyFromHost"
              and any(shape == list(d.values())[0] for d in e["args"].get("input_type_shape", []))]
    assert copies == []
