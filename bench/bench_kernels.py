"""Single onnxruntime CPU kernels behind the cpu target's choices, each form timed alone (2 threads, median of 50
runs after 5; onnxruntime's profiler's kernel time for the broadcasts, wall time per run for the convolutions):

- ``broadcast``: ``Mul`` of a tensor by a scalar, where the tensor's last axis is 1 (a 1x1 convolution's weight,
  ``[1280, 320, 1, 1]``) against the same values flat and the scalar at the tensor's rank
  (``onnxgrad.passes.optimize.broadcast``);
- ``depthwise``: a depthwise Conv (group = channels, the weight an input as in a training step) against PyTorch's
  ``conv2d`` and against the tap-matrix MatMuls of ``onnxgrad.passes.optimize.depthwise``, at MobileNet's and
  EfficientNet's shapes.

    python bench/bench_kernels.py [broadcast] [depthwise]
"""
from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

THREADS = 2
DEPTHWISE_SHAPES = [(4, 672, 4, 5), (4, 1152, 2, 5), (4, 240, 8, 5), (4, 144, 16, 3), (4, 96, 32, 3),
                    (4, 144, 56, 3)]       # (batch, channels, image side, kernel side)


def _session(nodes, inputs, outputs, inits=(), profile=False):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level, so.enable_profiling = THREADS, 3, profile
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _wall_ms(fn, n=50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def broadcast() -> None:
    print("Mul(x, s), kernel time (onnxruntime's profiler, median of 50 runs), us")
    f = TensorProto.FLOAT
    for shape, scalar in (([1280, 320, 1, 1], []), ([409600], []), ([1280, 320, 1, 1], [1]),
                          ([1280, 320, 1, 1], [1, 1, 1, 1]), ([1280, 320], [])):
        s = _session([helper.make_node("Mul", ["x", "s"], ["y"])],
                     [helper.make_tensor_value_info("x", f, shape), helper.make_tensor_value_info("s", f, scalar)],
                     [helper.make_tensor_value_info("y", f, shape)], profile=True)
        feeds = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32),
                 "s": np.full(scalar, 0.9, np.float32)}
        for _ in range(55):
            s.run(None, feeds)
        kernels = collections.defaultdict(list)
        with open(s.end_profiling()) as fh:
            for e in json.load(fh):
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                    kernels[e["name"]].append(e["dur"])
        us = statistics.median(next(iter(kernels.values()))[5:])
        print(f"  x {str(shape):18s} s {str(scalar):14s} {us:8.1f}")


def depthwise() -> None:
    import torch

    from onnxgrad.passes.optimize.depthwise import tap_matrix

    torch.set_num_threads(THREADS)
    f = TensorProto.FLOAT
    print("depthwise Conv, wall ms per run (median of 50): onnxruntime's Conv, PyTorch's conv2d, the tap-matrix "
          "MatMuls")
    for n, c, side, k in DEPTHWISE_SHAPES:
        pad = k // 2
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, c, side, side)).astype(np.float32)
        w = rng.standard_normal((c, 1, k, k)).astype(np.float32)
        xs, ws = (helper.make_tensor_value_info("x", f, x.shape), helper.make_tensor_value_info("w", f, w.shape))
        conv = _session([helper.make_node("Conv", ["x", "w"], ["y"], group=c, pads=[pad] * 4)], [xs, ws],
                        [helper.make_tensor_value_info("y", f, x.shape)])
        p = side * side
        taps = tap_matrix((side, side), (side, side), (k, k), [1, 1], [1, 1], [pad] * 4).reshape(k * k, -1) \
            if p <= 256 else np.zeros((1, 1))
        ints = {"wshape": [c, k * k], "tshape": [c, p, p], "xshape": [n, c, p], "yshape": [n, c, side, side]}
        matmuls = None if p > 256 else _session([     # above 256 positions the tap matrices take gigabytes
            helper.make_node("Reshape", ["w", "wshape"], ["wf"]), helper.make_node("MatMul", ["wf", "taps"], ["tf"]),
            helper.make_node("Reshape", ["tf", "tshape"], ["t"]), helper.make_node("Reshape", ["x", "xshape"], ["xr"]),
            helper.make_node("Transpose", ["xr"], ["xc"], perm=[1, 0, 2]), helper.make_node("MatMul", ["xc", "t"], ["yc"]),
            helper.make_node("Transpose", ["yc"], ["yr"], perm=[1, 0, 2]),
            helper.make_node("Reshape", ["yr", "yshape"], ["y"])], [xs, ws],
            [helper.make_tensor_value_info("y", f, x.shape)],
            [numpy_helper.from_array(taps.astype(np.float32), "taps")]
            + [numpy_helper.from_array(np.array(v, np.int64), k_) for k_, v in ints.items()])
        want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=pad, groups=c).numpy()
        if matmuls is not None:
            np.testing.assert_allclose(matmuls.run(None, {"x": x, "w": w})[0], want, rtol=1e-4, atol=1e-4)
        feeds, xt, wt = {"x": x, "w": w}, torch.from_numpy(x), torch.from_numpy(w)
        ours = _wall_ms(lambda: conv.run(None, feeds))
        theirs = _wall_ms(lambda: torch.nn.functional.conv2d(xt, wt, padding=pad, groups=c))
        tapped = f"{_wall_ms(lambda: matmuls.run(None, feeds)):6.3f}" if matmuls is not None else "     -"
        print(f"  [{n}, {c}, {side}, {side}] {k}x{k}: Conv {ours:6.3f}  PyTorch {theirs:6.3f}  ({ours / theirs:4.1f}x)  "
              f"tap MatMuls {tapped}")


def main(argv: list[str]) -> int:
    for name in argv or ["broadcast", "depthwise"]:
        {"broadcast": broadcast, "depthwise": depthwise}[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
