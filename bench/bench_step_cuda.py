"""Speed of a training step on CUDA: onnxgrad.TrainingSession on onnxruntime's CUDAExecutionProvider against
PyTorch CUDA eager and ``torch.compile`` (issue 25).

The models are ``bench_step.py``'s builders at the issue's sizes: the MLP at batch 64 and 2048, the CNN at
batch 32, the transformer block at d256/seq128/batch 8 and at d768/12 heads/seq 512/MLP 3072/batch 16, and
ResNet-18 at 3x224x224, batch 64, 1000 classes, trained in train mode (batch statistics). Both frameworks
start from the same weights and batch (the first losses are printed side by side as a check), run with
TF32 off (onnxruntime's ``use_tf32=0``, PyTorch's matmul and cuDNN flags), and are timed interleaved in one
process after warm-up: wall clock around each call with the device synchronised before and after
(``torch.cuda.synchronize``: the whole device, so onnxruntime's streams too); median [min] of ``--reps``.

Per model it prints: the onnxruntime forward (weights as initializers, batch and output bound on the
device), the TrainingSession AdamW step, step/forward, PyTorch eager's step (zero_grad, forward, loss,
backward, AdamW.step; ``torch.backends.cudnn.benchmark`` on, as onnxruntime's exhaustive cuDNN search),
``torch.compile``'s (for the models in ``--compile``: compiling takes a minute per model), the ratios, and
peak device memory. A line under each model splits both steps into the update (step - gradient) and the
forward + backward (``bench_step.gradient_model``: the step's graph without its update, on the device).

Memory: PyTorch's is ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) of its eager step's
build and warm-up. onnxruntime exposes no arena statistics in Python, and nvidia-smi sees the process as a
whole (PyTorch's cache included), so onnxgrad's is the drop of the device's free memory
(``torch.cuda.mem_get_info``) over building the TrainingSession, putting the batch on the device and its
warm-up steps, with PyTorch's cache emptied before: onnxruntime's arena only grows, so the drop is the
most it reserved (rounded up by the arena's power-of-two growth; compare it with PyTorch's reserved), plus
the session's cuDNN/cuBLAS workspaces; a tiny CUDA session primed first keeps the one-off library loads out
of it. The session's own buffers (weights, optimizer state, the batch) are OrtValues from onnxruntime's
process-wide CUDA allocator, an arena that keeps what earlier models freed: the first model's figure is
whole, a later one's can miss up to what the earlier models' buffers took (ResNet-18's: about 0.25 GB), so
the GPU run measures the two large models first.

The batch is given to ``step`` as device OrtValues where the session takes them without reading them back
to host memory (checked at run time: ``OrtValue.__array__``/``numpy`` must not be called on them), else
as numpy arrays (copied from host memory each step), and the row says which.

    source .gpu/b/env.sh && python3 bench/bench_step_cuda.py                  # on the GPU machine
    python3 bench/bench_step_cuda.py --smoke                                   # tiny shapes, CPU: runs anywhere

Without CUDAExecutionProvider (onnxruntime-gpu) and PyTorch with CUDA, the default mode refuses to run.
A benchmark, not a test: it prints times and asserts nothing about them.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step as B  # noqa: E402  (sets the thread environment before numpy and torch are imported)
import numpy as np  # noqa: E402

# the models, and tiny ones of the same builders for --smoke
MODELS: dict[str, Callable[[], B.Bench]] = {
    "mlp_b64": lambda: B.mlp(64),
    "mlp_b2048": lambda: B.mlp(2048),
    "cnn_b32": lambda: B.cnn(32),
    "transformer_d256": lambda: B.transformer(batch=8, seq=128, d=256, heads=4, hidden=1024),
    "transformer_d768": lambda: B.transformer(batch=16, seq=512, d=768, heads=12, hidden=3072),
    "resnet18_224_b64": lambda: B.resnet18(batch=64, size=224, classes=1000),
}
SMOKE_MODELS: dict[str, Callable[[], B.Bench]] = {
    "mlp_b64": lambda: B.mlp(4),
    "mlp_b2048": lambda: B.mlp(16),
    "cnn_b32": lambda: B.cnn(2),
    "transformer_d256": lambda: B.transformer(batch=2, seq=8, d=32, heads=4, hidden=64),
    "transformer_d768": lambda: B.transformer(batch=2, seq=16, d=48, heads=12, hidden=96),
    # 64 pixels, not 32: at 32 the last stage's batch norm sees 2 values per channel and float32 rounding
    # moves the first loss by 1e-4
    "resnet18_224_b64": lambda: B.resnet18(batch=2, size=64, classes=10),
}
COMPILED = ("mlp_b2048", "transformer_d768")     # the torch.compile rows


@dataclass
class Device:
    """Where both frameworks run: onnxruntime's providers, the device tensors live on, how to wait for it."""

    kind: str                                   # "cuda" or "cpu" (--smoke)
    providers: list[Any]
    session_options: Callable[[], Any]
    torch: Any = None                           # the torch module, when importable

    def sync(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> float:
        """ms of one call of ``fn`` with the device idle before and synchronised after."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    def free_bytes(self) -> int | None:
        """The device's free memory (None on the CPU), PyTorch's cache emptied first."""
        if self.kind != "cuda":
            return None
        gc.collect()
        self.torch.cuda.empty_cache()
        self.sync()
        return int(self.torch.cuda.mem_get_info()[0])


@dataclass
class Result:
    label: str
    ms: dict[str, float] = field(default_factory=dict)
    low: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    first_loss: dict[str, float] = field(default_factory=dict)
    memory_mb: dict[str, float] = field(default_factory=dict)
    build_s: float = 0.0
    batch: str = ""
    error: str | None = None


def _refuse(why: str) -> None:
    """One ``error:`` line on stderr and exit status 2, as onnxgrad's command line does."""
    print(f"error: {why}", file=sys.stderr)
    raise SystemExit(2)


def cuda_device(ort_options: dict[str, str]) -> Device:
    """The CUDA device, or exit 2 saying what is missing."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        _refuse(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers: "
                f"{', '.join(ort.get_available_providers())}): install onnxruntime-gpu (on the GPU machine: "
                "source .gpu/b/env.sh), or run --smoke for the CPU check of this script")
    try:
        import torch
    except ImportError:
        _refuse("PyTorch is not importable: it is the baseline, and its device-wide synchronisation times "
                "both frameworks")
    if not torch.cuda.is_available():
        _refuse("torch.cuda.is_available() is False: no GPU the baselines can run on")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def options():
        so = ort.SessionOptions()
        so.log_severity_level = 3
        return so
    return Device("cuda", [("CUDAExecutionProvider", {"use_tf32": "0", **ort_options}), "CPUExecutionProvider"],
                  options, torch)


def cpu_device() -> Device:
    try:
        import torch

        torch.set_num_threads(B.THREADS)
    except ImportError:
        torch = None
    return Device("cpu", ["CPUExecutionProvider"], B.session_options, torch)


def _prime(dev: Device) -> None:
    """One tiny Conv and MatMul on the device: the CUDA libraries' one-off loads happen here, not in the first
    model's memory."""
    if dev.kind != "cuda":
        return
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4, 3, 3])
    y = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
                           helper.make_node("MatMul", ["y", "y"], ["z"])], "prime", [x, w], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", B.OPSET)])
    m.ir_version = 8
    s = ort.InferenceSession(m.SerializeToString(), dev.session_options(), providers=dev.providers)
    s.run(None, {"x": np.ones((1, 4, 8, 8), np.float32), "w": np.ones((4, 4, 3, 3), np.float32)})


