"""One training step timed across commits, in alternating processes: where a regression came in, and whether it is
gone. Tables taken days apart on a shared virtual machine do not show a change of 20-30% reliably; commits compared
in one sitting, alternating, do.

The model is a conv-BN-ReLU peer CNN (three blocks of a 3x3 Conv, BatchNormalization in train mode, ReLU and a 2x2
MaxPool, 32/64/128 channels, 3x32x32 images, batch 32, global pool and a linear layer to 10 classes), built with
onnx.helper and trained with ``TrainingSession`` (cross-entropy, AdamW), an API every commit since 9512f75 has;
PyTorch eager runs the same network (``torch.nn.functional``) beside them. Each commit is checked out in a
temporary git worktree and imported from there (``PYTHONPATH``); each process times 20 steps after 5.

    python bench/bench_commits.py 9512f75 ff26220 HEAD [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
THREADS = 2
STEPS, WARMUP = 20, 5


def peer_cnn():
    """The ONNX model and its initial weights (seeded)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, x, cin = [], {}, "x", 3
    for i, c in enumerate([32, 64, 128]):
        weights[f"w{i}"] = (rng.standard_normal((c, cin, 3, 3)) * np.sqrt(2 / (cin * 9))).astype(np.float32)
        for k, v in (("s", 1.0), ("b", 0.0), ("m", 0.0), ("v", 1.0)):
            weights[f"{k}{i}"] = np.full(c, v, np.float32)
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  helper.make_node("BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}", f"v{i}"], [f"n{i}"],
                                   name=f"bn{i}"),
                  helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
                  helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2],
                                   name=f"pool{i}")]
        x, cin = f"p{i}", c
    weights["fc"] = (rng.standard_normal((10, 128)) * 0.1).astype(np.float32)
    nodes += [helper.make_node("GlobalAveragePool", [x], ["g"], name="gap"),
              helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
              helper.make_node("Gemm", ["f", "fc"], ["logits"], transB=1, name="fc")]
    graph = helper.make_graph(nodes, "peer_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 3, 32, 32])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [32, 10])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


def step_of(framework: str):
    """A function running one training step of ``framework`` ("onnxgrad": whichever is on sys.path; "torch")."""
    import numpy as np

    model, weights = peer_cnn()
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((32, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int64)
    if framework == "torch":
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(THREADS)
        w = {k: torch.tensor(v, requires_grad=k[0] in "wsbf") for k, v in weights.items()}
        opt = torch.optim.AdamW([t for t in w.values() if t.requires_grad], lr=1e-3)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)

        def step():
            opt.zero_grad()
            a = xt
            for i in range(3):
                a = F.conv2d(a, w[f"w{i}"], padding=1)
                a = F.batch_norm(a, w[f"m{i}"], w[f"v{i}"], w[f"s{i}"], w[f"b{i}"], training=True)
                a = F.max_pool2d(F.relu(a), 2)
            F.cross_entropy(a.mean((2, 3)) @ w["fc"].T, yt).backward()
            opt.step()
        return step
    import onnxruntime as ort

    from onnxgrad import TrainingSession, losses, optim

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = THREADS, 1, 3
    s = TrainingSession(model, loss=losses.CrossEntropyLoss(output="logits", target="t"),
                        optimizer=optim.AdamW(lr=1e-3), providers=["CPUExecutionProvider"], session_options=so)
    return lambda: s.step({"x": x, "t": y})


def child(framework: str) -> None:
    step = step_of(framework)
    times = []
    for k in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        step()
        if k >= WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"median_ms": statistics.median(times)}))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("commits", nargs="*", help="commits (any git revision) to compare")
    ap.add_argument("--rounds", type=int, default=4, help="processes per commit, alternating")
    ap.add_argument("--child", choices=["onnxgrad", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if not args.commits:
        ap.error("name at least one commit")
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for commit in args.commits:
            tree = os.path.join(tmp, str(len(trees)))
            subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-q", tree, commit], check=True)
            trees[commit] = tree
        try:
            times: dict[str, list[float]] = {c: [] for c in [*trees, "PyTorch eager"]}
            for _ in range(args.rounds):
                for name in times:
                    env = dict(os.environ)
                    if name in trees:
                        env["PYTHONPATH"] = trees[name]
                    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                        "onnxgrad" if name in trees else "torch"],
                                       capture_output=True, text=True, env=env, check=True)
                    times[name].append(json.loads(r.stdout.strip().splitlines()[-1])["median_ms"])
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], check=False)
    eager = statistics.median(times["PyTorch eager"])
    print(f"peer CNN (conv-BN-ReLU x3, 3x32x32, batch 32, AdamW), {THREADS} threads; median of {args.rounds} "
          f"alternating processes, each the median of {STEPS} steps (ms)")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:>16s}  {m:7.2f}  / eager {m / eager:5.2f}   ({' '.join(f'{t:.1f}' for t in ts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
