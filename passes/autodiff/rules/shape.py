"""Gradients of data-movement ops: reshapes, transposes, joins, slices, gathers, scatters.

Ops that copy input elements to output positions share one mechanism when no
cheaper inverse exists: apply the op to the flat element indices of the input
(``Range`` reshaped like it) to learn where each output element came from, then
scatter-add the output gradient back (``ScatterElements(reduction="add")``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.autodiff.registry import grad_rule

# ---- pure reshapes -------------------------------------------------------------------------


@grad_rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", diff_inputs=(0,))
def _reshape(b, n, g):
    return [b.Reshape(g[0], b.Shape(n.inputs[0]))]


@grad_rule("Transpose")
def _transpose(b, n, g):
    perm = n.attr("perm")
    if perm is None:
        perm = list(reversed(range(n.inputs[0].rank)))
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [b.Transpose(g[0], perm=inverse)]


@grad_rule("Expand", diff_inputs=(0,), broadcast=True)
def _expand(b, n, g):
    return [g[0], None]


@grad_rule("Tile", diff_inputs=(0,))
def _tile(b, n, g):
    """View the output as [r0, d0, r1, d1, ...] and sum the repeat axes."""
    x = n.inputs[0]
    rank = x.rank
    pairs = b.Concat(b.Unsqueeze(n.inputs[1], [1]), b.Unsqueeze(b.Shape(x), [1]), axis=1)
    split = b.Reshape(g[0], b.Reshape(pairs, [-1]))
    return [b.reduce("ReduceSum", split, list(range(0, 2 * rank, 2)), keepdims=0), None]


# ---- joins and splits ------------------------------------------------------------------------


@grad_rule("Concat")
def _concat(b, n, g):
    axis = n.attr("axis")
    sizes = b.Concat(*[b.dim(x, axis) for x in n.inputs], axis=0)
    parts = b.Split(g[0], sizes, axis=axis, _outputs=len(n.inputs))
    parts = parts if isinstance(parts, list) else [parts]
    return [p if n.needs_grad(i) else None for i, p in enumerate(parts)]


@grad_rule("Split", diff_inputs=(0,))
def _split(b, n, g):
    axis = n.attr("axis", 0)
    parts = [gi if gi is not None else b.zeros_like(y) for gi, y in zip(g, n.outputs)]
    return [b.Concat(*parts, axis=axis)]


# ---- flat-index mechanism ----------------------------------------------------------------------


def flat_ids(b, x):
    """int64 tensor shaped like ``x`` holding 0..numel-1."""
    count = b.Reshape(b.Size(x), [])
    ids = b.Range(b.const(np.array(0, np.int64)), count, b.const(np.array(1, np.int64)))
    return b.Reshape(ids, b.Shape(x))


def scatter_back(b, x, ids, go, *, unique=False):
    """Add ``go`` at flat positions ``ids`` of a zero tensor shaped like ``x``."""
    flat_zero = b.Reshape(b.zeros_like(x), [-1])
    flat_ids_ = b.Reshape(ids, [-1])
    flat_go = b.Reshape(go, [-1])
    if unique:
        out = b.ScatterElements(flat_zero, flat_ids_, flat_go, axis=0)
    elif b.opset >= 16:
        out = b.ScatterElements(flat_zero, flat_ids_, flat_go, axis=0, reduction="add")
    else:
        # float32 one-hot (onnxruntime has no OneHot kernel with float64 values), then go's dtype
        onehot = b.OneHot(flat_ids_, b.Reshape(b.Size(x), [1]), b.const(np.array([0.0, 1.0], np.float32)))
        out = b.MatMul(b.Unsqueeze(flat_go, [0]), b.cast_to(onehot, go.dtype))
    return b.Reshape(out, b.Shape(x))


def _replay(b, n, ids, *, extra=None):
    """Run the forward op again on ``ids`` in place of input 0, same attributes."""
    inputs = [ids] + list(n.inputs[1:]) if extra is None else [ids] + extra
    attrs = {k: n.attr(k) for k in n.node.attributes}
    return b.op(n.op_type, *inputs, **attrs)


def _selection(op_type: str, *, unique: bool, diff_inputs=(0,)) -> None:
    @grad_rule(op_type, diff_inputs=diff_inputs)
    def rule(b, n, g):
        x = n.inputs[0]
        ids = _replay(b, n, flat_ids(b, x))
        return [scatter_back(b, x, ids, g[0], unique=unique)]

    rule.__name__ = f"_{op_type.lower()}_by_index"


_selection("GatherElements", unique=False)
_selection("GatherND", unique=False)


@grad_rule("SpaceToDepth")
def _space_to_depth(b, n, g):
    """A permutation: undone by DepthToSpace of the same mode (SpaceToDepth has modes from opset 28)."""
    return [b.DepthToSpace(g[0], blocksize=n.attr("blocksize"), mode=n.attr("mode", "DCR"))]


@grad_rule("DepthToSpace")
def _depth_to_space(b, n, g):
    """DCR is undone by SpaceToDepth; CRD by the inverse reshape-transpose-reshape."""
    bs = n.attr("blocksize")
    if n.attr("mode", "DCR") == "DCR":
        return [b.SpaceToDepth(g[0], blocksize=bs)]
    x, go = n.inputs[0], g[0]
    # g: [N, C, H*bs, W*bs] -> [N, C, H, bs, W, bs] -> [N, C, bs, bs, H, W] -> x's shape
    split = b.Concat(b.dim(go, 0), b.dim(go, 1), b.dim(x, 2), [bs], b.dim(x, 3), [bs], axis=0)
    blocks = b.Transpose(b.Reshape(go, split), perm=[0, 1, 3, 5, 2, 4])
    return [b.Reshape(blocks, b.Shape(x))]

_selection("ReverseSequence", unique=True)


@grad_rule("Slice", diff_inputs=(0,))
def _slice(b, n, g):
    x = n.inputs[0]
    steps = n.const_input(4)
    if steps is None and not n.has_input(4) or steps is not None and np.all(steps == 1):
        return [_slice_by_pad(b, n, g[0])]
    return [scatter_back(b, x, _replay(b, n, flat_ids(b, x)), g[0], unique=True)]


def _slice_by_pad(b, n, go):
    """Unit steps: pad the gradient back with zeros (pads computed from runtime shapes)."""
    x = n.inputs[0]
    rank = x.rank
    int64 = ir.DataType.INT64
    starts, ends = b.cast_to(n.inputs[1], int64), b.cast_to(n.inputs[2], int64)
    axes = b.cast_to(n.inputs[3], int64) if n.has_input(3) else b.Range(
        b.const(np.array(0, np.int64)), b.Reshape(b.Size(starts), []), b.const(np.array(1, np.int64)))
    axes = b.Where(b.Less(axes, 0), axes + rank, axes)
    dims = b.Gather(b.Shape(x), axes, axis=0)
    begin = b.Min(b.Max(b.Where(b.Less(starts, 0), starts + dims, starts), 0), dims)
    stop = b.Min(b.Max(b.Where(b.Less(ends, 0), ends + dims, ends), 0), dims)
    stop = b.Max(stop, begin)
    zeros = b.const(np.zeros(rank, np.int64))
    pad_begin = b.ScatterElements(zeros, axes, begin, axis=0)
    pad_end = b.ScatterElements(zeros, axes, dims - stop, axis=0)
    return b.Pad(go, b.Concat(pad_begin, pad_end, axis=0), mode="constant")


# Node metadata naming a row of Gather's data that gets no gradient (torch's padding_idx; set by
# passes.exports.torch_conventions from the export's record of aten.embedding).
PADDING_IDX_KEY = "gradgraph.padding_idx"


@grad_rule("Gather", diff_inputs=(0,))
def _gather(b, n, g):
    """ScatterND-add the gradient rows back; the gathered axis is moved to the front."""
    x, idx = n.inputs
    axis = n.attr("axis", 0)
    rank, irank = x.rank, idx.rank
    axis = axis + rank if axis < 0 else axis
    go = g[0]
    size = b.dim(x, axis)
    idx = b.cast_to(idx, ir.DataType.INT64)  # int32 indices: ScatterND and the size are int64
    idx = b.Where(b.Less(idx, 0), idx + b.Reshape(size, []), idx)
    padding = n.node.metadata_props.get(PADDING_IDX_KEY)
    if padding is not None and axis == 0:  # torch's embedding padding_idx: that row gets no gradient
        hit = b.Equal(idx, b.CastLike(b.const(np.array(int(padding), np.int64)), idx))
        hit = b.Unsqueeze(hit, list(range(irank, irank + rank - 1))) if rank > 1 else hit
        go = b.Where(hit, b.const(0.0, go.dtype), go)
    if b.opset < 16:
        return [scatter_back(b, x, _replay(b, n, flat_ids(b, x), extra=[n.inputs[1]]), go), None]
    if axis != 0:
        # go: pre + idx + post -> idx + pre + post ; x: pre + [a] + post -> [a] + pre + post
        perm_g = list(range(axis, axis + irank)) + list(range(axis)) + list(range(axis + irank, rank - 1 + irank))
        go = b.Transpose(go, perm=perm_g)
        perm_x = [axis] + list(range(axis)) + list(range(axis + 1, rank))
        xt = b.Transpose(x, perm=perm_x)
    else:
        xt = x
    zeros = b.zeros_like(xt)
    out = b.ScatterND(zeros, b.Unsqueeze(idx, [-1]), go, reduction="add")
    if axis != 0:
        inverse = [0] * rank
        for i, p in enumerate(perm_x):
            inverse[p] = i
        out = b.Transpose(out, perm=inverse)
    return [out, None]


def _scatter_grads(b, n, g, gather, scatter):
    """Gradients of a scatter for every reduction, given ``gather(t)`` (t at the written
    positions, shaped like updates) and ``scatter(base, values, reduction)`` (the op's indices).

    none: updates overwrite; add: they accumulate; mul: out = data * product of the updates
    (zero-safe: the product of the others is taken over nonzero factors where no other is
    zero); min/max: the gradient goes to the data and update values equal to the output,
    ties sharing it evenly (as ReduceMax does).
    """
    data, _, upd = n.inputs
    reduction, go = n.attr("reduction", "none"), g[0]
    d_data = d_upd = None
    if reduction in ("none", "add"):
        if n.needs_grad(0):
            d_data = scatter(go, b.zeros_like(upd), "none") if reduction == "none" else go
        d_upd = gather(go) if n.needs_grad(2) else None
    elif reduction == "mul":
        if n.needs_grad(0):
            d_data = go * scatter(b.ones_like(data), upd, "mul")
        if n.needs_grad(2):
            is_zero = b.Equal(upd, 0.0)
            nonzero = b.Where(is_zero, 1.0, upd, _like=upd)
            zero_f = b.CastLike(is_zero, upd)
            others_zero = gather(scatter(b.zeros_like(data), zero_f, "add")) - zero_f
            full = gather(go * data * scatter(b.ones_like(data), nonzero, "mul"))
            d_upd = b.Where(b.Equal(others_zero, 0.0), full / nonzero, 0.0, _like=upd)
    elif reduction in ("min", "max"):
        y = n.outputs[0]
        hit_data = b.CastLike(b.Equal(data, y), y)
        hit_upd = b.CastLike(b.Equal(upd, gather(y)), y)
        share = go / (hit_data + scatter(b.zeros_like(data), hit_upd, "add"))
        d_data = share * hit_data if n.needs_grad(0) else None
        d_upd = gather(share) * hit_upd if n.needs_grad(2) else None
    else:
        raise ValueError(f"{n.op_type} gradient does not support reduction={reduction!r}")
    return [d_data, None, d_upd]


@grad_rule("ScatterND", diff_inputs=(0, 2))
def _scatter_nd(b, n, g):
    idx = n.inputs[1]
    return _scatter_grads(b, n, g, lambda t: b.GatherND(t, idx),
                          lambda base, v, red: b.ScatterND(base, idx, v, reduction=_reduction_attr(red)))


@grad_rule("ScatterElements", diff_inputs=(0, 2))
def _scatter_elements(b, n, g):
    idx, axis = n.inputs[1], n.attr("axis", 0)
    return _scatter_grads(b, n, g, lambda t: b.GatherElements(t, idx, axis=axis),
                          lambda base, v, red: b.ScatterElements(base, idx, v, axis=axis,
                                                                 reduction=_reduction_attr(red)))


def _reduction_attr(reduction: str):
    """The ``reduction`` attribute to write: none for "none" (scatters before opset 16 have none)."""
    return None if reduction == "none" else reduction


@grad_rule("Pad", diff_inputs=(0,))
def _pad(b, n, g):
    mode = n.attr("mode", "constant")
    x = n.inputs[0]
    if mode == "constant":
        pads = n.inputs[1]
        extra = [n.inputs[3]] if n.has_input(3) else []
        if extra:
            return [b.Pad(g[0], b.Neg(pads), None, *extra, mode="constant"), None, None, None]
        return [b.Pad(g[0], b.Neg(pads), mode="constant"), None, None]
    ids = _replay(b, n, flat_ids(b, x))
    return [scatter_back(b, x, ids, g[0])]


@grad_rule("Trilu", diff_inputs=(0,))
def _trilu(b, n, g):
    return [b.op("Trilu", g[0], *n.inputs[1:], upper=n.attr("upper", 1)), None]


@grad_rule("TopK", diff_inputs=(0,))
def _topk(b, n, g):
    x = n.inputs[0]
    axis = n.attr("axis", -1)
    if g[0] is None:
        return [None, None]
    zeros = b.zeros_like(x)
    return [b.ScatterElements(zeros, n.outputs[1], g[0], axis=axis), None]


# ---- generated tensors that are linear in a float input --------------------------------------


@grad_rule("Range", since=11, diff_inputs=(0, 2))
def _range(b, n, g):
    """y[i] = start + i * delta (the element count is locally constant in start, limit and
    delta): d start = sum(dY), d delta = sum(dY * i); limit only sets the count."""
    go = g[0]
    grads = [None, None, None]
    if n.needs_grad(0):
        grads[0] = b.reduce("ReduceSum", go, None, keepdims=0)
    if n.needs_grad(2):
        count = b.Reshape(b.Size(go), [])
        steps = b.Range(b.const(np.array(0, np.int64)), count, b.const(np.array(1, np.int64)))
        grads[2] = b.reduce("ReduceSum", go * b.CastLike(steps, go), None, keepdims=0)
    return grads


@grad_rule("OneHot", since=9, diff_inputs=(2,))
def _one_hot(b, n, g):
    """y = values[1] at the hot positions, values[0] elsewhere: d values = [sum of dY off the
    hot positions, sum of dY on them]. The hot positions come from the forward op itself on
    values [0, 1] (same indices, depth, axis and dtypes, so the same kernel runs)."""
    values, go = n.inputs[2], g[0]
    unit = b.CastLike(b.const(np.array([0.0, 1.0], np.float32)), values)
    hot = b.cast_to(b.OneHot(n.inputs[0], n.inputs[1], unit, axis=n.attr("axis", -1)), go.dtype)
    on = b.reduce("ReduceSum", go * hot, None, keepdims=1)
    off = b.reduce("ReduceSum", go - go * hot, None, keepdims=1)
    return [None, None, b.Reshape(b.Concat(off, on, axis=0), b.Shape(values))]
