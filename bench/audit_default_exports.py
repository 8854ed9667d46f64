"""The path a PyTorch user walks with the exporters' defaults: export, then train with onnxgrad, against
PyTorch's own training of the same module (``model.train()``, the same optimizer, batch and steps).

    .venv/bin/python bench/audit_default_exports.py            # needs torch; transformers for BERT/GPT-2

For each architecture and exporter (``torch.onnx.export(dynamo=True)`` with its default ``optimize=True``,
and the TorchScript exporter's defaults, ``dynamo=False``), it prints what onnxgrad says before the first step
(refused, warned, or nothing) and, where it trains, the worst relative loss difference over the steps and
the worst parameter difference after them relative to the parameter's largest value, at least 1e-2 (a key
bias, whose gradient is zero, stays at zero up to rounding; parameters matched by PyTorch's names; transposed
folds compared transposed). Dropout is 0 in every model so that trajectories can be compared. Asserts
nothing; prints one line per model and exporter.
"""
from __future__ import annotations

import copy
import io
import sys
import warnings

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

import onnxgrad
from onnxgrad import TrainingSession, losses, optim

STEPS = 5


class SqueezeExcite(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True)))))


class SmallResNet(nn.Module):
    """conv-BN-ReLU stem, a residual block with a squeeze-excitation, global pool, linear; PyTorch's init."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv1, self.bn1 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.se = SqueezeExcite(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.stem(x)))
        h = F.relu(h + self.se(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h)))))))
        return self.fc(h.mean((2, 3)))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(32, 3)

    def forward(self, idx):
        return self.head(self.layers(self.emb(idx))[:, 0])


class Logits(nn.Module):
    """A Hugging Face classifier's logits as the one output."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(input_ids=idx).logits


def architectures():
    torch.manual_seed(0)
    yield "small ResNet + SE (BatchNorm)", SmallResNet(), torch.randn(4, 3, 16, 16), "sgd"
    yield "transformer encoder (torch.nn)", Encoder(), torch.randint(0, 50, (4, 8)), "sgd"
    try:
        import transformers
    except ImportError:
        print("transformers not importable: BERT and GPT-2 skipped")
        return
    tiny = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    # SGD: Adam turns the float32 rounding noise of a gradient that is zero (attention's key bias) into full steps
    yield ("BERT classifier (transformers)", Logits(transformers.BertForSequenceClassification(
        transformers.BertConfig(**tiny))), torch.randint(0, 64, (4, 8)), "sgd")
    yield ("GPT-2 classifier (transformers)", Logits(transformers.GPT2ForSequenceClassification(
        transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, num_labels=3,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0)
    )), torch.randint(1, 64, (4, 8)), "sgd")
    yield ("GPT-2 LM, head tied to the embedding (transformers)", Logits(transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)
    )), torch.randint(0, 64, (4, 8)), "sgd")


def export(module: nn.Module, x: torch.Tensor, dynamo: bool) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            return torch.onnx.export(copy.deepcopy(module), (x,), dynamo=True, input_names=["x"],
                                     output_names=["y"], verbose=False).model_proto
        f = io.BytesIO()
        torch.onnx.export(copy.deepcopy(module), (x,), f, dynamo=False, input_names=["x"], output_names=["y"])
        return onnx.load_from_string(f.getvalue())


def pytorch(module: nn.Module, x, target, optimizer: str):
    m = copy.deepcopy(module).train()
    opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(m.parameters(), lr=1e-3))
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(m(x), target)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return np.array(out), {k: p.detach().numpy() for k, p in m.named_parameters()}


def ours(proto: onnx.ModelProto, x, target, optimizer: str):
    model = losses.mse_loss(proto, output=proto.graph.output[0].name, target="target")
    opt = optim.SGD(lr=0.05, momentum=0.9) if optimizer == "sgd" else optim.AdamW(lr=1e-3)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", onnxgrad.ExportWarning)
        s = TrainingSession(model, loss="loss", optimizer=opt)
    feeds = {proto.graph.input[0].name: x.numpy(), "target": target.numpy()}
    got = np.array([s.step(feeds) for _ in range(STEPS)])
    return got, s, [str(w.message) for w in said if issubclass(w.category, onnxgrad.ExportWarning)]


def main() -> None:
    for name, module, x, optimizer in architectures():
        with torch.no_grad():
            y = module.train()(x)
        target = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        want, torch_params = pytorch(module, x, target, optimizer)
        for dynamo in (True, False):
            exporter = "dynamo default" if dynamo else "TorchScript default"
            try:
                proto = export(module.train(), x, dynamo)
            except Exception as e:      # an exporter that cannot export the model is reported
                print(f"{name}, {exporter}: export failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            try:
                got, s, said = ours(proto, x, target, optimizer)
            except onnxgrad.OnnxGradError as e:
                print(f"{name}, {exporter}: refused: {str(e)[:160]}...")
                continue
            loss_err = float(np.max(np.abs(got - want) / np.abs(want)))
            worst, matched = 0.0, 0
            report = s.artifacts.report
            for init, value in s.parameters().items():
                ref = torch_params.get(report[init].torch_name or init)
                if ref is None:
                    continue
                folded_transpose = value.ndim == 2 and "transposed" in report[init].reason
                value = value.T if folded_transpose or (value.shape != ref.shape and value.ndim == 2) else value
                if value.size != ref.size:
                    continue
                matched += 1
                # relative to the parameter's scale, at least 1e-2: a key bias stays at zero up to rounding
                scale = max(float(np.max(np.abs(ref))), 1e-2)
                worst = max(worst, float(np.max(np.abs(value.reshape(ref.shape) - ref))) / scale)
            said_text = f"; warned: {' | '.join(w[:100] for w in said)}" if said else ""
            print(f"{name}, {exporter}: {len(torch_params)} PyTorch parameters, {len(s.spec.params)} trained, "
                  f"{matched} matched by name; {STEPS} steps: worst loss rel diff {loss_err:.1e}, worst parameter "
                  f"rel diff {worst:.1e}{said_text}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