@contextlib.contextmanager
def _host_reads(values: list[Any]) -> Iterator[list[int]]:
    """Counts the reads of ``values`` (OrtValues) into host memory (``__array__``, ``numpy``) inside the block."""
    import onnxruntime as ort

    count = [0]
    ids = {id(v) for v in values}
    originals = {name: getattr(ort.OrtValue, name) for name in ("__array__", "numpy")}

    def counting(original):
        def wrapper(self, *args, **kwargs):
            if id(self) in ids:
                count[0] += 1
            return original(self, *args, **kwargs)
        return wrapper
    for name, original in originals.items():
        setattr(ort.OrtValue, name, counting(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(ort.OrtValue, name, original)


def device_batch(ts, feeds: dict[str, np.ndarray], dev: Device) -> tuple[dict[str, Any], str, float, str]:
    """The feeds the step gets, what they are, the first step's loss and a note: device OrtValues when the
    session takes them without reading them back into host memory (onnxgrad with device batches), else numpy."""
    import onnxruntime as ort

    on_device = {k: ort.OrtValue.ortvalue_from_numpy(v, dev.kind, 0) for k, v in feeds.items()}
    try:
        with _host_reads(list(on_device.values())) as reads:
            loss = ts.step(on_device)
    except Exception as e:       # an onnxgrad without device batches refuses them: say so, feed numpy
        why = f"step refused OrtValues ({type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''})"
        loss = ts.step(feeds)
    else:
        if not reads[0]:
            return on_device, "device", loss, "the batch goes to step as device OrtValues"
        why = "step read the OrtValues back into host memory"
    return feeds, "numpy", loss, f"the batch goes to step as numpy, copied from host memory each step: {why}"


def _bound_run(sess, inputs: dict[str, Any], dev: Device) -> Callable[[], Any]:
    """A run of ``sess`` through an IOBinding: the inputs (device OrtValues) bound once, every output bound
    on the device (onnxruntime allocates them per run there)."""
    io = sess.io_binding()
    for name, value in inputs.items():
        io.bind_ortvalue_input(name, value)
    for o in sess.get_outputs():
        io.bind_output(o.name, dev.kind, 0)
    return lambda: sess.run_with_iobinding(io)


def measure(label: str, bench: B.Bench, dev: Device, reps: int, warmup: int, compile: bool) -> Result:
    import onnxruntime as ort

    from onnxgrad import TrainingSession, optim
    from onnxgrad.passes.optimize import target_for

    r = Result(label)
    feeds = {**bench.feeds, **bench.target}
    runs: dict[str, Callable[[], Any]] = {}

    # onnxgrad: build, first step, warm-up; the device memory it took
    def session(train_mode: bool) -> tuple[Any, dict[str, Any], str, float, str]:
        t0 = time.perf_counter()
        ts = TrainingSession(bench.forward, loss=bench.loss, optimizer=optim.AdamW(lr=1e-3), train_mode=train_mode,
                             providers=dev.providers, session_options=dev.session_options())
        r.build_s = time.perf_counter() - t0
        if ts.device != dev.kind:
            raise RuntimeError(f"the TrainingSession runs on {ts.device}, not {dev.kind}")
        return (ts, *device_batch(ts, feeds, dev))

    free0 = dev.free_bytes()
    try:
        ts, batch, r.batch, r.first_loss["onnxgrad"], note = session(train_mode=True)
    except Exception as e:
        if not any(n.op_type == "BatchNormalization" for n in bench.forward.graph.node):
            raise
        # onnxruntime's CUDA batch norm refuses training_mode=1 at opset >= 14: time the frozen-BN step, and say so
        r.notes.append(f"FROZEN BATCH NORM: the train-mode step did not run ({type(e).__name__}: "
                       f"{' '.join(str(e).split())[:160]}); the step is train_mode=False, PyTorch's in train mode")
        gc.collect()
        free0 = dev.free_bytes()
        ts, batch, r.batch, r.first_loss["onnxgrad"], note = session(train_mode=False)
        r.batch += "*"
    r.notes.append(note)
    runs["step"] = lambda: ts.step(batch)
    for _ in range(warmup):
        runs["step"]()
    free1 = dev.free_bytes()
    if free0 is not None and free1 is not None:
        r.memory_mb["onnxgrad"] = (free0 - free1) / 2**20

    # the forward, and the step's graph without its update, batch and outputs on the device
    def device_values(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        return {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), dev.kind, 0) for k, v in arrays.items()}
    fwd = ort.InferenceSession(bench.forward.SerializeToString(), dev.session_options(), providers=dev.providers)
    fwd_inputs = device_values(bench.feeds)
    runs["forward"] = _bound_run(fwd, fwd_inputs, dev)
    try:
        gm, weights = B.gradient_model(bench, target=target_for(dev.providers))
        gsess = ort.InferenceSession(gm.SerializeToString(), dev.session_options(), providers=dev.providers)
        grad_inputs = device_values({**feeds, **weights})
        runs["gradient"] = _bound_run(gsess, grad_inputs, dev)
        runs["gradient"]()
    except Exception as e:
        runs.pop("gradient", None)
        r.notes.append(f"gradient graph: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")

    # PyTorch: eager (its peak memory over build and warm-up), eager without the update, compiled
    torch = dev.torch
    if torch is not None and bench.torch_step is not None:
        if dev.kind == "cuda":
            dev.free_bytes()
            torch.cuda.reset_peak_memory_stats()
        eager = bench.torch_step(bench.weights, device=dev.kind)
        r.first_loss["eager"] = eager()
        for _ in range(warmup):
            eager()
        if dev.kind == "cuda":
            dev.sync()
            r.memory_mb["eager"] = torch.cuda.max_memory_allocated() / 2**20
            r.memory_mb["eager_reserved"] = torch.cuda.max_memory_reserved() / 2**20
        runs["eager"] = eager
        runs["eager_gradient"] = bench.torch_step(bench.weights, update=False, device=dev.kind)
        if compile:
            try:
                t0 = time.perf_counter()
                compiled = bench.torch_step(bench.weights, compile=True, device=dev.kind)
                r.first_loss["compile"] = compiled()
                r.notes.append(f"torch.compile: first step (compiling) {time.perf_counter() - t0:.1f} s")
                runs["compile"] = compiled
            except Exception as e:       # where it does not build: say why, time the rest
                r.notes.append(f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    for name, fn in runs.items():
        if name != "step":
            for _ in range(warmup):
                fn()

    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():       # interleaved: each round times every candidate once
            times[k].append(dev.timed(fn))
    r.ms = {k: float(np.median(v)) for k, v in times.items()}
    r.low = {k: float(np.min(v)) for k, v in times.items()}
    return r


def _cell(r: Result, k: str) -> str:
    return f"{r.ms[k]:.2f} [{r.low[k]:.2f}]" if k in r.ms else "-"


def _ratio(r: Result, a: str, b: str) -> str:
    return f"{r.ms[a] / r.ms[b]:.2f}" if a in r.ms and b in r.ms else "-"


HEADER = (f"{'model':<18} {'build s':>7} {'forward':>15} {'step':>15} {'step/fwd':>8} {'eager step':>15} "
          f"{'compiled step':>15} {'step/eager':>10} {'step/compiled':>13} {'mem MB ours':>11} "
          f"{'mem MB eager':>12} {'batch':>6}")


def print_result(r: Result) -> None:
    if r.error:
        print(f"{r.label:<18} error: {r.error}", flush=True)
        return
    mem = {k: f"{v:.0f}" for k, v in r.memory_mb.items()}
    print(f"{r.label:<18} {r.build_s:>7.1f} {_cell(r, 'forward'):>15} {_cell(r, 'step'):>15} "
          f"{_ratio(r, 'step', 'forward'):>8} {_cell(r, 'eager'):>15} {_cell(r, 'compile'):>15} "
          f"{_ratio(r, 'step', 'eager'):>10} {_ratio(r, 'step', 'compile'):>13} {mem.get('onnxgrad', '-'):>11} "
          f"{mem.get('eager', '-'):>12} {r.batch:>6}", flush=True)
    ms = r.ms
    if "gradient" in ms and "eager_gradient" in ms:
        print(f"    split: the update (step - gradient) ours {ms['step'] - ms['gradient']:.2f} ms, PyTorch's "
              f"{ms['eager'] - ms['eager_gradient']:.2f}; forward + backward ours {_cell(r, 'gradient')}, "
              f"PyTorch's {_cell(r, 'eager_gradient')}: {_ratio(r, 'gradient', 'eager_gradient')}x", flush=True)
    losses = ", ".join(f"{k} {v:.5f}" for k, v in r.first_loss.items())
    print(f"    first loss (same weights and batch): {losses}", flush=True)
    if "eager_reserved" in r.memory_mb:
        print(f"    memory: ours {r.memory_mb['onnxgrad']:.0f} MB (device free-memory drop), PyTorch eager "
              f"{r.memory_mb['eager']:.0f} MB peak allocated ({r.memory_mb['eager_reserved']:.0f} MB reserved)",
              flush=True)
    for note in r.notes:
        print(f"    {note}", flush=True)


def print_markdown(results: list[Result], device_name: str) -> None:
    """The rows as docs/benchmarks.md's GPU table: median [min] ms, ratios of medians, peak memory."""
    print(f"\n| model ({device_name}) | forward ms | onnxgrad step ms | PyTorch eager ms | torch.compile ms | "
          "onnxgrad / eager | step / forward | memory MB, ours / eager (reserved) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r.memory_mb
        memory = (f"{m['onnxgrad']:.0f} / {m['eager']:.0f} ({m['eager_reserved']:.0f})" if "eager_reserved" in m
                  else "-")
        frozen = " (frozen BN)" if r.batch.endswith("*") else ""
        print(f"| {r.label}{frozen} | {_cell(r, 'forward')} | {_cell(r, 'step')} | {_cell(r, 'eager')} | "
              f"{_cell(r, 'compile')} | {_ratio(r, 'step', 'eager')} | {_ratio(r, 'step', 'forward')} | {memory} |",
              flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", metavar="MODEL", help=f"some of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU provider and torch CPU")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds (default 30; --smoke 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; --smoke 1)")
    ap.add_argument("--compile", default=None, metavar="MODELS",
                    help=f"comma-separated models to time torch.compile on, 'all' or 'none' "
                         f"(default {','.join(COMPILED)}; --smoke none)")
    ap.add_argument("--no-cudnn-benchmark", action="store_true",
                    help="PyTorch without torch.backends.cudnn.benchmark (onnxruntime searches cuDNN's algorithms)")
    ap.add_argument("--ort-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a CUDAExecutionProvider option (e.g. cudnn_conv_algo_search=HEURISTIC, prefer_nhwc=1)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no model after this many seconds (the later ones print as skipped)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    table = SMOKE_MODELS if args.smoke else MODELS
    unknown = [m for m in args.models if m not in table]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}: use some of {', '.join(table)}")
    names = args.models or list(table)
    reps = args.reps if args.reps is not None else (3 if args.smoke else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    compile_arg = args.compile if args.compile is not None else ("none" if args.smoke else ",".join(COMPILED))
    compiled = set(table) if compile_arg == "all" else set() if compile_arg == "none" else set(compile_arg.split(","))
    ort_options = dict(o.split("=", 1) for o in args.ort_option)
    dev = cpu_device() if args.smoke else cuda_device(ort_options)

    import onnxruntime as ort

    versions = f"onnxruntime {ort.__version__}"
    if dev.torch is not None:
        versions += f", torch {dev.torch.__version__}"
        if dev.kind == "cuda":
            dev.torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
            versions += (f" on {dev.torch.cuda.get_device_name()}, TF32 off on both, cudnn.benchmark "
                         f"{'off' if args.no_cudnn_benchmark else 'on'}; onnxruntime CUDA options "
                         f"{dev.providers[0][1]}")
    device_name = dev.torch.cuda.get_device_name() if dev.kind == "cuda" else "CPU (smoke)"
    print(f"{'SMOKE (tiny shapes, CPU): ' if args.smoke else ''}{versions}; median [min] of {reps} interleaved, "
          f"device-synchronised runs after {warmup} warm-up, in ms", flush=True)
    print(HEADER, flush=True)
    _prime(dev)
    start = time.perf_counter()
    results = []
    for name in names:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"{name:<18} skipped: the time budget of {args.budget_s:.0f} s is spent", flush=True)
            continue
        try:
            r = measure(name, table[name](), dev, reps, warmup, name in compiled and dev.torch is not None)
        except Exception as e:       # one model's failure (a kernel onnxruntime refuses) must not end the run
            r = Result(name, error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        print_result(r)
        results.append(r)
        gc.collect()
        if dev.kind == "cuda":
            dev.torch.cuda.empty_cache()
    print(f"done: {sum(r.error is None for r in results)} of {len(names)} models measured in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    print_markdown([r for r in results if r.error is None], device_name)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
