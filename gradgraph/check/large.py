"""The float64 oracle of a model over the external-data threshold (see
:mod:`gradgraph.runtime.external`), without a float64 copy of its weights.

The oracle of :mod:`gradgraph.check.oracles` copies the model into a float64 ModelProto, every
weight in it, and perturbs a copy of the whole trained tensor for each difference quotient: 3 W
of memory for W bytes of weights, and no model over protobuf's 2 GB. Here the float64 copy of
the forward model is made in onnx_ir instead, and:

1. each trained tensor ``w`` (and each other float initializer of at least
   :data:`~gradgraph.runtime.external.EXTERNAL_TENSOR_MIN_BYTES`) becomes a graph input of its
   own type, fed the model's array as it is (a memory map of the external data file, never
   copied), cast to float64 inside the graph, right before its first reader: onnxruntime holds
   the float64 tensor only while the nodes reading it run;
2. a trained ``w`` of rank >= 1 then goes through ``ScatterND(Cast(w), w/fd_index,
   w/fd_value)``: the entry a difference quotient moves is set to its float64 value
   ``x + h`` (fed, two tiny inputs); the others keep their float32 values, exactly as a float64
   copy of the tensor holds them. A trained scalar is a float64 input;
3. smaller float initializers and the inputs are retyped as the other float64 oracle does
   (:class:`passes.forward.to_double.ToDoublePass`, normalizations' ``stash_type`` too).

The loss is computed in float64 as in the ``float64-ort`` oracle, at the same points: the
difference quotients are the same. Only onnxruntime runs it; where it cannot (no float64
kernel for an op), the check of such a model stops with a :class:`GradientError`: the
reference evaluator and the float32 oracle would copy the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from gradgraph.check.oracles import _RETYPED, _describe_failure, _has_stash_type, _options, _Oracle
from gradgraph.check.report import ORACLE_FLOAT64_ORT
from gradgraph.runtime.external import EXTERNAL_TENSOR_MIN_BYTES, inference_session, session_parts
from passes.autodiff import GradientError
from passes.forward.to_double import LOW_PRECISION, ToDoublePass

INDEX_SUFFIX = "/fd_index"
VALUE_SUFFIX = "/fd_value"


def skeleton(model: ir.Model) -> onnx.ModelProto:
    """``model`` as a ModelProto without its large tensors (placeholders): for reading its
    graph, never for running it."""
    return session_parts(model)[0]


def _detach(model: ir.Model, trained: Sequence[str]) -> dict[str, tuple[ir.Value, np.ndarray]]:
    """Take the trained tensors and the large float initializers out of the graph: name ->
    (the value the nodes read, its array; not copied)."""
    graph = model.graph
    wanted = set(trained)
    taken: dict[str, tuple[ir.Value, np.ndarray]] = {}
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        if tensor is None or tensor.dtype not in LOW_PRECISION:
            continue
        if name in wanted or tensor.nbytes >= EXTERNAL_TENSOR_MIN_BYTES:
            graph.initializers.pop(name)
            value.const_value = None
            taken[name] = (value, tensor.numpy())
    return taken


def _insert_before_first_reader(graph: ir.Graph, value: ir.Value, nodes: list[ir.Node],
                                order: Mapping[int, int]) -> None:
    readers = [order[id(node)] for node, _ in value.uses() if id(node) in order]
    nodes_in_order = list(graph)
    if readers and min(readers) < len(nodes_in_order):
        graph.insert_before(nodes_in_order[min(readers)], nodes)
    elif nodes_in_order:
        graph.insert_before(nodes_in_order[0], nodes)
    else:
        graph.extend(nodes)


def _float64_model(forward: ir.Model, loss: str, trained: Sequence[str],
                   feeds: Mapping[str, np.ndarray]) -> tuple[ir.Model, dict[str, np.ndarray]]:
    """The oracle's model (module docstring) and its base feeds (every entry at its value)."""
    model = forward.clone(deep_copy=True)  # the graph copied; the tensors shared, not copied
    graph = model.graph
    fed = {v.name: v for v in graph.inputs if v.name in set(trained)}
    for value in fed.values():  # a trained graph input: fed its array, as an initializer is
        graph.inputs.remove(value)
    detached = _detach(model, trained)
    detached.update({name: (value, np.asarray(feeds[name])) for name, value in fed.items()})
    ToDoublePass(low_precision=True)(model)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if _has_stash_type(node, model.opset_imports):
            node.attributes["stash_type"] = ir.AttrInt64("stash_type", int(ir.DataType.DOUBLE))
    if loss not in {o.name for o in graph.outputs}:
        out = next((v for n in graph for v in n.outputs if v.name == loss), None)
        if out is None:
            raise GradientError(f"loss {loss!r} is no value of the model")
        graph.outputs.append(out)
    base = {k: (np.asarray(v).astype(np.float64) if np.asarray(v).dtype.name in _RETYPED else np.asarray(v))
            for k, v in feeds.items() if k not in fed}
    order = {id(node): index for index, node in enumerate(graph)}
    f64 = ir.TensorType(ir.DataType.DOUBLE)
    for name, (value, array) in detached.items():
        shape = ir.Shape(array.shape)
        value.name = f"{name}/float64"
        if name in trained and array.ndim == 0:
            source = ir.Value(name=name, type=f64, shape=shape)
            graph.inputs.append(source)
            value.replace_all_uses_with(source, replace_graph_outputs=True)
            base[name] = np.asarray(array, np.float64)
            continue
        source = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(array.dtype)), shape=shape)
        graph.inputs.append(source)
        base[name] = array
        nodes = [ir.Node("", "Cast", [source], [ir.AttrInt64("to", int(ir.DataType.DOUBLE))],
                         name=f"{name}/cast_float64")]
        if name in trained:
            index = ir.Value(name=name + INDEX_SUFFIX, type=ir.TensorType(ir.DataType.INT64),
                             shape=ir.Shape([1, array.ndim]))
            point = ir.Value(name=name + VALUE_SUFFIX, type=f64, shape=ir.Shape([1]))
            graph.inputs.extend([index, point])
            nodes.append(ir.Node("", "ScatterND", [nodes[0].outputs[0], index, point],
                                 name=f"{name}/fd_point"))
            base[index.name or ""] = np.zeros((1, array.ndim), np.int64)
            base[point.name or ""] = np.asarray(array.reshape(-1)[:1], np.float64)
        for node in nodes:
            node.outputs[0].type, node.outputs[0].shape = f64, shape
        value.replace_all_uses_with(nodes[-1].outputs[0], replace_graph_outputs=True)
        _insert_before_first_reader(graph, nodes[-1].outputs[0], nodes, order)
    return model, base


