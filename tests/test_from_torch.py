"""onnxgrad.from_torch: small PyTorch architectures exported with it train in a TrainingSession as
``model.train()`` + the same torch.optim optimizer train them: the loss of every step, the parameters
and the BatchNorm running statistics after the steps agree to float32 rounding."""
from __future__ import annotations

import copy
import functools
import math

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import onnxgrad  # noqa: E402
from onnxgrad import TrainingSession, losses, optim  # noqa: E402
from onnxgrad.torch_export import FROM_TORCH_KEY, TORCH_TRAINING_KEY, TorchExportError  # noqa: E402

STEPS = 4
RTOL = 1e-5            # float32: the relative difference of a loss, a parameter or a running statistic
WORST: dict[str, float] = {}


# -- the architectures --------------------------------------------------------------------------------
class SqueezeExcite(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.reduce = nn.Linear(channels, channels // 2)
        self.expand = nn.Linear(channels // 2, channels)

    def forward(self, x):
        w = torch.sigmoid(self.expand(F.relu(self.reduce(x.mean((2, 3))))))
        return x * w[:, :, None, None]


class ResidualCNN(nn.Module):
    """Conv-BN-ReLU, then a residual block whose branch is Conv-BN-squeeze-excitation."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)   # a bias before BatchNorm has no gradient
        self.stem_bn = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8, momentum=0.2)
        self.se = SqueezeExcite(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        h = F.relu(self.stem_bn(self.stem(x)))
        h = F.relu(h + self.se(self.bn(self.conv(h))))
        return self.head(h.mean((2, 3)))


class LSTMClassifier(nn.Module):
    def __init__(self, features: int = 6, hidden: int = 8, classes: int = 4):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class TransformerClassifier(nn.Module):
    """nn.TransformerEncoder (LayerNorm, GELU) over a sequence, mean-pooled. Without biases: the attention's
    key bias has no gradient (softmax cancels it) but rounding, which Adam divides by its own magnitude."""

    def __init__(self, features: int = 6, width: int = 16, classes: int = 4, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Linear(features, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=32, dropout=dropout, activation="gelu",
                                           batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class CausalBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)      # a key bias has no gradient: softmax cancels it
        self.value = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x):
        n, t, c = x.shape
        h = self.ln1(x)
        q, k, v = self.query(h), self.key(h), self.value(h)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        scores = scores.masked_fill(self.mask[:t, :t] == 0, float("-inf"))
        y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(n, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style language model whose LM head is the token embedding (tied weights)."""

    def __init__(self, vocab: int = 11, width: int = 16, context: int = 8, layers: int = 2):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(CausalBlock(width, 2) for _ in range(layers))
        mask = torch.tril(torch.ones(context, context))
        for block in self.blocks:
            block.register_buffer("mask", mask)
        self.ln = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.tokens.weight

    def forward(self, ids):
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln(h)).transpose(1, 2)      # (N, vocab, T): cross_entropy's class axis 1


class FrozenAndBuffer(nn.Module):
    """An MLP with a frozen (requires_grad=False) input projection and a registered normalising buffer."""

    def __init__(self):
        super().__init__()
        self.project = nn.Linear(6, 12)
        self.project.weight.requires_grad_(False)
        self.temperature = nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.register_buffer("centre", torch.linspace(-1, 1, 6))
        self.hidden = nn.Linear(12, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(F.relu(self.project(x - self.centre))))) / self.temperature


# -- data and the two trainers ------------------------------------------------------------------------
def batches(kind: str, rng: np.random.Generator, n: int = 6):
    """``STEPS`` batches of (input, target) for one architecture."""
    for _ in range(STEPS):
        if kind == "image":
            yield rng.standard_normal((n, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, n)
        elif kind == "sequence":
            yield rng.standard_normal((n, 5, 6)).astype(np.float32), rng.integers(0, 4, n)
        elif kind == "tokens":
            ids = rng.integers(0, 11, (n, 8))
            yield ids, np.roll(ids, -1, axis=1)
        elif kind == "regression":
            yield rng.standard_normal((n, 6)).astype(np.float32), rng.standard_normal((n, 3)).astype(np.float32)


OPTIMIZERS = {
    "sgd": (lambda: optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3)),
    "adamw": (lambda: optim.AdamW(lr=1e-2, weight_decay=0.05),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05)),
}


