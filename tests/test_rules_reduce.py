"""Gradient checks for Reduce*, CumSum, CumProd and TopK."""
import numpy as np
import pytest

from harness import Case, distinct, randn, run_declared, run_second_order


def _axes(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _data(op: str, *shape: int) -> np.ndarray:
    if op == "ReduceLogSum":
        return randn(*shape, low=0.5, high=2.0)
    if op in ("ReduceMax", "ReduceMin"):
        return distinct(*shape)
    if op == "ReduceProd":
        return randn(*shape, low=0.5, high=1.5) * np.sign(randn(*shape))
    return randn(*shape)


REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


def _reduce_cases(op: str) -> list[Case]:
    x = lambda: _data(op, 2, 3, 4)  # noqa: E731
    # axes as an attribute up to opset 17 (ReduceSum: up to 12, below what we load, so input from 13)
    if op == "ReduceSum":
        old = [Case(op, [x(), _axes(1)], dict(keepdims=0), opset=13, id="op13-axis1"),
               Case(op, [x(), _axes(-1, 0)], dict(keepdims=1), opset=13, id="op13-neg-keep")]
    else:
        old = [Case(op, [x()], dict(axes=[1], keepdims=0), opset=13, id="op13-axis1"),
               Case(op, [x()], dict(axes=[-1, 0]), opset=13, id="op13-neg-keep")]
    old.append(Case(op, [x()], dict(keepdims=0), opset=13, id="op13-all"))
    new = [
        Case(op, [x(), _axes(0, 2)], dict(keepdims=0), opset=18, id="axes02"),
        Case(op, [x(), _axes(-1)], dict(keepdims=1), opset=18, id="neg-keep"),
        Case(op, [x()], dict(keepdims=0), opset=18, id="all"),
        Case(op, [x()], dict(keepdims=1), opset=18, id="all-keep"),
        Case(op, [x()], dict(noop_with_empty_axes=1), opset=18, id="noop"),
        Case(op, [x(), _axes()], dict(noop_with_empty_axes=1, keepdims=0), opset=18, id="noop-empty-axes"),
        Case(op, [x(), _axes(1, -1)], dict(keepdims=0), opset=18, dynamic=[1], id="dyn-axes"),
        Case(op, [x(), _axes(1)], dict(keepdims=1), opset=18, dynamic=[1], id="dyn-axes-keep"),
        Case(op, [x(), _axes()], dict(keepdims=0), opset=18, dynamic=[1], id="dyn-empty-axes"),
        Case(op, [x(), _axes()], dict(keepdims=0, noop_with_empty_axes=1), opset=18, dynamic=[1],
             id="dyn-empty-noop"),
        Case(op, [x(), _axes(1)], dict(keepdims=0), opset=18, unknown_shapes=True, id="unknown-shapes"),
        Case(op, [x()], dict(keepdims=0), opset=18, unknown_shapes=True, id="unknown-shapes-all"),
    ]
    if op in ("ReduceMax", "ReduceMin"):
        new.append(Case(op, [x(), _axes(1)], dict(keepdims=0), opset=20, id="op20"))
    return old + new


REDUCE = [c for op in REDUCE_OPS for c in _reduce_cases(op)]

SPECIAL = [
    # ties of two: the central difference is the even split, 1/2 each (torch.amax's rule)
    Case("ReduceMax", [np.array([[1.0, 3.0, 3.0], [2.0, -1.0, 0.5]], np.float32)], dict(axes=[1]), opset=13,
         id="tie"),
    Case("ReduceMin", [np.array([[1.0, 1.0], [2.0, -1.0], [1.0, 4.0]], np.float32), _axes(0)], opset=18, id="tie"),
    # zeros in the product: one zero in a group, two zeros in a group
    Case("ReduceProd", [np.array([[1.5, 0.0, -2.0], [0.0, 0.0, 3.0], [0.5, 2.0, -1.0]], np.float32), _axes(1)],
         opset=18, id="zeros"),
    Case("ReduceProd", [np.array([[1.5, 0.0, -2.0], [0.0, 0.0, 3.0], [0.5, 2.0, -1.0]], np.float32)],
         dict(keepdims=0), opset=18, id="zeros-all"),
    Case("ReduceProd", [np.array([[0.0, 2.0], [3.0, -1.0]], np.float32)], dict(axes=[0], keepdims=0), opset=13,
         id="zero-op13"),
    Case("ReduceL2", [np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]], np.float32), _axes(1)], opset=18,
         id="zero-row"),
]


def _cum(x: np.ndarray, axis: int, **attrs) -> dict:
    return dict(inputs=[x, np.array(axis, np.int64)], attrs=attrs)


