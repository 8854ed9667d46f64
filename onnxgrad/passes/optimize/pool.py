"""MaxPool backward rewrite for onnxruntime's CPU kernels.

The canonical MaxPool rule scatters dy at the forward's Indices. For 2x2 windows that tile the
image, the first maximum of each tile can be found again from x and y with four strided Slices,
so the forward pool drops its Indices output (onnxruntime's Indices kernel costs several times
the pool itself) and the backward needs no scatter.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto

from ...ir.builder import Builder, Var
from .rewriter import GraphView, Match, Rewrite

_TAP_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE)   # onnxruntime's Equal has no float16 kernel


def max_pool_taps_pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """Reshape(ScatterElements(zeros, Reshape(MaxPool(x).Indices), Reshape(dy)), x's shape): the
    canonical MaxPool gradient of windows that do not overlap (:func:`onnxgrad.rules.nn._scatter_add`)."""
    if len(node.input) != 3 or view.attr(node, "reduction", "none") != "none":
        return None
    where, updates = view.made_by(node.input[1], "Reshape"), view.made_by(node.input[2], "Reshape")
    final = view.only_reader(node.output[0], "Reshape")
    if where is None or updates is None or final is None:
        return None
    pool = view.producer.get(where.input[0])
    if pool is None or pool.op_type != "MaxPool" or len(pool.output) < 2 or pool.output[1] != where.input[0]:
        return None
    return Match(final, [final.output[0]], dict(pool=pool, x=pool.input[0], y=pool.output[0],
                                                dy=updates.input[0]))


def max_pool_taps_check(view: GraphView, m: Match) -> str | None:
    pool, shape = m.pool, view.shape(m.x)
    if view.info(m.x).dtype not in _TAP_TYPES:
        return "x is neither float nor double"
    if (view.attr(pool, "kernel_shape") != [2, 2] or view.attr(pool, "strides") != [2, 2]
            or any(view.attr(pool, "pads", [])) or any(d != 1 for d in view.attr(pool, "dilations", []))
            or view.attr(pool, "auto_pad", "NOTSET") not in ("NOTSET", "VALID")
            or view.attr(pool, "storage_order", 0) != 0):
        return "not 2x2 windows with stride 2 and no pads"
    if shape is None or len(shape) != 4 or shape[2] % 2 or shape[3] % 2:
        return "x's spatial shape is not static and even"
    return None


def first_maximum_taps(b: Builder, view: GraphView, m: Match, masks: str = "bool") -> list[Var]:
    """Tap t = (i, j) of every tile is x[..., i::2, j::2]; it is the first maximum where it equals y
    and no earlier tap did:  hit_t = (x_t == y) and not any_{s<t} (x_s == y);  dx_t = where(hit_t, dy, 0),
    and the four quarter planes interleave back by two Concats. ``masks="float"`` keeps the masks as 0/1
    floats (hit_t = eq_t (1 - taken), taken += hit_t, dx_t = dy hit_t) for runtimes without fast And/Or."""
    x, y, dy = b.var(m.x), b.var(m.y), b.var(m.dy)
    axes, steps, ends = b.ints([2, 3]), b.ints([2, 2]), b.ints(view.shape(m.x)[2:])
    earlier = None                                                          # some earlier tap is the max
    taps = []
    for i, j in ((0, 0), (0, 1), (1, 0), (1, 1)):
        equal = b.op.Equal(b.op.Slice(x, b.ints([i, j]), ends, axes, steps), y)       # [N, C, H/2, W/2]
        if masks == "float":
            equal = b.op.Cast(equal, to=x.dtype)
            hit = equal if earlier is None else equal * (b.scalar(1.0, x) - earlier)
            earlier = hit if earlier is None else earlier + hit
            taps.append(b.unsqueeze(dy * hit, [3, 5]))
            continue
        hit = equal if earlier is None else b.op.And(equal, b.op.Not(earlier))
        if (i, j) != (1, 1):
            earlier = equal if earlier is None else b.op.Or(earlier, equal)
        taps.append(b.unsqueeze(b.op.Where(hit, dy, b.scalar(0.0, x)), [3, 5]))   # [N, C, H/2, 1, W/2, 1]
    rows = [b.op.Concat(taps[0], taps[1], axis=5), b.op.Concat(taps[2], taps[3], axis=5)]
    return [b.reshape_like(b.op.Concat(*rows, axis=3), x)]                   # [N, C, H/2, 2, W/2, 2]


MAX_POOL_TAPS = Rewrite("max_pool_taps", "ScatterElements", max_pool_taps_pattern, max_pool_taps_check,
                        first_maximum_taps, "2x2 MaxPool's scatter at the Indices as four strided compares with y")
