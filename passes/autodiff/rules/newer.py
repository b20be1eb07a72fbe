"""Gradients of ops added or extended in recent opsets: GridSample, AffineGrid, Col2Im,
CenterCropPad, Compress, MaxUnpool, LpNormalization, LRN, GlobalLpPool, Det, CumProd, Mod and
Hardmax.

Not here: Upsample (newest schema opset 10) and Scatter (opset 11) are deprecated, so no model at
the gradient builder's floor (opset 13) can hold them.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir

from passes.autodiff.registry import grad_rule
from passes.autodiff.rules.shape import _replay, _selection, flat_ids

# End index for "up to the last element" in Slice.
_TO_END = np.iinfo(np.int64).max
# Leading (batch, channel) axes of image tensors.
_LEAD = 2


def _static_rank(n, x, what: str) -> int:
    if x.rank is None:
        raise ValueError(f"{n.op_type} gradient needs the rank of {what} (run shape inference)")
    return x.rank


def _fill(b, shape, value: float, like):
    """A tensor of ``shape`` (an int64 Var) filled with ``value`` in ``like``'s dtype."""
    return b.ConstantOfShape(shape, value=ir.tensor(np.array([value], like.known_dtype.numpy())))


# ---- data movement -----------------------------------------------------------------------------

_selection("Compress", unique=True)


@grad_rule("CenterCropPad", since=18, diff_inputs=(0,))
def _center_crop_pad(b, n, g):
    """A centred crop is undone by the centred pad of the same offsets, and vice versa (both
    put the odd element last), so dX is CenterCropPad of dY back to X's sizes."""
    x, axes = n.inputs[0], n.attr("axes")
    sizes = b.Shape(x) if axes is None else b.Gather(b.Shape(x), axes, axis=0)
    return [b.CenterCropPad(g[0], sizes, axes=axes), None]


@grad_rule("Col2Im", since=18, diff_inputs=(0,))
def _col2im(b, n, g):
    """Col2Im sums blocks into an image; its adjoint extracts them (im2col): a Conv of each
    channel of dY with one one-hot kernel per block position (channels folded into the batch)."""
    x, block = n.inputs[0], n.inputs[2]
    count = b.reduce("ReduceProd", block, None, keepdims=1)
    eye = b.EyeLike(_fill(b, b.Concat(count, count, axis=0), 0.0, x))
    kernel = b.Reshape(eye, b.Concat(count, [1], block, axis=0))
    go = g[0]
    per_channel = b.Reshape(go, b.Concat([-1, 1], b.Slice(b.Shape(go), [_LEAD], [_TO_END]), axis=0))
    attrs = {k: n.attr(k) for k in ("dilations", "pads", "strides") if n.attr(k)}
    cols = b.Conv(per_channel, kernel, **attrs)
    return [b.Reshape(cols, b.Shape(x)), None, None]


# A MaxUnpool replay marks each element of X with its flat id in float32: ids are split into
# two parts below this bound, each exact in float32.
_ID_SPLIT = 4096


@grad_rule("MaxUnpool", diff_inputs=(0,))
def _max_unpool(b, n, g):
    """Y.flat[I] = X: dX = dY.flat[I], for the elements whose write survived (with repeated
    indices one write wins; replaying the op on the elements' ids tells which)."""
    x, indices = n.inputs[0], n.inputs[1]
    ids = flat_ids(b, x)
    high = b.Div(ids, b.const(np.array(_ID_SPLIT, np.int64)))
    won = None
    for part in (high, ids - high * _ID_SPLIT):
        marks = b.Cast(part + 1, to=int(ir.DataType.FLOAT))
        landed = b.Gather(b.Reshape(_replay(b, n, marks), [-1]), indices, axis=0)
        hit = b.Equal(landed, marks)
        won = hit if won is None else b.And(won, hit)
    picked = b.Gather(b.Reshape(g[0], [-1]), indices, axis=0)
    return [b.Where(won, picked, b.const(0.0, g[0].dtype))]


# ---- normalizations and pools --------------------------------------------------------------------


