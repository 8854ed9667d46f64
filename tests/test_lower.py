"""onnxgrad.lower: ai.onnx.preview.training ops to standard ops, run by stock onnxruntime."""
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxgrad
from onnxgrad.ir.load import MIN_OPSET, RUNTIME_MAX_IR, RUNTIME_MAX_OPSET
from onnxgrad.tools.cli import main as cli_main
from onnxgrad.tools.lowering import TRAINING_DOMAIN, lower

F = TensorProto.FLOAT
NODE_CASES = ["test_adagrad", "test_adagrad_multiple", "test_adam", "test_adam_multiple", "test_momentum",
              "test_momentum_multiple", "test_nesterov_momentum"]
MODEL_CASES = ["test_gradient_of_add", "test_gradient_of_add_and_mul"]


def _collect():
    """The cases above: importing an op's case module exports its cases (0.3 s for these three ops;
    collect_testcases() would export every op's, 3 s, at each collection)."""
    import importlib

    import onnx.backend.test.case.model as model_cases
    import onnx.backend.test.case.node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ("adagrad", "adam", "momentum"):
            importlib.import_module(f"onnx.backend.test.case.node.{op}")
        cases = {c.name: c for c in node_cases._NodeTestCases if c.name in NODE_CASES}
        cases.update({c.name: c for c in model_cases.collect_testcases() if c.name in MODEL_CASES})
    assert set(cases) == set(NODE_CASES + MODEL_CASES), sorted(set(NODE_CASES + MODEL_CASES) - set(cases))
    return cases


CASES = _collect()


def session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def assert_lowered(model):
    onnx.checker.check_model(model, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    assert [o.domain for o in model.opset_import] == [""]
    assert MIN_OPSET <= model.opset_import[0].version <= RUNTIME_MAX_OPSET
    assert model.ir_version <= RUNTIME_MAX_IR


@pytest.mark.parametrize("name", NODE_CASES + MODEL_CASES)
def test_onnx_backend_case_on_stock_onnxruntime(name):
    case = CASES[name]
    lowered = lower(case.model)
    assert_lowered(lowered)
    sess = session(lowered)
    for inputs, expected in case.data_sets:
        feeds = {i.name: v for i, v in zip(lowered.graph.input, inputs)}
        got = sess.run(None, feeds)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=case.rtol, atol=case.atol)


def test_lower_is_also_reachable_as_onnxgrad_lower():
    case = CASES["test_adam"]
    assert onnxgrad.lower(case.model).graph.node[0].domain == ""


# -- optimizers against onnx's reference implementation, beyond the backend cases -------------------------
def optimizer_model(op, n, state, attrs, dtype=F):
    ins = ["R", "T"] + [f"{k}{i}" for k in ["X", "G"] + state for i in range(n)]
    outs = [f"{k}{i}_new" for k in ["X"] + state for i in range(n)]
    node = helper.make_node(op, ins, outs, domain=TRAINING_DOMAIN, **attrs)
    vi = [helper.make_tensor_value_info("R", dtype, []), helper.make_tensor_value_info("T", TensorProto.INT64, [])]
    vi += [helper.make_tensor_value_info(x, dtype, [2, 3]) for x in ins[2:]]
    g = helper.make_graph([node], op, vi, [helper.make_tensor_value_info(o, dtype, [2, 3]) for o in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(TRAINING_DOMAIN, 1)])
    m.ir_version = 7
    return m


OPTIMIZER_CASES = [
    ("Adagrad", ["H"], {}),                                         # defaults
    ("Adagrad", ["H"], {"decay_factor": 0.3, "epsilon": 1e-3, "norm_coefficient": 0.1}),
    ("Adam", ["V", "H"], {}),
    ("Adam", ["V", "H"], {"alpha": 0.8, "beta": 0.7, "epsilon": 1e-2, "norm_coefficient": 0.05,
                          "norm_coefficient_post": 0.1}),
    ("Momentum", ["V"], {"alpha": 0.9, "beta": 0.5, "mode": "standard", "norm_coefficient": 0.0}),
    ("Momentum", ["V"], {"alpha": 0.7, "beta": 0.3, "mode": "nesterov", "norm_coefficient": 0.2}),
]


