"""Tensor shapes of a finished graph's values, filled in by onnx shape inference.

Passes that run after the gradient read shapes the gradient rules did not write (a rule's
output values carry their dtype, rarely their shape). ``infer_missing_shapes`` runs onnx shape
inference on a copy whose constant-only nodes are folded (so Expand shapes computed by
Where/ConstantOfShape chains are known) and whose large initializers are inputs (only their
shapes matter), and copies what it found back. onnx_ir's ShapeInferencePass is not used: it
types the outputs of sequence ops as tensors.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from passes.forward.fold_constants import FoldConstantsPass


def static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The value's shape when every dim is a known integer, else None."""
    if value is None or value.shape is None or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(int(d) for d in value.shape)  # type: ignore[arg-type]


def infer_missing_shapes(model: ir.Model, replace_dynamic: bool = False) -> bool:
    """Give node outputs without a shape the inferred one (``replace_dynamic``: also replace a
    shape with symbolic or unknown dims). False when inference failed (nothing changed)."""
    initializers = list(model.graph.initializers.values())
    large = [v for v in initializers if v.const_value is not None and v.const_value.size > 1024]
    for value in large:  # serialized without their data, then put back in their order
        model.graph.initializers.pop(value.name or "")
    try:
        proto = ir.to_proto(model)
    finally:
        model.graph.initializers.clear()
        for value in initializers:
            model.graph.register_initializer(value)
    proto.graph.input.extend(onnx.helper.make_tensor_value_info(v.name or "", int(v.dtype or 1),
                                                                v.const_value.shape.numpy() if v.const_value else [])
                             for v in large)
    folded = ir.from_proto(proto)
    with np.errstate(all="ignore"):  # e.g. casting a -inf mask to int: only shapes are read
        FoldConstantsPass()(folded)
    try:
        inferred = onnx.shape_inference.infer_shapes(ir.to_proto(folded), strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - the callers work with the shapes they have
        return False
    types = {info.name: info.type for info in [*inferred.graph.value_info, *inferred.graph.output]}
    for node in model.graph:
        for value in node.outputs:
            found = types.get(value.name or "")
            if found is not None:
                take_inferred(value, found, replace_dynamic)
    return True


def take_inferred(value: ir.Value, found: onnx.TypeProto, replace_dynamic: bool = False) -> None:
    """Give ``value`` the tensor type and shape onnx inferred (``found``) where it has none
    (``replace_dynamic``: also replace a shape with symbolic or unknown dims)."""
    if found.WhichOneof("value") != "tensor_type":
        return
    if value.type is None:
        value.type = ir.serde.deserialize_type_proto_for_type(found)
    shape = ir.serde.deserialize_type_proto_for_shape(found)
    if not isinstance(value.type, ir.TensorType) or shape is None:
        return
    if value.shape is None or (replace_dynamic and static_shape(value) is None):
        value.shape = shape

