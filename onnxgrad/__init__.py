"""onnxgrad: gradients of ONNX models as standard ONNX graphs.

>>> import onnxgrad
>>> gm = onnxgrad.grad("model.onnx", loss="loss")   # forward + backward, one ModelProto
"""
from __future__ import annotations

__version__ = "0.1.0"

from .autodiff import grad
from .errors import (
    InvalidModelError,
    NonFloatError,
    OnnxGradError,
    RuleError,
    UnknownNameError,
    UnsupportedOpError,
    UnusedError,
)
from .registry import register as register_rule
from . import rules  # noqa: F401,E402  (registers the built-in rules)

__all__ = [
    "grad",
    "register_rule",
    "OnnxGradError",
    "InvalidModelError",
    "UnknownNameError",
    "NonFloatError",
    "UnusedError",
    "UnsupportedOpError",
    "RuleError",
    "__version__",
]
