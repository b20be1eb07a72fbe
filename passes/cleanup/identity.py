"""IdentityEliminationPass: remove ``y = Identity(x)`` nodes, keeping graph output names.

onnx_ir's pass of that name, given ``y = Identity(x)`` with both ``x`` and ``y`` graph outputs,
renames ``x`` to ``y`` and loses the output ``x``; it knows no roles either. Here, in every graph
(subgraphs included), for a default-domain Identity whose role is not in ``keep_roles``:

1. ``y`` not a graph output: uses of ``y`` read ``x``; the node is removed;
2. ``y`` a graph output and ``x`` produced by a node of the same graph and neither a graph
   input, an initializer, nor a graph output: ``x`` takes ``y``'s place, name and value marks;
3. otherwise (``y`` is an output that must stay apart from ``x``) the node stays.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.cleanup._common import ONNX_DOMAINS, has_role


class IdentityEliminationPass(InPlacePass):
    def __init__(self, keep_roles: tuple[str, ...] = ("recompute",)) -> None:
        super().__init__()
        self.keep_roles = keep_roles

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if self._removable(node):
                _eliminate(node)
                modified = True
        return PassResult(model, modified)

    def _removable(self, node: ir.Node) -> bool:
        if (node.op_type != "Identity" or node.domain not in ONNX_DOMAINS or len(node.inputs) != 1
                or len(node.outputs) != 1 or node.inputs[0] is None or has_role(node, self.keep_roles)):
            return False
        x, y = node.inputs[0], node.outputs[0]
        if not y.is_graph_output():
            return True
        producer = x.producer()
        return (producer is not None and producer.graph is node.graph and not x.is_graph_output()
                and not x.is_graph_input() and not x.is_initializer())


def _eliminate(node: ir.Node) -> None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None and node.graph is not None
    output = y.is_graph_output()
    if x.shape is None:
        x.shape = y.shape
    if x.type is None:
        x.type = y.type
    if output:
        x.metadata_props.update(y.metadata_props)
    y.replace_all_uses_with(x, replace_graph_outputs=True)
    node.graph.remove(node, safe=True)
    if output:
        x.name = y.name
