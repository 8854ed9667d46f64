"""Corrections to onnx.reference kernels, so the float64 numeric truth is right.

``onnx.reference`` is where the checker evaluates float64 models that onnxruntime
has no kernels for (:class:`onnxgrad.tools.check.Runner` says when, and why). Some of its
kernels are wrong or missing; these replace them (passed as ``new_ops``, nothing is
patched globally). Each says what it fixes and the onnx release it was found in
(onnx 1.23, the release CI tests: see pyproject.toml); when a newer onnx fixes one,
it can go (``tests/test_models.py`` checks several against closed forms).
"""
from __future__ import annotations

import math

import numpy as np
from onnx import helper
from onnx.reference.op_run import OpRun
from onnx.reference.ops import op_batch_normalization, op_conv_transpose, op_loop, op_resize
from onnx.reference.ops.op_causal_conv_with_state import CausalConvWithState as _RefCausalConv

_erf = np.vectorize(math.erf, otypes=[np.float64])


class Erf(OpRun):
    """onnx.reference's erf is a float32 approximation (onnx 1.23)."""

    op_domain = ""

    def _run(self, x):
        return (_erf(x).astype(x.dtype),)


class Gelu(OpRun):
    """Exact in float64 (onnx.reference's uses its float32 erf: onnx 1.23)."""

    op_domain = ""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            y = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
        else:
            y = 0.5 * x * (1 + _erf(x / np.sqrt(2)))
        return (y.astype(x.dtype),)


class ConvTranspose(op_conv_transpose.ConvTranspose):
    """onnx.reference splits W by output channels for group > 1; W is split by input channels (onnx 1.23)."""

    op_domain = ""

    def _run(self, X, W, B=None, group=None, **kw):
        run = super()._run
        if not group or group == 1:
            return run(X, W, B, group=1, **kw)
        parts = [run(x, w, None, group=1, **kw)[0]
                 for x, w in zip(np.split(X, group, axis=1), np.split(W, group, axis=0))]
        y = np.concatenate(parts, axis=1)
        if B is not None:
            y = y + B.reshape(1, -1, *[1] * (y.ndim - 2))
        return (y.astype(X.dtype),)


class LRN(OpRun):
    """onnx.reference sums its window over the batch axis (and takes 4-D only) (onnx 1.23)."""

    op_domain = ""

    def _run(self, x, alpha=None, beta=None, bias=None, size=None):
        before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
        square_sum = np.zeros_like(x)
        for c in range(x.shape[1]):
            square_sum[:, c] = np.sum(x[:, max(0, c - before):c + after + 1] ** 2, axis=1)
        return ((x / (bias + alpha / size * square_sum) ** beta).astype(x.dtype),)


class GlobalLpPool(OpRun):
    """Missing from onnx.reference (onnx 1.23)."""

    op_domain = ""

    def _run(self, x, p=None):
        axes = tuple(range(2, x.ndim))
        return ((np.sum(np.abs(x) ** p, axis=axes, keepdims=True) ** (1.0 / p)).astype(x.dtype),)


class MaxRoiPool(OpRun):
    """Missing from onnx.reference (onnx 1.23); onnxruntime's (Caffe's) bins."""

    op_domain = ""

    def _run(self, x, rois, pooled_shape=None, spatial_scale=None):
        ph, pw = pooled_shape
        scale = 1.0 if spatial_scale is None else spatial_scale
        height, width = x.shape[2:]
        y = np.zeros((rois.shape[0], x.shape[1], ph, pw), x.dtype)

        def rnd(v):
            return int(np.sign(v) * np.floor(abs(v) + 0.5))

        for r, (image, x1, y1, x2, y2) in enumerate(rois):
            sw, sh, ew, eh = (rnd(v * scale) for v in (x1, y1, x2, y2))
            bin_h, bin_w = max(eh - sh + 1, 1) / ph, max(ew - sw + 1, 1) / pw
            for i in range(ph):
                hs = min(max(int(np.floor(i * bin_h)) + sh, 0), height)
                he = min(max(int(np.ceil((i + 1) * bin_h)) + sh, 0), height)
                for j in range(pw):
                    ws = min(max(int(np.floor(j * bin_w)) + sw, 0), width)
                    we = min(max(int(np.ceil((j + 1) * bin_w)) + sw, 0), width)
                    if he > hs and we > ws:
                        y[r, :, i, j] = x[int(image), :, hs:he, ws:we].max(axis=(1, 2))
        return (y,)


