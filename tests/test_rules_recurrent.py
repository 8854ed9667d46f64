"""RNN, GRU and LSTM gradients (backpropagation through time), checked against central differences.

onnxruntime has no float64 kernels for these ops (GRU and LSTM even accept a
float64 session and fail only when run), and onnx.reference ignores
sequence_lens, clip and most activations. So the float64 forward the numeric
check differentiates is ``onnxgrad.tools.check.kernels.recurrent_reference``, a direct numpy transcription of
the ONNX equations with onnxruntime's conventions; every case first checks it
against onnxruntime's float32 forward.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import harness
import onnxgrad
from harness import Case, randn, run_case
from onnxgrad.errors import UnsupportedOpError
from onnxgrad.rules.registry import NON_DIFFERENTIABLE, beyond_tags_inputs, get_rule, get_schema
from onnxgrad.tools.check import Runner
from onnxgrad.tools.check.kernels import recurrent_reference

T, B, I, H = 3, 2, 3, 4          # seq, batch, input, hidden


# -- cases -----------------------------------------------------------------------------------
def w(*shape):
    return randn(*shape) * 0.6


def lens(*v):
    return np.array(v, np.int32)


def rnn(D=1, layout=0, h0=True, seq=None, **kw):
    x = randn(B, T, I) if layout else randn(T, B, I)
    init = None if not h0 else (randn(B, D, H) if layout else randn(D, B, H))
    return [x, w(D, H, I), w(D, H, H), w(D, 2 * H), seq, init]


def gru(D=1, layout=0, h0=True, seq=None):
    x = randn(B, T, I) if layout else randn(T, B, I)
    init = None if not h0 else (randn(B, D, H) if layout else randn(D, B, H))
    return [x, w(D, 3 * H, I), w(D, 3 * H, H), w(D, 6 * H), seq, init]


def lstm(D=1, layout=0, h0=True, seq=None, peep=False):
    x = randn(B, T, I) if layout else randn(T, B, I)
    shape = (B, D, H) if layout else (D, B, H)
    init = [randn(*shape), randn(*shape)] if h0 else [None, None]
    return [x, w(D, 4 * H, I), w(D, 4 * H, H), w(D, 8 * H), seq, *init] + ([w(D, 3 * H)] if peep else [])


PARAMS = [0, 1, 2, 3]        # X, W, R, B (the initial states, tagged NonDifferentiable: INITIAL_STATE)
BIDI = {"direction": "bidirectional"}
REV = {"direction": "reverse"}

# onnxruntime (1.32) refuses layout=1 in its RNN, GRU and LSTM kernels: those cases run in onnx.reference
BATCH_FIRST = "onnxruntime's RNN/GRU/LSTM kernels refuse layout=1 (batch-first)"

CASES = [
    Case("RNN", rnn(), {"hidden_size": H}, wrt=PARAMS, outputs=2, id="forward"),
    Case("RNN", rnn(), {"hidden_size": H}, wrt=PARAMS, outputs=2, opset=13, id="opset13"),
    Case("RNN", rnn(), {"hidden_size": H, **REV}, wrt=PARAMS, outputs=2, id="reverse"),
    Case("RNN", rnn(2, layout=1), {"hidden_size": H, "layout": 1, **BIDI}, wrt=PARAMS, outputs=2,
         opset=22, id="bidirectional-layout1", reference=BATCH_FIRST),
    Case("RNN", rnn(h0=False)[:4], {"hidden_size": H, "clip": 1.0}, outputs=2, id="clip-no-h0"),
    Case("RNN", rnn(seq=lens(3, 2)), {"hidden_size": H}, wrt=PARAMS, outputs=2, id="seq-lens"),
    Case("RNN", rnn(2, seq=lens(1, 3)), {"hidden_size": H, **BIDI}, wrt=PARAMS, outputs=2,
         id="seq-lens-bidirectional"),
    Case("RNN", rnn(2), {"hidden_size": H, **BIDI, "activations": ["Sigmoid", "Softsign"]},
         wrt=PARAMS, outputs=2, id="sigmoid-softsign"),
    Case("RNN", rnn(), {"hidden_size": H, "activations": ["LeakyRelu"], "activation_alpha": [0.2]},
         wrt=PARAMS, outputs=2, id="leakyrelu"),
    Case("RNN", rnn(), {"hidden_size": H, "activations": ["Elu"]}, wrt=PARAMS, outputs=2, id="elu"),
    Case("RNN", rnn(), {"hidden_size": H, "activations": ["Softplus"]}, wrt=PARAMS, outputs=2, id="softplus"),
    Case("RNN", rnn(), {"hidden_size": H, "activations": ["Relu"]}, wrt=PARAMS, id="relu-Y-only"),
    Case("RNN", rnn(), {"hidden_size": H, "activations": ["ScaledTanh"], "activation_alpha": [1.5],
                        "activation_beta": [0.7]}, wrt=PARAMS, outputs=2, id="scaledtanh"),
    Case("RNN", rnn(), {"hidden_size": H, "activations": ["HardSigmoid"], "activation_alpha": [0.3],
                        "activation_beta": [0.4]}, wrt=PARAMS, outputs=2, id="hardsigmoid"),

    Case("GRU", gru(), {"hidden_size": H}, wrt=PARAMS, outputs=2, id="forward"),
    Case("GRU", gru(), {"hidden_size": H}, wrt=PARAMS, outputs=2, opset=13, id="opset13"),
    Case("GRU", gru(), {"hidden_size": H, "linear_before_reset": 1}, wrt=PARAMS, outputs=2, id="lbr"),
    Case("GRU", gru(), {"hidden_size": H, **REV}, wrt=PARAMS, outputs=2, id="reverse"),
    Case("GRU", gru(2, layout=1), {"hidden_size": H, "layout": 1, "linear_before_reset": 1, **BIDI},
         wrt=PARAMS, outputs=2, opset=22, id="bidirectional-layout1-lbr", reference=BATCH_FIRST),
    Case("GRU", gru(h0=False)[:4], {"hidden_size": H, "clip": 0.8}, outputs=2, id="clip-no-h0"),
    Case("GRU", gru(seq=lens(2, 3)), {"hidden_size": H}, wrt=PARAMS, outputs=2, id="seq-lens"),
    Case("GRU", gru(2, seq=lens(3, 1)), {"hidden_size": H, "linear_before_reset": 1, **BIDI},
         wrt=PARAMS, outputs=2, id="seq-lens-bidirectional-lbr"),
    Case("GRU", gru(), {"hidden_size": H, "activations": ["HardSigmoid", "Softsign"]},
         wrt=PARAMS, outputs=2, id="hardsigmoid-softsign"),

    Case("LSTM", lstm(), {"hidden_size": H}, wrt=PARAMS, outputs=3, id="forward"),
    Case("LSTM", lstm(), {"hidden_size": H}, wrt=PARAMS, outputs=3, opset=13, id="opset13"),
    Case("LSTM", lstm(peep=True), {"hidden_size": H}, wrt=PARAMS + [7], outputs=3, id="peepholes"),
    Case("LSTM", lstm(peep=True), {"hidden_size": H, **REV}, wrt=PARAMS + [7], outputs=3, id="reverse-peepholes"),
    Case("LSTM", lstm(2, layout=1, peep=True), {"hidden_size": H, "layout": 1, **BIDI},
         wrt=PARAMS + [7], outputs=3, opset=22, id="bidirectional-layout1-peepholes", reference=BATCH_FIRST),
    Case("LSTM", lstm(h0=False)[:4], {"hidden_size": H, "clip": 0.9}, outputs=3, id="clip-no-initial"),
    Case("LSTM", lstm(seq=lens(2, 3)), {"hidden_size": H}, wrt=PARAMS, outputs=3, id="seq-lens"),
    Case("LSTM", lstm(2, seq=lens(3, 1), peep=True), {"hidden_size": H, **BIDI}, wrt=PARAMS + [7],
         outputs=3, id="seq-lens-bidirectional-peepholes"),
    Case("LSTM", lstm(), {"hidden_size": H, "activations": ["HardSigmoid", "Softsign", "Elu"]},
         wrt=PARAMS, outputs=3, id="hardsigmoid-softsign-elu"),
]


def _ids(case: Case) -> str:
    return str(case)


def _check_reference(case: Case) -> None:
    """The numpy reference agrees with onnxruntime's float32 forward on this case."""
    model, feeds, _ = harness.case_model(case)
    got = harness.case_runner(case, model)(feeds)
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    values.update(feeds)
    node = model.graph.node[0]
    args = [values[x].astype(np.float64) if x and values[x].dtype.kind == "f" else values.get(x) if x else None
            for x in node.input]
    want = recurrent_reference(case.op, args, {a.name: helper.get_attribute_value(a) for a in node.attribute})
    for name, ref in zip(node.output, want):
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-5, err_msg=f"{case}: {name}")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rule(case):
    _check_reference(case)
    run_case(case)