@pytest.mark.parametrize("op, state, attrs", OPTIMIZER_CASES, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("dtype", [F, TensorProto.DOUBLE], ids=["float", "double"])
def test_optimizer_matches_reference_implementation(op, state, attrs, t, dtype):
    # onnx.reference returns float32 from a multi-tensor Adam even for double inputs: one tensor in double
    m = optimizer_model(op, 2 if dtype == F else 1, state, attrs, dtype)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(t)
    feeds = {"R": np.array(0.1, np_type), "T": np.array(t, np.int64)}
    for vi in m.graph.input[2:]:
        value = rng.standard_normal((2, 3))
        feeds[vi.name] = (np.abs(value) if vi.name.startswith("H") else value).astype(np_type)
    expected = ReferenceEvaluator(m).run(None, feeds)
    lowered = lower(m)
    assert_lowered(lowered)
    got = session(lowered).run(None, feeds)
    for g, e in zip(got, expected):
        assert g.dtype == np_type
        np.testing.assert_allclose(g, e, rtol=1e-5 if dtype == F else 1e-12, atol=1e-7)


# -- Gradient beyond the backend cases -------------------------------------------------------------------------
def make(nodes, inputs, outputs, opset=17, inits=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, F, s) for n, s in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAINING_DOMAIN, 1)])
    m.ir_version = 8
    return m


def gradient(inputs, outputs, xs, y, zs=(), name="grad"):
    attrs = {"xs": list(xs), "y": y}
    if zs:
        attrs["zs"] = list(zs)
    return helper.make_node("Gradient", list(inputs), list(outputs), domain=TRAINING_DOMAIN, name=name, **attrs)


X = np.array([[0.5, -1.0, 2.0], [1.5, 0.3, -0.7]], np.float32)
W = np.array([[0.2, -0.4], [1.1, 0.6], [-0.3, 0.9]], np.float32)


def test_gradient_of_a_matmul_tanh_network_with_zs_and_an_intermediate_x():
    # y = sum(tanh(X @ W)); d y/d W = X^T (1 - h^2); d y/d H = 1 - h^2 (H = X @ W, an intermediate)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["H"]), helper.make_node("Tanh", ["H"], ["T"]),
             helper.make_node("ReduceSum", ["T"], ["y"], keepdims=0),
             gradient(["W", "X"], ["dW"], xs=["W"], zs=["X"], y="y", name="g1"),
             gradient(["H"], ["dH"], xs=["H"], y="y", name="g2")]
    m = make(nodes, [("X", [2, 3]), ("W", [3, 2])], [("y", []), ("dW", [3, 2]), ("dH", [2, 2])])
    lowered = lower(m)
    assert_lowered(lowered)
    y, dw, dh = session(lowered).run(None, {"X": X, "W": W})
    t = np.tanh(X @ W)
    np.testing.assert_allclose(y, t.sum(), rtol=1e-6)
    np.testing.assert_allclose(dh, 1 - t * t, rtol=1e-5)
    np.testing.assert_allclose(dw, X.T @ (1 - t * t), rtol=1e-5)


def test_gradient_at_other_input_values_recomputes_the_subgraph():
    # the Gradient node is fed (A2, B2) for xs (A, B): d(A*B)/dA at A2 = B2 (seeded with ones)
    nodes = [helper.make_node("Mul", ["A", "B"], ["C"]),
             gradient(["A2", "B2"], ["dA", "dB"], xs=["A", "B"], y="C")]
    m = make(nodes, [("A", [3]), ("B", [3]), ("A2", [3]), ("B2", [3])], [("C", [3]), ("dA", [3]), ("dB", [3])])
    a, b, a2, b2 = (np.arange(3, dtype=np.float32) + k for k in range(4))
    c, da, db = session(lower(m)).run(None, {"A": a, "B": b, "A2": a2, "B2": b2})
    np.testing.assert_allclose(c, a * b)
    np.testing.assert_allclose(da, b2)
    np.testing.assert_allclose(db, a2)


def test_unused_x_gets_zeros_and_empty_outputs_are_skipped():
    nodes = [helper.make_node("Mul", ["A", "A"], ["C"]),
             gradient(["A", "B"], ["", "dB"], xs=["A", "B"], y="C")]
    m = make(nodes, [("A", [2]), ("B", [2])], [("C", [2]), ("dB", [2])])
    _, db = session(lower(m)).run(None, {"A": np.ones(2, np.float32), "B": np.ones(2, np.float32)})
    np.testing.assert_array_equal(db, np.zeros(2, np.float32))


