"""TypeSequenceOutputsPass: type the untyped outputs of sequence-producing ops.

onnx_ir's ShapeInferencePass merges inferred types with ``value.dtype = ...``; on a value
without a type that makes a *tensor* type, so the output of e.g. ``SplitToSequence``
(the dynamo exporter's ``torch.split``) became ``tensor(float)`` and onnxruntime refused
the model ("Type (tensor(float)) of output arg ... does not match expected type
(seq(tensor(float)))"). Run before shape inference: every untyped output whose ONNX
schema allows only sequence types gets ``seq(tensor(<dtype>))``, the element dtype taken
from the node's first typed input (or SequenceEmpty's ``dtype`` attribute). A Loop value
carried from a sequence gets the sequence's type on the body's input and output and on the
Loop's output. Run again after shape inference, it corrects the outputs that inference
typed as tensors (their element dtype was unknown before it).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult


def _sequence_outputs(op_type: str, opset: int) -> list[bool]:
    """Per formal output of the op's schema: whether it can only be a sequence."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return []
    constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    result = []
    for formal in schema.outputs:
        allowed = constraints.get(formal.type_str, [formal.type_str])
        result.append(bool(allowed) and all(t.startswith("seq(") for t in allowed))
    return result


def _element_dtype(node: ir.Node) -> ir.DataType | None:
    if node.op_type == "SequenceEmpty":
        attr = node.attributes.get("dtype")
        return ir.DataType(attr.value) if attr is not None else ir.DataType.FLOAT
    return next((v.dtype for v in node.inputs if v is not None and v.dtype is not None), None)


class TypeSequenceOutputsPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        opset = model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx", 1)
        modified = False
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.domain not in ("", "ai.onnx") or not node.op_type.startswith(("Sequence", "SplitTo")):
                continue
            is_seq = _sequence_outputs(node.op_type, opset)
            for i, out in enumerate(node.outputs):
                if isinstance(out.type, ir.SequenceType) or not is_seq or not is_seq[min(i, len(is_seq) - 1)]:
                    continue
                # untyped, or typed as a tensor by shape inference (its dtype is the elements')
                dtype = out.type.dtype if isinstance(out.type, ir.TensorType) else _element_dtype(node)
                if dtype is None:
                    continue
                out.type = ir.SequenceType(ir.TensorType(dtype))
                modified = True
        while _type_loop_carried(model.graph):  # nested loops: until nothing changes
            modified = True
        return PassResult(model, modified)


def _type_loop_carried(graph: ir.Graph) -> bool:
    """A Loop value carried from a sequence (the dynamo exporter's EmbeddingBag, a list built
    in a loop) gets that sequence type on the body's input and output and on the Loop's
    output; shape inference would make them tensors, which onnxruntime refuses."""
    changed = False
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type != "Loop" or node.domain not in ("", "ai.onnx") or "body" not in node.attributes:
            continue
        body = node.attributes["body"].value
        for k, initial in enumerate(node.inputs[2:]):
            if initial is None or not isinstance(initial.type, ir.SequenceType):
                continue
            linked = [body.inputs[2 + k] if 2 + k < len(body.inputs) else None,
                      body.outputs[1 + k] if 1 + k < len(body.outputs) else None,
                      node.outputs[k] if k < len(node.outputs) else None]
            for value in linked:
                if value is not None and not isinstance(value.type, ir.SequenceType):
                    value.type = initial.type
                    changed = True
    return changed
