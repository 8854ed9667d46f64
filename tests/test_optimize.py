"""The rewrites of onnxgrad.passes.optimize: each one applies where its pattern and check say, gives the
canonical gradient graph's outputs in onnxruntime, passes the full checker, and says why it declines.

The canonical graphs are the ones the rule tables prove against central differences; here every
rewritten graph is compared with its canonical graph on the same feeds, in onnxruntime (float32).
"""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from harness import Case, case_model, distinct, make_model, randn
from onnxgrad.errors import OnnxGradError
from onnxgrad.passes.optimize import REWRITES, TARGETS, cuda_refusals, optimize, target_for
from onnxgrad.passes.optimize.rewriter import GraphView
from onnxgrad.passes.record import backward_nodes


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(names, feeds)))


def _seeded(model: onnx.ModelProto, gm: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """The feeds plus a random seed for every seed input of the gradient model."""
    rng = np.random.default_rng(7)
    declared = {i.name for i in model.graph.input}
    out = dict(feeds)
    for i in gm.graph.input:
        if i.name not in declared:
            shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
            dtype = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
            out[i.name] = rng.standard_normal(shape).astype(dtype)
    return out


def _declined(case: Case, rewrite: str, reason: str, alone: bool = False) -> onnx.ModelProto:
    """The gradient of ``case`` (its output ``y0``) rewritten for the CPU (``alone``: by ``rewrite`` only),
    once ``rewrite`` is seen to decline it with ``reason``."""
    model, _, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    fast, report = (optimize(gm, None, first=1, rewrites=[rewrite]) if alone else optimize(gm, "cpu", first=1))
    assert report.count(rewrite) == 0
    assert any(reason in why for why in report.reasons(rewrite)), report.declined
    return fast


def _equivalent(model: onnx.ModelProto, feeds: dict, rewrite: str, rtol: float = 1e-4, exact: bool = False,
                beside: tuple[str, ...] = (), **grad_args) -> onnx.ModelProto:
    """The canonical gradient of ``model`` and the same with ``rewrite`` (and the rewrites ``beside`` it)
    applied give the same outputs."""
    gm = onnxgrad.grad(model, **grad_args)
    fast, report = optimize(gm, None, first=len(model.graph.node), rewrites=[rewrite, *beside])
    assert report.count(rewrite) >= 1, f"{rewrite} did not apply: {report.declined}"
    onnx.checker.check_model(fast, full_check=True)
    feeds = _seeded(model, gm, feeds)
    want, got = _run(gm, feeds), _run(fast, feeds)
    assert want.keys() == got.keys()
    for name, value in want.items():
        if exact:
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        else:
            scale = max(float(np.abs(value).max()), 1e-6)
            np.testing.assert_allclose(got[name], value, rtol=0, atol=rtol * scale, err_msg=name)
    return fast


def _case(case: Case, rewrite: str, **kw) -> onnx.ModelProto:
    model, feeds, wrt = case_model(case)
    return _equivalent(model, feeds, rewrite, wrt=wrt, of=["y0"], **kw)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# -- conv_weight_grad_patches -----------------------------------------------------------------------
PATCH_CASES = [
    Case("Conv", [randn(2, 3, 9, 8), randn(4, 3, 3, 3)], dict(pads=[1, 1, 1, 1]), id="batched-matmul", wrt=[1]),
    Case("Conv", [randn(1, 3, 6, 7), randn(5, 3, 3, 3), randn(5)], dict(pads=[1, 1, 1, 1]), id="one-image"),
    Case("Conv", [randn(3, 4, 4, 4), randn(16, 4, 3, 3)], dict(pads=[1, 1, 1, 1]), id="gemm-few-positions",
         wrt=[1]),
    Case("Conv", [randn(2, 3, 7, 6), randn(4, 3, 3, 2)], dict(strides=[2, 1], pads=[1, 0, 1, 1]),
         id="stride-asymmetric-pads"),
    Case("Conv", [randn(2, 2, 9, 9), randn(3, 2, 3, 3)], dict(dilations=[2, 2], pads=[2, 1, 0, 2]),
         id="dilation", wrt=[1]),
    Case("Conv", [randn(2, 4, 5, 5), randn(6, 4, 1, 1)], dict(strides=[2, 2]), id="1x1-stride-2", wrt=[1]),
    Case("Conv", [randn(2, 3, 11), randn(4, 3, 3)], dict(pads=[1, 1], strides=[2]), id="1-d", wrt=[1]),
    Case("Conv", [randn(1, 2, 4, 5, 4), randn(3, 2, 2, 2, 2)], dict(pads=[1, 0, 1, 0, 1, 0]), id="3-d", wrt=[1]),
    Case("Conv", [randn(2, 3, 7, 6), randn(4, 3, 2, 3)], dict(strides=[3, 2], pads=[0, 1, 0, 1]),
         id="stride-not-dividing", wrt=[1]),
    Case("ConvTranspose", [randn(2, 3, 4, 3), randn(3, 2, 3, 3)], dict(strides=[2, 2], pads=[1, 0, 1, 1]),
         id="conv-transpose", wrt=[1]),
]


@pytest.mark.parametrize("case", PATCH_CASES, ids=str)
def test_conv_weight_grad_patches(case):
    fast = _case(case, "conv_weight_grad_patches")
    backward = _ops(fast)[1:]
    assert "Conv" in backward and ("Gemm" in backward or "MatMul" in backward)


def test_conv_weight_grad_patches_inside_a_model():
    """The gradient reaching the Conv comes from another rule (Tanh's): its shape is the Conv output's."""
    x, w = randn(2, 3, 7, 6), randn(4, 3, 3, 2)
    model = make_model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv", strides=[2, 1], pads=[1, 0, 1, 1]),
                        helper.make_node("Tanh", ["c"], ["y"], name="tanh")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c", "d"])],
                       [numpy_helper.from_array(w, "w")])
    _equivalent(model, {"x": x}, "conv_weight_grad_patches", wrt=["x", "w"], of=["y"])


