"""MaxPool backward rewrites without the forward's Indices.

The canonical MaxPool rule scatters dy at the forward's Indices. For 2x2 windows that tile the
image, the first maximum of each tile can be found again from x and y, so the forward pool drops its
Indices output (onnxruntime's Indices kernel costs several times the pool itself: 1.9 against 0.3 ms
at bench_step's CNN's first pool, ``[32, 32, 32, 32]``).

- ``max_pool_taps`` (cpu target): the taps of x's tiles in two contiguous splits, the first one not
  below y as an index, and MaxUnpool puts dy there;
- ``relu_max_pool_taps`` (cpu target): the same where x = Relu(z) and the pool is all that reads x, with
  the ReLU's mask applied to dy at the pool's resolution, a quarter of x's, instead of to dx;
- :func:`first_maximum_taps` (the webgpu target's ``max_pool_taps_float``): the same taps, float masks per
  tap, interleaved back by Concats.
"""
from __future__ import annotations

import numpy as np
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
    if final.output[0] not in view.outputs and not view.readers.get(final.output[0]):
        return None                     # unread: a relu_max_pool_taps took the gradient it gave
    pool = view.producer.get(where.input[0])
    if pool is None or pool.op_type != "MaxPool" or len(pool.output) < 2 or pool.output[1] != where.input[0]:
        return None
    return Match(final, [final.output[0]], dict(pool=pool, x=pool.input[0], y=pool.output[0],
                                                dy=updates.input[0]))


def max_pool_taps_check(view: GraphView, m: Match) -> str | None:
    pool, shape = m.pool, view.batched_shape(m.x)
    if view.info(m.x).dtype not in _TAP_TYPES:
        return "x is neither float nor double"
    if (view.attr(pool, "kernel_shape") != [2, 2] or view.attr(pool, "strides") != [2, 2]
            or any(view.attr(pool, "pads", [])) or any(d != 1 for d in view.attr(pool, "dilations", []))
            or view.attr(pool, "auto_pad", "NOTSET") not in ("NOTSET", "VALID")
            or view.attr(pool, "storage_order", 0) != 0):
        return "not 2x2 windows with stride 2 and no pads"
    if shape is None or len(shape) != 4 or shape[2] % 2 or shape[3] % 2:
        return "x's spatial shape is not static and even (or its channels are not static)"
    return None


def max_pool_unpool_check(view: GraphView, m: Match) -> str | None:
    if view.info(m.x).dtype != TensorProto.FLOAT:
        return "x is not float (onnxruntime's MaxUnpool has a float kernel only)"
    return max_pool_taps_check(view, m)


