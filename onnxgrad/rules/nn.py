"""Gradient rules: nn."""
from __future__ import annotations

from ..registry import register
