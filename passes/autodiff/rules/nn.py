"""Gradients of neural-network ops: softmax family, normalizations, dropout, losses."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.autodiff.registry import grad_rule

# Ops that hand the softmax output on unchanged (but for its dtype), when looking for a NaN guard.
_PASS_ON = frozenset({"Cast", "Identity"})
# How far through such ops the guard is looked for.
_GUARD_DEPTH = 4


def _nan_guarded(b, value, depth: int = _GUARD_DEPTH) -> bool:
    """Whether the forward graph replaces NaNs of ``value``: it feeds (through Cast/Identity/
    CastLike) a branch of a Where or an IsNaN, as expanded Attention does for the NaN rows that a
    softmax over a fully masked row gives (``Where(all_masked, 0, softmax)``)."""
    for node, index in value.uses():
        if node.domain not in ("", "ai.onnx") or any(b.owns(o) for o in node.outputs):
            continue  # another rule's gradient node, not the forward graph
        if node.op_type == "IsNaN" or node.op_type == "Where" and index in (1, 2):
            return True
        passes_on = node.op_type in _PASS_ON or node.op_type == "CastLike" and index == 0
        if passes_on and depth > 0 and _nan_guarded(b, node.outputs[0], depth - 1):
            return True
    return False


def _zero_nans(b, y):
    return b.Where(b.IsNaN(y), 0.0, y, _like=y)


@grad_rule("Softmax", since=13)
def _softmax(b, n, g):
    """dX = y * (dY - sum(dY * y)). Where the forward graph replaces the NaNs of y (a row of
    -inf only; see :func:`_nan_guarded`), dY is 0 there and NaN y counts as 0: dX = 0, not NaN.
    Unguarded softmax outputs (the common case) get no extra node."""
    y = n.outputs[0]
    axis = n.attr("axis", -1)
    if _nan_guarded(b, n.node.outputs[0]):
        y = _zero_nans(b, y)
    return [y * (g[0] - b.ReduceSum(g[0] * y, [axis], keepdims=1))]


@grad_rule("LogSoftmax", since=13)
def _log_softmax(b, n, g):
    """dX = dY - exp(y) * sum(dY); NaN rows count as 0 where the graph replaces them (as Softmax)."""
    y = n.outputs[0]
    axis = n.attr("axis", -1)
    probs = b.Exp(y)
    if _nan_guarded(b, n.node.outputs[0]):
        probs = _zero_nans(b, probs)
    return [g[0] - probs * b.ReduceSum(g[0], [axis], keepdims=1)]


def _normalized(b, x, axes, epsilon):
    """(x - mean) * inv_std over ``axes`` (keepdims) and inv_std."""
    mean = b.reduce("ReduceMean", x, axes, keepdims=1)
    centered = x - mean
    var = b.reduce("ReduceMean", centered * centered, axes, keepdims=1)
    inv_std = b.Reciprocal(b.Sqrt(var + epsilon))
    return centered * inv_std, inv_std


def _norm_input_grad(b, dxhat, xhat, inv_std, axes):
    """dX of xhat = (x - mean(x)) * inv_std, given d xhat, over ``axes``."""
    mean_d = b.reduce("ReduceMean", dxhat, axes, keepdims=1)
    mean_dx = b.reduce("ReduceMean", dxhat * xhat, axes, keepdims=1)
    return inv_std * (dxhat - mean_d - xhat * mean_dx)


def _grad_of(b, g, k, like):
    """The gradient of output ``k`` in ``like``'s dtype, or None."""
    if len(g) <= k or g[k] is None:
        return None
    return b.cast_to(g[k], like.dtype)


def _sum_parts(b, parts):
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else b.Sum(*parts)


def _count(b, x, reduced):
    """Elements per reduced group, as a scalar of ``x``'s dtype."""
    return b.CastLike(b.Div(b.Size(x), b.Size(reduced)), x)