# Only some outputs carry a seed; the forward keeps its outputs.
@pytest.mark.parametrize("case, of", [
    (Case("GRU", gru(), {"hidden_size": H}, wrt=PARAMS, outputs=2, id="Y_h-only"), ["y1"]),
    (Case("LSTM", lstm(seq=lens(2, 3)), {"hidden_size": H, **REV}, wrt=PARAMS, outputs=3,
          id="Y_c-only-reverse-seq-lens"), ["y2"]),
    (Case("LSTM", lstm(peep=True), {"hidden_size": H}, wrt=PARAMS + [7], outputs=3, id="Y_h-only"), ["y1"]),
], ids=lambda c: str(c) if isinstance(c, Case) else "")
def test_some_outputs(case, of):
    run_case(case, of=of)


@pytest.mark.parametrize("op, inputs, attrs", [
    ("RNN", rnn(), {"hidden_size": H}),
    ("GRU", gru(seq=lens(3, 2)), {"hidden_size": H, "linear_before_reset": 1}),
    ("LSTM", lstm(peep=True), {"hidden_size": H, **REV}),
], ids=["RNN", "GRU", "LSTM"])
def test_model_without_Y(op, inputs, attrs):
    """The model dropped Y: the rule names it on the forward node; Y_h stays what it was."""
    case = Case(op, inputs, attrs, wrt=PARAMS + ([7] if op == "LSTM" else []), outputs=2)
    model, feeds, wrt = harness.case_model(case)
    node = model.graph.node[0]
    node.output[0] = ""
    del model.graph.output[0]
    gm = onnxgrad.grad(model, wrt=wrt, of=["y1"])
    onnx.checker.check_model(gm, full_check=True)
    assert gm.graph.node[0].output[0], "Y was not exposed"
    before = Runner(model)(feeds)["y1"]
    after = Runner(gm)({**feeds, "y1_grad": np.ones_like(before)})["y1"]
    np.testing.assert_array_equal(before, after)
    r = onnxgrad.tools.check.check(model, gm, feeds)
    assert r.ok(case.tol32), r.errors


