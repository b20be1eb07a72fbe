"""Per-op precision tables for :mod:`passes.precision` (cast propagation and mixed precision).

Cast propagation (onnxruntime's PropagateCastOps):

- :data:`CAST_PROPAGATION_LEVELS`: the fp16-safe ops each level adds (cumulative; level 0 is
  the user's allow list only). At every level Softmax is also allowed between a Cast to fp32
  and a single Cast back to the low type (see ``cast_propagation``).
- :data:`RELEVANT_PORTS`: the inputs / outputs that decide whether a node computes in the low
  type; the reference's table plus ``Where`` (its condition is bool) and ``CastLike`` (its
  output follows input 1). Ops not listed use the ports of the type constraint of their first
  float-capable input in the ONNX schema (which reproduces the reference's table), and ops
  without a schema every port.

Mixed precision (one of :class:`Precision` per op), following PyTorch autocast's CUDA lists:

- :data:`LOW_PRECISION_OPS`, autocast's lower-precision list (matmul, conv, linear, einsum):
  always computed in the low type;
- :data:`FP32_OPS`, autocast's fp32 list: softmax and log-softmax, exp / log / pow /
  reciprocal / softplus, reductions that accumulate (sum, mean, prod, norms, logsumexp,
  cumsum), the losses, and the normalizations whose statistics autocast keeps in fp32
  (group / instance / Lp; BatchNormalization too, for its fp32 running statistics). Sqrt and
  Erf are not on autocast's fp32 list (rsqrt and erfinv are), so they pass through;
- :data:`PASS_THROUGH_OPS`: autocast's "run in the input's type" ops: elementwise arithmetic
  and activations, comparisons, data movement and shape ops, max/min reductions and pooling.
  They compute in the low type when one of their float inputs already is low. Unlike
  autocast, LayerNormalization is here (as in onnxruntime's mixed-precision transformer):
  it runs in the low type with fp32 statistics (``stash_type=1``, :data:`STASH_TYPE_OPS`);
- every other op (unknown ops, other domains, control flow, recurrent ops) stays fp32;
- :data:`LOSS_OPS` seed the loss subgraph, which stays fp32 with everything downstream.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from passes.kernels._graph import CONTRIB_GELUS, DEFAULT_DOMAINS, MS_DOMAIN

# ---- cast propagation -------------------------------------------------------------------------

# Index i: the ops level i adds (cumulative).
CAST_PROPAGATION_LEVELS: tuple[frozenset[str], ...] = (
    frozenset(),
    frozenset({"Expand", "Transpose", "Relu", "Reshape", "Split", "Tanh", "Squeeze", "Unsqueeze",
               "Gelu"}),
    frozenset({"Add", "BiasGelu", "Dropout", "FastGelu", "Gather", "LayerNormalization", "Where"}),
)
MAX_LEVEL = len(CAST_PROPAGATION_LEVELS) - 1

# op_type -> (relevant inputs, relevant outputs).
RELEVANT_PORTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "Gather": ((0,), (0,)),
    "Reshape": ((0,), (0,)),
    "Dropout": ((0,), (0,)),
    "Expand": ((0,), (0,)),
    "Squeeze": ((0,), (0,)),
    "Unsqueeze": ((0,), (0,)),
    "LayerNormalization": ((0, 1, 2), (0,)),
    "Where": ((1, 2), (0,)),
    "CastLike": ((1,), (0,)),
    "Cast": ((), ()),
}


def allowed_ops(level: int, allow: tuple[str, ...] | frozenset[str] = ()) -> frozenset[str]:
    """The fp16-safe ops at ``level`` (clamped to 0..2) plus the user's ``allow`` list."""
    ops = set(allow)
    for added in CAST_PROPAGATION_LEVELS[1:min(max(level, 0), MAX_LEVEL) + 1]:
        ops |= added
    return frozenset(ops)


# ---- mixed precision --------------------------------------------------------------------------


class Precision(str, enum.Enum):
    LOW = "low"
    FP32 = "fp32"
    PASS_THROUGH = "pass_through"


LOW_PRECISION_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})

