"""Forward vs gradient-graph run time in onnxruntime, for real models.

For each model: the time ``onnxgrad.grad`` takes to build the gradient graph, then the
forward model and the gradient model (forward + backward) run in onnxruntime on the
CPU with 2 intra-op threads, interleaved in one loop after a warm-up; medians of N runs
and their ratio. The models are the PyTorch exports in models/ (with their stored
inputs, seeds and ``wrt``), and three benchmark-size models built here with onnx.helper:

- ``bench_mlp``: 784-512-512-10, ReLU, batch 64;
- ``bench_cnn``: two stages of 3x3 conv + ReLU + 2x2 max-pool (32, 64 channels) on
  3x32x32, then a linear layer to 10 classes, batch 32;
- ``bench_transformer``: one pre-LN decoder block, d_model 256, 4 heads, sequence 128,
  causal softmax attention with explicit MatMuls, MLP 1024 with erf GELU, batch 8.

    /tmp/venv/bin/python bench/bench_models.py                  # everything, N=30
    /tmp/venv/bin/python bench/bench_models.py -n 50 bench_cnn  # some models
    /tmp/venv/bin/python bench/bench_models.py --profile bench_transformer
        # + onnxruntime's per-op profile of the gradient model, backward nodes by op type

A benchmark, not a test: it prints what it measures and asserts nothing about time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.tools.check import gradient_spec

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
OPSET = 17
THREADS = 2


# -- benchmark-size models, built with onnx.helper ---------------------------------------
class _Graph:
    """A small helper to write models: initializers, nodes with fresh output names."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = collections.Counter()

    def param(self, name: str, shape: tuple[int, ...], scale: float | None = None, value=None) -> str:
        if value is None:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            scale = scale if scale is not None else 1.0 / np.sqrt(fan_in)
            value = self.rng.standard_normal(shape) * scale
        self.inits.append(numpy_helper.from_array(np.asarray(value).astype(np.float32), name))
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None, **attrs):
        self.count[op_type] += 1
        base = name or f"{op_type.lower()}{self.count[op_type]}"
        outs = [base] if outputs == 1 else [f"{base}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=base, **attrs))
        return outs[0] if outputs == 1 else outs

    def model(self, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "bench", inputs, outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        m.ir_version = 8
        onnx.checker.check_model(m, full_check=True)
        return m


def bench_mlp(batch: int = 64) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    g = _Graph(1)
    h = "x"
    sizes = [784, 512, 512, 10]
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        h = g.op("Gemm", h, g.param(f"fc{i}.weight", (b, a)), g.param(f"fc{i}.bias", (b,), 0.1), transB=1)
        if i < len(sizes) - 2:
            h = g.op("Relu", h)
    g.nodes[-1].output[0] = "logits"
    m = g.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 784])],
                [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])])
    return m, {"x": g.rng.standard_normal((batch, 784)).astype(np.float32)}


def bench_cnn(batch: int = 32) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    g = _Graph(2)
    h = "x"
    for i, (cin, cout) in enumerate([(3, 32), (32, 64)]):
        h = g.op("Conv", h, g.param(f"conv{i}.weight", (cout, cin, 3, 3)), g.param(f"conv{i}.bias", (cout,), 0.1),
                 kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        h = g.op("Relu", h)
        h = g.op("MaxPool", h, kernel_shape=[2, 2], strides=[2, 2])
    h = g.op("Flatten", h, axis=1)
    g.op("Gemm", h, g.param("fc.weight", (10, 64 * 8 * 8)), g.param("fc.bias", (10,), 0.1), transB=1, name="logits")
    m = g.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 32, 32])],
                [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])])
    return m, {"x": g.rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}


