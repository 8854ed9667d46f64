"""Data movement and sums: linear in the data, so the tangent is the op itself on the tangent.

Indices, shapes, axes, pads and scales stay as they are; a second data input
(Concat's pieces, Pad's constant, Scatter's updates) is zeros when no tangent
reaches it.
"""
from __future__ import annotations

from .base import deflinear

deflinear(
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand", "Tile",
    "Slice", "Concat", "Split", "Pad", "DepthToSpace", "SpaceToDepth", "Trilu",
    "Gather", "GatherElements", "GatherND", "Compress", "ReverseSequence",
    "ReduceSum", "ReduceMean", "CumSum", "AveragePool", "GlobalAveragePool",
    "NegativeLogLikelihoodLoss",
)
