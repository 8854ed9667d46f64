"""Sequence and optional rules, checked as small models (the ops only make sense in chains): the gradient
graph passes the full checker and matches float64 central differences, run in onnxruntime in float32 and
in float64."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import pytest

import onnxgrad
from harness import randn
from onnxgrad.errors import NonFloatError
from onnxgrad.tools.check import check, run_float64

# (id, model text (its graph's float inputs are differentiated), feeds)
MODELS = [
    ("split-at-static", """
        g (float[6,4] x, float[4] w) => (float[2,4] y0, float[3,4] y1) {
          s = SplitToSequence<axis = 0>(x, split)
          a = SequenceAt(s, i0)
          y0 = Mul(a, w)
          y1 = SequenceAt(s, im1)
        }""", dict(x=randn(6, 4), w=randn(4))),
    ("split-no-keepdims-same-element-twice", """
        g (float[3,4] x) => (float[3] y) {
          s = SplitToSequence<axis = 1, keepdims = 0>(x)
          a = SequenceAt(s, i1)
          b = SequenceAt(s, i1)
          y = Mul(a, b)
        }""", dict(x=randn(3, 4))),
    ("split-scalar-chunks-dynamic-index", """
        g (float[7,2] x, int64 k) => (float[3,2] y) {
          s = SplitToSequence<axis = 0>(x, i3)
          a = SequenceAt(s, k)
          y = Tanh(a)
        }""", dict(x=randn(7, 2), k=np.array(1, np.int64))),
    ("construct-concat-ragged", """
        g (float[2,3] a, float[2,1] b, float[2,2] c) => (float[2,6] y) {
          s = SequenceConstruct(a, b, c)
          t = ConcatFromSequence<axis = 1>(s)
          y = Mul(t, t)
        }""", dict(a=randn(2, 3), b=randn(2, 1), c=randn(2, 2))),
    ("construct-concat-new-axis", """
        g (float[2,3] a, float[2,3] b) => (float[2,2,3] y) {
          s = SequenceConstruct(a, b)
          t = ConcatFromSequence<axis = -2, new_axis = 1>(s)
          y = Sin(t)
        }""", dict(a=randn(2, 3), b=randn(2, 3))),
    ("construct-at-dynamic-index", """
        g (float[2,3] a, float[4] b, int64 k) => (float[4] y, float[2,3] z) {
          s = SequenceConstruct(a, b)
          y = SequenceAt(s, k)
          t = SequenceAt(s, i0)
          z = Mul(t, t)
        }""", dict(a=randn(2, 3), b=randn(4), k=np.array(-1, np.int64))),
    ("insert-erase-concat-and-at", """
        g (float[1,3] a, float[2,3] b, float[3,3] c) => (float[5,3] y, float[2,3] z) {
          s = SequenceConstruct(a, b)
          s2 = SequenceInsert(s, c, i1)
          s3 = SequenceErase(s2, i0)
          t = ConcatFromSequence<axis = 0>(s3)
          y = Mul(t, t)
          z = SequenceAt(s3, im1)
        }""", dict(a=randn(1, 3), b=randn(2, 3), c=randn(3, 3))),
    ("append-from-empty", """
        g (float[3] a, float[2] b) => (float[2] y) {
          s0 = SequenceEmpty<dtype = 1>()
          s1 = SequenceInsert(s0, a)
          s2 = SequenceInsert(s1, b)
          p = SequenceAt(s2, im1)
          q = SequenceAt(s2, i0)
          r = ReduceSum<keepdims = 0>(q)
          y = Mul(p, r)
        }""", dict(a=randn(3), b=randn(2))),
    ("append-at-static-from-back", """
        g (float[3] a, float[2] b) => (float[3] y) {
          s0 = SequenceEmpty<dtype = 1>()
          s1 = SequenceInsert(s0, a)
          s2 = SequenceInsert(s1, b)
          y = SequenceAt(s2, im2)
        }""", dict(a=randn(3), b=randn(2))),
    ("erase-dynamic-position", """
        g (float[6,2] x, int64 k) => (float[2,2] y, float[4,2] z) {
          s = SplitToSequence<axis = 0>(x, i2)
          s2 = SequenceErase(s, k)
          a = SequenceAt(s2, i1)
          y = Mul(a, a)
          z = ConcatFromSequence<axis = 0>(s2)
        }""", dict(x=randn(6, 2), k=np.array(0, np.int64))),
    ("erase-last-two-whole-gradients", """
        g (float[6,2] x) => (float[4,2] y, float[2,2,2] z) {
          s = SplitToSequence<axis = 0>(x, i2)
          s2 = SequenceErase(s)
          y = ConcatFromSequence<axis = 0>(s2)
          t = ConcatFromSequence<axis = 0, new_axis = 1>(s2)
          z = Mul(t, t)
        }""", dict(x=randn(6, 2))),
    ("insert-dynamic-position", """
        g (float[4,2] x, float[1,2] c, int64 k) => (float[5,2] y) {
          s = SplitToSequence<axis = 0>(x, i2)
          s2 = SequenceInsert(s, c, k)
          t = ConcatFromSequence<axis = 0>(s2)
          y = Mul(t, t)
        }""", dict(x=randn(4, 2), c=randn(1, 2), k=np.array(1, np.int64))),
    ("optional-two-uses", """
        g (float[3] x) => (float[3] y) {
          o = Optional(x)
          a = OptionalGetElement(o)
          b = OptionalGetElement(o)
          y = Mul(a, b)
        }""", dict(x=randn(3))),
    ("optional-get-element-of-a-tensor", """
        g (float[3] x) => (float[3] y) {
          a = OptionalGetElement(x)
          y = Sin(a)
        }""", dict(x=randn(3))),
]

_CONSTANTS = """
          i0 = Constant<value = int64 {0}>()
          i1 = Constant<value = int64 {1}>()
          i2 = Constant<value = int64 {2}>()
          i3 = Constant<value = int64 {3}>()
          im1 = Constant<value = int64 {-1}>()
          im2 = Constant<value = int64 {-2}>()
          split = Constant<value = int64[3] {2, 1, 3}>()
