"""onnxgrad.from_torch: small PyTorch architectures exported with it train in a TrainingSession as
``model.train()`` + the same torch.optim optimizer train them: the loss of every step, the parameters
and the BatchNorm running statistics after the steps agree to float32 rounding."""
from __future__ import annotations

import copy
import functools
import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")       # torch.onnx's dynamo exporter
nn = torch.nn
F = torch.nn.functional

import onnxgrad  # noqa: E402
from onnxgrad import TrainingSession, losses, optim  # noqa: E402
from onnxgrad.passes.params import NO_GRADIENT_KEY, REQUIRES_GRAD_KEY  # noqa: E402
from onnxgrad.training.torch_export import FROM_TORCH_KEY, TORCH_TRAINING_KEY, TorchExportError  # noqa: E402

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
    # inference after training: the session's exported model in stock onnxruntime is PyTorch's eval()
    x, _ = next(batches(data_kind, np.random.default_rng(2)))
    inference = ort.InferenceSession(session.exported_model().SerializeToString(), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = reference.eval()(torch.from_numpy(x)).numpy()
    worst["exported model's output"] = relative(inference.run(["logits"], {"x": x})[0], expected)
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


# the inner loop (-m "not slow") trains the BatchNorm CNN with SGD and the frozen-parameter MLP; the rest
# runs with the slow suites (an export and a session build take seconds each)
FAST = {("cnn_bn_se_residual", "sgd"), ("frozen_and_buffer", "sgd"), ("frozen_and_buffer", "adamw")}


@pytest.mark.parametrize("name, optimizer", [
    pytest.param(name, opt, marks=() if (name, opt) in FAST else pytest.mark.slow)
    for name in sorted(CASES) for opt in sorted(OPTIMIZERS)])
def test_trains_as_pytorch(name, optimizer):
    train_both(name, optimizer)


def test_train_mode_false_trains_as_pytorchs_eval_mode():
    """The same export, train_mode=False: BatchNorm on its running statistics (not updated), no Dropout."""
    reference, _ = fresh("cnn_bn_se_residual")
    reference.eval()
    session = TrainingSession(copy.deepcopy(exported("cnn_bn_se_residual")), train_mode=False,
                              loss=losses.CrossEntropyLoss(output="logits", target="y"),
                              optimizer=OPTIMIZERS["sgd"][0]())
    torch_optimizer = OPTIMIZERS["sgd"][1](reference.parameters())
    for x, y in batches("image", np.random.default_rng(0)):
        got = session.step({"x": x, "y": y})
        torch_optimizer.zero_grad()
        expected = F.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y))
        expected.backward()
        torch_optimizer.step()
        assert relative(got, expected.item()) <= RTOL
    state = reference.state_dict()
    for name, value in session.parameters().items():
        assert relative(value, state[name].numpy()) <= RTOL, name
    assert session.buffers() == {}


