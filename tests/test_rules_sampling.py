"""Gradient checks for the resampling rules (rules/sampling.py).

onnxruntime has no float64 Resize and no float64 GridSample-16, so the harness
differentiates those forwards in onnx.reference; where the reference cannot run
a configuration, the check below probes the forward op's Jacobian instead (the
ops are linear in X, so feeding one-hot inputs reads it off exactly).

GridSample's grid and AffineGrid's theta are tagged NonDifferentiable but get
PyTorch's gradients: checked against central differences (GRID, AFFINE_GRID)
and against torch.nn.functional.grid_sample / affine_grid where torch is installed.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import helper

import harness
import onnxgrad
from harness import Case, randn, run_case
from onnxgrad.errors import UnsupportedOpError
from onnxgrad.tools.check import Runner, to_float64


def f32(*v):
    return np.array(v, np.float32)


def i64(*v):
    return np.array(v, np.int64)


def resize(inputs, attrs, **kw):
    """A Resize case differentiating X only (roi and scales are float, but NonDifferentiable)."""
    return Case("Resize", inputs, attrs, wrt=[0], **kw)


def sample(op, inputs, attrs, **kw):
    """A GridSample / RoiAlign case differentiating X only (the grid / rois are constants here)."""
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
    # round(scale * in) > floor(scale * in): 1.5 * 3 = 4.5 -> 5 rows; 0.75 * 2 = 1.5 -> 2 (onnx's not_smaller case)
    resize([X4, None, None, i64(5, 6)], {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"},
           opset=18, id="keep-ratio-round-up-linear"),
    resize([randn(1, 1, 2, 4), None, None, i64(1, 3)],
           {"mode": "nearest", "axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"}, opset=18,
           id="keep-ratio-round-up-nearest-down"),
    resize([randn(1, 2, 5, 3), None, None, i64(6, 2)],
           {"mode": "cubic", "axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller",
            "coordinate_transformation_mode": "asymmetric"}, opset=18, id="keep-ratio-round-up-cubic"),
    # keep_aspect_ratio_policy with sizes fed at run time (or X's dims unknown): the common scale computed in the
    # graph (onnx's test_resize_*_sizes_nearest_not_larger/not_smaller with their sizes a graph input)
    resize([randn(1, 1, 2, 2), None, None, i64(7, 8)],
           {"mode": "nearest", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}, opset=18, dynamic=[3],
           id="keep-ratio-runtime-sizes-nearest-up"),
    resize([randn(1, 1, 2, 4), None, None, i64(1, 3)],
           {"mode": "nearest", "axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"}, opset=18, dynamic=[3],
           id="keep-ratio-runtime-sizes-round-up-nearest-down"),
    resize([X4, None, None, i64(5, 6)], {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"},
           opset=18, dynamic=[3], id="keep-ratio-runtime-sizes-round-up-linear"),
    resize([randn(1, 1, 4, 5), None, None, i64(5, 9)],   # scale 1.25: 6.25 columns -> 6
           {"mode": "cubic", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}, opset=19, dynamic=[3],
           id="keep-ratio-runtime-sizes-fractional-cubic"),
    resize([randn(1, 2, 2, 4), None, None, i64(5, 6)],
           {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"}, opset=18,
           unknown_shapes=True, id="keep-ratio-unknown-shapes"),
    # align_corners by scales: the corners of the floor(scale * in) outputs onnxruntime and PyTorch make (onnx's
    # test_resize_downsample_scales_*_align_corners; onnx.reference's kernel is corrected, see check/kernels.py)
    resize([randn(1, 1, 2, 4), None, f32(1, 1, 0.6, 0.6)],
           {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, opset=13,
           id="bilinear-align-corners-down-scales"),
    resize([randn(1, 1, 4, 4), None, f32(1, 1, 0.8, 0.8)],
           {"mode": "cubic", "coordinate_transformation_mode": "align_corners"}, opset=13,
           id="cubic-align-corners-down-scales"),
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
    resize([randn(5), None, f32(1.6)], {"mode": "linear"}, opset=18, id="1d",
           reference="onnxruntime's Resize takes no 1-D input in linear mode"),
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


# The grid's gradient (with X's): every mode, padding and align_corners, 4-D and 5-D. Grids stay
# clear of the kinks (integer source coordinates, the borders) by the luck of the draw; cubic
# "border" keeps its grid in bounds (onnxruntime departs from the spec outside, see above).
# Opset 20 and 22 only: onnx.reference, the float64 forward of GridSample-16, rounds coordinates
# to float32, too coarse for central differences in the grid (opset 16: the torch tests below).
def grid_case(x, grid, attrs, opset=20, **kw):
    return Case("GridSample", [x, grid], attrs, opset=opset, **kw)


GRID = [
    grid_case(randn(2, 2, 3, 4), _grid(2, 3, 2, 2, low=-1.6, high=1.6),
              {"mode": mode, "padding_mode": padding, "align_corners": align},
              id=f"{mode}-{padding}{'-align' if align else ''}")
    for mode, padding, align in itertools.product(["linear", "cubic", "nearest"], ["zeros", "border", "reflection"],
                                                  [0, 1])
    if (mode, padding) != ("cubic", "border")
] + [
    grid_case(randn(1, 2, 4, 4), _grid(1, 3, 3, 2, low=-1, high=1), {"mode": "cubic", "padding_mode": "border"},
              id="cubic-border-in-bounds"),
    grid_case(randn(1, 2, 4, 4), _grid(1, 3, 3, 2, low=-1, high=1),
              {"mode": "cubic", "padding_mode": "border", "align_corners": 1}, id="cubic-border-in-bounds-align"),
    grid_case(randn(1, 2, 4, 5), _grid(1, 3, 3, 2, low=-3.5, high=3.5), {"padding_mode": "reflection"},
              id="linear-reflection-several-turns"),
    grid_case(randn(1, 2, 4, 5), _grid(1, 3, 3, 2, low=-3.5, high=3.5),
              {"mode": "cubic", "padding_mode": "reflection", "align_corners": 1}, id="cubic-reflection-several-turns"),
    grid_case(randn(1, 2, 1, 4), _grid(1, 3, 3, 2), {"align_corners": 1}, id="height-1-align"),
    grid_case(randn(1, 2, 2, 3, 4), _grid(1, 2, 2, 3, 3, low=-1.4, high=1.4), {"mode": "linear"}, id="trilinear"),
    grid_case(randn(1, 2, 2, 3, 4), _grid(1, 2, 2, 3, 3, low=-1.4, high=1.4),
              {"mode": "linear", "padding_mode": "border", "align_corners": 1}, opset=22, id="trilinear-border-align"),
    grid_case(randn(1, 2, 2, 3, 4), _grid(1, 2, 2, 3, 3, low=-2.5, high=2.5),
              {"mode": "linear", "padding_mode": "reflection"}, opset=22, id="trilinear-reflection"),
    grid_case(randn(1, 2, 2, 3, 4), _grid(1, 2, 2, 3, 3, low=-1.4, high=1.4), {"mode": "nearest"}, opset=22,
              id="3d-nearest"),
    grid_case(randn(2, 2, 3, 4), _grid(2, 3, 2, 2), {}, unknown_shapes=True, id="dynamic"),
    grid_case(randn(1, 2, 4, 4), _grid(1, 3, 3, 2), {"mode": "cubic", "padding_mode": "reflection"},
              unknown_shapes=True, id="dynamic-cubic"),
]


def affine(theta, size, attrs, **kw):
    """An AffineGrid case: theta (tagged NonDifferentiable) differentiated, the int64 size a constant."""
    return Case("AffineGrid", [theta, size], attrs, opset=20, **kw)


AFFINE_GRID = [
    affine(randn(2, 2, 3), i64(2, 3, 4, 5), {}, id="2d"),
    affine(randn(2, 2, 3), i64(2, 3, 4, 5), {"align_corners": 1}, id="2d-align"),
    affine(randn(1, 2, 3), i64(1, 1, 1, 4), {}, id="2d-height-1"),
    affine(randn(1, 2, 3), i64(1, 1, 1, 4), {"align_corners": 1}, id="2d-height-1-align"),
    affine(randn(2, 3, 4), i64(2, 1, 2, 3, 4), {}, id="3d"),
    affine(randn(1, 3, 4), i64(1, 2, 3, 2, 2), {"align_corners": 1}, id="3d-align"),
    affine(randn(2, 2, 3), i64(2, 3, 4, 5), {"align_corners": 1}, dynamic=[1], unknown_shapes=True,
           id="dynamic"),
    affine(randn(2, 3, 4), i64(2, 1, 2, 3, 4), {}, dynamic=[1], unknown_shapes=True, id="3d-dynamic"),
]


@pytest.mark.parametrize("case", GRID + AFFINE_GRID, ids=str)
def test_beyond_tags(case):
    run_case(case)


def test_nearest_grid_gradient_is_zero():
    """Nearest sampling is piecewise constant in the grid: its gradient is zeros, as PyTorch's."""
    model, feeds, wrt = harness.case_model(grid_case(randn(1, 2, 3, 4), _grid(1, 3, 2, 2), {"mode": "nearest"}))
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    out = Runner(gm)({**feeds, "y0_grad": randn(1, 2, 3, 2)}, ["x0_grad", "x1_grad"])
    assert np.all(out["x1_grad"] == 0) and np.any(out["x0_grad"] != 0)


