"""Shape and data-movement rules (rules/shape.py) against finite differences."""
import numpy as np
import onnx
import pytest
from onnx import helper

import harness
import onnxgrad
from harness import Case, case_model, distinct, float_outputs, randn, run_case
from onnxgrad.tools.check import Runner, gradient_spec


def i64(*values):
    return np.array(values, np.int64)


BIG = np.iinfo(np.int64).max

RESHAPE = [
    Case("Reshape", [randn(2, 3, 4), i64(4, -1)], id="minus1"),
    Case("Reshape", [randn(2, 3, 4), i64(0, -1)], id="zero-copies"),
    Case("Reshape", [randn(2, 3, 4), i64(3, 8)], attrs={"allowzero": 1}, opset=14, id="allowzero"),
    Case("Reshape", [randn(2, 3, 4), i64(6, 4)], dynamic=[1], id="shape-at-runtime"),
    Case("Reshape", [randn(2, 3, 4), i64(-1)], unknown_shapes=True, id="unknown-shapes"),
    Case("Reshape", [randn(0, 3, 4), i64(3, 4, 0)], attrs={"allowzero": 1}, opset=14, id="empty"),
    Case("Reshape", [randn(0, 3, 4), i64(3, 4, 0)], attrs={"allowzero": 1}, opset=14, unknown_shapes=True,
         id="empty-unknown"),
    Case("Transpose", [randn(2, 3, 4)], attrs={"perm": [1, 2, 0]}, id="perm"),
    Case("Transpose", [randn(2, 3, 4)], id="default-reverse"),
    Case("Transpose", [randn(2, 3, 4, 2)], attrs={"perm": [3, 0, 2, 1]}, unknown_shapes=True, id="unknown"),
    Case("Flatten", [randn(2, 3, 4)], id="default"),
    Case("Flatten", [randn(2, 3, 4)], attrs={"axis": 0}, id="axis0"),
    Case("Flatten", [randn(2, 3, 4)], attrs={"axis": -1}, id="axis-neg"),
    Case("Flatten", [randn(2, 3, 4)], attrs={"axis": 3}, unknown_shapes=True, id="axis-rank"),
    Case("Squeeze", [randn(2, 1, 4, 1), i64(1)], opset=13, id="axes"),
    Case("Squeeze", [randn(2, 1, 4, 1), i64(-1, 1)], opset=21, id="neg-axes"),
    Case("Squeeze", [randn(2, 1, 4, 1)], id="no-axes"),
    Case("Squeeze", [randn(2, 1, 4, 1), i64(3)], unknown_shapes=True, id="unknown"),
    Case("Unsqueeze", [randn(2, 3), i64(0, -1)], opset=13, id="axes"),
    Case("Unsqueeze", [randn(2, 3), i64(1)], opset=24, unknown_shapes=True, id="unknown"),
]

CONCAT_SPLIT = [
    Case("Concat", [randn(2, 3), randn(2, 1), randn(2, 4)], attrs={"axis": 1}, id="three"),
    Case("Concat", [randn(2, 3, 2), randn(2, 3, 1)], attrs={"axis": -1}, id="neg-axis"),
    Case("Concat", [randn(2, 3), randn(1, 3), randn(3, 3)], attrs={"axis": 0}, wrt=[0, 2], id="some-need"),
    Case("Concat", [randn(2, 3), randn(2, 2), randn(2, 4)], attrs={"axis": 1}, wrt=[1, 2],
         unknown_shapes=True, id="some-need-unknown"),
    Case("Concat", [randn(2, 3), randn(2, 2)], attrs={"axis": 1}, unknown_shapes=True, id="unknown"),
    Case("Concat", [randn(2, 3)], attrs={"axis": 0}, id="single"),
    Case("Split", [randn(2, 4), i64(1, 3)], attrs={"axis": 1}, outputs=2, opset=13, id="split-input"),
    Case("Split", [randn(6, 2)], outputs=3, opset=13, id="equal"),
    Case("Split", [randn(2, 7)], attrs={"axis": -1, "num_outputs": 3}, outputs=3, opset=18, id="uneven"),
    Case("Split", [randn(2, 5), i64(2, 3)], attrs={"axis": 1}, outputs=2, opset=18, unknown_shapes=True,
         id="unknown"),
]

