"""onnx's own backend node test cases, checked numerically for every op with a rule (issue: every op, proven).

Each case keeps onnx's model and integer inputs, draws float inputs from a
domain where the op is smooth, and compares the gradient graph (onnxruntime,
float32) with float64 central differences (see tests/backend_cases.py).
The cases with integer inputs run twice: those inputs as constants (as exporters write
them), then fed at run time with fresh float inputs (the rules see no value: shapes,
sizes and axes computed in the graph).
"""
import numpy as np
import pytest
from backend_cases import (
    EXPECTED_OVERFLOW,
    _beyond_range,
    _differentiable_inputs,
    _differentiable_outputs,
    _runtime_opset,
    _seeds,
    all_cases,
    cases_for_rules,
    cases_with_integer_inputs,
    run_case,
)

import onnxgrad
from onnxgrad.ir.load import load
from onnxgrad.tools.check import Runner, as_float64, gradient_spec, to_float64

CASES = cases_for_rules()
FED = cases_with_integer_inputs()


def _judge(case, outcome):
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    if outcome.status == "declined":
        pytest.xfail(f"the {case.op_type} rule declines this configuration: {outcome.detail}")
    if outcome.status == "overflow":
        assert case.name in EXPECTED_OVERFLOW, (
            f"{case.name}: a gradient beyond its type's range ({outcome.detail}); if PyTorch's autograd overflows "
            "there too, list the case in EXPECTED_OVERFLOW with that evidence")
        pytest.xfail(f"expected overflow: {outcome.detail}. {EXPECTED_OVERFLOW[case.name]}")
    assert outcome.status == "pass", f"{case.name} ({case.op_type}): {outcome.detail}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backend_case(case):
    _judge(case, run_case(case))


@pytest.mark.parametrize("case", FED, ids=lambda c: c.name)
def test_backend_case_integers_fed(case):
    _judge(case, run_case(case, seed=1, integers_fed=True))


def test_suite_is_not_empty():
    ops = {c.op_type for c in CASES}
    assert len(CASES) > 100 and {"Add", "MatMul", "Relu"} <= ops
    assert {"AffineGrid", "Resize", "MaxUnpool"} <= {c.op_type for c in FED}


