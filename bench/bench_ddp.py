"""Data-parallel step time on this machine: one worker against two, with the all-reduce's share.

    python bench/bench_ddp.py [mlp cnn] [--rounds 5] [--steps 60] [--engine torch|mpi]

For the MLP and CNN of bench/bench_step.py (AdamW; global batch 64 and 32) it launches, in interleaved
rounds, three configurations of the same global batch on the loopback:

- ``1 fused``: one worker, the fused single-run step (what ``data_parallel=True`` runs on one worker),
  ``BENCH_THREADS`` (2) intra-op threads;
- ``1 split``: one worker running the split step (backward into buckets, update) with a no-op reduction:
  the cost of splitting the step, without communication;
- ``2 workers``: two processes (torchrun's environment, or ``mpiexec -n 2``), each on half the batch with
  BENCH_THREADS / 2 threads, the buckets summed by the engine between the two graphs.

Each worker times ``--steps`` steps after warm-up; the engine is wrapped to time the all-reduce inside
the step (which includes waiting for the slower worker), and after the steps the same buckets are
all-reduced alone between barriers (the transfer's own cost). Printed: per configuration the median over
rounds of each run's median step, with the [min-max] over rounds; the all-reduce in the step and alone;
the all-reduce's share of the step. Idle intra-op threads block (no spinning), as in bench_step.py. A
benchmark, not a test: it asserts nothing. The cores may be shared: the spread says how much that moved.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
ROOT = Path(__file__).resolve().parents[1]


# -- one worker -------------------------------------------------------------------------------------
def worker(model: str, steps: int, engine: str, split: bool, out: str) -> None:
    import numpy as np
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT / "bench"))
    import bench_step

    from onnxgrad import TrainingSession, optim
    from onnxgrad.training import distributed as D

    inner = D.engine(engine)

    class Timed(D.Engine):
        """The engine, with the time of every all-reduce of the buckets; or no reduction at all (``split``
        on one worker: a world of 2 that only this worker is in, so the split step runs alone)."""

        def __init__(self):
            self.rank, self.local_rank = inner.rank, inner.local_rank
            self.world_size = 2 if split else inner.world_size
            self.local_world_size = inner.local_world_size
            self.times: list[float] = []

        def all_reduce(self, values, average=False):
            t0 = time.perf_counter()
            if not split:
                inner.all_reduce(values, average)
            if not average:
                self.times.append((time.perf_counter() - t0) * 1e3)

        def broadcast(self, values, src=0):
            if not split:
                inner.broadcast(values, src)

        def barrier(self):
            inner.barrier()

    import inspect
    build = bench_step.MODELS[model]
    batch = inspect.signature(build).parameters["batch"].default
    bench = build(batch=batch // inner.world_size)        # the models have static shapes: this worker's shard
    eng = Timed()
    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, THREADS // inner.local_world_size)
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = TrainingSession(bench.forward, loss=bench.loss, optimizer=optim.AdamW(lr=1e-3),
                        providers=["CPUExecutionProvider"], session_options=so, data_parallel=eng)
    mine = {**bench.feeds, **bench.target}
    for _ in range(10):
        s.step(mine)
    eng.times.clear()
    inner.barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        s.step(mine)
        times.append((time.perf_counter() - t0) * 1e3)
    alone = []
    if s._split is not None and not split:      # the buckets' all-reduce by itself, between barriers
        buckets = list(s._reduced.values())
        for _ in range(steps):
            inner.barrier()
            t0 = time.perf_counter()
            inner.all_reduce(buckets)
            alone.append((time.perf_counter() - t0) * 1e3)
    mb = sum(b.size * 4 for b in s._split.buckets) / 2**20 if s._split else 0.0
    if inner.rank == 0:
        Path(out).write_text(json.dumps({"step": float(np.median(times)),
                                         "reduce": float(np.median(eng.times)) if eng.times else 0.0,
                                         "alone": float(np.median(alone)) if alone else 0.0, "mb": mb}))


# -- launching ----------------------------------------------------------------------------------------
def _port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def launch(model: str, steps: int, engine: str, n: int, split: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        args = [sys.executable, __file__, "--worker", model, str(steps), engine, str(int(split)), out]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1"}
        if engine == "mpi":
            mpiexec = Path(sys.executable).parent / "mpiexec"
            subprocess.run([str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(n)] + args, env=env,
                           check=True, timeout=600)
        else:
            port = _port()
            procs = [subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
                                                 "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                                                 "MASTER_PORT": port}) for r in range(n)]
            for p in procs:
                if p.wait(timeout=600):
                    raise SystemExit(f"a worker failed ({p.returncode})")
        return json.loads(Path(out).read_text())


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--worker":
        model, steps, engine, split, out = argv[1:]
        worker(model, int(steps), engine, split == "1", out)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=["mlp", "cnn"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--engine", default="torch", choices=["torch", "mpi"])
    args = p.parse_args(argv)
    import numpy as np

    configs = [("1 fused", 1, False), ("1 split", 1, True), ("2 workers", 2, False)]
    print(f"engine {args.engine}; {os.cpu_count()} cores; {args.rounds} interleaved rounds of {args.steps} steps")
    for model in args.models:
        runs: dict[str, list[dict]] = {c[0]: [] for c in configs}
        for _ in range(args.rounds):
            for name, n, split in configs:
                runs[name].append(launch(model, args.steps, args.engine, n, split))

        def stat(name: str, key: str) -> str:
            v = [r[key] for r in runs[name]]
            return f"{np.median(v):7.3f} [{min(v):.3f}-{max(v):.3f}]"
        mb = runs["2 workers"][0]["mb"]
        print(f"\n{model} (buckets {mb:.2f} MiB), ms: median over rounds [min-max]")
        for name, _, _ in configs:
            line = f"  {name:10s} step {stat(name, 'step')}"
            if name == "2 workers":
                step = np.median([r["step"] for r in runs[name]])
                reduce = np.median([r["reduce"] for r in runs[name]])
                line += (f"  all-reduce in the step {stat(name, 'reduce')}  alone {stat(name, 'alone')}"
                         f"  share {reduce / step:.0%}")
            print(line)
        fused = [r["step"] for r in runs["1 fused"]]
        two = [r["step"] for r in runs["2 workers"]]
        print(f"  2 workers / 1 fused, same global batch: {np.median(two) / np.median(fused):.2f}x the step time "
              f"(medians), {min(two) / min(fused):.2f}x (minima: the least disturbed rounds)")


if __name__ == "__main__":
    main(sys.argv[1:])
