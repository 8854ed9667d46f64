"""Attention, RotaryEmbedding, SwiGLU and CausalConvWithState gradients, checked against central differences.

The float64 forward the numeric check differentiates comes from onnx.reference
wherever onnxruntime cannot run it faithfully (``onnxgrad.tools.check.Runner`` decides):

- onnxruntime's float64 Attention departs from the spec, and from its own float32
  kernel: NaN for a fully-masked query row (the spec and float32 give 0), and a
  top-left causal frontier with nonpad_kv_seqlen (the spec: bottom-right);
- it refuses at run time (not at load) an attn_mask shorter than the keys;
- it has no Attention-25, RotaryEmbedding in float64, nor the opset-27/28 ops;
- onnx.reference computes CausalConvWithState's SiLU and the whole LinearAttention
  recurrence in float32, so float64-exact versions of those two ops are used.

onnx.reference in turn writes the softcapped scores to qk_matmul_output in mode 0,
where the spec (and onnxruntime) write the raw scores; that one case is checked
against onnxruntime's float64 forward.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

import harness
import onnxgrad
import onnxgrad.tools.check
from harness import Case, randn, run_case, run_declared
from onnxgrad.errors import UnsupportedOpError
from onnxgrad.tools.check.kernels import linear_attention

B, S, L, E = 2, 3, 4, 3            # batch, query length, key length, head size


def qkv(hq=2, hk=2, s=S, l=L, e=E, ev=E, packed=False, b=B):
    if packed:
        return [randn(b, s, hq * e), randn(b, l, hk * e), randn(b, l, hk * ev)]
    return [randn(b, hq, s, e), randn(b, hk, l, e), randn(b, hk, l, ev)]


def bool_mask(*shape, full_row=None):
    m = np.random.default_rng(7).random(shape) > 0.4
    m[..., 0] = True
    if full_row is not None:
        m[..., full_row, :] = False              # a row with no key: the op makes its output 0
    return m


CASES = [
    Case("Attention", qkv(), opset=23, id="mha"),
    Case("Attention", qkv(), opset=24, id="mha-opset24"),
    Case("Attention", qkv(4, 2, b=1), opset=23, id="gqa"),
    Case("Attention", qkv(4, 1, b=1), opset=23, id="mqa"),
    Case("Attention", qkv(2, 1, packed=True), {"q_num_heads": 2, "kv_num_heads": 1}, opset=23, id="packed-gqa"),
    Case("Attention", qkv(ev=2), {"scale": 0.4, "softcap": 1.5}, opset=23, id="scale-softcap-dv2"),
    Case("Attention", qkv(l=S), {"is_causal": 1}, opset=23, id="causal"),
    Case("Attention", qkv(s=2, l=2) + [None, randn(B, 2, 3, E), randn(B, 2, 3, E)], {"is_causal": 1},
         opset=23, outputs=3, id="causal-past"),
    Case("Attention", qkv(2, 1, s=2, l=2, packed=True) + [None, randn(B, 1, 2, E), randn(B, 1, 2, E)],
         {"q_num_heads": 2, "kv_num_heads": 1}, opset=24, outputs=3, id="packed-gqa-past"),
    Case("Attention", qkv() + [bool_mask(S, L)], opset=23, id="bool-mask"),
    Case("Attention", qkv() + [bool_mask(B, 1, S, L, full_row=1)], opset=24, id="bool-mask-empty-row"),
    Case("Attention", qkv() + [randn(B, 1, S, L)], opset=23, id="float-mask"),
    Case("Attention", qkv() + [randn(S, L)], {"is_causal": 1, "softcap": 2.0}, opset=23, id="float-mask-2d-causal"),
    Case("Attention", qkv() + [randn(2, S, L)], opset=24, id="float-mask-3d"),
    Case("Attention", qkv() + [randn(S, L - 1)], opset=24, id="float-mask-short",
         reference="onnxruntime's Attention refuses at run time an attn_mask shorter than the keys"),
    Case("Attention", qkv() + [None, None, None, np.array([2, 4], np.int64)], opset=24, id="nonpad"),
    Case("Attention", qkv() + [None, None, None, np.array([2, 4], np.int64)], {"is_causal": 1}, opset=24,
         id="nonpad-causal"),
    Case("Attention", qkv(), {"left_window_size": 1, "right_window_size": 0}, opset=25, id="window"),
    Case("Attention", qkv(l=2) + [randn(2, S, 2)], opset=23, id="float-mask-3d-l2"),
    Case("Attention", qkv() + [bool_mask(S, L)], {"softmax_precision": onnx.TensorProto.DOUBLE}, opset=23,
         id="softmax-precision-double"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention(case):
    run_case(case)


# qk_matmul_output (output 3) seeded too; modes 1-3 with softcap (onnx.reference's mode 0 differs, below)
QK_OUTPUT = [
    Case("Attention", qkv() + [randn(B, 1, S, L)], {"qk_matmul_output_mode": mode, "softcap": 2.5},
         opset=23, outputs=4, id=f"mode{mode}")
    for mode in (1, 2, 3)
] + [
    Case("Attention", qkv() + [randn(B, 1, S, L)], {"qk_matmul_output_mode": 0}, opset=23, outputs=4, id="mode0"),
    Case("Attention", qkv(4, 2, b=1) + [bool_mask(S, L, full_row=2)], {"qk_matmul_output_mode": 3},
         opset=24, outputs=4, id="mode3-gqa-empty-row"),
    Case("Attention", qkv() + [randn(S, L)], {"qk_matmul_output_mode": 3, "softmax_precision": 11},
         opset=24, outputs=4, id="mode3-softmax-precision-double"),
]


@pytest.mark.parametrize("case", QK_OUTPUT, ids=str)
def test_attention_qk_output(case):
    run_declared(case, keep=[0, 3])


class _OnnxruntimeRunner(onnxgrad.tools.check.Runner):
    """onnxruntime even for float64 Attention (its automatic declaration for onnx.reference refused)."""

    def __init__(self, model, runtime=None, reason=""):
        super().__init__(model, runtime="onnxruntime")


def test_attention_qk_output_mode0_softcap(monkeypatch):
    """Mode 0 is the raw scores, before the softcap: onnxruntime's float64 forward (onnx.reference differs)."""
    monkeypatch.setattr(onnxgrad.tools.check, "Runner", _OnnxruntimeRunner)
    case = Case("Attention", qkv() + [randn(B, 1, S, L)], {"qk_matmul_output_mode": 0, "softcap": 2.5},
                opset=23, outputs=4)
    run_declared(case, keep=[0, 3])


