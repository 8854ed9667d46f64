"""The webgpu target (onnxgrad.passes.optimize.webgpu, .schedule): each rewrite computes what the op it replaces
does (onnxruntime's CPU provider on both graphs), and training artifacts built for webgpu train as the canonical
ones do, with nothing left that the WebGPU providers run on the CPU or compute wrong. tests/test_browser.py runs
them in Chromium."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from artifacts_loop import train_steps
from onnx import TensorProto, helper, numpy_helper
from train_fixtures import lstm_classifier

from onnxgrad import losses, optim
from onnxgrad.ir import model as M
from onnxgrad.passes.optimize import REWRITES, apply_rewrites, webgpu
from onnxgrad.training.artifacts import build

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
OPSET = 18
F = TensorProto.FLOAT
I64 = TensorProto.INT64
rng = np.random.default_rng(0)

# what the WebGPU providers of onnxruntime-web 1.30 run on the CPU (in either bundle) or fail: none may remain
CPU_OR_FAILING = {"Sum", "Mean", "Max", "Min", "Sign", "IsNaN", "IsInf", "Or", "And", "Xor", "LogSoftmax",
                  "ConstantOfShape", "Size", "OneHot", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
                  "ScatterElements", "Identity", "Softplus", "Softsign", "Round", "Trilu", "Dropout"}


def one_node(op, inputs, outputs, attrs=None, consts=()):
    """A model of one node: ``inputs``/``outputs`` as (name, elem_type, shape); ``consts`` initializers."""
    node = helper.make_node(op, [i[0] for i in inputs] + [c.name for c in consts], [o[0] for o in outputs],
                            **(attrs or {}))
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs], list(consts))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def rewritten(model, name):
    out, report = apply_rewrites(onnx.shape_inference.infer_shapes(model), [REWRITES[name]], first=0)
    assert [n for n, _ in report.applied] == [name], report
    onnx.checker.check_model(out, full_check=True)
    return out


def floats(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def assert_same(model, name, feeds, gone):
    out = rewritten(model, name)
    assert not [n for n in out.graph.node if n.op_type == gone]
    for got, want in zip(run(out, feeds), run(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return out


# -- one rewrite at a time -------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,name", [("Sum", "sum_as_adds"), ("Mean", "mean_as_adds"), ("Max", "max_as_where"),
                                     ("Min", "min_as_where")])
def test_variadic_ops_as_binary_trees(op, name):
    shapes = [(2, 3), (3,), (2, 3), (1, 3), (2, 3)]        # broadcasting as the op does
    m = one_node(op, [(f"x{k}", F, s) for k, s in enumerate(shapes)], [("y", F, (2, 3))])
    feeds = {f"x{k}": floats(*s) for k, s in enumerate(shapes)}
    feeds["x2"][0, 0] = feeds["x0"][0, 0]                   # ties pick the same value
    assert_same(m, name, feeds, op)


@pytest.mark.parametrize("n", [8, 12, 50])
def test_wide_concat_as_a_tree_of_at_most_seven(n):
    m = one_node("Concat", [(f"x{k}", F, (2, k + 1)) for k in range(n)], [("y", F, (2, n * (n + 1) // 2))],
                 {"axis": 1})
    out = assert_same(m, "concat_tree", {f"x{k}": floats(2, k + 1) for k in range(n)}, "None")
    assert max(len(nd.input) for nd in out.graph.node if nd.op_type == "Concat") <= webgpu.MAX_BINDINGS - 1


@pytest.mark.parametrize("sizes", [[1] * 12, list(range(1, 10)), None])
def test_wide_split_as_a_tree_of_at_most_seven(sizes):
    n = len(sizes) if sizes else 12
    total = sum(sizes) if sizes else 36
    consts = [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")] if sizes else []
    attrs = {"axis": 1} if sizes else {"axis": 1, "num_outputs": n}
    m = one_node("Split", [("x", F, (2, total))], [(f"y{k}", F, None) for k in range(n)], attrs, consts)
    out = assert_same(m, "split_tree", {"x": floats(2, total)}, "None")
    assert max(len(nd.output) for nd in out.graph.node if nd.op_type == "Split") <= webgpu.MAX_BINDINGS - 1


@pytest.mark.parametrize("pads,extra", [([1, 1, 0, 0], None), ([2, 1, 1, 0], None), ([1, 0, 0, 0], [0, 1])])
def test_conv_transpose_asymmetric_pads_as_symmetric_and_output_padding(pads, extra):
    attrs = {"strides": [3, 3], "pads": pads, **({"output_padding": extra} if extra else {})}
    x, w = floats(2, 4, 5, 5), floats(4, 3, 3, 3)
    m = one_node("ConvTranspose", [("x", F, x.shape), ("w", F, w.shape)], [("y", F, None)], attrs)
    out = assert_same(m, "conv_transpose_symmetric_pads", {"x": x, "w": w}, "None")
    node = next(n for n in out.graph.node if n.op_type == "ConvTranspose")
    written = next(list(a.ints) for a in node.attribute if a.name == "pads")
    assert written[:2] == written[2:]


def test_conv_attributes_written_out():
    x, w = floats(1, 2, 6, 6), floats(3, 2, 3, 3)
    m = one_node("Conv", [("x", F, x.shape), ("w", F, w.shape)], [("y", F, None)], {"pads": [1, 1, 1, 1]})
    out = assert_same(m, "conv_explicit_attributes", {"x": x, "w": w}, "None")
    attrs = {a.name for a in out.graph.node[0].attribute}
    assert {"dilations", "strides", "pads"} <= attrs


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("reduction,ignore,weighted,spatial", [
    ("mean", None, False, False), ("mean", 2, False, False), ("sum", None, True, False), ("none", 1, True, False),
    ("mean", 0, True, True), ("mean", None, False, True)])
def test_loss_ops_as_reductions(op, reduction, ignore, weighted, spatial):
    shape = (4, 5, 3) if spatial else (4, 5)
    labels = rng.integers(0, 5, shape[:1] + shape[2:]).astype(np.int64)
    labels.reshape(-1)[0] = ignore if ignore is not None else labels.reshape(-1)[0]
    feeds = {"x": floats(*shape), "t": labels}
    inputs = [("x", F, shape), ("t", TensorProto.INT64, labels.shape)]
    if weighted:
        inputs.append(("w", F, (5,)))
        feeds["w"] = rng.uniform(0.5, 2, 5).astype(np.float32)
    attrs = {"reduction": reduction, **({"ignore_index": ignore} if ignore is not None else {})}
    outputs = [("loss", F, None)] + ([("logp", F, None)] if op == "SoftmaxCrossEntropyLoss" else [])
    name = "softmax_cross_entropy_as_ops" if op == "SoftmaxCrossEntropyLoss" else "nll_loss_as_ops"
    out = assert_same(one_node(op, inputs, outputs, attrs), name, feeds, op)
    assert not [n for n in out.graph.node if n.op_type in CPU_OR_FAILING]


@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements_at_constant_indices_as_scatter_nd(reduction):
    idx = numpy_helper.from_array(np.array([[0, 2, -1], [1, 1, 0]], np.int64), "idx")
    m = one_node("ScatterElements", [("x", F, (2, 4)), ("u", F, (2, 3))], [("y", F, (2, 4))],
                 {"axis": 1, "reduction": reduction}, [idx])
    # reordered so the indices come second, as the op takes them
    m.graph.node[0].input[:] = ["x", "idx", "u"]
    assert_same(m, "scatter_elements_as_nd", {"x": floats(2, 4), "u": floats(2, 3)}, "ScatterElements")


def test_scatter_elements_at_expanded_constant_indices_as_scatter_nd():
    # a gradient of a Gather at one index (BERT's first token): its indices a constant expanded over the updates
    nodes = [helper.make_node("Expand", ["idx", "shape"], ["idx_all"]),
             helper.make_node("ScatterElements", ["x", "idx_all", "u"], ["y"], axis=1)]
    g = helper.make_graph(nodes, "scatter", [helper.make_tensor_value_info("x", F, (2, 4, 3)),
                                             helper.make_tensor_value_info("u", F, (2, 1, 3))],
                          [helper.make_tensor_value_info("y", F, (2, 4, 3))],
                          [numpy_helper.from_array(np.zeros((1, 1, 1), np.int64), "idx"),
                           numpy_helper.from_array(np.array([2, 1, 3], np.int64), "shape")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    assert_same(m, "scatter_elements_as_nd", {"x": floats(2, 4, 3), "u": floats(2, 1, 3)}, "ScatterElements")


@pytest.mark.parametrize("reduction", ["none", "add"])
@pytest.mark.parametrize("index_type", [TensorProto.INT64, TensorProto.INT32])
def test_scatter_of_one_index_per_row_as_a_where_of_the_class_compare(reduction, index_type):
    # the loss gradients' scatter at each target's class, its indices the labels (known at run time)
    m = one_node("ScatterElements", [("x", F, (3, 5, 2)), ("idx", index_type, (3, 1, 2)), ("u", F, (3, 1, 2))],
                 [("y", F, (3, 5, 2))], {"axis": 1, "reduction": reduction})
    idx = np.array([[[4, 0]], [[2, 2]], [[0, 3]]], helper.tensor_dtype_to_np_dtype(index_type))
    out = assert_same(m, "one_per_row_scatter_as_where", {"x": floats(3, 5, 2), "idx": idx, "u": floats(3, 1, 2)},
                      "ScatterElements")
    assert {n.op_type for n in out.graph.node} <= {"Constant", "Equal", "Where", "Add"}


@pytest.mark.parametrize("rows, per_row, reason", [
    (3, 2, "more than one element per row"),
    # ScatterElements' indices may be smaller than the data off the axis: only row 0 of 3 is written, which a
    # Where of the class compare would broadcast over every row
    (1, 1, "part of the data's rows"),
], ids=["several-per-row", "part-of-the-rows"])
def test_a_scatter_a_where_cannot_stand_for_stays(rows, per_row, reason):
    m = one_node("ScatterElements", [("x", F, (3, 5)), ("idx", TensorProto.INT64, (rows, per_row)),
                                     ("u", F, (rows, per_row))], [("y", F, (3, 5))], {"axis": 1})
    _, report = apply_rewrites(onnx.shape_inference.infer_shapes(m), [REWRITES["one_per_row_scatter_as_where"]])
    assert not report.applied
    assert reason in str(report)


def test_static_shapes_fold_in_rounds_and_compute_the_same():
    # the second Shape reads a tensor whose shape is known only once the first is folded (a Reshape to it)
    nodes = [helper.make_node("Shape", ["x"], ["s1"], start=0, end=1),
             helper.make_node("Concat", ["s1", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("Shape", ["r"], ["s2"]),
             helper.make_node("Size", ["r"], ["n"]),
             helper.make_node("Reshape", ["r", "s2"], ["y"])]
    g = helper.make_graph(nodes, "shapes", [helper.make_tensor_value_info("x", F, (2, 3, 4))],
                          [helper.make_tensor_value_info("y", F, (2, 12)), helper.make_tensor_value_info("n", I64, ())],
                          [numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    before = onnx.ModelProto()
    before.CopyFrom(m)
    assert webgpu.static_shapes_folded(m) == 3
    assert not [n for n in m.graph.node if n.op_type in ("Shape", "Size", "Concat")]
    onnx.checker.check_model(m, full_check=True)
    x = floats(2, 3, 4)
    for got, want in zip(run(m, {"x": x}), run(before, {"x": x})):
        np.testing.assert_array_equal(got, want)


def test_a_shape_known_only_at_run_time_stays():
    m = one_node("Shape", [("x", F, ("B", 3))], [("s", I64, (2,))])
    assert webgpu.static_shapes_folded(m) == 0
    assert [n.op_type for n in m.graph.node] == ["Shape"]


@pytest.mark.parametrize("op,first", [("Equal", False), ("Less", True)])
def test_unsqueezed_comparison_compares_the_unsqueezed_operand(op, first):
    # an embedding's padding mask: Unsqueeze(Equal(ids, 0)) -> Equal(Unsqueeze(ids), 0), no boolean Unsqueeze
    pad = numpy_helper.from_array(np.array(1, np.int64), "pad")
    nodes = [helper.make_node(op, ["pad", "ids"] if first else ["ids", "pad"], ["hit"]),
             helper.make_node("Unsqueeze", ["hit", "axes"], ["y"])]
    g = helper.make_graph(nodes, "mask", [helper.make_tensor_value_info("ids", TensorProto.INT64, (2, 4))],
                          [helper.make_tensor_value_info("y", TensorProto.BOOL, (2, 4, 1))],
                          [pad, numpy_helper.from_array(np.array([-1], np.int64), "axes")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    out = assert_same(m, "compare_unsqueezed", {"ids": np.array([[0, 1, 2, 1], [1, 1, 0, 3]])}, "None")
    assert [n.op_type for n in out.graph.node if n.op_type != "Constant"] == ["Unsqueeze", op]


def test_finiteness_as_one_compare():
    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]), helper.make_node("IsInf", ["x"], ["inf"]),
             helper.make_node("Or", ["nan", "inf"], ["either"]), helper.make_node("Not", ["either"], ["finite"])]
    g = helper.make_graph(nodes, "finite", [helper.make_tensor_value_info("x", F, (6,))],
                          [helper.make_tensor_value_info("finite", TensorProto.BOOL, (6,))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    x = np.array([0, -1e30, np.inf, -np.inf, np.nan, 3.4e38], np.float32)
    out = assert_same(m, "finite_as_compare", {"x": x}, "IsNaN")
    assert not [n for n in out.graph.node if n.op_type in CPU_OR_FAILING]


@pytest.mark.parametrize("op,name", [("And", "and_as_arithmetic"), ("Or", "or_as_arithmetic")])
def test_mask_logic_as_arithmetic(op, name):
    B = TensorProto.BOOL
    m = one_node(op, [("a", B, (4,)), ("b", B, (4,))], [("y", B, (4,))])
    out = assert_same(m, name, {"a": np.array([0, 0, 1, 1], bool), "b": np.array([0, 1, 0, 1], bool)}, op)
    assert not [n for n in out.graph.node if n.op_type in CPU_OR_FAILING]


@pytest.mark.parametrize("initial,bias,outputs", [(False, True, 1), (True, True, 3), (False, False, 2)])
def test_lstm_unrolled(initial, bias, outputs):
    T, Bt, I, H = 9, 2, 3, 4
    consts = [numpy_helper.from_array(floats(1, 4 * H, I), "W"), numpy_helper.from_array(floats(1, 4 * H, H), "R")]
    names = ["x", "W", "R"]
    if bias:
        consts.append(numpy_helper.from_array(floats(1, 8 * H), "B"))
    names.append("B" if bias else "")
    inputs = [("x", F, (T, Bt, I))]
    if initial:
        names += ["", "h0", "c0"]
        inputs += [("h0", F, (1, Bt, H)), ("c0", F, (1, Bt, H))]
    outs = [("Y", F, None), ("Yh", F, None), ("Yc", F, None)][:outputs]
    m = one_node("LSTM", inputs, outs, {"hidden_size": H}, consts)
    m.graph.node[0].input[:] = names
    feeds = {"x": floats(T, Bt, I), **({"h0": floats(1, Bt, H), "c0": floats(1, Bt, H)} if initial else {})}
    out = assert_same(m, "lstm_as_ops", feeds, "LSTM")
    assert max(len(n.input) for n in out.graph.node if n.op_type == "Concat") <= webgpu.MAX_BINDINGS - 1


def test_isnan_as_one_compare():
    m = one_node("IsNaN", [("x", F, (5,))], [("y", TensorProto.BOOL, (5,))])
    x = np.array([0, np.nan, np.inf, -np.inf, -2], np.float32)
    out = assert_same(m, "isnan_as_compare", {"x": x}, "IsNaN")
    assert not [n for n in out.graph.node if n.op_type in CPU_OR_FAILING]


def test_labels_as_int32_stops_where_int64_is_needed():
    m = one_node("SoftmaxCrossEntropyLoss", [("x", F, (4, 5)), ("t", TensorProto.INT64, (4,))], [("loss", F, None)])
    m = rewritten(m, "softmax_cross_entropy_as_ops")
    assert webgpu.labels_as_int32(m, ["t"]) == ["t"]
    assert all(i.type.tensor_type.elem_type != TensorProto.INT64 for i in m.graph.input)
    x, t = floats(4, 5), np.array([0, 4, 2, 1])
    ref = run(one_node("SoftmaxCrossEntropyLoss", [("x", F, (4, 5)), ("t", TensorProto.INT64, (4,))],
                       [("loss", F, None)]), {"x": x, "t": t.astype(np.int64)})
    np.testing.assert_allclose(run(m, {"x": x, "t": t.astype(np.int32)})[0], ref[0], rtol=1e-6)
    shape_use = one_node("Reshape", [("x", F, (4, 5)), ("s", TensorProto.INT64, (2,))], [("y", F, None)])
    assert webgpu.labels_as_int32(shape_use, ["s"]) == []          # a shape stays int64


# -- whole training graphs ------------------------------------------------------------------------------------
def cases():
    """(name, forward model, loss, optimizer, batches)."""
    bn = dict(np.load(MODELS / "train_step" / "cnn_bn_dynamo.npz"))
    bn_batches = [{"x": (bn["x"] + rng.normal(0, 0.5, bn["x"].shape)).astype(np.float32), "t": bn["t"]}
                  for _ in range(3)]
    mlp = dict(np.load(MODELS / "mlp_ce_dynamo.npz"))
    mlp_batches = [{"x": floats(8, 16), "target": rng.integers(0, 4, 8).astype(np.int64)} for _ in range(3)]
    gpt_batches = [{"idx": rng.integers(0, 32, (2, 8)), "pos": np.tile(np.arange(8), (2, 1)),
                    "t": floats(2, 8, 32)} for _ in range(3)]
    lstm_batches = [{"x": floats(12, 2, 4), "t": rng.integers(0, 3, 2).astype(np.int64)} for _ in range(3)]
    assert mlp["input/x"].shape == (8, 16)
    return [
        ("bn_cnn", str(MODELS / "cnn_bn_dynamo.onnx"), losses.MSELoss(output=str(bn["output"]), target="t"),
         lambda: optim.SGD(lr=0.05, momentum=0.9), bn_batches),
        ("mlp_ce_adamw", str(MODELS / "mlp_ce_dynamo.onnx"), "loss", lambda: optim.AdamW(lr=1e-2), mlp_batches),
        ("lstm_seq12", lstm_classifier(), losses.CrossEntropyLoss(output="y", target="t"),
         lambda: optim.SGD(lr=0.1, momentum=0.9), lstm_batches),
        ("gpt_embeddings", str(MODELS / "gpt_dynamo.onnx"), losses.MSELoss(output="logits", target="t"),
         lambda: optim.SGD(lr=0.05, momentum=0.9), gpt_batches),
    ]


def train(art, batches):
    """3 steps of the artifacts on onnxruntime's CPU provider: the losses and the parameters after them."""
    losses_, values = train_steps(art.train, art.schedule, art.initial_values(), art.spec.loss, batches)
    return losses_, {p: values[p] for p in art.spec.params}


