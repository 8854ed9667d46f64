"""The digits page's files: the UCI handwritten digits (8x8, as scikit-learn ships them) as a small safetensors file,
a small CNN written with onnx.helper (random weights, no torch), and its training artifacts written by the CLI for
the webgpu target (they also run on wasm). Run once from the repository root; the outputs are committed:

    python examples/browser/make.py            # needs scikit-learn for the data (pip install scikit-learn)
"""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
BATCH = 32
CLASSES = 10


def digits() -> tuple[np.ndarray, np.ndarray]:
    """1797 images (uint8, 0..16) and labels, shuffled once with a fixed seed."""
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    return d.images[order].astype(np.uint8), d.target[order].astype(np.uint8)


def cnn(seed: int = 0) -> onnx.ModelProto:
    """x [32, 1, 8, 8] -> Conv 3x3 (8) -> ReLU -> MaxPool 2x2 -> Conv 3x3 (16) -> ReLU -> MaxPool 2x2 -> Gemm (10)."""
    rng = np.random.default_rng(seed)

    def he(name, *shape):
        fan_in = int(np.prod(shape[1:]))
        return numpy_helper.from_array((rng.standard_normal(shape) * np.sqrt(2 / fan_in)).astype(np.float32), name)

    def zeros(name, n):
        return numpy_helper.from_array(np.zeros(n, np.float32), name)

    inits = [he("conv1.weight", 8, 1, 3, 3), zeros("conv1.bias", 8), he("conv2.weight", 16, 8, 3, 3),
             zeros("conv2.bias", 16), he("fc.weight", CLASSES, 64), zeros("fc.bias", CLASSES)]
    nodes = [
        helper.make_node("Conv", ["x", "conv1.weight", "conv1.bias"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1),
    ]
    g = helper.make_graph(nodes, "digits_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (BATCH, 1, 8, 8))],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, (BATCH, CLASSES))], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def main() -> int:
    from safetensors.numpy import save_file

    from onnxgrad.tools.cli import main as cli_main

    images, labels = digits()
    save_file({"images": images, "labels": labels}, str(HERE / "digits.safetensors"))
    out = HERE / "artifacts"
    out.mkdir(exist_ok=True)
    onnx.save(cnn(), out / "digits.onnx")
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli_main([str(out / "digits.onnx"), "--loss-fn", "cross_entropy", "--target", "y", "--predictions",
                         "logits", "--optimizer", "adamw", "--lr", "0.01", "--optimize-for", "webgpu",
                         "-o", str(out / "digits.train.onnx")])
    print(f"wrote {HERE / 'digits.safetensors'} ({len(labels)} images) and {out}/digits.*")
    return code


if __name__ == "__main__":
    sys.exit(main())
