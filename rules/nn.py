"""Convolution and pooling: Conv, ConvTranspose, the pools, Col2Im, MaxUnpool, LRN, RoI pooling, DeformConv.

A windowed op reads input positions ``o*s + k*d - pad_begin`` for output ``o``
and kernel tap ``k``. Its gradient is the adjoint window op: Conv's input
gradient is a ConvTranspose and ConvTranspose's a Conv; a pool's window sum
goes back through a ConvTranspose with a ones kernel. Weight gradients are a
Conv over the batch axis (batch and channel axes exchanged, strides and
dilations exchanged).

Window geometry (pads from ``auto_pad``, output sizes, ``ceil_mode``, average
counts, ConvTranspose's ``output_shape``) follows onnxruntime, which is what
users run; where onnx.reference differs (ConvTranspose with a negative total
padding, AveragePool with ``ceil_mode`` plus ``auto_pad`` or dilations) the
tests keep to configurations where the two agree.

Unknown spatial dims: the input gradient is a ConvTranspose with the largest
``output_padding`` cropped to the input's run-time shape by a Slice,
``auto_pad=SAME_*`` pads are computed in the graph from ``Shape``, and AveragePool's
divisors for partial windows are counted in the graph by a ones-kernel Conv.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from onnxgrad.ir.builder import INT64_MAX, Var

from .registry import register

_SAME = ("SAME_UPPER", "SAME_LOWER")


# -- window geometry ----------------------------------------------------------------------
@dataclass
class _Geo:
    """Per spatial axis: kernel, strides, dilations, pads and sizes (None where unknown) of one window op.

    ``begin``/``end`` are None when they are ``auto_pad=SAME_*`` pads that depend on
    unknown input sizes (then computed in the graph, see :func:`_same_pads`).
    """

    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    begin: list[int] | None
    end: list[int] | None
    in_dims: list[int | None]
    out_dims: list[int | None]
    auto_pad: str = "NOTSET"

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @property
    def axes(self) -> list[int]:
        return list(range(2, 2 + self.rank))

    @property
    def extent(self) -> list[int]:
        """Dilated kernel size (k-1)*d + 1."""
        return [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations)]

    @property
    def static(self) -> bool:
        return self.begin is not None and None not in self.in_dims and None not in self.out_dims


def _trunc_div(a: int, b: int) -> int:
    """C++ integer division (rounds toward zero), as onnxruntime computes pads."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _spatial_dims(v: Var, rank: int) -> list[int | None]:
    shape = v.shape
    if shape is None or len(shape) != rank + 2:
        return [None] * rank
    return list(shape[2:])


def _kernel(n, w: Var | None = None) -> list[int]:
    """kernel_shape, else W's spatial shape."""
    ks = n.attr("kernel_shape")
    if ks:
        return list(ks)
    if w is not None and w.shape is not None and None not in w.shape[2:]:
        return list(w.shape[2:])
    n.decline("the kernel's spatial shape is unknown (no kernel_shape attribute and W's shape is not inferred)")


