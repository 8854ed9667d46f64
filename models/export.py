"""Export small deterministic PyTorch models to ONNX, with PyTorch's gradients as the reference.

Run with an environment that has torch (the tests do not need it)::

    /tmp/torchvenv/bin/python models/export.py            # every model, both exporters
    /tmp/torchvenv/bin/python models/export.py mlp cnn    # some of them

For each model and exporter it writes ``<model>_<exporter>.onnx`` and, beside
it, ``<model>_<exporter>.npz`` holding

- ``input/<name>``: the graph inputs fed (float and integer);
- ``output/<name>``: PyTorch's forward outputs (float32), a sanity check;
- ``seed/<name>``: the seed (upstream gradient) of each differentiated output,
  or ``loss``: the name of the scalar loss output (a 0-d string array);
- ``grad/<name>``: PyTorch autograd's gradient (computed in float64) of the
  objective ``sum(seed * output)`` or the loss, for every float graph input
  and every ONNX initializer that holds a torch parameter, in the layout of
  that initializer;
- ``param/<init>``: for each of those initializers, the torch parameter name(s)
  it holds (a 0-d string; several joined by ", " when folded or re-packed);
- ``torch_params``, ``buffers``: the names of the module's requires_grad
  parameters and of its buffers (1-d string arrays).

Exports that keep BatchNormalization nodes also get ``train_step/<stem>.npz``
(see ``write_train_step``): one plain-SGD step of PyTorch, in train and in eval
mode, as the reference for training the ONNX model as PyTorch would.

Exporters rename, transpose, reshape or (LSTM) re-pack parameters. The script
maps each float initializer back to the parameter it came from by value
(parameters are random, so values identify them) under the layouts the
exporters use: as is, transposed, reshaped, and the ONNX LSTM packing
(gates i,f,g,o -> i,o,f,c; the two biases concatenated). Every torch parameter
must be found in exactly one initializer, else the export fails loudly.
"""
from __future__ import annotations

import copy
import io
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
LEGACY_OPSET = 17       # LayerNormalization exists from 17; Reduce* still take attribute axes
DYNAMO_OPSET = 20       # the dynamo exporter's default
MAX_IR = 13             # onnxruntime 1.31 reads IR <= 13
TRAIN_DIR = os.path.join(HERE, "train_step")   # not models/*.npz: tests/test_models.py globs those as fixtures
TRAIN_LR = 0.1          # plain SGD: no momentum, no weight decay


# -- the models ---------------------------------------------------------------------
class MLP(nn.Module):
    """16-32-32-4 with ReLU and Tanh."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(F.relu(self.fc1(x)))))


class MLPCrossEntropy(nn.Module):
    """The MLP with its cross-entropy loss inside the graph (integer targets)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x, target):
        return F.cross_entropy(self.mlp(x), target)


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class CNN(nn.Module):
    """Conv-BN-ReLU, a residual block, MaxPool, AveragePool, a strided conv, GlobalAveragePool, Linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.block = ResBlock(8)
        self.pool1 = nn.MaxPool2d(2)
        self.pool2 = nn.AvgPool2d(2)
        self.conv = nn.Conv2d(8, 12, 3, stride=2, padding=1)
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.stem(x)))
        h = self.pool1(self.block(h))
        h = self.pool2(h)
        h = F.relu(self.conv(h))
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.fc(h)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, block: int, sdpa: bool):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("mask", torch.tril(torch.ones(block, block, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
            att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, block: int, sdpa: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, block, sdpa)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))   # exact (erf) GELU


class GPT(nn.Module):
    """Token + position embeddings (Gather), two pre-LN decoder blocks, final LayerNorm, LM head."""

    def __init__(self, sdpa: bool, vocab: int = 32, d: int = 16, heads: int = 2, block: int = 8, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads, block, sdpa) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, pos):
        # position ids are an input (as in Hugging Face models): with torch.arange inside,
        # both exporters fold the position Gather into a constant
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class LSTMClassifier(nn.Module):
    """One-layer LSTM over a batch-first sequence; a Linear on the last hidden state."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


