"""ToDoublePass: retype a float32 model to float64 (for finite-difference oracles).

With ``low_precision=True`` float16 and bfloat16 are retyped too (the same rules, "float32"
below reading "float32, float16 or bfloat16"): the oracle of a float16 model, or of one that
casts to float16 inside, is then the exact math, not float16 arithmetic that a step of 1e-6
does not move.

1. float32 graph inputs, outputs, initializers and intermediate values become float64,
   in the main graph and in every subgraph; sequence and optional values keep their
   structure (``seq(float)`` becomes ``seq(double)``, never a tensor);
2. tensor attributes holding float32 (Constant ``value``, ConstantOfShape ``value``) are
   converted; Constant's ``value_float`` / ``value_floats`` (which can only hold float32)
   become a float64 ``value`` tensor;
3. dtype attributes that name float32 (Cast ``to``, Random* ``dtype``, EyeLike, window
   ``output_datatype``, the ``stash_type`` of normalizations, ...) name float64, and ops
   whose output is float32 when such an attribute is absent get it set explicitly
   (ConstantOfShape without ``value``, RandomNormal/RandomUniform and SequenceEmpty without
   ``dtype``, windows without ``output_datatype``, normalizations without ``stash_type``).

Ops whose output type follows an input (CastLike, Expand, Range, Split, ...) need nothing:
their inputs are retyped.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.subgraphs import node_subgraphs

F32, F64 = ir.DataType.FLOAT, ir.DataType.DOUBLE
F32_ONLY = frozenset({F32})
LOW_PRECISION = frozenset({F32, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_DTYPE_ATTRS = ("to", "dtype", "stash_type", "output_datatype", "output_dtype")

# Ops whose float output comes from an attribute that defaults to float32 when absent:
# op_type -> the attribute (set to float64 when absent).
_FLOAT32_BY_DEFAULT: dict[str, str] = {
    "RandomNormal": "dtype",
    "RandomUniform": "dtype",
    "SequenceEmpty": "dtype",
    "HannWindow": "output_datatype",
    "HammingWindow": "output_datatype",
    "BlackmanWindow": "output_datatype",
    "MelWeightMatrix": "output_datatype",
}


def _double_type(type_: ir.TypeProtocol | None, sources: frozenset) -> ir.TypeProtocol | None:
    """``type_`` with float32 (``sources``) elements made float64, or None when nothing changes."""
    if isinstance(type_, ir.TensorType):
        return ir.TensorType(F64) if type_.dtype in sources else None
    if isinstance(type_, (ir.SequenceType, ir.OptionalType)):
        elem = _double_type(type_.elem_type, sources)
        return None if elem is None else type(type_)(elem)
    return None


def _retype(value: ir.Value, sources: frozenset) -> bool:
    new = _double_type(value.type, sources)
    if new is None:
        return False
    value.type = new
    return True


def _convert_tensor(tensor: ir.TensorProtocol, sources: frozenset) -> ir.TensorProtocol | None:
    if tensor.dtype not in sources:
        return None
    return ir.tensor(tensor.numpy().astype(np.float64), name=tensor.name)


def _is_default_domain(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _has_attribute(node: ir.Node, name: str, opset: int) -> bool:
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return False
    return name in schema.attributes


def _convert_node(node: ir.Node, opset: int, sources: frozenset) -> bool:
    modified = False
    attrs = node.attributes
    default_domain = _is_default_domain(node)
    if default_domain and node.op_type == "Constant":
        if "value_float" in attrs:
            value = float(attrs.pop("value_float").value)
            attrs["value"] = ir.AttrTensor("value", ir.tensor(np.array(value, dtype=np.float64)))
            modified = True
        elif "value_floats" in attrs:
            values = list(attrs.pop("value_floats").value)
            attrs["value"] = ir.AttrTensor("value", ir.tensor(np.array(values, dtype=np.float64)))
            modified = True
    if default_domain and node.op_type == "ConstantOfShape" and "value" not in attrs:
        attrs["value"] = ir.AttrTensor("value", ir.tensor(np.zeros(1, dtype=np.float64)))
        modified = True
    if default_domain and node.op_type in _FLOAT32_BY_DEFAULT:
        name = _FLOAT32_BY_DEFAULT[node.op_type]
        if name not in attrs:
            attrs[name] = ir.AttrInt64(name, int(F64))
            modified = True
    if default_domain and "stash_type" not in attrs and _has_attribute(node, "stash_type", opset):
        # Normalizations compute their statistics in float32 unless told otherwise.
        attrs["stash_type"] = ir.AttrInt64("stash_type", int(F64))
        modified = True
    for name, attr in list(attrs.items()):
        if attr.type == ir.AttributeType.TENSOR:
            converted = _convert_tensor(attr.value, sources)
            if converted is not None:
                attrs[name] = ir.AttrTensor(name, converted)
                modified = True
        elif attr.type == ir.AttributeType.INT and name in _DTYPE_ATTRS and attr.value in sources:
            attrs[name] = ir.AttrInt64(name, int(F64))
            modified = True
    for out in node.outputs:
        modified |= _retype(out, sources)
    return modified


def _convert_graph_values(graph: ir.Graph, sources: frozenset) -> bool:
    modified = False
    for value in list(graph.inputs) + list(graph.outputs):
        modified |= _retype(value, sources)
    for value in graph.initializers.values():
        if value.const_value is not None and value.const_value.dtype in sources:
            value.const_value = _convert_tensor(value.const_value, sources)
            modified = True
        modified |= _retype(value, sources)
    return modified


class ToDoublePass(InPlacePass):
    def __init__(self, low_precision: bool = False):
        super().__init__()
        self.sources = LOW_PRECISION if low_precision else F32_ONLY

    def call(self, model: ir.Model) -> PassResult:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        src = self.sources
        modified = _convert_graph_values(model.graph, src)
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            modified |= _convert_node(node, opset, src)
            for sub in node_subgraphs(node):
                modified |= _convert_graph_values(sub, src)
        for function in model.functions.values():
            for node in ir.traversal.RecursiveGraphIterator(function):
                modified |= _convert_node(node, function.opset_imports.get("", opset), src)
        return PassResult(model, modified)