@grad_rule("LpNormalization")
def _lp_normalization(b, n, g):
    """y = x / ||x||_p along ``axis``: dX = (dY - dnorm * sum(dY * y)) / ||x||_p, where
    dnorm = d||x||_p / dx is sign(x) for p = 1 and y for p = 2.

    A slice of zeros has y = 0 (onnxruntime and the reference define 0/0 as 0 there), and no
    derivative: y jumps to +-e_k along every axis k (the central difference grows like 1/step).
    Its gradient is 0, the derivative of the constant branch the forward takes, not dY / 0 = inf:
    1 / ||x||_p is taken on the reduced slices (as cheap as the division it replaces) with 0 for 0.
    """
    x, y, go = n.inputs[0], n.outputs[0], g[0]
    p, axis = n.attr("p", 2), n.attr("axis", -1)
    if p not in (1, 2):
        raise ValueError(f"LpNormalization gradient supports p=1 or p=2 (the spec's), not p={p}")
    norm = b.reduce("ReduceL1" if p == 1 else "ReduceL2", x, [axis], keepdims=1)
    inv_norm = b.Where(b.Equal(norm, 0.0), 0.0, b.Reciprocal(norm), _like=norm)
    dnorm = b.Sign(x) if p == 1 else y
    return [(go - dnorm * b.reduce("ReduceSum", go * y, [axis], keepdims=1)) * inv_norm]


def _channel_window_sum(b, v, before: int, after: int):
    """Sum of ``v`` (N, C, ...) over channels c - before .. c + after (zeros outside)."""
    size = before + after + 1
    rows = b.Reshape(v, b.Concat(b.dim(v, 0), [1], b.dim(v, 1), [-1], axis=0))
    kernel = b.const(np.ones((1, 1, size, 1)), v.dtype)
    summed = b.Conv(rows, kernel, pads=[before, 0, after, 0])
    return b.Reshape(summed, b.Shape(v))


@grad_rule("LRN")
def _lrn(b, n, g):
    """y = x * s^-beta, s = bias + alpha / size * window_sum(x^2):
    dX = dY * s^-beta - 2 alpha beta / size * x * window_sum^T(dY * x * s^-beta / s)."""
    x, go = n.inputs[0], g[0]
    size = n.attr("size")
    alpha, beta, bias = n.attr("alpha", 1e-4), n.attr("beta", 0.75), n.attr("bias", 1.0)
    before, after = (size - 1) // 2, size // 2
    s = bias + (alpha / size) * _channel_window_sum(b, x * x, before, after)
    scale = b.Pow(s, b.const(-beta, x.dtype))
    spread = _channel_window_sum(b, go * x * scale / s, after, before)
    return [go * scale - (2.0 * alpha * beta / size) * x * spread]


@grad_rule("GlobalLpPool")
def _global_lp_pool(b, n, g):
    """y = (sum |x|^p)^(1/p) over the spatial axes: dX = dY * y^(1-p) * sign(x) |x|^(p-1)."""
    x, y = n.inputs[0], n.outputs[0]
    p = float(n.attr("p", 2))
    spread = g[0] * b.Pow(y, b.const(1.0 - p, y.dtype))
    return [spread * b.Sign(x) * b.Pow(b.Abs(x), b.const(p - 1.0, x.dtype))]


# ---- linear algebra and scans --------------------------------------------------------------------


@grad_rule("Det", diff_inputs=(0,))
def _det(b, n, g):
    """d det / dX[i, j] = the cofactor (-1)^(i+j) det(minor_ij): exact for singular X too.
    The minors are gathered (rows, then columns) and batched into one Det."""
    x = n.inputs[0]
    rank = _static_rank(n, x, "X")
    size = (x.shape or [None])[-1]
    if not isinstance(size, int):
        raise ValueError("Det gradient needs a static matrix size (the last dim of X)")
    go = b.Unsqueeze(g[0], [-2, -1])
    if size == 1:
        return [go]
    keep = b.const(np.array([[k for k in range(size) if k != i] for i in range(size)], np.int64))
    minors = b.Gather(b.Gather(x, keep, axis=-2), keep, axis=-1)  # [..., i, M-1, j, M-1]
    batch = list(range(rank - 2))
    minors = b.Transpose(minors, perm=batch + [rank - 2, rank, rank - 1, rank + 1])
    signs = (-1.0) ** np.add.outer(np.arange(size), np.arange(size))
    return [go * b.Det(minors) * b.const(signs, x.dtype)]


