"""Old models: IR 3, opset 7 or 8, every initializer also listed as a graph input (the onnx model zoo's
older models). They are upgraded to opset 13 on load and must check, differentiate and train as a model
written today does."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad import losses, optim
from onnxgrad.tools.check import check, random_inputs
from onnxgrad.tools.cli import main as cli_main

F = TensorProto.FLOAT
BATCH = 2


def _weights(rng: np.random.Generator) -> list[onnx.TensorProto]:
    values = {
        "fc1_w": rng.standard_normal((6, 5)) * 0.4,
        "fc1_b": rng.standard_normal(5) * 0.1,
        "bn_scale": 1.0 + 0.2 * rng.standard_normal(5),
        "bn_bias": 0.1 * rng.standard_normal(5),
        "bn_mean": 0.1 * rng.standard_normal(5),
        "bn_var": 1.0 + 0.2 * rng.random(5),
        "fc2_w": rng.standard_normal((5, 4)) * 0.3,
        "fc2_b": rng.standard_normal(4) * 0.1,
    }
    return [numpy_helper.from_array(v.astype(np.float32), k) for k, v in values.items()]


def zoo_style_model(opset: int, old: bool = True) -> onnx.ModelProto:
    """Gemm -> BatchNormalization -> Relu -> Gemm on x [2, 6] (ops onnxruntime runs in float64, so the check's
    float64 truth runs there too). ``old``: IR 3 with the initializers listed as graph inputs at ``opset``;
    else the same model as written today (IR 8)."""
    weights = _weights(np.random.default_rng(0))
    nodes = [
        helper.make_node("Gemm", ["x", "fc1_w", "fc1_b"], ["fc1"], name="fc1"),
        helper.make_node("BatchNormalization", ["fc1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["bn"],
                         name="bn", epsilon=1e-5),
        helper.make_node("Relu", ["bn"], ["relu"], name="relu"),
        helper.make_node("Gemm", ["relu", "fc2_w", "fc2_b"], ["logits"], name="fc2"),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [BATCH, 6])]
    if old:
        inputs += [helper.make_tensor_value_info(w.name, F, list(w.dims)) for w in weights]
    graph = helper.make_graph(nodes, "zoo", inputs, [helper.make_tensor_value_info("logits", F, [BATCH, 4])],
                              weights)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 3 if old else 8
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("opset", [7, 8])
def test_cli_check_passes_on_an_ir3_model(opset, tmp_path, capsys):
    path, out = tmp_path / "old.onnx", tmp_path / "old_grad.onnx"
    onnx.save(zoo_style_model(opset), path)
    assert cli_main([str(path), "--check", "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert "numeric check" in printed.out and "error" not in printed.err
    gm = onnx.load(out)
    onnx.checker.check_model(gm, full_check=True)
    assert {o.name for o in gm.graph.output} >= {"fc1_w_grad", "bn_scale_grad", "fc2_b_grad"}


def test_gradients_of_an_ir3_model_match_central_differences():
    m = zoo_style_model(8)
    gm = onnxgrad.grad(m, wrt=["x", "fc1_w", "bn_scale", "bn_mean", "fc2_b"])
    onnx.checker.check_model(gm, full_check=True)
    r = check(m, gm, random_inputs(m, 1), max_elements=16)
    assert r.grad_backend == r.backend == "onnxruntime"
    assert r.ok(1e-4), r.errors


@pytest.mark.parametrize("train_mode", [True, False], ids=["train_mode", "frozen_bn"])
def test_ir3_model_trains_as_the_same_model_written_today(train_mode):
    """Two TrainingSession steps on the old model (upgraded to opset 13, where BatchNormalization says training
    mode by its five outputs) and on the model written today at opset 17 (its training_mode attribute): the
    same losses, parameters and running statistics, in train mode and with frozen BatchNorm."""
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((BATCH, 6)).astype(np.float32),
             "target": rng.standard_normal((BATCH, 4)).astype(np.float32)}
    runs = []
    for model in (zoo_style_model(8), zoo_style_model(17, old=False)):
        s = onnxgrad.TrainingSession(model, loss=losses.MSELoss(output="logits"), optimizer=optim.SGD(lr=0.1),
                                     train_mode=train_mode, providers=["CPUExecutionProvider"])
        losses_seen = [float(s.step(feeds)) for _ in range(2)]
        runs.append((losses_seen, {**s.parameters(), **s.buffers()}))
    (old_losses, old_params), (new_losses, new_params) = runs
    assert old_losses[1] < old_losses[0]
    np.testing.assert_allclose(old_losses, new_losses, rtol=1e-5)
    assert sorted(old_params) == sorted(new_params)
    for name, value in new_params.items():
        np.testing.assert_allclose(old_params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
