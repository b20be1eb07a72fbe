"""Gradients of convolutions and pooling: Conv, ConvTranspose, MaxPool, AveragePool, LpPool, Global*
(DeformConv: deform_conv.py).

All of them are built from one piece of window geometry, computed from runtime shapes
so that symbolic dims and every ``auto_pad`` mode work (spatial values are int64
vectors with one entry per spatial axis):

- ``eff_k = (k - 1) * dilation + 1`` is the extent of one window,
- ``pb`` the padding before each axis, ``full = (out - 1) * stride + eff_k`` the extent
  of the padded input that the windows cover.

The adjoint of a (grouped) correlation is a ``ConvTranspose`` without pads, whose result
covers ``full``; a ``Pad`` with pads ``[-pb, in + pb - full]`` (negative pads crop)
aligns it with the input. With stride 1 and static shapes it is a ``Conv`` instead
(:func:`_input_grad_as_conv`: faster in onnxruntime). The weight gradient is a correlation of the input with the
output gradient, computed as a ``Conv`` with the batch axis as channels
(:func:`_correlate`). Pools fold channels into the batch and use a ones kernel.

``out`` is always read from the runtime shape of dY, never from attributes or inferred
shapes: with ``ceil_mode`` onnxruntime drops a last window that starts in the end padding,
which ONNX shape inference before opset 22 keeps (it infers one window more than runs).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from passes.autodiff.registry import grad_rule
from passes.autodiff.rules.shape import scatter_back

# End index for "up to the last element" in Slice.
_TO_END = np.iinfo(np.int64).max
# Leading (batch, channel) axes of every conv/pool tensor.
_LEAD = 2
_SAME = ("SAME_UPPER", "SAME_LOWER")


# ---- geometry ------------------------------------------------------------------------------


def _spatial_rank(n, *candidates) -> int:
    """Number of spatial axes, from an attribute list or a known input rank."""
    for c in candidates:
        if isinstance(c, list):
            return len(c)
        if c is not None and c.rank is not None:
            return c.rank - _LEAD
    raise ValueError(f"{n.op_type} gradient needs the input rank (run shape inference)")


def _ints(n, name: str, dims: int, default: int) -> list[int]:
    value = n.attr(name)
    return list(value) if value else [default] * dims


def _spatial(b, x):
    """int64 vector of the spatial dims of ``x`` (``Shape(x)[2:]``)."""
    return b.Slice(b.Shape(x), [_LEAD], [_TO_END])


def _window_extent(b, kernel, dilations):
    """``(k - 1) * d + 1`` per axis; ``kernel`` is an int64 Var or a list."""
    if isinstance(kernel, list):
        return b.const(np.array([(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)], np.int64))
    return (kernel - 1) * dilations + 1


def _same_split(b, total, upper: bool):
    """Begin padding of a SAME split: the odd element goes last (upper) or first (lower)."""
    half = b.Div(total, b.const(np.array(2, np.int64)))
    return half if upper else total - half


def _begin_pads(b, n, dims, in_sp, out_sp, eff_k, strides):
    """Padding before each spatial axis of a Conv or pool, every ``auto_pad`` mode."""
    auto_pad = n.attr("auto_pad", "NOTSET")
    if auto_pad in _SAME:
        total = b.Max((out_sp - 1) * strides + eff_k - in_sp, b.const(np.zeros(dims, np.int64)))
        return _same_split(b, total, auto_pad == "SAME_UPPER")
    if auto_pad == "VALID":
        return b.const(np.zeros(dims, np.int64))
    return b.const(np.array(_ints(n, "pads", 2 * dims, 0)[:dims], np.int64))


def _end_pads(b, n, dims, in_sp, out_sp, eff_k, strides, pb):
    """Padding after each spatial axis (explicit, or what SAME adds after ``pb``)."""
    auto_pad = n.attr("auto_pad", "NOTSET")
    if auto_pad in _SAME:
        total = b.Max((out_sp - 1) * strides + eff_k - in_sp, b.const(np.zeros(dims, np.int64)))
        return total - pb
    if auto_pad == "VALID":
        return b.const(np.zeros(dims, np.int64))
    return b.const(np.array(_ints(n, "pads", 2 * dims, 0)[dims:], np.int64))


def _pad_spatial(b, x, begin, end):
    """Pad (or crop, where negative) the spatial axes of ``x`` with zeros."""
    lead = b.const(np.zeros(_LEAD, np.int64))
    return b.Pad(x, b.Concat(lead, begin, lead, end, axis=0), mode="constant")


def _strided(b, values: list[int]):
    return b.const(np.array(values, np.int64))


# ---- the two adjoints ----------------------------------------------------------------------


def _input_grad(b, go, kernel, in_sp, pb, eff_k, strides, dilations, group=1, full=None):
    """Adjoint of ``Conv(pad(x), kernel)`` w.r.t. x (pads given by ``pb``, runtime sizes unless
    ``full`` is given)."""
    if full is None:
        full = (_spatial(b, go) - 1) * _strided(b, strides) + eff_k
    spread = b.ConvTranspose(go, kernel, strides=strides, dilations=dilations, group=group)
    return _pad_spatial(b, spread, -pb, in_sp + pb - full)


def _input_grad_cropped(b, go, w, static, strides, dilations, group):
    """Static geometry: the ``ConvTranspose`` crops and extends to x's size itself (its ``pads``
    and ``output_padding``), no ``Pad`` after it: ``full - in - pb`` rows past x's end are
    cropped, or ``in + pb - full`` rows x has past the last window get zeros (fewer than a
    stride; ``output_padding`` must be below it)."""
    crop, extend = np.maximum(static.pe, 0), np.maximum(-static.pe, 0)
    if (extend >= np.array(strides)).any():  # onnxruntime refuses output_padding >= stride
        return None
    return b.ConvTranspose(go, w, strides=list(strides), dilations=list(dilations), group=group,
                           pads=[int(v) for v in (*static.pb, *crop)], output_padding=[int(v) for v in extend])


def _input_grad_as_conv(b, go, w, static, strides, dilations, group, dims):
    """Stride 1 with static geometry: the adjoint as one ``Conv`` of dY with the kernel's
    channel axes swapped (per group) and its taps flipped, padded ``eff_k - 1 - pb`` before and
    ``eff_k - 1 - pe`` after each axis, which yields x's size directly; None where a stride is
    not 1 or a forward pad exceeds the window (a negative pad).

    onnxruntime's CPU ConvTranspose is a GEMM and a col2im, then the crop: on ResNet-18's 3x3
    shapes at batch 32 (64@32x32 ... 512@4x4) the Conv took 0.43-0.78x its time, 0.87x at
    16@32x32, 0.76-1.05x depthwise (the two forms of one op in one process, medians of 7 runs)."""
    if any(s != 1 for s in strides):
        return None
    begin, end = static.eff_k - 1 - static.pb, static.eff_k - 1 - static.pe
    if (begin < 0).any() or (end < 0).any():
        return None
    sp = list(range(_LEAD, _LEAD + dims))
    flipped = _flipped_taps(b, w, dims)
    if group == 1:  # a Transpose last: onnxruntime merges it with one that follows
        kernel = b.Transpose(flipped, perm=[1, 0] + sp)
    else:  # (M, C/g, k) -> (g, M/g, C/g, k) -> (g, C/g, M/g, k) -> (C, M/g, k)
        split = b.Reshape(flipped, b.Concat(b.const(np.array([group, -1], np.int64)),
                                            b.Slice(b.Shape(w), [1], [_TO_END]), axis=0))
        swapped = b.Transpose(split, perm=[0, 2, 1] + [a + 1 for a in sp])
        kernel = b.Reshape(swapped, b.Concat(b.const(np.array([-1], np.int64)),
                                             b.Slice(b.Shape(swapped), [2], [_TO_END]), axis=0))
    return b.Conv(go, kernel, pads=[int(v) for v in begin] + [int(v) for v in end],
                  dilations=list(dilations), group=group)


_REVERSIBLE = {ir.DataType.FLOAT: np.float32, ir.DataType.DOUBLE: np.float64}
# The reversal matrix is taps x taps: up to 7x7x7 kernels (0.5 MB in float32), a Slice above.
_MAX_REVERSAL_TAPS = 343


def _flipped_taps(b, w, dims):
    """The kernel with its taps reversed along every spatial axis (static kernel sizes). Reversing
    every axis reverses the flattened taps: for float32 / float64 one ``MatMul`` by the
    reversal matrix (exact: each tap times 1 plus zeros; a -0.0 tap becomes +0.0, an inf or NaN
    tap makes its whole row NaN), 0.3 against 1.5 ms for onnxruntime's ``Slice`` with step -1
    on a [256, 256, 3, 3] kernel, which copies element by element; a ``Slice`` otherwise and
    above ``_MAX_REVERSAL_TAPS`` taps."""
    taps = int(np.prod(list(w.shape)[_LEAD:]))
    if w.dtype not in _REVERSIBLE or taps == 1 or taps > _MAX_REVERSAL_TAPS:
        sp = list(range(_LEAD, _LEAD + dims))
        return w if taps == 1 else b.Slice(w, [-1] * dims, [np.iinfo(np.int64).min] * dims, sp, [-1] * dims)
    reversal = np.eye(taps, dtype=_REVERSIBLE[w.dtype])[::-1].copy()
    return b.Reshape(b.MatMul(b.Reshape(w, [0, 0, -1]), b.const(reversal)), b.Shape(w))


def _correlate(b, a, src, group, strides, dilations, dims, pads=None):
    """R[cb, ca, k] = sum_n,i a[n, grp(cb) * Ca/g + ca, k * strides + i * dilations] * src[n, cb, i].

    ``a`` is (N, Ca, ...), ``src`` (N, Cb, ...); the result (Cb, Ca/g, K) is a grouped
    Conv whose batch is Ca/g, whose channels are (group, N) and whose weight is ``src``
    with N as its input channels. ``pads`` (begin..., end..., non-negative ints) pad ``a``:
    the Conv's own attribute (passes.kernels.conv_weight_gemm's gather forms read zeros there).
    """
    sp = list(range(_LEAD, _LEAD + dims))
    padding = {"pads": pads} if pads else {}
    if group == 1:  # (N, Ca, ...) -> (Ca, N, ...): a Transpose that may merge with the next
        out = b.Conv(b.Transpose(a, perm=[1, 0] + sp), b.Transpose(src, perm=[1, 0] + sp),
                     strides=strides, dilations=dilations, **padding)
        return b.Transpose(out, perm=[1, 0] + sp)
    shape_a = b.Shape(a)
    split = b.Concat(b.Slice(shape_a, [0], [1]), [group, -1], b.Slice(shape_a, [_LEAD], [_TO_END]), axis=0)
    grouped = b.Transpose(b.Reshape(a, split), perm=[2, 1, 0] + [s + 1 for s in sp])
    data = b.Reshape(grouped, b.Concat([0, -1], b.Slice(shape_a, [_LEAD], [_TO_END]), axis=0))
    weight = b.Transpose(src, perm=[1, 0] + sp)
    out = b.Conv(data, weight, group=group, strides=strides, dilations=dilations, **padding)
    return b.Transpose(out, perm=[1, 0] + sp)


def _bias_grad(b, go, dims):
    return b.reduce("ReduceSum", go, [0] + list(range(_LEAD, _LEAD + dims)), keepdims=0)


# ---- Conv / ConvTranspose --------------------------------------------------------------------


def _conv_attrs(n) -> tuple[int, list[int], list[int], int]:
    """(dims, strides, dilations, group) of a Conv or ConvTranspose node."""
    dims = _spatial_rank(n, n.attr("kernel_shape"), n.inputs[1], n.inputs[0])
    return dims, _ints(n, "strides", dims, 1), _ints(n, "dilations", dims, 1), n.attr("group", 1)


def _conv_geometry(b, n, go):
    """(dims, strides, dilations, group, input/output spatial sizes, dilated kernel extent)."""
    dims, strides, dilations, group = _conv_attrs(n)
    eff_k = _window_extent(b, _spatial(b, n.inputs[1]), _strided(b, dilations))
    return dims, strides, dilations, group, _spatial(b, n.inputs[0]), _spatial(b, go), eff_k


class _Static(NamedTuple):
    """A Conv's window geometry as int64 arrays (the sizes the runtime branch computes)."""

    in_sp: np.ndarray
    pb: np.ndarray  # begin pads
    full: np.ndarray  # extent of the padded input the windows cover
    eff_k: np.ndarray

    @property
    def pe(self) -> np.ndarray:
        """End pads the windows use: negative where x has rows past the last window (a crop)."""
        return self.full - self.in_sp - self.pb


