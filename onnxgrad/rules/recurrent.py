"""Gradient rules: recurrent."""
from __future__ import annotations

from ..registry import register
