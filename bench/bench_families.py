"""The model families people train, through onnxgrad.from_torch, against PyTorch eager (and with --compile
torch.compile): torchvision's
MobileNetV2, MobileNetV3-Large, EfficientNet-B0 and ResNet-18 (64x64 images, batch 4, 1000 classes), transformers'
BERT (4 layers, d256, sequences of 128, batch 8) and GPT-2 (4 layers, d256, 128 positions, batch 4, its 50257-token
vocabulary) (bench/torch_models.py), trained in train mode with AdamW and cross-entropy, ours with ``module=net`` (the
session updates the module's own tensors, as torch.optim does: the weights are held once). One framework per process
(alternating processes: in one process the two frameworks' thread pools slow each other, PyTorch's most); the
export's and the session's build times; and onnxruntime's profile of onnxgrad's step by op type. Needs torch and
transformers (pip install ".[cpu,torch]" transformers).

    python bench/bench_families.py [MODEL ...] [--reps 10] [--rounds 2] [--compile] [--profile]
    python bench/bench_families.py --json bench/results/families_DATE.json     # the published figures
    python bench/bench_families.py --against bench/results/families_DATE.json  # a later run against them
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import bench_memory  # noqa: E402
import bench_step as B  # noqa: E402
import published  # noqa: E402
import torch_models  # noqa: E402


def run(name: str, framework: str, reps: int, profile: bool) -> dict:
    """Time ``reps`` steps of one framework in this process (after 3 warm-up steps)."""
    import torch

    torch.set_num_threads(B.THREADS)
    net, inputs, y = torch_models.example(name)
    if framework == "onnxgrad":
        from onnxgrad import TrainingSession, from_torch, losses, optim

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            model = from_torch(net, inputs)
            export = time.perf_counter() - t0
    base, reset = bench_memory.baseline()      # the model loaded (and exported): what building and training add
    if framework in ("torch", "compile"):
        net.train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        loss_fn = torch.nn.CrossEntropyLoss()
        forward = torch.compile(net) if framework == "compile" else net

        def step():
            opt.zero_grad()
            loss_fn(forward(*inputs), y).backward()
            opt.step()
        build = export = 0.0
    else:
        so = B.session_options("/tmp/bench_families" if profile else None)
        t0 = time.perf_counter()
        s = TrainingSession(model, loss=losses.CrossEntropyLoss(output=model.graph.output[0].name, target="t"),
                            optimizer=optim.AdamW(lr=1e-3), providers=["CPUExecutionProvider"], session_options=so,
                            module=net)
        build = time.perf_counter() - t0
        feeds = {i.name: x.numpy() for i, x in zip(model.graph.input, inputs)} | {"t": y.numpy()}

        def step():
            s.step(feeds)
    times = []
    for k in range(reps + 3):
        t0 = time.perf_counter()
        step()
        if k >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    if profile and framework == "onnxgrad":
        B.print_profile(s._train.end_profiling(), "onnxgrad step", reps + 3)
    peak = bench_memory._mb("VmHWM") - base
    return {"median": statistics.median(times), "min": min(times), "build_s": build, "export_s": export,
            "peak_mb": peak, "peak_reset": reset}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", metavar="MODEL", help=f"of {', '.join(torch_models.MODELS)} (default: all)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="processes per framework, alternating")
    ap.add_argument("--profile", action="store_true", help="also print onnxruntime's profile of the step")
    ap.add_argument("--json", metavar="PATH", help="also write the figures, and the run's date, machine and commit")
    ap.add_argument("--against", metavar="PATH", help="compare this run's onnxgrad / eager ratios with a published "
                    f"--json file, one line per model, a ratio worse by more than --tolerance flagged {published.FLAG}")
    ap.add_argument("--tolerance", type=float, default=published.DEFAULT_TOLERANCE, metavar="FRACTION",
                    help="relative rise of a ratio flagged as a regression (default %(default)s)")
    ap.add_argument("--compile", action="store_true",
                    help="also time torch.compile (each process compiles first: about 35 s for MobileNetV2 here)")
    ap.add_argument("--framework", choices=["onnxgrad", "torch", "compile"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = args.models or list(torch_models.MODELS)
    unknown = [n for n in names if n not in torch_models.MODELS]
    if unknown:
        ap.error(f"unknown model {', '.join(unknown)} (models: {', '.join(torch_models.MODELS)})")
    try:
        before = published.load(args.against) if args.against else None     # a wrong file fails before the run
    except (OSError, ValueError) as e:
        ap.error(f"--against: {e}")
    if args.framework:
        print(json.dumps(run(names[0], args.framework, args.reps, args.profile)))
        return 0
    # each framework alone in its process: idle threads spin, both frameworks' default (bench_step's BENCH_SPIN=1;
    # its blocking default suits one process running both, where spinning threads stall the other side)
    spin = os.environ.get("BENCH_SPIN", "1")
    env = {**os.environ, "BENCH_SPIN": spin, "OMP_WAIT_POLICY": "ACTIVE" if spin == "1" else "PASSIVE"}
    print(f"train mode, AdamW, cross-entropy, {B.THREADS} threads, spinning "
          f"{env['BENCH_SPIN'] == '1'}; median of {args.rounds} processes per framework, each the median of "
          f"{args.reps} steps (ms)")
    print(f"{'model':20s} {'onnxgrad':>9s} {'eager':>9s} {'ratio':>6s} {'export s':>9s} {'session s':>10s} "
          f"{'peak MB ours / eager':>21s} {'ratio':>6s}"
          + (f" {'compile':>9s} {'ratio':>6s}" if args.compile else ""))
    table = {}
    for name in names:
        results: dict[str, list[dict]] = {"onnxgrad": [], "torch": [], **({"compile": []} if args.compile else {})}
        for _ in range(args.rounds):
            for framework in results:
                r = subprocess.run([sys.executable, __file__, name, "--framework", framework, "--reps",
                                    str(args.reps)], capture_output=True, text=True, env=env, check=True)
                results[framework].append(json.loads(r.stdout.strip().splitlines()[-1]))
        row = {"onnxgrad_ms": statistics.median(r["median"] for r in results["onnxgrad"]),
               "eager_ms": statistics.median(r["median"] for r in results["torch"]),
               "export_s": statistics.median(r["export_s"] for r in results["onnxgrad"]),
               "session_s": statistics.median(r["build_s"] for r in results["onnxgrad"])}
        row["ratio"] = row["onnxgrad_ms"] / row["eager_ms"]
        row["onnxgrad_peak_mb"] = statistics.median(r["peak_mb"] for r in results["onnxgrad"])
        row["eager_peak_mb"] = statistics.median(r["peak_mb"] for r in results["torch"])
        row["memory/eager"] = row["onnxgrad_peak_mb"] / row["eager_peak_mb"]
        row["peak_reset"] = all(r["peak_reset"] for rs in results.values() for r in rs)
        if args.compile:
            row["compile_ms"] = statistics.median(r["median"] for r in results["compile"])
            row["step/compile"] = row["onnxgrad_ms"] / row["compile_ms"]
        table[name] = row
        print(f"{name:20s} {row['onnxgrad_ms']:9.1f} {row['eager_ms']:9.1f} {row['ratio']:6.2f} "
              f"{row['export_s']:9.2f} {row['session_s']:10.2f} "
              f"{row['onnxgrad_peak_mb']:10.0f} / {row['eager_peak_mb']:<8.0f} {row['memory/eager']:6.2f}"
              + (f" {row['compile_ms']:9.1f} {row['step/compile']:6.2f}" if args.compile else "")
              + ("" if row["peak_reset"] else "  (peak not reset: includes the export)"), flush=True)
    measured = published.run_info(threads=B.THREADS, rounds=args.rounds, reps=args.reps, models=table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(measured, f, indent=1)
    if before is not None:
        print()
        for difference in published.setup_differences(measured, before):
            print(f"note: published on another setup ({difference}): the ratios move with it")
        comparisons = published.compare(table, before["models"],
                                        ["ratio", "memory/eager", "step/compile"])
        for line in published.report(comparisons, args.tolerance, f"{args.against} ({published.describe(before)})"):
            print(line)
    if args.profile:
        for name in names:
            run(name, "onnxgrad", args.reps, True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
