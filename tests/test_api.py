"""The public contract of onnxgrad.grad: names, defaults, errors, metadata, opsets."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from harness import make_model
from onnxgrad.tools.check import check, gradient_spec

F = TensorProto.FLOAT


def init(name, *shape, seed=0):
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def mlp(loss=True):
    """x[4,3] -> tanh(x W1 + b1) W2 -> (sum of squares as loss)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="add1"),
        helper.make_node("Tanh", ["h1"], ["h"], name="act"),
        helper.make_node("MatMul", ["h", "W2"], ["y"], name="mm2"),
    ]
    outputs = [helper.make_tensor_value_info("y", F, [4, 2])]
    if loss:
        nodes += [helper.make_node("Mul", ["y", "y"], ["sq"], name="sq"),
                  helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0, name="sum")]
        outputs = [helper.make_tensor_value_info("loss", F, [])]
    return make_model(nodes, [helper.make_tensor_value_info("x", F, [4, 3])], outputs,
                [init("W1", 3, 5, seed=1), init("b1", 5, seed=2), init("W2", 5, 2, seed=3)])


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


X = np.random.default_rng(9).standard_normal((4, 3)).astype(np.float32)


def test_scalar_output_is_the_loss_and_wrt_defaults_to_float_initializers():
    gm = onnxgrad.grad(mlp())
    names = [o.name for o in gm.graph.output]
    assert names == ["loss", "W1_grad", "b1_grad", "W2_grad"]
    assert [i.name for i in gm.graph.input] == ["x"]          # no seed input for a loss
    onnx.checker.check_model(gm, full_check=True)
    out = run(gm, {"x": X})
    assert out["W1_grad"].shape == (3, 5) and out["b1_grad"].shape == (5,)
    assert check(mlp(), gm, {"x": X}).ok(1e-3)


def test_of_adds_a_seed_input_per_output_and_wrt_order_is_kept():
    m = mlp(loss=False)
    gm = onnxgrad.grad(m, wrt=["W2", "x"], of=["y"])
    assert [i.name for i in gm.graph.input] == ["x", "y_grad"]
    assert [o.name for o in gm.graph.output] == ["y", "W2_grad", "x_grad"]
    seed = gm.graph.input[1].type.tensor_type
    assert seed.elem_type == F and [d.dim_value for d in seed.shape.dim] == [4, 2]
    assert check(m, gm, {"x": X}).ok(1e-3)


def test_vector_output_without_of_seeds_every_float_output():
    gm = onnxgrad.grad(mlp(loss=False))
    assert "y_grad" in [i.name for i in gm.graph.input]


def test_generated_names_do_not_collide():
    m = mlp()
    # a tensor already called W1_grad (an intermediate) forces a suffix on the gradient output
    m.graph.node[0].output[0] = "W1_grad"
    m.graph.node[1].input[0] = "W1_grad"
    gm = onnxgrad.grad(m, wrt=["W1"])
    assert [o.name for o in gm.graph.output] == ["loss", "W1_grad_1"]
    assert gradient_spec(gm)["gradients"] == {"W1": "W1_grad_1"}
    onnx.checker.check_model(gm, full_check=True)


def test_gradient_of_an_intermediate_constant():
    m = mlp()
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32(0.5)), name="c")
    m.graph.node.insert(3, const)
    m.graph.node.insert(4, helper.make_node("Mul", ["h", "c"], ["hc"], name="scale"))
    m.graph.node[5].input[0] = "hc"
    gm = onnxgrad.grad(m, wrt=["c", "h"])
    assert [o.name for o in gm.graph.output][1:] == ["c_grad", "h_grad"]
    assert check(m, gm, {"x": X}).ok(1e-3)


def test_unused_wrt_is_an_error_unless_allowed():
    m = mlp()
    m.graph.initializer.append(init("unused", 2, 2))
    with pytest.raises(onnxgrad.UnusedError, match="unused"):
        onnxgrad.grad(m, wrt=["W1", "unused"])
    gm = onnxgrad.grad(m, wrt=["W1", "unused"], allow_unused=True)
    out = run(gm, {"x": X})
    np.testing.assert_array_equal(out["unused_grad"], np.zeros((2, 2), np.float32))


def test_unknown_and_non_float_names():
    with pytest.raises(onnxgrad.UnknownNameError, match="nope"):
        onnxgrad.grad(mlp(), wrt=["nope"])
    with pytest.raises(onnxgrad.UnknownNameError, match="not an output"):
        onnxgrad.grad(mlp(), loss="h")
    m = mlp()
    m.graph.initializer.append(numpy_helper.from_array(np.array([1, 2], np.int64), "ints"))
    with pytest.raises(onnxgrad.NonFloatError, match="ints"):
        onnxgrad.grad(m, wrt=["ints"])
    with pytest.raises(onnxgrad.UnknownNameError, match="not a scalar"):
        onnxgrad.grad(mlp(loss=False), loss="y")
    assert issubclass(onnxgrad.NonFloatError, onnxgrad.OnnxGradError)


def test_unsupported_ops_are_all_listed_at_once():
    nodes = [
        helper.make_node("MyOp", ["x"], ["a"], domain="custom", name="mine"),
        helper.make_node("TheirOp", ["a"], ["b"], domain="other", name="theirs"),
        helper.make_node("Relu", ["b"], ["y"], name="relu"),
    ]
    m = make_model(nodes, [helper.make_tensor_value_info("x", F, [3])], [helper.make_tensor_value_info("y", F, [3])])
    m.opset_import.extend([helper.make_opsetid("custom", 1), helper.make_opsetid("other", 1)])
    with pytest.raises(onnxgrad.UnsupportedOpError) as e:
        onnxgrad.grad(m, wrt=["x"])
    assert set(e.value.ops) == {"MyOp", "TheirOp"}
    assert "mine" in str(e.value) and "theirs" in str(e.value)
    # the same model differentiated after those nodes works
    gm = onnxgrad.grad(m, wrt=["b"])
    assert gm.graph.output[-1].name == "b_grad"