def relative(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference relative to the reference's scale (its largest magnitude, at least 1e-3)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-3)) if b.size else 0.0


@functools.lru_cache(maxsize=None)
def exported(name: str) -> onnx.ModelProto:
    """The from_torch export of case ``name``'s module (made once; each test trains a copy)."""
    module, example = fresh(name)
    return onnxgrad.from_torch(module, (torch.from_numpy(example),), dynamic_batch=True,
                               input_names=["x"], output_names=["logits"])


def fresh(name: str) -> tuple[nn.Module, np.ndarray]:
    """Case ``name``'s module, initialised from seed 0 and in train mode, and an example input of batch 2."""
    make, kind, _ = CASES[name]
    torch.manual_seed(0)
    module = make().train()
    example, _ = next(batches(kind, np.random.default_rng(1), n=2))
    return module, example


def train_both(name: str, optimizer: str):
    """Train case ``name``'s module for STEPS steps in PyTorch (train mode) and in a TrainingSession on its
    from_torch export, on the same batches; compare losses, parameters and running statistics."""
    _, data_kind, loss = CASES[name]
    reference, _ = fresh(name)
    model = copy.deepcopy(exported(name))
    make, make_torch = OPTIMIZERS[optimizer]
    loss_fn = (losses.CrossEntropyLoss(output="logits", target="y") if loss == "cross_entropy"
               else losses.MSELoss(output="logits", target="y"))
    session = TrainingSession(model, loss=loss_fn, optimizer=make())
    torch_optimizer = make_torch([p for p in reference.parameters() if p.requires_grad])
    torch_loss = F.cross_entropy if loss == "cross_entropy" else F.mse_loss
    worst = {"loss": 0.0, "parameter": 0.0, "running statistic": 0.0}
    for x, y in batches(data_kind, np.random.default_rng(0)):
        got = session.step({"x": x, "y": y})
        torch_optimizer.zero_grad()
        expected = torch_loss(reference(torch.from_numpy(x)), torch.from_numpy(y))
        expected.backward()
        torch_optimizer.step()
        worst["loss"] = max(worst["loss"], relative(got, expected.item()))
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    params = session.parameters()
    # the session trains exactly PyTorch's requires_grad parameters, each once (a tied one under one of its names)
    by_name = dict(reference.named_parameters(remove_duplicate=False))
    assert sorted(id(by_name[n]) for n in session.spec.params) == sorted(
        id(p) for p in reference.parameters() if p.requires_grad)
    for n, value in params.items():
        worst["parameter"] = max(worst["parameter"], relative(value, state[n]))
    for n, value in session.buffers().items():
        worst["running statistic"] = max(worst["running statistic"], relative(value, state[n]))
    WORST[f"{name}/{optimizer}"] = max(worst.values())
    print(f"{name} {optimizer}: " + ", ".join(f"worst {k} {v:.1e}" for k, v in worst.items()))
    for what, value in worst.items():
        assert value <= RTOL, f"{name} with {optimizer}: {what} differs by {value:.2e} relative after {STEPS} steps"
    return session, model


# -- the trajectories ---------------------------------------------------------------------------------
CASES = {
    "cnn_bn_se_residual": (lambda: ResidualCNN(), "image", "cross_entropy"),
    "lstm_classifier": (lambda: LSTMClassifier(), "sequence", "cross_entropy"),
    "transformer_encoder": (lambda: TransformerClassifier(), "sequence", "cross_entropy"),
    "gpt_tied_head": (lambda: TinyGPT(), "tokens", "cross_entropy"),
    "frozen_and_buffer": (lambda: FrozenAndBuffer(), "regression", "mse"),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_trains_as_pytorch(name, optimizer):
    train_both(name, optimizer)
