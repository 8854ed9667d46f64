"""Make the PyTorch reference trajectories that tests/test_training.py replays with TrainingSession.

Run with a Python that has torch (CPU) and onnxscript (for torch.onnx.export)::

    /tmp/torchvenv/bin/python models/training/make_fixtures.py

Writes, beside this script:

- ``mlp.onnx``: an 8-16-3 MLP (Linear, ReLU, Linear) exported by torch.onnx.export
  (dynamo), with the initial weights every run starts from;
- ``trajectories.npz``: the data (``x`` [steps, batch, 8] float32, ``y`` [steps, batch]
  int64) and, for every run ``<run>`` in RUNS, the loss of each step
  (``<run>/losses``, computed before that step's update) and the final weights
  (``<run>/<initializer name>``);
- ``runs.json``: each run's optimizer, its options and the training options
  (clipping, accumulation, learning-rate schedule, loss options).

A run trains with cross-entropy from the same initial weights for STEPS steps;
with ``accumulation`` k, a step is k micro-batches (the batch split in k
parts), each contributing ``loss / k`` to the gradients, as is usual in PyTorch.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 5
BATCH = 16

# name -> (optimizer class, options, training options)
RUNS = {
    "sgd_momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}, {}),
    "adamw": ("AdamW", {"lr": 1e-2}, {}),
    "sgd_nesterov_wd": ("SGD", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 1e-2}, {}),
    "sgd_dampening": ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}, {}),
    "sgd_plain_schedule": ("SGD", {"lr": 0.2}, {"gamma": 0.5}),
    "adam_l2": ("Adam", {"lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 1e-2}, {}),
    "adagrad": ("Adagrad", {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 1e-3,
                            "initial_accumulator_value": 0.1}, {}),
    "adamw_clip": ("AdamW", {"lr": 1e-2, "weight_decay": 0.05}, {"clip_grad_norm": 0.5}),
    "sgd_accumulate": ("SGD", {"lr": 0.1, "momentum": 0.9}, {"accumulation": 2}),
    "adamw_smoothing": ("AdamW", {"lr": 1e-2}, {"label_smoothing": 0.1}),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def train(net: torch.nn.Module, kind: str, options: dict, training: dict, x: np.ndarray, y: np.ndarray):
    opt = getattr(torch.optim, kind)(net.parameters(), **options)
    k = training.get("accumulation", 1)
    losses = []
    for step in range(STEPS):
        if "gamma" in training:
            for group in opt.param_groups:
                group["lr"] = options["lr"] * training["gamma"] ** step
        opt.zero_grad()
        xs = np.split(x[step], k)
        ys = np.split(y[step], k)
        for xm, ym in zip(xs, ys):
            logits = net(torch.from_numpy(xm))
            loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(ym),
                                                     label_smoothing=training.get("label_smoothing", 0.0))
            (loss / k).backward()
            losses.append(loss.item())
        if "clip_grad_norm" in training:
            torch.nn.utils.clip_grad_norm_(net.parameters(), training["clip_grad_norm"])
        opt.step()
    return np.array(losses, np.float64), {name: p.detach().numpy().copy() for name, p in net.named_parameters()}


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS, BATCH, 8)).astype(np.float32)
    y = rng.integers(0, 3, (STEPS, BATCH)).astype(np.int64)

    net = make_model()
    torch.onnx.export(net, (torch.from_numpy(x[0]),), os.path.join(HERE, "mlp.onnx"), input_names=["x"],
                      output_names=["logits"], dynamic_shapes=({0: torch.export.Dim("N")},), dynamo=True,
                      opset_version=18, external_data=False)
    initial = {k: v.detach().clone() for k, v in net.state_dict().items()}

    arrays = {"x": x, "y": y}
    for name, (kind, options, training) in RUNS.items():
        net.load_state_dict(initial)
        losses, weights = train(net, kind, options, training, x, y)
        arrays[f"{name}/losses"] = losses
        for w, v in weights.items():
            arrays[f"{name}/{w}"] = v
        print(f"{name:20s} losses {np.round(losses, 4).tolist()}")
    np.savez(os.path.join(HERE, "trajectories.npz"), **arrays)
    runs = {name: {"optimizer": kind, "options": options, "training": training}
            for name, (kind, options, training) in RUNS.items()}
    with open(os.path.join(HERE, "runs.json"), "w") as f:
        json.dump({"steps": STEPS, "batch": BATCH, "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
