"""Gradient checks for the resampling rules (onnxgrad/rules/sampling.py).

onnxruntime has no float64 Resize and no float64 GridSample-16, so the harness
differentiates those forwards in onnx.reference; where the reference cannot run
a configuration, the check below probes the forward op's Jacobian instead (the
ops are linear in X, so feeding one-hot inputs reads it off exactly).
"""
import numpy as np
import onnx
import pytest
from onnx import helper

import harness
import onnxgrad
from harness import Case, randn, run_case
from onnxgrad.check import Runner
from onnxgrad.errors import UnsupportedOpError


def f32(*v):
    return np.array(v, np.float32)


def i64(*v):
    return np.array(v, np.int64)


def resize(inputs, attrs, **kw):
    """A Resize case differentiating X only (roi and scales are float, but NonDifferentiable)."""
    return Case("Resize", inputs, attrs, wrt=[0], **kw)


def sample(op, inputs, attrs, **kw):
    """A GridSample / RoiAlign case differentiating X only (grid and rois get no gradient)."""
    return Case(op, inputs, attrs, wrt=[0], **kw)


X4 = randn(1, 2, 3, 4)

RESIZE = [
    # nearest, every nearest_mode
    resize([X4, None, f32(1, 1, 2, 2)], {"mode": "nearest"}, opset=13, id="nearest-up2"),
    resize([X4, None, f32(1, 1, 1.5, 0.5)],
           {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
           opset=13, id="nearest-floor-asymmetric"),
    resize([X4, None, f32(1, 1, 2.5, 1.5)],
           {"mode": "nearest", "coordinate_transformation_mode": "align_corners", "nearest_mode": "ceil"},
           opset=18, id="nearest-ceil-align-corners"),
    resize([X4, None, None, i64(1, 2, 5, 7)], {"mode": "nearest", "nearest_mode": "round_prefer_ceil"},
           opset=19, id="nearest-round-prefer-ceil-sizes"),
    resize([X4, None, f32(1, 1, 0.5, 0.5)],
           {"mode": "nearest", "coordinate_transformation_mode": "pytorch_half_pixel"}, opset=13,
           id="nearest-down"),
    # linear
    resize([X4, None, f32(1, 1, 2, 2)], {"mode": "linear"}, opset=13, id="bilinear-up2"),
    resize([X4, None, f32(1, 1, 0.5, 0.75)], {"mode": "linear"}, opset=13, id="bilinear-down"),
    resize([X4, None, None, i64(1, 2, 5, 3)], {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
           opset=13, id="bilinear-align-corners-sizes"),
    resize([X4, None, f32(1, 1, 2, 1.5)], {"mode": "linear", "coordinate_transformation_mode": "asymmetric"},
           opset=18, id="bilinear-asymmetric"),
    resize([X4, None, None, i64(1, 2, 1, 6)],
           {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, opset=18,
           id="bilinear-pytorch-half-pixel"),
    resize([X4, None, f32(1, 1, 1.5, 1.5)],
           {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"}, opset=19,
           id="bilinear-half-pixel-symmetric"),
    resize([randn(1, 1, 2, 3, 4), None, f32(1, 1, 2, 1.5, 0.5)], {"mode": "linear"}, opset=13, id="trilinear"),
    # cubic
    resize([X4, None, f32(1, 1, 2, 1.5)], {"mode": "cubic"}, opset=13, id="cubic"),
    resize([X4, None, f32(1, 1, 1.5, 0.75)], {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1},
           opset=18, id="cubic-exclude-outside"),
    resize([X4, None, None, i64(1, 2, 4, 4)], {"mode": "cubic", "coordinate_transformation_mode": "align_corners"},
           opset=19, id="cubic-align-corners-sizes"),
    # tf_crop_and_resize: roi (NonDifferentiable), extrapolation outside it
    resize([X4, f32(0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2), None, i64(1, 2, 4, 5)],
           {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 3.0},
           opset=13, id="tf-crop-and-resize"),
    resize([X4, f32(0.1, 0.3, 0.8, 0.7), f32(2, 1.5)],
           {"mode": "nearest", "coordinate_transformation_mode": "tf_crop_and_resize", "axes": [2, 3]},
           opset=18, id="tf-crop-and-resize-axes"),
    # antialias (opset 18)
    resize([randn(1, 1, 6, 8), None, f32(1, 1, 0.5, 0.375)], {"mode": "linear", "antialias": 1}, opset=18,
           id="antialias-linear"),
    resize([randn(1, 1, 6, 8), None, f32(1, 1, 0.5, 0.75)], {"mode": "cubic", "antialias": 1}, opset=18,
           id="antialias-cubic"),
    # axes (opset 18), keep_aspect_ratio_policy
    resize([X4, None, f32(2, 1.5)], {"mode": "linear", "axes": [2, 3]}, opset=18, id="axes"),
    resize([X4, None, f32(2)], {"mode": "nearest", "axes": [1]}, opset=18, id="axes-channel"),
    resize([randn(1, 2, 2, 4), None, None, i64(5, 6)],
           {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}, opset=18,
           id="keep-ratio-not-larger"),
    resize([randn(1, 2, 2, 4), None, None, i64(5, 6)],
           {"mode": "nearest", "axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"}, opset=18,
           id="keep-ratio-not-smaller"),
    resize([randn(1, 1, 4, 5), None, None, i64(5, 9)],   # scale 1.25: 6.25 columns -> 6
           {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}, opset=19,
           id="keep-ratio-fractional"),
    # nearest upsampling by integer factors: block sums (and one that is not: s=3, rounding)
    resize([X4, None, f32(1, 1, 3, 2)],
           {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
           opset=13, id="nearest-block-asymmetric-floor"),
    resize([X4, None, None, i64(1, 2, 6, 12)],
           {"mode": "nearest", "coordinate_transformation_mode": "pytorch_half_pixel"}, opset=13,
           id="nearest-block-pytorch-half-pixel"),
    resize([randn(2, 3, 2), None, f32(3, 1, 2)], {"mode": "nearest", "nearest_mode": "round_prefer_ceil"},
           opset=13, id="nearest-block-leading-axis"),
    resize([X4, None, f32(1, 1, 3, 3)],
           {"mode": "nearest", "coordinate_transformation_mode": "asymmetric"}, opset=13,
           id="nearest-asymmetric-round-factor3"),
    resize([X4, None, f32(1, 1, 2, 2)], {"mode": "nearest", "nearest_mode": "floor"}, opset=13,
           id="nearest-half-pixel-floor-factor2"),
    # leading axes (contracted through a Reshape), 2-D and 1-D inputs
    resize([randn(3, 2, 4), None, f32(2, 1, 1.5)], {"mode": "nearest"}, opset=13, id="3d-axis0"),
    resize([randn(3, 4), None, f32(2, 0.5)], {"mode": "linear"}, opset=13, id="2d"),
    resize([randn(5), None, f32(1.6)], {"mode": "linear"}, opset=18, id="1d"),
    resize([X4, None, f32(1, 1, 1.5, 2)], {"mode": "cubic", "antialias": 1}, opset=26, id="opset26"),
    # unknown shapes, run-time scales, sizes and roi
    resize([X4, None, f32(1, 1, 2, 1.5)], {"mode": "linear"}, opset=13, unknown_shapes=True, id="dynamic"),
    resize([X4, None, f32(1, 1, 2, 1.5)], {"mode": "cubic"}, opset=18, dynamic=[2], id="runtime-scales"),
    # (a sizes input of unknown length fails onnx's strict shape inference, so X's shape is known)
    resize([randn(2, 3, 4), None, None, i64(3, 3, 6)], {"mode": "nearest"}, opset=13, dynamic=[3],
           id="runtime-sizes"),
    resize([X4, None, None, i64(1, 2, 5, 3)], {"mode": "linear"}, opset=18, dynamic=[3],
           id="runtime-sizes-linear"),
    resize([X4, f32(0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2), None, i64(1, 2, 4, 5)],
           {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}, opset=13, dynamic=[1],
           id="runtime-roi"),
]


def _grid(*shape, low=-1.2, high=1.2):
    return randn(*shape, low=low, high=high)


# Mode names: bilinear/bicubic at opset 16, linear/cubic from 20. onnx.reference knows only the
# new names, so opset-16 cases leave the mode at its default or use nearest (see also below).
GRID_SAMPLE = [
    sample("GridSample", [randn(2, 2, 3, 4), _grid(2, 3, 2, 2)], {}, opset=16, id="bilinear-zeros"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2)], {"align_corners": 1}, opset=16,
           id="bilinear-zeros-align"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2, low=-1.6, high=1.6)], {"padding_mode": "border"},
           opset=16, id="bilinear-border"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2, low=-2.5, high=2.5)],
           {"padding_mode": "reflection"}, opset=16, id="bilinear-reflection"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2, low=-2.5, high=2.5)],
           {"padding_mode": "reflection", "align_corners": 1}, opset=16, id="bilinear-reflection-align"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2)], {"mode": "nearest"}, opset=16,
           id="nearest-zeros"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2, low=-2, high=2)],
           {"mode": "nearest", "padding_mode": "border"}, opset=16, id="nearest-border"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2, low=-2.5, high=2.5)],
           {"mode": "nearest", "padding_mode": "reflection", "align_corners": 1}, opset=16,
           id="nearest-reflection-align"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2, low=-1.6, high=1.6)], {"mode": "linear"},
           opset=20, id="opset20-linear"),
    sample("GridSample", [randn(1, 2, 4, 4), _grid(1, 3, 3, 2, low=-2.5, high=2.5)], {"mode": "cubic"},
           opset=20, id="opset20-cubic-zeros"),
    sample("GridSample", [randn(1, 2, 4, 4), _grid(1, 3, 3, 2, low=-2.5, high=2.5)],
           {"mode": "cubic", "padding_mode": "reflection", "align_corners": 1}, opset=20,
           id="opset20-cubic-reflection"),
    # onnxruntime's cubic "border" clamps the taps but not the coordinate, unlike the spec's
    # "border values for out-of-bound grid locations" (onnx.reference): in-bound grid here,
    # out of bounds against onnx.reference in test_grid_sample_jacobian
    sample("GridSample", [randn(1, 2, 4, 4), _grid(1, 3, 3, 2, low=-1, high=1)],
           {"mode": "cubic", "padding_mode": "border"}, opset=20, id="opset20-cubic-border"),
    sample("GridSample", [randn(1, 2, 2, 3, 4), _grid(1, 2, 2, 3, 3)], {"mode": "linear"}, opset=20,
           id="opset20-trilinear"),
    sample("GridSample", [randn(1, 2, 2, 3, 4), _grid(1, 2, 2, 3, 3, low=-2, high=2)],
           {"mode": "nearest", "padding_mode": "reflection"}, opset=22, id="opset22-3d-nearest"),
    sample("GridSample", [randn(1, 2, 3, 4), _grid(1, 4, 3, 2, low=-2.5, high=2.5)],
           {"padding_mode": "reflection"}, opset=26, id="opset26"),
    sample("GridSample", [randn(2, 2, 3, 4), _grid(2, 3, 2, 2)], {}, opset=16, dynamic=[1],
           unknown_shapes=True, id="dynamic"),
    sample("GridSample", [randn(1, 2, 4, 4), _grid(1, 3, 3, 2)], {"mode": "cubic"}, opset=20, dynamic=[1],
           unknown_shapes=True, id="dynamic-cubic"),
]