# since opset 1: below ONNX's opset 17 the default-domain LayerNormalization is onnxruntime's
# own (the same op; its optimizers write it into models of older opsets)
@grad_rule("LayerNormalization", since=1)
def _layer_norm(b, n, g):
    """Y, and the Mean and InvStdDev outputs (keepdims-shaped) when they carry gradient."""
    x, scale = n.inputs[0], n.inputs[1]
    rank = x.rank
    axis = n.attr("axis", -1)
    axis = axis + rank if axis < 0 else axis
    axes = list(range(axis, rank))
    if n.has_output(1) and n.has_output(2):  # the forward's statistics (ExposeNormStatsPass)
        inv_std = b.cast_to(n.outputs[2], x.dtype)
        xhat = (x - b.cast_to(n.outputs[1], x.dtype)) * inv_std
    else:
        xhat, inv_std = _normalized(b, x, axes, n.attr("epsilon", 1e-5))
    go, g_mean, g_inv_std = g[0], _grad_of(b, g, 1, x), _grad_of(b, g, 2, x)
    dx = None
    if n.needs_grad(0):
        # elements per normalized group from the shape, not Size(x) / Size(inv_std): that
        # divides by zero on an empty batch (a loss whose labels are all ignored gathers none)
        count = (b.CastLike(b.reduce("ReduceProd", b.Shape(x, start=axis), [0], keepdims=0), x)
                 if g_mean is not None or g_inv_std is not None else None)
        dx = _sum_parts(b, [
            _norm_input_grad(b, go * scale, xhat, inv_std, axes) if go is not None else None,
            b.Expand(g_mean / count, b.Shape(x)) if g_mean is not None else None,
            # d inv_std / dx = -inv_std^2 * xhat / count
            -(g_inv_std * inv_std * inv_std) * xhat / count if g_inv_std is not None else None,
        ])
    dscale = dbias = None
    if go is not None and n.needs_grad(1):
        dscale = b.unbroadcast(go * xhat, n.outputs[0].shape, scale)
    if go is not None and n.needs_grad(2):
        dbias = b.unbroadcast(go, n.outputs[0].shape, n.inputs[2])
    return [dx, dscale, dbias]


def _channel_view(b, v, rank):
    """A per-channel (C,) tensor reshaped to broadcast against (N, C, ...)."""
    return b.Reshape(v, [-1] + [1] * (rank - 2))


def _sum_to_channel(b, v, rank):
    return b.reduce("ReduceSum", v, [0] + list(range(2, rank)), keepdims=0)


@grad_rule("BatchNormalization", since=9)
def _batch_norm(b, n, g):
    """Inference mode: Y of (x, scale, B, mean, var). Training mode: Y of batch statistics,
    running_mean = mean * m + batch_mean * (1 - m), running_var likewise (population var)."""
    x = n.inputs[0]
    if any(_grad_of(b, g, k, x) is not None for k in (3, 4)):
        raise ValueError("BatchNormalization gradient does not support the saved_mean/saved_var outputs")
    if n.attr("training_mode", 0) or len(n.outputs) > 1 and n.opset < 14:
        return _batch_norm_training(b, n, g)
    return _batch_norm_inference(b, n, g)


def _batch_norm_inference(b, n, g):
    x, scale, bias, mean, var = n.inputs[:5]
    rank, go = x.rank, g[0]
    if go is None:
        return [None] * 5
    inv_std_c = b.Reciprocal(b.Sqrt(var + n.attr("epsilon", 1e-5)))
    inv_std = _channel_view(b, inv_std_c, rank)
    xhat = (x - _channel_view(b, mean, rank)) * inv_std
    gs = go * _channel_view(b, scale, rank)
    sum_g_xhat = _sum_to_channel(b, go * xhat, rank) if n.needs_grad(1) or n.needs_grad(4) else None
    return [
        gs * inv_std if n.needs_grad(0) else None,
        sum_g_xhat if n.needs_grad(1) else None,
        _sum_to_channel(b, go, rank) if n.needs_grad(2) else None,
        -(_sum_to_channel(b, gs, rank) * inv_std_c) if n.needs_grad(3) else None,
        # dY/dvar = -0.5 * scale * xhat * inv_std^2
        (-0.5) * scale * inv_std_c * inv_std_c * sum_g_xhat if n.needs_grad(4) else None,
    ]