@pytest.fixture(scope="module", params=cases(), ids=lambda c: c[0])
def built(request):
    name, model, loss, opt, batches = request.param
    return (build(model, loss, opt(), target="webgpu"), build(model, loss, opt()), batches)


def test_webgpu_artifacts_train_as_the_canonical_ones(built):
    gpu, canonical, batches = built
    got, want = train(gpu, batches), train(canonical, batches)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for p, value in want[1].items():
        np.testing.assert_allclose(got[1][p], value, rtol=1e-4, atol=1e-6, err_msg=p)


def test_webgpu_artifacts_hold_nothing_the_providers_lack(built):
    gpu, canonical, _ = built
    for model in (gpu.train, gpu.eval):
        onnx.checker.check_model(model, full_check=True)
        ops = {n.op_type for n in run_time_nodes(model)}     # onnxruntime folds the others when it loads
        assert not ops & CPU_OR_FAILING, ops & CPU_OR_FAILING
        assert not [n for n in model.graph.node if n.op_type == "BatchNormalization"
                    and any(a.name == "training_mode" and a.i for a in n.attribute)]
        fans = [len(n.input) for n in model.graph.node if n.op_type == "Concat"] + \
               [len(n.output) for n in model.graph.node if n.op_type == "Split"]
        assert max(fans, default=0) <= webgpu.MAX_BINDINGS - 1
        assert not computed_wide(model), "int64 or float64 tensors computed in the step (the GPU holds neither)"
    assert gpu.spec.target == "webgpu"
    step = next(i for i in gpu.train.graph.input if i.name == gpu.spec.step)
    assert step.type.tensor_type.elem_type == TensorProto.INT32