@dataclass
class Spec:
    """A model, its example inputs (names as in the ONNX graph) and what is differentiated."""

    make: Callable[[], nn.Module]
    inputs: dict[str, Callable[[torch.Generator], torch.Tensor]]
    outputs: list[str]
    loss: bool = False                 # the single output is a scalar loss (no seed)
    exporters: dict[str, dict] = field(default_factory=lambda: {
        "dynamo": {"dynamo": True, "opset_version": DYNAMO_OPSET},
        "legacy": {"dynamo": False, "opset_version": LEGACY_OPSET},
    })


def _randn(*shape):
    return lambda g: torch.randn(*shape, generator=g)


def _randint(high, *shape):
    return lambda g: torch.randint(0, high, shape, generator=g)


def _positions(b, t):
    return lambda g: torch.arange(t).expand(b, t).contiguous()


SPECS: dict[str, Spec] = {
    "mlp": Spec(MLP, {"x": _randn(8, 16)}, ["y"]),
    "mlp_ce": Spec(MLPCrossEntropy, {"x": _randn(8, 16), "target": _randint(4, 8)}, ["loss"], loss=True),
    "cnn": Spec(CNN, {"x": _randn(2, 3, 16, 16)}, ["y"], exporters={
        "dynamo": {"dynamo": True, "opset_version": DYNAMO_OPSET},
        # the dynamo exporter's optimizer folds BatchNorm into the Conv (FuseBatchNormIntoConv,
        # even from a train-mode model); with optimize=False the BN nodes stay (eval mode)
        "bn_dynamo": {"dynamo": True, "opset_version": DYNAMO_OPSET, "optimize": False},
        "legacy": {"dynamo": False, "opset_version": LEGACY_OPSET},
    }),
    "gpt": Spec(lambda: GPT(sdpa=False), {"idx": _randint(32, 2, 8), "pos": _positions(2, 8)}, ["logits"]),
    "gpt_sdpa": Spec(lambda: GPT(sdpa=True), {"idx": _randint(32, 2, 8), "pos": _positions(2, 8)}, ["logits"], exporters={
        "dynamo": {"dynamo": True, "opset_version": DYNAMO_OPSET},
        # opset 23 has the ONNX Attention op; the dynamo exporter emits it for SDPA there
        "dynamo23": {"dynamo": True, "opset_version": 23},
        "legacy": {"dynamo": False, "opset_version": LEGACY_OPSET},
    }),
    "lstm": Spec(LSTMClassifier, {"x": _randn(3, 5, 4)}, ["y"]),
}


