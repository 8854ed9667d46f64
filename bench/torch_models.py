"""The PyTorch models of bench_families.py: torchvision's MobileNetV2, MobileNetV3-Large, EfficientNet-B0 and
ResNet-18, written in plain torch, and transformers' BERT and GPT-2 from configs (random weights).

torchvision's wheel does not import beside this machine's CPU torch, and timm needs torchvision, so the
benchmarks build the same networks here: the same layer configurations, channel counts, activations
(ReLU6, Hardswish, SiLU), squeeze-and-excitation blocks and classifier heads as torchvision's
``mobilenet_v2``, ``mobilenet_v3_large``, ``efficientnet_b0`` and ``resnet18`` (random weights, 1000
classes). Left out: EfficientNet's stochastic depth (``StochasticDepth`` is identity at rate 0, which is what
this module uses); the classifiers' Dropout is kept, as in training.

:func:`example` gives each model with a batch: the module (its output: logits [N, classes]), its inputs and the
class targets.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _divisible(v: float, divisor: int = 8) -> int:
    """torchvision's ``_make_divisible``: round to a multiple of ``divisor``, never below 90% of ``v``."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: type | None = nn.ReLU6):
    layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, act()) if act else nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int, act: type, gate: type):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(x.mean((2, 3), keepdim=True)))))


class InvertedResidual(nn.Module):
    """MobileNetV2's block, V3's (with its squeeze-and-excitation and activation) and EfficientNet's MBConv."""

    def __init__(self, cin: int, hidden: int, cout: int, k: int, stride: int, act: type, se: nn.Module | None):
        super().__init__()
        layers = [_conv_bn(cin, hidden, 1, act=act)] if hidden != cin else []
        layers.append(_conv_bn(hidden, hidden, k, stride, groups=hidden, act=act))
        if se is not None:
            layers.append(se)
        layers.append(_conv_bn(hidden, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.block(x) if self.residual else self.block(x)


class _Classifier(nn.Module):
    def __init__(self, features: nn.Module, head: nn.Module):
        super().__init__()
        self.features, self.classifier = features, head

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


def mobilenet_v2(classes: int = 1000) -> nn.Module:
    layers, cin = [_conv_bn(3, 32, 3, 2)], 32
    for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                       (6, 320, 1, 1)]:
        for i in range(n):
            layers.append(InvertedResidual(cin, cin * t, c, 3, s if i == 0 else 1, nn.ReLU6, None))
            cin = c
    layers.append(_conv_bn(cin, 1280, 1))
    return _Classifier(nn.Sequential(*layers), nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes)))


def mobilenet_v3_large(classes: int = 1000) -> nn.Module:
    layers, cin = [_conv_bn(3, 16, 3, 2, act=nn.Hardswish)], 16
    for k, hidden, cout, se, act, s in [
            (3, 16, 16, False, nn.ReLU, 1), (3, 64, 24, False, nn.ReLU, 2), (3, 72, 24, False, nn.ReLU, 1),
            (5, 72, 40, True, nn.ReLU, 2), (5, 120, 40, True, nn.ReLU, 1), (5, 120, 40, True, nn.ReLU, 1),
            (3, 240, 80, False, nn.Hardswish, 2), (3, 200, 80, False, nn.Hardswish, 1),
            (3, 184, 80, False, nn.Hardswish, 1), (3, 184, 80, False, nn.Hardswish, 1),
            (3, 480, 112, True, nn.Hardswish, 1), (3, 672, 112, True, nn.Hardswish, 1),
            (5, 672, 160, True, nn.Hardswish, 2), (5, 960, 160, True, nn.Hardswish, 1),
            (5, 960, 160, True, nn.Hardswish, 1)]:
        excite = SqueezeExcitation(hidden, _divisible(hidden // 4), nn.ReLU, nn.Hardsigmoid) if se else None
        layers.append(InvertedResidual(cin, hidden, cout, k, s, act, excite))
        cin = cout
    layers.append(_conv_bn(cin, 960, 1, act=nn.Hardswish))
    head = nn.Sequential(nn.Linear(960, 1280), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1280, classes))
    return _Classifier(nn.Sequential(*layers), head)


def efficientnet_b0(classes: int = 1000) -> nn.Module:
    layers, cin = [_conv_bn(3, 32, 3, 2, act=nn.SiLU)], 32
    for t, k, s, c, n in [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
                          (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]:
        for i in range(n):
            excite = SqueezeExcitation(cin * t, max(1, cin // 4), nn.SiLU, nn.Sigmoid)
            layers.append(InvertedResidual(cin, cin * t, c, k, s if i == 0 else 1, nn.SiLU, excite))
            cin = c
    layers.append(_conv_bn(cin, 1280, 1, act=nn.SiLU))
    return _Classifier(nn.Sequential(*layers), nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes)))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(_conv_bn(cin, cout, 3, stride, act=nn.ReLU), _conv_bn(cout, cout, 3, act=None))
        self.down = _conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else nn.Identity()
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.body(x) + self.down(x))


def resnet18(classes: int = 1000) -> nn.Module:
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in [(64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)]:
        layers.append(_BasicBlock(cin, cout, stride))
        cin = cout
    return _Classifier(nn.Sequential(*layers), nn.Linear(512, classes))


class _Logits(nn.Module):
    """A transformers model's logits, [N, classes] (a language model's flattened over the positions)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        logits = self.model(input_ids=ids).logits
        return logits.reshape(-1, logits.shape[-1])


def bert() -> nn.Module:
    """BERT for sequence classification: 4 layers, hidden 256, 4 heads, 2 classes (BERT's vocabulary)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                        num_labels=2)
    return _Logits(BertForSequenceClassification(config))


def gpt2() -> nn.Module:
    """GPT-2 as a language model: 4 layers, width 256, 4 heads, 128 positions, GPT-2's 50257-token vocabulary."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128)
    return _Logits(GPT2LMHeadModel(config))


VISION = {"mobilenet_v2": mobilenet_v2, "mobilenet_v3_large": mobilenet_v3_large,
          "efficientnet_b0": efficientnet_b0, "resnet18": resnet18}
TEXT = {"bert": (bert, 8, 2), "gpt2": (gpt2, 4, 50257)}       # model, batch, classes; sequences of 128
MODELS = [*VISION, *TEXT]


def example(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """Model ``name`` (random weights from seed 0) with a batch: images 3x64x64, batch 4, 1000 classes; token
    sequences of 128 (batch 8 for BERT, 4 for GPT-2, whose targets are one per position)."""
    torch.manual_seed(0)
    if name in VISION:
        return VISION[name](), (torch.randn(4, 3, 64, 64),), torch.randint(0, 1000, (4,))
    build, batch, classes = TEXT[name]
    ids = torch.randint(0, 1000, (batch, 128))
    targets = torch.randint(0, classes, (batch * 128 if name == "gpt2" else batch,))
    return build(), (ids,), targets
