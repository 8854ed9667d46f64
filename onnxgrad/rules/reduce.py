"""Gradient rules: reduce."""
from __future__ import annotations

from ..registry import register
