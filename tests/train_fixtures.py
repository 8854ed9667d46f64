"""Training jobs the JavaScript and browser tests run: small models of the families people train on devices, each
written by the CLI as a user would (`python -m onnxgrad MODEL ... --optimize-for webgpu`), with its batches in a
safetensors file (tensors "k/input") that the pages and node read."""
from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file

from onnxgrad.tools.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
OPSET = 18
F = TensorProto.FLOAT


def lstm_classifier(seq=12, hidden=32, features=4, classes=3, batch=2, seed=0) -> onnx.ModelProto:
    """An LSTM classifier (the last step's hidden state, a Gemm head): its gradient splits and concatenates
    ``seq`` time steps, the node width JSEP computed wrong."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((1, 4 * hidden, features)) * 0.3).astype(np.float32)
    r = (rng.standard_normal((1, 4 * hidden, hidden)) * 0.3).astype(np.float32)
    b = (rng.standard_normal((1, 8 * hidden)) * 0.1).astype(np.float32)
    fc = (rng.standard_normal((classes, hidden)) * 0.3).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (r, "R"), (b, "B"), (fc, "fc.weight"))]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "zero"))
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], ["", "h"], hidden_size=hidden),
             helper.make_node("Squeeze", ["h", "zero"], ["h2"]),
             helper.make_node("Gemm", ["h2", "fc.weight"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "lstm", [helper.make_tensor_value_info("x", F, (seq, batch, features))],
                          [helper.make_tensor_value_info("y", F, (batch, classes))], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])


def depthwise_cnn(batch=4, size=16, channels=8, classes=5, seed=0) -> onnx.ModelProto:
    """MobileNet's block: a stem Conv, a depthwise 3x3 stride-2 Conv (group = channels) with BatchNormalization and
    ReLU6 (Clip), a pointwise Conv, global average pooling and a Gemm head."""
    rng = np.random.default_rng(seed)

    def t(name, *shape, scale=0.3):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    c2 = 2 * channels
    inits = [t("stem.weight", channels, 3, 3, 3), t("dw.weight", channels, 1, 3, 3), t("pw.weight", c2, channels, 1, 1),
             t("fc.weight", classes, c2), t("fc.bias", classes, scale=0.1),
             numpy_helper.from_array(np.ones(channels, np.float32), "bn.weight"),
             numpy_helper.from_array(np.zeros(channels, np.float32), "bn.bias"),
             numpy_helper.from_array(np.zeros(channels, np.float32), "bn.running_mean"),
             numpy_helper.from_array(np.ones(channels, np.float32), "bn.running_var"),
             numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array(6, np.float32), "six")]
    nodes = [
        helper.make_node("Conv", ["x", "stem.weight"], ["s"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["s"], ["s1"]),
        helper.make_node("Conv", ["s1", "dw.weight"], ["d"], pads=[1, 1, 1, 1], strides=[2, 2], group=channels),
        helper.make_node("BatchNormalization", ["d", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                         ["n"], epsilon=1e-5, momentum=0.9),
        helper.make_node("Clip", ["n", "zero", "six"], ["r"]),
        helper.make_node("Conv", ["r", "pw.weight"], ["p"]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["y"], transB=1),
    ]
    g = helper.make_graph(nodes, "dw_cnn", [helper.make_tensor_value_info("x", F, (batch, 3, size, size))],
                          [helper.make_tensor_value_info("y", F, (batch, classes))], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])


# name -> (model, CLI arguments, batches(rng, steps))
JOBS: dict[str, tuple[Callable[[], "onnx.ModelProto | Path"], list[str], Callable]] = {
    "mlp": (lambda: MODELS / "mlp_ce_dynamo.onnx", ["--loss", "loss", "--optimizer", "adamw", "--lr", "0.01"],
            lambda rng, n: [{"x": rng.standard_normal((8, 16)).astype(np.float32), "target": rng.integers(0, 4, 8)}
                            for _ in range(n)]),
    "bn_cnn": (lambda: MODELS / "cnn_bn_dynamo.onnx",
               ["--loss-fn", "mse", "--target", "t", "--predictions", "y", "--optimizer", "sgd", "--lr", "0.05",
                "--momentum", "0.9"],
               lambda rng, n: [{"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32),
                                "t": rng.standard_normal((2, 5)).astype(np.float32)} for _ in range(n)]),
    "dw_cnn": (depthwise_cnn, ["--loss-fn", "cross_entropy", "--target", "t", "--predictions", "y", "--optimizer",
                               "sgd", "--lr", "0.05", "--momentum", "0.9"],
               lambda rng, n: [{"x": rng.standard_normal((4, 3, 16, 16)).astype(np.float32),
                                "t": rng.integers(0, 5, 4)} for _ in range(n)]),
    "lstm12": (lstm_classifier, ["--loss-fn", "cross_entropy", "--target", "t", "--predictions", "y",
                                 "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9"],
               lambda rng, n: [{"x": rng.standard_normal((12, 2, 4)).astype(np.float32), "t": rng.integers(0, 3, 2)}
                               for _ in range(n)]),
    "gpt": (lambda: MODELS / "gpt_dynamo.onnx", ["--loss-fn", "mse", "--target", "t", "--predictions", "logits",
                                                 "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"],
            lambda rng, n: [{"idx": rng.integers(0, 32, (2, 8)), "pos": np.tile(np.arange(8), (2, 1)),
                             "t": rng.standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(n)]),
}


def write_job(folder: Path, name: str, steps: int, target: str | None = "webgpu", seed: int = 7,
              extra: tuple[str, ...] = (), stem: str | None = None) -> list[dict]:
    """Write job ``name``'s artifacts (``<stem>.train.onnx`` ..., the CLI's ``extra`` arguments added) and batches
    into ``folder``; returns the batches."""
    model, args, batches_of = JOBS[name]
    source = model()
    stem = stem or name
    path = folder / f"{stem}.onnx"
    if isinstance(source, onnx.ModelProto):
        onnx.save(source, path)
    else:
        shutil.copy(source, path)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main([str(path), *args, *extra, *(["--optimize-for", target] if target else []),
                         "-o", str(folder / f"{stem}.train.onnx")]) == 0
    batches = batches_of(np.random.default_rng(seed), steps)
    save_file({f"{k}/{i}": np.ascontiguousarray(v) for k, b in enumerate(batches) for i, v in b.items()},
              str(folder / f"{stem}.batches.safetensors"))
    return batches
