"""FoldConstantsPass: evaluate small nodes whose inputs are all ``Constant`` nodes.

Exporters often compute shape arguments (Slice starts/ends/steps, Reshape shapes, axes)
from constants, e.g. ``Unsqueeze(Constant)``. Folding them lets gradient rules see those
arguments as constants and choose cheaper gradients.

1. A deterministic default-domain node without subgraphs, with one output, whose every
   input is produced by a ``Constant`` node, is evaluated with onnx's reference evaluator;
   if the result has at most ``max_elements`` elements it is replaced by a ``Constant``.
   Ops whose result can dwarf their inputs (ConstantOfShape, Expand, Tile, Range) are
   sized from their inputs first and not run when over the limit. ``Constant`` nodes with
   ``value_int(s)`` / ``value_float(s)`` count as constants too.
2. Initializers are never folded into: they may be trained, so they are not constants here.
3. Constant nodes that fed only folded nodes are removed (nothing reads them any more).
4. Everything else is left alone; a node the evaluator cannot run is kept as it is.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator
from onnx_ir.passes import InPlacePass, PassResult

from passes.subgraphs import has_subgraphs

_NON_DETERMINISTIC = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)


@dataclasses.dataclass(frozen=True)
class FoldOptions:
    # Largest folded result, in elements: folding is for shape-like arguments, not tensors.
    max_elements: int = 4096


def _constant_of(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx"):
        return None
    attr = producer.attributes.get("value")
    if attr is not None and attr.type == ir.AttributeType.TENSOR:
        return attr.value.numpy()
    for name, dtype in (("value_int", np.int64), ("value_ints", np.int64),
                        ("value_float", np.float32), ("value_floats", np.float32)):
        other = producer.attributes.get(name)
        if other is not None:
            return np.asarray(other.value, dtype=dtype)
    return None


def _predicted_elements(node: ir.Node, arrays: list[np.ndarray | None]) -> int | None:
    """The result size of ops whose output can dwarf their inputs, known before running them."""
    try:
        if node.op_type == "ConstantOfShape" and arrays[0] is not None:
            return int(np.prod(arrays[0].astype(np.int64)))
        if node.op_type == "Expand" and arrays[0] is not None and arrays[1] is not None:
            return int(np.prod(np.broadcast_shapes(arrays[0].shape, tuple(arrays[1].astype(np.int64)))))
        if node.op_type == "Tile" and arrays[0] is not None and arrays[1] is not None:
            return int(arrays[0].size * np.prod(arrays[1].astype(np.int64)))
        if node.op_type == "Range" and all(a is not None for a in arrays[:3]):
            start, limit, delta = (float(np.asarray(a).reshape(-1)[0]) for a in arrays[:3])  # type: ignore[union-attr]
            return int(max(np.ceil((limit - start) / delta), 0)) if delta else None
    except (ValueError, OverflowError, TypeError):
        return None
    return 0


def _foldable(node: ir.Node) -> bool:
    return (node.domain in ("", "ai.onnx") and node.op_type not in _NON_DETERMINISTIC
            and node.op_type != "Constant" and len(node.outputs) == 1 and bool(node.inputs)
            and not has_subgraphs(node))


def evaluate_node(node: ir.Node, arrays: list[np.ndarray | None], opset: int) -> np.ndarray | None:
    """Run one single-output node on constant inputs with onnx's reference evaluator
    (None for an absent optional input); None when the evaluator cannot run it."""
    names = [f"in{i}" if a is not None else "" for i, a in enumerate(arrays)]
    proto = onnx.helper.make_node(node.op_type, names, ["out"])
    proto.attribute.extend(ir.serde.serialize_node(node).attribute)
    try:
        evaluator = ReferenceEvaluator(proto, opsets={"": opset})
        with np.errstate(all="ignore"):  # log(0) = -inf is the value (T5's position buckets)
            (out,) = evaluator.run(None, {n: a for n, a in zip(names, arrays) if n})
    except Exception:  # noqa: BLE001 - an op the evaluator cannot run stays unfolded
        return None
    return np.asarray(out)


class FoldConstantsPass(InPlacePass):
    def __init__(self, options: FoldOptions | None = None) -> None:
        super().__init__()
        self.options = options or FoldOptions()

    def call(self, model: ir.Model) -> PassResult:
        opset = model.opset_imports.get("", 13)
        modified = False
        fed_folded: list[ir.Node] = []
        for node in list(model.graph):
            if not _foldable(node):
                continue
            arrays = [_constant_of(v) for v in node.inputs]
            if any(a is None and v is not None for a, v in zip(arrays, node.inputs)):
                continue
            predicted = _predicted_elements(node, arrays)
            if predicted is None or predicted > self.options.max_elements:
                continue  # never allocate a huge (or unknowable) result to find it is too big
            result = evaluate_node(node, arrays, opset)
            if result is None or result.size > self.options.max_elements:
                continue
            # every input is None or a Constant's output (checked above), so producers are set
            fed_folded.extend(
                p for v in node.inputs if v is not None and (p := v.producer()) is not None)
            self._replace(model.graph, node, result)
            modified = True
        for const in dict.fromkeys(fed_folded):  # unique, in order
            out = const.outputs[0]
            if not out.uses() and not out.is_graph_output() and const.graph is model.graph:
                model.graph.remove(const, safe=True)
        return PassResult(model, modified)

    @staticmethod
    def _replace(graph: ir.Graph, node: ir.Node, result: np.ndarray) -> None:
        old = node.outputs[0]
        tensor = ir.tensor(result, name=old.name)
        const = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], num_outputs=1,
                        name=f"{node.name or node.op_type}_folded")
        new = const.outputs[0]
        new.type, new.shape = ir.TensorType(tensor.dtype), ir.Shape(result.shape)
        graph.insert_before(node, const)
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        new.name = old.name
