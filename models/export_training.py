"""PyTorch's training trajectories for every model in models/, and the default exports users make.

Run with an environment that has torch (the tests do not need it)::

    .venv/bin/python models/export_training.py

For each model ``models/<stem>.onnx`` written by ``models/export.py`` it trains the same PyTorch module
(rebuilt from the same seed) for a few steps in train mode (``model.train()``), in float64, and writes
``models/trains/<stem>.npz``. It also exports, with the exporters' **default** settings, the models a user
makes, into ``models/trains/<stem>.onnx`` beside their references:

- ``encoder_dynamo``: a transformer encoder with PyTorch's default initialisation (LayerNorm weights of 1,
  zero biases) and a padding token through ``torch.onnx.export(dynamo=True)`` (``optimize=True``): the
  exporter merges the equal-valued parameters and drops a zero bias, which onnxgrad splits off and restores,
  and the padding row gets no gradient, as in PyTorch;
- ``tied_lm_dynamo``: a language model whose head is its token embedding (a tie: one parameter, which the
  default export keeps as one initializer, as it does parameters merged by value; onnxgrad keeps it one);
- ``cnn_legacy_training``: the CNN through the TorchScript exporter with ``training=TrainingMode.TRAINING``
  (BatchNormalization nodes in training mode; the export's trace updates the module's running statistics,
  so the reference trains the module as the export left it);
- ``cnn_legacy_eval``: the same with ``training=TrainingMode.EVAL`` (BatchNorm folded into the convolutions:
  onnxgrad refuses to train it in train mode; no trajectory);
- ``scaled_dynamo``: a classifier with a learnable temperature used as ``logit_scale.exp()``, default dynamo
  export: the exporter folds ``exp(logit_scale)`` into a constant (onnxgrad warns; no trajectory).

Keys of ``<stem>.npz``: ``input/<name>`` (the batch, fed at every step), ``target`` (the MSE target of the
first output; absent when the model's output is its loss), ``output`` (the output the loss reads),
``optimizer`` ("sgd": lr 0.05, momentum 0.9; "adamw": lr 0.01, weight decay 0.01), ``losses`` (PyTorch's
loss at each step, before its update), ``init/<initializer>`` (every initializer holding parameters, after
the steps, in its layout; where models/export.py's mapping by value finds them) and ``torch/<name>`` (every
parameter after the steps, in PyTorch's layout), ``alias/<name>`` (a tied parameter's other name: the name
``torch/`` holds it under), ``running/<initializer>`` (BatchNorm running statistics).
"""
from __future__ import annotations

import copy
import io
import math
import os
import sys
import warnings

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export as E  # noqa: E402  (models/export.py: the models, their seeds and the mapping by value)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "trains")
STEPS = 4
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01)}


class Encoder(nn.Module):
    """Token embedding (padding_idx 0: PyTorch gives that row no gradient), LayerNorm, one
    nn.TransformerEncoderLayer (dropout 0), a classifier on token 0."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16, padding_idx=0)
        self.ln = nn.LayerNorm(16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, idx):
        return self.head(self.layer(self.ln(self.emb(idx)))[:, 0])


class TiedLM(nn.Module):
    """Token embedding, LayerNorm, an MLP, and an LM head tied to the embedding (one parameter)."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(24, 16)
        self.ln = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 24, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx):
        h = self.tokens(idx)
        return self.head(self.ln(h + self.mlp(h)))


class Scaled(nn.Module):
    """A linear classifier whose logits are multiplied by exp(logit_scale), as CLIP's are."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, x):
        return self.fc(x) * self.logit_scale.exp()


def trajectory(model: nn.Module, inputs: dict[str, torch.Tensor], target: torch.Tensor | None, optimizer: str):
    """PyTorch's losses over STEPS steps in train mode, float64, and the module after them."""
    m = copy.deepcopy(model).double().train()
    opt = OPTIMIZERS[optimizer](m.parameters())
    xs = [v.double() if v.is_floating_point() else v for v in inputs.values()]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        out = m(*xs)
        loss = out if target is None else F.mse_loss(out, target.double())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses), m


