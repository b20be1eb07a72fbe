"""Gradients of quantization (QuantizeLinear / DequantizeLinear), signal (DFT, STFT), detection
(RoiAlign, MaxRoiPool) ops and of the newest fused ops (TensorScatter, SwiGLU,
CausalConvWithState, LinearAttention).

Quantization-aware training: the straight-through estimator of torch's fake-quantize ops.
``QuantizeLinear`` rounds (derivative zero almost everywhere), so its rule treats its integer
output ``q = clamp(round(x / s) + zp, qmin, qmax)`` as the real number it holds and passes
``dq/dx = 1/s`` where ``round(x / s) + zp`` lies in ``[qmin, qmax]``, 0 where it is clipped
(torch's mask). ``DequantizeLinear`` (``y = (q - zp) * s``) gives its quantized input the
gradient ``g * s``, kept in floating point; so a Q -> DQ pair passes ``g`` inside the range
and 0 outside, as ``torch.fake_quantize_per_tensor_affine`` / ``_per_channel_affine`` do.
The scale gets a gradient too: DQ's exact ``g * (q - zp)`` plus Q's straight-through
``-g * x / s**2`` (inside the range), which sum to the gradient of torch's learnable
fake-quantize (``torch._fake_quantize_learnable_per_tensor_affine`` / ``_per_channel_affine``
with ``grad_factor=1``): ``g * (round(x/s) - x/s)`` inside the range, ``g * (qmin - zp)`` /
``g * (qmax - zp)`` outside. When every reader of a QuantizeLinear is a DequantizeLinear with
its scale, zero point and granularity (fake quantization), the DQ rules give that sum
directly, as ``g * (y - x) / s`` inside and ``g * y / s`` outside (y the DQ output), without
the float32 cancellation of the two terms. Zero points are integers: no gradient. Per-tensor,
per-axis and blocked (``block_size``) scales; integer types of 2 to 16 bits.

Refused (ValueError, reported by the engine naming the node): a QuantizeLinear whose output is
also read by other ops, and quantization to float8 / float4 / float6 types. The quantized value
between Q and DQ is an integer tensor: the engine must let it carry the floating-point gradient
(the edge QuantizeLinear -> DequantizeLinear input 0). Without that, the trained value before
a Q -> DQ pair does not reach the loss, and only a DequantizeLinear's scale gets a gradient.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.autodiff.builder import OpBuilder, Var
from passes.autodiff.registry import grad_rule

_INT64 = ir.DataType.INT64
_END = np.iinfo(np.int64).max
# First default-domain opset with ScatterElements(reduction=...).
_SCATTER_REDUCTION_SINCE = 16
_WORK_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _ints(b: OpBuilder, *values: int) -> Var:
    return b.const(np.array(values, np.int64))


def _normalized_axis(n, axis: int, rank: int | None) -> int:
    if axis >= 0:
        return axis
    if rank is None:
        raise ValueError(f"{n.op_type}: negative axis {axis} on an input of unknown rank")
    return axis + rank


# ---- quantization ------------------------------------------------------------------------------

# QuantizeLinear's saturation range per integer output type.
_QUANT_RANGES = {
    ir.DataType.UINT8: (0, 255), ir.DataType.INT8: (-128, 127),
    ir.DataType.UINT16: (0, 65535), ir.DataType.INT16: (-32768, 32767),
    ir.DataType.UINT4: (0, 15), ir.DataType.INT4: (-8, 7),
    ir.DataType.UINT2: (0, 3), ir.DataType.INT2: (-2, 1),
}


class _Granularity:
    """How a scale / zero point of shape ``p`` spreads over the data ``x`` of a Q/DQ node."""

    def __init__(self, b: OpBuilder, n, x: Var, scale: Var) -> None:
        self.b, self.x = b, x
        self.block = n.attr("block_size", 0)
        self.scale_rank = scale.rank
        if self.scale_rank is None:
            raise ValueError(f"{n.op_type}: scale of unknown rank")
        rank = x.rank
        per_axis = self.scale_rank == 1 and not self.block
        if (per_axis or self.block) and rank is None:
            raise ValueError(f"{n.op_type}: per-axis or blocked quantization of an input of unknown rank")
        self.axis = _normalized_axis(n, n.attr("axis", 1), rank) if per_axis or self.block else 0
        self.rank = rank or 0
        self.kind = "tensor" if self.scale_rank == 0 else "blocked" if self.block else "axis"

    def expand(self, p: Var) -> Var:
        """``p`` broadcastable against ``x``."""
        b, axis = self.b, self.axis
        if self.kind == "tensor":
            return p
        if self.kind == "axis":
            return b.Reshape(p, [-1 if i == axis else 1 for i in range(self.rank)])
        # blocked: repeat each entry block_size times along axis, cut to x's length
        spread = b.Expand(b.Unsqueeze(p, [axis + 1]), _ints(b, *[self.block if i == axis + 1 else 1
                                                                  for i in range(self.rank + 1)]))
        shape = b.Shape(p)
        merged = b.Concat(b.Slice(shape, [0], [axis]), _ints(b, -1), b.Slice(shape, [axis + 1], [_END]), axis=0)
        return b.Slice(b.Reshape(spread, merged), [0], b.dim(self.x, axis), [axis])

    def reduce(self, v: Var, p: Var) -> Var:
        """Sum ``v`` (shaped like ``x``) down to the shape of ``p``: the adjoint of :meth:`expand`."""
        b, axis = self.b, self.axis
        if self.kind == "tensor":
            return b.Reshape(b.reduce("ReduceSum", v, None, keepdims=0), b.Shape(p))
        if self.kind == "axis":
            others = [i for i in range(self.rank) if i != axis]
            return b.reduce("ReduceSum", v, others, keepdims=0) if others else v
        blocks = b.dim(p, axis)
        missing = blocks * _ints(b, self.block) - b.dim(self.x, axis)
        pads = b.Concat(_ints(b, *[0] * (self.rank + axis)), missing, _ints(b, *[0] * (self.rank - axis - 1)), axis=0)
        shape = b.Shape(p)
        split = b.Concat(b.Slice(shape, [0], [axis + 1]), _ints(b, self.block), b.Slice(shape, [axis + 1], [_END]),
                         axis=0)
        return b.reduce("ReduceSum", b.Reshape(b.Pad(v, pads), split), [axis + 1], keepdims=0)


def _work_dtype(scale: Var, precision: int) -> ir.DataType:
    if precision:
        return ir.DataType(precision)
    return scale.dtype if scale.dtype in _WORK_TYPES else ir.DataType.FLOAT


def _same_quantization(q: ir.Node, dq: ir.Node) -> bool:
    """``dq`` dequantizes with ``q``'s own scale, zero point and granularity (a fake-quant pair)."""
    def attrs(node: ir.Node) -> tuple:
        return tuple(node.attributes[k].value if k in node.attributes else d for k, d in (("axis", 1), ("block_size", 0)))

    def zero(node: ir.Node) -> ir.Value | None:
        return node.inputs[2] if len(node.inputs) > 2 else None

    return q.inputs[1] is dq.inputs[1] and zero(q) is zero(dq) and attrs(q) == attrs(dq)