SLICE = [
    Case("Slice", [randn(5, 6), i64(1, 2), i64(4, 5)], id="basic"),
    Case("Slice", [randn(5, 6), i64(-4), i64(-1), i64(1)], id="negative-bounds"),
    Case("Slice", [randn(5, 6), i64(-10, 2), i64(100, BIG), i64(0, 1)], id="clamped"),
    Case("Slice", [randn(5, 6), i64(0), i64(6), i64(1), i64(2)], id="step2"),
    Case("Slice", [randn(5, 7), i64(1), i64(7), i64(-1), i64(3)], id="step3-neg-axis"),
    Case("Slice", [randn(5, 6), i64(-1), i64(-BIG - 1), i64(1), i64(-1)], id="reverse"),
    Case("Slice", [randn(6, 5), i64(4, 3), i64(0, -100), i64(0, 1), i64(-2, -1)], id="neg-steps"),
    Case("Slice", [randn(4, 6, 3), i64(1, 5), i64(4, 0), i64(2, 1), i64(1, -3)], id="mixed"),
    Case("Slice", [randn(4, 5), i64(3), i64(1), i64(0)], id="empty"),
    Case("Slice", [randn(4, 5), i64(2), i64(3), i64(0)], id="single"),
    Case("Slice", [randn(4, 5), i64(1, 1), i64(3, 4)], unknown_shapes=True, id="unknown-shapes"),
    Case("Slice", [randn(4, 5), i64(-3, 1), i64(BIG, -1), i64(1, 0)], unknown_shapes=True,
         id="unknown-negative"),
    Case("Slice", [randn(4, 5), i64(1), i64(-1), i64(1)], dynamic=[1, 2], id="bounds-at-runtime"),
    Case("Slice", [randn(6, 5), i64(1, 4), i64(6, 0), i64(0, 1), i64(2, -2)], unknown_shapes=True,
         id="unknown-steps"),
    Case("Slice", [randn(6, 5), i64(5), i64(-BIG), i64(0), i64(-2)], dynamic=[4], id="steps-at-runtime"),
    Case("Slice", [randn(3, 4, 5), i64(1), i64(4), i64(-1), i64(2)], opset=13, unknown_shapes=True,
         id="unknown-opset13"),
    Case("Slice", [randn(3, 4, 5), i64(-1, 1), i64(0, 3), i64(2, 0), i64(-2, 1)], dynamic=[1, 2, 3, 4],
         id="all-at-runtime"),
    Case("Slice", [randn(3, 4, 5), i64(-1, 1), i64(0, 3), i64(2, 0), i64(-2, 1)], dynamic=[1, 2, 3, 4],
         opset=13, unknown_shapes=True, id="all-at-runtime-unknown-opset13"),
    Case("Slice", [randn(3, 4, 5), i64(-3, 1), i64(BIG, 3), i64(-1, 0)], dynamic=[3], opset=18,
         unknown_shapes=True, id="axes-at-runtime"),
    Case("Slice", [randn(3, 4, 5), i64(-3, 1), i64(BIG, 3), i64(-1, 0)], dynamic=[1, 2, 3], opset=13,
         id="axes-at-runtime-opset13"),
]

