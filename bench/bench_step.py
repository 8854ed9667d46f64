"""Speed of a training step: onnxgrad.TrainingSession (AdamW) vs the onnxruntime forward and PyTorch eager.

Four models are built here with onnx.helper (no torch needed to build them):

- ``mlp``: 784-512-512-10 MLP (Gemm transB=1, ReLU), batch 64, cross-entropy;
- ``cnn``: [3x3 conv (pad 1) + ReLU + 2x2 max-pool] with 32 then 64 channels on
  3x32x32 input, Flatten, Linear to 10 classes, batch 32, cross-entropy;
- ``transformer``: one pre-LayerNorm block, d_model 256, 4 heads, seq 128,
  MLP 1024 with erf-GELU, explicit softmax attention (MatMul, Softmax), batch 8, MSE;
- ``resnet18``: torchvision's ResNet-18 layout (Conv without bias + BatchNormalization, trained in
  train mode), 3x112x112, batch 8, 100 classes, cross-entropy;
- ``resnet18_export`` (only when named; needs torch and onnxscript): the same network as a torch.nn.Module,
  exported by ``torch.onnx.export(dynamo=True, optimize=False)`` as a user exports it for training.

For each model it prints, measured interleaved in one run after warm-up
(median [min] of ``--reps`` single calls, in ms): the build time (artifacts,
i.e. grad + training graph, plus session creation, in s), the onnxruntime
forward (weights as initializers), the gradient graph (the step without its update: forward in
training mode + loss + backward, weights as graph inputs as the step binds them, so that step - gradient
is what the update and its guard cost), the TrainingSession AdamW step,
the ratios step/forward and gradient/forward, and, when torch is importable,
PyTorch eager's step (zero_grad, forward, loss, backward, AdamW.step) on the
same weights and batch, and the same step with the forward and loss through ``torch.compile``
(compiled during warm-up; ``--no-compile`` skips it), and PyTorch eager's step without ``AdamW.step``: a
line under each model splits both steps into the update (step - gradient) and the forward and backward.
Another gives the same forward with its weights as graph inputs, as the step binds them (no weight prepacked or
reordered for the NCHWc convolutions, no batch norm folded into a Conv: what no training step can use) and the
step and gradient over it: the ratio that a step's arithmetic, about three forwards, bounds from below.
Another times the same step with the batch axis symbolic, as an export with a dynamic batch axis has it (the
CPU rewrites once declined it: the CNN's and ResNet-18's steps 1.7x). ``--recompute`` adds the step of a
``TrainingSession(recompute=True)`` (:mod:`onnxgrad.passes.recompute`). Every framework runs with 2 intra-op threads
(``BENCH_THREADS``) whose idle threads block rather than spin: on shared,
oversubscribed cores (where this was written) spinning threads stall the other
side for whole scheduler slices and medians swing 2-10x. On a machine with free
cores, ``BENCH_SPIN=1`` (onnxruntime's and OpenMP's default) is faster for both:
the MLP step took 1.7 ms spinning against 2.6 ms blocking. ``--memory`` adds ``bench_memory.py``'s
measurement: each framework in a fresh process, the peak RSS of building the trainer and of a 20-step
loop above the process with the model built, and the ratio to PyTorch eager's.
``--profile MODEL`` prints onnxruntime's per-node profile of the step and of the forward.

    /tmp/torchvenv/bin/python bench/bench_step.py                 # all models, with PyTorch
    /tmp/torchvenv/bin/python bench/bench_step.py mlp --memory
    /tmp/venv/bin/python bench/bench_step.py --profile transformer

A benchmark, not a test: it prints times and asserts nothing about them. The
machine is shared, so timings are noisy: the measurements are interleaved and
reported as medians, with the minimum (the cost without interference) beside them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

THREADS = int(os.environ.get("BENCH_THREADS", "2"))
SPIN = os.environ.get("BENCH_SPIN", "0") == "1"   # idle intra-op threads busy-wait (both frameworks)
# set before torch (OpenMP) is imported: measured on 2 shared cores, PyTorch's MLP step took 46 ms with its
# threads spinning against onnxruntime's and 10 ms with them blocking
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE" if SPIN else "PASSIVE")

import numpy as np
import onnx
import published
from onnx import TensorProto, helper, numpy_helper

OPSET = 20     # torch.onnx.export's default (torch 2.13), as a new user exports


# -- the models ----------------------------------------------------------------------------------
@dataclass
class Bench:
    name: str
    forward: onnx.ModelProto            # weights as initializers
    output: str
    loss: Any                           # an onnxgrad.losses loss (callable model -> model)
    feeds: dict[str, np.ndarray]        # forward inputs
    target: dict[str, np.ndarray]       # the loss's target input
    weights: dict[str, np.ndarray]
    torch_step: Callable[..., Callable[[], float]] | None = None    # (weights, compile, update, device) -> step


def _init(rng, shape, fan_in) -> np.ndarray:
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def _model(nodes, inputs, outputs, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    g = helper.make_graph(nodes, "bench", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def mlp(batch: int = 64) -> Bench:
    from onnxgrad import losses

    rng = np.random.default_rng(0)
    sizes = [784, 512, 512, 10]
    w: dict[str, np.ndarray] = {}
    nodes, h = [], "x"
    for i, (k, n) in enumerate(zip(sizes, sizes[1:])):
        w[f"fc{i}.weight"] = _init(rng, (n, k), k)
        w[f"fc{i}.bias"] = _init(rng, (n,), k)
        out = "logits" if i == len(sizes) - 2 else f"h{i}"
        pre = out if i == len(sizes) - 2 else f"z{i}"
        nodes.append(helper.make_node("Gemm", [h, f"fc{i}.weight", f"fc{i}.bias"], [pre], transB=1, name=f"fc{i}"))
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [pre], [out], name=f"relu{i}"))
        h = out
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 784])],
               [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])], w)
    feeds = {"x": rng.standard_normal((batch, 784)).astype(np.float32)}
    target = {"y": rng.integers(0, 10, batch).astype(np.int64)}

    def torch_step(params, compile: bool = False, update: bool = True, device: str = "cpu"):
        import torch
        import torch.nn.functional as F

        p = {k: torch.nn.Parameter(_tensor(v.copy(), device)) for k, v in params.items()}
        x, y = _tensor(feeds["x"], device), _tensor(target["y"], device)

        def loss_fn():
            h = x
            for i in range(3):
                h = F.linear(h, p[f"fc{i}.weight"], p[f"fc{i}.bias"])
                if i < 2:
                    h = F.relu(h)
            return F.cross_entropy(h, y)
        return _torch_adamw(p, loss_fn, compile, update)

    return Bench("mlp", m, "logits", losses.CrossEntropyLoss(output="logits", target="y"), feeds, target, w,
                 torch_step)


def cnn(batch: int = 32) -> Bench:
    from onnxgrad import losses

    rng = np.random.default_rng(1)
    w = {"conv1.weight": _init(rng, (32, 3, 3, 3), 27), "conv1.bias": _init(rng, (32,), 27),
         "conv2.weight": _init(rng, (64, 32, 3, 3), 288), "conv2.bias": _init(rng, (64,), 288),
         "fc.weight": _init(rng, (10, 64 * 8 * 8), 64 * 8 * 8), "fc.bias": _init(rng, (10,), 64 * 8 * 8)}
    nodes, h = [], "x"
    for i in (1, 2):
        nodes += [helper.make_node("Conv", [h, f"conv{i}.weight", f"conv{i}.bias"], [f"c{i}"],
                                   kernel_shape=[3, 3], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"),
                  helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2],
                                   name=f"pool{i}")]
        h = f"p{i}"
    nodes += [helper.make_node("Flatten", [h], ["flat"], axis=1, name="flatten"),
              helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 32, 32])],
               [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 10])], w)
    feeds = {"x": rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)}
    target = {"y": rng.integers(0, 10, batch).astype(np.int64)}

    def torch_step(params, compile: bool = False, update: bool = True, device: str = "cpu"):
        import torch
        import torch.nn.functional as F

        p = {k: torch.nn.Parameter(_tensor(v.copy(), device)) for k, v in params.items()}
        x, y = _tensor(feeds["x"], device), _tensor(target["y"], device)

        def loss_fn():
            h = x
            for i in (1, 2):
                h = F.max_pool2d(F.relu(F.conv2d(h, p[f"conv{i}.weight"], p[f"conv{i}.bias"], padding=1)), 2)
            return F.cross_entropy(F.linear(h.flatten(1), p["fc.weight"], p["fc.bias"]), y)
        return _torch_adamw(p, loss_fn, compile, update)

    return Bench("cnn", m, "logits", losses.CrossEntropyLoss(output="logits", target="y"), feeds, target, w,
                 torch_step)


def transformer(batch: int = 8, seq: int = 128, d: int = 256, heads: int = 4, hidden: int = 1024) -> Bench:
    from onnxgrad import losses

    rng = np.random.default_rng(2)
    hd = d // heads
    w = {"ln1.weight": np.ones(d, np.float32) + 0.1 * rng.standard_normal(d).astype(np.float32),
         "ln1.bias": 0.1 * rng.standard_normal(d).astype(np.float32)}
    for k in ("q", "k", "v", "o"):
        w[f"{k}.weight"] = _init(rng, (d, d), d)      # stored [in, out]: y = x @ W + b
        w[f"{k}.bias"] = _init(rng, (d,), d)
    w["ln2.weight"] = np.ones(d, np.float32) + 0.1 * rng.standard_normal(d).astype(np.float32)
    w["ln2.bias"] = 0.1 * rng.standard_normal(d).astype(np.float32)
    w["fc1.weight"], w["fc1.bias"] = _init(rng, (d, hidden), d), _init(rng, (hidden,), d)
    w["fc2.weight"], w["fc2.bias"] = _init(rng, (hidden, d), hidden), _init(rng, (d,), hidden)
    consts = {"split_heads": np.array([batch, seq, heads, hd], np.int64),
              "merge_heads": np.array([batch, seq, d], np.int64),
              "scale": np.array(1.0 / np.sqrt(hd), np.float32),
              "half": np.array(0.5, np.float32), "one": np.array(1.0, np.float32),
              "inv_sqrt2": np.array(1.0 / np.sqrt(2.0), np.float32)}
    N = helper.make_node
    nodes = [N("Constant", [], [k], value=numpy_helper.from_array(v, k), name=f"const_{k}") for k, v in consts.items()]

    def linear(x, name, out):
        return [N("MatMul", [x, f"{name}.weight"], [f"{out}_mm"], name=f"{name}/MatMul"),
                N("Add", [f"{out}_mm", f"{name}.bias"], [out], name=f"{name}/Add")]

    nodes.append(N("LayerNormalization", ["x", "ln1.weight", "ln1.bias"], ["ln1"], axis=-1, epsilon=1e-5,
                   name="ln1"))
    for k in ("q", "k", "v"):
        nodes += linear("ln1", k, k)
        nodes += [N("Reshape", [k, "split_heads"], [f"{k}_4d"], name=f"{k}/split"),
                  N("Transpose", [f"{k}_4d"], [f"{k}_h"], perm=[0, 2, 3, 1] if k == "k" else [0, 2, 1, 3],
                    name=f"{k}/transpose")]
    nodes += [N("MatMul", ["q_h", "k_h"], ["scores_raw"], name="attn/qk"),
              N("Mul", ["scores_raw", "scale"], ["scores"], name="attn/scale"),
              N("Softmax", ["scores"], ["probs"], axis=-1, name="attn/softmax"),
              N("MatMul", ["probs", "v_h"], ["ctx_h"], name="attn/pv"),
              N("Transpose", ["ctx_h"], ["ctx_t"], perm=[0, 2, 1, 3], name="attn/merge_t"),
              N("Reshape", ["ctx_t", "merge_heads"], ["ctx"], name="attn/merge")]
    nodes += linear("ctx", "o", "attn_out")
    nodes += [N("Add", ["x", "attn_out"], ["res1"], name="res1"),
              N("LayerNormalization", ["res1", "ln2.weight", "ln2.bias"], ["ln2"], axis=-1, epsilon=1e-5,
                name="ln2")]
    nodes += linear("ln2", "fc1", "h1")
    nodes += [N("Mul", ["h1", "inv_sqrt2"], ["h1_s"], name="gelu/scale"),
              N("Erf", ["h1_s"], ["h1_erf"], name="gelu/erf"),
              N("Add", ["h1_erf", "one"], ["h1_1p"], name="gelu/add"),
              N("Mul", ["h1", "h1_1p"], ["h1_x"], name="gelu/mul"),
              N("Mul", ["h1_x", "half"], ["gelu"], name="gelu/half")]
    nodes += linear("gelu", "fc2", "mlp_out")
    nodes.append(N("Add", ["res1", "mlp_out"], ["out"], name="res2"))
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, d])],
               [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, seq, d])], w)
    feeds = {"x": rng.standard_normal((batch, seq, d)).astype(np.float32)}
    target = {"target": rng.standard_normal((batch, seq, d)).astype(np.float32)}

    def torch_step(params, compile: bool = False, update: bool = True, device: str = "cpu"):
        import torch
        import torch.nn.functional as F

        p = {k: torch.nn.Parameter(_tensor(v.copy(), device)) for k, v in params.items()}
        x, t = _tensor(feeds["x"], device), _tensor(target["target"], device)

        def loss_fn():
            h = F.layer_norm(x, (d,), p["ln1.weight"], p["ln1.bias"], 1e-5)
            q, k, v = (torch.matmul(h, p[f"{n}.weight"]) + p[f"{n}.bias"] for n in "qkv")
            q, v = (z.reshape(batch, seq, heads, hd).transpose(1, 2) for z in (q, v))
            k = k.reshape(batch, seq, heads, hd).permute(0, 2, 3, 1)
            probs = torch.softmax(torch.matmul(q, k) * (1.0 / np.sqrt(hd)), dim=-1)
            ctx = torch.matmul(probs, v).transpose(1, 2).reshape(batch, seq, d)
            r = x + torch.matmul(ctx, p["o.weight"]) + p["o.bias"]
            h = F.layer_norm(r, (d,), p["ln2.weight"], p["ln2.bias"], 1e-5)
            h = F.gelu(torch.matmul(h, p["fc1.weight"]) + p["fc1.bias"])
            out = r + torch.matmul(h, p["fc2.weight"]) + p["fc2.bias"]
            return F.mse_loss(out, t)
        return _torch_adamw(p, loss_fn, compile, update)

    return Bench("transformer", m, "out", losses.MSELoss(output="out", target="target"), feeds, target, w,
                 torch_step)


def resnet18(batch: int = 8, size: int = 112, classes: int = 100) -> Bench:
    """ResNet-18 (torchvision's layout: 7x7/2 stem, 3x3/2 max-pool, four stages of two basic blocks,
    1x1/2 projection shortcuts, global average pool, Linear), Conv without bias + BatchNormalization."""
    from onnxgrad import losses

    rng = np.random.default_rng(3)
    w: dict[str, np.ndarray] = {}
    N = helper.make_node
    nodes: list[onnx.NodeProto] = []
    plan: list[tuple] = []            # the same network for PyTorch: ("conv", name, stride, pad) / ("relu",) ...

    def conv_bn(x: str, name: str, cin: int, cout: int, k: int, stride: int, relu: bool) -> str:
        w[f"{name}.weight"] = _init(rng, (cout, cin, k, k), cin * k * k)
        w[f"{name}.bn.weight"] = np.ones(cout, np.float32)
        w[f"{name}.bn.bias"] = np.zeros(cout, np.float32)
        w[f"{name}.bn.running_mean"] = np.zeros(cout, np.float32)
        w[f"{name}.bn.running_var"] = np.ones(cout, np.float32)
        nodes.append(N("Conv", [x, f"{name}.weight"], [f"{name}_c"], kernel_shape=[k, k], strides=[stride, stride],
                       pads=[k // 2] * 4, name=name))
        nodes.append(N("BatchNormalization", [f"{name}_c", f"{name}.bn.weight", f"{name}.bn.bias",
                                              f"{name}.bn.running_mean", f"{name}.bn.running_var"],
                       [f"{name}_bn"], epsilon=1e-5, momentum=0.9, name=f"{name}.bn"))
        if not relu:
            return f"{name}_bn"
        nodes.append(N("Relu", [f"{name}_bn"], [f"{name}_r"], name=f"{name}.relu"))
        return f"{name}_r"

    h = conv_bn("x", "conv1", 3, 64, 7, 2, True)
    nodes.append(N("MaxPool", [h], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], name="maxpool"))
    h, cin = "pool", 64
    for stage, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            name, stride = f"layer{stage}.{block}", (2 if stage > 1 and block == 0 else 1)
            a = conv_bn(h, f"{name}.conv1", cin, cout, 3, stride, True)
            b = conv_bn(a, f"{name}.conv2", cout, cout, 3, 1, False)
            short = conv_bn(h, f"{name}.downsample", cin, cout, 1, stride, False) if stride != 1 or cin != cout else h
            nodes += [N("Add", [b, short], [f"{name}_sum"], name=f"{name}.add"),
                      N("Relu", [f"{name}_sum"], [f"{name}_out"], name=f"{name}.relu")]
            plan.append((name, stride, stride != 1 or cin != cout))
            h, cin = f"{name}_out", cout
    w["fc.weight"], w["fc.bias"] = _init(rng, (classes, 512), 512), _init(rng, (classes,), 512)
    nodes += [N("GlobalAveragePool", [h], ["gap"], name="avgpool"),
              N("Flatten", ["gap"], ["flat"], axis=1, name="flatten"),
              N("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])],
               [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], w)
    feeds = {"x": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}
    target = {"y": rng.integers(0, classes, batch).astype(np.int64)}

    def torch_step(params, compile: bool = False, update: bool = True, device: str = "cpu"):
        import torch
        import torch.nn.functional as F

        trainable = {k: torch.nn.Parameter(_tensor(v.copy(), device)) for k, v in params.items() if "running" not in k}
        stats = {k: _tensor(v.copy(), device) for k, v in params.items() if "running" in k}
        x, y = _tensor(feeds["x"], device), _tensor(target["y"], device)

        def cbr(h, name, stride, relu):
            k = trainable[f"{name}.weight"].shape[-1]
            h = F.conv2d(h, trainable[f"{name}.weight"], stride=stride, padding=k // 2)
            h = F.batch_norm(h, stats[f"{name}.bn.running_mean"], stats[f"{name}.bn.running_var"],
                             trainable[f"{name}.bn.weight"], trainable[f"{name}.bn.bias"], training=True,
                             momentum=0.1, eps=1e-5)
            return F.relu(h) if relu else h

        def loss_fn():
            h = F.max_pool2d(cbr(x, "conv1", 2, True), 3, 2, 1)
            for name, stride, project in plan:
                a = cbr(h, f"{name}.conv1", stride, True)
                b = cbr(a, f"{name}.conv2", 1, False)
                h = F.relu(b + (cbr(h, f"{name}.downsample", stride, False) if project else h))
            h = F.adaptive_avg_pool2d(h, 1).flatten(1)
            return F.cross_entropy(F.linear(h, trainable["fc.weight"], trainable["fc.bias"]), y)
        return _torch_adamw(trainable, loss_fn, compile, update)

    return Bench("resnet18", m, "logits", losses.CrossEntropyLoss(output="logits", target="y"), feeds, target, w,
                 torch_step)


def resnet18_export(batch: int = 8, size: int = 112, classes: int = 100) -> Bench:
    """The same ResNet-18 as a torch.nn.Module, exported as a user exports it for training:
    ``torch.onnx.export(dynamo=True, optimize=False)`` (the optimizer would fold the batch norms into the
    convolutions), the exporter's own node names and attributes; PyTorch trains the module itself. Needs
    torch and onnxscript (not run by default). The export is cached in the temporary folder (the module's
    weights come from a fixed seed, so a later process builds the same module and loads the same model):
    ``--memory``'s fresh processes load it rather than carry the export's heap."""
    import copy

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import onnxgrad
    from onnxgrad import losses

    def conv_bn(cin, cout, k, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1, self.conv2 = conv_bn(cin, cout, 3, stride), conv_bn(cout, cout, 3, 1)
            self.downsample = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

        def forward(self, x):
            h = self.conv2(F.relu(self.conv1(x)))
            return F.relu(h + (self.downsample(x) if self.downsample is not None else x))

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, blocks, cin = conv_bn(3, 64, 7, 2), [], 64
            for stage, cout in enumerate((64, 128, 256, 512)):
                for block in range(2):
                    blocks.append(Block(cin, cout, 2 if stage and not block else 1))
                    cin = cout
            self.blocks, self.fc = nn.Sequential(*blocks), nn.Linear(512, classes)

        def forward(self, x):
            h = self.blocks(F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1))
            return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))

    torch.manual_seed(3)
    net = ResNet18().train()
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}
    target = {"y": rng.integers(0, classes, batch).astype(np.int64)}
    # exported once per shape and cached: a process that only loads it does not carry the export's heap
    cache = os.path.join(tempfile.gettempdir(), f"onnxgrad_bench_resnet18_export_{batch}_{size}_{classes}.onnx")
    if os.path.exists(cache):
        m = onnx.load(cache)
    else:
        m = torch.onnx.export(copy.deepcopy(net), (torch.from_numpy(feeds["x"]),), dynamo=True, optimize=False,
                              input_names=["x"], output_names=["logits"], verbose=False).model_proto
        onnx.save(m, cache + ".part")
        os.replace(cache + ".part", cache)
    loss = losses.CrossEntropyLoss(output="logits", target="y")
    trainable = onnxgrad.parameters(loss(m), loss="loss").trainable
    weights = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer if i.name in trainable}

    def torch_step(params, compile: bool = False, update: bool = True, device: str = "cpu"):
        module = copy.deepcopy(net).to(device)
        x, y = _tensor(feeds["x"], device), _tensor(target["y"], device)
        return _torch_adamw(dict(module.named_parameters()), lambda: F.cross_entropy(module(x), y), compile,
                            update)

    return Bench("resnet18_export", m, "logits", loss, feeds, target, weights, torch_step)


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "resnet18": resnet18}
OPTIONAL = {"resnet18_export": resnet18_export}     # named on the command line: needs torch and onnxscript
BUILDERS = {**MODELS, **OPTIONAL}


def _tensor(a: np.ndarray, device: str):
    """``a`` as a torch tensor on ``device`` (on the CPU it shares ``a``'s memory)."""
    import torch

    t = torch.from_numpy(a)
    return t if device == "cpu" else t.to(device)


def _torch_adamw(params, loss_fn, compile: bool = False, update: bool = True) -> Callable[[], float]:
    """PyTorch's step: zero_grad, forward, loss, backward, AdamW.step (torch's default AdamW);
    ``compile``: the forward and loss through ``torch.compile`` (its backward compiled by AOTAutograd);
    ``update=False``: the step without AdamW.step (its forward and backward alone)."""
    import torch

    opt = torch.optim.AdamW(params.values(), lr=1e-3)
    if compile:
        loss_fn = torch.compile(loss_fn)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        if update:
            opt.step()
        return float(loss.detach())
    return step


# -- onnxruntime pieces ---------------------------------------------------------------------------
def session_options(profile: str | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if not SPIN:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return so


def ort_session(model: onnx.ModelProto, profile: str | None = None):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), session_options(profile),
                                providers=["CPUExecutionProvider"])