def _readers(q: ir.Node) -> list[ir.Node]:
    """The forward nodes reading a QuantizeLinear's output (gradient nodes being built are not
    in the graph yet)."""
    return [u for u, _ in q.outputs[0].uses() if u.graph is q.graph]


def _fake_quantizer(dq: ir.Node) -> ir.Node | None:
    """The QuantizeLinear before ``dq`` when every reader of it is a DequantizeLinear with its
    own quantization parameters: those DQ rules then give the whole scale gradient."""
    producer = dq.inputs[0].producer() if dq.inputs[0] is not None else None
    if producer is None or producer.op_type != "QuantizeLinear" or producer.domain not in ("", "ai.onnx"):
        return None
    paired = all(u.op_type == "DequantizeLinear" and u.domain in ("", "ai.onnx") and _same_quantization(producer, u)
                 for u in _readers(producer))
    return producer if paired else None


class _Quantizer:
    """A QuantizeLinear node's range test: round(x / s) + zp within its output type's range."""

    def __init__(self, b: OpBuilder, q: ir.Node) -> None:
        n = _ForeignNode(b, q)
        out = q.outputs[0]
        bounds = None if out.dtype is None else _QUANT_RANGES.get(out.dtype)
        if bounds is None:
            raise ValueError(f"QuantizeLinear to {out.dtype}: the straight-through gradient is defined for "
                             f"integer quantization ({', '.join(t.name for t in _QUANT_RANGES)})")
        self.x, self.scale = n.input(0), n.input(1)
        self.grain = _Granularity(b, n, self.x, self.scale)
        self.work = _work_dtype(self.scale, n.attr("precision", 0))
        self.s = b.cast_to(self.grain.expand(self.scale), self.work)
        self.ratio = b.cast_to(self.x, self.work) / self.s
        level = b.Round(self.ratio)
        if n.has_input(2):
            level = level + self.grain.expand(b.Cast(n.inputs[2], to=int(self.work)))
        low, high = (b.const(np.array(v), self.work) for v in bounds)
        self.inside = b.CastLike(b.And(b.GreaterOrEqual(level, low), b.LessOrEqual(level, high)), self.s)


class _ForeignNode:
    """The NodeView reads (inputs, attributes) of a node other than the rule's own."""

    def __init__(self, b: OpBuilder, node: ir.Node) -> None:
        self.node, self.op_type = node, node.op_type
        self.inputs = [None if v is None else b.wrap(v) for v in node.inputs]

    def attr(self, name: str, default=None):
        attr = self.node.attributes.get(name)
        return default if attr is None else attr.value

    def has_input(self, index: int) -> bool:
        return index < len(self.inputs) and self.inputs[index] is not None

    def input(self, index: int) -> Var:
        value = self.inputs[index] if index < len(self.inputs) else None
        if value is None:
            raise ValueError(f"{self.op_type} {self.node.name!r}: input {index} is missing")
        return value


@grad_rule("QuantizeLinear", since=13, diff_inputs=(0, 1))
def _quantize_linear(b, n, g):
    """Straight-through estimator; ``g[0]`` is the gradient of the quantized value as a real
    number (from the DequantizeLinear that reads it)."""
    out = n.node.outputs[0]
    readers = _readers(n.node)
    others = sorted({u.op_type for u in readers if u.op_type != "DequantizeLinear" or u.domain != ""})
    if others:
        raise ValueError(f"QuantizeLinear output {out.name!r} is read by {', '.join(others)}: a straight-through "
                         "gradient is defined only for QuantizeLinear -> DequantizeLinear")
    q = _Quantizer(b, n.node)
    passed = b.cast_to(g[0], q.work) * q.inside / q.s  # d loss / d (x / s) where not clipped
    # Fake-quant pairs (DQ with this node's scale) give the whole scale gradient themselves.
    own_scale = n.needs_grad(1) and _fake_quantizer(readers[0]) is None
    return [passed if n.needs_grad(0) else None, q.grain.reduce(-passed * q.ratio, q.scale) if own_scale else None,
            None]


@grad_rule("DequantizeLinear", since=13, diff_inputs=(0, 1))
def _dequantize_linear(b, n, g):
    """y = (x - zp) * s: ``g * s`` to the quantized input (kept in floating point, for the
    QuantizeLinear that made it), ``g * (x - zp)`` summed per scale entry to the scale. After
    a QuantizeLinear with the same scale (fake quantization) the scale's gradient is the whole
    pair's, ``g * (y - x) / s`` inside the range and ``g * y / s`` outside, as torch computes
    it (no cancellation between the two nodes' terms)."""
    x, scale = n.inputs[0], n.inputs[1]
    grain = _Granularity(b, n, x, scale)
    work = _work_dtype(scale, 0)
    go = b.cast_to(g[0], work)
    dx = go * b.cast_to(grain.expand(scale), work) if n.needs_grad(0) else None
    dscale = None
    if n.needs_grad(1):
        producer = _fake_quantizer(n.node)
        if producer is not None:
            q = _Quantizer(b, producer)
            y = b.cast_to(n.outputs[0], q.work)
            level = (y - q.inside * b.cast_to(q.x, q.work)) / q.s
            go = b.cast_to(go, q.work)
        else:
            level = b.Cast(x, to=int(work))
            if n.has_input(2):
                level = level - grain.expand(b.Cast(n.inputs[2], to=int(work)))
        dscale = grain.reduce(go * level, scale)
    return [dx, dscale, None]


