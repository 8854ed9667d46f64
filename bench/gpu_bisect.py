"""Where does a BatchNorm model's training on CUDA part from the CPU's? One diagnostic run on the GPU machine.

Issue 35's first GPU run (H200, onnxruntime-gpu 1.31.1) found ResNet-18 (BatchNormalization in train mode,
lowered for the cuda target) off the CPU session after 5 steps (loss 4.9e-2 relative), two sessions on one
batch 3.2e-4 apart, and the NaN batch refused but the weights changed; the MLP, CNN and transformer agreed.
This script separates the suspects, each against the CPU session on the same model, batch and optimizer:

- ``tf32``: onnxruntime's CUDA provider computes Conv and MatMul in TF32 unless ``use_tf32`` is 0;
- ``in place``: the session binds a guarded output to its input's buffer (:func:`onnxgrad.training.artifacts.in_place`);
- ``binding``: the session's IOBinding loop itself, against a plain ``InferenceSession.run`` loop;
- ``kernels``: every node's output of the first step, CUDA against CPU, the first nodes that differ.

    source .gpu/b/env.sh && python3 bench/gpu_bisect.py          # on the GPU machine
    python bench/gpu_bisect.py --cpu                             # the script's own check, here
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

STEPS = 5


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12)) if b.size else 0.0


def models(cpu: bool):
    """(name, forward model, loss, feeds, optimizer factory)."""
    from onnxgrad import losses, optim

    out = []
    for stem in ("cnn_legacy", "cnn_bn_dynamo"):
        ref = dict(np.load(ROOT / "models" / "train_step" / f"{stem}.npz"))
        out.append((stem, str(ROOT / "models" / f"{stem}.onnx"),
                    losses.MSELoss(output=str(ref["output"]), target="t"), {"x": ref["x"], "t": ref["t"]},
                    lambda lr=float(ref["lr"]): optim.SGD(lr=lr, momentum=0.9)))
    import bench_step as B

    bench = B.MODELS["resnet18"](batch=4, size=64, classes=100)
    out.append(("resnet18_64_b4", bench.forward, bench.loss, {**bench.feeds, **bench.target},
                lambda: optim.SGD(lr=1e-3, momentum=0.9)))
    if not cpu:
        bench = B.MODELS["resnet18"]()
        out.append(("resnet18_default", bench.forward, bench.loss, {**bench.feeds, **bench.target},
                    lambda: optim.SGD(lr=1e-3, momentum=0.9)))
    return out


def session(forward, loss, opt, providers, in_place=True):
    from onnxgrad import TrainingSession

    cls = TrainingSession
    if not in_place:
        class NoInPlace(TrainingSession):
            def _in_place(self):
                return set()
        cls = NoInPlace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(forward, loss=loss, optimizer=opt(), providers=providers)


def trajectory(s, feeds) -> tuple[list[float], dict[str, np.ndarray]]:
    losses = [s.step(feeds) for _ in range(STEPS)]
    return losses, {**s.parameters(), **s.buffers()}


def compare(label, got, want) -> None:
    (gl, gt), (wl, wt) = got, want
    worst = max(wt, key=lambda k: rel(gt[k], wt[k]))
    print(f"  {label:34s} loss {rel(gl, wl):.1e}  tensors {rel(gt[worst], wt[worst]):.1e} ({worst})", flush=True)


def start_values(s) -> dict[str, np.ndarray]:
    """Every state input of a session that has not stepped yet (optimizer state zero, as it starts)."""
    from onnx import helper

    values = {**s.artifacts.initial_values(), **s.parameters(), **s.buffers()}
    for i in s.artifacts.train.graph.input:
        t = i.type.tensor_type
        if i.name not in values and i.name not in s.artifacts.spec.data_inputs:
            values[i.name] = np.zeros([d.dim_value for d in t.shape.dim], helper.tensor_dtype_to_np_dtype(t.elem_type))
    return values


def raw_loop(art, start, feeds, providers) -> tuple[list[float], dict[str, np.ndarray]]:
    """The training graph run by InferenceSession.run, each ``X.next`` fed back as ``X``: no IOBinding."""
    import onnxruntime as ort

    sess = ort.InferenceSession(art.train.SerializeToString(), providers=providers)
    values = {**start, **feeds}
    names = [o.name for o in sess.get_outputs()]
    losses = []
    for _ in range(STEPS):
        out = dict(zip(names, sess.run(None, {i.name: values[i.name] for i in sess.get_inputs()})))
        losses.append(float(out[art.spec.loss]))
        for o, v in out.items():
            if o.endswith(".next") and o[:-5] in values:
                values[o[:-5]] = v
    held = {k: values[k] for k in [*art.spec.params, *art.spec.buffers] if k in values}
    return losses, held


def every_output(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.shape_inference.infer_shapes(model)
    have = {o.name for o in m.graph.output}
    typed = {vi.name: vi for vi in m.graph.value_info if vi.type.tensor_type.elem_type}
    for node in m.graph.node:
        for o in node.output:
            if o and o not in have and o in typed:
                m.graph.output.append(typed[o])
                have.add(o)
    return m


def kernels(art, start, feeds, providers, cpu_providers, opt_level) -> None:
    """Every node output of step 1 under ``providers`` against the CPU's; the first nodes that differ."""
    import onnxruntime as ort

    m = every_output(art.train)
    values = {**start, **feeds}
    results = []
    for prov in (providers, cpu_providers):
        so = ort.SessionOptions()
        so.graph_optimization_level = opt_level
        so.log_severity_level = 3
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=prov)
        names = [o.name for o in sess.get_outputs()]
        results.append(dict(zip(names, sess.run(None, {i.name: values[i.name] for i in sess.get_inputs()}))))
    got, want = results
    producer = {o: n for n in m.graph.node for o in n.output}
    bad = []
    for node in m.graph.node:
        for o in node.output:
            if o in got and got[o].dtype.kind == "f" and got[o].size:
                r = rel(got[o], want[o])
                if not np.isfinite(r) or r > 1e-3:
                    bad.append((o, r))
    print(f"  kernels ({opt_level.name}): {len(bad)} of {len(got)} node outputs beyond 1e-3", flush=True)
    for o, r in bad[:6]:
        n = producer[o]
        print(f"    {n.op_type:20s} {n.name[:60]:60s} {r:.1e} {list(got[o].shape)}", flush=True)