# -- RNN, GRU, LSTM: onnx.reference ignores sequence_lens, clip and most activations (onnx 1.23) --
def _act(name: str, alpha, beta):
    return {
        "relu": lambda z: np.maximum(z, 0),
        "tanh": np.tanh,
        "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
        "affine": lambda z: alpha * z + beta,
        "leakyrelu": lambda z: np.where(z >= 0, z, alpha * z),
        "thresholdedrelu": lambda z: np.where(z > alpha, z, 0),
        "scaledtanh": lambda z: alpha * np.tanh(beta * z),
        "hardsigmoid": lambda z: np.clip(alpha * z + beta, 0, 1),
        "elu": lambda z: np.where(z >= 0, z, alpha * (np.exp(z) - 1)),
        "softsign": lambda z: z / (1 + np.abs(z)),
        "softplus": lambda z: np.log1p(np.exp(z)),
    }[name]


_USES = {"affine": (1, 1), "leakyrelu": (1, 0), "thresholdedrelu": (1, 0), "scaledtanh": (1, 1),
         "hardsigmoid": (1, 1), "elu": (1, 0)}
_DEFAULT_ALPHA_BETA = {"leakyrelu": (0.01, 0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0)}


def _activations(attrs: dict, defaults: list[str], D: int) -> list[list]:
    names = [s.decode() if isinstance(s, bytes) else s for s in attrs.get("activations", [])] or defaults * D
    if len(names) == len(defaults) and D == 2:
        names = names * 2
    alphas, betas = list(attrs.get("activation_alpha", [])), list(attrs.get("activation_beta", []))
    fns = []
    for name in names:
        key = name.lower()
        ua, ub = _USES.get(key, (0, 0))
        da, db = _DEFAULT_ALPHA_BETA.get(key, (None, None))
        fns.append(_act(key, alphas.pop(0) if ua and alphas else da, betas.pop(0) if ub and betas else db))
    k = len(defaults)
    return [fns[d * k:(d + 1) * k] for d in range(D)]


def recurrent_reference(op: str, inputs: list, attrs: dict) -> list[np.ndarray]:
    """The ONNX RNN/GRU/LSTM equations, one sequence at a time, in float64."""
    X, W, R = inputs[:3]
    Bias, lens, h0, c0, P = (list(inputs[3:]) + [None] * 5)[:5]
    layout = attrs.get("layout", 0)
    if layout:
        X = X.swapaxes(0, 1)
        h0 = None if h0 is None else h0.swapaxes(0, 1)
        c0 = None if c0 is None else c0.swapaxes(0, 1)
    Tn, Bn, _ = X.shape
    D, Hn = W.shape[0], R.shape[-1]
    G = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    direction = attrs.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    acts = _activations(attrs, {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"],
                                "LSTM": ["Sigmoid", "Tanh", "Tanh"]}[op], D)
    clip = attrs.get("clip")
    cl = (lambda z: np.clip(z, -clip, clip)) if clip is not None else (lambda z: z)
    Bias = np.zeros((D, 2 * G * Hn)) if Bias is None else Bias
    P = np.zeros((D, 3 * Hn)) if P is None else P
    lens = np.full(Bn, Tn) if lens is None else lens
    Y = np.zeros((Tn, D, Bn, Hn))
    Yh, Yc = np.zeros((D, Bn, Hn)), np.zeros((D, Bn, Hn))
    for d in range(D):
        reverse = direction == "reverse" or d == 1
        w, r = np.split(W[d], G), np.split(R[d], G)
        wb, rb = np.split(Bias[d], 2 * G)[:G], np.split(Bias[d], 2 * G)[G:]
        pi, po, pf = np.split(P[d], 3)
        for b in range(Bn):
            h = np.zeros(Hn) if h0 is None else h0[d, b]
            c = np.zeros(Hn) if c0 is None else c0[d, b]
            steps = range(lens[b])
            for t in (reversed(steps) if reverse else steps):
                x = X[t, b]

                def pre(k, hh=h):
                    return w[k] @ x + r[k] @ hh + wb[k] + rb[k]
                if op == "RNN":
                    h = acts[d][0](cl(pre(0)))
                elif op == "GRU":
                    f, g = acts[d]
                    z, rr = f(cl(pre(0))), f(cl(pre(1)))
                    if attrs.get("linear_before_reset", 0):
                        a = w[2] @ x + rr * (r[2] @ h + rb[2]) + wb[2]
                    else:
                        a = w[2] @ x + r[2] @ (rr * h) + rb[2] + wb[2]
                    h = (1 - z) * g(cl(a)) + z * h
                else:
                    f, g, hf = acts[d]
                    i = f(cl(pre(0) + pi * c))
                    fg = f(cl(pre(2) + pf * c))
                    c = fg * c + i * g(cl(pre(3)))
                    o = f(cl(pre(1) + po * c))
                    h = o * hf(c)
                Y[t, d, b] = h
            Yh[d, b], Yc[d, b] = h, c
    if layout:
        Y, Yh, Yc = Y.transpose(2, 0, 1, 3), Yh.swapaxes(0, 1), Yc.swapaxes(0, 1)
    return [Y, Yh, Yc]


