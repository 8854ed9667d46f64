"""The built-in gradient rules: one module per op family, in one registry (:mod:`.registry`); importing a
family registers its rules. Installed as ``onnxgrad.rules`` (the directory stands beside ``onnxgrad/``).

A rule reads like its formula: it receives a :class:`~.registry.Node` (the forward node's tensors as
builder Vars, the output gradients ``n.dy``/``n.dys``) and returns one gradient per input, in standard ops.
The forward-mode tangent rules are :mod:`.tangents`. Rules import the IR (``onnxgrad.ir``) and nothing
above it: the few that differentiate a graph of their own get the reverse pass as ``n.differentiate``.
"""
from . import (  # noqa: F401  (importing registers the rules)
    activations,
    attention,
    control,
    elementwise,
    linalg,
    losses,
    nn,
    normalization,
    recurrent,
    reduce,
    sampling,
    sequence,
    shape,
    spectral,
    stop,
)
