"""Build time of the training artifacts, per target: the model families of bench_families.py exported with
onnxgrad.from_torch, then ``onnxgrad.training.artifacts.build`` (AdamW, cross-entropy, train mode, the update
guarded) for the canonical graph, the ``cpu`` target and the ``webgpu`` target (what
``python -m onnxgrad MODEL --optimize-for webgpu`` builds for the browser). Median of ``--repeats`` builds in one
process, after the export. Needs torch and transformers (pip install ".[cpu,torch]" transformers).

    python bench/bench_artifacts.py [MODEL ...] [--targets canonical cpu webgpu] [--repeats 3]

A benchmark, not a test: it prints times and asserts nothing about them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch_models  # noqa: E402

TARGETS = {"canonical": None, "cpu": "cpu", "webgpu": "webgpu"}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", metavar="MODEL", help=f"of {', '.join(torch_models.MODELS)} (default: all)")
    ap.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    names = args.models or list(torch_models.MODELS)
    unknown = [n for n in names if n not in torch_models.MODELS]
    if unknown:
        ap.error(f"unknown model {', '.join(unknown)} (models: {', '.join(torch_models.MODELS)})")

    import torch

    from onnxgrad import from_torch, losses, optim
    from onnxgrad.training import artifacts

    torch.set_num_threads(2)
    print(f"artifacts.build, AdamW, cross-entropy, train mode; median of {args.repeats} builds (s)")
    print(f"{'model':20s} {'nodes':>7s}" + "".join(f" {t:>10s}" for t in args.targets))
    for name in names:
        net, inputs, _ = torch_models.example(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = from_torch(net, inputs)
        loss = losses.CrossEntropyLoss(output=model.graph.output[0].name, target="t")
        cells = []
        for target in args.targets:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    artifacts.build(model, loss, optim.AdamW(lr=1e-3), guard=True, target=TARGETS[target])
                times.append(time.perf_counter() - t0)
            cells.append(statistics.median(times))
        print(f"{name:20s} {len(model.graph.node):7d}" + "".join(f" {c:10.2f}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
