"""Gradient rules: resampling (Resize, GridSample, RoiAlign) and AffineGrid.

All three resamplers are linear in X: every output is a weighted sum of input
pixels, with weights fixed by the scales, sizes, grid or boxes. The gradient of
X is the transposed map applied to dy:

- Resize is separable: per resized axis k, ``Y = X ×_k A_k`` with an
  (out_k, in_k) interpolation matrix, so ``dX = dY ×_k A_k^T``, one MatMul per
  axis. ``A_k`` is computed in the graph by resizing an identity matrix along
  one axis with axis k's settings, so it is exactly the runtime's own
  interpolation (every mode, nearest_mode, cubic_coeff_a, exclude_outside,
  antialias, coordinate transformation) and needs no static shapes.
- GridSample and RoiAlign read a few taps per output; their transpose scatters
  dy times the tap weights back to the taps, one ScatterND with reduction "add".
  The taps and weights are computed from the grid / boxes the way the ONNX
  reference implementation does.

GridSample's grid and AffineGrid's theta are tagged NonDifferentiable, but
PyTorch differentiates them and so do we (``beyond_tags``): the grid through
the tap weights' slopes (d weight / d coordinate), theta through the linear map
grid = [base, 1] theta'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from onnx import TensorProto

from onnxgrad.ir.builder import Dim, Var

from . import nn
from .registry import Node, register


# -- helpers ------------------------------------------------------------------------------
def _float(n: Node, d: Dim, like: Var) -> float | Var:
    """A size as a float scalar of ``like``'s type (a Python float when static)."""
    return float(d) if isinstance(d, int) else n.b.cast_like(n.op.Squeeze(d, n.b.ints([0])), like)


def _attrs(n: Node, drop: Sequence[str] = ()) -> dict:
    return {a.name: n.attr(a.name) for a in n.proto.attribute if a.name not in drop}


# -- Resize -------------------------------------------------------------------------------
@register("Resize")
def resize(n):
    """Y = X ×_k A_k over the resized axes k, A_k the (out_k, in_k) interpolation matrix of axis k.

    dX = dY ×_k A_k^T, where A_k = Resize(I) along one axis with axis k's scale or size and roi
    (a 2-D Resize of an identity matrix, then one MatMul per axis). Nearest upsampling by an
    integer factor repeats each input: its transpose is a sum over blocks (Reshape, ReduceSum).
    """
    x = n.inputs[0]
    rank = n.b.rank(x)
    axes = [a + rank if a < 0 else a for a in n.attr("axes", list(range(rank)))]
    plans = _resize_plans(n, x, axes)
    y_shape = n.outputs[0].shape
    dims = list(y_shape) if y_shape is not None else [None] * rank
    t = n.dy
    for k in sorted(plans, reverse=True):
        last = k == rank - 1
        block = _nearest_block(n, plans[k], x.shape[k] if x.shape is not None else None, dims[k])
        if block:                                       # each input repeated `block` times: sum them
            t = _block_sum(n, t, k, rank, x.shape[k], block, dims)
            dims[k] = x.shape[k]
            continue
        a = _interpolation_matrix(n, x, k, plans[k], transposed=not last)
        if last:
            t = t @ a                                   # (..., out_k) @ (out_k, in_k)
        elif k == rank - 2:
            t = a @ t                                   # (in_k, out_k) @ (..., out_k, W)
        else:                                           # contract axis k of (d_0..d_k-1, out_k, rest)
            back = _restore(n, t, k, dims)
            t = n.op.Reshape(a @ n.op.Reshape(t, n.b.ints([0] * (k + 1) + [-1])), back)
        dims[k] = x.shape[k] if x.shape is not None else None
    return (t,)


def _nearest_block(n: Node, plan: dict, size_in: int | None, size_out: int | None) -> int | None:
    """s when a nearest resize maps output o to input o // s (integer upsampling), else None.

    With an integer factor s the source coordinate of o = q * s + r is q + (2r + 1 - s) / 2s under
    the half-pixel transforms (never a tie, so every round_* mode gives q) and q + r / s under
    asymmetric (floor gives q; round_prefer_floor too when s = 2).
    """
    if n.attr("mode", "nearest") != "nearest" or "roi" in plan or size_in is None:
        return None
    out = plan.get("size") if isinstance(plan.get("size"), int) else size_out
    if not isinstance(out, int) or out % size_in or out // size_in < 2:
        return None
    factor = out // size_in
    if "scale" in plan and not (isinstance(plan["scale"], float) and plan["scale"] == factor):
        return None
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    nearest = n.attr("nearest_mode", "round_prefer_floor")
    if ctm in ("half_pixel", "pytorch_half_pixel", "half_pixel_symmetric"):
        ok = nearest in ("round_prefer_floor", "round_prefer_ceil")
    elif ctm == "asymmetric":
        ok = nearest == "floor" or (nearest == "round_prefer_floor" and factor == 2)
    else:
        ok = False
    return factor if ok else None


