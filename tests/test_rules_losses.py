"""Gradient checks for SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss."""
import numpy as np
import pytest

from harness import Case as _Case
from harness import randn, run_case, run_second_order

RNG = np.random.default_rng(7)


def Case(*args, **kwargs) -> _Case:
    """A harness Case differentiating the scores only: weights are float but not differentiable."""
    return _Case(*args, wrt=[0], **kwargs)


def labels(*shape: int, classes: int, ignore: int | None = None, dtype=np.int64) -> np.ndarray:
    """Random labels in [0, classes); with ``ignore``, every third target carries it and no other does."""
    out = RNG.integers(0, classes, shape)
    if ignore is not None:
        flat = out.reshape(-1)
        flat[flat == ignore] = (ignore + 1) % classes
        flat[:: 3] = ignore
    return out.astype(dtype)


def weights(classes: int) -> np.ndarray:
    return RNG.uniform(0.5, 2.0, classes).astype(np.float32)


def _cases(op: str, outputs: int = 1) -> list[Case]:
    cases = []
    for reduction in ("none", "sum", "mean"):
        cases += [
            Case(op, [randn(3, 4), labels(3, classes=4)], dict(reduction=reduction), outputs=outputs,
                 id=f"{reduction}"),
            Case(op, [randn(3, 4), labels(3, classes=4), weights(4)], dict(reduction=reduction),
                 outputs=outputs, id=f"{reduction}-weights"),
            Case(op, [randn(4, 3), labels(4, classes=3, ignore=1), weights(3)],
                 dict(reduction=reduction, ignore_index=1), outputs=outputs, id=f"{reduction}-ignore-class"),
            Case(op, [randn(2, 3, 4), labels(2, 4, classes=3, ignore=-1)],
                 dict(reduction=reduction, ignore_index=-1), outputs=outputs, id=f"{reduction}-ignore-neg-dims"),
            Case(op, [randn(2, 3, 2, 2), labels(2, 2, 2, classes=3, ignore=-100), weights(3)],
                 dict(reduction=reduction, ignore_index=-100), outputs=outputs, id=f"{reduction}-ignore-weights-2d"),
        ]
    cases += [
        Case(op, [randn(3, 4), labels(3, classes=4, dtype=np.int32)], outputs=outputs, id="int32-labels"),
        Case(op, [randn(3, 5), labels(3, classes=5, ignore=4)], dict(ignore_index=4), outputs=outputs,
             id="mean-ignore-no-weights"),
        Case(op, [randn(2, 3, 4), labels(2, 4, classes=3, ignore=0), weights(3)], dict(ignore_index=0),
             outputs=outputs, unknown_shapes=True, id="unknown-shapes"),
        Case(op, [randn(2, 3, 4), labels(2, 4, classes=3), weights(3)], dict(reduction="none"),
             outputs=outputs, unknown_shapes=True, id="unknown-shapes-none"),
    ]
    return cases


SCE = _cases("SoftmaxCrossEntropyLoss") + [
    # both outputs seeded: the loss and log_prob
    Case("SoftmaxCrossEntropyLoss", [randn(3, 4), labels(3, classes=4)], outputs=2, id="log-prob"),
    Case("SoftmaxCrossEntropyLoss", [randn(2, 3, 4), labels(2, 4, classes=3, ignore=2), weights(3)],
         dict(reduction="none", ignore_index=2), outputs=2, id="log-prob-none-ignore"),
    Case("SoftmaxCrossEntropyLoss", [randn(2, 3, 4), labels(2, 4, classes=3, ignore=-1), weights(3)],
         dict(reduction="sum", ignore_index=-1), outputs=2, unknown_shapes=True, id="log-prob-unknown-shapes"),
]

NLL = _cases("NegativeLogLikelihoodLoss") + [
    Case("NegativeLogLikelihoodLoss", [randn(3, 4), labels(3, classes=4), weights(4)], opset=22, id="op22"),
    Case("NegativeLogLikelihoodLoss", [randn(2, 3, 4), labels(2, 4, classes=3, ignore=1)],
         dict(reduction="mean", ignore_index=1), opset=22, id="op22-ignore"),
]


@pytest.mark.parametrize("case", SCE + NLL, ids=str)
def test_rule(case):
    run_case(case)


def test_log_prob_only():
    """Only the log_prob output seeded: the gradient is LogSoftmax's."""
    case = Case("SoftmaxCrossEntropyLoss", [randn(3, 4), labels(3, classes=4), weights(4)], outputs=2)
    run_case(case, of=["y1"])


@pytest.mark.parametrize("case", [
    Case("SoftmaxCrossEntropyLoss", [randn(3, 4), labels(3, classes=4, ignore=1), weights(4)],
         dict(ignore_index=1), id="sce"),
    Case("SoftmaxCrossEntropyLoss", [randn(2, 3, 4), labels(2, 4, classes=3)], dict(reduction="none"),
         outputs=2, id="sce-log-prob"),
    Case("NegativeLogLikelihoodLoss", [randn(3, 4), labels(3, classes=4), weights(4)], id="nll"),
], ids=str)
def test_second_order(case):
    run_second_order(case)
