"""Training on a device, the parts the CPU can check (issue 24): the step's scalars and finiteness verdict,
the CUDA target's BatchNormalization in train mode, no silent change of device, batches handed over as
OrtValues or DLPack tensors. tests/test_cuda.py runs the same on a GPU."""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxgrad.training.session as T
from mlp_batches import DATA, assert_unchanged, batch, poisoned
from onnxgrad import OnnxGradError, TrainingSession, losses, optim
from onnxgrad.passes.optimize import cuda_refusals, provider_name
from onnxgrad.tools.cli import main as cli_main
from onnxgrad.training.session import DeviceError, DeviceFallbackWarning, NonFiniteError, StepReadbackError

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
TRAIN_STEPS = sorted(p.stem for p in (MODELS / "train_step").glob("*.npz"))


def mlp(**kw) -> TrainingSession:
    kw.setdefault("providers", ["CPUExecutionProvider"])
    return TrainingSession(onnx.load(MODELS / "training" / "mlp.onnx"),
                           loss=losses.CrossEntropyLoss(output="logits", target="y"),
                           optimizer=optim.Adam(lr=1e-2), **kw)


# -- the step's scalars and the verdict --------------------------------------------------------------------
class Stale:
    """A session's run that leaves the host scalars bound before it as they were, holding wrong values (what
    the guard read on CUDA: memory the step does not write), and can replace one returned scalar after the
    run (an output the runtime did not write: ``drop``, or one holding another value: ``fake``)."""

    def __init__(self, sess, drop: str | None = None, fake: tuple[str, object] | None = None):
        self.sess, self.drop, self.fake, self.unwritten = sess, drop, fake, 0

    def __getattr__(self, name):
        return getattr(self.sess, name)

    def run_with_iobinding(self, io_, *args):
        held = [v for v in io_.get_outputs() if v.has_value() and v.device_name().lower() == "cpu" and not v.shape()]
        wrong = [np.array(not v.numpy() if v.numpy().dtype == np.bool_ else 12345.0, v.numpy().dtype) for v in held]
        self.sess.run_with_iobinding(io_, *args)
        for v, value in zip(held, wrong):          # not written by this run
            v.update_inplace(value)
        self.unwritten += len(held)
        if self.drop:
            io_.bind_output(self.drop, "cpu")                      # its value gone: as if never written
        if self.fake:
            name, value = self.fake
            io_.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(np.array(value)))


def test_scalars_are_the_runs_own_whatever_the_last_runs_outputs_hold():
    s, reference = mlp(), mlp()
    s._train = Stale(s._train)
    for step in range(3):
        assert s.step(batch(step)) == reference.step(batch(step))
        assert s.last_grad_norm == reference.last_grad_norm and math.isfinite(s.last_grad_norm)
    before, state = s.parameters(), s.optimizer_state()
    with pytest.raises(NonFiniteError, match="not applied"):       # the stale 'finite' read True: refused anyway
        s.step(poisoned())
    assert s.step_count == 3
    assert_unchanged(s, before, state)
    assert s.step(batch(4)) == reference.step(batch(4))


def test_no_scalar_of_a_run_stays_bound_after_it():
    """The scalars onnxruntime allocated in its arena are let go once read: held until the next step's
    bindings, they split the arena's free blocks, which grew step after step (BERT: 338 MB, then 369)."""
    s = mlp(accumulation_steps=2)
    runs = []

    class Spy:
        def __init__(self, sess):
            self.sess = sess

        def __getattr__(self, name):
            return getattr(self.sess, name)

        def run_with_iobinding(self, io_, *args):
            self.sess.run_with_iobinding(io_, *args)
            runs.append(io_)

    s._train, s._accumulate = Spy(s._train), Spy(s._accumulate)
    for x, y in zip(np.split(DATA["x"][0], 2), np.split(DATA["y"][0], 2)):
        s.step({"x": x, "y": y})
    assert len(runs) == 2 and s.step_count == 1
    for io_ in runs:
        assert [v for v in io_.get_outputs() if v.has_value() and not v.shape()] == []


