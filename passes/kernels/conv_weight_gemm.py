"""ConvWeightGemmPass: a Conv with few output positions and a large kernel, as GEMMs.

The Conv gradient rule (passes/autodiff/rules/conv.py) writes a weight gradient as a
correlation: a ``Conv`` whose data is the padded input with the batch folded into the channels
(``(Cin/g, g*N, *spatial)``), whose kernel is the output gradient (``(Cout, N, *out)``), and whose
output has the original kernel's taps as its positions (3x3 = 9). onnxruntime's CPU Conv runs it
as an im2col of ``N*H*W`` rows per output position and a GEMM whose columns are those few
positions: a thin GEMM far from MLAS's peak. The same sum is, for every output position ``t``
(``t * stride`` the offset of its window)::

    Y[b, m, t] = sum_{c in group(m), i} Dp[b, c, t * stride + i * dilation] * W[m, c, i]

that is the product of ``W`` flattened to ``(M, C/g * K)`` with the window of ``Dp`` that
position ``t`` reads (a ``Slice`` with step ``dilation``), flattened to ``(B, C/g * K)``. Forms
(picked by :class:`ConvGemmOptions` from the shapes):

1. ``unfold`` (group 1): the T windows concatenated, ``(T*B, C*K)``, one ``Gemm`` with
   ``transB`` (im2col + GEMM, as torch computes a weight gradient);
2. ``taps`` (group 1, an unfold above ``max_unfold_bytes`` or of a symbolic channel count): one
   ``Gemm`` per position, ``W (M, C*K) x window^T``;
3. ``grouped`` (group > 1, depthwise included): per position a batched ``MatMul`` over the
   groups, ``(g, M/g, C/g*K) x (g, C/g*K, B)``; only where the windows are read with step 1
   (``grouped_max_window_step``).

Measured (tools/ab_pass.py and single-Conv A/Bs, medians of interleaved ratios on a shared,
loaded 2-core machine; docs/passes.md, Convolutions): the benchmark CNN's three weight
gradients 0.6-0.8x the Conv (taps as fast for 32 and 64 input channels, 1.4x the Conv for 3
input channels and for 256 channels at 4x4), a 1x1 conv's 0.3-0.4x, depthwise stride 1 0.3x;
depthwise stride 2 1.4x (left alone).

The positions' results are stacked, transposed to ``(B, M, T)`` and reshaped to Y's shape (a
bias input is added). Pads (explicit, ``VALID`` or ``SAME_*``) become one ``Pad``.

Rewritten (models of opset 13 or later): a default-domain float32 / float64 Conv of the main graph whose data has a static
spatial shape and first dim, whose weight has a static first dim and kernel, with
``T <= max_output_positions`` output positions and a kernel of at least
``min_kernel_per_position`` times T taps (the weight-gradient shape; a forward Conv with a
small kernel is left to onnxruntime's own kernel). 1-D, 2-D and 3-D, any stride, dilation and
group. Values agree with the Conv to float rounding (sums in another order).
"""

from __future__ import annotations

import dataclasses
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
    # Largest concatenated window tensor (bytes) built for the unfold form; above, per-position Gemms.
    max_unfold_bytes: int = 256 * 1024 * 1024
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
                     tuple(pads), tuple(out), channels, _FLOATS[data.dtype])


def choose_form(geo: _Geometry, options: ConvGemmOptions) -> str | None:
    """The form to write (module docstring), or None: leave the Conv to onnxruntime."""
    if geo.positions > options.max_output_positions:
        return None
    if math.prod(geo.kernel) < options.min_kernel_per_position * geo.positions:
        return None
    if geo.group > 1:
        return "grouped" if max(geo.dilations) <= options.grouped_max_window_step else None
    if geo.channels is None:
        return "taps"
    unfold = geo.positions * geo.batch * geo.channels * math.prod(geo.kernel) * geo.itemsize
    return "unfold" if unfold <= options.max_unfold_bytes else "taps"


class _Writer:
    """Builds one form for one Conv (``b`` the builder, ``geo`` its geometry)."""

    def __init__(self, b: OpBuilder, geo: _Geometry, data: Var, weight: Var) -> None:
        self.b, self.geo = b, geo
        dims = geo.dims
        if any(geo.pads):
            data = b.Pad(data, b.const(np.array([0, 0, *geo.pads[:dims], 0, 0, *geo.pads[dims:]], np.int64)))
        self.data, self.weight = data, weight

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
        if form == "unfold":
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