def run_time_nodes(model):
    """The nodes that depend on a graph input: what onnxruntime cannot fold when it loads the model."""
    dynamic, nodes = {i.name for i in model.graph.input}, []
    for n in model.graph.node:
        if any(x in dynamic for x in [*n.input, *M.subgraph_inputs(n)]):
            dynamic.update(o for o in n.output if o)
            nodes.append(n)
    return nodes


def computed_wide(model):
    """The int64 and float64 tensors computed in a step (the GPU holds neither)."""
    infos, _ = M.tensor_infos(M.infer(model))
    made = [o for n in run_time_nodes(model) for o in n.output if o]
    return sorted(t for t in made if t in infos and infos[t].dtype in (TensorProto.INT64, TensorProto.DOUBLE))


def test_the_canonical_artifacts_are_what_the_checks_refuse(built):
    # the checks above can fail: the canonical graphs hold what the rewrites remove
    _, canonical, _ = built
    ops = {n.op_type for n in run_time_nodes(canonical.train)}
    assert ops & CPU_OR_FAILING and computed_wide(canonical.train)


def test_the_lstm_gradient_is_wider_than_webgpu_binds_until_rewritten():
    canonical = build(lstm_classifier(), losses.CrossEntropyLoss(output="y", target="t"), optim.SGD(lr=0.1))
    fans = [len(n.input) for n in canonical.train.graph.node if n.op_type == "Concat"] + \
           [len(n.output) for n in canonical.train.graph.node if n.op_type == "Split"]
    assert max(fans) >= webgpu.MAX_BINDINGS          # the silent error's shape: 12 time steps in one node


