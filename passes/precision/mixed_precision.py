"""MixedPrecisionPass: run a forward graph's compute in float16 or bfloat16, fp32 master weights.

Each op has a category from :mod:`passes.precision.policy` (PyTorch autocast's lists). In
topological order over the main graph:

1. float graph inputs, initializers and the outputs of ``Constant`` / ``ConstantOfShape`` /
   ``Cast->fp32`` are *neutral*: they stay fp32 and feed low-precision consumers through one
   ``Cast->low`` per value, shared by those consumers (so a weight's gradient flows back
   through the Cast rule as fp32: the weights are fp32 master weights);
2. LOW ops (MatMul, Gemm, Conv, ...) compute in the low type: their float inputs are cast;
3. PASS_THROUGH ops compute in the low type when one of their float inputs is low (else in
   fp32); LayerNormalization-like ops in the low type get ``stash_type=1`` (fp32 statistics);
4. FP32 ops, unknown ops, ops of other domains, control flow and the *loss subgraph* compute
   in fp32: low inputs get a ``Cast->fp32``. The loss subgraph is seeded by
   :data:`~passes.precision.policy.LOSS_OPS` and, with ``options.loss``, by the loss's producer
   and the elementwise / reduction tail above it (up to a LOW op or a normalization,
   :data:`~passes.precision.policy.LOSS_TAIL_STOP`); everything downstream of a seed is in it;
5. only the relevant ports (:func:`~passes.precision.policy.relevant_ports`) change type:
   Dropout's ratio, Pow's exponent, Resize's scales, LayerNormalization's statistics stay
   fp32; integer and bool values are never touched;
6. graph outputs keep their name and original dtype (a ``Cast->fp32`` produces them).

*Emulated* ops: with ``supported`` (see :func:`gradgraph.runtime.kernels.kernel_predicate`), an op to
run in the low type that the predicate rejects runs in fp32 on its inputs rounded to the low
type (``Cast x->low->fp32``), and its output is rounded (``Cast->low``) for its consumers: the
numerics are those of low-precision storage, the kernels fp32 ones. ``emulated`` counts them
per op type after a call; such nodes carry ``gradgraph.emulated=<dtype>``.

The model is marked ``gradgraph.mixed_precision=<dtype>``: a second run changes nothing, and a
run with the other dtype is refused. Values without a type get one from ONNX shape inference.
"""

from __future__ import annotations

import dataclasses
import enum

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.precision.cast_cleanup import F32, CastEditor, cast_to, ensure_types
from passes.precision.cast_propagation import KernelPredicate
from passes.precision.policy import (
    CONSTANT_OPS,
    DEFAULT_DOMAINS,
    LOSS_OPS,
    LOSS_TAIL_STOP,
    STASH_TYPE_OPS,
    Precision,
    precision_of,
    relevant_ports,
)
from passes.subgraphs import has_subgraphs

MARKER_KEY = "gradgraph.mixed_precision"
EMULATED_KEY = "gradgraph.emulated"
LOW_DTYPES = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}


@dataclasses.dataclass(frozen=True)
class MixedPrecisionOptions:
    dtype: str = "float16"
    # The loss value's name: its elementwise / reduction tail stays fp32 (None: LOSS_OPS only).
    loss: str | None = None
    # Op types kept in fp32 on top of the policy's FP32 table.
    fp32_ops: tuple[str, ...] = ()
    # Normalization statistics in fp32 (the reference's ``layernorm_stash_as_fp32``).
    stash_fp32: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in LOW_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(LOW_DTYPES)}, not {self.dtype!r}")

    @property
    def low(self) -> ir.DataType:
        return LOW_DTYPES[self.dtype]


class _Kind(enum.Enum):
    NEUTRAL = "neutral"  # fp32 without a compute precision of its own (weights, constants)
    FP32 = "fp32"
    LOW = "low"


def _has_subgraph(node: ir.Node) -> bool:
    return has_subgraphs(node)