# -- what the export holds and records ----------------------------------------------------------------
def test_the_export_is_standard_onnx_and_records_its_origin():
    module, example = fresh("frozen_and_buffer")
    model = exported("frozen_and_buffer")
    onnx.checker.check_model(model, full_check=True)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta[FROM_TORCH_KEY] == torch.__version__ and meta[TORCH_TRAINING_KEY] == "true"
    inits = {i.name: {p.key: p.value for p in i.metadata_props} for i in model.graph.initializer}
    marked = {n for n, props in inits.items() if props.get(REQUIRES_GRAD_KEY) == "false"}
    assert marked == {"project.weight", "temperature"}
    report = onnxgrad.parameters(losses.mse_loss(model, output="logits", target="y"))
    assert sorted(report.trainable) == sorted(n for n, p in module.named_parameters() if p.requires_grad)
    assert "requires_grad=False" in report["project.weight"].reason
    assert "buffer" in report["centre"].reason
    # the batch axis is dynamic: a batch of 5 runs although the example had 2
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((5, 6)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(sess.run(["logits"], {"x": x})[0], module.eval()(torch.from_numpy(x)).numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_every_parameter_stays_one_tensor_under_its_pytorch_name():
    """No folding and no merging: BatchNorm nodes and their running statistics are there, and parameters that
    hold equal values (zero biases, norm weights of 1) stay apart."""
    module, _ = fresh("cnn_bn_se_residual")
    model = exported("cnn_bn_se_residual")
    names = {i.name for i in model.graph.initializer}
    assert set(module.state_dict()) - {n for n in module.state_dict() if n.endswith("num_batches_tracked")} <= names
    assert sum(n.op_type == "BatchNormalization" for n in model.graph.node) == 2
    assert np.array_equal(module.stem_bn.bias.detach().numpy(), module.bn.bias.detach().numpy())   # both zeros


def test_dropout_is_present_and_active_in_training_only():
    torch.manual_seed(0)
    module = TransformerClassifier(dropout=0.5).eval()          # the module's own mode: recorded, restored
    x, y = next(batches("sequence", np.random.default_rng(0)))
    model = onnxgrad.from_torch(module, (torch.from_numpy(x),), input_names=["x"], output_names=["logits"])
    assert not any(m.training for m in module.modules())
    assert {p.key: p.value for p in model.metadata_props}[TORCH_TRAINING_KEY] == "false"
    assert sum(n.op_type == "Dropout" for n in model.graph.node) >= 4
    session = TrainingSession(model, loss=losses.CrossEntropyLoss(output="logits", target="y"),
                              optimizer=optim.SGD(lr=0.0))
    steps = [session.step({"x": x, "y": y}) for _ in range(3)]
    evaluated = session.eval({"x": x, "y": y})
    with torch.no_grad():
        expected = F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert relative(evaluated["loss"], expected) <= RTOL          # eval(): no dropout, PyTorch's eval()
    assert len(set(steps)) == 3 and all(abs(s - expected) > 1e-4 for s in steps)   # a fresh mask per step


class MaskedMean(nn.Module):
    """Two inputs, the second a keyword argument: a padding mask over the sequence."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 4)

    def forward(self, x, mask=None):
        h = self.proj(x) * mask[..., None]
        return h.sum(1) / mask.sum(1, keepdim=True)


def test_keyword_arguments_and_a_dynamic_batch():
    module = MaskedMean()
    x, mask = torch.randn(2, 5, 6), torch.ones(2, 5)
    model = onnxgrad.from_torch(module, (x,), {"mask": mask}, dynamic_batch=True)
    assert [i.name for i in model.graph.input] == ["x", "mask"]
    assert all(i.type.tensor_type.shape.dim[0].dim_param == "batch" for i in model.graph.input)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x, mask = torch.randn(3, 5, 6), (torch.rand(3, 5) > 0.3).float() + torch.eye(3, 5)
    with torch.no_grad():
        expected = module(x, mask=mask).numpy()
    np.testing.assert_allclose(sess.run(None, {"x": x.numpy(), "mask": mask.numpy()})[0], expected, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.slow                   # the GPT export; its trajectories are slow too
def test_a_tied_head_is_one_initializer():
    module, _ = fresh("gpt_tied_head")
    model = exported("gpt_tied_head")
    holders = [i.name for i in model.graph.initializer if i.name in ("tokens.weight", "lm_head.weight")]
    assert len(holders) == 1
    report = onnxgrad.parameters(losses.cross_entropy(model, output="logits", target="y"))
    assert holders[0] in report.trainable
    assert len(report.trainable) == len(list(module.parameters()))      # parameters() counts a tied one once


# -- what is refused ----------------------------------------------------------------------------------
@pytest.mark.parametrize("option, message", [
    ({"optimize": True}, "optimize=True would break training"),
    ({"dynamo": False}, "dynamo=False would break training"),
    ({"f": "model.onnx"}, "onnx.save"),
    ({"training": 1}, "module.train()"),
    ({"dynamic_batch": True, "dynamic_shapes": {"x": {0: "n"}}}, "not both"),
])
def test_options_that_would_break_training_are_refused(option, message):
    with pytest.raises(TorchExportError, match=message):
        onnxgrad.from_torch(nn.Linear(2, 2), (torch.zeros(1, 2),), **option)


def test_the_settings_training_needs_may_be_given():
    model = onnxgrad.from_torch(nn.Linear(2, 2), (torch.zeros(1, 2),), dynamo=True, optimize=False, opset_version=18)
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 18


def test_batch_norms_it_cannot_train_as_pytorch_are_refused():
    for layer, message in ((nn.BatchNorm1d(3, momentum=None), "momentum=None"),
                           (nn.BatchNorm1d(3, track_running_stats=False), "track_running_stats=False")):
        with pytest.raises(TorchExportError, match=message):
            onnxgrad.from_torch(nn.Sequential(nn.Linear(2, 3), layer), (torch.zeros(2, 2),))
    mixed = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Dropout(0.1)).train()
    mixed[1].eval()
    with pytest.raises(TorchExportError, match="different modes"):
        onnxgrad.from_torch(mixed, (torch.zeros(2, 2),))


class ReturnsAnObject(nn.Module):
    def forward(self, x):
        return {"value": x, "shape": object()}


def test_a_module_the_exporter_cannot_export_is_one_error_of_ours():
    with pytest.raises(TorchExportError, match="could not export ReturnsAnObject") as e:
        onnxgrad.from_torch(ReturnsAnObject(), (torch.zeros(2),))
    assert "\n" not in str(e.value) and isinstance(e.value.__cause__, torch.onnx.OnnxExporterError)


@pytest.mark.parametrize("missing, said", [
    (["torch"], "torch is missing"),
    (["onnxscript"], "onnxscript is missing"),
    (["torch", "onnxscript"], "torch and onnxscript are missing"),
])
def test_without_torch_the_error_says_what_is_missing_and_how_to_install_it(monkeypatch, missing, said):
    import sys

    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)        # import fails as if not installed
    with pytest.raises(TorchExportError, match=said + r': pip install "onnxgrad\[torch\]" installs both'):
        onnxgrad.from_torch(object(), ())


# -- parameters not in the graph: the forward's unused ones change nothing; a used one lost does ---------
class KeepsAnUnusedCopy(nn.Module):
    """As peft's ``modules_to_save`` wrapper: the original layer kept beside the copy the forward uses (here
    trainable too, and one frozen parameter beside it)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.original_module = nn.Linear(4, 3)
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(self.original_module)})
        self.unused_frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x):
        return self.modules_to_save["default"](torch.relu(self.body(x)))


