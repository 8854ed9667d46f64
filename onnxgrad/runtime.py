"""onnxruntime, which onnxgrad's core does not depend on: training, checking and coverage run on it.

onnxruntime (CPU) and onnxruntime-gpu are two distributions of one ``onnxruntime`` module, so the package
leaves the choice to its extras: ``pip install "onnxgrad[cpu]"`` or ``pip install "onnxgrad[cuda]"``.
Building gradient graphs needs neither.
"""
from __future__ import annotations

from types import ModuleType

from .errors import OnnxGradError

__all__ = ["RuntimeMissingError", "onnxruntime"]

INSTALL = 'pip install "onnxgrad[cpu]" (or "onnxgrad[cuda]" for onnxruntime-gpu)'


class RuntimeMissingError(OnnxGradError):
    """onnxruntime is not installed, and what was asked runs on it."""


def onnxruntime(what: str) -> ModuleType:
    """The ``onnxruntime`` module; :class:`RuntimeMissingError` naming ``what`` needs it and the install
    command when it is not installed."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise RuntimeMissingError(f"{what} runs on onnxruntime, which is not installed: {INSTALL}; building "
                                  "gradient graphs (onnxgrad.grad, the CLI without --check) needs no runtime") from None
    return ort
