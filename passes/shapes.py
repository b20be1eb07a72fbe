"""Tensor shapes of a finished graph's values, filled in by onnx shape inference.

Passes that run after the gradient read shapes the gradient rules did not write (a rule's
output values carry their dtype, rarely their shape). ``infer_missing_shapes`` runs onnx shape
inference on a copy whose constant-only nodes are folded (so Expand shapes computed by
Where/ConstantOfShape chains are known) and whose large initializers are inputs (only their
shapes matter), and copies what it found back. onnx_ir's ShapeInferencePass is not used: it
types the outputs of sequence ops as tensors. ``infer_shapes_for`` is the cheap one for a
pass that needs the shapes of a few values: onnx's inference of the nodes they depend on, one
at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def infer_shapes_for(model: ir.Model, targets: Sequence[ir.Value]) -> bool:
    """Static shapes for ``targets`` (main-graph values) from the values they are computed from,
    on demand: onnx's inference of a target's producer alone (:func:`infer_node`; and
    :func:`shape_of_shape_input`), and where that leaves the shape open, first of the producers
    of its inputs without a static shape, and so on up. It visits only the nodes a shape
    depends on (a handful where a gradient value is asked for), not the whole graph as
    :func:`infer_missing_shapes` does, and knows less: no constant folding, no data propagation
    beyond small constant inputs and ``Shape`` inputs. A shape found replaces one that is not
    static. Returns whether every target has a static shape afterwards; where not, the shapes
    it gave are taken back (the model is as it was: ask :func:`infer_missing_shapes`)."""
    graph = model.graph
    opsets = {"" if d == "ai.onnx" else d: v for d, v in model.opset_imports.items()}
    tried: set[int] = set()
    given: dict[ir.Value, tuple[ir.TypeProtocol | None, ir.Shape | None]] = {}
    stack = [node for v in targets if static_shape(v) is None and (node := v.producer()) is not None
             and node.graph is graph]
    while stack:
        node = stack[-1]
        first = id(node) not in tried
        tried.add(id(node))
        for value in node.outputs:
            given.setdefault(value, (value.type, value.shape))
        _infer_alone(node, opsets)
        if first and any(static_shape(v) is None for v in node.outputs):
            inputs = [p for v in node.inputs if v is not None and static_shape(v) is None
                      and (p := v.producer()) is not None and p.graph is graph and id(p) not in tried]
            if inputs:  # infer them, then this node again
                stack.extend(inputs)
                continue
        stack.pop()
    if all(static_shape(v) is not None for v in targets):
        return True
    for value, (type_, shape) in given.items():
        value.type, value.shape = type_, shape
    return False


def _infer_alone(node: ir.Node, opsets: dict[str, int]) -> None:
    """Shapes of ``node``'s outputs from its inputs' alone, where they have none, or one that is
    not static and the shape found is."""
    found = infer_node(node, opsets)
    through = shape_of_shape_input(node)
    for index, value in enumerate(node.outputs):
        proto = found.get(value.name or "")
        shape = through if index == 0 else None
        if proto is not None and proto.WhichOneof("value") == "tensor_type":
            if value.type is None:
                value.type = ir.serde.deserialize_type_proto_for_type(proto)
            shape = shape or ir.serde.deserialize_type_proto_for_shape(proto)
        if shape is None or not isinstance(value.type, ir.TensorType):
            continue
        if value.shape is None or (static_shape(value) is None and all(isinstance(d, int) for d in shape)):
            value.shape = shape


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


def infer_node(node: ir.Node, opsets: dict[str, int]) -> dict[str, onnx.TypeProto]:
    """onnx's inference of ``node`` alone, from its inputs' types and constants (``opsets``:
    domain -> version, the default domain as ""): output name -> type; {} where onnx cannot."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return {}
    inputs = [v for v in node.inputs if v is not None]
    if any(v.type is None for v in inputs):
        return {}
    types = {v.name or "": ir.serde.serialize_value(v).type for v in inputs}
    constants = {v.name or "": ir.convenience.get_const_tensor(v) for v in inputs}  # Constant nodes too
    data = {name: ir.serde.serialize_tensor(t) for name, t in constants.items() if t is not None and t.size <= 64}
    try:
        return dict(onnx.shape_inference.infer_node_outputs(
            schema, ir.serde.serialize_node(node), types, data,
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]))
    except Exception:  # noqa: BLE001 - an op onnx cannot infer alone keeps its unknown shape
        return {}


def shape_of_shape_input(node: ir.Node) -> ir.Shape | None:
    """``Reshape(x, Shape(v))`` and ``ConstantOfShape(Shape(v))`` are shaped as ``v``: onnx's
    inference of the node alone does not see the values of ``Shape(v)``, nor does its data
    propagation through a Shape of opset 13 (torch's legacy GroupNorm export at opset 13
    reshapes back that way). None for any other node."""
    if node.op_type not in ("Reshape", "ConstantOfShape") or node.domain not in ("", "ai.onnx"):
        return None
    shape_input = node.inputs[1 if node.op_type == "Reshape" else 0] if len(node.inputs) > int(
        node.op_type == "Reshape") else None
    shape_node = shape_input.producer() if shape_input is not None else None
    if shape_node is None or shape_node.op_type != "Shape" or shape_node.domain not in ("", "ai.onnx") \
            or "start" in shape_node.attributes or "end" in shape_node.attributes:
        return None
    source = shape_node.inputs[0]
    if source is None or source.shape is None:
        return None
    # Reshape with allowzero 0: a 0 in the shape copies x's dimension there, which v's does not say
    if node.op_type == "Reshape" and not node.attributes.get_int("allowzero", 0) \
            and any(d == 0 for d in source.shape):
        return None
    return ir.Shape(list(source.shape))
