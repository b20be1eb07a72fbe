"""Kernels for onnx's ReferenceEvaluator where the stock ones are not float64-exact, are wrong,
or are too slow to serve as a central-difference oracle (:mod:`gradgraph.check`).

ReferenceEvaluator matches these to nodes by class name (``new_ops``). The pooling kernels
(AveragePool, LpPool) are vectorized over sliding windows: the stock ones loop in Python over
every output position and window element (a 3-D AveragePool of 98k values took ~2 s per run,
and a central-difference check runs the model twice per compared entry).
"""

from __future__ import annotations

import math

import numpy as np
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_conv_transpose import ConvTranspose as _StockConvTranspose


class Erf(OpRun):
    """float64-exact Erf (the stock reference kernel computes in float32)."""

    op_domain = ""

    def _run(self, x):  # type: ignore[no-untyped-def]
        return (np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype),)


class Gelu(OpRun):
    """float64-exact Gelu (the stock one is a function body whose Erf computes in float32)."""

    op_domain = ""

    def _run(self, x, approximate="none"):  # type: ignore[no-untyped-def]
        if approximate == "tanh":
            inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
            return ((0.5 * x * (1.0 + np.tanh(inner))).astype(x.dtype),)
        erf = np.vectorize(math.erf, otypes=[np.float64])
        return ((0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(x.dtype),)


class Mean(OpRun):
    """Broadcasting Mean (the stock reference kernel adds in place into its first input)."""

    op_domain = ""

    def _run(self, *args):  # type: ignore[no-untyped-def]
        return (np.asarray(sum(args) / len(args)).astype(args[0].dtype),)


class Softsign(OpRun):
    """Softsign that accepts 0-d inputs (the stock one returns a numpy scalar for them)."""

    op_domain = ""

    def _run(self, x):  # type: ignore[no-untyped-def]
        return (np.asarray(x / (1.0 + np.abs(x))).astype(x.dtype),)


class LayerNormalization(OpRun):
    """LayerNormalization computed in the input's dtype (the stock one knows only stash float32)."""

    op_domain = ""

    def _run(self, x, scale, bias=None, axis=-1, epsilon=1e-5, stash_type=1):  # type: ignore[no-untyped-def]
        axes = tuple(range(axis % x.ndim, x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        inv_std = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + epsilon)
        y = (x - mean) * inv_std * scale + (0 if bias is None else bias)
        return y.astype(x.dtype), mean.astype(x.dtype), inv_std.astype(x.dtype)


class ConvTranspose(_StockConvTranspose):
    """Grouped ConvTranspose as one ungrouped call per group (the stock grouping is broken)."""

    op_domain = ""

    def _run(self, x, w, bias=None, group=None, **attrs):  # type: ignore[no-untyped-def]
        group = group or 1
        if group == 1:
            return super()._run(x, w, bias, group=1, **attrs)
        xs, ws = np.split(x, group, axis=1), np.split(w, group, axis=0)
        y = np.concatenate([super(ConvTranspose, self)._run(xg, wg, None, group=1, **attrs)[0]
                            for xg, wg in zip(xs, ws)], axis=1)
        if bias is not None:
            y = y + bias.reshape((1, -1) + (1,) * (y.ndim - 2))
        return (y.astype(x.dtype),)


class GlobalMaxPool(OpRun):
    """Max over the spatial axes (the stock kernel drops the channel axis)."""

    op_domain = ""

    def _run(self, x):  # type: ignore[no-untyped-def]
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


class GlobalAveragePool(OpRun):
    """Mean over the spatial axes, keeping N and C."""

    op_domain = ""

    def _run(self, x):  # type: ignore[no-untyped-def]
        return (x.mean(axis=tuple(range(2, x.ndim)), keepdims=True).astype(x.dtype),)


# ---- pooling over sliding windows (onnxruntime's semantics) ------------------------------------


def _trunc_div(a: int, b: int) -> int:
    """C++'s integer division (towards zero), which onnxruntime's pooling geometry uses."""
    return a // b if a >= 0 else -(-a // b)


def _pool_geometry(in_shape: tuple[int, ...], kernel: list[int], strides: list[int], dilations: list[int],
                   pads: list[int], auto_pad: str, ceil_mode: int) -> tuple[list[int], list[int], list[int]]:
    """(output shape, pads at the start, pads at the end) of each spatial axis as onnxruntime
    computes them (its ComputeSizePadDilations): SAME pads from the undilated kernel and
    possibly negative, VALID and SAME sizes by C++ division; a ceil-mode window that would
    start in the end padding is dropped."""
    n = len(in_shape)
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        needed = [(-(-i // s) - 1) * s + k - i for i, s, k in zip(in_shape, strides, kernel)]
        begin = [_trunc_div(t + (auto_pad == "SAME_LOWER"), 2) for t in needed]
        out = [_trunc_div(i + t - e, s) + 1 for i, t, e, s in zip(in_shape, needed, eff, strides)]
        return out, begin, [t - b for t, b in zip(needed, begin)]
    if auto_pad == "VALID":
        return [_trunc_div(i - e, s) + 1 for i, e, s in zip(in_shape, eff, strides)], [0] * n, [0] * n
    begin, end = (list(pads[:n]), list(pads[n:])) if pads else ([0] * n, [0] * n)
    out = []
    for i, s, e, b, f in zip(in_shape, strides, eff, begin, end):
        span = i + b + f - e
        size = (-(-span // s) if ceil_mode else _trunc_div(span, s)) + 1
        if ceil_mode and (size - 1) * s >= i + b:
            size -= 1
        out.append(size)
    return out, begin, end


def _window_sums(x: np.ndarray, kernel: list[int], strides: list[int], dilations: list[int],
                 out: list[int], begin: list[int]) -> np.ndarray:
    """Sum over each window of ``x`` (spatial axes last), the first window starting ``begin``
    before the input (a negative ``begin``: inside it), zeros outside the input."""
    n = len(kernel)
    lead = x.ndim - n
    if min(out) <= 0:
        return np.zeros((*x.shape[:lead], *[max(0, o) for o in out]), x.dtype)
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    # the coordinates the windows cover, relative to the input: [-begin, reach - begin)
    reach = [(o - 1) * s + e for o, s, e in zip(out, strides, eff)]
    x = x[(*[slice(None)] * lead, *[slice(max(0, -b), None) for b in begin])]
    widths = [(0, 0)] * lead + [(max(0, b), max(0, r - max(0, b) - i))
                                for b, r, i in zip(begin, reach, x.shape[lead:])]
    padded = np.pad(x, widths)[(*[slice(None)] * lead, *[slice(0, r) for r in reach])]
    windows = np.lib.stride_tricks.sliding_window_view(padded, eff, axis=tuple(range(lead, x.ndim)))
    index = (*[slice(None)] * lead, *[slice(None, None, s) for s in strides],
             *[slice(None, None, d) for d in dilations])
    return windows[index].sum(axis=tuple(range(x.ndim, x.ndim + n)))


def _counts(in_shape: tuple[int, ...], kernel: list[int], strides: list[int], dilations: list[int],
            out: list[int], begin: list[int], end: list[int], include_pad: bool) -> np.ndarray:
    """How many elements of each window are inside the input (or, ``include_pad``, inside the
    input and its explicit pads): a product of one count per axis."""
    total = np.ones([1, 1, *out])
    for axis, (i, k, s, d, o, b, f) in enumerate(zip(in_shape, kernel, strides, dilations, out, begin, end)):
        position = np.arange(o)[:, None] * s + np.arange(k)[None, :] * d - b  # input coordinate
        inside = (position >= -b) & (position < i + f) if include_pad else (position >= 0) & (position < i)
        shape = [1] * total.ndim
        shape[2 + axis] = o
        total = total * inside.sum(axis=1).reshape(shape)
    return total


class _WindowPool(OpRun):
    op_domain = ""

    def _geometry(self, x: np.ndarray, kernel_shape: list[int], strides: list[int] | None,
                  dilations: list[int] | None, pads: list[int] | None, auto_pad: str | bytes | None,
                  ceil_mode: int | None) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
        kernel = [int(k) for k in kernel_shape]
        n = len(kernel)
        stride = [int(s) for s in strides] if strides else [1] * n
        dilation = [int(d) for d in dilations] if dilations else [1] * n
        mode = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
        out, begin, end = _pool_geometry(x.shape[2:], kernel, stride, dilation,
                                         [int(p) for p in pads] if pads else [], mode, int(ceil_mode or 0))
        return kernel, stride, dilation, out, begin, end


class AveragePool(_WindowPool):
    """AveragePool as sums over sliding windows divided by each window's count."""

    def _run(self, x, auto_pad=None, ceil_mode=None, count_include_pad=None, dilations=None,  # type: ignore[no-untyped-def]
             kernel_shape=None, pads=None, strides=None):
        kernel, stride, dilation, out, begin, end = self._geometry(x, kernel_shape, strides, dilations, pads,
                                                                   auto_pad, ceil_mode)
        sums = _window_sums(x, kernel, stride, dilation, out, begin)
        counts = _counts(x.shape[2:], kernel, stride, dilation, out, begin, end, bool(count_include_pad))
        with np.errstate(all="ignore"):  # a window wholly in the padding: 0 / 0, as onnxruntime's
            return ((sums / counts).astype(x.dtype),)


class LpPool(_WindowPool):
    """LpPool as ``(sum |x|^p)^(1/p)`` over each window, the padding counting as zeros (the stock
    kernel scales a padded window's mean by the full window size instead)."""

    def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, p=2,  # type: ignore[no-untyped-def]
             pads=None, strides=None):
        kernel, stride, dilation, out, begin, _ = self._geometry(x, kernel_shape, strides, dilations, pads,
                                                                 auto_pad, ceil_mode)
        sums = _window_sums(np.abs(x) ** p, kernel, stride, dilation, out, begin)
        return ((sums ** (1.0 / p)).astype(x.dtype),)


class LRN(OpRun):
    """LRN summing squares over the channel window of each channel, as the spec and onnxruntime
    do (the stock kernel loops over the batch axis instead of the channels: wrong whenever the
    batch and channel counts differ)."""

    op_domain = ""

    def _run(self, x, alpha=1e-4, beta=0.75, bias=1.0, size=None):  # type: ignore[no-untyped-def]
        channels = x.shape[1]
        before, after = (size - 1) // 2, math.ceil((size - 1) / 2)
        squares = x * x
        square_sum = np.zeros_like(x)
        for c in range(channels):
            square_sum[:, c] = squares[:, max(0, c - before):min(channels, c + after + 1)].sum(axis=1)
        return ((x / (bias + (alpha / size) * square_sum) ** beta).astype(x.dtype),)


# ReferenceEvaluator matches these to nodes by class name.
def _contrib_gelu(name: str, approximate: str, biased: bool) -> type[OpRun]:
    """onnxruntime's com.microsoft GELUs (what passes.kernels.GeluFusionPass writes below opset
    20), float64-exact: ``Gelu`` (erf), ``FastGelu`` (tanh; optional bias), ``BiasGelu`` (erf of
    ``A + B``)."""

    def _run(self, x, bias=None, **_attributes):  # type: ignore[no-untyped-def]
        # (the evaluator passes the attributes of an ONNX op of the same name: not these ops')
        return Gelu._run(self, x if bias is None else x + bias, approximate=approximate)

    doc = f"com.microsoft {name}: Gelu(x{' + bias' if biased else ''}), approximate={approximate!r}"
    return type(name, (OpRun,), {"op_domain": "com.microsoft", "_run": _run, "__doc__": doc})


REFERENCE_OVERRIDES: list[type[OpRun]] = [
    AveragePool, ConvTranspose, Erf, Gelu, GlobalAveragePool, GlobalMaxPool, LayerNormalization, LpPool, LRN,
    Mean, Softsign,
    _contrib_gelu("Gelu", "none", False), _contrib_gelu("FastGelu", "tanh", True),
    _contrib_gelu("BiasGelu", "none", True),
]