def build(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model with every parameter and buffer drawn from a seeded generator, in eval mode."""
    spec = SPECS[name]
    torch.manual_seed(0)
    model = spec.make()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # distinct random values for every parameter (LayerNorm/BN weights too),
            # so that each ONNX initializer identifies the parameter it holds
            z = torch.randn(p.shape, generator=g)
            if isinstance(model.get_submodule(pname.rsplit(".", 1)[0]), nn.Embedding):
                p.copy_(z)
            elif p.ndim >= 2:                                   # 1/sqrt(fan-in)
                p.copy_(z / math.sqrt(p[0].numel()))
            elif pname.endswith("weight"):                      # norm scales near 1
                p.copy_(1.0 + 0.2 * z)
            else:                                               # biases
                p.copy_(0.1 * z)
        for bname, buf in model.named_buffers():
            if bname.endswith("running_mean"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
            elif bname.endswith("running_var"):
                buf.copy_(torch.rand(buf.shape, generator=g) + 0.5)
    model.eval()
    gi = torch.Generator().manual_seed(99)
    inputs = {k: f(gi) for k, f in spec.inputs.items()}
    return model, inputs


# -- export ---------------------------------------------------------------------------
def export(model: nn.Module, inputs: dict[str, torch.Tensor], outputs: list[str], kw: dict) -> onnx.ModelProto:
    args = tuple(inputs.values())
    names = dict(input_names=list(inputs), output_names=outputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kw["dynamo"]:
            prog = torch.onnx.export(model, args, dynamo=True, opset_version=kw["opset_version"],
                                     optimize=kw.get("optimize", True), verbose=False, **names)
            proto = prog.model_proto
        else:
            f = io.BytesIO()
            # PRESERVE (the model is in eval mode) keeps BatchNormalization as a node:
            # EVAL mode would fold it into the preceding Conv's weights
            torch.onnx.export(model, args, f, dynamo=False, opset_version=kw["opset_version"],
                              training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=True, **names)
            proto = onnx.load_from_string(f.getvalue())
    proto.ir_version = min(proto.ir_version, MAX_IR)
    proto.producer_name = f"torch {torch.__version__} ({'dynamo' if kw['dynamo'] else 'torchscript'} exporter)"
    keep_initializer_value_info(proto.graph)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def keep_initializer_value_info(graph: onnx.GraphProto) -> None:
    """Drop the intermediate value_info; keep that of initializers, which carries the exporter's metadata.

    The dynamo exporter records on an initializer's ``value_info.metadata_props`` what it was
    in torch (``pkg.torch.export.graph_signature.InputSpec.kind``: PARAMETER, BUFFER...) and,
    for a tensor its optimizer folded, where from (``pkg.onnxscript.optimizer.folded_from``).
    Node metadata and the graph's ``metadata_props`` (the ExportedProgram's graph signature)
    are kept as they are.
    """
    inits = {i.name for i in graph.initializer}
    keep = [vi for vi in graph.value_info if vi.name in inits]
    del graph.value_info[:]
    graph.value_info.extend(keep)


# -- reference gradients ------------------------------------------------------------
def _reorder_gates(w: np.ndarray) -> np.ndarray:
    """PyTorch LSTM gate blocks (i, f, g, o) along axis 0 -> ONNX order (i, o, f, c)."""
    i, f, g, o = np.split(w, 4, axis=0)
    return np.concatenate([i, o, f, g], axis=0)


def _candidates(model: nn.Module) -> list[tuple[str, np.ndarray, Callable[[dict], np.ndarray], tuple[str, ...]]]:
    """(label, value, grad_of(torch_grads), params covered) for every layout an exporter may store."""
    params = {k: p.detach().numpy() for k, p in model.named_parameters()}
    out = []
    for k, v in params.items():
        out.append((k, v, lambda gr, k=k: gr[k], (k,)))
        if v.ndim == 2:
            out.append((k + ".T", v.T, lambda gr, k=k: gr[k].T, (k,)))
    for mname, mod in model.named_modules():
        if isinstance(mod, nn.LSTM):
            assert mod.num_layers == 1 and not mod.bidirectional
            p = f"{mname}." if mname else ""
            wi, wh, bi, bh = (f"{p}weight_ih_l0", f"{p}weight_hh_l0", f"{p}bias_ih_l0", f"{p}bias_hh_l0")
            out.append((f"{p}W", _reorder_gates(params[wi])[None],
                        lambda gr, k=wi: _reorder_gates(gr[k])[None], (wi,)))
            out.append((f"{p}R", _reorder_gates(params[wh])[None],
                        lambda gr, k=wh: _reorder_gates(gr[k])[None], (wh,)))
            out.append((f"{p}B", np.concatenate([_reorder_gates(params[bi]), _reorder_gates(params[bh])])[None],
                        lambda gr, a=bi, b=bh: np.concatenate([_reorder_gates(gr[a]), _reorder_gates(gr[b])])[None],
                        (bi, bh)))
    mods = list(model.named_modules())
    for (cname, conv), (bname, bn) in zip(mods, mods[1:]):
        if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
            out += _folded_conv_bn(cname, conv, bname, bn)
    return out


def _folded_conv_bn(cname: str, conv: nn.Conv2d, bname: str, bn: nn.BatchNorm2d):
    """Conv followed by eval-mode BN, folded as exporters do: W' = W s, b' = (b - mean) s + beta.

    With s = gamma / sqrt(var + eps) fixed, the folded model is y = conv(x, W') + b', so
    dL/dW' = dL/dW / s (per output channel) and dL/db' = dL/dbeta.
    """
    s = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach().numpy()
    w = conv.weight.detach().numpy()
    b = conv.bias.detach().numpy() if conv.bias is not None else 0.0
    mean, beta = bn.running_mean.numpy(), bn.bias.detach().numpy()
    # the parameters each folded tensor is a function of (s is one of gamma)
    w_of = (f"{cname}.weight", f"{bname}.weight")
    b_of = ((f"{cname}.bias",) if conv.bias is not None else ()) + (f"{bname}.weight", f"{bname}.bias")
    sw = s.reshape(-1, 1, 1, 1).astype(np.float64)
    return [
        (f"{cname}.weight*{bname}", w * sw, lambda gr, k=f"{cname}.weight": gr[k] / sw, w_of),
        (f"{cname}.bias*{bname}", (b - mean) * s + beta, lambda gr, k=f"{bname}.bias": gr[k], b_of),
    ]


def _same(candidate: np.ndarray, value: np.ndarray, label: str) -> bool:
    """Exact equality for parameters stored as they are; float32 rounding allowed for folded ones."""
    if candidate.size != value.size:
        return False
    a, b = candidate.reshape(-1), value.reshape(-1)
    if "*" in label:
        return bool(np.allclose(a, b, rtol=1e-5, atol=1e-6))
    return bool(np.array_equal(a, b))


@dataclass
class Held:
    """What an ONNX initializer holds: a candidate layout of one or more torch parameters."""

    label: str                              # the layout (see _candidates): "fc.weight.T", "lstm.B"...
    params: tuple[str, ...]                 # the torch parameters it holds (or was folded from)
    shape: tuple[int, ...]                  # the initializer's shape

    def grad(self, torch_grads: dict[str, np.ndarray], model: nn.Module) -> np.ndarray:
        """Its gradient, from torch's parameter gradients (``model``: the module they are of)."""
        return _by_label(model)[self.label][1](torch_grads).reshape(self.shape)

    def value(self, model: nn.Module) -> np.ndarray:
        """Its value for the parameters (and BN statistics) of ``model``, e.g. after a training step."""
        return _by_label(model)[self.label][0].reshape(self.shape)


def _by_label(model: nn.Module) -> dict[str, tuple[np.ndarray, Callable[[dict], np.ndarray]]]:
    return {label: (value, fn) for label, value, fn, _ in _candidates(model)}


def map_initializers(proto: onnx.ModelProto, model: nn.Module) -> dict[str, Held]:
    """ONNX initializer name -> the torch parameter(s) it holds and in which layout."""
    cands = _candidates(model)
    found: dict[str, Held] = {}
    covered: dict[str, list[str]] = {}     # parameter -> labels of the initializers holding it
    for init in proto.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        value = onnx.numpy_helper.to_array(init)
        # element j of the initializer is element j of the candidate layout (reshapes allowed)
        hits = [c for c in cands if _same(c[1], value, c[0])]
        if not hits:
            continue            # a constant (running statistics, masks, ...), not a parameter
        if len({h[0] for h in hits}) > 1:
            raise RuntimeError(f"initializer {init.name} matches several parameters: {[h[0] for h in hits]}")
        label, _, _, ps = hits[0]
        found[init.name] = Held(label, ps, tuple(value.shape))
        for p in ps:
            covered.setdefault(p, []).append(label)
    missing = [k for k, _ in model.named_parameters() if k not in covered]
    # a parameter held by two initializers would have two uses, and torch's gradient would be
    # their sum; only a folded Conv+BN pair (weight and bias) legitimately shares parameters
    twice = {k: v for k, v in covered.items() if len(v) != len(set(v)) or len([x for x in v if "*" not in x]) > 1}
    if missing or twice:
        raise RuntimeError(f"parameters not found in the ONNX initializers: {missing}; found twice: {twice}")
    return found


def map_running_stats(proto: onnx.ModelProto, model: nn.Module) -> dict[str, str]:
    """The running_mean / running_var initializers of the BatchNormalization nodes -> torch buffer names.

    Matched by value (the statistics are random); each node's momentum must be PyTorch's
    in ONNX's convention (running = momentum * running + (1 - momentum) * batch).
    """
    bufs = {k: b.numpy() for k, b in model.named_buffers() if k.endswith(("running_mean", "running_var"))}
    modules = dict(model.named_modules())
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    found: dict[str, str] = {}
    for node in proto.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        names = [k for name in node.input[3:5] for k, b in bufs.items()
                 if name in inits and b.shape == inits[name].shape and np.array_equal(b, inits[name])]
        assert len(names) == 2, f"{node.name}: running statistics {list(node.input[3:5])} not found among the buffers"
        found.update(zip(node.input[3:5], names))
        bn = modules[names[0].rsplit(".", 1)[0]]
        momentum = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)
        assert abs(momentum - (1.0 - bn.momentum)) < 1e-6, f"{node.name}: momentum {momentum}, torch's {bn.momentum}"
    assert sorted(found.values()) == sorted(bufs), f"running statistics not found: {set(bufs) - set(found.values())}"
    return found


