"""onnxgrad.losses: values against numpy references (PyTorch's formulas), gradients against finite differences."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad import losses
from onnxgrad.tools.check import check

F = TensorProto.FLOAT
RNG = np.random.default_rng(7)


def forward(shape, opset=17, dims=None):
    """x -> Identity -> logits: the predictions are a graph input we can differentiate."""
    declared = dims if dims is not None else shape
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"], name="id")], "fwd",
                          [helper.make_tensor_value_info("x", F, declared)],
                          [helper.make_tensor_value_info("logits", F, declared)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def run(m, feeds):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(["loss"], feeds)[0]


# -- numpy references (float64), written from PyTorch's documented formulas -------------------------
def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(1, keepdims=True))


def class_shape(w, ndim):
    return w.reshape((-1,) + (1,) * (ndim - 2))


def ref_nll(logp, t, w, ignore_index, reduction, smoothing=0.0):
    c = logp.shape[1]
    w = np.ones(c) if w is None else w.astype(np.float64)
    counted = t != ignore_index
    safe = np.where(counted, t, 0)
    picked = np.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
    wt = w[safe] * counted
    nll = -picked * wt
    smooth = -(logp * class_shape(w, logp.ndim)).sum(1) * counted
    if reduction == "none":
        return (1 - smoothing) * nll + smoothing / c * smooth
    total = (1 - smoothing) * nll.sum() + smoothing / c * smooth.sum()
    return total / wt.sum() if reduction == "mean" else total


def ref_ce_probs(x, t, w, reduction, smoothing):
    c = x.shape[1]
    t = t * (1 - smoothing) + smoothing / c
    w = np.ones(c) if w is None else w
    per = -(log_softmax(x) * t * class_shape(w, x.ndim)).sum(1)
    return reduce_(per, reduction)


def ref_bce(x, t, w, pw, reduction):
    x = x.astype(np.float64)
    log_sig, log_one_minus = -np.logaddexp(0, -x), -np.logaddexp(0, x)
    pw = 1.0 if pw is None else pw
    per = -(pw * t * log_sig + (1 - t) * log_one_minus)
    return reduce_(per if w is None else per * w, reduction)


def reduce_(per, reduction):
    return per.mean() if reduction == "mean" else per.sum() if reduction == "sum" else per


# -- cases: (id, builder(model) -> model, feeds, reference) -------------------------------------------
def ce_case(shape, reduction="mean", weight=False, smoothing=0.0, ignore=True, opset=17, dims=None):
    x = RNG.standard_normal(shape).astype(np.float32)
    c = shape[1]
    t = RNG.integers(0, c, [shape[0]] + list(shape[2:])).astype(np.int64)
    if ignore:
        t.flat[1] = -100
    w = RNG.uniform(0.5, 2.0, c).astype(np.float32) if weight else None
    ident = f"ce-{'x'.join(map(str, shape))}-{reduction}{'-w' if weight else ''}" \
            f"{f'-ls{smoothing}' if smoothing else ''}-op{opset}{'-dyn' if dims else ''}"
    build = lambda m: losses.cross_entropy(m, "logits", "y", weight=w, reduction=reduction,  # noqa: E731
                                           label_smoothing=smoothing)
    return ident, forward(shape, opset, dims), build, {"x": x, "y": t}, \
        ref_nll(log_softmax(x), t, w, -100, reduction, smoothing)


def ce_prob_case(shape, reduction="mean", weight=False, smoothing=0.0, opset=17):
    x = RNG.standard_normal(shape).astype(np.float32)
    t = RNG.uniform(0, 1, shape).astype(np.float32)
    t /= t.sum(1, keepdims=True)
    w = RNG.uniform(0.5, 2.0, shape[1]).astype(np.float32) if weight else None
    ident = f"ce-prob-{'x'.join(map(str, shape))}-{reduction}{'-w' if weight else ''}{f'-ls{smoothing}' if smoothing else ''}"
    build = lambda m: losses.cross_entropy(m, "logits", "y", weight=w, reduction=reduction,  # noqa: E731
                                           label_smoothing=smoothing, probabilities=True)
    return ident, forward(shape, opset), build, {"x": x, "y": t}, ref_ce_probs(x, t, w, reduction, smoothing)


def nll_case(shape, reduction="mean", weight=False, opset=17):
    x = log_softmax(RNG.standard_normal(shape)).astype(np.float32)
    c = shape[1]
    t = RNG.integers(0, c, [shape[0]] + list(shape[2:])).astype(np.int64)
    t.flat[0] = 1                    # a custom ignore_index
    w = RNG.uniform(0.5, 2.0, c).astype(np.float32) if weight else None
    build = lambda m: losses.nll_loss(m, "logits", "y", weight=w, reduction=reduction, ignore_index=1)  # noqa: E731
    return f"nll-{'x'.join(map(str, shape))}-{reduction}{'-w' if weight else ''}-op{opset}", forward(shape, opset), \
        build, {"x": x, "y": t}, ref_nll(x.astype(np.float64), t, w, 1, reduction)


def bce_case(shape, reduction="mean", weight=False, pos_weight=False, scale=1.0):
    x = (RNG.standard_normal(shape) * scale).astype(np.float32)
    t = RNG.uniform(0, 1, shape).astype(np.float32)
    w = RNG.uniform(0.5, 2.0, shape[-1]).astype(np.float32) if weight else None
    pw = RNG.uniform(0.5, 3.0, shape[-1]).astype(np.float32) if pos_weight else None
    build = lambda m: losses.binary_cross_entropy_with_logits(m, "logits", "y", weight=w,  # noqa: E731
                                                              pos_weight=pw, reduction=reduction)
    ident = f"bce-{'x'.join(map(str, shape))}-{reduction}{'-w' if weight else ''}{'-pw' if pos_weight else ''}" \
            f"{f'-x{scale:g}' if scale != 1 else ''}"
    return ident, forward(shape), build, {"x": x, "y": t}, ref_bce(x, t, w, pw, reduction)


def pointwise_case(fn, ref, shape, reduction="mean", opset=17):
    x = RNG.standard_normal(shape).astype(np.float32)
    t = RNG.standard_normal(shape).astype(np.float32)
    build = lambda m: fn(m, "logits", "y", reduction=reduction)  # noqa: E731
    return f"{fn.__name__}-{'x'.join(map(str, shape))}-{reduction}-op{opset}", forward(shape, opset), build, \
        {"x": x, "y": t}, reduce_(ref(x.astype(np.float64) - t), reduction)


CASES = [
    ce_case([4, 5]),
    ce_case([4, 5], "sum", weight=True),
    ce_case([4, 5], "none", weight=True),
    ce_case([4, 5], "mean", weight=True, opset=13),
    ce_case([4, 5], "mean", smoothing=0.2),
    ce_case([4, 5], "mean", weight=True, smoothing=0.1, opset=18),
    ce_case([4, 5], "sum", weight=True, smoothing=0.3),
    ce_case([4, 5], "none", smoothing=0.3, opset=13),
    ce_case([3, 4, 2, 2], "mean", weight=True),
    ce_case([3, 4, 2, 2], "mean", weight=True, smoothing=0.2, opset=21),
    ce_case([4, 5], "mean", smoothing=0.2, dims=["N", "C"]),          # unknown class count
    ce_prob_case([4, 5]),
    ce_prob_case([4, 5], "sum", weight=True, smoothing=0.1),
    ce_prob_case([3, 4, 2], "none", weight=True, smoothing=0.2, opset=13),
    ce_prob_case([3, 4, 2], "mean", opset=18),
    nll_case([4, 5]),
    nll_case([4, 5], "sum", weight=True),
    nll_case([3, 4, 2], "none", weight=True, opset=13),
    bce_case([4, 3]),
    bce_case([4, 3], "sum", weight=True, pos_weight=True),
    bce_case([2, 3, 3], "none", pos_weight=True),
    bce_case([4, 3], "mean", scale=40.0),                              # large logits: stable form
    pointwise_case(losses.mse_loss, np.square, [4, 3]),
    pointwise_case(losses.mse_loss, np.square, [2, 3, 2], "sum", opset=13),
    pointwise_case(losses.mse_loss, np.square, [5], "none", opset=18),
    pointwise_case(losses.l1_loss, np.abs, [4, 3]),
    pointwise_case(losses.l1_loss, np.abs, [2, 3, 2], "sum", opset=18),
    pointwise_case(losses.l1_loss, np.abs, [4, 3], "none", opset=13),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loss_value_and_gradient(case):
    ident, fwd, build, feeds, ref = case
    m = build(fwd)
    onnx.checker.check_model(m, full_check=True)
    assert [i.name for i in m.graph.input] == ["x", "y"]
    assert [o.name for o in m.graph.output] == ["logits", "loss"]
    got = run(m, feeds)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    scalar = np.ndim(ref) == 0
    gm = onnxgrad.grad(m, wrt=["x"], loss="loss") if scalar else onnxgrad.grad(m, wrt=["x"], of=["loss"])
    onnx.checker.check_model(gm, full_check=True)
    result = check(m, gm, feeds)
    assert result.ok(2e-3), f"{ident}: gradient errors {result.errors}"


def test_loss_output_is_a_declared_scalar_and_target_shapes_follow_the_predictions():
    m = losses.cross_entropy(forward([4, 5], dims=["N", 5]), "logits", "labels")
    y = next(i for i in m.graph.input if i.name == "labels")
    assert y.type.tensor_type.elem_type == TensorProto.INT64
    assert [d.dim_param or d.dim_value for d in y.type.tensor_type.shape.dim] == ["N"]
    loss = next(o for o in m.graph.output if o.name == "loss")
    assert loss.type.tensor_type.HasField("shape") and len(loss.type.tensor_type.shape.dim) == 0
    m = losses.mse_loss(forward([4, 5], dims=["N", 5]), target="t", loss="objective")
    t = next(i for i in m.graph.input if i.name == "t")
    assert t.type.tensor_type.elem_type == F
    assert [d.dim_param or d.dim_value for d in t.type.tensor_type.shape.dim] == ["N", 5]
    assert m.graph.output[-1].name == "objective"


def test_weights_are_constants_not_initializers():
    m = losses.cross_entropy(forward([4, 5]), weight=np.ones(5), label_smoothing=0.1)
    assert len(m.graph.initializer) == 0
    assert any(n.op_type == "Constant" for n in m.graph.node)


def test_loss_classes_apply_the_same_options():
    fwd = forward([4, 5])
    x = RNG.standard_normal((4, 5)).astype(np.float32)
    t = np.array([0, 1, -100, 4])
    loss = losses.CrossEntropyLoss(output="logits", target="y", label_smoothing=0.1, reduction="sum")
    a = run(loss(fwd), {"x": x, "y": t})
    b = run(losses.cross_entropy(fwd, "logits", "y", label_smoothing=0.1, reduction="sum"), {"x": x, "y": t})
    assert a == b
    assert loss.name == "loss" and "label_smoothing=0.1" in repr(loss)
    for name, cls in losses.LOSS_CLASSES.items():
        assert cls.fn is losses.LOSSES[name]


@pytest.mark.parametrize("call, error, words", [
    (lambda m: losses.cross_entropy(m, "nope"), onnxgrad.UnknownNameError, "not an output"),
    (lambda m: losses.cross_entropy(m, target="x"), onnxgrad.UnknownNameError, "already a tensor"),
    (lambda m: losses.mse_loss(m, target="t", loss="t"), onnxgrad.UnknownNameError, "both named"),
    (lambda m: losses.mse_loss(m, reduction="avg"), onnxgrad.OnnxGradError, "reduction must be one of"),
    (lambda m: losses.cross_entropy(m, label_smoothing=1.5), onnxgrad.OnnxGradError, "label_smoothing"),
    (lambda m: losses.cross_entropy(m, weight=[1.0, 2.0]), onnxgrad.OnnxGradError, "one entry per class"),
])
def test_user_errors(call, error, words):
    with pytest.raises(error, match=words):
        call(forward([4, 5]))


def test_predictions_must_be_batched_and_float():
    with pytest.raises(onnxgrad.OnnxGradError, match="add a batch dimension"):
        losses.cross_entropy(forward([5]))
    g = helper.make_graph([helper.make_node("ArgMax", ["x"], ["idx"], axis=1, keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", F, [4, 5])],
                          [helper.make_tensor_value_info("idx", TensorProto.INT64, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(onnxgrad.OnnxGradError, match="floating-point"):
        losses.mse_loss(m)
    two = forward([4, 5])
    two.graph.output.append(helper.make_tensor_value_info("x", F, [4, 5]))
    with pytest.raises(onnxgrad.UnknownNameError, match="name the predictions"):
        losses.mse_loss(two)


# -- class labels out of range: one clear error before a run, as PyTorch's "Target 7 is out of bounds." ---------
LABEL_CASES = [   # (loss, options, labels, first bad label or None, its position)
    (losses.cross_entropy, {}, [0, 7, 1, 2], 7, [1]),
    (losses.cross_entropy, {}, [0, 5, 1, 2], 5, [1]),                       # C itself
    (losses.cross_entropy, {}, [0, -3, 1, 9], -3, [1]),                     # negative, and a second bad one
    (losses.cross_entropy, {}, [0, -100, 4, 2], None, None),                # the default ignore_index
    (losses.cross_entropy, {"ignore_index": 9}, [9, 0, 1, 4], None, None),  # an ignore_index >= C is ignored
    (losses.cross_entropy, {"ignore_index": 2}, [0, -100, 1, 2], -100, [1]),
    (losses.cross_entropy, {"label_smoothing": 0.1}, [0, 1, 6, 2], 6, [2]),
    (losses.nll_loss, {}, [0, 1, 2, 8], 8, [3]),
    (losses.nll_loss, {"ignore_index": -1}, [-1, 0, 1, 2], None, None),
]


@pytest.mark.parametrize("loss, options, labels, bad, where", LABEL_CASES)
def test_labels_are_checked_against_the_recorded_class_count(loss, options, labels, bad, where):
    m = loss(forward([4, 5]), output="logits", target="t", **options)
    [target] = losses.class_targets(m)
    assert (target.target, target.classes, target.output) == ("t", 5, "logits")
    assert target.ignore_index == options.get("ignore_index", -100)
    labels = np.array(labels, np.int64)
    if bad is None:
        losses.check_labels([target], {"t": labels}, "step")
        assert np.isfinite(run(m, {"x": RNG.standard_normal((4, 5)).astype(np.float32), "t": labels}))
        return
    with pytest.raises(losses.LabelError) as e:
        losses.check_labels([target], {"t": labels}, "step")
    assert isinstance(e.value, onnxgrad.OnnxGradError)
    text = str(e.value)
    assert text.startswith(f"step: target {bad} is out of bounds: the label at position {where} of 't'")
    assert "[0, 5)" in text and f"ignore_index ({target.ignore_index})" in text


def test_label_check_of_a_loss_over_spatial_targets_and_an_unknown_class_count():
    m = losses.cross_entropy(forward([2, 3, 4]), output="logits", target="t")
    labels = np.zeros((2, 4), np.int64)
    labels[1, 2] = 3
    with pytest.raises(losses.LabelError, match=r"target 3 is out of bounds: the label at position \[1, 2\]"):
        losses.check_labels(losses.class_targets(m), {"t": labels})
    # the class dimension not fixed in the model: only a negative label is known to be wrong before a run
    dynamic = losses.cross_entropy(forward([2, 3], dims=["N", "C"]), output="logits", target="t")
    [target] = losses.class_targets(dynamic)
    assert target.classes is None
    target.check(np.array([0, 99]))
    with pytest.raises(losses.LabelError, match=r"target -2 is out of bounds.*\[0, C\)"):
        target.check(np.array([0, -2]))
    # two losses appended to one model: both are recorded
    both = losses.nll_loss(losses.cross_entropy(forward([4, 5]), output="logits", target="t"),
                           output="logits", target="u", loss="nll")
    assert [t.target for t in losses.class_targets(both)] == ["t", "u"]
    assert losses.class_targets(losses.mse_loss(forward([4, 5]), output="logits")) == []


@pytest.mark.parametrize("labels", [[0, 7, 1, 2], [0, 1, -3, 2], [[0, 1, 2, 5], [0, 0, 0, 0]]])
def test_label_error_says_what_pytorch_says(labels):
    torch = pytest.importorskip("torch")
    labels = np.array(labels, np.int64)
    shape = [2, 5, 4] if labels.ndim == 2 else [4, 5]
    with pytest.raises(IndexError) as expected:
        torch.nn.functional.cross_entropy(torch.zeros(shape), torch.from_numpy(labels))
    m = losses.cross_entropy(forward(shape), output="logits", target="t")
    with pytest.raises(losses.LabelError) as got:
        losses.check_labels(losses.class_targets(m), {"t": labels})
    assert str(expected.value).rstrip(".").lower() in str(got.value).lower()
