"""Gradient rules: losses."""
from __future__ import annotations

from ..registry import register
