"""Make a model loadable by an older onnxruntime (lower IR version, lower default-domain opset).

``onnxruntime`` 1.19 (the last ``onnxruntime-training`` release) loads IR versions <= 10 and
default-domain opsets <= 21, while the ``onnx`` package writes newer ones. :func:`for_runtime`
lowers both, converting the opset with ``onnx.version_converter`` and refusing (with a
:class:`GradientError` naming the op or data type) what cannot be expressed at the target.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import onnx
import onnxruntime as ort
from onnx import TensorProto

from passes.autodiff import GradientError

#: What onnxruntime 1.19.x (and so onnxruntime-training 1.19.2) reads.
ORT_1_19_MAX_IR_VERSION = 10
ORT_1_19_MAX_OPSET = 21

_DEFAULT_DOMAINS = ("", "ai.onnx")

# First IR version that knows each data type (only the ones newer than IR 9 matter here).
_DTYPE_MIN_IR = {
    name: ir_version
    for name, ir_version in (
        ("FLOAT8E4M3FN", 9), ("FLOAT8E4M3FNUZ", 9), ("FLOAT8E5M2", 9), ("FLOAT8E5M2FNUZ", 9),
        ("UINT4", 10), ("INT4", 10),
        ("FLOAT4E2M1", 11),
        ("FLOAT8E8M0", 12), ("UINT2", 12), ("INT2", 12),
    )
    if hasattr(TensorProto, name)
}
_DTYPE_ATTRS = ("to", "dtype", "output_dtype")


# onnxruntime's refusal of a model newer than it reads
_IR_REFUSED = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")


def inference_session(model: onnx.ModelProto, *args: Any, **kwargs: Any) -> ort.InferenceSession:
    """``onnxruntime.InferenceSession`` of ``model`` (the other arguments are the session's). A
    model whose IR version is above what this onnxruntime reads (the ``onnx`` package writes
    the newest) is lowered to the runtime's maximum, which it names in its refusal; a data type
    that IR version cannot hold is refused by :func:`for_runtime` with its name."""
    try:
        return ort.InferenceSession(model.SerializeToString(), *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's Fail; anything else is raised as it is
        refused = _IR_REFUSED.search(str(exc))
        if refused is None:
            raise
    lowered = for_runtime(model, max_ir_version=int(refused.group(2)), max_opset=10**6)
    return ort.InferenceSession(lowered.SerializeToString(), *args, **kwargs)


def provider_names(providers: Any) -> list[str]:
    """The names of onnxruntime ``providers`` given as names or ``(name, options)`` pairs."""
    return [p if isinstance(p, str) else p[0] for p in providers or ()]


def default_opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain (``""``/``ai.onnx``) opset version, or None."""
    for imp in model.opset_import:
        if imp.domain in _DEFAULT_DOMAINS:
            return imp.version
    return None


def for_runtime(
    model: onnx.ModelProto,
    max_ir_version: int = ORT_1_19_MAX_IR_VERSION,
    max_opset: int = ORT_1_19_MAX_OPSET,
) -> onnx.ModelProto:
    """Return a copy of ``model`` with IR version <= ``max_ir_version`` and opset <= ``max_opset``.

    The default-domain opset is converted down with ``onnx.version_converter`` when it is
    above ``max_opset``; other domains are kept as they are. A model already within both
    limits is returned as an unchanged copy. Raises :class:`GradientError` naming the op that
    does not exist at, or cannot be converted to, ``max_opset``, or the data type that IR
    version ``max_ir_version`` cannot hold.
    """
    if max_opset < 1 or max_ir_version < 3:
        raise GradientError(f"invalid target: IR version {max_ir_version}, opset {max_opset}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    opset = default_opset(out)
    if opset is not None and opset > max_opset:
        out = _convert_opset(out, opset, max_opset)
    if out.ir_version > max_ir_version:
        _check_dtypes(out, max_ir_version)
        out.ir_version = max_ir_version
    return out


def _convert_opset(model: onnx.ModelProto, opset: int, target: int) -> onnx.ModelProto:
    missing = sorted({op for op in _op_types(model.graph, model) if _schema_missing(op, target)})
    if missing:
        raise GradientError(
            f"cannot lower the model from opset {opset} to {target}: op(s) {', '.join(missing)} "
            f"do not exist at opset {target}")
    if model.functions:
        raise GradientError(
            f"cannot lower a model with local functions from opset {opset} to {target} "
            f"(onnx.version_converter does not convert functions: "
            f"{', '.join(sorted({f.name for f in model.functions}))}); inline them first")
    try:
        converted = onnx.version_converter.convert_version(model, target)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError/ValueError/...
        msg = str(exc)
        found = re.search(r"for (\w+)", msg)
        op = f"op {found.group(1)!r}" if found else "an op"
        raise GradientError(
            f"cannot lower the model from opset {opset} to {target}: onnx.version_converter "
            f"has no conversion for {op} ({msg.strip().splitlines()[-1] if msg.strip() else type(exc).__name__})"
        ) from exc
    return converted


def _schema_missing(op_type: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return True
    return False


def _op_types(graph: onnx.GraphProto, model: onnx.ModelProto):
    local = {(f.domain, f.name) for f in model.functions}
    for g in proto_graphs(graph):
        for node in g.node:
            if node.domain in _DEFAULT_DOMAINS and (node.domain, node.op_type) not in local:
                yield node.op_type


def proto_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph of its nodes' attributes (If / Loop / Scan bodies), nested."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from proto_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from proto_graphs(sub)


def _type_elems(tp: onnx.TypeProto):
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        yield getattr(tp, kind).elem_type
    elif kind in ("sequence_type", "optional_type"):
        yield from _type_elems(getattr(tp, kind).elem_type)
    elif kind == "map_type":
        yield tp.map_type.key_type
        yield from _type_elems(tp.map_type.value_type)


def _dtypes(model: onnx.ModelProto):
    graphs = list(proto_graphs(model.graph))
    for f in model.functions:
        graphs.append(onnx.helper.make_graph(f.node, f.name, [], []))
    for g in graphs:
        for t in g.initializer:
            yield t.data_type, f"initializer {t.name!r}"
        for t in g.sparse_initializer:
            yield t.values.data_type, f"initializer {t.values.name!r}"
        for vi in (*g.input, *g.output, *g.value_info):
            for dt in _type_elems(vi.type):
                yield dt, f"value {vi.name!r}"
        for node in g.node:
            where = f"node {node.name or node.op_type!r} ({node.op_type})"
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t.data_type, where
                elif attr.type == onnx.AttributeProto.TENSORS:
                    for t in attr.tensors:
                        yield t.data_type, where
                elif attr.type == onnx.AttributeProto.INT and attr.name in _DTYPE_ATTRS:
                    yield attr.i, where


def _check_dtypes(model: onnx.ModelProto, max_ir_version: int) -> None:
    for dtype, where in _dtypes(model):
        name = TensorProto.DataType.Name(dtype) if dtype in TensorProto.DataType.values() else str(dtype)
        need = _DTYPE_MIN_IR.get(name)
        if need is not None and need > max_ir_version:
            raise GradientError(
                f"cannot lower the model to IR version {max_ir_version}: {where} uses data type "
                f"{name}, which needs IR version {need}")