GATHER = [
    Case("Gather", [randn(5, 3), i64(0, 2, 2, 4)], id="axis0-repeats"),
    Case("Gather", [randn(5, 3), i64(0, 2, 2, 4)], opset=13, id="axis0-repeats-opset13"),
    Case("Gather", [randn(3, 5, 2), i64(-1, 1, 1, 0)], attrs={"axis": 1}, id="axis1-negative"),
    Case("Gather", [randn(3, 5, 2), i64(-1, 1, 1, 0)], attrs={"axis": 1}, opset=13, id="axis1-opset13"),
    Case("Gather", [randn(3, 4), np.array(2, np.int64)], attrs={"axis": -1}, id="scalar-index"),
    Case("Gather", [randn(3, 4), np.array(-3, np.int64)], attrs={"axis": -1}, opset=15, id="scalar-opset15"),
    Case("Gather", [randn(4, 3), i64(3, 0, 3, 3, 1, 0).reshape(2, 3)], id="2d-indices"),
    Case("Gather", [randn(2, 4, 3), i64(3, 0, 3, 3, 1, 0).reshape(3, 2)], attrs={"axis": 1}, opset=13,
         id="2d-indices-opset13"),
    Case("Gather", [randn(5, 3), i64(1, -1, 1)], dynamic=[1], id="dynamic-indices"),
    Case("Gather", [randn(2, 5, 3), i64(1, -1, 1)], attrs={"axis": 1}, dynamic=[1], opset=13,
         id="dynamic-indices-opset13"),
    Case("Gather", [randn(2, 5, 3), np.array([4, -5, 4], np.int32)], attrs={"axis": 1}, dynamic=[1],
         unknown_shapes=True, id="unknown-int32"),
    Case("Gather", [randn(5, 3), i64(2, 2, 0)], dynamic=[1], unknown_shapes=True, opset=14,
         id="unknown-opset14"),
    Case("GatherElements", [randn(3, 4), i64(0, 2, 2, 1, 1, 1, 0, 0).reshape(2, 4)], id="axis0-repeats"),
    Case("GatherElements", [randn(3, 4), i64(3, -1, 0, 0, 1, 2).reshape(3, 2)], attrs={"axis": 1},
         id="axis1-negative"),
    Case("GatherElements", [randn(3, 4), i64(0, 2, 2, 1, 0, 1, 2, 1).reshape(2, 4)], opset=13,
         id="axis0-repeats-opset13"),
    Case("GatherElements", [randn(3, 4), i64(0, 2, 2, 1, 1, 1, 0, 0).reshape(2, 4)], opset=13,
         id="axis0-once-opset13"),
    Case("GatherElements", [randn(3, 4, 2), i64(3, -1, 0, 3, 3, 2, 1, 1, 1, 0, 2, -4).reshape(2, 3, 2)],
         attrs={"axis": -2}, opset=13, id="smaller-opset13"),
    Case("GatherElements", [randn(3, 4), i64(3, -1, 0, 0, 1, 2).reshape(2, 3)], attrs={"axis": 1},
         dynamic=[1], unknown_shapes=True, opset=15, id="unknown-opset15"),
    Case("GatherElements", [randn(3, 4, 2), i64(3, -1, 0, 3, 3, 2, 1, 1, 1, 0, 2, -4).reshape(2, 3, 2)],
         attrs={"axis": -2}, dynamic=[1], unknown_shapes=True, id="unknown-smaller"),
    Case("GatherND", [randn(3, 4), i64(0, 1, 2, 3, 0, 1).reshape(3, 2)], id="elements-repeats"),
    Case("GatherND", [randn(3, 4), i64(0, 1, 2, 3, 0, 1).reshape(3, 2)], opset=13, id="elements-opset13"),
    Case("GatherND", [randn(3, 4, 2), i64(-1, 0, -1).reshape(3, 1)], id="rows-negative"),
    Case("GatherND", [randn(2, 3, 4), i64(0, 1, 2, 2).reshape(2, 2, 1)], attrs={"batch_dims": 1},
         id="batch-dims"),
    Case("GatherND", [randn(2, 3, 4), i64(0, 1, 2, -1, 1, 1).reshape(2, 1, 3)[..., :2]],
         attrs={"batch_dims": 1}, opset=13, id="batch-dims-opset13"),
    Case("GatherND", [randn(2, 3, 4), i64(0, -1, 2, 2, 1, 1, 0, 3).reshape(2, 2, 2)], attrs={"batch_dims": 1},
         dynamic=[1], id="batch-dims-dynamic"),
    Case("GatherND", [randn(2, 3, 4), i64(0, -1, 2, 2, 1, 1, 0, 3).reshape(2, 2, 2)], attrs={"batch_dims": 1},
         unknown_shapes=True, id="batch-dims-unknown"),
    Case("GatherND", [randn(2, 3, 4, 2), i64(1, -3, 2, 0, 1, 1, 1, 1).reshape(2, 2, 2)], attrs={"batch_dims": 1},
         unknown_shapes=True, opset=13, id="batch-dims-unknown-opset13"),
    Case("GatherND", [randn(3, 4), i64(2, 3, 2, 3).reshape(2, 2)], dynamic=[1], opset=13, id="dynamic-opset13"),
    # the index depth (indices' last dim) unknown: row strides computed at run time
    Case("GatherND", [randn(3, 4), i64(0, 1, 2, 3, 0, 1).reshape(3, 2)], dynamic=[1], unknown_shapes=True,
         id="unknown-depth"),
    Case("GatherND", [randn(3, 4, 2), i64(2, -1, 2, 0).reshape(2, 2, 1)], dynamic=[1], unknown_shapes=True,
         opset=13, id="unknown-depth-opset13"),
    Case("GatherND", [randn(2, 3, 4), i64(0, -1, 2, 2, 1, 1, 0, 3).reshape(2, 2, 2)], attrs={"batch_dims": 1},
         dynamic=[1], unknown_shapes=True, id="unknown-depth-batch-dims"),
    Case("GatherND", [randn(2, 2, 4, 3), i64(1, -3, 2, 0, 1, 1, 1, 1).reshape(2, 2, 2)], attrs={"batch_dims": 2},
         dynamic=[1], unknown_shapes=True, opset=13, id="unknown-depth-batch-dims2-opset13"),
    Case("Compress", [randn(3, 4), np.array([True, False, True])], attrs={"axis": 0}, id="axis0"),
    Case("Compress", [randn(3, 4), np.array([False, True, True])], attrs={"axis": -1}, id="axis-neg-short"),
    Case("Compress", [randn(3, 4), np.array([True, False, True, True, False, True])], id="flattened"),
    Case("Compress", [randn(3, 4), np.array([True, False, True, True])], attrs={"axis": 1}, dynamic=[1],
         unknown_shapes=True, id="dynamic"),
    Case("Compress", [randn(2, 3), np.array([False, True, False, False, True, True])], dynamic=[1],
         unknown_shapes=True, id="flattened-dynamic"),
]

