"""Gradient checks for convolution and pooling (rules/nn.py).

The numeric truth is central differences of the float64 forward, run by onnxruntime where it
has float64 kernels (MaxPool, RoiAlign, DeformConv) and by onnx.reference otherwise. Some
onnx.reference kernels are wrong or missing for these ops; onnxgrad/tools/check/kernels.py corrects them
for the checker, and ``test_forward_matches_onnxruntime`` checks every case's forward
(fixes included) against onnxruntime's float32 kernels, so the truth is what users run.
Window configurations where onnxruntime and onnx.reference disagree (ConvTranspose with a
negative total padding, AveragePool with ceil_mode and auto_pad or dilations) are left out:
the rules follow onnxruntime there.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxgrad
from harness import Case, case_model, distinct, randn, run_case
from onnxgrad.errors import UnsupportedOpError
from onnxgrad.rules import nn, registry
from onnxgrad.tools.check import Runner, check, gradient_spec, to_float64


# -- cases ----------------------------------------------------------------------------------
def _indices(x: np.ndarray, **attrs) -> np.ndarray:
    """MaxPool's Indices from onnxruntime (MaxUnpool's input)."""
    node = onnx.helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))],
        [onnx.helper.make_empty_tensor_value_info("y"), onnx.helper.make_empty_tensor_value_info("i")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 9
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[1]


def _offsets(*shape: int) -> np.ndarray:
    """DeformConv offsets at least 0.23 from an integer (bilinear sampling has kinks there)."""
    return (np.round(randn(*shape, low=-1.6, high=1.6) * 2) / 2 + 0.23).astype(np.float32)


_ROIS = np.array([[0.3, 0.7, 4.1, 3.6], [1.2, 0.4, 5.3, 4.9], [-0.6, 2.2, 3.7, 6.8],
                  [2.1, 1.1, 2.9, 1.8], [4.6, 3.2, 9.0, 8.4]], np.float32)       # (x1, y1, x2, y2)
_ROI_BATCH = np.array([1, 0, 1, 1, 0], np.int64)
_BATCHED_ROIS = np.concatenate([_ROI_BATCH[:, None].astype(np.float32), _ROIS], axis=1)

CASES = [
    # Conv
    Case("Conv", [randn(2, 3, 7), randn(4, 3, 3), randn(4)], id="1d-bias"),
    Case("Conv", [randn(1, 2, 5, 6), randn(3, 2, 3, 2)], attrs=dict(strides=[2, 2], pads=[1, 0, 1, 1]),
         id="2d-stride-pads"),
    Case("Conv", [randn(1, 2, 7, 6), randn(3, 2, 2, 3)], attrs=dict(strides=[3, 2], dilations=[2, 1]),
         id="stride-not-dividing"),
    Case("Conv", [randn(2, 4, 6, 5), randn(6, 2, 3, 3), randn(6)], attrs=dict(group=2, pads=[1, 1, 1, 1]),
         id="group"),
    Case("Conv", [randn(2, 3, 6, 5), randn(3, 1, 3, 3)], attrs=dict(group=3, strides=[2, 2]), id="depthwise"),
    Case("Conv", [randn(2, 2, 6, 5), randn(4, 1, 3, 2)], attrs=dict(group=2, dilations=[2, 1]),
         id="depthwise-multiplier"),
    Case("Conv", [randn(1, 2, 7, 6), randn(3, 2, 3, 3)], attrs=dict(auto_pad="SAME_UPPER", strides=[2, 2]),
         id="same-upper"),
    Case("Conv", [randn(1, 2, 6, 7), randn(3, 2, 2, 4)], attrs=dict(auto_pad="SAME_LOWER", strides=[2, 3]),
         id="same-lower"),
    Case("Conv", [randn(1, 3, 6, 7), randn(2, 3, 1, 1)], attrs=dict(auto_pad="SAME_UPPER", strides=[2, 2]),
         id="same-1x1-stride2"),
    Case("Conv", [randn(1, 2, 7, 6), randn(3, 2, 3, 2)], attrs=dict(auto_pad="VALID", strides=[2, 2]), id="valid"),
    Case("Conv", [randn(1, 2, 4, 4, 5), randn(2, 2, 2, 2, 3), randn(2)],
         attrs=dict(strides=[1, 2, 2], pads=[0, 1, 1, 1, 0, 1]), id="3d"),
    Case("Conv", [randn(1, 4, 3, 4, 4), randn(4, 2, 2, 2, 2)], attrs=dict(group=2, strides=[1, 2, 1]),
         id="3d-group"),
    Case("Conv", [randn(1, 2, 6, 5), randn(3, 2, 3, 3)], attrs=dict(pads=[1, 1, 1, 1]), opset=13, id="opset13"),
    Case("Conv", [randn(2, 2, 7, 6), randn(3, 2, 3, 3), randn(3)],
         attrs=dict(strides=[2, 2], pads=[1, 1, 0, 0], kernel_shape=[3, 3]), unknown_shapes=True, id="dynamic"),
    Case("Conv", [randn(2, 4, 7, 6), randn(4, 2, 3, 3)],
         attrs=dict(strides=[2, 3], group=2, auto_pad="SAME_UPPER", kernel_shape=[3, 3]), unknown_shapes=True,
         id="dynamic-same-group"),
    Case("Conv", [randn(1, 2, 7, 6), randn(3, 2, 3, 2)],
         attrs=dict(auto_pad="SAME_LOWER", kernel_shape=[3, 2]), unknown_shapes=True, id="dynamic-same-stride1"),
    # SAME with a stride larger than the kernel: pads computed (and clamped at 0) at run time
    Case("Conv", [randn(1, 3, 7, 7), randn(2, 3, 1, 1)], attrs=dict(auto_pad="SAME_UPPER", strides=[2, 2]),
         id="same-stride-over-kernel"),
    Case("Conv", [randn(1, 3, 7, 7), randn(2, 3, 1, 1), randn(2)],
         attrs=dict(auto_pad="SAME_UPPER", strides=[2, 2], kernel_shape=[1, 1]), unknown_shapes=True,
         id="dynamic-same-stride-over-kernel"),
    Case("Conv", [randn(2, 2, 8, 7), randn(3, 2, 1, 2)],
         attrs=dict(auto_pad="SAME_LOWER", strides=[3, 3], kernel_shape=[1, 2]), unknown_shapes=True,
         id="dynamic-same-lower-negative-total"),
    Case("Conv", [randn(1, 4, 7, 8), randn(4, 2, 2, 1)],
         attrs=dict(auto_pad="SAME_UPPER", strides=[3, 2], group=2, kernel_shape=[2, 1]), unknown_shapes=True,
         id="dynamic-same-stride-over-kernel-group"),
    # ConvTranspose
    Case("ConvTranspose", [randn(2, 3, 4), randn(3, 2, 3), randn(2)], id="1d-bias"),
    Case("ConvTranspose", [randn(1, 2, 3, 4), randn(2, 3, 3, 2)],
         attrs=dict(strides=[2, 3], pads=[1, 0, 1, 1], output_padding=[1, 2]), id="output-padding"),
    Case("ConvTranspose", [randn(1, 4, 3, 3), randn(4, 1, 2, 3), randn(2)],
         attrs=dict(group=2, strides=[2, 1], dilations=[1, 2]), id="group-dilations"),
    Case("ConvTranspose", [randn(1, 2, 3, 3), randn(2, 2, 3, 3)],
         attrs=dict(strides=[2, 2], output_shape=[6, 5], auto_pad="SAME_LOWER"), id="output-shape"),
    Case("ConvTranspose", [randn(1, 2, 3, 3), randn(2, 2, 3, 2)], attrs=dict(strides=[2, 2], auto_pad="SAME_UPPER"),
         id="same-upper"),
    Case("ConvTranspose", [randn(1, 2, 3, 3), randn(2, 2, 3, 3)], attrs=dict(strides=[2, 2], auto_pad="SAME_LOWER"),
         id="same-lower"),
    Case("ConvTranspose", [randn(1, 2, 3, 3), randn(2, 2, 2, 3)], attrs=dict(strides=[1, 2], auto_pad="VALID"),
         id="valid"),
    Case("ConvTranspose", [randn(1, 2, 2, 3, 2), randn(2, 1, 2, 2, 3)],
         attrs=dict(strides=[2, 1, 2], pads=[0, 1, 1, 1, 0, 1]), id="3d"),
    Case("ConvTranspose", [randn(2, 2, 3, 4), randn(2, 2, 3, 3)],
         attrs=dict(strides=[2, 2], pads=[1, 1, 0, 1], output_padding=[1, 0], kernel_shape=[3, 3]),
         unknown_shapes=True, id="dynamic"),
    # MaxPool (distinct values: no ties)
    Case("MaxPool", [distinct(2, 3, 6, 6)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]), id="2x2"),
    Case("MaxPool", [distinct(2, 3, 6, 6)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]), opset=13,
         id="2x2-opset13"),
    Case("MaxPool", [distinct(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
         id="overlap"),
    Case("MaxPool", [distinct(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
         opset=13, id="overlap-opset13"),
    Case("MaxPool", [distinct(1, 2, 7, 7)], attrs=dict(kernel_shape=[3, 2], dilations=[2, 1], pads=[1, 0, 0, 1]),
         opset=15, id="dilations-opset15"),
    Case("MaxPool", [distinct(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), id="ceil"),
    Case("MaxPool", [distinct(1, 2, 9)], attrs=dict(kernel_shape=[3], strides=[2], auto_pad="SAME_UPPER"),
         id="1d-same"),
    Case("MaxPool", [distinct(1, 2, 4, 4, 5)], attrs=dict(kernel_shape=[2, 2, 3], strides=[2, 2, 2]), id="3d"),
    Case("MaxPool", [distinct(1, 2, 6, 5)], attrs=dict(kernel_shape=[2, 2], strides=[2, 1], storage_order=1),
         outputs=2, id="storage-order-with-indices"),
    Case("MaxPool", [distinct(2, 3, 6, 6)], attrs=dict(kernel_shape=[3, 3], strides=[2, 2]), unknown_shapes=True,
         id="dynamic"),
    # non-overlapping windows (one plain scatter) with pads, ceil_mode, dilations, SAME, unknown shapes
    Case("MaxPool", [distinct(1, 2, 5, 5)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 0, 0, 1]),
         id="disjoint-pads"),
    Case("MaxPool", [distinct(1, 2, 5, 7)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
         id="disjoint-ceil"),
    Case("MaxPool", [distinct(1, 2, 8, 7)], attrs=dict(kernel_shape=[2, 2], strides=[3, 2], dilations=[2, 1]),
         id="disjoint-dilations"),
    # (SAME_UPPER: onnx.reference's MaxPool gets SAME_LOWER's output size wrong, 3x2 for onnxruntime's 4x3 on
    # a 7x5 input, which matters wherever the float64 check runs in onnx.reference)
    Case("MaxPool", [distinct(1, 2, 7, 5)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2], auto_pad="SAME_UPPER"),
         id="disjoint-same"),
    Case("MaxPool", [distinct(2, 3, 6, 7)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]), unknown_shapes=True,
         id="disjoint-dynamic"),
    Case("MaxPool", [distinct(1, 2, 1, 3)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1]),
         id="disjoint-input-smaller-than-output"),
    # AveragePool
    Case("AveragePool", [randn(2, 3, 6, 6)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]), id="2x2"),
    Case("AveragePool", [randn(1, 2, 9)], attrs=dict(kernel_shape=[3], strides=[2]), id="1d"),
    Case("AveragePool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
         id="pads-exclude"),
    Case("AveragePool", [randn(1, 2, 7, 6)],
         attrs=dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 2, 1], count_include_pad=1), id="pads-include"),
    Case("AveragePool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 2], strides=[2, 2], ceil_mode=1,
                                                        pads=[1, 0, 1, 0]), id="ceil"),
    Case("AveragePool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 2], strides=[2, 2], ceil_mode=1,
                                                        pads=[1, 0, 1, 0], count_include_pad=1), id="ceil-include"),
    Case("AveragePool", [randn(1, 2, 7, 8)], attrs=dict(kernel_shape=[3, 2], strides=[2, 3], auto_pad="SAME_UPPER"),
         id="same-upper"),
    Case("AveragePool", [randn(1, 2, 7, 8)], attrs=dict(kernel_shape=[3, 3], strides=[2, 3], auto_pad="SAME_LOWER",
                                                        count_include_pad=1), id="same-lower-include"),
    Case("AveragePool", [randn(1, 2, 9, 8)], attrs=dict(kernel_shape=[2, 2], strides=[1, 2], dilations=[2, 2],
                                                        pads=[1, 0, 1, 1]), opset=19, id="dilations"),
    Case("AveragePool", [randn(1, 2, 3, 4, 5)], attrs=dict(kernel_shape=[2, 2, 3], strides=[1, 2, 2],
                                                           pads=[0, 1, 1, 1, 0, 1]), opset=13, id="3d-opset13"),
    Case("AveragePool", [randn(2, 2, 7, 6)], attrs=dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                                                        count_include_pad=1), unknown_shapes=True, id="dynamic"),
    # partial windows on unknown spatial dims: the divisors counted at run time
    Case("AveragePool", [randn(2, 2, 7, 6)], attrs=dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
         unknown_shapes=True, id="dynamic-pads-exclude"),
    Case("AveragePool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 2], strides=[2, 2], ceil_mode=1,
                                                        pads=[1, 0, 1, 0]), unknown_shapes=True, id="dynamic-ceil"),
    Case("AveragePool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 2], strides=[2, 2], ceil_mode=1,
                                                        pads=[1, 0, 1, 0], count_include_pad=1),
         unknown_shapes=True, id="dynamic-ceil-include"),
    Case("AveragePool", [randn(1, 2, 7, 8)], attrs=dict(kernel_shape=[3, 2], strides=[2, 3], auto_pad="SAME_UPPER"),
         unknown_shapes=True, id="dynamic-same-upper"),
    Case("AveragePool", [randn(1, 2, 7, 8)], attrs=dict(kernel_shape=[3, 3], strides=[2, 3], auto_pad="SAME_LOWER",
                                                        count_include_pad=1), unknown_shapes=True,
         id="dynamic-same-lower-include"),
    Case("AveragePool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER"),
         unknown_shapes=True, id="dynamic-same-stride1"),
    Case("AveragePool", [randn(1, 2, 9, 8)], attrs=dict(kernel_shape=[2, 2], strides=[1, 2], dilations=[2, 2],
                                                        pads=[1, 0, 1, 1]), opset=19, unknown_shapes=True,
         id="dynamic-dilations"),
    Case("AveragePool", [randn(1, 2, 3, 4, 5)], attrs=dict(kernel_shape=[2, 2, 3], strides=[1, 2, 2],
                                                           pads=[0, 1, 1, 1, 0, 1]), opset=13, unknown_shapes=True,
         id="dynamic-3d-opset13"),
    # LpPool, global pools
    Case("LpPool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1]), id="p2"),
    Case("LpPool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2], p=1), id="p1"),
    Case("LpPool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[2, 3], strides=[1, 2], p=3), id="p3"),
    Case("LpPool", [randn(1, 2, 7, 6)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2], dilations=[2, 1],
                                                   ceil_mode=1), opset=18, id="ceil-dilations"),
    Case("GlobalAveragePool", [randn(2, 3, 4, 5)], id="2d"),
    Case("GlobalAveragePool", [randn(2, 3, 2, 3, 2)], id="3d"),
    Case("GlobalAveragePool", [randn(2, 3, 4, 5)], unknown_shapes=True, id="dynamic"),
    # (no 1-D GlobalMaxPool: onnx.reference returns shape (N, 1) for an (N, C, L) input)
    Case("GlobalMaxPool", [distinct(2, 3, 4, 5)], id="2d"),
    Case("GlobalMaxPool", [distinct(2, 3, 4, 3)], unknown_shapes=True, id="dynamic"),
    Case("GlobalLpPool", [randn(2, 3, 4, 5)], id="p2"),
    Case("GlobalLpPool", [randn(2, 3, 4)], attrs=dict(p=3), id="p3"),
    Case("GlobalLpPool", [randn(2, 3, 4)], attrs=dict(p=1), id="p1"),
    # Col2Im, MaxUnpool, LRN
    Case("Col2Im", [randn(2, 3 * 4, 12), np.array([4, 5]), np.array([2, 2])], opset=18, id="2x2"),
    Case("Col2Im", [randn(1, 2 * 6, 6), np.array([5, 6]), np.array([2, 3])],
         attrs=dict(strides=[2, 2], pads=[1, 0, 0, 1], dilations=[2, 1]), opset=18, id="strides-pads-dilations"),
    Case("Col2Im", [randn(1, 2 * 4, 6), np.array([3, 4]), np.array([2, 2])], opset=18, dynamic=[1],
         id="image-shape-at-run-time"),
    Case("Col2Im", [randn(1, 2 * 6, 6), np.array([5, 6]), np.array([2, 3])],
         attrs=dict(strides=[2, 2], pads=[1, 0, 0, 1], dilations=[2, 1]), opset=18, dynamic=[1, 2],
         id="block-shape-at-run-time"),
    Case("MaxUnpool", [randn(2, 3, 2, 3), _indices(distinct(2, 3, 4, 6), kernel_shape=[2, 2], strides=[2, 2])],
         attrs=dict(kernel_shape=[2, 2], strides=[2, 2]), id="2d"),
    Case("MaxUnpool", [randn(1, 2, 3), _indices(distinct(1, 2, 6), kernel_shape=[2], strides=[2])],
         attrs=dict(kernel_shape=[2], strides=[2]), opset=13, id="1d"),
    # output_shape larger than the default (MaxPool of a 5x5 image): indices address the output_shape tensor,
    # as onnxruntime and PyTorch's max_unpool2d(output_size=) read them (onnx.reference and the backend
    # case's expected data read them in the default 4x4 shape: see onnxgrad/tools/check/kernels.py's MaxUnpool)
    Case("MaxUnpool", [randn(1, 2, 2, 2), _indices(distinct(1, 2, 5, 5), kernel_shape=[2, 2], strides=[2, 2]),
                       np.array([1, 2, 5, 5])], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]), id="output-shape"),
    Case("LRN", [randn(2, 5, 3, 4)], attrs=dict(size=3, alpha=0.3, beta=0.75, bias=1.5), id="size3"),
    Case("LRN", [randn(2, 6, 3, 4)], attrs=dict(size=4, alpha=0.5, beta=0.6, bias=2.0), id="size4-even",
         reference="onnxruntime's LRN kernel takes an odd size only"),
    Case("LRN", [randn(1, 4, 5, 3)], attrs=dict(size=5, alpha=0.5, beta=1.2), unknown_shapes=True, id="dynamic"),
    # RoI pooling (RoIs and batch indices get no gradient)
    Case("MaxRoiPool", [distinct(2, 3, 6, 7), _BATCHED_ROIS], attrs=dict(pooled_shape=[2, 3]), opset=16, wrt=[0],
         id="2x3"),
    Case("MaxRoiPool", [distinct(2, 3, 6, 7), _BATCHED_ROIS * np.array([1, 2, 2, 2, 2], np.float32)],
         attrs=dict(pooled_shape=[3, 2], spatial_scale=0.5), opset=16, wrt=[0], id="scale"),
    Case("MaxRoiPool", [distinct(2, 3, 6, 7), _BATCHED_ROIS], attrs=dict(pooled_shape=[2, 2]), opset=16, wrt=[0],
         unknown_shapes=True, id="dynamic"),
    # DeformConv (offsets and mask are differentiated too)
    Case("DeformConv", [randn(1, 2, 4, 5), randn(3, 2, 2, 2), _offsets(1, 8, 3, 4)], opset=19, id="basic"),
    Case("DeformConv", [randn(2, 4, 5, 5), randn(4, 2, 3, 2), _offsets(2, 2 * 12, 2, 2), randn(4),
                        randn(2, 2 * 6, 2, 2, low=0.2, high=1.0)],
         attrs=dict(group=2, offset_group=2, strides=[2, 2], pads=[1, 0, 0, 1], dilations=[1, 2]), opset=19,
         id="groups-bias-mask"),
    Case("DeformConv", [randn(1, 3, 4, 4), randn(2, 3, 2, 2), _offsets(1, 8, 5, 5), None,
                        randn(1, 4, 5, 5, low=0.2, high=1.0)], attrs=dict(pads=[1, 1, 1, 1]), opset=22, id="pads-mask"),
]

ROI_ALIGN_CASES = [
    Case("RoiAlign", [randn(2, 3, 6, 7), _ROIS, _ROI_BATCH],
         attrs=dict(output_height=2, output_width=3, sampling_ratio=2), opset=16, wrt=[0], id="ratio2"),
    Case("RoiAlign", [randn(2, 3, 6, 7), _ROIS, _ROI_BATCH], attrs=dict(output_height=3, output_width=2),
         opset=16, wrt=[0], id="adaptive"),
    Case("RoiAlign", [randn(2, 3, 6, 7), _ROIS * 2, _ROI_BATCH],
         attrs=dict(output_height=2, output_width=2, spatial_scale=0.5,
                    coordinate_transformation_mode="output_half_pixel"), opset=16, wrt=[0], id="output-half-pixel"),
    Case("RoiAlign", [randn(2, 3, 6, 7), _ROIS, _ROI_BATCH], attrs=dict(output_height=2, output_width=2,
                                                                        sampling_ratio=1), opset=13, wrt=[0],
         id="opset13"),
    Case("RoiAlign", [randn(2, 3, 6, 7), _ROIS, _ROI_BATCH], attrs=dict(output_height=2, output_width=3),
         opset=16, unknown_shapes=True, wrt=[0], id="dynamic"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rule(case):
    run_case(case)


@pytest.fixture
def nn_roi_align():
    """RoiAlign's registered rule (rules/sampling.py) uses this dense form below opset 16; test it at every opset."""
    with registry.override("RoiAlign", nn.roi_align, inputs=(0,)):
        yield


