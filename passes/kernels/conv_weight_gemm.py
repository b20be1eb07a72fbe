"""ConvWeightGemmPass: a Conv with few output positions and a large kernel, as GEMMs.

The Conv gradient rule (passes/autodiff/rules/conv.py) writes a weight gradient as a
correlation: a ``Conv`` whose data is the input with the batch folded into the channels
(``(Cin/g, g*N, *spatial)``; padded by the Conv's ``pads`` for group 1, by a ``Pad`` before it
otherwise), whose kernel is the output gradient (``(Cout, N, *out)``), and whose
output has the original kernel's taps as its positions (3x3 = 9). onnxruntime's CPU Conv runs it
as an im2col of ``N*H*W`` rows per output position and a GEMM whose columns are those few
positions: a thin GEMM far from MLAS's peak. The same sum is, for every output position ``t``
(``t * stride`` the offset of its window)::

    Y[b, m, t] = sum_{c in group(m), i} Dp[b, c, t * stride + i * dilation] * W[m, c, i]

that is the product of ``W`` flattened to ``(M, C/g * K)`` with the window of ``Dp`` that
position ``t`` reads (a ``Slice`` with step ``dilation``), flattened to ``(B, C/g * K)``. Forms
(picked by :class:`ConvGemmOptions` from the shapes):

1. ``gather`` (group 1, C channels of at least ``gather_min_block_bytes``): the data moved
   channels last, ``(B, prod(S), C)``, and all T windows read by one ``Gather`` of a constant
   index table ``(T, K)`` (pads read a zero row appended to the data, strides and dilations
   are in the table): ``(B, T, K, C)``, each index one block of C values. One ``Gemm`` of
   ``(B*T, K*C)`` by the kernel moved channels last, ``(M, K*C)``, with ``transB``. For a weight
   gradient (C = the batch) this is im2col + GEMM, as torch computes it, in one copy of the
   windows; ResNet-18's step 0.80x the ``unfold`` form's (tools/ab_rule.py on
   ``gather_fits``, 20 pairs);
2. ``unfold`` (group 1): the T windows sliced and concatenated, ``(T*B, C*K)``, one ``Gemm``
   with ``transB`` (two copies of the windows, the ``Slice``s' rows K wide);
3. ``taps`` (group 1, an unfold above ``max_unfold_bytes`` or of a symbolic channel count): one
   ``Gemm`` per position, ``W (M, C*K) x window^T``;
4. ``grouped`` (group > 1, depthwise included): per position a batched ``MatMul`` over the
   groups, ``(g, M/g, C/g*K) x (g, C/g*K, B)``; only where the windows are read with step 1
   (``grouped_max_window_step``).

Measured (tools/ab_pass.py and single-Conv A/Bs, medians of interleaved ratios on a shared,
loaded 2-core machine; docs/passes.md, Convolutions): the benchmark CNN's three weight
gradients 0.6-0.8x the Conv (taps as fast for 32 and 64 input channels, 1.4x the Conv for 3
input channels and for 256 channels at 4x4), a 1x1 conv's 0.3-0.4x, depthwise stride 1 0.3x;
depthwise stride 2 1.4x (left alone).

The positions' results are stacked, transposed to ``(B, M, T)`` and reshaped to Y's shape (a
bias input is added). Pads (explicit, ``VALID`` or ``SAME_*``) become one ``Pad`` (the gather
form: indices of a zero row).

Rewritten (models of opset 13 or later): a default-domain float32 / float64 Conv of the main graph whose data has a static
spatial shape and first dim, whose weight has a static first dim and kernel, with
``T <= max_output_positions`` output positions and a kernel of at least
``min_kernel_per_position`` times T taps (the weight-gradient shape). A Conv with a smaller
kernel (a forward, a stride-1 input gradient) is left to onnxruntime's own kernel, except a
group-1 one with a kernel above 1x1 and at most ``gather_max_forward_positions`` output
positions per image, in the gather form: onnxruntime runs a Conv as one im2col and GEMM per
image, thin where an image has few positions (ResNet-18's 8x8 and 4x4 stages; its step 0.89x,
tools/ab_rule.py on ``small_output_gather``, 16 pairs; a 1x1 kernel was 1.06x on MobileNetV2). 1-D, 2-D and 3-D, any stride, dilation and
group. Values agree with the Conv to float rounding (sums in another order).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.builder import OpBuilder, Var, scope_taken_names
from passes.kernels._graph import DEFAULT_DOMAINS, default_opset, take_over
from passes.shapes import infer_missing_shapes

_LEAD = 2  # batch and channel axes
_FLOATS = {ir.DataType.FLOAT: 4, ir.DataType.DOUBLE: 8}
# Slice, Pad and ReduceSum with their index inputs (not attributes).
_MIN_OPSET = 13


@dataclasses.dataclass(frozen=True)
class ConvGemmOptions:
    """Which Convs are rewritten and in which form (measurements: docs/passes.md, Convolutions)."""

    # At most this many output positions (one window and one GEMM term each): 7x7x7 kernels.
    max_output_positions: int = 343
    # Kernel taps per output position more than this (the correlation of a weight gradient has
    # H*W kernel taps for k*k positions, times N channels; a forward Conv's kernel is smaller
    # than its output: ResNet's last 3x3 stage at 4x4 has 16 taps for 9 positions, its forward
    # 9 for 16).
    min_kernel_per_position: float = 1.0
    # Largest window tensor (bytes) built for the unfold and gather forms; above, per-position
    # Gemms (a forward-like Conv: left to onnxruntime).
    max_unfold_bytes: int = 256 * 1024 * 1024
    # The gather form (group 1): each window row is one block of the data's C channels, so C
    # times the item size must be at least this many bytes (smaller blocks: the unfold).
    gather_min_block_bytes: int = 64
    # A Conv with a small kernel (a forward, an input gradient) in the gather form when its
    # output has at most this many positions per image (0: never).
    gather_max_forward_positions: int = 64
    # Largest index table (bytes, int32 or int64) the gather form stores; above, the unfold.
    max_gather_index_bytes: int = 64 * 1024 * 1024
    # Groups > 1: rewritten only when the windows are read with at most this step (the Conv's
    # dilation, the forward's stride): a strided Slice is an element-wise copy in onnxruntime,
    # slower than the grouped Conv itself (depthwise stride 2: 1.4x the Conv).
    grouped_max_window_step: int = 1


@dataclasses.dataclass(frozen=True)
class _Geometry:
    dims: int
    group: int
    batch: int  # B: data's first dim
    out_channels: int  # M: weight's first dim
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: tuple[int, ...]  # begin..., end...
    out: tuple[int, ...]
    spatial: tuple[int, ...]  # the data's, unpadded
    channels: int | None  # C: data's channels (None where symbolic)
    itemsize: int

    @property
    def positions(self) -> int:
        return math.prod(self.out)


def _ints(node: ir.Node, name: str, default: list[int]) -> list[int]:
    attr = node.attributes.get(name)
    return list(attr.as_ints()) if attr is not None and list(attr.as_ints()) else default


def _pads(node: ir.Node, spatial: list[int], kernel: list[int], strides: list[int],
          dilations: list[int]) -> list[int]:
    dims = len(spatial)
    auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
    if auto_pad == "VALID":
        return [0] * (2 * dims)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(spatial, kernel, strides, dilations, strict=True):
            total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
            first = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
            begin.append(first)
            end.append(total - first)
        return begin + end
    return _ints(node, "pads", [0] * (2 * dims))


def geometry(node: ir.Node) -> _Geometry | None:
    """The Conv's static geometry where the rewrite can apply, else None."""
    if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    data, weight = node.inputs[0], node.inputs[1]
    if data.dtype not in _FLOATS or data.shape is None or weight.shape is None:
        return None
    dshape, wshape = list(data.shape), list(weight.shape)
    dims = len(dshape) - _LEAD
    if dims < 1 or len(wshape) != len(dshape):
        return None
    fixed = [d for d in (dshape[0], wshape[0], *dshape[_LEAD:], *wshape[_LEAD:]) if isinstance(d, int)]
    if len(fixed) != 2 + 2 * dims:
        return None
    batch, out_channels, *sizes = fixed
    spatial, kernel = sizes[:dims], sizes[dims:]
    strides = _ints(node, "strides", [1] * dims)
    dilations = _ints(node, "dilations", [1] * dims)
    pads = _pads(node, spatial, kernel, strides, dilations)
    out = [(size + pads[a] + pads[dims + a] - (k - 1) * d - 1) // s + 1
           for a, (size, k, s, d) in enumerate(zip(spatial, kernel, strides, dilations, strict=True))]
    if min(out) < 1:
        return None
    group = node.attributes.get_int("group", 1)
    channels = dshape[1] if isinstance(dshape[1], int) else None
    return _Geometry(dims, group, batch, out_channels, tuple(kernel), tuple(strides), tuple(dilations),
                     tuple(pads), tuple(out), tuple(spatial), channels, _FLOATS[data.dtype])