def large_float64_oracle(forward: ir.Model, loss: str, trained: Sequence[str],
                         feeds: Mapping[str, np.ndarray], model_desc: str) -> _Oracle:
    """The float64 oracle of a large ``forward`` (module docstring), at ``feeds``."""
    model, base = _float64_model(forward, loss, trained, feeds)
    try:
        session = inference_session(model, _options(large=True), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types
        reason = _describe_failure(exc, skeleton(model), "float64 copy", "float64")[0]
        raise GradientError(f"cannot check {model_desc}: {reason}; a model over the external-data "
                            "threshold is checked in float64 in onnxruntime only (the other "
                            "oracles would copy its weights)") from exc

    def loss_of(point: Mapping[str, np.ndarray]) -> float:
        with np.errstate(all="ignore"):
            return float(np.sum(np.asarray(session.run([loss], dict(point))[0], dtype=np.float64)))

    def perturb(name: str, k: int, offset: float) -> tuple[float, dict[str, np.ndarray]]:
        array = base[name]
        x = float(array.reshape(-1)[k]) + offset
        point = dict(base)
        if array.ndim == 0:
            point[name] = np.asarray(x, np.float64)
        else:
            point[name + INDEX_SUFFIX] = np.asarray([np.unravel_index(k, array.shape)], np.int64)
            point[name + VALUE_SUFFIX] = np.asarray([x], np.float64)
        return x, point

    try:
        f0 = loss_of(base)
    except Exception as exc:  # noqa: BLE001
        reason = _describe_failure(exc, skeleton(model), "float64 copy", "float64")[0]
        raise GradientError(f"cannot check {model_desc}: {reason}") from exc
    return _Oracle(ORACLE_FLOAT64_ORT, "", loss_of, base, f0, perturb)
