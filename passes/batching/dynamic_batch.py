"""DynamicBatchPass: make the fixed batch dimension of a model's inputs symbolic.

Which graph inputs are batched (B is the static leading size they share):
1. ``batch_inputs`` given: exactly those inputs; each needs rank >= 1 and the same static
   leading size.
2. Otherwise the candidates are the inputs a dynamo export marks ``USER_INPUT`` (value metadata
   ``pkg.torch.export.graph_signature.InputSpec.kind``), or every non-initializer graph input
   when none is marked. Among candidates of rank >= 1 with a static leading size, B is the most
   common leading size (a tie goes to the earliest input) and exactly the candidates whose
   leading size is B are batched.
3. No such candidate (e.g. the batch is symbolic already): nothing changes (``modified=False``).

The graph is sorted and shapes are inferred at B (on a copy whose constant-only nodes are
folded). An analysis then walks the graph in order and records for each value the axis holding
the batch (an axis of k*N entries when a reshape merged the batch with other dims, e.g. [N, 6, 8]
-> [6N, 8] or [L, N, E] -> [L*N, E]), or that the value is batch-free, or "unknown" after ops it
does not model; and which entries of shape tensors computed by ``Shape`` hold N. Constants
holding B are rewritten by their role, never by their value alone (a hidden size equal to B
stays):
1. Reshape / Flatten of a batched value: the target entry of the dim that receives the batch
   rows becomes 0 (``allowzero=0``, same axis and layout), else -1 (no other -1), else
   ``Concat(..., N*k, ...)``. A constant target that splits the rows across dims
   (``x.reshape(2, -1)``) is refused.
2. A batch-free value meeting a batched one on the batch axis (broadcasting ops, Concat, MatMul,
   Gemm's C, the initial states of LSTM/GRU/RNN, the indices of Gather/GatherND into the batch
   axis, the data of GatherElements / ScatterElements, a graph output with leading size B) is
   traced back through elementwise ops, Cast, Transpose, (Un)squeeze, Concat, Slice (of other
   axes), Gather and Expand (to ``u`` when the shape is ``Shape(u)``) to where it comes from,
   which is rewritten: an Expand / ConstantOfShape / Tile shape entry or a
   Range limit (start 0, step 1) becomes N*k; a constant (initializer or Constant) whose slices
   along that axis are all equal becomes its first slice (broadcast, or expanded to N); an
   integer constant whose slices are C0 + b*D (batch indices, a folded ``arange``) becomes
   C0 + arange(N)*D. Anything else is refused (a per-row parameter of shape [B, ...]).
3. An Expand shape entry facing a batched data axis becomes 1.
4. Slice over the batch axis with start 0, step 1 and end k*B: the end becomes INT64_MAX; other
   starts/ends holding k*B there are refused. Slices of other axes are kept.
5. Resize ``sizes``: the batch entry becomes N*k.
6. Mean losses: ``Div(s, c)`` (or ``Mul(s, 1/c)``) where ``s`` sums over the batch axis
   (ReduceSum, ReduceSumSquare, ReduceL1, a loss with ``reduction="sum"``) and ``c`` is B, k*B or
   the number of summed elements: ``c`` becomes ``N*c/B``. ReduceMean needs nothing.
7. Refused rather than guessed: a shape-like argument holding B (Reshape, Expand, Tile, Slice,
   Resize) of a value whose batch is unknown, and a small integer constant holding B fed to an
   op the analysis does not model together with a batched or unknown value.
Finally the batched inputs' leading dim becomes ``dim_name``; batched values get ``dim_name``
(or ``"dim_name*k"``) on their batch axis; values whose batch is unknown lose their shape.
A refusal raises :class:`GradientError` with :data:`BATCH_ERROR`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import TopologicalSortPass

from passes.autodiff.errors import GradientError
from passes.forward.fold_constants import FoldConstantsPass

USER_INPUT_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
INT64_MAX = int(np.iinfo(np.int64).max)
_TO_THE_END = int(np.iinfo(np.int32).max)  # Slice ends from here on mean "to the end" (exporters use both)

BATCH_ERROR = (
    "cannot make the batch dimension of model input(s) {inputs} dynamic: {reason}. Export the "
    "model with a dynamic batch instead: with the dynamo exporter, batch = "
    "torch.export.Dim(\"batch\"); torch.onnx.export(model, args, path, "
    "dynamic_shapes={dynamic_shapes}); with dynamo=False, torch.onnx.export(model, args, path, "
    "input_names=[...], dynamic_axes={dynamic_axes})"
)


def batch_error(inputs: Sequence[str], reason: str) -> GradientError:
    """The one documented refusal: names the inputs and how to export them with a dynamic batch."""
    shapes = "{" + ", ".join(f"{n!r}: {{0: batch}}" for n in inputs) + "}"
    axes = "{" + ", ".join(f"{n!r}: {{0: 'batch'}}" for n in inputs) + "}"
    return GradientError(BATCH_ERROR.format(inputs=", ".join(repr(n) for n in inputs), reason=reason,
                                            dynamic_shapes=shapes, dynamic_axes=axes))


def select_batch_inputs(graph: ir.Graph, names: Sequence[str] | None = None) -> tuple[int, list[ir.Value]]:
    """(B, batched inputs) by the numbered rule above; (0, []) when no input has a static batch."""
    inputs = [v for v in graph.inputs if not v.is_initializer()]
    if names is not None:
        by_name = {v.name: v for v in inputs}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise batch_error(list(names), f"{missing} are not graph inputs (inputs: {list(by_name)})")
        sizes = {_leading(by_name[n]) for n in names}
        if len(sizes) != 1 or None in sizes:
            raise batch_error(list(names), f"their leading dimensions are not one static size ({sizes})")
        return int(sizes.pop() or 0), [by_name[n] for n in names]
    marked = [v for v in inputs if v.metadata_props.get(USER_INPUT_KEY) == "USER_INPUT"]
    candidates = [v for v in (marked or inputs) if _leading(v) is not None]
    if not candidates:
        return 0, []
    leading = [_leading(v) for v in candidates]
    counts = collections.Counter(leading)
    size = max(counts, key=lambda s: (counts[s], -leading.index(s)))
    return int(size or 0), [v for v in candidates if _leading(v) == size]


class DynamicBatchPass(InPlacePass):
    def __init__(self, batch_inputs: Sequence[str] | None = None, dim_name: str = "batch") -> None:
        super().__init__()
        self.batch_inputs = None if batch_inputs is None else list(batch_inputs)
        self.dim_name = dim_name

    def call(self, model: ir.Model) -> PassResult:
        size, inputs = select_batch_inputs(model.graph, self.batch_inputs)
        if not inputs:
            return PassResult(model, False)
        TopologicalSortPass()(model)  # the analysis walks the graph once, in order
        _infer_shapes(model)  # static shapes at B, read by the analysis
        analysis = _Analysis(model, size, inputs)
        try:
            analysis.run()
        except _Refusal as refusal:
            raise batch_error([v.name or "" for v in inputs], str(refusal)) from None
        _Emitter(model.graph, inputs[0]).apply({**analysis.edits, **analysis.fixed})
        for value in inputs:
            value.shape = ir.Shape([ir.SymbolicDim(self.dim_name), *list(value.shape or [])[1:]])
        for value, batch in analysis.state.items():
            if batch is None or value.is_graph_input() or not isinstance(value.type, ir.TensorType):
                continue
            if value.shape is None or batch is UNKNOWN or batch.axis >= len(value.shape):
                value.shape = None
            else:
                dims = list(value.shape)
                name = self.dim_name if batch.factor == 1 else f"{self.dim_name}*{batch.factor}"
                dims[batch.axis] = ir.SymbolicDim(name)
                value.shape = ir.Shape(dims)
        return PassResult(model, True)


def _infer_shapes(model: ir.Model) -> None:
    """Fill in node outputs' tensor shapes with onnx shape inference, run on a copy whose
    constant-only nodes are folded (so Expand shapes computed by Where/ConstantOfShape chains are
    known) and whose large initializers are inputs (only their shapes matter). onnx_ir's
    ShapeInferencePass is not used: it types the outputs of sequence ops as tensors."""
    initializers = list(model.graph.initializers.values())
    large = [v for v in initializers if v.const_value is not None and v.const_value.size > 1024]
    for value in large:  # serialized without their data, then put back in their order
        model.graph.initializers.pop(value.name or "")
    try:
        proto = ir.to_proto(model)
    finally:
        model.graph.initializers.clear()
        for value in initializers:
            model.graph.register_initializer(value)
    proto.graph.input.extend(onnx.helper.make_tensor_value_info(v.name or "", int(v.dtype or 1),
                                                                v.const_value.shape.numpy() if v.const_value else [])
                             for v in large)
    folded = ir.from_proto(proto)
    with np.errstate(all="ignore"):  # e.g. casting a -inf mask to int: only shapes are read
        FoldConstantsPass()(folded)
    try:
        inferred = onnx.shape_inference.infer_shapes(ir.to_proto(folded), strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - the analysis then works with the shapes it has
        return
    types = {info.name: info.type for info in [*inferred.graph.value_info, *inferred.graph.output]}
    for node in model.graph:
        for value in node.outputs:
            found = types.get(value.name or "")
            if found is None or found.WhichOneof("value") != "tensor_type":
                continue
            if value.type is None:
                value.type = ir.serde.deserialize_type_proto_for_type(found)
            shape = ir.serde.deserialize_type_proto_for_shape(found)
            if isinstance(value.type, ir.TensorType) and shape is not None and _static(value) is None:
                value.shape = shape


# ---------------------------------------------------------------------------------------------
# The analysis: where the batch is, and which constants to rewrite (planned, applied afterwards)


@dataclasses.dataclass(frozen=True)
class Batch:
    """The batch of a value: ``axis`` holds ``factor`` * N entries laid out outer x N x inner
    (outer * inner = factor; outer > 1 once a reshape merged leading dims with the batch)."""

    axis: int
    factor: int = 1
    outer: int = 1

    def at(self, axis: int) -> Batch:
        return dataclasses.replace(self, axis=axis)


UNKNOWN = Batch(-1, 0)


@dataclasses.dataclass(frozen=True)
class N:
    """A shape entry N * factor, computed from the batch size at run time."""

    factor: int = 1


@dataclasses.dataclass(frozen=True)
class Edit:
    """What replaces one node input: ``entries`` (a shape); ``affine``: a constant whose slices
    along ``axis`` are C0 + b*D, rebuilt for N (C0 expanded to N * ``factor`` when ``expand``);
    ``divisor``: N * ``scale`` (its reciprocal for Mul); ``scalar``: N * ``factor`` (Range limit)."""

    kind: str
    entries: tuple[int | N, ...] = ()
    axis: int = 0
    factor: int = 1
    expand: bool = False
    scale: float = 1.0


class _Refusal(Exception):
    pass


_SAME = frozenset(
    "Abs Acos Acosh Asin Asinh Atan Atanh Cast Ceil Celu Clip Cos Cosh CumSum Dropout Elu "
    "Erf Exp Floor Gelu HardSigmoid HardSwish Hardmax Identity IsInf IsNaN LeakyRelu Log LogSoftmax "
    "LpNormalization MeanVarianceNormalization Mish Neg Not Reciprocal Relu Round Selu Shrink "
    "Sigmoid Sign Sin Sinh Softmax Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Trilu".split())
_BROADCAST = frozenset(
    "Add And BitShift BitwiseAnd BitwiseOr BitwiseXor Div Equal Greater GreaterOrEqual Less "
    "LessOrEqual Max Mean Min Mod Mul Or PRelu Pow Sub Sum Where Xor".split())
_SPATIAL = frozenset(
    "AveragePool BatchNormalization Conv ConvTranspose DepthToSpace GlobalAveragePool GlobalLpPool "
    "GlobalMaxPool GroupNormalization InstanceNormalization LRN LpPool MaxPool SpaceToDepth".split())
_REDUCE = frozenset(
    "ArgMax ArgMin ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin "
    "ReduceProd ReduceSum ReduceSumSquare".split())
_RECURRENT = frozenset({"GRU", "LSTM", "RNN"})
_SUMS = frozenset({"ReduceSum", "ReduceSumSquare", "ReduceL1"})
_SUM_PASS = frozenset({"Identity", "Cast", "Neg", "Squeeze", "Unsqueeze", "Reshape", "Flatten"})
_RANDOM = frozenset("Bernoulli Dropout Multinomial RandomNormal RandomNormalLike RandomUniform "
                    "RandomUniformLike".split())
_GENERATORS = {"Expand": 1, "ConstantOfShape": 0, "Tile": 1}


def _leading(value: ir.Value) -> int | None:
    dims = _dims(value)
    return dims[0] if dims and isinstance(dims[0], int) else None


def _dims(value: ir.Value | None) -> list[int | None] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def _rank(value: ir.Value | None) -> int:
    return len(value.shape) if value is not None and value.shape is not None else 0


def _static(value: ir.Value | None) -> list[int] | None:
    dims = _dims(value)
    return None if dims is None or None in dims else [int(d or 0) for d in dims]


def _ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(x) for x in attr.value]


def _regroup(dims: list[int], batch: Batch, size: int, out: list[int]) -> Batch | None:
    """Where the batch lands when ``dims`` (batch ``batch``, batch size ``size``) are reshaped to
    ``out``: the one output dim that holds all N rows whole, or None when a reshape splits them."""
    before = math.prod(dims[: batch.axis]) * batch.outer  # elements laid out ahead of N
    acc = 1
    for j, width in enumerate(out):
        if before % acc == 0 and width and (acc * width) % (before * size) == 0:
            outer, inner = before // acc, acc * width // (before * size)
            return Batch(j, outer * inner, outer)
        acc *= width
        if acc > before:
            return None
    return None


class _Analysis:
    def __init__(self, model: ir.Model, size: int, inputs: list[ir.Value]) -> None:
        self.graph, self.B = model.graph, size
        self.opset = model.opset_imports.get("", 13)
        self.inputs: dict[ir.Value, Batch | None] = {v: Batch(0) for v in inputs}
        self.forced: dict[ir.Value, Batch] = {}  # made batched by rewriting where they come from
        self.fixed: dict[tuple[ir.Node, int], Edit] = {}  # those rewrites
        self.edits: dict[tuple[ir.Node, int], Edit] = {}  # rewrites found by the last sweep
        self.state: dict[ir.Value, Batch | None] = {}
        self.sums: dict[ir.Value, tuple[int, int]] = {}  # value -> (summed elements, factor)
        self.shapes: dict[ir.Value | None, dict[int, int]] = {}  # shape tensor -> {position: factor of N}
        self._consts: dict[ir.Value, np.ndarray | None] = {}

    def run(self) -> None:
        for node in self.graph:  # shapes of values computed from constants, where inference has none
            for value in node.outputs:
                array = self.const(value) if _static(value) is None and len(node.outputs) == 1 else None
                if array is not None:
                    value.shape, value.dtype = ir.Shape(array.shape), ir.DataType.from_numpy(array.dtype)
        for _ in range(len(self.graph) + 2):
            grown = (len(self.forced), len(self.fixed))
            self.sweep()
            for out in self.graph.outputs:
                if self.state.get(out) is None and _leading(out) == self.B and self.B > 1:
                    self.resolve(out, 0, 1, None, 0, soft=True)
            if (len(self.forced), len(self.fixed)) == grown:
                return

    def sweep(self) -> None:
        self.state, self.edits, self.sums, self.shapes = dict(self.inputs), {}, {}, {}
        for node in self.graph:
            outs = self.visit(node)
            for value, batch in zip(node.outputs, outs):
                self.state[value] = self.forced.get(value, batch)

    # -- helpers ------------------------------------------------------------------------------
    def const(self, value: ir.Value | None) -> np.ndarray | None:
        """The value's array when it is computed from constants only (not from graph inputs)."""
        if value is None or value.is_graph_input():
            return None
        if value not in self._consts:
            self._consts[value] = None
            node, out = value.producer(), None
            if node is None:
                out = value.const_value.numpy() if value.const_value is not None else None
            elif node.op_type == "Constant":
                tensor = ir.convenience.get_const_tensor(value)
                out = tensor.numpy() if tensor is not None else None
            elif node.domain in ("", "ai.onnx") and node.op_type not in _RANDOM and len(node.outputs) == 1 \
                    and not any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                                for a in node.attributes.values()):
                arrays = [self.const(v) for v in node.inputs]
                if all((a is not None and a.size <= 4096) or v is None for a, v in zip(arrays, node.inputs)):
                    with np.errstate(all="ignore"):  # e.g. casting a -inf mask: the value is not needed
                        out = FoldConstantsPass._evaluate(node, arrays, self.opset)
            self._consts[value] = out
        return self._consts[value]

    def holds(self, array: np.ndarray | None, factor: int = 1) -> bool:
        if array is None or array.dtype.kind not in "iu" or array.ndim > 1:
            return False
        return bool(np.isin(array, [self.B, factor * self.B]).any())

    def refuse_if_holds(self, node: ir.Node, indices: Sequence[int], factor: int = 1) -> None:
        for i in indices:
            if i < len(node.inputs) and self.holds(self.const(node.inputs[i]), factor):
                raise _Refusal(f"{node.op_type} node {node.name!r} takes {self.const(node.inputs[i])!s} "
                               f"(holding the batch size {self.B}) but where its input holds the batch "
                               "is not known")

    def affine(self, array: np.ndarray, axis: int, factor: int) -> bool:
        """Slices along ``axis`` all equal, or (integers, factor 1) C0 + b*D: batch indices."""
        rows = np.moveaxis(array, axis, 0)
        if self.B > 1 and (rows == rows[:1]).all():
            return True
        if factor != 1 or array.dtype.kind not in "iu" or len(rows) < 2:
            return False
        steps = np.arange(len(rows)).reshape((-1,) + (1,) * (rows.ndim - 1))
        return bool((rows == rows[0] + steps * (rows[1] - rows[0])).all())

    def meet(self, node: ir.Node, index: int, axis: int, factor: int, expand: bool) -> None:
        """A batch-free input of ``node`` meets the batch on its ``axis``: rewrite its source."""
        dims = _dims(node.inputs[index])
        if axis < 0 or dims is None or dims[axis] is None or (node, index) in self.fixed:
            return
        if dims[axis] == 1 and not (expand and factor * self.B == 1):  # it broadcasts
            return
        self.resolve(node.inputs[index], axis, factor, node, index, expand=expand)

    def resolve(self, value: ir.Value | None, axis: int, factor: int, consumer: ir.Node | None,
                index: int, *, expand: bool = False, soft: bool = False) -> bool:
        """Make ``value`` carry the batch on ``axis`` by rewriting where it comes from (a constant
        whose slices are C0 + b*D, a generator's shape, or the sources of an op that passes the
        axis through). ``soft``: report failure instead of refusing."""
        if value is None or value in self.forced:
            return True
        node, array = value.producer(), self.const(value)
        what = f"{value.name!r} (shape {list(value.shape or [])})"
        if node is None or node.op_type == "Constant":
            if soft or array is None or consumer is None:
                if soft:
                    return False
                raise _Refusal(f"{what} meets the batch on axis {axis} but is not computed from it")
            if self.affine(array, axis, factor) or (expand and factor * self.B == 1):
                self.fixed[(consumer, index)] = Edit("affine", axis=axis, factor=factor, expand=expand)
                return True
            raise _Refusal(f"the constant {what} has one row per batch entry on axis {axis} and its "
                           "rows differ (a parameter or table of the batch's size)")
        edit = self.generator(node, value, axis, factor)
        if edit is not None:
            self.fixed[(node, edit[0])] = edit[1]
            self.forced[value] = Batch(axis, factor)
            return True
        sources = self.sources(node, value, axis)
        if sources and not (soft and len(sources) > 1) and all(
                self.resolve(source, k, factor, user, i, expand=True, soft=soft)
                for source, k, user, i in sources):
            self.forced[value] = Batch(axis, factor)
            return True
        if soft:
            return False
        raise _Refusal(f"{what} meets the batch on axis {axis} but its {node.op_type} node {node.name!r} "
                       "computes it without the batch")

    def generator(self, node: ir.Node, value: ir.Value, axis: int, factor: int) -> tuple[int, Edit] | None:
        """The rewrite that makes an Expand / ConstantOfShape / Tile / Range output N*k long on ``axis``."""
        if node.op_type == "Range":
            start, limit, delta = (self.const(v) for v in node.inputs)
            if axis == 0 and start is not None and delta is not None and limit is not None and start == 0 \
                    and delta == 1 and limit == factor * self.B:
                return 1, Edit("scalar", factor=factor)
            return None
        if node.op_type not in _GENERATORS:
            return None
        at, rank = _GENERATORS[node.op_type], _rank(value)
        shape = self.const(node.inputs[at])
        if shape is None or shape.ndim != 1:
            return None
        pos = axis - (rank - len(shape))
        data = _dims(node.inputs[0]) if node.op_type != "ConstantOfShape" else []
        data_axis = axis - (rank - len(data or []))
        data_dim = (data or [None])[data_axis] if data is not None and 0 <= data_axis < len(data) else 1
        if 0 <= pos < len(shape) and shape[pos] == factor * self.B and data_dim == 1:
            entries: list[int | N] = [int(x) for x in shape]
            entries[pos] = N(factor)
            return at, Edit("entries", tuple(entries))
        return None

    def sources(self, node: ir.Node, value: ir.Value, axis: int) -> list[tuple[ir.Value, int, ir.Node, int]]:
        """(source, its axis, the node reading it, input index) for what makes ``axis`` of
        ``value``, for the ops a batch-sized value is traced back through (the source of an
        Expand whose shape is ``Shape(u)`` is u); empty for other ops."""
        found = [(node.inputs[i], k, node, i) for i, k in self._input_axes(node, value, axis)]
        if node.op_type == "Expand" and not found:
            shape = node.inputs[1]
            producer = shape.producer() if shape is not None else None
            if producer is not None and producer.op_type == "Shape" and producer.inputs[0] is not None:
                length, source = (_static(shape) or [0])[0], producer.inputs[0]
                start = producer.attributes.get_int("start", 0) % max(_rank(source), 1)
                found = [(source, axis - (_rank(value) - length) + start, producer, 0)]
        return [(v, k, user, i) for v, k, user, i in found if v is not None]

    def _input_axes(self, node: ir.Node, value: ir.Value, axis: int) -> list[tuple[int, int]]:
        op, rank = node.op_type, _rank(value)
        if op in _SAME or op == "CastLike":
            return [(0, axis)]
        if op in _BROADCAST or op == "Concat":
            found = []
            for i, v in enumerate(node.inputs):
                dims = _dims(v)
                k = axis - (rank - len(dims or []))
                if dims is not None and 0 <= k < len(dims) and dims[k] != 1:
                    found.append((i, k))
            return found
        if op == "Transpose":
            return [(0, (_ints(node, "perm") or list(reversed(range(rank))))[axis])]
        if op in ("Unsqueeze", "Squeeze"):
            axes = self._axes(node) or []
            if op == "Unsqueeze":
                inserted = {a % rank for a in axes}
                return [] if axis in inserted else [(0, axis - sum(a < axis for a in inserted))]
            removed = {a % max(_rank(node.inputs[0]), 1) for a in axes}
            return [(0, [p for p in range(_rank(node.inputs[0])) if p not in removed][axis])]
        if op == "Gather":
            gather_axis = node.attributes.get_int("axis", 0) % max(_rank(node.inputs[0]), 1)
            width = _rank(node.inputs[1])
            if gather_axis <= axis < gather_axis + width:
                return [(1, axis - gather_axis)]
            return [(0, axis if axis < gather_axis else axis - width + 1)]
        if op == "Expand":
            data = _dims(node.inputs[0]) or []
            k = axis - (rank - len(data))
            return [(0, k)] if 0 <= k < len(data) and data[k] != 1 else []
        if op == "Slice":  # a slice of other axes
            starts = self.const(node.inputs[1])
            given = len(node.inputs) > 3 and node.inputs[3] is not None
            slice_axes = self.const(node.inputs[3]) if given else None
            if starts is None or (slice_axes is None and given):
                return []
            sliced = [int(a) % rank for a in (slice_axes if slice_axes is not None else range(len(starts)))]
            return [] if axis in sliced else [(0, axis)]
        return []

    def _axes(self, node: ir.Node) -> list[int] | None:
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            array = self.const(node.inputs[1])
            return None if array is None else [int(x) for x in array.reshape(-1)]
        return _ints(node, "axes")

    # -- the walk -----------------------------------------------------------------------------
    def visit(self, node: ir.Node) -> list[Batch | None]:
        ins = [self.state.get(v) if v is not None else None for v in node.inputs]
        n = len(node.outputs)
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return [UNKNOWN] * n  # a subgraph may read batched values of the outer graph
        if node.domain not in ("", "ai.onnx"):
            if any(s is not None for s in ins):
                self.refuse_if_holds(node, range(len(node.inputs)))
                return [UNKNOWN] * n
            return [None] * n
        self.follow_shapes(node, ins)
        made = self.made_from_shape(node) if not ins or ins[0] is None else None
        if made is not None:
            return [made]
        if all(s is None for s in ins):
            self.follow_sums(node)
            return [None] * n
        handler = getattr(self, f"v_{node.op_type}", None)
        if handler is None:
            for group, method in ((_SAME, self.same), (_BROADCAST, self.broadcast),
                                  (_SPATIAL, self.spatial), (_REDUCE, self.reduce),
                                  (_RECURRENT, self.recurrent)):
                if node.op_type in group:
                    return method(node, ins)
            self.refuse_if_holds(node, range(len(node.inputs)))
            return [UNKNOWN] * n
        if UNKNOWN in ins and node.op_type not in ("Reshape", "Expand", "Tile", "Slice", "Resize"):
            return [UNKNOWN] * n
        result: list[Batch | None] = handler(node, ins)
        return result

    def follow_sums(self, node: ir.Node) -> None:
        source = node.inputs[0] if node.inputs else None
        if source is None or source not in self.sums:
            return
        if node.op_type in ("Div", "Mul"):
            numel, factor = self.sums[source]
            c = self.const(node.inputs[1])
            if c is not None and c.size == 1 and c.ndim <= 1 and c.dtype.kind == "f" and (
                    self.B > 1 or node.op_type == "Div"):
                value = float(c.reshape(-1)[0])
                target = value if node.op_type == "Div" else (1.0 / value if value else 0.0)
                if any(math.isclose(target, k, rel_tol=1e-6) for k in (self.B, factor * self.B, numel)):
                    self.edits[(node, 1)] = Edit("divisor", scale=target / self.B)
                    return
        elif node.op_type not in _SUM_PASS:
            return
        self.sums[node.outputs[0]] = self.sums[source]

    def follow_shapes(self, node: ir.Node, ins: list[Batch | None]) -> None:
        """Record which entries of shape tensors (from Shape of batched values) hold N * k."""
        op, out = node.op_type, node.outputs[0] if node.outputs else None
        if out is None:
            return
        if op == "Shape" and ins[0] is not None and ins[0] is not UNKNOWN:
            rank = _rank(node.inputs[0])
            start = node.attributes.get_int("start", 0) % max(rank, 1)
            end = node.attributes.get_int("end", rank)
            end = end % rank if end < 0 else min(end, rank)
            if start <= ins[0].axis < end:
                self.shapes[out] = {ins[0].axis - start: ins[0].factor}
            return
        held = self.shapes.get(node.inputs[0]) if node.inputs else None
        if op == "Concat":
            found, offset = {}, 0
            for v in node.inputs:
                for pos, factor in self.shapes.get(v, {}).items():
                    found[offset + pos] = factor
                offset += (_static(v) or [1])[0] if _rank(v) else 1
            if found:
                self.shapes[out] = found
        elif held is None:
            return
        elif op in ("Cast", "Identity") or (op in ("Squeeze", "Unsqueeze", "Reshape") and set(held) == {0}
                                            and math.prod(_static(node.inputs[0]) or [2]) == 1):
            self.shapes[out] = held
        elif op == "Gather" and node.attributes.get_int("axis", 0) == 0:
            index = self.const(node.inputs[1])
            length = (_static(node.inputs[0]) or [0])[0]
            if index is not None and length:
                picked = {i: held[int(x) % length] for i, x in enumerate(index.reshape(-1)) if int(x) % length in held}
                if picked:
                    self.shapes[out] = picked
        elif op == "Slice":
            starts, ends = self.const(node.inputs[1]), self.const(node.inputs[2])
            length = (_static(node.inputs[0]) or [0])[0]
            steps = self.const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
            if starts is not None and ends is not None and starts.size == 1 and length and (
                    steps is None or int(steps.reshape(-1)[0]) == 1):
                lo = max(0, min(length, int(starts[0]) % length if starts[0] < 0 else int(starts[0])))
                hi = max(0, min(length, int(ends[0]) + length if ends[0] < 0 else int(ends[0])))
                picked = {p - lo: f for p, f in held.items() if lo <= p < hi}
                if picked:
                    self.shapes[out] = picked
        elif op == "Mul":
            k = self.const(node.inputs[1])
            if k is not None and k.size == 1 and k.dtype.kind in "iu":
                self.shapes[out] = {p: f * int(k.reshape(-1)[0]) for p, f in held.items()}

    def made_from_shape(self, node: ir.Node) -> Batch | None:
        """Expand / ConstantOfShape / Range whose shape (limit) is a shape tensor holding N * k."""
        at = {"Expand": 1, "ConstantOfShape": 0, "Range": 1}.get(node.op_type)
        if at is None or at >= len(node.inputs) or node.inputs[at] not in self.shapes:
            return None
        held = self.shapes[node.inputs[at]]
        if len(held) != 1:
            return UNKNOWN
        (pos, factor), = held.items()
        if node.op_type == "Range":
            start, delta = self.const(node.inputs[0]), self.const(node.inputs[2])
            return Batch(0, factor) if start is not None and delta is not None and start == 0 and delta == 1 \
                else UNKNOWN
        length = (_static(node.inputs[at]) or [0])[0]
        return Batch(pos + _rank(node.outputs[0]) - length, factor)

    def same(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        return [ins[0] if ins[0] is not None else UNKNOWN] * len(node.outputs)

    def broadcast(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        ranks = [len(v.shape) if v is not None and v.shape is not None else None for v in node.inputs]
        if UNKNOWN in ins or None in ranks:
            return [UNKNOWN] * len(node.outputs)
        r = max(int(x or 0) for x in ranks)
        outs = {s.at(s.axis + r - int(ranks[i] or 0)) for i, s in enumerate(ins) if s is not None}
        if len(outs) != 1:
            return [UNKNOWN] * len(node.outputs)
        out = outs.pop()
        for i, s in enumerate(ins):
            if s is None and node.inputs[i] is not None:
                self.meet(node, i, out.axis - (r - int(ranks[i] or 0)), out.factor, expand=False)
        return [out] * len(node.outputs)

    def spatial(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s = ins[0]
        if s is None or s.axis != 0 or any(x is not None for x in ins[1:]):
            return [UNKNOWN] * len(node.outputs)
        if node.op_type == "BatchNormalization":
            return [s] + [None] * (len(node.outputs) - 1)
        return [s] * len(node.outputs)

    def reduce(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, dims = ins[0], _static(node.inputs[0])
        if s is None or s is UNKNOWN or dims is None:
            return [UNKNOWN]
        if node.op_type in ("ArgMax", "ArgMin"):
            axes: list[int] | None = [int(node.attributes.get_int("axis", 0))]
        else:
            axes = self._axes(node)
            if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
                return [UNKNOWN]
            axes = axes or []
        if not axes:
            if node.attributes.get_int("noop_with_empty_axes", 0):
                return [s]
            axes = list(range(len(dims)))
        axes = [a % len(dims) for a in axes]
        if s.axis in axes:
            if node.op_type in _SUMS:
                self.sums[node.outputs[0]] = (math.prod(dims[a] for a in axes), s.factor)
            return [None]
        keep = node.attributes.get_int("keepdims", 1)
        return [s.at(s.axis if keep else s.axis - sum(a < s.axis for a in axes))]

    def recurrent(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        """LSTM / GRU / RNN: X is [seq, batch, in] (layout 0) or [batch, seq, in] (layout 1)."""
        layout = node.attributes.get_int("layout", 0)
        x, axis = ins[0], 1 - layout
        if x is None or x != Batch(axis):
            return [UNKNOWN] * len(node.outputs)
        for i in range(4, min(len(node.inputs), 7)):  # sequence_lens, initial_h, initial_c
            want = 0 if i == 4 else axis
            if ins[i] is None and node.inputs[i] is not None:
                self.meet(node, i, want, 1, expand=True)
            elif ins[i] is not None and ins[i] != Batch(want):
                return [UNKNOWN] * len(node.outputs)
        outs: list[Batch | None] = [Batch(2 if layout == 0 else 0)]
        return outs + [Batch(axis)] * (len(node.outputs) - 1)

    # -- ops that move, merge or consume the batch (one method per op type) -------------------
    def v_CastLike(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        return [ins[0]]

    def v_Concat(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        found = {s for s in ins if s is not None}
        rank = _rank(node.outputs[0])
        if len(found) != 1 or _dims(node.outputs[0]) is None:
            return [UNKNOWN]
        s = found.pop()
        if s.axis == node.attributes.get_int("axis", 0) % rank:
            return [UNKNOWN]
        for i, x in enumerate(ins):
            if x is None:
                self.meet(node, i, s.axis, s.factor, expand=True)
        return [s]

    def v_MatMul(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        ranks = [len(_dims(v) or []) for v in node.inputs]
        if ranks[1] == 1 and ins[1] is None and ins[0] is not None and ins[0].axis < ranks[0] - 1:
            return [ins[0]]  # a matrix-vector product keeps the rows
        if min(ranks) < 2:
            return [UNKNOWN]
        r, (a, b) = max(ranks), ins
        rows = a is not None and a.axis == ranks[0] - 1
        cols = b is not None and b.axis == ranks[1] - 2
        if rows or cols:  # the batch is contracted: fine when it is on both sides
            return [None] if rows and cols else [UNKNOWN]
        outs = set()
        if a is not None:
            outs.add(a.at(a.axis + r - ranks[0]))
        if b is not None:
            outs.add(b.at(r - 1 if b.axis == ranks[1] - 1 else b.axis + r - ranks[1]))
        if len(outs) != 1:
            return [UNKNOWN]
        out = outs.pop()
        for i, s in enumerate(ins):
            k = out.axis - (r - ranks[i])
            if s is None and 0 <= k < ranks[i] - 2:
                self.meet(node, i, k, out.factor, expand=False)
        return [out]

    def v_Gemm(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        a, b = ins[0], ins[1]
        ta, tb = node.attributes.get_int("transA", 0), node.attributes.get_int("transB", 0)
        if (a is not None and a.axis != ta) or (b is not None and b.axis != 1 - tb) or (a and b):
            return [UNKNOWN]
        s = a.at(0) if a is not None else (b.at(1) if b is not None else UNKNOWN)
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if c is not None and ins[2] is None and c.shape is not None:
            self.meet(node, 2, s.axis - (2 - len(c.shape)), s.factor, expand=False)
        elif c is not None and ins[2] is not None and ins[2] != s.at(s.axis - 2 + _rank(c)):
            return [UNKNOWN]
        return [s]

    def v_Reshape(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, dims, target = ins[0], _static(node.inputs[0]), self.const(node.inputs[1])
        if s is None or s is UNKNOWN or dims is None:
            self.refuse_if_holds(node, [1])
            return [UNKNOWN]
        allowzero = node.attributes.get_int("allowzero", 0)
        out = _static(node.outputs[0]) if target is None else _reshaped(dims, target, allowzero)
        found = None if out is None else _regroup(dims, s, self.B, out)
        held = self.shapes.get(node.inputs[1], {})
        if found is None and target is None and len(held) == 1:  # a target computed from Shape(...)
            (pos, factor), = held.items()
            found = s.at(pos) if (pos, factor) == (s.axis, s.factor) else Batch(pos, factor)
        if found is None:
            if target is None:
                return [UNKNOWN]
            raise _Refusal(f"Reshape node {node.name!r} to {target.tolist()} splits the rows of the batch "
                           f"(axis {s.axis} of shape {dims}) across dimensions")
        if target is not None and out is not None:
            j, entries = found.axis, [int(x) for x in target]
            copies = [i for i, x in enumerate(target) if x == 0 and not allowzero]
            if (s.axis in copies and s.axis != j) or (j in copies and (j != s.axis or found != s.at(j))):
                raise _Refusal(f"Reshape node {node.name!r} copies (0) the batch of {dims} into a "
                               f"fixed position of {target.tolist()}")
            if entries[j] == out[j]:
                new: list[int | N] = list(entries)
                if not allowzero and j == s.axis and found == s:
                    new[j] = 0
                else:
                    new[j] = -1 if -1 not in entries else N(found.factor)
                self.edits[(node, 1)] = Edit("entries", tuple(new))
        return [found]

    def v_Flatten(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, dims = ins[0], _static(node.inputs[0])
        if s is None or dims is None:
            return [UNKNOWN]
        axis = node.attributes.get_int("axis", 1) % (len(dims) + 1)
        found = _regroup(dims, s, self.B, [math.prod(dims[:axis]), math.prod(dims[axis:])])
        return [found if found is not None else UNKNOWN]

    def v_Expand(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, shape, rd = ins[0], self.const(node.inputs[1]), _rank(node.inputs[0])
        if s is None or s is UNKNOWN or _dims(node.inputs[0]) is None:
            self.refuse_if_holds(node, [1])
            return [UNKNOWN]
        if shape is None and _dims(node.outputs[0]) is None:
            return [UNKNOWN]
        r = max(rd, len(shape)) if shape is not None else _rank(node.outputs[0])
        out = s.at(s.axis + r - rd)
        if shape is not None:
            pos = out.axis - (r - len(shape))
            if 0 <= pos and shape[pos] == s.factor * self.B and self.B > 1:
                entries: list[int | N] = [int(x) for x in shape]
                entries[pos] = 1
                self.edits[(node, 1)] = Edit("entries", tuple(entries))
        return [out]

    def v_Tile(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, repeats = ins[0], self.const(node.inputs[1])
        if s is None or s is UNKNOWN or repeats is None or repeats[s.axis] != 1:
            self.refuse_if_holds(node, [1])
            return [UNKNOWN]
        return [s]

    def v_Slice(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], _rank(node.inputs[0])
        args = [self.const(v) if i < len(node.inputs) else None for i, v in enumerate(node.inputs[:5])]
        args += [None] * (5 - len(args))
        if s is None or s is UNKNOWN or args[1] is None or args[2] is None or (
                len(node.inputs) > 3 and node.inputs[3] is not None and args[3] is None):
            self.refuse_if_holds(node, [1, 2])
            return [UNKNOWN]
        starts, ends = args[1].tolist(), args[2].tolist()
        axes = [a % rank for a in (args[3].tolist() if args[3] is not None else range(len(starts)))]
        if s.axis not in axes:
            return [s]
        i, size = axes.index(s.axis), s.factor * self.B
        step = int(args[4][i]) if args[4] is not None else 1
        if starts[i] == 0 and step == 1 and (ends[i] == size or ends[i] >= _TO_THE_END):
            if ends[i] == size:
                ends[i] = INT64_MAX
                self.edits[(node, 2)] = Edit("entries", tuple(ends))
            return [s]
        if any(abs(x) in (self.B, size) for x in (starts[i], ends[i])):
            raise _Refusal(f"Slice node {node.name!r} takes rows {starts[i]}:{ends[i]}:{step} of the batch "
                           f"axis (batch size {self.B})")
        return [UNKNOWN]

    def v_Resize(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s = ins[0]
        if s is None or s is UNKNOWN or s.axis != 0 or any(x is not None for x in ins[1:]):
            self.refuse_if_holds(node, [3])
            return [UNKNOWN]
        sizes = self.const(node.inputs[3]) if len(node.inputs) > 3 else None
        if sizes is not None and sizes.size and sizes[0] == s.factor * self.B:
            self.edits[(node, 3)] = Edit("entries", (N(s.factor), *[int(x) for x in sizes[1:]]))
        return [s]

    def _index_batch(self, node: ir.Node, index: Batch | None) -> Batch | None:
        """Indices into the batch axis of the data: they carry the batch when they are batched or
        have one batch-sized axis (then rewritten as batch indices)."""
        if index is not None:
            return index if index is not UNKNOWN else None
        dims = _dims(node.inputs[1]) or []
        if node.op_type == "GatherND":
            dims = dims[:-1]
        axes = [k for k, d in enumerate(dims) if d == self.B]
        if len(axes) != 1 or self.B == 1:
            return None
        self.meet(node, 1, axes[0], 1, expand=True)
        return Batch(axes[0])

    def v_Gather(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        (data, index), rank = ins[:2], _rank(node.inputs[0])
        axis = node.attributes.get_int("axis", 0) % max(rank, 1)
        if rank == 0 or (data is not None and index is not None and data.axis != axis):
            return [UNKNOWN]
        if data is not None and data.axis == axis:  # rows picked by indices
            found = self._index_batch(node, index)
            return [found.at(axis + found.axis)] if found is not None else [UNKNOWN]
        if index is not None:
            return [index.at(axis + index.axis)]
        assert data is not None
        if _dims(node.inputs[1]) is None:
            return [UNKNOWN]
        return [data.at(data.axis if data.axis < axis else data.axis + _rank(node.inputs[1]) - 1)]

    def v_GatherND(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        data, index = ins[:2]
        depth = (_dims(node.inputs[1]) or [None])[-1]
        if node.attributes.get_int("batch_dims", 0) or not isinstance(depth, int):
            return [UNKNOWN]
        width = _rank(node.inputs[1]) - 1
        if data is not None and data.axis >= depth and index is None:
            return [data.at(width + data.axis - depth)]
        if index is not None and index.axis >= width:
            return [UNKNOWN]
        found = self._index_batch(node, index)
        return [found] if found is not None else [UNKNOWN]

    def v_GatherElements(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        data, index = ins[:2]
        if index is None or index is UNKNOWN or data not in (None, index):
            return [UNKNOWN]
        if data is None:  # the data needs the batch too (its dims bound the indices' dims)
            self.meet(node, 0, index.axis, index.factor, expand=True)
        return [index]

    def v_SoftmaxCrossEntropyLoss(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        scores, labels = ins[:2]
        reduction = node.attributes.get_string("reduction", "mean")
        if labels is None or any(x is not None for x in ins[2:]):
            return [UNKNOWN] * len(node.outputs)
        if reduction == "sum":
            self.sums[node.outputs[0]] = (math.prod(_static(node.inputs[1]) or [0]), labels.factor)
        return [labels if reduction == "none" else None, scores][: len(node.outputs)]

    v_NegativeLogLikelihoodLoss = v_SoftmaxCrossEntropyLoss

    def v_Transpose(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], _rank(node.inputs[0])
        perm = _ints(node, "perm") or list(reversed(range(rank)))
        return [s.at(perm.index(s.axis))] if s is not None else [UNKNOWN]

    def v_Squeeze(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, dims, axes = ins[0], _dims(node.inputs[0]), self._axes(node)
        if s is None or dims is None:
            return [UNKNOWN]
        axes = [i for i, d in enumerate(dims) if d == 1] if axes is None and all(dims) else axes
        if axes is None or s.axis in [a % len(dims) for a in axes]:
            return [UNKNOWN]
        return [s.at(s.axis - sum(a % len(dims) < s.axis for a in axes))]

    def v_Unsqueeze(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, axes, rank = ins[0], self._axes(node), _rank(node.inputs[0])
        if s is None or axes is None or _dims(node.inputs[0]) is None:
            return [UNKNOWN]
        inserted = {a % (rank + len(axes)) for a in axes}
        kept = [p for p in range(rank + len(axes)) if p not in inserted]
        return [s.at(kept[s.axis])]

    def v_Split(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], _rank(node.inputs[0])
        same = s is not None and rank > 0 and node.attributes.get_int("axis", 0) % rank != s.axis
        return [s if same else UNKNOWN] * len(node.outputs)

    v_SplitToSequence = v_Split

    def v_SequenceAt(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        return [ins[0]]

    def v_Shape(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        return [None]

    v_Size = v_Shape

    def v_OneHot(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], _rank(node.inputs[0])
        if s is None or ins[1] is not None or _dims(node.inputs[0]) is None:
            return [UNKNOWN]
        axis = node.attributes.get_int("axis", -1) % (rank + 1)
        return [s.at(s.axis if s.axis < axis else s.axis + 1)]

    def v_TopK(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], _rank(node.inputs[0])
        same = s is not None and rank > 0 and node.attributes.get_int("axis", -1) % rank != s.axis
        return [s if same else UNKNOWN] * len(node.outputs)

    def v_LayerNormalization(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], _rank(node.inputs[0])
        if s is None or any(x is not None for x in ins[1:]) or rank == 0:
            return [UNKNOWN] * len(node.outputs)
        stats = s if s.axis < node.attributes.get_int("axis", -1) % rank else None
        return [s] + [stats] * (len(node.outputs) - 1)

    def v_Pad(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, pads, rank = ins[0], self.const(node.inputs[1]), _rank(node.inputs[0])
        plain = len(node.inputs) < 4 or node.inputs[3] is None
        if s is None or pads is None or not plain or pads[s.axis] or pads[s.axis + rank]:
            return [UNKNOWN]
        return [s]

    def v_ScatterElements(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        data = ins[0]
        if data is None or data is UNKNOWN or any(x not in (None, data) for x in ins[1:]):
            return [UNKNOWN]
        if node.op_type == "ScatterElements":  # indices and updates match the data's rank
            for i in (1, 2):
                if ins[i] is None:
                    self.meet(node, i, data.axis, data.factor, expand=True)
        return [data]

    v_ScatterND = v_ScatterElements


def _reshaped(dims: list[int], target: np.ndarray, allowzero: int) -> list[int] | None:
    out = [dims[i] if x == 0 and not allowzero and i < len(dims) else int(x) for i, x in enumerate(target)]
    if out.count(-1) == 1:
        known = math.prod(x for x in out if x != -1)
        if known <= 0:
            return None
        out[out.index(-1)] = math.prod(dims) // known
    return out if min(out, default=0) >= 0 else None


# ---------------------------------------------------------------------------------------------
# Applying the planned rewrites


class _Emitter:
    """Builds what each edit needs (N is ``Shape(source)[0]``, made once) and rewires the input."""

    def __init__(self, graph: ir.Graph, source: ir.Value) -> None:
        self.graph, self.source = graph, source
        self.taken = {v.name for n in graph for v in n.outputs} | {v.name for v in graph.inputs}
        self.taken |= set(graph.initializers)
        self._n: dict[bool, ir.Value] = {}

    def apply(self, edits: dict[tuple[ir.Node, int], Edit]) -> None:
        order = {node: i for i, node in enumerate(self.graph)}
        built: dict[tuple[ir.Value, Edit], ir.Value] = {}  # consumers of one constant share its rewrite
        for (node, index), edit in sorted(edits.items(), key=lambda item: (order[item[0][0]], item[0][1])):
            old = node.inputs[index]
            assert old is not None
            if (old, edit) not in built:
                built[(old, edit)] = self.build(node, old, edit)
            new = built[(old, edit)]
            node.replace_input_with(index, new)
            if old.is_initializer() and not old.uses() and not old.is_graph_output():
                self.graph.initializers.pop(old.name or "")
            self.remove_dead(old)

    def remove_dead(self, value: ir.Value) -> None:
        """Remove the producer of ``value`` and its constant-only inputs once nothing reads them."""
        producer = value.producer()
        if producer is None or producer.graph is not self.graph or any(
                o.uses() or o.is_graph_output() for o in producer.outputs):
            return
        inputs = [v for v in producer.inputs if v is not None]
        self.graph.remove(producer, safe=True)
        for source in inputs:
            self.remove_dead(source)

    def build(self, node: ir.Node, old: ir.Value, edit: Edit) -> ir.Value:
        dtype = old.dtype.numpy() if old.dtype is not None else np.dtype(np.int64)
        if edit.kind == "affine":
            return self.affine(node, old, edit)
        if edit.kind == "divisor":
            scalar = old.shape is not None and len(old.shape) == 0
            count = self.op(node, "Cast", [self.n(scalar=scalar)], old.name, to=int(old.dtype or 1))
            if edit.scale != 1:
                scale = self.const(node, np.asarray(edit.scale, dtype), f"{old.name}_scale")
                count = self.op(node, "Mul", [count, scale], old.name)
            return self.op(node, "Reciprocal", [count], old.name) if node.op_type == "Mul" else count
        if edit.kind == "scalar":
            factor = self.const(node, np.asarray(edit.factor, np.int64), f"{old.name}_factor")
            count = self.op(node, "Mul", [self.n(scalar=True), factor], old.name)
            return self.op(node, "Cast", [count], old.name, to=int(old.dtype or 7))
        if all(isinstance(e, int) for e in edit.entries):
            return self.const(node, np.asarray(edit.entries, dtype), f"{old.name}_dynamic")
        return self.shape(node, edit.entries, old.name)

    def affine(self, node: ir.Node, old: ir.Value, edit: Edit) -> ir.Value:
        """C0 + arange(N) * D along ``edit.axis`` (C0 alone, expanded if asked, when D is 0)."""
        array = _numpy(old)
        row = np.take(array, [0], axis=edit.axis)
        step = np.take(array, [1], axis=edit.axis) - row if array.shape[edit.axis] > 1 else row * 0
        initializer, name = old.is_initializer(), f"{old.name}_row"
        if initializer and len(old.uses()) == 1 and not old.is_graph_output():  # the row takes its name
            self.graph.initializers.pop(old.name or "")
            self.taken.discard(name := old.name or name)
        value = self.const(node, row, name, initializer=initializer)
        value.metadata_props.update(old.metadata_props)
        if step.any():
            zero, one = (self.const(node, np.asarray(x, np.int64), f"{old.name}_range") for x in (0, 1))
            index = self.op(node, "Range", [zero, self.n(scalar=True), one], old.name)
            shape = [1] * array.ndim
            shape[edit.axis] = -1
            index = self.op(node, "Reshape", [index, self.const(node, np.asarray(shape, np.int64),
                                                                 f"{old.name}_shape")], old.name)
            index = self.op(node, "Cast", [index], old.name, to=int(ir.DataType.from_numpy(array.dtype)))
            scaled = self.op(node, "Mul", [index, self.const(node, step, f"{old.name}_step")], old.name)
            return self.op(node, "Add", [value, scaled], old.name)
        if not edit.expand:
            return value
        entries: list[int | N] = [1] * row.ndim
        entries[edit.axis] = N(edit.factor)
        return self.op(node, "Expand", [value, self.shape(node, entries, old.name)], old.name)

    def shape(self, node: ir.Node, entries: Sequence[int | N], base: str | None) -> ir.Value:
        parts, fixed = [], []
        for entry in [*entries, None]:
            if isinstance(entry, int):
                fixed.append(entry)
                continue
            if fixed:
                parts.append(self.const(node, np.asarray(fixed, np.int64), f"{base}_dims"))
                fixed = []
            if isinstance(entry, N) and entry.factor == 1:
                parts.append(self.n())
            elif isinstance(entry, N):
                factor = self.const(node, np.asarray([entry.factor], np.int64), f"{base}_factor")
                parts.append(self.op(node, "Mul", [self.n(), factor], base))
        return self.op(node, "Concat", parts, f"{base}_batch", axis=0)

    def n(self, scalar: bool = False) -> ir.Value:
        """The batch size N (int64, shape [1] or a scalar), computed once at the top of the graph."""
        if scalar not in self._n:
            first = next(iter(self.graph))
            shape = self.op(first, "Shape", [self.source], "batch_size")
            index = self.const(first, np.asarray(0 if scalar else [0], np.int64), "batch_size_index")
            self._n[scalar] = self.op(first, "Gather", [shape, index], "batch_size", axis=0)
            self._n[scalar].type = ir.TensorType(ir.DataType.INT64)
            self._n[scalar].shape = ir.Shape([] if scalar else [1])
        return self._n[scalar]

    def op(self, before: ir.Node, op_type: str, inputs: Sequence[ir.Value], base: str | None,
           **attrs: int) -> ir.Value:
        node = ir.Node("", op_type, inputs, [ir.AttrInt64(k, v) for k, v in attrs.items()], num_outputs=1)
        node.outputs[0].name = self.unique(f"{base or 'batch'}_{op_type.lower()}")
        self.graph.insert_before(before, node)
        return node.outputs[0]

    def const(self, before: ir.Node, array: np.ndarray, base: str, *, initializer: bool = False) -> ir.Value:
        tensor = ir.tensor(array)
        if initializer:
            value = ir.Value(name=self.unique(base), const_value=tensor, shape=ir.Shape(array.shape),
                             type=ir.TensorType(tensor.dtype))
            self.graph.register_initializer(value)
            return value
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], num_outputs=1)
        out = node.outputs[0]
        out.name, out.shape, out.type = self.unique(base), ir.Shape(array.shape), ir.TensorType(tensor.dtype)
        self.graph.insert_before(before, node)
        return out

    def unique(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name


def _numpy(value: ir.Value) -> np.ndarray:
    tensor = ir.convenience.get_const_tensor(value)
    assert tensor is not None, f"{value.name!r} is not a constant"
    return tensor.numpy()