def _rois():
    # boxes (x1, y1, x2, y2) in input pixels: inside, reaching over the border, and small
    return f32(0.5, 0.5, 4.5, 3.5,
               -1.5, 2.0, 3.0, 7.5,
               2.2, 1.1, 3.0, 2.9).reshape(3, 4)


ROI_ALIGN = [
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois(), i64(0, 1, 1)],
           {"output_height": 2, "output_width": 3, "sampling_ratio": 2}, opset=16, id="ratio2"),
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois(), i64(1, 0, 1)],
           {"output_height": 2, "output_width": 2, "sampling_ratio": 0}, opset=16, id="adaptive"),
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois() * 2, i64(0, 1, 0)],
           {"output_height": 3, "output_width": 2, "sampling_ratio": 1, "spatial_scale": 0.5,
            "coordinate_transformation_mode": "output_half_pixel"}, opset=16, id="output-half-pixel"),
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois(), i64(0, 1, 1)], {"output_height": 2, "output_width": 2},
           opset=22, dynamic=[1, 2], unknown_shapes=True, id="dynamic-adaptive"),
    # below opset 16 (RoiAlign-10, output_half_pixel): rules/nn.py's dense form
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois(), i64(0, 1, 1)],
           {"output_height": 2, "output_width": 3, "sampling_ratio": 2}, opset=13, id="opset13"),
]