def reference(model: nn.Module, inputs: dict[str, torch.Tensor], spec: Spec, seeds: dict[str, np.ndarray]):
    """PyTorch autograd in float64: outputs, gradients of parameters and of float inputs."""
    m64 = copy.deepcopy(model).double()
    xs = {k: (v.double().requires_grad_() if v.is_floating_point() else v) for k, v in inputs.items()}
    out = m64(*xs.values())
    outs = out if isinstance(out, tuple) else (out,)
    if spec.loss:
        objective = outs[0]
    else:
        objective = sum((o * torch.from_numpy(seeds[n]).double()).sum() for n, o in zip(spec.outputs, outs))
    objective.backward()
    grads = {k: p.grad.numpy() for k, p in m64.named_parameters()}
    input_grads = {k: v.grad.numpy() for k, v in xs.items() if v.is_floating_point()}
    return grads, input_grads


# -- one training step (models with BatchNormalization nodes) ------------------------------
@dataclass
class Step:
    """One plain-SGD step of PyTorch on F.mse_loss (mean), in float64."""

    loss_before: float          # the loss of the forward pass the step differentiates
    output: np.ndarray          # that forward pass's output
    after: nn.Module            # the float64 module after the step (parameters and BN statistics)


def sgd_step(model: nn.Module, x: torch.Tensor, t: torch.Tensor, train: bool, lr: float = TRAIN_LR) -> Step:
    """``model.train()`` (BN on batch statistics, running statistics updated) or eval mode."""
    m64 = copy.deepcopy(model).double().train(train)
    y = m64(x.double())
    loss = F.mse_loss(y, t.double())
    loss.backward()
    with torch.no_grad():
        for p in m64.parameters():
            p -= lr * p.grad
    return Step(float(loss.detach()), y.detach().numpy(), m64)