def _reference_op(op: str):
    def _run(self, *inputs, **_):
        attrs = {a.name: helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        outs = recurrent_reference(op, list(inputs), attrs)
        dtype = inputs[0].dtype
        return tuple(o.astype(dtype) for o in outs[: len(self.onnx_node.output)])
    return type(op, (OpRun,), {"op_domain": "", "_run": _run})


_RECURRENT = [_reference_op(op) for op in ("RNN", "GRU", "LSTM")]


class CausalConvWithState(_RefCausalConv):
    """onnx.reference's op with its SiLU in the input's precision (it computes it in float32: onnx 1.23)."""

    op_domain = ""

    def _run(self, input, weight, bias=None, past_state=None, activation=None):
        out, present = super()._run(input, weight, bias, past_state, "none")
        if activation in ("silu", "swish"):
            out = out / (1 + np.exp(-out))
        return out, present


# -- LinearAttention: onnx.reference computes the recurrence in float32 (onnx 1.23) -------------
def linear_attention(q, k, v, past=None, decay=None, beta=None, *, q_num_heads, kv_num_heads,
                      update_rule="gated_delta", scale=0.0):
    """The LinearAttention recurrence, step by step in the inputs' precision."""
    def heads(x, h):
        b, t, hd = x.shape
        return x.reshape(b, t, h, hd // h).transpose(0, 2, 1, 3)
    q4, k4, v4 = heads(q, q_num_heads), heads(k, kv_num_heads), heads(v, kv_num_heads)
    b, _, t, dk = q4.shape
    g = q_num_heads // kv_num_heads
    state = np.zeros((b, kv_num_heads, dk, v4.shape[-1]), q.dtype) if past is None else past.copy()
    out = np.zeros((b, q_num_heads, t, v4.shape[-1]), q.dtype)
    scale = scale or 1 / np.sqrt(dk)
    for i in range(t):
        if update_rule in ("gated", "gated_delta"):
            gi = heads(decay, kv_num_heads)[:, :, i, :]                      # [B, Hk, dk | 1]
            state = state * np.exp(gi)[..., None]
        ki, vi = k4[:, :, i], v4[:, :, i]
        if update_rule in ("delta", "gated_delta"):
            bi = beta.transpose(0, 2, 1)[:, :, i, None]                       # [B, Hk | 1, 1]
            vi = bi * (vi - np.einsum("bhdm,bhd->bhm", state, ki))
        state = state + ki[..., :, None] * vi[..., None, :]
        out[:, :, i] = scale * np.einsum("bhd,bhdm->bhm", q4[:, :, i], np.repeat(state, g, axis=1))
    return out.transpose(0, 2, 1, 3).reshape(b, t, -1), state


class LinearAttention(OpRun):
    op_domain = ""

    def _run(self, *inputs, **_):
        attrs = {a.name: helper.get_attribute_value(a) for a in self.onnx_node.attribute}
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items() if k != "chunk_size"}
        return linear_attention(*inputs, **attrs)


class DynamicQuantizeLinear(OpRun):
    """onnx.reference computes y_scale in float32 whatever x is (onnx 1.23): central differences of a float64
    copy need it in x's precision (onnx's formula otherwise)."""

    op_domain = ""

    def _run(self, x):
        low, high = min(0.0, float(x.min())), max(0.0, float(x.max()))
        scale = (high - low) / 255.0
        zero_point = np.clip(np.rint(-low / scale), 0, 255) if scale else 0.0
        y = np.clip(np.rint(x / scale) + zero_point, 0, 255) if scale else np.zeros_like(x)
        return y.astype(np.uint8), np.array(scale, x.dtype), np.array(zero_point, np.uint8)


class Resize(op_resize.Resize):
    """Under align_corners with scales, onnx.reference maps output i to i * (in - 1) / (scale * in - 1), the
    unrounded output length (onnx 1.23); onnxruntime and PyTorch (interpolate's align_corners, which the rule
    follows) map the corners of the output they make, floor(scale * in) long, onto the input's corners
    (test_resize_downsample_scales_linear_align_corners: [1, 4], not [1, 3.14]). Given as those sizes."""

    op_domain = ""

    def _run(self, X, roi, scales=None, sizes=None, antialias=None, axes=None, coordinate_transformation_mode=None,
             cubic_coeff_a=None, exclude_outside=None, extrapolation_value=None, keep_aspect_ratio_policy=None,
             mode=None, nearest_mode=None):
        if (coordinate_transformation_mode == "align_corners" and not antialias and scales is not None
                and np.size(scales) and (sizes is None or not np.size(sizes))):
            resized = list(axes) if axes is not None else list(range(X.ndim))
            # float32, as onnxruntime computes the output length
            sizes = np.array([int(np.float32(s) * np.float32(X.shape[a])) for a, s in zip(resized, scales)],
                             np.int64)
            scales = None
        return super()._run(X, roi, scales, sizes, antialias, axes, coordinate_transformation_mode, cubic_coeff_a,
                            exclude_outside, extrapolation_value, keep_aspect_ratio_policy, mode, nearest_mode)


class MaxUnpool(OpRun):
    """onnx.reference ignores output_shape when it scatters (it fills the default shape) (onnx 1.23)."""

    op_domain = ""

    def _run(self, x, indices, output_shape=None, kernel_shape=None, pads=None, strides=None):
        spatial = x.ndim - 2
        pads = list(pads) if pads else [0] * (2 * spatial)
        strides = list(strides) if strides else [1] * spatial
        if output_shape is not None:
            shape = [int(v) for v in output_shape]
        else:
            shape = list(x.shape[:2]) + [
                (x.shape[2 + i] - 1) * strides[i] + kernel_shape[i] - pads[i] - pads[spatial + i]
                for i in range(spatial)]
        y = np.zeros(int(np.prod(shape)), x.dtype)
        y[indices.reshape(-1)] = x.reshape(-1)
        return (y.reshape(shape),)


class GatherElements(OpRun):
    """onnx.reference gathers with ``np.choose``, which takes at most 64 choices: with more along the axis
    a 2-D gather returns one element per row (BERT's ``token_type_ids`` buffer of 512 read at 32 positions:
    "cannot reshape array of size 1 into shape (1,32)") and other ranks fail; and it refuses indices shorter
    than the data off the axis, which the spec, onnxruntime and ``torch.gather`` take (onnx 1.23)."""

    op_domain = ""

    def _run(self, data, indices, axis=None):
        axis = (axis or 0) % data.ndim
        size = data.shape[axis]
        if indices.size and (indices.min() < -size or indices.max() >= size):
            raise IndexError(f"GatherElements: an index is outside [-{size}, {size - 1}] along axis {axis}")
        window = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(indices.shape))
        return (np.take_along_axis(data[window], np.where(indices < 0, indices + size, indices), axis=axis),)


