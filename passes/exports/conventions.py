"""TorchConventionsPass: mark nodes whose torch gradient differs from the ONNX op's plain one.

The ONNX op alone cannot say these; a dynamo export's FX provenance (``fx_call``) can:

1. ``Gather`` from ``aten.embedding(weight, ids, padding_idx)`` with ``padding_idx >= 0``: the
   padding row gets no gradient (``PADDING_IDX_KEY``);
2. ``Clip`` from ``aten.clamp``/``aten.clip``: the gradient passes at the bounds
   (``CLIP_BOUNDS_KEY = "closed"``). Without a mark, Clip follows ``aten.hardtanh`` (ReLU6):
   no gradient at exactly min or max;
3. ``BatchNormalization`` from a training-mode ``aten._native_batch_norm_legit_functional``
   (a module in ``train()`` mode) that the exporter wrote in inference mode gets
   ``training_mode = 1``: batch statistics, as torch computes them;
4. every training-mode ``BatchNormalization`` of a torch export (such a call, or any in a
   model whose producer is ``pytorch``, the legacy exporter's) gets ``RUNNING_VAR_KEY =
   "unbiased"``: torch updates the running variance with the unbiased batch variance, ONNX
   with the biased one (``ExposeRunningStatsPass`` corrects the update it exposes);
5. a ``Dropout`` written for ``aten.scaled_dot_product_attention`` without ``training_mode``
   gets it true: torchlib writes ``dropout_p`` as ``Dropout(weights, p)``, which ONNX defines as
   inference (the identity), while torch applies it whenever ``dropout_p > 0`` (modules pass 0
   in eval). An export with the exporter's default ``optimize=True`` has lost that Dropout
   already (the optimizer removes an inference Dropout); with ``optimize=False`` it is kept;
6. ``ReduceMax`` / ``ReduceMin`` from ``aten.max.dim`` / ``aten.min.dim``: a tie's gradient goes
   to the first extreme, the index torch returns (``EXTREME_TIES_KEY = "first"``); without a
   mark ties share the gradient, as ``aten.amax`` / ``aten.amin`` (and ``torch.max(x)``) do;
7. ``Atan(Div(y, x))`` from ``aten.atan2`` (torchlib's decomposition; the Div read by the Atan
   alone): ``ATAN2_KEY`` marks both, and their gradient is atan2's, ``(x, -y) / (x^2 + y^2)``
   and 0 at (0, 0) as torch's, not NaN at x = 0;
8. ``Pow`` / ``Sqrt`` written for a norm or distance (``aten.linalg_vector_norm``, ``norm``,
   ``dist``, ``_cdist_forward``, ``_pdist_forward``, ``_euclidean_dist``) get ``NORM_KEY =
   "zero"``: their gradient where the base is 0 is 0, torch's subgradient at a zero norm (the
   chain rule gives inf * 0 = NaN); ``ReduceMax`` written for ``_cdist_forward`` /
   ``_pdist_forward`` (p = inf) gets ``EXTREME_TIES_KEY = "all"``: every tie gets the whole
   gradient, as torch's cdist backward gives it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.rules.elementwise import ATAN2_KEY, CLIP_BOUNDS_KEY, NORM_KEY
from passes.autodiff.rules.reduce import EXTREME_TIES_KEY
from passes.autodiff.rules.shape import PADDING_IDX_KEY
from passes.exports.signature import fx_call
from passes.names import free_name

# On a training-mode BatchNormalization: "unbiased" = its running variance follows torch.
RUNNING_VAR_KEY = "gradgraph.running_var"
# On the nodes that correct such a node's update (ExposeRunningStatsPass): the node's name.
CORRECTION_OF_KEY = "gradgraph.running_var_correction_of"
_TRAINING_BATCH_NORMS = frozenset({"aten._native_batch_norm_legit_functional.default",
                                   "aten._native_batch_norm_legit.default"})
_CLAMPS = frozenset({"aten.clamp.default", "aten.clamp.Tensor", "aten.clip.default",
                     "aten.clamp_min.default", "aten.clamp_max.default"})
_ATAN2 = "aten.atan2.default"
_EXTREMES_WITH_INDEX = {"ReduceMax": "aten.max.dim", "ReduceMin": "aten.min.dim"}
_DISTANCES = frozenset({"aten._cdist_forward.default", "aten._pdist_forward.default"})
_NORMS = _DISTANCES | {"aten.linalg_vector_norm.default", "aten.dist.default", "aten._euclidean_dist.default",
                       "aten.linalg_norm.default", "aten.frobenius_norm.dim", "aten.norm.Scalar",
                       "aten.norm.ScalarOpt_dim", "aten.norm.ScalarOpt_dim_dtype", "aten.norm.ScalarOpt_dtype"}


class TorchConventionsPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        modified = False
        from_torch = (model.producer_name or "").lower() == "pytorch"
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            call = fx_call(node)
            if call is None:
                if (from_torch and node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
                        and node.attributes.get_int("training_mode", 0) != 0):
                    modified |= _mark_unbiased(node)
                continue
            if node.op_type == "Gather" and call.target == "aten.embedding.default" and len(call.args) >= 3:
                try:
                    padding = int(call.args[2])
                except ValueError:
                    continue
                if padding >= 0 and node.metadata_props.get(PADDING_IDX_KEY) != str(padding):
                    node.metadata_props[PADDING_IDX_KEY] = str(padding)
                    modified = True
            elif (node.op_type == "BatchNormalization" and call.target in _TRAINING_BATCH_NORMS
                  and len(call.args) > 5 and call.args[5] == "True"
                  and not node.attributes.get_int("training_mode", 0)):
                node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
                if len(node.outputs) < 3:  # training mode also outputs the updated statistics
                    node.resize_outputs(3)
                    for out, what in zip(node.outputs[1:], ("running_mean", "running_var"), strict=True):
                        out.name = out.name or f"{node.outputs[0].name}.{what}"
                _mark_unbiased(node)
                modified = True
            elif (node.op_type == "BatchNormalization" and (call.target in _TRAINING_BATCH_NORMS or from_torch)
                  and node.attributes.get_int("training_mode", 0) != 0):
                modified |= _mark_unbiased(node)
            elif node.op_type == "Clip" and call.target in _CLAMPS:
                if node.metadata_props.get(CLIP_BOUNDS_KEY) != "closed":
                    node.metadata_props[CLIP_BOUNDS_KEY] = "closed"
                    modified = True
            elif _EXTREMES_WITH_INDEX.get(node.op_type) == call.target:
                if node.metadata_props.get(EXTREME_TIES_KEY) != "first":
                    node.metadata_props[EXTREME_TIES_KEY] = "first"
                    modified = True
            elif node.op_type == "Atan" and call.target == _ATAN2:
                modified |= _mark_atan2(node)
            elif node.op_type in ("Pow", "Sqrt") and call.target in _NORMS:
                modified |= _mark(node, NORM_KEY, "zero")
            elif node.op_type == "ReduceMax" and call.target in _DISTANCES:
                modified |= _mark(node, EXTREME_TIES_KEY, "all")
        attention = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if is_attention_dropout(n)]
        return PassResult(model, train_dropouts(model, attention) or modified)


def _mark(node: ir.Node, key: str, value: str) -> bool:
    if node.metadata_props.get(key) == value:
        return False
    node.metadata_props[key] = value
    return True


def _mark_atan2(atan: ir.Node) -> bool:
    """Mark torchlib's ``Atan(Div(y, x))`` of one atan2 call (convention 7); False when the Div
    is not the atan2's own or something else reads it."""
    ratio = atan.inputs[0].producer() if atan.inputs and atan.inputs[0] is not None else None
    if ratio is None or ratio.op_type != "Div" or len(ratio.outputs[0].uses()) != 1:
        return False
    call = fx_call(ratio)
    if call is None or call.target != _ATAN2 or ratio.outputs[0].is_graph_output():
        return False
    if atan.metadata_props.get(ATAN2_KEY) == "atan" and ratio.metadata_props.get(ATAN2_KEY) == "ratio":
        return False
    atan.metadata_props[ATAN2_KEY] = "atan"
    ratio.metadata_props[ATAN2_KEY] = "ratio"
    return True


