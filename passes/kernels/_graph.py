"""Small graph helpers shared by the kernel rewrites."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

DEFAULT_DOMAINS = ("", "ai.onnx")
MS_DOMAIN = "com.microsoft"  # onnxruntime's contrib ops (in stock onnxruntime, CPU and CUDA)
# onnxruntime's contrib GELUs (GeluFusionPass writes Gelu / FastGelu below opset 20): elementwise
# on x (and a bias over the last axis), in the precision of their input like the standard Gelu.
CONTRIB_GELUS = frozenset({"Gelu", "FastGelu", "BiasGelu", "QuickGelu"})


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value of a constant (initializer or Constant node), else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    try:
        return np.asarray(tensor.numpy())
    except Exception:  # noqa: BLE001 - external data that is not loaded
        return None


def only_use(value: ir.Value | None, graph: ir.Graph, consumer: ir.Node) -> bool:
    """``value`` is read by ``consumer`` alone (and is not a graph output)."""
    return value is not None and (all(user is consumer for user, _ in value.uses())
                                  and not any(out is value for out in graph.outputs))


def producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The default-domain ``op_type`` node that makes ``value``, else None."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in DEFAULT_DOMAINS:
        return None
    return node


def default_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx", 13)


def take_over(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """``new`` replaces ``old`` everywhere, graph outputs included, under ``old``'s name."""
    name = old.name
    meta = dict(old.metadata_props)
    for i, out in enumerate(graph.outputs):
        if out is old:
            graph.outputs[i] = new
    ir.convenience.replace_all_uses_with(old, new)
    old.name = None
    new.name = name
    new.metadata_props.update(meta)


def ignore_index_loss(loss: ir.Node) -> int | None:
    """The ``ignore_index`` of a SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss whose
    ignored positions add nothing (``mean`` or ``sum``) and whose ``log_prob`` is unused, else
    None: the losses whose ignored rows the kernel rewrites may change."""
    ignore = loss.attributes.get("ignore_index")
    reduction = loss.attributes.get("reduction")
    if ignore is None or (reduction is not None and reduction.as_string() not in ("mean", "sum")):
        return None
    if len(loss.outputs) > 1 and (loss.outputs[1].uses() or loss.outputs[1].is_graph_output()):
        return None
    return ignore.as_int()


def holds_label(labels: ir.Value | None, label: int) -> bool:
    """``labels`` are int32/int64 and their dtype can hold ``label``."""
    if labels is None or labels.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return False
    info = np.iinfo(labels.dtype.numpy())
    return bool(info.min <= label <= info.max)
