"""onnxgrad: gradients of ONNX models as standard ONNX graphs.

>>> import onnxgrad
>>> gm = onnxgrad.grad("model.onnx", loss="loss")   # forward + backward, one ModelProto
"""
from __future__ import annotations

__version__ = "0.1.0"

from .autodiff import grad, gradient_spec
from .errors import (
    ExportFoldedError,
    ExportWarning,
    InvalidModelError,
    NonFloatError,
    OnnxGradError,
    RuleError,
    UnknownNameError,
    UnsupportedOpError,
    UnusedError,
)
from .forward import jvp
from .funcs import hessian, hvp, jacfwd, jacobian, jacrev
from .params import parameters
from .registry import register as register_rule
from .torch_export import TorchExportError, from_torch

# isort: split
from . import rules  # noqa: F401,E402  (registers the built-in rules)

_LAZY = {"TrainingSession": "training", "optim": None, "losses": None, "lower": "lowering"}


def __getattr__(name: str):
    """Training pieces load on first use, so ``import onnxgrad`` stays light."""
    import importlib

    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
        return module if _LAZY[name] is None else getattr(module, name)
    raise AttributeError(f"module 'onnxgrad' has no attribute {name!r}")


__all__ = [
    "from_torch",
    "TrainingSession",
    "optim",
    "losses",
    "lower",
    "grad",
    "gradient_spec",
    "jvp",
    "hvp",
    "jacrev",
    "jacfwd",
    "jacobian",
    "hessian",
    "parameters",
    "register_rule",
    "OnnxGradError",
    "ExportFoldedError",
    "ExportWarning",
    "InvalidModelError",
    "UnknownNameError",
    "NonFloatError",
    "UnusedError",
    "UnsupportedOpError",
    "RuleError",
    "TorchExportError",
    "__version__",
]