def test_grid_gradient_cubic_border_out_of_bounds():
    """Cubic "border" out of bounds, where onnxruntime departs from the spec: the grid's gradient
    against central differences of onnx.reference's float64 forward (the spec's semantics).

    The reference rounds source coordinates to float32, so the differences take a step of 1e-3
    and the points sit at least 0.2 pixels from a tap boundary (kinks) and from the borders."""
    pixels = np.array([-2.3, -0.3, 0.4, 1.6, 2.7, 3.3, 4.2, 5.6, 1.25], np.float32)        # 4 pixels wide
    columns, rows = pixels, np.roll(pixels, 3)
    grid = (np.stack([columns, rows], axis=-1) * 2 + 1) / 4 - 1                           # align_corners=0
    case = grid_case(randn(1, 2, 4, 4), grid.reshape(1, 3, 3, 2).astype(np.float32),
                     {"mode": "cubic", "padding_mode": "border"})
    model, feeds, wrt = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    seed = randn(1, 2, 3, 3)
    analytic = Runner(gm)({**feeds, "y0_grad": seed}, ["x1_grad"])["x1_grad"]
    forward = Runner(to_float64(model), runtime="reference", reason="the spec's cubic border: onnx.reference's forward")
    assert forward.backend == "reference"
    x64, grid64 = feeds["x0"].astype(np.float64), feeds["x1"].astype(np.float64)
    numeric = np.zeros_like(grid64)
    h = 1e-3
    for j in range(grid64.size):
        step = np.zeros(grid64.shape)
        step.flat[j] = h
        up, down = (forward({"x0": x64, "x1": grid64 + s})["y0"] for s in (step, -step))
        numeric.flat[j] = np.sum(seed * (up - down)) / (2 * h)
    assert np.sum(numeric == 0) >= 4 and np.sum(numeric != 0) >= 8     # clamped coordinates, and the others
    np.testing.assert_allclose(analytic, numeric, rtol=1e-3, atol=1e-3 * np.max(np.abs(numeric)))