def test_integer_paths_stop_gradients():
    nodes = [
        helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT64, name="to_int"),
        helper.make_node("Cast", ["xi"], ["xf"], to=F, name="to_float"),
        helper.make_node("Add", ["xf", "x"], ["y"], name="add"),
    ]
    m = make_model(nodes, [helper.make_tensor_value_info("x", F, [3])], [helper.make_tensor_value_info("y", F, [3])])
    gm = onnxgrad.grad(m, wrt=["x"])
    out = run(gm, {"x": np.array([0.3, 1.7, -2.2], np.float32), "y_grad": np.ones(3, np.float32)})
    np.testing.assert_array_equal(out["x_grad"], np.ones(3, np.float32))   # only the Add path counts


def test_invalid_model():
    with pytest.raises(onnxgrad.InvalidModelError, match="no such file"):
        onnxgrad.grad("/nonexistent/model.onnx")
    bad = mlp()
    bad.graph.node[0].input[1] = "missing_tensor"
    with pytest.raises(onnxgrad.InvalidModelError, match="checker"):
        onnxgrad.grad(bad)


def test_metadata_names_and_ir_version():
    gm = onnxgrad.grad(mlp(), wrt=["W1"])
    meta = {p.key: p.value for p in gm.metadata_props}
    assert meta["onnxgrad.version"] == onnxgrad.__version__
    assert json.loads(meta["onnxgrad.wrt"]) == ["W1"] and json.loads(meta["onnxgrad.loss"]) == "loss"
    backward = gm.graph.node[len(mlp().graph.node):]
    forward_names = {n.name for n in mlp().graph.node}
    for node in backward:
        owner = node.name.split("/")[0]
        # named after its forward node, or the seed / the exposed gradient of a wrt tensor
        assert owner in forward_names | {"loss", "W1_grad"}, node.name
        assert node.doc_string, node.name
    assert gm.ir_version <= 13


def test_opset_18_and_new_ir_version_model_loads_in_onnxruntime():
    m = mlp()
    m.opset_import[0].version = 18
    m.ir_version = 14        # what onnx 1.23 writes by default; onnxruntime 1.31 reads <= 13
    gm = onnxgrad.grad(m)
    assert gm.ir_version <= 13
    run(gm, {"x": X})


def test_old_opset_is_upgraded(capsys):
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"], name="sq")]
    m = make_model(nodes, [helper.make_tensor_value_info("x", F, [3])], [helper.make_tensor_value_info("y", F, [3])],
             opset=11)
    m.ir_version = 6
    gm = onnxgrad.grad(m, wrt=["x"])
    assert "upgrading" in capsys.readouterr().err
    assert [o.version for o in gm.opset_import if o.domain == ""] == [13]
    out = run(gm, {"x": np.array([1, 2, 3], np.float32), "y_grad": np.ones(3, np.float32)})
    np.testing.assert_allclose(out["x_grad"], [2, 4, 6])


def test_unknown_shapes():
    m = mlp()
    for vi in list(m.graph.input) + list(m.graph.output):
        for k, d in enumerate(vi.type.tensor_type.shape.dim):
            d.dim_param = f"d{k}"
    gm = onnxgrad.grad(m)
    onnx.checker.check_model(gm, full_check=True)
    assert check(m, gm, {"x": X}).ok(1e-3)


def test_several_consumers_sum_once():
    nodes = [helper.make_node("Mul", ["x", "x"], ["a"], name="m1"),
             helper.make_node("Tanh", ["x"], ["b"], name="t"),
             helper.make_node("Add", ["a", "b"], ["c"], name="a1"),
             helper.make_node("Add", ["c", "x"], ["y"], name="a2")]
    m = make_model(nodes, [helper.make_tensor_value_info("x", F, [3])], [helper.make_tensor_value_info("y", F, [3])])
    gm = onnxgrad.grad(m, wrt=["x"])
    sums = [n for n in gm.graph.node if n.op_type == "Sum"]
    assert len(sums) == 1 and len(sums[0].input) == 4     # x*x twice, tanh, identity
    assert check(m, gm, {"x": np.array([0.1, -0.5, 0.9], np.float32)}).ok(1e-3)


def test_hessian_vector_product_of_a_tanh_mlp():
    """grad(grad(m)): seeding W1_grad with v gives H v; checked against differences of the gradient."""
    m = mlp()
    gm = onnxgrad.grad(m, wrt=["W1", "W2"])
    hvp = onnxgrad.grad(gm, wrt=["W1"], of=["W1_grad"])
    onnx.checker.check_model(hvp, full_check=True)
    # the names say what they are: W1_grad_seed is the vector v seeding W1_grad, W1_grad2 the second-order
    # gradient of W1 (H v); a third order would give W1_grad3
    spec = gradient_spec(hvp)
    assert spec["seeds"] == {"W1_grad": "W1_grad_seed"} and spec["gradients"] == {"W1": "W1_grad2"}
    third = onnxgrad.grad(hvp, wrt=["W1"], of=["W1_grad2"])
    assert gradient_spec(third)["gradients"] == {"W1": "W1_grad3"}
    assert gradient_spec(third)["seeds"] == {"W1_grad2": "W1_grad2_seed"}
    result = check(gm, hvp, {"x": X})
    assert result.ok(1e-3), result.errors