EXPAND_TILE = [
    Case("Expand", [randn(3, 1), i64(2, 3, 4)], id="broadcast"),
    Case("Expand", [randn(1, 4), i64(3, 1)], id="keeps-larger"),
    Case("Expand", [randn(3, 1), i64(2, 3, 4)], unknown_shapes=True, id="unknown"),
    Case("Tile", [randn(2, 3), i64(2, 3)], id="both"),
    Case("Tile", [randn(2, 3, 2), i64(1, 3, 1)], id="one-axis"),
    Case("Tile", [randn(2, 3), i64(1, 1)], id="identity"),
    Case("Tile", [randn(2, 3), i64(3, 2)], dynamic=[1], id="dynamic-repeats"),
    Case("Tile", [randn(2, 3), i64(2, 1)], unknown_shapes=True, id="unknown"),
    Case("Tile", [randn(2, 3, 2), i64(2, 1, 3)], dynamic=[1], unknown_shapes=True, opset=13,
         id="unknown-dynamic-repeats"),
]

PAD = [
    Case("Pad", [randn(3, 4), i64(1, 0, 2, 3)], opset=13, id="constant"),
    Case("Pad", [randn(3, 4), i64(1, 2, 0, 1), np.array(1.5, np.float32)], opset=13, wrt=[0], id="value"),
    # negative pads crop; onnx.reference cannot run them, onnxruntime can (float32 and float64)
    Case("Pad", [randn(3, 4), i64(1, -1, -1, 2)], id="negative"),
    Case("Pad", [randn(2, 3, 4), i64(1, 2, 0, 1), None, i64(-1, 0)], opset=18, id="axes"),
    Case("Pad", [randn(3, 4), i64(0, 1, 2, 0)], unknown_shapes=True, id="unknown"),
    Case("Pad", [randn(3, 4), i64(1, 0, 2, 3)], dynamic=[1], id="pads-at-runtime"),
    Case("Pad", [randn(3, 4), i64(1, -2, 0, 1)], dynamic=[1], id="negative-at-runtime"),
    # (pads and axes both at run time: shape inference loses the output's rank, the harness needs it)
    Case("Pad", [randn(2, 3, 4), i64(2, -1), None, i64(-2)], dynamic=[1], opset=18, unknown_shapes=True,
         id="axes-pads-at-runtime"),
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "reflect"}, id="reflect"),
    Case("Pad", [randn(2, 5), i64(0, 4, 0, 4)], attrs={"mode": "reflect"}, id="reflect-full"),
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "edge"}, id="edge"),
    Case("Pad", [randn(2, 3, 4), i64(1, 3), None, i64(-1)], attrs={"mode": "edge"}, opset=18, unknown_shapes=False,
         id="edge-axes"),
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "wrap"}, opset=19, id="wrap"),
    Case("Pad", [randn(2, 3), i64(0, 4, 0, 5)], attrs={"mode": "wrap"}, opset=19, id="wrap-twice"),
    # the border modes along axes whose size is unknown when the gradient is built: the source of each
    # y position computed at run time (clamped, mirrored, wrapped), then scatter-added (one-hot before opset 16)
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "edge"}, unknown_shapes=True, id="edge-unknown"),
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "edge"}, opset=13, unknown_shapes=True,
         id="edge-unknown-opset13"),
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "reflect"}, unknown_shapes=True, id="reflect-unknown"),
    Case("Pad", [randn(2, 5), i64(0, 4, 0, 4)], attrs={"mode": "reflect"}, opset=13, unknown_shapes=True,
         id="reflect-full-unknown-opset13"),
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "wrap"}, opset=19, unknown_shapes=True,
         id="wrap-unknown"),
    Case("Pad", [randn(2, 3), i64(0, 4, 0, 5)], attrs={"mode": "wrap"}, opset=19, unknown_shapes=True,
         id="wrap-twice-unknown"),
    Case("Pad", [randn(2, 3, 4), i64(1, 3), None, i64(-1)], attrs={"mode": "edge"}, opset=18, unknown_shapes=True,
         id="edge-axes-unknown"),
    # pads (and axes) computed at run time in the border modes: every axis folded from the pads tensor
    Case("Pad", [randn(3, 4), i64(2, 0, 1, 3)], attrs={"mode": "reflect"}, dynamic=[1], id="reflect-pads-at-runtime"),
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "edge"}, dynamic=[1], unknown_shapes=True,
         opset=13, id="edge-pads-at-runtime-unknown-opset13"),
    Case("Pad", [randn(2, 3, 4), i64(1, 3), None, i64(-1)], attrs={"mode": "wrap"}, dynamic=[1, 3], opset=19,
         unknown_shapes=True, id="wrap-axes-at-runtime-unknown"),
    Case("CenterCropPad", [randn(5, 4), i64(3, 7)], opset=18, id="crop-pad"),
    Case("CenterCropPad", [randn(2, 6, 3), i64(3, 6)], attrs={"axes": [-1, 1]}, opset=18, id="axes"),
    Case("CenterCropPad", [randn(2, 5, 3), i64(4, 2)], attrs={"axes": [1, 2]}, opset=18, unknown_shapes=True,
         id="unknown"),
]