@pytest.mark.parametrize("case, reason", [
    (Case("Conv", [randn(1, 3, 12, 12), randn(4, 3, 5, 5)], dict(pads=[2, 2, 2, 2]), wrt=[1]), "5x5 kernel"),
    (Case("Conv", [randn(2, 3, 6, 6), randn(4, 3, 3, 3)], dict(pads=[1, 1, 1, 1], kernel_shape=[3, 3]), wrt=[0, 1],
          unknown_shapes=True),
     "static shapes"),
], ids=["large-kernel", "unknown-shapes"])
def test_conv_weight_grad_patches_declines_with_a_reason(case, reason):
    _declined(case, "conv_weight_grad_patches", reason)


# -- depthwise_weight_grad_patches ------------------------------------------------------------------
DEPTHWISE_WEIGHT_CASES = [
    Case("Conv", [randn(2, 6, 9, 9), randn(6, 1, 3, 3)], dict(group=6, pads=[1, 1, 1, 1]), id="3x3", wrt=[1]),
    Case("Conv", [randn(1, 4, 9, 10), randn(4, 1, 3, 3), randn(4)], dict(group=4, pads=[1, 1, 1, 1]),
         id="one-image-bias"),
    Case("Conv", [randn(3, 4, 9, 8), randn(4, 1, 3, 3)], dict(group=4, strides=[2, 2], pads=[1, 0, 1, 1]),
         id="stride-asymmetric-pads", wrt=[0, 1]),
    Case("Conv", [randn(2, 3, 10, 9), randn(3, 1, 3, 2)], dict(group=3, dilations=[2, 1], pads=[2, 1, 0, 0]),
         id="dilation-kernel-3x2", wrt=[1]),
    Case("Conv", [randn(2, 5, 7, 9), randn(5, 1, 3, 3)], dict(group=5, strides=[3, 2]),
         id="stride-not-dividing", wrt=[1]),
    Case("Conv", [randn(2, 4, 17), randn(4, 1, 3)], dict(group=4, pads=[1, 1]), id="1-d", wrt=[1]),
]


@pytest.mark.parametrize("case", DEPTHWISE_WEIGHT_CASES, ids=str)
def test_depthwise_weight_grad_patches(case):
    """The grouped swapped-role Conv of a depthwise weight gradient becomes the one-hot patches (a Conv with a
    constant weight) and batched MatMuls; the gradients are the canonical graph's."""
    fast = _case(case, "depthwise_weight_grad_patches")
    constants = {n.output[0] for n in fast.graph.node if n.op_type == "Constant"}
    backward = [n for n in fast.graph.node[1:] if n.op_type == "Conv"]
    assert "MatMul" in _ops(fast) and backward and all(n.input[1] in constants for n in backward)


@pytest.mark.parametrize("case, reason", [
    (Case("Conv", [randn(2, 4, 12, 12), randn(4, 1, 5, 5)], dict(group=4, pads=[2, 2, 2, 2]), wrt=[1]),
     "5x5 kernel"),
    (Case("Conv", [randn(2, 3, 9, 9), randn(6, 1, 3, 3)], dict(group=3, pads=[1, 1, 1, 1]), wrt=[1]),
     "not depthwise"),
    (Case("Conv", [randn(2, 4, 9, 9), randn(4, 2, 3, 3)], dict(group=2, pads=[1, 1, 1, 1]), wrt=[1]),
     "not depthwise"),
], ids=["large-kernel", "two-outputs-per-channel", "two-channels-per-group"])
def test_depthwise_weight_grad_patches_declines_with_a_reason(case, reason):
    _declined(case, "depthwise_weight_grad_patches", reason)


# -- conv_forward_patches ---------------------------------------------------------------------------
FORWARD_PATCH_CASES = [
    Case("Conv", [randn(3, 6, 4, 4), randn(5, 6, 3, 3)], dict(pads=[1, 1, 1, 1]), id="3x3", wrt=[0, 1]),
    Case("Conv", [randn(2, 3, 6, 7), randn(5, 3, 3, 3), randn(5)], dict(pads=[1, 1, 1, 1], strides=[2, 2]),
         id="stride-bias"),
    Case("Conv", [randn(2, 3, 7, 6), randn(4, 3, 3, 2)], dict(strides=[2, 1], pads=[1, 0, 1, 1]),
         id="stride-asymmetric-pads", wrt=[1]),
    Case("Conv", [randn(2, 2, 9, 9), randn(3, 2, 3, 3)], dict(dilations=[2, 2], pads=[2, 1, 0, 2]),
         id="dilation", wrt=[1]),
    Case("Conv", [randn(2, 4, 5, 5), randn(6, 4, 1, 1)], dict(strides=[2, 2]), id="1x1-stride-2", wrt=[0, 1]),
    Case("Conv", [randn(2, 3, 11), randn(4, 3, 3)], dict(pads=[1, 1], strides=[2]), id="1-d", wrt=[1]),
    Case("Conv", [randn(1, 2, 3, 5, 4), randn(3, 2, 2, 2, 2)], dict(pads=[1, 0, 1, 0, 1, 0]), id="3-d", wrt=[1]),
]


