"""The IR layer: ONNX models as the passes read and write them, below everything else.

- :mod:`.load`: reading a model (a path, external data), validating and normalising it; ``parse``.
- :mod:`.model`: :class:`~.model.ParsedModel`, the model every pass shares, and its facts (types and
  shapes, opset, constants, subgraphs, names).
- :mod:`.builder`: the expression builder that rules and passes emit nodes with (``Var`` arithmetic).
- :mod:`.graph`: walks (which nodes and tensors some targets depend on).
- :mod:`.files`: writing models and arrays, external data, weights held aside.
- :mod:`.grouping`: the grouped view of a backward graph (one function call per forward node).

Imports nothing of onnxgrad but :mod:`onnxgrad.errors`.
"""
