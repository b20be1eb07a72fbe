"""Gradients of neural-network ops: softmax family, normalizations, dropout, losses."""

from __future__ import annotations

import numpy as np

from passes.autodiff.registry import grad_rule


@grad_rule("Softmax", since=13)
def _softmax(b, n, g):
    y = n.outputs[0]
    axis = n.attr("axis", -1)
    return [y * (g[0] - b.ReduceSum(g[0] * y, [axis], keepdims=1))]


@grad_rule("LogSoftmax", since=13)
def _log_softmax(b, n, g):
    y = n.outputs[0]
    axis = n.attr("axis", -1)
    return [g[0] - b.Exp(y) * b.ReduceSum(g[0], [axis], keepdims=1)]


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


@grad_rule("LayerNormalization", since=17)
def _layer_norm(b, n, g):
    x, scale = n.inputs[0], n.inputs[1]
    rank = x.rank
    axis = n.attr("axis", -1)
    axis = axis + rank if axis < 0 else axis
    axes = list(range(axis, rank))
    xhat, inv_std = _normalized(b, x, axes, n.attr("epsilon", 1e-5))
    go = g[0]
    if go is None:
        return [None] * len(n.inputs)
    dx = _norm_input_grad(b, go * scale, xhat, inv_std, axes) if n.needs_grad(0) else None
    dscale = b.unbroadcast(go * xhat, n.outputs[0].shape, scale) if n.needs_grad(1) else None
    dbias = b.unbroadcast(go, n.outputs[0].shape, n.inputs[2]) if n.needs_grad(2) else None
    return [dx, dscale, dbias]


def _channel_view(b, v, rank):
    """A per-channel (C,) tensor reshaped to broadcast against (N, C, ...)."""
    return b.Reshape(v, [-1] + [1] * (rank - 2))


def _sum_to_channel(b, v, rank):
    return b.reduce("ReduceSum", v, [0] + list(range(2, rank)), keepdims=0)


@grad_rule("BatchNormalization", since=9, diff_inputs=(0, 1, 2))
def _batch_norm(b, n, g):
    x, scale, bias, mean, var = n.inputs[:5]
    rank = x.rank
    eps = n.attr("epsilon", 1e-5)
    go = g[0]
    if go is None:
        return [None] * 5
    axes = [0] + list(range(2, rank))
    s = _channel_view(b, scale, rank)
    if n.attr("training_mode", 0) or len(n.outputs) > 1 and n.opset < 14:
        xhat, inv_std = _normalized(b, x, axes, eps)
        dx = _norm_input_grad(b, go * s, xhat, inv_std, axes) if n.needs_grad(0) else None
    else:
        inv_std = b.Reciprocal(b.Sqrt(_channel_view(b, var, rank) + eps))
        xhat = (x - _channel_view(b, mean, rank)) * inv_std
        dx = go * s * inv_std if n.needs_grad(0) else None
    dscale = _sum_to_channel(b, go * xhat, rank) if n.needs_grad(1) else None
    dbias = _sum_to_channel(b, go, rank) if n.needs_grad(2) else None
    return [dx, dscale, dbias, None, None]


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
    return go * w / b.ReduceSum(w, keepdims=0)


def _one_hot(b, labels, classes, like):
    return b.OneHot(labels, b.Reshape(classes, [1]), b.const(np.array([0.0, 1.0]), like.dtype), axis=1)


@grad_rule("SoftmaxCrossEntropyLoss", since=12, diff_inputs=(0,))
def _softmax_ce(b, n, g):
    scores, labels = n.inputs[0], b.Cast(n.inputs[1], to=7)
    w, safe = _class_weights(b, n, labels, 2, n.attr("ignore_index"), scores)
    probs = b.Softmax(scores, axis=1)
    onehot = _one_hot(b, safe, b.dim(scores, 1), scores)
    dscore = None
    if g[0] is not None:
        factor = _per_sample_grad(b, n, g[0], w)
        dscore = (probs - onehot) * b.Unsqueeze(factor, [1])
    if len(g) > 1 and g[1] is not None:
        # log_prob = LogSoftmax(scores, axis=1)
        dlog = g[1] - probs * b.ReduceSum(g[1], [1], keepdims=1)
        dscore = dlog if dscore is None else dscore + dlog
    return [dscore, None, None]


@grad_rule("NegativeLogLikelihoodLoss", since=12, diff_inputs=(0,))
def _nll(b, n, g):
    x, labels = n.inputs[0], b.Cast(n.inputs[1], to=7)
    w, safe = _class_weights(b, n, labels, 2, n.attr("ignore_index"), x)
    onehot = _one_hot(b, safe, b.dim(x, 1), x)
    factor = _per_sample_grad(b, n, g[0], w)
    return [-(onehot * b.Unsqueeze(factor, [1])), None, None]
