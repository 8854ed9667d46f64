"""What the passes record on the gradient models they write (JSON metadata), read back.

:func:`onnxgrad.grad` records which tensors it differentiated and the names of the gradients and seeds it
added (:func:`gradient_spec`), and where its backward nodes start (:func:`backward_nodes`). The checker,
recomputation, the training artifacts, the lowering and the CLI read these records; only the pass writes them.
"""
from __future__ import annotations

import json

import onnx

from ..errors import UnknownNameError

__all__ = ["SPEC_KEYS", "gradient_spec", "backward_nodes"]

# The metadata keys the pass writes on a gradient model (JSON values), read back by gradient_spec.
SPEC_KEYS = ("wrt", "of", "loss", "gradients", "seeds")


def gradient_spec(grad_model: onnx.ModelProto) -> dict:
    """wrt, of, loss, gradient and seed names, as :func:`grad` recorded them in the model's metadata."""
    meta = {p.key: p.value for p in grad_model.metadata_props}
    return {k: json.loads(meta[f"onnxgrad.{k}"]) for k in SPEC_KEYS}


def backward_nodes(grad_model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes :func:`grad` appended after the forward's (it records where they start; the forward it
    copied may have more nodes than the model it was given: tied weights recomputed, names given)."""
    meta = {p.key: p.value for p in grad_model.metadata_props}
    if "onnxgrad.forward_nodes" not in meta:
        raise UnknownNameError("the model has no onnxgrad.forward_nodes metadata: it is not a gradient model "
                               "written by this version of onnxgrad.grad")
    return list(grad_model.graph.node[int(meta["onnxgrad.forward_nodes"]):])
