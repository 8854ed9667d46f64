"""Data parallelism: 2 local workers (loopback) on torch.distributed/gloo and on MPI, against one process.

The workers (tests/ddp_worker.py) are launched once per engine for the whole module (shared by pytest-xdist
workers through a lock file) and run every scenario; each test reads what they saved and compares it with
the same scenario run here in one process on the full batch. An engine that is not installed is skipped.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import ddp_worker as W
import numpy as np
import pytest
from onnx import numpy_helper

from onnxgrad import OnnxGradError, TrainingSession, optim
from onnxgrad.training import distributed as D

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(W.__file__).resolve()
TIMEOUT = 180            # seconds for the whole launch; a hung collective fails the tests, never CI's budget
ENV_KEYS = D._TORCHRUN_ENV + D._MPI_ENV + ("LOCAL_RANK", "LOCAL_WORLD_SIZE")


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Relative L2 error of ``got`` against ``want``."""
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


def assert_close(got: dict, want: dict, tol: float, prefix: str = "") -> None:
    for k, v in want.items():
        if np.asarray(v).dtype.kind == "f":
            err = rel_err(got[prefix + k], v)
            assert err <= tol, f"{prefix}{k}: relative error {err:.2e} > {tol:.0e}"


# -- launching ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _wait(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the workers did not finish in {TIMEOUT} s:\n" + "\n".join(f.read_text()[-3000:] for f in logs))
    if any(p.returncode for p in procs):
        pytest.fail("a worker failed:\n" + "\n".join(f.read_text()[-3000:] for f in logs))


def _launch_torch(out: Path) -> None:
    """Two workers with the environment torchrun gives them (env:// rendezvous on the loopback)."""
    env, port, procs, logs = _env(), str(_free_port()), [], []
    for rank in range(2):
        logs.append(out / f"log{rank}.txt")
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(out), "torch"], cwd=ROOT, stdout=logs[-1].open("w"),
            stderr=subprocess.STDOUT,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}))
    _wait(procs, logs)


def _mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def _launch_mpi(out: Path) -> None:
    logs = [out / "log.txt"]
    proc = subprocess.Popen([_mpiexec(), "-n", "2", sys.executable, str(WORKER), str(out), "mpi"], cwd=ROOT,
                            stdout=logs[0].open("w"), stderr=subprocess.STDOUT, env=_env())
    _wait([proc], logs)


def _needs(engine: str) -> None:
    if engine == "torch":
        dist = pytest.importorskip("torch.distributed", reason="the torch extra is not installed")
        if not dist.is_available():
            pytest.skip("this PyTorch has no torch.distributed")
    else:
        pytest.importorskip("mpi4py", reason="the mpi extra is not installed")
        if _mpiexec() is None:
            pytest.skip("no mpiexec")


@pytest.fixture(scope="module", params=["torch", "mpi"])
def run(request, tmp_path_factory) -> list[dict[str, np.ndarray]]:
    """Both workers' results, from one launch per engine shared by every xdist worker."""
    engine = request.param
    _needs(engine)
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / f"ddp-{engine}"
    out.mkdir(exist_ok=True)
    import fcntl
    with open(shared / f"ddp-{engine}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "rank1.npz").exists():
            (_launch_torch if engine == "torch" else _launch_mpi)(out)
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]


_REFERENCES: dict[str, dict[str, np.ndarray]] = {}


def reference(name: str) -> dict[str, np.ndarray]:
    """The scenario run in this one process on the full batch."""
    if name not in _REFERENCES:
        make = lambda **kw: TrainingSession(W.model(), loss=W.loss(), **kw)      # noqa: E731
        _REFERENCES[name] = {k: v for k, v in getattr(W, name)(make, 0, 1, False).items()}
    return _REFERENCES[name]


def of(result: dict, scenario: str) -> dict[str, np.ndarray]:
    return {k[len(scenario) + 1:]: v for k, v in result.items() if k.startswith(scenario + "/")}


# -- what the workers show ------------------------------------------------------------------------------
def test_two_workers_ran(run):
    assert [int(r["world"]) for r in run] == [2, 2]


