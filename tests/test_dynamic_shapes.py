"""Real exports: symbolic dims, ranks onnx's inference misses, and onnxruntime's optimizer.

Every gradient graph here must pass the checker, load and run in onnxruntime with its default
(all) optimizations, and match float64 central differences.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from harness import make_model
from onnxgrad.tools.check import check

F, I64 = TensorProto.FLOAT, TensorProto.INT64
RNG = np.random.default_rng(7)


def model(nodes, inputs, outputs, inits=(), opset=17):
    m = make_model(nodes, inputs, outputs, inits, opset)
    onnx.checker.check_model(m, full_check=True)
    return m


def verify(m, feeds, wrt, of=None, tol=2e-3):
    gm = onnxgrad.grad(m, wrt=wrt, of=of)
    onnx.checker.check_model(gm, full_check=True)
    ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])   # default optimizations
    r = check(m, gm, feeds)
    assert r.grad_backend == "onnxruntime", "the gradient graph did not run in onnxruntime"
    assert r.ok(tol), r.errors
    return gm


@pytest.mark.parametrize("axis,idx", [(0, -1), (-3, -1), (-2, -1), (-1, [-1, 0]), (-2, [[0, -1], [1, 1]])])
def test_gather_negative_axis_and_indices_on_symbolic_dims(axis, idx):
    """A 0-D negative index made non-negative at run time stays 0-D (it became [1]: ScatterND refused)."""
    x = helper.make_tensor_value_info("x", F, ["B", "S", "D"])
    idx = numpy_helper.from_array(np.array(idx, np.int64), "i")
    m = model([helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)], [x], [], [idx])
    m = onnx.shape_inference.infer_shapes(m)
    m.graph.output.append(m.graph.value_info[0])
    del m.graph.value_info[:]
    verify(m, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)}, ["x"], ["y"])


def _computed_reshape(tail_op):
    """x [B, S, 8] -> Reshape(x, Concat(Shape(x)[0:end], [2, 4])) with end an input: the rank of the
    result is unknown to onnx's inference; the declared output implies it."""
    x = helper.make_tensor_value_info("x", F, ["B", "S", 8])
    end = helper.make_tensor_value_info("end", I64, [1])
    w = numpy_helper.from_array(RNG.standard_normal((4, 3)).astype(np.float32), "W")
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Slice", ["s", "start", "end"], ["s2"]),
             helper.make_node("Concat", ["s2", "tail"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Tanh", ["r"], ["t"]), tail_op]
    n = 3 if tail_op.op_type == "MatMul" else 4
    inits = [numpy_helper.from_array(np.array([0], np.int64), "start"),
             numpy_helper.from_array(np.array([2, 4], np.int64), "tail"), w]
    return model(nodes, [x, end], [helper.make_tensor_value_info("y", F, ["B", "S", 2, n])], inits)


FEEDS = {"x": RNG.standard_normal((2, 3, 8)).astype(np.float32), "end": np.array([2], np.int64)}


def test_wrt_after_a_reshape_to_a_computed_shape_has_a_shaped_gradient_output():
    m = _computed_reshape(helper.make_node("Mul", ["t", "t"], ["y"]))
    for wrt in (["r"], ["t"], ["x", "r"]):
        gm = verify(m, FEEDS, wrt, ["y"])
        for o in gm.graph.output:
            assert o.type.tensor_type.HasField("shape")


def test_matmul_after_a_reshape_to_a_computed_shape():
    """The operand's rank comes back from the declared output and the weight's rank."""
    verify(_computed_reshape(helper.make_node("MatMul", ["t", "W"], ["y"])), FEEDS, ["x", "W", "r"], ["y"])


def test_check_perturbs_an_input_through_an_intermediate_also_differentiated():
    """wrt=[x, r] with r computed from x: perturbing x moves r (the check cut r from x before)."""
    m = _computed_reshape(helper.make_node("Mul", ["t", "t"], ["y"]))
    gm = onnxgrad.grad(m, wrt=["x", "r"], of=["y"])
    r = check(m, gm, FEEDS, max_elements=100)
    assert np.abs(r.numeric["x"]).max() > 0.1 and r.ok(2e-3)


def test_gemm_reading_a_third_split_output():
    """Concat(a, b, MatMul(b, W)): the backward's Split output #2 must not feed a Gemm (GemmSumFusion)."""
    a, b = (helper.make_tensor_value_info(k, F, [2, 3]) for k in "ab")
    w = numpy_helper.from_array(RNG.standard_normal((3, 3)).astype(np.float32), "W")
    m = model([helper.make_node("MatMul", ["b", "W"], ["c"]), helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=1)],
              [a, b], [helper.make_tensor_value_info("y", F, [2, 9])], [w])
    feeds = {k: RNG.standard_normal((2, 3)).astype(np.float32) for k in "ab"}
    verify(m, feeds, ["a", "b", "W"])


def test_transpose_then_pad_with_axes():
    """Transpose -> Pad-18(edge, axes) -> Sin: onnxruntime's transpose optimizer ignores axes."""
    x = helper.make_tensor_value_info("x", F, [2, 3, 4])
    inits = [numpy_helper.from_array(np.array([1, 1], np.int64), "p"), numpy_helper.from_array(np.array([2], np.int64), "ax")]
    m = model([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
               helper.make_node("Pad", ["t", "p", "", "ax"], ["q"], mode="edge"), helper.make_node("Sin", ["q"], ["y"])],
              [x], [helper.make_tensor_value_info("y", F, [3, 2, 6])], inits, opset=18)
    verify(m, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)}, ["x"])


