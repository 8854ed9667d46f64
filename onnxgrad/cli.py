"""Command line: ``python -m onnxgrad MODEL [-o OUT] [--wrt ...] [--of ... | --loss NAME] [--check]``.

Also ``python -m onnxgrad ops`` (rule coverage of every ai.onnx op) and
``python -m onnxgrad lower MODEL`` (replace ai.onnx.preview.training ops).
User errors print one ``error: ...`` line on stderr and exit 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from typing import Sequence

from .errors import OnnxGradError

CHECK_TOLERANCE = 1e-3


def _grad_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m onnxgrad",
        description="Append the backward graph to an ONNX model: gradients as standard ONNX ops.",
        epilog="Other commands: 'python -m onnxgrad ops' lists rule coverage of every ai.onnx op; "
        "'python -m onnxgrad lower MODEL' replaces ai.onnx.preview.training ops by standard ones.",
    )
    p.add_argument("model", help="the forward model (.onnx)")
    p.add_argument("-o", "--output", help="where to write the gradient model (default: <stem>.grad.onnx beside MODEL)")
    p.add_argument("--wrt", nargs="+", metavar="NAME",
                   help="tensors to differentiate (default: every float initializer the outputs depend on)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--of", nargs="+", metavar="NAME",
                       help="outputs to differentiate; each gets a seed input NAME_grad")
    group.add_argument("--loss", metavar="NAME", help="a scalar output to differentiate (seed 1)")
    p.add_argument("--allow-unused", action="store_true",
                   help="give zeros for wrt tensors the outputs do not depend on, instead of an error")
    p.add_argument("--check", action="store_true",
                   help="also compare the gradients with central differences on random inputs")
    p.add_argument("--seed", type=int, default=0, help="random seed for --check (default 0)")
    return p


def _default_output(model_path: str) -> str:
    stem = model_path[:-5] if model_path.endswith(".onnx") else model_path
    return stem + ".grad.onnx"


def save_model(model, path: str) -> None:
    """Write atomically (temporary file in the same folder, then rename): never a half-written model."""
    import onnx

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".onnxgrad-", suffix=".onnx", dir=folder)
    os.close(fd)
    try:
        if model.ByteSize() > 2_000_000_000:
            data = os.path.basename(path) + ".data"
            onnx.save(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True, location=data)
        else:
            onnx.save(model, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _shape_text(vi) -> str:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return "?"
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    return "[" + ", ".join(dims) + "]"


def run_grad(args: argparse.Namespace) -> int:
    import onnx

    from . import check as C
    from .autodiff import grad
    from .model import load

    out_path = args.output or _default_output(args.model)
    if os.path.abspath(out_path) == os.path.abspath(args.model):
        raise OnnxGradError(f"output '{out_path}' is the input model; choose another path with -o")
    t0 = time.perf_counter()
    model = load(args.model)
    gm = grad(model, wrt=args.wrt, of=args.of, loss=args.loss, allow_unused=args.allow_unused)
    build_s = time.perf_counter() - t0
    save_model(gm, out_path)

    spec = C.gradient_spec(gm)
    n_forward = len(model.graph.node)
    backward = gm.graph.node[n_forward:]
    ops = Counter(n.op_type for n in backward)
    outputs = {o.name: o for o in gm.graph.output}
    inputs = {i.name: i for i in gm.graph.input}
    print(f"wrote {out_path}")
    print(f"forward nodes: {n_forward}   backward nodes: {len(backward)}   built in {build_s:.3f} s")
    print("backward ops: " + ", ".join(f"{op} x{k}" for op, k in sorted(ops.items())))
    what = f"loss '{spec['loss']}' (seed 1)" if spec["loss"] else "outputs " + ", ".join(spec["of"])
    print(f"differentiated: {what}")
    for o, seed in spec["seeds"].items():
        print(f"  seed input {seed} {_shape_text(inputs[seed])}: dL/d{o}")
    for w, g in spec["gradients"].items():
        print(f"  gradient {g} {_shape_text(outputs[g])}")
    if args.check:
        t1 = time.perf_counter()
        result = C.check(model, gm, rng=args.seed)
        print(f"numeric check ({result.backend} float64 central differences, {time.perf_counter() - t1:.1f} s):")
        for w, err in result.errors.items():
            print(f"  {spec['gradients'][w]}: worst relative error {err:.2e}")
        if not result.ok(CHECK_TOLERANCE):
            print(f"error: numeric check failed: errors above {CHECK_TOLERANCE:g}", file=sys.stderr)
            return 1
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
    from .lower import lower
    from .model import load

    out = args.output or (args.model[:-5] if args.model.endswith(".onnx") else args.model) + ".lowered.onnx"
    if os.path.abspath(out) == os.path.abspath(args.model):
        raise OnnxGradError(f"output '{out}' is the input model; choose another path with -o")
    lowered = lower(load(args.model))
    save_model(lowered, out)
    print(f"wrote {out}")
    return 0


COMMANDS = {"ops": run_ops, "lower": run_lower}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS and not os.path.isfile(argv[0]):
            return COMMANDS[argv[0]](argv[1:])
        return run_grad(_grad_parser().parse_args(argv))
    except OnnxGradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head` closed the pipe: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
