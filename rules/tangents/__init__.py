"""Forward-mode (tangent) rules, one module per op family, in one registry (:mod:`.base`).

Ops without a native rule that have a reverse rule get their tangent from the transpose of the reverse rule
(:mod:`onnxgrad.passes.tangent_fallback`, a pass: it runs the reverse pass).
"""
from onnxgrad.ir.builder import total

from . import elementwise, linalg, nn, shape  # noqa: F401  (importing registers the rules)
from .base import TNode, all_tangent_rules, defjvp, deflinear, get_tangent_rule

__all__ = ["TNode", "defjvp", "deflinear", "get_tangent_rule", "all_tangent_rules", "total"]