BLOCKS = [
    Case("DepthToSpace", [randn(1, 8, 2, 3)], attrs={"blocksize": 2}, id="dcr"),
    Case("DepthToSpace", [randn(2, 8, 2, 3)], attrs={"blocksize": 2, "mode": "CRD"}, id="crd"),
    Case("DepthToSpace", [randn(1, 9, 2, 2)], attrs={"blocksize": 3, "mode": "CRD"}, unknown_shapes=True,
         id="crd-unknown"),
    Case("SpaceToDepth", [randn(1, 2, 4, 6)], attrs={"blocksize": 2}, id="basic"),
    Case("Trilu", [randn(4, 5)], opset=14, id="upper"),
    Case("Trilu", [randn(2, 4, 5), i64(1)], attrs={"upper": 0}, opset=14, id="lower-k"),
    Case("Trilu", [randn(4, 5), i64(-1)], opset=14, dynamic=[1], id="k-at-runtime"),
    Case("ReverseSequence", [randn(4, 2, 3), i64(4, 2)], attrs={"batch_axis": 1, "time_axis": 0}, id="time-major"),
    Case("ReverseSequence", [randn(3, 4, 2), i64(1, 3, 4)], attrs={"batch_axis": 0, "time_axis": 1},
         id="batch-major"),
]

