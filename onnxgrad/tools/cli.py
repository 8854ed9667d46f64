"""Command line: ``python -m onnxgrad MODEL [-o OUT] [--wrt ...] [--of ... | --loss NAME] [--check]``.

Training artifacts: ``python -m onnxgrad MODEL --loss-fn cross_entropy --target y --optimizer adamw
[--lr ...]`` writes ``<stem>.train.onnx`` (forward + loss + backward + update) and ``<stem>.eval.onnx``.

Also ``python -m onnxgrad ops`` (rule coverage of every ai.onnx op),
``python -m onnxgrad params MODEL`` (what is trained, and why the rest is not),
``python -m onnxgrad lower MODEL`` (replace ai.onnx.preview.training ops) and
``python -m onnxgrad jvp MODEL --wrt NAME ...`` (forward mode, :mod:`onnxgrad.passes.forward`).
User errors print one ``error: ...`` line on stderr and exit 2.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from typing import Sequence

from ..errors import OnnxGradError
from ..ir.files import save_model
from ..passes.optimize import TARGETS

CHECK_TOLERANCE = 1e-3
CHECK_SAMPLE = 8


def _version() -> str:
    from ..version import __version__

    return __version__


def _writable(path: str) -> None:
    """Refuse, before any work, an output path that cannot be written: a folder, or in a folder we
    cannot create or write to."""
    if os.path.isdir(path):
        raise OnnxGradError(f"cannot write '{path}': it is a folder")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OnnxGradError(f"cannot write '{path}': '{existing}' is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OnnxGradError(f"cannot write '{path}': no permission to write in '{existing}'")


def _save(model, path: str) -> None:
    try:
        save_model(model, path)
    except OSError as e:
        raise OnnxGradError(f"cannot write '{path}': {e.strerror or e}") from None


class _Progress:
    """A tqdm bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, desc: str):
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(desc=desc, unit="run", leave=False, file=sys.stderr)
            except ImportError:
                pass

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _grad_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m onnxgrad",
        description="Append the backward graph to an ONNX model: gradients as standard ONNX ops.",
        epilog="Other commands: 'python -m onnxgrad ops' lists rule coverage of every ai.onnx op; "
        "'python -m onnxgrad params MODEL' lists the trainable parameters and why other initializers are left "
        "out; 'python -m onnxgrad lower MODEL' replaces ai.onnx.preview.training ops by standard ones; "
        "'python -m onnxgrad jvp MODEL --wrt NAME ...' appends the forward-mode (tangent) graph.",
    )
    p.add_argument("model", help="the forward model (.onnx)")
    p.add_argument("-o", "--output", help="where to write the gradient model (default: <stem>.grad.onnx beside MODEL)")
    p.add_argument("--wrt", nargs="+", metavar="NAME",
                   help="tensors to differentiate (default: the model's trainable parameters, as "
                   "'python -m onnxgrad params MODEL' lists them)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--of", nargs="+", metavar="NAME",
                       help="outputs to differentiate; each gets a seed input NAME_grad")
    group.add_argument("--loss", metavar="NAME", help="a scalar output to differentiate (seed 1)")
    p.add_argument("--allow-unused", action="store_true",
                   help="give zeros for wrt tensors the outputs do not depend on, instead of an error")
    p.add_argument("--strict-tags", action="store_true",
                   help="follow the ONNX schemas' differentiability tags only: no gradients for the inputs they "
                   "tag non-differentiable but PyTorch differentiates (LSTM initial states, Clip bounds, ...)")
    p.add_argument("--group", action="store_true",
                   help="write each forward node's backward as one call of a model-local function (one node per "
                   "forward op in Netron; runtimes inline them)")
    p.add_argument("--optimize-for", choices=sorted(TARGETS), metavar="RUNTIME",
                   help="rewrite the gradient for onnxruntime's 'cpu' or 'cuda' provider (onnxgrad.passes.optimize: "
                   "the measured fast forms of the same values, as TrainingSession uses them; 'cuda' also writes "
                   "train-mode BatchNormalization, which its kernel refuses, as standard ops, and guards the update "
                   "on the GPU), or for onnxruntime-web's 'webgpu' providers (every node on the GPU: step and class "
                   "labels int32, the step's float64 scalars in <stem>.schedule.onnx, run on the CPU before each "
                   "step); default: the canonical adjoints")
    p.add_argument("--recompute", action="store_true",
                   help="recompute cheap activations in the backward instead of keeping them "
                   "(onnxgrad.passes.recompute); run the result with onnxruntime's CommonSubexpressionElimination "
                   "disabled")
    p.add_argument("--check", action="store_true",
                   help="also compare the gradients with central differences on random inputs")
    p.add_argument("--seed", type=int, default=0, help="random seed for --check (default 0)")
    p.add_argument("--check-sample", type=int, default=CHECK_SAMPLE, metavar="K",
                   help=f"--check compares at most K gradients one by one (a random choice) and all of them "
                   f"together along random directions (default {CHECK_SAMPLE}; 0: the joint check alone)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="with --optimizer: list every parameter, input and output of the training model (default: "
                   "a summary with their counts)")
    p.add_argument("--version", action="version", version=f"onnxgrad {_version()}")
    _training_arguments(p)
    return p


def _training_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that append a loss (--loss-fn) and build training artifacts (--optimizer)."""
    from ..training.losses import LOSSES
    from ..training.optim import OPTIMIZERS

    lg = p.add_argument_group(
        "loss", "append a loss to the model's predictions; with --optimizer, train it, else differentiate it")
    lg.add_argument("--loss-fn", choices=sorted(LOSSES), help="the loss function (PyTorch semantics)")
    lg.add_argument("--target", default="target", metavar="NAME",
                    help="name of the new target input (default: target)")
    lg.add_argument("--predictions", metavar="NAME",
                    help="the model output the loss reads (default: the model's only output)")
    lg.add_argument("--reduction", choices=["mean", "sum"], default="mean", help="default: mean")
    lg.add_argument("--label-smoothing", type=float, default=0.0, help="cross_entropy only (default 0)")
    lg.add_argument("--ignore-index", type=int, default=-100, help="cross_entropy and nll (default -100)")
    lg.add_argument("--probabilities", action="store_true",
                    help="cross_entropy: the target holds class probabilities, not class indices")
    tg = p.add_argument_group(
        "training", "with --optimizer, write a training model (forward + loss + backward + update, one run "
        "per step) to -o (default <stem>.train.onnx) and an eval model (forward, parameters as inputs) "
        "to --eval-output; both list their inputs and outputs")
    tg.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="the optimizer (PyTorch update rules)")
    tg.add_argument("--lr", type=float, help="initial learning rate: the value of the required lr input in "
                    "<stem>.state.safetensors, which the training loop feeds (and a scheduler changes) each step "
                    "(default: the optimizer's)")
    tg.add_argument("--momentum", type=float, help="sgd")
    tg.add_argument("--dampening", type=float, help="sgd")
    tg.add_argument("--nesterov", action="store_true", help="sgd")
    tg.add_argument("--betas", type=float, nargs=2, metavar=("BETA1", "BETA2"), help="adam, adamw")
    tg.add_argument("--eps", type=float, help="adam, adamw, adagrad")
    tg.add_argument("--lr-decay", type=float, help="adagrad")
    tg.add_argument("--weight-decay", type=float, help="default: the optimizer's (adamw 0.01, others 0)")
    tg.add_argument("--clip-grad-norm", type=float, metavar="MAX", help="clip the global gradient norm to MAX")
    tg.add_argument("--accumulation-steps", type=int, default=1, metavar="K",
                    help="average gradients over K micro-batches; also writes <stem>.accumulate.onnx")
    tg.add_argument("--freeze", nargs="+", default=[], metavar="NAME", help="initializers not to train")
    tg.add_argument("--train", nargs="+", metavar="NAME",
                    help="train exactly these initializers (default: the model's parameters, as "
                    "'python -m onnxgrad params MODEL' lists them)")
    tg.add_argument("--eval-mode", action="store_true",
                    help="keep the exported eval-mode graph while training (BatchNormalization on its running "
                    "statistics, Dropout off): frozen-BN fine-tuning; default: train mode, as model.train()")
    tg.add_argument("--eval-output", metavar="PATH", help="default: <stem>.eval.onnx beside -o (else MODEL)")


def _default_output(model_path: str, suffix: str = ".grad.onnx") -> str:
    stem = model_path[:-5] if model_path.endswith(".onnx") else model_path
    return stem + suffix


def _speed_lines(model) -> list[str]:
    """What --optimize-for and --recompute did to the graph, from its metadata."""
    import json

    from ..passes.recompute import ORT_DISABLED_OPTIMIZERS

    meta = {p.key: p.value for p in model.metadata_props}
    lines = []
    if "onnxgrad.rewrites" in meta:
        rewrites = json.loads(meta["onnxgrad.rewrites"])
        lines.append(f"rewritten for onnxruntime {json.loads(meta['onnxgrad.target'])}: "
                     + ", ".join(f"{name} x{k}" for name, k in rewrites.items()))
    if "onnxgrad.recomputed" in meta:
        lines.append(f"recomputed in the backward: {len(json.loads(meta['onnxgrad.recomputed']))} activations "
                     f"(run it with disabled_optimizers={list(ORT_DISABLED_OPTIMIZERS)}: onnxruntime would merge "
                     "them back into the forward)")
    return lines


def _shape_text(vi) -> str:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return "?"
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return "[" + ", ".join(dims) + "]"


def run_grad(args: argparse.Namespace) -> int:
    from ..ir.load import load
    from ..passes.autodiff import grad
    from ..passes.params import parameters, restore_ties
    from ..passes.record import backward_nodes, gradient_spec
    from . import check as C

    if args.optimizer:
        return run_train(args)
    out_path = args.output or _default_output(args.model)
    if os.path.abspath(out_path) == os.path.abspath(args.model):
        raise OnnxGradError(f"output '{out_path}' is the input model; choose another path with -o")
    _writable(out_path)
    t0 = time.perf_counter()
    model = load(args.model)
    loss_name = args.loss
    if args.loss_fn:
        if args.of or args.loss:
            raise OnnxGradError("--loss-fn appends the loss: do not also give --of or --loss")
        model = _loss_fn(args)(model)
        loss_name = "loss"
    report = None
    if args.wrt is None:
        report = parameters(model, loss=loss_name, of=args.of, strict_tags=args.strict_tags)
        model = restore_ties(model, report)       # merged tensors split off, tied copies computed
        if not report.trainable:
            left = "; ".join(p.line(None) for p in report.left_out[:5]) + (" ..." if len(report.left_out) > 5 else "")
            raise OnnxGradError("no trainable parameter found" + (f" (float initializers left out: {left})" if left
                                                                 else " (the model has no float initializer)")
                                + "; name the tensors to differentiate with --wrt")
    if args.group and (args.optimize_for or args.recompute):
        raise OnnxGradError("--group writes the canonical graph for reading: do not combine it with "
                            "--optimize-for or --recompute")
    gm = grad(model, wrt=report.trainable if report is not None else args.wrt, of=args.of, loss=loss_name,
              allow_unused=args.allow_unused, strict_tags=args.strict_tags, group=args.group,
              target=args.optimize_for, recompute=args.recompute)
    build_s = time.perf_counter() - t0
    result, check_s = None, 0.0
    if args.check:          # before writing: a gradient model that fails its check is not written
        t1 = time.perf_counter()
        bar = _Progress("--check")
        try:
            result = C.check(model, gm, rng=args.seed, sample=max(args.check_sample, 0), progress=bar)
        except OnnxGradError:
            raise
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OnnxGradError(f"--check could not run the model on random inputs: {first}") from None
        finally:
            bar.close()
        check_s = time.perf_counter() - t1
    if result is None or result.ok(CHECK_TOLERANCE):
        _save(gm, out_path)

    spec = gradient_spec(gm)
    backward = backward_nodes(gm)
    n_forward = len(gm.graph.node) - len(backward)
    ops = Counter(n.op_type for n in backward)
    outputs = {o.name: o for o in gm.graph.output}
    inputs = {i.name: i for i in gm.graph.input}
    if result is None or result.ok(CHECK_TOLERANCE):
        print(f"wrote {out_path}")
    print(f"forward nodes: {n_forward}   backward nodes: {len(backward)}   built in {build_s:.3f} s")
    print("backward ops: " + ", ".join(f"{op} x{k}" for op, k in sorted(ops.items())))
    for line in _speed_lines(gm):
        print(line)
    what = f"loss '{spec['loss']}' (seed 1)" if spec["loss"] else "outputs " + ", ".join(spec["of"])
    print(f"differentiated: {what}")
    for o, seed in spec["seeds"].items():
        print(f"  seed input {seed} {_shape_text(inputs[seed])}: dL/d{o}")
    torch_names = {p.name: p.torch_name for p in report} if report is not None else {}
    for w, g in spec["gradients"].items():
        torch = f" (PyTorch '{torch_names[w]}')" if torch_names.get(w) not in (None, w) else ""
        print(f"  gradient {g} {_shape_text(outputs[g])}{torch}")
    if report is not None and report.left_out:
        print(f"not differentiated: {len(report.left_out)} float initializer(s) that are not parameters "
              f"('python -m onnxgrad params {args.model}' says why)")
    if result is not None:
        print(f"numeric check ({result.backend} float64 central differences, gradients run in "
              f"{result.grad_backend}, {check_s:.1f} s):")
        for w, err in result.errors.items():
            print(f"  {spec['gradients'][w]}: worst relative error {err:.2e}")
        if result.joint is not None:
            print(f"  the other {len(spec['gradients']) - len(result.errors)} gradient(s) checked together with "
                  f"these along random directions: worst relative error {result.joint:.2e}")
        if not result.ok(CHECK_TOLERANCE):
            print(f"error: numeric check failed: errors above {CHECK_TOLERANCE:g}; {out_path} not written",
                  file=sys.stderr)
            return 1
    return 0


def _loss_fn(args: argparse.Namespace):
    """The loss --loss-fn and its options describe, as a callable model -> model."""
    from ..training import losses

    options: dict = {"reduction": args.reduction}
    if args.loss_fn in ("cross_entropy", "nll"):
        options["ignore_index"] = args.ignore_index
    if args.loss_fn == "cross_entropy":
        options["label_smoothing"] = args.label_smoothing
        options["probabilities"] = args.probabilities
    elif args.label_smoothing or args.probabilities:
        raise OnnxGradError("--label-smoothing and --probabilities apply to --loss-fn cross_entropy only")
    return losses.LOSS_CLASSES[args.loss_fn](args.predictions, args.target, **options)


def _optimizer(args: argparse.Namespace):
    from ..training.optim import OPTIMIZERS

    cls = OPTIMIZERS[args.optimizer]
    flags = {"lr": args.lr, "momentum": args.momentum, "dampening": args.dampening,
             "nesterov": args.nesterov or None, "betas": tuple(args.betas) if args.betas else None,
             "eps": args.eps, "lr_decay": args.lr_decay, "weight_decay": args.weight_decay}
    given = {k: v for k, v in flags.items() if v is not None}
    wrong = [k for k in given if k not in cls.defaults]
    if wrong:
        raise OnnxGradError(f"--optimizer {args.optimizer} takes no "
                            + ", ".join("--" + k.replace("_", "-") for k in wrong))
    return cls(**given)


def _io_table(title: str, values) -> list[str]:
    lines = [title]
    for vi in values:
        dtype = _onnx_type_name(vi.type.tensor_type.elem_type)
        doc = f"  {vi.doc_string}" if vi.doc_string else ""
        lines.append(f"  {vi.name}: {dtype} {_shape_text(vi)}{doc}")
    return lines


def _onnx_type_name(elem_type: int) -> str:
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(elem_type).name if elem_type else "?"


def run_train(args: argparse.Namespace) -> int:
    """Write the training model, the eval model (and the accumulation model) for --optimizer."""
    from ..training import artifacts

    if args.of or args.wrt or args.check:
        raise OnnxGradError("--optimizer trains every float initializer (use --freeze to exclude some): "
                            "do not give --of, --wrt or --check")
    if args.loss_fn and args.loss:
        raise OnnxGradError("--loss-fn appends the loss: do not also give --loss")
    stem = args.model[:-5] if args.model.endswith(".onnx") else args.model
    out_path = args.output or stem + ".train.onnx"
    if args.output:         # the other artifacts go beside the training model the user placed
        stem = out_path[:-11] if out_path.endswith(".train.onnx") else (out_path[:-5] if out_path.endswith(".onnx")
                                                                        else out_path)
    eval_path = args.eval_output or stem + ".eval.onnx"
    acc_path = (out_path[:-11] if out_path.endswith(".train.onnx") else stem) + ".accumulate.onnx"
    for path in (out_path, eval_path):
        if os.path.abspath(path) == os.path.abspath(args.model):
            raise OnnxGradError(f"output '{path}' is the input model; choose another path")
        _writable(path)
    loss = _loss_fn(args) if args.loss_fn else (args.loss or "loss")
    t0 = time.perf_counter()
    if args.group:
        raise OnnxGradError("--group writes a gradient graph for reading: do not combine it with --optimizer")
    art = artifacts.build(args.model, loss, _optimizer(args), frozen=args.freeze, trainable=args.train,
                          clip_grad_norm=args.clip_grad_norm, accumulation_steps=args.accumulation_steps,
                          guard=True, defaults=False, train_mode=not args.eval_mode, target=args.optimize_for,
                          recompute=args.recompute)
    build_s = time.perf_counter() - t0
    init_path = (out_path[:-11] if out_path.endswith(".train.onnx") else stem) + ".state.safetensors"
    _save(art.train, out_path)
    _save(art.eval, eval_path)
    try:
        art.save_state(init_path)
    except OSError as e:
        raise OnnxGradError(f"cannot write '{init_path}': {e.strerror or e}") from None
    spec = art.spec
    print(f"wrote {out_path} (training: forward + loss + backward + {spec.optimizer['type']} update, "
          "one run per step" + (", BatchNormalization/Dropout in train mode" if spec.train_mode else "") + ")")
    print(f"wrote {eval_path} (eval: forward outputs; parameters{' and running statistics' if spec.buffers else ''} "
          "are required inputs)")
    print(f"wrote {init_path} (the state file, safetensors: every state input's value before the first step; "
          "feed each <name>.next output back as <name>)")
    if art.schedule is not None:
        schedule_path = (out_path[:-11] if out_path.endswith(".train.onnx") else stem) + ".schedule.onnx"
        _save(art.schedule, schedule_path)
        print(f"wrote {schedule_path} (the step's scalars from lr and step: run it before each step, on the CPU, "
              "and feed its outputs to the training model)")
    if art.accumulate is not None:
        _save(art.accumulate, acc_path)
        print(f"wrote {acc_path} (accumulation: adds one micro-batch's gradients to the <param>.grad_acc inputs)")
    print(f"built in {build_s:.3f} s")
    for line in _speed_lines(art.train):
        print(line)
    report = art.report.lines(command_line=True) if art.report is not None else []
    for line in report if args.verbose else [line for line in report if not line.startswith("  ")]:
        print(line)
    print("optimizer: " + ", ".join(f"{k}={v}" for k, v in spec.optimizer.items()))
    if not args.verbose:
        for line in _io_summary(art, os.path.basename(init_path)):
            print(line)
        return 0
    for line in _io_table(f"training inputs (state inputs start from {os.path.basename(init_path)}):",
                          art.train.graph.input):
        print(line)
    for line in _io_table("training outputs (feed each <name>.next back as <name> for the next step):",
                          art.train.graph.output):
        print(line)
    return 0


def _io_summary(art, state_file: str) -> list[str]:
    """The training model's inputs and outputs in three lines: the data by name, the state by count, the
    outputs to read by name and those to feed back by count (-v lists them all)."""
    spec, graph = art.spec, art.train.graph
    inputs = {vi.name: vi for vi in graph.input}
    kinds = {"parameter(s)": list(spec.params),
             "optimizer-state tensor(s)": [i for st in spec.state.values() for i, _ in st.values()],
             "running statistic(s)": [i for i, _ in spec.buffers.values()],
             "gradient accumulator(s)": [i for i, _ in spec.accumulators.values()]}
    held = {name for names in kinds.values() for name in names} | set(spec.data_inputs)
    data = ", ".join(f"{n} {_onnx_type_name(inputs[n].type.tensor_type.elem_type)} {_shape_text(inputs[n])}"
                     for n in spec.data_inputs if n in inputs)
    state = ", ".join(f"{len(names)} {kind}" for kind, names in kinds.items() if names)
    scalars = ", ".join(n for n in inputs if n not in held)
    fed_back = [o.name for o in graph.output if o.name.endswith(".next") and o.name[:-len(".next")] in inputs]
    read = ", ".join(o.name for o in graph.output if o.name not in fed_back)
    return [f"training inputs: data {data or '(none)'}; from {state_file}: {state}, {scalars}",
            f"training outputs: {read}; and {len(fed_back)} <name>.next to feed back as <name> for the next step",
            "(-v lists every parameter, input and output)"]


def run_params(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxgrad params",
                                description="List the tensors onnxgrad trains by default (with their PyTorch "
                                "names where the exporter recorded them) and the float initializers it leaves "
                                "out, with the reason.")
    p.add_argument("model")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--of", nargs="+", metavar="NAME", help="differentiated outputs")
    group.add_argument("--loss", metavar="NAME", help="the scalar loss output")
    p.add_argument("--freeze", nargs="+", default=[], metavar="NAME", help="initializers not to train")
    p.add_argument("--strict-tags", action="store_true", help="follow the ONNX differentiability tags only")
    args = p.parse_args(argv)
    from ..passes.params import parameters

    report = parameters(args.model, loss=args.loss, of=args.of, frozen=args.freeze, strict_tags=args.strict_tags)
    for line in report.lines(command_line=True):
        print(line)
    return 0


def run_ops(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxgrad ops",
                                description="Rule coverage of every ai.onnx operator.")
    p.add_argument("--cases", action="store_true",
                   help="also run onnx's backend node test cases for every op with a rule and count them")
    args = p.parse_args(argv)
    from .coverage import print_table

    return print_table(run_cases=args.cases)


def run_lower(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxgrad lower",
                                description="Replace ai.onnx.preview.training ops (Gradient, Adagrad, Adam, "
                                "Momentum) by standard ai.onnx ops.")
    p.add_argument("model")
    p.add_argument("-o", "--output", help="default: <stem>.lowered.onnx beside MODEL")
    args = p.parse_args(argv)
    from ..ir.load import load
    from .lowering import lower

    out = args.output or (args.model[:-5] if args.model.endswith(".onnx") else args.model) + ".lowered.onnx"
    if os.path.abspath(out) == os.path.abspath(args.model):
        raise OnnxGradError(f"output '{out}' is the input model; choose another path with -o")
    _writable(out)
    lowered = lower(load(args.model))
    _save(lowered, out)
    print(f"wrote {out}")
    return 0


def run_jvp(argv: Sequence[str]) -> int:
    """``python -m onnxgrad jvp MODEL --wrt NAME ... [--of NAME ...] [-o OUT] [--check]``"""
    p = argparse.ArgumentParser(prog="python -m onnxgrad jvp",
                                description="Append the forward-mode (tangent) graph to an ONNX model: an input "
                                "<x>_tangent per --wrt tensor (a direction v) and an output <y>_tangent per "
                                "--of output (J v), as standard ONNX ops.")
    p.add_argument("model", help="the forward model (.onnx)")
    p.add_argument("-o", "--output", help="where to write the model (default: <stem>.jvp.onnx beside MODEL)")
    p.add_argument("--wrt", nargs="+", metavar="NAME", required=True, help="tensors the directions perturb")
    p.add_argument("--of", nargs="+", metavar="NAME", help="outputs to differentiate (default: every float output)")
    p.add_argument("--allow-unused", action=argparse.BooleanOptionalAction, default=True,
                   help="zeros for outputs no wrt tensor reaches, and ignore wrt tensors that reach no output, as "
                   "torch.func.jvp (the default); --no-allow-unused makes either an error")
    p.add_argument("--strict-tags", action="store_true", help="follow the ONNX differentiability tags only")
    p.add_argument("--check", action="store_true",
                   help="also compare the tangents with central differences along random directions")
    p.add_argument("--seed", type=int, default=0, help="random seed for --check (default 0)")
    args = p.parse_args(argv)
    from ..ir.load import load
    from ..passes.forward import jvp, tangent_spec
    from .check.jvp import check_jvp

    out_path = args.output or _default_output(args.model, ".jvp.onnx")
    if os.path.abspath(out_path) == os.path.abspath(args.model):
        raise OnnxGradError(f"output '{out_path}' is the input model; choose another path with -o")
    _writable(out_path)
    t0 = time.perf_counter()
    model = load(args.model)
    jm = jvp(model, wrt=args.wrt, of=args.of, allow_unused=args.allow_unused, strict_tags=args.strict_tags)
    build_s = time.perf_counter() - t0
    _save(jm, out_path)
    spec = tangent_spec(jm)
    n_forward = len(model.graph.node)
    added = jm.graph.node[n_forward:]
    inputs = {i.name: i for i in jm.graph.input}
    outputs = {o.name: o for o in jm.graph.output}
    print(f"wrote {out_path}")
    print(f"forward nodes: {n_forward}   tangent nodes: {len(added)}   built in {build_s:.3f} s")
    print("tangent ops: " + ", ".join(f"{op} x{k}" for op, k in sorted(Counter(n.op_type for n in added).items())))
    for w, t in spec["tangent_inputs"].items():
        print(f"  direction input {t} {_shape_text(inputs[t])}: v for '{w}'")
    for y, t in spec["tangents"].items():
        print(f"  tangent output {t} {_shape_text(outputs[t])}: J v of '{y}'")
    if args.check:
        errors, _ = check_jvp(model, jm, rng=args.seed)
        print("numeric check (float64 central differences along random directions):")
        for y, err in errors.items():
            print(f"  {spec['tangents'][y]}: worst relative error {err:.2e}")
        if not all(math.isfinite(e) and e <= CHECK_TOLERANCE for e in errors.values()):
            print(f"error: numeric check failed: errors above {CHECK_TOLERANCE:g}", file=sys.stderr)
            return 1
    return 0


COMMANDS = {"ops": run_ops, "lower": run_lower, "params": run_params, "jvp": run_jvp}


def _in_flags(message: Exception | str) -> str:
    """An error's or a warning's message with the arguments it tells the user to pass as the command line's
    flags (``--of y``, not ``of=['y']``: onnxgrad.errors.arg)."""
    return message.on_command_line() if hasattr(message, "on_command_line") else str(message)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """onnxgrad's warnings as one ``warning: ...`` line each, as errors are one ``error: ...`` line."""
    print(f"warning: {_in_flags(message)}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with warnings.catch_warnings():      # one line per warning while the command runs, restored after it
            warnings.showwarning = _warning_line
            if argv and argv[0] in COMMANDS and not os.path.isfile(argv[0]):
                return COMMANDS[argv[0]](argv[1:])
            return run_grad(_grad_parser().parse_args(argv))
    except OnnxGradError as e:
        print(f"error: {_in_flags(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head` closed the pipe: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