def test_second_derivative_through_a_lowered_gradient():
    # y = A^3 summed: dy/dA = 3 A^2, and the gradient of sum(dy/dA) is 6 A
    nodes = [helper.make_node("Mul", ["A", "A"], ["A2"]), helper.make_node("Mul", ["A2", "A"], ["A3"]),
             helper.make_node("ReduceSum", ["A3"], ["y"], keepdims=0),
             gradient(["A"], ["dA"], xs=["A"], y="y", name="first"),
             helper.make_node("ReduceSum", ["dA"], ["s"], keepdims=0),
             gradient(["A"], ["ddA"], xs=["A"], y="s", name="second")]
    m = make(nodes, [("A", [3])], [("dA", [3]), ("ddA", [3])])
    a = np.array([0.5, -1.0, 2.0], np.float32)
    da, dda = session(lower(m)).run(None, {"A": a})
    np.testing.assert_allclose(da, 3 * a * a, rtol=1e-6)
    np.testing.assert_allclose(dda, 6 * a, rtol=1e-6)


def test_gradient_with_an_initializer_and_a_newer_opset_than_the_runtime_loads():
    # opset 28 (newer than onnxruntime 1.31's 26), IR 13+: lowered to versions the runtime loads
    w = numpy_helper.from_array(W, "W")
    nodes = [helper.make_node("MatMul", ["X", "W"], ["H"]), helper.make_node("ReduceSum", ["H"], ["y"], keepdims=0),
             gradient(["W"], ["dW"], xs=["W"], y="y")]
    m = make(nodes, [("X", [2, 3])], [("dW", [3, 2])], opset=onnx.defs.onnx_opset_version(), inits=[w])
    m.ir_version = onnx.IR_VERSION
    lowered = lower(m)
    assert_lowered(lowered)
    (dw,) = session(lowered).run(None, {"X": X})
    np.testing.assert_allclose(dw, X.T @ np.ones((2, 2), np.float32), rtol=1e-6)


def test_old_opset_is_upgraded():
    case = CASES["test_gradient_of_add_and_mul"]
    assert case.model.opset_import[0].version < MIN_OPSET
    assert lower(case.model).opset_import[0].version == MIN_OPSET


def test_errors():
    nodes = [helper.make_node("Mul", ["A", "A"], ["C"]), gradient(["A"], ["dA"], xs=["A"], y="C")]
    bad = make(nodes, [("A", [2])], [("dA", [2])])
    bad.graph.node[1].input.append("A")            # two inputs for one name in xs
    with pytest.raises(onnxgrad.InvalidModelError, match="inputs for"):
        lower(bad)
    nodes = [helper.make_node("Floor", ["A"], ["C"]), helper.make_node("Mul", ["C", "A"], ["D"]),
             helper.make_node("Einsum", ["D"], ["E"], equation="i->i"),
             helper.make_node("Sum", ["E"], ["F"]),
             gradient(["A"], ["dA"], xs=["A"], y="F")]
    # every op here has a rule or stops gradients, so this one lowers fine
    assert_lowered(lower(make(nodes, [("A", [2])], [("dA", [2])])))
    with pytest.raises(onnxgrad.InvalidModelError, match="cannot read"):
        lower("/nonexistent/model.onnx")


def test_cli_lower(tmp_path, capsys):
    path = tmp_path / "adam.onnx"
    onnx.save(CASES["test_adam"].model, path)
    assert cli_main(["lower", str(path)]) == 0
    lowered = onnx.load(tmp_path / "adam.lowered.onnx")
    assert_lowered(lowered)
    assert "wrote" in capsys.readouterr().out


def test_gradient_through_an_op_whose_rule_exposes_forward_outputs():
    # the LayerNormalization rule reads the saved mean and inverse std: the forward node gains outputs
    nodes = [helper.make_node("LayerNormalization", ["X", "S", "B"], ["Y"], axis=-1, name="ln"),
             helper.make_node("Mul", ["Y", "Y"], ["Y2"]), helper.make_node("ReduceSum", ["Y2"], ["y"], keepdims=0),
             gradient(["X", "S"], ["dX", "dS"], xs=["X", "S"], y="y")]
    m = make(nodes, [("X", [2, 4]), ("S", [4]), ("B", [4])], [("y", []), ("dX", [2, 4]), ("dS", [4])])
    lowered = lower(m)
    assert_lowered(lowered)
    rng = np.random.default_rng(0)
    x, s, b = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, 4), (4,), (4,)))
    _, dx, ds = session(lowered).run(None, {"X": x, "S": s, "B": b})
    x64 = x.astype(np.float64)
    xhat = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    dy = 2 * (xhat * s + b)                                   # d sum(Y^2) / dY
    np.testing.assert_allclose(ds, (dy * xhat).sum(0), rtol=1e-4, atol=1e-5)
    g = dy * s
    expected_dx = (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) / np.sqrt(
        x64.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-4, atol=1e-5)
