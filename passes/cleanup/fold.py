"""FoldConstantNodesPass: ``passes.forward.fold_constants.FoldConstantsPass``, keeping marks.

That pass folds nodes computed from ``Constant`` nodes only, never from initializers (they may
be trained), with a cap on the folded size, and never random ops; each folded node becomes a
``Constant`` node of the same output name but without marks. Here the new Constant takes the
marks (``metadata_props``) of the node it replaces.

onnxscript's ``fold_constants`` is not used: it treats initializers as constants (it folds
``Transpose(W)`` into a new initializer and drops ``W``, a trainable weight), stores folded
values as new initializers (floats of two or more elements would then count as parameters)
and renames values (NameFixPass).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.forward.fold_constants import FoldConstantsPass, FoldOptions


class FoldConstantNodesPass(InPlacePass):
    def __init__(self, max_elements: int = FoldOptions.max_elements) -> None:
        super().__init__()
        self.max_elements = max_elements

    def call(self, model: ir.Model) -> PassResult:
        marks = {out.name: dict(node.metadata_props) for node in model.graph
                 if node.metadata_props and len(node.outputs) == 1 for out in node.outputs}
        result = FoldConstantsPass(FoldOptions(max_elements=self.max_elements))(model)
        if result.modified:
            for node in model.graph:
                name = node.outputs[0].name if node.op_type == "Constant" and node.outputs else None
                if name in marks and not node.metadata_props:
                    node.metadata_props.update(marks[name])
        return PassResult(model, result.modified)
