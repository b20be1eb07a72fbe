"""Gradients of the transformer ops of opsets 23+: Attention, RMSNormalization, RotaryEmbedding,
Swish, and MeanVarianceNormalization.

Attention is recomputed inside the rule from Q, K, V (and the caches): the probabilities
``P = softmax(softcap(sqrt(s) Q (sqrt(s) K)^T) + bias)`` are rebuilt with the bias the
forward op uses (attention mask, causal frontier, opset 25 windows, opset 24 padding of the
external cache), then the usual backward ``dV = P^T dY``, ``dS = P * (dP - rowsum(dP * P))``,
``dQ = s dS K``, ``dK = s dS^T Q``. Grouped-query heads stay grouped: the ``G = Hq / Hkv``
query heads that share one key/value head are folded into its sequence axis, so no repeated
K/V is materialized and ``dK``/``dV`` sum over the group by the MatMul itself.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.autodiff.registry import grad_rule
from passes.autodiff.rules.elementwise import swish_derivative
from passes.autodiff.rules.nn import _grad_of, _norm_input_grad, _normalized, _sum_parts

INT64_MAX = np.iinfo(np.int64).max
# qk_matmul_output_mode: the 4th output is the raw scaled Q K^T (0), after softcap (1), after the
# bias (2), or the probabilities (3).
QK_RAW, QK_SOFTCAPPED, QK_BIASED, QK_PROBS = 0, 1, 2, 3


# ---- Attention: layout ------------------------------------------------------------------------


def _split_heads(b, x, heads):
    """(B, S, H * D) -> (B, H, S, D)."""
    return b.Transpose(b.Reshape(x, [0, 0, heads, -1]), perm=[0, 2, 1, 3])


def _merge_heads(b, x):
    """(B, H, S, D) -> (B, S, H * D)."""
    return b.Reshape(b.Transpose(x, perm=[0, 2, 1, 3]), [0, 0, -1])


def _swap_last(b, x):
    return b.Transpose(x, perm=[0, 1, 3, 2])


def _static(shape, axis):
    """``shape[axis]`` when it is a known int, else None."""
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    dim = shape[axis]
    return dim if isinstance(dim, int) else None


class _Heads:
    """Folds the query heads sharing one key/value head into its sequence axis and back:
    (B, Hq, S, X) <-> (B, Hkv, G * S, X), query head ``h`` using key/value head ``h // G``
    (onnx's interleaved repeat of K and V). The identity when Hq == Hkv is known."""

    def __init__(self, b, q4, kv4, hq, hkv):
        self.b = b
        self.same = hq is not None and hq == hkv
        self.hq = [hq] if hq is not None else b.dim(q4, 1)
        self.hkv = [hkv] if hkv is not None else b.dim(kv4, 1)

    def _reshape(self, x, heads):
        return self.b.Reshape(x, self.b.Concat([0], heads, [-1], [0], axis=0))

    def group(self, x):
        return x if self.same else self._reshape(x, self.hkv)

    def ungroup(self, x):
        return x if self.same else self._reshape(x, self.hq)


# ---- Attention: the bias ------------------------------------------------------------------------


def _allowed_keys(b, n, q4, kp):
    """Bool mask of the keys each query may attend under ``is_causal``, the opset 25 windows
    and the opset 24 ``nonpad_kv_seqlen`` padding; (Sq, T) or (B, 1, Sq, T); None if all."""
    causal = n.attr("is_causal", 0)
    left, right = n.attr("left_window_size", -1), n.attr("right_window_size", -1)
    nonpad = n.inputs[6] if n.has_input(6) else None
    keys = b.Range(0, b.Squeeze(b.dim(kp, 2)), 1)
    conds = []
    if nonpad is not None:
        conds.append(b.Less(b.Reshape(keys, [1, 1, 1, -1]), b.Reshape(nonpad, [-1, 1, 1, 1])))
    if causal or left >= 0 or right >= 0:
        queries = b.Range(0, b.Squeeze(b.dim(q4, 2)), 1)
        # diff = query position - key position, the query offset by the keys before its block
        diff = b.Sub(b.Unsqueeze(queries, [1]), keys)
        if n.has_input(4):
            diff = diff + b.dim(n.inputs[4], 2)
        elif nonpad is not None:
            diff = diff + b.Reshape(nonpad - b.dim(q4, 2), [-1, 1, 1, 1])
        if causal:
            conds.append(b.GreaterOrEqual(diff, 0))
        if left >= 0:
            conds.append(b.LessOrEqual(diff, left))
        if right >= 0:
            conds.append(b.GreaterOrEqual(diff, -right))
    if not conds:
        return None
    allowed = conds[0]
    for cond in conds[1:]:
        allowed = b.And(allowed, cond)
    return allowed


def _mask_is_short(n, total):
    """Whether the mask's last axis may be shorter than the keys (then padded with -inf)."""
    mask_len = _static(n.inputs[3].shape, -1)
    return mask_len is None or total is None or mask_len != total


def _attention_bias(b, n, like, q4, kp, total):
    """The additive bias of the scores (-inf where a key is not attended), or None."""
    zero, neg_inf = b.const(0.0, like.dtype), b.const(-np.inf, like.dtype)
    parts = []
    if n.has_input(3):
        mask = n.inputs[3]
        if mask.dtype == ir.DataType.BOOL:
            mask = b.Where(mask, zero, neg_inf)
        if _mask_is_short(n, total):
            pad = b.Concat([0], b.Sub(b.dim(kp, 2), b.dim(mask, -1)), axis=0)
            mask = b.Pad(mask, pad, neg_inf, [-1])
        parts.append(mask)
    allowed = _allowed_keys(b, n, q4, kp)
    if allowed is not None:
        parts.append(b.Where(allowed, zero, neg_inf))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else b.Sum(*parts)


def _probabilities(b, n, logits, bias):
    """Softmax over the keys (in ``softmax_precision``), zero rows where no key is attended."""
    precision = n.attr("softmax_precision")
    wide = logits if precision is None else b.Cast(logits, to=int(precision))
    probs = b.cast_to(b.Softmax(wide, axis=-1), logits.dtype)
    if bias is None:
        return probs
    fully_masked = b.IsInf(b.reduce("ReduceMax", bias, [-1], keepdims=1), detect_positive=0)
    return b.Where(fully_masked, b.const(0.0, logits.dtype), probs)


# ---- Attention: the rule ------------------------------------------------------------------------


def _check_attention(n):
    q, k, v = n.inputs[:3]
    if q.rank not in (3, 4) or k.rank != q.rank or v.rank != q.rank:
        raise ValueError(f"Attention gradient needs Q, K and V of known rank 3 or 4 (got "
                         f"{q.rank}, {k.rank}, {v.rank}; run shape inference)")
    if q.rank == 3 and (n.attr("q_num_heads") is None or n.attr("kv_num_heads") is None):
        raise ValueError("Attention gradient of 3-D Q, K, V needs the q_num_heads and "
                         "kv_num_heads attributes")
    if len({x.dtype for x in (q, k, v)}) != 1:
        raise ValueError("Attention gradient needs Q, K and V of one element type (got "
                         f"{q.dtype}, {k.dtype}, {v.dtype})")
    if n.has_input(4) != n.has_input(5):
        raise ValueError("Attention gradient needs past_key and past_value together")
    mode = n.attr("qk_matmul_output_mode", QK_RAW)
    if n.has_output(3) and mode not in (QK_RAW, QK_SOFTCAPPED, QK_BIASED, QK_PROBS):
        raise ValueError(f"Attention gradient does not support qk_matmul_output_mode={mode}")


def _sqrt_scale(b, n, q4, head_size):
    """sqrt(scale), which the forward op multiplies Q and K by (scale: 1/sqrt(head size))."""
    scale = n.attr("scale")
    if scale is not None:
        return b.const(float(scale) ** 0.5, q4.dtype)
    if head_size is not None:
        return b.const(float(head_size) ** -0.25, q4.dtype)
    return b.Pow(b.CastLike(b.dim(q4, 3), q4), b.const(-0.25, q4.dtype))


def _split_cache(b, grad, past, n, index):
    """The cache part and the new part of the gradient of Concat(past, new) on axis 2."""
    if not n.has_input(index):
        return None, grad
    past_len = b.dim(past, 2)
    return b.Slice(grad, [0], past_len, [2]), b.Slice(grad, past_len, [INT64_MAX], [2])


@grad_rule("Attention", since=23, diff_inputs=(0, 1, 2, 3, 4, 5))
def _attention(b, n, g):
    _check_attention(n)
    q, k, v = n.inputs[:3]
    past_k = n.inputs[4] if n.has_input(4) else None
    past_v = n.inputs[5] if n.has_input(5) else None
    three_d = q.rank == 3
    if three_d:
        hq, hkv = n.attr("q_num_heads"), n.attr("kv_num_heads")
        q4, k4, v4 = _split_heads(b, q, hq), _split_heads(b, k, hkv), _split_heads(b, v, hkv)
        hidden = _static(q.shape, 2)
        head_size = hidden // hq if hidden is not None else None
        seq_k = _static(k.shape, 1)
    else:
        hq, hkv = _static(q.shape, 1), _static(k.shape, 1)
        q4, k4, v4 = q, k, v
        head_size, seq_k = _static(q.shape, 3), _static(k.shape, 2)
    past_len = _static(past_k.shape, 2) if past_k is not None else 0
    total = past_len + seq_k if past_len is not None and seq_k is not None else None
    kp = b.Concat(past_k, k4, axis=2) if past_k is not None else k4
    vp = b.Concat(past_v, v4, axis=2) if past_v is not None else v4
    heads = _Heads(b, q4, kp, hq, hkv)

    # forward recomputation, scores in (B, Hq, Sq, T)
    c = _sqrt_scale(b, n, q4, head_size)
    qs, ks = heads.group(q4 * c), kp * c
    raw = heads.ungroup(b.MatMul(qs, _swap_last(b, ks)))
    softcap = float(n.attr("softcap", 0.0) or 0.0)
    tanh = b.Tanh(raw / softcap) if softcap > 0 else None
    capped = tanh * softcap if tanh is not None else raw
    bias = _attention_bias(b, n, q, q4, kp, total)
    probs = _probabilities(b, n, capped + bias if bias is not None else capped, bias)

    # backward; the qk_matmul_output gradient joins where its value was taken
    gy = _grad_of(b, g, 0, q)
    g_qk = _grad_of(b, g, 3, q)
    mode = n.attr("qk_matmul_output_mode", QK_RAW)

    def qk_grad(at):
        return g_qk if g_qk is not None and mode == at else None

    gy4 = (_split_heads(b, gy, hq) if three_d else gy) if gy is not None else None
    gy_g = heads.group(gy4) if gy4 is not None else None
    d_vp = _sum_parts(b, [
        b.MatMul(_swap_last(b, heads.group(probs)), gy_g) if gy_g is not None else None,
        _grad_of(b, g, 2, v),
    ]) if n.needs_grad(2) or n.needs_grad(5) else None
    d_logits = None
    if any(n.needs_grad(i) for i in (0, 1, 3, 4)):
        d_probs = _sum_parts(b, [
            heads.ungroup(b.MatMul(gy_g, _swap_last(b, vp))) if gy_g is not None else None,
            qk_grad(QK_PROBS),
        ])
        d_logits = _sum_parts(b, [
            probs * (d_probs - b.ReduceSum(d_probs * probs, [-1], keepdims=1))
            if d_probs is not None else None,
            qk_grad(QK_BIASED),
        ])
    d_mask = None
    if d_logits is not None and n.needs_grad(3):
        mask = n.inputs[3]
        d_mask = d_logits
        if _mask_is_short(n, total):
            d_mask = b.Slice(d_mask, [0], b.dim(mask, -1), [-1])
        scores = [_static(q.shape, 0), hq, _static(q.shape, -2 if three_d else 2)]
        d_mask = b.unbroadcast(d_mask, scores + [_static(mask.shape, -1)], mask)
    d_raw = None
    if any(n.needs_grad(i) for i in (0, 1, 4)):
        d_capped = _sum_parts(b, [d_logits, qk_grad(QK_SOFTCAPPED)])
        if d_capped is not None and tanh is not None:
            d_capped = d_capped * (1.0 - tanh * tanh)
        d_raw = _sum_parts(b, [d_capped, qk_grad(QK_RAW)])
    dq4 = d_kp = None
    if d_raw is not None:
        d_raw_g = heads.group(d_raw)
        dq4 = heads.ungroup(b.MatMul(d_raw_g, ks)) * c if n.needs_grad(0) else None
        d_kp = b.MatMul(_swap_last(b, d_raw_g), qs) * c if n.needs_grad(1) or n.needs_grad(4) else None
    d_kp = _sum_parts(b, [d_kp, _grad_of(b, g, 1, q)])

    d_past_k, dk4 = _split_cache(b, d_kp, past_k, n, 4) if d_kp is not None else (None, None)
    d_past_v, dv4 = _split_cache(b, d_vp, past_v, n, 5) if d_vp is not None else (None, None)
    un_heads = (lambda x: _merge_heads(b, x) if x is not None else None) if three_d else (lambda x: x)
    return [un_heads(dq4), un_heads(dk4), un_heads(dv4), d_mask, d_past_k, d_past_v, None]


# ---- normalizations and activations --------------------------------------------------------------

# Widening order of the float types, for RMSNormalization's stash_type.
_WIDTH = {ir.DataType.FLOAT16: 0, ir.DataType.BFLOAT16: 0, ir.DataType.FLOAT: 1,
          ir.DataType.DOUBLE: 2}


def _stashed(b, x, stash_type):
    """``x`` in the stash type when that is wider (never narrows a float64 computation)."""
    stash = ir.DataType(stash_type)
    if x.dtype in _WIDTH and stash in _WIDTH and _WIDTH[stash] > _WIDTH[x.dtype]:
        return b.Cast(x, to=int(stash))
    return x


def _trailing_axes(x, axis):
    """Axes ``axis..rank-1``; negative ``axis`` needs no rank (negative axes)."""
    if axis < 0:
        return list(range(axis, 0))
    if x.rank is None:
        raise ValueError(f"gradient with axis={axis} needs the input rank (run shape inference)")
    return list(range(axis, x.rank))


@grad_rule("RMSNormalization", since=23)
def _rms_norm(b, n, g):
    """y = x * inv_rms * scale, inv_rms = 1 / sqrt(mean(x^2) + eps) over axis.. (keepdims)."""
    x, scale = n.inputs[0], n.inputs[1]
    axes = _trailing_axes(x, n.attr("axis", -1))
    xs = _stashed(b, x, n.attr("stash_type", int(ir.DataType.FLOAT)))
    inv_rms = b.Reciprocal(b.Sqrt(b.reduce("ReduceMean", xs * xs, axes) + n.attr("epsilon", 1e-5)))
    xhat = xs * inv_rms
    go = g[0]
    dx = dscale = None
    if n.needs_grad(0):
        dxhat = b.cast_to(go, xs.dtype) * b.cast_to(scale, xs.dtype)
        dx = inv_rms * (dxhat - xhat * b.reduce("ReduceMean", dxhat * xhat, axes))
    if n.needs_grad(1):
        dscale = b.unbroadcast(go * b.cast_to(xhat, go.dtype), n.outputs[0].shape, scale)
    return [dx, dscale]


@grad_rule("SimplifiedLayerNormalization")
def _simplified_layer_norm(b, n, g):
    """onnxruntime's RMS norm before opset 23 (default domain, written by its optimizers and by
    LLaMA-style exports): RMSNormalization's formula and attributes; its optional second
    output, the inverse RMS, is a statistic no loss reads through."""
    if len(g) > 1 and g[1] is not None:
        raise ValueError("a loss reads SimplifiedLayerNormalization's inverse RMS output; its gradient "
                         "through that output is not supported")
    return _rms_norm(b, n, g[:1])


# onnxruntime's default epsilon of SkipLayerNormalization / SkipSimplifiedLayerNormalization
# (kDefaultSkipLayerNormEpsilon in its contrib op definitions)
_SKIP_NORM_EPSILON = 1e-12


def _skip_norm(b, n, g, simplified: bool):
    """onnxruntime's SkipLayerNormalization (inputs x, skip, gamma, beta?, bias?) and
    SkipSimplifiedLayerNormalization (x, skip, gamma, bias?): ``s = x + skip (+ bias)``
    normalized over the last axis (LayerNormalization's or RMSNormalization's formula), its
    outputs Y, the statistics (mean, inverse std / RMS: no loss reads through them) and ``s``
    itself (input_skip_bias_sum). Registered with broadcast: the engine sums each full-shape
    gradient down to its input (a skip of (S, H) or (1, S, H), the per-hidden gamma, beta, bias)."""
    x, skip, gamma = n.inputs[0], n.inputs[1], n.inputs[2]
    if any(len(g) > k and g[k] is not None for k in (1, 2)):
        raise ValueError(f"a loss reads {n.op_type}'s mean or inverse standard deviation output; its "
                         "gradient through those statistics is not supported")
    bias_index = 3 if simplified else 4
    s = x + skip
    if n.has_input(bias_index):
        s = s + n.inputs[bias_index]
    eps = n.attr("epsilon", _SKIP_NORM_EPSILON)
    go, g_sum = g[0], _grad_of(b, g, 3, x)
    if simplified:
        inv = b.Reciprocal(b.Sqrt(b.reduce("ReduceMean", s * s, [-1]) + eps))
        xhat = s * inv
    else:
        xhat, inv = _normalized(b, s, [-1], eps)
    ds = None
    if go is not None and any(n.needs_grad(k) for k in (0, 1, bias_index)):
        dxhat = go * gamma
        ds = (inv * (dxhat - xhat * b.reduce("ReduceMean", dxhat * xhat, [-1])) if simplified
              else _norm_input_grad(b, dxhat, xhat, inv, [-1]))
    ds = _sum_parts(b, [ds, g_sum])
    dgamma = go * xhat if go is not None and n.needs_grad(2) else None
    grads = [ds, ds, dgamma]
    if not simplified:
        grads.append(go if go is not None and n.needs_grad(3) else None)
    grads.append(ds)
    return grads


@grad_rule("SkipLayerNormalization", domain="com.microsoft", broadcast=True)
def _ms_skip_layer_norm(b, n, g):
    return _skip_norm(b, n, g, simplified=False)


@grad_rule("SkipSimplifiedLayerNormalization", domain="com.microsoft", broadcast=True)
def _ms_skip_simplified_layer_norm(b, n, g):
    return _skip_norm(b, n, g, simplified=True)


@grad_rule("MeanVarianceNormalization", since=13)
def _mean_variance_norm(b, n, g):
    """y = (x - mean) / (std + 1e-9) over ``axes`` (the epsilon of the op's function body)."""
    x, go = n.inputs[0], g[0]
    axes = n.attr("axes", [0, 2, 3])
    centered = x - b.reduce("ReduceMean", x, axes)
    std = b.Sqrt(b.reduce("ReduceMean", centered * centered, axes))
    denom = std + 1e-9
    xhat = centered / denom
    mean_g = b.reduce("ReduceMean", go, axes)
    mean_gx = b.reduce("ReduceMean", go * xhat, axes)
    return [(go - mean_g) / denom - xhat * mean_gx / std]


@grad_rule("Swish", since=24)
def _swish(b, n, g):
    """y = x * sigmoid(alpha x)."""
    return [g[0] * swish_derivative(b, n.inputs[0], float(n.attr("alpha", 1.0)))]


# ---- RotaryEmbedding ------------------------------------------------------------------------------


def _rotated_halves(b, n, t, rank):
    """The (x1, x2) pairs the op rotates, each (B, S, H, R/2), from X-shaped ``t``."""
    if rank == 4:
        t = b.Transpose(t, perm=[0, 2, 1, 3])
    else:
        t = b.Reshape(t, [0, 0, n.attr("num_heads"), -1])
    dim = n.attr("rotary_embedding_dim", 0)
    if dim:
        t = b.Slice(t, [0], [dim], [-1])
    if n.attr("interleaved", 0):
        return (b.Slice(t, [0], [INT64_MAX], [-1], [2]), b.Slice(t, [1], [INT64_MAX], [-1], [2]))
    return b.Split(t, axis=-1, num_outputs=2, _outputs=2)


@grad_rule("RotaryEmbedding", since=23, diff_inputs=(0, 1, 2))
def _rotary_embedding(b, n, g):
    """real = cos x1 - sin x2, imag = sin x1 + cos x2 (pairs per the layout attributes).

    dX is the inverse rotation, RotaryEmbedding with -sin; the caches get
    dcos = sum over heads of (d_real x1 + d_imag x2), dsin = sum of (d_imag x1 - d_real x2),
    scatter-added at ``position_ids`` when they index the caches.
    """
    x, cos, sin = n.inputs[:3]
    pos = n.inputs[3] if n.has_input(3) else None
    go = g[0]
    attrs = {k: n.attr(k) for k in ("interleaved", "rotary_embedding_dim", "num_heads")}
    dx = b.RotaryEmbedding(go, cos, b.Neg(sin), pos, **attrs) if n.needs_grad(0) else None
    dcos = dsin = None
    if n.needs_grad(1) or n.needs_grad(2):
        if x.rank not in (3, 4):
            raise ValueError("RotaryEmbedding gradient of the caches needs X of known rank 3 or 4")
        x1, x2 = _rotated_halves(b, n, x, x.rank)
        g1, g2 = _rotated_halves(b, n, go, x.rank)

        def to_cache(d, cache):
            d = b.ReduceSum(d, [2], keepdims=0)  # (B, S, R/2)
            if pos is None:
                return d
            index = b.Unsqueeze(b.cast_to(pos, ir.DataType.INT64), [-1])
            return b.ScatterND(b.zeros_like(cache), index, d, reduction="add")

        dcos = to_cache(g1 * x1 + g2 * x2, cos) if n.needs_grad(1) else None
        dsin = to_cache(g2 * x1 - g1 * x2, sin) if n.needs_grad(2) else None
    return [dx, dcos, dsin, None]