@pytest.mark.parametrize("case", ROI_ALIGN_CASES, ids=str)
def test_roi_align(case, nn_roi_align):
    run_case(case)


@pytest.mark.parametrize("case", [c for c in CASES + ROI_ALIGN_CASES if not c.unknown_shapes], ids=str)
def test_forward_matches_onnxruntime(case):
    """The numeric truth (onnxruntime in float64, else onnx.reference with the fixes) is onnxruntime's forward."""
    model, feeds, _ = case_model(case)
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:   # onnxruntime's LRN takes odd sizes only
        pytest.skip(f"onnxruntime cannot run this forward: {str(e).splitlines()[0][:120]}")
    expected = session.run(None, feeds)[0]
    feeds64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    truth = Runner(to_float64(model))        # what the numeric check differentiates
    got = truth(feeds64)["y0"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


# -- behaviour the numeric check cannot see ----------------------------------------------------------
def _gradient(case: Case, seed: np.ndarray) -> np.ndarray:
    model, feeds, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt[:1], of=["y0"])
    sess = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([f"{wrt[0]}_grad"], {**feeds, "y0_grad": seed})[0]


@pytest.mark.parametrize("opset", [13, 17])
def test_max_pool_ties_go_to_the_first_maximum(opset):
    """Ties: the gradient follows MaxPool's Indices (the first maximum), counted once per window."""
    x = np.zeros((1, 1, 3, 3), np.float32)
    case = Case("MaxPool", [x], attrs=dict(kernel_shape=[2, 2], strides=[1, 1]), opset=opset)
    dx = _gradient(case, np.array([[[[1.0, 2.0], [4.0, 8.0]]]], np.float32))
    expected = np.zeros((3, 3), np.float32)
    expected[0, 0], expected[0, 1], expected[1, 0], expected[1, 1] = 1.0, 2.0, 4.0, 8.0
    np.testing.assert_array_equal(dx[0, 0], expected)