# -- against PyTorch ------------------------------------------------------------------------
TORCH_GRID = [(mode, padding, align, reach)
              for mode, padding, align, reach in itertools.product(
                  ["bilinear", "bicubic", "nearest"], ["zeros", "border", "reflection"], [0, 1], [1.0, 2.5])
              if not (mode == "bicubic" and padding == "border" and reach > 1)]   # see above


@pytest.mark.parametrize("mode, padding, align, reach", TORCH_GRID,
                         ids=["-".join(map(str, c)) for c in TORCH_GRID])
def test_grid_sample_matches_torch(mode, padding, align, reach):
    """X's and the grid's gradients are torch.nn.functional.grid_sample's (opset-16 names, float32)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    grid = rng.uniform(-reach, reach, (2, 3, 2, 2)).astype(np.float32)
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    _assert_matches_torch(grid_case(x, grid, attrs, opset=16), rng, torch,
                          lambda tx, tg: torch.nn.functional.grid_sample(
                              tx, tg, mode=mode, padding_mode=padding, align_corners=bool(align)))


@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_grid_sample_3d_matches_torch(padding):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 2, 3, 4)).astype(np.float32)
    grid = rng.uniform(-1.5, 1.5, (1, 2, 2, 3, 3)).astype(np.float32)
    _assert_matches_torch(grid_case(x, grid, {"mode": "linear", "padding_mode": padding}, opset=22), rng, torch,
                          lambda tx, tg: torch.nn.functional.grid_sample(
                              tx, tg, mode="bilinear", padding_mode=padding, align_corners=False))


@pytest.mark.parametrize("shape, align", [((2, 3, 4, 5), 0), ((2, 3, 4, 5), 1), ((1, 2, 2, 3, 4), 0),
                                          ((1, 2, 2, 3, 4), 1)], ids=["2d", "2d-align", "3d", "3d-align"])
def test_affine_grid_matches_torch(shape, align):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    spatial = len(shape) - 2
    theta = rng.standard_normal((shape[0], spatial, spatial + 1)).astype(np.float32)
    _assert_matches_torch(affine(theta, i64(*shape), {"align_corners": align}), rng, torch,
                          lambda t: torch.nn.functional.affine_grid(t, list(shape), align_corners=bool(align)))


def _assert_matches_torch(case, rng, torch, forward) -> None:
    """The case's output and the gradients of its float inputs, onnxgrad in onnxruntime against torch autograd."""
    model, feeds, wrt = harness.case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    y = Runner(model)(feeds)["y0"]
    seed = rng.standard_normal(y.shape).astype(np.float32)
    got = Runner(gm)({**feeds, "y0_grad": seed})
    tensors = [torch.tensor(feeds[name], requires_grad=True) for name in wrt]
    out = forward(*tensors)
    np.testing.assert_allclose(y, out.detach().numpy(), rtol=1e-5, atol=1e-5)
    want = torch.autograd.grad(out, tensors, torch.tensor(seed))
    for name, w in zip(wrt, want):
        np.testing.assert_allclose(got[f"{name}_grad"], w.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


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
           opset=16, dynamic=[1, 2], unknown_shapes=True, id="dynamic-adaptive"),
    # max mode: the gradient goes to the largest weighted tap of the bin's samples
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois(), i64(0, 1, 1)],
           {"mode": "max", "output_height": 2, "output_width": 3, "sampling_ratio": 2}, opset=16, id="max-ratio2"),
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois(), i64(1, 0, 1)],
           {"mode": "max", "output_height": 2, "output_width": 2}, opset=16, id="max-adaptive"),
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois() * 2, i64(0, 1, 0)],
           {"mode": "max", "output_height": 3, "output_width": 2, "sampling_ratio": 1, "spatial_scale": 0.5,
            "coordinate_transformation_mode": "output_half_pixel"}, opset=16, id="max-output-half-pixel"),
    sample("RoiAlign", [randn(2, 2, 6, 5), _rois(), i64(0, 1, 1)], {"mode": "max", "output_height": 2},
           opset=16, dynamic=[1, 2], unknown_shapes=True, id="max-dynamic-adaptive"),
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
    run_fwd = Runner(model, runtime="onnxruntime") if forward == "onnxruntime" else Runner(
        model, runtime="reference", reason="the spec's semantics: onnx.reference's forward")
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
    assert onnxgrad.tools.check.check(model, gm, {"x": randn(2, 5, 3, 4)}).ok(2e-3)


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
    (resize([X4, None, None, i64(5, 6)], {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger",
                                          "coordinate_transformation_mode": "align_corners"},
            opset=18, id="keep-ratio-round-up-align-corners"), "keep_aspect_ratio_policy"),
    (resize([X4, None, None, i64(5, 6)], {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger",
                                          "coordinate_transformation_mode": "half_pixel_symmetric"},
            opset=18, dynamic=[3], id="keep-ratio-runtime-sizes-half-pixel-symmetric"),
     "keep_aspect_ratio_policy and sizes or input dims known only at run time"),
    (sample("RoiAlign", [randn(1, 1, 4, 4), _rois(), i64(0, 0, 0)], {"mode": "max"}, opset=13, id="roi-max-13"),
     "mode='max' below opset 16"),
], ids=lambda v: getattr(v, "id", ""))
def test_unsupported(case, reason):
    model, _, wrt = harness.case_model(case)
    with pytest.raises(UnsupportedOpError, match=reason):
        onnxgrad.grad(model, wrt=wrt, of=["y0"])


