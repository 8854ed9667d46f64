"""Gradient rules: attention."""
from __future__ import annotations

from ..registry import register