def _session_warnings(model):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = TrainingSession(model, loss=losses.MSELoss(output="logits", target="y"),
                                  optimizer=optim.AdamW(lr=1e-2))
    return session, [str(w.message) for w in caught if issubclass(w.category, onnxgrad.ExportWarning)]


@functools.lru_cache(maxsize=None)
def _unused_copy_export() -> onnx.ModelProto:
    torch.manual_seed(0)
    return onnxgrad.from_torch(KeepsAnUnusedCopy(), (torch.randn(2, 4),), input_names=["x"], output_names=["logits"])


def test_parameters_the_forward_does_not_use_are_no_warning_and_are_named_in_the_report():
    model = copy.deepcopy(_unused_copy_export())
    assert "original_module.weight" not in {i.name for i in model.graph.initializer}
    session, said = _session_warnings(model)
    assert said == []
    assert sorted(session.spec.params) == ["body.bias", "body.weight", "modules_to_save.default.bias",
                                           "modules_to_save.default.weight"]
    report = onnxgrad.parameters(model)
    assert sorted(report.untouched) == ["original_module.bias", "original_module.weight", "unused_frozen"]
    assert any("get no gradient in PyTorch either" in line for line in report.lines())


def test_a_used_parameter_missing_from_the_graph_still_warns():
    """An exporter that folded a parameter the forward uses into a constant: PyTorch trains it, the graph
    cannot, so training differs and the warning stays (the unused ones stay quiet beside it)."""
    model = copy.deepcopy(_unused_copy_export())
    for init in model.graph.initializer:
        if init.name == "body.bias":
            init.name = "val_99"
            del init.metadata_props[:]
    for node in model.graph.node:
        node.input[:] = ["val_99" if x == "body.bias" else x for x in node.input]
    _, said = _session_warnings(model)
    assert len(said) == 1 and "1 PyTorch parameter(s) of the module are not in the graph ('body.bias')" in said[0]
    assert "original_module" not in said[0]


