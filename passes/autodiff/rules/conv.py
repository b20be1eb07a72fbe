"""Gradients of convolutions and pooling: Conv, ConvTranspose, MaxPool, AveragePool, LpPool, Global*.

All of them are built from one piece of window geometry, computed from runtime shapes
so that symbolic dims and every ``auto_pad`` mode work (spatial values are int64
vectors with one entry per spatial axis):

- ``eff_k = (k - 1) * dilation + 1`` is the extent of one window,
- ``pb`` the padding before each axis, ``full = (out - 1) * stride + eff_k`` the extent
  of the padded input that the windows cover.

The adjoint of a (grouped) correlation is a ``ConvTranspose`` without pads, whose result
covers ``full``; a ``Pad`` with pads ``[-pb, in + pb - full]`` (negative pads crop)
aligns it with the input. The weight gradient is a correlation of the input with the
output gradient, computed as a ``Conv`` with the batch axis as channels
(:func:`_correlate`). Pools fold channels into the batch and use a ones kernel.

``out`` is always read from the runtime shape of dY, never from attributes or inferred
shapes: with ``ceil_mode`` onnxruntime drops a last window that starts in the end padding,
which ONNX shape inference before opset 22 keeps (it infers one window more than runs).
"""

from __future__ import annotations

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


def _input_grad(b, go, kernel, in_sp, pb, eff_k, strides, dilations, group=1):
    """Adjoint of ``Conv(pad(x), kernel)`` w.r.t. x (pads given by ``pb``, runtime sizes)."""
    full = (_spatial(b, go) - 1) * _strided(b, strides) + eff_k
    spread = b.ConvTranspose(go, kernel, strides=strides, dilations=dilations, group=group)
    return _pad_spatial(b, spread, -pb, in_sp + pb - full)


def _correlate(b, a, src, group, strides, dilations, dims):
    """R[cb, ca, k] = sum_n,i a[n, grp(cb) * Ca/g + ca, k * strides + i * dilations] * src[n, cb, i].

    ``a`` is (N, Ca, ...), ``src`` (N, Cb, ...); the result (Cb, Ca/g, K) is a grouped
    Conv whose batch is Ca/g, whose channels are (group, N) and whose weight is ``src``
    with N as its input channels.
    """
    sp = list(range(_LEAD, _LEAD + dims))
    shape_a = b.Shape(a)
    split = b.Concat(b.Slice(shape_a, [0], [1]), [group, -1], b.Slice(shape_a, [_LEAD], [_TO_END]), axis=0)
    grouped = b.Transpose(b.Reshape(a, split), perm=[2, 1, 0] + [s + 1 for s in sp])
    data = b.Reshape(grouped, b.Concat([0, -1], b.Slice(shape_a, [_LEAD], [_TO_END]), axis=0))
    weight = b.Transpose(src, perm=[1, 0] + sp)
    out = b.Conv(data, weight, group=group, strides=strides, dilations=dilations)
    return b.Transpose(out, perm=[1, 0] + sp)


def _bias_grad(b, go, dims):
    return b.reduce("ReduceSum", go, [0] + list(range(_LEAD, _LEAD + dims)), keepdims=0)


# ---- Conv / ConvTranspose --------------------------------------------------------------------


def _conv_geometry(b, n, go):
    """(dims, strides, dilations, group, input/output spatial sizes, dilated kernel extent)."""
    x, w = n.inputs[0], n.inputs[1]
    dims = _spatial_rank(n, n.attr("kernel_shape"), w, x)
    strides, dilations = _ints(n, "strides", dims, 1), _ints(n, "dilations", dims, 1)
    eff_k = _window_extent(b, _spatial(b, w), _strided(b, dilations))
    return dims, strides, dilations, n.attr("group", 1), _spatial(b, x), _spatial(b, go), eff_k


@grad_rule("Conv")
def _conv(b, n, g):
    """dX: unpadded ConvTranspose, then crop; dW: correlation of padded X with dY."""
    x, w, go = n.inputs[0], n.inputs[1], g[0]
    dims, strides, dilations, group, in_sp, out_sp, eff_k = _conv_geometry(b, n, go)
    pb = _begin_pads(b, n, dims, in_sp, out_sp, eff_k, _strided(b, strides))
    grads = [None] * len(n.inputs)
    if n.needs_grad(0):
        grads[0] = _input_grad(b, go, w, in_sp, pb, eff_k, strides, dilations, group)
    if n.needs_grad(1):
        full = (out_sp - 1) * _strided(b, strides) + eff_k
        x_padded = _pad_spatial(b, x, pb, full - in_sp - pb)
        grads[1] = _correlate(b, x_padded, go, group, dilations, strides, dims)
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


@grad_rule("AveragePool")
def _average_pool(b, n, g):
    """dX = window-sum adjoint of dY / count (count of in-bounds taps, or of taps in the pads too).

    A dilated window can hold padding only (count 0, y = 0): its dY reaches no input; a count
    of 1 keeps it finite (not inf) on its way into the pads that are cropped away.
    """
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
    """Scatter-add dY at the argmax positions (the Indices output, or a re-run that makes it)."""
    if n.attr("storage_order", 0) != 0:
        raise ValueError("MaxPool gradient supports storage_order=0 only")
    if g[0] is None:
        return [None]
    x, go = n.inputs[0], g[0]
    if n.has_output(1):
        indices = n.outputs[1]
    else:
        attrs = {k: n.attr(k) for k in n.node.attributes}
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