def _block_sum(n: Node, t: Var, k: int, rank: int, size_in: int, factor: int, dims: list) -> Var:
    """Sum axis k of t, of length size_in * factor, over consecutive blocks of ``factor``."""
    if k == rank - 1:
        return n.b.sum(n.op.Reshape(t, n.b.ints([0] * k + [size_in, factor])), [k + 1], keepdims=False)
    grouped = n.op.Reshape(t, n.b.ints([0] * k + [size_in, factor, -1]))
    return n.op.Reshape(n.b.sum(grouped, [k + 1], keepdims=False), _restore(n, t, k, dims))


def _restore(n: Node, t: Var, k: int, dims: list) -> Var:
    """The shape to reshape (d_0 .. d_k, rest) back to t's axes after k, with the first k + 1 kept."""
    trailing = dims[k + 1:]
    if all(d is not None for d in trailing):
        return n.b.ints([0] * (k + 1) + trailing)
    return n.op.Concat(n.b.ints([0] * (k + 1)), n.b.shape_of(t, k + 1), axis=0)


def _resize_plans(n: Node, x: Var, axes: list[int]) -> dict[int, dict]:
    """Per resized axis: how its 1-D resize is specified ("scale" or "size", and the roi), identities left out."""
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    policy = n.attr("keep_aspect_ratio_policy", "stretch")
    crop = ctm == "tf_crop_and_resize"
    use_sizes = n.input(3) is not None
    scales, sizes, roi = n.const_value(2), n.const_value(3), n.const_value(1)
    static_in = [x.shape[k] if x.shape is not None else None for k in axes]
    y_shape = n.outputs[0].shape
    static_out = [y_shape[k] if y_shape is not None else None for k in axes]
    common: float | Var | None = None
    if use_sizes and policy != "stretch":
        if sizes is None or None in static_in:
            common = _keep_ratio_scale(n, x, axes, policy)
        else:
            ratios = [s / d for s, d in zip(sizes.tolist(), static_in)]
            common = min(ratios) if policy == "not_larger" else max(ratios)
    plans = {}
    for i, k in enumerate(axes):
        plan: dict = {}
        if crop:
            plan["roi"] = ((float(roi[i]), float(roi[i + len(axes)])) if roi is not None
                           else ("input", i, len(axes)))
        if isinstance(common, Var):
            plan.update(_keep_ratio_plan_at_run_time(n, common, k))
        elif common is not None:
            plan.update(_keep_ratio_plan(n, common, static_in[i]))
        elif use_sizes:
            plan["size"] = int(sizes[i]) if sizes is not None else n.op.Gather(n.inputs[3], n.b.ints([i]), axis=0)
        else:
            plan["scale"] = (float(np.float32(scales[i])) if scales is not None
                             else n.op.Gather(n.inputs[2], n.b.ints([i]), axis=0))
        if _is_identity(plan, static_in[i], static_out[i]):
            continue
        plans[k] = plan
    return plans


def _keep_ratio_plan(n: Node, scale: float, size_in: int) -> dict:
    """Axis settings under keep_aspect_ratio_policy: scale ``scale``, output round(scale * in).

    A 1-D resize gives both only if floor(scale * in) is that output size (then by scale),
    or scale * in is that size (then by size).
    """
    out = int(scale * size_in + 0.5)
    if int(np.float32(scale) * np.float32(size_in)) == out:
        return {"scale": float(np.float32(scale))}
    if abs(scale * size_in - out) < 1e-6 * max(out, 1):
        return {"size": out}
    # round(scale * in) > floor(scale * in): resize an input made longer by repeating its last element (what
    # the coordinate clamp reads past the edge) at the same scale, and keep the first `out` outputs
    _decline_unless_extendable(n, f"where round(scale * in) differs from floor(scale * in) (scale {scale:g}, "
                                  f"input size {size_in})")
    return {"scale": float(np.float32(scale)), "rows": out, "pad": int(np.ceil(2.0 / scale)) + 2}


def _decline_unless_extendable(n: Node, case: str) -> None:
    """Resizing a longer input and keeping the first outputs is right only where an output's source coordinate
    does not depend on the input's length (and no tap weight on the input's edge: cubic's exclude_outside)."""
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    cubic_inside = n.attr("mode", "nearest") == "cubic" and n.attr("exclude_outside", 0)
    if ctm not in ("half_pixel", "asymmetric", "tf_half_pixel_for_nn", "pytorch_half_pixel") or cubic_inside:
        n.decline(f"Resize with keep_aspect_ratio_policy {case} and coordinate_transformation_mode '{ctm}'"
                  + (" with exclude_outside" if cubic_inside else ""))


