"""Time of the AdamW update alone on ResNet-18's 11M parameters, and its full-size ops per parameter,
against PyTorch's ``torch.optim.AdamW`` on the same shapes (its default for CPU tensors, ``foreach=True``
and ``fused=True``), each in its own process.

The update is the data-parallel step's second graph (``artifacts.build(split=True).split.update``): it
reads the flat gradient buffers, slices each parameter's gradient out, checks finiteness, takes the norm
and applies AdamW; it is run here with the parameters and state bound as the session binds them: in place
when this onnxgrad has ``artifacts.in_place`` (outputs written into the input buffers), else into a spare
set. ``--before PATH`` times the onnxgrad package under ``PATH`` too (``git archive`` of another revision),
with the guard the session of that revision used; each revision runs in its own process, alternately,
``--rounds`` times, and each round reports the median of ``--reps`` runs. ``NOINPLACE=1`` in the
environment binds this revision's outputs to a spare set too (in place against double-buffered).

    PYTHONPATH=. python bench/bench_adamw.py --before /tmp/memory-before

A benchmark, not a test: it prints what it measures and asserts nothing (on a shared machine timings are
noisy: compare the medians over the rounds, with their spread).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_step as B  # noqa: E402


def child(reps: int) -> dict:
    import numpy as np
    import onnxruntime as ort
    from onnx import helper

    import onnxgrad.training.artifacts as A
    from onnxgrad import optim

    bench = B.resnet18()
    in_place = hasattr(A, "in_place")
    art = A.build(bench.forward, bench.loss, optim.AdamW(lr=1e-3), split=True, target="cpu",
                  guard=in_place, defaults=False)          # the guard each revision's session used
    sp, spec = art.split, art.split.spec
    model = sp.update
    sess = ort.InferenceSession(model.SerializeToString(), B.session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    values = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        if vi.name == spec.lr:
            values[vi.name] = np.array(1e-3, dtype)
        elif vi.name == spec.step:
            values[vi.name] = np.array(3, dtype)
        else:
            values[vi.name] = (rng.standard_normal(shape) * 1e-2).astype(dtype)
    for b in sp.buckets:                  # the stats pair: a weight of 1, so the mean is the sum
        if b.dtype == 1:
            values[b.name][sp.stats:sp.stats + 2] = [0.5, 1.0]
    for p, st in spec.state.items():
        for s_, (i, _) in st.items():
            values[i] = np.abs(values[i]) if s_ == "exp_avg_sq" else values[i]
    ovs = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in values.items()}
    pairs = dict(spec.params)
    pairs.update({i: o for st in spec.state.values() for i, o in st.values()})
    inplace = A.in_place(model, pairs, spec.finite) if in_place and not os.environ.get("NOINPLACE") else set()
    io_ = sess.io_binding()
    for k, ov in ovs.items():
        io_.bind_ortvalue_input(k, ov)
    for i, o in pairs.items():
        io_.bind_ortvalue_output(o, ovs[i] if i in inplace else ort.OrtValue.ortvalue_from_numpy(values[i].copy()))
    for o in (spec.loss, spec.finite, spec.grad_norm):
        io_.bind_output(o, "cpu")
    for _ in range(3):
        sess.run_with_iobinding(io_)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io_)
        times.append((time.perf_counter() - t0) * 1e3)
    ops = {}
    nodes = list(model.graph.node)
    while nodes:               # the update's nodes, in the guard's If branches too
        n = nodes.pop()
        nodes += [x for a in n.attribute if a.type == a.GRAPH for x in a.g.node]
        if n.name.startswith("train/optimizer/") and n.name.count("/") > 2 and n.op_type != "Constant":
            p = n.name.split("/")[2]
            if p in spec.params:
                ops[p] = ops.get(p, 0) + 1
    elements = sum(int(np.prod(values[p].shape)) for p in spec.params)
    return {"ms": float(np.median(times)), "min": float(np.min(times)), "elements": elements,
            "params": len(spec.params), "in_place": len(inplace), "outputs": len(pairs),
            "ops_per_param": sorted(set(ops.values()))}


def torch_child(reps: int, variant: str) -> dict:
    """PyTorch's AdamW step on tensors of ResNet-18's parameter shapes (``variant``: its default for CPU
    tensors, ``foreach`` or ``fused``), the gradients already there."""
    import numpy as np
    import torch

    torch.set_num_threads(B.THREADS)
    bench = B.resnet18()
    params = [torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in bench.weights.items() if "running" not in k]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    kw = {} if variant == "default" else {variant: True}
    opt = torch.optim.AdamW(params, lr=1e-3, **kw)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": float(np.median(times)), "min": float(np.min(times))}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", metavar="PATH")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.reps)))
        return
    if args.torch_child:
        print(json.dumps(torch_child(args.reps, args.torch_child)))
        return
    here = os.environ.get("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    versions = {"onnxgrad": here, **({"onnxgrad@before": args.before} if args.before else {})}
    try:
        import torch  # noqa: F401
        variants = [] if args.no_torch else ["default", "foreach", "fused"]
    except ImportError:
        variants = []
    rounds: dict[str, list[dict]] = {k: [] for k in list(versions) + [f"torch {v}" for v in variants]}
    for _ in range(args.rounds):
        for k in rounds:
            flag = ["--torch-child", k.split()[1]] if k.startswith("torch ") else ["--child"]
            path = versions.get(k, here)
            r = subprocess.run([sys.executable, os.path.abspath(__file__), *flag, "--reps", str(args.reps)],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path}, timeout=900)
            if r.returncode:
                raise SystemExit(f"{k}: {r.stderr.strip().splitlines()[-1]}")
            rounds[k].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"AdamW update graph on ResNet-18's parameters, {B.THREADS} threads; per round the median of {args.reps} "
          f"runs; median [min-max] over {args.rounds} rounds")
    for k, rs in rounds.items():
        ms = sorted(r["ms"] for r in rs)
        r0 = rs[0]
        line = (f"{k:<16} {ms[len(ms) // 2]:7.2f} ms [{ms[0]:.2f}-{ms[-1]:.2f}]  best single run "
                f"{min(r['min'] for r in rs):.2f} ms")
        if "elements" in r0:
            line += (f"; {r0['elements'] / 1e6:.1f}M elements in {r0['params']} parameters; full-size optimizer "
                     f"ops per parameter {r0['ops_per_param']}; {r0['in_place']}/{r0['outputs']} outputs in place")
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
