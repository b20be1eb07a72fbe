"""Gradients of MatMul (N-D, broadcast batch dims, 1-D operands), onnxruntime's FusedMatMul,
Gemm and Einsum."""

from __future__ import annotations

import onnx_ir as ir

from passes.autodiff.registry import grad_rule


def _swap_last(b, x, rank):
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return b.Transpose(x, perm=perm)


@grad_rule("MatMul")
def _matmul(b, n, g):
    a, c = n.inputs
    if a.rank is None or c.rank is None:
        raise ValueError("MatMul gradient needs the operand ranks (run shape inference)")
    return _matmul_grads(b, a, c, n.outputs[0].shape, g[0], n.needs_grad(0), n.needs_grad(1))


@grad_rule("FusedMatMul", domain="com.microsoft")
def _fused_matmul(b, n, g):
    """onnxruntime's ``FusedMatMul`` (its optimizer's MatMul with a Transpose or a scale folded
    in): ``alpha * op(A) @ op(B)``, ``op`` swapping the last two axes where transA / transB say.
    The MatMul gradient of the transposed operands, transposed back."""
    a, c = n.inputs[0], n.inputs[1]
    if n.attr("transBatchA", 0) or n.attr("transBatchB", 0):
        raise ValueError("FusedMatMul gradient with transBatchA / transBatchB is not supported")
    ta, tb, alpha = n.attr("transA", 0), n.attr("transB", 0), float(n.attr("alpha", 1.0))
    if a.rank is None or c.rank is None:
        raise ValueError("FusedMatMul gradient needs the operand ranks (run shape inference)")
    if (ta and a.rank < 2) or (tb and c.rank < 2):
        raise ValueError("FusedMatMul gradient: transA / transB on a 1-D operand")
    a2 = _swapped_operand(b, a) if ta else a
    c2 = _swapped_operand(b, c) if tb else c
    go = g[0] if alpha == 1.0 else g[0] * alpha
    da, dc = _matmul_grads(b, a2, c2, n.outputs[0].shape, go, n.needs_grad(0), n.needs_grad(1))
    if da is not None and ta:
        da = _swap_last(b, da, a.rank)
    if dc is not None and tb:
        dc = _swap_last(b, dc, c.rank)
    return [da, dc]


def _swapped_operand(b, x):
    """``x`` with its last two axes swapped, its shape known as ``x``'s is (the MatMul gradient
    reads operand ranks and shapes)."""
    out = _swap_last(b, x, x.rank)
    if x.value.shape is not None:
        dims = list(x.value.shape)
        dims[-1], dims[-2] = dims[-2], dims[-1]
        out.value.shape = ir.Shape(dims)
    out.value.type = x.value.type
    return out


def _matmul_grads(b, a, c, out_shape, go, need_a: bool, need_c: bool):
    """The gradients of ``MatMul(a, c)`` (N-D, broadcast batch dims, 1-D operands) for the
    output gradient ``go``; None where not needed."""
    ra, rc = a.rank, c.rank
    # Promote 1-D operands as the MatMul spec does, and the output gradient with them.
    a2 = b.Unsqueeze(a, [0]) if ra == 1 else a
    c2 = b.Unsqueeze(c, [1]) if rc == 1 else c
    if ra == 1:
        go = b.Unsqueeze(go, [-2] if rc > 1 else [0])
    if rc == 1:
        go = b.Unsqueeze(go, [-1])
    ra2, rc2 = max(ra, 2), max(rc, 2)
    out_rank = max(ra2, rc2)
    batch = (out_shape or [None] * out_rank)
    batch = list(batch[: out_rank - 2]) if ra > 1 and rc > 1 else [None] * (out_rank - 2)
    da = dc = None
    if need_a:
        if rc2 == 2 and ra2 > 2:
            da = b.MatMul(go, _swap_last(b, c2, 2))
        else:
            da = b.MatMul(go, _swap_last(b, c2, rc2))
            da = b.unbroadcast(da, batch + (a2.shape or [None, None])[-2:] if ra > 1 else None, a2)
        if ra == 1:
            da = b.Reshape(da, b.Shape(a))
    if need_c:
        if rc2 == 2 and ra2 > 2:
            # Linear layer: fold the batch dims of A and G into rows, one 2-D MatMul.
            a_rows = b.Reshape(a2, b.Concat([-1], b.dim(a2, -1), axis=0))
            g_rows = b.Reshape(go, b.Concat([-1], b.dim(go, -1), axis=0))
            dc = b.MatMul(b.Transpose(a_rows, perm=[1, 0]), g_rows)
        else:
            dc = b.MatMul(_swap_last(b, a2, ra2), go)
            dc = b.unbroadcast(dc, batch + (c2.shape or [None, None])[-2:] if rc > 1 else None, c2)
        if rc == 1:
            dc = b.Reshape(dc, b.Shape(c))
    return [da, dc]


