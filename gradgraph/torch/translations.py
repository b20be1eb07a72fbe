"""torch 2.13 exporter translations gradgraph replaces (traps 2, 6, 7 and 8 of
:mod:`gradgraph.torch.export`): each returns a ``custom_translation_table`` entry for
``torch.onnx.export(dynamo=True)``, written with onnxscript."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import torch


def bn_train_translation() -> dict:
    """aten._native_batch_norm_legit_functional written with ``training_mode=1`` (trap 2 of gradgraph.torch.export)."""
    from onnxscript import opset20

    op: Any = opset20  # traced: its typed signatures do not apply to the exporter's values

    def bn_train(input, weight, bias, running_mean, running_var, training: bool, momentum: float,
                 eps: float):
        if weight is None or bias is None:  # affine=False: ONNX's BatchNormalization needs both
            channels = op.Slice(op.Shape(input), op.Constant(value_ints=[1]), op.Constant(value_ints=[2]))
            dtype = (input.dtype or ir.DataType.FLOAT).numpy()  # CastLike: an opset-19 op
            if weight is None:
                weight = op.ConstantOfShape(channels, value=ir.tensor(np.ones(1, dtype)))
            if bias is None:
                bias = op.ConstantOfShape(channels, value=ir.tensor(np.zeros(1, dtype)))
        y, rm, rv = op.BatchNormalization(input, weight, bias, running_mean, running_var,
                                          epsilon=eps, momentum=1.0 - momentum, training_mode=1)
        return y, rm, rv, rm, rv

    return {torch.ops.aten._native_batch_norm_legit_functional.default: bn_train}


def cross_entropy_translation() -> dict:
    """aten.cross_entropy_loss as torch computes it (trap 6 of gradgraph.torch.export): torchlib writes
    SoftmaxCrossEntropyLoss for every call, which drops ``label_smoothing`` and is an invalid
    model for probability (float) targets."""
    from onnxscript import opset18

    op: Any = opset18  # traced: its typed signatures do not apply to the exporter's values

    def scalar(value: float, like):  # a float constant of ``like``'s dtype
        return op.CastLike(op.Constant(value_float=float(value)), like)

    def cross_entropy(self, target, weight=None, reduction: int = 1, ignore_index: int = -100,
                      label_smoothing: float = 0.0):
        reduce_name = {0: "none", 1: "mean", 2: "sum"}[reduction]
        soft = target.dtype is not None and target.dtype.is_floating_point()
        rank = len(self.shape) if self.shape is not None else 2
        first = op.Constant(value_ints=[0])

        def batched(loss_op, scores, labels):  # ONNX's losses take [N, C]: an unbatched call gets N = 1
            if rank != 1:
                return loss_op(scores, labels)
            loss = loss_op(op.Unsqueeze(scores, first), op.Unsqueeze(labels, first))
            return op.Squeeze(loss, first) if reduction == 0 else loss

        if not soft and not label_smoothing:  # what torchlib writes: torch's result
            return batched(lambda x, t: op.SoftmaxCrossEntropyLoss(
                x, t, weight, reduction=reduce_name, ignore_index=ignore_index)[0], self, target)
        axis = 0 if rank == 1 else 1
        axes = op.Constant(value_ints=[axis])
        logp = op.LogSoftmax(self, axis=axis)
        classes = op.CastLike(op.Gather(op.Shape(self), op.Constant(value_int=axis)), self)
        weighted = logp
        if weight is not None:
            weighted = op.Mul(logp, op.Reshape(weight, op.Constant(
                value_ints=[-1 if k == axis else 1 for k in range(rank)])))
        if soft:  # -sum(target * log p), the mean over the positions (the class axis summed)
            if label_smoothing:
                target = op.Add(op.Mul(target, scalar(1.0 - label_smoothing, self)),
                                op.Div(scalar(label_smoothing, self), classes))
            per_position = op.Neg(op.ReduceSum(op.Mul(weighted, target), axes, keepdims=0))
            if reduction == 0:
                return per_position
            total = op.ReduceSum(per_position, keepdims=0)
            if reduction == 2:
                return total
            return op.Div(total, op.Div(op.CastLike(op.Size(self), self), classes))
        # class indices with label smoothing: (1 - e) nll + e / C * smooth (torch's formula)
        nll = batched(lambda x, t: op.NegativeLogLikelihoodLoss(
            x, t, weight, reduction=reduce_name, ignore_index=ignore_index), logp, target)
        ignored = op.Equal(target, op.CastLike(op.Constant(value_int=ignore_index), target))
        zero = scalar(0.0, self)
        smooth = op.Where(ignored, zero, op.Neg(op.ReduceSum(weighted, axes, keepdims=0)))
        if reduction != 0:
            smooth = op.ReduceSum(smooth, keepdims=0)
        if reduction == 1:
            if weight is None:
                counted = op.CastLike(op.Not(ignored), self)
            else:
                safe = op.Where(ignored, op.CastLike(op.Constant(value_int=0), target), target)
                counted = op.Where(ignored, zero, op.Gather(weight, safe))
            smooth = op.Div(smooth, op.ReduceSum(counted, keepdims=0))
        return op.Add(op.Mul(nll, scalar(1.0 - label_smoothing, self)),
                      op.Mul(smooth, op.Div(scalar(label_smoothing, self), classes)))

    return {torch.ops.aten.cross_entropy_loss.default: cross_entropy}


def attention_translation() -> dict:
    """aten.scaled_dot_product_attention with a boolean mask: torchlib's, then zeros for a query
    whose mask row has no key (trap 7 of gradgraph.torch.export: torchlib masks with the dtype's lowest value, so
    such a row averaged every value where torch gives zeros)."""
    from onnxscript import opset18
    from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

    op: Any = opset18

    def attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False):
        out = torchlib_nn.aten_scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
        if attn_mask is None or attn_mask.dtype != ir.DataType.BOOL:
            return out
        sees_a_key = op.Cast(op.ReduceMax(op.Cast(attn_mask, to=ir.DataType.INT32),
                                          op.Constant(value_ints=[-1]), keepdims=1), to=ir.DataType.BOOL)
        return op.Where(sees_a_key, out, op.CastLike(op.Constant(value_float=0.0), out))

    return {torch.ops.aten.scaled_dot_product_attention.default: attention}


def embedding_bag_translation() -> dict:
    """aten embedding_bag without a Loop (trap 8 of gradgraph.torch.export): the bag of each index from the offsets
    (a scatter of ones at the bag starts, then a running sum), the rows gathered, weighted
    (per_sample_weights; 0 at padding_idx) and scattered into their bags with ScatterND's
    add (sum, mean: divided by the bag's size) or max (an empty bag gives zeros, as in torch).
    torchlib builds the bags in a Loop over a sequence, which has no gradient here."""
    from onnxscript import opset18

    op: Any = opset18

    def embedding_bag(weight, indices, offsets, scale_grad_by_freq: bool = False, mode: int = 0,
                      sparse: bool = False, per_sample_weights=None, include_last_offset: bool = False,
                      padding_idx: int | None = None):
        if scale_grad_by_freq or sparse:  # gradient-only options the graph cannot carry
            raise NotImplementedError("embedding_bag(scale_grad_by_freq=True or sparse=True) has no "
                                      "ONNX form here")
        int64 = ir.DataType.INT64
        idx = op.Reshape(indices, op.Constant(value_ints=[-1]))
        starts = op.Slice(offsets, op.Constant(value_ints=[0]), op.Constant(value_ints=[-1])) \
            if include_last_offset else offsets
        n = op.Shape(idx)  # [L]
        bags = op.Shape(starts)  # [B]
        # bag of each index: ones scattered at the starts (an empty bag's start repeats), summed
        marks = op.ScatterElements(op.ConstantOfShape(op.Add(n, op.Constant(value_ints=[1])),
                                                      value=ir.tensor([0], dtype=int64)),
                                   starts, op.Expand(op.Constant(value_ints=[1]), bags), reduction="add")
        bag = op.Sub(op.CumSum(op.Slice(marks, op.Constant(value_ints=[0]), n), op.Constant(value_int=0)),
                     op.Constant(value_int=1))
        rows = op.Gather(weight, idx)  # [L, D]
        keep = None
        if padding_idx is not None and padding_idx >= 0:
            keep = op.Not(op.Equal(idx, op.CastLike(op.Constant(value_int=int(padding_idx)), idx)))
        where = op.Unsqueeze(bag, op.Constant(value_ints=[-1]))  # ScatterND indices [L, 1]
        out_shape = op.Concat(bags, op.Slice(op.Shape(weight), op.Constant(value_ints=[1]),
                                             op.Constant(value_ints=[2])), axis=0)
        zero = op.CastLike(op.Constant(value_float=0.0), weight)
        ones = op.Expand(op.CastLike(op.Constant(value_float=1.0), weight), n)
        counted = ones if keep is None else op.Where(keep, ones, zero)
        size = op.ScatterND(op.Expand(zero, bags), where, counted, reduction="add")  # [B]
        if mode == 2:  # max over the bag's rows; an empty bag (or padding only) gives zeros
            lowest = op.CastLike(op.Constant(value_float=float(np.finfo(np.float32).min)), weight)
            if keep is not None:
                rows = op.Where(op.Unsqueeze(keep, op.Constant(value_ints=[-1])), rows, lowest)
            out = op.ScatterND(op.Expand(lowest, out_shape), where, rows, reduction="max")
            out = op.Where(op.Unsqueeze(op.Greater(size, zero), op.Constant(value_ints=[-1])), out, zero)
        else:
            scale = counted if per_sample_weights is None else op.Mul(
                op.Reshape(per_sample_weights, op.Constant(value_ints=[-1])), counted)
            out = op.ScatterND(op.Expand(zero, out_shape), where,
                               op.Mul(rows, op.Unsqueeze(scale, op.Constant(value_ints=[-1]))), reduction="add")
            if mode == 1:
                one = op.CastLike(op.Constant(value_float=1.0), weight)
                out = op.Div(out, op.Unsqueeze(op.Max(size, one), op.Constant(value_ints=[-1])))
        # torch's other three outputs, unused by the forward: the exporter writes torch's shapes
        # on them (empty in some modes), so they are values of their own, removed unused
        return out, op.Identity(bag), op.Cast(size, to=int64), op.Cast(op.Expand(zero, out_shape), to=int64)

    return {target: embedding_bag for target in (
        torch.ops.aten.embedding_bag.padding_idx, torch.ops.aten._embedding_bag.default,
        torch.ops.aten._embedding_bag_forward_only.default)}


def distance_translation() -> dict:
    """aten._cdist_forward, _pdist_forward and _euclidean_dist (torch.cdist, F.pdist), which
    torchlib does not write (the export fell to the TorchScript exporter, whose cdist ignores
    ``p``): the p-norm of the row differences with linalg_vector_norm's ops (ReduceL2 for 2,
    ReduceL1 for 1, ReduceMax of Abs for inf, else ``(sum |d|^p)^(1/p)``), and torch's
    ``|x1|^2 - 2 x1 x2^T + |x2|^2`` then the root for _euclidean_dist (cdist of more than 25
    rows). Convention 8 of :mod:`passes.exports.conventions` gives their gradients torch's 0 at
    a zero distance. The differences are materialized: [..., P, R, D] for cdist."""
    from onnxscript import opset18

    op: Any = opset18
    last = [-1]

    def norm(diff, p: float):
        axes = op.Constant(value_ints=last)
        if p == 2.0:
            return op.ReduceL2(diff, axes, keepdims=0)
        if p == 1.0:
            return op.ReduceL1(diff, axes, keepdims=0)
        if p == float("inf"):
            return op.ReduceMax(op.Abs(diff), axes, keepdims=0)
        if p == 0.0:  # the count of differing coordinates; through Sign: torch's zero gradient
            return op.ReduceSum(op.Abs(op.Sign(diff)), axes, keepdims=0)
        # float64 constants: a float32 1 / p is off by 3e-8 in a float64 model
        power = op.CastLike(op.Constant(value=ir.tensor(np.array(p, np.float64))), diff)
        root = op.CastLike(op.Constant(value=ir.tensor(np.array(1.0 / p, np.float64))), diff)
        return op.Pow(op.ReduceSum(op.Pow(op.Abs(diff), power), axes, keepdims=0), root)

    def cdist(x1, x2, p: float = 2.0, compute_mode: int | None = None):
        return norm(op.Sub(op.Unsqueeze(x1, op.Constant(value_ints=[-2])),
                           op.Unsqueeze(x2, op.Constant(value_ints=[-3]))), p)

    def pdist(input, p: float = 2.0):
        n = op.Slice(op.Shape(input), op.Constant(value_ints=[0]), op.Constant(value_ints=[1]))
        upper = op.Trilu(op.ConstantOfShape(op.Concat(n, n, axis=0), value=ir.tensor([1], dtype=ir.DataType.INT64)),
                         op.Constant(value_int=1), upper=1)
        pairs = op.NonZero(upper)  # [2, n(n-1)/2]: (i, j), i < j, row-major as torch orders them
        first = op.Gather(pairs, op.Constant(value_int=0), axis=0)
        second = op.Gather(pairs, op.Constant(value_int=1), axis=0)
        return norm(op.Sub(op.Gather(input, first, axis=0), op.Gather(input, second, axis=0)), p)

    def euclidean(x1, x2):
        axes = op.Constant(value_ints=last)
        sq1 = op.ReduceSum(op.Mul(x1, x1), axes, keepdims=1)  # [..., P, 1]
        sq2 = op.ReduceSum(op.Mul(x2, x2), axes, keepdims=1)  # [..., R, 1]
        rank = len(x2.shape) if x2.shape is not None else 2
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
        # torch's one product of [-2 x1, |x1|^2, 1] and [x2, 1, |x2|^2]: its rounding, as far as
        # the product's summation order allows (a zero distance is sqrt of a rounding error)
        left = op.Concat(op.Mul(x1, op.CastLike(op.Constant(value_float=-2.0), x1)), sq1,
                         op.Expand(op.CastLike(op.Constant(value_float=1.0), x1), op.Shape(sq1)), axis=-1)
        right = op.Concat(x2, op.Expand(op.CastLike(op.Constant(value_float=1.0), x2), op.Shape(sq2)), sq2, axis=-1)
        return op.Sqrt(op.Relu(op.MatMul(left, op.Transpose(right, perm=perm))))

    return {torch.ops.aten._cdist_forward.default: cdist, torch.ops.aten._pdist_forward.default: pdist,
            torch.ops.aten._euclidean_dist.default: euclidean}


def multinomial_translation() -> dict:
    """aten.multinomial from uniform draws the graph reads from torch's generator (the
    ``RandomUniformLike`` nodes become inputs torch fills on every call:
    :class:`passes.kernels.random_inputs.RandomInputsPass`), so ``torch.manual_seed`` repeats
    it (torch's own draws are another stream: the samples differ from eager torch's, their
    distribution does not). torchlib wrote ONNX's Multinomial, drawn in onnxruntime from a
    generator seeded once per build, and with replacement even for ``replacement=False``.

    1. without replacement, or one sample: torch's own algorithm, the top ``num_samples`` of
       ``p / q`` with ``q = -log(1 - U)`` exponential draws (distinct categories);
    2. with replacement: the inverse of the cumulative distribution at ``U * sum(p)``, one
       draw per sample."""
    from onnxscript import opset18

    op: Any = opset18

    def multinomial(self, num_samples: int, replacement: bool = False, generator=None):
        last = op.Constant(value_ints=[-1])
        one = op.CastLike(op.Constant(value_float=1.0), self)
        dtype = int(self.dtype) if self.dtype is not None else int(ir.DataType.FLOAT)
        def typed(value):  # self's type on an elementwise value (a typeless one is not saved)
            value.dtype, value.shape = self.dtype, self.shape
            return value

        if not replacement or num_samples == 1:
            uniform = typed(op.RandomUniformLike(self, dtype=dtype))
            q = typed(op.Neg(typed(op.Log(typed(op.Sub(one, uniform))))))
            keys = typed(op.Div(self, q))
            if num_samples == 1:
                return op.ArgMax(keys, axis=-1, keepdims=1)
            _, indices = op.TopK(keys, op.Constant(value_ints=[num_samples]), axis=-1, largest=1, sorted=1)
            return indices
        categories = op.Shape(self, start=-1)
        shape = op.Concat(op.Shape(self, end=-1), op.Constant(value_ints=[num_samples]), axis=0)
        draws = op.RandomUniformLike(op.Expand(op.CastLike(op.Constant(value_float=0.0), self), shape), dtype=dtype)
        cdf = op.CumSum(self, op.Constant(value_int=-1))
        total = op.ReduceSum(self, last, keepdims=1)
        at = op.Unsqueeze(op.Mul(draws, total), last)  # [..., n, 1]
        below = op.LessOrEqual(op.Unsqueeze(cdf, op.Constant(value_ints=[-2])), at)  # [..., n, C]
        index = op.ReduceSum(op.Cast(below, to=ir.DataType.INT64), last, keepdims=0)
        return op.Min(index, op.Sub(categories, op.Constant(value_ints=[1])))

    return {torch.ops.aten.multinomial.default: multinomial}