def test_align_corners_scales_truth_follows_onnxruntime():
    """Under align_corners with scales, the float64 truth (onnx.reference with the corrected kernel) maps the
    corners of the floor(scale * in) outputs onto the input's corners, as onnxruntime and PyTorch do: x [2, 4]
    scaled by 0.6 gives [1, 2] outputs, x[0, 0] and x[0, 3] (onnx.reference alone reads 3.14 for the second)."""
    for x, scale, mode in ((np.arange(1.0, 9.0, dtype=np.float32).reshape(1, 1, 2, 4), 0.6, "linear"),
                           (randn(1, 1, 4, 4), 0.8, "cubic")):
        case = resize([x, None, f32(1, 1, scale, scale)],
                      {"mode": mode, "coordinate_transformation_mode": "align_corners"}, opset=13)
        model, feeds, _ = harness.case_model(case)
        runtime = Runner(model)(feeds)["y0"]
        truth = Runner(to_float64(model), runtime="reference", reason="the corrected Resize kernel under test")(
            {k: v.astype(np.float64) for k, v in feeds.items()})["y0"]
        np.testing.assert_allclose(truth, runtime, rtol=1e-5, atol=1e-5, err_msg=mode)
        if mode == "linear":
            np.testing.assert_allclose(truth.ravel(), [x[0, 0, 0, 0], x[0, 0, 0, 3]])