SCATTER = [
    Case("ScatterElements", [randn(3, 4), i64(1, 0, 2, 0, 2, 1, 0, 1).reshape(2, 4), randn(2, 4)], opset=13,
         id="none"),
    Case("ScatterElements", [randn(3, 4), i64(-1, 0, 3, 2, 1, 2).reshape(3, 2), randn(3, 2)], attrs={"axis": 1},
         dynamic=[1], id="none-axis1"),
    Case("ScatterElements", [randn(3, 4), i64(1, 1, 1, 0, 1, 1, 0, 0).reshape(2, 4), randn(2, 4)],
         attrs={"reduction": "add"}, opset=16, id="add"),
    Case("ScatterElements", [randn(3, 4), i64(1, 0, 2, 0, 2, 1, 0, 1).reshape(2, 4), randn(2, 4)],
         attrs={"reduction": "mul"}, opset=16, id="mul"),
    Case("ScatterElements", [distinct(3, 4), i64(1, 1, 2, 0, 1, 1, 0, 0).reshape(2, 4), distinct(2, 4, scale=1.7)],
         attrs={"reduction": "max"}, opset=18, id="max"),
    Case("ScatterElements", [distinct(3, 4), i64(3, 3, 2, 0, 1, 1).reshape(3, 2), distinct(3, 2, scale=1.3)],
         attrs={"reduction": "min", "axis": -1}, opset=18, id="min"),
    Case("ScatterND", [randn(4, 3), i64(1, 3).reshape(2, 1), randn(2, 3)], opset=13, id="none-rows"),
    Case("ScatterND", [randn(3, 4), i64(0, 1, 2, -1, 1, 2).reshape(3, 2), randn(3)], dynamic=[1], id="none-elements"),
    Case("ScatterND", [randn(4, 3), i64(1, 3, 1).reshape(3, 1), randn(3, 3)], attrs={"reduction": "add"},
         opset=16, id="add"),
    Case("ScatterND", [randn(3, 4), i64(0, 1, 2, 3, 1, 2).reshape(3, 2), randn(3)], attrs={"reduction": "mul"},
         opset=16, id="mul"),
    Case("ScatterND", [distinct(4, 3), i64(1, 3, 1).reshape(3, 1), distinct(3, 3, scale=1.3)],
         attrs={"reduction": "max"}, opset=18, id="max"),
    Case("ScatterND", [distinct(4, 3), i64(1, 3, 1).reshape(3, 1), distinct(3, 3, scale=1.3)],
         attrs={"reduction": "min"}, opset=18, id="min"),
    Case("TensorScatter", [randn(2, 5, 3), randn(2, 2, 3)], opset=24, id="prefill"),
    Case("TensorScatter", [randn(2, 5, 3), randn(2, 2, 3), i64(1, 3)], opset=24, id="linear"),
    Case("TensorScatter", [randn(2, 3, 4, 2), randn(2, 3, 3, 2), i64(3, 1)], attrs={"mode": "circular"},
         opset=24, id="circular"),
    Case("TensorScatter", [randn(2, 4, 3), randn(2, 1, 3), i64(2, 0)], attrs={"axis": 1}, dynamic=[2],
         unknown_shapes=True, opset=24, id="axis1-unknown"),
]

CASES = RESHAPE + CONCAT_SPLIT + SLICE + GATHER + EXPAND_TILE + PAD + BLOCKS + SCATTER


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rule(case):
    run_case(case)


@pytest.mark.parametrize("seeded", [["y0", "y2"], ["y1"]], ids=["ends", "middle"])
def test_split_outputs_without_gradient(seeded):
    """Outputs no gradient reaches contribute zeros to the Concat."""
    case = Case("Split", [randn(2, 7)], attrs={"axis": 1, "num_outputs": 3}, outputs=3, opset=18)
    run_case(case, of=seeded)
    case = Case("Split", [randn(5, 2), i64(2, 1, 2)], outputs=3, opset=13, unknown_shapes=True)
    run_case(case, of=seeded)


def _grad_ops(case: Case) -> list[str]:
    model, _, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt)
    return [node.op_type for node in gm.graph.node[len(model.graph.node):]]


@pytest.mark.parametrize("case", [
    Case("Slice", [randn(5, 6), i64(1, 2), i64(4, 5)]),
    Case("Slice", [randn(5, 6), i64(5, 0), i64(0, 6), i64(0, 1), i64(-2, 3)]),
    Case("Slice", [randn(5, 6), i64(1), i64(-1), i64(1)], dynamic=[1, 2]),
    Case("Pad", [randn(3, 4), i64(2, 1, 1, 3)], attrs={"mode": "reflect"}),
], ids=["unit", "strided", "runtime-bounds", "reflect"])
def test_slice_and_pad_need_no_scatter(case):
    assert not {"ScatterND", "ScatterElements"} & set(_grad_ops(case))