@grad_rule("CumProd", since=26, diff_inputs=(0,))
def _cumprod(b, n, g):
    """dX_j = sum over the outputs i that hold x_j of dY_i * (product of their other factors),
    exact where x has zeros: with x' = x (zeros as 1) and Z = the count of zeros in each
    product, that product is Y'_i / x'_j where no zero but x_j's own enters Y_i, else 0."""
    x, axis, go = n.inputs[0], n.inputs[1], g[0]
    exclusive, reverse = n.attr("exclusive", 0), n.attr("reverse", 0)
    is_zero = b.Equal(x, 0.0)
    nonzero = b.Where(is_zero, 1.0, x, _like=x)
    prods = b.CumProd(nonzero, axis, exclusive=exclusive, reverse=reverse)
    zeros = b.CumSum(b.CastLike(is_zero, x), axis, exclusive=exclusive, reverse=reverse)

    def gather_back(count: float):
        terms = b.Where(b.Equal(zeros, count), go * prods, 0.0, _like=x)
        return b.CumSum(terms, axis, exclusive=exclusive, reverse=1 - reverse)

    return [b.Where(is_zero, gather_back(1.0), gather_back(0.0)) / nonzero, None]


# ---- elementwise ---------------------------------------------------------------------------------


@grad_rule("Mod", broadcast=True)
def _mod(b, n, g):
    """C = A - q * B, q = trunc(A / B) (fmod=1) or floor(A / B) (fmod=0), locally constant:
    dA = dC, dB = -q * dC, with q read back from C (the runtime's own quotient)."""
    a, c = n.inputs
    quotient = b.Round((a - n.outputs[0]) / c)
    return [g[0] if n.needs_grad(0) else None, -(g[0] * quotient) if n.needs_grad(1) else None]


@grad_rule("Hardmax")
def _hardmax(b, n, g):
    """A one-hot of the argmax: piecewise constant, its gradient is zero."""
    return [None]


@grad_rule("Shrink", since=9)
def _shrink(b, n, g):
    """``x - bias`` above ``lambd``, ``x + bias`` below ``-lambd``, 0 between: slope 1 outside."""
    x = n.inputs[0]
    lambd = float(n.attr("lambd", 0.5))
    outside = b.Greater(b.Abs(x), b.const(lambd, x.dtype))
    return [b.Where(outside, g[0], b.const(0.0, x.dtype))]


# ---- sampling grids ------------------------------------------------------------------------------


@grad_rule("AffineGrid", since=20, diff_inputs=(0,))
def _affine_grid(b, n, g):
    """grid[n, p] = theta[n] @ [base(p), 1]: linear in theta, so d theta[n] = dgrid[n]^T @ B,
    where B[p, j] (the base coordinates and the ones column) is read from AffineGrid itself on
    the thetas whose first row is e_j (its align_corners conventions included)."""
    theta, size, go = n.inputs[0], n.inputs[1], g[0]
    dims = (theta.shape or [None, None])[-2]
    if not isinstance(dims, int):  # size holds (N, C) and the spatial sizes
        count = (size.shape or [None])[0]
        dims = count - _LEAD if isinstance(count, int) else None
    if dims not in (2, 3):
        raise ValueError("AffineGrid gradient needs theta's shape (N, 2, 3) or (N, 3, 4)")
    basis = np.zeros((dims + 1, dims, dims + 1))
    basis[np.arange(dims + 1), 0, np.arange(dims + 1)] = 1.0
    sizes = b.Concat([dims + 1], b.Slice(size, [1], [_TO_END]), axis=0)
    base_grid = b.AffineGrid(b.const(basis, theta.dtype), sizes, align_corners=n.attr("align_corners", 0))
    base = b.Reshape(b.Gather(base_grid, b.const(np.array(0, np.int64)), axis=-1), [dims + 1, -1])
    rows = b.Transpose(b.Reshape(go, b.Concat(b.dim(go, 0), [-1, dims], axis=0)), perm=[0, 2, 1])
    return [b.MatMul(rows, b.Transpose(base, perm=[1, 0])), None]


