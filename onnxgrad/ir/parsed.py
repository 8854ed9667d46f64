"""One parsed model that the passes share: the proto and the facts about it, each computed once.

A pass that is handed a :class:`ParsedModel` reads its facts (``opset``, the shape-inferred ``inferred``,
tensor ``infos`` and ``types``, ``nodes``, ``producer``, ``consumers``, ``initializers``) instead of
computing them again from the proto; the parameter policy, the reverse pass and the training build hand one
parsed model on. An edit that keeps every tensor's type (restoring tied parameters, holding weights aside)
is :meth:`ParsedModel.edited`: the new proto with the facts that still hold.
"""
from __future__ import annotations

import os
from functools import cached_property

import onnx

from . import model as M
from .builder import TensorInfo

__all__ = ["ParsedModel"]


class ParsedModel:
    """A loaded, validated model (:func:`onnxgrad.ir.model.load`) and its facts, computed on first use."""

    def __init__(self, proto: onnx.ModelProto):
        self.proto = proto

    @classmethod
    def of(cls, model: "ParsedModel | onnx.ModelProto | str | os.PathLike") -> "ParsedModel":
        """``model`` parsed: a parsed model as it is; a proto or a path loaded, validated and normalised."""
        return model if isinstance(model, ParsedModel) else cls(M.load(model))

    def edited(self, proto: onnx.ModelProto) -> "ParsedModel":
        """The parsed model of an edit of this one that keeps the opset and every tensor's type (it may add
        tensors: their types are inferred again, on first use)."""
        out = ParsedModel(proto)
        out.__dict__["opset"] = self.opset
        return out

    @property
    def graph(self) -> onnx.GraphProto:
        return self.proto.graph

    @cached_property
    def opset(self) -> int:
        """The ai.onnx opset the model imports."""
        return M.opset_of(self.proto)

    @cached_property
    def inferred(self) -> onnx.ModelProto:
        """The model with ONNX shape inference's types and shapes (:func:`onnxgrad.ir.model.infer`)."""
        return M.infer(self.proto)

    @cached_property
    def _infos_and_types(self) -> tuple[dict[str, TensorInfo], dict[str, onnx.TypeProto]]:
        return M.tensor_infos(self.inferred)

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Every tensor's element type and shape, as far as they are known."""
        return self._infos_and_types[0]

    @property
    def types(self) -> dict[str, onnx.TypeProto]:
        """Every tensor's TypeProto (sequences and optionals included)."""
        return self._infos_and_types[1]

    @cached_property
    def nodes(self) -> list[onnx.NodeProto]:
        """The graph's nodes in order, each with a name (``<op>_<index>`` for the unnamed: the name the
        backward nodes, errors and a viewer give it)."""
        nodes = list(self.graph.node)
        for i, node in enumerate(nodes):
            if not node.name:
                node.name = f"{node.op_type}_{i}"
        return nodes

    @cached_property
    def producer(self) -> dict[str, onnx.NodeProto]:
        """The node that makes each tensor."""
        return {o: node for node in self.nodes for o in node.output if o}

    @cached_property
    def consumers(self) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
        """The nodes reading each tensor, with the input position (a tensor read twice is listed twice)."""
        out: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in self.nodes:
            for k, x in enumerate(node.input):
                if x:
                    out.setdefault(x, []).append((node, k))
        return out

    @cached_property
    def initializers(self) -> dict[str, onnx.TensorProto]:
        """The initializers by name (their data may be held aside: :mod:`onnxgrad.ir.files`)."""
        return {i.name: i for i in self.graph.initializer}

    @cached_property
    def known(self) -> set[str]:
        """Every tensor of the main graph: inputs, initializers and node outputs."""
        return {i.name for i in self.graph.input} | set(self.initializers) | set(self.producer)

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.graph.output]
