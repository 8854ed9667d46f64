"""Gradient rules: attention and the ops around it (Attention, RotaryEmbedding, SwiGLU, CausalConvWithState).

Attention's backward recomputes the attention probabilities P from Q, K and the
mask (or takes them from the node itself when its ``qk_matmul_output_mode`` is
3), then runs the textbook softmax-attention backward. Grouped-query attention
is handled by viewing the query heads of a group as extra query rows of their
KV head ([B, Hq, S, d] -> [B, Hk, g*S, d]), so K and V are never repeated and
their gradients need no extra sum.

The opset-27/28 ops (SwiGLU, CausalConvWithState, LinearAttention) list their
differentiable inputs, the same as their schemas' tags: the rules then do not
depend on a schema lookup at the model's opset. Their ``past_state`` inputs are
tagged NonDifferentiable, but a recurrent state has a gradient that PyTorch
gives it (as for an RNN's h_0, or ``torch.cat([past, x])`` before a conv), so
the rules differentiate them beyond the tags.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxgrad.ir.builder import INT64_MAX, Var, total
from onnxgrad.ir.model import FLOAT_TYPES

from .registry import Node, register


def _t(n: Node, x: Var) -> Var:
    """Swap the last two axes of a 4-D tensor."""
    return n.op.Transpose(x, perm=[0, 1, 3, 2])


# -- Attention ---------------------------------------------------------------------------------
class _Heads:
    """Q-side tensors [B, Hq, S, d] viewed per KV head as [B, Hk, g*S, d] (GQA: g query heads share one)."""

    def __init__(self, n: Node, hq: int, hk: int):
        if hq % hk:
            n.decline(f"q_num_heads ({hq}) is not a multiple of kv_num_heads ({hk})")
        self.n, self.hq, self.hk = n, hq, hk

    def grouped(self, x: Var) -> Var:
        return x if self.hq == self.hk else self.n.op.Reshape(x, self.n.b.ints([0, self.hk, -1, 0]))

    def ungrouped(self, x: Var) -> Var:
        return x if self.hq == self.hk else self.n.op.Reshape(x, self.n.b.ints([0, self.hq, -1, 0]))

    def matmul(self, a: Var, b: Var) -> Var:
        """a [B, Hq, S, x] @ b [B, Hk, x, y] -> [B, Hq, S, y], each query head with its KV head."""
        return self.ungrouped(self.n.op.MatMul(self.grouped(a), b))

    def matmul_t(self, a: Var, b: Var) -> Var:
        """a' @ b for a [B, Hq, S, x], b [B, Hq, S, y] -> [B, Hk, x, y], summed over each group."""
        return self.n.op.MatMul(_t(self.n, self.grouped(a)), self.grouped(b))


def _split_heads(n: Node, x: Var, heads: int) -> Var:
    """[B, S, H*d] -> [B, H, S, d]"""
    return n.op.Transpose(n.op.Reshape(x, n.b.ints([0, 0, heads, -1])), perm=[0, 2, 1, 3])


def _merge_heads(n: Node, x: Var) -> Var:
    """[B, H, S, d] -> [B, S, H*d]"""
    return n.op.Reshape(n.op.Transpose(x, perm=[0, 2, 1, 3]), n.b.ints([0, 0, -1]))


def _positions(n: Node, x: Var, axis: int, length: int | None, shape: tuple) -> Var:
    """0, 1, ... along ``axis`` of x, int64, shaped ``shape`` (with -1 where the positions go)."""
    if length is not None:
        return n.b.const(np.arange(length, dtype=np.int64).reshape(shape))
    end = n.b.squeeze(n.b.shape_of(x, axis, axis + 1), [0])
    r = n.op.Range(n.b.const(np.array(0, np.int64)), end, n.b.const(np.array(1, np.int64)))
    return n.op.Reshape(r, n.b.ints(shape))