@pytest.mark.parametrize("case", FORWARD_PATCH_CASES, ids=str)
def test_conv_forward_patches_shares_the_patches_with_the_weight_gradient(case):
    """The forward Conv becomes patches and a MatMul; the weight gradient reads those patches (one patches
    Conv in the whole graph, in the forward) and the forward's node count is recorded again."""
    model, feeds, wrt = case_model(case)
    fast = _equivalent(model, feeds, "conv_forward_patches", beside=("conv_weight_grad_patches",), wrt=wrt,
                       of=["y0"])
    patches = [n for n in fast.graph.node if n.op_type == "Conv"]
    assert len(patches) == 1 and patches[0].name.startswith("Conv_node/conv_forward_patches/"), _ops(fast)
    forward = len(fast.graph.node) - len(backward_nodes(fast))
    assert all(n.name.startswith("Conv_node/conv_forward_patches/") for n in fast.graph.node[:forward])
    assert all("/grad/" in n.name for n in backward_nodes(fast)), [n.name for n in backward_nodes(fast)]


@pytest.mark.parametrize("case, reason", [
    (Case("Conv", [randn(1, 2, 12, 12), randn(3, 2, 3, 3)], dict(pads=[1, 1, 1, 1]), wrt=[1]), "144 positions"),
    (Case("Conv", [randn(1, 2, 12, 12), randn(3, 2, 5, 5)], dict(strides=[3, 3]), wrt=[1]), "5x5 kernel"),
], ids=["many-positions", "large-kernel"])
def test_conv_forward_patches_declines_with_a_reason(case, reason):
    fast = _declined(case, "conv_forward_patches", reason)
    assert fast.graph.node[0].op_type == "Conv" and len(fast.graph.node) - len(backward_nodes(fast)) == 1


def test_conv_forward_patches_leaves_a_conv_without_a_weight_gradient_alone():
    """Nothing to share: a Conv whose weight is not differentiated keeps onnxruntime's Conv."""
    model, feeds, _ = case_model(Case("Conv", [randn(2, 3, 4, 4), randn(5, 3, 3, 3)], dict(pads=[1, 1, 1, 1]),
                                      wrt=[0]))
    fast, report = optimize(onnxgrad.grad(model, wrt=["x0"], of=["y0"]), "cpu", first=1)
    assert report.count("conv_forward_patches") == 0 and not report.reasons("conv_forward_patches")
    assert fast.graph.node[0].op_type == "Conv"


# -- conv_input_grad_flipped ----------------------------------------------------------------------
@pytest.mark.parametrize("kernel, pads", [((3, 3), [1, 1, 1, 1]), ((3, 3), [0, 2, 1, 0]), ((2, 3), [1, 0, 0, 2]),
                                          ((3,), [2, 0])], ids=["3x3", "3x3-asymmetric-pads", "2x3", "1-d"])
def test_conv_input_grad_flipped(kernel, pads):
    """Every spatial axis reversed at once, as the taps' row-major order reversed (non-square kernels too)."""
    image = (5, 6)[:len(kernel)]
    case = Case("Conv", [randn(1, 24, *image), randn(16, 24, *kernel)], attrs=dict(pads=pads), wrt=[0])
    fast = _case(case, "conv_input_grad_flipped")
    assert "ConvTranspose" not in _ops(fast) and _ops(fast).count("Conv") == 2


def test_conv_input_grad_flipped_declines_where_the_conv_transpose_is_faster():
    case = Case("Conv", [randn(1, 8, 5, 6), randn(32, 8, 3, 3)], attrs=dict(pads=[1, 1, 1, 1]), wrt=[0])
    model, _, wrt = case_model(case)
    _, report = optimize(onnxgrad.grad(model, wrt=wrt, of=["y0"]), "cpu", first=1)
    assert report.count("conv_input_grad_flipped") == 0 and "fewer than 16 channels" in report.reasons(
        "conv_input_grad_flipped")[0]


# -- conv_input_grad_col2im ---------------------------------------------------------------------
COL2IM_CASES = [
    Case("Conv", [randn(3, 6, 4, 4), randn(5, 6, 3, 3)], dict(pads=[1, 1, 1, 1]), opset=18, wrt=[0], id="3x3"),
    Case("Conv", [randn(2, 4, 7, 6), randn(3, 4, 3, 2)], dict(strides=[2, 1], pads=[1, 0, 1, 1]), opset=20,
         wrt=[0, 1], id="stride-asymmetric-pads"),
    Case("Conv", [randn(2, 3, 9, 9), randn(4, 3, 3, 3)], dict(dilations=[2, 2], pads=[2, 1, 0, 2]), opset=18,
         wrt=[0], id="dilation"),
    Case("Conv", [randn(2, 4, 5, 5), randn(6, 4, 1, 1)], dict(strides=[2, 2]), opset=18, wrt=[0], id="1x1-stride-2"),
    Case("Conv", [randn(2, 3, 11), randn(4, 3, 3)], dict(pads=[1, 1], strides=[2]), opset=18, wrt=[0], id="1-d"),
]


@pytest.mark.parametrize("case", COL2IM_CASES, ids=str)
def test_conv_input_grad_col2im(case):
    fast = _case(case, "conv_input_grad_col2im")
    assert "ConvTranspose" not in _ops(fast) and "Col2Im" in _ops(fast)