def bn_training_mode(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every BatchNormalization in training mode, its updated statistics as outputs."""
    m = copy.deepcopy(proto)
    for node in m.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        for a in list(node.attribute):
            if a.name == "training_mode":
                node.attribute.remove(a)
        node.attribute.append(onnx.helper.make_attribute("training_mode", 1))
        outs = [node.input[3] + ".next", node.input[4] + ".next"]
        del node.output[1:]
        node.output.extend(outs)
        m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in outs)
    return m


def check_train_step(proto: onnx.ModelProto, arrays: dict[str, np.ndarray], running: dict[str, str], base: str) -> dict:
    """The references against onnxruntime: the eval-mode loss of the model as exported, and the
    train-mode loss of the model with its BN nodes switched to training_mode=1."""
    x, t, name = arrays["x"], arrays["t"], str(arrays["output"])
    (y,) = run_onnx(proto, {"x": x})[:1]
    eval_loss = float(np.mean((y.astype(np.float64) - t) ** 2))
    assert abs(eval_loss - arrays["eval_loss_before"]) < 1e-5 * arrays["eval_loss_before"], \
        f"{base}: onnxruntime eval loss {eval_loss}, PyTorch's {arrays['eval_loss_before']}"
    trained = bn_training_mode(proto)
    values = dict(zip([o.name for o in trained.graph.output], run_onnx(trained, {"x": x})))
    train_loss = float(np.mean((values[name].astype(np.float64) - t) ** 2))
    assert abs(train_loss - arrays["loss_before"]) < 1e-5 * arrays["loss_before"], \
        f"{base}: onnxruntime train-mode loss {train_loss}, PyTorch's {arrays['loss_before']}"
    # how far onnxruntime's training-mode statistics are from PyTorch's (reported, not asserted:
    # ONNX's running_var uses the biased batch variance, PyTorch's the unbiased one)
    stats = {k: float(np.max(np.abs(values[k + ".next"] - arrays[f"running/{k}"]))) for k in running}
    return {"eval": eval_loss, "train": train_loss,
            "mean": max(v for k, v in stats.items() if running[k].endswith("mean")),
            "var": max(v for k, v in stats.items() if running[k].endswith("var"))}


def write_train_step(base: str, proto: onnx.ModelProto, model: nn.Module, held: dict[str, Held],
                     x: torch.Tensor, output: str) -> None:
    """``train_step/<base>.npz``: PyTorch's reference for one SGD step on the ONNX model.

    Keys: ``x``, ``t`` (the MSE target, shaped as the output), ``output`` (its name), ``loss``
    ("mse"), ``lr``; train mode: ``loss_before``, ``param/<init>`` (every initializer holding a
    parameter, after the step, in its layout), ``running/<init>`` (BN running_mean/running_var
    initializers after the step); eval mode (frozen BN): ``eval_loss_before``, ``eval_param/<init>``.
    """
    running = map_running_stats(proto, model)
    with torch.no_grad():
        y = model(x)
    t = torch.randn(y.shape, generator=torch.Generator().manual_seed(11))
    train, frozen = sgd_step(model, x, t, train=True), sgd_step(model, x, t, train=False)
    buffers = dict(train.after.named_buffers())
    arrays = {"x": x.numpy(), "t": t.numpy(), "output": np.array(output), "loss": np.array("mse"),
              "lr": np.array(TRAIN_LR), "loss_before": np.array(train.loss_before),
              "eval_loss_before": np.array(frozen.loss_before)}
    arrays.update({f"param/{k}": h.value(train.after).astype(np.float32) for k, h in held.items()})
    arrays.update({f"running/{k}": buffers[b].numpy().astype(np.float32) for k, b in running.items()})
    arrays.update({f"eval_param/{k}": h.value(frozen.after).astype(np.float32) for k, h in held.items()})
    got = check_train_step(proto, arrays, running, base)
    os.makedirs(TRAIN_DIR, exist_ok=True)
    np.savez_compressed(os.path.join(TRAIN_DIR, base + ".npz"), **arrays)
    print(f"{base}: train step: loss before {train.loss_before:.6f} (train mode; onnxruntime {got['train']:.6f}), "
          f"{frozen.loss_before:.6f} (eval mode; onnxruntime {got['eval']:.6f}); onnxruntime's training-mode "
          f"running statistics differ from PyTorch's by {got['mean']:.1e} (mean), {got['var']:.1e} (var)")


def run_onnx(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def export_one(name: str) -> None:
    spec = SPECS[name]
    model, inputs = build(name)
    with torch.no_grad():
        out = model(*inputs.values())
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(7)
    seeds = {} if spec.loss else {
        n: torch.randn(o.shape, generator=g).numpy() for n, o in zip(spec.outputs, outs)}
    grads, input_grads = reference(model, inputs, spec, seeds)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    for exporter, kw in spec.exporters.items():
        base = f"{name}_{exporter}"
        try:
            proto = export(model, inputs, spec.outputs, kw)
        except Exception as e:  # an exporter that cannot export this model is reported, not fatal
            print(f"{base}: export failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        got = run_onnx(proto, feeds)
        for n, o, ref in zip(spec.outputs, got, outs):
            err = np.max(np.abs(o - ref.numpy())) / (np.max(np.abs(ref.numpy())) + 1e-6)
            assert err < 1e-4, f"{base}: onnxruntime output '{n}' differs from torch by {err:.2e}"
        graph_inputs = [i.name for i in proto.graph.input]
        assert set(graph_inputs) <= set(inputs), f"{base}: unexpected graph inputs {graph_inputs}"
        held = map_initializers(proto, model)
        arrays = {f"input/{k}": v for k, v in feeds.items() if k in graph_inputs}
        arrays.update({f"output/{n}": o.numpy().astype(np.float32) for n, o in zip(spec.outputs, outs)})
        if spec.loss:
            arrays["loss"] = np.array(spec.outputs[0])
        arrays.update({f"seed/{n}": s.astype(np.float32) for n, s in seeds.items()})
        arrays.update({f"grad/{k}": v for k, v in input_grads.items() if k in graph_inputs})
        arrays.update({f"grad/{init}": h.grad(grads, model) for init, h in held.items()})
        arrays.update(names_of(model, held))
        onnx.save(proto, os.path.join(HERE, base + ".onnx"))
        np.savez_compressed(os.path.join(HERE, base + ".npz"), **arrays)
        ops = sorted({n.op_type for n in proto.graph.node})
        size = os.path.getsize(os.path.join(HERE, base + ".onnx"))
        print(f"{base}: opset {proto.opset_import[0].version}, IR {proto.ir_version}, {len(proto.graph.node)} nodes, "
              f"{size / 1024:.0f} KiB, {len(held)} parameter tensors; {metadata_summary(proto)}; ops: {' '.join(ops)}")
        if "BatchNormalization" in ops:
            write_train_step(base, proto, model, held, inputs["x"], spec.outputs[0])


def names_of(model: nn.Module, held: dict[str, Held]) -> dict[str, np.ndarray]:
    """``param/<init>``: the torch parameter names each initializer holds; ``torch_params``, ``buffers``."""
    out = {f"param/{k}": np.array(", ".join(h.params)) for k, h in held.items()}
    out["torch_params"] = np.array([k for k, p in model.named_parameters() if p.requires_grad])
    out["buffers"] = np.array([k for k, _ in model.named_buffers()], dtype=str)
    return out


def metadata_summary(proto: onnx.ModelProto) -> str:
    """How many initializers carry the exporter's InputSpec.kind and folded_from metadata."""
    inits = {i.name for i in proto.graph.initializer}
    keys = [{m.key: m.value for m in vi.metadata_props} for vi in proto.graph.value_info if vi.name in inits]
    kinds = [k["pkg.torch.export.graph_signature.InputSpec.kind"] for k in keys
             if "pkg.torch.export.graph_signature.InputSpec.kind" in k]
    folded = sum("pkg.onnxscript.optimizer.folded_from" in k for k in keys)
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds))) or "none"
    return f"{len(inits)} initializers: InputSpec.kind {counts}; folded_from {folded}"


def main(argv: list[str]) -> None:
    names = argv or list(SPECS)
    for name in names:
        export_one(name)


if __name__ == "__main__":
    main(sys.argv[1:])
