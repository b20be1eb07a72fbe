"""Checkpoint files: one safetensors file whose header metadata holds a small JSON document.

Tensors and metadata live in one file so a single atomic rename (temp file, fsync, rename;
``gradgraph.io.atomic_writer``) switches from the previous checkpoint to the next: a
process killed while writing leaves the previous checkpoint intact. Tensors are written
straight from the arrays given (the session's buffers: no copy) and read straight from the
file into arrays of their own, so saving or loading W bytes of state needs W bytes, not 2-3 W.
The file is standard safetensors: ``safetensors.torch.load_file`` reads it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradgraph.io import atomic_writer
from passes.autodiff import GradientError

# The state key of the accumulation counter (a session's state and its checkpoints); it lives here,
# below both the session and the data-parallel runner, which read it.
MICRO_STEP_KEY = "micro_step"

FORMAT = "gradgraph-checkpoint"
VERSION = 1
_META_KEY = "gradgraph"
_HEADER_LEN_BYTES = 8


class CheckpointError(GradientError):
    """A checkpoint file is missing, unreadable, or does not fit the session (a
    :class:`GradientError`, so a ``ValueError`` too: the CLI prints one line and exits 2)."""


# Metadata entries save_checkpoint writes that must be non-negative integers when present.
_COUNTERS = ("step", "micro_step", "skipped_steps", "accumulation_steps")


def _check_meta(meta: dict[str, Any], where: str) -> None:
    """Refuse metadata a session could not act on (damaged or hand-edited files)."""
    for key in _COUNTERS:
        value = meta.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{where}: metadata {key!r} must be an integer >= 0, got "
                                  f"{value!r}; the file is damaged or was edited (save a new "
                                  "checkpoint, or train without resuming)")
    if not isinstance(meta.get("user", {}), dict):
        raise CheckpointError(f"{where}: metadata 'user' must be a JSON object (the user_dict "
                              f"of save_checkpoint), got {meta['user']!r}")


# safetensors' dtype names (bfloat16 through ml_dtypes, as onnx_ir and onnxruntime use it).
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "U64": "uint64", "I32": "int32", "U32": "uint32", "I16": "int16", "U16": "uint16",
           "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_CODES = {name: code for code, name in _DTYPES.items()}
# Bytes written per call (a view of the array: no copy).
_CHUNK = 64 << 20


def _np_dtype(code: str) -> np.dtype:
    if code == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_DTYPES[code])


def write_checkpoint(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                     meta: Mapping[str, Any]) -> None:
    """A safetensors file of ``tensors`` (viewed, never copied: the session's own buffers) and
    ``meta`` (JSON in the header), streamed to a temp file renamed over ``path``."""
    doc = {"format": FORMAT, "version": VERSION, **meta}
    arrays = {k: np.asarray(v) for k, v in tensors.items()}
    header: dict[str, Any] = {"__metadata__": {_META_KEY: json.dumps(doc, sort_keys=True)}}
    offset = 0
    for name, array in arrays.items():
        code = _CODES.get(array.dtype.name)
        if code is None or array.dtype.byteorder == ">":
            raise CheckpointError(f"tensor {name!r} has dtype {array.dtype}, which a safetensors "
                                  f"checkpoint cannot hold ({', '.join(_DTYPES.values())})")
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with atomic_writer(path) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for array in arrays.values():
            flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            for begin in range(0, flat.size, _CHUNK):
                f.write(flat[begin:begin + _CHUNK].data)


def _read_header(f: Any, size: int) -> tuple[dict[str, Any], int]:
    head = f.read(_HEADER_LEN_BYTES)
    (header_len,) = struct.unpack("<Q", head)
    if header_len > min(size - _HEADER_LEN_BYTES, 100 << 20):
        raise ValueError(f"header length {header_len} is past the end of the file")
    header = json.loads(f.read(header_len))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, _HEADER_LEN_BYTES + header_len


def _read_tensors(f: Any, header: Mapping[str, Any], start: int, size: int) -> dict[str, np.ndarray]:
    """Each tensor read from the file straight into an array of its own (one copy in memory)."""
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _np_dtype(entry["dtype"])
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if any(d < 0 for d in shape) or end - begin != nbytes or begin < 0 or start + end > size:
            raise ValueError(f"tensor {name!r}: bytes {begin}..{end} do not hold shape {list(shape)} "
                             f"{dtype} inside the file")
        array = np.empty(shape, dtype)
        f.seek(start + begin)
        view = array.reshape(-1).view(np.uint8).data
        done = 0
        while done < nbytes:  # one read call returns at most ~2 GiB
            got = f.readinto(view[done:done + _CHUNK])
            if not got:
                raise ValueError(f"tensor {name!r} is cut short")
            done += got
        tensors[name] = array
    return tensors


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors (arrays of their own, writable) and metadata of a checkpoint file."""
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"checkpoint {str(file)!r} does not exist")
    try:
        with file.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            header, start = _read_header(f, size)
            meta = json.loads(header["__metadata__"][_META_KEY])
            tensors = _read_tensors(f, header, start, size)
    except OSError:  # the file system's error, said as such by the caller
        raise
    except Exception as exc:  # noqa: BLE001 - struct, json, a damaged header raise several types
        raise CheckpointError(f"checkpoint {str(file)!r} is not a gradgraph checkpoint ({exc})") from exc
    where = f"checkpoint {str(file)!r}"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} is not a gradgraph checkpoint (its metadata is a JSON "
                              f"{type(meta).__name__}, not an object)")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{where} has format {meta.get('format')!r} "
                              f"version {meta.get('version')!r}; expected {FORMAT!r} {VERSION}")
    _check_meta(meta, where)
    return tensors, meta


def read_checkpoints(paths: Sequence[str | os.PathLike]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One checkpoint, or the merge of several ranks' (data-parallel, ZeRO-1 partitions).

    The union of their tensors; a tensor in several files (weights, the step) must be equal in
    all; their steps must agree and none may be mid-accumulation (a rank's partial gradient
    sums do not merge). The metadata is the first file's.
    """
    if not paths:
        raise CheckpointError("no checkpoint path given")
    parts = [(str(p), *read_checkpoint(p)) for p in paths]
    if len(parts) == 1:
        return parts[0][1], parts[0][2]
    first, tensors, meta = parts[0][0], dict(parts[0][1]), dict(parts[0][2])
    for where, more, other in parts[1:]:
        for key in ("step", "optimizer"):
            if other.get(key) != meta.get(key):
                raise CheckpointError(f"checkpoints {first!r} and {where!r} disagree on {key} "
                                      f"({meta.get(key)!r} vs {other.get(key)!r}): not ranks of one run")
        for name, value in more.items():
            if name in tensors and not np.array_equal(tensors[name], value):
                raise CheckpointError(f"checkpoints {first!r} and {where!r} hold different values of "
                                      f"{name!r}: not ranks of one run")
            tensors[name] = value
    if any(other.get("micro_step", 0) for _, _, other in parts):
        raise CheckpointError(f"checkpoints {[p for p, _, _ in parts]} were saved mid-accumulation: "
                              "several ranks' partial gradient sums cannot be merged; save at an "
                              "optimizer step")
    return tensors, meta
