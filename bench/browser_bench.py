"""A training step in the browser and in Node: onnxgrad's JavaScript session against TensorFlow.js training the
same MLP and CNN (same sizes, batch, momentum SGD and softmax cross-entropy), in the same headless Chromium.

- wasm: onnxgrad on onnxruntime-web's wasm bundle (`ort.wasm.min.mjs`) against `@tensorflow/tfjs-backend-wasm`,
  both on one thread (the page is not cross-origin isolated: `ort.env.wasm.numThreads = 1`,
  `tf.wasm.setThreadsCount(1)`).
- webgpu: onnxgrad on both onnxruntime-web WebGPU bundles, the native provider (`ort.webgpu.min.mjs`) and JSEP
  (`ort.all.min.mjs`), against `@tensorflow/tfjs-backend-webgpu`.
- node: onnxgrad's JavaScript session on onnxruntime-node (provider 'cpu') against Python's
  `onnxgrad.TrainingSession` on onnxruntime's CPU provider, the same state file and batches, interleaved.

The ONNX models are built with onnx.helper and turned into artifacts with the CLI as a user would
(`python -m onnxgrad M.onnx --loss-fn cross_entropy --target y --predictions logits --optimizer sgd --lr 0.01
--momentum 0.9 --optimize-for webgpu`; `--optimize-for cpu` for the Node/Python rows). Every step, in every
framework, takes its batch from CPU arrays and brings the loss back to the CPU (onnxgrad's `step` returns it;
TF.js's step here ends with `await loss.data()`). Each configuration runs in a fresh page: warm-up steps, then
the median ms over the timed steps; `--rounds R` repeats every configuration R times, interleaved, and reports
the median of the rounds' medians.

    python bench/browser_bench.py --json bench/results/browser_DATE.json
    python bench/browser_bench.py --models mlp --backends wasm --steps 20

Needs Playwright, Debian's chromium and `cd js && npm ci` (tests/browser_support.missing() says what is absent).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import browser_support as B  # noqa: E402

TFJS = ROOT / "js" / "node_modules" / "@tensorflow"
OPSET = 18
LR, MOMENTUM = 0.01, 0.9
BATCHES = 4                    # distinct batches, cycled
SIZES = {   # the sizes; "tiny" for the smoke test
    "full": {"mlp": {"kind": "mlp", "features": 784, "hidden": 256, "classes": 10, "batch": 64},
             "cnn": {"kind": "cnn", "size": 28, "c1": 16, "c2": 32, "classes": 10, "batch": 32}},
    "tiny": {"mlp": {"kind": "mlp", "features": 16, "hidden": 8, "classes": 4, "batch": 4},
             "cnn": {"kind": "cnn", "size": 8, "c1": 2, "c2": 4, "classes": 4, "batch": 2}},
}
# browser backend -> the onnxgrad runs (label, bundle, provider) and the TF.js backend
BROWSER = {
    "wasm": ([("wasm", B.CONFIGS["wasm"][0], "wasm")], "wasm"),
    "webgpu": ([("webgpu", B.CONFIGS["webgpu"][0], "webgpu"), ("jsep", B.CONFIGS["jsep"][0], "webgpu")], "webgpu"),
}


def missing() -> str | None:
    """What keeps this bench from running here (None: nothing)."""
    why = B.missing()
    if why:
        return why
    for p in ("tfjs-core", "tfjs-layers", "tfjs-backend-wasm", "tfjs-backend-webgpu"):
        if not (TFJS / p / "dist").is_dir():
            return f"no @tensorflow/{p} (cd js && npm ci)"
    return None


def build_model(spec: dict, seed: int = 0) -> onnx.ModelProto:
    """The ONNX model of ``spec``: input ``x``, output ``logits``; the CNN in NCHW with 'same' 3x3 convolutions."""
    rng = np.random.default_rng(seed)
    inits: list = []

    def w(name, *shape, fan_in):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2 / fan_in)).astype(np.float32),
                                             name))
        return name

    def b(name, n):
        inits.append(numpy_helper.from_array(np.zeros(n, np.float32), name))
        return name

    n, k = spec["batch"], spec["classes"]
    nodes = []
    if spec["kind"] == "mlp":
        f, h = spec["features"], spec["hidden"]
        x_shape = [n, f]
        nodes += [helper.make_node("Gemm", ["x", w("fc1.weight", h, f, fan_in=f), b("fc1.bias", h)], ["h1"], transB=1),
                  helper.make_node("Relu", ["h1"], ["r1"]),
                  helper.make_node("Gemm", ["r1", w("fc2.weight", h, h, fan_in=h), b("fc2.bias", h)], ["h2"], transB=1),
                  helper.make_node("Relu", ["h2"], ["r2"]),
                  helper.make_node("Gemm", ["r2", w("fc3.weight", k, h, fan_in=h), b("fc3.bias", k)], ["logits"],
                                   transB=1)]
    else:
        s, c1, c2 = spec["size"], spec["c1"], spec["c2"]
        x_shape = [n, 1, s, s]
        flat = c2 * (s // 4) * (s // 4)
        pads = [1, 1, 1, 1]
        nodes += [
            helper.make_node("Conv", ["x", w("conv1.weight", c1, 1, 3, 3, fan_in=9), b("conv1.bias", c1)], ["a1"],
                             pads=pads),
            helper.make_node("Relu", ["a1"], ["r1"]),
            helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Conv", ["p1", w("conv2.weight", c2, c1, 3, 3, fan_in=9 * c1), b("conv2.bias", c2)],
                             ["a2"], pads=pads),
            helper.make_node("Relu", ["a2"], ["r2"]),
            helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Flatten", ["p2"], ["f"]),
            helper.make_node("Gemm", ["f", w("fc.weight", k, flat, fan_in=flat), b("fc.bias", k)], ["logits"],
                             transB=1)]
    g = helper.make_graph(nodes, spec["kind"], [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [n, k])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])


def cli_args(target: str) -> list[str]:
    return ["--loss-fn", "cross_entropy", "--target", "y", "--predictions", "logits", "--optimizer", "sgd",
            "--lr", str(LR), "--momentum", str(MOMENTUM), "--optimize-for", target]


def write(folder: Path, name: str, spec: dict) -> dict:
    """``name``.onnx, its artifacts for the webgpu target (the browser) and the cpu target (``name``_cpu.*: Node
    and Python), and ``name``.batches.safetensors (tensors "k/x" float32, "k/y" int32); returns the batches."""
    from onnxgrad.tools.cli import main as cli_main

    onnx.save(build_model(spec), folder / f"{name}.onnx")
    for target, stem in (("webgpu", name), ("cpu", f"{name}_cpu")):
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli_main([str(folder / f"{name}.onnx"), *cli_args(target),
                             "-o", str(folder / f"{stem}.train.onnx")]) == 0
    rng = np.random.default_rng(7)
    x_shape = [spec["batch"], spec["features"]] if spec["kind"] == "mlp" else [spec["batch"], 1, spec["size"],
                                                                               spec["size"]]
    batches = [{"x": rng.standard_normal(x_shape).astype(np.float32),
                "y": rng.integers(0, spec["classes"], spec["batch"]).astype(np.int32)} for _ in range(BATCHES)]
    tensors = {f"{k}/{i}": v for k, b in enumerate(batches) for i, v in b.items()}
    save_file(tensors, str(folder / f"{name}.batches.safetensors"))
    save_file(tensors, str(folder / f"{name}_cpu.batches.safetensors"))
    return {"batches": batches}


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} cores"
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "?"


def run_browser(folder: Path, models: dict, backends: list[str], counts: dict, rounds: int) -> tuple:
    """Every (model, backend, framework) configuration, each in a fresh page, ``rounds`` times interleaved."""
    configs = []
    for name, spec in models.items():
        for backend in backends:
            ours, tf_backend = BROWSER[backend]
            for label, bundle, ep in ours:
                configs.append({"model": name, "backend": backend, "framework": "onnxgrad", "variant": label,
                                "cfg": {"framework": "onnxgrad", "bundle": bundle, "ep": ep, "model": name}})
            configs.append({"model": name, "backend": backend, "framework": "tfjs", "variant": f"tfjs-{tf_backend}",
                            "cfg": {"framework": "tfjs", "backend": tf_backend, "model": name, "spec": spec}})
    results: dict[tuple, list] = {}
    with B.served(folder) as base, B.chromium() as browser:
        info = {"chromium": browser.version}
        for r in range(rounds):
            for c in configs:
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                try:
                    page.goto(f"{base}/bench/browser/bench.html")
                    page.wait_for_function("window.ready === true", timeout=60_000)
                    if "adapter" not in info:
                        info["adapter"] = page.evaluate("window.adapter()")
                    out = page.evaluate("cfg => window.bench(cfg)",
                                        {**c["cfg"], "warmup": counts[c["backend"]][0],
                                         "steps": counts[c["backend"]][1],
                                         "spec": {**c["cfg"].get("spec", {}), "lr": LR, "momentum": MOMENTUM}})
                except Exception as e:            # a configuration that fails is reported, not fatal
                    message = str(e).splitlines()[0][:300]
                    out = {"error": f"{type(e).__name__}: {message}", "page_errors": errors}
                    if "not registered for backend" in message:      # a kernel the framework lacks: can't train
                        out["unsupported"] = message.split("Error: ")[-1]
                finally:
                    page.close()
                key = (c["model"], c["backend"], c["variant"])
                results.setdefault(key, []).append(out)
                print(f"  round {r + 1} {key}: " + (f"{out['median']:.2f} ms" if "median" in out else out["error"]),
                      file=sys.stderr)
    return configs, results, info


def run_node(folder: Path, models: dict, warmup: int, steps: int, rounds: int) -> dict:
    """onnxgrad's JS session on onnxruntime-node against Python's TrainingSession, interleaved per round."""
    import onnxruntime as ort
    from safetensors.numpy import load_file

    from onnxgrad import TrainingSession, optim
    from onnxgrad.training import losses

    results: dict[tuple, list] = {}
    script = ROOT / "bench" / "browser" / "node_bench.mjs"
    for name in models:
        stem = f"{name}_cpu"
        raw = load_file(str(folder / f"{stem}.batches.safetensors"))
        batches = [{"x": raw[f"{k}/x"], "y": raw[f"{k}/y"].astype(np.int64)} for k in range(BATCHES)]
        for _ in range(rounds):
            r = subprocess.run(["node", str(script), str(folder), stem, str(warmup), str(steps)], capture_output=True,
                               text=True, timeout=600)
            out = (json.loads(r.stdout) if r.returncode == 0 else
                   {"error": next((x for x in r.stderr.splitlines() if "Error" in x), r.stderr.strip()[-300:])})
            results.setdefault((name, "node", "onnxgrad-node"), []).append(out)
            session = TrainingSession(folder / f"{name}.onnx", loss=losses.CrossEntropyLoss("logits", "y"),
                                      optimizer=optim.SGD(lr=LR, momentum=MOMENTUM),
                                      providers=["CPUExecutionProvider"])
            session.restore(folder / f"{stem}.state.safetensors")
            for k in range(warmup):
                session.step(batches[k % BATCHES])
            ms, lo = [], []
            for k in range(steps):
                t0 = time.perf_counter()
                lo.append(session.step(batches[(warmup + k) % BATCHES]))
                ms.append((time.perf_counter() - t0) * 1e3)
            results.setdefault((name, "node", "python-cpu"), []).append(
                {"ms": ms, "losses": lo, "median": statistics.median(ms), "version": ort.__version__})
            del session
    return results


def summarize(results: dict) -> dict:
    """Per configuration: the median of its rounds' medians (None where a round failed)."""
    out = {}
    for key, rounds in results.items():
        ok = [r["median"] for r in rounds if "median" in r]
        out[key] = statistics.median(ok) if ok and len(ok) == len(rounds) else None
    return out