def with_symbolic_batch(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with the first axis of its data inputs and outputs symbolic, as torch.onnx.export's dynamic_axes
    (or dynamic_shapes) writes a batch axis; every other dim as it was."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for value in [*out.graph.input, *out.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if value.name not in weights and len(dims):
            dims[0].Clear()
            dims[0].dim_param = "batch"
    del out.graph.value_info[:]
    return out


def training_session(bench: Bench, profile: str | None = None, recompute: bool = False, symbolic_batch: bool = False):
    from onnxgrad import TrainingSession, optim

    options = {"recompute": True} if recompute else {}      # older onnxgrad versions have no recompute
    forward = bench.forward
    if symbolic_batch:
        forward = with_symbolic_batch(forward, bench.weights)
    return TrainingSession(forward, loss=bench.loss, optimizer=optim.AdamW(lr=1e-3),
                           providers=["CPUExecutionProvider"], session_options=session_options(profile), **options)


def gradient_model(bench: Bench, target: str | None = "cpu") -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The step without its update, and the weights to feed it: the loss model in training mode (batch
    norm on batch statistics, as the session trains), differentiated and rewritten for ``target``'s kernels
    (:mod:`onnxgrad.passes.optimize`) as TrainingSession does, with the weights as graph inputs as the session binds
    them. As initializers they would be constants that onnxruntime folds and prepacks (NCHWc convolutions,
    batch norm folded into the Conv), which no training step can have: ResNet-18's forward alone takes 37 ms
    with constant weights against 56 ms with weights as inputs."""
    import inspect

    import onnxgrad
    import onnxgrad.training.artifacts as A

    model = bench.loss(bench.forward)
    try:
        from onnxgrad.training.train_mode import to_train_mode
    except ImportError:          # older onnxgrad versions, benchmarked for a before/after
        pass
    else:
        model = to_train_mode(model).model
    # (older onnxgrad versions have no target)
    rewrites = {"target": target} if "target" in inspect.signature(onnxgrad.grad).parameters else {}
    gm = onnxgrad.grad(model, loss="loss", **rewrites)      # wrt: the parameters the session trains
    held = [t.name for t in gm.graph.initializer if t.name in bench.weights]
    return A._params_as_inputs(gm, held, defaults=False), {name: bench.weights[name] for name in held}


# -- measuring ------------------------------------------------------------------------------------
def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure(bench: Bench, reps: int, warmup: int, with_torch: bool, with_compile: bool = False,
            with_recompute: bool = False) -> dict:
    import onnxgrad.training.artifacts as A

    t0 = time.perf_counter()
    gm, weights = gradient_model(bench)
    t_grad = time.perf_counter() - t0
    t0 = time.perf_counter()
    A.build(bench.forward, bench.loss, None, guard=False, defaults=False)
    t_artifacts = time.perf_counter() - t0
    t0 = time.perf_counter()
    ts = training_session(bench)
    t_session = time.perf_counter() - t0

    fwd = ort_session(bench.forward)
    # the same forward with its weights as graph inputs, as a step binds them: no prepacked or NCHWc-reordered
    # constant weights, no batch norm folded into the Conv
    held = [t.name for t in bench.forward.graph.initializer if t.name in bench.weights]
    fwd_inputs = ort_session(A._params_as_inputs(bench.forward, held, False))
    held_feeds = {**bench.feeds, **{name: bench.weights[name] for name in held}}
    gsess = ort_session(gm)
    all_feeds = {**bench.feeds, **bench.target}
    gnames = [o.name for o in gm.graph.output]
    runs: dict[str, Callable[[], Any]] = {
        "forward": lambda: fwd.run(None, bench.feeds),
        "forward_inputs": lambda: fwd_inputs.run(None, held_feeds),
        "gradient": lambda: gsess.run(gnames, {**all_feeds, **weights}),
        "step": lambda: ts.step(all_feeds),
    }
    # the same step with the batch axis symbolic, as an export with a dynamic batch axis trains
    ts_symbolic = training_session(bench, symbolic_batch=True)
    runs["step_symbolic_batch"] = lambda: ts_symbolic.step(all_feeds)
    if with_recompute:
        ts_recompute = training_session(bench, recompute=True)
        runs["recompute"] = lambda: ts_recompute.step(all_feeds)
    if with_torch and bench.torch_step is not None:
        import torch

        torch.set_num_threads(THREADS)
        runs["torch"] = bench.torch_step(bench.weights)
        runs["torch_gradient"] = bench.torch_step(bench.weights, update=False)
        if with_compile:
            runs["compile"] = bench.torch_step(bench.weights, compile=True)
    t_compile = None
    for k, fn in runs.items():
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        if k == "compile":
            t_compile = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():         # interleaved: each round times every candidate once
            times[k].append(_time(fn))
    gc.collect()
    med = {k: float(np.median(v)) for k, v in times.items()}
    low = {k: float(np.min(v)) for k, v in times.items()}
    return {"model": bench.name, "build_grad_s": t_grad, "build_artifacts_s": t_artifacts,
            "session_s": t_session, "compile_s": t_compile, "ms": med, "min": low, "times": times,
            "fwd_nodes": len(bench.forward.graph.node), "grad_nodes": len(gm.graph.node),
            "train_nodes": len(ts.artifacts.train.graph.node)}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory(name: str, frameworks: list[str]) -> dict[str, dict]:
    """bench_memory.py's measurement, run as that script (once per framework, in a fresh process): the peak
    RSS of building the trainer and of a 20-step loop, in MB above the process with the model built."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "memory.json")
        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_memory.py"),
                        name, "--frameworks", ",".join(frameworks), "--repeats", "1", "--json", out],
                       check=True, stdout=subprocess.DEVNULL, timeout=3600)
        with open(out) as f:
            return {fw: runs[0] for fw, runs in json.load(f)[name].items()}


