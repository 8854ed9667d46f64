"""Gradient rules: sampling."""
from __future__ import annotations

from ..registry import register