FP32_OPS = frozenset({
    # softmax family
    "Softmax", "LogSoftmax",
    # pointwise ops autocast keeps in fp32
    "Exp", "Log", "Pow", "Reciprocal", "Softplus", "Acos", "Asin", "Cosh", "Sinh", "Tan",
    # reductions that accumulate
    "ReduceSum", "ReduceMean", "ReduceProd", "ReduceSumSquare", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "CumSum",
    # normalizations with fp32 statistics in autocast
    "GroupNormalization", "InstanceNormalization", "LpNormalization", "BatchNormalization",
    # losses
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
})

PASS_THROUGH_OPS = frozenset({
    # elementwise arithmetic
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Max", "Min", "Sum", "Mean", "Mod", "Sign",
    "Floor", "Ceil", "Round", "Clip", "Sin", "Cos", "Erf", "Where",
    # activations
    "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Gelu", "Sigmoid", "HardSigmoid",
    "HardSwish", "Tanh", "Mish", "Softsign", "ThresholdedRelu",
    # comparisons (float inputs, bool output)
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "IsNaN", "IsInf",
    # normalization with fp32 statistics (stash_type)
    "LayerNormalization", "RMSNormalization",
    # data movement and shape
    "Identity", "Dropout", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Expand",
    "Concat", "Split", "Slice", "Gather", "GatherElements", "GatherND", "ScatterElements",
    "ScatterND", "Tile", "Pad", "Shape", "Size", "Trilu", "CastLike", "DepthToSpace",
    "SpaceToDepth", "Resize",
    # max/min reductions and pooling
    "ReduceMax", "ReduceMin", "ArgMax", "ArgMin", "TopK", "MaxPool", "AveragePool",
    "GlobalAveragePool", "GlobalMaxPool",
})

# Ops whose statistics dtype is the ``stash_type`` attribute (1 = float32).
STASH_TYPE_OPS = frozenset({"LayerNormalization", "RMSNormalization"})

# Ops that compute a loss: they and everything downstream of them stay fp32.
LOSS_OPS = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})

# Ops that end the backward walk from the loss output (``MixedPrecisionOptions.loss``): the
# loss tail is the elementwise / reduction chain between the last of these and the loss.
LOSS_TAIL_STOP = LOW_PRECISION_OPS | frozenset({"LayerNormalization", "RMSNormalization",
                                                 "BatchNormalization", "Gather"})

# Ops whose float outputs are constants: they carry no compute precision of their own.
CONSTANT_OPS = frozenset({"Constant", "ConstantOfShape"})


def precision_of(op_type: str, domain: str) -> Precision:
    """The mixed-precision category of an op; anything unlisted stays fp32."""
    if domain == MS_DOMAIN and op_type in CONTRIB_GELUS:
        return Precision.PASS_THROUGH  # as the standard Gelu (kernels.GeluFusionPass writes them)
    if domain not in DEFAULT_DOMAINS:
        return Precision.FP32
    if op_type in LOW_PRECISION_OPS:
        return Precision.LOW
    if op_type in PASS_THROUGH_OPS:
        return Precision.PASS_THROUGH
    return Precision.FP32


# ---- ports ------------------------------------------------------------------------------------


@functools.cache
def _schema_ports(op_type: str, domain: str, opset: int, n_in: int, n_out: int
                  ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None
    if not schema.inputs:
        return None
    float_capable = [p.type_str for p in schema.inputs
                     if any("float" in t for t in _allowed_types(schema, p.type_str))]
    if not float_capable:
        return None
    key = float_capable[0]

    def matching(formal: Sequence[onnx.defs.OpSchema.FormalParameter], n: int) -> tuple[int, ...]:
        return tuple(i for i in range(n) if formal and formal[min(i, len(formal) - 1)].type_str == key)

    return matching(schema.inputs, n_in), matching(schema.outputs, n_out)


def _allowed_types(schema: onnx.defs.OpSchema, type_str: str) -> list[str]:
    for constraint in schema.type_constraints:
        if constraint.type_param_str == type_str:
            return list(constraint.allowed_type_strs)
    return [type_str]


def relevant_ports(node: ir.Node, opset: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input indices, output indices) that decide the node's compute type."""
    if node.domain in DEFAULT_DOMAINS and node.op_type in RELEVANT_PORTS:
        return RELEVANT_PORTS[node.op_type]
    domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
    ports = _schema_ports(node.op_type, domain, opset, len(node.inputs), len(node.outputs))
    if ports is None:
        return tuple(range(len(node.inputs))), tuple(range(len(node.outputs)))
    return ports