def _unknown_rank(node, inits, out_rank, opset=17):
    """x [2, 3, 4] reshaped to a shape fed at run time (its rank unknown to the pass), then node -> y."""
    x = helper.make_tensor_value_info("x", F, [2, 3, 4])
    s = helper.make_tensor_value_info("s", I64, ["k"])
    y = helper.make_tensor_value_info("y", F, [f"y{i}" for i in range(out_rank)])
    node.input[0] = "r"
    return model([helper.make_node("Reshape", ["x", "s"], ["r"]), node], [x, s], [y], inits, opset)


FEEDS_RANK3 = {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32), "s": np.array([2, 3, 4], np.int64)}


@pytest.mark.parametrize("axis,idx,opset", [(0, [1, 0, 1], 17), (1, [[-1, 0]], 17), (-1, 1, 17), (-2, [0, -1, 0], 13),
                                            (2, [3, 3], 13)])
def test_gather_on_an_operand_of_unknown_rank(axis, idx, opset):
    """x seen as [A, d, B] from Shape(x): one scatter-add whatever x's rank."""
    idx = np.array(idx, np.int64)
    m = _unknown_rank(helper.make_node("Gather", ["x", "i"], ["y"], axis=axis),
                      [numpy_helper.from_array(idx, "i")], 2 + idx.ndim, opset)
    verify(m, FEEDS_RANK3, ["x"], ["y"])


@pytest.mark.parametrize("mode,opset", [("constant", 17), ("edge", 17), ("reflect", 13), ("wrap", 19)])
def test_pad_on_an_operand_of_unknown_rank(mode, opset):
    """Without axes, pads has two entries per axis: the rank is len(pads) / 2."""
    pads = numpy_helper.from_array(np.array([1, 0, 1, 1, 1, 2], np.int64), "p")
    m = _unknown_rank(helper.make_node("Pad", ["x", "p"], ["y"], mode=mode), [pads], 3, opset)
    verify(m, FEEDS_RANK3, ["x"], ["y"])


def _hidden_rank(node, shape, out_rank, inits=(), fed=None, opset=17):
    """x of ``shape`` reshaped to a shape fed at run time (its rank unknown to the pass), then node -> y;
    ``fed``: an int64 array for the node's second input, fed flat and reshaped the same way (its rank
    unknown too). Returns the model and its feeds."""
    x = helper.make_tensor_value_info("x", F, list(shape))
    inputs = [x, helper.make_tensor_value_info("s", I64, ["k"])]
    y = helper.make_tensor_value_info("y", F, [f"y{i}" for i in range(out_rank)])
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"])]
    node.input[0] = "r"
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32), "s": np.array(shape, np.int64)}
    if fed is not None:
        fed = np.array(fed, np.int64)
        inputs += [helper.make_tensor_value_info("flat", I64, ["n"]), helper.make_tensor_value_info("fs", I64, ["q"])]
        nodes.append(helper.make_node("Reshape", ["flat", "fs"], [node.input[1]]))
        feeds.update(flat=fed.reshape(-1), fs=np.array(fed.shape, np.int64))
    return model(nodes + [node], inputs, [y], list(inits), opset), feeds


