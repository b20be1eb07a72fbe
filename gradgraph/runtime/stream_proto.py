"""A single-file ONNX model written with its weights streamed from their arrays.

``ir.to_proto(model).SerializeToString()`` holds the weights twice beside the arrays they come
from (the ModelProto's copy, then the serialized bytes): 2 W of transient memory for W bytes of
weights. :func:`write_model` writes the same model without either copy: the ModelProto without
its large initializers, then each of them as one more ``graph { initializer { ... } }`` record
whose ``raw_data`` bytes are written straight from the tensor's array. Protobuf merges repeated
records of a message field (the graph) and appends repeated fields (its initializers), so
readers (onnx, onnxruntime) see one graph holding every initializer.
"""

from __future__ import annotations

from typing import BinaryIO

import numpy as np
import onnx
import onnx_ir as ir

from gradgraph.runtime.external import session_parts

# Field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer, TensorProto.raw_data.
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9
_LENGTH_DELIMITED = 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int) -> bytes:
    return _varint(field << 3 | _LENGTH_DELIMITED)


def write_model(model: ir.Model, f: BinaryIO) -> None:
    """Write ``model`` (under protobuf's 2 GiB) to ``f`` as one ``.onnx`` file, its main graph's
    large initializers streamed from their arrays (see the module docstring)."""
    proto, names, arrays = session_parts(model)
    streamed = set(names)
    headers = {}
    kept = []
    for tensor in proto.graph.initializer:
        if tensor.name in streamed:
            headers[tensor.name] = onnx.TensorProto(name=tensor.name, dims=tensor.dims,
                                                    data_type=tensor.data_type).SerializeToString()
        else:
            kept.append(tensor)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    f.write(proto.SerializeToString())
    del proto
    for name, array in zip(names, arrays, strict=True):
        data = np.ascontiguousarray(array)
        if data.dtype.byteorder == ">":
            data = data.astype(data.dtype.newbyteorder("<"))
        raw = data.reshape(-1).view(np.uint8).data
        header = headers[name] + _key(_TENSOR_RAW_DATA) + _varint(raw.nbytes)
        tensor_size = len(header) + raw.nbytes
        initializer = _key(_GRAPH_INITIALIZER) + _varint(tensor_size)
        f.write(_key(_MODEL_GRAPH) + _varint(len(initializer) + tensor_size) + initializer + header)
        f.write(raw)
