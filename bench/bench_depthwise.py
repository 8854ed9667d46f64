"""A MobileNetV2-like network (inverted residual blocks: 1x1 expand, BatchNorm, ReLU6, 3x3 depthwise, BatchNorm,
ReLU6, 1x1 project, BatchNorm; 7 blocks, 64x64 images, batch 4) trained with AdamW through onnxgrad.from_torch
against PyTorch eager on the same machine, one framework per process (alternating processes: in one process the
two frameworks' thread pools slow each other, PyTorch's most), and onnxruntime's profile of onnxgrad's step by op
type (issue 33: the depthwise families). Needs torch (pip install ".[cpu,torch]").

    python bench/bench_depthwise.py [--reps 10] [--rounds 2] [--profile]
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


def network():
    import torch.nn as nn

    class InvertedResidual(nn.Module):
        def __init__(self, cin, cout, stride, expand=4):
            super().__init__()
            h = cin * expand
            self.block = nn.Sequential(
                nn.Conv2d(cin, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
                nn.Conv2d(h, h, 3, stride, 1, groups=h, bias=False), nn.BatchNorm2d(h), nn.ReLU6(),
                nn.Conv2d(h, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.block(x) if self.residual else self.block(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
            blocks = [(16, 24, 2), (24, 24, 1), (24, 32, 2), (32, 32, 1), (32, 64, 2), (64, 64, 1), (64, 96, 1)]
            self.blocks = nn.Sequential(*[InvertedResidual(a, b, s) for a, b, s in blocks])
            self.head = nn.Linear(96, 10)

        def forward(self, x):
            return self.head(self.blocks(self.stem(x)).mean((2, 3)))

    return Net()


def run(framework: str, reps: int, profile: bool) -> dict:
    """Time ``reps`` steps of one framework in this process (after 3 warm-up steps)."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(B.THREADS)
    net = network()
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    if framework == "torch":
        net.train()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step():
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()
        build = 0.0
    else:
        from onnxgrad import TrainingSession, from_torch, losses, optim

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = from_torch(net, (x,))
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
    return {"median": statistics.median(times), "min": min(times), "build_s": build}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="processes per framework, alternating")
    ap.add_argument("--profile", action="store_true", help="also print onnxruntime's profile of the step")
    ap.add_argument("--framework", choices=["onnxgrad", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.framework:
        print(json.dumps(run(args.framework, args.reps, args.profile)))
        return 0
    results: dict[str, list[dict]] = {"onnxgrad": [], "torch": []}
    # each framework alone in its process: idle threads spin, both frameworks' default (bench_step's BENCH_SPIN=1;
    # its blocking default suits one process running both, where spinning threads stall the other side)
    spin = os.environ.get("BENCH_SPIN", "1")
    env = {**os.environ, "BENCH_SPIN": spin, "OMP_WAIT_POLICY": "ACTIVE" if spin == "1" else "PASSIVE"}
    for _ in range(args.rounds):
        for framework in results:
            r = subprocess.run([sys.executable, __file__, "--framework", framework, "--reps", str(args.reps)],
                               capture_output=True, text=True, env=env, check=True)
            results[framework].append(json.loads(r.stdout.strip().splitlines()[-1]))
    o = statistics.median(r["median"] for r in results["onnxgrad"])
    e = statistics.median(r["median"] for r in results["torch"])
    print(f"MobileNetV2-like, 64x64, batch 4, AdamW, {B.THREADS} threads, spinning {env['BENCH_SPIN'] == '1'}; "
          f"median of {args.rounds} processes per framework, each the median of {args.reps} steps")
    print(f"onnxgrad {o:.1f} ms, PyTorch eager {e:.1f} ms, onnxgrad / eager {o / e:.2f}; session built in "
          f"{statistics.median(r['build_s'] for r in results['onnxgrad']):.2f} s")
    if args.profile:
        run("onnxgrad", args.reps, True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