# ---- signal: DFT, STFT ---------------------------------------------------------------------------
# Complex tensors are real pairs in a last axis of 2. Every DFT mode is linear in the input, so
# its gradient is the adjoint map, built from forward DFTs only (onnxruntime's inverse DFT is less
# accurate in double): the adjoint of y = W x (W_kn = exp(-2 pi i k n / N)) is
# W^H g = conj(W conj(g)).


def _pad_end(b: OpBuilder, v: Var, axis: int, amount: Var, rank: int) -> Var:
    """``v`` with ``amount`` (1-element int64) zeros appended along ``axis``."""
    pads = b.Concat(_ints(b, *[0] * (rank + axis)), amount, _ints(b, *[0] * (rank - axis - 1)), axis=0)
    return b.Pad(v, pads)


def _fit(b: OpBuilder, v: Var, axis: int, length: Var, rank: int) -> Var:
    """``v`` cut or zero-padded along ``axis`` to ``length``: the adjoint of the reverse fit."""
    cut = b.Slice(v, [0], length, [axis])
    return _pad_end(b, cut, axis, b.Max(length - b.dim(cut, axis), _ints(b, 0)), rank)


def _conj(b: OpBuilder, z: Var) -> Var:
    return z * b.const(np.array([1.0, -1.0]), z.known_dtype)


def _dft(b: OpBuilder, z: Var, axis: int, onesided: int = 0) -> Var:
    """Forward DFT of ``z`` along ``axis`` (non-negative), in the opset's signature."""
    if b.opset >= 20:
        return b.DFT(z, None, b.const(np.array(axis, np.int64)), onesided=onesided)
    return b.DFT(z, None, axis=axis, onesided=onesided)


def _adjoint_dft(b: OpBuilder, g: Var, axis: int, length: Var, onesided: int, rank: int) -> Var:
    """The gradient of a forward DFT of ``length`` points (complex result, zero-filled first if
    the DFT returned only its ``onesided`` half)."""
    if onesided:
        g = _pad_end(b, g, axis, length - b.dim(g, axis), rank)
    return _conj(b, _dft(b, _conj(b, g), axis))


def _complex_last(n, x: Var) -> bool:
    last = None if x.shape is None else x.shape[-1]
    if last not in (1, 2):
        raise ValueError(f"{n.op_type}: the last dimension of the input (1: real, 2: complex) must be known")
    return last == 2


def _dft_axis(n, rank: int) -> int:
    if n.opset >= 20:
        axis = n.const_input(2) if n.has_input(2) else np.array(-2)
        if axis is None:
            raise ValueError("DFT: a computed 'axis' input is not supported (a constant is)")
        axis = int(axis)
    else:
        axis = n.attr("axis", 1)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank - 1:
        raise ValueError(f"DFT: axis {axis} is not a signal axis of a rank-{rank} input")
    return axis


def _irfft_weights(b: OpBuilder, n, x: Var, axis: int, rank: int) -> Var:
    """IRFFT (inverse, onesided) of N points: per input bin, 1 / N for bin 0 (and N / 2 for even
    N), 2 / N for the bins that stand for a conjugate pair, shaped to broadcast along ``axis``. Only the standard layout of
    N // 2 + 1 input bins is supported (onnxruntime and numpy disagree on others)."""
    bins = None if x.shape is None else x.shape[axis]
    given = n.const_input(1) if n.has_input(1) else None
    if not isinstance(bins, int) or (n.has_input(1) and given is None):
        raise ValueError("DFT inverse onesided (IRFFT): needs a static bin count and a constant dft_length")
    length = int(given) if given is not None else 2 * (bins - 1)
    if bins != length // 2 + 1:
        raise ValueError(f"DFT inverse onesided (IRFFT) of {bins} bins to dft_length {length}: only "
                         f"dft_length // 2 + 1 = {length // 2 + 1} input bins are supported")
    weights = np.full(bins, 2.0)
    weights[0] = 1.0
    if length % 2 == 0:
        weights[-1] = 1.0
    return b.const((weights / length).reshape([-1] + [1] * (rank - axis - 1)), x.known_dtype)


@grad_rule("DFT", since=17, diff_inputs=(0,))
def _dft_grad(b, n, g):
    x = n.inputs[0]
    rank = x.rank
    if rank is None:
        raise ValueError("DFT: input of unknown rank")
    axis = _dft_axis(n, rank)
    complex_in = _complex_last(n, x)
    inverse, onesided = n.attr("inverse", 0), n.attr("onesided", 0)
    if inverse and onesided:  # y = irfft(x): the adjoint is rfft(g) weighted per bin
        return [_dft(b, g[0], axis, onesided=1) * _irfft_weights(b, n, x, axis, rank), None, None]
    n_in = b.dim(x, axis)
    length = b.Reshape(b.Cast(n.inputs[1], to=_INT64), [1]) if n.has_input(1) else n_in
    if inverse:  # y = conj(W) x / N: the adjoint is W g / N
        dz = _dft(b, g[0], axis) / b.CastLike(length, g[0])
    else:
        dz = _adjoint_dft(b, g[0], axis, length, onesided, rank)
    dx = _fit(b, dz, axis, n_in, rank)
    return [dx if complex_in else b.Slice(dx, [0], [1], [rank - 1]), None, None]