def _keep_ratio_scale(n: Node, x: Var, axes: list[int], policy: str) -> Var:
    """The policy's common scale, computed in the graph where sizes or the input's dims are known only at run
    time: min (not_larger) or max (not_smaller) of sizes[i] / in[axes[i]], in float32 as onnxruntime computes it
    (shape [1])."""
    f32 = TensorProto.FLOAT
    ins = n.op.Cast(n.op.Gather(n.b.shape_of(x), n.b.ints(axes), axis=0), to=f32)
    ratios = n.op.Cast(n.inputs[3], to=f32) / ins
    return n.b.reduce("ReduceMin" if policy == "not_larger" else "ReduceMax", ratios, [0], keepdims=True)


def _keep_ratio_plan_at_run_time(n: Node, scale: Var, k: int) -> dict:
    """Axis k's settings under keep_aspect_ratio_policy with a scale known at run time: the resize by ``scale`` of
    an input made longer by repeating its last element, cut to the output's length (:func:`_keep_ratio_plan`'s
    third case, which holds in the other two as well: whether round(scale * in) and floor(scale * in) differ is
    not known here)."""
    _decline_unless_extendable(n, "and sizes or input dims known only at run time (declare them as constants)")
    two = n.b.const(np.array([2.0], np.float32))
    pad = n.op.Cast(n.op.Ceil(two / scale), to=TensorProto.INT64) + n.b.ints([2])
    return {"scale": scale, "rows": n.b.shape_of(n.dy, k, k + 1), "pad": pad}


def _is_identity(plan: dict, size_in: int | None, size_out: int | None) -> bool:
    """Whether an axis is left as it is: scale 1, or a size equal to the input's (roi [0, 1])."""
    roi = plan.get("roi")
    if roi is not None and roi != (0.0, 1.0):
        return False
    if "scale" in plan:
        return plan["scale"] == 1.0 if isinstance(plan["scale"], float) else False
    size = plan["size"] if isinstance(plan["size"], int) else size_out   # a size computed in the graph
    return size is not None and size == size_in                         # may still be known statically


def _interpolation_matrix(n: Node, x: Var, k: int, plan: dict, transposed: bool) -> Var:
    """A_k, (out_k, in_k), or its transpose: Resize of the in_k x in_k identity along one axis."""
    along = 1 if transposed else 0          # resize the eye's rows (A) or columns (A^T)
    size_in = n.b.dim(x, k)
    eye = n.op.EyeLike(n.b.zeros([size_in, size_in], x))
    if "pad" in plan:           # the last element repeated (see _keep_ratio_plan)
        pad = plan["pad"] if isinstance(plan["pad"], Var) else n.b.ints([plan["pad"]])
        pads = [n.b.ints([0] * (2 + along)), pad] + ([] if along else [n.b.ints([0])])    # [b0, b1, e0, e1]
        eye = n.op.Pad(eye, n.op.Concat(*pads, axis=0), mode="edge")
    roi = scales = sizes = None
    if "roi" in plan:
        roi = _roi_2d(n, plan["roi"], along)
    if "scale" in plan:
        s = plan["scale"]
        if isinstance(s, float):
            scales = n.b.const(np.array([1.0, s] if along else [s, 1.0], np.float32))
        else:
            one = n.b.const(np.array([1.0], np.float32))
            scales = n.op.Concat(*([one, s] if along else [s, one]), axis=0)
    else:
        size = plan["size"]
        sizes = n.b.vector([size_in, size] if along else [size, size_in])
    attrs = _attrs(n, drop=("axes", "keep_aspect_ratio_policy", "extrapolation_value"))
    if "roi" in plan:
        attrs["extrapolation_value"] = 0.0   # outputs outside the crop do not depend on X
    a = n.op.Resize(eye, roi, scales, sizes, **attrs)
    if "pad" in plan:
        rows = plan["rows"] if isinstance(plan["rows"], Var) else n.b.ints([plan["rows"]])
        a = n.op.Slice(a, n.b.ints([0]), rows, n.b.ints([along]))
    return a


def _roi_2d(n: Node, roi, along: int) -> Var:
    """The roi of the 2-D resize: [0, 1] on the identity's other axis, axis k's [start, end] along ``along``."""
    if isinstance(roi, tuple) and roi[0] != "input":
        start, end = roi
        values = [0.0, start, 1.0, end] if along else [start, 0.0, end, 1.0]
        dtype = n.inputs[1].dtype or TensorProto.FLOAT
        return n.b.const(np.array(values), dtype)
    _, i, count = roi
    given = n.inputs[1]
    start = n.op.Gather(given, n.b.ints([i]), axis=0)
    end = n.op.Gather(given, n.b.ints([i + count]), axis=0)
    zero, one = n.b.const_like(np.array([0.0]), given), n.b.const_like(np.array([1.0]), given)
    parts = [zero, start, one, end] if along else [start, zero, end, one]
    return n.op.Concat(*parts, axis=0)