def test_the_check_leaves_the_modules_state_alone():
    """The forward that tells used from unused parameters runs in train mode on the example: the running
    statistics and the module's mode are as before."""
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.spare = nn.Linear(2, 2)

        def forward(self, x):
            return F.dropout(self.bn(self.conv(x)), 0.5, self.training)

    module = Unused().eval()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    model = onnxgrad.from_torch(module, (torch.randn(2, 3, 6, 6),))
    assert not module.training
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert json.loads(dict((p.key, p.value) for p in model.metadata_props)[NO_GRADIENT_KEY]) == [
        "spare.weight", "spare.bias"]


# -- module=: the module itself trained, as torch.optim trains it -------------------------------------
def _linked_session(name: str, **options) -> tuple[TrainingSession, nn.Module]:
    """A session on case ``name``'s export given the exported module itself (``module=``)."""
    _, _, loss = CASES[name]
    module, example = fresh(name)
    model = onnxgrad.from_torch(module, (torch.from_numpy(example),), dynamic_batch=True, input_names=["x"],
                                output_names=["logits"])
    loss_fn = (losses.CrossEntropyLoss(output="logits", target="y") if loss == "cross_entropy"
               else losses.MSELoss(output="logits", target="y"))
    return TrainingSession(model, loss=loss_fn, optimizer=OPTIMIZERS["adamw"][0](), module=module, **options), module


def _assert_trained_alike(module: nn.Module, reference: nn.Module, what: str) -> None:
    """``module``'s state is ``reference``'s: parameters and running statistics to float32 rounding, the
    batch counts exactly."""
    mine, theirs = module.state_dict(), reference.state_dict()
    assert mine.keys() == theirs.keys()
    for k, v in mine.items():
        if k.endswith("num_batches_tracked"):
            assert int(v) == int(theirs[k]), f"{what}: {k} is {int(v)}, PyTorch's {int(theirs[k])}"
        else:
            assert relative(v.numpy(), theirs[k].numpy()) <= RTOL, f"{what}: {k}"


@pytest.mark.parametrize("name, accumulation", [
    ("cnn_bn_se_residual", 1),
    ("cnn_bn_se_residual", 2),
    pytest.param("gpt_tied_head", 1, marks=pytest.mark.slow),
])
def test_the_module_given_is_trained_in_place_as_torch_optim_trains_it(name, accumulation):
    """After every step the module holds what torch.optim's step gives (its running statistics and
    batch counts too), in the same memory the session updates: one copy of each trained tensor."""
    session, module = _linked_session(name, accumulation_steps=accumulation)
    tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())
    trained = [*session.spec.params, *session.spec.buffers]
    assert trained and all(session._cur[n].data_ptr() == tensors[n].data_ptr() for n in trained)
    reference, _ = fresh(name)
    torch_optimizer = OPTIMIZERS["adamw"][1]([p for p in reference.parameters() if p.requires_grad])
    torch_loss = F.cross_entropy if CASES[name][2] == "cross_entropy" else F.mse_loss
    for k, (x, y) in enumerate(batches(CASES[name][1], np.random.default_rng(0))):
        session.step({"x": x, "y": y})
        (torch_loss(reference(torch.from_numpy(x)), torch.from_numpy(y)) / accumulation).backward()
        if (k + 1) % accumulation == 0:
            torch_optimizer.step()
            torch_optimizer.zero_grad()
        _assert_trained_alike(module, reference, f"after step {k + 1}")
    held = session.parameters()
    assert all(np.array_equal(held[n], tensors[n].detach().numpy()) for n in session.spec.params)


def test_tensors_the_step_does_not_update_in_place_are_copied_into_the_module(monkeypatch):
    """A tensor the update graph cannot write in place (here: none may) keeps its spare buffer; the module
    still holds the current values after every step."""
    import onnxgrad.training.artifacts as A

    monkeypatch.setattr(A, "in_place", lambda *args: set())
    session, module = _linked_session("cnn_bn_se_residual")
    assert session._linked == {}
    reference, _ = fresh("cnn_bn_se_residual")
    torch_optimizer = OPTIMIZERS["adamw"][1](reference.parameters())
    for k, (x, y) in enumerate(batches("image", np.random.default_rng(0))):
        session.step({"x": x, "y": y})
        torch_optimizer.zero_grad()
        F.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        torch_optimizer.step()
        _assert_trained_alike(module, reference, f"after step {k + 1}")


