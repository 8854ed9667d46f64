"""Gradient rules: shape."""
from __future__ import annotations

from ..registry import register