def test_a_scalar_the_run_did_not_write_is_never_read():
    s = mlp()
    s._train = Stale(s._train, drop=s.spec.finite)
    with pytest.raises(StepReadbackError, match="no value for 'finite'"):
        s.step(batch(0))


@pytest.mark.parametrize("fake, data", [(False, batch(0)), (True, poisoned())])
def test_a_verdict_contradicting_the_loss_and_gradient_norm_raises(fake, data):
    s = mlp()
    before = s.parameters()
    s._train = Stale(s._train, fake=("finite", fake))
    with pytest.raises(StepReadbackError, match=f"finite={fake}"):
        s.step(data)
    if fake:          # the graph's own guard refused the NaN step whatever was read back
        for name, value in s.parameters().items():
            np.testing.assert_array_equal(value, before[name])


VERDICTS = [        # (loss, finite, grad_norm, verdict or the error)
    (2.3, True, 0.8, True),
    (float("nan"), False, 0.8, False),
    (2.3, False, float("inf"), False),
    (2.3, False, float("nan"), False),
    (1e30, False, 1e20, False),                     # loss + norm^2 overflowed: finite parts, non-finite sum
    (2.3, False, 0.8, StepReadbackError),           # the per-session CUDA symptom: refused with finite values
    (float("nan"), True, 0.8, StepReadbackError),   # a NaN step read as finite
    (2.3, True, float("inf"), StepReadbackError),
    (2.3, True, None, True),                        # an accumulating micro-batch: no norm
    (2.3, False, None, False),                      # its gradients may be the non-finite ones
    (float("inf"), True, None, StepReadbackError),
]


@pytest.mark.parametrize("loss, finite, grad_norm, expected", VERDICTS)
def test_verdict_table(loss, finite, grad_norm, expected):
    if expected is StepReadbackError:
        with pytest.raises(StepReadbackError, match="contradict"):
            T._verdict(loss, finite, grad_norm, 1)
    else:
        assert T._verdict(loss, finite, grad_norm, 1) is expected


def test_accumulated_steps_read_their_scalars_afresh():
    s, reference = mlp(accumulation_steps=2), mlp(accumulation_steps=2)
    s._accumulate = Stale(s._accumulate)
    s._train = Stale(s._train)
    for step in range(2):
        for x, y in zip(np.split(DATA["x"][step], 2), np.split(DATA["y"][step], 2)):
            assert s.step({"x": x, "y": y}) == reference.step({"x": x, "y": y})
    assert s.step_count == 2
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, reference.parameters()[name])


# -- no silent change of device ----------------------------------------------------------------------------
CUDA_FIRST = ["CUDAExecutionProvider", "CPUExecutionProvider"]
cpu_only = pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                              reason="onnxruntime without CUDA: it builds the session on the CPU")


@cpu_only
def test_explicit_cuda_that_onnxruntime_cannot_enable_raises():
    with pytest.warns(UserWarning), pytest.raises(DeviceError, match="without CUDAExecutionProvider") as e:
        mlp(providers=CUDA_FIRST)
    assert "providers=['CPUExecutionProvider']" in str(e.value) and "onnxgrad[cuda]" in str(e.value)


@cpu_only
def test_default_cuda_that_onnxruntime_cannot_enable_warns_and_says_cpu(monkeypatch):
    monkeypatch.setattr(T, "default_providers", lambda: list(CUDA_FIRST))
    with pytest.warns(DeviceFallbackWarning, match="training on the CPU, not on the GPU.*without CUDA"):
        s = mlp(providers=None)
    assert s.device == "cpu" and s._train.get_providers() == ["CPUExecutionProvider"]
    assert math.isfinite(s.step(batch(0)))


def _failing_cuda_session(monkeypatch):
    build = TrainingSession._session

    def session(self, model):
        if provider_name(self._providers[0]) == "CUDAExecutionProvider":
            raise RuntimeError("CUDA failure 100: no CUDA-capable device is detected")
        return build(self, model)

    monkeypatch.setattr(TrainingSession, "_session", session)