def test_embedding_gradients_as_one_hot_matmuls():
    # Gather's gradient scatters rows at int64 indices (ScatterND needs int64): one-hot rows and a MatMul instead,
    # so that the token ids are fed as int32
    table = numpy_helper.from_array(floats(6, 3), "table")
    m = one_node("Gather", [("idx", TensorProto.INT64, (2, 4))], [("y", F, (2, 4, 3))], {"axis": 0}, [table])
    m.graph.node[0].input[:] = ["table", "idx"]
    gm = build(m, losses.MSELoss(output="y", target="t"), optim.SGD(lr=0.1), target="webgpu")
    assert not [n for n in gm.train.graph.node if n.op_type == "ScatterND"]
    assert next(i for i in gm.train.graph.input if i.name == "idx").type.tensor_type.elem_type == TensorProto.INT32
    canonical = build(m, losses.MSELoss(output="y", target="t"), optim.SGD(lr=0.1))
    assert [n for n in canonical.train.graph.node if n.op_type == "ScatterND"]
    batches = [{"idx": np.array([[0, 5, 5, 2], [5, 1, 0, 0]]), "t": floats(2, 4, 3)} for _ in range(2)]
    (got, gp), (want, wp) = train(gm, batches), train(canonical, batches)       # repeated rows accumulate
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(gp["table"], wp["table"], rtol=1e-5, atol=1e-7)