@pytest.mark.parametrize("case, reason", [
    (Case("Conv", [randn(1, 2, 12, 12), randn(3, 2, 3, 3)], dict(pads=[1, 1, 1, 1]), opset=18, wrt=[0]),
     "144 positions"),
    (Case("Conv", [randn(1, 2, 4, 4), randn(3, 2, 3, 3)], dict(pads=[1, 1, 1, 1]), opset=17, wrt=[0]), "opset 18"),
], ids=["many-positions", "opset-17"])
def test_conv_input_grad_col2im_declines_with_a_reason(case, reason):
    _declined(case, "conv_input_grad_col2im", reason, alone=True)


# -- max_pool_taps ---------------------------------------------------------------------------------
@pytest.mark.parametrize("x", [distinct(2, 3, 4, 6), np.random.default_rng(3).integers(0, 3, (2, 3, 4, 6)).astype(
    np.float32)], ids=["distinct", "ties"])
@pytest.mark.parametrize("rewrite", ["max_pool_taps", "max_pool_taps_float"])
def test_max_pool_taps(x, rewrite):
    """2x2 tiles, ties included: exactly the canonical scatter at the Indices (the first maximum), for the cpu
    target's unpool and the webgpu target's float masks."""
    case = Case("MaxPool", [x], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]))
    fast = _case(case, rewrite, exact=True)
    assert len(fast.graph.node[0].output) == 1          # the forward pool computes no Indices
    assert not any(op.startswith("Scatter") for op in _ops(fast))


@pytest.mark.parametrize("attrs, reason", [
    (dict(kernel_shape=[2, 2], strides=[2, 2]), "static and even"),              # 5 x 5: the tiles leave a row
    (dict(kernel_shape=[3, 3], strides=[3, 3]), "not 2x2 windows"),
], ids=["odd", "3x3"])
def test_max_pool_taps_declines_with_a_reason(attrs, reason):
    model, _, wrt = case_model(Case("MaxPool", [distinct(1, 2, 5, 5)], attrs=attrs))
    _, report = optimize(onnxgrad.grad(model, wrt=wrt, of=["y0"]), "cpu", first=1)
    assert report.count("max_pool_taps") == 0 and reason in report.reasons("max_pool_taps")[0]


def test_max_pool_taps_leaves_overlapping_windows_alone():
    """Overlapping windows scatter with reduction='add': not the pattern, the canonical graph stays."""
    model, _, wrt = case_model(Case("MaxPool", [distinct(1, 2, 6, 6)],
                                    attrs=dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])))
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    fast, report = optimize(gm, "cpu", first=1, rewrites=["max_pool_taps"])
    assert not report.applied and not report.declined and _ops(fast) == _ops(gm)


# -- where_zero_as_mul ----------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    Case("Relu", [randn(3, 4)]),
    Case("PRelu", [randn(3, 4), randn(4)], id="zero-first"),     # dslope = Where(x > 0, 0, dy * x)
    Case("Clip", [randn(3, 4), np.array(-0.5, np.float32), np.array(0.5, np.float32)], wrt=[0]),
], ids=str)
def test_where_zero_as_mul(case):
    fast = _case(case, "where_zero_as_mul", exact=True)
    model, _, wrt = case_model(case)
    canonical = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    assert _ops(fast).count("Where") == _ops(canonical).count("Where") - 1 and "Cast" in _ops(fast)


def test_max_pool_taps_unpools_at_the_first_maximum_with_no_where_or_strided_slice():
    """The cpu target's 2x2 MaxPool gradient puts dy at each tile's first maximum with one MaxUnpool: no Where
    (its four Wheres once took bench_step's CNN from 11.0 to 13.7 ms a step, found bisecting issue 33's
    regression) and no strided Slice of x (twice the time of the contiguous splits)."""
    case = Case("MaxPool", [distinct(2, 3, 4, 4)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]))
    model, _, wrt = case_model(case)
    fast, report = optimize(onnxgrad.grad(model, wrt=wrt, of=["y0"]), "cpu", first=1)
    assert [name for name, _ in report.applied] == ["max_pool_taps"], report.applied
    ops = _ops(fast)
    assert ops.count("MaxUnpool") == 1 and "Where" not in ops and "ScatterElements" not in ops
    for node in fast.graph.node:
        if node.op_type == "Slice":
            assert len(node.input) == 4, node.name                     # no steps input: unit steps


def _relu_pool(x: np.ndarray, extra_reader: bool = False) -> tuple[onnx.ModelProto, dict]:
    """z -> Relu -> 2x2 MaxPool -> y0 (and, with ``extra_reader``, the ReLU's output also summed into y1)."""
    N = helper.make_node
    nodes = [N("Relu", ["z"], ["r"], name="relu"), N("MaxPool", ["r"], ["y0"], kernel_shape=[2, 2], strides=[2, 2],
                                                     name="pool")]
    outputs = [helper.make_tensor_value_info("y0", TensorProto.FLOAT, None)]
    if extra_reader:
        nodes.append(N("ReduceSum", ["r"], ["y1"], keepdims=0, name="sum"))
        outputs.append(helper.make_tensor_value_info("y1", TensorProto.FLOAT, None))
    model = make_model(nodes, [helper.make_tensor_value_info("z", TensorProto.FLOAT, list(x.shape))], outputs)
    return onnx.shape_inference.infer_shapes(model), {"z": x}


@pytest.mark.parametrize("z", [randn(2, 3, 4, 6), np.random.default_rng(5).integers(-2, 3, (2, 3, 4, 6)).astype(
    np.float32)], ids=["distinct", "ties-and-zeros"])
