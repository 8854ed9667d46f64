"""Speed of each onnxgrad.passes.optimize rewrite against the canonical gradient graph, in onnxruntime (CPU).

For every rewrite, a few one-node forward models (a ReLU and the node, for a rewrite of both gradients) at the
shapes it was chosen for (ResNet-18 at 3x112x112 batch 8, bench_step.py's CNN, an MLP's ReLU): the gradient
graph with the canonical adjoints and the same graph with that rewrite alone (or beside the rewrites it pays
with or replaces, ``BESIDE``: those applied to both), run interleaved (median [min] of ``--reps`` runs, ms),
with the ratio rewritten / canonical, and the reason where the rewrite declines (then both columns time the
same graph). A benchmark, not a test: it prints and asserts nothing.

    PYTHONPATH=. python bench/bench_rewrites.py [--reps 20] [REWRITE ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

THREADS = int(os.environ.get("BENCH_THREADS", "2"))

OPSET = 20     # torch.onnx.export's default (torch 2.13); Col2Im needs 18


def _model(op: str, x_shape, w=None, outputs=1, **attrs) -> tuple[onnx.ModelProto, list[str], dict]:
    rng = np.random.default_rng(0)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    names, inits, wrt = ["x"], [], ["x"]
    if w is not None:       # a graph input, as the weights are in a training step (no constant to prepack)
        names.append("w")
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w)))
        feeds["w"] = rng.standard_normal(w).astype(np.float32) * 0.1
        wrt.append("w")
    node = helper.make_node(op, names, ["y"], name=op.lower(), **attrs)
    g = helper.make_graph([node], "bench", inputs, [helper.make_empty_tensor_value_info("y")], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    m = onnx.shape_inference.infer_shapes(m)
    del m.graph.output[:]
    m.graph.output.extend(vi for vi in m.graph.value_info if vi.name == "y")
    del m.graph.value_info[:]
    return m, wrt, feeds


def _relu_then(op: str, x_shape, **attrs) -> tuple[onnx.ModelProto, list[str], dict]:
    """Relu(x) then one ``op`` node: what a rewrite of the two gradients together is timed on."""
    model, wrt, feeds = _model(op, x_shape, **attrs)
    g = model.graph
    g.node[0].input[0] = "r"
    g.node.insert(0, helper.make_node("Relu", ["x"], ["r"], name="relu"))
    return model, wrt, feeds


def _conv(n, c, m, size, k=3, s=1):
    return _model("Conv", (n, c, size, size), (m, c, k, k), pads=[k // 2] * 4, strides=[s, s])


def _depthwise(n, c, size, k=3, s=1):
    return _model("Conv", (n, c, size, size), (c, 1, k, k), pads=[k // 2] * 4, strides=[s, s], group=c)


# ResNet-18's 3x3 stages at 3x112x112, batch 8
RESNET_STAGES = [
    ("resnet layer1 3x3 64->64 28x28 n8", _conv(8, 64, 64, 28)),
    ("resnet layer2 3x3 128->128 14x14 n8", _conv(8, 128, 128, 14)),
    ("resnet layer3 3x3 256->256 7x7 n8", _conv(8, 256, 256, 7)),
    ("resnet layer4 3x3 512->512 4x4 n8", _conv(8, 512, 512, 4)),
]

CASES = {
    "conv_weight_grad_patches": RESNET_STAGES + [
        ("resnet layer2.0 3x3/2 64->128 28x28 n8", _conv(8, 64, 128, 28, s=2)),
        ("resnet downsample 1x1/2 128->256 14x14 n8", _conv(8, 128, 256, 14, k=1, s=2)),
        ("resnet stem 7x7/2 3->64 112x112 n8", _conv(8, 3, 64, 112, k=7, s=2)),
        ("cnn conv2 3x3 32->64 16x16 n32", _conv(32, 32, 64, 16)),
    ],
    # the depthwise convolutions above 64 positions (smaller images are lowered to MatMuls before the gradient) of
    # MobileNetV2 and EfficientNet-B0 at 64x64, batch 4 (bench_families.py)
    "depthwise_weight_grad_patches": [
        ("mobilenet_v2 features.1 dw 3x3 32 32x32 n4", _depthwise(4, 32, 32)),
        ("mobilenet_v2 features.2 dw 3x3/2 96 32x32 n4", _depthwise(4, 96, 32, s=2)),
        ("mobilenet_v2 features.3 dw 3x3 144 16x16 n4", _depthwise(4, 144, 16)),
        ("mobilenet_v2 features.4 dw 3x3/2 144 16x16 n4", _depthwise(4, 144, 16, s=2)),
        ("efficientnet_b0 dw 5x5/2 144 16x16 n4", _depthwise(4, 144, 16, k=5, s=2)),
    ],
    "conv_forward_patches": RESNET_STAGES + [
        ("resnet layer3.0 3x3/2 128->256 14x14 n8", _conv(8, 128, 256, 14, s=2)),
        ("resnet layer4.0 3x3/2 256->512 7x7 n8", _conv(8, 256, 512, 7, s=2)),
        ("resnet downsample 1x1/2 128->256 14x14 n8", _conv(8, 128, 256, 14, k=1, s=2)),
        ("resnet downsample 1x1/2 256->512 7x7 n8", _conv(8, 256, 512, 7, k=1, s=2)),
    ],
    "conv_input_grad_col2im": RESNET_STAGES + [
        ("resnet layer4.0 3x3/2 256->512 7x7 n8", _conv(8, 256, 512, 7, s=2)),
    ],
    "conv_input_grad_flipped": [
        ("3x3 64->32 16x16 n32 (dx wider than dy)", _conv(32, 64, 32, 16)),
        *RESNET_STAGES[:2],
        ("cnn conv2 3x3 32->64 16x16 n32", _conv(32, 32, 64, 16)),
    ],
    "max_pool_taps": [
        ("cnn pool1 2x2 [32,32,32,32]", _model("MaxPool", (32, 32, 32, 32), kernel_shape=[2, 2], strides=[2, 2])),
        ("2x2 [8,64,56,56]", _model("MaxPool", (8, 64, 56, 56), kernel_shape=[2, 2], strides=[2, 2])),
    ],
    "relu_max_pool_taps": [
        ("cnn relu1+pool1 2x2 [32,32,32,32]", _relu_then("MaxPool", (32, 32, 32, 32), kernel_shape=[2, 2],
                                                         strides=[2, 2])),
        ("relu+2x2 [8,64,56,56]", _relu_then("MaxPool", (8, 64, 56, 56), kernel_shape=[2, 2], strides=[2, 2])),
    ],
    "where_zero_as_mul": [
        ("relu [8,64,56,56]", _model("Relu", (8, 64, 56, 56))),
        ("relu [64,512]", _model("Relu", (64, 512))),
    ],
}


# what a rewrite is timed against when it only pays beside others, or replaces them: those applied on both sides
BESIDE = {"conv_forward_patches": ["conv_weight_grad_patches"],
          "relu_max_pool_taps": ["max_pool_taps", "where_zero_as_mul"]}


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time(sess, feeds) -> float:
    t0 = time.perf_counter()
    sess.run(None, feeds)
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str]) -> None:
    import onnxgrad
    from onnxgrad.passes.optimize import optimize

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rewrites", nargs="*", default=list(CASES), metavar="REWRITE")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"{THREADS} intra-op threads; median [min] of {args.reps} interleaved runs, ms")
    print(f"{'rewrite':<26} {'case':<44} {'canonical':>15} {'rewritten':>15} {'ratio':>6}  note")
    for name in args.rewrites:
        for label, (model, wrt, feeds) in CASES[name]:
            gm = onnxgrad.grad(model, wrt=wrt, of=["y"])
            first = len(model.graph.node)
            fast, report = optimize(gm, None, first=first, rewrites=[name, *BESIDE.get(name, [])])
            if name in BESIDE:
                gm, _ = optimize(gm, None, first=first, rewrites=BESIDE[name])
                report.applied = [a for a in report.applied if a[0] == name]
                report.declined = [d for d in report.declined if d[0] == name]
            rng = np.random.default_rng(1)
            seed = next(i for i in gm.graph.input if i.name not in feeds)
            shape = [d.dim_value for d in seed.type.tensor_type.shape.dim]
            all_feeds = {**feeds, seed.name: rng.standard_normal(shape).astype(np.float32)}
            sessions = {"canonical": _session(gm), "rewritten": _session(fast)}
            times: dict[str, list[float]] = {k: [] for k in sessions}
            for s in sessions.values():
                for _ in range(3):
                    s.run(None, all_feeds)
            for _ in range(args.reps):
                for k, s in sessions.items():
                    times[k].append(_time(s, all_feeds))
            med = {k: float(np.median(v)) for k, v in times.items()}
            cell = {k: f"{med[k]:.2f} [{min(v):.2f}]" for k, v in times.items()}
            note = "applied" if report.applied else "declined: " + "; ".join(w for _, _, w in report.declined)
            print(f"{name:<26} {label:<44} {cell['canonical']:>15} {cell['rewritten']:>15} "
                  f"{med['rewritten'] / med['canonical']:>6.2f}  {note}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
