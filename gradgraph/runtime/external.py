"""Models over protobuf's 2 GB limit: weights read lazily, never held by a ModelProto.

A model file whose external data holds at least :data:`EXTERNAL_DATA_THRESHOLD` bytes is
loaded with its tensors left in the file (``onnx_ir.ExternalTensor``, memory-mapped on first
use); every reference is checked first (:func:`check_external_data`: inside the model's
folder, within the file). Such a model is saved with external data (``OUT.onnx`` +
``OUT.onnx.data``, see :func:`gradgraph.io.save_model`) and handed to onnxruntime as a
weightless ModelProto whose large initializers are injected as OrtValues over the arrays
(:func:`session_parts`). Smaller models keep every tensor inline, as before.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from gradgraph.runtime.compat import proto_graphs
from passes.autodiff import GradientError

# Models whose tensors hold at least this many bytes (1 GiB) are loaded lazily, saved with
# external data and handed to onnxruntime without their weights in a protobuf. protobuf cannot
# serialize 2 GiB; the margin leaves room for the graph and for tensors a build adds.
# The environment variable GRADGRAPH_EXTERNAL_DATA_THRESHOLD (bytes) sets another threshold.
EXTERNAL_DATA_THRESHOLD = 1 << 30


def _threshold_from_env() -> int:
    text = os.environ.get("GRADGRAPH_EXTERNAL_DATA_THRESHOLD", "")
    if not text:
        return EXTERNAL_DATA_THRESHOLD
    try:
        value = int(text)
    except ValueError:
        raise GradientError(f"GRADGRAPH_EXTERNAL_DATA_THRESHOLD={text!r} is not a number of bytes; "
                            "unset it or give an integer (e.g. 1073741824)") from None
    if value < 0:
        raise GradientError(f"GRADGRAPH_EXTERNAL_DATA_THRESHOLD={text!r} must be >= 0")
    return value


EXTERNAL_DATA_THRESHOLD = _threshold_from_env()
# Tensors of at least this many bytes go to the external data file (smaller ones stay inline),
# and are injected into onnxruntime sessions as OrtValues.
EXTERNAL_TENSOR_MIN_BYTES = 1024
# Types numpy holds natively (onnxruntime takes them as OrtValues from numpy arrays).
_INJECTABLE = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.INT8,
                         ir.DataType.UINT8, ir.DataType.INT16, ir.DataType.UINT16, ir.DataType.INT32,
                         ir.DataType.UINT32, ir.DataType.INT64, ir.DataType.UINT64, ir.DataType.BOOL})
# Placeholder location of an initializer whose value a session gets as an OrtValue.
INJECTED = "__gradgraph_injected__"


def _tensor_protos(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    for graph in proto_graphs(proto.graph):
        yield from graph.initializer
        for attr in (a for node in graph.node for a in node.attribute):
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors


def _expected_bytes(t: onnx.TensorProto) -> int | None:
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError):
        return None
    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return None
    return int(np.prod(t.dims, dtype=np.int64)) * itemsize


def check_external_data(proto: onnx.ModelProto, path: Path) -> int:
    """Check every external reference of ``proto`` (loaded from ``path`` without its external
    data) and return the bytes they hold: the file must lie inside the model's folder (no
    absolute path, no ``..``, no link out), exist, and hold ``offset + length`` bytes of the
    tensor's size. A violation is a :class:`GradientError` naming the tensor and file."""
    folder = path.parent.resolve()
    total = 0
    for t in _tensor_protos(proto):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        where = f"model file {str(path)!r}: tensor {t.name!r}"
        file = (folder / location).resolve()
        if not location or os.path.isabs(location) or not file.is_relative_to(folder):
            raise GradientError(f"{where} keeps its data at {location!r}, outside the model's folder "
                                f"{str(folder)!r}; gradgraph reads external data only from files "
                                "beside the model")
        if not file.is_file():
            missing = sorted({e.value for x in _tensor_protos(proto) for e in x.external_data
                              if e.key == "location" and not (folder / e.value).is_file()})
            raise GradientError(
                f"model file {str(path)!r} keeps its weights in external data file(s) {missing}, "
                f"missing from {str(folder)!r}: copy them beside the model (an export's .onnx.data "
                "file travels with its .onnx)")
        try:
            offset, length = int(info.get("offset", 0)), info.get("length")
        except ValueError as exc:
            raise GradientError(f"{where}: external data offset {info.get('offset')!r} is not an "
                                "integer; the file is damaged") from exc
        size = file.stat().st_size
        expected = _expected_bytes(t)
        nbytes = int(length) if length is not None else (expected if expected is not None else size - offset)
        if expected is not None and nbytes != expected:
            raise GradientError(f"{where} claims {nbytes} bytes in {location!r} for dims "
                                f"{list(t.dims)} ({expected} expected); the file is damaged")
        if offset < 0 or offset + nbytes > size:
            raise GradientError(f"{where}: bytes {offset}..{offset + nbytes} are past the end of "
                                f"{location!r} ({size} bytes); the data file is truncated or "
                                "belongs to another model")
        total += nbytes
    return total