def choose_form(geo: _Geometry, options: ConvGemmOptions) -> str | None:
    """The form to write (module docstring), or None: leave the Conv to onnxruntime."""
    if geo.positions > options.max_output_positions:
        return None
    if math.prod(geo.kernel) < options.min_kernel_per_position * geo.positions:
        return "gather" if small_output_gather(geo, options) else None
    if geo.group > 1:
        return "grouped" if max(geo.dilations) <= options.grouped_max_window_step else None
    if geo.channels is None:
        return "taps"
    if _window_bytes(geo) > options.max_unfold_bytes:
        return "taps"
    return "gather" if gather_fits(geo, options) else "unfold"


def _window_bytes(geo: _Geometry) -> int:
    """Bytes of all windows side by side (the unfold's and the gather form's copy of the data)."""
    assert geo.channels is not None
    return geo.positions * geo.batch * geo.channels * math.prod(geo.kernel) * geo.itemsize


def small_output_gather(geo: _Geometry, options: ConvGemmOptions) -> bool | None:
    """Whether a forward-like Conv (a small kernel) is written in the gather form: group 1,
    few output positions per image, so that onnxruntime's per-image GEMMs are thin and one
    GEMM over the whole batch is not (None: left to onnxruntime; also where the windows, K times
    the data, exceed ``max_unfold_bytes``: onnxruntime's im2col holds one image's)."""
    if (geo.group != 1 or geo.channels is None or geo.positions > options.gather_max_forward_positions
            or math.prod(geo.kernel) == 1  # 1x1: onnxruntime's GEMM needs no im2col (mobilenetv2 1.06x)
            or _window_bytes(geo) > options.max_unfold_bytes):
        return None
    return gather_fits(geo, options)