# -- scatter of tap weights (GridSample, RoiAlign) ----------------------------------------
def _scatter_taps(n: Node, x: Var, index: Var, weight: Var | None, batch: Var | None,
                  spatial: Sequence[Dim]) -> Var:
    """dX for Y[b, c, l] = sum_t weight[b, l, t] * X[batch[b], c, index[b, l, t]].

    ``n.dy``: (B, C, L...) read as (B, C, L); ``index`` (int64) and ``weight``: (B, L, T),
    ``index`` into x's flattened spatial axes, ``weight`` None for ones; ``batch``: int64 (B,),
    the sample of x each output row reads (None: b itself). One ScatterND "add" of rows of C.
    """
    b = n.b
    dy = n.dy
    n_x, channels = n.b.dim(x, 0), n.b.dim(x, 1)
    pixels = spatial[0]
    for d in spatial[1:]:
        pixels = n.b.prod([pixels, d])
    updates = b.unsqueeze(n.op.Transpose(n.op.Reshape(dy, b.ints([0, 0, -1])), perm=[0, 2, 1]), [2])
    if weight is not None:                                                           # (B, L, T, C)
        updates = updates * b.unsqueeze(n.b.cast_like(weight, dy), [3])
    updates = n.op.Reshape(updates, n.b.vector([-1, channels]))
    if batch is None:
        batch = b.arange(b.dim(dy, 0))
    base = b.unsqueeze(n.op.Mul(batch, n.b.vector([pixels])), [1, 2])                  # (B, 1, 1)
    rows = n.op.Reshape(n.op.Add(index, base), b.ints([-1, 1]))
    zeros = n.b.zeros([n.b.prod([n_x, pixels]), channels], dy)
    grad = n.op.ScatterND(zeros, rows, updates, reduction="add")                      # (N * P, C)
    grad = n.op.Transpose(n.op.Reshape(grad, n.b.vector([n_x, pixels, channels])), perm=[0, 2, 1])
    return b.reshape_like(grad, x)


def _combine_index(n: Node, index: list[list[Var]], sizes: Sequence[Dim], lead: int) -> Var:
    """Flat input indices (int64) of every combination of per-axis taps.

    ``index[i]``: spatial axis i's tap indices, shaped like the first ``lead`` axes; the result
    has those axes, then one axis of tap choices per spatial axis.
    """
    strides: list[Dim] = [1]
    for d in reversed(sizes[1:]):
        strides.insert(0, n.b.prod([strides[0], d]))
    flat = None
    for i, axis_index in enumerate(index):
        others = [lead + j for j in range(len(index)) if j != i]
        idx = n.op.Mul(n.op.Cast(_stack(n, axis_index, others), to=TensorProto.INT64), n.b.vector([strides[i]]))
        flat = idx if flat is None else n.op.Add(flat, idx)
    return flat


def _combine_weights(n: Node, weights: list[list[Var] | None], lead: int) -> Var | None:
    """Weights of every combination of per-axis taps (laid out as :func:`_combine_index`): their product.

    ``weights[i]``: spatial axis i's tap weights, None when they are all one.
    """
    product = None
    for i, axis_weights in enumerate(weights):
        if axis_weights is None:
            continue
        others = [lead + j for j in range(len(weights)) if j != i]
        w = _stack(n, axis_weights, others)
        product = w if product is None else product * w
    return product


def _stack(n: Node, parts: list[Var], unsqueeze: list[int]) -> Var:
    """Stack along a new last axis, then insert size-1 axes at ``unsqueeze``."""
    v = n.op.Concat(*[n.b.unsqueeze(p, [-1]) for p in parts], axis=-1) if len(parts) > 1 \
        else n.b.unsqueeze(parts[0], [-1])
    return n.b.unsqueeze(v, unsqueeze) if unsqueeze else v


def _s(n: Node, v: float | Var, like: Var) -> Var:
    return v if isinstance(v, Var) else n.b.scalar(v, like)


def _float_range(n: Node, count: int, shape: Sequence[int], like: Var) -> Var:
    """0, 1, ..., count - 1 as a constant of like's float type, reshaped to ``shape``."""
    return n.b.const_like(np.arange(count, dtype=np.float32).reshape(shape), like)


# -- GridSample ---------------------------------------------------------------------------
_CUBIC_A = -0.75


def _cubic_weights(f: Var) -> list[Var]:
    """Keys' cubic convolution weights (a = -0.75) of the taps at -1, 0, 1, 2 for an offset f in [0, 1)."""
    a = _CUBIC_A
    f1, g, g1 = f + 1.0, 1.0 - f, 2.0 - f
    return [
        ((f1 * a - 5 * a) * f1 + 8 * a) * f1 - 4 * a,
        (f * (a + 2) - (a + 3)) * f * f + 1.0,
        (g * (a + 2) - (a + 3)) * g * g + 1.0,
        ((g1 * a - 5 * a) * g1 + 8 * a) * g1 - 4 * a,
    ]


