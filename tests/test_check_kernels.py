"""The numeric check's float64 kernels (onnxgrad.tools.check.kernels) against onnxruntime, and a failing one named."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgrad.tools.check import ReferenceKernelError, Runner

D = TensorProto.DOUBLE


def _gather_elements(axis: int) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("GatherElements", ["data", "idx"], ["y"], axis=axis, name="gather")],
                          "gather_elements", [helper.make_tensor_value_info("data", D, None),
                                              helper.make_tensor_value_info("idx", TensorProto.INT64, None)],
                          [helper.make_tensor_value_info("y", D, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


RNG = np.random.default_rng(11)
GATHER_CASES = [   # (data shape, axis, index shape, low, high)
    ((1, 512), 1, (1, 32), 0, 512),        # BERT: the token_type_ids buffer read at the 32 positions
    ((3, 100), 1, (3, 7), -100, 100),      # more than 64 along the axis, negative indices
    ((2, 70, 3), 1, (2, 5, 3), 0, 70),     # rank 3, more than 64
    ((4, 3), 0, (2, 2), -4, 4),            # indices shorter than the data off the axis
    ((5, 6, 7), -1, (5, 2, 9), 0, 7),
    ((2, 3), 1, (2, 0), 0, 3),             # no index
]


@pytest.mark.parametrize("data_shape, axis, idx_shape, low, high", GATHER_CASES)
def test_gather_elements_in_reference_equals_onnxruntime(data_shape, axis, idx_shape, low, high):
    feeds = {"data": RNG.standard_normal(data_shape), "idx": RNG.integers(low, high, idx_shape)}
    m = _gather_elements(axis)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = Runner(m, runtime="reference", reason="the corrected kernel under test")(feeds)["y"]
    assert got.shape == want.shape == idx_shape
    np.testing.assert_array_equal(got, want)


def test_a_kernel_that_fails_names_its_node_and_op():
    run = Runner(_gather_elements(1), runtime="reference", reason="the corrected kernel under test")
    with pytest.raises(ReferenceKernelError, match=r"node 'gather' \(GatherElements\) of the model "
                       r"'gather_elements': GatherElements: an index is outside \[-4, 3\] along axis 1") as e:
        run({"data": np.zeros((2, 4)), "idx": np.array([[0, 4], [1, 2]])})
    assert e.value.node.op_type == "GatherElements"
