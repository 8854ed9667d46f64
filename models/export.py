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
  that initializer.

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
    "cnn": Spec(CNN, {"x": _randn(2, 3, 16, 16)}, ["y"]),
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
                                     verbose=False, **names)
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
    del proto.graph.value_info[:]
    onnx.checker.check_model(proto, full_check=True)
    return proto


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
    covers = (f"{cname}.weight", f"{bname}.weight", f"{bname}.bias") + ((f"{cname}.bias",) if conv.bias is not None else ())
    sw = s.reshape(-1, 1, 1, 1).astype(np.float64)
    return [
        (f"{cname}.weight*{bname}", w * sw, lambda gr, k=f"{cname}.weight": gr[k] / sw, covers),
        (f"{cname}.bias*{bname}", (b - mean) * s + beta, lambda gr, k=f"{bname}.bias": gr[k], covers),
    ]


def _same(candidate: np.ndarray, value: np.ndarray, label: str) -> bool:
    """Exact equality for parameters stored as they are; float32 rounding allowed for folded ones."""
    if candidate.size != value.size:
        return False
    a, b = candidate.reshape(-1), value.reshape(-1)
    if "*" in label:
        return bool(np.allclose(a, b, rtol=1e-5, atol=1e-6))
    return bool(np.array_equal(a, b))


def map_initializers(proto: onnx.ModelProto, model: nn.Module) -> dict[str, Callable[[dict], np.ndarray]]:
    """ONNX initializer name -> how to get its gradient from torch's parameter gradients."""
    cands = _candidates(model)
    found: dict[str, Callable] = {}
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
        label, _, fn, ps = hits[0]
        shape = tuple(value.shape)
        found[init.name] = lambda gr, fn=fn, shape=shape: fn(gr).reshape(shape)
        for p in ps:
            covered.setdefault(p, []).append(label)
    missing = [k for k, _ in model.named_parameters() if k not in covered]
    # a parameter held by two initializers would have two uses, and torch's gradient would be
    # their sum; only a folded Conv+BN pair (weight and bias) legitimately shares parameters
    twice = {k: v for k, v in covered.items() if len(v) != len(set(v)) or len([x for x in v if "*" not in x]) > 1}
    if missing or twice:
        raise RuntimeError(f"parameters not found in the ONNX initializers: {missing}; found twice: {twice}")
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
        mapping = map_initializers(proto, model)
        arrays = {f"input/{k}": v for k, v in feeds.items() if k in graph_inputs}
        arrays.update({f"output/{n}": o.numpy().astype(np.float32) for n, o in zip(spec.outputs, outs)})
        if spec.loss:
            arrays["loss"] = np.array(spec.outputs[0])
        arrays.update({f"seed/{n}": s.astype(np.float32) for n, s in seeds.items()})
        arrays.update({f"grad/{k}": v for k, v in input_grads.items() if k in graph_inputs})
        arrays.update({f"grad/{init}": fn(grads) for init, fn in mapping.items()})
        onnx.save(proto, os.path.join(HERE, base + ".onnx"))
        np.savez_compressed(os.path.join(HERE, base + ".npz"), **arrays)
        ops = sorted({n.op_type for n in proto.graph.node})
        size = os.path.getsize(os.path.join(HERE, base + ".onnx"))
        print(f"{base}: opset {proto.opset_import[0].version}, IR {proto.ir_version}, {len(proto.graph.node)} nodes, "
              f"{size / 1024:.0f} KiB, {len(mapping)} parameter tensors; ops: {' '.join(ops)}")


def main(argv: list[str]) -> None:
    names = argv or list(SPECS)
    for name in names:
        export_one(name)


if __name__ == "__main__":
    main(sys.argv[1:])