def _static_conv_geometry(n, x, w):
    """(in, begin pads, full, eff_k) as int64 arrays when x's and w's spatial dims are static
    (the sizes the runtime branch computes; constants let shape inference see the padded
    input, which passes.kernels.conv_weight_gemm needs), else None."""
    if x.shape is None or w.shape is None or x.rank is None or w.rank != x.rank:
        return None
    spatial = list(x.shape)[_LEAD:] + list(w.shape)[_LEAD:]
    if not all(isinstance(d, int) for d in spatial):
        return None
    dims = x.rank - _LEAD
    in_sp, kernel = np.array(spatial[:dims], np.int64), np.array(spatial[dims:], np.int64)
    strides = np.array(_ints(n, "strides", dims, 1), np.int64)
    eff_k = (kernel - 1) * np.array(_ints(n, "dilations", dims, 1), np.int64) + 1
    auto_pad = n.attr("auto_pad", "NOTSET")
    if auto_pad in _SAME:
        out = -(-in_sp // strides)
        total = np.maximum((out - 1) * strides + eff_k - in_sp, 0)
        pb = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
    else:
        pads = np.array(_ints(n, "pads", 2 * dims, 0), np.int64) if auto_pad != "VALID" else np.zeros(2 * dims, np.int64)
        pb = pads[:dims]
        out = (in_sp + pads[:dims] + pads[dims:] - eff_k) // strides + 1
    if np.any(out < 1):
        return None
    return _Static(in_sp, pb, (out - 1) * strides + eff_k, eff_k)


@grad_rule("Conv")
def _conv(b, n, g):
    """dX: unpadded ConvTranspose, then crop; dW: correlation of padded X with dY. With static
    spatial sizes (:func:`_static_conv_geometry`) the pads and crops are attributes and no
    runtime geometry is built unless a fallback needs it."""
    x, w, go = n.inputs[0], n.inputs[1], g[0]
    static = _static_conv_geometry(n, x, w)
    dims, strides, dilations, group = _conv_attrs(n)

    def geometry():  # (in, begin pads, full, end pads, eff_k) as graph values
        if static is not None:
            return tuple(b.const(v) for v in (static.in_sp, static.pb, static.full, static.pe, static.eff_k))
        _, _, _, _, in_sp, out_sp, eff_k = _conv_geometry(b, n, go)
        pb = _begin_pads(b, n, dims, in_sp, out_sp, eff_k, _strided(b, strides))
        full = (out_sp - 1) * _strided(b, strides) + eff_k
        return in_sp, pb, full, full - in_sp - pb, eff_k

    grads = [None] * len(n.inputs)
    if n.needs_grad(0):
        direct = None if static is None else _input_grad_as_conv(b, go, w, static, strides, dilations,
                                                                 group, dims)
        if direct is None and static is not None:
            direct = _input_grad_cropped(b, go, w, static, strides, dilations, group)
        if direct is None:
            in_sp, pb, full, _, eff_k = geometry()
            direct = _input_grad(b, go, w, in_sp, pb, eff_k, strides, dilations, group, full)
        grads[0] = direct
    if n.needs_grad(1):
        pads = None if static is None else [int(v) for v in (*static.pb, *static.pe)]
        if pads is not None and min(pads) >= 0:
            grads[1] = _correlate(b, x, go, group, dilations, strides, dims, pads if any(pads) else None)
        else:  # runtime sizes, or a negative end pad (a crop)
            _, pb, _, pe, _ = geometry()
            grads[1] = _correlate(b, _pad_spatial(b, x, pb, pe), go, group, dilations, strides, dims)
    if n.needs_grad(2):
        grads[2] = _bias_grad(b, go, dims)
    return grads


def _transpose_begin_pads(b, n, dims, full, out_sp):
    """Crop before each axis of ConvTranspose's full output (onnxruntime's convention)."""
    auto_pad = n.attr("auto_pad", "NOTSET")
    if n.attr("output_shape") or auto_pad in _SAME:
        total = b.Max(full - out_sp, b.const(np.zeros(dims, np.int64)))
        return _same_split(b, total, auto_pad == "SAME_UPPER")
    if auto_pad == "VALID":
        return b.const(np.zeros(dims, np.int64))
    return b.const(np.array(_ints(n, "pads", 2 * dims, 0)[:dims], np.int64))


@grad_rule("ConvTranspose")
def _conv_transpose(b, n, g):
    """Un-crop dY to the full output (minus output_padding); dX is a Conv of it, dW a correlation."""
    x, w, go = n.inputs[0], n.inputs[1], g[0]
    dims, strides, dilations, group, in_sp, out_sp, eff_k = _conv_geometry(b, n, go)
    core = (in_sp - 1) * _strided(b, strides) + eff_k
    full = core + _strided(b, _ints(n, "output_padding", dims, 0))
    pb = _transpose_begin_pads(b, n, dims, full, out_sp)
    g_core = _pad_spatial(b, go, pb, core - pb - out_sp)
    grads = [None] * len(n.inputs)
    if n.needs_grad(0):
        grads[0] = b.Conv(g_core, w, strides=strides, dilations=dilations, group=group)
    if n.needs_grad(1):
        grads[1] = _correlate(b, g_core, x, group, dilations, strides, dims)
    if n.needs_grad(2):
        grads[2] = _bias_grad(b, go, dims)
    return grads


# ---- pools ---------------------------------------------------------------------------------


class _Pool:
    """Window geometry of a pooling node, with channels folded into the batch axis."""

    def __init__(self, b, n, go):
        self.b, self.x = b, n.inputs[0]
        kernel = n.attr("kernel_shape")
        self.dims = _spatial_rank(n, kernel)
        self.strides = _ints(n, "strides", self.dims, 1)
        self.dilations = _ints(n, "dilations", self.dims, 1)
        self.in_sp, self.out_sp = _spatial(b, self.x), _spatial(b, go)
        self.eff_k = _window_extent(b, kernel, self.dilations)
        stride_vec = _strided(b, self.strides)
        self.pb = _begin_pads(b, n, self.dims, self.in_sp, self.out_sp, self.eff_k, stride_vec)
        self.pe = _end_pads(b, n, self.dims, self.in_sp, self.out_sp, self.eff_k, stride_vec, self.pb)
        self.full = (self.out_sp - 1) * stride_vec + self.eff_k
        self.kernel_shape = [1, 1] + list(kernel)
        self.ones_kernel = b.const(np.ones(self.kernel_shape), self.x.dtype)

    def may_miss_input(self) -> bool:
        """Whether a window can have no tap inside x: only with dilation (pads < kernel)."""
        return any(d > 1 for d in self.dilations)

    def fold(self, v):
        """(N, C, ...) -> (N*C, 1, ...)."""
        return self.b.Reshape(v, self.b.Concat([-1, 1], _spatial(self.b, v), axis=0))

    def window_sum_adjoint(self, go_folded):
        """Adjoint of the sum over each window (zero padding), reshaped like x."""
        b = self.b
        dx = _input_grad(b, go_folded, self.ones_kernel, self.in_sp, self.pb, self.eff_k,
                         self.strides, self.dilations)
        return b.Reshape(dx, b.Shape(self.x))

    def window_counts(self, include_pad: bool, dtype=None):
        """(1, 1, *out) number of window taps inside x (or inside x and its pads), in ``dtype``
        (default x's)."""
        b = self.b
        dtype = dtype or self.x.dtype
        begin = b.const(np.zeros(self.dims, np.int64)) if include_pad else self.pb
        length = self.in_sp + self.pb + self.pe if include_pad else self.in_sp
        ones = b.ConstantOfShape(b.Concat([1, 1], length, axis=0), value=_scalar_tensor(1.0, dtype))
        region = _pad_spatial(b, ones, begin, self.full - length - begin)
        kernel = self.ones_kernel if dtype == self.x.dtype else b.const(np.ones(self.kernel_shape), dtype)
        return b.Conv(region, kernel, strides=self.strides, dilations=self.dilations)


def _scalar_tensor(value: float, dtype):
    """A 1-element tensor attribute value (for ConstantOfShape)."""
    return ir.tensor(np.array([value], dtype=dtype.numpy()))


# ---- pools whose windows tile the input (kernel == stride) --------------------------------


def _tiled(n) -> list[int] | None:
    """The kernel of a pool whose windows tile the input without overlap or padding (kernel ==
    strides, no dilation, zero pads, NOTSET or VALID), else None. Its backward needs no scatter
    nor ConvTranspose: each window is an axis pair of a reshape of x."""
    kernel = list(n.attr("kernel_shape") or [])
    dims = len(kernel)
    if not kernel or _ints(n, "strides", dims, 1) != kernel or any(d != 1 for d in _ints(n, "dilations", dims, 1)):
        return None
    if n.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or any(_ints(n, "pads", 2 * dims, 0)):
        return None
    if n.attr("ceil_mode", 0):  # a last, partial window: the general rule
        return None
    return kernel


class _Tiles:
    """x cropped to the rows and columns the windows cover (none where x's static sizes are
    multiples of the kernel), a way to fill each window with one value of the output's shape,
    and the way back to x's shape (zero gradient where no window reaches: the pool drops it)."""

    def __init__(self, b, x, go, kernel: list[int]):
        self.b, self.x, self.kernel = b, x, kernel
        dims = len(kernel)
        spatial = list(x.shape)[_LEAD:] if x.shape is not None else None
        self.exact = spatial is not None and all(isinstance(d, int) and d % k == 0
                                                 for d, k in zip(spatial, kernel, strict=True))
        self.cropped, self.covered = x, None
        if not self.exact:
            self.covered = _spatial(b, go) * _strided(b, kernel)
            zero = b.const(np.zeros(dims, np.int64))
            self.cropped = b.Slice(x, zero, self.covered, list(range(_LEAD, _LEAD + dims)))

    def upsample(self, v):
        """y-like -> the cropped x's shape, each window filled with its value (a nearest Resize:
        onnxruntime's Expand copies an inner broadcast axis one element at a time, 10x slower)."""
        scales = self.b.const(np.array([1.0, 1.0, *self.kernel], np.float32))
        return self.b.Resize(v, None, scales, mode="nearest", coordinate_transformation_mode="asymmetric",
                             nearest_mode="floor")

    def back(self, flat):
        """The cropped x's shape -> x's, zeros where no window reaches."""
        if self.exact:
            return flat
        b = self.b
        zero = b.const(np.zeros(len(self.kernel), np.int64))
        return _pad_spatial(b, flat, zero, _spatial(b, self.x) - self.covered)


def _first_max_mask(b, tiles, y):
    """True at the first (row-major) position of each window that holds its maximum ``y``, the
    one torch's and onnxruntime's max pools pick: a tie (the zeros after a ReLU) passes the
    gradient once. Among the hits, each scores ``taps - index`` (a kernel-shaped pattern tiled
    by Resize); the highest score (a MaxPool of the scores) wins."""
    kernel = tiles.kernel
    taps = int(np.prod(kernel))
    pattern = (taps - np.arange(taps)).astype(np.float32).reshape([1, 1, *kernel])
    priority = b.Tile(b.const(pattern), b.Concat(b.const(np.ones(_LEAD, np.int64)),
                                               b.Slice(b.Shape(y), [_LEAD], [_TO_END]), axis=0))
    score = b.CastLike(b.Equal(tiles.cropped, tiles.upsample(y)), priority) * priority
    best = b.MaxPool(score, kernel_shape=kernel, strides=kernel)
    return b.Equal(score, tiles.upsample(best))


@grad_rule("AveragePool")
def _average_pool(b, n, g):
    """dX = window-sum adjoint of dY / count (count of in-bounds taps, or of taps in the pads too);
    windows that tile x (kernel == stride, no pads): dY / taps expanded over each window.

    A dilated window can hold padding only (count 0, y = 0): its dY reaches no input; a count
    of 1 keeps it finite (not inf) on its way into the pads that are cropped away.
    """
    kernel = _tiled(n)
    if kernel is not None:
        tiles = _Tiles(b, n.inputs[0], g[0], kernel)
        return [tiles.back(tiles.upsample(g[0] / float(np.prod(kernel))))]
    pool = _Pool(b, n, g[0])
    counts = pool.window_counts(bool(n.attr("count_include_pad", 0)))
    if pool.may_miss_input():
        counts = b.Max(counts, b.const(np.array(1.0), pool.x.dtype))
    return [pool.window_sum_adjoint(pool.fold(g[0]) / counts)]


@grad_rule("LpPool")
def _lp_pool(b, n, g):
    """y = (sum |x|^p)^(1/p): dX = sign(x) |x|^(p-1) * adjoint(dY * y^(1-p))."""
    x, y = n.inputs[0], n.outputs[0]
    p = float(n.attr("p", 2))
    pool = _Pool(b, n, g[0])
    spread = pool.window_sum_adjoint(pool.fold(g[0] * b.Pow(y, b.const(1.0 - p, y.dtype))))
    return [spread * b.Sign(x) * b.Pow(b.Abs(x), b.const(p - 1.0, x.dtype))]


@grad_rule("MaxPool")
def _max_pool(b, n, g):
    """Windows that tile x (kernel == stride): dY where x is its window's first maximum
    (:func:`_first_max_mask`). Else scatter-add dY at the argmax positions (the Indices output,
    or a re-run that makes it; with storage_order=1 the Indices are column-major, so the re-run
    asks for row-major ones)."""
    if g[0] is None:
        return [None]
    x, go = n.inputs[0], g[0]
    kernel = _tiled(n)
    if kernel is not None:
        tiles = _Tiles(b, x, go, kernel)
        mask = _first_max_mask(b, tiles, n.outputs[0])
        return [tiles.back(b.CastLike(mask, go) * tiles.upsample(go))]
    if n.has_output(1) and n.attr("storage_order", 0) == 0:
        indices = n.outputs[1]
    else:
        attrs = {k: n.attr(k) for k in n.node.attributes if k != "storage_order"}
        indices = b.op("MaxPool", x, _outputs=2, **attrs)[1]
    if any(d > 1 for d in n.attr("dilations") or []):
        pool = _Pool(b, n, go)
        # A dilated window that holds padding only: onnxruntime gives y = lowest float and an
        # index built from position -1 (another element, or out of range). No gradient flows.
        # (Counted in float32: onnxruntime has no float64 Conv.)
        counts = pool.window_counts(include_pad=False, dtype=ir.DataType.FLOAT)
        hits = b.Greater(counts, b.const(np.array(0.0, np.float32), ir.DataType.FLOAT))
        indices = b.Where(hits, indices, b.const(np.array(0, np.int64)))
        go = b.Where(hits, go, b.zeros_like(go))
    return [scatter_back(b, x, indices, go)]


@grad_rule("GlobalAveragePool")
def _global_average_pool(b, n, g):
    x = n.inputs[0]
    count = b.CastLike(b.reduce("ReduceProd", _spatial(b, x), None, keepdims=1), g[0])
    return [b.Expand(g[0] / count, b.Shape(x))]


@grad_rule("GlobalMaxPool")
def _global_max_pool(b, n, g):
    """Split dY evenly between the positions that attain the maximum."""
    x, y = n.inputs[0], n.outputs[0]
    mask = b.CastLike(b.Equal(x, y), x)
    axes = list(range(_LEAD, x.rank)) if x.rank is not None else None
    if axes is None:
        raise ValueError("GlobalMaxPool gradient needs the input rank (run shape inference)")
    return [g[0] * mask / b.reduce("ReduceSum", mask, axes, keepdims=1)]
