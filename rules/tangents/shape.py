"""Data movement and sums: linear in the data, so the tangent is the op itself on the tangent.

Indices, shapes, axes, pads and scales stay as they are; a second data input
(Concat's pieces, Pad's constant, Scatter's updates) is zeros when no tangent
reaches it.
"""
from __future__ import annotations

from .base import TNode, defjvp, deflinear

deflinear(
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand", "Tile",
    "Slice", "Concat", "Split", "DepthToSpace", "SpaceToDepth", "Trilu",
    "Gather", "GatherElements", "GatherND", "Compress", "ReverseSequence",
    "ReduceSum", "ReduceMean", "CumSum", "AveragePool", "GlobalAveragePool",
    "NegativeLogLikelihoodLoss",
)


@defjvp("Pad")
def pad(t: TNode):
    """d Pad(x, pads, c) = Pad(dx, pads, dc): the padding of the tangent is dc, 0 for a constant c
    (not c: the op is affine, not linear, in x when c is not 0)"""
    args = list(t.inputs)
    args[0] = t.tangent_or_zeros(0)
    if len(args) > 2 and args[2] is not None:
        args[2] = t.tangent_or_zeros(2)
    return t.same_op(*args)