def test_attention_present_outputs_seeded():
    case = Case("Attention", qkv(2, 1, s=2, l=2) + [None, randn(B, 1, 2, E), randn(B, 1, 2, E)],
                {"is_causal": 1}, opset=23, outputs=3)
    run_declared(case, of=["y1", "y2"])


def test_attention_symbolic_batch_and_lengths():
    """Batch and sequence lengths unknown, head sizes known (with all dims unknown, onnx's shape
    inference declares Y's last dim 0, which no graph can then use)."""
    case = Case("Attention", qkv(2, 1, packed=True) + [randn(S, L)], {"q_num_heads": 2, "kv_num_heads": 1,
                                                                      "is_causal": 1}, opset=23)
    run_declared(case, shapes={"x0": ["b", "s", 2 * E], "x1": ["b", "l", E], "x2": ["b", "l", E],
                       "x3": ["s", "l"], "y0": ["b", "s", 2 * E]})


def test_attention_probabilities_output_is_reused():
    """Mode 3 exposes the probabilities: the backward reads them instead of a second softmax."""
    model, _, wrt = harness.case_model(Case("Attention", qkv(), {"qk_matmul_output_mode": 3}, opset=23))
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    assert gm.graph.node[0].output[3], "qk_matmul_output was not exposed"
    assert not any(node.op_type == "Softmax" for node in gm.graph.node)


def test_attention_only_V_needs_no_scores():
    model, _, _ = harness.case_model(Case("Attention", qkv(), opset=23))
    gm = onnxgrad.grad(model, wrt=["x2"], of=["y0"])
    ops = [node.op_type for node in gm.graph.node[1:]]
    assert ops.count("MatMul") == 2          # Q K' to recompute P, then P' dY


def test_attention_bool_mask_has_no_gradient():
    model, feeds, _ = harness.case_model(Case("Attention", qkv() + [bool_mask(S, L)], opset=23, wrt=[0]))
    gm = onnxgrad.grad(model, wrt=["x0"], of=["y0"])
    assert onnxgrad.tools.check.check(model, gm, feeds).ok(2e-3)


# -- RotaryEmbedding --------------------------------------------------------------------------
POS = np.array([[0, 2, 2], [5, 1, 3]], np.int64)        # a repeated position: its cache row gets both