def test_a_cuda_session_that_fails_to_build_raises_with_the_reason(monkeypatch):
    _failing_cuda_session(monkeypatch)
    with pytest.raises(DeviceError, match="no CUDA-capable device"):
        mlp(providers=CUDA_FIRST)


def test_a_default_cuda_session_that_fails_to_build_warns_with_the_reason(monkeypatch):
    _failing_cuda_session(monkeypatch)
    monkeypatch.setattr(T, "default_providers", lambda: list(CUDA_FIRST))
    with pytest.warns(DeviceFallbackWarning, match="no CUDA-capable device"):
        s = mlp(providers=None)
    assert s.device == "cpu"


def test_a_cpu_session_that_fails_to_build_raises_as_it_is(monkeypatch):
    monkeypatch.setattr(TrainingSession, "_session", lambda self, model: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError, match="bad"):
        mlp()


# -- batches already on the device -------------------------------------------------------------------------
def _as_ortvalues(feeds: dict[str, np.ndarray]) -> dict[str, ort.OrtValue]:
    return {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}


def test_ortvalue_batches_train_as_numpy_ones():
    s, reference = mlp(), mlp()
    for step in range(3):
        assert s.step(_as_ortvalues(batch(step))) == reference.step(batch(step))
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, reference.parameters()[name])
    out = s.eval(_as_ortvalues({"x": DATA["x"][0]}))
    np.testing.assert_array_equal(out["logits"], reference.eval({"x": DATA["x"][0]})["logits"])


def test_eval_can_return_outputs_on_the_device():
    s = mlp()
    host = s.eval(batch(0))
    held = s.eval(_as_ortvalues(batch(0)), device_outputs=True)
    assert set(held) == set(host)
    for name, v in held.items():
        assert isinstance(v, ort.OrtValue) and v.device_name().lower() == s.device
        np.testing.assert_array_equal(v.numpy(), host[name])


def test_ortvalue_batches_accumulate():
    s, reference = mlp(accumulation_steps=2), mlp(accumulation_steps=2)
    for x, y in zip(np.split(DATA["x"][0], 2), np.split(DATA["y"][0], 2)):
        assert s.step(_as_ortvalues({"x": x, "y": y})) == reference.step({"x": x, "y": y})
    for name, value in s.parameters().items():
        np.testing.assert_array_equal(value, reference.parameters()[name])


def test_a_device_batch_of_the_wrong_type_is_refused_not_converted():
    s = mlp()
    feeds = _as_ortvalues({"x": DATA["x"][0].astype(np.float64), "y": DATA["y"][0]})
    with pytest.raises(OnnxGradError, match=r"'x' is float64 \[16, 8\] on cpu, the model takes float32 \[N, 8\]: "
                       r"convert it to float32 where it lies"):
        s.step(feeds)
    assert s.step_count == 0


def test_torch_tensors_train_through_dlpack():
    torch = pytest.importorskip("torch")
    s, reference = mlp(), mlp()
    for step in range(2):
        feeds = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch(step).items()}
        assert s.step(feeds) == reference.step(batch(step))
    out = s.eval({"x": torch.from_numpy(DATA["x"][0])}, device_outputs=True)["logits"]
    np.testing.assert_array_equal(torch.from_dlpack(out).numpy(), reference.eval({"x": DATA["x"][0]})["logits"])
    with pytest.raises(OnnxGradError, match=r"'y' is int32 \[16\] on cpu, the model takes int64 \[N\]: convert it "
                       r"to int64 where it lies \(torch: \.to\(torch\.int64\)\)"):
        s.step({"x": torch.from_numpy(DATA["x"][0]), "y": torch.from_numpy(DATA["y"][0]).int()})


# -- the guard for the CUDA provider: Where on the device, no If reading a host copy -------------------------
def cuda_target(monkeypatch, **kw) -> TrainingSession:
    """A session built for the CUDA target, run by the CPU provider."""
    with monkeypatch.context() as m:
        m.setattr(T, "target_for", lambda providers: "cuda")
        return mlp(**kw)