# GridSample's opset 16 mode names.
_GRID_MODES = {"bilinear": "linear", "bicubic": "cubic"}
_GRID_PADDINGS = ("zeros", "border", "reflection")
# Keys' cubic convolution coefficient (PyTorch's, ONNX's).
_CUBIC_A = -0.75


def _cubic_near(b, t):
    """Keys' kernel and its derivative for 0 <= t <= 1."""
    a = _CUBIC_A
    return ((a + 2) * t - (a + 3)) * t * t + 1.0, (3.0 * (a + 2) * t - 2.0 * (a + 3)) * t


def _cubic_far(b, t):
    """Keys' kernel and its derivative for 1 <= t <= 2."""
    a = _CUBIC_A
    return ((a * t - 5.0 * a) * t + 8.0 * a) * t - 4.0 * a, (3.0 * a * t - 10.0 * a) * t + 8.0 * a


def _reflect(b, v, lo, hi):
    """``v`` reflected into [lo, hi] (GridSample's, repeated reflections), and d/dv (+-1).
    The span is 0 (a side of 1 with align_corners) or at least 1: a period of 1 maps every
    integral tap of a side of 1 to its one element."""
    span = hi - lo
    period = b.Max(span * 2.0, 1.0)
    t = v - lo
    t = t - b.Floor(t / period) * period
    u = t - span
    return lo + span - b.Abs(u), -b.Sign(u)


class _GridAxis:
    """One spatial axis of a GridSample: where each output point samples it.

    ``taps`` lists (int64 index into the axis, weight, d weight / d coordinate) per tap,
    indices already mapped by the padding mode; weights are None for 1 (nearest without zeros
    padding) and derivatives None for nearest. ``slope`` is d coordinate / d grid value.
    """

    def __init__(self, b, x, grid, axis: int, dims: int, mode: str, padding: str, align: bool):
        self.b, self.padding = b, padding
        self.size = b.Reshape(b.dim(x, _LEAD + axis), [])
        length = b.CastLike(self.size, grid)
        # the grid's last axis lists coordinates innermost spatial axis first
        coord = b.Reshape(b.Gather(grid, b.const(np.array(dims - 1 - axis, np.int64)), axis=-1), [0, 1, -1])
        self.length = length
        if align:
            pos, scale = (coord + 1.0) * ((length - 1.0) / 2.0), (length - 1.0) / 2.0
            self.lo, self.hi = b.const(0.0, grid.dtype), length - 1.0
        else:
            pos, scale = ((coord + 1.0) * length - 1.0) / 2.0, length / 2.0
            self.lo, self.hi = b.const(-0.5, grid.dtype), length - 0.5
        if mode == "nearest":
            pos = b.Round(pos)
        # cubic pads its taps only (as onnxruntime and torch do; the reference evaluator also
        # clamps the coordinate with border padding, a different function)
        pos, slope = (pos, None) if mode == "cubic" else self._pad_coordinate(pos)
        self.slope = scale if slope is None else scale * slope
        self.taps = self._taps(pos, mode)

    def _outside(self, v):
        return self.b.Or(self.b.Less(v, self.lo), self.b.Greater(v, self.hi))

    def _pad_coordinate(self, pos):
        """Coordinates outside [lo, hi] are clamped (border) or reflected (reflection)."""
        b = self.b
        if self.padding == "zeros":
            return pos, None
        out = self._outside(pos)
        if self.padding == "border":
            moved, slope = b.Max(b.Min(pos, self.length - 1.0), 0.0), 0.0
        else:
            moved, slope = _reflect(b, pos, self.lo, self.hi)
        return b.Where(out, moved, pos), b.Where(out, slope, 1.0, _like=pos)

    def _taps(self, pos, mode: str):
        b = self.b
        if mode == "nearest":
            return [self._tap(pos, None, None)]
        start = b.Floor(pos)
        f = pos - start
        if mode == "linear":
            one = b.const(1.0, pos.dtype)
            return [self._tap(start, 1.0 - f, -one), self._tap(start + 1.0, f, one)]
        w0, d0 = _cubic_far(b, f + 1.0)
        w1, d1 = _cubic_near(b, f)
        w2, d2 = _cubic_near(b, 1.0 - f)
        w3, d3 = _cubic_far(b, 2.0 - f)
        return [self._tap(start - 1.0, w0, d0), self._tap(start, w1, d1),
                self._tap(start + 1.0, w2, -d2), self._tap(start + 2.0, w3, -d3)]

    def _tap(self, index, weight, dweight):
        """Map a (float, integral) tap index by the padding mode; zeros padding masks it."""
        b = self.b
        if self.padding == "zeros":
            valid = b.And(b.GreaterOrEqual(index, 0.0), b.Less(index, self.length))
            mask = b.CastLike(valid, index)
            index = b.Where(valid, index, 0.0, _like=index)
            weight = mask if weight is None else weight * mask
            dweight = None if dweight is None else dweight * mask
        elif self.padding == "border":
            index = b.Max(b.Min(index, self.length - 1.0), 0.0)
        else:
            index = b.Where(self._outside(index), _reflect(b, index, self.lo, self.hi)[0], index)
        return b.Cast(b.Round(index), to=int(ir.DataType.INT64)), weight, dweight