def test_global_max_pool_ties_share_the_gradient():
    x = np.array([[[[3.0, 1.0], [3.0, 2.0]]]], np.float32)
    dx = _gradient(Case("GlobalMaxPool", [x]), np.array([[[[2.0]]]], np.float32))
    np.testing.assert_array_equal(dx[0, 0], [[1.0, 0.0], [1.0, 0.0]])


def _backward_ops(case: Case) -> list[str]:
    model, _, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    return [node.op_type for node in gm.graph.node[1:] if node.op_type not in ("Constant", "Identity")]


@pytest.mark.parametrize("pads", [[1, 1, 1, 1], [0, 2, 1, 0]])
def test_conv_input_gradient_is_one_conv_transpose(pads):
    """The canonical input gradient: ConvTranspose(dy, w) sized like x (the flipped-Conv form is a
    rewrite for onnxruntime's CPU, tests/test_optimize.py)."""
    case = Case("Conv", [randn(1, 16, 5, 6), randn(16, 16, 3, 3)], attrs=dict(pads=pads), wrt=[0])
    ops = _backward_ops(case)
    assert ops.count("ConvTranspose") == 1 and "Conv" not in ops
    run_case(case)


def test_conv_backward_is_one_conv_transpose_and_one_swapped_conv():
    """ResNet-style 3x3 stride-1 conv: dx one ConvTranspose, dw one Conv of x with dy as its kernel
    (batch and channels exchanged by Transposes), db one ReduceSum; no im2col."""
    case = Case("Conv", [randn(2, 4, 6, 6), randn(5, 4, 3, 3), randn(5)], attrs=dict(pads=[1, 1, 1, 1]))
    ops = _backward_ops(case)
    assert ops.count("ConvTranspose") == 1 and ops.count("Conv") == 1 and ops.count("ReduceSum") == 1
    assert ops.count("Transpose") == 3 and "Gemm" not in ops and "Slice" not in ops