def test_relu_max_pool_taps(z):
    """ReLU then a 2x2 MaxPool: the ReLU's mask applied to dy at the pool's resolution gives the canonical
    gradient exactly, ties and all-zero windows (whose maximum is 0: no gradient) included."""
    model, feeds = _relu_pool(z)
    fast = _equivalent(model, feeds, "relu_max_pool_taps", exact=True, wrt=["z"], of=["y0"])
    ops = _ops(fast)
    assert ops.count("MaxUnpool") == 1 and "Where" not in ops and "ScatterElements" not in ops
    greater = next(n for n in fast.graph.node if n.op_type == "Greater")
    assert greater.input[0] != "r"                          # the mask reads the pooled y, not the ReLU's output


def test_relu_max_pool_taps_leaves_a_relu_read_elsewhere_to_max_pool_taps():
    """A ReLU output something besides the pool reads gets the sum of two gradients: the mask stays on it."""
    model, feeds = _relu_pool(randn(2, 3, 4, 6), extra_reader=True)
    gm = onnxgrad.grad(model, wrt=["z"], of=["y0", "y1"])
    fast, report = optimize(gm, "cpu", first=len(model.graph.node))
    assert report.count("relu_max_pool_taps") == 0 and report.count("max_pool_taps") == 1, report.applied
    feeds = _seeded(model, gm, feeds)
    want, got = _run(gm, feeds), _run(fast, feeds)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_max_pool_taps_declines_float64_with_a_reason():
    """onnxruntime's MaxUnpool has no float64 kernel: a double pool keeps the canonical scatter."""
    case = Case("MaxPool", [distinct(2, 3, 4, 4).astype(np.float64)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]))
    model, _, wrt = case_model(case)
    fast, report = optimize(onnxgrad.grad(model, wrt=wrt, of=["y0"]), "cpu", first=1)
    assert report.count("max_pool_taps") == 0 and "float kernel only" in report.reasons("max_pool_taps")[0]
    assert "ScatterElements" in _ops(fast)


def test_where_zero_as_mul_keeps_a_where_that_scrubs_nan():
    """Softmax's gradient zeroes the NaN rows of fully masked attention with Where(IsNaN(y), 0, y): as a
    product the NaN stays, and every gradient of the model (the exported GPT at opset 23, ONNX Attention with
    a causal mask) came out NaN under the CPU target. The rewrite declines it and the gradients are finite."""
    from pathlib import Path

    models = Path(__file__).resolve().parent.parent / "models"
    model = onnxgrad.losses.mse_loss(onnx.load(str(models / "gpt_sdpa_dynamo23.onnx")), output="logits",
                                     target="target")
    z = np.load(models / "gpt_sdpa_dynamo23.npz")
    feeds = {"idx": z["input/idx"], "pos": z["input/pos"], "target": np.zeros((2, 8, 32), np.float32)}
    fast = onnxgrad.grad(model, loss="loss", target="cpu")
    sess = ort.InferenceSession(fast.SerializeToString(), providers=["CPUExecutionProvider"])
    for out, value in zip(sess.get_outputs(), sess.run(None, feeds)):
        assert np.isfinite(value).all(), out.name
    _, report = optimize(onnxgrad.grad(model, loss="loss"), "cpu", first=len(model.graph.node),
                         rewrites=["where_zero_as_mul"])
    assert any("NaN on purpose" in why for _, _, why in report.declined), report.declined


# -- batch_norm_training_as_ops (the cuda target) ----------------------------------------------------
def _bn(*shape):
    c = shape[1]
    return [randn(*shape), randn(c), randn(c), randn(c), randn(c, low=0.5, high=2.0)]


BN_TRAINING_CASES = [
    Case("BatchNormalization", _bn(4, 3), {"training_mode": 1}, opset=15, outputs=3, id="2d"),
    Case("BatchNormalization", _bn(2, 3, 5), {"training_mode": 1, "momentum": 0.7}, opset=15, outputs=3,
         id="3d-momentum"),
    Case("BatchNormalization", _bn(2, 3, 4, 5), {"training_mode": 1, "epsilon": 1e-3, "momentum": 0.0}, opset=15,
         outputs=3, id="4d-momentum0"),
    Case("BatchNormalization", _bn(2, 2, 3, 2, 2), {"training_mode": 1}, opset=18, outputs=3, id="5d-opset18"),
    Case("BatchNormalization", _bn(8, 4, 3, 3), {"training_mode": 1, "momentum": 0.1}, opset=20, outputs=3,
         id="4d-opset20"),
]


@pytest.mark.parametrize("case", BN_TRAINING_CASES, ids=str)
def test_batch_norm_training_as_ops(case):
    """The three outputs (y, the running statistics by ONNX's momentum formula) and the gradient reading them."""
    fast = _case(case, "batch_norm_training_as_ops", rtol=1e-5)
    model, _, _ = case_model(case)
    assert cuda_refusals(model) and cuda_refusals(fast) == [] and "BatchNormalization" not in _ops(fast)
    assert "ReduceMean" in _ops(fast)


def test_batch_norm_training_as_ops_leaves_inference_alone():
    model, _, wrt = case_model(Case("BatchNormalization", _bn(2, 3, 4), opset=15))
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    fast, report = optimize(gm, "cuda", first=1)
    assert not report.applied and not report.declined and _ops(fast) == _ops(gm) and cuda_refusals(gm) == []