def _untrained_dropout(node: ir.Node) -> bool:
    """A default-domain Dropout without ``training_mode`` (inference, whatever its ratio)."""
    return (node.op_type == "Dropout" and node.domain in ("", "ai.onnx")
            and (len(node.inputs) < 3 or node.inputs[2] is None))


def is_attention_dropout(node: ir.Node) -> bool:
    """Convention 5's Dropout: written for scaled_dot_product_attention, no ``training_mode``."""
    call = fx_call(node) if _untrained_dropout(node) else None
    return call is not None and "scaled_dot_product" in call.target


def train_dropouts(model: ir.Model, nodes: list[ir.Node]) -> bool:
    """Each Dropout of ``nodes`` without ``training_mode`` gets it true (one initializer they
    share; an absent ratio stays absent: 0.5). Changed any?"""
    nodes = [n for n in nodes if _untrained_dropout(n)]
    if not nodes:
        return False
    taken = set(model.graph.initializers) | {v.name or "" for v in model.graph.inputs}
    on = ir.Value(name=free_name("gradgraph_dropout_training", taken), const_value=ir.tensor(np.array(True)))
    on.type, on.shape = ir.TensorType(ir.DataType.BOOL), ir.Shape([])
    model.graph.register_initializer(on)
    for node in nodes:
        if len(node.inputs) < 2:
            node.resize_inputs(2)
        node.resize_inputs(3)
        node.replace_input_with(2, on)
    return True


def _mark_unbiased(node: ir.Node) -> bool:
    if node.metadata_props.get(RUNNING_VAR_KEY) == "unbiased":
        return False
    node.metadata_props[RUNNING_VAR_KEY] = "unbiased"
    return True


def running_stat_input(value: ir.Value | None) -> ir.Value | None:
    """A BatchNormalization's running-statistic input as the graph holds it: through the
    ordering node ExposeRunningStatsPass puts before a corrected one (``max(var, ...)``)."""
    producer = value.producer() if value is not None else None
    if producer is not None and CORRECTION_OF_KEY in producer.metadata_props:
        return producer.inputs[0]
    return value
