"""ToDoublePass: retype a float32 model to float64 (for finite-difference oracles).

1. float32 graph inputs, outputs, initializers and intermediate values become float64;
2. tensor attributes holding float32 (Constant, ConstantOfShape) are converted;
3. dtype attributes that name float32 (Cast ``to``, Random* ``dtype``, EyeLike, the
   ``stash_type`` of normalizations) name float64.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

F32, F64 = ir.DataType.FLOAT, ir.DataType.DOUBLE
_DTYPE_ATTRS = ("to", "dtype", "stash_type")


def _retype(value: ir.Value) -> bool:
    if value.dtype == F32:
        value.type = ir.TensorType(F64)
        return True
    return False


def _convert_tensor(tensor: ir.TensorProtocol) -> ir.Tensor | None:
    if tensor.dtype != F32:
        return None
    return ir.tensor(tensor.numpy().astype(np.float64), name=tensor.name)


class ToDoublePass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for value in list(model.graph.inputs) + list(model.graph.outputs):
            modified |= _retype(value)
        for value in model.graph.initializers.values():
            if value.const_value is not None and value.const_value.dtype == F32:
                value.const_value = _convert_tensor(value.const_value)
                modified |= _retype(value)
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            for out in node.outputs:
                modified |= _retype(out)
            for name, attr in list(node.attributes.items()):
                if attr.type == ir.AttributeType.TENSOR:
                    converted = _convert_tensor(attr.value)
                    if converted is not None:
                        node.attributes[name] = ir.AttrTensor(name, converted)
                        modified = True
                elif attr.type == ir.AttributeType.INT and name in _DTYPE_ATTRS and attr.value == F32:
                    node.attributes[name] = ir.AttrInt64(name, int(F64))
                    modified = True
            for sub in node.attributes.values():
                if sub.type == ir.AttributeType.GRAPH:
                    for value in list(sub.value.inputs) + list(sub.value.outputs):
                        modified |= _retype(value)
        return PassResult(model, modified)