def _tiles(b: Builder, view: GraphView, m: Match) -> tuple[int, int, Var, Var, dict[tuple[int, int], Var]]:
    """x as tiles t[r, i, c, j] = x[n, k, 2h + i, 2c + j] (r = (n K + k) H/2 + h): (rows, W, y and dy as flat
    [rows, W/2] planes, the taps (i, j) -> t[:, i, :, j] as such planes). Every plane is flat (a last axis of
    1 would take onnxruntime's slow broadcast), and the taps are slices of contiguous axes: the column splits
    each row pair, the row split is a copy of whole rows (a strided Slice of x took 2x as long)."""
    n, c, h, w = view.batched_shape(m.x)
    rows, half = (-1 if n is None else n * c * h // 2), w // 2           # -1: a symbolic batch axis
    tiles = b.op.Reshape(b.var(m.x), b.ints([rows, 2, half, 2]))
    flat = b.ints([rows, half])
    columns = [b.op.Slice(tiles, b.ints([j]), b.ints([j + 1]), b.ints([3])) for j in (0, 1)]
    taps = {(i, j): b.op.Reshape(b.op.Slice(columns[j], b.ints([i]), b.ints([i + 1]), b.ints([1])), flat)
            for i in (0, 1) for j in (0, 1)}
    return rows, w, b.op.Reshape(b.var(m.y), flat), b.op.Reshape(b.var(m.dy), flat), taps


def first_maximum_unpooled(b: Builder, view: GraphView, m: Match, relu: bool = False) -> list[Var]:
    """Tap (i, j) of tile (r, c) (:func:`_tiles`) is the first maximum where no earlier tap in row-major order
    is the maximum, as PyTorch's max_pool2d picks it; a tap below y is not:  below_ij = t[:, i, :, j] < y.
    Its index in x, flat, is

        2 W r + 2 c + below_00 (1 + below_01 (W - 1 + below_10))       (+0, +1, +W or +W + 1)

    and MaxUnpool puts dy there. The index within the row pair is small and exact in float, where the
    arithmetic is cheaper than in int64; only the row pair's start is added in int64. With ``relu``, x =
    Relu(z) and the result is dz = dx (x > 0): the first maximum's x is y, so the mask is (y > 0) on dy, a
    quarter of x's size.
    """
    x = b.var(m.x)
    rows, w, y, dy, taps = _tiles(b, view, m)

    def below(i: int, j: int) -> Var:
        return b.op.Cast(b.op.Less(taps[i, j], y), to=x.dtype)

    in_pair = below(0, 0) * (1.0 + below(0, 1) * (w - 1.0 + below(1, 0))) + b.const(np.arange(w // 2) * 2.0, x.dtype)
    size = b.op.Size(x) if rows == -1 else b.int_scalar(rows * 2 * w)                     # = rows 2W
    starts = b.op.Range(b.int_scalar(0), size, b.int_scalar(2 * w))
    index = b.op.Reshape(starts, b.ints([rows, 1])) + b.op.Cast(in_pair, to=TensorProto.INT64)
    if relu:
        dy = dy * b.op.Cast(b.op.Greater(y, b.scalar(0.0, x)), to=x.dtype)
    quarter = b.ints([1, 1, rows, w // 2])
    dx = b.op.MaxUnpool(b.op.Reshape(dy, quarter), b.op.Reshape(index, quarter), kernel_shape=[2, 2],
                        strides=[2, 2])                                                 # [1, 1, 2 rows, W]
    return [b.reshape_like(dx, x)]


def relu_max_pool_pattern(view: GraphView, node: onnx.NodeProto) -> Match | None:
    """Where(Greater(x, 0), dx, 0), the gradient of x = Relu(z) (:func:`onnxgrad.rules.activations.relu`), where
    dx is the canonical gradient of a MaxPool of x (:func:`max_pool_taps_pattern`) and nothing else reads it: x
    has no other reader whose gradient would add to dx."""
    if len(node.input) != 3 or not view.is_scalar(node.input[2], 0.0):
        return None
    mask, final = view.made_by(node.input[0], "Greater"), view.made_by(node.input[1], "Reshape")
    if mask is None or final is None or not view.is_scalar(mask.input[1], 0.0):
        return None
    scatter = view.made_by(final.input[0], "ScatterElements")
    pooled = max_pool_taps_pattern(view, scatter) if scatter is not None else None
    if (pooled is None or pooled.root is not final or pooled.x != mask.input[0]
            or view.made_by(pooled.x, "Relu") is None or view.readers.get(final.output[0]) != [node]):
        return None
    return Match(node, [node.output[0]], dict(pooled.values))


def first_maximum_taps(b: Builder, view: GraphView, m: Match) -> list[Var]:
    """Tap t = (i, j) of every tile (:func:`_tiles`) is the first maximum where it equals y and no earlier tap
    did, with the masks as 0/1 floats for runtimes without MaxUnpool or fast And/Or: hit_t = eq_t (1 - taken),
    taken += hit_t, dx_t = dy hit_t; the four quarter planes interleave back by Concats of the tiles' axes."""
    x = b.var(m.x)
    rows, w, y, dy, taps = _tiles(b, view, m)
    earlier = None                                                          # some earlier tap is the max
    quarter = b.ints([rows, 1, w // 2, 1])
    parts = {}
    for i, j in ((0, 0), (0, 1), (1, 0), (1, 1)):
        equal = b.op.Cast(b.op.Equal(taps[i, j], y), to=x.dtype)
        hit = equal if earlier is None else equal * (b.scalar(1.0, x) - earlier)
        earlier = hit if earlier is None else earlier + hit
        parts[i, j] = b.op.Reshape(dy * hit, quarter)                      # [rows, 1, W/2, 1]
    pairs = [b.op.Concat(parts[i, 0], parts[i, 1], axis=3) for i in (0, 1)]
    return [b.reshape_like(b.op.Concat(*pairs, axis=1), x)]                 # [rows, 2, W/2, 2]


MAX_POOL_TAPS = Rewrite("max_pool_taps", "ScatterElements", max_pool_taps_pattern, max_pool_unpool_check,
                        first_maximum_unpooled, "2x2 MaxPool's scatter at the Indices as the first tap not below y, "
                        "unpooled there")


def _unpooled_through_relu(b: Builder, view: GraphView, m: Match) -> list[Var]:
    return first_maximum_unpooled(b, view, m, relu=True)


RELU_MAX_POOL_TAPS = Rewrite("relu_max_pool_taps", "Where", relu_max_pool_pattern, max_pool_unpool_check,
                             _unpooled_through_relu,
                             "a ReLU's mask under a 2x2 MaxPool's unpooled gradient applied to dy, before the unpool")