@pytest.mark.parametrize("case", RESIZE + GRID_SAMPLE + ROI_ALIGN, ids=str)
def test_rule(case):
    run_case(case)


# -- where the harness's float64 forward cannot run: Jacobians probed with one-hot inputs ----
def _jacobians(case, forward):
    """(forward Jacobian probed with one-hot x, the gradient graph's, run in onnxruntime float32)."""
    model, feeds, wrt = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    onnx.checker.check_model(gm, full_check=True)
    x = feeds["x0"]
    run_fwd = Runner(model) if forward == "onnxruntime" else Runner(model, prefer="reference")
    assert run_fwd.backend == forward
    y = run_fwd(feeds)["y0"]
    fwd = np.zeros((y.size, x.size))
    for j in range(x.size):
        e = np.zeros(x.size, np.float32)
        e[j] = 1
        fwd[:, j] = run_fwd({**feeds, "x0": e.reshape(x.shape)})["y0"].ravel()
    run_grad = Runner(gm)
    back = np.zeros_like(fwd)
    for o in range(y.size):
        seed = np.zeros(y.size, np.float32)
        seed[o] = 1
        back[o] = run_grad({**feeds, "y0_grad": seed.reshape(y.shape)}, ["x0_grad"])["x0_grad"].ravel()
    return fwd, back