def rope(heads=2, head=4, rot=None, packed=False, pos=True, max_pos=6):
    half = (rot or head) // 2
    x = randn(B, S, heads * head) if packed else randn(B, heads, S, head)
    if pos:
        return [x, randn(max_pos, half), randn(max_pos, half), POS]
    return [x, randn(B, S, half), randn(B, S, half)]


ROPE = [
    Case("RotaryEmbedding", rope(), opset=23, id="4d"),
    Case("RotaryEmbedding", rope(), {"interleaved": 1}, opset=23, id="4d-interleaved"),
    Case("RotaryEmbedding", rope(packed=True), {"num_heads": 2}, opset=23, id="3d"),
    Case("RotaryEmbedding", rope(head=6, rot=4), {"rotary_embedding_dim": 4, "interleaved": 1}, opset=23,
         id="partial-interleaved"),
    Case("RotaryEmbedding", rope(packed=True, head=6, rot=4), {"num_heads": 2, "rotary_embedding_dim": 4},
         opset=24, id="3d-partial"),
    Case("RotaryEmbedding", rope(pos=False), opset=23, id="no-position-ids"),
    Case("RotaryEmbedding", rope(), opset=23, wrt=[0], id="x-only"),
]


@pytest.mark.parametrize("case", ROPE, ids=str)
def test_rotary_embedding(case):
    run_case(case)


def test_rotary_embedding_x_gradient_is_the_inverse_rotation():
    model, _, _ = harness.case_model(Case("RotaryEmbedding", rope(), opset=23, wrt=[0]))
    gm = onnxgrad.grad(model, wrt=["x0"], of=["y0"])
    assert [node.op_type for node in gm.graph.node].count("RotaryEmbedding") == 2


# onnxruntime 1.32 has no SwiGLU-28 kernel, and the Swish-24 of its function body has none either
NO_SWIGLU = "onnxruntime has no kernel for SwiGLU-28 nor for its function body's Swish-24"

# -- SwiGLU, CausalConvWithState --------------------------------------------------------------
OTHERS = [
    Case("SwiGLU", [randn(3, 4), randn(3, 4)], opset=28, id="default", reference=NO_SWIGLU),
    Case("SwiGLU", [randn(2, 3, 4), randn(2, 3, 4)], {"alpha": 1.702}, opset=28, id="alpha", reference=NO_SWIGLU),
    Case("CausalConvWithState", [randn(B, 3, 5), randn(3, 1, 3), randn(3)], opset=27, outputs=2, id="no-state"),
    Case("CausalConvWithState", [randn(B, 3, 5), randn(3, 1, 3), None, randn(B, 3, 2)], opset=27,
         wrt=[0, 1], outputs=2, id="state"),
    Case("CausalConvWithState", [randn(B, 3, 4), randn(3, 1, 4), randn(3), randn(B, 3, 3)],
         {"activation": "silu"}, opset=27, wrt=[0, 1, 2], outputs=2, id="state-silu"),
    Case("CausalConvWithState", [randn(1, 2, 2), randn(2, 1, 4), randn(2)], {"activation": "swish"},
         opset=27, outputs=2, id="kernel-longer-than-input"),
]


@pytest.mark.parametrize("case", OTHERS, ids=str)
def test_other(case):
    # (onnx's CausalConvWithState inference writes output 1 even where the node has one: cases keep both)
    run_case(case)


def test_causal_conv_present_state_only():
    case = Case("CausalConvWithState", [randn(B, 3, 5), randn(3, 1, 3), randn(3)], opset=27, outputs=2)
    run_case(case, of=["y1"])


def test_attention_unknown_heads_is_declined():
    model, _, wrt = harness.case_model(Case("Attention", qkv(), opset=23, unknown_shapes=True))
    with pytest.raises(UnsupportedOpError, match="heads"):
        onnxgrad.grad(model, wrt=wrt, of=["y0"])


T = 3


def lin(hq=2, hk=2, dk=2, dv=3, decay=None, beta=None, past=False, b=B):
    inputs = [randn(b, T, hq * dk), randn(b, T, hk * dk), randn(b, T, hk * dv)]
    inputs += [randn(b, hk, dk, dv) if past else None]
    inputs += [None if decay is None else randn(b, T, decay, low=-1.0, high=-0.05)]
    inputs += [None if beta is None else randn(b, T, beta, low=0.1, high=0.9)]
    while inputs[-1] is None:
        inputs.pop()
    return inputs


