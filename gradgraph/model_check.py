"""Structural checks of a model proto before any pass sees it.

A malformed graph must be refused with a clear error, not hang or crash deep in a pass:

1. a value produced twice (two nodes, or a node and a graph input / initializer), or read
   by a node of the main graph without being produced;
2. a cycle among the nodes of the main graph (names the nodes on it);
3. an initializer whose data does not hold ``prod(dims)`` elements (raw or typed fields);
4. an initializer claiming more than :data:`MAX_ELEMENTS` elements;
5. a default-domain node whose op ONNX does not define;
6. a tensor whose data is still external (an initializer or Constant pointing at a file): a
   model given as a path has its external data loaded by ``onnx.load``, which only reads files
   inside the model's folder; one given as bytes, a ModelProto or an onnx_ir Model has no
   folder to check against, so its external data is refused (give the model's path instead).

Subgraphs (If/Loop/Scan bodies) are checked for 1 and 3 too.
"""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto, helper

from passes.autodiff import GradientError
from passes.forward.contrib_shapes import ORT_DEFAULT_DOMAIN_OPS

# Refuse tensors claiming more elements than this (2**34: 64 GiB of float32).
MAX_ELEMENTS = 2**34

_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def _label(node: onnx.NodeProto, index: int) -> str:
    return f"{node.name!r} ({node.op_type})" if node.name else f"#{index} ({node.op_type})"


def _tensor_problem(t: TensorProto, external_ok: bool = False) -> str | None:
    if any(d < 0 for d in t.dims):
        return f"has a negative dimension {list(t.dims)}"
    n = math.prod(t.dims)
    if n > MAX_ELEMENTS:
        return f"claims {n:,} elements (over the {MAX_ELEMENTS:,} limit)"
    if t.data_location == TensorProto.EXTERNAL:
        if external_ok:  # checked against its file by the caller (gradgraph.io)
            return None
        where = next((e.value for e in t.external_data if e.key == "location"), "?")
        return (f"keeps its data in an external file ({where!r}); gradgraph reads external data "
                "only through a model file path (onnx checks it stays inside the model's "
                "folder): pass the path of the .onnx file")
    if t.data_type in (TensorProto.STRING,
                                                                   TensorProto.UNDEFINED):
        return None
    if t.HasField("raw_data"):
        try:
            itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        except (KeyError, TypeError):
            return None
        bits = {TensorProto.INT4, TensorProto.UINT4}
        expected = (n + 1) // 2 if t.data_type in bits else n * itemsize
        if len(t.raw_data) != expected:
            return f"holds {len(t.raw_data)} bytes of data for dims {list(t.dims)} ({expected} expected)"
        return None
    present = [f for f in _TYPED_FIELDS if len(getattr(t, f))]
    if present:
        count = len(getattr(t, present[0]))
        complex_ = t.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128)
        if count != n * (2 if complex_ else 1) and not (n == 0 and count == 0):
            return f"holds {count} values for dims {list(t.dims)} ({n} expected)"
    return None


def _check_graph(graph: onnx.GraphProto, source: str, top: bool, external_ok: bool = False) -> None:
    produced: dict[str, str] = {}
    for v in graph.input:
        produced[v.name] = "a graph input"
    for t in graph.initializer:
        problem = _tensor_problem(t, external_ok)
        if problem:
            hint = "" if "external" in problem else ("; the file is damaged or was written by a "
                                                     "broken exporter")
            raise GradientError(f"{source}: initializer {t.name!r} {problem}{hint}")
        produced.setdefault(t.name, "an initializer")
    for index, node in enumerate(graph.node):
        for out in node.output:
            if not out:
                continue
            if out in produced and produced[out] != "an initializer":
                raise GradientError(f"{source}: value {out!r} is produced twice (by node "
                                    f"{_label(node, index)} and by {produced[out]}); an ONNX graph "
                                    "assigns each value once")
            if out in produced:
                raise GradientError(f"{source}: node {_label(node, index)} writes {out!r}, "
                                    "which is also an initializer")
            produced[out] = f"node {_label(node, index)}"
        for attr in node.attribute:
            tensors = ([attr.t] if attr.HasField("t") else []) + list(attr.tensors)
            problem = next((p for p in (_tensor_problem(t, external_ok) for t in tensors) if p), None)
            if problem:
                raise GradientError(f"{source}: attribute {attr.name!r} of node "
                                    f"{_label(node, index)} {problem}")
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _check_graph(sub, source, top=False, external_ok=external_ok)
    for index, node in enumerate(graph.node):
        texts = [node.op_type, node.domain, node.name, *node.input, *node.output]
        if not all(isinstance(t, str) for t in texts):
            raise GradientError(f"{source}: node #{index} has an op type or name that is not valid "
                                "UTF-8 text; the file is damaged")
        if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type) \
                and node.op_type not in ORT_DEFAULT_DOMAIN_OPS:
            raise GradientError(f"{source}: node {_label(node, index)} uses op {node.op_type!r}, "
                                "which ONNX does not define (a custom op needs its own domain)")
    if top:
        for index, node in enumerate(graph.node):
            missing = next((x for x in node.input if x and x not in produced), None)
            if missing is not None:
                raise GradientError(f"{source}: node {_label(node, index)} reads {missing!r}, which "
                                    "no node, graph input or initializer provides")
        _check_acyclic(graph, source)


def _check_acyclic(graph: onnx.GraphProto, source: str) -> None:
    """Kahn's algorithm over node dependencies; whatever is left sits on or behind a cycle."""
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    deps = [{producer[x] for x in node.input if x in producer} for node in graph.node]
    users: list[list[int]] = [[] for _ in graph.node]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    pending = [len(ds) for ds in deps]
    ready = [i for i, n in enumerate(pending) if n == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
    if done < len(graph.node):
        stuck = [i for i, n in enumerate(pending) if n > 0]
        shown = ", ".join(_label(graph.node[i], i) for i in stuck[:6])
        raise GradientError(f"{source}: the graph has a cycle: {len(stuck)} nodes depend on "
                            f"each other's outputs ({shown}{', ...' if len(stuck) > 6 else ''})")


def check_model_proto(proto: onnx.ModelProto, source: str, external_ok: bool = False) -> None:
    """Raise :class:`GradientError` naming ``source`` and the value/node for a malformed graph.

    ``external_ok``: tensors in external data are accepted (the caller checked them against
    the model's folder, see :func:`gradgraph.io.load_model`), not refused as in point 6."""
    _check_opsets(proto, source)
    _check_graph(proto.graph, source, top=True, external_ok=external_ok)


def _check_opsets(proto: onnx.ModelProto, source: str) -> None:
    """An ONNX opset newer than the installed onnx defines (its gradient model would not load in
    onnxruntime either), or none at all."""
    newest = onnx.defs.onnx_opset_version()
    default = [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")]
    if not proto.opset_import:
        raise GradientError(f"{source}: the model imports no opset (opset_import is empty); set the "
                            "ONNX opset it was written for")
    if default and max(default) > newest:
        raise GradientError(f"{source}: the model imports ONNX opset {max(default)}, newer than the {newest} "
                            f"this onnx ({onnx.__version__}) defines; re-export it with opset {newest} or "
                            "older, or upgrade onnx")