@grad_rule("STFT", since=17, diff_inputs=(0, 2))
def _stft(b, n, g):
    """Frames z[f, m] = window[m] * x[f * step + m] go through a DFT of frame_length points: the
    frames' gradient is the adjoint DFT; x's is its overlap-add (ScatterElements add), the
    window's its product with the frames summed over batch, frames and real/imaginary."""
    x = n.inputs[0]
    complex_in = _complex_last(n, x)
    window = n.inputs[2] if n.has_input(2) else None
    if window is not None:
        length = b.dim(window, 0)
    elif n.has_input(3):
        length = b.Reshape(b.Cast(n.inputs[3], to=_INT64), [1])
    else:
        length = b.dim(x, 1)
    dz = _adjoint_dft(b, g[0], 2, length, n.attr("onesided", 1), 4)
    if not complex_in:
        dz = b.Slice(dz, [0], [1], [3])
    zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
    starts = b.Range(zero, b.Squeeze(b.dim(n.outputs[0], 1), [0]), one) * b.Cast(n.inputs[1], to=_INT64)
    index = b.Unsqueeze(starts, [1]) + b.Range(zero, b.Squeeze(length, [0]), one)  # [frames, length]
    dx = dwindow = None
    if n.needs_grad(0):
        dframes = dz if window is None else dz * b.Reshape(window, [1, 1, -1, 1])
        flat = b.Reshape(dframes, b.Concat(b.dim(x, 0), _ints(b, -1), b.dim(x, 2), axis=0))
        where = b.Expand(b.Reshape(index, [1, -1, 1]), b.Shape(flat))
        dx = b.ScatterElements(b.zeros_like(x), where, flat, axis=1, reduction="add")
    if window is not None and n.needs_grad(2):
        dwindow = b.reduce("ReduceSum", dz * b.Gather(x, index, axis=1), [0, 1, 3], keepdims=0)
    return [dx, None, dwindow, None]


# ---- newest fused ops: TensorScatter, SwiGLU, CausalConvWithState --------------------------------


@grad_rule("TensorScatter", since=24, diff_inputs=(0, 1))
def _tensor_scatter(b, n, g):
    """present = past with ``update`` written at rows write_indices[batch] + s (mod the cache
    length when circular) of ``axis``: the update gets those rows of g, the past the rest."""
    past, update = n.inputs[0], n.inputs[1]
    rank = past.rank
    if rank is None:
        raise ValueError("TensorScatter: cache of unknown rank")
    axis = _normalized_axis(n, n.attr("axis", -2), rank)
    zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
    rows = b.Unsqueeze(b.Range(zero, b.Squeeze(b.dim(update, axis), [0]), one), [0])  # [1, S]
    if n.has_input(2):
        rows = b.Unsqueeze(b.Cast(n.inputs[2], to=_INT64), [1]) + rows  # [B, S]
    if n.attr("mode", "linear") == "circular":
        rows = b.Mod(rows, b.dim(past, axis))
    spread = [i for i in range(1, rank) if i != axis]
    where = b.Expand(b.Unsqueeze(rows, spread) if spread else rows, b.Shape(update))
    dupdate = b.GatherElements(g[0], where, axis=axis) if n.needs_grad(1) else None
    dpast = b.ScatterElements(g[0], where, b.zeros_like(update), axis=axis) if n.needs_grad(0) else None
    return [dpast, dupdate, None]


def _swish_grad(b: OpBuilder, z: Var, alpha: float = 1.0) -> tuple[Var, Var]:
    """swish(z) = z * sigmoid(alpha z) and its derivative."""
    s = b.Sigmoid(z * alpha) if alpha != 1.0 else b.Sigmoid(z)
    swish = z * s
    return swish, s + swish * alpha * (1.0 - s)


@grad_rule("SwiGLU", since=28)
def _swiglu(b, n, g):
    """y = swish_alpha(a) * v."""
    a, v = n.inputs[0], n.inputs[1]
    swish, dswish = _swish_grad(b, a, n.attr("alpha", 1.0))
    return [g[0] * v * dswish if n.needs_grad(0) else None, g[0] * swish if n.needs_grad(1) else None]


def _pad_begin(b: OpBuilder, v: Var, amount: Var) -> Var:
    """``v`` ([B, C, L]) with ``amount`` zeros put in front along time."""
    return b.Pad(v, b.Concat(_ints(b, 0, 0), amount, _ints(b, 0, 0, 0), axis=0))


@grad_rule("CausalConvWithState", since=27)
def _causal_conv_with_state(b, n, g):
    """padded = [past_state (zeros when absent), x] along time; z[t] = sum_j w[j] padded[t + j]
    + bias per channel; output = act(z); present_state = the last k - 1 steps of padded. The
    windows padded[t + j] are gathered once ([B, C, L, k]): the weight's gradient is their
    product with dz, padded's the scatter-add of dz * w (plus present_state's gradient)."""
    x, w = n.inputs[0], n.inputs[1]
    taps = b.dim(w, 2)
    history = taps - _ints(b, 1)
    if n.has_input(3):
        padded = b.Concat(n.inputs[3], x, axis=2)
    else:
        padded = _pad_begin(b, x, history)
    zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
    index = (b.Unsqueeze(b.Range(zero, b.Squeeze(b.dim(x, 2), [0]), one), [1])
             + b.Range(zero, b.Squeeze(taps, [0]), one))  # [L, k]
    windows = b.Gather(padded, index, axis=2)  # [B, C, L, k]
    kernel = b.Unsqueeze(b.Squeeze(w, [1]), [0, 2])  # [1, C, 1, k]
    dz = g[0]
    activation = n.attr("activation", "none")
    if activation in ("silu", "swish") and dz is not None:
        z = b.ReduceSum(windows * kernel, [3], keepdims=0)
        if n.has_input(2):
            z = z + b.Reshape(n.inputs[2], [1, -1, 1])
        dz = dz * _swish_grad(b, z)[1]
    elif activation != "none":
        raise ValueError(f"CausalConvWithState: activation {activation!r} is not supported")
    grads: list[Var | None] = [None] * 4
    dpadded = None
    if dz is not None:
        if n.needs_grad(1):
            grads[1] = b.Reshape(b.ReduceSum(windows * b.Unsqueeze(dz, [3]), [0, 2], keepdims=0), b.Shape(w))
        if n.needs_grad(2):
            grads[2] = b.ReduceSum(dz, [0, 2], keepdims=0)
        spread = b.Reshape(b.Unsqueeze(dz, [3]) * kernel, b.Concat(b.Slice(b.Shape(x), [0], [2]), _ints(b, -1),
                                                                   axis=0))
        where = b.Expand(b.Reshape(index, [1, 1, -1]), b.Shape(spread))
        dpadded = b.ScatterElements(b.zeros_like(padded), where, spread, axis=2, reduction="add")
    if len(g) > 1 and g[1] is not None:  # present_state = padded[..., L:]
        tail = _pad_begin(b, g[1], b.dim(x, 2))
        dpadded = tail if dpadded is None else dpadded + tail
    if dpadded is not None:
        grads[0] = b.Slice(dpadded, history, [_END], [2]) if n.needs_grad(0) else None
        grads[3] = b.Slice(dpadded, [0], history, [2]) if n.needs_grad(3) else None
    return grads


