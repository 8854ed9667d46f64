"""Is training on onnxruntime's CUDA provider right? One script to run on the GPU machine (issue 24).

For bench_step.py's MLP, CNN and transformer and its ResNet-18 (BatchNormalization trained in train mode)
it prints, per model:

- ``verdict``: wrong finiteness verdicts over ``--sessions`` fresh processes (each builds a session and
  runs ``--steps`` good steps and one NaN batch; half of them with torch imported first, a third with
  onnxruntime's profiling on, half with ``on_nonfinite="skip"``), the NaN batches refused, and the processes
  whose weights the NaN batch left unchanged;
- ``agree``: after 5 steps of SGD with momentum, the largest relative difference of the losses, parameters
  and running statistics between the CUDA session and the CPU session, and between the CUDA session and
  PyTorch (the model's bench_step reference, its tensors on the GPU, its optimizer torch.optim.SGD). Not
  AdamW: its first step is ``lr * sign(gradient)``, which turns rounding-level differences of near-zero
  gradients into differences of 2 lr, so its parameters cannot be compared element by element (the
  trajectory tests compare AdamW with PyTorch on the CPU);
- ``device batch``: the step's loss with the batch handed over as a torch CUDA tensor (DLPack) against the
  host batch's, and how many ``MemcpyFromHost`` of a tensor of the batch's shape onnxruntime's profile holds
  for the host batch and for the device batch (the device batch must have none).

It exits with 1 if any check fails (a wrong verdict, a NaN step applied, an agreement beyond 1e-4 relative
for losses, 1e-3 of each tensor's largest value + 1e-5 for parameters and statistics, a copy of the device
batch). ``--smoke``: tiny models on the
CPU provider, 2 processes per model, the "device" session built for the CUDA target (its BatchNormalization
in train mode as standard ops) and run by the CPU provider: the script's own check, on any machine (about
3 minutes on 2 shared cores).

    bash ../shared/gpu/prepare.sh          # here, once: onnxruntime-gpu 1.31.1 in .gpu/a and .gpu/b
    # on the GPU machine (../shared/gpu/README.md): a first call carrying .gpu/a runs bash .gpu/a/install.sh,
    # the next, carrying .gpu/b, this script and then the CUDA tests five times (pytest: the machine's, or a
    # wheel carried beside .gpu/b):
    source .gpu/b/env.sh && python3 bench/gpu_correctness.py 2>&1 | tee $OUT/gpu_correctness.log &&
        for i in 1 2 3 4 5; do python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py; done | tee -a $OUT/gpu_correctness.log
    python bench/gpu_correctness.py --smoke

Expected on an H200 (not measured yet): the verdict processes dominate, about 200 fresh processes 8 at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import bench_step as B  # noqa: E402

# ResNet-18 at 64x64: BatchNormalization over 2x2 positions in its last stage (at 32x32, over one position
# per image: its statistics of 2 values made 5 steps chaotic)
SMOKE_SIZES = {"mlp": dict(batch=8), "cnn": dict(batch=4),
               "transformer": dict(batch=1, seq=16, d=32, heads=2, hidden=64),
               "resnet18": dict(batch=4, size=64, classes=100)}
AGREE_STEPS, AGREE_LR, AGREE_MOMENTUM = 5, 1e-3, 0.9
LOSS_RTOL, TENSOR_RTOL, TENSOR_ATOL = 1e-4, 1e-3, 1e-5


def build(name: str, smoke: bool) -> B.Bench:
    return B.MODELS[name](**(SMOKE_SIZES[name] if smoke else {}))


def providers(smoke: bool) -> list[str]:
    return ["CPUExecutionProvider"] if smoke else ["CUDAExecutionProvider", "CPUExecutionProvider"]


def session(bench: B.Bench, provider_list: list[str], optimizer=None, **kw):
    from onnxgrad import TrainingSession, optim

    return TrainingSession(bench.forward, loss=bench.loss, optimizer=optimizer or optim.AdamW(lr=1e-3),
                           providers=provider_list, **kw)


@contextmanager
def target(name: str | None):
    """Sessions built in this block rewrite their graphs for ``name`` whatever their provider (None: theirs)."""
    import onnxgrad.training.session as T

    chosen = T.target_for
    if name is not None:
        T.target_for = lambda providers: name
    try:
        yield
    finally:
        T.target_for = chosen


def agree_optimizer():
    from onnxgrad import optim

    return optim.SGD(lr=AGREE_LR, momentum=AGREE_MOMENTUM)


def poisoned(bench: B.Bench) -> dict[str, np.ndarray]:
    feeds = {k: v.copy() for k, v in bench.feeds.items()}
    first = next(k for k, v in feeds.items() if v.dtype.kind == "f")
    feeds[first].reshape(-1)[0] = np.nan
    return {**feeds, **bench.target}


# -- one fresh process: the verdict --------------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    """Build a session, run good steps and one NaN batch, print what the verdicts were (JSON)."""
    if args.with_torch:
        import torch  # noqa: F401   (the verdict must not depend on what the process loaded before)
    import onnxruntime as ort

    from onnxgrad.training.session import NonFiniteError, StepReadbackError

    bench = build(args.child, args.smoke)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if args.profile:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tempfile.gettempdir(), f"gpu_correctness_{os.getpid()}")
    s = session(bench, providers(args.smoke), on_nonfinite=args.mode, session_options=options)
    feeds = {**bench.feeds, **bench.target}
    wrong = readback = 0
    for _ in range(args.steps):
        try:
            s.step(feeds)
        except NonFiniteError:
            wrong += 1
        except StepReadbackError:
            readback += 1
    before = s.parameters()
    refused = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            s.step(poisoned(bench))
            refused = s.skipped_steps == 1
        except NonFiniteError:
            refused = True
        except StepReadbackError:
            readback += 1
    unchanged = all(np.array_equal(v, before[n]) for n, v in s.parameters().items())
    if args.profile:
        os.remove(s._train.end_profiling())
    print(json.dumps({"wrong": wrong + (not refused), "readback": readback, "refused": refused,
                      "unchanged": unchanged, "device": s.device}))


def verdicts(name: str, args: argparse.Namespace) -> tuple[dict, bool]:
    """Run ``args.sessions`` fresh processes of ``name`` (``args.jobs`` at once) and sum what they found."""
    def run(k: int) -> dict:
        cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps),
               "--mode", ("raise", "skip")[k // 2 % 2]] + ["--with-torch"] * (k % 2) + ["--profile"] * (k % 3 == 0) \
            + ["--smoke"] * args.smoke
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
        return json.loads(r.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, range(args.sessions)))
    errors = [r["error"] for r in results if "error" in r]
    done = [r for r in results if "error" not in r]
    summary = {"sessions": len(results), "failed to run": len(errors),
               "wrong verdicts": sum(r["wrong"] for r in done), "readback errors": sum(r["readback"] for r in done),
               "NaN refused": sum(r["refused"] for r in done), "weights unchanged": sum(r["unchanged"] for r in done),
               "devices": sorted({r["device"] for r in done})}
    ok = (not errors and summary["wrong verdicts"] == 0 and summary["readback errors"] == 0
          and summary["NaN refused"] == summary["weights unchanged"] == len(results))
    if errors:
        summary["first error"] = errors[0]
    return summary, ok


# -- agreement: CUDA session, CPU session, PyTorch ---------------------------------------------------------------
def torch_run(bench: B.Bench, device: str) -> tuple[list[float], dict[str, np.ndarray]] | None:
    """PyTorch's SGD steps of the model's bench_step reference with its tensors on ``device``: the losses,
    then the parameters and running statistics. The reference builds every tensor with ``torch.from_numpy``
    (parameters in the weights' order, then the running statistics, then the batch): moved to ``device``
    here and recorded, which names the running statistics; its optimizer is replaced by torch.optim.SGD."""
    try:
        import torch
    except ImportError:
        return None
    made: list = []
    seen: dict = {}
    original_from_numpy, original_adamw = torch.from_numpy, B._torch_adamw

    def from_numpy(a):
        t = original_from_numpy(a).to(device)
        made.append(t)
        return t

    def sgd(params, loss_fn, compile=False, update=True):
        seen.update(params)
        opt = torch.optim.SGD(params.values(), lr=AGREE_LR, momentum=AGREE_MOMENTUM)

        def step() -> float:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn()
            loss.backward()
            opt.step()
            return float(loss.detach())
        return step

    torch.from_numpy, B._torch_adamw = from_numpy, sgd
    try:
        step = bench.torch_step(bench.weights)
        losses = [step() for _ in range(AGREE_STEPS)]
    finally:
        torch.from_numpy, B._torch_adamw = original_from_numpy, original_adamw
    held = {k: v.detach().cpu().numpy() for k, v in seen.items()}
    running = [k for k in bench.weights if "running" in k]
    for k, t in zip(running, made[len(seen):len(seen) + len(running)]):
        held[k] = t.cpu().numpy()
    return losses, held


def worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, str, bool]:
    """The largest difference over the tensors both hold, relative to each tensor's largest value, its tensor,
    and whether every tensor is within TENSOR_RTOL of its largest value plus TENSOR_ATOL (a tensor of small
    values, a late BatchNormalization's bias after 5 steps, differs at float32's rounding of its gradient)."""
    diff = {k: float(np.abs(a[k] - b[k]).max()) for k in b if k in a}
    scale = {k: float(np.abs(b[k]).max()) for k in diff}
    errors = {k: diff[k] / max(scale[k], 1e-12) for k in diff}
    name = max(errors, key=errors.get)
    return errors[name], name, all(diff[k] <= TENSOR_RTOL * scale[k] + TENSOR_ATOL for k in diff)


def agreement(name: str, args: argparse.Namespace) -> tuple[dict, bool]:
    bench = build(name, args.smoke)
    feeds = {**bench.feeds, **bench.target}
    runs = {}
    for label, provider_list in (("device", providers(args.smoke)), ("cpu", ["CPUExecutionProvider"])):
        with target("cuda" if label == "device" else None):
            s = session(bench, provider_list, agree_optimizer())
        losses = [s.step(feeds) for _ in range(AGREE_STEPS)]
        runs[label] = (losses, {**s.parameters(), **s.buffers()}, s.device)
    reference = torch_run(bench, "cpu" if args.smoke else "cuda")
    out = {"device": runs["device"][2]}
    ok = True
    against = [("cpu session", runs["cpu"][:2])] + ([("pytorch", reference)] if reference else [])
    for label, (losses, held) in against:
        loss_err = float(np.max(np.abs(np.subtract(runs["device"][0], losses)) / np.maximum(np.abs(losses), 1e-12)))
        tensor_err, where, within = worst(runs["device"][1], held)
        out[label] = f"loss {loss_err:.1e}, tensors {tensor_err:.1e} ({where})"
        ok &= loss_err <= LOSS_RTOL and within
    if reference is None:
        out["pytorch"] = "torch not importable: not compared"
    return out, ok


# -- a batch already on the device ---------------------------------------------------------------------------------
def device_batch(name: str, args: argparse.Namespace) -> tuple[dict, bool]:
    """The step with the batch as a torch tensor on the device (an OrtValue where torch is missing) against
    the host batch, and the MemcpyFromHost of a tensor of the batch's shape in each one's profile."""
    import onnxruntime as ort

    bench = build(name, args.smoke)
    device = "cpu" if args.smoke else "cuda"
    try:
        import torch

        def hand_over(v: np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(v)).to(device)
        how = f"torch {device} tensor"
    except ImportError:
        def hand_over(v: np.ndarray):
            return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), device, 0)
        how = f"OrtValue on {device}"
    shapes = [list(v.shape) for v in bench.feeds.values()]
    result, copies = {}, {}
    for label in ("host", "device"):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tempfile.gettempdir(), f"gpu_correctness_{label}_{os.getpid()}")
        s = session(bench, providers(args.smoke), session_options=options)
        feeds = {**bench.feeds, **bench.target}
        if label == "device":
            feeds = {k: hand_over(v) for k, v in feeds.items()}
        result[label] = [s.step(feeds) for _ in range(3)]
        path = s._train.end_profiling()
        events = json.loads(Path(path).read_text())
        os.remove(path)
        copies[label] = sum(1 for e in events if e.get("args", {}).get("op_name") == "MemcpyFromHost"
                            and any(list(d.values())[0] in shapes for d in e["args"].get("input_type_shape", [])))
    rel = float(np.max(np.abs(np.subtract(result["device"], result["host"])) / np.abs(result["host"])))
    out = {"as": how, "loss vs host batch": f"{rel:.1e}",
           "MemcpyFromHost of the batch": f"host batch {copies['host']}, device batch {copies['device']}"}
    return out, rel <= LOSS_RTOL and copies["device"] == 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=list(B.MODELS), help=f"of {', '.join(B.MODELS)} (default: all)")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU provider, 2 processes per model")
    p.add_argument("--sessions", type=int, default=None, help="fresh processes per model (default 50; smoke 2)")
    p.add_argument("--resnet-sessions", type=int, default=None, help="for resnet18 (default 24; smoke 2)")
    p.add_argument("--steps", type=int, default=3, help="good steps per process before the NaN batch")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="processes at once")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="raise", help=argparse.SUPPRESS)
    p.add_argument("--with-torch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, providers {ort.get_available_providers()}; "
          f"{'smoke: tiny models, CPU provider' if args.smoke else 'CUDA provider'}", flush=True)
    if not args.smoke and "CUDAExecutionProvider" not in ort.get_available_providers():
        print("no CUDAExecutionProvider in this onnxruntime: install onnxruntime-gpu, or pass --smoke")
        return 1
    all_ok = True
    for name in args.models:
        start = time.perf_counter()
        if args.smoke:
            args.sessions_now = args.sessions or 2
        else:
            args.sessions_now = (args.resnet_sessions or 24) if name == "resnet18" else (args.sessions or 50)
        print(f"== {name}", flush=True)
        for label, check in (("verdict", verdicts), ("agree", agreement), ("device batch", device_batch)):
            if check is verdicts:
                args_ = argparse.Namespace(**{**vars(args), "sessions": args.sessions_now})
                found, ok = check(name, args_)
            else:
                found, ok = check(name, args)
            all_ok &= ok
            print(f"  {label:13s} {'ok  ' if ok else 'FAIL'} {json.dumps(found)}", flush=True)
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    print("all checks passed" if all_ok else "SOME CHECKS FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
