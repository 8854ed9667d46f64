"""Memory of the per-iteration values the If/Loop/Scan gradients store, against the forward (a script).

A 100-step RNN h_t = tanh(x_t W + h_{t-1} U), written once as a Scan and once as a Loop (trip count
100, weights read from the outer scope, every h_t a scan output). It prints, in bytes:

- the forward's own activations: its outputs (the sequence of h_t and the last h);
- what the gradient graph stores per iteration (the forward node's extra scan outputs: the state
  entering each step), and what storing every float intermediate of the body would take instead
  (the store-everything alternative to recomputing one step in the backward);
- how much the resident memory grows while onnxruntime runs the forward alone and the gradient graph
  (sampled from /proc, arena off, each in a fresh process), and their ratio.

    .venv/bin/python bench/bench_control_memory.py [--steps 100 --batch 64 --hidden 256]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import numpy as np
import onnx
import onnx.parser

import onnxgrad
from onnxgrad.tools.check import gradient_spec

SCAN = """
m (float[{B},{H}] h0, float[{T},{B},{I}] xs, float[{I},{H}] W, float[{H},{H}] U) => (float[{B},{H}] h, float[{T},{B},{H}] ys) {{
    h, ys = Scan (h0, xs) <num_scan_inputs = 1, body = step (float[{B},{H}] hp, float[{B},{I}] x) => (float[{B},{H}] hn, float[{B},{H}] y) {{
        a = MatMul (x, W)
        r = MatMul (hp, U)
        pre = Add (a, r)
        hn = Tanh (pre)
        y = Identity (hn)
    }}>
}}"""
LOOP = """
m (float[{B},{H}] h0, float[{T},{B},{I}] xs, float[{I},{H}] W, float[{H},{H}] U) => (float[{B},{H}] h, float[{T},{B},{H}] ys) {{
    n = Constant <value = int64 {{{T}}}> ()
    t = Constant <value = bool {{1}}> ()
    h, ys = Loop (n, t, h0) <body = step (int64 i, bool c, float[{B},{H}] hp) => (bool co, float[{B},{H}] hn, float[{B},{H}] y) {{
        co = Identity (c)
        x = Gather <axis = 0> (xs, i)
        a = MatMul (x, W)
        r = MatMul (hp, U)
        pre = Add (a, r)
        hn = Tanh (pre)
        y = Identity (hn)
    }}>
}}"""


def _model(text: str, **dims) -> onnx.ModelProto:
    m = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>\n' + text.format(**dims))
    m.ir_version = onnxgrad.ir.load.emitted_ir_version(m)
    return m


def _body_float_bytes(node: onnx.NodeProto, model: onnx.ModelProto, feeds: dict) -> int:
    """Bytes of every float tensor one body step computes (what storing all intermediates would keep)."""
    body = next(a.g for a in node.attribute if a.name == "body")
    inferred = onnx.shape_inference.infer_shapes(model)
    body = next(a.g for n in inferred.graph.node for a in n.attribute if a.name == "body" and n.op_type == node.op_type)
    made = {o for n in body.node for o in n.output}
    total = 0
    for vi in list(body.value_info) + list(body.output):
        tt = vi.type.tensor_type
        if vi.name in made and tt.elem_type == onnx.TensorProto.FLOAT and not vi.name.endswith("_stored"):
            total += 4 * int(np.prod([d.dim_value for d in tt.shape.dim]))
    return total


_RUN = """
import os, sys, threading, time, numpy as np, onnxruntime as ort
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
path, data = sys.argv[1], np.load(sys.argv[2])
feeds = {k: np.ascontiguousarray(data[k]) for k in data.files}
opts = ort.SessionOptions()
opts.enable_cpu_mem_arena = False         # memory returned when freed: the samples see what is live
s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
feeds = {i.name: feeds[i.name] for i in s.get_inputs()}
before, peak, done = rss(), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)
t = threading.Thread(target=sample)
t.start()
out = s.run(None, feeds)
done.append(1)
t.join()
print(max(peak[0], rss()) - before, before)
"""


def _peak_rss(model: onnx.ModelProto, feeds: dict, tmp: str, name: str) -> tuple[int, int]:
    path, data = f"{tmp}/{name}.onnx", f"{tmp}/{name}.npz"
    onnx.save(model, path)
    np.savez(data, **feeds)
    out = subprocess.run([sys.executable, "-c", _RUN, path, data], capture_output=True, text=True, check=True)
    peak, before = map(int, out.stdout.split())
    return peak, before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--input", type=int, default=128)
    args = ap.parse_args()
    dims = dict(T=args.steps, B=args.batch, H=args.hidden, I=args.input)
    rng = np.random.default_rng(0)
    feeds = {"h0": rng.standard_normal((args.batch, args.hidden)).astype(np.float32),
             "xs": rng.standard_normal((args.steps, args.batch, args.input)).astype(np.float32),
             "W": (rng.standard_normal((args.input, args.hidden)) * 0.1).astype(np.float32),
             "U": (rng.standard_normal((args.hidden, args.hidden)) * 0.1).astype(np.float32)}
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, text in (("Scan", SCAN), ("Loop", LOOP)):
            model = _model(text, **dims)
            gm = onnxgrad.grad(model, wrt=["h0", "W", "U", "xs"] if kind == "Scan" else ["h0", "W", "U"],
                               of=["ys"])
            node = next(n for n in gm.graph.node if n.op_type == kind)
            stored_names = [o for o in node.output if o.endswith("_per_iteration")]
            probe = onnx.ModelProto()
            probe.CopyFrom(gm)
            probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in stored_names)
            seeds = {s: np.ones((args.steps, args.batch, args.hidden), np.float32)
                     for s in gradient_spec(gm)["seeds"].values()}
            import onnxruntime as ort

            sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
            run_feeds = {i.name: {**feeds, **seeds}[i.name] for i in sess.get_inputs()}
            values = dict(zip([o.name for o in probe.graph.output], sess.run(None, run_feeds)))
            forward_bytes = sum(values[o.name].nbytes for o in model.graph.output)
            stored = {o: (values[o].shape, str(values[o].dtype), values[o].nbytes) for o in stored_names}
            stored_bytes = sum(v[2] for v in stored.values())
            everything = _body_float_bytes(node, model, feeds) * args.steps
            fwd_peak, base = _peak_rss(model, {k: v for k, v in feeds.items()}, tmp, f"{kind}_fwd")
            grad_peak, _ = _peak_rss(gm, run_feeds, tmp, f"{kind}_grad")
            report[kind] = {
                "forward outputs (bytes)": forward_bytes,
                "stored per iteration (bytes)": stored_bytes,
                "stored tensors": {k: list(v[:2]) for k, v in stored.items()},
                "stored / forward outputs": round(stored_bytes / forward_bytes, 3),
                "store-every-intermediate alternative (bytes)": everything,
                "run's peak RSS growth, forward (MiB)": round(fwd_peak / 2**20, 1),
                "run's peak RSS growth, gradient graph (MiB)": round(grad_peak / 2**20, 1),
                "gradient / forward": round(grad_peak / max(fwd_peak, 1), 2),
            }
    print(json.dumps({"dims": dims, **report}, indent=2))


if __name__ == "__main__":
    main()