def _product(b, factors):
    """The product of the non-None factors (None when there is none)."""
    out = None
    for f in factors:
        if f is not None:
            out = f if out is None else out * f
    return out


@grad_rule("GridSample", since=16)
def _grid_sample(b, n, g):
    """Y[n, c, p] = sum over taps t of w_t(p) X[n, c, s_t(p)], taps and weights per axis
    (1 nearest, 2 linear, 4 cubic); the padding mode maps the coordinates (nearest, linear)
    and the taps, as onnxruntime does. dX scatter-adds dY * w_t at s_t; dgrid sums
    dY * X[s_t] * dw_t/dgrid."""
    x, grid, go = n.inputs[0], n.inputs[1], g[0]
    dims = _static_rank(n, x, "X") - _LEAD
    mode = n.attr("mode", "linear" if n.opset >= 20 else "bilinear")
    mode = _GRID_MODES.get(mode, mode)
    padding = n.attr("padding_mode", "zeros")
    if mode not in ("nearest", "linear", "cubic") or padding not in _GRID_PADDINGS:
        raise ValueError(f"GridSample gradient does not support mode={mode!r}, padding_mode={padding!r}")
    axes = [_GridAxis(b, x, grid, a, dims, mode, padding, bool(n.attr("align_corners", 0)))
            for a in range(dims)]
    flat_x = b.Reshape(x, [0, 0, -1])
    flat_g = b.Reshape(go, [0, 0, -1])
    taps = []  # (spatial flat index expanded over channels, per-axis (weight, dweight))
    for combo in itertools.product(*(axis.taps for axis in axes)):
        index = combo[0][0]
        for axis, tap in zip(axes[1:], combo[1:]):
            index = index * axis.size + tap[0]
        taps.append((b.Expand(index, b.Shape(flat_g)), [(w, d) for _, w, d in combo]))
    grads = [None, None]
    if n.needs_grad(0):
        spread = [(idx, _product(b, [flat_g] + [w for w, _ in parts])) for idx, parts in taps]
        scattered = b.ScatterElements(b.zeros_like(flat_x), b.Concat(*[i for i, _ in spread], axis=2),
                                      b.Concat(*[u for _, u in spread], axis=2), axis=2, reduction="add")
        grads[0] = b.Reshape(scattered, b.Shape(x))
    if n.needs_grad(1) and mode != "nearest":
        # dY . X[s_t] summed over channels, per tap, then the weight derivative along each axis
        seen = [b.ReduceSum(flat_g * b.GatherElements(flat_x, idx, axis=2), [1], keepdims=1)
                for idx, _ in taps]
        comps = []
        for a in reversed(range(dims)):
            terms = [_product(b, [s] + [d if k == a else w for k, (w, d) in enumerate(parts)])
                     for s, (_, parts) in zip(seen, taps)]
            comps.append(b.Sum(*terms) * axes[a].slope)
        stacked = b.Transpose(b.Concat(*comps, axis=1), perm=[0, 2, 1])
        grads[1] = b.Reshape(stacked, b.Shape(grid))
    return grads