CUMSUM = [
    Case("CumSum", **_cum(randn(3, 4), 1), opset=14, id="axis1"),
    Case("CumSum", **_cum(randn(3, 4), 0, exclusive=1), opset=14, id="exclusive"),
    Case("CumSum", **_cum(randn(3, 4), -1, reverse=1), opset=14, id="reverse"),
    Case("CumSum", **_cum(randn(2, 3, 4), 1, exclusive=1, reverse=1), opset=14, id="exclusive-reverse"),
    Case("CumSum", **_cum(randn(5), 0), opset=13, id="op13"),
    Case("CumSum", **_cum(randn(3, 4), -1, reverse=1), opset=18, dynamic=[1], id="dyn-axis"),
    Case("CumSum", inputs=[randn(3, 4), np.array([1], np.int32)], attrs=dict(exclusive=1), opset=14,
         id="axis-int32"),
    Case("CumSum", **_cum(randn(2, 3, 4), 2), opset=14, unknown_shapes=True, id="unknown-shapes"),
]

_ZEROS = np.array([[1.5, 0.0, -2.0, 0.5, 0.0], [0.5, 2.0, -1.0, 1.2, 0.8], [0.0, 1.1, 0.9, -1.3, 2.0]],
                  np.float32)

CUMPROD = [
    Case("CumProd", **_cum(randn(3, 4, low=0.5, high=1.5), 1), opset=26, id="axis1"),
    Case("CumProd", **_cum(randn(3, 4), 0, exclusive=1), opset=26, id="exclusive"),
    Case("CumProd", **_cum(randn(3, 4), -1, reverse=1), opset=26, id="reverse"),
    Case("CumProd", **_cum(randn(2, 3, 4), 1, exclusive=1, reverse=1), opset=26, id="exclusive-reverse"),
    Case("CumProd", **_cum(_ZEROS, 1), opset=26, id="zeros"),
    Case("CumProd", **_cum(_ZEROS, 1, exclusive=1), opset=26, id="zeros-exclusive"),
    Case("CumProd", **_cum(_ZEROS, -1, reverse=1), opset=26, id="zeros-reverse"),
    Case("CumProd", **_cum(_ZEROS, 1, exclusive=1, reverse=1), opset=26, id="zeros-exclusive-reverse"),
    Case("CumProd", **_cum(_ZEROS, 0), opset=26, id="zeros-axis0"),
    Case("CumProd", **_cum(_ZEROS, 1), opset=26, dynamic=[1], unknown_shapes=True, id="dyn"),
]

TOPK = [
    Case("TopK", [distinct(3, 5), np.array([2], np.int64)], outputs=2, id="last-axis"),
    Case("TopK", [distinct(4, 3), np.array([3], np.int64)], dict(axis=0), outputs=2, id="axis0"),
    Case("TopK", [distinct(2, 3, 4), np.array([2], np.int64)], dict(axis=-2, largest=0), outputs=2,
         id="smallest"),
    Case("TopK", [distinct(3, 5), np.array([3], np.int64)], dict(sorted=0), outputs=2, id="unsorted"),
    Case("TopK", [distinct(3, 5), np.array([2], np.int64)], outputs=2, opset=13, id="op13"),
    Case("TopK", [distinct(3, 5), np.array([2], np.int64)], outputs=2, opset=24, id="op24"),
    Case("TopK", [distinct(3, 5), np.array([2], np.int64)], outputs=2, dynamic=[1], unknown_shapes=True,
         id="dyn"),
]


SECOND_ORDER = [
    Case("ReduceMax", [distinct(2, 3, 4), _axes(1)], dict(keepdims=0), opset=18, id="max"),
    Case("ReduceProd", [randn(2, 3, 4), _axes(1)], dict(keepdims=0), opset=18, id="prod"),
    Case("ReduceL2", [randn(2, 3, 4)], dict(axes=[1]), opset=13, id="l2"),
    Case("ReduceLogSumExp", [randn(2, 3, 4)], dict(axes=[-1]), opset=13, id="lse"),
    Case("ReduceMean", [randn(2, 3, 4), _axes(1)], dict(keepdims=0), opset=18, unknown_shapes=True, id="mean-dyn"),
    Case("CumProd", **_cum(randn(3, 4), 1, exclusive=1), opset=26, id="cumprod"),
    Case("TopK", [distinct(3, 5), np.array([2], np.int64)], outputs=2, id="topk"),
]


@pytest.mark.parametrize("case", REDUCE + SPECIAL + CUMSUM + CUMPROD + TOPK, ids=str)
def test_rule(case):
    run_declared(case)


@pytest.mark.parametrize("case", SECOND_ORDER, ids=str)
def test_second_order(case):
    run_second_order(case)
