"""Audit onnxgrad.tools.compare_with_torch on four models, random weights, nothing downloaded:

- ``efficientnet``: an EfficientNet-B0-like CNN in plain torch (stem Conv-BN-SiLU, MBConv blocks with a 1x1
  expansion, a depthwise 3x3, squeeze-excitation and a residual, a Conv-BN-SiLU head, Dropout 0.2);
- ``resnet``: a ResNet-like CNN in plain torch, its convolutions with biases before BatchNorm (as hand-written
  ResNets often have: those biases have a gradient of zero but for rounding);
- ``distilbert``: transformers' DistilBertForSequenceClassification from a small config, its default dropout;
- ``vit``: transformers' ViTForImageClassification from a small config, dropout 0.1 (hidden and attention).

    pip install transformers   # for distilbert and vit; the others run without it
    python bench/audit_compare.py [--steps 3] [--only efficientnet resnet ...]

Each trains ``--steps`` AdamW steps (lr 1e-3, weight decay 0.01) in onnxgrad and in PyTorch float32 and
float64, and prints the tool's report: per-step losses, the worst parameters, the noise-only ones named apart,
the naive worst difference beside PyTorch's own float32-vs-float64 one, and the verdict.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

try:
    import torch
except ImportError:
    print('skipped: torch is not installed (pip install "onnxgrad[torch]")')
    sys.exit(0)

from onnxgrad import optim
from onnxgrad.tools.compare import compare_with_torch

nn = torch.nn


# -- EfficientNet-like --------------------------------------------------------------------------------
def conv_bn_silu(cin: int, cout: int, k: int = 1, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01), nn.SiLU())


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(nn.functional.silu(self.reduce(s))))


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, expand: int, stride: int):
        super().__init__()
        mid = cin * expand
        self.expand = conv_bn_silu(cin, mid) if expand != 1 else nn.Identity()
        self.depthwise = conv_bn_silu(mid, mid, 3, stride, groups=mid)
        self.se = SqueezeExcite(mid, max(1, cin // 4))
        self.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        h = self.project(self.se(self.depthwise(self.expand(x))))
        return x + h if self.residual else h


class EfficientNetLike(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = conv_bn_silu(3, 16, 3, 2)
        self.blocks = nn.Sequential(MBConv(16, 16, 1, 1), MBConv(16, 24, 6, 2), MBConv(24, 24, 6, 1),
                                    MBConv(24, 40, 6, 2), MBConv(40, 40, 6, 1))
        self.head = conv_bn_silu(40, 96)
        self.dropout = nn.Dropout(0.2)
        self.classifier = nn.Linear(96, classes)

    def forward(self, x):
        h = self.head(self.blocks(self.stem(x))).mean((2, 3))
        return self.classifier(self.dropout(h))


# -- ResNet-like --------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)          # a bias before BatchNorm
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.down(x) + self.bn2(self.conv2(h)))


class ResNetLike(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


# -- transformers, from small configs -----------------------------------------------------------------
def distilbert() -> nn.Module:
    import transformers

    config = transformers.DistilBertConfig(vocab_size=100, max_position_embeddings=32, dim=32, n_layers=2,
                                           n_heads=2, hidden_dim=64, num_labels=3)   # dropout 0.1, 0.1, 0.2
    return transformers.DistilBertForSequenceClassification(config)


def vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=5,
                                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return transformers.ViTForImageClassification(config)


def image_batches(rng, steps: int, n: int, size: int, classes: int):
    return [(rng.standard_normal((n, 3, size, size)).astype(np.float32), rng.integers(0, classes, n))
            for _ in range(steps)]


def token_batches(rng, steps: int, n: int = 4, length: int = 12):
    out = []
    for _ in range(steps):
        ids = rng.integers(0, 100, (n, length))
        mask = np.ones((n, length), np.int64)
        mask[0, length // 2:] = 0                      # one padded sequence
        out.append(((ids, mask), rng.integers(0, 3, n)))
    return out


MODELS = {
    "efficientnet": (EfficientNetLike, lambda rng, s: image_batches(rng, s, 4, 32, 10)),
    "resnet": (ResNetLike, lambda rng, s: image_batches(rng, s, 4, 16, 10)),
    "distilbert": (distilbert, token_batches),
    "vit": (vit, lambda rng, s: image_batches(rng, s, 4, 16, 5)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS))
    args = parser.parse_args()
    print(f"torch {torch.__version__}, AdamW(lr=1e-3, weight_decay=0.01), {args.steps} steps, train mode")
    for name in args.only or list(MODELS):
        make, batches = MODELS[name]
        try:
            torch.manual_seed(0)
            module = make().train()
        except ImportError as e:
            print(f"\n== {name}: skipped, {e.name} is not installed (pip install transformers)")
            continue
        start = time.perf_counter()
        report = compare_with_torch(module, batches(np.random.default_rng(0), args.steps),
                                    optim.AdamW(lr=1e-3, weight_decay=0.01))
        print(f"\n== {name} ({time.perf_counter() - start:.0f} s)")
        print(report)


if __name__ == "__main__":
    main()