def _geometry(n, x: Var, kernel: list[int], ceil_mode: int = 0) -> _Geo:
    """Pads and output sizes of Conv and the pools, as onnxruntime computes them.

    ``auto_pad=SAME_*``: total pad ``max(0, (ceil(D/s) - 1)*s + k - D)`` (the undilated kernel),
    the odd unit at the end (UPPER) or the beginning (LOWER). onnxruntime clamps the total at 0
    where a stride larger than the kernel makes it negative (onnx.reference floors a negative half).
    """
    rank = len(kernel)
    strides = list(n.attr("strides") or [1] * rank)
    dilations = list(n.attr("dilations") or [1] * rank)
    auto_pad = n.attr("auto_pad", "NOTSET")
    dims = _spatial_dims(x, rank)
    begin: list[int] | None
    end: list[int] | None
    if auto_pad in _SAME:
        if None not in dims:
            needed = [max(0, ((d + s - 1) // s - 1) * s + k - d) for d, s, k in zip(dims, strides, kernel)]
        elif all(s == 1 for s in strides):
            needed = [k - 1 for k in kernel]
        else:
            needed = None
        if needed is None:
            begin = end = None
        else:
            begin = [(t + 1) // 2 if auto_pad == "SAME_LOWER" else t // 2 for t in needed]
            end = [t - b for t, b in zip(needed, begin)]
    elif auto_pad == "VALID":
        begin, end = [0] * rank, [0] * rank
    else:
        pads = list(n.attr("pads") or [0] * (2 * rank))
        begin, end = pads[:rank], pads[rank:]
    out: list[int | None] = []
    for i in range(rank):
        if dims[i] is None or begin is None:
            out.append(None)
            continue
        num = dims[i] + begin[i] + end[i] - dilations[i] * (kernel[i] - 1) - 1
        size = _trunc_div(num, strides[i]) + 1
        if ceil_mode:
            size = math.ceil(num / strides[i]) + 1
            if (size - 1) * strides[i] >= dims[i] + begin[i]:   # the last window starts inside the input
                size -= 1
        out.append(size)
    return _Geo(kernel, strides, dilations, begin, end, dims, out, auto_pad)


def _same_pads(n, x: Var, geo: _Geo) -> tuple[Var, Var]:
    """auto_pad SAME pads computed in the graph from x's run-time spatial shape (clamped at 0 as in
    :func:`_geometry`: a stride larger than the kernel can make the spec's total pad negative)."""
    b = n.b
    dims = b.shape_of(x, 2)
    strides = b.ints(geo.strides)
    outs = n.op.Div(dims + b.ints([s - 1 for s in geo.strides]), strides)          # ceil(D / s)
    needed = (outs - b.ints([1] * geo.rank)) * strides + b.ints(geo.kernel) - dims
    if any(k < s for k, s in zip(geo.kernel, geo.strides)):
        needed = n.op.Max(needed, b.ints([0] * geo.rank))
    if geo.auto_pad == "SAME_LOWER":
        needed_for_begin = needed + b.ints([1] * geo.rank)
    else:
        needed_for_begin = needed
    begin = n.op.Div(needed_for_begin, b.ints([2] * geo.rank))
    return begin, needed - begin


# -- the adjoint window ops ------------------------------------------------------------------
def _window_transpose(n, dy: Var, w: Var, x: Var, geo: _Geo, group: int = 1) -> Var:
    """ConvTranspose(dy, w) sized like x: the adjoint of the windowed sum Conv(x, w).

    Static: pads and output_padding chosen so the result has exactly x's spatial
    size (also when the stride does not divide it). Unknown sizes: the largest
    output_padding, then a Slice to x's run-time size.
    """
    group_attr = group if group != 1 else None
    if geo.static:
        end, output_padding = [], []
        for size, out, extent, s, d, pb in zip(geo.in_dims, geo.out_dims, geo.extent, geo.strides,
                                               geo.dilations, geo.begin):
            surplus = s * (out - 1) + extent - pb - size     # ConvTranspose's natural length minus x's
            if -surplus >= max(s, d):
                n.decline("the windows leave more than a stride of the input unread")
            end.append(max(surplus, 0))
            output_padding.append(max(-surplus, 0))
        return n.op.ConvTranspose(dy, w, strides=geo.strides, dilations=geo.dilations, group=group_attr,
                                  pads=list(geo.begin) + end,
                                  output_padding=output_padding if any(output_padding) else None)
    b = n.b
    dims = b.shape_of(x, 2)
    if geo.begin is not None:
        pads = list(geo.begin) + [0] * geo.rank
        starts = b.ints([0] * geo.rank)
    else:
        pads = [0] * (2 * geo.rank)
        starts, _ = _same_pads(n, x, geo)
    full = n.op.ConvTranspose(dy, w, strides=geo.strides, dilations=geo.dilations, group=group_attr,
                              pads=pads, output_padding=[s - 1 for s in geo.strides])
    return n.op.Slice(full, starts, starts + dims, b.ints(geo.axes))


def _filter_grad(n, x: Var, dy: Var, geo: _Geo, group: int) -> Var:
    """dW[m, c, k] = sum_{b,o} dy[b, m, o] * x_padded[b, g(m)*Cg + c, o*s + k*d]:
    a Conv of x (channels as batch) with dy (batch as input channels) as its kernel,
    strides and dilations exchanged, then cropped to the kernel size (JAX's conv
    transpose pair). Runtime-tuned forms are rewrites: see :mod:`onnxgrad.passes.optimize`.
    """
    b, rank, axes = n.b, geo.rank, geo.axes
    if geo.begin is None:
        begin, end = _same_pads(n, x, geo)
        zeros = b.ints([0, 0])
        x = n.op.Pad(x, n.op.Concat(zeros, begin, zeros, end, axis=0))
        pads = [0] * (2 * rank)
    else:
        pads = list(geo.begin) + [max(e, 0) for e in geo.end]
    if group == 1:
        xt = n.op.Transpose(x, perm=[1, 0, *axes])                                  # [C, N, *D]
    else:
        # [N, G*Cg, *D] -> [Cg, G*N, *D]: channel g*N + b of image c is x[b, g*Cg + c]
        static_dims = None not in geo.in_dims
        spatial = b.ints(geo.in_dims) if static_dims else b.shape_of(x, 2)
        split = n.op.Reshape(x, n.op.Concat(b.ints([0, group, -1]), spatial, axis=0))  # [N, G, Cg, *D]
        split = n.op.Transpose(split, perm=[2, 1, 0, *[a + 1 for a in axes]])            # [Cg, G, N, *D]
        xt = n.op.Reshape(split, n.op.Concat(b.ints([0, -1]), spatial, axis=0))
    dyt = n.op.Transpose(dy, perm=[1, 0, *axes])                                    # [M, N, *O]
    dw = n.op.Conv(xt, dyt, strides=geo.dilations, dilations=geo.strides, pads=pads,
                   group=group if group != 1 else None)                              # [Cg, M, *K']
    dw = n.op.Transpose(dw, perm=[1, 0, *axes])
    if geo.static:
        full = [(size + pb + max(pe, 0) - s * (out - 1) - 1) // d + 1
                for size, pb, pe, s, d, out in zip(geo.in_dims, geo.begin, geo.end, geo.strides,
                                                   geo.dilations, geo.out_dims)]
        if full == geo.kernel:
            return dw
    return n.op.Slice(dw, b.ints([0] * rank), b.ints(geo.kernel), b.ints(axes))


def _conv_transpose_geometry(n, x: Var, kernel: list[int]) -> _Geo:
    """The Conv that is ConvTranspose's adjoint: from the output (Oy) back to the input (D).

    onnxruntime: with output_shape or SAME, total pad = max(0, natural - target),
    SAME_UPPER puts the odd unit at the end, everything else at the beginning.
    The adjoint Conv's end pad is max(0, pe - output_padding), so it yields D exactly.
    """
    rank = len(kernel)
    strides = list(n.attr("strides") or [1] * rank)
    dilations = list(n.attr("dilations") or [1] * rank)
    out_pad = list(n.attr("output_padding") or [0] * rank)
    auto_pad = n.attr("auto_pad", "NOTSET")
    output_shape = n.attr("output_shape")
    dims = _spatial_dims(x, rank)
    pads = list(n.attr("pads") or [0] * (2 * rank))
    begin, end, out_dims = [], [], []
    for i in range(rank):
        s, op, extent, size = strides[i], out_pad[i], (kernel[i] - 1) * dilations[i] + 1, dims[i]
        natural = None if size is None else (size - 1) * s + op + extent
        if output_shape:
            if size is None:
                n.decline("ConvTranspose with output_shape needs known spatial dims")
            target = list(output_shape)[-rank:][i]
            total = max(0, natural - target)
        elif auto_pad in _SAME:
            total = max(0, op + extent - s)       # natural - D*s, independent of D
            target = None if natural is None else natural - total
        if output_shape or auto_pad in _SAME:
            pb = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            pe = total - pb
        elif auto_pad == "VALID":
            pb = pe = 0
            target = None if natural is None else natural
        else:
            pb, pe = pads[i], pads[rank + i]
            target = None if natural is None else natural - pb - pe
        begin.append(pb)
        if target is not None and size is not None:
            end.append(max(0, s * (size - 1) + extent - target - pb))
        else:
            end.append(max(0, pe - op))
        out_dims.append(target)
    return _Geo(kernel, strides, dilations, begin, end, out_dims, dims, auto_pad)


def _spatial_shape(n, v: Var, dims: list[int | None]) -> Var:
    """v's spatial shape: a constant when known, else Shape(v)[2:]."""
    return n.b.ints(dims) if None not in dims else n.b.shape_of(v, 2)


def _pool_window_transpose(n, g: Var, x: Var, geo: _Geo) -> Var:
    """Each input position gets the sum of g over the windows it is in: a ones-kernel
    ConvTranspose over [N*C, 1, *spatial] (channels as batch, so C need not be known)."""
    b = n.b
    planes = n.op.Reshape(g, n.op.Concat(b.ints([-1, 1]), _spatial_shape(n, g, geo.out_dims), axis=0))
    ones = n.b.const_like(np.ones([1, 1, *geo.kernel]), x)
    summed = _window_transpose(n, planes, ones, x, geo)
    return b.reshape_like(summed, x)


# -- Conv and ConvTranspose ----------------------------------------------------------------------
@register("Conv")
def conv(n):
    """y = conv(x, w) + b:
    dx = ConvTranspose(dy, w)  (same strides, dilations, pads, group; sized like x)
    dw = conv(x^T, dy^T)       (batch and channels exchanged, strides and dilations exchanged)
    db = sum(dy, batch and spatial axes)
    """
    x, w = n.inputs[0], n.inputs[1]
    geo = _geometry(n, x, _kernel(n, w))
    group = n.attr("group", 1)
    dx = _window_transpose(n, n.dy, w, x, geo, group) if n.needs(0) else None
    dw = _filter_grad(n, x, n.dy, geo, group) if n.needs(1) else None
    db = n.b.sum(n.dy, [0, *geo.axes], keepdims=False) if n.needs(2) else None
    return (dx, dw, db)[:len(n.inputs)]


@register("ConvTranspose")
def conv_transpose(n):
    """y = conv_transpose(x, w) + b, the adjoint of a Conv:
    dx = Conv(dy, w)           (same strides, dilations, group; the cropped pads become Conv pads)
    dw = conv(dy^T, x^T)       (batch and channels exchanged, strides and dilations exchanged)
    db = sum(dy, batch and spatial axes)
    """
    x, w = n.inputs[0], n.inputs[1]
    geo = _conv_transpose_geometry(n, x, _kernel(n, w))
    group = n.attr("group", 1)
    dx = dw = db = None
    if n.needs(0):
        dx = n.op.Conv(n.dy, w, strides=geo.strides, dilations=geo.dilations, pads=geo.begin + geo.end,
                       group=group if group != 1 else None)
        if None not in geo.in_dims and None not in geo.out_dims:
            length = [(size + pb + pe - e) // s + 1 for size, pb, pe, e, s in
                      zip(geo.in_dims, geo.begin, geo.end, geo.extent, geo.strides)]
            if length != geo.out_dims:      # an output_shape longer than the natural size
                dx = n.op.Slice(dx, n.b.ints([0] * geo.rank), n.b.ints(geo.out_dims), n.b.ints(geo.axes))
    if n.needs(1):
        dw = _filter_grad(n, n.dy, x, geo, group)
    if n.needs(2):
        db = n.b.sum(n.dy, [0, *geo.axes], keepdims=False)
    return (dx, dw, db)[:len(n.inputs)]


# -- pooling ------------------------------------------------------------------------------------
def _pool_geometry(n, x: Var) -> _Geo:
    return _geometry(n, x, list(n.attr("kernel_shape")), n.attr("ceil_mode", 0))


def _window_counts(geo: _Geo, include_pad: bool) -> np.ndarray:
    """Per output position, the divisor onnxruntime's AveragePool uses (0 for an empty window).

    Along one axis, window o covers o*s - pb + j*d for j < k, clipped to [-pb, D + pe);
    count_include_pad counts all of those, otherwise only the ones inside [0, D).
    A window is the product of its axes, and so is its count.
    """
    count = np.ones([], np.float64)
    for size, out, k, s, d, pb, pe in zip(geo.in_dims, geo.out_dims, geo.kernel, geo.strides,
                                          geo.dilations, geo.begin, geo.end):
        axis = np.zeros(out)
        for o in range(out):
            start = o * s - pb
            stop = min(start + k * d, size + pe)
            taps = range(start, stop, d)
            inside = sum(1 for t in taps if 0 <= t < size)
            axis[o] = (len(taps) if include_pad else inside) if inside else 0
        count = np.multiply.outer(count, axis)
    return count


@register("AveragePool")
def average_pool(n):
    """y[o] = sum_{window o} x / count[o]:  dx = ConvTranspose(dy / count, ones kernel)"""
    x = n.inputs[0]
    geo = _pool_geometry(n, x)
    include_pad = bool(n.attr("count_include_pad", 0))
    if geo.static:
        count = _window_counts(geo, include_pad)
        scale = np.divide(1.0, count, out=np.zeros_like(count), where=count > 0)
        if np.all(scale == scale.flat[0]):
            scale = scale.flat[0]
    elif geo.begin is not None and not n.attr("ceil_mode", 0) and (include_pad or not any(geo.begin + geo.end)):
        scale = 1.0 / float(np.prod(geo.kernel))      # every window is full whatever the size
    else:
        return (_pool_window_transpose(n, n.dy / _window_counts_dynamic(n, x, geo, include_pad), x, geo),)
    g = n.dy * n.b.const_like(np.asarray(scale), x)
    return (_pool_window_transpose(n, g, x, geo),)


def _window_counts_dynamic(n, x: Var, geo: _Geo, include_pad: bool) -> Var:
    """:func:`_window_counts` at run time, [1, 1, *O]: a ones-kernel Conv over a grid that is 1 where a tap
    counts (inside x, or inside its pads with count_include_pad) and 0 beyond, with s - 1 more zeros at
    the end for ceil_mode's last window, cropped to y's spatial shape; empty windows count 1 (their
    gradient lands nowhere in x)."""
    b, rank = n.b, geo.rank
    if geo.begin is not None:
        begin, end = b.ints(geo.begin), b.ints(geo.end)
    else:
        begin, end = _same_pads(n, x, geo)
    zeros, extra = b.ints([0, 0]), b.ints([s - 1 for s in geo.strides])
    one = b.scalar(1.0, x)
    grid = n.op.Expand(one, n.op.Concat(b.ints([1, 1]), b.shape_of(x, 2), axis=0))       # [1, 1, *D]
    if include_pad:
        grid = n.op.Pad(grid, n.op.Concat(zeros, begin, zeros, end, axis=0), one)
        grid = n.op.Pad(grid, n.op.Concat(b.ints([0] * (rank + 2)), zeros, extra, axis=0))
    else:
        grid = n.op.Pad(grid, n.op.Concat(zeros, begin, zeros, end + extra, axis=0))
    kernel = b.const_like(np.ones([1, 1, *geo.kernel]), x)
    counts = n.op.Conv(grid, kernel, strides=geo.strides, dilations=geo.dilations)
    counts = n.op.Slice(counts, b.ints([0] * rank), b.shape_of(n.outputs[0], 2), b.ints(geo.axes))
    return n.op.Max(counts, one)


@register("LpPool")
def lp_pool(n):
    """y[o] = (sum_{window o} |x|^p)^(1/p):
    dx = sign(x) |x|^(p-1) * ConvTranspose(dy * y^(1-p), ones kernel)
    """
    x, y = n.inputs[0], n.outputs[0]
    p = n.attr("p", 2)
    geo = _pool_geometry(n, x)
    g = n.dy if p == 1 else n.dy * y ** n.b.const_like(np.asarray(1.0 - p), x)
    return (_lp_local(n, x, p) * _pool_window_transpose(n, g, x, geo),)


def _lp_local(n, x: Var, p: int) -> Var:
    """d|x|^p / dx / p = sign(x) |x|^(p-1)"""
    if p == 1:
        return n.op.Sign(x)
    if p == 2:
        return x
    return x * n.op.Abs(x) ** n.b.const_like(np.asarray(p - 2.0), x)


@register("MaxPool")
def max_pool(n):
    """y[o] = x[i(o)], i(o) = argmax over window o (the Indices output):  dx.flat[i(o)] += dy[o]"""
    x = n.inputs[0]
    kernel = list(n.attr("kernel_shape"))
    rank = len(kernel)
    strides = list(n.attr("strides") or [1] * rank)
    dilations = list(n.attr("dilations") or [1] * rank)
    if n.attr("storage_order", 0) == 1:
        # the model's indices are column-major: compute row-major ones
        attrs = {k: n.attr(k) for k in ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")
                 if n.has_attr(k)}
        _, indices = n.op.MaxPool(x, outputs=2, **attrs)
    else:
        indices = n.expose_output(1, "indices")
    # windows o and o + t along an axis are disjoint once t*s >= (k-1)*d + 1
    phases = [-(-((k - 1) * d + 1) // s) for k, d, s in zip(kernel, dilations, strides)]
    return (_scatter_add(n, n.dy, indices, x, phases),)


def _scatter_add(n, dy: Var, indices: Var, x: Var, phases: list[int]) -> Var:
    """zeros_like(x).flat[indices] += dy, exactly, with repeated indices added.

    Windows that do not overlap (all phases 1) give distinct indices: a plain
    ScatterElements. Overlapping: ScatterElements reduction="add" (opset 16+);
    before it, the outputs split into prod(phases) strided classes whose windows
    are disjoint, each added by a gather-add-scatter.
    """
    b = n.b
    flat = b.const(np.array([-1], np.int64))
    acc = n.op.Reshape(b.zeros_like(x), flat)
    if all(t == 1 for t in phases):
        # (MaxUnpool would be ~0.8 ms cheaper per million elements on onnxruntime's CPU, but it has no
        # float64 kernel there and none at all in its CUDA provider)
        acc = n.op.ScatterElements(acc, n.op.Reshape(indices, flat), n.op.Reshape(dy, flat), axis=0)
    elif n.opset >= 16:
        acc = n.op.ScatterElements(acc, n.op.Reshape(indices, flat), n.op.Reshape(dy, flat), axis=0,
                                   reduction="add")
    else:
        rank = len(phases)
        axes, steps, ends = b.ints(range(2, 2 + rank)), b.ints(phases), b.ints([INT64_MAX] * rank)
        for start in itertools.product(*[range(t) for t in phases]):
            starts = b.ints(start)
            where = n.op.Reshape(n.op.Slice(indices, starts, ends, axes, steps), flat)
            part = n.op.Reshape(n.op.Slice(dy, starts, ends, axes, steps), flat)
            acc = n.op.ScatterElements(acc, where, n.op.GatherElements(acc, where, axis=0) + part, axis=0)
    return b.reshape_like(acc, x)


@register("GlobalAveragePool")
def global_average_pool(n):
    """y = mean(x, spatial axes):  dx = expand(dy / size)"""
    x = n.inputs[0]
    b = n.b
    dims = x.shape[2:] if x.shape is not None else None
    if dims is not None and None not in dims:
        g = n.dy * n.b.const_like(np.asarray(1.0 / float(np.prod(dims))), x)
    else:
        size = b.reduce("ReduceProd", b.shape_of(x, 2), None, keepdims=False)
        g = n.dy / n.b.cast_like(size, x)
    return (n.op.Expand(g, b.ints(x.shape) if x.info.static else b.shape_of(x)),)


@register("GlobalMaxPool")
def global_max_pool(n):
    """y = max(x, spatial axes):  dx = dy * [x == y] / #maxima (ties share the gradient equally)"""
    x, y = n.inputs[0], n.outputs[0]
    mask = n.b.cast_like(n.op.Equal(x, y), x)
    axes = list(range(2, x.rank)) if x.rank is not None else None
    if axes is None:
        n.decline("GlobalMaxPool needs the input's rank")
    return (mask * (n.dy / n.b.sum(mask, axes, keepdims=True)),)


@register("GlobalLpPool")
def global_lp_pool(n):
    """y = (sum_{spatial} |x|^p)^(1/p):  dx = sign(x) |x|^(p-1) * dy * y^(1-p)"""
    x, y = n.inputs[0], n.outputs[0]
    p = n.attr("p", 2)
    g = n.dy if p == 1 else n.dy * y ** n.b.const_like(np.asarray(1.0 - p), x)
    return (_lp_local(n, x, p) * g,)


# -- Col2Im, MaxUnpool, LRN -----------------------------------------------------------------------
@register("Col2Im")
def col2im(n):
    """y = col2im(x) sums the columns' blocks into the image:
    dx = im2col(dy) = Conv(dy, identity kernel) over [N*C, 1, *image], one output channel per block tap
    """
    x, b = n.inputs[0], n.b
    block = n.const_ints(2)
    if block is not None:
        taps = int(np.prod(block))
        eye = n.b.const_like(np.eye(taps).reshape(taps, 1, *block), x)
    else:       # the same identity kernel made at run time: EyeLike of a [taps, taps] fill, reshaped
        taps = b.reduce("ReduceProd", n.inputs[2], None)                                 # [1]
        square = b.zeros(n.op.Concat(taps, taps, axis=0), x)
        eye = n.op.Reshape(n.op.EyeLike(square), n.op.Concat(taps, b.ints([1]), n.inputs[2], axis=0))
    image = n.const_ints(1)
    image = b.ints(image) if image is not None else n.input(1)
    planes = n.op.Reshape(n.dy, n.op.Concat(b.ints([-1, 1]), image, axis=0))        # [N*C, 1, *image]
    cols = n.op.Conv(planes, eye, strides=n.attr("strides"), dilations=n.attr("dilations"),
                     pads=n.attr("pads"))                                             # [N*C, taps, *blocks]
    return (b.reshape_like(cols, x), None, None)[:len(n.inputs)]


@register("MaxUnpool")
def max_unpool(n):
    """y.flat[I] = x, zeros elsewhere:  dx = dy.flat[I]  (I as MaxPool's Indices: distinct positions)

    With output_shape, I indexes the output_shape tensor, as onnxruntime and PyTorch (max_unpool's
    output_size) read it; onnx.reference reads I in the default shape and pastes that block at the origin,
    a forward onnxruntime marks as a results mismatch (test_maxunpool_export_with_output_shape, onnx#2398)."""
    flat = n.op.Reshape(n.dy, n.b.ints([-1]))
    return (n.op.Gather(flat, n.inputs[1], axis=0), None, None)[:len(n.inputs)]


def _channel_window_sum(n, v: Var, rank: int, before: int, after: int) -> Var:
    """sum_{j = c - before .. c + after} v[:, j]: a ones-kernel Conv along the channel axis."""
    size = before + after + 1
    planes = n.b.unsqueeze(v, [1])                                                    # [N, 1, C, *spatial]
    ones = n.b.const_like(np.ones([1, 1, size] + [1] * (rank - 2)), v)
    pads = [before] + [0] * (rank - 2) + [after] + [0] * (rank - 2)
    return n.b.squeeze(n.op.Conv(planes, ones, pads=pads), [1])


@register("LRN")
def lrn(n):
    """y = x * s^-beta,  s = bias + alpha/size * sum_{channel window} x^2:
    dx = dy * s^-beta - (2 alpha beta / size) * x * sum_{transposed window} (dy * y / s)
    """
    x, y = n.inputs[0], n.outputs[0]
    rank = x.rank
    if rank is None:
        n.decline("LRN needs the input's rank")
    size = n.attr("size")
    alpha, beta, bias = n.attr("alpha", 1e-4), n.attr("beta", 0.75), n.attr("bias", 1.0)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    s = _channel_window_sum(n, x * x, rank, before, after) * (alpha / size) + bias
    back = _channel_window_sum(n, n.dy * y / s, rank, after, before)
    return n.dy * s ** (-beta) - x * back * (2.0 * alpha * beta / size)


# -- RoI pooling ----------------------------------------------------------------------------------
def _roi_axis_weights(n, x: Var, rois: Var, axis: int, out: int) -> Var:
    """RoiAlign's bilinear sampling along one image axis, averaged over the bin's samples: [R, out, size].

    onnxruntime samples y = start + i*bin + (k + 0.5)*bin/grid (k < grid) and weights row h
    by max(0, 1 - |clip(y, 0, size-1) - h|), zero when y is outside [-1, size].
    """
    b = n.b
    half_pixel = n.attr("coordinate_transformation_mode",
                        "half_pixel" if n.opset >= 16 else "output_half_pixel") == "half_pixel"
    scale, offset = n.attr("spatial_scale", 1.0), 0.5 if half_pixel else 0.0
    ratio = n.attr("sampling_ratio", 0)
    column = 1 - axis                                # rois are (x1, y1, x2, y2); axis 0 is y
    start = n.op.Gather(rois, b.ints([column]), axis=1) * scale - offset                 # [R, 1]
    length = n.op.Gather(rois, b.ints([column + 2]), axis=1) * scale - offset - start
    if not half_pixel:
        length = n.op.Max(length, n.b.const_like(np.asarray(1.0), x))
    bin_size = length / float(out)
    if ratio > 0:
        grid = n.b.const_like(np.asarray(float(ratio)), x)
        steps = b.ints([ratio])
    else:   # adaptive: ceil(length / out) samples (at least 1), as many as the largest RoI needs
        grid = n.op.Max(n.op.Ceil(length / float(out)), n.b.const_like(np.asarray(1.0), x))
        steps = n.op.Cast(b.reduce("ReduceMax", grid, None, keepdims=False), to=TensorProto.INT64)
        steps = b.unsqueeze(steps, [0])
    k = n.b.cast_like(b.arange(steps), x)                                                   # [G]
    i = n.b.const_like(np.arange(out).reshape(1, out, 1), x)
    start, bin_size = b.unsqueeze(start, [2]), b.unsqueeze(bin_size, [2])               # [R, 1, 1]
    if ratio <= 0:
        grid = b.unsqueeze(grid, [2])
    pos = start + i * bin_size + (k + 0.5) * bin_size / grid                               # [R, out, G]
    size = b.squeeze(b.shape_of(x, 2 + axis, 3 + axis), [0])
    size_f = n.b.cast_like(size, x)
    inside = n.op.And(n.op.And(n.op.GreaterOrEqual(pos, n.b.const_like(np.asarray(-1.0), x)),
                               n.op.LessOrEqual(pos, size_f)),
                      n.op.Less(k, grid))
    clipped = n.op.Clip(pos, n.b.const_like(np.asarray(0.0), x), size_f - 1.0)
    rows = n.b.cast_like(n.op.Range(b.int_scalar(0), size, b.int_scalar(1)), x)    # [size]
    tent = n.op.Relu(1.0 - n.op.Abs(b.unsqueeze(clipped, [3]) - rows))                   # [R, out, G, size]
    tent = tent * b.unsqueeze(n.b.cast_like(inside, x), [3])
    return b.sum(tent, [2], keepdims=False) / grid                                       # [R, out, size]


def roi_align(n):
    """RoiAlign's gradient below opset 16 (registered by rules/sampling.py, which scatters from 16 on).

    mode avg: y[r,c,i,j] = sum_{h,w} ay[r,i,h] ax[r,j,w] x[b_r,c,h,w] (bilinear sampling is separable):
    dx[b] = sum_{r: b_r = b} ay[r]^T dy[r] ax[r]
    """
    if n.attr("mode", "avg") != "avg":
        n.decline("RoiAlign mode='max' below opset 16 (its gradient scatters with ScatterElements 'add', opset 16)")
    x, rois, batch = n.inputs
    b = n.b
    ay = _roi_axis_weights(n, x, rois, 0, n.attr("output_height", 1))                    # [R, oh, H]
    ax = _roi_axis_weights(n, x, rois, 1, n.attr("output_width", 1))                     # [R, ow, W]
    t = n.op.MatMul(n.dy, b.unsqueeze(ax, [1]))                                           # [R, C, oh, W]
    # sum over RoIs and their rows at once: [N, H, R*oh] @ [R*oh, C*W]
    images = b.arange(b.shape_of(x, 0, 1))                                                  # [N]
    onehot = n.b.cast_like(n.op.Equal(b.unsqueeze(images, [1]), b.unsqueeze(batch, [0])), x)  # [N, R]
    k = b.unsqueeze(onehot, [2, 3]) * b.unsqueeze(ay, [0])                                # [N, R, oh, H]
    k = n.op.Reshape(k, n.op.Concat(b.ints([0, -1]), b.shape_of(x, 2, 3), axis=0))     # [N, R*oh, H]
    k = n.op.Transpose(k, perm=[0, 2, 1])
    cols = n.op.Reshape(n.op.Transpose(t, perm=[0, 2, 1, 3]), n.op.Concat(
        b.ints([-1]), n.op.Mul(b.shape_of(x, 1, 2), b.shape_of(x, 3, 4)), axis=0))       # [R*oh, C*W]
    dx = n.op.MatMul(k, cols)                                                               # [N, H, C*W]
    dx = n.op.Reshape(dx, n.op.Concat(b.ints([0, 0]), b.shape_of(x, 1, 2), b.ints([-1]), axis=0))
    return (n.op.Transpose(dx, perm=[0, 2, 1, 3]),)


def _roi_bins(n, x: Var, rois: Var, axis: int, pooled: int) -> tuple[Var, Var]:
    """MaxRoiPool's bins along one axis, [R, pooled] int64 each: [start, end) clipped to the image.

    onnxruntime (as Caffe): corners rounded half away from zero, length = max(end - start + 1, 1),
    bin i covers [floor(i*len/pooled), ceil((i+1)*len/pooled)) + start.
    """
    b = n.b
    scale = n.attr("spatial_scale", 1.0)
    column = 2 - axis                                 # rois are (batch, x1, y1, x2, y2); axis 0 is y

    def rounded(col: int) -> Var:
        v = n.op.Gather(rois, b.ints([col]), axis=1) * scale
        return n.op.Sign(v) * n.op.Floor(n.op.Abs(v) + 0.5)                            # [R, 1]

    start = rounded(column)
    length = n.op.Max(rounded(column + 2) - start + 1.0, n.b.const_like(np.asarray(1.0), x))
    i = n.b.const_like(np.arange(pooled + 1).reshape(1, -1), x)
    edges = i * length / float(pooled)                                                 # [R, pooled+1]
    size = n.b.cast_like(b.shape_of(x, 2 + axis, 3 + axis), x)
    zero = n.b.const_like(np.asarray(0.0), x)
    first = n.op.Slice(edges, b.ints([0]), b.ints([pooled]), b.ints([1]))
    last = n.op.Slice(edges, b.ints([1]), b.ints([pooled + 1]), b.ints([1]))
    lo = n.op.Min(n.op.Max(n.op.Floor(first) + start, zero), size)
    hi = n.op.Min(n.op.Max(n.op.Ceil(last) + start, zero), size)
    return n.op.Cast(lo, to=TensorProto.INT64), n.op.Cast(hi, to=TensorProto.INT64)


@register("MaxRoiPool")
def max_roi_pool(n):
    """y[r,c,i,j] = max of x[b_r, c] over bin (i, j) of RoI r (0 when empty):
    dx.flat[argmax] += dy, the argmax (first in row-major order) found among the bin's
    candidates, gathered up to the largest bin's size.
    """
    if n.opset < 16:
        n.decline("MaxRoiPool below opset 16 (RoIs may overlap: the gradient needs ScatterElements "
                      "with reduction 'add')")
    x, rois = n.inputs[0], n.inputs[1]
    b = n.b
    ph, pw = n.attr("pooled_shape")
    h_lo, h_hi = _roi_bins(n, x, rois, 0, ph)                                          # [R, ph]
    w_lo, w_hi = _roi_bins(n, x, rois, 1, pw)                                          # [R, pw]
    span_h = b.reduce("ReduceMax", h_hi - h_lo, None, keepdims=False)
    span_w = b.reduce("ReduceMax", w_hi - w_lo, None, keepdims=False)
    span_h, span_w = n.op.Max(span_h, n.b.int_scalar(1)), n.op.Max(span_w, n.b.int_scalar(1))
    rows = b.unsqueeze(h_lo, [2]) + n.op.Range(b.int_scalar(0), span_h, b.int_scalar(1))  # [R, ph, Mh]
    cols = b.unsqueeze(w_lo, [2]) + n.op.Range(b.int_scalar(0), span_w, b.int_scalar(1))  # [R, pw, Mw]
    row_ok = n.op.Less(rows, b.unsqueeze(h_hi, [2]))
    col_ok = n.op.Less(cols, b.unsqueeze(w_hi, [2]))
    shape = b.shape_of(x)
    height, width = n.op.Gather(shape, b.ints([2])), n.op.Gather(shape, b.ints([3]))
    # candidates [R, ph, pw, Mh, Mw]: flat spatial position, and whether inside the bin
    pos = b.unsqueeze(rows * width, [2, 4]) + b.unsqueeze(cols, [1, 3])
    ok = n.op.And(b.unsqueeze(row_ok, [2, 4]), b.unsqueeze(col_ok, [1, 3]))
    pos = n.op.Where(ok, pos, n.b.int_scalar(0))
    image = n.op.Cast(n.op.Gather(rois, b.ints([0]), axis=1), to=TensorProto.INT64)                   # [R, 1]
    pos = n.op.Reshape(pos, b.ints([0, -1]))                                           # [R, P]
    where = n.op.Concat(b.unsqueeze(n.op.Expand(image, n.op.Shape(pos)), [2]), b.unsqueeze(pos, [2]),
                        axis=2)                                                        # [R, P, 2]
    planes = n.op.Reshape(x, n.op.Concat(b.shape_of(x, 0, 2), b.ints([-1]), axis=0))
    planes = n.op.Transpose(planes, perm=[0, 2, 1])                                   # [N, H*W, C]
    values = n.op.GatherND(planes, where)                                              # [R, P, C]
    lowest = n.b.const_like(np.asarray(-np.inf), x)
    values = n.op.Where(b.unsqueeze(n.op.Reshape(ok, b.ints([0, -1])), [2]), values, lowest)
    values = n.op.Reshape(values, n.op.Concat(b.ints([0, ph * pw, -1]), b.shape_of(x, 1, 2), axis=0))
    best = n.op.Reshape(n.op.ArgMax(values, axis=2, keepdims=1), b.ints([0, ph, pw, -1]))  # [R, ph, pw, C]
    best_row = n.op.Reshape(h_lo, b.ints([0, ph, 1, 1])) + n.op.Div(best, span_w)
    best_col = n.op.Reshape(w_lo, b.ints([0, 1, pw, 1])) + n.op.Mod(best, span_w)
    channels = n.op.Gather(shape, b.ints([1]))
    channel = b.arange(channels)                                                        # [C]
    plane = b.unsqueeze(image, [2, 3]) * channels + channel                            # [R, 1, 1, C]
    index = (plane * height + best_row) * width + best_col                             # [R, ph, pw, C]
    empty = n.op.Or(n.op.Reshape(n.op.LessOrEqual(h_hi, h_lo), b.ints([0, ph, 1, 1])),
                    n.op.Reshape(n.op.LessOrEqual(w_hi, w_lo), b.ints([0, 1, pw, 1])))
    index = n.op.Where(empty, n.b.int_scalar(0), index)
    grads = n.op.Where(empty, n.b.const_like(np.asarray(0.0), x), n.op.Transpose(n.dy, perm=[0, 2, 3, 1]))
    flat = b.ints([-1])
    acc = n.op.Reshape(b.zeros_like(x), flat)
    acc = n.op.ScatterElements(acc, n.op.Reshape(index, flat), n.op.Reshape(grads, flat), axis=0,
                               reduction="add")
    return b.reshape_like(acc, x), None


# -- DeformConv -----------------------------------------------------------------------------------
def _deform_taps(n, x: Var, offset: Var, geo: _Geo, offset_group: int) -> tuple[Var, Var, Var, Var]:
    """DeformConv's bilinear taps, each [N, G, 4, K, O] (G offset groups, K kernel taps, O outputs).

    Sample (k, o) sits at o*s - pad + k*d + offset[b, g, k, :, o] (offsets as (y, x) pairs); it reads
    its 4 neighbours (lo,lo) (lo,hi) (hi,lo) (hi,hi), zero outside the image (torchvision's rule).
    Returns the flat pixel index of each tap, its weight, and the weight's derivatives along y and x.
    """
    b = n.b
    (height, width), (out_h, out_w), (kh, kw) = x.shape[2:], geo.out_dims, geo.kernel
    ki, kj = np.meshgrid(np.arange(kh), np.arange(kw), indexing="ij")
    oi, oj = np.meshgrid(np.arange(out_h), np.arange(out_w), indexing="ij")
    base_y = oi.reshape(1, -1) * geo.strides[0] - geo.begin[0] + ki.reshape(-1, 1) * geo.dilations[0]
    base_x = oj.reshape(1, -1) * geo.strides[1] - geo.begin[1] + kj.reshape(-1, 1) * geo.dilations[1]
    shifts = n.op.Reshape(offset, b.ints([0, offset_group, kh * kw, 2, out_h * out_w]))
    shift_y, shift_x = (b.squeeze(n.op.Gather(shifts, b.ints([i]), axis=3), [3]) for i in (0, 1))
    pos_y, pos_x = shift_y + n.b.const_like(base_y, x), shift_x + n.b.const_like(base_x, x)   # [N, G, K, O]
    lo_y, lo_x = n.op.Floor(pos_y), n.op.Floor(pos_x)
    fy, fx = pos_y - lo_y, pos_x - lo_x
    zero = n.b.const_like(np.asarray(0.0), x)
    last_row, last_col = n.b.const_like(np.asarray(height - 1.0), x), n.b.const_like(np.asarray(width - 1.0), x)
    index, weight, d_y, d_x = [], [], [], []
    for high_y, high_x in ((0, 0), (0, 1), (1, 0), (1, 1)):
        row, col = lo_y + float(high_y), lo_x + float(high_x)
        wy = fy if high_y else 1.0 - fy
        wx = fx if high_x else 1.0 - fx
        inside = n.op.And(n.op.And(n.op.GreaterOrEqual(row, zero), n.op.LessOrEqual(row, last_row)),
                          n.op.And(n.op.GreaterOrEqual(col, zero), n.op.LessOrEqual(col, last_col)))
        inside = n.b.cast_like(inside, x)
        row, col = n.op.Clip(row, zero, last_row), n.op.Clip(col, zero, last_col)
        index.append(n.op.Cast(row * float(width) + col, to=TensorProto.INT64))
        weight.append(wy * wx * inside)
        d_y.append((wx if high_y else -wx) * inside)
        d_x.append((wy if high_x else -wy) * inside)
    return tuple(n.op.Concat(*[b.unsqueeze(v, [2]) for v in vs], axis=2) for vs in (index, weight, d_y, d_x))


@register("DeformConv", inputs=(0, 1, 2, 3, 4))
def deform_conv(n):
    """y[b,m,o] = sum_{c,k} w[m,c,k] * cols[b,c,k,o] + bias[m],  cols = mask[b,g,k,o] * s[b,c,k,o],
    s = bilinear sample of x[b,c] at o*s - pad + k*d + offset[b,g,k,o] (g: c's offset group):
    dw = dy cols^T,  dbias = sum(dy),  dcols = w^T dy,
    dmask = sum_c dcols*s,  doffset = sum_c dcols*mask*ds/dpos,  dx = scatter-add of dcols*mask*tap weight
    """
    x, w, offset, mask = n.inputs[0], n.inputs[1], n.inputs[2], n.input(4)
    b = n.b
    kernel = _kernel(n, w)
    if x.shape is None or len(x.shape) != 4 or None in x.shape[1:] or len(kernel) != 2:
        n.decline("DeformConv gradients are implemented for 2-D inputs with known channels and spatial dims")
    channels, height, width = x.shape[1:]
    group, offset_group = n.attr("group", 1), n.attr("offset_group", 1)
    geo = _geometry(n, x, kernel)
    taps, outs = kernel[0] * kernel[1], geo.out_dims[0] * geo.out_dims[1]
    per_offset, per_group = channels // offset_group, channels // group
    index, weight, d_y, d_x = _deform_taps(n, x, offset, geo, offset_group)             # [N, G, 4, K, O]
    # every channel of an offset group reads the same taps: [N, G, Cog, 4*K*O]
    index = n.op.Expand(b.unsqueeze(n.op.Reshape(index, b.ints([0, offset_group, -1])), [2]),
                        b.ints([1, 1, per_offset, 1]))
    pixels = n.op.Reshape(x, b.ints([0, offset_group, per_offset, height * width]))
    values = n.op.Reshape(n.op.GatherElements(pixels, index, axis=3),
                          b.ints([0, offset_group, per_offset, 4, taps, outs]))      # [N, G, Cog, 4, K, O]
    weight, d_y, d_x = (b.unsqueeze(v, [2]) for v in (weight, d_y, d_x))             # [N, G, 1, 4, K, O]
    samples = b.sum(values * weight, [3], keepdims=False)                            # [N, G, Cog, K, O]
    modulation = None if mask is None else b.unsqueeze(
        n.op.Reshape(mask, b.ints([0, offset_group, taps, outs])), [2])              # [N, G, 1, K, O]
    dy = n.op.Reshape(n.dy, b.ints([0, group, -1, outs]))                            # [N, gr, Mg, O]
    grads: list[Var | None] = [None] * len(n.inputs)
    if n.needs(1):
        cols = samples if modulation is None else samples * modulation
        cols = n.op.Reshape(cols, b.ints([0, group, per_group * taps, outs]))       # [N, gr, Cg*K, O]
        per_image = n.op.MatMul(dy, n.op.Transpose(cols, perm=[0, 1, 3, 2]))        # [N, gr, Mg, Cg*K]
        grads[1] = b.reshape_like(b.sum(per_image, [0], keepdims=False), w)
    if len(n.inputs) > 3 and n.needs(3):
        grads[3] = b.sum(n.dy, [0, 2, 3], keepdims=False)
    if not any(n.needs(i) for i in (0, 2, 4)):
        return grads
    weights = n.op.Reshape(w, b.ints([group, -1, per_group * taps]))                 # [gr, Mg, Cg*K]
    dcols = n.op.MatMul(n.op.Transpose(weights, perm=[0, 2, 1]), dy)                 # [N, gr, Cg*K, O]
    dcols = n.op.Reshape(dcols, b.ints([0, offset_group, per_offset, taps, outs]))  # [N, G, Cog, K, O]
    if mask is not None and n.needs(4):
        grads[4] = b.reshape_like(b.sum(dcols * samples, [2], keepdims=False), mask)
    dsamples = dcols if modulation is None else dcols * modulation
    if n.needs(2):
        slopes = [b.sum(dsamples * b.sum(values * d, [3], keepdims=False), [2], keepdims=False) for d in (d_y, d_x)]
        pairs = n.op.Concat(*[b.unsqueeze(v, [3]) for v in slopes], axis=3)          # [N, G, K, 2, O]
        grads[2] = b.reshape_like(pairs, offset)
    if n.needs(0):
        spread = n.op.Reshape(b.unsqueeze(dsamples, [3]) * weight, b.ints([0, offset_group, per_offset, -1]))
        scattered = n.op.ScatterElements(b.zeros_like(pixels), index, spread, axis=3, reduction="add")
        grads[0] = b.reshape_like(scattered, x)
    return grads