@pytest.mark.parametrize("axis,opset,fed", [(0, 17, False), (-1, 17, True), (1, 13, False), (-2, 13, True),
                                            (2, 13, True)])
def test_gather_elements_on_operands_of_unknown_rank(axis, opset, fed):
    """x's rank unknown; idx a constant (its rank is x's) or fed with no rank: a ScatterElements-add from
    opset 16, a one-hot contraction over [A, K, B] views before."""
    idx = RNG.integers(-2, 2, size=(2, 2, 3)).astype(np.int64)
    node = helper.make_node("GatherElements", ["x", "i"], ["y"], axis=axis)
    if fed:
        m, feeds = _hidden_rank(node, (2, 3, 4), 3, fed=idx, opset=opset)
    else:
        m, feeds = _hidden_rank(node, (2, 3, 4), 3, [numpy_helper.from_array(idx, "i")], opset=opset)
    verify(m, feeds, ["x"], ["y"])


@pytest.mark.parametrize("reps,fed,opset", [([2, 1, 3], False, 17), ([1, 2, 2], True, 17), ([2, 2, 1], True, 13)])
def test_tile_on_an_operand_of_unknown_rank(reps, fed, opset):
    """The rank from len(reps) when they are constant, else the summed axes made at run time."""
    inits = [] if fed else [numpy_helper.from_array(np.array(reps, np.int64), "t")]
    m, feeds = _hidden_rank(helper.make_node("Tile", ["x", "t"], ["y"]), (2, 3, 2), 3, inits,
                            reps if fed else None, opset)
    verify(m, feeds, ["x"], ["y"])


@pytest.mark.parametrize("idx,bd,opset", [([[0, 1], [1, -1], [0, 1]], 0, 17), ([[0, 1], [1, -1], [0, 1]], 0, 13),
                                          ([[[1], [0]], [[-1], [2]]], 1, 17), ([[[1, 0], [0, -2]], [[1, 3], [1, 3]]], 1, 13),
                                          ([[1, 2, 3], [-1, 0, 0]], 0, 16)])
def test_gather_nd_with_unknown_depth_and_rank(idx, bd, opset):
    """The indices fed with no shape (depth k unknown) and x's rank unknown: strides at run time, one
    row scatter-add (a one-hot MatMul before opset 16)."""
    idx = np.array(idx, np.int64)
    out_rank = idx.ndim - 1 + 3 - idx.shape[-1] - bd          # idx.shape[:-1] + x.shape[bd + k:]
    m, feeds = _hidden_rank(helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=bd), (2, 3, 4), out_rank,
                            fed=idx, opset=opset)
    verify(m, feeds, ["x"], ["y"])


@pytest.mark.parametrize("shape,training,opset", [((2, 3, 4), 0, 17), ((2, 3, 2, 2), 1, 17), ((5, 3), 1, 14),
                                                  ((2, 3, 4), 0, 9), ((2, 3, 4), 1, 9)])
def test_batch_normalization_of_unknown_rank(shape, training, opset):
    """Statistics over every axis but 1 of an [N, C, L] view: inference and training mode alike."""
    c = shape[1]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in
             (("scale", 1 + 0.3 * RNG.standard_normal(c)), ("B", RNG.standard_normal(c)),
              ("mean", RNG.standard_normal(c)), ("var", RNG.uniform(0.5, 1.5, c)))]
    outs = ["y"] if not training else ["y", "rm", "rv"] if opset >= 14 else ["y", "rm", "rv", "sm", "sv"]
    attrs = dict(training_mode=training) if opset >= 14 else {}
    node = helper.make_node("BatchNormalization", ["x", "scale", "B", "mean", "var"], outs, **attrs)
    m, feeds = _hidden_rank(node, shape, len(shape), inits, opset=opset)
    verify(m, feeds, ["x", "scale", "B"] if training else ["x", "scale", "B", "mean", "var"], ["y"])


