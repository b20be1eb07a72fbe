"""CommonSubexpressionEliminationPass: merge nodes computing the same thing from the same values.

onnx_ir's pass of that name merges Dropout (training mode) and Bernoulli nodes and knows no
roles, so this one guards it. In each graph (subgraphs included, each on its own), a node is
merged into an earlier node with the same op, domain, attributes, input values and number of
outputs, and the later node is removed:

1. never a random node (``_common.is_random``: Random*, Bernoulli, Multinomial, training-mode
   Dropout), nor a node with a subgraph, nor a node whose role is in ``keep_roles`` (recompute
   clones exist on purpose: merging one back into its forward node undoes the recompute);
2. a node with a tensor attribute over ``max_tensor_elements`` is never merged (weights held in
   Constant nodes stay apart; comparing them costs more than it saves);
3. the later node's uses read the earlier node's outputs; a later output that is a graph output
   passes its name and value marks to the earlier value, unless that one is itself a graph input
   or output (then nothing is merged: it would cost an Identity);
4. the surviving node keeps its own marks (``metadata_props``).
"""

from __future__ import annotations

from collections.abc import Hashable

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.cleanup._common import has_role, is_random, subgraphs


class CommonSubexpressionEliminationPass(InPlacePass):
    def __init__(self, keep_roles: tuple[str, ...] = ("recompute",), max_tensor_elements: int = 16) -> None:
        super().__init__()
        self.keep_roles = keep_roles
        self.max_tensor_elements = max_tensor_elements

    def call(self, model: ir.Model) -> PassResult:
        return PassResult(model, self._graph(model.graph))

    def _graph(self, graph: ir.Graph) -> bool:
        modified = False
        seen: dict[Hashable, ir.Node] = {}
        for node in list(graph):
            for inner in subgraphs(node):
                modified = self._graph(inner) or modified
            key = self._key(node)
            if key is None:
                continue
            earlier = seen.setdefault(key, node)
            if earlier is not node and _merge(graph, node, earlier):
                modified = True
        return modified

    def _key(self, node: ir.Node) -> Hashable | None:
        if not node.outputs or is_random(node) or has_role(node, self.keep_roles):
            return None
        attributes: list[tuple[str, Hashable]] = []
        for name, attr in sorted(node.attributes.items()):
            if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) or attr.is_ref():
                return None
            if attr.type == ir.AttributeType.TENSOR:
                if attr.value.size > self.max_tensor_elements:
                    return None
                array = attr.value.numpy()
                attributes.append((name, (array.shape, str(array.dtype), array.tobytes())))
            elif attr.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
                attributes.append((name, tuple(attr.value)))
            elif attr.type in (ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING):
                attributes.append((name, attr.value))
            else:  # tensors lists, types, sparse tensors: rare; not worth comparing
                return None
        return (node.op_identifier(), len(node.outputs), tuple(id(v) for v in node.inputs),
                tuple(attributes))


def _merge(graph: ir.Graph, node: ir.Node, earlier: ir.Node) -> bool:
    pairs = list(zip(node.outputs, earlier.outputs))
    for old, new in pairs:
        if old.is_graph_output() and (new.is_graph_output() or new.is_graph_input()):
            return False
    renamed = [(old, new) for old, new in pairs if old.is_graph_output()]
    for old, new in renamed:
        new.metadata_props.update(old.metadata_props)
        new.type = new.type or old.type
        new.shape = new.shape or old.shape
    for old, new in pairs:
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    for old, new in renamed:
        new.name = old.name
    return True