# -- targets and plumbing ---------------------------------------------------------------------------
def _small_cnn(batch: int | str = 2) -> tuple[onnx.ModelProto, dict]:
    """conv-bn-relu, overlapping 3x3/2 max-pool, conv, relu, 2x2 max-pool, global pool, linear (``batch`` a name:
    the batch axis symbolic, as an export's dynamic axis; the feeds have 2 images)."""
    rng = np.random.default_rng(0)
    w = {"w1": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
         "s": np.ones(8, np.float32), "b": np.zeros(8, np.float32), "m": np.zeros(8, np.float32),
         "v": np.ones(8, np.float32), "w2": rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2,
         "fc": rng.standard_normal((5, 16)).astype(np.float32) * 0.3}
    N = helper.make_node
    nodes = [N("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             N("BatchNormalization", ["c1", "s", "b", "m", "v"], ["n1"], name="bn1"),
             N("Relu", ["n1"], ["r1"], name="relu1"),
             N("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], name="pool1"),
             N("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
             N("Relu", ["c2"], ["r2"], name="relu2"),
             N("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2], name="pool2"),
             N("GlobalAveragePool", ["p2"], ["g"], name="gap"),
             N("Flatten", ["g"], ["f"], name="flatten"),
             N("Gemm", ["f", "fc"], ["y"], transB=1, name="fc"),
             N("ReduceSumSquare", ["y"], ["loss"], keepdims=0, name="loss")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 16, 16])],
                       [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                       [numpy_helper.from_array(v, k) for k, v in w.items()])
    return model, {"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)}


def test_cpu_target_matches_the_canonical_graph_on_a_network():
    model, feeds = _small_cnn()
    canonical = onnxgrad.grad(model, wrt=["w1", "s", "b", "w2", "fc"], loss="loss")
    fast = onnxgrad.grad(model, wrt=["w1", "s", "b", "w2", "fc"], loss="loss", target="cpu")
    onnx.checker.check_model(fast, full_check=True)
    meta = {p.key: p.value for p in fast.metadata_props}
    for rewrite in ("conv_forward_patches", "conv_weight_grad_patches", "relu_max_pool_taps"):
        assert rewrite in meta["onnxgrad.rewrites"]
    forward = fast.graph.node[:len(fast.graph.node) - len(backward_nodes(fast))]     # forward first
    assert [n.name for n in forward if n.name in {m.name for m in model.graph.node}] == [
        n.name for n in model.graph.node if n.name != "conv2"]
    assert all(n.name.startswith("conv2/conv_forward_patches/") for n in forward if n.name not in {
        m.name for m in model.graph.node})
    want, got = _run(canonical, feeds), _run(fast, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4 * np.abs(want[name]).max())


def test_cpu_rewrites_apply_with_a_symbolic_batch_axis():
    """An export's dynamic batch axis (torch.onnx.export's dynamic_axes) leaves every other dim static: the
    rewrites apply as with a static batch (without them bench_step's CNN and ResNet-18 stepped 1.7x slower),
    and one graph gives the canonical gradients at two batch sizes."""
    model, feeds = _small_cnn(batch="N")
    wrt = ["w1", "s", "b", "w2", "fc"]
    canonical = onnxgrad.grad(model, wrt=wrt, loss="loss")
    fast = onnxgrad.grad(model, wrt=wrt, loss="loss", target="cpu")
    onnx.checker.check_model(fast, full_check=True)
    static = onnxgrad.grad(_small_cnn()[0], wrt=wrt, loss="loss", target="cpu")
    rewrites = json.loads(_metadata(fast)["onnxgrad.rewrites"])
    assert rewrites == json.loads(_metadata(static)["onnxgrad.rewrites"])
    assert {"conv_forward_patches", "conv_weight_grad_patches", "relu_max_pool_taps"} <= set(rewrites)
    for n in (2, 3):
        x = {"x": np.random.default_rng(n).standard_normal((n, 3, 16, 16)).astype(np.float32)}
        want, got = _run(canonical, x), _run(fast, x)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4 * np.abs(want[name]).max(),
                                       err_msg=f"{name}, batch {n}")


def test_depthwise_conv_as_matmul_with_a_symbolic_batch_axis():
    """The lowering applies with the batch axis symbolic, and one graph gives the canonical gradients at two
    batch sizes."""
    model, _, wrt = case_model(DEPTHWISE_CASES[1])
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    del model.graph.value_info[:]
    canonical = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    fast = onnxgrad.grad(model, wrt=wrt, of=["y0"], target="cpu")
    assert json.loads(_metadata(fast)["onnxgrad.lowered"]) == {"depthwise_conv_as_matmul": 1}
    rng = np.random.default_rng(4)
    for n in (1, 3):
        feeds = {"x0": rng.standard_normal((n, 5, 4, 4)).astype(np.float32),
                 **{i.name: rng.standard_normal([d.dim_value or n for d in i.type.tensor_type.shape.dim])
                    .astype(np.float32) for i in canonical.graph.input[1:]}}
        want, got = _run(canonical, feeds), _run(fast, feeds)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-5 * float(np.abs(value).max()),
                                       err_msg=f"{name}, batch {n}")


def test_cpu_rewrites_apply_to_a_dynamo_export():
    """torch.onnx.export writes auto_pad="NOTSET" on every Conv and MaxPool: it is the default, and the rewrites
    that decline other paddings still apply (they read the attribute as text, not as bytes)."""
    from pathlib import Path

    model = onnx.load(Path(__file__).resolve().parents[1] / "models" / "cnn_dynamo.onnx")
    assert all(GraphView.attr(n, "auto_pad") == "NOTSET" for n in model.graph.node if n.op_type in ("Conv", "MaxPool"))
    x = np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32)
    fast = _equivalent(model, {"x": x}, "conv_forward_patches",
                       beside=("conv_weight_grad_patches", "max_pool_taps", "conv_input_grad_col2im"), of=["y"])
    rewrites = json.loads({p.key: p.value for p in fast.metadata_props}["onnxgrad.rewrites"])
    assert rewrites["max_pool_taps"] == 1 and rewrites["conv_input_grad_col2im"] >= 1


