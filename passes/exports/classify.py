"""ClassifyWeightsPass: mark each float initializer a parameter, a buffer or a constant.

The mark goes on the value's ``metadata_props`` (``KIND_KEY``, with a human reason under
``REASON_KEY``); the gradient engine's default trained set is the values marked parameter.

With a torch export signature (dynamo exports):
1. the signature's PARAMETERs (and parameters recovered by ``RecoverParametersPass``, also
   a merged call's copies named ``<parameter>@merged:<call>``) are parameters; its BUFFERs and
   lifted constants are buffers;
2. every other initializer is an exporter constant (folded values, masks, tables, scalars).

Without one (legacy exports, other producers), in this order:
1. the running mean and variance inputs of BatchNormalization are buffers;
2. a tensor of at most one element is a constant (epsilons, exponents, scales), unless it is
   named like a torch module's weight or bias (``out.bias`` of ``Linear(n, 1)``);
3. a tensor holding inf or NaN is a constant (attention masks);
4. every other float initializer is a parameter.
"""

from __future__ import annotations

import enum
import re

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.engine import WEIGHT_KIND_KEY as KIND_KEY  # noqa: E402  (one key, defined by its reader)
from passes.exports.conventions import running_stat_input
from passes.exports.recover import RECOVERED_KEY
from passes.exports.signature import TorchSignature, folded_from

REASON_KEY = "gradgraph.weight_reason"
# A torch state_dict name of a module's weight or bias (the legacy exporter keeps these names):
# a one-element one is a parameter (the bias of Linear(n, 1)), not an exporter scalar.
_TORCH_PARAMETER_NAME = re.compile(r"[A-Za-z_][\w.]*\.(weight|bias)")
FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


class WeightKind(str, enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"


def running_stat_names(graph: ir.Graph) -> set[str]:
    """The names of the running mean and variance inputs of every BatchNormalization (read
    through the ordering node of a corrected variance update, see ``running_stat_input``)."""
    stats: set[str] = set()
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            inputs = [running_stat_input(v) for v in node.inputs[3:5]]
            stats.update(v.name for v in inputs if v is not None and v.name)
    return stats


def _rule_without_signature(value: ir.Value, stats: set[str]) -> tuple[WeightKind, str]:
    if value.name in stats:
        return WeightKind.BUFFER, "BatchNormalization running statistic"
    tensor = value.const_value
    size = int(np.prod(value.shape.numpy())) if value.shape is not None and value.shape.is_static() else None
    if size is not None and size <= 1:
        if size == 1 and _TORCH_PARAMETER_NAME.fullmatch(value.name or ""):
            return WeightKind.PARAMETER, "one-element torch weight or bias (named <module>.weight/.bias)"
        return WeightKind.CONSTANT, "scalar (epsilon, exponent or scale)"
    if tensor is not None and not np.isfinite(tensor.numpy()).all():
        return WeightKind.CONSTANT, "holds inf/NaN (a mask)"
    recovered = value.metadata_props.get(RECOVERED_KEY)
    if recovered:
        return WeightKind.PARAMETER, f"float initializer ({recovered})"
    return WeightKind.PARAMETER, "float initializer (no export signature)"


def _rule_with_signature(value: ir.Value, signature: TorchSignature) -> tuple[WeightKind, str]:
    name = value.name or ""
    recovered = value.metadata_props.get(RECOVERED_KEY)
    if name in signature.parameters:
        return WeightKind.PARAMETER, f"torch parameter ({recovered})" if recovered else "torch parameter"
    if name in signature.buffers:
        return WeightKind.BUFFER, "torch buffer"
    if recovered:  # a merged call's own copy that no torch name could be derived for
        return WeightKind.PARAMETER, f"torch parameter without a torch name ({recovered})"
    if folded_from(value):
        return WeightKind.CONSTANT, "exporter constant (folded by the exporter's optimizer)"
    return WeightKind.CONSTANT, "exporter constant"


class ClassifyWeightsPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        signature = TorchSignature.read(model)
        stats = running_stat_names(graph) if signature is None else set()
        modified = False
        for value in graph.initializers.values():
            if value.dtype not in FLOATS:
                continue
            kind, reason = (_rule_with_signature(value, signature) if signature is not None
                            else _rule_without_signature(value, stats))
            if value.metadata_props.get(KIND_KEY) != kind.value:
                value.metadata_props[KIND_KEY] = kind.value
                value.metadata_props[REASON_KEY] = reason
                modified = True
        return PassResult(model, modified)