@pytest.mark.parametrize("op, x, w, attrs", [
    ("Conv", randn(2, 3, 7, 6), randn(4, 3, 3, 2), dict(strides=[2, 1], pads=[1, 0, 1, 1])),
    ("ConvTranspose", randn(2, 3, 4, 3), randn(3, 2, 3, 3), dict(strides=[2, 2], pads=[1, 0, 1, 1])),
])
def test_filter_gradient_inside_a_model(op, x, w, attrs):
    """dy from another rule: the weight gradient is the swapped-role Conv, right inside a model."""
    nodes = [onnx.helper.make_node(op, ["x", "w"], ["c"], name="conv", **attrs),
             onnx.helper.make_node("Tanh", ["c"], ["y"], name="tanh")]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["a", "b", "c", "d"])],
        [onnx.numpy_helper.from_array(w, "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    gm = onnxgrad.grad(model, wrt=["x", "w"], of=["y"])
    assert "Gemm" not in [n.op_type for n in gm.graph.node if n.name.startswith("conv/grad")]
    assert check(model, gm, {"x": x}).ok(2e-3)


@pytest.mark.parametrize("case", [
    Case("Conv", [randn(2, 3, 7, 6), randn(4, 3, 3, 2), randn(4)], attrs=dict(strides=[2, 1], pads=[1, 0, 1, 1]),
         id="conv"),
    Case("Conv", [randn(1, 2, 7, 6), randn(3, 2, 2, 3)], attrs=dict(strides=[3, 2], dilations=[2, 1]),
         id="conv-stride-not-dividing"),
    Case("ConvTranspose", [randn(1, 3, 4, 3), randn(3, 2, 3, 3)], attrs=dict(strides=[2, 2], pads=[1, 0, 1, 1]),
         id="conv-transpose"),
], ids=str)
def test_filter_gradient_is_the_swapped_conv(case):
    """The weight gradient is a Conv of x (channels as batch) with dy as its kernel."""
    ops = _backward_ops(case)
    assert "Gemm" not in ops and ops.count("Conv") == (2 if case.op == "ConvTranspose" else 1)   # + its dx
    run_case(case)


def test_pool_backward_has_no_scatter_where_windows_do_not_overlap():
    ops = _backward_ops(Case("AveragePool", [randn(1, 2, 4, 4)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2])))
    assert "ConvTranspose" in ops and not any(op.startswith("Scatter") for op in ops)
    ops = _backward_ops(Case("MaxPool", [distinct(1, 2, 5, 5)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2])))
    assert ops.count("ScatterElements") == 1


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_max_pool_tile_ties_go_to_the_first_maximum_in_every_float_type(dtype):
    """2x2 tiles with ties in float64 and float16: the first maximum."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 3, (2, 3, 4, 6)).astype(np.float32)
    case = Case("MaxPool", [x.astype(dtype)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]))
    seed = rng.standard_normal((2, 3, 2, 3)).astype(dtype)
    dx = _gradient(case, seed)
    expected = np.zeros(x.size, dtype)
    expected[_indices(x, kernel_shape=[2, 2], strides=[2, 2]).reshape(-1)] = seed.reshape(-1)
    assert dx.dtype == dtype
    np.testing.assert_array_equal(dx, expected.reshape(x.shape))


@pytest.mark.parametrize("k", [2, 3])
def test_max_pool_tile_ties_go_to_the_first_maximum(k):
    """Tiles with ties (ReLU zeros, repeated values): dy goes where MaxPool's Indices point, the first
    maximum in row-major order, as onnxruntime and PyTorch choose it."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 3, (2, 3, 2 * k, 3 * k)).astype(np.float32)       # many ties in every tile
    case = Case("MaxPool", [x], attrs=dict(kernel_shape=[k, k], strides=[k, k]))
    seed = rng.standard_normal((2, 3, 2, 3)).astype(np.float32)
    dx = _gradient(case, seed)
    indices = _indices(x, kernel_shape=[k, k], strides=[k, k])
    expected = np.zeros(x.size, np.float32)
    expected[indices.reshape(-1)] = seed.reshape(-1)
    np.testing.assert_array_equal(dx, expected.reshape(x.shape))