# initial_h / initial_c: tagged NonDifferentiable by the schemas, differentiated as PyTorch's h_0 / c_0
INITIAL_STATE = [
    Case("RNN", rnn(seq=lens(2, 3)), {"hidden_size": H}, wrt=[0, 5], outputs=2, opset=13, id="seq-lens"),
    Case("RNN", rnn(2, layout=1), {"hidden_size": H, "layout": 1, **BIDI}, wrt=PARAMS + [5], outputs=2,
         opset=22, id="bidirectional-layout1", reference=BATCH_FIRST),
    Case("RNN", rnn(), {"hidden_size": H, **REV}, wrt=[5], id="reverse-Y-only-h0-only"),
    Case("GRU", gru(2, seq=lens(3, 2)), {"hidden_size": H, **BIDI}, wrt=[0, 5], outputs=2, opset=13,
         id="seq-lens-bidirectional"),
    Case("GRU", gru(), {"hidden_size": H, "linear_before_reset": 1, **REV}, wrt=PARAMS + [5], outputs=2,
         id="reverse-lbr"),
    Case("GRU", gru(2, layout=1), {"hidden_size": H, "layout": 1, **BIDI}, wrt=[5], outputs=2, opset=22,
         id="bidirectional-layout1-h0-only", reference=BATCH_FIRST),
    Case("LSTM", lstm(2, seq=lens(1, 3), peep=True), {"hidden_size": H, **BIDI}, wrt=[0, 5, 6], outputs=3,
         opset=13, id="seq-lens-bidirectional-peepholes"),
    Case("LSTM", lstm(peep=True), {"hidden_size": H, **REV}, wrt=PARAMS + [5, 6, 7], outputs=3,
         id="reverse-peepholes"),
    Case("LSTM", lstm(2, layout=1), {"hidden_size": H, "layout": 1, **BIDI}, wrt=[5, 6], outputs=3, opset=22,
         id="bidirectional-layout1-states-only", reference=BATCH_FIRST),
    Case("LSTM", lstm(), {"hidden_size": H, "clip": 0.9}, wrt=[6], outputs=3, id="clip-c0-only"),
]


@pytest.mark.parametrize("case", INITIAL_STATE, ids=_ids)
def test_initial_state_gradient(case):
    """initial_h/initial_c get gradients by default (beyond the schema's tags), checked like every other input."""
    _check_reference(case)
    run_case(case)