def test_gather_scatter_add_by_opset():
    """Repeated indices: ScatterND reduction=add from opset 16, an exact one-hot MatMul before;
    constant indices without repeats: a plain ScatterND at any opset."""
    case = Case("Gather", [randn(5, 3), i64(0, 2, 2)], opset=16)
    assert "ScatterND" in _grad_ops(case)
    case.opset = 15
    ops = _grad_ops(case)
    assert "MatMul" in ops and "ScatterND" not in ops
    case = Case("Gather", [randn(5, 3), i64(0, -1, 2)], opset=13)
    ops = _grad_ops(case)
    assert "ScatterND" in ops and "MatMul" not in ops
    case = Case("GatherElements", [randn(3, 4), i64(0, 2, 2, 1, 1, 1, 0, 0).reshape(2, 4)], opset=13)
    ops = _grad_ops(case)
    assert "ScatterElements" in ops and "ReduceSum" not in ops


def _with_zero(x, *where):
    x = x.copy()
    for w in where:
        x[w] = 0.0
    return x


@pytest.mark.parametrize("case", [
    Case("ScatterElements", [randn(3, 4), i64(1, 1, 2, 0, 1, 1, 0, 0).reshape(2, 4),
                             _with_zero(randn(2, 4), (0, 1), (0, 3), (1, 3))],
         attrs={"reduction": "mul"}, opset=16, id="repeats-zeros"),
    Case("ScatterElements", [randn(3, 4), i64(1, 1, 2, 0, 1, 1, 0, 0).reshape(2, 4), randn(2, 4)],
         attrs={"reduction": "mul"}, opset=18, dynamic=[1], id="dynamic"),
    Case("ScatterND", [randn(4, 3), i64(1, 3, 1, 1).reshape(4, 1), _with_zero(randn(4, 3), (0, 0), (2, 0), (3, 1))],
         attrs={"reduction": "mul"}, opset=16, id="nd-repeats-zeros"),
], ids=str)
def test_scatter_mul_with_repeated_places(case):
    """Updates written to one place multiply: each one's gradient is the product of the others (zeros too)."""
    assert "Div" in _grad_ops(case)
    run_case(case)


def test_scatter_before_opset_11_is_upgraded():
    """Scatter (deprecated at 11) cannot be loaded at 13+; older models are upgraded to ScatterElements."""
    case = Case("Scatter", [randn(3, 4), i64(1, 0, 2, 0).reshape(1, 4), randn(1, 4)], opset=10)
    run_case(case)


# -- second order: the gradient graph is linear in the seeds; its own gradient is the forward op again --
def _check(model, feeds, wrt, of, tol32=2e-3, tol64=1e-5):
    harness.check_gradients(model, feeds, wrt, of, tol32=tol32, tol64=tol64, allow_unused=True)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradient_of_gradient(case):
    """d(dx)/d(seed) through the rules' own output (every op they emit has a rule)."""
    model, feeds, wrt = case_model(case)
    gm = onnxgrad.grad(model, wrt=wrt, of=float_outputs(model))
    spec = gradient_spec(gm)
    values = Runner(model)(feeds)
    rng = np.random.default_rng(0)
    feeds = dict(feeds)
    for out, seed in spec["seeds"].items():
        feeds[seed] = rng.standard_normal(values[out].shape).astype(np.float32)
    _check(gm, feeds, wrt=list(spec["seeds"].values()), of=list(spec["gradients"].values()))


# -- some dims known, some not (the harness's unknown_shapes hides them all) -------------------------
def _symbolic(case: Case, dims: dict[int, list]) -> tuple[onnx.ModelProto, dict, list[str]]:
    """case's model with input i declared with ``dims[i]`` (ints, or names for unknown dims)."""
    model, feeds, wrt = case_model(case)
    for i, shape in dims.items():
        vi = next(v for v in model.graph.input if v.name == f"x{i}")
        vi.type.tensor_type.CopyFrom(helper.make_tensor_type_proto(vi.type.tensor_type.elem_type, shape).tensor_type)
    del model.graph.output[:]
    inferred = onnx.shape_inference.infer_shapes(model)
    out = [vi for vi in inferred.graph.value_info if vi.name.startswith("y")]
    model.graph.output.extend(out)
    return model, feeds, wrt


