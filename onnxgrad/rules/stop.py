"""Gradient rules: stop."""
from __future__ import annotations

from ..registry import register