def _cubic_weight_slopes(f: Var) -> list[Var]:
    """d/df of :func:`_cubic_weights`: 3a t^2 - 10a t + 8a for the outer taps (t = 1 + f, 2 - f),
    3(a + 2) t^2 - 2(a + 3) t for the inner ones (t = f, 1 - f); taps past f count down."""
    a = _CUBIC_A
    f1, g, g1 = f + 1.0, 1.0 - f, 2.0 - f
    return [
        (f1 * (3 * a) - 10 * a) * f1 + 8 * a,
        (f * (3 * (a + 2)) - 2 * (a + 3)) * f,
        -((g * (3 * (a + 2)) - 2 * (a + 3)) * g),
        -((g1 * (3 * a) - 10 * a) * g1 + 8 * a),
    ]


def _reflect(n: Node, v: Var, lo: float, hi: float | Var) -> Var:
    """v reflected by the borders lo, hi until inside them (the reference's _gs_reflect)."""
    return _reflect_with_slope(n, v, lo, hi)[0]


def _reflect_with_slope(n: Node, v: Var, lo: float, hi: float | Var) -> tuple[Var, Var]:
    """(v reflected by the borders lo, hi until inside them, d reflected / dv).

    Outside the borders v is reflected turns + 1 times, each reflection flipping its
    direction: the slope is (-1)^(turns + 1); inside it is 1.
    """
    below = n.op.Less(v, _s(n, lo, v))
    above = n.op.Greater(v, _s(n, hi, v))
    span = hi - lo
    dx = n.op.Where(below, lo - v, v - hi)
    turns = n.op.Floor(dx / span)
    r = dx - turns * span
    even = n.op.Equal(turns - n.op.Floor(turns * 0.5) * 2.0, _s(n, 0.0, v))
    # an even number of turns below, or an odd one above, ends measured from lo
    reflected = n.op.Where(n.op.Equal(below, even), r + lo, hi - r)
    outside = n.op.Or(below, above)
    slope = n.op.Where(n.op.And(outside, even), _s(n, -1.0, v), _s(n, 1.0, v))
    return n.op.Where(outside, reflected, v), slope


def _clamp(n: Node, v: Var, hi: float | Var) -> Var:
    return n.op.Min(n.op.Max(v, _s(n, 0.0, v)), _s(n, hi, v))


@dataclass
class _AxisTaps:
    """One spatial axis of GridSample: per tap the input index, the weight (``weight`` None: one tap
    of weight one, nearest) and d weight / d grid coordinate (``slope``, None for nearest)."""

    index: list[Var]
    weight: list[Var] | None
    slope: list[Var] | None


def _grid_taps(n: Node, g: Var, size: Dim, mode: str, padding: str, align: bool) -> _AxisTaps:
    """One spatial axis: the taps read for normalised coordinates g, their weights and the weights' slopes.

    The source coordinate is x = unnormalize(g), padded (clamped or reflected) then split into
    taps; dx/dg is the unnormalizing scale times the padding's slope (0 where border clamps,
    +-1 where reflection turns), and a weight's slope is dw/dx * dx/dg.
    """
    d = _float(n, size, g)
    last = d - 1.0
    x = (g + 1.0) * 0.5 * last if align else ((g + 1.0) * d - 1.0) * 0.5
    dx_dg = last * 0.5 if align else d * 0.5
    lo, hi = (0.0, last) if align else (-0.5, d - 0.5)
    if mode == "nearest":
        x = n.op.Round(x)                       # half to even, as the reference and PyTorch
    if padding == "border":
        outside = n.op.Or(n.op.Less(x, _s(n, lo, x)), n.op.Greater(x, _s(n, hi, x)))
        x = n.op.Where(outside, _clamp(n, x, last), x)
        dx_dg = n.op.Where(outside, _s(n, 0.0, x), _s(n, dx_dg, x))
    elif padding == "reflection":
        x, turn = _reflect_with_slope(n, x, lo, hi)
        dx_dg = turn * dx_dg
    if mode == "nearest":
        index, weight, slope = [x], None, None
    else:
        x0 = n.op.Floor(x)
        f = x - x0
        if mode == "linear":
            offsets, weight, dw_dx = (0, 1), [1.0 - f, f], [n.b.fill_like(f, -1.0), n.b.fill_like(f, 1.0)]
        else:
            offsets, weight, dw_dx = (-1, 0, 1, 2), _cubic_weights(f), _cubic_weight_slopes(f)
        index = [x0 + float(o) if o else x0 for o in offsets]
        slope = [w * dx_dg for w in dw_dx]
    for t, i in enumerate(index):
        if padding == "zeros":   # taps outside read zero: weight 0, any valid index
            inside = n.b.cast_like(n.op.And(n.op.GreaterOrEqual(i, _s(n, 0.0, i)),
                                       n.op.LessOrEqual(i, _s(n, last, i))), i)
            if weight is None:
                weight = [None] * len(index)
            weight[t] = inside if weight[t] is None else weight[t] * inside
            if slope is not None:
                slope[t] = slope[t] * inside
            index[t] = _clamp(n, i, last)
        elif padding == "border":
            index[t] = _clamp(n, i, last)
        else:
            index[t] = _reflect(n, i, lo, hi)
    return _AxisTaps(index, weight, slope)