# ---- detection: RoiAlign, MaxRoiPool -------------------------------------------------------------
# Both read, for each RoI r, the image batch_index[r] of X: their gradients are computed per RoI
# ([R, C, H, W]) and summed into X's batch entries with a one-hot product.


def _to_batch(b: OpBuilder, per_roi: Var, batch: Var, x: Var) -> Var:
    """Sum the per-RoI gradients [R, C, H, W] into X's shape by RoI batch index."""
    hot = b.OneHot(b.Cast(batch, to=_INT64), b.dim(x, 0), b.const(np.array([0.0, 1.0]), per_roi.known_dtype), axis=1)
    flat = b.MatMul(b.Transpose(hot, perm=[1, 0]), b.Reshape(per_roi, b.Concat(b.dim(per_roi, 0), _ints(b, -1),
                                                                              axis=0)))
    return b.Reshape(flat, b.Shape(x))


def _range_float(b: OpBuilder, count: Var, like: Var) -> Var:
    return b.CastLike(b.Range(b.const(np.array(0, np.int64)), count, b.const(np.array(1, np.int64))), like)


def _route_max(b: OpBuilder, xr: Var, g: Var, rows, cols) -> Var:
    """Gradient of y[r, c, p, q] = max over candidates (i, j) of wr[r,p,i] wc[r,q,j] xr[r, c, row, col]
    (candidates where both exist), into xr's shape: g goes to each max's (row, col), times its
    weight. ``rows`` / ``cols``: (index [R, P, A] int64, weight [R, P, A] or None, exists [R, P, A])."""
    (ri, rw, rok), (ci, cw, cok) = rows, cols
    rank_mid = b.Concat(b.Slice(b.Shape(xr), [0], [2]), _ints(b, -1), axis=0)  # [R, C, -1]
    grid = b.Concat(b.Slice(b.Shape(xr), [0], [2]), b.Slice(b.Shape(ri), [1], [3]),
                    b.Slice(b.Shape(ci), [1], [3]), axis=0)  # [R, C, P, A, Q, B]

    def as_rows(v):  # [R, P, A] -> [R, 1, P*A, 1]
        return b.Reshape(v, [0, 1, -1, 1])

    def as_cols(v):  # [R, Q, B] -> [R, 1, 1, Q*B]
        return b.Reshape(v, [0, 1, 1, -1])

    by_rows = b.Expand(as_rows(ri), b.Concat(b.Slice(b.Shape(xr), [0], [2]), b.dim(as_rows(ri), 2),
                                             b.dim(xr, 3), axis=0))
    picked = b.GatherElements(xr, by_rows, axis=2)
    by_cols = b.Expand(as_cols(ci), b.Concat(b.Slice(b.Shape(picked), [0], [3]), b.dim(as_cols(ci), 3), axis=0))
    values = b.GatherElements(picked, by_cols, axis=3)
    if rw is not None:
        values = values * as_rows(rw) * as_cols(cw)
    exists = b.And(as_rows(rok), as_cols(cok))
    values = b.Where(exists, values, b.const(np.array(-np.inf), values.known_dtype))
    flat = b.Reshape(b.Transpose(b.Reshape(values, grid), perm=[0, 1, 2, 4, 3, 5]),
                     b.Concat(b.Slice(grid, [0], [3]), b.Slice(grid, [4], [5]), _ints(b, -1), axis=0))
    best = b.ArgMax(flat, axis=4, keepdims=1)  # [R, C, P, Q, 1]
    width = b.Slice(grid, [5], [6])
    outer = b.Concat(b.Slice(grid, [0], [3]), b.Slice(grid, [4], [5]), axis=0)  # [R, C, P, Q]

    def pick(v, along_rows: bool):  # the winner's entry of a per-row / per-col candidate tensor
        view = b.Unsqueeze(v, [1, 3]) if along_rows else b.Unsqueeze(v, [1, 2])  # [R,1,P,1,A] / [R,1,1,Q,B]
        full = b.Expand(view, b.Concat(outer, b.dim(v, 2), axis=0))
        return b.GatherElements(full, b.Div(best, width) if along_rows else b.Mod(best, width), axis=4)

    keep = b.CastLike(b.And(pick(rok, True), pick(cok, False)), g)
    if rw is not None:
        keep = keep * pick(rw, True) * pick(cw, False)
    at = b.Reshape(pick(ri, True) * b.dim(xr, 3) + pick(ci, False), rank_mid)
    updates = b.Reshape(b.Unsqueeze(g, [4]) * keep, rank_mid)
    if b.opset >= _SCATTER_REDUCTION_SINCE:
        routed = b.ScatterElements(b.zeros_like(b.Reshape(xr, rank_mid)), at, updates, axis=2, reduction="add")
    else:  # no ScatterElements(reduction=add) yet: one-hot product over the H * W cells
        cells = b.Range(b.const(np.array(0, np.int64)), b.Squeeze(b.dim(xr, 2) * b.dim(xr, 3), [0]),
                        b.const(np.array(1, np.int64)))
        hits = b.CastLike(b.Equal(b.Unsqueeze(at, [3]), cells), updates)  # [R, C, K, H*W]
        routed = b.MatMul(b.Unsqueeze(updates, [2]), hits)
    return b.Reshape(routed, b.Shape(xr))