def _gated_delta_rule(torch, q, k, v, decay, beta, q_heads, kv_heads, inside=None):
    """LinearAttention's gated delta rule (no past state) as PyTorch ops, step by step, in ``inside``'s precision
    (the inputs' when None), its results cast back to the inputs' type."""
    dtype = q.dtype
    if inside is not None:
        q, k, v, decay, beta = (x.to(inside) for x in (q, k, v, decay, beta))
    b, t, _ = q.shape

    def heads(x, h):
        return x.reshape(b, t, h, -1).transpose(1, 2)

    q4, k4, v4, g4 = heads(q, q_heads), heads(k, kv_heads), heads(v, kv_heads), heads(decay, kv_heads)
    dk = q4.shape[-1]
    state = torch.zeros(b, kv_heads, dk, v4.shape[-1], dtype=q.dtype)
    outs = []
    for i in range(t):
        state = state * torch.exp(g4[:, :, i])[..., None]
        ki = k4[:, :, i]
        delta = beta[:, i, :, None] * (v4[:, :, i] - torch.einsum("bhdm,bhd->bhm", state, ki))
        state = state + ki[..., :, None] * delta[..., None, :]
        read = state.repeat_interleave(q_heads // kv_heads, dim=1)
        outs.append(torch.einsum("bhd,bhdm->bhm", q4[:, :, i], read) / dk ** 0.5)
    return torch.stack(outs, 2).transpose(1, 2).reshape(b, t, -1).to(dtype), state.to(dtype)


@pytest.mark.parametrize("name", sorted(EXPECTED_OVERFLOW))
def test_linear_attention_fp16_gradient_beyond_float16(name):
    """The evidence behind EXPECTED_OVERFLOW: at inputs uniform in (-2, 2) (seed 276), beta's float64 gradient is
    finite and beyond float16's largest; onnxgrad's float16 gradient graph is inf exactly at those elements and
    within 4 eps elsewhere; PyTorch's float16 autograd of the same recurrence (float16 throughout, and float32
    inside as the ONNX function body computes) is inf at the same elements and finite where onnxgrad's is."""
    case = {c.name: c for c in all_cases()}[name]
    model = _runtime_opset(load(case.model))
    wrt, of = _differentiable_inputs(case, model), _differentiable_outputs(case, model)
    rng = np.random.default_rng(276)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}
    feeds = {w: rng.uniform(-2.0, 2.0, shapes[w]).astype(np.float16) for w in wrt}
    gm = onnxgrad.grad(model, wrt=wrt, of=of, allow_unused=True)
    spec = gradient_spec(gm)
    seeds = _seeds(gm, Runner(model)(feeds, of), np.random.default_rng(276))
    native = Runner(gm)({**feeds, **seeds})
    exact = Runner(to_float64(gm))(as_float64({**feeds, **seeds}))
    reason = _beyond_range(gm, native, exact)
    assert reason.startswith("beta:") and ";" not in reason, reason          # beta alone, and only by its range
    beyond = ~np.isfinite(np.asarray(native[spec["gradients"]["beta"]], np.float64))
    assert beyond.any() and np.isfinite(exact[spec["gradients"]["beta"]]).all()

    torch = pytest.importorskip("torch")
    attrs = {a.name: a.i for a in case.model.graph.node[0].attribute} if not case.expanded else {}
    q_heads, kv_heads = attrs.get("q_num_heads", 8), attrs.get("kv_num_heads", 4)
    assert (q_heads, kv_heads) == (8, 4)           # the case's heads (test_linear_attention_fp16's node)
    for inside in (None, torch.float32):
        xs = {w: torch.tensor(feeds[w]).requires_grad_() for w in wrt}
        out, state = _gated_delta_rule(torch, xs["query"], xs["key"], xs["value"], xs["decay"], xs["beta"],
                                       q_heads, kv_heads, inside)
        results = dict(zip(case.node_outputs, (out, state)))
        torch.autograd.backward([results[o] for o in of], [torch.tensor(seeds[spec["seeds"][o]]) for o in of])
        theirs = xs["beta"].grad.numpy()
        assert (~np.isfinite(theirs) == beyond).all(), f"PyTorch (inside {inside}): inf elsewhere than onnxgrad"
        if inside is not None:           # the same float32 math: the same float16 values where finite
            np.testing.assert_allclose(theirs[~beyond], native[spec["gradients"]["beta"]][~beyond], rtol=4e-3,
                                       atol=4 * 2.0 ** -10 * float(np.abs(exact[spec["gradients"]["beta"]]).max()))


def test_overflow_outcome_needs_the_true_value_beyond_range(monkeypatch):
    """run_case says "overflow" (and its float64 math is checked) at the draw above, and _beyond_range refuses
    an inf where the float64 gradient is within float16's range."""
    import backend_cases

    case = {c.name: c for c in all_cases()}["test_linear_attention_fp16_expanded"]

    def wide(case, model, wrt, rng):
        rng = np.random.default_rng(276)
        shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}
        return {w: rng.uniform(-2.0, 2.0, shapes[w]).astype(np.float16) for w in wrt}

    monkeypatch.setattr(backend_cases, "_inputs", wide)
    outcome = run_case(case, seed=276)
    assert outcome.status == "overflow" and outcome.detail.startswith("beta:"), outcome
    model = _runtime_opset(load(case.model))
    wrt, of = _differentiable_inputs(case, model), _differentiable_outputs(case, model)
    feeds = wide(case, model, wrt, None)
    gm = onnxgrad.grad(model, wrt=wrt, of=of, allow_unused=True)
    seeded = {**feeds, **_seeds(gm, Runner(model)(feeds, of), np.random.default_rng(276))}
    native, exact = Runner(gm)(seeded), Runner(to_float64(gm))(as_float64(seeded))
    assert _beyond_range(gm, native, exact)
    value = gradient_spec(gm)["gradients"]["value"]
    native[value] = native[value].copy()
    native[value].flat[0] = np.inf                      # |float64| there is far below 65504
    assert _beyond_range(gm, native, exact) == ""