@register("GridSample", beyond_tags=(1,))
def grid_sample(n):
    """Y[n, c, p] = sum_t w[n, p, t] * X[n, c, i[n, p, t]], taps i and weights w from the grid.

    dX = scatter-add of dy[n, c, p] * w[n, p, t] at i[n, p, t];
    dgrid[n, p, k] = sum_t (sum_c dy[n, c, p] X[n, c, i[n, p, t]]) * dw[n, p, t] / dgrid_k, as
    PyTorch's grid_sampler backward (zero for nearest, which is piecewise constant). The grid
    is tagged NonDifferentiable; it gets a gradient beyond the tags.
    """
    x, grid = n.inputs
    spatial = n.b.rank(x) - 2
    mode = n.attr("mode", "bilinear" if n.opset < 20 else "linear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    padding = n.attr("padding_mode", "zeros")
    align = bool(n.attr("align_corners", 0))
    sizes = [n.b.dim(x, 2 + i) for i in range(spatial)]
    points = n.op.Reshape(grid, n.b.ints([0, -1, spatial]))                           # (N, L, S)
    taps = []
    for i in range(spatial):   # the grid lists coordinates innermost axis first: (x, y[, z])
        g = n.op.Gather(points, n.b.const(np.array(spatial - 1 - i, np.int64)), axis=2)
        taps.append(_grid_taps(n, g, sizes[i], mode, padding, align))
    flat = n.b.ints([0, 0, -1])
    index = n.op.Reshape(_combine_index(n, [t.index for t in taps], sizes, lead=2), flat)   # (N, L, T)
    dx = dgrid = None
    if n.needs(0):
        weight = _combine_weights(n, [t.weight for t in taps], lead=2)
        weight = None if weight is None else n.op.Reshape(weight, flat)
        dx = _scatter_taps(n, x, index, weight, None, sizes)
    if n.needs(1) and mode != "nearest":
        dgrid = _grid_gradient(n, x, grid, index, taps)
    return dx, dgrid


def _grid_gradient(n: Node, x: Var, grid: Var, index: Var, taps: list[_AxisTaps]) -> Var:
    """dgrid[n, p, k] = sum_t v[n, p, t] * dw_t / dgrid_k, with v[n, p, t] = sum_c dy[n, c, p] X[n, c, i[n, p, t]]
    (the seed's dot product with each tap's pixel) and dw_t / dgrid_k the tap weight with axis k's
    factor replaced by its slope."""
    b = n.b
    pixels = n.op.Transpose(n.op.Reshape(x, b.ints([0, 0, -1])), perm=[0, 2, 1])             # (N, P, C)
    read = n.op.GatherND(pixels, b.unsqueeze(index, [-1]), batch_dims=1)                      # (N, L, T, C)
    seed = b.unsqueeze(n.op.Transpose(n.op.Reshape(n.dy, b.ints([0, 0, -1])), perm=[0, 2, 1]), [-1])
    v = b.squeeze(n.op.MatMul(read, seed), [-1])                                              # (N, L, T)
    weights = [t.weight for t in taps]
    parts = []
    for k, axis in enumerate(taps):
        dw = _combine_weights(n, weights[:k] + [axis.slope] + weights[k + 1:], lead=2)
        parts.append(b.sum(v * n.op.Reshape(dw, b.ints([0, 0, -1])), [-1], keepdims=True))  # (N, L, 1)
    dgrid = n.op.Concat(*parts[::-1], axis=-1)   # the grid lists the innermost axis first
    return b.reshape_like(dgrid, grid)


# -- AffineGrid --------------------------------------------------------------------------
@register("AffineGrid", beyond_tags=(0,))
def affine_grid(n):
    """grid[n, p] = theta[n] @ [base[p], 1], base[p] the normalised coordinates of position p;

    dtheta[n] = sum_p dgrid[n, p]' [base[p], 1] = [dgrid[n]' base, sum_p dgrid[n, p]'].
    base is AffineGrid of the identity for one sample: the runtime's own coordinates for any
    align_corners and sizes known only at run time. theta is tagged NonDifferentiable; it gets
    a gradient beyond the tags, as PyTorch's affine_grid gives it.
    """
    theta, size = n.inputs
    b = n.b
    spatial = n.b.dim(theta, 1)                                                       # S
    identity = b.unsqueeze(n.op.EyeLike(n.b.zeros([spatial, n.b.dim(theta, 2)], theta)), [0])
    known = n.const_ints(1)
    if known is not None:
        one_sample = b.ints([1] + known[1:])
    else:
        rest = n.op.Slice(size, b.ints([1]), b.ints([np.iinfo(np.int64).max]))
        one_sample = n.op.Concat(b.ints([1]), rest, axis=0)
    base = n.op.AffineGrid(identity, one_sample, align_corners=n.attr("align_corners", 0))
    base = n.op.Reshape(base, n.b.vector([-1, spatial]))                                     # (P, S)
    dgrid = n.op.Reshape(n.dy, n.b.vector([0, -1, spatial]))                                 # (N, P, S)
    linear = n.op.MatMul(n.op.Transpose(dgrid, perm=[0, 2, 1]), base)                      # (N, S, S)
    translation = n.op.Transpose(b.sum(dgrid, [1], keepdims=True), perm=[0, 2, 1])         # (N, S, 1)
    return n.op.Concat(linear, translation, axis=2), None


# -- RoiAlign -----------------------------------------------------------------------------
def _roi_align_max(n: Node, x: Var, batch: Var, index: Var, weight: Var, exist: Var | None,
                   pooled: tuple[int, int], sizes: Sequence[Dim]) -> Var:
    """max mode, as onnxruntime and onnx.reference compute it: Y[r, c, ph, pw] = the largest w * X[b_r, c, p]
    over the bin's samples and each sample's four bilinear taps (no average). The gradient goes to that
    one tap, dX[b_r, c, p] += dy * w (the first in sample, then tap order on ties, as they take it).

    ``index``, ``weight``: (R, PH, PW, Gy, 2, Gx, 2); ``exist``: False for the samples of an adaptive grid
    narrower than the widest one (they take no part in the max), None when every sample exists.
    """
    b = n.b
    perm = [0, 1, 2, 3, 5, 4, 6]                       # samples (iy, ix), then taps (y, x): onnxruntime's order
    flat = b.ints([0, pooled[0] * pooled[1], -1])
    full = b.shape_of(index)
    index = n.op.Reshape(n.op.Transpose(index, perm=perm), flat)                         # (R, L, T)
    weight = n.op.Reshape(n.op.Transpose(weight, perm=perm), flat)
    channels, pixels = n.b.dim(x, 1), n.b.prod([sizes[0], sizes[1]])
    c, r = b.arange(channels), b.arange(b.shape_of(batch))
    taps = b.unsqueeze(index, [1])                                                        # (R, 1, L, T)
    # flat positions (plain Gathers: onnx.reference's GatherElements takes at most 64 positions per row)
    plane = n.op.Add(n.op.Mul(b.unsqueeze(r, [1]), n.b.vector([channels])), b.unsqueeze(c, [0]))      # (R, C)
    images = n.op.Reshape(n.op.Gather(x, batch, axis=0), b.ints([-1]))                   # R * C * H * W
    values = n.op.Gather(images, n.op.Add(n.op.Mul(b.unsqueeze(plane, [2, 3]), n.b.vector([pixels])), taps))
    values = values * b.unsqueeze(weight, [1])                                            # (R, C, L, T)
    if exist is not None:
        exist = n.op.Reshape(n.op.Transpose(n.op.Expand(exist, full), perm=perm), flat)
        values = n.op.Where(b.unsqueeze(exist, [1]), values, b.scalar(-np.inf, values))
    pick = n.op.ArgMax(values, axis=3, keepdims=1)                                       # (R, C, L, 1)
    chosen = n.op.Equal(b.arange(b.shape_of(index, 2, 3)), pick)                       # (R, C, L, T)
    tap = b.sum(n.op.Where(chosen, taps, b.const(np.array(0, np.int64))), [3])           # (R, C, L, 1)
    w = b.sum(n.op.Where(chosen, b.unsqueeze(weight, [1]), b.scalar(0.0, values)), [3])
    update = n.op.Reshape(n.dy, b.ints([0, 0, -1, 1])) * w
    image = n.op.Add(n.op.Mul(b.unsqueeze(batch, [1]), n.b.vector([channels])), b.unsqueeze(c, [0]))  # (R, C)
    where = n.op.Add(n.op.Mul(b.unsqueeze(image, [2, 3]), n.b.vector([pixels])), tap)
    zeros = n.b.zeros(b.shape_of(n.op.Reshape(x, b.ints([-1]))), n.dy)
    grad = n.op.ScatterElements(zeros, n.op.Reshape(where, b.ints([-1])), n.op.Reshape(update, b.ints([-1])),
                                axis=0, reduction="add")
    return b.reshape_like(grad, x)


def _roi_axis_taps(n: Node, start: Var, length: Var, pooled: int, grid: Var | float, samples: Var,
                   size: Dim) -> list[tuple[Var, Var]]:
    """One axis of RoiAlign's bilinear samples: the two taps of each, shaped (R, pooled, G).

    Sample s of bin p sits at start + p * bin + (s + 0.5) * bin / grid (bin = length / pooled),
    for s < grid; it reads nothing when outside [-1, size], else the pixels around max(pos, 0),
    the last one twice past the edge. ``start``, ``length``: (R, 1, 1).
    """
    b = n.b
    bin_size = length / float(pooled)
    pos = start + _float_range(n, pooled, (1, pooled, 1), start) * bin_size + (samples + 0.5) * bin_size / grid
    d = _float(n, size, pos)
    edge = _s(n, d - 1.0, pos)
    keep = n.op.And(n.op.GreaterOrEqual(pos, b.scalar(-1.0, pos)), n.op.LessOrEqual(pos, _s(n, d, pos)))
    if isinstance(grid, Var):   # adaptive grids: only the first `grid` of the G samples exist
        keep = n.op.And(keep, n.op.Less(samples, grid))
    keep = n.b.cast_like(keep, pos)
    pos = n.op.Max(pos, b.scalar(0.0, pos))
    low = n.op.Floor(pos)
    at_edge = n.op.GreaterOrEqual(low, edge)
    low = n.op.Where(at_edge, edge, low)
    high = n.op.Where(at_edge, edge, low + 1.0)
    frac = n.op.Where(at_edge, b.scalar(0.0, pos), pos - low)
    return [(low, (1.0 - frac) * keep), (high, frac * keep)]


@register("RoiAlign", inputs=(0,))
def roi_align(n):
    """avg mode: Y[r, c, ph, pw] = mean over the bin's sample grid of the bilinear sample of X[b_r, c].

    dX = scatter-add of dy * w / count at the 4 taps of every sample; rois and batch_indices
    get no gradient. (rules/nn.py has a dense separable form, dX[b] = sum_r Ay[r]^T dy[r] Ax[r],
    with no scatter but O(N H W R oh C) work; it serves opsets below 16, which have no ScatterND "add".)
    """
    x, rois, batch = n.inputs[:3]
    if n.opset < 16:   # no ScatterND "add" yet: the dense separable form of rules/nn.py
        return nn.roi_align(n)
    b = n.b
    pooled = (n.attr("output_height", 1), n.attr("output_width", 1))
    ratio = n.attr("sampling_ratio", 0)
    half_pixel = n.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    box = rois * n.attr("spatial_scale", 1.0)
    if half_pixel:
        box = box - 0.5
    sizes = [n.b.dim(x, 2), n.b.dim(x, 3)]
    taps, grids, exists = [], [], []
    for axis in range(2):   # y (height), then x (width); a box is (x1, y1, x2, y2)
        start = n.op.Gather(box, b.ints([1 - axis]), axis=1)                         # (R, 1)
        length = n.op.Gather(box, b.ints([3 - axis]), axis=1) - start
        if not half_pixel:
            length = n.op.Max(length, b.scalar(1.0, length))
        if ratio > 0:
            grid = float(ratio)
            samples = _float_range(n, ratio, (1, 1, ratio), length)
        else:
            grid = n.op.Ceil(length / float(pooled[axis]))                          # (R, 1)
            most = n.op.Cast(b.reduce("ReduceMax", grid, None, keepdims=False), to=TensorProto.INT64)
            samples = n.b.cast_like(n.op.Range(b.int_scalar(0), most, b.int_scalar(1)), length)
            samples = b.unsqueeze(samples, [0, 1])                                    # (1, 1, G)
            exists.append(n.op.Less(samples, b.unsqueeze(grid, [2])))                 # (R, 1, G)
        grids.append(grid)
        taps.append(_roi_axis_taps(n, b.unsqueeze(start, [2]), b.unsqueeze(length, [2]), pooled[axis],
                                   grid if ratio > 0 else b.unsqueeze(grid, [2]), samples, sizes[axis]))
    # y taps (R, PH, Gy, 2) and x taps (R, PW, Gx, 2) -> (R, PH, PW, Gy, 2, Gx, 2)
    y_idx, y_w = _stack(n, [i for i, _ in taps[0]], [2, 5, 6]), _stack(n, [w for _, w in taps[0]], [2, 5, 6])
    x_idx, x_w = _stack(n, [i for i, _ in taps[1]], [1, 3, 4]), _stack(n, [w for _, w in taps[1]], [1, 3, 4])
    index = n.op.Add(n.op.Mul(n.op.Cast(y_idx, to=TensorProto.INT64), n.b.vector([sizes[1]])),
                     n.op.Cast(x_idx, to=TensorProto.INT64))
    if n.attr("mode", "avg") == "max":
        exist = None if not exists else n.op.And(b.unsqueeze(exists[0], [2, 4, 5, 6]),
                                                  b.unsqueeze(exists[1], [1, 3, 4, 6]))
        return _roi_align_max(n, x, batch, index, y_w * x_w, exist, pooled, sizes), None, None
    if ratio > 0:
        weight = y_w * x_w * (1.0 / (ratio * ratio))
    else:
        count = n.op.Max(grids[0] * grids[1], b.scalar(1.0, grids[0]))               # (R, 1)
        weight = y_w * x_w / b.unsqueeze(count, [2, 3, 4, 5, 6])
    flat = b.ints([0, pooled[0] * pooled[1], -1])
    grad = _scatter_taps(n, x, n.op.Reshape(index, flat), n.op.Reshape(weight, flat), batch, sizes)
    return grad, None, None
