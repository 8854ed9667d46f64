"""The GPU benchmarks of issue 25 (``bench/bench_step_cuda.py``, ``bench/bench_rewrites_cuda.py``,
``bench/gpu_run.sh``) run end to end in their ``--smoke`` mode (tiny shapes, CPU provider, torch CPU), so
that the one prepared GPU run cannot rot between GPU sessions. They time nothing here: the checks are that
every model and case prints its row, that both frameworks start from the same loss, and that every
candidate form gives the canonical output."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
NUMBER = r"\d+\.\d+ \[\d+\.\d+\]"       # a "median [min]" cell


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _labels(module: str, expression: str) -> list[str]:
    """The row labels a benchmark promises, from the benchmark itself."""
    code = f"import sys; sys.path.insert(0, {BENCH!r}); import {module} as M; print('\\n'.join({expression}))"
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\n")[:-1]


def test_step_smoke_prints_every_model_with_the_same_first_loss():
    proc = _run(os.path.join(BENCH, "bench_step_cuda.py"), "--smoke", "--reps", "2", "--warmup", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    labels = _labels("bench_step_cuda", "M.SMOKE_MODELS")
    assert len(labels) == 6
    for label in labels:
        row = re.search(rf"^{label} +\d+\.\d+ +{NUMBER} +{NUMBER} +\d+\.\d+ +{NUMBER} .*$", out, re.M)
        assert row, f"no measured row for {label}:\n{out}"
        # the first loss of each framework, from the same weights and batch
        losses = re.search(rf"^{label} .*\n(?:    .*\n)*?    first loss \(same weights and batch\): "
                           r"onnxgrad (\S+), eager (\S+)$", out, re.M)
        assert losses, f"no first-loss line for {label}:\n{out}"
        ours, eager = float(losses.group(1).rstrip(",")), float(losses.group(2))
        assert abs(ours - eager) <= 1e-4 * max(1.0, abs(eager)), (label, ours, eager)
        assert re.search(rf"^{label} .*\n    split: the update", out, re.M), f"no split line for {label}"
    assert f"done: {len(labels)} of {len(labels)} models measured" in out


def test_rewrites_smoke_checks_every_form_and_profiles_the_step():
    proc = _run(os.path.join(BENCH, "bench_rewrites_cuda.py"), "--smoke", "--reps", "1", "--warmup", "0",
                "--profile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    labels = _labels("bench_rewrites_cuda", "[label for label, _ in M.cases(True)]")
    assert len(labels) >= 12
    for label in labels:
        canonical = re.search(rf"^{re.escape(label)} +\w+ +.*\(canonical\) +{NUMBER} +1\.00 ", out, re.M)
        assert canonical, f"no canonical row for {label}:\n{out}"
    forms = [line for line in out.splitlines() if any(line.startswith(label + " ") for label in labels)]
    timed_forms = [line for line in forms if "(canonical)" not in line and re.search(NUMBER, line)]
    assert timed_forms, out
    assert all("differs" not in line and "fails" not in line for line in forms), out
    for form in ("dilated_flipped", "phase_convs"):         # the forms defined there, checked and timed
        assert any(form in line for line in timed_forms), out
    assert "== resnet18 step (onnxruntime, by node launch), kernel time per run" in out, out


def test_the_default_mode_refuses_without_the_cuda_provider():
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    for script in ("bench_step_cuda.py", "bench_rewrites_cuda.py"):
        proc = _run(os.path.join(BENCH, script))
        assert proc.returncode == 2
        assert "error: onnxruntime" in proc.stderr and "no CUDAExecutionProvider" in proc.stderr, proc.stderr


def test_gpu_run_script_parses():
    proc = subprocess.run(["bash", "-n", os.path.join(BENCH, "gpu_run.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