def test_averaged_gradient_is_the_full_batch_gradient(run):
    want = reference("grad")
    for r in run:
        got = of(r, "grad")
        assert_close(got, {k: v for k, v in want.items() if k.startswith("grad/")}, 1e-6)
        assert rel_err(got["loss"], want["loss"]) <= 1e-6          # the loss reported is the global mean


def test_a_sum_instead_of_a_mean_fails_the_check(run):
    """The check above catches a wrong reduction: an engine that sums the gradients without the divisor."""
    want = {k: v for k, v in reference("grad").items() if k.startswith("grad/")}
    got = of(run[0], "sum_not_mean")
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(got, want, 1e-6)
    assert_close(got, {k: 2 * v for k, v in want.items()}, 1e-6)      # it is the sum over the 2 workers


def test_five_sgd_steps_match_one_process_on_the_full_batch(run):
    want = reference("sgd5")
    for r in run:
        assert_close(of(r, "sgd5"), want, 1e-5)


def test_ranks_hold_bit_identical_parameters(run):
    keys = [k for k in run[0] if "param/" in k or "grad/" in k or "grad_norm" in k or "/loss" in k
            or "buffer/" in k]
    assert len(keys) > 50
    for k in keys:
        assert np.array_equal(run[0][k], run[1][k]), k


def test_every_worker_starts_from_rank0_weights(run):
    """Rank 1 built its session from other weights (rank 0's plus 1); both hold rank 0's after building."""
    start = {t.name: numpy_helper.to_array(t) for t in W.model().graph.initializer}
    for r in run:
        got = of(r, "broadcast")
        assert len(got) == 4
        for k, v in got.items():
            np.testing.assert_array_equal(v, start[k[len("param/"):]], err_msg=k)


def test_nonfinite_loss_on_one_rank_skips_on_every_rank(run):
    want = reference("nonfinite")
    assert int(want["skipped"]) == 1              # one process on the full batch skips that step too
    for rank, r in enumerate(run):
        got = of(r, "nonfinite")
        assert int(got["skipped"]) == 1 and int(got["steps"]) == 2
        for k in (k for k in got if k.endswith("@1")):
            np.testing.assert_array_equal(got[k], got[k.replace("@1", "@0")], err_msg=k)   # not applied
        assert int(got["warned1"]) == (1 if rank == 0 else 0)        # rank 0 alone warns
        assert_close(got, {k: v for k, v in want.items() if k.endswith("@2")}, 1e-5)


def test_uneven_shards_follow_the_global_batch_mean(run):
    want = reference("uneven")
    for r in run:
        assert_close(of(r, "uneven"), want, 1e-6)
    # the plain average of the two shards' mean gradients (each shard weighted alike) is another gradient
    x, y = W.batches()
    grads = []
    for rank in range(2):
        s = TrainingSession(W.model(), loss=W.loss(), optimizer=optim.SGD(lr=0.1), keep_grads=True)
        s.step({"x": W.shard(x[0], rank, 2, [5, 11]), "y": W.shard(y[0], rank, 2, [5, 11])})
        grads.append(s.grads()["0.weight"])
    s = TrainingSession(W.model(), loss=W.loss(), optimizer=optim.SGD(lr=0.1), keep_grads=True)
    s.step({"x": x[0], "y": y[0]})
    assert rel_err((grads[0] + grads[1]) / 2, s.grads()["0.weight"]) > 1e-2


def test_clipping_and_adamw_after_the_reduction(run):
    want = reference("clip_adamw")
    assert float(want["grad_norm0"]) > 0.05        # the clip was active
    for r in run:
        assert_close(of(r, "clip_adamw"), want, 1e-5)


def test_accumulation_times_data_parallel_is_one_process_with_the_whole_batch(run):
    want = reference("accumulate")             # one process, no accumulation, 16 samples per step
    for r in run:
        got = of(r, "accumulate")
        assert int(got["steps"]) == 3
        assert_close(got, {k: v for k, v in want.items() if k.startswith("param/")}, 1e-5)
        assert bool(got["mid_update_save_refused"])


def test_resume_from_rank0_checkpoint_is_exact(run):
    want = reference("resume")
    for rank, r in enumerate(run):
        got = of(r, "resume")
        assert bool(got["wrote"]) == (rank == 0)          # rank 0 alone wrote
        assert int(got["resumed_at"]) == 2
        unbroken = {k: v for k, v in got.items() if k.startswith("unbroken/")}
        assert len(unbroken) == 4
        for k, v in unbroken.items():
            np.testing.assert_array_equal(got[k.replace("unbroken/", "resumed/")], v, err_msg=k)
        assert_close(got, want, 1e-5)


