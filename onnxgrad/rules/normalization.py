"""Gradient rules: normalization."""
from __future__ import annotations

from ..registry import register
