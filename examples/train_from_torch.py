"""Train a small PyTorch CNN on scikit-learn's digits with onnxgrad and stock onnxruntime.

    pip install ".[torch,examples]"
    python examples/train_from_torch.py [--epochs 8] [--export digits_cnn.onnx]

The model is written in PyTorch (Conv-BatchNorm-ReLU twice, Dropout, Linear) and exported for training
with onnxgrad.from_torch; the loss comes from onnxgrad.losses and every step is one onnxruntime run
(forward, loss, backward, the AdamW update and the BatchNorm running statistics), written into the
module's own tensors (``module=``), as ``torch.optim`` would: PyTorch runs no step, and the module is the
trained model afterwards. Ends with ``test accuracy: <value>`` (about 0.97) and, as a check of the
session's inference graph, the largest difference between its outputs and the trained module's own
``eval()`` outputs.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import onnxgrad
from onnxgrad import TrainingSession, losses, optim


class DigitsCNN(nn.Module):
    """1x8x8 images -> 10 logits."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--export", metavar="PATH", help="write the trained inference model here")
    args = p.parse_args()

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]          # (N, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)

    torch.manual_seed(0)
    module = DigitsCNN().train()
    model = onnxgrad.from_torch(module, (torch.from_numpy(x_train[:2]),), dynamic_batch=True,
                                input_names=["image"], output_names=["logits"])
    session = TrainingSession(model, loss=losses.CrossEntropyLoss(output="logits", target="label"),
                              optimizer=optim.AdamW(lr=args.lr, weight_decay=1e-4), module=module)
    rng = np.random.default_rng(0)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        for k in range(0, len(order), args.batch):
            idx = order[k:k + args.batch]
            loss = session.step({"image": x_train[idx], "label": y_train[idx]})
        print(f"epoch {epoch + 1}: last loss {loss:.4f}")

    logits = session.eval({"image": x_test})["logits"]
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
    # the session trained the module's own weights and running statistics: its eval() agrees
    with torch.no_grad():
        expected = module.eval()(torch.from_numpy(x_test)).numpy()
    print(f"largest difference from the PyTorch module's eval(): {np.abs(logits - expected).max():.1e}")
    if args.export:
        session.export(args.export)
        print(f"wrote {args.export}")
    print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
