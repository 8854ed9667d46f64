"""onnxgrad: gradients of ONNX models as standard ONNX graphs.

>>> import onnxgrad
>>> gm = onnxgrad.grad("model.onnx", loss="loss")   # forward + backward, one ModelProto
"""
from __future__ import annotations


def _rules_beside_the_package() -> None:
    """In a source checkout the per-op rules stand beside the package, in ``rules/``, which the wheel installs
    as ``onnxgrad.rules`` (pyproject's package-dir): import them from there under that name, as installed."""
    import importlib.util
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    init = os.path.join(os.path.dirname(here), "rules", "__init__.py")
    if "onnxgrad.rules" in sys.modules or os.path.isdir(os.path.join(here, "rules")) or not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location("onnxgrad.rules", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    sys.modules["onnxgrad.rules"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_rules_beside_the_package()

# isort: split
from .errors import (
    ExportFoldedError,
    ExportWarning,
    FeedConversionWarning,
    FeedError,
    InvalidModelError,
    NonFloatError,
    OnnxGradError,
    RuleError,
    UnknownNameError,
    UnsupportedOpError,
    UnusedError,
)
from .passes.autodiff import grad
from .passes.forward import jvp
from .passes.funcs import hessian, hvp, jacfwd, jacobian, jacrev
from .passes.params import parameters
from .passes.record import gradient_spec
from .rules.registry import register as register_rule
from .training.torch_export import TorchExportError, from_torch
from .version import __version__

# isort: split
from . import rules  # noqa: F401,E402  (registers the built-in rules)

_LAZY = {"TrainingSession": "training.session", "optim": "training.optim", "losses": "training.losses",
         "lower": "tools.lowering"}


def __getattr__(name: str):
    """Training pieces load on first use, so ``import onnxgrad`` stays light."""
    import importlib

    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return module if _LAZY[name].endswith(f".{name}") else getattr(module, name)
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
    "FeedError",
    "FeedConversionWarning",
    "InvalidModelError",
    "UnknownNameError",
    "NonFloatError",
    "UnusedError",
    "UnsupportedOpError",
    "RuleError",
    "TorchExportError",
    "__version__",
]