def gather_fits(geo: _Geometry, options: ConvGemmOptions) -> bool | None:
    """Whether a group-1 unfold is written as one ``Gather`` (True) or Slices and a Concat
    (None; tools/ab_rule.py turns the gather form off by patching this to return None)."""
    assert geo.channels is not None
    index_bytes = geo.positions * math.prod(geo.kernel) * _index_dtype(geo)().itemsize
    if geo.channels * geo.itemsize < options.gather_min_block_bytes or index_bytes > options.max_gather_index_bytes:
        return None
    return True


def _index_dtype(geo: _Geometry) -> type[np.integer]:
    return np.int32 if math.prod(geo.spatial) < np.iinfo(np.int32).max else np.int64


class _Writer:
    """Builds one form for one Conv (``b`` the builder, ``geo`` its geometry)."""

    def __init__(self, b: OpBuilder, geo: _Geometry, data: Var, weight: Var) -> None:
        self.b, self.geo = b, geo
        self.unpadded, self.weight = data, weight

    @functools.cached_property
    def data(self) -> Var:
        """The data with the Conv's pads (one ``Pad``; the gather form reads zeros otherwise)."""
        geo, dims = self.geo, self.geo.dims
        if not any(geo.pads):
            return self.unpadded
        pads = np.array([0, 0, *geo.pads[:dims], 0, 0, *geo.pads[dims:]], np.int64)
        return self.b.Pad(self.unpadded, self.b.const(pads))

    def window(self, position: tuple[int, ...]) -> Var:
        """The (B, C, *kernel) window of the padded data that output ``position`` reads."""
        geo, b = self.geo, self.b
        starts = [t * s for t, s in zip(position, geo.strides, strict=True)]
        ends = [start + (k - 1) * d + 1 for start, k, d in zip(starts, geo.kernel, geo.dilations, strict=True)]
        return b.Slice(self.data, b.const(np.array(starts, np.int64)), b.const(np.array(ends, np.int64)),
                       b.const(np.arange(_LEAD, _LEAD + geo.dims, dtype=np.int64)),
                       b.const(np.array(geo.dilations, np.int64)))

    def positions(self) -> list[tuple[int, ...]]:
        return list(itertools.product(*[range(o) for o in self.geo.out]))

    def finish(self, stacked: Var) -> Var:
        """(T, M, B) -> Y: (B, M, *out)."""
        geo, b = self.geo, self.b
        moved = b.Transpose(stacked, perm=[2, 1, 0])
        return b.Reshape(moved, b.const(np.array([geo.batch, geo.out_channels, *geo.out], np.int64)))

    def stack(self, parts: list[Var]) -> Var:
        """Per-position (M, B) results -> (T, M, B)."""
        b = self.b
        shape = b.const(np.array([1, self.geo.out_channels, self.geo.batch], np.int64))
        lifted = [b.Reshape(p, shape) for p in parts]
        return lifted[0] if len(lifted) == 1 else b.Concat(*lifted, axis=0)

    def unfold(self) -> Var:
        geo, b = self.geo, self.b
        windows = [self.window(t) for t in self.positions()]
        stacked = windows[0] if len(windows) == 1 else b.Concat(*windows, axis=0)  # (T*B, C, *K)
        columns = b.Reshape(stacked, b.const(np.array([geo.positions * geo.batch, -1], np.int64)))
        rows = b.Reshape(self.weight, b.const(np.array([geo.out_channels, -1], np.int64)))
        product = b.Gemm(columns, rows, transB=1)  # (T*B, M)
        shape = b.const(np.array([geo.positions, geo.batch, geo.out_channels], np.int64))
        return self.finish(b.Transpose(b.Reshape(product, shape), perm=[0, 2, 1]))

    def gather_index(self) -> np.ndarray:
        """(T, K): the flat (unpadded) data position output position t reads at kernel tap i,
        or prod(spatial), the zero row's, where that position is padding."""
        geo = self.geo
        flat = np.zeros((geo.positions, math.prod(geo.kernel)), np.int64)
        valid = np.ones(flat.shape, bool)
        grids = np.meshgrid(*[np.arange(o) for o in geo.out], indexing="ij")
        taps = np.meshgrid(*[np.arange(k) for k in geo.kernel], indexing="ij")
        for a in range(geo.dims):
            t = grids[a].reshape(-1, 1)
            i = taps[a].reshape(1, -1)
            p = t * geo.strides[a] + i * geo.dilations[a] - geo.pads[a]
            valid &= (p >= 0) & (p < geo.spatial[a])
            flat = flat * geo.spatial[a] + np.clip(p, 0, geo.spatial[a] - 1)
        return np.where(valid, flat, math.prod(geo.spatial)).astype(_index_dtype(geo))

    def gather(self) -> Var:
        """Channels last: the windows' rows are blocks of C, gathered in one op (module docstring)."""
        geo, b = self.geo, self.b
        dims = geo.dims
        channels_last = [0, *range(_LEAD, _LEAD + dims), 1]
        rows = b.Transpose(self.unpadded, perm=channels_last)  # (B, *S, C)
        rows = b.Reshape(rows, b.const(np.array([geo.batch, -1, geo.channels], np.int64)))
        index = self.gather_index()
        windows = rows  # a 1x1 kernel reading every position: the rows are the windows
        if index.shape[1] != 1 or not np.array_equal(index[:, 0], np.arange(math.prod(geo.spatial))):
            if (index == math.prod(geo.spatial)).any():
                zero = b.const(np.zeros((1, 1, 1), np.float32 if geo.itemsize == 4 else np.float64))
                zeros = b.Expand(zero, b.const(np.array([geo.batch, 1, geo.channels], np.int64)))
                rows = b.Concat(rows, zeros, axis=1)
            windows = b.Gather(rows, b.const(index), axis=1)  # (B, T, K, C)
        columns = b.Reshape(windows, b.const(np.array([geo.batch * geo.positions, -1], np.int64)))
        kernel = b.Transpose(self.weight, perm=channels_last)  # (M, *K, C)
        kernel = b.Reshape(kernel, b.const(np.array([geo.out_channels, -1], np.int64)))
        # (B*T, M): MLAS packs the second operand, the small one here (the other order was 1.5x).
        # onnxruntime fuses a Transpose right after the Gemm into it (the slow order again): the
        # Reshape between keeps them apart. One Transpose to Y; for a weight gradient the rule's
        # Transpose follows it and onnxruntime merges the two into one 2-D transpose.
        product = b.Reshape(b.Gemm(columns, kernel, transB=1),
                            b.const(np.array([geo.batch, *geo.out, geo.out_channels], np.int64)))
        return b.Transpose(product, perm=[0, dims + 1, *range(1, dims + 1)])  # (B, M, *out)

    def taps(self) -> Var:
        geo, b = self.geo, self.b
        rows = b.Reshape(self.weight, b.const(np.array([geo.out_channels, -1], np.int64)))
        flat = b.const(np.array([geo.batch, -1], np.int64))
        return self.finish(self.stack([b.Gemm(rows, b.Reshape(self.window(t), flat), transB=1)
                                       for t in self.positions()]))

    def grouped(self) -> Var:
        """Per position, a batched MatMul over the groups: (g, M/g, C/g*K) x (g, C/g*K, B)."""
        geo, b = self.geo, self.b
        g = geo.group
        rows = b.Reshape(self.weight, b.const(np.array([g, geo.out_channels // g, -1], np.int64)))
        parts = []
        for t in self.positions():
            split = b.Reshape(self.window(t), b.const(np.array([geo.batch, g, -1], np.int64)))
            part = b.MatMul(rows, b.Transpose(split, perm=[1, 2, 0]))
            parts.append(b.Reshape(part, b.const(np.array([geo.out_channels, geo.batch], np.int64))))
        return self.finish(self.stack(parts))


class ConvWeightGemmPass(InPlacePass):
    """Rewrite each Conv that :func:`choose_form` picks (module docstring)."""

    def __init__(self, options: ConvGemmOptions | None = None) -> None:
        super().__init__()
        self.options = options or ConvGemmOptions()

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if default_opset(model) < _MIN_OPSET:
            return PassResult(model, False)
        convs = [n for n in graph if n.op_type == "Conv" and n.domain in DEFAULT_DOMAINS]
        if any(n.inputs[0] is not None and n.inputs[0].shape is None for n in convs):
            infer_missing_shapes(model)  # gradient values: their shapes were not written
        modified = False
        for node in convs:
            geo = geometry(node)
            form = choose_form(geo, self.options) if geo is not None else None
            if geo is not None and form is not None:
                self._rewrite(model, node, geo, form)
                modified = True
        return PassResult(model, modified)

    @staticmethod
    def _rewrite(model: ir.Model, node: ir.Node, geo: _Geometry, form: str) -> None:
        graph = model.graph
        b = OpBuilder(default_opset(model), dict(model.opset_imports))
        b.prefix = f"{node.name or 'Conv'}/gemm"
        b.marks = dict(node.metadata_props)
        data, weight = node.inputs[0], node.inputs[1]
        assert data is not None and weight is not None
        writer = _Writer(b, geo, b.wrap(data), b.wrap(weight))
        if form == "gather":
            y = writer.gather()
        elif form == "unfold":
            y = writer.unfold()
        elif form == "taps":
            y = writer.taps()
        else:
            y = writer.grouped()
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            per_channel = b.const(np.array([1, -1] + [1] * geo.dims, np.int64))
            y = b.Add(y, b.Reshape(b.wrap(node.inputs[2]), per_channel))
        scope_taken_names(graph, b.nodes, b.prefix)
        graph.insert_before(node, b.nodes)
        old = node.outputs[0]
        y.value.type, y.value.shape = old.type, old.shape
        take_over(graph, old, y.value)
        graph.remove(node, safe=True)