def table(models: dict, backends: list[str], node: bool, med: dict, results: dict, header: list[str]) -> str:
    lines = [*header, "", "| model | backend | onnxgrad | onnxgrad ms/step | TF.js ms/step | onnxgrad / TF.js |",
             "|---|---|---|---:|---:|---:|"]

    def fmt(v, key=None):
        if v is not None:
            return f"{v:.2f}"
        why = next((r["unsupported"] for r in results.get(key, []) if "unsupported" in r), None)
        return f"cannot train: {why}" if why else "failed"

    for name in models:
        for backend in backends:
            ours, tf_backend = BROWSER[backend]
            tkey = (name, backend, f"tfjs-{tf_backend}")
            theirs = med.get(tkey)
            for label, bundle, _ in ours:
                mine = med.get((name, backend, label))
                ratio = f"{mine / theirs:.2f}" if mine and theirs else "-"
                lines.append(f"| {name} | {backend} | {label} (`{bundle}`) | {fmt(mine, (name, backend, label))} | "
                             f"{fmt(theirs, tkey)} | {ratio} |")
        if node:
            mine, theirs = med.get((name, "node", "onnxgrad-node")), med.get((name, "node", "python-cpu"))
            ratio = f"{mine / theirs:.2f}" if mine and theirs else "-"
            lines.append(f"| {name} | cpu | onnxruntime-node vs Python `TrainingSession` (last column: Python) | "
                         f"{fmt(mine)} | {fmt(theirs)} | {ratio} |")
    errors = [f"- {k}: {r['error']}" for k, rs in results.items() for r in rs if "error" in r and "unsupported" not in r]
    if errors:
        lines += ["", "Failures:", *sorted(set(errors))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--backends", default="wasm,webgpu", help="browser backends: wasm, webgpu (or none)")
    ap.add_argument("--no-node", action="store_true", help="skip the Node / Python rows")
    ap.add_argument("--sizes", choices=sorted(SIZES), default="full")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--webgpu-warmup", type=int, default=2, help="warm-up steps of the webgpu rows")
    ap.add_argument("--webgpu-steps", type=int, default=8, help="timed steps of the webgpu rows (software here)")
    ap.add_argument("--node-steps", type=int, default=100, help="timed steps of the Node and Python rows")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--md", help="write the printed table here too")
    args = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"browser_bench: {why}", file=sys.stderr)
        return 2
    models = {m: SIZES[args.sizes][m] for m in args.models.split(",")}
    backends = [b for b in args.backends.split(",") if b and b != "none"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, spec in models.items():
            write(folder, name, spec)
        counts = {"wasm": (args.warmup, args.steps), "webgpu": (args.webgpu_warmup, args.webgpu_steps)}
        configs, results, info = (run_browser(folder, models, backends, counts, args.rounds)
                                  if backends else ([], {}, {}))
        if not args.no_node:
            results.update(run_node(folder, models, args.warmup, args.node_steps, args.rounds))
    med = summarize(results)
    versions = {k[2]: rs[0].get("version") for k, rs in results.items() if rs and rs[0].get("version")}
    adapter = info.get("adapter", "")
    software = "swiftshader" in adapter.lower()
    header = [
        f"Machine: {machine()}. Chromium {info.get('chromium', '-')} (headless, `--enable-unsafe-webgpu`). "
        f"WebGPU adapter: {adapter or '-'}" + (" (SwiftShader: a software renderer on the CPU, so the webgpu rows "
                                               "measure software, not a GPU)" if software else "") + ".",
        f"Versions: {', '.join(f'{k} {v}' for k, v in sorted(versions.items()))}.",
        f"Sizes '{args.sizes}': " + "; ".join(f"{n} {s}" for n, s in models.items()) + f". SGD lr {LR} momentum "
        f"{MOMENTUM}, softmax cross-entropy. Median ms/step over {args.steps} steps after {args.warmup} warm-up "
        f"steps (webgpu: {args.webgpu_steps} after {args.webgpu_warmup}; Node and Python: {args.node_steps}), "
        f"each configuration in a fresh page, {args.rounds} round(s) (median of the rounds' medians). "
        "Every step uploads its batch from CPU arrays and reads the loss back to the CPU, in both frameworks. "
        "wasm: one thread on both sides (no cross-origin isolation). Node rows: onnxruntime-node and Python's "
        "onnxruntime, each with its default thread count, the cpu-target artifacts and the same state file.",
    ]
    text = table(models, backends, not args.no_node, med, results, header)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": machine(), "info": info, "sizes": args.sizes,
            "models": models, "warmup": args.warmup, "steps": args.steps, "webgpu_warmup": args.webgpu_warmup,
            "webgpu_steps": args.webgpu_steps, "rounds": args.rounds,
            "versions": versions,
            "results": [{"model": k[0], "backend": k[1], "variant": k[2], "median_ms": med[k], "rounds": rs}
                        for k, rs in results.items()],
        }, indent=1) + "\n")
    failed = [k for k, rs in results.items() for r in rs if "error" in r and "unsupported" not in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