class _AttentionBias:
    """The additive bias Attention puts on the scores: attn_mask (bool: 0 / -inf), the causal and
    sliding-window frontiers, and nonpad_kv_seqlen's padding, broadcast to [B, Hq, S, L]."""

    def __init__(self, n: Node, q4: Var, kc: Var, s_len: int | None, l_len: int | None):
        self.n, self.b = n, n.b
        zero, ninf = n.b.scalar(0.0, q4), n.b.scalar(-np.inf, q4)
        past, nonpad = n.input(4), n.input(6)
        mask = n.input(3)
        terms: list[Var] = []
        self.mask, self.mask_padded = mask, False
        if mask is not None:
            m = mask if mask.dtype in FLOAT_TYPES else n.op.Where(mask, zero, ninf)
            terms.append(self._pad_keys(m, kc, l_len, ninf))
        left, right = n.attr("left_window_size", -1), n.attr("right_window_size", -1)
        causal = n.attr("is_causal", 0)
        if causal or left >= 0 or right >= 0:
            i = _positions(n, q4, 2, s_len, (-1, 1))
            j = _positions(n, kc, 2, l_len, (1, -1))
            if past is not None:
                offset = n.b.shape_of(past, 2, 3)
            elif nonpad is not None:                                       # per batch: nonpad - S
                seq = n.b.shape_of(q4, 2, 3)
                offset = self.b.unsqueeze(n.op.Sub(n.op.Cast(nonpad, to=TensorProto.INT64), seq), [1, 2, 3])
            else:
                offset = None
            frontier = i if offset is None else i + offset                 # query i's own position
            if causal:
                terms.append(n.op.Where(n.op.LessOrEqual(j, frontier), zero, ninf))
            if left >= 0:
                terms.append(n.op.Where(n.op.LessOrEqual(frontier - j, n.b.ints([left])), zero, ninf))
            if right >= 0:
                terms.append(n.op.Where(n.op.LessOrEqual(j - frontier, n.b.ints([right])), zero, ninf))
        if nonpad is not None:
            j = _positions(n, kc, 2, l_len, (1, -1))
            keep = n.op.Less(j, self.b.unsqueeze(n.op.Cast(nonpad, to=TensorProto.INT64), [1]))   # [B, L]
            terms.append(self.b.unsqueeze(n.op.Where(keep, zero, ninf), [1, 2]))
        self.bias = None
        for t in terms:
            self.bias = total(self.bias, t)
        # rows of -inf only are possible; the op makes their probabilities 0 (softmax would give NaN)
        self.may_mask_rows = mask is not None or nonpad is not None or left >= 0 or right >= 0

    def _pad_keys(self, m: Var, kc: Var, l_len: int | None, ninf: Var) -> Var:
        """A mask shorter than the keys is padded with -inf (the positions past it are masked)."""
        m_len = self.b.static_dim(self.mask, -1)
        if m_len is not None and m_len == l_len:
            return m
        rank = self.mask.rank
        if rank is None:
            self.n.decline("the rank of attn_mask must be known")
        if m_len is not None and l_len is not None:
            missing = self.b.ints([l_len - m_len])
        else:
            missing = self.n.op.Sub(self.b.shape_of(kc, 2, 3), self.b.shape_of(m, rank - 1, rank))
        self.mask_padded = True
        return self.n.op.Pad(m, self.n.op.Concat(self.b.ints([0] * (2 * rank - 1)), missing, axis=0), ninf)

    def mask_grad(self, dz: Var, scores_shape: tuple) -> Var:
        """d(float attn_mask): dZ (``scores_shape``, dims None where unknown) over the mask's own key
        positions, summed to the mask's shape."""
        if self.mask_padded:
            rank = self.mask.rank
            end = self.b.shape_of(self.mask, rank - 1, rank)
            dz = self.n.op.Slice(dz, self.b.ints([0]), end, self.b.ints([-1]))
            scores_shape = (*scores_shape[:3], self.b.static_dim(self.mask, -1))
        return self.b.unbroadcast(self.b.with_shape(dz, scores_shape), self.mask)

    def probabilities(self, z: Var) -> Var:
        p = self.n.op.Softmax(z, axis=-1)
        if not self.may_mask_rows:
            return p
        row_max = self.b.reduce("ReduceMax", self.bias, [-1], keepdims=True)
        masked_row = self.n.op.Equal(row_max, self.b.scalar(-np.inf, row_max))
        return self.n.op.Where(masked_row, self.b.scalar(0.0, p), p)