def test_load_parameters_and_restore_write_into_the_module(tmp_path):
    session, module = _linked_session("cnn_bn_se_residual")
    x, y = next(batches("image", np.random.default_rng(0)))
    session.step({"x": x, "y": y})
    session.save(tmp_path / "ckpt.onnxgrad")
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    session.step({"x": x, "y": y})
    session.load_parameters({"head.bias": np.full(5, 7.0, np.float32)})
    assert torch.equal(module.head.bias.detach(), torch.full((5,), 7.0))
    session.restore(tmp_path / "ckpt.onnxgrad")
    for k, v in module.state_dict().items():
        if not k.endswith("num_batches_tracked"):        # a count of batches seen; checkpoints hold no count
            assert torch.equal(v, saved[k]), k


@pytest.mark.parametrize("other, options, said", [
    ("another seed", {}, r"module=: the module's '.*' holds other values than the model's .* export it again"),
    ("another architecture", {}, r"module=: the session trains '.*', which the module has no parameter or buffer"),
    ("not a module", {}, r"module= takes the torch.nn.Module the model was exported from, got dict"),
    ("the module", {"providers": ["CUDAExecutionProvider"]},
     r"module= trains the module's CPU tensors in place, in a CPU session, and this session would run on "
     r"CUDAExecutionProvider: pass providers=\['CPUExecutionProvider'\]"),
])
def test_a_module_the_session_cannot_train_in_place_is_refused_before_the_first_step(other, options, said):
    module, example = fresh("cnn_bn_se_residual")
    model = copy.deepcopy(exported("cnn_bn_se_residual"))
    if other == "another seed":
        torch.manual_seed(1)
        module = ResidualCNN()
    elif other == "another architecture":
        module = FrozenAndBuffer()
    elif other == "not a module":
        module = dict(module.state_dict())
    with pytest.raises(onnxgrad.OnnxGradError, match=said) as e:
        TrainingSession(model, loss=losses.CrossEntropyLoss(output="logits", target="y"),
                        optimizer=optim.AdamW(lr=1e-2), module=module, **options)
    assert "leave module= out" in str(e.value) and "\n" not in str(e.value)


def test_a_data_parallel_session_trains_the_module_too():
    """The split step (backward, reduction, update): the module holds the session's parameters and running
    statistics after every update, the parameters in the session's own buffers. The engine is one process
    standing for two workers with the same shard (the sums twice this worker's, the means its own)."""
    from onnxgrad.training.distributed import Engine

    class Mirror(Engine):
        name = "mirror"
        rank, world_size, local_rank, local_world_size = 0, 2, 0, 1

        def all_reduce(self, values, average=False):
            if not average:
                for v in values:
                    v.update_inplace(v.numpy() * 2)

        def broadcast(self, values, src=0):
            pass

        def barrier(self):
            pass

    session, module = _linked_session("cnn_bn_se_residual", data_parallel=Mirror())
    assert session.artifacts.split is not None and session._linked
    tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers())
    for k, (x, y) in enumerate(batches("image", np.random.default_rng(0))):
        session.step({"x": x, "y": y})
        held = {**session.parameters(), **session.buffers()}
        for name, value in held.items():
            np.testing.assert_array_equal(tensors[name].detach().numpy(), value, err_msg=f"step {k + 1}: {name}")
        assert int(module.bn.num_batches_tracked) == k + 1
    assert all(session._cur[n].data_ptr() == tensors[n].data_ptr() for n in session.spec.params)


def test_a_module_tensor_replaced_after_the_build_stops_the_next_step():
    """module.half(), module.to(), p.data = ...: the module's tensor is no longer the session's memory, so an
    update would not reach it; the step says so and changes nothing."""
    session, module = _linked_session("cnn_bn_se_residual")
    x, y = next(batches("image", np.random.default_rng(0)))
    session.step({"x": x, "y": y})
    before = session.parameters()
    module.head.weight.data = module.head.weight.data.clone()
    with pytest.raises(onnxgrad.OnnxGradError, match=r"module=: the module's 'head.weight' was replaced since the "
                                                     r"session was built .* nothing was changed"):
        session.step({"x": x, "y": y})
    assert session.step_count == 1
    assert all(np.array_equal(v, before[k]) for k, v in session.parameters().items())