class MeanVarianceNormalization(OpRun):
    """onnx.reference runs the function body, whose epsilon is a float32 constant: not float64-clean
    (onnx 1.23)."""

    op_domain = ""

    def _run(self, x, axes=None):
        axes = tuple(axes) if axes is not None else (0, 2, 3)
        mean = x.mean(axis=axes, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
        return (((x - mean) / np.sqrt(var + 1e-9)).astype(x.dtype),)


class LayerNormalization(OpRun):
    """onnx.reference refuses stash_type other than float32 (onnx 1.23); the float64 check needs double
    statistics."""

    op_domain = ""

    def _run(self, x, scale, bias=None, axis=None, epsilon=None, stash_type=None):
        axis = -1 if axis is None else axis
        axis = axis % x.ndim
        eps = 1e-5 if epsilon is None else epsilon
        axes = tuple(range(axis, x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        inv = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
        y = (x - mean) * inv * scale
        if bias is not None:
            y = y + bias
        outputs = (y.astype(x.dtype), mean.astype(x.dtype), inv.astype(x.dtype))
        return outputs[: max(1, len(self.onnx_node.output))]


class BatchNormalization(op_batch_normalization.BatchNormalization_14):
    """onnx.reference's BatchNormalization-9 uses batch statistics whenever momentum is set, and it
    always is (default 0.9) (onnx 1.23). The op is in inference mode unless training_mode=1 (opset 14+) or,
    before 14, the node asks for the training outputs."""

    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None):
        outputs = len(self.onnx_node.output)
        training = bool(training_mode) if training_mode is not None else outputs > 1
        if training:
            y, *stats = super()._run(x, scale, bias, mean, var, epsilon, 0.9 if momentum is None else momentum, 1)
            axes = tuple(i for i in range(x.ndim) if i != 1)
            stats += [x.mean(axis=axes), x.var(axis=axes)]          # BatchNormalization-9's saved_*
            return (y, *stats)[:outputs]
        shape = (-1,) + (1,) * (x.ndim - 2)
        eps = 1e-5 if epsilon is None else float(epsilon)
        y = scale.reshape(shape) * (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) + bias.reshape(shape)
        return (y.astype(x.dtype),)


class Loop(op_loop.Loop):
    """Scan outputs stacked on a new axis 0 ([T, *shape]), as the spec and onnxruntime do: onnx.reference
    uses np.vstack, which gives [T, 1] for scalars and [T * d0, ...] for tensors of rank 2 and more (onnx 1.23)."""

    op_domain = ""

    def _run(self, M, cond, *args, context=None, body=None, attributes=None, bindings=None):
        body = self.body
        names = body.input_names
        inputs = dict.fromkeys(names)
        inputs.update(zip(names[2:], args))
        if context is not None:
            inputs.update(context)
        stacked = [[] for _ in range(self.K)]
        it = 0
        carried = list(args)
        while (cond is None or cond) and (M is None or it < M):
            if names[0]:
                inputs[names[0]] = np.array(it, dtype=np.int64)
            if len(names) > 1 and names[1]:
                inputs[names[1]] = np.array(True) if cond is None else cond
            outputs = self._run_body(inputs, attributes=attributes, bindings=bindings)
            for k in range(self.K):
                stacked[k].append(outputs[-self.K + k])
            cond = outputs[self.output_index[body.output_names[0]]]
            carried = [outputs[self.output_index[o]] for o in body.output_names[1:1 + self.N]]
            inputs.update(zip(names[2:], carried))
            it += 1
        return tuple(carried) + tuple(np.stack(x) if x else np.empty((0,)) for x in stacked)


KERNELS = [Loop, BatchNormalization, DynamicQuantizeLinear, GatherElements, LayerNormalization, MaxUnpool,
           MeanVarianceNormalization, Resize, Erf, Gelu, ConvTranspose, LRN, GlobalLpPool, MaxRoiPool,
           CausalConvWithState, LinearAttention, *_RECURRENT]
