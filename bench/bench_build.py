"""Build time of onnxgrad.grad on long synthetic chains: is it linear in the number of nodes?

Each block of the chain is ``h = Tanh(MatMul(h, W_i) + b_i) * c_i`` on 4x4 tensors
(4 nodes, 3 initializers). The gradient is taken with respect to the input and every
initializer (the default ``wrt``), so the backward graph is about as big as it can be.

    /tmp/venv/bin/python bench/bench_build.py             # 1k, 10k, 100k nodes
    /tmp/venv/bin/python bench/bench_build.py 1000 10000  # some sizes
    /tmp/venv/bin/python bench/bench_build.py --profile 10000   # cProfile of one build
    /tmp/venv/bin/python bench/bench_build.py --against /tmp/base 10000   # this checkout against another

``--against DIR``: a checkout of another commit (``git worktree add DIR HEAD``); each side builds in its
own process, alternately, and the ratio of the medians is printed.

A benchmark, not a test: it prints times and asserts nothing about them.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxgrad


def chain(n_nodes: int, size: int = 4, opset: int = 17) -> onnx.ModelProto:
    """A chain of n_nodes nodes (rounded down to blocks of 4) ending in a ReduceSum loss."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    h = "x"
    for i in range(max(1, (n_nodes - 1) // 4)):
        w, b, c = f"W{i}", f"b{i}", f"c{i}"
        inits += [numpy_helper.from_array((rng.standard_normal((size, size)) / size).astype(np.float32), w),
                  numpy_helper.from_array(rng.standard_normal(size).astype(np.float32), b),
                  numpy_helper.from_array(rng.uniform(0.5, 1.5, size).astype(np.float32), c)]
        nodes += [helper.make_node("MatMul", [h, w], [f"m{i}"], name=f"matmul{i}"),
                  helper.make_node("Add", [f"m{i}", b], [f"a{i}"], name=f"add{i}"),
                  helper.make_node("Tanh", [f"a{i}"], [f"t{i}"], name=f"tanh{i}"),
                  helper.make_node("Mul", [f"t{i}", c], [f"h{i}"], name=f"mul{i}")]
        h = f"h{i}"
    nodes.append(helper.make_node("ReduceSum", [h], ["loss"], keepdims=0, name="loss"))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def measure(n: int) -> dict:
    # imported here, not at the top: --against runs this file on other checkouts, which need onnxgrad.grad alone
    from onnxgrad.ir.load import load
    from onnxgrad.ir.model import infer

    model = chain(n)
    nodes = len(model.graph.node)
    wrt = ["x"] + [i.name for i in model.graph.initializer]
    t0 = time.perf_counter()
    load(model)                         # the checker, as grad() runs it
    t1 = time.perf_counter()
    infer(model)                        # shape inference, as grad() runs it
    t2 = time.perf_counter()
    gm = onnxgrad.grad(model, wrt=wrt, loss="loss")
    t3 = time.perf_counter()
    total = t3 - t2
    return {"nodes": nodes, "backward": len(gm.graph.node) - nodes, "wrt": len(wrt),
            "load": t1 - t0, "infer": t2 - t1, "grad": total}


def _grad_seconds(n: int) -> float:
    model = chain(n)
    wrt = ["x"] + [i.name for i in model.graph.initializer]
    t0 = time.perf_counter()
    onnxgrad.grad(model, wrt=wrt, loss="loss")
    return time.perf_counter() - t0


def _one_build(n: int) -> None:
    """Child process of --against: one timed build of an n-node chain (after a warm-up), with the public
    API alone (the other checkout may lay its modules out otherwise)."""
    _grad_seconds(200)
    print(onnxgrad.__file__, _grad_seconds(n))


def against(other: str, n: int, runs: int = 8) -> None:
    """Build time of this checkout's onnxgrad and of the one in ``other``, alternately, one process each."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    times: dict[str, list[float]] = {here: [], other: []}
    for r in range(runs):
        for root in (here, other) if r % 2 == 0 else (other, here):
            env = dict(os.environ, PYTHONPATH=root)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(n)], env=env,
                                 capture_output=True, text=True, check=True)
            module, seconds = out.stdout.split()[-2:]
            if not module.startswith(os.path.abspath(root)):
                sys.exit(f"{root}: the child imported onnxgrad from {module}")
            times[root].append(float(seconds))
    for root, ts in times.items():
        print(f"{root}: median {statistics.median(ts):.3f} s  ({' '.join(f'{t:.2f}' for t in ts)})")
    print(f"ratio {statistics.median(times[here]) / statistics.median(times[other]):.3f} ({n} nodes)")


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--one":
        _one_build(int(argv[1]))
        return
    if argv and argv[0] == "--against":
        against(argv[1], int(argv[2]) if len(argv) > 2 else 10000)
        return
    if argv and argv[0] == "--profile":
        model = chain(int(argv[1]) if len(argv) > 1 else 10000)
        wrt = ["x"] + [i.name for i in model.graph.initializer]
        prof = cProfile.Profile()
        prof.enable()
        onnxgrad.grad(model, wrt=wrt, loss="loss")
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        return
    sizes = [int(a) for a in argv] or [1_000, 10_000, 100_000]
    measure(200)                        # warm-up: imports, rule registry
    print(f"{'nodes':>8} {'backward':>9} {'wrt':>7} {'grad() s':>9} {'us/node':>8} "
          f"{'(apart) checker s':>18} {'shape inference s':>18}")
    for n in sizes:
        r = measure(n)
        print(f"{r['nodes']:>8} {r['backward']:>9} {r['wrt']:>7} {r['grad']:>9.2f} "
              f"{1e6 * r['grad'] / r['nodes']:>8.1f} {r['load']:>18.2f} {r['infer']:>18.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
