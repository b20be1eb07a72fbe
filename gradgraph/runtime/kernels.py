"""Which ops an onnxruntime build can run in a given dtype: a probe for the precision passes.

``kernel_predicate(providers)`` returns a :class:`KernelProbe`: a callable
``supported(op_type, domain, dtype) -> bool``, the ``supported`` argument of
:class:`passes.precision.CastPropagationPass` and :class:`passes.precision.MixedPrecisionPass`.
It answers by creating a one-node ``InferenceSession`` on ``providers`` with the op's
schema-driven inputs: the inputs of the type constraint of the first float-capable input in
``dtype``, the others in int64 when their constraint allows it (shapes, axes, indices), else
float32, else the constraint's first type (optional ones left out); required attributes get a
plain value (``to`` names ``dtype``). Graph optimizations are off, so the node itself needs a
kernel. Any failure (no schema, no kernel, a model onnxruntime refuses) means unsupported; the
predicate never raises and caches every answer.

onnxruntime falls back to the CPU provider for nodes other providers lack, so ``True`` means
"runs in this session", not necessarily on the first provider. On CPU, onnxruntime also runs
many float16 nodes through fp32 kernels by inserting casts itself; the probe reports those as
supported, as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import onnx
import onnx_ir as ir

# The opset the probe models use: the newest one every onnxruntime >= 1.19 loads.
PROBE_OPSET = 21
PROBE_IR_VERSION = 10
_DEFAULT_DOMAINS = ("", "ai.onnx")


def _tensor_type(type_str: str) -> int | None:
    if not type_str.startswith("tensor(") or not type_str.endswith(")"):
        return None
    name = type_str[len("tensor("):-1]
    mapping = {"float": onnx.TensorProto.FLOAT, "double": onnx.TensorProto.DOUBLE,
               "bool": onnx.TensorProto.BOOL, "string": onnx.TensorProto.STRING}
    if name in mapping:
        return mapping[name]
    return getattr(onnx.TensorProto, name.upper(), None)


def _allowed(schema: onnx.defs.OpSchema, type_str: str) -> list[str]:
    for constraint in schema.type_constraints:
        if constraint.type_param_str == type_str:
            return list(constraint.allowed_type_strs)
    return [type_str]


def _other_input_type(schema: onnx.defs.OpSchema, type_str: str) -> int | None:
    allowed = _allowed(schema, type_str)
    for preferred in ("tensor(int64)", "tensor(float)"):
        if preferred in allowed:
            return _tensor_type(preferred)
    return next((t for t in map(_tensor_type, allowed) if t is not None), None)


def _attribute(name: str, attr: onnx.defs.OpSchema.Attribute, dtype: int) -> onnx.AttributeProto:
    kind = attr.type
    if name == "to":
        return onnx.helper.make_attribute(name, dtype)
    if kind == onnx.defs.OpSchema.AttrType.INT:
        return onnx.helper.make_attribute(name, 0)
    if kind == onnx.defs.OpSchema.AttrType.INTS:
        return onnx.helper.make_attribute(name, [0])
    if kind == onnx.defs.OpSchema.AttrType.FLOAT:
        return onnx.helper.make_attribute(name, 0.0)
    if kind == onnx.defs.OpSchema.AttrType.FLOATS:
        return onnx.helper.make_attribute(name, [0.0])
    if kind == onnx.defs.OpSchema.AttrType.STRING:
        return onnx.helper.make_attribute(name, "")
    raise ValueError(f"no probe value for attribute {name!r} of type {kind}")


def probe_model(op_type: str, domain: str, dtype: ir.DataType, opset: int = PROBE_OPSET
                ) -> onnx.ModelProto:
    """A one-node model running ``op_type`` on inputs of ``dtype`` (raises when it cannot)."""
    schema = onnx.defs.get_schema(op_type, opset, domain)
    elem = int(dtype)
    key = next((p.type_str for p in schema.inputs
                if any("float" in t for t in _allowed(schema, p.type_str))),
               schema.inputs[0].type_str if schema.inputs else None)
    inputs: list[onnx.ValueInfoProto] = []
    names: list[str] = []
    for i, param in enumerate(schema.inputs):
        optional = param.option == onnx.defs.OpSchema.FormalParameterOption.Optional
        if optional and param.type_str != key:
            names.append("")
            continue
        elem_i = elem if param.type_str == key else _other_input_type(schema, param.type_str)
        if elem_i is None:
            raise ValueError(f"no probe type for input {param.name} of {op_type}")
        names.append(f"in{i}")
        inputs.append(onnx.helper.make_tensor_value_info(f"in{i}", elem_i, None))
    while names and not names[-1]:
        names.pop()
    outputs = [f"out{i}" for i in range(len(schema.outputs))]
    attrs = [_attribute(name, attr, elem) for name, attr in schema.attributes.items()
             if attr.required]
    node = onnx.helper.make_node(op_type, names, outputs, domain=domain)
    node.attribute.extend(attrs)
    graph = onnx.helper.make_graph(
        [node], "probe", inputs,
        [onnx.helper.make_empty_tensor_value_info(o) for o in outputs])
    opsets = [onnx.helper.make_opsetid("", opset)]
    if domain:
        opsets.append(onnx.helper.make_opsetid(domain, schema.since_version))
    return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=PROBE_IR_VERSION)


class KernelProbe:
    """``probe(op_type, domain, dtype) -> bool``: see the module docstring."""

    def __init__(self, providers: Sequence[str], opset: int = PROBE_OPSET) -> None:
        self.providers, self.opset = tuple(providers), opset
        self._cached = functools.cache(self._session_loads)

    def _session_loads(self, op_type: str, domain: str, dtype: int) -> bool:
        try:
            import onnxruntime as ort

            domain = "" if domain in _DEFAULT_DOMAINS else domain
            model = probe_model(op_type, domain, ir.DataType(dtype), self.opset)
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.log_severity_level = 4
            ort.InferenceSession(model.SerializeToString(), options, providers=list(self.providers))
        except Exception:  # noqa: BLE001 - any failure means "cannot run it"
            return False
        return True

    def __call__(self, op_type: str, domain: str, dtype: ir.DataType) -> bool:
        try:
            return self._cached(str(op_type), str(domain), int(dtype))
        except Exception:  # noqa: BLE001 - arguments that are no op / dtype: unsupported
            return False

    def cache_info(self) -> Any:
        return self._cached.cache_info()


def kernel_predicate(providers: Sequence[str], opset: int = PROBE_OPSET) -> KernelProbe:
    """``supported(op_type, domain, dtype)``: whether ``providers`` can run the op in ``dtype``."""
    return KernelProbe(providers, opset)


# Probe data: the first float input is PROBE_DIM x PROBE_DIM, other float inputs PROBE_DIM
# (broadcasting, scales, biases), integer inputs zeros of PROBE_DIM (indices, shapes).
PROBE_DIM = 3


class TrainingKernelProbe(KernelProbe):
    """Like :class:`KernelProbe`, and the op's gradient must run in ``dtype`` too.

    A forward kernel is not enough for training: e.g. onnxruntime's CPU provider runs Gather in
    float16 but not the ScatterND(add) of its gradient. The probe builds the gradient of the
    one-node model (gradgraph's own rules) on small concrete inputs and runs both:

    1. the forward model does not load: unsupported;
    2. the forward model does not run on the probe data (it does not fit the op: shapes,
       attributes): the answer of 1 stands (inconclusive);
    3. the op has no gradient (no rule, nothing differentiable): the answer of 1 stands;
    4. the gradient model does not load or run: unsupported.
    """

    def _session_loads(self, op_type: str, domain: str, dtype: int) -> bool:
        if not super()._session_loads(op_type, domain, dtype):
            return False
        try:
            import numpy as np
            import onnxruntime as ort

            domain = "" if domain in _DEFAULT_DOMAINS else domain
            model = probe_model(op_type, domain, ir.DataType(dtype), self.opset)
            feeds = _probe_feeds(model, dtype)
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.log_severity_level = 4
            forward = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=list(self.providers))
            outputs = forward.run(None, feeds)
        except Exception:  # noqa: BLE001 - the probe data does not fit this op: inconclusive
            return True
        grad_model = _with_gradient(model, dtype, [np.asarray(o) for o in outputs])
        if grad_model is None:
            return True
        try:
            session = ort.InferenceSession(grad_model.SerializeToString(), options,
                                           providers=list(self.providers))
            session.run(None, feeds)
        except Exception:  # noqa: BLE001 - the gradient needs a kernel this build lacks
            return False
        return True


def _probe_feeds(model: onnx.ModelProto, dtype: int) -> dict[str, Any]:
    import numpy as np

    feeds: dict[str, Any] = {}
    first = True
    for value in model.graph.input:
        elem = value.type.tensor_type.elem_type
        if elem == dtype:
            shape = (PROBE_DIM, PROBE_DIM) if first else (PROBE_DIM,)
            first = False
            feeds[value.name] = np.full(shape, 0.5, onnx.helper.tensor_dtype_to_np_dtype(elem))
        elif elem == onnx.TensorProto.BOOL:
            feeds[value.name] = np.ones((PROBE_DIM,), np.bool_)
        else:
            feeds[value.name] = np.zeros((PROBE_DIM,), onnx.helper.tensor_dtype_to_np_dtype(elem))
    return feeds


def _with_gradient(model: onnx.ModelProto, dtype: int, outputs: list[Any]) -> onnx.ModelProto | None:
    """The probe model with loss = sum of its float outputs (in fp32) and its gradient, or None
    when the op has none."""
    from gradgraph.api import build_gradient_graph
    from passes.autodiff import GradientError

    m = onnx.ModelProto()
    m.CopyFrom(model)
    terms = []
    for out, array in zip(list(m.graph.output), outputs):
        if array.dtype.kind != "f":
            continue
        cast, total = f"{out.name}_f32", f"{out.name}_sum"
        m.graph.node.append(onnx.helper.make_node("Cast", [out.name], [cast], to=onnx.TensorProto.FLOAT))
        m.graph.node.append(onnx.helper.make_node("ReduceSum", [cast], [total], keepdims=0))
        terms.append(total)
    wrt = [v.name for v in m.graph.input if v.type.tensor_type.elem_type == dtype]
    if not terms or not wrt:
        return None
    m.graph.node.append(onnx.helper.make_node("Sum", terms, ["probe_loss"]))
    m.graph.output.append(onnx.helper.make_tensor_value_info("probe_loss", onnx.TensorProto.FLOAT, []))
    try:
        return build_gradient_graph(m, "probe_loss", wrt, allow_unused=True)
    except (GradientError, ValueError):
        return None


def training_kernel_predicate(providers: Sequence[str], opset: int = PROBE_OPSET) -> KernelProbe:
    """``supported(op_type, domain, dtype)``: whether ``providers`` run the op and its gradient."""
    return TrainingKernelProbe(providers, opset)
