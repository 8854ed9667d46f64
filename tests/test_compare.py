"""onnxgrad.tools.compare_with_torch: it reports agreement on a small BatchNorm CNN trained with AdamW (the
zero-gradient bias before BatchNorm named apart as noise), and disagreement when onnxgrad's training is
perturbed by 0.1% of the learning rate: a checker that cannot fail proves nothing."""
from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")       # torch.onnx's dynamo exporter
nn = torch.nn

import onnxgrad  # noqa: E402
from onnxgrad import optim  # noqa: E402
from onnxgrad.tools.compare import CompareError, compare_with_torch  # noqa: E402


def small_cnn() -> nn.Module:
    """Conv (with a bias before BatchNorm: a gradient of zero but for rounding), BatchNorm, SiLU, Dropout."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(), nn.Dropout(0.2),
                         nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).train()


def batches():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((4, 3, 6, 6)).astype(np.float32), rng.integers(0, 5, 4)) for _ in range(3)]


@functools.lru_cache(maxsize=None)
def agreeing():
    return compare_with_torch(small_cnn(), batches(), optim.AdamW(lr=1e-2))


def test_onnxgrad_agrees_with_pytorch_within_its_own_rounding():
    report = agreeing()
    assert report.agrees, str(report)
    assert len(report.losses) == 3 and all(len(step) == 3 for step in report.losses)
    noise = {d.name: d.noise_only for d in report.noise_only}
    assert noise.get("0.bias") == "float64 gradient zero"            # the bias before BatchNorm
    assert "0.weight" not in noise and "5.weight" not in noise
    # the naive comparison says 'differs' on that bias, and PyTorch float32 differs from float64 as much
    bias = next(d for d in report.parameters if d.name == "0.bias")
    assert bias.ours_vs_torch > 1e-3 and bias.torch_vs_fp64 > 1e-3
    determined = [d for d in report.parameters if not d.noise_only]
    assert determined and max(d.ours_vs_fp64 for d in determined) <= 1e-5
    text = str(report)
    assert "dropout set to 0 for the comparison ('3' p=0.2)" in text
    assert "verdict: AGREES" in text


def test_a_perturbed_training_is_reported_as_differing(monkeypatch):
    """onnxgrad's steps taken with the learning rate 0.1% too large: the checker must say so."""
    step = onnxgrad.TrainingSession.step
    monkeypatch.setattr(onnxgrad.TrainingSession, "step",
                        lambda self, feeds, lr=None, **kw: step(self, feeds, lr=self.lr * 1.001, **kw))
    report = compare_with_torch(small_cnn(), batches(), optim.AdamW(lr=1e-2))
    assert not report.agrees
    names = {d.name for d in report.disagreements}
    assert {"loss at step 1", "loss at step 2", "5.weight"} <= names
    assert "loss at step 0" not in names             # the first loss comes before any update
    assert "verdict: DIFFERS" in str(report)


def test_a_forward_still_random_is_refused():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x + 0.1 * torch.randn_like(x))

    data = [(np.ones((2, 4), np.float32), np.array([0, 1]))]
    with pytest.raises(CompareError, match="forward is random even with its dropout set to 0"):
        compare_with_torch(Noisy(), data, optim.SGD(lr=0.1))


def test_batches_of_other_shapes_are_refused():
    data = [(np.ones((2, 4), np.float32), np.array([0, 1])), (np.ones((3, 4), np.float32), np.array([0, 1, 2]))]
    with pytest.raises(CompareError, match="batch 1 has another"):
        compare_with_torch(nn.Linear(4, 3), data, optim.SGD(lr=0.1))