def test_targets_by_provider():
    assert target_for(["CPUExecutionProvider"]) == "cpu"
    assert target_for([("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]) == "cuda"
    assert target_for(["SomeOtherExecutionProvider"]) is None and target_for(None) is None
    assert set(TARGETS["cpu"]) <= set(REWRITES) and set(TARGETS["cuda"]) <= set(REWRITES)
    model, _ = _small_cnn()
    with pytest.raises(OnnxGradError, match="unknown optimization target 'tpu'"):
        onnxgrad.grad(model, wrt=["w1"], loss="loss", target="tpu")


def test_training_session_on_cpu_trains_the_rewritten_graph_like_the_canonical(monkeypatch):
    """TrainingSession picks the CPU rewrites by its provider; its steps match a canonical session's."""
    import onnxgrad.training.session
    from onnxgrad import TrainingSession, optim

    model, feeds = _small_cnn()
    fast = TrainingSession(model, loss="loss", optimizer=optim.AdamW(lr=0.01), providers=["CPUExecutionProvider"])
    assert any("/conv_weight_grad_patches/" in n.name for n in fast.artifacts.train.graph.node)
    monkeypatch.setattr(onnxgrad.training.session, "target_for", lambda providers: None)
    canonical = TrainingSession(model, loss="loss", optimizer=optim.AdamW(lr=0.01),
                                providers=["CPUExecutionProvider"])
    assert not any("/conv_weight_grad_patches/" in n.name for n in canonical.artifacts.train.graph.node)
    for _ in range(3):
        np.testing.assert_allclose(fast.step(feeds), canonical.step(feeds), rtol=1e-4)


def _pointwise_conv() -> tuple[onnx.ModelProto, dict]:
    """A 1x1 convolution (weight [6, 3, 1, 1]: a shape whose scalar broadcasts are slow on the CPU provider), then
    a 3x3 one (weight [4, 6, 3, 3]) and a sum of squares."""
    rng = np.random.default_rng(1)
    w = {"pw": rng.standard_normal((6, 3, 1, 1)).astype(np.float32) * 0.5,
         "k": rng.standard_normal((4, 6, 3, 3)).astype(np.float32) * 0.2}
    N = helper.make_node
    nodes = [N("Conv", ["x", "pw"], ["h"], name="pointwise"), N("Relu", ["h"], ["r"], name="relu"),
             N("Conv", ["r", "k"], ["y"], pads=[1, 1, 1, 1], name="conv"),
             N("ReduceSumSquare", ["y"], ["loss"], keepdims=0, name="loss")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 5])],
                       [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                       [numpy_helper.from_array(v, k) for k, v in w.items()])
    return model, {"x": rng.standard_normal((2, 3, 5, 5)).astype(np.float32)}


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD", "Adagrad"])
def test_cpu_update_gives_a_pointwise_weights_scalars_its_rank(monkeypatch, optimizer):
    """The cpu target's update multiplies [6, 3, 1, 1] by scalars reshaped to [1, 1, 1, 1] (a [3, 3] kernel's
    and every canonical update's stay scalars) and steps as the canonical update does."""
    import onnxgrad.training.artifacts
    import onnxgrad.training.session
    from onnxgrad import TrainingSession, optim

    opt = {"AdamW": lambda: optim.AdamW(lr=0.05, weight_decay=0.1),
           "SGD": lambda: optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=True),
           "Adagrad": lambda: optim.Adagrad(lr=0.05, lr_decay=0.01)}[optimizer]
    model, feeds = _pointwise_conv()
    monkeypatch.setattr(onnxgrad.training.artifacts, "FOREACH_MAX_ELEMENTS", 0)   # each tensor its own update

    def reshaped_scalars(s) -> set[str]:
        """The parameters whose update reads a scalar reshaped to rank 4."""
        graph = s.artifacts.train.graph
        nodes = [n for n in graph.node if n.op_type != "If"] + [
            n for g in graph.node if g.op_type == "If" for a in g.attribute if a.name == "then_branch"
            for n in a.g.node]
        reshaped = {n.output[0] for n in nodes if n.op_type == "Reshape" and n.name.startswith("train/optimizer/")}
        return {n.name.split("/")[2] for n in nodes if set(n.input) & reshaped}

    fast = TrainingSession(model, loss="loss", optimizer=opt(), providers=["CPUExecutionProvider"])
    assert reshaped_scalars(fast) == {"pw"}
    onnx.checker.check_model(fast.artifacts.train, full_check=True)
    monkeypatch.setattr(onnxgrad.training.session, "target_for", lambda providers: None)
    canonical = TrainingSession(model, loss="loss", optimizer=opt(), providers=["CPUExecutionProvider"])
    assert reshaped_scalars(canonical) == set()
    for _ in range(3):       # the backward's CPU rewrites sum the gradient in another order: not bit for bit
        np.testing.assert_allclose(fast.step(feeds), canonical.step(feeds), rtol=1e-6)
    for name, value in canonical.parameters().items():
        np.testing.assert_allclose(fast.parameters()[name], value, rtol=1e-6, atol=1e-7)