def test_a_pointwise_weights_update_reads_its_scalars_at_its_rank(monkeypatch):
    """A [6, 3, 1, 1] weight updated alone: its AdamW scalars reshaped to [1, 1, 1, 1] (wasm runs the webgpu files
    with onnxruntime's CPU kernels, which broadcast a scalar against such a shape one element at a time), nothing
    the providers lack, and the canonical training."""
    import onnxgrad.training.artifacts as A

    monkeypatch.setattr(A, "FOREACH_MAX_ELEMENTS", 0)
    w = numpy_helper.from_array((rng.standard_normal((6, 3, 1, 1)) * 0.5).astype(np.float32), "pw")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "pw"], ["y"], name="pointwise")], "pointwise",
                              [helper.make_tensor_value_info("x", F, (2, 3, 4, 4))],
                              [helper.make_tensor_value_info("y", F, (2, 6, 4, 4))], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    loss = losses.MSELoss(output="y", target="t")
    gpu = build(model, loss, optim.AdamW(lr=1e-2, weight_decay=0.1), target="webgpu")
    canonical = build(model, loss, optim.AdamW(lr=1e-2, weight_decay=0.1))
    reshaped = {n.output[0] for n in gpu.train.graph.node if n.op_type == "Reshape" and n.input[0] not in ("x", "pw")}
    assert any(set(n.input) & reshaped for n in gpu.train.graph.node if n.name.startswith("train/optimizer/pw/"))
    assert not {n.op_type for n in run_time_nodes(gpu.train)} & CPU_OR_FAILING
    batches = [{"x": floats(2, 3, 4, 4), "t": floats(2, 6, 4, 4)} for _ in range(3)]
    (got, gp), (want, wp) = train(gpu, batches), train(canonical, batches)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(gp["pw"], wp["pw"], rtol=1e-5, atol=1e-7)


