"""Candidate forms of the convolution and pooling gradients on onnxruntime's CUDAExecutionProvider, per shape
(issue 25), and where one ResNet-18 training step spends its time there.

For every convolution of ResNet-18 at 3x224x224, batch 64 (and its max-pool, and bench_step.py's CNN
pool), a one-node forward model is differentiated by ``onnxgrad.grad`` for one input at a time, the graph
cut down to that gradient alone (the forward Conv, which it does not need, dropped: MaxPool's stays, its
Indices are read), and each candidate form of it is built:

- input gradient: the canonical ``ConvTranspose``; the CPU rewrites ``conv_input_grad_flipped`` (a Conv
  with the transposed, reversed kernel, stride 1) and ``conv_input_grad_col2im`` (one Gemm and Col2Im);
  and two forms of a strided Conv's, defined here: ``dilated_flipped`` (dy with stride - 1 zeros between its
  elements, then that Conv) and ``phase_convs`` (one stride-1 Conv whose output channels are dx's s x s
  phases, interleaved by DepthToSpace: no products with inserted zeros);
- weight gradient: the canonical swapped-role Conv; the CPU rewrite ``conv_weight_grad_patches`` (one-hot
  Conv patches and a Gemm);
- max-pool gradient: the canonical scatter at the forward's Indices; the CPU rewrite ``max_pool_taps``.

A CPU rewrite whose check declines (its thresholds were measured on the CPU) is forced past it, the row says
why it declined; the forms defined here decline only where they cannot compute dx. On CUDA, a form with a
node the CUDA provider has no kernel for (Col2Im) is reported and not timed. Every candidate's
output is checked against the canonical one on the device (max |difference| / max |canonical|, TF32 off)
before it is timed; one that differs is reported and not timed. Inputs and outputs are bound on the
device; each run is timed by wall clock with the device synchronised before and after; median [min] of
``--reps``, interleaved, and the ratio to the canonical form. The forms defined here are candidates to
measure, not library rewrites: one that wins moves to ``onnxgrad/optimize`` with an equivalence test.

``--profile`` adds onnxruntime's per-op-type profile of ResNet-18's TrainingSession step (after warm-up
runs, which the profile's first runs are dropped for). On CUDA the nodes are launched asynchronously: a
node's time there is its launch, and the waits for the device land on whichever node synchronises
(memory copies to the host, the update's If): read it with care. Beside it, the GPU kernels of the same
steps as CUPTI sees them (``torch.profiler``, which records every kernel of the process, onnxruntime's
too), by kernel name.

    source .gpu/b/env.sh && python3 bench/bench_rewrites_cuda.py --profile       # on the GPU machine
    python3 bench/bench_rewrites_cuda.py --smoke --profile                        # tiny shapes, CPU

A benchmark, not a test: it prints and asserts nothing about times.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_rewrites as R  # noqa: E402
import bench_step as B  # noqa: E402  (sets the thread environment before numpy and torch are imported)
import bench_step_cuda as C  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402

from onnxgrad.ir import graph as G  # noqa: E402
from onnxgrad.ir.builder import Builder, Var  # noqa: E402
from onnxgrad.passes.optimize import REWRITES  # noqa: E402
from onnxgrad.passes.optimize.rewriter import GraphView, Match, Rewrite, apply  # noqa: E402


# -- a candidate defined here: the strided input gradient as a Conv over zero-dilated dy ----------------
def _dilated_pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """The canonical input gradient of a strided Conv: a ConvTranspose, group 1, explicit pads, output
    padding (the rows the forward's windows skipped) allowed: dx's static shape says what it adds."""
    strides = view.attr(node, "strides")
    if not strides or all(s == 1 for s in strides) or len(node.input) != 2 or view.attr(node, "group", 1) != 1:
        return None
    if view.attr(node, "auto_pad", "NOTSET") != "NOTSET":
        return None
    return Match(node, [node.output[0]], dict(dy=node.input[0], w=node.input[1]))


def _dilated_check(view: GraphView, m: Match) -> str | None:
    ws, ys, xs = view.shape(m.w), view.shape(m.dy), view.shape(m.outputs[0])
    if ws is None or ys is None or xs is None:
        return "w, dy and dx need static shapes"
    rank = len(ws) - 2
    if any(d != 1 for d in view.attr(m.root, "dilations", [1] * rank)):
        return "a dilated convolution"
    if any(k - 1 - p < 0 for k, p in zip(ws[2:], view.attr(m.root, "pads", [0] * (2 * rank))[:rank])):
        return "pads larger than the kernel"
    return None


def _dilated_replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """ConvTranspose(dy, w, strides s, pads p) = Conv(dy with s - 1 zeros after each element, w^T reversed
    along every spatial axis, pads k - 1 - p before and what gives dx's size after). The zeros: dy as
    [N, M, o1, 1, o2, 1, ...] padded to [N, M, o1, s1, o2, s2, ...], flattened to [N, M, o1 s1, o2 s2, ...]."""
    (out_ch, c, *kernel), (n, _, *o), (_, _, *image) = view.shape(m.w), view.shape(m.dy), view.shape(m.outputs[0])
    rank, taps = len(kernel), int(np.prod(kernel))
    strides = view.attr(m.root, "strides")
    begin = view.attr(m.root, "pads", [0] * (2 * rank))[:rank]
    spread = [d for oi in o for d in (oi, 1)]
    dilated = b.op.Pad(b.op.Reshape(b.var(m.dy), b.ints([n, out_ch, *spread])),
                       b.ints([0] * (2 + 2 * rank) + [0, 0] + [d for s in strides for d in (0, s - 1)]))
    length = [oi * s for oi, s in zip(o, strides)]
    dilated = b.op.Reshape(dilated, b.ints([n, out_ch, *length]))
    before = [k - 1 - p for k, p in zip(kernel, begin)]
    after = [x + k - 1 - lo - ln for x, k, lo, ln in zip(image, kernel, before, length)]
    if any(a < 0 for a in after):        # more trailing zeros than the Conv reads: cut them
        keep = [ln + min(a, 0) for ln, a in zip(length, after)]
        dilated = b.op.Slice(dilated, b.ints([0] * rank), b.ints(keep), b.ints(list(range(2, 2 + rank))))
        after = [max(a, 0) for a in after]
    swapped = b.op.Transpose(b.var(m.w), perm=[1, 0, *range(2, 2 + rank)])
    exchange = b.const(np.eye(taps)[::-1], b.var(m.w).dtype)
    flipped = b.op.Reshape(b.op.MatMul(b.op.Reshape(swapped, b.ints([c * out_ch, taps])), exchange),
                           b.ints([c, out_ch, *kernel]))
    return [b.op.Conv(dilated, flipped, pads=before + after)]


DILATED_FLIPPED = Rewrite(
    "dilated_flipped", "ConvTranspose", _dilated_pattern, _dilated_check, _dilated_replacement,
    "a strided Conv's input gradient as a Conv over zero-dilated dy with the transposed, reversed kernel")


# -- a candidate defined here: the strided input gradient as one stride-1 Conv per output phase -----------
def _phase_check(view: GraphView, m: Match) -> str | None:
    why = _dilated_check(view, m)
    if why is None and len(view.shape(m.w)) != 4:
        return "DepthToSpace interleaves two spatial axes: a 2-D convolution only"
    if why is None and len(set(view.attr(m.root, "strides"))) != 1:
        return "DepthToSpace takes one block size: the same stride along both axes only"
    return why


def _phase_taps(k: int, s: int, p: int) -> tuple[int, np.ndarray]:
    """Along one axis: the phase kernels' size U and which tap each uses, ``taps[t, a, u]`` = 1 where phase a's
    kernel at u is w's tap t. dx[s j + a] = sum_q dy[j - q] w[s q + a + p] over the q with 0 <= s q + a + p < k;
    as a correlation over dy padded by q_max before, u = q_max - q."""
    q_max, q_min = (k - 1 - p) // s, -((s - 1 + p) // s)
    size = q_max - q_min + 1
    taps = np.zeros((k, s, size))
    for a in range(s):
        for u in range(size):
            t = s * (q_max - u) + a + p
            if 0 <= t < k:
                taps[t, a, u] = 1.0
    return size, taps


def _phase_replacement(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """ConvTranspose(dy, w, strides s, pads p) = DepthToSpace(Conv(dy, phases)): each of the s x s phases of
    dx (its rows and columns = a mod s) is a stride-1 correlation of dy with the taps of w that reach it; the
    phases' kernels are one Conv's output channels (C s^2, taps gathered from w by one MatMul with a constant
    0/1 matrix), DepthToSpace (CRD) interleaves them, and a Slice cuts dx's size. No zeros are multiplied
    but the phases' padding to one kernel size (3x3/2: 2x2 per phase, 16 products where ConvTranspose has 9)."""
    (out_ch, c, *kernel), (_, _, *o), (_, _, *image) = view.shape(m.w), view.shape(m.dy), view.shape(m.outputs[0])
    s, pads = view.attr(m.root, "strides")[0], view.attr(m.root, "pads", [0, 0, 0, 0])[:2]
    (u1, t1), (u2, t2) = (_phase_taps(k, s, p) for k, p in zip(kernel, pads))
    select = np.einsum("iau,jbv->ijabuv", t1, t2).reshape(kernel[0] * kernel[1], s * s * u1 * u2)
    phases = b.op.MatMul(b.op.Reshape(b.var(m.w), b.ints([out_ch * c, kernel[0] * kernel[1]])),
                         b.const(select, b.var(m.w).dtype))                               # [M C, s s U1 U2]
    phases = b.op.Transpose(b.op.Reshape(phases, b.ints([out_ch, c, s, s, u1, u2])), perm=[1, 2, 3, 0, 4, 5])
    phases = b.op.Reshape(phases, b.ints([c * s * s, out_ch, u1, u2]))
    before = [(k - 1 - p) // s for k, p in zip(kernel, pads)]
    rows = [-(-x // s) for x in image]                                                      # ceil(x / s)
    after = [max(0, r - y - lo + u - 1) for r, y, lo, u in zip(rows, o, before, (u1, u2))]
    out = b.op.Conv(b.var(m.dy), phases, pads=before + after)
    out = b.op.DepthToSpace(b.op.Slice(out, b.ints([0, 0]), b.ints(rows), b.ints([2, 3])), blocksize=s, mode="CRD")
    if any(r * s != x for r, x in zip(rows, image)):
        out = b.op.Slice(out, b.ints([0, 0]), b.ints(image), b.ints([2, 3]))
    return [out]


PHASES = Rewrite(
    "phase_convs", "ConvTranspose", _dilated_pattern, _phase_check, _phase_replacement,
    "a strided Conv's input gradient as one stride-1 Conv over dy per output phase, interleaved by DepthToSpace")

# the forms timed against the canonical one, per gradient
FORMS: dict[str, list[Rewrite]] = {
    "x_grad": [REWRITES["conv_input_grad_flipped"], REWRITES["conv_input_grad_col2im"], DILATED_FLIPPED, PHASES],
    "w_grad": [REWRITES["conv_weight_grad_patches"]],
    "pool_grad": [REWRITES["max_pool_taps"]],
}
CANONICAL = {"x_grad": "ConvTranspose", "w_grad": "swapped-role Conv", "pool_grad": "scatter at Indices"}


def _conv(n: int, c: int, m: int, size: int, k: int, s: int) -> tuple[onnx.ModelProto, list[str], dict]:
    return R._conv(n, c, m, size, k=k, s=s)


def _weight_only(built: tuple[onnx.ModelProto, list[str], dict]) -> tuple[onnx.ModelProto, list[str], dict]:
    model, _, feeds = built
    return model, ["w"], feeds


def _pool(shape: tuple[int, ...], k: int, s: int, p: int) -> tuple[onnx.ModelProto, list[str], dict]:
    return R._model("MaxPool", shape, kernel_shape=[k, k], strides=[s, s], pads=[p] * 4)


def resnet_cases(n: int, size: int, width: int = 64) -> list[tuple[str, Callable[[], tuple]]]:
    """ResNet-18's distinct convolutions (and its max-pool) at batch ``n`` on size x size images;
    ``width``: the first stage's channels (64; less for --smoke)."""
    cases: list[tuple[str, Callable[[], tuple]]] = []
    s1 = size // 4                          # after the stem's stride 2 and the max-pool's
    # the stem's input is the image: a step computes its weight gradient alone
    cases.append((f"stem 7x7/2 3->{width} {size}", lambda: _weight_only(_conv(n, 3, width, size, 7, 2))))
    cases.append((f"maxpool 3x3/2 p1 {width}x{size // 2}", lambda: _pool((n, width, size // 2, size // 2), 3, 2, 1)))
    cin, hw = width, s1
    for stage in range(4):
        cout = width * 2 ** stage
        if stage:
            cases.append((f"layer{stage + 1}.0 3x3/2 {cin}->{cout} {hw}",
                          lambda c=cin, m=cout, h=hw: _conv(n, c, m, h, 3, 2)))
            cases.append((f"layer{stage + 1}.0 ds 1x1/2 {cin}->{cout} {hw}",
                          lambda c=cin, m=cout, h=hw: _conv(n, c, m, h, 1, 2)))
            hw //= 2
        cases.append((f"layer{stage + 1} 3x3 {cout}->{cout} {hw}", lambda m=cout, h=hw: _conv(n, m, m, h, 3, 1)))
        cin = cout
    return cases


def cases(smoke: bool) -> list[tuple[str, Callable[[], tuple]]]:
    if smoke:
        return resnet_cases(2, 32, 8) + [("cnn pool 2x2/2 4x8", lambda: _pool((2, 4, 8, 8), 2, 2, 0))]
    return resnet_cases(64, 224) + [("cnn pool 2x2/2 32x32 n32", lambda: _pool((32, 32, 32, 32), 2, 2, 0))]


def _only(gm: onnx.ModelProto, output: str) -> onnx.ModelProto:
    """``gm`` computing ``output`` alone: the other outputs and the nodes only they need dropped."""
    out = onnx.ModelProto()
    out.CopyFrom(gm)
    g = out.graph
    keep = [o for o in g.output if o.name == output]
    del g.output[:]
    g.output.extend(keep)
    nodes = G.live_nodes(list(g.node), [output])
    del g.node[:]
    g.node.extend(nodes)
    read = {i for n in nodes for i in n.input}
    inputs = [i for i in g.input if i.name in read]
    del g.input[:]
    g.input.extend(inputs)
    return out


def _no_check(view: GraphView, m: Match) -> str | None:
    return None


def candidates(model: onnx.ModelProto, wrt: str, kind: str) -> list[tuple[str, onnx.ModelProto | None, str]]:
    """(form, gradient model or None, note) for the canonical form first, then every form of ``kind``."""
    import onnxgrad

    first = len(model.graph.node)
    gm = onnxgrad.grad(model, wrt=[wrt], of=["y"])
    output = f"{wrt}_grad"
    out = [(f"{CANONICAL[kind]} (canonical)", _only(gm, output), "")]
    for rw in FORMS[kind]:
        rewritten, report = apply(gm, [rw], first)
        note = ""
        if not report.applied and report.declined:
            why = report.declined[0][2]
            if rw.name not in REWRITES:          # a form defined here declines where it cannot compute dx
                out.append((rw.name, None, f"declined: {why}"))
                continue
            # the CPU rewrites' checks are thresholds measured on the CPU: on the GPU, time them anyway
            note = f"forced past its check ({why})"
            rewritten, report = apply(gm, [dataclasses.replace(rw, check=_no_check)], first)
        if not report.applied:          # not a form of this gradient (a stride-1 form of a strided Conv's)
            continue
        out.append((rw.name, _only(rewritten, output), note))
    return out


def _feeds(model: onnx.ModelProto, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The given inputs and, for the others (the seed dy), values of their static shapes."""
    rng = np.random.default_rng(1)
    feeds = {}
    for i in model.graph.input:
        if i.name in given:
            feeds[i.name] = given[i.name]
        else:
            shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def run_case(label: str, built: tuple, dev: C.Device, reps: int, warmup: int) -> list[dict[str, Any]]:
    """Every gradient of the case's model, each form checked against the canonical one, then timed."""
    import onnxruntime as ort

    model, wrts, given = built
    rows = []
    for wrt in wrts:
        kind = "pool_grad" if model.graph.node[0].op_type == "MaxPool" else f"{wrt}_grad"
        forms = candidates(model, wrt, kind)
        ref = None
        runs: dict[str, Callable[[], Any]] = {}
        results: dict[str, dict[str, Any]] = {}
        for form, gm, note in forms:
            row = {"case": label, "grad": kind, "form": form, "note": note}
            results[form] = row
            if gm is None:
                continue
            so, providers = dev.session_options(), dev.providers
            if ref is not None and dev.kind == "cuda":
                # a form with a node the CUDA provider has no kernel for (Col2Im) would time host copies and a
                # CPU kernel: not a CUDA form, and at batch 64 seconds a run (onnxruntime refuses the option
                # with the CPU provider named in the list)
                so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
                providers = providers[:1]
            try:
                sess = ort.InferenceSession(gm.SerializeToString(), so, providers=providers)
                feeds = _feeds(gm, given if ref is None else {**given, **ref["feeds"]})
                bound = {k: ort.OrtValue.ortvalue_from_numpy(v, dev.kind, 0) for k, v in feeds.items()}
                run = C._bound_run(sess, bound, dev)
                io = sess.io_binding()
                for k, v in bound.items():
                    io.bind_ortvalue_input(k, v)
                io.bind_output(gm.graph.output[0].name, "cpu")
                sess.run_with_iobinding(io)
                value = io.copy_outputs_to_cpu()[0]
            except Exception as e:
                why = " ".join(str(e).split())
                if "fallback" in why.lower():
                    why = "not timed: onnxruntime assigns part of it to the CPU provider (no CUDA kernel)"
                else:
                    why = f"fails: {type(e).__name__}: {why[:150]}"
                row["note"] = f"{note + '; ' if note else ''}{why}"
                continue
            if ref is None:
                ref = {"value": value, "feeds": feeds}
            else:
                err = float(np.max(np.abs(value - ref["value"])) / max(float(np.max(np.abs(ref["value"]))), 1e-30))
                row["error"] = err
                if not np.isfinite(err) or err > 1e-4:
                    row["note"] = f"{note + '; ' if note else ''}differs from the canonical output: not timed"
                    continue
            runs[form] = run
        for fn in runs.values():
            for _ in range(warmup):
                fn()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(reps):
            for k, fn in runs.items():
                times[k].append(dev.timed(fn))
        for form, t in times.items():
            results[form]["ms"], results[form]["min"] = float(np.median(t)), float(np.min(t))
        rows += list(results.values())
        del runs
        gc.collect()
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    canonical = {(r["case"], r["grad"]): r.get("ms") for r in rows if r["form"].endswith("(canonical)")}
    for r in rows:
        cell = f"{r['ms']:.3f} [{r['min']:.3f}]" if "ms" in r else "-"
        base = canonical.get((r["case"], r["grad"]))
        ratio = f"{r['ms'] / base:.2f}" if "ms" in r and base else "-"
        err = f"{r['error']:.1e}" if "error" in r else "-"
        print(f"{r['case']:<34} {r['grad']:<9} {r['form']:<36} {cell:>17} {ratio:>6} {err:>8}  {r['note']}",
              flush=True)


# -- where a ResNet-18 step's time goes ----------------------------------------------------------------
def _steady(path: str, skip_runs: int) -> str:
    """The profile at ``path`` without its first ``skip_runs`` runs (cuDNN's algorithm search, the arena's
    growth), written to $OUT when set, else beside it."""
    with open(path) as f:
        events = json.load(f)
    starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    cut = starts[skip_runs] if len(starts) > skip_runs else float("inf")
    kept = [e for e in events if e.get("cat") != "Node" or e["ts"] >= cut]
    steady = os.path.join(os.environ.get("OUT") or os.path.dirname(path),
                          os.path.basename(path).replace(".json", "_steady.json"))
    with open(steady, "w") as f:
        json.dump(kept, f)
    return steady


def profile(dev: C.Device, smoke: bool, reps: int, warmup: int) -> None:
    """onnxruntime's profile by op type of ResNet-18's step, and the GPU kernels of the same steps."""
    from onnxgrad import TrainingSession, optim

    bench = (C.SMOKE_MODELS if smoke else C.MODELS)["resnet18_224_b64"]()
    feeds = {**bench.feeds, **bench.target}
    prefix = os.path.join(tempfile.gettempdir(), "resnet18_step")     # the steady part goes to $OUT
    for train_mode in (True, False):
        so = dev.session_options()
        so.enable_profiling = True
        so.profile_file_prefix = prefix + ("_train" if train_mode else "_frozen_bn")
        try:
            ts = TrainingSession(bench.forward, loss=bench.loss, optimizer=optim.AdamW(lr=1e-3),
                                 providers=dev.providers, session_options=so, train_mode=train_mode)
            batch, kind, _, note = C.device_batch(ts, feeds, dev)
            for _ in range(warmup):
                ts.step(batch)
        except Exception as e:
            print(f"\nresnet18 step, train_mode={train_mode}: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
                  + ("; profiling the frozen-BN step instead" if train_mode else ""), flush=True)
            continue
        wall = [dev.timed(lambda: ts.step(batch)) for _ in range(reps)]
        print(f"\nresnet18 step, train_mode={train_mode}, {kind} batch: {np.median(wall):.2f} ms median "
              f"[{np.min(wall):.2f}] wall clock ({note})", flush=True)
        B.print_profile(_steady(ts._train.end_profiling(), 1 + warmup), "resnet18 step (onnxruntime, by node launch)",
                        reps)
        kernels(dev, lambda: ts.step(batch), reps)
        return


def kernels(dev: C.Device, step: Callable[[], Any], reps: int, top: int = 20) -> None:
    """The GPU kernels of ``reps`` steps by name, as CUPTI records them (``torch.profiler``)."""
    if dev.kind != "cuda":
        print("  (GPU kernels: CUDA only)", flush=True)
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    try:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                step()
            dev.sync()
        stats = [(e.key, e.self_device_time_total / 1e3 / reps, e.count // reps) for e in prof.key_averages()]
    except Exception as e:
        print(f"  GPU kernels: torch.profiler failed: {type(e).__name__}: {e}", flush=True)
        return
    total = sum(ms for _, ms, _ in stats)
    print(f"\n== resnet18 step, GPU kernels (CUPTI), {total:.2f} ms of kernel time per step", flush=True)
    for name, ms, count in sorted(stats, key=lambda s: -s[1])[:top]:
        print(f"  {name[:90]:<90} {ms:8.3f} ms  x{count:<4} {100 * ms / max(total, 1e-9):5.1f}%", flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU provider")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds (default 20; --smoke 2)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also profile one ResNet-18 training step")
    ap.add_argument("--only-profile", action="store_true", help="the profile alone")
    ap.add_argument("--ort-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a CUDAExecutionProvider option (e.g. cudnn_conv_algo_search=HEURISTIC)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    reps = args.reps if args.reps is not None else (2 if args.smoke else 20)
    dev = C.cpu_device() if args.smoke else C.cuda_device(dict(o.split("=", 1) for o in args.ort_option))
    import onnxruntime as ort

    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if not args.only_profile:
        where = dev.torch.cuda.get_device_name() if dev.kind == "cuda" else "CPU"
        print(f"{'SMOKE (tiny shapes, CPU): ' if args.smoke else ''}onnxruntime {ort.__version__} on {where}, "
              f"providers {dev.providers}; median [min] of {reps} interleaved, device-synchronised runs, ms; "
              "ratio to the canonical form; error: max |diff| / max |canonical|", flush=True)
        print(f"{'case':<34} {'gradient':<9} {'form':<36} {'ms':>17} {'ratio':>6} {'error':>8}  note", flush=True)
        for label, build in cases(args.smoke):
            case_rows = run_case(label, build(), dev, reps, args.warmup)
            print_rows(case_rows)
            rows += case_rows
        print(f"forms: {len(rows)} rows in {time.perf_counter() - start:.0f} s", flush=True)
    if args.profile or args.only_profile:
        profile(dev, args.smoke, reps=max(reps, 3), warmup=args.warmup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
