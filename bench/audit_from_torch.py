"""Audit onnxgrad.from_torch on architectures nobody here wrote: transformers' BERT and GPT-2 sequence
classifiers and its ResNet and MobileNetV2 image classifiers (BatchNorm), from small random configs.

    pip install transformers   # not a dependency of onnxgrad; the audit is skipped without it
    python bench/audit_from_torch.py [--steps 5] [--only bert gpt2 ...]

Each model is exported with onnxgrad.from_torch in train mode, then trained in a TrainingSession with
losses.cross_entropy for ``--steps`` steps, and a copy in PyTorch (``model.train()``, the same torch.optim
optimizer, the same batches) alongside; once with SGD (momentum 0.9) and once with AdamW. Per model and
optimizer it prints the worst relative difference of the step losses, of the parameters after the steps
(and which parameter), of the running statistics, and of the exported model's output against PyTorch's
``eval()``. Parameters whose PyTorch gradient is zero but for rounding (attention key biases, which softmax
cancels) move by about +-lr per AdamW step in any two implementations (Adam divides the rounding by its own
magnitude), so the parameter column also gives the worst over the other elements ("others").

The control: a second PyTorch copy whose parameters start one float32 ulp away, trained alike, compared with
the same numbers. It says how far rounding alone carries a model in these steps: onnxgrad's differences
should be of its size. (MobileNetV2 here is chaotic at these learning rates: a ReLU6 whose input lies within
rounding of 0 passes or stops a gradient, and the control leaves PyTorch as far as onnxgrad does.)
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Callable

import numpy as np

try:
    import torch
    import transformers
except ImportError as e:         # an optional audit: say what is missing and stop cleanly
    print(f"skipped: {e.name} is not installed (pip install torch transformers)")
    sys.exit(0)

import onnxruntime as ort

import onnxgrad
from onnxgrad import TrainingSession, losses, optim

F = torch.nn.functional
CLASSES = 3
VERBOSE = False


def bert() -> tuple[torch.nn.Module, str]:
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=CLASSES,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config), "tokens"


def gpt2() -> tuple[torch.nn.Module, str]:
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     num_labels=CLASSES, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False)
    return transformers.GPT2ForSequenceClassification(config), "tokens"


def resnet() -> tuple[torch.nn.Module, str]:
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck",
                                       num_labels=CLASSES)
    return transformers.ResNetForImageClassification(config), "image"


def mobilenet_v2() -> tuple[torch.nn.Module, str]:
    config = transformers.MobileNetV2Config(image_size=64, depth_multiplier=0.25, num_labels=CLASSES,
                                            classifier_dropout_prob=0.0)
    return transformers.MobileNetV2ForImageClassification(config), "image"


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, str]]] = {
    "bert": bert, "gpt2": gpt2, "resnet": resnet, "mobilenet_v2": mobilenet_v2}
OPTIMIZERS = {
    "sgd": (lambda: optim.SGD(lr=0.05, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "adamw": (lambda: optim.AdamW(lr=1e-3), lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
}


def batch(kind: str, rng: np.random.Generator, n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    if kind == "tokens":
        return rng.integers(1, 97, (n, 16)), rng.integers(0, CLASSES, n)
    return rng.standard_normal((n, 3, 64, 64)).astype(np.float32), rng.integers(0, CLASSES, n)


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-3))


class TorchRun:
    """A copy of the module trained in PyTorch; ``ulp=True``: its parameters first moved by one float32 ulp
    each, up or down at random (the control: how far rounding alone carries the model in these steps)."""

    def __init__(self, module: torch.nn.Module, optimizer: str, ulp: bool = False):
        self.module = copy.deepcopy(module)
        if ulp:
            rng = np.random.default_rng(7)
            with torch.no_grad():
                for p in self.module.parameters():
                    a = p.numpy()
                    p.copy_(torch.from_numpy(np.nextafter(a, np.where(rng.random(a.shape) < 0.5, -np.inf, np.inf)
                                                          .astype(a.dtype))))
        self.optimizer = OPTIMIZERS[optimizer][1]([p for p in self.module.parameters() if p.requires_grad])

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.module(torch.from_numpy(x)).logits, torch.from_numpy(y))
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def state(self) -> dict[str, np.ndarray]:
        return {k: v.detach().numpy().copy() for k, v in self.module.state_dict().items()}

    def eval_logits(self, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.module.eval()(torch.from_numpy(x)).logits.numpy()


class SessionRun:
    """The module exported with from_torch, trained in a TrainingSession."""

    def __init__(self, model, optimizer: str):
        self.session = TrainingSession(model, loss=losses.CrossEntropyLoss(output="logits", target="y"),
                                       optimizer=OPTIMIZERS[optimizer][0]())

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        return self.session.step({"x": x, "y": y})

    def state(self) -> dict[str, np.ndarray]:
        return {**self.session.parameters(), **self.session.buffers()}

    def eval_logits(self, x: np.ndarray) -> np.ndarray:
        inference = ort.InferenceSession(self.session.exported_model().SerializeToString(),
                                         providers=["CPUExecutionProvider"])
        return inference.run(["logits"], {"x": x})[0]


def audit(name: str, optimizer: str, steps: int) -> dict[str, object]:
    torch.manual_seed(0)
    module, kind = MODELS[name]()
    module.train()
    example, _ = batch(kind, np.random.default_rng(1), n=2)
    t0 = time.perf_counter()
    model = onnxgrad.from_torch(module, (torch.from_numpy(example),), dynamic_batch=True, input_names=["x"],
                                output_names=["logits"])
    export_s = time.perf_counter() - t0
    reference, ours, control = TorchRun(module, optimizer), SessionRun(model, optimizer), TorchRun(module, optimizer,
                                                                                                  ulp=True)
    spec = ours.session.spec
    by_name = dict(reference.module.named_parameters(remove_duplicate=False))
    assert sorted(id(by_name[n]) for n in spec.params) == sorted(
        id(p) for p in reference.module.parameters() if p.requires_grad), "the session trains other parameters"
    largest_grad = {n: np.zeros(tuple(by_name[n].shape)) for n in spec.params}     # per element, over the steps
    worst_loss = {"ours": 0.0, "control": 0.0}
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x, y = batch(kind, rng)
        expected = reference.step(x, y)
        for key, run in (("ours", ours), ("control", control)):
            worst_loss[key] = max(worst_loss[key], relative(run.step(x, y), expected))
        for n in largest_grad:
            largest_grad[n] = np.maximum(largest_grad[n], by_name[n].grad.abs().numpy())
    state = reference.state()
    scale = max(float(g.max()) for g in largest_grad.values())
    rounding = {n: largest_grad[n] <= 1e-6 * scale for n in spec.params}   # zero gradient but for rounding
    x, _ = batch(kind, np.random.default_rng(2))
    eval_expected = reference.eval_logits(x)
    result = {"model": name, "optimizer": optimizer, "steps": steps, "params": len(spec.params),
              "rounding": int(sum(r.sum() for r in rounding.values())), "running stats": len(spec.buffers),
              "export_s": export_s}
    for key, run in (("ours", ours), ("control", control)):
        got = run.state()
        diffs = {n: relative(got[n], state[n]) for n in spec.params}
        others = {n: relative(np.where(rounding[n], state[n], got[n]), state[n]) for n in spec.params}
        worst = max(diffs, key=diffs.get)
        if VERBOSE:
            for n in sorted(diffs, key=diffs.get)[-3:]:
                print(f"    {key}: {n}: {diffs[n]:.1e} ({others[n]:.1e} without rounding-only elements), largest "
                      f"gradient {largest_grad[n].max():.1e} (model's {scale:.1e})")
        result[key] = {"loss": worst_loss[key], "param": diffs[worst], "worst": worst, "others": max(others.values()),
                       "stat": max((relative(got[n], state[n]) for n in spec.buffers), default=None),
                       "export": relative(run.eval_logits(x), eval_expected)}
    return result


def line(r: dict[str, object], key: str) -> str:
    d = r[key]
    stat = "none" if d["stat"] is None else f"{r['running stats']} tensors, worst {d['stat']:.1e}"
    return (f"loss {d['loss']:.1e}, parameter {d['param']:.1e} ({d['worst']}), others {d['others']:.1e}; running "
            f"statistics {stat}; eval() output {d['export']:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("-v", "--verbose", action="store_true", help="the four parameters that differ most, per run")
    p.add_argument("--only", nargs="*", choices=sorted(MODELS), default=sorted(MODELS))
    args = p.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, onnxruntime {ort.__version__}")
    for name in args.only:
        for optimizer in OPTIMIZERS:
            r = audit(name, optimizer, args.steps)
            print(f"{r['model']} {r['optimizer']}: {r['steps']} steps, {r['params']} parameters "
                  f"({r['rounding']} elements with a rounding-only gradient), export {r['export_s']:.1f} s")
            print(f"  onnxgrad vs PyTorch:         {line(r, 'ours')}")
            print(f"  PyTorch 1 ulp apart (control): {line(r, 'control')}")


if __name__ == "__main__":
    main()