def _roi_align_axis(b: OpBuilder, start: Var, size: Var, pooled: int, ratio: int, extent: Var):
    """One axis of RoiAlign's sample points: for RoI r and bin p, ``grid`` samples (sampling_ratio,
    else ceil(size / pooled) per RoI), each a 2-tap linear interpolation (onnxruntime's: samples
    beyond [-1, extent] weigh 0, coordinates clamp at 0 and at extent - 1). Returns the taps as
    (index, weight, exists), each [R, P, 2G], and max(grid, 1) [R, 1, 1]."""
    start, size = b.Reshape(start, [-1, 1, 1]), b.Reshape(size, [-1, 1, 1])
    cell = size / float(pooled)
    if ratio > 0:
        grid, count = b.const(np.array(float(ratio)), start.known_dtype), b.const(np.array(ratio, np.int64))
    else:
        grid = b.Ceil(cell)
        count = b.Cast(b.reduce("ReduceMax", grid, None, keepdims=0), to=_INT64)
    divisor = b.Max(grid, b.const(np.array(1.0), start.known_dtype))
    steps = b.Reshape(_range_float(b, count, start), [1, 1, -1])
    bins = b.Reshape(_range_float(b, b.const(np.array(pooled, np.int64)), start), [1, -1, 1])
    pos = start + bins * cell + (steps + 0.5) * cell / divisor  # [R, P, G]
    last = b.CastLike(extent, pos) - 1.0
    exists = b.Expand(b.Less(steps, grid), b.Shape(pos))
    inside = b.CastLike(b.And(b.GreaterOrEqual(pos, -1.0), b.LessOrEqual(pos, last + 1.0)), pos)
    clamped = b.Max(pos, b.const(np.array(0.0), pos.known_dtype))
    low = b.Floor(clamped)
    at_end = b.GreaterOrEqual(low, last)
    low = b.Where(at_end, last, low)
    frac = b.Where(at_end, b.const(np.array(0.0), pos.known_dtype), clamped - low)
    high = b.Min(low + 1.0, last)
    index = b.Cast(b.Concat(low, high, axis=2), to=_INT64)
    weight = b.Concat((1.0 - frac) * inside, frac * inside, axis=2)
    return (index, weight, b.Concat(exists, exists, axis=2)), divisor


def _interpolation_matrix(b: OpBuilder, taps, divisor: Var, extent: Var) -> Var:
    """[R, P, E]: the average over a bin's samples of their interpolation weights on each cell."""
    index, weight, exists = taps
    cells = b.Reshape(b.Range(b.const(np.array(0, np.int64)), b.Squeeze(extent, [0]), b.const(np.array(1, np.int64))),
                      [1, 1, 1, -1])
    hits = b.CastLike(b.Equal(b.Unsqueeze(index, [3]), cells), weight)
    used = b.Unsqueeze(weight * b.CastLike(exists, weight), [3])
    return b.ReduceSum(used * hits, [2], keepdims=0) / divisor


def _roi_column(b: OpBuilder, rois: Var, k: int) -> Var:
    return b.Reshape(b.Slice(rois, [k], [k + 1], [1]), [-1])


@grad_rule("RoiAlign", since=10, diff_inputs=(0,))
def _roi_align(b, n, g):
    """avg: the interpolation is separable, Y[r] = Ay[r] X[batch[r]] Ax[r]^T per channel (Ay, Ax
    the per-axis averaged interpolation weights), so X[batch[r]] gets Ay^T dY Ax. max: the
    winning (sample, corner) of each bin gets dY times its interpolation weight."""
    x, rois, batch = n.inputs
    half = n.opset >= 16 and n.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    corners = rois * n.attr("spatial_scale", 1.0) - (0.5 if half else 0.0)
    ratio = n.attr("sampling_ratio", 0)
    axes = []
    for lo, pooled, dim in ((1, n.attr("output_height", 1), 2), (0, n.attr("output_width", 1), 3)):
        start = _roi_column(b, corners, lo)
        size = _roi_column(b, corners, lo + 2) - start
        if not half:  # malformed RoIs become 1 x 1
            size = b.Max(size, b.const(np.array(1.0), size.known_dtype))
        axes.append((*_roi_align_axis(b, start, size, pooled, ratio, b.dim(x, dim)), b.dim(x, dim)))
    (rows, grid_h, height), (cols, grid_w, width) = axes
    if n.attr("mode", "avg") == "avg":
        ay = _interpolation_matrix(b, rows, grid_h, height)
        ax = _interpolation_matrix(b, cols, grid_w, width)
        per_roi = b.MatMul(b.MatMul(b.Unsqueeze(b.Transpose(ay, perm=[0, 2, 1]), [1]), g[0]), b.Unsqueeze(ax, [1]))
    else:
        per_roi = _route_max(b, b.Gather(x, batch, axis=0), g[0], rows, cols)
    return [_to_batch(b, per_roi, batch, x), None, None]


