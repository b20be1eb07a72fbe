"""ExposeDropoutMaskPass: give every training-mode Dropout a named mask output.

The gradient of Dropout must reuse the mask drawn in the forward pass, so:

1. a Dropout whose ``training_mode`` input is present and not the constant False,
   and whose mask output is missing or unnamed, gets a mask output
   ``<output>_mask``;
2. everything else is left alone (inference Dropout is the identity).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult


def _training_mode_off(node: ir.Node) -> bool:
    if len(node.inputs) < 3 or node.inputs[2] is None:
        return True
    value = node.inputs[2].const_value
    return value is not None and not bool(value.numpy())


class ExposeDropoutMaskPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx"):
                continue
            if _training_mode_off(node):
                continue
            if len(node.outputs) < 2:
                node.resize_outputs(2)
            mask = node.outputs[1]
            if not mask.name:
                mask.name = f"{node.outputs[0].name}_mask"
                modified = True
            if mask.type is None:
                mask.type = ir.TensorType(ir.DataType.BOOL)
                mask.shape = node.outputs[0].shape
                modified = True
        return PassResult(model, modified)