def _batch_norm_training(b, n, g):
    """The batch statistics are recomputed from x (onnxruntime's kernel outputs none at opset 14+),
    each one pass: mean, centered = x - mean, var = sum(centered^2) / M (M elements per channel).
    Then, with inv_std = 1 / sqrt(var + epsilon) and xhat = centered * inv_std:

        dbias = sum(dY)        dscale = sum(dY * centered) * inv_std
        dX = scale * inv_std * (dY - dbias / M - xhat * dscale / M)
           = BatchNormalization(dY; scale, bias = -scale * inv_std * dbias / M, mean 0, var)
             - centered * (scale * inv_std^2 * dscale / M)

    10 passes over the activation (the textbook form: 18); the inference-mode op applies the
    per-channel scale and shift to dY in one pass (onnxruntime's broadcast Mul / Add by a
    [1, C, 1, 1] tensor take about twice as long). Step A/B (tools/ab_rule.py, 12 pairs, loaded
    machine): resnet18 0.970, mobilenetv2 0.927."""
    x, scale = n.inputs[0], n.inputs[1]
    rank, go = x.rank, g[0]
    momentum, epsilon = n.attr("momentum", 0.9), n.attr("epsilon", 1e-5)
    g_mean, g_var = _grad_of(b, g, 1, x), _grad_of(b, g, 2, x)
    use = go is not None
    need_dx = n.needs_grad(0) and (use or g_mean is not None or g_var is not None)
    need_dscale, need_dbias = use and n.needs_grad(1), use and n.needs_grad(2)
    count = _count(b, x, scale) if need_dx or need_dscale else None
    centered = (x - b.reduce("ReduceMean", x, [0, *range(2, rank)], keepdims=1)
                if need_dx or need_dscale else None)
    sum_g = _sum_to_channel(b, go, rank) if use and (need_dx or need_dbias) else None
    dx = dscale = None
    if use and (n.needs_grad(0) or need_dscale):
        var = _sum_to_channel(b, centered * centered, rank) / count
        inv_std = b.Reciprocal(b.Sqrt(var + epsilon))
        dscale = _sum_to_channel(b, go * centered, rank) * inv_std
        if n.needs_grad(0):
            a = b.cast_to(scale, x.dtype) * inv_std
            shift = -(a * sum_g) / count
            zero = b.Expand(b.const(0.0, x.dtype), b.Shape(var))
            from_go = b.BatchNormalization(go, b.cast_to(scale, x.dtype), shift, zero, var, epsilon=epsilon)
            dx = from_go - centered * _channel_view(b, a * inv_std * dscale / count, rank)
    if n.needs_grad(0):
        dx = _sum_parts(b, [
            dx,
            b.Expand(_channel_view(b, g_mean, rank) * ((1.0 - momentum) / count), b.Shape(x))
            if g_mean is not None else None,
            _channel_view(b, g_var, rank) * centered * (2.0 * (1.0 - momentum) / count)
            if g_var is not None else None,
        ])
    return [
        dx,
        dscale if need_dscale else None,
        sum_g if need_dbias else None,
        g_mean * momentum if g_mean is not None and n.needs_grad(3) else None,
        g_var * momentum if g_var is not None and n.needs_grad(4) else None,
    ]


@grad_rule("InstanceNormalization")
def _instance_norm(b, n, g):
    x, scale, bias = n.inputs
    rank = x.rank
    axes = list(range(2, rank))
    xhat, inv_std = _normalized(b, x, axes, n.attr("epsilon", 1e-5))
    go = g[0]
    dx = _norm_input_grad(b, go * _channel_view(b, scale, rank), xhat, inv_std, axes) \
        if n.needs_grad(0) else None
    dscale = _sum_to_channel(b, go * xhat, rank) if n.needs_grad(1) else None
    dbias = _sum_to_channel(b, go, rank) if n.needs_grad(2) else None
    return [dx, dscale, dbias]


@grad_rule("GroupNormalization", since=18)
def _group_norm(b, n, g):
    """Normalize (N, G, C/G * spatial); scale/bias are per group (opset 18) or channel (21)."""
    x, scale, bias = n.inputs
    rank = x.rank
    groups = n.attr("num_groups")
    grouped = b.Reshape(x, [0, groups, -1])
    xhat_g, inv_std = _normalized(b, grouped, [2], n.attr("epsilon", 1e-5))
    xhat = b.Reshape(xhat_g, b.Shape(x))
    go = g[0]
    per_channel = n.opset >= 21
    if per_channel:
        s = _channel_view(b, scale, rank)
    else:
        channels = b.dim(x, 1)
        s = b.Reshape(b.Expand(b.Unsqueeze(scale, [1]), b.Concat([groups], channels / groups, axis=0)),
                      [-1] + [1] * (rank - 2))
    dx = None
    if n.needs_grad(0):
        dxhat = b.Reshape(go * s, [0, groups, -1])
        dx = b.Reshape(_norm_input_grad(b, dxhat, xhat_g, inv_std, [2]), b.Shape(x))
    dscale = dbias = None
    if n.needs_grad(1):
        dscale = _sum_to_channel(b, go * xhat, rank)
        if not per_channel:
            dscale = b.ReduceSum(b.Reshape(dscale, [groups, -1]), [1], keepdims=0)
    if n.needs_grad(2):
        dbias = _sum_to_channel(b, go, rank)
        if not per_channel:
            dbias = b.ReduceSum(b.Reshape(dbias, [groups, -1]), [1], keepdims=0)
    return [dx, dscale, dbias]