@grad_rule("MaxRoiPool", diff_inputs=(0,))
def _max_roi_pool(b, n, g):
    """onnxruntime's RoI max pooling: rois (batch, x1, y1, x2, y2) scaled and rounded half away
    from zero; bin p of a RoI spans [floor(p s), ceil((p + 1) s)) from its start, clipped to
    the image (s = RoI size / pooled, size = max(end - start + 1, 1)); empty bins give 0. Each
    bin's first maximum (row-major) gets dY."""
    x, rois = n.inputs
    pooled = n.attr("pooled_shape")
    if pooled is None or len(pooled) != 2:
        raise ValueError("MaxRoiPool: pooled_shape must hold (height, width)")
    scaled = rois * n.attr("spatial_scale", 1.0)
    axes = []
    for col, count, dim in ((2, pooled[0], 2), (1, pooled[1], 3)):
        lo, hi = (b.Unsqueeze(b.Sign(v) * b.Floor(b.Abs(v) + 0.5), [1])  # std::round, [R, 1]
                  for v in (_roi_column(b, scaled, col), _roi_column(b, scaled, col + 2)))
        zero = b.const(np.array(0.0), lo.known_dtype)
        cell = b.Max(hi - lo + 1.0, zero + 1.0) / float(count)
        bins = b.Unsqueeze(_range_float(b, b.const(np.array(count, np.int64)), lo), [0])
        extent = b.CastLike(b.dim(x, dim), lo)
        start = b.Min(b.Max(b.Floor(bins * cell) + lo, zero), extent)  # [R, P]
        span = b.Min(b.Max(b.Ceil((bins + 1.0) * cell) + lo, zero), extent) - start
        longest = b.Max(b.Cast(b.reduce("ReduceMax", span, None, keepdims=0), to=_INT64),
                        b.const(np.array(1, np.int64)))
        steps = b.Reshape(_range_float(b, longest, lo), [1, 1, -1])
        index = b.Cast(b.Min(b.Unsqueeze(start, [2]) + steps, extent - 1.0), to=_INT64)
        axes.append((index, None, b.Less(steps, b.Unsqueeze(span, [2]))))
    batch = b.Cast(_roi_column(b, rois, 0), to=_INT64)
    per_roi = _route_max(b, b.Gather(x, batch, axis=0), g[0], axes[0], axes[1])
    return [_to_batch(b, per_roi, batch, x), None]


# ---- LinearAttention -----------------------------------------------------------------------------
# Per batch and KV head, with a = exp(decay_t) (1 unless gated) and S_0 = past_state (or zeros):
#   P_t = a_t * S_{t-1}
#   u_t = beta_t * (v_t - P_t^T k_t)   (delta rules; v_t otherwise)
#   S_t = P_t + k_t u_t^T,   o_t[h] = scale * S_t^T q_t[h]   for the query heads h of the KV head.
# The backward recomputes S_{t-1} with a recording Scan, then runs the adjoint recurrence with a
# reverse Scan carrying dS (starting from present_state's gradient); its final dS is past_state's
# gradient. Computed in float32, as the op's function body does.

_FLOAT = ir.DataType.FLOAT


def _scan(b: OpBuilder, name: str, states: list[Var], scans: list[Var], body, n_outputs: int,
          reverse: bool = False) -> list[Var]:
    """Scan over axis 0 of ``scans`` carrying ``states``; ``body(sub, states, slices)`` returns the
    new states followed by ``n_outputs`` per-step outputs (stacked along axis 0)."""
    sub = OpBuilder(b.opset, b.opset_imports)
    sub.prefix = b.fresh_name(name)
    inputs = [ir.Value(name=f"{sub.prefix}/in{k}", type=ir.TensorType(_FLOAT)) for k in range(len(states) + len(scans))]
    wrapped = [sub.wrap(v) for v in inputs]
    results = body(sub, wrapped[:len(states)], wrapped[len(states):])
    outputs = [r if sub.owns(r.value) else sub.Identity(r) for r in results]
    for node in sub.nodes:  # the body's constants are named like the outer graph's: prefix them
        if node.op_type == "Constant":
            node.name = f"{sub.prefix}/{node.name}"
            node.outputs[0].name = f"{sub.prefix}/{node.outputs[0].name}"
    graph = ir.Graph(inputs, [o.value for o in outputs], nodes=sub.nodes, name=sub.prefix)
    directions = {"scan_input_directions": [1] * len(scans), "scan_output_directions": [1] * n_outputs} if reverse else {}
    outs = b.Scan(*states, *scans, _outputs=len(states) + n_outputs, body=graph, num_scan_inputs=len(scans),
                  **directions)
    outs = outs if isinstance(outs, list) else [outs]
    for out in outs:
        out.value.type = ir.TensorType(_FLOAT)
    return outs