def write(stem: str, proto: onnx.ModelProto, model: nn.Module, inputs: dict[str, torch.Tensor], output: str,
          optimizer: str, loss_inside: bool = False) -> None:
    """``trains/<stem>.npz``: PyTorch's trajectory for the module ``proto`` was exported from."""
    graph_inputs = [i.name for i in proto.graph.input]
    with torch.no_grad():
        y = model(*inputs.values())
    target = None if loss_inside else torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    losses, after = trajectory(model, inputs, target, optimizer)
    arrays = {f"input/{k}": v.numpy() for k, v in inputs.items() if k in graph_inputs}
    arrays.update(output=np.array(output), optimizer=np.array(optimizer), losses=losses)
    if target is not None:
        arrays["target"] = target.numpy()
    arrays.update({f"torch/{k}": p.detach().numpy() for k, p in after.named_parameters()})
    canonical = {id(p): k for k, p in after.named_parameters()}     # a tied parameter's other names
    arrays.update({f"alias/{k}": np.array(canonical[id(p)]) for k, p in after.named_parameters(remove_duplicate=False)
                   if canonical[id(p)] != k})
    try:
        held = E.map_initializers(proto, model)
        arrays.update({f"init/{k}": h.value(after) for k, h in held.items()})
    except RuntimeError:        # merged by value: the test maps PyTorch's names instead
        pass
    if any(n.op_type == "BatchNormalization" for n in proto.graph.node):
        buffers = dict(after.named_buffers())
        arrays.update({f"running/{k}": buffers[b].numpy() for k, b in E.map_running_stats(proto, model).items()})
    os.makedirs(OUT, exist_ok=True)
    np.savez_compressed(os.path.join(OUT, f"{stem}.npz"), **arrays)
    print(f"{stem}: {optimizer}, losses {np.array2string(losses, precision=5)}, "
          f"{len([k for k in arrays if k.startswith('init/')])} initializers mapped")


def models_of_export_py() -> None:
    """A trajectory for every model models/export.py wrote, from the same module and batch."""
    for name, spec in E.SPECS.items():
        model, inputs = E.build(name)
        for exporter in spec.exporters:
            stem = f"{name}_{exporter}"
            path = os.path.join(HERE, f"{stem}.onnx")
            if not os.path.exists(path):
                continue
            proto = onnx.load(path)
            if stem == "cnn_dynamo":        # BatchNorm folded: onnxgrad refuses it in train mode
                continue
            # SGD where a parameter's gradient is zero up to rounding (attention's key bias, which softmax
            # ignores; a convolution's bias before train-mode BatchNorm, which the batch mean removes): Adam
            # normalises that float32 noise to full steps, in PyTorch float32 as here; AdamW on the rest
            adam = name in ("mlp", "mlp_ce", "lstm")
            write(stem, proto, model, inputs, spec.outputs[0], "adamw" if adam else "sgd", loss_inside=spec.loss)


def default_exports() -> None:
    """The exports a user makes with the exporters' defaults, and their trajectories where PyTorch's holds."""
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    enc = Encoder()
    idx = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(3))
    idx[:, -2:] = 0         # padding at the end of every sequence
    proto = dynamo_default(enc, idx, "idx", "encoder_dynamo")
    write("encoder_dynamo", proto, enc, {"idx": idx}, "logits", "sgd")

    torch.manual_seed(0)
    lm = TiedLM()
    idx = torch.randint(0, 24, (3, 5), generator=torch.Generator().manual_seed(4))
    proto = dynamo_default(lm, idx, "idx", "tied_lm_dynamo")
    write("tied_lm_dynamo", proto, lm, {"idx": idx}, "logits", "adamw")

    cnn, inputs = E.build("cnn")
    for mode in ("TRAINING", "EVAL"):
        module = copy.deepcopy(cnn)
        f = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the TorchScript exporter traces the module in the mode asked for: TRAINING updates its buffers
            torch.onnx.export(module, tuple(inputs.values()), f, dynamo=False, opset_version=E.LEGACY_OPSET,
                              training=getattr(torch.onnx.TrainingMode, mode), input_names=["x"], output_names=["y"])
        proto = onnx.load_from_string(f.getvalue())
        stem = f"cnn_legacy_{mode.lower()}"
        save(proto, stem)
        if mode == "TRAINING":
            write(stem, proto, module.eval(), inputs, "y", "sgd")

    torch.manual_seed(0)
    dynamo_default(Scaled(), torch.randn(2, 8), "x", "scaled_dynamo")


def dynamo_default(module: nn.Module, x: torch.Tensor, input_name: str, stem: str) -> onnx.ModelProto:
    """``torch.onnx.export(dynamo=True)`` with its defaults (``optimize=True``), of the module in train mode, one
    input and the output ``logits``; saved as ``trains/<stem>.onnx``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(copy.deepcopy(module).train(), (x,), dynamo=True, input_names=[input_name],
                                  output_names=["logits"], verbose=False).model_proto
    save(proto, stem)
    return proto


def save(proto: onnx.ModelProto, stem: str) -> None:
    proto.ir_version = min(proto.ir_version, E.MAX_IR)
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, os.path.join(OUT, f"{stem}.onnx"))


if __name__ == "__main__":
    models_of_export_py()
    default_exports()