def profile(name: str, reps: int) -> None:
    """onnxruntime's profile of the training step and the forward: time per op type and the top nodes."""
    bench = BUILDERS[name]()
    feeds = {**bench.feeds, **bench.target}
    ts = training_session(bench, profile=f"/tmp/bench_step_{name}_train")
    fwd = ort_session(bench.forward, profile=f"/tmp/bench_step_{name}_fwd")
    for _ in range(reps):
        ts.step(feeds)
        fwd.run(None, bench.feeds)
    for what, sess in (("step", ts._train), ("forward", fwd)):
        print_profile(sess.end_profiling(), f"{name}: {what}", reps)


def print_profile(path: str, title: str, reps: int, top: int = 15) -> None:
    """An onnxruntime profile (``path``, of ``reps`` runs) as time per run by op type and the top nodes."""
    with open(path) as f:
        events = json.load(f)
    by_type: dict[str, float] = {}
    by_node: dict[str, tuple[str, float]] = {}
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        op = e["args"].get("op_name", "?")
        node = e["name"][: -len("_kernel_time")]
        by_type[op] = by_type.get(op, 0.0) + e["dur"] / 1e3 / reps
        by_node[node] = (op, by_node.get(node, (op, 0.0))[1] + e["dur"] / 1e3 / reps)
    total = sum(by_type.values())
    print(f"\n== {title}, kernel time per run {total:.2f} ms ({path})")
    for op, ms in sorted(by_type.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {op:<28} {ms:8.3f} ms  {100 * ms / total:5.1f}%")
    print("  -- top nodes")
    for node, (op, ms) in sorted(by_node.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {node[:70]:<70} {op:<20} {ms:8.3f} ms")


# -- the figures a run publishes, and the comparison with the published ones ----------------------------
RATIOS = ("step/eager", "step/compile", "step/forward", "memory/eager", "symbolic_batch/step")
COLUMNS = {"forward": "forward", "forward_inputs": "forward_weights_as_inputs", "gradient": "gradient",
           "step": "step", "torch": "eager",
           "torch_gradient": "eager_gradient", "compile": "compile", "recompute": "recompute",
           "step_symbolic_batch": "step_symbolic_batch"}


def figures(r: dict) -> dict:
    """One model's measurement as published: median and min in ms per column, the build times, the same-run
    ratios of ``RATIOS`` (those measured), and with ``--memory`` bench_memory.py's figures per framework."""
    ms, lo = r["ms"], r["min"]
    out: dict[str, Any] = {"build_artifacts_s": r["build_artifacts_s"], "session_s": r["session_s"]}
    for key, column in COLUMNS.items():
        if key in ms:
            out[f"{column}_ms"], out[f"{column}_min_ms"] = ms[key], lo[key]
    out["step/forward"] = ms["step"] / ms["forward"]
    if "step_symbolic_batch" in ms:
        out["symbolic_batch/step"] = ms["step_symbolic_batch"] / ms["step"]
    if "forward_inputs" in ms:
        out["step/forward_weights_as_inputs"] = ms["step"] / ms["forward_inputs"]
    for column in ("eager", "compile"):
        if f"{column}_ms" in out:
            out[f"step/{column}"] = out["step_ms"] / out[f"{column}_ms"]
    if "memory" in r:
        out["memory"] = r["memory"]
        ours, eager = (r["memory"].get(fw, {}).get("peak_mb") for fw in ("onnxgrad", "torch"))
        if ours and eager:
            out["memory/eager"] = ours / eager
    return out


def run_info(args: argparse.Namespace, have_torch: bool) -> dict:
    """The run beside its figures: date, machine, cores, commit, and how it was measured."""
    import onnxruntime as ort

    torch_version = None
    if have_torch:
        import torch

        torch_version = torch.__version__
    return published.run_info(threads=THREADS, spinning=SPIN, reps=args.reps, warmup=args.warmup,
                              onnxruntime=ort.__version__, torch=torch_version)


def print_against(measured: dict, before: dict, path: str, tolerance: float) -> None:
    """This run's ratios against the published ``before`` (read from ``path``), a regression flagged."""
    print()
    for difference in published.setup_differences(measured, before):
        print(f"note: published on another setup ({difference}): the ratios move with it")
    comparisons = published.compare(measured["models"], before["models"], RATIOS)
    for line in published.report(comparisons, tolerance, f"{path} ({published.describe(before)})"):
        print(line)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=list(MODELS), metavar="MODEL",
                    help=f"some of {', '.join(BUILDERS)} (default: {', '.join(MODELS)})")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (it compiles for a minute or so)")
    ap.add_argument("--memory", action="store_true",
                    help="peak RSS of building and of a 20-step loop, each framework in a fresh process")
    ap.add_argument("--recompute", action="store_true",
                    help="also time the step of a TrainingSession(recompute=True), interleaved with the others")
    ap.add_argument("--profile", metavar="MODEL", choices=list(BUILDERS))
    ap.add_argument("--json", metavar="PATH",
                    help="also write what the run measured (per model: ms, minima, ratios, memory) and the run's "
                         "date, machine, cores, threads, versions and commit as JSON: the file --against reads")
    ap.add_argument("--against", metavar="PATH",
                    help="after the table, compare this run's ratios (step/eager, step/compile, step/forward, "
                         "memory/eager) with those of a published --json file, one line per model, a ratio "
                         f"worse by more than --tolerance flagged {published.FLAG}; the exit status stays 0")
    ap.add_argument("--tolerance", type=float, default=published.DEFAULT_TOLERANCE, metavar="FRACTION",
                    help="relative rise of a ratio flagged as a regression (default %(default)s: 15%%). Ratios, "
                         "not milliseconds: on a shared virtual machine one day's milliseconds differ from "
                         "another's by more than a regression, while the two sides of a ratio, measured "
                         "interleaved in one run, slow down together: the machine's speed cancels")
    args = ap.parse_args(argv)
    if args.profile:
        profile(args.profile, args.reps)
        return
    try:
        before = published.load(args.against) if args.against else None     # a wrong file fails before the run
    except (OSError, ValueError) as e:
        ap.error(f"--against: {e}")
    try:
        import torch  # noqa: F401
        have_torch = not args.no_torch
    except ImportError:
        have_torch = False
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, {THREADS} intra-op threads, spinning {'on' if SPIN else 'off'}; "
          f"torch: {'yes' if have_torch else 'no'} (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}); "
          f"median [min] of {args.reps} interleaved runs after {args.warmup} warm-up, in ms")
    results = []
    print(f"{'model':<12} {'build s':>11} {'forward':>15} {'gradient':>15} {'step':>17} {'torch step':>17} "
          f"{'compiled step':>17} {'step/fwd':>8} {'grad/fwd':>8} {'step/torch':>10} {'step/compiled':>13} "
          f"{'nodes f/g/t':>14}")
    for name in args.models:
        r = measure(BUILDERS[name](), args.reps, args.warmup, have_torch, have_torch and not args.no_compile,
                    args.recompute)
        ms, lo = r["ms"], r["min"]

        def cell(k: str) -> str:
            return f"{ms[k]:.2f} [{lo[k]:.2f}]" if k in ms else "-"

        def ratio(k: str) -> str:
            return f"{ms['step'] / ms[k]:.2f}" if k in ms else "-"
        build = f"{r['build_artifacts_s']:.2f}+{r['session_s']:.2f}"
        print(f"{name:<12} {build:>11} {cell('forward'):>15} {cell('gradient'):>15} {cell('step'):>17} "
              f"{cell('torch'):>17} {cell('compile'):>17} {ms['step'] / ms['forward']:>8.2f} "
              f"{ms['gradient'] / ms['forward']:>8.2f} {ratio('torch'):>10} {ratio('compile'):>13} "
              f"{r['fwd_nodes']:>4}/{r['grad_nodes']}/{r['train_nodes']}", flush=True)
        if "forward_inputs" in ms:
            print(f"    the forward with its weights as graph inputs, as the step binds them: {cell('forward_inputs')} "
                  f"ms ({ms['forward_inputs'] / ms['forward']:.2f} x the forward); the step is "
                  f"{ms['step'] / ms['forward_inputs']:.2f} of it, the gradient {ms['gradient'] / ms['forward_inputs']:.2f}",
                  flush=True)
        if "step_symbolic_batch" in ms:
            print(f"    the step with the batch axis symbolic (an export's dynamic axis): {cell('step_symbolic_batch')} "
                  f"ms, {ms['step_symbolic_batch'] / ms['step']:.2f} x the step", flush=True)
        if "torch_gradient" in ms:
            print(f"    the update, step - gradient: ours {ms['step'] - ms['gradient']:.2f} ms, PyTorch's "
                  f"{ms['torch'] - ms['torch_gradient']:.2f} (its step without AdamW.step: "
                  f"{cell('torch_gradient')}); forward + backward, ours / PyTorch's: "
                  f"{ms['gradient'] / ms['torch_gradient']:.2f}", flush=True)
        if "recompute" in ms:
            print(f"    step with recompute=True {cell('recompute')} ms: {ms['recompute'] / ms['step']:.2f} x the step",
                  flush=True)
        if args.memory:
            frameworks = ["onnxgrad"] + (["torch"] if have_torch else []) + (
                ["compile"] if have_torch and not args.no_compile else [])
            r["memory"] = memory(name, frameworks)
            torch_peak = r["memory"].get("torch", {}).get("peak_mb")
            for fw, m in r["memory"].items():
                if "error" in m:
                    print(f"    memory {fw}: error: {m['error']}")
                    continue
                ratio = f", {m['peak_mb'] / torch_peak:.2f}x PyTorch eager's" if torch_peak and fw != "torch" else ""
                print(f"    memory {fw:<8}: peak {m['peak_mb']:6.1f} MB above the built model (build {m['build_mb']:.1f}, "
                      f"20-step loop {m['loop_mb']:.1f}){ratio}"
                      + ("" if m["peak_reset"] else " (peaks not reset between phases)"), flush=True)
        results.append(r)
    measured = {**run_info(args, have_torch), "models": {r["model"]: figures(r) for r in results}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(measured, f, indent=1)
    if before is not None:
        print_against(measured, before, args.against, args.tolerance)


if __name__ == "__main__":
    main(sys.argv[1:])