@grad_rule("Gemm")
def _gemm(b, n, g):
    a, c = n.inputs[0], n.inputs[1]
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    ta, tb = n.attr("transA", 0), n.attr("transB", 0)
    go = g[0]
    da = dc = dbias = None
    if n.needs_grad(0):
        if ta:
            da = b.Gemm(c, go, alpha=alpha, transA=tb, transB=1)
        else:
            da = b.Gemm(go, c, alpha=alpha, transB=1 - tb)
    if n.needs_grad(1):
        if tb:
            dc = b.Gemm(go, a, alpha=alpha, transA=1, transB=ta)
        else:
            dc = b.Gemm(a, go, alpha=alpha, transA=1 - ta)
    if n.needs_grad(2):
        scaled = go if beta == 1.0 else go * beta
        dbias = b.unbroadcast(scaled, n.outputs[0].shape, n.inputs[2])
    return [da, dc, dbias]


def _parse_einsum(equation: str):
    lhs, _, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if not _:
        letters = sorted({ch for t in terms for ch in t if ch.isalpha()})
        counts = {ch: sum(t.count(ch) for t in terms) for ch in letters}
        rhs = ("..." if any("..." in t for t in terms) else "") + "".join(
            ch for ch in letters if counts[ch] == 1)
    return terms, rhs


def _letters(term: str) -> list[str]:
    return [ch for ch in term.replace("...", "") if ch.isalpha()]


def _axes_of(term: str, ell_rank: int) -> list[str | int]:
    """The axes of an operand written ``term``: its letters, and 0..ell_rank-1 for the ellipsis."""
    head, dots, tail = term.partition("...")
    return list(head) + (list(range(ell_rank)) if dots else []) + list(tail)


def _ellipsis_rank(n, terms: list[str], out: str) -> int | None:
    """How many dimensions the ellipsis stands for (onnxruntime wants the same in every operand)."""
    for term, v in [*zip(terms, n.inputs), (out, n.outputs[0])]:
        if "..." in term and v.rank is not None:
            return v.rank - len(_letters(term))
    return None


@grad_rule("Einsum")
def _einsum(b, n, g):
    """d operand_i = einsum(other operands, grad -> term_i), expanded over lost letters.

    The ellipsis goes where the operand has it; an operand without one gets the gradient of
    the broadcast (``...`` first) summed over the ellipsis axes, since an Einsum whose inputs
    have an ellipsis must keep it in its output. Ellipsis axes where the operand has size 1
    and another operand does not are summed back to 1.
    """
    terms, out = _parse_einsum(n.attr("equation"))
    ell = _ellipsis_rank(n, terms, out) if any("..." in t for t in terms) else 0
    grads = []
    for i, x in enumerate(n.inputs):
        if not n.needs_grad(i):
            grads.append(None)
            continue
        term = terms[i]
        letters = _letters(term)
        if len(set(letters)) != len(letters):
            raise ValueError(f"Einsum gradient does not support repeated indices in {term!r}")
        if ell is None:
            raise ValueError("Einsum gradient with '...' needs the operand ranks (run shape inference)")
        others = [t for k, t in enumerate(terms) if k != i]
        available = set("".join(others) + out)
        own_dots = "..." in term
        if own_dots:
            target = "".join(ch for ch in term if ch == "." or ch in available)
        else:
            target = ("..." if ell else "") + "".join(ch for ch in term if ch in available)
        eq = ",".join(others + [out]) + "->" + target
        inputs = [v for k, v in enumerate(n.inputs) if k != i] + [g[0]]
        d = b.Einsum(*inputs, equation=eq)
        if ell and not own_dots:
            d = b.reduce("ReduceSum", d, list(range(ell)), keepdims=0)
        axes = _axes_of(term, ell if own_dots else 0)
        lost = [k for k, a in enumerate(axes) if isinstance(a, str) and a not in available]
        if lost:
            # Letters summed away in the forward pass: put them back as broadcast dims.
            d = b.Unsqueeze(d, lost)
            d = b.Expand(d, b.Shape(x))
        if own_dots and ell:
            d = _sum_broadcast_ellipsis(b, n, d, x, axes, out)
        grads.append(d)
    return grads


def _sum_broadcast_ellipsis(b, n, d, x, axes, out):
    """Sum the ellipsis axes where ``x`` has size 1 and the output does not."""
    xs = x.shape
    ell_axes = [k for k, a in enumerate(axes) if isinstance(a, int)]
    if xs is not None and all(isinstance(xs[k], int) and xs[k] != 1 for k in ell_axes):
        return d
    ys = n.outputs[0].shape
    if xs is not None and ys is not None:
        y_ell = [dim for dim, a in zip(ys, _axes_of(out, len(ell_axes))) if isinstance(a, int)]
        from_shape = list(xs)
        for k, dim in zip(ell_axes, y_ell):
            from_shape[k] = dim
        return b.unbroadcast(d, from_shape, x)
    return b.unbroadcast(d, None, x)