@grad_rule("Dropout", since=12, diff_inputs=(0,))
def _dropout(b, n, g):
    """Reuse the forward mask (the pre-pass exposes it): dX = G * mask / (1 - ratio)."""
    training = n.const_input(2)
    if not n.has_input(2) or training is not None and not bool(training):
        return [g[0]]
    if not n.has_output(1):
        raise ValueError("training-mode Dropout needs its mask output (run ExposeDropoutMask first)")
    ratio = n.inputs[1] if n.has_input(1) else b.const(0.5, g[0].dtype)
    scale = b.Reciprocal(1.0 - b.CastLike(ratio, g[0]))
    dropped = g[0] * b.CastLike(n.outputs[1], g[0]) * scale
    if training is None:
        return [b.Where(n.inputs[2], dropped, g[0])]
    return [dropped]


def _class_weights(b, n, labels, weight_index, ignore_index, like):
    """Per-sample weight (class weight, zero where ignored) and labels safe to one-hot."""
    if ignore_index is not None:
        keep = b.Not(b.Equal(labels, b.const(np.array(ignore_index, np.int64))))
        safe = b.Where(keep, labels, b.const(np.array(0, np.int64)))
    else:
        keep, safe = None, labels
    if n.has_input(weight_index):
        w = b.Gather(n.inputs[weight_index], safe, axis=0)
    else:
        w = b.CastLike(b.ones_like(b.cast_to(safe, like.dtype)), like)
    if keep is not None:
        w = w * b.CastLike(keep, like)
    return w, safe


def _per_sample_grad(b, n, go, w):
    """Turn the loss gradient into a per-sample factor for each reduction mode."""
    reduction = n.attr("reduction", "mean")
    if reduction == "none":
        return go * w
    if reduction == "sum":
        return go * w
    # every label ignored: the loss is 0 / 0 (NaN) but, as torch's, the gradient is zero
    total = b.ReduceSum(w, keepdims=0)
    return go * w / b.Where(b.Equal(total, 0.0), 1.0, total, _like=total)


def _subtract_at_labels(b, dense, labels, amount):
    """``dense`` with ``amount`` subtracted at each sample's label position along axis 1.

    Equivalent to ``dense - one_hot(labels) * amount`` without materializing the one-hot
    (N x C, large for vocabulary-sized C): gather the label entries, scatter them back changed.
    """
    idx = b.Unsqueeze(labels, [1])
    at_label = b.GatherElements(dense, idx, axis=1)
    return b.ScatterElements(dense, idx, at_label - b.Unsqueeze(amount, [1]), axis=1)


@grad_rule("SoftmaxCrossEntropyLoss", since=12, diff_inputs=(0,))
def _softmax_ce(b, n, g):
    scores, labels = n.inputs[0], b.Cast(n.inputs[1], to=ir.DataType.INT64)
    w, safe = _class_weights(b, n, labels, 2, n.attr("ignore_index"), scores)
    probs = b.Softmax(scores, axis=1)
    dscore = None
    if g[0] is not None:
        # (softmax - one_hot(label)) * factor, per sample
        factor = _per_sample_grad(b, n, g[0], w)
        dscore = _subtract_at_labels(b, probs * b.Unsqueeze(factor, [1]), safe, factor)
    if len(g) > 1 and g[1] is not None:
        # log_prob = LogSoftmax(scores, axis=1)
        dlog = g[1] - probs * b.ReduceSum(g[1], [1], keepdims=1)
        dscore = dlog if dscore is None else dscore + dlog
    return [dscore, None, None]


@grad_rule("NegativeLogLikelihoodLoss", since=12, diff_inputs=(0,))
def _nll(b, n, g):
    x, labels = n.inputs[0], b.Cast(n.inputs[1], to=ir.DataType.INT64)
    w, safe = _class_weights(b, n, labels, 2, n.attr("ignore_index"), x)
    factor = _per_sample_grad(b, n, g[0], w)
    return [_subtract_at_labels(b, b.zeros_like(x), safe, factor), None, None]