class _LinearAttention:
    """Shapes and the shared step of a LinearAttention node (time-major float32 inputs)."""

    def __init__(self, b: OpBuilder, n) -> None:
        rule = n.attr("update_rule", "gated_delta")
        if rule not in ("linear", "gated", "delta", "gated_delta"):
            raise ValueError(f"LinearAttention: update_rule {rule!r} is not supported")
        self.gated, self.delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
        self.q_heads, self.kv_heads = n.attr("q_num_heads"), n.attr("kv_num_heads")
        if not self.q_heads or not self.kv_heads or self.q_heads % self.kv_heads:
            raise ValueError("LinearAttention: q_num_heads must be a positive multiple of kv_num_heads")
        self.b, self.n = b, n
        query, key, value = n.inputs[:3]
        self.group = self.q_heads // self.kv_heads
        key_dim = b.Div(b.dim(query, 2), _ints(b, self.q_heads))
        scale = n.attr("scale", 0.0)
        self.scale = (b.const(np.array(scale, np.float32)) if scale
                      else b.Reciprocal(b.Sqrt(b.Cast(key_dim, to=int(_FLOAT)))))
        self.q = self._time_major(query, [self.kv_heads, self.group, -1])  # [T, B, Hkv, G, dk]
        self.k = self._time_major(key, [self.kv_heads, -1])  # [T, B, Hkv, dk]
        self.v = self._time_major(value, [self.kv_heads, -1])  # [T, B, Hkv, dv]
        self.a = self._time_major(n.inputs[4], [self.kv_heads, -1]) if self.gated else None  # [T, B, Hkv, dk or 1]
        self.a = None if self.a is None else b.Exp(self.a)
        self.beta = self._time_major(n.inputs[5], [-1, 1]) if self.delta else None  # [T, B, Hkv or 1, 1]
        # decay [B, T, Hkv] (one per head) or [B, T, Hkv * dk]; beta [B, T, Hkv] or [B, T, 1]
        self.head_decay = self.gated and self._last_dim(4) == self.kv_heads
        self.shared_beta = self.delta and self._last_dim(5) == 1 and self.kv_heads > 1
        batch = b.dim(query, 0)
        self.state_shape = b.Concat(batch, _ints(b, self.kv_heads), key_dim,
                                    b.Div(b.dim(value, 2), _ints(b, self.kv_heads)), axis=0)

    def _last_dim(self, index: int) -> int:
        shape = self.n.inputs[index].shape if self.n.has_input(index) else None
        if shape is None or not isinstance(shape[-1], int):
            raise ValueError(f"LinearAttention: input {index} needs a static last dimension")
        return shape[-1]

    def _time_major(self, x: Var, heads: list[int]) -> Var:
        b = self.b
        split = b.Reshape(b.Cast(x, to=int(_FLOAT)), [0, 0, *heads])
        return b.Transpose(split, perm=[1, 0, *range(2, 2 + len(heads))])

    def initial(self, index: int, grad: Var | None = None) -> Var:
        b = self.b
        if grad is not None:
            return b.Cast(grad, to=int(_FLOAT))
        if index >= 0 and self.n.has_input(index):
            return b.Cast(self.n.inputs[index], to=int(_FLOAT))
        return b.ConstantOfShape(self.state_shape, value=ir.tensor(np.zeros(1, np.float32)))

    def step(self, sub: OpBuilder, state: Var, k: Var, v: Var, a: Var | None, beta: Var | None):
        """P, the delta read r = P^T k (or None), u and the next state."""
        col = sub.Unsqueeze(k, [-1])
        decayed = state if a is None else state * sub.Unsqueeze(a, [-1])
        read = sub.ReduceSum(decayed * col, [2], keepdims=0) if self.delta else None
        u = v if read is None else beta * (v - read)
        return decayed, read, u, decayed + col * sub.Unsqueeze(u, [-2])

    def sliced(self) -> list[Var]:
        return [x for x in (self.k, self.v, self.a, self.beta) if x is not None]

    def unpack(self, sub: OpBuilder, xs: list[Var]):
        k, v, *rest = xs
        a = rest.pop(0) if self.gated else None
        beta = rest.pop(0) if self.delta else None
        return k, v, a, beta

    def batch_major(self, x: Var, like: Var, rank: int = 4) -> Var:
        """[T, B, ...] (``rank`` axes) -> ``like``'s shape [B, T, ...]."""
        return self.b.Reshape(self.b.Transpose(x, perm=[1, 0, *range(2, rank)]), self.b.Shape(like))


@grad_rule("LinearAttention", since=27, diff_inputs=(0, 1, 2, 3, 4, 5))
def _linear_attention(b, n, g):
    la = _LinearAttention(b, n)
    sliced = la.sliced()

    def record(sub, states, xs):
        k, v, a, beta = la.unpack(sub, xs)
        return [la.step(sub, states[0], k, v, a, beta)[3], states[0]]

    _, previous = _scan(b, "linear_attention_states", [la.initial(3)], sliced, record, 1)

    do = g[0] if g[0] is not None else b.zeros_like(n.outputs[0])
    do = la._time_major(do, [la.kv_heads, la.group, -1])  # [T, B, Hkv, G, dv]
    present = g[1] if len(g) > 1 else None

    def adjoint(sub, states, xs):
        d_state = states[0]
        prev, q, do_t, *rest = xs
        k, v, a, beta = la.unpack(sub, rest)
        decayed, read, u, state = la.step(sub, prev, k, v, a, beta)
        d_state = d_state + sub.Mul(la.scale, sub.MatMul(sub.Transpose(q, perm=[0, 1, 3, 2]), do_t))
        dq = sub.Mul(la.scale, sub.MatMul(do_t, sub.Transpose(state, perm=[0, 1, 3, 2])))
        du = sub.ReduceSum(d_state * sub.Unsqueeze(k, [-1]), [2], keepdims=0)
        dk = sub.ReduceSum(d_state * sub.Unsqueeze(u, [-2]), [3], keepdims=0)
        d_decayed, extra = d_state, []
        dv = du
        if la.delta:
            dv = beta * du
            extra.append(sub.ReduceSum((v - read) * du, [1, 2] if la.shared_beta else [2], keepdims=1))
            d_read = -(beta * du)
            d_decayed = d_state + sub.Unsqueeze(k, [-1]) * sub.Unsqueeze(d_read, [-2])
            dk = dk + sub.ReduceSum(decayed * sub.Unsqueeze(d_read, [-2]), [3], keepdims=0)
        if a is None:
            return [d_decayed, dq, dk, dv, *extra]
        da = sub.ReduceSum(d_decayed * prev, [3], keepdims=0)
        if la.head_decay:
            da = sub.ReduceSum(da, [2], keepdims=1)  # one decay per head
        return [d_decayed * sub.Unsqueeze(a, [-1]), dq, dk, dv, da * a, *extra]

    outs = _scan(b, "linear_attention_grad", [la.initial(-1, present)], [previous, la.q, do, *sliced], adjoint,
                 3 + la.gated + la.delta, reverse=True)
    d_past, dq, dk, dv, *rest = outs
    grads: list[Var | None] = [la.batch_major(dq, n.inputs[0], 5), la.batch_major(dk, n.inputs[1]),
                               la.batch_major(dv, n.inputs[2]), d_past if n.has_input(3) else None, None, None]
    if la.gated:
        grads[4] = la.batch_major(rest.pop(0), n.inputs[4])
    if la.delta:
        grads[5] = la.batch_major(rest.pop(0), n.inputs[5])
    return grads