def bench_transformer(batch: int = 8, seq: int = 128, d: int = 256, heads: int = 4,
                      hidden: int = 1024) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x + attn(LN1(x)), then + MLP(LN2(.)): the GPT-2 block, written as exporters write it."""
    g = _Graph(3)
    dh = d // heads
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    ln1 = g.op("LayerNormalization", "x", g.param("ln1.weight", (d,), value=ones(d)),
               g.param("ln1.bias", (d,), value=np.zeros(d)), axis=-1, epsilon=1e-5)
    qkv = g.op("Add", g.op("MatMul", ln1, g.param("attn.qkv.weight", (d, 3 * d), 1 / np.sqrt(d))),
               g.param("attn.qkv.bias", (3 * d,), 0.02))
    q, k, v = g.op("Split", qkv, g.const("split", np.array([d, d, d], np.int64)), outputs=3, axis=-1)
    heads_shape = g.const("heads_shape", np.array([batch, seq, heads, dh], np.int64))
    q = g.op("Transpose", g.op("Reshape", q, heads_shape), perm=[0, 2, 1, 3])
    kt = g.op("Transpose", g.op("Reshape", k, heads_shape), perm=[0, 2, 3, 1])
    v = g.op("Transpose", g.op("Reshape", v, heads_shape), perm=[0, 2, 1, 3])
    scores = g.op("Mul", g.op("MatMul", q, kt), g.const("scale", np.array(1 / np.sqrt(dh), np.float32)))
    causal = g.const("causal", np.tril(np.ones((seq, seq), bool)))
    scores = g.op("Where", causal, scores, g.const("minus_inf", np.array(-np.inf, np.float32)))
    att = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
    att = g.op("Reshape", g.op("Transpose", att, perm=[0, 2, 1, 3]), g.const("model_shape", np.array([batch, seq, d], np.int64)))
    proj = g.op("Add", g.op("MatMul", att, g.param("attn.proj.weight", (d, d), 1 / np.sqrt(d))),
                g.param("attn.proj.bias", (d,), 0.02))
    x1 = g.op("Add", "x", proj)
    ln2 = g.op("LayerNormalization", x1, g.param("ln2.weight", (d,), value=ones(d)),
               g.param("ln2.bias", (d,), value=np.zeros(d)), axis=-1, epsilon=1e-5)
    h = g.op("Add", g.op("MatMul", ln2, g.param("mlp.fc.weight", (d, hidden), 1 / np.sqrt(d))),
             g.param("mlp.fc.bias", (hidden,), 0.02))
    # GELU(h) = 0.5 h (1 + erf(h / sqrt 2))
    erf = g.op("Erf", g.op("Mul", h, g.const("inv_sqrt2", np.array(1 / np.sqrt(2), np.float32))))
    gelu = g.op("Mul", g.op("Mul", h, g.op("Add", erf, g.const("one", np.array(1, np.float32)))),
                g.const("half", np.array(0.5, np.float32)))
    out = g.op("Add", g.op("MatMul", gelu, g.param("mlp.proj.weight", (hidden, d), 1 / np.sqrt(hidden))),
               g.param("mlp.proj.bias", (d,), 0.02))
    g.op("Add", x1, out, name="y")
    m = g.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, d])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, d])])
    return m, {"x": g.rng.standard_normal((batch, seq, d)).astype(np.float32)}


BUILT = {"bench_mlp": bench_mlp, "bench_cnn": bench_cnn, "bench_transformer": bench_transformer}


# -- what to benchmark -------------------------------------------------------------------
def exported(stem: str):
    """A model of models/: the model, its inputs, and grad() arguments as the tests use them."""
    model = onnx.load(str(MODELS / f"{stem}.onnx"))
    with np.load(MODELS / f"{stem}.npz") as z:
        data = {k: z[k] for k in z.files}
    inputs = {k[6:]: v for k, v in data.items() if k.startswith("input/")}
    wrt = [k[5:] for k in data if k.startswith("grad/")]
    if "loss" in data:
        return model, inputs, dict(wrt=wrt, loss=str(data["loss"])), {}
    seeds = {k[5:]: v for k, v in data.items() if k.startswith("seed/")}
    return model, inputs, dict(wrt=wrt, of=list(seeds)), seeds


def built(name: str):
    """A benchmark-size model: gradients of every parameter (and of x for the transformer)."""
    model, inputs = BUILT[name]()
    out = model.graph.output[0]
    shape = [d.dim_value for d in out.type.tensor_type.shape.dim]
    seeds = {out.name: np.random.default_rng(9).standard_normal(shape).astype(np.float32)}
    wrt = [i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT
           and i.name not in ("scale", "minus_inf", "inv_sqrt2", "one", "half")]
    if name == "bench_transformer":
        wrt = ["x"] + wrt
    return model, inputs, dict(wrt=wrt, of=[out.name]), seeds


def all_names() -> list[str]:
    return sorted(p.stem for p in MODELS.glob("*.onnx")) + list(BUILT)


# -- measuring ------------------------------------------------------------------------
def session(model: onnx.ModelProto, profile: str | None = None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    if profile:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def bench(name: str, n: int, warmup: int, profile: bool) -> dict:
    model, inputs, kwargs, seeds = exported(name) if name not in BUILT else built(name)
    t0 = time.perf_counter()
    gm = onnxgrad.grad(model, **kwargs)
    build = time.perf_counter() - t0
    seed_names = gradient_spec(gm)["seeds"]
    gfeeds = dict(inputs)
    gfeeds.update({seed_names[o]: v for o, v in seeds.items()})
    fwd, grd = session(model), session(gm)
    ffeeds = {k: v for k, v in inputs.items() if k in {i.name for i in fwd.get_inputs()}}
    gfeeds = {k: v for k, v in gfeeds.items() if k in {i.name for i in grd.get_inputs()}}
    for _ in range(warmup):
        fwd.run(None, ffeeds)
        grd.run(None, gfeeds)
    tf, tg = [], []
    for _ in range(n):                      # interleaved: both see the same machine state
        t = time.perf_counter()
        fwd.run(None, ffeeds)
        tf.append(time.perf_counter() - t)
        t = time.perf_counter()
        grd.run(None, gfeeds)
        tg.append(time.perf_counter() - t)
    f, g = statistics.median(tf), statistics.median(tg)
    result = {"name": name, "build_s": build, "fwd_ms": 1e3 * f, "grad_ms": 1e3 * g, "ratio": g / f,
              "fwd_nodes": len(model.graph.node), "bwd_nodes": len(gm.graph.node) - len(model.graph.node)}
    if profile:
        result["profile"] = op_profile(gm, gfeeds, len(model.graph.node), n)
    return result


def op_profile(gm: onnx.ModelProto, feeds: dict, n_forward: int, n: int) -> list[tuple[str, str, float, int]]:
    """onnxruntime's per-node times in the gradient model: (part, op type, ms per run, nodes)."""
    forward = {node.name for node in gm.graph.node[:n_forward]}
    with tempfile.TemporaryDirectory() as tmp:
        sess = session(gm, profile=os.path.join(tmp, "prof"))
        for _ in range(3):
            sess.run(None, feeds)
        for _ in range(n):
            sess.run(None, feeds)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    totals: dict[tuple[str, str], float] = collections.defaultdict(float)
    nodes: dict[tuple[str, str], set] = collections.defaultdict(set)
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        node = e["name"][: -len("_kernel_time")]
        key = ("forward" if node in forward else "backward", e["args"].get("op_name", "?"))
        totals[key] += e["dur"] / 1e3 / (n + 3)
        nodes[key].add(node)
    return sorted(((part, op, ms, len(nodes[(part, op)])) for (part, op), ms in totals.items()),
                  key=lambda r: -r[2])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", help=f"default: all ({', '.join(all_names())})")
    ap.add_argument("-n", type=int, default=30, help="timed runs of each model (median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="per-op profile of the gradient models")
    args = ap.parse_args(argv)
    print(f"onnxruntime {ort.__version__}, {THREADS} intra-op threads, median of {args.n} interleaved runs "
          f"after {args.warmup} warm-up runs")
    print(f"{'model':<20} {'fwd nodes':>9} {'bwd nodes':>9} {'build s':>8} {'forward ms':>11} "
          f"{'gradient ms':>12} {'grad/fwd':>9}")
    for name in args.models or all_names():
        try:
            r = bench(name, args.n, args.warmup, args.profile)
        except onnxgrad.OnnxGradError as e:
            print(f"{name:<20} not built: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            continue
        print(f"{name:<20} {r['fwd_nodes']:>9} {r['bwd_nodes']:>9} {r['build_s']:>8.3f} {r['fwd_ms']:>11.3f} "
              f"{r['grad_ms']:>12.3f} {r['ratio']:>9.2f}", flush=True)
        if args.profile:
            for part, op, ms, count in r["profile"][:15]:
                print(f"    {part:<9} {op:<22} {ms:>9.3f} ms/run  ({count} nodes)")


if __name__ == "__main__":
    main(sys.argv[1:])