PARTLY_KNOWN = [
    (Case("Slice", [randn(6, 5), i64(5), i64(0), i64(0), i64(-2)]), {0: [6, "T"]}),
    (Case("Slice", [randn(3, 7), i64(1), i64(7), i64(1), i64(3)]), {0: ["N", 7]}),
    (Case("Pad", [randn(2, 4), i64(0, 2, 0, 3)], attrs={"mode": "reflect"}), {0: ["N", 4]}),
    (Case("Gather", [randn(2, 5, 3), i64(4, 0, 4)], attrs={"axis": 1}), {0: ["N", 5, "C"]}),
    (Case("Gather", [randn(2, 5, 3), i64(4, 0, 4)], attrs={"axis": 1}, opset=13), {0: ["N", 5, "C"]}),
    (Case("GatherElements", [randn(2, 3), i64(2, 0, 0, 1).reshape(2, 2)], attrs={"axis": 1}, opset=13),
     {0: ["N", 3]}),
    (Case("Tile", [randn(2, 3), i64(2, 2)]), {0: ["N", 3]}),
    (Case("Concat", [randn(2, 3), randn(2, 2), randn(2, 4)], attrs={"axis": 1}, wrt=[0, 1]),
     {0: ["N", "A"], 1: ["N", "B"]}),
    (Case("DepthToSpace", [randn(2, 8, 2, 3)], attrs={"blocksize": 2, "mode": "CRD"}), {0: ["N", 8, 2, "W"]}),
    (Case("CenterCropPad", [randn(2, 5, 3), i64(4, 2)], attrs={"axes": [1, 2]}, opset=18), {0: ["N", 5, 3]}),
]


@pytest.mark.parametrize("case,dims", PARTLY_KNOWN, ids=[str(c) for c, _ in PARTLY_KNOWN])
def test_partly_known_shapes(case, dims):
    model, feeds, wrt = _symbolic(case, dims)
    _check(model, feeds, wrt, of=float_outputs(model))


def _rank_unknown_model(node: onnx.NodeProto, extra: list, out_shapes: list, opset: int = 18):
    """x [2, 3] -> Reshape(x, s) with s fed at run time (so r's rank is unknown) -> node(r, *extra)."""
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
              helper.make_tensor_value_info("s", onnx.TensorProto.INT64, [None])]
    inputs += [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(v.shape)) for name, v in extra]
    outputs = [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, shape)
               for o, shape in zip(node.output, out_shapes)]
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["r"]), node], "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = onnxgrad.ir.load.emitted_ir_version(model)
    feeds = {"x": randn(2, 3), "s": i64(2, 3), **dict(extra)}
    return model, feeds, ["x"] + [name for name, _ in extra]


@pytest.mark.parametrize("node,extra,out_shapes", [
    (helper.make_node("Concat", ["r", "w"], ["y"], axis=-1), [("w", randn(2, 2))], [[2, 5]]),
    (helper.make_node("Concat", ["w", "r"], ["y"], axis=0), [("w", randn(1, 3))], [[3, 3]]),
    (helper.make_node("Split", ["r"], ["y0", "y1"], axis=-1, num_outputs=2), [], [[2, 2], [2, 1]]),
    (helper.make_node("Slice", ["r", "b", "e", "a", "t"], ["y"]), [], [[2, 2]]),
    (helper.make_node("Transpose", ["r"], ["y"]), [], [[3, 2]]),
], ids=["concat-neg-axis", "concat", "split", "slice", "transpose"])
def test_unknown_rank(node, extra, out_shapes):
    model, feeds, wrt = _rank_unknown_model(node, extra, out_shapes)
    if node.op_type == "Slice":   # r[:, ::-2] with all bounds constant
        model.graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in
                                       dict(b=i64(-1), e=i64(-BIG), a=i64(-1), t=i64(-2)).items())
    r = [vi for vi in onnxgrad.ir.model.infer(model).graph.value_info if vi.name == "r"]
    assert not r or not r[0].type.tensor_type.HasField("shape")   # r's rank is unknown
    _check(model, feeds, wrt, of=[o.name for o in model.graph.output])
