"""Gradient rules: linalg."""
from __future__ import annotations

from ..registry import register


@register("MatMul")
def matmul(n):
    """d(A @ B) = (dY @ B^T, A^T @ dY), numpy matmul semantics (1-D operands, batch broadcast)."""
    from ..builder import Var  # noqa: F401
    a, b = n.inputs
    dy = n.dy
    ra, rb = a.rank, b.rank
    if ra is None or rb is None:
        raise NotImplementedError
    bt = n.op.Transpose(b, perm=list(range(rb - 2)) + [rb - 1, rb - 2]) if rb >= 2 else b
    da = n.op.MatMul(dy, bt)
    db = n.op.MatMul(n.op.Transpose(a, perm=list(range(ra - 2)) + [ra - 1, ra - 2]), dy)
    return n.b.unbroadcast(da, a), n.b.unbroadcast(db, b)
