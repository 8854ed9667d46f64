"""Recomputation (onnxgrad.passes.recompute): the recomputing gradient and training models give the plain ones'
outputs in onnxruntime, the recomputed forward tensors have no backward reader left, the clones read only
tensors the backward keeps anyway, and nothing random or expensive is cloned.

The plain models are the reference: their gradients are the ones the rule tables prove against central
differences; each recomputing model is compared with its plain twin on the same feeds (float32).
"""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from harness import make_model
from onnxgrad import TrainingSession, losses, optim
from onnxgrad.ir.model import subgraph_inputs
from onnxgrad.passes.recompute import ELEMENTWISE, MAX_CLONES, ORT_DISABLED_OPTIMIZERS, recompute_activations
from onnxgrad.passes.record import backward_nodes
from onnxgrad.training import artifacts

F = TensorProto.FLOAT
N = helper.make_node


def _init(rng, name: str, shape, scale: float = 0.3) -> onnx.TensorProto:
    return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32), name)


# -- models ---------------------------------------------------------------------------------------
def conv_bn_relu_model() -> onnx.ModelProto:
    """Two Conv -> BatchNormalization -> ReLU layers, a residual Add and ReLU, pooled into a Linear: the
    ReLU outputs (the next conv's input) are recomputable from the conv outputs and batch statistics."""
    rng = np.random.default_rng(0)
    inits, nodes, h = [], [], "x"
    for i in (1, 2, 3):
        cin = 3 if i == 1 else 6
        inits += [_init(rng, f"conv{i}.weight", (6, cin, 3, 3)),
                  numpy_helper.from_array(1 + 0.1 * rng.standard_normal(6).astype(np.float32), f"bn{i}.weight"),
                  _init(rng, f"bn{i}.bias", (6,), 0.1),
                  numpy_helper.from_array(np.zeros(6, np.float32), f"bn{i}.running_mean"),
                  numpy_helper.from_array(np.ones(6, np.float32), f"bn{i}.running_var")]
        nodes += [N("Conv", [h, f"conv{i}.weight"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  N("BatchNormalization", [f"c{i}", f"bn{i}.weight", f"bn{i}.bias", f"bn{i}.running_mean",
                                           f"bn{i}.running_var"], [f"b{i}"], momentum=0.9, name=f"bn{i}")]
        if i < 3:
            nodes.append(N("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}"))
            h = f"r{i}"
    inits += [_init(rng, "fc.weight", (4, 6)), _init(rng, "fc.bias", (4,), 0.1)]
    nodes += [N("Add", ["b3", "r1"], ["sum"], name="residual"), N("Relu", ["sum"], ["out"], name="relu_out"),
              N("GlobalAveragePool", ["out"], ["gap"], name="gap"), N("Flatten", ["gap"], ["flat"], name="flatten"),
              N("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc")]
    return make_model(nodes, [helper.make_tensor_value_info("x", F, [4, 3, 8, 8])],
                      [helper.make_tensor_value_info("logits", F, [4, 4])], inits)


def mlp_model(activation: str = "Gelu", dropout: bool = False) -> onnx.ModelProto:
    """Linear -> activation (-> Dropout) -> Linear -> mean squared loss."""
    rng = np.random.default_rng(1)
    inits = [_init(rng, "fc1.weight", (5, 16)), _init(rng, "fc1.bias", (16,), 0.1),
             _init(rng, "fc2.weight", (16, 3)), _init(rng, "fc2.bias", (3,), 0.1)]
    nodes = [N("MatMul", ["x", "fc1.weight"], ["z_mm"], name="fc1"),
             N("Add", ["z_mm", "fc1.bias"], ["z"], name="fc1.add"), N(activation, ["z"], ["a"], name="act")]
    h = "a"
    if dropout:
        inits.append(numpy_helper.from_array(np.array(0.25, np.float32), "ratio"))
        inits.append(numpy_helper.from_array(np.array(True), "training"))
        nodes.append(N("Dropout", ["a", "ratio", "training"], ["d"], name="dropout", seed=3))
        h = "d"
    nodes += [N("MatMul", [h, "fc2.weight"], ["y_mm"], name="fc2"),
              N("Add", ["y_mm", "fc2.bias"], ["y"], name="fc2.add"),
              N("Sub", ["y", "target"], ["err"], name="err"), N("Mul", ["err", "err"], ["sq"], name="sq"),
              N("ReduceMean", ["sq"], ["loss"], keepdims=0, name="mean")]
    return make_model(nodes, [helper.make_tensor_value_info("x", F, [8, 5]),
                              helper.make_tensor_value_info("target", F, [8, 3])],
                      [helper.make_tensor_value_info("loss", F, [])], inits, opset=20)


def layer_norm_gelu_model() -> onnx.ModelProto:
    """LayerNormalization -> Linear -> GELU written out with Erf (as exporters do) -> Linear, residual."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(1 + 0.1 * rng.standard_normal(8).astype(np.float32), "ln.weight"),
             _init(rng, "ln.bias", (8,), 0.1), _init(rng, "fc1.weight", (8, 16)), _init(rng, "fc1.bias", (16,), 0.1),
             _init(rng, "fc2.weight", (16, 8)), _init(rng, "fc2.bias", (8,), 0.1)]
    nodes = [N("Constant", [], [k], value=numpy_helper.from_array(np.array(v, np.float32)), name=k)
             for k, v in (("half", 0.5), ("one", 1.0), ("inv_sqrt2", 1 / np.sqrt(2)))]
    nodes += [N("LayerNormalization", ["x", "ln.weight", "ln.bias"], ["ln"], axis=-1, epsilon=1e-5, name="ln"),
             N("MatMul", ["ln", "fc1.weight"], ["h_mm"], name="fc1"),
             N("Add", ["h_mm", "fc1.bias"], ["h"], name="fc1.add"),
             N("Mul", ["h", "inv_sqrt2"], ["h_s"], name="gelu/scale"), N("Erf", ["h_s"], ["h_erf"], name="gelu/erf"),
             N("Add", ["h_erf", "one"], ["h_1p"], name="gelu/add"), N("Mul", ["h", "h_1p"], ["h_x"], name="gelu/mul"),
             N("Mul", ["h_x", "half"], ["gelu"], name="gelu/half"),
             N("MatMul", ["gelu", "fc2.weight"], ["o_mm"], name="fc2"),
             N("Add", ["o_mm", "fc2.bias"], ["o"], name="fc2.add"),
             N("Add", ["x", "o"], ["y"], name="residual"), N("Mul", ["y", "y"], ["sq"], name="sq"),
             N("ReduceMean", ["sq"], ["loss"], keepdims=0, name="mean")]
    return make_model(nodes, [helper.make_tensor_value_info("x", F, [2, 6, 8])],
                      [helper.make_tensor_value_info("loss", F, [])], inits)


def _feeds(model: onnx.ModelProto, seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        out[i.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of ``model`` in onnxruntime, run as a recomputing model must be run."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(ORT_DISABLED_OPTIMIZERS))
    names = [o.name for o in model.graph.output]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def _differences(plain: onnx.ModelProto, recomputing: onnx.ModelProto, feeds: dict) -> dict[str, float]:
    """Each output's largest difference between the two models, relative to the plain output's largest value."""
    want, got = _run(plain, feeds), _run(recomputing, feeds)
    assert want.keys() == got.keys()
    return {k: float(np.abs(got[k].astype(np.float64) - v).max()) / max(float(np.abs(v).max()), 1e-6)
            for k, v in want.items()}


def recomputed(model: onnx.ModelProto) -> list[str]:
    return json.loads({p.key: p.value for p in model.metadata_props}["onnxgrad.recomputed"])


def _train_mode_gradient(recompute: bool) -> tuple[onnx.ModelProto, dict]:
    """The conv-BN-ReLU model's training graph (BatchNormalization in train mode, AdamW), and its feeds."""
    model = conv_bn_relu_model()
    loss = losses.CrossEntropyLoss(output="logits", target="label")
    art = artifacts.build(model, loss, optim.AdamW(lr=1e-2), recompute=recompute)
    feeds = {**_feeds(model), "label": np.array([0, 3, 1, 2]), **art.initial_values()}
    return art.train, feeds


def _gradient(build, recompute: bool) -> onnx.ModelProto:
    return onnxgrad.grad(build(), loss="loss", recompute=recompute)


GRADIENT_MODELS = {
    "mlp_gelu": (lambda: mlp_model("Gelu"), ["a"]),
    "layer_norm_erf_gelu": (layer_norm_gelu_model, ["ln", "h_s", "h_1p", "gelu"]),
}


# -- the values -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GRADIENT_MODELS))
def test_recomputing_gradient_model_gives_the_plain_outputs(name):
    build, expected = GRADIENT_MODELS[name]
    plain, rm = _gradient(build, False), _gradient(build, True)
    assert recomputed(rm) == expected
    onnx.checker.check_model(rm, full_check=True)
    assert max(_differences(plain, rm, _feeds(build())).values()) < 1e-6


def test_train_mode_conv_bn_relu_training_graph_gives_the_plain_outputs():
    plain, feeds = _train_mode_gradient(False)
    rm, _ = _train_mode_gradient(True)
    assert artifacts.TrainingSpec.of(rm).recompute and not artifacts.TrainingSpec.of(plain).recompute
    assert len(rm.graph.node) > len(plain.graph.node)
    differences = _differences(plain, rm, feeds)       # the loss, every updated parameter, AdamW state, BN buffers
    assert len(differences) > 20
    assert max(differences.values()) < 1e-6


def test_the_comparison_catches_a_wrong_clone():
    """The check above is not vacuous: a recomputing model whose GELU clone computes a ReLU instead
    (they differ only near and below zero) fails it."""
    build = GRADIENT_MODELS["mlp_gelu"][0]
    plain, rm = _gradient(build, False), _gradient(build, True)
    wrong = onnx.ModelProto()
    wrong.CopyFrom(rm)
    clone = next(n for n in wrong.graph.node if n.name == "act/recompute/Gelu")
    clone.op_type = "Relu"
    assert max(_differences(plain, rm, _feeds(build())).values()) < 1e-6
    assert max(_differences(plain, wrong, _feeds(build())).values()) > 1e-3


# -- the structure --------------------------------------------------------------------------------
def _clones(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in backward_nodes(model) if "/recompute/" in n.name]


@pytest.fixture(scope="module")
def train_mode_gradient():
    from onnxgrad.training.train_mode import to_train_mode

    loss = losses.CrossEntropyLoss(output="logits", target="label")
    model = to_train_mode(loss(conv_bn_relu_model())).model
    return onnxgrad.grad(model, loss="loss", recompute=True)


@pytest.mark.parametrize("name", ["train_mode", "layer_norm_erf_gelu"])
def test_recomputed_tensors_are_read_by_no_backward_node_and_clones_read_kept_tensors(name, train_mode_gradient):
    gm = train_mode_gradient if name == "train_mode" else _gradient(GRADIENT_MODELS[name][0], True)
    targets = set(recomputed(gm))
    if name == "train_mode":       # the ReLU outputs: the next conv's input and the residual's
        assert targets == {"r1", "r2", "out"}
    backward = backward_nodes(gm)
    clone_outputs = {o for n in _clones(gm) for o in n.output}
    others = [n for n in backward if "/recompute/" not in n.name]
    read_by_backward = {x for n in others for x in set(n.input) | subgraph_inputs(n)}
    assert not targets & read_by_backward
    assert clone_outputs & read_by_backward            # the backward reads the clones instead
    g = gm.graph
    free = {i.name for i in g.initializer} | {i.name for i in g.input} | {
        n.output[0] for n in g.node if n.op_type == "Constant"}
    for clone in _clones(gm):          # nothing new is kept: a clone reads a clone, a constant or a kept tensor
        for x in clone.input:
            assert x in clone_outputs or x in free or x in read_by_backward, (clone.name, x)


def test_clones_are_cheap_deterministic_ops_named_after_their_forward_node(train_mode_gradient):
    nodes = train_mode_gradient.graph.node
    forward = {n.name: n for n in nodes[:len(nodes) - len(backward_nodes(train_mode_gradient))]}
    clones = _clones(train_mode_gradient)
    assert {n.op_type for n in clones} == {"BatchNormalization", "Relu", "Add"}
    for clone in clones:
        assert clone.op_type in ELEMENTWISE | {"BatchNormalization"}
        owner = clone.name.split("/recompute/")[0]
        assert owner in forward and forward[owner].op_type == clone.op_type
        if clone.op_type == "BatchNormalization":       # the normalisation from the batch statistics
            assert len(clone.output) == 1 and not any(a.name == "training_mode" and a.i for a in clone.attribute)
            assert list(clone.input[3:5]) == list(forward[owner].output[1:3])


def test_random_and_expensive_producers_are_not_cloned():
    """The Linear's input after a GELU is recomputed from the GELU's input; after a Dropout it would need the
    dropout's random draw again, after a ReLU the Linear's matrix product before it: both stay kept."""
    assert recomputed(_gradient(lambda: mlp_model("Gelu"), True)) == ["a"]
    with_dropout = _gradient(lambda: mlp_model("Gelu", dropout=True), True)
    assert recomputed(with_dropout) == [] and not _clones(with_dropout)
    plain, rm = _gradient(lambda: mlp_model("Relu"), False), _gradient(lambda: mlp_model("Relu"), True)
    assert recomputed(rm) == [] and len(rm.graph.node) == len(plain.graph.node)
    assert "onnxgrad.recomputed" not in {p.key for p in plain.metadata_props}


def residual_stack_model(blocks: int = 7) -> onnx.ModelProto:
    """Identity residual blocks out_k = Relu(BN(Conv(out_k-1)) + out_k-1), inference-mode batch norm: each
    block output is computed from the one before, so recomputing one through the others would chain."""
    rng = np.random.default_rng(3)
    inits, nodes, h = [], [], "x"
    for k in range(blocks):
        inits += [_init(rng, f"conv{k}.weight", (4, 4, 3, 3)), _init(rng, f"bn{k}.weight", (4,)),
                  _init(rng, f"bn{k}.bias", (4,)), _init(rng, f"bn{k}.mean", (4,)),
                  numpy_helper.from_array(np.ones(4, np.float32), f"bn{k}.var")]
        nodes += [N("Conv", [h, f"conv{k}.weight"], [f"c{k}"], pads=[1, 1, 1, 1], name=f"conv{k}"),
                  N("BatchNormalization", [f"c{k}", f"bn{k}.weight", f"bn{k}.bias", f"bn{k}.mean", f"bn{k}.var"],
                    [f"b{k}"], name=f"bn{k}"),
                  N("Add", [f"b{k}", h], [f"s{k}"], name=f"add{k}"), N("Relu", [f"s{k}"], [f"out{k}"], name=f"relu{k}")]
        h = f"out{k}"
    nodes += [N("Mul", [h, h], ["sq"], name="sq"), N("ReduceMean", ["sq"], ["loss"], keepdims=0, name="mean")]
    return make_model(nodes, [helper.make_tensor_value_info("x", F, [2, 4, 5, 5])],
                      [helper.make_tensor_value_info("loss", F, [])], inits)


def test_chains_of_recomputation_stay_short():
    """A block output recomputed through recomputed ones before it clones their nodes too, up to MAX_CLONES
    nodes: some block outputs stay kept and break the chains, the others are recomputed, values unchanged."""
    plain, rm = _gradient(residual_stack_model, False), _gradient(residual_stack_model, True)
    outputs = {f"out{k}" for k in range(6)}            # the last one is only read by the loss's backward
    targets = set(recomputed(rm))
    assert targets & outputs and outputs - targets
    assert len(_clones(rm)) <= MAX_CLONES * len(targets)
    assert max(_differences(plain, rm, _feeds(residual_stack_model())).values()) < 1e-6


def _hand_written_gradient_model(activation: str, big_read_last: bool) -> onnx.ModelProto:
    """A gradient model written out: forward ``big = MatMul(x, w)``, ``t = <activation>(big)``; a backward
    of two nodes, one reading ``t``, one reading ``big``, in either order."""
    cast = {"to": TensorProto.FLOAT16} if activation == "Cast" else {}
    t_type = TensorProto.FLOAT16 if activation == "Cast" else F
    backward = [N("Neg", ["t"], ["t_grad"], name="t/grad/Neg"), N("Neg", ["big"], ["big_grad"], name="big/grad/Neg")]
    nodes = [N("MatMul", ["x", "w"], ["big"], name="mm"), N(activation, ["big"], ["t"], name="act", **cast)]
    nodes += backward if big_read_last else backward[::-1]
    model = make_model(nodes, [helper.make_tensor_value_info("x", F, [8, 8])],
                       [helper.make_tensor_value_info("t_grad", t_type, [8, 8]),
                        helper.make_tensor_value_info("big_grad", F, [8, 8])],
                       [numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")])
    model.graph.value_info.extend([helper.make_tensor_value_info("big", F, [8, 8]),
                                   helper.make_tensor_value_info("t", t_type, [8, 8])])
    model.metadata_props.add(key="onnxgrad.forward_nodes", value="2")
    return model


@pytest.mark.parametrize("activation, big_read_last, recomputes", [
    ("Sigmoid", True, True),      # big is held past t's reader anyway
    ("Sigmoid", False, True),     # big held a little longer, in t's place: no larger than t
    ("Cast", True, True),
    ("Cast", False, False),       # big (float32) held longer in place of t (float16): more memory, refused
])
def test_recomputes_only_from_tensors_held_anyway(activation, big_read_last, recomputes):
    rm = recompute_activations(_hand_written_gradient_model(activation, big_read_last))
    assert recomputed(rm) == (["t"] if recomputes else [])
    readers_of_t = [n.name for n in rm.graph.node if "t" in n.input]
    assert readers_of_t == ([] if recomputes else ["t/grad/Neg"])


# -- training -------------------------------------------------------------------------------------
def _session(recompute: bool) -> TrainingSession:
    return TrainingSession(conv_bn_relu_model(), loss=losses.CrossEntropyLoss(output="logits", target="label"),
                           optimizer=optim.AdamW(lr=1e-2), providers=["CPUExecutionProvider"], recompute=recompute)


def _batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(10 + step)
    return {"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32), "label": rng.integers(0, 4, 4)}


def test_training_session_with_recompute_trains_as_without(tmp_path):
    """Within 1e-6 over a few AdamW steps in train mode: the recomputed batch norm rounds its last bit
    differently from the training-mode kernel (1 / sqrt(var + eps) against sqrt(1 / (var + eps))). A model
    with a bias before a train-mode batch norm would drift further: that bias's gradient is zero but for
    rounding, and Adam scales any rounding noise to steps of the learning rate."""
    plain, rc = _session(False), _session(True)
    assert rc.spec.recompute and not plain.spec.recompute
    for step in range(4):
        np.testing.assert_allclose(rc.step(_batch(step)), plain.step(_batch(step)), rtol=0, atol=1e-6)
    for kind in ("parameters", "buffers"):
        want, got = getattr(plain, kind)(), getattr(rc, kind)()
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6, err_msg=name)
    rc.save(tmp_path / "ckpt")
    resumed = TrainingSession.load(tmp_path / "ckpt", providers=["CPUExecutionProvider"])
    assert resumed.spec.recompute
    assert resumed.step(_batch(4)) == rc.step(_batch(4))


def test_onnxruntime_runs_every_clone(tmp_path):
    """onnxruntime's common-subexpression elimination would merge a clone with its twin (the forward node,
    or the same tensor's clone elsewhere): the session turns it off, so every clone is in the graph it runs."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    s = TrainingSession(conv_bn_relu_model(), loss=losses.CrossEntropyLoss(output="logits", target="label"),
                        optimizer=optim.AdamW(lr=1e-2), providers=["CPUExecutionProvider"], recompute=True,
                        session_options=options)
    clones = {n.name for n in s.artifacts.train.graph.node if "/recompute/" in n.name}
    assert len(clones) >= 6
    ran = {n.name for n in onnx.load(options.optimized_model_filepath).graph.node}
    assert clones <= ran


def test_a_max_pool_input_the_cpu_backward_compares_is_not_recomputed():
    """onnxruntime's CPU rewrite of a 2x2 MaxPool's backward (max_pool_taps) finds each window's maximum
    again as x == y: a recomputed x (its batch norm rounding differently from the training kernel) would miss
    windows and lose their gradient. The pooled ReLU output is kept, and training matches the plain session
    (the recomputing one drifted by 5e-3 in three SGD steps before)."""
    rng = np.random.default_rng(3)
    inits = [_init(rng, "conv.weight", (6, 3, 3, 3)),
             numpy_helper.from_array(1 + 0.1 * rng.standard_normal(6).astype(np.float32), "bn.weight"),
             _init(rng, "bn.bias", (6,), 0.1), numpy_helper.from_array(np.zeros(6, np.float32), "bn.running_mean"),
             numpy_helper.from_array(np.ones(6, np.float32), "bn.running_var"), _init(rng, "fc.weight", (4, 6 * 16))]
    nodes = [N("Conv", ["x", "conv.weight"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             N("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"], ["b"],
               momentum=0.9, name="bn"),
             N("Relu", ["b"], ["r"], name="relu"),
             N("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             N("Flatten", ["p"], ["flat"], name="flatten"),
             N("Gemm", ["flat", "fc.weight"], ["logits"], transB=1, name="fc")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", F, [4, 3, 8, 8])],
                       [helper.make_tensor_value_info("logits", F, [4, 4])], inits)

    def session(recompute: bool) -> TrainingSession:
        return TrainingSession(model, loss=losses.CrossEntropyLoss(output="logits", target="label"),
                               optimizer=optim.SGD(lr=0.1, momentum=0.9), providers=["CPUExecutionProvider"],
                               recompute=recompute)

    plain, rc = session(False), session(True)
    assert any("max_pool_taps/" in n.name for n in rc.artifacts.train.graph.node)
    gm = onnxgrad.grad(losses.CrossEntropyLoss(output="logits", target="label")(model), loss="loss",
                       target="cpu", recompute=True)
    assert "r" not in recomputed(gm)
    for step in range(3):
        np.testing.assert_allclose(rc.step(_batch(step)), plain.step(_batch(step)), rtol=0, atol=1e-6)
    for name, value in plain.parameters().items():
        np.testing.assert_allclose(rc.parameters()[name], value, rtol=0, atol=1e-6, err_msg=name)