@pytest.mark.parametrize("op, states", [("RNN", [5]), ("GRU", [5]), ("LSTM", [5, 6])])
def test_initial_states_are_beyond_the_tags(op, states):
    """The schemas tag the initial states NonDifferentiable: strict tag-following leaves them out."""
    schema = get_schema(op, 22)
    assert all(schema.inputs[i].differentiation_category == NON_DIFFERENTIABLE for i in states)
    rule = get_rule(op)
    n_inputs = len(schema.inputs)
    assert set(states) <= set(rule.differentiable_inputs(schema, n_inputs))
    assert not set(states) & set(rule.differentiable_inputs(schema, n_inputs, strict=True))
    assert set(rule.differentiable_inputs(schema, n_inputs, strict=True)) == set(rule.inputs)
    assert beyond_tags_inputs(op) == tuple(states)


def test_initial_state_is_differentiated_by_default():
    """A real gradient, not zeros: it matches central differences and no ConstantOfShape makes it."""
    case = Case("GRU", gru(), {"hidden_size": H}, wrt=PARAMS + [5], outputs=2)
    model, feeds, _ = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=["x0", "x5"], of=["y0", "y1"])
    producer = {o: node for node in gm.graph.node for o in node.output}
    assert producer["x5_grad"].op_type not in ("ConstantOfShape", "Identity")
    r = onnxgrad.tools.check.check(model, gm, feeds)
    assert r.ok(case.tol32), r.errors
    assert np.any(r.analytic["x5"] != 0)


def test_initial_state_is_not_differentiated_in_strict_mode():
    """strict_tags=True follows the schema's tags: initial_h carries no gradient (zeros with allow_unused)."""
    model, _, _ = harness.case_model(Case("GRU", gru(), {"hidden_size": H}, wrt=PARAMS + [5], outputs=2))
    with pytest.raises(onnxgrad.UnusedError, match="x5"):
        onnxgrad.grad(model, wrt=["x0", "x5"], of=["y0", "y1"], strict_tags=True)
    gm = onnxgrad.grad(model, wrt=["x0", "x5"], of=["y0", "y1"], strict_tags=True, allow_unused=True)
    outputs = [o.name for o in gm.graph.output]
    assert "x5_grad" in outputs   # zeros: the schema says initial_h is not differentiable
    producer = {o: node for node in gm.graph.node for o in node.output}
    zeros = producer["x5_grad"]
    if zeros.op_type == "Identity":      # a copy where the zeros are not named x5_grad where they are made
        zeros = producer[zeros.input[0]]
    assert zeros.op_type == "ConstantOfShape"


def test_unknown_sequence_length_is_declined():
    case = Case("LSTM", lstm(), {"hidden_size": H}, wrt=PARAMS, outputs=3, unknown_shapes=True)
    model, _, wrt = harness.case_model(case)
    with pytest.raises(UnsupportedOpError, match="sequence length"):
        onnxgrad.grad(model, wrt=wrt, of=["y0"])


def test_unknown_batch_size():
    """Only the sequence length must be static; the batch may be symbolic."""
    case = Case("GRU", gru(seq=lens(3, 1)), {"hidden_size": H, "linear_before_reset": 1}, wrt=PARAMS, outputs=2)
    model, feeds, wrt = harness.case_model(case)
    x = next(i for i in model.graph.input if i.name == "x0")
    x.type.tensor_type.shape.dim[1].dim_param = "batch"
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0", "y1"])
    onnx.checker.check_model(gm, full_check=True)
    r = onnxgrad.tools.check.check(model, gm, feeds)
    assert r.ok(case.tol32), r.errors


def test_input_forget_is_declined():
    case = Case("LSTM", lstm(), {"hidden_size": H, "input_forget": 1}, wrt=PARAMS, outputs=3)
    model, _, wrt = harness.case_model(case)
    with pytest.raises(UnsupportedOpError, match="input_forget"):
        onnxgrad.grad(model, wrt=wrt, of=["y0"])


@pytest.mark.parametrize("case", [
    Case("RNN", rnn(seq=lens(3, 2)), {"hidden_size": H, **REV}, wrt=PARAMS),
    Case("GRU", gru(), {"hidden_size": H, "linear_before_reset": 1}, wrt=PARAMS),
    Case("LSTM", lstm(peep=True), {"hidden_size": H}, wrt=PARAMS + [7]),
], ids=str)
def test_second_order(case):
    """grad(grad(model)): the backward graph's ops all have rules; d(dL/dX)/dW against differences."""
    model, feeds, wrt = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    seed = randn(*feeds["x0"].shape[:1], 1, *feeds["x0"].shape[1:2], H)       # dL/dY, [T, 1, B, H]
    ggm = onnxgrad.grad(gm, wrt=["x1", "x2"], of=["x0_grad"])
    onnx.checker.check_model(ggm, full_check=True)
    r = onnxgrad.tools.check.check(gm, ggm, {**feeds, "y0_grad": seed}, max_elements=40)
    assert r.ok(2e-3), r.errors