def _loss_subgraph(graph: ir.Graph, loss: str | None) -> set[int]:
    """ids of the nodes that compute the loss (see the module docstring, case 4)."""
    seeds = [n for n in graph if n.op_type in LOSS_OPS and n.domain in DEFAULT_DOMAINS]
    producer = next((v.producer() for n in graph for v in n.outputs if v.name == loss), None)
    stack = [producer] if producer is not None and loss is not None else []
    while stack:  # the loss tail
        node = stack.pop()
        if node in seeds:
            continue
        seeds.append(node)
        for value in node.inputs:
            above = value.producer() if value is not None and value.dtype == F32 else None
            if (above is not None and above.graph is graph and above.op_type not in LOSS_TAIL_STOP
                    and above.op_type not in CONSTANT_OPS and not _has_subgraph(above)):
                stack.append(above)
    found: set[int] = set()
    pending = list(seeds)
    while pending:  # and everything downstream
        node = pending.pop()
        if id(node) in found or node.graph is not graph:
            continue
        found.add(id(node))
        pending.extend(u.node for v in node.outputs for u in v.uses())
    return found


class _Conversion:
    """One call's state: value kinds, shared casts, emulated counts."""

    def __init__(self, model: ir.Model, options: MixedPrecisionOptions,
                 supported: KernelPredicate | None) -> None:
        self.graph, self.options, self.supported = model.graph, options, supported
        self.low = options.low
        self.opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        self.edit = CastEditor(model)
        self.kinds: dict[int, _Kind] = {}
        self.retyped: set[int] = set()
        self.casts: dict[tuple[int, ir.DataType], ir.Value] = {}
        self.emulated: dict[str, int] = {}
        self.modified = False

    def kind(self, value: ir.Value) -> _Kind:
        default = _Kind.LOW if value.dtype == self.low else _Kind.NEUTRAL
        return self.kinds.get(id(value), default)

    def cast(self, value: ir.Value, to: ir.DataType) -> ir.Value:
        key = (id(value), to)
        if key not in self.casts:
            self.casts[key] = self.edit.new_cast(value, to, self.graph)
            self.kinds[id(self.casts[key])] = _Kind.LOW if to == self.low else _Kind.NEUTRAL
            self.modified = True
        return self.casts[key]

    def category(self, node: ir.Node, loss_nodes: set[int]) -> Precision:
        if (id(node) in loss_nodes or _has_subgraph(node) or node.op_type in self.options.fp32_ops):
            return Precision.FP32
        return precision_of(node.op_type, node.domain)

    def _to_low(self, value: ir.Value) -> None:
        """Retype a node output to the low type; uses inside subgraphs read an fp32 cast."""
        value.type = ir.TensorType(self.low)
        self.retyped.add(id(value))
        self.kinds[id(value)] = _Kind.LOW
        nested = [(u.node, u.idx) for u in value.uses() if u.node.graph is not self.graph]
        if nested:
            back = self.cast(value, F32)
            for node, index in nested:
                node.replace_input_with(index, back)

    def _emulate_outputs(self, node: ir.Node, outs: list[ir.Value]) -> None:
        node.metadata_props[EMULATED_KEY] = self.options.dtype
        self.emulated[node.op_type] = self.emulated.get(node.op_type, 0) + 1
        for value in outs:
            uses = [(u.node, u.idx) for u in value.uses()]
            rounded = self.cast(value, self.low)
            self.retyped.add(id(rounded))  # stands for an fp32 value of the original graph
            for user, index in uses:
                nested = user.graph is not self.graph  # subgraphs read it as fp32, rounded
                user.replace_input_with(index, self.cast(rounded, F32) if nested else rounded)
            if value.is_graph_output():
                self.edit.move_output(value, rounded, self.graph)
            self.kinds[id(value)] = _Kind.FP32

    def convert_node(self, node: ir.Node, category: Precision) -> None:
        ins, outs = relevant_ports(node, self.opset)
        floats = [v for i in ins if i < len(node.inputs) and (v := node.inputs[i]) is not None
                  and v.dtype in (F32, self.low)]
        if category == Precision.LOW:
            compute = self.low
        elif category == Precision.PASS_THROUGH:
            compute = self.low if any(self.kind(v) == _Kind.LOW for v in floats) else F32
        else:
            compute = F32
        emulate = (compute == self.low and self.supported is not None
                   and not self.supported(node.op_type, node.domain, self.low))
        for index, value in enumerate(list(node.inputs)):
            if value is None or value.dtype not in (F32, self.low):
                continue
            if index not in ins:  # keeps its original (fp32) type
                want = F32 if id(value) in self.retyped else value.dtype
                if value.dtype != want:
                    node.replace_input_with(index, self.cast(value, want))
            elif emulate:
                node.replace_input_with(index, self.cast(
                    value if value.dtype == self.low else self.cast(value, self.low), F32))
            elif value.dtype != compute:
                node.replace_input_with(index, self.cast(value, compute))
        float_outs = [node.outputs[i] for i in outs
                      if i < len(node.outputs) and node.outputs[i].dtype == F32]
        if emulate:
            self._emulate_outputs(node, float_outs)
        elif compute == self.low:
            for value in float_outs:
                self._to_low(value)
            self.modified |= bool(float_outs)
            stash = node.attributes.get("stash_type")
            if (node.op_type in STASH_TYPE_OPS and self.options.stash_fp32
                    and (stash is None or stash.as_int() != int(F32))):
                node.attributes["stash_type"] = ir.AttrInt64("stash_type", int(F32))
                self.modified = True
        else:
            strict = category != Precision.PASS_THROUGH or any(
                self.kind(v) == _Kind.FP32 for v in floats)
            for value in float_outs:
                self.kinds[id(value)] = _Kind.FP32 if strict else _Kind.NEUTRAL
        for value in node.outputs:  # the other float outputs (statistics, ...)
            if value.dtype == F32 and id(value) not in self.kinds:
                self.kinds[id(value)] = _Kind.FP32

    def run(self, originals: list[ir.DataType | None]) -> bool:
        loss_nodes = _loss_subgraph(self.graph, self.options.loss)
        for node in list(self.graph):
            to = cast_to(node)
            if (node.op_type in CONSTANT_OPS and node.domain in DEFAULT_DOMAINS) or to is not None:
                for value in node.outputs:
                    self.kinds[id(value)] = _Kind.LOW if value.dtype == self.low else _Kind.NEUTRAL
                continue
            self.convert_node(node, self.category(node, loss_nodes))
        for value, dtype in zip(list(self.graph.outputs), originals):
            if dtype is not None and value.dtype != dtype:
                self.edit.move_output(value, self.cast(value, dtype), self.graph)
        return self.modified


class MixedPrecisionPass(InPlacePass):
    """See the module docstring."""

    def __init__(self, options: MixedPrecisionOptions | None = None, *,
                 supported: KernelPredicate | None = None) -> None:
        super().__init__()
        self.options = options or MixedPrecisionOptions()
        self.supported = supported
        # After a call: op_type -> how many nodes ran emulated (fp32 kernels, low storage).
        self.emulated: dict[str, int] = {}

    def call(self, model: ir.Model) -> PassResult:
        self.emulated = {}
        done = model.metadata_props.get(MARKER_KEY)
        if done == self.options.dtype:
            return PassResult(model, False)
        if done is not None:
            raise ValueError(f"the model is already in mixed precision ({done}); "
                             f"refusing to convert it to {self.options.dtype}")
        ensure_types(model)
        model.graph.sort()
        originals = [v.dtype for v in model.graph.outputs]
        conversion = _Conversion(model, self.options, self.supported)
        modified = conversion.run(originals)
        self.emulated = conversion.emulated
        if modified:
            model.metadata_props[MARKER_KEY] = self.options.dtype
        return PassResult(model, modified)
