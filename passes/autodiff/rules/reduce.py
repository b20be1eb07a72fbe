"""Gradients of reductions and CumSum.

Every reduction's gradient is "put the reduced axes back, then expand to X's
shape", times a per-op local factor.
"""

from __future__ import annotations

from passes.autodiff.registry import grad_rule


def _axes(b, n):
    """The reduction axes: a list ([] = none, the no-op case), a Var, or None (= all axes)."""
    noop = bool(n.attr("noop_with_empty_axes", 0))
    if n.attr("axes") is not None:  # the attribute form: an empty list is every axis, as no list
        return list(n.attr("axes")) or ([] if noop else None)
    if n.has_input(1):
        const = n.const_input(1)
        if const is None:
            return n.inputs[1]
        if const.size == 0:
            return [] if noop else None
        return [int(a) for a in const.reshape(-1)]
    return [] if noop else None


def _restore(b, n, v):
    """Bring a reduced tensor (Y or its gradient) back to X's rank, keepdims-style."""
    if n.attr("keepdims", 1):
        return v
    axes = _axes(b, n)
    if axes is None or isinstance(axes, list) and not axes:
        return v  # a scalar broadcasts against X; no axes reduced: same shape
    return b.Unsqueeze(v, axes)


def _sum_back(b, n, v, op_type="ReduceSum"):
    """Reduce ``v`` (X-shaped) over the node's reduction axes, keepdims, same no-op semantics."""
    axes = _axes(b, n)
    if isinstance(axes, list) and not axes:
        return v
    if axes is None or isinstance(axes, list):
        return b.reduce(op_type, v, axes, keepdims=1)
    return b.op(op_type, v, axes, keepdims=1, noop_with_empty_axes=n.attr("noop_with_empty_axes", 0))


def _reduction(op_type: str, local):
    """Register dX = Expand(restore(G)) * local(b, x, restore(Y), n).

    An empty axes list with ``noop_with_empty_axes`` reduces over no axis: Y is the
    elementwise version of the op (|x| for ReduceL1, x*x for ReduceSumSquare, ...).
    """

    @grad_rule(op_type, diff_inputs=(0,))
    def rule(b, n, g):
        x = n.inputs[0]
        go = _restore(b, n, g[0])
        factor = local(b, x, lambda: _restore(b, n, n.outputs[0]), n)
        d = go if factor is None else go * factor
        return [b.Expand(d, b.Shape(x))]

    rule.__name__ = f"_{op_type.lower()}_grad"
    return rule


def _mean_factor(b, x, y, n):
    count = b.CastLike(b.Div(b.Size(x), b.Size(n.outputs[0])), x)
    return b.Reciprocal(count)


# Node metadata: "first" = a tie's gradient goes to the first extreme along the one reduced
# axis (torch.max(x, dim) / min(x, dim), whose index is ArgMax's); "all" = every tie gets the
# whole gradient (the inf-norm of torch.cdist / pdist); set from the exporter's record of the
# call (passes.exports.conventions); without it ties share (torch.amax/amin).
EXTREME_TIES_KEY = "gradgraph.extreme_ties"
_ARG_OF = {"ReduceMax": "ArgMax", "ReduceMin": "ArgMin"}


def _first_axis(b, n):
    """The one reduced axis when ties go to the first extreme (marked, or X also read by an
    ArgMax/ArgMin over that axis with the same keepdims: torch.max(x, dim)'s two outputs),
    else None."""
    axes = _axes(b, n)
    if not isinstance(axes, list) or len(axes) != 1:
        return None
    if n.node.metadata_props.get(EXTREME_TIES_KEY) == "first":
        return axes[0]
    for user, _ in n.node.inputs[0].uses():
        if (user.op_type == _ARG_OF[n.node.op_type] and user.domain in ("", "ai.onnx")
                and user.attributes.get_int("axis", 0) == axes[0]
                and not user.attributes.get_int("select_last_index", 0)
                and user.attributes.get_int("keepdims", 1) == n.attr("keepdims", 1)):
            return axes[0]
    return None


def _extreme_factor(b, x, y, n):
    """Ties share the gradient evenly (torch.amax/amin semantics), go to the first extreme
    where torch's max(dim)/min(dim) picked it (:func:`_first_axis`), or each get all of it
    (marked "all")."""
    hit = b.Equal(x, y())
    mask = b.CastLike(hit, x)
    if n.node.metadata_props.get(EXTREME_TIES_KEY) == "all":
        return mask
    axis = _first_axis(b, n)
    if axis is not None:  # the first hit along the axis: the running count of hits is 1 there
        first = b.And(hit, b.Equal(b.CumSum(mask, b.const([axis], "int64")), 1.0))
        return b.CastLike(first, x)
    return mask / _sum_back(b, n, mask)


def _prod_factor(b, x, y, n):
    """The product of the other elements of each group; exact where x has zeros (y / x is not)."""
    is_zero = b.Equal(x, 0.0)
    nonzero = b.Where(is_zero, 1.0, x, _like=x)
    others = _sum_back(b, n, nonzero, "ReduceProd") / nonzero
    zero_f = b.CastLike(is_zero, x)
    zeros_elsewhere = _sum_back(b, n, zero_f) - zero_f
    return b.Where(b.Equal(zeros_elsewhere, 0.0), others, 0.0, _like=x)


def _l2_factor(b, x, y, n):
    yk = y()
    safe = b.Where(b.Equal(yk, 0.0), 1.0, yk, _like=x)
    return b.Where(b.Equal(yk, 0.0), 0.0, x / safe, _like=x)


_reduction("ReduceSum", lambda b, x, y, n: None)
_reduction("ReduceMean", _mean_factor)
_reduction("ReduceMax", _extreme_factor)
_reduction("ReduceMin", _extreme_factor)
_reduction("ReduceProd", _prod_factor)
_reduction("ReduceL1", lambda b, x, y, n: b.Sign(x))
_reduction("ReduceL2", _l2_factor)
_reduction("ReduceSumSquare", lambda b, x, y, n: 2.0 * x)
_reduction("ReduceLogSumExp", lambda b, x, y, n: b.Exp(x - y()))
_reduction("ReduceLogSum", lambda b, x, y, n: b.Exp(-y()))


@grad_rule("CumSum", diff_inputs=(0,))
def _cumsum(b, n, g):
    reverse = 1 - n.attr("reverse", 0)
    return [b.CumSum(g[0], n.inputs[1], exclusive=n.attr("exclusive", 0), reverse=reverse), None]