"""


def _model(text: str, opset: int = 18) -> onnx.ModelProto:
    head, body = text.split("{", 1)
    m = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n{head}{{{_CONSTANTS}{body}')
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("case", MODELS, ids=[c[0] for c in MODELS])
def test_sequence_model(case):
    _, text, feeds = case
    model = _model(text)
    wrt = [i.name for i in model.graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    of = [o.name for o in model.graph.output]
    gm = onnxgrad.grad(model, wrt=wrt, of=of)
    onnx.checker.check_model(gm, full_check=True)
    r32 = check(model, gm, feeds)
    assert r32.ok(2e-3), r32.errors
    r64 = check(model, gm, feeds, analytic_run=run_float64)
    assert r64.ok(1e-6), r64.errors


def test_second_order_through_a_sequence():
    """grad(grad(m)): the backward's own sequence ops have rules too (H v of x -> split -> at -> x^3)."""
    model = _model("""
        g (float[4,2] x) => (float[2,2] y) {
          s = SplitToSequence<axis = 0>(x, i2)
          a = SequenceAt(s, i1)
          t = Mul(a, a)
          y = Mul(t, a)
        }""")
    gm = onnxgrad.grad(model, wrt=["x"], of=["y"])
    ggm = onnxgrad.grad(gm, wrt=["x", "y_grad"], of=["x_grad"], allow_unused=True)
    onnx.checker.check_model(ggm, full_check=True)
    feeds = dict(x=randn(4, 2), y_grad=randn(2, 2))
    r = check(gm, ggm, feeds, analytic_run=run_float64)
    assert r.ok(1e-6), r.errors


def test_a_sequence_is_not_a_wrt():
    model = _model("""
        g (float[4,2] x) => (float[2,2] y) {
          s = SplitToSequence<axis = 0>(x, i2)
          y = SequenceAt(s, i1)
        }""")
    with pytest.raises(NonFloatError, match="'s' is a sequence"):
        onnxgrad.grad(model, wrt=["s"], of=["y"])