def test_adam_schedule_keeps_float64_off_the_training_graph():
    art = build(str(MODELS / "mlp_ce_dynamo.onnx"), "loss", optim.AdamW(lr=1e-2), target="webgpu")
    assert art.schedule is not None and art.spec.schedule["inputs"] == ["lr", "step"]
    doubles = [n for n in art.schedule.graph.node if any(
        a.name == "to" and a.i == TensorProto.DOUBLE for a in n.attribute)]
    assert doubles                                              # bias corrections in float64, as PyTorch's
    assert set(art.spec.schedule["outputs"]) <= {i.name for i in art.train.graph.input}


def test_cli_writes_the_webgpu_artifacts_with_their_schedule(tmp_path, capsys):
    from onnxgrad.tools.cli import main as cli_main
    from onnxgrad.training import state

    model = tmp_path / "mlp.onnx"
    model.write_bytes((MODELS / "mlp_ce_dynamo.onnx").read_bytes())
    assert cli_main([str(model), "--loss", "loss", "--optimizer", "adamw", "--lr", "0.01",
                     "--optimize-for", "webgpu"]) == 0
    out = capsys.readouterr().out
    assert "mlp.schedule.onnx" in out
    train, schedule = onnx.load(tmp_path / "mlp.train.onnx"), onnx.load(tmp_path / "mlp.schedule.onnx")
    onnx.checker.check_model(schedule, full_check=True)
    assert {i.name for i in schedule.graph.input} == {"lr", "step"}
    held = state.read(tmp_path / "mlp.state.safetensors")
    assert held.tensors["step"].dtype == np.int32 and held.tensors["lr"].dtype == np.float32
    assert {o.name for o in schedule.graph.output} <= {i.name for i in train.graph.input}