# -- depthwise_conv_as_matmul (a lowering: applied to the forward before the gradient) -------------------
DEPTHWISE_CASES = [
    Case("Conv", [randn(2, 6, 4, 4), randn(6, 1, 3, 3)], dict(group=6, pads=[1, 1, 1, 1]), id="3x3"),
    Case("Conv", [randn(2, 5, 4, 4), randn(5, 1, 5, 5), randn(5)], dict(group=5, pads=[2, 2, 2, 2]),
         id="5x5-bias"),
    Case("Conv", [randn(3, 4, 7, 6), randn(4, 1, 3, 3)], dict(group=4, strides=[2, 2], pads=[1, 0, 1, 1]),
         id="stride-asymmetric-pads"),
    Case("Conv", [randn(2, 3, 6, 6), randn(3, 1, 3, 2)], dict(group=3, dilations=[2, 1], pads=[2, 1, 0, 0]),
         id="dilation-no-pad-end"),
    Case("Conv", [randn(1, 4, 2, 2), randn(4, 1, 5, 5)], dict(group=4, pads=[2, 2, 2, 2]),
         id="kernel-beyond-the-image"),
]


def _metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _lowered(case: Case) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    model, feeds, wrt = case_model(case)
    canonical = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    return canonical, onnxgrad.grad(model, wrt=wrt, of=["y0"], target="cpu"), _seeded(model, canonical, feeds)


@pytest.mark.parametrize("case", DEPTHWISE_CASES, ids=str)
def test_depthwise_conv_as_matmul(case):
    """The cpu target lowers a depthwise Conv on a small image to MatMuls before the gradient: no Conv nor
    ConvTranspose left, the outputs and every gradient the canonical graph's."""
    canonical, fast, feeds = _lowered(case)
    assert not {"Conv", "ConvTranspose"} & set(_ops(fast)), _ops(fast)
    assert json.loads(_metadata(fast)["onnxgrad.lowered"]) == {"depthwise_conv_as_matmul": 1}
    onnx.checker.check_model(fast, full_check=True)
    want, got = _run(canonical, feeds), _run(fast, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-5 * float(np.abs(value).max()), err_msg=name)


def test_depthwise_conv_as_matmul_declines_a_large_image_and_a_grouped_conv():
    """Above 64 positions the Conv stays (onnxruntime's is faster there), and a grouped Conv that is not
    depthwise (2 channels per group) is not matched."""
    large = Case("Conv", [randn(1, 3, 9, 9), randn(3, 1, 3, 3)], dict(group=3, pads=[1, 1, 1, 1]))
    grouped = Case("Conv", [randn(1, 4, 4, 4), randn(4, 2, 3, 3)], dict(group=2, pads=[1, 1, 1, 1]))
    for case in (large, grouped):
        canonical, fast, feeds = _lowered(case)
        assert "onnxgrad.lowered" not in _metadata(fast) and "Conv" in _ops(fast)
        for name, value in _run(canonical, feeds).items():
            np.testing.assert_allclose(_run(fast, feeds)[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_tap_matrix_is_the_convolution():
    """S[k, p, o] read back as a convolution of an image by a kernel gives numpy's sliding windows."""
    from onnxgrad.passes.optimize.depthwise import tap_matrix

    rng = np.random.default_rng(0)
    image, kernel = rng.standard_normal((5, 4)), rng.standard_normal((3, 2))
    s = tap_matrix((5, 4), (3, 4), (3, 2), [2, 1], [1, 1], [1, 1, 1, 0])     # pads 1 top, 1 left, 0 right
    padded = np.pad(image, ((1, 1), (1, 0)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 2))[::2, ::1]
    want = (windows * kernel).sum(axis=(2, 3))
    got = image.reshape(-1) @ np.tensordot(kernel.reshape(-1), s, axes=1)
    np.testing.assert_allclose(got.reshape(3, 4), want, rtol=1e-12)


# -- the update guard for the cuda target ----------------------------------------------------------------
def _guarded_model(else_op: str) -> onnx.ModelProto:
    """p.next = If(finite) then p - 1 else <else_op>(p): the shape of a guarded training graph's update."""
    f, b = TensorProto.FLOAT, TensorProto.BOOL
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    then = helper.make_graph([helper.make_node("Sub", ["p", "one"], ["p_new"], name="then/sub")], "update", [],
                             [helper.make_tensor_value_info("p_new", f, [3])])
    other = helper.make_graph([helper.make_node(else_op, ["p"], ["p_old"], name="else/keep")], "keep_old_values",
                              [], [helper.make_tensor_value_info("p_old", f, [3])])
    nodes = [helper.make_node("ReduceSum", ["p"], ["s"], keepdims=0, name="sum"),
             helper.make_node("IsNaN", ["s"], ["nan"], name="isnan"),
             helper.make_node("Not", ["nan"], ["finite"], name="not"),
             helper.make_node("If", ["finite"], ["p.next"], then_branch=then, else_branch=other, name="guard")]
    return make_model(nodes, [helper.make_tensor_value_info("p", f, [3])],
                      [helper.make_tensor_value_info("p.next", f, [3]), helper.make_tensor_value_info("finite", b, [])],
                      [one], opset=17)


def test_guard_as_where_keeps_the_guards_values():
    from onnxgrad.passes.optimize.guard import guard_as_where

    model = _guarded_model("Identity")
    rewritten, count = guard_as_where(model, "finite")
    assert count == 1 and "If" not in _ops(rewritten) and "Where" in _ops(rewritten)
    onnx.checker.check_model(rewritten, full_check=True)
    for p in (np.array([1, 2, 3], np.float32), np.array([1, np.nan, 3], np.float32)):
        want, got = _run(model, {"p": p}), _run(rewritten, {"p": p})
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def test_guard_as_where_leaves_an_if_that_is_no_guard_alone():
    from onnxgrad.passes.optimize.guard import guard_as_where

    model = _guarded_model("Neg")          # the else branch computes: not "keep the old values"
    assert guard_as_where(model, "finite") == (model, 0)
