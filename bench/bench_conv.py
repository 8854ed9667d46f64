"""Forward + backward of each of ResNet-18's convolutions and batch norms (3x112x112, batch 8), onnxgrad
against PyTorch.

For every convolution shape of ``bench_step.py``'s ResNet-18, three runs, interleaved (median [min] of
``--reps``, ms), each giving y, dx and dW for a given dy:

- ``ours``: ``onnxgrad.grad`` of the one-Conv model with its CPU rewrites, the weight a graph input as a
  training step binds it;
- ``ours, constant w``: the same graph with the weight an initializer, a constant that onnxruntime
  may reorder for its NCHWc kernels when the session is made; no training step can have this, the
  weight changes every step (it measures what those kernels would be worth);
- ``torch``: ``conv2d`` forward and ``torch.autograd.grad`` (oneDNN on the CPU).

Then each stage's batch norm in training mode followed by ReLU (y, dx, dscale, dB for a given dy): ``ours``
(:func:`onnxgrad.training.train_mode.to_train_mode` then ``grad`` with the CPU rewrites) against PyTorch's
``batch_norm(training=True)`` and ``relu``. The totals weigh each shape by how often ResNet-18 has it. 2 intra-op threads that block when idle, as in
``bench_step.py``. A benchmark, not a test: it prints and asserts nothing.

    PYTHONPATH=. python bench/bench_conv.py [--reps 20]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_step as B  # noqa: E402  (sets the OpenMP environment before torch is imported)
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from bench_rewrites import _conv  # noqa: E402  (the one-Conv model, the weight a graph input)

# (label, count in ResNet-18, batch, in channels, out channels, image size, kernel, stride)
SHAPES = [
    ("stem 7x7/2 3->64 112", 1, 8, 3, 64, 112, 7, 2),
    ("layer1 3x3 64 28", 4, 8, 64, 64, 28, 3, 1),
    ("layer2.0 3x3/2 64->128 28", 1, 8, 64, 128, 28, 3, 2),
    ("layer2 3x3 128 14", 3, 8, 128, 128, 14, 3, 1),
    ("downsample 1x1/2 64->128 28", 1, 8, 64, 128, 28, 1, 2),
    ("layer3.0 3x3/2 128->256 14", 1, 8, 128, 256, 14, 3, 2),
    ("layer3 3x3 256 7", 3, 8, 256, 256, 7, 3, 1),
    ("downsample 1x1/2 128->256 14", 1, 8, 128, 256, 14, 1, 2),
    ("layer4.0 3x3/2 256->512 7", 1, 8, 256, 512, 7, 3, 2),
    ("layer4 3x3 512 4", 3, 8, 512, 512, 4, 3, 1),
    ("downsample 1x1/2 256->512 7", 1, 8, 256, 512, 7, 1, 2),
]


def _constant_weight(model: onnx.ModelProto, w: np.ndarray) -> onnx.ModelProto:
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    inputs = [i for i in out.graph.input if i.name != "w"]
    del out.graph.input[:]
    out.graph.input.extend(inputs)
    out.graph.initializer.append(numpy_helper.from_array(w, "w"))
    return out


def _interleaved(runs: dict, reps: int) -> tuple[dict[str, float], dict[str, str]]:
    """Each run warmed up, then timed ``reps`` times in interleaved rounds: the medians, and 'median [min]'
    cells, in ms."""
    for fn in runs.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(reps):
        for key, fn in runs.items():
            times[key].append(B._time(fn))
    med = {key: float(np.median(v)) for key, v in times.items()}
    return med, {key: f"{med[key]:.2f} [{min(times[key]):.2f}]" for key in runs}


def main(argv: list[str]) -> None:
    import torch

    import onnxgrad

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(B.THREADS)
    print(f"{B.THREADS} intra-op threads; fwd + bwd of one Conv, median [min] of {args.reps} interleaved runs, ms")
    print(f"{'conv':<30} {'x':>2} {'ours':>15} {'ours, constant w':>17} {'torch':>15} {'ours/torch':>10}")
    totals = {"ours": 0.0, "constant": 0.0, "torch": 0.0}
    for label, count, n, c, m, size, k, s in SHAPES:
        model, wrt, feeds = _conv(n, c, m, size, k=k, s=s)
        x, w = feeds["x"], feeds["w"]
        gm = onnxgrad.grad(model, wrt=wrt, of=["y"], target="cpu")
        seed = next(i for i in gm.graph.input if i.name not in ("x", "w"))
        rng = np.random.default_rng(1)
        dy = rng.standard_normal([d.dim_value for d in seed.type.tensor_type.shape.dim]).astype(np.float32)
        ours, constant = B.ort_session(gm), B.ort_session(_constant_weight(gm, w))
        tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))
        tx.requires_grad_(True)
        tw.requires_grad_(True)

        def torch_step():
            y = torch.nn.functional.conv2d(tx, tw, stride=s, padding=k // 2)
            return torch.autograd.grad(y, (tx, tw), tdy)

        runs = {"ours": lambda: ours.run(None, {"x": x, "w": w, seed.name: dy}),
                "constant": lambda: constant.run(None, {"x": x, seed.name: dy}),
                "torch": torch_step}
        med, cell = _interleaved(runs, args.reps)
        for key in totals:
            totals[key] += count * med[key]
        print(f"{label:<30} {count:>2} {cell['ours']:>15} {cell['constant']:>17} {cell['torch']:>15} "
              f"{med['ours'] / med['torch']:>10.2f}", flush=True)
    print(f"{'ResNet-18 total (x count)':<33} {totals['ours']:>15.1f} {totals['constant']:>17.1f} "
          f"{totals['torch']:>15.1f} {totals['ours'] / totals['torch']:>10.2f}")
    batch_norms(args.reps)


# (label, count in ResNet-18: a block's two batch norms, each followed by a ReLU, the second through the
# residual Add; batch, channels, image size)
BN_SHAPES = [("stem 64 56", 1, 8, 64, 56), ("layer1 64 28", 4, 8, 64, 28), ("layer2 128 14", 4, 8, 128, 14),
             ("layer3 256 7", 4, 8, 256, 7), ("layer4 512 4", 4, 8, 512, 4)]


def _bn_relu_model(n, c, size) -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, size, size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, c, size, size])
    stats = [numpy_helper.from_array(np.full(c, v, np.float32), name)
             for name, v in (("scale", 1.0), ("bias", 0.0), ("mean", 0.0), ("var", 1.0))]
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["z"], name="bn"),
             helper.make_node("Relu", ["z"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(nodes, "bn_relu", [x], [y], stats),
                              opset_imports=[helper.make_opsetid("", B.OPSET)])
    model.ir_version = 8
    return model


def batch_norms(reps: int) -> None:
    import torch

    import onnxgrad
    from onnxgrad.training.train_mode import to_train_mode

    print(f"\n{'batch norm (training) + ReLU':<30} {'x':>2} {'ours':>15} {'torch':>15} {'ours/torch':>10}")
    totals = {"ours": 0.0, "torch": 0.0}
    for label, count, n, c, size in BN_SHAPES:
        gm = onnxgrad.grad(to_train_mode(_bn_relu_model(n, c, size)).model, wrt=["x", "scale", "bias"], of=["y"],
                           target="cpu")
        rng = np.random.default_rng(0)
        x = rng.standard_normal([n, c, size, size]).astype(np.float32)
        seed = next(i for i in gm.graph.input if i.name != "x")
        dy = rng.standard_normal([n, c, size, size]).astype(np.float32)
        ours, outputs = B.ort_session(gm), [o.name for o in gm.graph.output]
        tx, tdy = torch.from_numpy(x).requires_grad_(True), torch.from_numpy(dy)
        scale, bias = torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)
        mean, var = torch.zeros(c), torch.ones(c)

        def torch_step():
            y = torch.relu(torch.nn.functional.batch_norm(tx, mean, var, scale, bias, training=True))
            return torch.autograd.grad(y, (tx, scale, bias), tdy)

        runs = {"ours": lambda: ours.run(outputs, {"x": x, seed.name: dy}), "torch": torch_step}
        med, cell = _interleaved(runs, reps)
        for key in totals:
            totals[key] += count * med[key]
        print(f"{label:<30} {count:>2} {cell['ours']:>15} {cell['torch']:>15} {med['ours'] / med['torch']:>10.2f}",
              flush=True)
    print(f"{'ResNet-18 total (x count)':<33} {totals['ours']:>15.1f} {totals['torch']:>15.1f} "
          f"{totals['ours'] / totals['torch']:>10.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