def is_large_file(path: str | os.PathLike) -> bool:
    """Whether the model file ``path`` keeps :data:`EXTERNAL_DATA_THRESHOLD` bytes or more in
    external data (read without loading them; False for anything that is not such a file)."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
        return check_external_data(proto, Path(path)) >= EXTERNAL_DATA_THRESHOLD
    except Exception:  # noqa: BLE001 - not a model, or a bad one: load_model says why
        return False


def tensors(model: ir.Model) -> Iterator[tuple[ir.Value | None, ir.TensorProtocol]]:
    """Every tensor of ``model``: initializers of each graph (with their value) and tensor
    attributes (value None)."""
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value, value.const_value
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.TENSOR:
                yield None, attr.as_tensor()
            elif attr.type == ir.AttributeType.TENSORS:
                for t in attr.as_tensors():
                    yield None, t


def tensor_bytes(model: ir.Model) -> int:
    """The bytes of every tensor of ``model`` (without reading external data)."""
    return sum(t.nbytes for _, t in tensors(model))


def is_large(model: ir.Model) -> bool:
    """Whether ``model`` is handled as a large model (see :data:`EXTERNAL_DATA_THRESHOLD`)."""
    return tensor_bytes(model) >= EXTERNAL_DATA_THRESHOLD


def read_array(tensor: ir.TensorProtocol) -> np.ndarray:
    """A writable array of its own holding ``tensor``'s values: an external tensor is read
    from its file straight into the array (no memory map left resident), any other copied."""
    if isinstance(tensor, ir.ExternalTensor) and tensor.dtype.itemsize * 8 == tensor.dtype.bitwidth:
        array = np.empty(tensor.shape.numpy(), dtype=tensor.dtype.numpy())
        with open(tensor.path, "rb") as f:
            f.seek(tensor.offset or 0)
            view = array.reshape(-1).view(np.uint8).data
            done = 0
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise GradientError(f"tensor {tensor.name!r}: {tensor.path!r} ended early")
                done += got
        return array
    return np.array(tensor.numpy(), copy=True, order="C")


def drop_resident(array: np.ndarray) -> None:
    """Drop the pages of the memory map ``array`` views from this process (they are read
    again from the file when touched): a no-op for an array of its own."""
    base: Any = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    if isinstance(base, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        try:
            base.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def session_parts(model: ir.Model) -> tuple[onnx.ModelProto, list[str], list[np.ndarray]]:
    """``model`` as a ModelProto for onnxruntime whose main-graph initializers of at least
    :data:`EXTERNAL_TENSOR_MIN_BYTES` are placeholders, plus their names and arrays (to inject
    with ``SessionOptions.add_external_initializers``; keep the arrays alive with the session).
    ``model`` is not changed; the arrays view its tensors (external ones memory-mapped)."""
    names: list[str] = []
    arrays: list[np.ndarray] = []
    swapped: list[tuple[ir.Value, ir.TensorProtocol]] = []
    try:
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None or tensor.nbytes < EXTERNAL_TENSOR_MIN_BYTES or tensor.dtype not in _INJECTABLE:
                continue
            array = np.ascontiguousarray(tensor.numpy())
            placeholder = ir.ExternalTensor(INJECTED, 0, tensor.nbytes, tensor.dtype,
                                            shape=ir.Shape(tensor.shape.numpy()), name=name)
            swapped.append((value, tensor))
            value.const_value = placeholder
            names.append(name)
            arrays.append(array)
        proto = ir.to_proto(model)
    finally:
        for value, tensor in swapped:
            value.const_value = tensor
    return proto, names, arrays


def inference_session(model: ir.Model, options: Any = None, **kwargs: Any) -> Any:
    """An ``onnxruntime.InferenceSession`` of ``model`` built without a ModelProto holding its
    weights (:func:`session_parts`); ``options`` (a new SessionOptions when None) receives the
    injected initializers. The session keeps their OrtValues alive."""
    import onnxruntime as ort

    from gradgraph.runtime.compat import inference_session as session_of

    proto, names, arrays = session_parts(model)
    options = options if options is not None else ort.SessionOptions()
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
    if names:
        options.add_external_initializers(names, values)
    if sum(a.nbytes for a in arrays) >= EXTERNAL_DATA_THRESHOLD:
        # onnxruntime would keep a packed copy of each MatMul weight beside the injected one
        options.add_session_config_entry("session.disable_prepacking", "1")
    session = session_of(proto, options, **kwargs)
    session._gradgraph_injected = (arrays, values)  # alive as long as the session
    return session


__all__ = ["inference_session", "is_large_file", "EXTERNAL_DATA_THRESHOLD", "EXTERNAL_TENSOR_MIN_BYTES", "check_external_data", "drop_resident",
           "is_large", "read_array", "session_parts", "tensor_bytes", "tensors"]