LINEAR = [
    Case("LinearAttention", lin(), {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear"},
         opset=27, outputs=2, id="linear"),
    Case("LinearAttention", lin(4, 2, b=1, decay=2), {"q_num_heads": 4, "kv_num_heads": 2,
                                                      "update_rule": "gated"}, opset=27, outputs=2,
         id="gated-per-head-gqa"),
    Case("LinearAttention", lin(decay=4), {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "gated",
                                           "scale": 0.3}, opset=27, outputs=2, id="gated-per-key"),
    Case("LinearAttention", lin(beta=2), {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "delta"},
         opset=27, outputs=2, id="delta"),
    Case("LinearAttention", lin(2, 1, decay=2, beta=1, past=True), {"q_num_heads": 2, "kv_num_heads": 1},
         opset=27, outputs=2, wrt=[0, 1, 2, 4, 5], id="gated-delta-past-gqa"),
    Case("LinearAttention", lin(decay=2, beta=1), {"q_num_heads": 2, "kv_num_heads": 2}, opset=27,
         outputs=2, id="gated-delta-shared-beta"),
]


@pytest.mark.parametrize("case", LINEAR, ids=str)
def test_linear_attention(case):
    _check_linear_reference(case)
    run_case(case)


def test_linear_attention_present_state_only():
    case = Case("LinearAttention", lin(decay=4, beta=2, past=True), {"q_num_heads": 2, "kv_num_heads": 2},
                opset=27, outputs=2, wrt=[0, 1, 2, 4, 5])
    run_case(case, of=["y1"])


def _check_linear_reference(case: Case) -> None:
    """The float64 recurrence above agrees with onnx.reference's (float32) on this case."""
    model, feeds, _ = harness.case_model(case)
    values = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer} | feeds
    want = ReferenceEvaluator(model).run(None, feeds)
    node = model.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
    got = linear_attention(*[values[x].astype(np.float64) if x else None for x in node.input], **attrs)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", [
    Case("Attention", qkv(4, 2, b=1) + [randn(1, 1, S, L)], {"softcap": 2.0}, opset=23),
    Case("LinearAttention", lin(decay=2, beta=2), {"q_num_heads": 2, "kv_num_heads": 2}, opset=27, outputs=2),
], ids=str)
def test_second_order(case):
    """grad(grad(model)): the backward graph's ops all have rules; d(dL/dQ)/dK against differences."""
    model, feeds, wrt = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    y0 = next(o for o in model.graph.output if o.name == "y0")
    seed = randn(*[d.dim_value for d in y0.type.tensor_type.shape.dim])
    # LinearAttention is linear in Q: dL/dQ does not depend on Q (no path, so allow_unused gives its zeros)
    ggm = onnxgrad.grad(gm, wrt=["x0", "x1"], of=["x0_grad"], allow_unused=True)
    onnx.checker.check_model(ggm, full_check=True)
    r = onnxgrad.tools.check.check(gm, ggm, {**feeds, "y0_grad": seed}, max_elements=40)
    assert r.ok(2e-3), r.errors


def test_fully_masked_rows_of_a_written_out_attention_have_finite_gradients():
    """onnx's Attention body masks a row of -inf scores after Softmax (Where(row all -inf, 0, p)): the forward
    is finite and its gradient must be too (0, not 0 * NaN), equal to central differences."""
    import onnx.parser

    from onnxgrad.tools.check import check, run_float64

    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[2,3] q, float[4,3] k, float[4,3] v, float[2,4] bias) => (float[2,3] y) {
          ninf = Constant<value = float {-inf}>()
          zero = Constant<value = float {0}>()
          axes = Constant<value = int64[1] {-1}>()
          kt = Transpose<perm = [1, 0]>(k)
          s = MatMul(q, kt)
          t = Add(s, bias)
          p = Softmax(t)
          rowmax = ReduceMax<keepdims = 1>(bias, axes)
          masked = Equal(rowmax, ninf)
          safe = Where(masked, zero, p)
          y = MatMul(safe, v)
        }""")
    bias = np.array([[0, 0, -np.inf, 0], [-np.inf] * 4], np.float32)          # row 1 removes every key
    gm = onnxgrad.grad(model, wrt=["q", "k", "v"], of=["y"])
    onnx.checker.check_model(gm, full_check=True)
    feeds = dict(q=randn(2, 3), k=randn(4, 3), v=randn(4, 3), bias=bias)
    r = check(model, gm, feeds, analytic_run=run_float64)
    assert all(np.isfinite(g).all() for g in r.analytic.values())
    assert r.ok(1e-6), r.errors
    assert not r.analytic["q"][1].any()                  # the masked row's query has no influence