def nan_batch(forward, loss, opt, providers, feeds, in_place) -> str:
    from onnxgrad.training.session import NonFiniteError

    s = session(forward, loss, opt, providers, in_place=in_place)
    for _ in range(2):
        s.step(feeds)
    before = {**s.parameters(), **s.buffers()}
    bad = {k: v.copy() for k, v in feeds.items()}
    first = next(k for k, v in bad.items() if v.dtype.kind == "f")
    bad[first].reshape(-1)[0] = np.nan
    try:
        s.step(bad)
        verdict = "applied"
    except NonFiniteError:
        verdict = "refused"
    after = {**s.parameters(), **s.buffers()}
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    return f"{verdict}, {len(changed)} tensors changed{(' e.g. ' + changed[0]) if changed else ''}"


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help="cnn_legacy, cnn_bn_dynamo, resnet18_64_b4, resnet18_default (all)")
    ap.add_argument("--cpu", action="store_true", help="rehearse with the CPU provider in place of CUDA")
    args = ap.parse_args(argv)
    import onnxruntime as ort

    cpu_p = ["CPUExecutionProvider"]
    if args.cpu:
        cuda_p = cuda32 = cpu_p
    else:
        cuda_p = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        cuda32 = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    print(f"onnxruntime {ort.__version__}, {ort.get_available_providers()}", flush=True)
    for name, forward, loss, feeds, opt in models(args.cpu):
        if args.models and name not in args.models:
            continue
        t0 = time.time()
        print(f"== {name}", flush=True)
        ref = trajectory(session(forward, loss, opt, cpu_p), feeds)
        compare("session, default options", trajectory(session(forward, loss, opt, cuda_p), feeds), ref)
        compare("session, use_tf32=0", trajectory(session(forward, loss, opt, cuda32), feeds), ref)
        compare("session, use_tf32=0, no in-place", trajectory(session(forward, loss, opt, cuda32, in_place=False),
                                                               feeds), ref)
        fresh = session(forward, loss, opt, cuda32)
        art, start = fresh.artifacts, start_values(fresh)
        compare("InferenceSession.run loop, tf32=0", raw_loop(art, start, feeds, cuda32),
                raw_loop(art, start, feeds, cpu_p))
        print(f"  NaN batch, in place:    {nan_batch(forward, loss, opt, cuda32, feeds, True)}", flush=True)
        print(f"  NaN batch, no in place: {nan_batch(forward, loss, opt, cuda32, feeds, False)}", flush=True)
        if name != "resnet18_default":
            for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
                kernels(art, start, feeds, cuda32, cpu_p, level)
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
