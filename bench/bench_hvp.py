"""Hessian-vector products: forward over reverse (onnxgrad.passes.funcs.hvp = jvp(grad)) against reverse over
reverse (grad(grad)), on models/mlp_dynamo.onnx and models/gpt_dynamo.onnx with an MSE loss appended.

Prints, per model: graph sizes, onnxruntime run time (median of repeats, 2 threads) and the peak
memory a run adds (max RSS of a fresh process after the runs minus its RSS once the session is
built), and the ratios reverse-over-reverse / forward-over-reverse. Asserts nothing.

    python bench/bench_hvp.py [--repeats 200]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mlp_dynamo": "y", "gpt_dynamo": "logits"}


def _build(stem: str, out_dir: Path) -> dict:
    import onnx

    import onnxgrad
    from onnxgrad import losses
    from onnxgrad.passes.forward import tangent_spec
    from onnxgrad.passes.funcs import hvp
    from onnxgrad.tools.check import gradient_spec

    with np.load(ROOT / "models" / f"{stem}.npz") as z:
        inputs = {k[6:]: z[k] for k in z.files if k.startswith("input/")}
        outputs = {k[7:]: z[k] for k in z.files if k.startswith("output/")}
    m = losses.mse_loss(str(ROOT / "models" / f"{stem}.onnx"), output=MODELS[stem], target="t")
    wrt = [i.name for i in m.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) >= 1
           and i.name in set(onnxgrad.parameters(m, loss="loss").trainable)]
    rng = np.random.default_rng(0)
    feeds = dict(inputs, t=rng.standard_normal(outputs[MODELS[stem]].shape).astype(np.float32))
    sizes = {i.name: tuple(i.dims) for i in m.graph.initializer}
    v = {w: rng.standard_normal(sizes[w]).astype(np.float32) for w in wrt}

    t0 = time.perf_counter()
    fr = hvp(m, wrt, loss="loss")
    t_fr = time.perf_counter() - t0
    fr_feeds = dict(feeds, **{tangent_spec(fr)["tangent_inputs"][w]: v[w] for w in wrt})
    t0 = time.perf_counter()
    gm = onnxgrad.grad(m, wrt=wrt, loss="loss")
    grads = gradient_spec(gm)["gradients"]
    rr = onnxgrad.grad(gm, wrt=wrt, of=[grads[w] for w in wrt])
    t_rr = time.perf_counter() - t0
    seeds = gradient_spec(rr)["seeds"]
    rr_feeds = dict(feeds, **{seeds[grads[w]]: v[w] for w in wrt})
    cases = {}
    for name, model, f, build_s in (("fwd-over-rev", fr, fr_feeds, t_fr), ("rev-over-rev", rr, rr_feeds, t_rr)):
        path = out_dir / f"{stem}.{name}.onnx"
        onnx.save(model, path)
        np.savez(out_dir / f"{stem}.{name}.npz", **f)
        cases[name] = {"path": str(path), "nodes": len(model.graph.node), "build_s": build_s, "wrt": len(wrt)}
    return cases


def _measure(path: str, repeats: int) -> dict:
    """In a fresh process: median run time and the peak RSS the runs add to the built session."""
    code = f"""
import json, resource, time, numpy as np, onnxruntime as ort
def rss_kb():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1])
o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.log_severity_level = 3
s = ort.InferenceSession({path!r}, o, providers=['CPUExecutionProvider'])
with np.load({path[:-5] + '.npz'!r}) as z:
    feeds = {{k: z[k] for k in z.files if k in {{i.name for i in s.get_inputs()}}}}
before = rss_kb()
s.run(None, feeds)
times = []
for _ in range({repeats}):
    t = time.perf_counter(); s.run(None, feeds); times.append(time.perf_counter() - t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"ms": 1000 * float(np.median(times)), "peak_kb": peak - before}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        for stem in MODELS:
            cases = _build(stem, Path(tmp))
            res = {k: {**c, **_measure(c["path"], args.repeats)} for k, c in cases.items()}
            fr, rr = res["fwd-over-rev"], res["rev-over-rev"]
            print(f"{stem} ({fr['wrt']} parameter tensors):")
            for k, r in res.items():
                print(f"  {k:13s} nodes {r['nodes']:5d}   build {r['build_s']:.3f} s   run {r['ms']:.3f} ms   "
                      f"peak +{r['peak_kb'] / 1024:.1f} MiB")
            print(f"  ratio rev-over-rev / fwd-over-rev: nodes {rr['nodes'] / fr['nodes']:.2f}   "
                  f"run time {rr['ms'] / fr['ms']:.2f}   peak memory "
                  f"{rr['peak_kb'] / max(fr['peak_kb'], 1):.2f}")


if __name__ == "__main__":
    main()
