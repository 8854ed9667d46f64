"""Audit onnxgrad's parameter policy on real PyTorch exports (a script, not a test; needs torch).

For each model family (small, random weights, no downloads) and each exporter (dynamo, today's
default, and the TorchScript one; dynamo with optimize=False too for the BatchNorm families), it
exports the eval-mode module to a temp dir and compares ``onnxgrad.parameters(path)`` (and
``of=[...]`` for models with several outputs) with the truth: PyTorch's ``requires_grad``
parameters as they appear in the graph. Every float initializer is identified by value
(parameters are random, so each element identifies the parameter and position it came from):

- param: a one-to-one layout of one or more parameters (as is, transposed, reshaped, sliced,
  LSTM/GRU gates re-packed) or a Conv+BN fold; trainable when PyTorch's gradient of the
  differentiated outputs reaches its parameters. When several initializers hold the same
  elements, one of them (onnxgrad's choice when it made one) is the parameter, the others are
- copy: tied/repeated copies (elements repeated by a folded Gather/Expand, or a second copy of a
  tied parameter); not trainable, since training it separately breaks the tie;
- buffer (equals a torch buffer) and constant (anything else): not trainable.

``--bf16`` audits the same modules with weights rounded to bfloat16 (a checkpoint stored in bf16,
loaded in float32), whose values repeat; the truth comes from the float32 export, by name.
For the BatchNorm families it also runs one plain SGD step in ``TrainingSession`` (train_mode
True and False) against PyTorch (``model.train()`` / ``model.eval()``, F.mse_loss, SGD lr 0.1).
T5 and Swin use eager attention: with SDPA the dynamo exporter fails on them (torch 2.13:
"Cannot view a tensor with shape ... as a tensor with shape ..." while decomposing).

    .venv/bin/pip install transformers
    .venv/bin/python bench/audit_parameters.py --bf16       # every family (about 70 s on 2 cores)
    .venv/bin/python bench/audit_parameters.py resnet bert  # some
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import numpy_helper

import onnxgrad
from onnxgrad import losses, optim

LR = 0.1
FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)


# -- plain PyTorch families -------------------------------------------------------------------
def conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.a, self.b = conv_bn(cin, cout, 3, stride), conv_bn(cout, cout)
        self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        return F.relu(self.b(F.relu(self.a(x))) + (x if self.down is None else self.down(x)))


class ResNetish(nn.Module):
    """Stem conv+BN, two basic blocks (one with a 1x1 conv+BN shortcut), global pool, Linear."""

    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8)
        self.layers = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.layers(F.relu(self.stem(x))), 1).flatten(1))


class InvertedResidual(nn.Module):
    """1x1 expand + BN, depthwise 3x3 + BN, squeeze-excite (convs with bias), 1x1 project + BN."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        h = cin * 3
        self.expand, self.dw, self.project = conv_bn(cin, h, 1), conv_bn(h, h, 3, stride, groups=h), conv_bn(h, cout, 1)
        self.se1, self.se2 = nn.Conv2d(h, 4, 1), nn.Conv2d(4, h, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        h = F.relu6(self.dw(F.relu6(self.expand(x))))
        h = h * F.hardsigmoid(self.se2(F.relu(self.se1(F.adaptive_avg_pool2d(h, 1)))))
        h = self.project(h)
        return x + h if self.residual else h


class MobileNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, 2)
        self.blocks = nn.Sequential(InvertedResidual(8, 8, 1), InvertedResidual(8, 12, 2))
        self.head = conv_bn(12, 24, 1)
        self.fc = nn.Linear(24, 5)

    def forward(self, x):
        h = F.hardswish(self.head(self.blocks(F.hardswish(self.stem(x)))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class MLP(nn.Module):
    """Linear, LayerNorm, GELU, Dropout, Linear, ReLU, Linear, divided by a learnable scalar temperature."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.net(x) / self.temperature


class RNNClassifier(nn.Module):
    """LSTM (2 layers, bidirectional) or GRU (1 layer) over a batch-first sequence; logits and h_n."""

    def __init__(self, kind: str):
        super().__init__()
        lstm = kind == "lstm"
        self.rnn = nn.LSTM(4, 8, 2, batch_first=True, bidirectional=True) if lstm else nn.GRU(4, 8, batch_first=True)
        self.fc = nn.Linear(16 if lstm else 8, 3)

    def forward(self, x):
        out, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        return self.fc(out[:, -1]), h


class SpatialTransformer(nn.Module):
    """Localisation net -> theta -> F.affine_grid + F.grid_sample -> small classifier."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(1, 4, 5), nn.MaxPool2d(2), nn.ReLU(),
                                 nn.Conv2d(4, 6, 3), nn.MaxPool2d(2), nn.ReLU())
        self.fc_loc = nn.Sequential(nn.Linear(54, 16), nn.ReLU(), nn.Linear(16, 6))
        self.cls = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 18 * 18, 5))

    def forward(self, x):
        theta = self.fc_loc(self.loc(x).flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.cls(F.grid_sample(x, grid, align_corners=False))


# -- transformers families (tiny configs) -----------------------------------------------------
class HF(nn.Module):
    """A transformers model as a module of positional tensors returning a tuple of outputs."""

    def __init__(self, m: nn.Module, inputs: list[str], outputs: list[str]):
        super().__init__()
        self.m, self.inputs, self.outputs = m, inputs, outputs

    def forward(self, *args):
        out = self.m(**dict(zip(self.inputs, args)))
        return tuple(out[k] for k in self.outputs)


def hf(cls: str, config: str, inputs: list[str], outputs: list[str], **cfg) -> Callable[[], nn.Module]:
    def make():
        import transformers
        conf = getattr(transformers, config)(**cfg)
        return HF(getattr(transformers, cls)(conf), inputs, outputs)
    return make


TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
DECODER = dict(TINY, max_position_embeddings=32, use_cache=False)


@dataclass
class Family:
    make: Callable[[], nn.Module]
    inputs: dict[str, Callable[[torch.Generator], torch.Tensor]]
    outputs: list[str]
    of: tuple[str, ...] = ()          # a subset of outputs to differentiate as well (several outputs)
    bn: bool = False                  # has BatchNorm: train-mode check


def ones(*shape):
    return lambda g: torch.ones(*shape, dtype=torch.int64)


def randn(*shape):
    return lambda g: torch.randn(*shape, generator=g)


def ids(*shape):
    return lambda g: torch.randint(0, 100, shape, generator=g)


# decoders get an attention_mask input: without one, transformers' packed-sequence check calls
# torch.diff, which the TorchScript exporter cannot export
DEC = {"input_ids": ids(2, 8), "attention_mask": ones(2, 8)}
IMG = {"pixel_values": randn(2, 3, 16, 16)}
ENC_OUT = ["last_hidden_state", "pooler_output"]
FAMILIES: dict[str, Family] = {
    "resnet": Family(ResNetish, {"x": randn(4, 3, 16, 16)}, ["y"], bn=True),
    "mobilenet": Family(MobileNetish, {"x": randn(4, 3, 16, 16)}, ["y"], bn=True),
    "mlp": Family(MLP, {"x": randn(8, 16)}, ["y"]),
    "lstm": Family(lambda: RNNClassifier("lstm"), {"x": randn(3, 5, 4)}, ["y", "h"], of=("y",)),
    "gru": Family(lambda: RNNClassifier("gru"), {"x": randn(3, 5, 4)}, ["y", "h"], of=("y",)),
    "stn": Family(SpatialTransformer, {"x": randn(2, 1, 20, 20)}, ["y"]),
    "bert": Family(hf("BertModel", "BertConfig", ["input_ids"], ENC_OUT, max_position_embeddings=16, **TINY),
                   {"input_ids": ids(2, 8)}, ["hidden", "pooled"], of=("hidden",)),
    "gpt2": Family(hf("GPT2LMHeadModel", "GPT2Config", list(DEC), ["logits"], vocab_size=100, n_positions=16,
                      n_embd=32, n_layer=2, n_head=2, use_cache=False), DEC, ["logits"]),
    "vit": Family(hf("ViTModel", "ViTConfig", list(IMG), ENC_OUT, image_size=16, patch_size=4,
                     **{k: v for k, v in TINY.items() if k != "vocab_size"}),
                  IMG, ["hidden", "pooled"], of=("hidden",)),
    "t5": Family(hf("T5ForConditionalGeneration", "T5Config", ["input_ids", "decoder_input_ids"],
                    ["logits", "encoder_last_hidden_state"], vocab_size=100, d_model=32, d_kv=16, d_ff=64,
                    num_layers=2, num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                    decoder_start_token_id=0, use_cache=False, tie_word_embeddings=True, attn_implementation="eager"),
                 {"input_ids": ids(2, 8), "decoder_input_ids": ids(2, 6)}, ["logits", "encoder_hidden"],
                 of=("encoder_hidden",)),
    "llama": Family(hf("LlamaForCausalLM", "LlamaConfig", list(DEC), ["logits"], num_key_value_heads=1,
                       tie_word_embeddings=False, **DECODER), DEC, ["logits"]),
    "mistral": Family(hf("MistralForCausalLM", "MistralConfig", list(DEC), ["logits"], num_key_value_heads=1,
                         sliding_window=4, tie_word_embeddings=True, **DECODER), DEC, ["logits"]),
    "swin": Family(hf("SwinModel", "SwinConfig", list(IMG), ENC_OUT, image_size=16, patch_size=2, embed_dim=16,
                      depths=[1, 1], num_heads=[1, 2], window_size=4, mlp_ratio=2.0, attn_implementation="eager"),
                   IMG, ["hidden", "pooled"], of=("hidden",)),
}


def build(name: str, bf16: bool = False) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The module in eval mode with random values in every parameter and BN statistic (``bf16``:
    rounded to bfloat16, as a checkpoint stored in bf16 and loaded in float32)."""
    torch.manual_seed(0)
    model = FAMILIES[name].make()
    g = torch.Generator().manual_seed(1234)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if id(p) in embeddings:
                p.copy_(z)
            elif p.ndim >= 2:
                p.copy_(z / math.sqrt(p[0].numel()))
            else:
                p.copy_((1.0 if pname.endswith("weight") or p.ndim == 0 else 0.0) + 0.2 * z)
            if bf16:
                p.copy_(p.bfloat16().float())
        for bname, b in model.named_buffers():
            if bname.endswith("running_mean"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif bname.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    gi = torch.Generator().manual_seed(99)
    return model.eval(), {k: f(gi) for k, f in FAMILIES[name].inputs.items()}


# -- export -----------------------------------------------------------------------------------
EXPORTERS = {
    "dynamo": dict(dynamo=True),
    "dynamo-noopt": dict(dynamo=True, optimize=False),        # BN families only: keeps BatchNormalization
    "torchscript": dict(dynamo=False, opset_version=17, training=torch.onnx.TrainingMode.PRESERVE,
                        do_constant_folding=True),
}


def export(model: nn.Module, inputs: dict[str, torch.Tensor], outputs: list[str], exporter: str, path: str) -> str:
    """Export to ``path``; the TorchScript exporter tries opsets 17, 18, 20 (affine_grid needs 20)."""
    kw = dict(EXPORTERS[exporter], input_names=list(inputs), output_names=outputs)
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with warnings.catch_warnings(), quiet[0], quiet[1]:
        warnings.simplefilter("ignore")
        if kw["dynamo"]:
            torch.onnx.export(model, tuple(inputs.values()), **kw).save(path)
            return ""
        for opset in (17, 18, 20):
            try:
                torch.onnx.export(model, tuple(inputs.values()), path, **dict(kw, opset_version=opset))
                return "" if opset == 17 else f" (opset {opset})"
            except torch.onnx.errors.UnsupportedOperatorError:
                if opset == 20:
                    raise
    return ""


# -- the truth: what each float initializer holds ---------------------------------------------
@dataclass
class Truth:
    kind: str                         # param | copy | buffer | constant
    what: str
    params: tuple[str, ...] = ()
    index: np.ndarray | None = None   # positions in the concatenated parameter vector (exact layouts)


class Params:
    """Every parameter's elements in one vector, searchable by exact float32 value.

    Random float32 values collide now and then (birthday paradox: a few per 10^5 elements), so an
    initializer is first matched as a whole (as is, reshaped, transposed); element by element, a value
    found at several positions goes to a parameter the unambiguous elements come from, at a position
    no other element took while there is one. (bfloat16 values collide all the time: ``--bf16`` takes
    the truth from the float32 export of the same module, by initializer name.)"""

    def __init__(self, model: nn.Module):
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        arrays = [p.detach().float().numpy() for _, p in named]
        self.offsets = np.cumsum([0] + [a.size for a in arrays])
        self.whole: dict[bytes, np.ndarray] = {}
        for k, a in enumerate(arrays):
            positions = np.arange(self.offsets[k], self.offsets[k + 1])
            self.whole.setdefault(a.tobytes(), positions)
            if a.ndim == 2:
                self.whole.setdefault(np.ascontiguousarray(a.T).tobytes(), positions.reshape(a.shape).T.ravel())
        bits = np.concatenate([a.ravel() for a in arrays]).view(np.uint32)
        self.order = np.argsort(bits, kind="stable")
        self.sorted = bits[self.order]

    def owner(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, positions, side="right") - 1

    def locate(self, values: np.ndarray) -> np.ndarray | None:
        """The position of every element in the parameter vector, or None when one is not there."""
        flat = np.ascontiguousarray(values, dtype=np.float32).ravel()
        if flat.tobytes() in self.whole:
            return self.whole[flat.tobytes()]
        b = flat.view(np.uint32)
        lo, hi = np.searchsorted(self.sorted, b, "left"), np.searchsorted(self.sorted, b, "right")
        if not b.size or (lo == hi).any():
            return None
        pos = self.order[lo]
        sure = set(self.owner(pos[hi - lo == 1]).tolist())
        used = set(pos[hi - lo == 1].tolist())
        for i in np.nonzero(hi - lo > 1)[0]:       # a colliding value: a sure owner, an unused position
            cands = sorted(self.order[lo[i]:hi[i]].tolist(), key=lambda c: (self.owner(c) not in sure, c))
            pos[i] = next((c for c in cands if c not in used), cands[0])
            used.add(int(pos[i]))
        return pos

    def describe(self, pos: np.ndarray) -> tuple[tuple[str, ...], str]:
        owners = np.unique(self.owner(pos))
        names = tuple(self.names[o] for o in owners)
        if len(owners) > 1:
            return names, "packed from " + ", ".join(names)
        lo, hi = self.offsets[owners[0]], self.offsets[owners[0] + 1]
        if np.unique(pos).size < hi - lo:
            return names, f"slice of {names[0]}"
        return names, names[0] + (" (as is or reshaped)" if (pos == np.arange(lo, hi)).all() else " (permuted)")


def conv_bn_folds(model: nn.Module) -> list[tuple[str, np.ndarray, tuple[str, ...]]]:
    """Conv followed by eval-mode BN as exporters fold it: W s and (b - mean) s + beta."""
    mods, out = list(model.named_modules()), []
    for (cn, conv), (bn_name, bn) in zip(mods, mods[1:]):
        if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
            s = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach().numpy()
            b = conv.bias.detach().numpy() if conv.bias is not None else 0.0
            out.append((f"{cn}.weight*{bn_name}", conv.weight.detach().numpy() * s.reshape(-1, 1, 1, 1),
                        (f"{cn}.weight", f"{bn_name}.weight")))
            out.append((f"{cn}.bias*{bn_name}", (b - bn.running_mean.numpy()) * s + bn.bias.detach().numpy(),
                        (f"{bn_name}.weight", f"{bn_name}.bias")))
    return out


def identify(proto: onnx.ModelProto, model: nn.Module, P: Params, first: set[str]) -> dict[str, Truth]:
    """What every float initializer holds. ``first``: names to prefer as the one trained holder of
    a parameter held several times (onnxgrad's choice; any one of them is right)."""
    folds = conv_bn_folds(model)
    buffers = {k: b.numpy() for k, b in model.named_buffers() if b.is_floating_point()}
    used = {x for n in proto.graph.node for x in n.input}
    inits = [i for i in proto.graph.initializer if i.data_type in FLOATS]
    out: dict[str, Truth] = {}
    for init in inits:
        v = numpy_helper.to_array(init)
        fold = next((f for f in folds if f[1].size == v.size and np.allclose(f[1].ravel(), v.ravel(), 1e-5, 1e-6)),
                    None)
        idx = P.locate(v) if fold is None else None
        buf = next((k for k, b in buffers.items() if b.size == v.size and np.array_equal(b.ravel(), v.ravel())), None)
        if fold:
            out[init.name] = Truth("param", f"Conv+BN fold {fold[0]}", fold[2])
        elif idx is not None:
            if np.unique(idx).size < idx.size:
                owners, counts = np.unique(P.owner(idx), return_counts=True)
                names = tuple(P.names[o] for o in owners[counts >= 0.1 * idx.size])
                out[init.name] = Truth("copy", f"repeats elements of {', '.join(names)} (a Gather/Expand fold)", names)
            else:
                names, what = P.describe(idx)
                out[init.name] = Truth("param", what, names, idx)
        elif buf:
            out[init.name] = Truth("buffer", f"torch buffer {buf}")
        else:
            out[init.name] = Truth("constant", "no parameter's values (exporter constant, mask, folded buffer math)")
    # one holder per element: later holders of elements already held are tied copies
    taken = np.zeros(P.offsets[-1], dtype=np.int64) - 1
    names = [i.name for i in inits]
    for k in sorted(range(len(names)), key=lambda k: (names[k] not in used, names[k] not in first, k)):
        t = out[names[k]]
        if t.kind == "param" and t.index is not None:
            clash = taken[t.index]
            if (clash >= 0).any():
                out[names[k]] = Truth("copy", f"second copy of {', '.join(t.params)} (held by "
                                      f"'{names[clash[clash >= 0][0]]}')", t.params, t.index)
            else:
                taken[t.index] = k
    return out


def reached(model: nn.Module, inputs: dict[str, torch.Tensor], outputs: list[str], of: tuple[str, ...]) -> set[str]:
    """The parameters PyTorch gives a gradient (not None) for the outputs ``of``."""
    outs = model(*inputs.values())
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(5)
    obj = sum((o * torch.randn(o.shape, generator=g)).sum() for n, o in zip(outputs, outs) if n in of)
    named = list(model.named_parameters())
    grads = torch.autograd.grad(obj, [p for _, p in named], allow_unused=True)
    return {n for (n, _), gr in zip(named, grads) if gr is not None}


def metadata(proto: onnx.ModelProto, name: str) -> str:
    keys = {"pkg.torch.export.graph_signature.InputSpec.kind": "kind",
            "pkg.onnxscript.optimizer.folded_from": "folded_from"}
    md = {}
    for vi in list(proto.graph.value_info) + list(proto.graph.initializer):
        if vi.name == name:
            md.update({keys[p.key]: p.value[:100] for p in vi.metadata_props if p.key in keys})
    return ", ".join(f"{k}={v}" for k, v in md.items()) or "no metadata"


# -- the audit --------------------------------------------------------------------------------
@dataclass
class Row:
    family: str
    exporter: str
    floats: int = 0
    params: int = 0
    copies: int = 0
    trainable: int = 0
    agree: int = 0
    lost: list[str] = field(default_factory=list)       # reached parameters only copies hold
    untrained: list[str] = field(default_factory=list)  # reached parameters onnxgrad trains no holder of
    ms: float = 0.0


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    trains: list[tuple[str, str, str, dict]] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str, e: Exception) -> None:
        self.failures.append(f"{what}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
        print(self.failures[-1])


def audit(family: str, label: str, path: str, model: nn.Module, inputs: dict[str, torch.Tensor],
          of: tuple[str, ...] | None, truth_of: tuple[str, nn.Module], report: Report) -> None:
    """One table row: onnxgrad.parameters(path, of=of) against the truth (identified on ``truth_of``,
    an export of the same module with float32 weights, by initializer name)."""
    fam = FAMILIES[family]
    proto = onnx.load(path)
    t0 = time.perf_counter()
    rep = onnxgrad.parameters(path, of=list(of) if of else None)
    row = Row(family, label + (f" of={','.join(of)}" if of else ""), ms=(time.perf_counter() - t0) * 1e3)
    truth = identify(onnx.load(truth_of[0]), truth_of[1], Params(truth_of[1]), set(rep.trainable))
    if set(truth) != {i.name for i in proto.graph.initializer if i.data_type in FLOATS}:
        raise RuntimeError(f"{truth_of[0]} and {path} differ in their float initializers")
    hit = reached(model, inputs, fam.outputs, of or tuple(fam.outputs))
    used = {x for n in proto.graph.node for x in n.input}
    held: set[str] = set()
    trained: set[str] = set()
    for name, t in truth.items():
        expect = t.kind == "param" and name in used and bool(set(t.params) & hit)
        got = name in rep and rep[name].trainable
        row.floats += 1
        row.params += t.kind == "param"
        row.copies += t.kind == "copy"
        row.trainable += got
        row.agree += got == expect
        held |= set(t.params) if expect else set()
        trained |= set(t.params) if got and t.kind == "param" else set()
        reason = rep[name].reason if name in rep else "not listed"
        if t.kind == "copy" and not of:
            report.copies.append(f"{family} {label} {name}: {t.what}; onnxgrad: "
                                 f"{'TRAINS' if got else 'leaves out'} ({reason[:90]})")
        if got != expect:
            why = " (PyTorch gives it no gradient for these outputs)" if t.kind == "param" and not expect else ""
            report.disagreements.append(f"{family} {row.exporter} {name}: onnxgrad {'TRAINS' if got else 'leaves out'}"
                                        f" ({reason[:110]}); really: {t.kind}: {t.what}{why}; {metadata(proto, name)}")
            print("   ", report.disagreements[-1])
    row.lost, row.untrained = sorted(hit - held), sorted(hit - trained)
    report.rows.append(row)


def train_check(path: str, model: nn.Module, x: torch.Tensor, out: str, train_mode: bool,
                truth_of: tuple[str, nn.Module], tmp: str) -> dict:
    """One SGD step in TrainingSession against PyTorch; max abs diffs of loss, parameters, BN statistics."""
    truth = identify(onnx.load(truth_of[0]), truth_of[1], Params(truth_of[1]), set())
    bufs = {n: t.what.split()[-1] for n, t in truth.items() if t.kind == "buffer"}
    with torch.no_grad():
        target = torch.randn(model(x).shape, generator=torch.Generator().manual_seed(11))
    s = onnxgrad.TrainingSession(path, loss=losses.MSELoss(output=out, target="t"), optimizer=optim.SGD(lr=LR),
                                 train_mode=train_mode, providers=["CPUExecutionProvider"])
    loss = s.step({"x": x.numpy(), "t": target.numpy()})
    s.export(os.path.join(tmp, "after.onnx"))
    after = {i.name: numpy_helper.to_array(i) for i in onnx.load(os.path.join(tmp, "after.onnx")).graph.initializer}
    ref = copy.deepcopy(model).double().train(train_mode)
    ref_loss = F.mse_loss(ref(x.double()), target.double())
    ref_loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
    flat = np.concatenate([p.detach().numpy().ravel() for p in ref.parameters()])
    rbufs = {k: b.numpy().ravel() for k, b in ref.named_buffers()}
    d_par = max(float(np.abs(after[n].ravel() - flat[t.index]).max()) for n, t in truth.items()
                if t.kind == "param" and t.index is not None)
    d_buf = {k: max([float(np.abs(after[n].ravel() - rbufs[b]).max()) for n, b in bufs.items() if b.endswith(k)]
                    or [float("nan")]) for k in ("running_mean", "running_var")}
    return {"loss": abs(loss - ref_loss.item()), "params": d_par, "trained": len(s.spec.params),
            "buffers": len(s.spec.buffers), **d_buf}


def run_family(family: str, exporters: list[str], bf16: bool, tmp: str, report: Report) -> None:
    """Build, export with each exporter, audit (all outputs and ``of``), train-check BN exports;
    ``bf16``: the same with the weights rounded to bfloat16, against the float32 export's truth."""
    fam = FAMILIES[family]
    try:
        builds = {"": build(family)} | ({" bf16": build(family, bf16=True)} if bf16 else {})
    except Exception as e:
        return report.fail(f"{family}: build", e)
    for exporter in exporters + (["dynamo-noopt"] if fam.bn and "dynamo-noopt" not in exporters else []):
        ref: tuple[str, nn.Module] | None = None
        for suffix, (model, inputs) in builds.items():
            label, path = exporter + suffix, os.path.join(tmp, f"{family}_{exporter}{suffix.strip()}.onnx")
            t0 = time.perf_counter()
            try:
                note = export(model, inputs, fam.outputs, exporter, path)
            except Exception as e:
                report.fail(f"{family} {label}: export", e)
                break
            print(f"{family} {label}{note}: exported in {time.perf_counter() - t0:.1f} s")
            ref = ref or (path, model)
            for of in [None] + ([fam.of] if fam.of else []):
                try:
                    audit(family, label, path, model, inputs, of, ref, report)
                except Exception as e:
                    report.fail(f"{family} {label} of={of}: audit", e)
            if fam.bn and any(n.op_type == "BatchNormalization" for n in onnx.load(path).graph.node):
                for mode in (True, False):
                    try:
                        d = train_check(path, model, inputs["x"], fam.outputs[0], mode, ref, tmp)
                        report.trains.append((family, label, "train" if mode else "eval", d))
                    except Exception as e:
                        report.fail(f"{family} {label} train_mode={mode}", e)


def summary(report: Report) -> None:
    print("\n## onnxgrad.parameters() against PyTorch's parameters as they appear in the graph\n")
    print("| family | exporter | float inits | PyTorch-param inits | tied/repeated copies | onnxgrad trainable "
          "| agree | PyTorch params lost to folds | PyTorch params onnxgrad leaves untrained | parameters() ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report.rows:
        print(f"| {r.family} | {r.exporter} | {r.floats} | {r.params} | {r.copies} | {r.trainable} | "
              f"{r.agree}/{r.floats} | {len(r.lost)} | {len(r.untrained)} | {r.ms:.0f} |")
    print(f"\ndisagreements: {len(report.disagreements)}")
    for line in report.disagreements:
        print("  " + line)
    print(f"\ntied/repeated copies: {len(report.copies)}")
    for line in report.copies:
        print("  " + line)
    print("\nPyTorch parameters onnxgrad leaves untrained (* lost to folds: only a tied/repeated copy in the graph):")
    for r in report.rows:
        if r.untrained:
            print(f"  {r.family} {r.exporter}: " + ", ".join(n + "*" * (n in r.lost) for n in r.untrained))
    if report.trains:
        print("\n## one SGD step (lr 0.1), TrainingSession against PyTorch: max abs differences\n")
        print("| family | exporter | mode | trained / BN buffers | loss | parameters | running_mean | running_var |")
        print("|---|---|---|---|---|---|---|---|")
        for family, label, mode, d in report.trains:
            print(f"| {family} | {label} | {mode} | {d['trained']} / {d['buffers']} | {d['loss']:.1e} | "
                  f"{d['params']:.1e} | {d['running_mean']:.1e} | {d['running_var']:.1e} |")
    print(f"\nfailures: {len(report.failures)}")
    for line in report.failures:
        print("  " + line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", metavar="FAMILY", help=f"default: all of {', '.join(FAMILIES)}")
    ap.add_argument("--exporters", nargs="+", default=["dynamo", "torchscript"], choices=list(EXPORTERS),
                    help="dynamo-noopt (optimize=False) is added for the BatchNorm families")
    ap.add_argument("--bf16", action="store_true", help="also audit with weights rounded to bfloat16")
    args = ap.parse_args()
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    torch.set_num_threads(2)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)       # "torchvision is not installed"
    start = time.perf_counter()
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families or list(FAMILIES):
            run_family(family, list(args.exporters), args.bf16, tmp, report)
    summary(report)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