@pytest.mark.parametrize("shape", [(3, 3), (2, 3, 3), (2, 1, 2, 2)])
def test_det_of_unknown_rank(shape):
    """Batch dims, their number and M all known only at run time."""
    node = helper.make_node("Det", ["x"], ["y"])
    m, feeds = _hidden_rank(node, shape, len(shape) - 2)
    feeds["x"] = feeds["x"] + 2 * np.eye(shape[-1], dtype=np.float32)
    verify(m, feeds, ["x"], ["y"])


def test_a_wrt_tensor_of_unknown_rank_is_refused_clearly():
    """A gradient output needs a rank (onnx's checker refuses a graph output without one): a wrt tensor
    whose rank no inference finds is a clear error naming it, not an invalid model."""
    F = TensorProto.FLOAT
    nodes = [helper.make_node("Reshape", ["x", "dims"], ["r"]),         # dims: a run-time shape of any length
             helper.make_node("Tanh", ["r"], ["t"]),
             helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [6]),
                                       helper.make_tensor_value_info("dims", TensorProto.INT64, ["k"])],
                          [helper.make_tensor_value_info("loss", F, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(onnxgrad.UnknownNameError, match="the rank of 'r_grad' cannot be found"):
        onnxgrad.grad(m, wrt=["r"], loss="loss")
    gm = onnxgrad.grad(m, wrt=["x"], loss="loss")          # x's rank is known: fine
    onnx.checker.check_model(gm, full_check=True)


# -- shape inference: data propagation where it can know more, and only there ---------------------------------
def _reshaped(target_nodes, inits=()):
    """x [2, 3, 4] reshaped to the shape ``target_nodes`` compute as ``t``."""
    nodes = [*target_nodes, helper.make_node("Reshape", ["x", "t"], ["y"])]
    return model(nodes, [helper.make_tensor_value_info("x", F, [2, 3, 4])],
                 [helper.make_tensor_value_info("y", F, ["a", "b"])], inits)


def _shape_of(m, name):
    from onnxgrad.ir import model as M

    infos, _ = M.tensor_infos(M.infer(m))
    return infos[name].shape


def test_inference_propagates_a_shape_computed_from_shape():
    m = _reshaped([helper.make_node("Shape", ["x"], ["s"], start=0, end=1),
                   helper.make_node("Concat", ["s", "minus_one"], ["t"], axis=0)],
                  [numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    assert _shape_of(m, "y") == (2, 12)


def test_inference_propagates_a_shape_computed_from_integer_constants():
    m = _reshaped([helper.make_node("Concat", ["six", "minus_one"], ["t"], axis=0)],
                  [numpy_helper.from_array(np.array([6], np.int64), "six"),
                   numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    assert _shape_of(m, "y") == (6, 4)


def test_data_propagation_is_asked_only_where_it_can_know_more():
    from onnxgrad.ir.model import _propagates_data

    shape_made = _reshaped([helper.make_node("Shape", ["x"], ["s"], start=0, end=1),
                            helper.make_node("Concat", ["s", "minus_one"], ["t"], axis=0)],
                           [numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    constants_made = _reshaped([helper.make_node("Concat", ["six", "minus_one"], ["t"], axis=0)],
                               [numpy_helper.from_array(np.array([6], np.int64), "six"),
                                numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    # a count cast to float (batch norm's n), and a constant target: nothing to propagate
    nothing = model([helper.make_node("Constant", [], ["n"], value=numpy_helper.from_array(np.array(6, np.int64))),
                     helper.make_node("Cast", ["n"], ["nf"], to=F),
                     helper.make_node("Mul", ["x", "nf"], ["xn"]),
                     helper.make_node("Reshape", ["xn", "t"], ["y"])],
                    [helper.make_tensor_value_info("x", F, [2, 3, 4])], [helper.make_tensor_value_info("y", F, ["a", "b"])],
                    [numpy_helper.from_array(np.array([6, -1], np.int64), "t")])
    # token type ids: zeros expanded to the batch's shape (onnx propagates no data through Expand), and
    # position ids sliced from a long constant (no shape has 512 dims)
    ids = model([helper.make_node("Expand", ["zero", "batch"], ["types"]),
                 helper.make_node("Slice", ["positions", "start", "end", "axis"], ["pos"]),
                 helper.make_node("Gather", ["table", "types"], ["t_emb"]),
                 helper.make_node("Gather", ["table", "pos"], ["p_emb"]),
                 helper.make_node("Add", ["t_emb", "p_emb"], ["y"])],
                [helper.make_tensor_value_info("table", F, [512, 4])],
                [helper.make_tensor_value_info("y", F, [2, 8, 4])],
                [numpy_helper.from_array(np.zeros(1, np.int64), "zero"),
                 numpy_helper.from_array(np.array([2, 8], np.int64), "batch"),
                 numpy_helper.from_array(np.arange(512, dtype=np.int64).reshape(1, 512), "positions"),
                 numpy_helper.from_array(np.array([0], np.int64), "start"),
                 numpy_helper.from_array(np.array([8], np.int64), "end"),
                 numpy_helper.from_array(np.array([1], np.int64), "axis")])
    assert _propagates_data(shape_made.graph) and _propagates_data(constants_made.graph)
    assert not _propagates_data(nothing.graph) and not _propagates_data(ids.graph)
    assert _shape_of(ids, "y") == (2, 8, 4)
    assert _shape_of(nothing, "y") == (6, 4)


def _gradient_ops(gm: onnx.ModelProto, forward: int) -> list[str]:
    return [n.op_type for n in gm.graph.node[forward:]]


@pytest.mark.parametrize("other_dims, same", [
    (["C", 1, 1], True),            # a bias: it lacks the batch axis, has 1 on the others
    (["N", "C", 4, 4], True),       # a residual: the same symbol, the same size
    (["M", "C", 4, 4], False),      # another symbol: it may be 1 at run time (broadcast), only then known
], ids=["bias", "same-symbol", "other-symbol"])
def test_an_add_along_a_symbolic_batch_axis_sums_at_build_time_where_it_can(other_dims, same):
    """Add(x [N, C, 4, 4], other): x's gradient needs no sum along N where the other operand lacks N, has
    1 there, or names the same symbol; then no Shape, Equal and NonZero decide it at run time (an export
    with a dynamic batch axis ran 236 instead of 420 Shape nodes on MobileNetV2, 5-7% of its step). With
    another symbol the run time decides, and a batch of 1 on that side is summed over."""
    C = 3
    x = helper.make_tensor_value_info("x", F, ["N", C, 4, 4])
    other = helper.make_tensor_value_info("b", F, [C if d == "C" else d for d in other_dims])
    m = model([helper.make_node("Add", ["x", "b"], ["y"])], [x, other], [helper.make_tensor_value_info(
        "y", F, ["N", C, 4, 4])])
    gm = verify(m, {"x": RNG.standard_normal((2, C, 4, 4)).astype(np.float32),
                    "b": RNG.standard_normal([2 if d in ("N", "M") else C if d == "C" else d
                                              for d in other_dims]).astype(np.float32)}, ["x", "b"], ["y"])
    assert ("NonZero" not in _gradient_ops(gm, 1)) == same, _gradient_ops(gm, 1)
    if not same:            # the other side broadcast at run time: its gradient sums over the batch
        sess = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {"x": np.ones((2, C, 4, 4), np.float32), "b": np.ones((1, C, 4, 4), np.float32),
                 gm.graph.input[-1].name: np.ones((2, C, 4, 4), np.float32)}
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        np.testing.assert_array_equal(got["b_grad"], np.full((1, C, 4, 4), 2.0, np.float32))


def test_a_batched_matmul_gradient_sums_nothing_along_its_rows_and_columns():
    """A [C, N, P] @ B [C, P, O] with N symbolic: a matrix product broadcasts its batch axes only, so the
    symbolic row axis needs no sum decided at run time."""
    a = helper.make_tensor_value_info("a", F, [3, "N", 4])
    b = helper.make_tensor_value_info("b", F, [3, 4, 5])
    m = model([helper.make_node("MatMul", ["a", "b"], ["y"])], [a, b],
              [helper.make_tensor_value_info("y", F, [3, "N", 5])])
    gm = verify(m, {"a": RNG.standard_normal((3, 2, 4)).astype(np.float32),
                    "b": RNG.standard_normal((3, 4, 5)).astype(np.float32)}, ["a", "b"], ["y"])
    assert "NonZero" not in _gradient_ops(gm, 1), _gradient_ops(gm, 1)