JACOBIAN = [
    # explicit opset-16 names, which onnx.reference does not know: onnxruntime's float32 forward
    (sample("GridSample", [randn(1, 1, 3, 4), _grid(1, 3, 2, 2)], {"mode": "bilinear", "padding_mode": "border"},
            opset=16, id="bilinear-opset16"), "onnxruntime"),
    (sample("GridSample", [randn(1, 1, 4, 4), _grid(1, 3, 3, 2, low=-1, high=1)], {"mode": "bicubic"},
            opset=16, id="bicubic-opset16"), "onnxruntime"),
    (sample("GridSample", [randn(1, 1, 4, 4), _grid(1, 3, 3, 2, low=-2.5, high=2.5)],
            {"mode": "bicubic", "padding_mode": "reflection"}, opset=16, id="bicubic-reflection-opset16"),
     "onnxruntime"),
    # cubic "border" out of bounds: the spec's semantics, onnx.reference's forward (see above)
    (sample("GridSample", [randn(1, 1, 4, 4), _grid(1, 3, 3, 2, low=-2.5, high=2.5)],
            {"mode": "cubic", "padding_mode": "border"}, opset=20, id="cubic-border-out-of-bounds"), "reference"),
]


@pytest.mark.parametrize("case, forward", JACOBIAN, ids=[str(c) for c, _ in JACOBIAN])
def test_grid_sample_jacobian(case, forward):
    fwd, back = _jacobians(case, forward)
    assert np.max(np.abs(fwd - back)) < 1e-5 * max(1.0, np.max(np.abs(fwd)))


@pytest.mark.parametrize("attrs, block", [
    ({"mode": "nearest"}, True),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, True),
    ({"mode": "nearest", "nearest_mode": "floor"}, False),
    ({"mode": "linear"}, False),
])
def test_resize_integer_nearest_upsampling_is_a_block_sum(attrs, block):
    model, _, wrt = harness.case_model(resize([X4, None, f32(1, 1, 2, 2)], attrs, opset=13))
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    ops = {node.op_type for node in gm.graph.node}
    assert ("MatMul" not in ops and "ReduceSum" in ops) == block


def test_resize_sizes_from_shape_skip_unchanged_axes():
    """sizes = Concat(Shape(x)[:2], [6, 8]): N and C are known unchanged, only H and W are contracted."""
    nodes = [
        helper.make_node("Shape", ["x"], ["nc"], start=0, end=2),
        helper.make_node("Constant", [], ["hw"], value=onnx.numpy_helper.from_array(i64(6, 8))),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 5, 3, 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None] * 4)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    gm = onnxgrad.grad(model, wrt=["x"], of=["y"])
    assert sum(node.op_type == "MatMul" for node in gm.graph.node) == 2
    assert onnxgrad.check.check(model, gm, {"x": randn(2, 5, 3, 4)}).ok(2e-3)


def test_resize_negative_axes():
    """onnx.reference's Resize rejects negative axes: the gradient must equal the one for axes=[3]."""
    x, seed = randn(1, 2, 3, 4), randn(1, 2, 3, 2)
    grads = []
    for axes in ([-1], [3]):
        case = resize([x, None, f32(0.5)], {"mode": "linear", "axes": axes}, opset=18)
        model, feeds, wrt = harness.case_model(case)
        gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
        grads.append(Runner(gm)({**feeds, "y0_grad": seed}, ["x0_grad"])["x0_grad"])
    np.testing.assert_array_equal(grads[0], grads[1])
    assert np.any(grads[0] != 0)


@pytest.mark.parametrize("case, reason", [
    (resize([X4, None, None, i64(5, 6)], {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"},
            opset=18, id="keep-ratio-round-up"), "keep_aspect_ratio_policy"),
    (sample("RoiAlign", [randn(1, 1, 4, 4), _rois(), i64(0, 0, 0)], {"mode": "max"}, opset=16, id="roi-max"),
     "max mode"),
], ids=lambda v: getattr(v, "id", ""))
def test_unsupported(case, reason):
    model, _, wrt = harness.case_model(case)
    with pytest.raises(UnsupportedOpError, match=reason):
        onnxgrad.grad(model, wrt=wrt, of=["y0"])