@register("Attention", inputs=(0, 1, 2, 3, 4, 5))
def attention(n: Node):
    """Y = P V,  P = softmax(Z),  Z = cap(U) + bias,  U = s Q K',  cap(U) = c tanh(U / c) (softcap c > 0),
    with K, V = [past, new] along the sequence and each KV head shared by Hq / Hk query heads.

    dV = P' dY,  dP = dY V',  dZ = P (dP - rowsum(dP P)),  dU = dZ (1 - (cap(U) / c)^2),
    dQ = s dU K,  dK = s dU' Q,  d(float attn_mask) = dZ summed to the mask's shape;
    seeds of present_key/value add to dK, dV, and of qk_matmul_output to dU, dcap, dZ or dP (its mode).
    """
    q, k, v = n.inputs[:3]
    if q.rank is None:
        n.decline("the rank of Q must be known")
    packed = q.rank == 3
    hq = n.attr("q_num_heads") if packed else n.b.static_dim(q, 1)
    hk = n.attr("kv_num_heads") if packed else n.b.static_dim(k, 1)
    if hq is None or hk is None:
        n.decline("the numbers of query and key/value heads must be known")
    heads = _Heads(n, hq, hk)
    q4, k4, v4 = (_split_heads(n, x, h) for x, h in ((q, hq), (k, hk), (v, hk))) if packed else (q, k, v)
    past_k, past_v = n.input(4), n.input(5)
    kc = k4 if past_k is None else n.op.Concat(past_k, k4, axis=2)
    vc = v4 if past_v is None else n.op.Concat(past_v, v4, axis=2)
    s_len = n.b.static_dim(q, 1 if packed else 2)
    new_len, past_len = n.b.static_dim(k, 1 if packed else 2), 0 if past_k is None else n.b.static_dim(past_k, 2)
    l_len = None if new_len is None or past_len is None else new_len + past_len

    scale = n.attr("scale")
    if scale is not None:
        scale = n.b.scalar(scale, q)
    else:
        width = n.b.static_dim(q, 2)
        head = (width // hq if width is not None else None) if packed else n.b.static_dim(q, 3)
        if head is not None:
            scale = n.b.scalar(1.0 / np.sqrt(head), q)
        else:
            scale = n.op.Reciprocal(n.op.Sqrt(n.op.CastLike(n.b.shape_of(q4, 3, 4), q)))
    softcap = n.attr("softcap", 0.0) or 0.0
    mode = n.attr("qk_matmul_output_mode", 0)
    d_qk = n.dys[3] if len(n.dys) > 3 else None

    # softmax_precision: the softmax, and here its backward, run in that type; P is cast back for P V
    precision = n.attr("softmax_precision")
    widen = precision is not None and q.dtype is not None and precision != q.dtype
    bias = _AttentionBias(n, q4, kc, s_len, l_len)
    reuse = mode == 3 and not widen                                      # output 3 is P itself
    u = capped = None
    if softcap > 0 or not reuse:
        u = heads.matmul(q4, _t(n, kc)) * scale                         # [B, Hq, S, L]
        capped = n.op.Tanh(u / softcap) * softcap if softcap > 0 else u
    if reuse:
        p = p_wide = n.expose_output(3, "probabilities", like=q)
    else:
        z = total(capped, bias.bias)
        p_wide = bias.probabilities(n.op.Cast(z, to=precision) if widen else z)
        p = n.op.Cast(p_wide, to=q.dtype) if widen else p_wide

    dy = n.dy
    if dy is not None and packed:
        dy = _split_heads(n, dy, hq)
    dvc = heads.matmul_t(p, dy) if dy is not None else None             # [B, Hk, L, dv]
    dp = heads.matmul(dy, _t(n, vc)) if dy is not None else None
    dp = total(dp, d_qk if mode == 3 else None)
    dz = None
    if dp is not None:
        dp = n.op.Cast(dp, to=precision) if widen else dp
        dz = p_wide * (dp - n.b.sum(dp * p_wide, [-1], keepdims=True))
        dz = n.op.Cast(dz, to=q.dtype) if widen else dz
    dz = total(dz, d_qk if mode == 2 else None)
    dcap = total(dz, d_qk if mode == 1 else None)
    if dcap is not None and softcap > 0:
        t = capped / softcap
        dcap = dcap * (1.0 - t * t)
    du = total(dcap, d_qk if mode == 0 else None)
    dus = None if du is None else du * scale

    grads: list[Var | None] = [None] * len(n.inputs)
    if dus is not None and n.needs(0):
        dq4 = heads.matmul(dus, kc)
        grads[0] = _merge_heads(n, dq4) if packed else dq4
    dkc = total(heads.matmul_t(dus, q4) if dus is not None else None, n.dys[1] if len(n.dys) > 1 else None)
    dvc = total(dvc, n.dys[2] if len(n.dys) > 2 else None)
    for new, past, summed in ((1, 4, dkc), (2, 5, dvc)):
        if summed is None:
            continue
        if past_k is None:
            parts = (summed, None)
        else:
            cut = n.b.shape_of(n.inputs[past], 2, 3)
            parts = (n.op.Slice(summed, cut, n.b.ints([INT64_MAX]), n.b.ints([2])),
                     n.op.Slice(summed, n.b.ints([0]), cut, n.b.ints([2])))
        if n.needs(new):
            grads[new] = _merge_heads(n, parts[0]) if packed else parts[0]
        if parts[1] is not None and n.needs(past):
            grads[past] = parts[1]
    if n.needs(3) and dz is not None and bias.mask is not None and bias.mask.dtype in FLOAT_TYPES:
        grads[3] = bias.mask_grad(dz, (n.b.static_dim(q, 0), hq, s_len, l_len))
    return tuple(grads)


# -- RotaryEmbedding ---------------------------------------------------------------------------
def _rotated_halves(n: Node, x: Var, rot: int) -> tuple[Var, Var]:
    """The two halves (x1, x2) RotaryEmbedding rotates, each [B, S, heads, rot/2]."""
    if x.rank == 4:                                                      # [B, heads, S, d]
        x = n.op.Transpose(x, perm=[0, 2, 1, 3])
    else:                                                                # [B, S, heads*d]
        x = n.op.Reshape(x, n.b.ints([0, 0, n.attr("num_heads"), -1]))
    x = n.op.Slice(x, n.b.ints([0]), n.b.ints([rot]), n.b.ints([-1]))
    if n.attr("interleaved", 0):                                         # pairs (x[2i], x[2i+1])
        pairs = n.op.Reshape(x, n.b.ints([0, 0, 0, rot // 2, 2]))
        return tuple(n.b.squeeze(h, [-1]) for h in n.op.Split(pairs, n.b.ints([1, 1]), axis=-1, outputs=2))
    return tuple(n.op.Split(x, n.b.ints([rot // 2, rot // 2]), axis=-1, outputs=2))


@register("RotaryEmbedding", inputs=(0, 1, 2))
def rotary_embedding(n: Node):
    """Each rotated pair (x1, x2) at position p: y1 = cos x1 - sin x2, y2 = sin x1 + cos x2,
    cos = cos_cache[p], sin = sin_cache[p].

    dX = the rotation transposed = RotaryEmbedding(dY, cos_cache, -sin_cache);
    dcos = sum_heads (dy1 x1 + dy2 x2),  dsin = sum_heads (dy2 x1 - dy1 x2), added to the rows p of the caches.
    """
    x, cos, sin = n.inputs[:3]
    pos = n.input(3)
    attrs = {a: n.attr(a) for a in ("interleaved", "num_heads", "rotary_embedding_dim") if n.has_attr(a)}
    dx = n.op.RotaryEmbedding(n.dy, cos, -sin, pos, **attrs) if n.needs(0) else None
    if not (n.needs(1) or n.needs(2)):
        return dx, None, None
    half = n.b.static_dim(cos, -1) if n.b.static_dim(cos, -1) is not None else n.b.static_dim(sin, -1)
    if half is None or x.rank is None:
        n.decline("the rotary dimension (last dim of cos_cache) and the rank of X must be known")
    x1, x2 = _rotated_halves(n, x, 2 * half)
    d1, d2 = _rotated_halves(n, n.dy, 2 * half)
    grads = []
    for i, g in ((1, d1 * x1 + d2 * x2), (2, d2 * x1 - d1 * x2)):
        if not n.needs(i):
            grads.append(None)
            continue
        g = n.b.sum(g, [2], keepdims=False)                             # [B, S, rot/2]
        cache = n.inputs[i]
        if pos is None:
            grads.append(n.b.unbroadcast(g, cache))
        else:                                                            # rows picked by position_ids
            grads.append(n.op.ScatterND(n.b.zeros_like(cache), n.b.unsqueeze(pos, [-1]), g, reduction="add"))
    return dx, grads[0], grads[1]


# -- SwiGLU ------------------------------------------------------------------------------------
@register("SwiGLU", inputs=(0, 1))
def swiglu(n: Node):
    """Y = A sigmoid(alpha A) B:  dA = dY B (s + alpha A s (1 - s)),  dB = dY A s,  s = sigmoid(alpha A)."""
    a, b = n.inputs
    alpha = n.attr("alpha", 1.0)
    s = n.op.Sigmoid(a * alpha if alpha != 1.0 else a)
    da = n.dy * b * (s + a * s * (1.0 - s) * alpha) if n.needs(0) else None
    db = n.dy * a * s if n.needs(1) else None
    return da, db


# -- CausalConvWithState -----------------------------------------------------------------------
@register("CausalConvWithState", inputs=(0, 1, 2), beyond_tags=(3,))
def causal_conv_with_state(n: Node):
    """X' = [past_state, X] along time;  C = conv_depthwise(X', W) + bias;  Y = act(C) (none or SiLU);
    present_state = the last k - 1 steps of X'.

    dC = dY act'(C),  dX' = conv_transpose_depthwise(dC, W) + [0, d(present_state)],  dX = dX'[k-1:],
    d(past_state) = dX'[:k-1] (beyond the schema's tags),
    dW[c, j] = sum_b,t dC[b, c, t] X'[b, c, t + j],  d(bias) = sum_b,t dC.
    """
    x, w = n.inputs[:2]
    bias, past = n.input(2), n.input(3)
    channels, k = n.b.static_dim(w, 0), n.b.static_dim(w, 2)
    if channels is None or k is None:
        n.decline("the weight's shape (channels, 1, k) must be known")
    if past is None:
        padded = n.op.Pad(x, n.b.ints([0, 0, k - 1, 0, 0, 0]))
    else:
        padded = n.op.Concat(past, x, axis=2)
    dc = n.dy
    if dc is not None and n.attr("activation", "none") in ("silu", "swish"):
        c = n.op.Conv(padded, w, bias, group=channels)
        s = n.op.Sigmoid(c)
        dc = dc * (s + c * s * (1.0 - s))
    d_present = n.dys[1] if len(n.dys) > 1 else None
    dx = db = dw = dpast = None
    if n.needs(0) or n.needs(3):
        dpadded = None if dc is None else n.op.ConvTranspose(dc, w, group=channels)
        if d_present is not None:                                        # the last k - 1 steps of X'
            length = n.b.shape_of(x, 2, 3)
            dpadded = total(dpadded, n.op.Pad(d_present, n.op.Concat(n.b.ints([0, 0]), length,
                                                                      n.b.ints([0, 0, 0]), axis=0)))
        if n.needs(0):
            dx = n.op.Slice(dpadded, n.b.ints([k - 1]), n.b.ints([INT64_MAX]), n.b.ints([2]))
        if n.needs(3):
            dpast = n.op.Slice(dpadded, n.b.ints([0]), n.b.ints([k - 1]), n.b.ints([2]))
    if dc is not None and n.needs(1):
        # one group per channel: input rows X'[:, c], kernel rows dC[:, c]
        rows = n.op.Reshape(n.op.Transpose(padded, perm=[1, 0, 2]), n.b.ints([1, -1, 0]))
        kernels = n.op.Transpose(dc, perm=[1, 0, 2])
        dw = n.op.Reshape(n.op.Conv(rows, kernels, group=channels), n.b.ints([channels, 1, k]))
    if dc is not None and bias is not None and n.needs(2):
        db = n.b.sum(dc, [0, 2], keepdims=False)
    return (dx, dw, db, dpast)[: len(n.inputs)]


# -- LinearAttention ---------------------------------------------------------------------------
@register("LinearAttention", inputs=(0, 1, 2, 4, 5), beyond_tags=(3,))
def linear_attention(n: Node):
    """Per step t, per KV head (state S: [dk, dv]; a_t = exp(decay_t) when gated, u_t = v_t when not delta):
    D_t = a_t S_t-1,  u_t = beta_t (v_t - D_t' k_t),  S_t = D_t + k_t u_t',  o_t = s q_t' S_t
    (each KV head's state read by its q_num_heads / kv_num_heads query heads).

    dS_t += s q_t do_t',  dq_t = s S_t do_t,  dk_t = dS_t u_t,  du_t = dS_t' k_t,  dD_t = dS_t;
    delta:  dbeta_t = du_t . (v_t - D_t' k_t),  dv_t = beta_t du_t,  dr = -beta_t du_t,
            dD_t += k_t dr',  dk_t += D_t dr;
    gated:  dS_t-1 = a_t dD_t,  ddecay_t = a_t sum(dD_t S_t-1)  (over dv, and dk for a per-head decay);
    d(past_state) = dS_-1, the carry left after the first step (beyond the schema's tags).
    """
    q, k, v = n.inputs[:3]
    past, decay, beta = n.input(3), n.input(4), n.input(5)
    rule = n.attr("update_rule", "gated_delta")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    hq, hk = n.attr("q_num_heads"), n.attr("kv_num_heads")
    T, qh, vh = n.b.static_dim(q, 1), n.b.static_dim(q, 2), n.b.static_dim(v, 2)
    if None in (T, qh, vh):
        n.decline("the sequence length and the hidden sizes of query and value must be known "
                      "(the backward through time is unrolled over the sequence)")
    dk, dv = qh // hq, vh // hk
    heads = _Heads(n, hq, hk)
    scale = n.attr("scale", 0.0) or 1.0 / np.sqrt(dk)
    b, op = n.b, n.op

    def per_step(x: Var | None, h: int) -> list[Var | None]:
        """[B, T, h*d] -> T tensors [B, h, 1, d]"""
        if x is None:
            return [None] * T
        x4 = _split_heads(n, x, h)
        return list(op.Split(x4, b.ints([1] * T), axis=2, outputs=T)) if T > 1 else [x4]

    q_s, k_s, v_s = per_step(q, hq), per_step(k, hk), per_step(v, hk)
    g_s = per_step(decay, hk)                                   # [B, Hk, 1, dk | 1]
    per_key = gated and n.b.static_dim(decay, 2) == hk * dk
    a_s = [None if g is None else op.Exp(_t(n, g) if per_key else g) for g in g_s]   # columns scaling S's rows
    beta_heads = n.b.static_dim(beta, 2) if beta is not None else 1
    if beta is not None and beta_heads is None:
        n.decline("the last dim of beta must be known")
    beta_s = per_step(beta, beta_heads)                         # [B, Hk | 1, 1, 1]

    # the forward once more: the state before and after each step
    if past is not None:
        state = past
    else:
        shape = op.Concat(b.shape_of(q, 0, 1), b.ints([hk, dk, dv]), axis=0)
        state = op.Expand(b.scalar(0.0, q), shape)
    prev, decayed, u_s, after = [None] * T, [None] * T, [None] * T, [None] * T
    for t in range(T):
        prev[t] = state
        decayed[t] = state * a_s[t] if gated else state
        u_s[t] = beta_s[t] * (v_s[t] - op.MatMul(k_s[t], decayed[t])) if delta else v_s[t]
        state = after[t] = decayed[t] + _t(n, k_s[t]) * u_s[t]

    # backward through time
    do_s = per_step(n.dy, hq)
    carry = n.dys[1] if len(n.dys) > 1 else None
    dq, dk_, dv_, ddecay, dbeta = ([None] * T for _ in range(5))
    for t in reversed(range(T)):
        ds = carry
        if do_s[t] is not None:
            ds = total(ds, heads.matmul_t(q_s[t], do_s[t]) * scale)              # [B, Hk, dk, dv]
            dq[t] = heads.matmul(do_s[t], _t(n, after[t])) * scale               # [B, Hq, 1, dk]
        if ds is None:                                                           # nothing reaches step t
            continue
        dk_[t] = op.MatMul(u_s[t], _t(n, ds))
        du = op.MatMul(k_s[t], ds)                                               # [B, Hk, 1, dv]
        dd = ds
        if delta:
            retrieved = op.MatMul(k_s[t], decayed[t])
            dbeta[t] = b.sum(du * (v_s[t] - retrieved), [-1], keepdims=True)
            dv_[t] = beta_s[t] * du
            dr = -dv_[t]
            dd = dd + _t(n, k_s[t]) * dr
            dk_[t] = dk_[t] + op.MatMul(dr, _t(n, decayed[t]))
        else:
            dv_[t] = du
        if gated:
            da = b.sum(dd * prev[t], [-1], keepdims=True)                       # [B, Hk, dk, 1]
            if not per_key:
                da = b.sum(da, [2], keepdims=True)
            ddecay[t] = da * a_s[t]
            carry = dd * a_s[t]
        else:
            carry = dd

    def stacked(parts: list[Var | None], like: list[Var]) -> Var:
        """T tensors [B, h, 1, d] (None: nothing reached that step) -> [B, T, h*d]"""
        parts = [p if p is not None else b.zeros_like(l) for p, l in zip(parts, like)]
        return _merge_heads(n, parts[0] if T == 1 else op.Concat(*parts, axis=2))

    grads: list[Var | None] = [None] * len(n.inputs)
    if n.needs(0):
        grads[0] = stacked(dq, q_s)
    if n.needs(1):
        grads[1] = stacked(dk_, k_s)
    if n.needs(2):
        grads[2] = stacked(dv_, v_s)
    if gated and n.needs(4):
        grads[4] = stacked([None if g is None else _t(n, g) if per_key else g for g in ddecay], g_s)
    if delta and n.needs(5):
        if beta_heads == 1 and hk > 1:                          # one rate shared by the heads
            dbeta = [None if g is None else b.sum(g, [1], keepdims=True) for g in dbeta]
        grads[5] = stacked(dbeta, beta_s)
    if n.needs(3):
        grads[3] = carry
    return tuple(grads)
