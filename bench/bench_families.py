"""torchvision's MobileNetV2, MobileNetV3-Large, EfficientNet-B0 and ResNet-18 (bench/vision_models.py: the same
networks in plain torch) trained in train mode with AdamW through onnxgrad.from_torch against PyTorch eager on the
same machine (64x64 images, batch 4, 1000 classes), one framework per process (alternating processes: in one
process the two frameworks' thread pools slow each other, PyTorch's most); the session's build time; and
onnxruntime's profile of onnxgrad's step by op type (issue 33: the depthwise families). Needs torch
(pip install ".[cpu,torch]").

    python bench/bench_depthwise.py [MODEL ...] [--reps 10] [--rounds 2] [--profile]
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

import bench_step as B  # noqa: E402
import vision_models  # noqa: E402


def run(name: str, framework: str, reps: int, profile: bool) -> dict:
    """Time ``reps`` steps of one framework in this process (after 3 warm-up steps)."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(B.THREADS)
    net = vision_models.MODELS[name]()
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))
    if framework == "torch":
        net.train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step():
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
        build = export = 0.0
    else:
        from onnxgrad import TrainingSession, from_torch, losses, optim

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            model = from_torch(net, (x,))
            export = time.perf_counter() - t0
        so = B.session_options("/tmp/bench_depthwise" if profile else None)
        t0 = time.perf_counter()
        s = TrainingSession(model, loss=losses.CrossEntropyLoss(output=model.graph.output[0].name, target="t"),
                            optimizer=optim.AdamW(lr=1e-3), providers=["CPUExecutionProvider"], session_options=so)
        build = time.perf_counter() - t0
        feeds = {model.graph.input[0].name: x.numpy(), "t": y.numpy()}

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
    return {"median": statistics.median(times), "min": min(times), "build_s": build, "export_s": export}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", choices=[[]] + list(vision_models.MODELS), default=[],
                    help="default: all four")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="processes per framework, alternating")
    ap.add_argument("--profile", action="store_true", help="also print onnxruntime's profile of the step")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--framework", choices=["onnxgrad", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = args.models or list(vision_models.MODELS)
    if args.framework:
        print(json.dumps(run(names[0], args.framework, args.reps, args.profile)))
        return 0
    # each framework alone in its process: idle threads spin, both frameworks' default (bench_step's BENCH_SPIN=1;
    # its blocking default suits one process running both, where spinning threads stall the other side)
    spin = os.environ.get("BENCH_SPIN", "1")
    env = {**os.environ, "BENCH_SPIN": spin, "OMP_WAIT_POLICY": "ACTIVE" if spin == "1" else "PASSIVE"}
    print(f"64x64 images, batch 4, 1000 classes, train mode, AdamW, {B.THREADS} threads, spinning "
          f"{env['BENCH_SPIN'] == '1'}; median of {args.rounds} processes per framework, each the median of "
          f"{args.reps} steps (ms)")
    print(f"{'model':20s} {'onnxgrad':>9s} {'eager':>9s} {'ratio':>6s} {'export s':>9s} {'session s':>10s}")
    table = {}
    for name in names:
        results: dict[str, list[dict]] = {"onnxgrad": [], "torch": []}
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
        table[name] = row
        print(f"{name:20s} {row['onnxgrad_ms']:9.1f} {row['eager_ms']:9.1f} {row['ratio']:6.2f} "
              f"{row['export_s']:9.2f} {row['session_s']:10.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": B.THREADS, "rounds": args.rounds, "reps": args.reps, "models": table}, f, indent=1)
    if args.profile:
        for name in names:
            run(name, "onnxgrad", args.reps, True)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
