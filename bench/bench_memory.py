"""Peak memory of a 20-step training loop: onnxgrad.TrainingSession (AdamW) vs PyTorch eager and torch.compile.

The models are bench_step.py's (``mlp``, ``cnn``, ``transformer``, ``resnet18``). Each (model, framework)
runs in a fresh process, ``--repeats`` times, the processes interleaved (every framework once per round),
and reports, in MB above the process's RSS once the imports are done and the model is built (its ONNX proto
and numpy weights, which every framework starts from):

- ``build``: the peak while building the trainer (onnxgrad: artifacts and onnxruntime sessions;
  PyTorch: parameters and optimizer);
- ``loop``: the peak during the 20 steps (the first steps included: onnxruntime's arena grows there,
  PyTorch's optimizer state is created at its first step, ``torch.compile`` compiles on its first call);
- ``peak``: the whole run's peak (the larger of the two);
- ``after``: the RSS after the loop.

The baseline is taken after glibc's ``malloc_trim``: the heap that building the model freed goes back to the
system first. Without it, whichever framework reuses more of that freed heap looks smaller (before
2026-11-27 it was not trimmed, and ResNet-18's onnxgrad session reused about 120 MB of it unseen).

Peaks are the kernel's high-water mark (``VmHWM``), reset between the phases through
``/proc/self/clear_refs`` (when the kernel refuses, the loop's peak includes the build's; the output says so).
``--before PATH`` adds an ``onnxgrad@before`` column: the same session from the onnxgrad package under
``PATH`` (a checkout or ``git archive`` of another revision), for a before/after in one interleaved run.
``--recompute`` adds an ``onnxgrad+recompute`` column: the session with ``recompute=True``
(:mod:`onnxgrad.passes.recompute`: cheap activations computed again in the backward rather than kept).

    PYTHONPATH=. python bench/bench_memory.py                     # all models, every framework
    PYTHONPATH=. python bench/bench_memory.py resnet18 --before /tmp/memory-before --repeats 3
    PYTHONPATH=. python bench/bench_memory.py --frameworks onnxgrad --recompute

A benchmark, not a test: it prints what it measures and asserts nothing. Medians are given with the
[min-max] of the repeats; on a shared machine other processes do not change a process's own RSS, but the
allocator's behaviour under pressure can move it a little.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_step as B  # noqa: E402  (sets the thread environment before torch is imported)

STEPS = 20
FRAMEWORKS = ("onnxgrad", "torch", "compile")


def _mb(field: str) -> float:
    return B._rss_kb(field) / 1024


def _trim() -> None:
    """glibc's malloc_trim (elsewhere nothing): return the freed heap to the operating system."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def baseline() -> tuple[float, bool]:
    """The resident MB now, after a collection and malloc_trim (the heap building the model freed goes back first:
    no framework reuses it unseen), and whether the peak was reset to it (/proc/self/clear_refs), so that the peak
    read later is what came after."""
    gc.collect()
    _trim()
    return _mb("VmRSS"), B._reset_peak()


def child(name: str, framework: str) -> dict:
    """In a fresh process: build the trainer of one model, run STEPS steps, report the phases' peaks."""
    bench = B.BUILDERS[name]()
    if framework in ("torch", "compile"):
        import torch

        torch.set_num_threads(B.THREADS)
    else:
        import onnxruntime  # noqa: F401

        import onnxgrad  # noqa: F401
    base, reset = baseline()
    if framework in ("torch", "compile"):
        step = bench.torch_step(bench.weights, compile=framework == "compile")
    else:
        ts = B.training_session(bench, recompute=framework == "onnxgrad+recompute")
        feeds = {**bench.feeds, **bench.target}
        step = lambda: ts.step(feeds)  # noqa: E731
    gc.collect()
    build_peak = _mb("VmHWM")
    built = _mb("VmRSS")
    reset = B._reset_peak() and reset
    for _ in range(STEPS):
        step()
    loop_peak = _mb("VmHWM")
    gc.collect()
    after = _mb("VmRSS")
    return {"base_mb": base, "build_mb": build_peak - base, "built_mb": built - base,
            "loop_mb": loop_peak - base, "peak_mb": max(build_peak, loop_peak) - base,
            "after_mb": after - base, "peak_reset": reset}


def run_child(name: str, framework: str, before: str | None) -> dict:
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = before if framework.endswith("@before") else env.get("PYTHONPATH", here)
    env["PYTHONPATH"] = root
    fw = framework.split("@")[0]
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, fw], capture_output=True,
                       text=True, timeout=900, env=env)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"rc {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=list(B.MODELS), metavar="MODEL",
                    help=f"some of {', '.join(B.BUILDERS)} (default: {', '.join(B.MODELS)})")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated, of " + ", ".join(FRAMEWORKS))
    ap.add_argument("--before", metavar="PATH", help="also measure the onnxgrad package under PATH")
    ap.add_argument("--recompute", action="store_true", help="also measure TrainingSession(recompute=True)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    frameworks = [f for f in args.frameworks.split(",") if f]
    for name in args.models:
        if name in B.OPTIONAL:          # its export made once, here, and cached for the measured processes
            B.BUILDERS[name]()
    if args.recompute:
        frameworks.insert(frameworks.index("onnxgrad") + 1 if "onnxgrad" in frameworks else 0, "onnxgrad+recompute")
    if args.before:
        frameworks.insert(frameworks.index("onnxgrad") + 1 if "onnxgrad" in frameworks else 0, "onnxgrad@before")
    print(f"peak RSS of {STEPS} AdamW steps, MB above the process with the model built; median [min-max] of "
          f"{args.repeats} fresh processes per cell, interleaved; {B.THREADS} threads")
    results: dict = {}
    for name in args.models:
        runs: dict[str, list[dict]] = {fw: [] for fw in frameworks}
        for _ in range(args.repeats):
            for fw in frameworks:
                runs[fw].append(run_child(name, fw, args.before))
        results[name] = runs
        for fw, rs in runs.items():
            ok = [r for r in rs if "error" not in r]
            if not ok:
                print(f"{name:<12} {fw:<16} error: {rs[0]['error']}", flush=True)
                continue

            def cell(key: str) -> str:
                v = sorted(r[key] for r in ok)
                return f"{v[len(v) // 2]:7.1f} [{v[0]:.0f}-{v[-1]:.0f}]"
            note = "" if all(r["peak_reset"] for r in ok) else "  (peaks not reset between phases)"
            print(f"{name:<12} {fw:<16} build {cell('build_mb')}  loop {cell('loop_mb')}  "
                  f"peak {cell('peak_mb')}  after {cell('after_mb')}{note}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