@pytest.mark.parametrize("case, reason", [
    (Case("MaxRoiPool", [distinct(2, 3, 6, 7), _BATCHED_ROIS], attrs=dict(pooled_shape=[2, 2]), opset=15, wrt=[0]),
     "opset 16"),
    (Case("RoiAlign", [randn(2, 3, 6, 7), _ROIS, _ROI_BATCH], attrs=dict(mode="max"), opset=16, wrt=[0]),
     "mode='max'"),
])
def test_unsupported_configurations_say_why(case, reason, nn_roi_align):
    with pytest.raises(UnsupportedOpError, match=reason):
        run_case(case)


@pytest.mark.parametrize("case", [
    Case("Conv", [randn(1, 4, 5, 6), randn(4, 2, 3, 2), randn(4)], attrs=dict(strides=[2, 2], group=2,
                                                                               pads=[1, 0, 1, 1])),
    Case("ConvTranspose", [randn(1, 2, 3, 4), randn(2, 3, 3, 2)],
         attrs=dict(strides=[2, 3], pads=[1, 0, 1, 1], output_padding=[1, 2])),
    Case("MaxPool", [distinct(1, 2, 7, 6)], attrs=dict(kernel_shape=[3, 3], strides=[2, 2]), opset=13),
    Case("MaxPool", [distinct(1, 2, 4, 6)], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]), id="tiles"),
    Case("Conv", [randn(2, 3, 5, 4), randn(2, 3, 3, 3)], attrs=dict(pads=[1, 1, 1, 1]), id="conv-im2col"),
    Case("Conv", [randn(1, 16, 4, 4), randn(16, 16, 3, 3)], attrs=dict(pads=[1, 0, 1, 1]), id="conv-flipped"),
    Case("LRN", [randn(2, 5, 3, 4)], attrs=dict(size=3, alpha=0.3, beta=0.75, bias=1.5)),
], ids=str)
def test_second_order(case):
    """Differentiating the gradient graph again: every op the rules emit has a rule."""
    model, feeds, wrt = case_model(case)
    first = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    seed = first.graph.input[-1]
    shape = [d.dim_value for d in seed.type.tensor_type.shape.dim]
    feeds = {**feeds, seed.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    second = onnxgrad.grad(first, wrt=wrt, of=[f"{wrt[0]}_grad"], allow_unused=True)
    onnx.checker.check_model(second, full_check=True)
    result = check(first, second, feeds, max_elements=40)
    assert result.ok(2e-3), result.errors


def test_max_unpool_output_shape_matches_torch():
    """With output_shape, the rule reads the indices as PyTorch's max_unpool2d(output_size=) does (the reading
    ``ops`` names): its forward in onnxruntime and its gradient equal PyTorch's."""
    torch = pytest.importorskip("torch")
    x, image = randn(1, 2, 2, 2), distinct(1, 2, 5, 5)
    indices = _indices(image, kernel_shape=[2, 2], strides=[2, 2])
    case = Case("MaxUnpool", [x, indices, np.array([1, 2, 5, 5])], attrs=dict(kernel_shape=[2, 2], strides=[2, 2]))
    model, feeds, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=["y0"])
    seed = randn(1, 2, 5, 5)
    got = Runner(gm)({**feeds, "y0_grad": seed})
    tx = torch.tensor(x, requires_grad=True)
    plane = (np.arange(2) * 25).reshape(1, 2, 1, 1)           # ONNX indexes the whole tensor, torch each plane
    ty = torch.nn.functional.max_unpool2d(tx, torch.tensor(indices - plane), kernel_size=2, stride=2,
                                          output_size=(5, 5))
    ty.backward(torch.tensor(seed))
    np.testing.assert_allclose(got["y0"], ty.detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(got[gradient_spec(gm)["gradients"][wrt[0]]], tx.grad.numpy(), rtol=1e-6)


def test_ops_names_the_max_unpool_reading(capsys):
    from onnxgrad.tools.coverage import print_table

    print_table()
    line = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("MaxUnpool "))
    assert "output_shape" in line and "PyTorch" in line and "onnx.reference" in line