def test_cuda_target_guards_the_update_with_where_and_trains_as_the_if(monkeypatch):
    s, reference = cuda_target(monkeypatch), mlp()
    train = s.artifacts.train
    assert not [n for n in train.graph.node if n.op_type == "If"]
    assert [n for n in train.graph.node if n.op_type == "Where" and n.input[0] == s.spec.finite]
    assert [n for n in reference.artifacts.train.graph.node if n.op_type == "If"]
    onnx.checker.check_model(train, full_check=True)
    assert s._inplace == reference._inplace           # still updated in place: one buffer per tensor
    for step in range(3):
        assert s.step(batch(step)) == pytest.approx(reference.step(batch(step)), rel=1e-6)
    before, state = s.parameters(), s.optimizer_state()
    with pytest.raises(NonFiniteError, match="not applied"):
        s.step(poisoned())
    assert_unchanged(s, before, state)
    s.step(batch(3))
    reference.step(batch(3))
    for name, value in s.parameters().items():
        np.testing.assert_allclose(value, reference.parameters()[name], rtol=1e-5, atol=1e-7)


def test_cuda_target_accumulates_and_skips_as_the_cpu_one(monkeypatch):
    s = cuda_target(monkeypatch, accumulation_steps=2, on_nonfinite="skip")
    reference = mlp(accumulation_steps=2, on_nonfinite="skip")
    for feeds in (batch(0), poisoned(), batch(1), batch(2)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for x, y in zip(np.split(feeds["x"], 2), np.split(feeds["y"], 2)):
                s.step({"x": x, "y": y})
                reference.step({"x": x, "y": y})
    assert (s.step_count, s.skipped_steps) == (reference.step_count, reference.skipped_steps) == (3, 1)
    for name, value in s.parameters().items():
        np.testing.assert_allclose(value, reference.parameters()[name], rtol=1e-5, atol=1e-7)


# -- BatchNormalization in train mode for the CUDA provider --------------------------------------------------
def bn_session(stem: str, target: str, monkeypatch, momentum: float = 0.9) -> tuple[TrainingSession, dict]:
    """A train-mode session of ``models/<stem>.onnx`` built for ``target``, run by the CPU provider."""
    ref = dict(np.load(MODELS / "train_step" / f"{stem}.npz"))
    with monkeypatch.context() as m:
        m.setattr(T, "target_for", lambda providers: target)
        s = TrainingSession(MODELS / f"{stem}.onnx", loss=losses.MSELoss(output=str(ref["output"]), target="t"),
                            optimizer=optim.SGD(lr=float(ref["lr"]), momentum=momentum),
                            providers=["CPUExecutionProvider"])
    return s, ref


@pytest.mark.parametrize("stem", TRAIN_STEPS)
def test_cuda_target_trains_batch_norm_as_the_cpu_session(stem, monkeypatch):
    cuda, ref = bn_session(stem, "cuda", monkeypatch)
    cpu, _ = bn_session(stem, "cpu", monkeypatch)
    assert cuda_refusals(cuda.artifacts.train) == [] and cuda_refusals(cpu.artifacts.train)
    rng = np.random.default_rng(0)
    for step in range(4):
        x = ref["x"] if step == 0 else (ref["x"] + rng.normal(0, 0.5, ref["x"].shape)).astype(np.float32)
        feeds = {"x": x, "t": ref["t"]}
        assert cuda.step(feeds) == pytest.approx(cpu.step(feeds), rel=1e-5, abs=1e-6)
    assert cuda.buffers().keys() == cpu.buffers().keys() and cuda.buffers()
    for kind in ("parameters", "buffers"):
        got, want = getattr(cuda, kind)(), getattr(cpu, kind)()
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{kind}: {name}")


@pytest.mark.parametrize("stem", TRAIN_STEPS)
def test_cuda_target_train_step_matches_pytorch(stem, monkeypatch):
    s, ref = bn_session(stem, "cuda", monkeypatch, momentum=0.0)       # the reference's step: plain SGD
    assert cuda_refusals(s.artifacts.train) == []
    assert s.step({"x": ref["x"], "t": ref["t"]}) == pytest.approx(float(ref["loss_before"]), abs=1e-5)
    held = {**s.parameters(), **s.buffers()}
    for key in ref:
        if key.startswith(("param/", "running/")):
            np.testing.assert_allclose(held[key.split("/", 1)[1]], ref[key], rtol=0, atol=2e-6, err_msg=key)


def test_optimize_for_cuda_writes_a_training_model_the_cuda_provider_runs(tmp_path, capsys):
    model = tmp_path / "cnn.onnx"                   # the eval model is written beside it
    model.write_bytes((MODELS / "cnn_bn_dynamo.onnx").read_bytes())
    predictions = str(np.load(MODELS / "train_step" / "cnn_bn_dynamo.npz")["output"])
    out = tmp_path / "cnn.train.onnx"
    assert cli_main([str(model), "--loss-fn", "mse", "--target", "t", "--predictions", predictions,
                     "--optimizer", "sgd", "--lr", "0.1", "--optimize-for", "cuda", "-o", str(out)]) == 0
    capsys.readouterr()
    train = onnx.load(out)
    assert cuda_refusals(train) == [] and not [n for n in train.graph.node if n.op_type == "If"]
    assert not [n for n in train.graph.node if n.op_type == "BatchNormalization"
                and any(a.name == "training_mode" and a.i for a in n.attribute)]
    onnx.checker.check_model(train, full_check=True)
    ort.InferenceSession(out.as_posix(), providers=["CPUExecutionProvider"])       # stock onnxruntime loads it
    default = tmp_path / "canonical.train.onnx"
    assert cli_main([str(model), "--loss-fn", "mse", "--target", "t", "--predictions", predictions,
                     "--optimizer", "sgd", "--lr", "0.1", "-o", str(default)]) == 0
    assert cuda_refusals(onnx.load(default))          # the canonical one holds the refused form: the rewrite is why


# -- the core without a runtime ----------------------------------------------------------------------------------
def test_without_onnxruntime_graphs_build_and_training_names_the_install_command():
    import subprocess
    import sys

    code = f"""
import sys
sys.modules["onnxruntime"] = None           # not installed: its import raises ImportError
import onnxgrad
gm = onnxgrad.grad({str(MODELS / "mlp_ce_dynamo.onnx")!r})
assert any(o.name.endswith("_grad") for o in gm.graph.output)
from onnxgrad.runtime import RuntimeMissingError
try:
    onnxgrad.TrainingSession({str(MODELS / "training" / "mlp.onnx")!r}, loss="logits")
except RuntimeMissingError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'TrainingSession runs on onnxruntime, which is not installed: pip install "onnxgrad[cpu]"' in r.stdout


def test_cuda_computes_float32_in_float32_unless_told_otherwise():
    # onnxruntime's CUDA default is TF32 (on an H200 a BatchNorm ResNet's 5 steps ended 4.7e-3 off the CPU's)
    assert T.float32_providers(["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        ("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    assert T.float32_providers([("CUDAExecutionProvider", {"device_id": 1, "use_tf32": "1"})]) == [
        ("CUDAExecutionProvider", {"device_id": 1, "use_tf32": "1"})]
    assert T.float32_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


@pytest.mark.parametrize("stem", TRAIN_STEPS)
def test_cuda_target_leaves_no_conv_transpose_to_the_cpu_provider(stem, monkeypatch):
    # a strided Conv's input gradient: a ConvTranspose with asymmetric pads, which the CUDA provider hands to the
    # CPU provider; the cuda target writes it with symmetric pads and output_padding (computed as the CPU's above)
    cuda, _ = bn_session(stem, "cuda", monkeypatch)
    canonical, _ = bn_session(stem, None, monkeypatch)
    assert [r for r in cuda_refusals(canonical.artifacts.train) if "ConvTranspose" in r]
    assert cuda_refusals(cuda.artifacts.train) == []
