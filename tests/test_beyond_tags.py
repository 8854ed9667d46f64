"""Gradients beyond the ONNX tags: float inputs the schemas tag NonDifferentiable that PyTorch differentiates.

The rules declare them (``register(..., beyond_tags=...)``); they carry gradients by default and
``strict_tags=True`` (``Rule.differentiable_inputs(..., strict=True)``) follows the tags alone. The
numeric checks of each rule live in its module's tests; here: the registry's contract, the pass in
both modes, the coverage report, the opset-27 recurrent caches (past_state), second order, and a
spatial transformer differentiated end to end through AffineGrid and GridSample.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx.defs
import pytest
from onnx import TensorProto, helper, numpy_helper

import harness
import onnxgrad
from harness import Case, make_model, randn, run_case, run_second_order
from onnxgrad.rules.registry import NON_DIFFERENTIABLE, Rule, all_rules, beyond_tags_inputs, get_rule, get_schema
from onnxgrad.tools.check import Runner, check
from onnxgrad.tools.coverage import coverage
from test_rules_attention import lin  # query, key, value (, past_state, decay, beta) of LinearAttention

F32 = TensorProto.FLOAT

# op: (input names beyond the tags) -- what this change promises
EXPECTED = {
    "Clip": ("min", "max"),
    "Mod": ("B",),
    "GridSample": ("grid",),
    "AffineGrid": ("theta",),
    "CausalConvWithState": ("past_state",),
    "LinearAttention": ("past_state",),
    "DFT": ("input",),
    "STFT": ("signal", "window"),
    "RNN": ("initial_h",),
    "GRU": ("initial_h",),
    "LSTM": ("initial_h", "initial_c"),
}


def _newest(op: str) -> onnx.defs.OpSchema:
    return onnx.defs.get_schema(op, onnx.defs.onnx_opset_version(), "")


def _is_float(schema: onnx.defs.OpSchema, i: int) -> bool:
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    types = allowed.get(schema.inputs[i].type_str, [schema.inputs[i].type_str])
    return any(t in ("tensor(float)", "tensor(double)", "tensor(float16)") for t in types)


# -- the registry's contract ------------------------------------------------------------------
def test_the_rules_that_go_beyond_the_tags():
    declared = {op: tuple(_newest(op).inputs[i].name for i in rule.beyond_tags)
                for op, rule in all_rules().items() if rule.beyond_tags}
    assert declared == EXPECTED


@pytest.mark.parametrize("op", sorted(EXPECTED))
def test_beyond_tags_are_float_inputs_tagged_non_differentiable(op):
    schema = _newest(op)
    for i in beyond_tags_inputs(op):
        assert schema.inputs[i].differentiation_category == NON_DIFFERENTIABLE, (op, i)
        assert _is_float(schema, i), (op, i)


@pytest.mark.parametrize("op", sorted(EXPECTED))
def test_strict_follows_the_tags_and_default_adds_beyond_tags(op):
    schema = _newest(op)
    rule = get_rule(op)
    n = len(schema.inputs)
    strict, default = rule.differentiable_inputs(schema, n, strict=True), rule.differentiable_inputs(schema, n)
    assert not set(strict) & set(rule.beyond_tags)
    assert set(default) == set(strict) | set(rule.beyond_tags)
    assert all(schema.inputs[i].differentiation_category != NON_DIFFERENTIABLE for i in strict)


def test_differentiable_inputs_mechanism():
    """Tagged positions (or the rule's own list) plus beyond_tags; absent trailing inputs dropped; stop rules none."""
    clip = get_schema("Clip", 13)
    rule = Rule("Clip", fn=lambda n: None, beyond_tags=(1, 2))
    assert rule.differentiable_inputs(clip, 3) == (0, 1, 2)
    assert rule.differentiable_inputs(clip, 3, strict=True) == (0,)
    assert rule.differentiable_inputs(clip, 2) == (0, 1)          # Clip(x, min): no max input
    own = Rule("LSTM", fn=lambda n: None, inputs=(0, 1, 2, 3, 7), beyond_tags=(5, 6))
    lstm = get_schema("LSTM", 22)
    assert own.differentiable_inputs(lstm, 8) == (0, 1, 2, 3, 5, 6, 7)
    assert own.differentiable_inputs(lstm, 8, strict=True) == (0, 1, 2, 3, 7)
    assert own.differentiable_inputs(lstm, 6) == (0, 1, 2, 3, 5)
    plain = Rule("Relu", fn=lambda n: None)
    assert plain.differentiable_inputs(get_schema("Relu", 14), 1) == (0,)
    assert beyond_tags_inputs("Relu") == () and beyond_tags_inputs("NoSuchOp") == ()
    assert Rule("Floor", None, stop=True, beyond_tags=(0,)).differentiable_inputs(get_schema("Floor", 13), 1) == ()


def test_coverage_marks_the_inputs_beyond_the_tags(capsys):
    rows = {r.op_type: r for r in coverage()}
    for op, names in EXPECTED.items():
        row = rows[op]
        assert row.status == "rule" and tuple(row.beyond_tags) == names and not row.flags, row
        for name in names:
            assert f"{name}:N+" in row.tags.split()
    assert rows["Resize"].beyond_tags == [] and "scales:N" in rows["Resize"].tags.split()
    from onnxgrad.tools.coverage import print_table

    print_table()
    out = capsys.readouterr().out
    assert "N+ NonDifferentiable but given PyTorch's gradient" in out
    assert "AffineGrid: theta; CausalConvWithState: past_state; Clip: min, max; DFT: input;" in out


# -- the opset-27 recurrent caches (rules/attention.py): past_state as an RNN's h_0 ------------------
B = 2


PAST_STATE = [
    Case("CausalConvWithState", [randn(B, 3, 5), randn(3, 1, 3), None, randn(B, 3, 2)], opset=27, outputs=2,
         id="state"),
    Case("CausalConvWithState", [randn(B, 3, 4), randn(3, 1, 4), randn(3), randn(B, 3, 3)], {"activation": "silu"},
         opset=27, outputs=2, id="state-silu"),
    Case("CausalConvWithState", [randn(1, 2, 2), randn(2, 1, 4), randn(2), randn(1, 2, 3)], {"activation": "swish"},
         opset=27, outputs=2, wrt=[3], id="kernel-longer-than-input-state-only"),
    Case("LinearAttention", lin(2, 1, decay=2, beta=1, past=True), {"q_num_heads": 2, "kv_num_heads": 1}, opset=27,
         outputs=2, id="gated-delta-gqa"),
    Case("LinearAttention", lin(past=True), {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear"},
         opset=27, outputs=2, wrt=[3], id="linear-state-only"),
    Case("LinearAttention", lin(past=True, decay=4), {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "gated"},
         opset=27, outputs=2, wrt=[0, 3], id="gated-per-key"),
    Case("LinearAttention", lin(past=True, beta=2), {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "delta"},
         opset=27, outputs=2, wrt=[3, 5], id="delta"),
]


@pytest.mark.parametrize("case", PAST_STATE, ids=str)
def test_past_state_gradient(case):
    run_case(case)


# grad(grad(model)) through the inputs beyond the tags: the backward graphs' ops all have rules
SECOND_ORDER = [
    Case("Clip", [randn(3, 4), np.array(-0.3, np.float32), np.array(0.4, np.float32)], opset=13),
    Case("GridSample", [randn(1, 2, 3, 4), randn(1, 2, 2, 2, low=-1, high=1)], {"mode": "linear"}, opset=20,
         id="linear"),
    Case("GridSample", [randn(1, 2, 4, 4), randn(1, 2, 2, 2, low=-1, high=1)],
         {"mode": "cubic", "padding_mode": "reflection"}, opset=20, id="cubic-reflection"),
    Case("AffineGrid", [randn(2, 2, 3), np.array([2, 1, 3, 4], np.int64)], opset=20),
    Case("DFT", [randn(2, 5, 1)], {"axis": 1, "onesided": 1}, opset=17),
    Case("STFT", [randn(2, 16, 1), np.array(4, np.int64), randn(8), None], {"onesided": 1}, opset=17),
]


@pytest.mark.parametrize("case", SECOND_ORDER, ids=str)
def test_second_order(case):
    run_second_order(case)


# -- the pass, by default and strict ----------------------------------------------------------
STRICT = [   # (case, positions beyond the tags)
    (Case("Clip", [randn(3, 4), np.array(-0.3, np.float32), np.array(0.4, np.float32)], opset=13), [1, 2]),
    (Case("Mod", [np.array([1.3, -2.7, 5.1], np.float32), np.array([0.7, 1.1, -1.9], np.float32)],
          {"fmod": 1}, opset=13), [1]),
    (Case("GridSample", [randn(1, 2, 3, 4), randn(1, 2, 2, 2, low=-0.9, high=0.9)], opset=20), [1]),
    (Case("AffineGrid", [randn(2, 2, 3), np.array([2, 1, 3, 4], np.int64)], opset=20), [0]),
]


@pytest.mark.parametrize("case, beyond", STRICT, ids=[c.op for c, _ in STRICT])
def test_pass_default_and_strict(case, beyond):
    """By default the inputs beyond the tags get their gradient (checked against differences);
    with strict_tags=True they carry none: an UnusedError, or zeros with allow_unused, while
    the tagged inputs keep theirs."""
    model, feeds, wrt = harness.case_model(case)
    beyond = [f"x{i}" for i in beyond]
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    r = check(model, gm, feeds)
    assert r.ok(2e-3), r.errors
    assert all(np.any(r.analytic[name] != 0) for name in beyond)
    with pytest.raises(onnxgrad.UnusedError, match=beyond[0]):
        onnxgrad.grad(model, wrt=beyond, of=["y0"], strict_tags=True)
    strict = onnxgrad.grad(model, wrt=wrt, of=["y0"], strict_tags=True, allow_unused=True)
    y = Runner(model)(feeds)["y0"]
    seeded = {**feeds, "y0_grad": randn(*y.shape)}
    out, full = Runner(strict)(seeded), Runner(gm)(seeded)
    for name in wrt:
        want = np.zeros_like(feeds[name]) if name in beyond else full[f"{name}_grad"]
        np.testing.assert_array_equal(out[f"{name}_grad"], want, err_msg=name)


# -- a spatial transformer: theta = Reshape(features @ W + b) -> AffineGrid -> GridSample -> loss ------
N, C, H, W_, FEATURES = 2, 2, 5, 6, 4


def _spatial_transformer(attrs: dict) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """loss = sum(GridSample(image, AffineGrid(Reshape(features @ W + b, [N, 2, 3]), size)) * target)."""
    rng = np.random.default_rng(11)
    identity = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 0.0], np.float32)
    values = {
        "features": rng.standard_normal((N, FEATURES)).astype(np.float32),
        "image": rng.standard_normal((N, C, H, W_)).astype(np.float32),
        "W": (rng.standard_normal((FEATURES, 6)) * 0.15).astype(np.float32),
        "b": (identity * 0.9 + rng.standard_normal(6) * 0.05).astype(np.float32),
        "target": rng.standard_normal((N, C, 3, 4)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["features", "W"], ["fw"]),
        helper.make_node("Add", ["fw", "b"], ["params"]),
        helper.make_node("Reshape", ["params", "theta_shape"], ["theta"]),
        helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=attrs.get("align_corners", 0)),
        helper.make_node("GridSample", ["image", "grid"], ["sampled"], **attrs),
        helper.make_node("Mul", ["sampled", "target"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(np.array([N, 2, 3], np.int64), "theta_shape"),
             numpy_helper.from_array(np.array([N, C, 3, 4], np.int64), "size")]
    inputs = [helper.make_tensor_value_info(k, F32, list(v.shape)) for k, v in values.items()]
    model = make_model(nodes, inputs, [helper.make_tensor_value_info("loss", F32, [])], inits, opset=20)
    return model, values


CHAINS = [{"mode": "linear", "padding_mode": "zeros"},
          {"mode": "linear", "padding_mode": "border", "align_corners": 1},
          {"mode": "linear", "padding_mode": "reflection"},
          {"mode": "cubic", "padding_mode": "zeros", "align_corners": 1}]


@pytest.mark.parametrize("attrs", CHAINS, ids=lambda a: "-".join(str(v) for v in a.values()))
def test_spatial_transformer_chain(attrs):
    """Gradients of W, b (through theta and the grid, both beyond the tags) and the image, against differences."""
    model, values = _spatial_transformer(attrs)
    gm = onnxgrad.grad(model, wrt=["W", "b", "image"], loss="loss")
    onnx.checker.check_model(gm, full_check=True)
    r = check(model, gm, values, max_elements=64)
    assert r.ok(2e-3), r.errors
    assert all(np.any(r.analytic[name] != 0) for name in ("W", "b", "image"))
    with pytest.raises(onnxgrad.UnusedError, match="'W'"):
        onnxgrad.grad(model, wrt=["W", "image"], loss="loss", strict_tags=True)


def test_spatial_transformer_matches_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    model, values = _spatial_transformer({"mode": "linear", "padding_mode": "zeros"})
    gm = onnxgrad.grad(model, wrt=["W", "b", "image"], loss="loss")
    got = Runner(gm)(values)
    t = {k: torch.tensor(v, requires_grad=k in ("W", "b", "image")) for k, v in values.items()}
    theta = (t["features"] @ t["W"] + t["b"]).reshape(N, 2, 3)
    grid = F.affine_grid(theta, [N, C, 3, 4], align_corners=False)
    loss = (F.grid_sample(t["image"], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
            * t["target"]).sum()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for name, g in zip(("W", "b", "image"), torch.autograd.grad(loss, [t["W"], t["b"], t["image"]])):
        np.testing.assert_allclose(got[f"{name}_grad"], g.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
