"""DeadCodeEliminationPass: onnx_ir's RemoveUnusedNodesPass, keeping initializers by default.

onnx_ir's pass removes (1) nodes none of whose outputs is used or a graph output, in every
graph, (2) unused optional outputs and trailing empty inputs of the nodes kept, and (3) every
initializer nothing reads. (3) would drop a trainable weight that does not reach an output,
and with it a slot of the model's state, so here unused initializers are put back, in their
order, unless ``remove_unused_initializers``. (2) would drop the mask output of a main-graph
training-mode Dropout, which its gradient reuses: named masks are kept. ``modified``
compares the model's structure before and after (onnx_ir's flag would count what is put back).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnx_ir.passes.common import RemoveUnusedNodesPass

from passes.cleanup._common import fingerprint


class DeadCodeEliminationPass(InPlacePass):
    def __init__(self, remove_unused_initializers: bool = False) -> None:
        super().__init__()
        self.remove_unused_initializers = remove_unused_initializers

    def call(self, model: ir.Model) -> PassResult:
        before = fingerprint(model)
        initializers = list(model.graph.initializers.items())
        # Dropout masks are held as graph outputs while onnx_ir's pass runs (it drops unused
        # optional outputs), so the very same values stay
        masks = [node.outputs[1] for node in model.graph
                 if node.op_type == "Dropout" and node.domain in ("", "ai.onnx")
                 and len(node.outputs) > 1 and node.outputs[1].name
                 and not node.outputs[1].is_graph_output()]
        model.graph.outputs.extend(masks)
        try:
            RemoveUnusedNodesPass()(model)
        finally:
            for mask in masks:
                model.graph.outputs.remove(mask)
        if not self.remove_unused_initializers:
            kept = model.graph.initializers
            if len(kept) != len(initializers):
                kept.clear()
                for _, value in initializers:
                    model.graph.register_initializer(value)
        return PassResult(model, fingerprint(model) != before)