def test_running_statistics_are_averaged_over_the_workers(run):
    """BatchNorm in train mode: each worker's statistics come from its shard (as DDP without SyncBatchNorm);
    after the update both hold the mean of what one process computes on each shard."""
    def make(**kw):
        return TrainingSession(kw.pop("model"), loss=kw.pop("loss"), **kw)
    shards = [W.batchnorm(make, rank, 2, False) for rank in range(2)]
    buffers = [k for k in shards[0] if k.startswith("buffer/")]
    assert len(buffers) == 6
    for k in buffers:
        assert rel_err(shards[0][k], shards[1][k]) > 1e-3       # the shards' statistics differ
        for r in run:
            assert rel_err(r[f"batchnorm/{k}"], (shards[0][k] + shards[1][k]) / 2) <= 1e-6, k
        np.testing.assert_array_equal(run[0][f"batchnorm/{k}"], run[1][f"batchnorm/{k}"])


# -- in this process ------------------------------------------------------------------------------------
def test_world_size_one_is_the_fused_step_bit_for_bit(monkeypatch):
    """torchrun --nproc-per-node 1: data_parallel=True keeps the fused single-run step."""
    dist = pytest.importorskip("torch.distributed", reason="the torch extra is not installed")
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    x, y = W.batches()
    try:
        one = TrainingSession(W.model(), loss=W.loss(), optimizer=optim.AdamW(lr=1e-2), data_parallel=True)
        assert (one.world_size, one.rank, one.artifacts.split) == (1, 0, None)
        plain = TrainingSession(W.model(), loss=W.loss(), optimizer=optim.AdamW(lr=1e-2))
        assert one.artifacts.train.SerializeToString() == plain.artifacts.train.SerializeToString()
        for t in range(5):
            assert one.step({"x": x[t], "y": y[t]}) == plain.step({"x": x[t], "y": y[t]})
        for name, v in plain.parameters().items():
            np.testing.assert_array_equal(one.parameters()[name], v, err_msg=name)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _no_launcher(monkeypatch) -> None:
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")


def test_data_parallel_without_a_launcher_says_what_to_do(monkeypatch):
    _no_launcher(monkeypatch)
    with pytest.raises(D.DataParallelError, match="torchrun --nproc-per-node N.*mpiexec -n N") as e:
        TrainingSession(W.model(), loss=W.loss(), data_parallel=True)
    assert isinstance(e.value, OnnxGradError) and "not started by a launcher" in str(e.value)


@pytest.mark.parametrize("engine, module, extra", [("torch", "torch", "torch"), ("mpi", "mpi4py", "mpi")])
def test_data_parallel_without_the_extra_says_what_to_install(monkeypatch, engine, module, extra):
    _no_launcher(monkeypatch)
    monkeypatch.setitem(sys.modules, module, None)            # import fails as if not installed
    if module == "torch":
        monkeypatch.setitem(sys.modules, "torch.distributed", None)
        for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
            monkeypatch.setenv(k, v)                            # under torchrun, torch missing
    else:
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
        monkeypatch.setenv("PMI_RANK", "0")                     # under mpiexec, mpi4py missing
    with pytest.raises(D.DataParallelError, match=rf'pip install "onnxgrad\[{extra}\]"'):
        TrainingSession(W.model(), loss=W.loss(), data_parallel=True)
    with pytest.raises(D.DataParallelError, match=rf'pip install "onnxgrad\[{extra}\]"'):
        TrainingSession(W.model(), loss=W.loss(), data_parallel=engine)


def test_data_parallel_names_its_choices(monkeypatch):
    _no_launcher(monkeypatch)
    with pytest.raises(D.DataParallelError, match="True, 'torch' or 'mpi'"):
        TrainingSession(W.model(), loss=W.loss(), data_parallel="nccl")


def test_the_core_never_imports_an_engine():
    code = ("import sys, onnxgrad; from onnxgrad.training import distributed, session; "
            "from onnxgrad import TrainingSession; "
            "print(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
