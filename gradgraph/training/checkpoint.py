"""Checkpoint files: one safetensors file whose header metadata holds a small JSON document.

Tensors and metadata live in one file so a single atomic rename (temp file, fsync, rename;
``gradgraph.io.atomic_write_bytes``) switches from the previous checkpoint to the next: a
process killed while writing leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from gradgraph.io import atomic_write_bytes

FORMAT = "gradgraph-checkpoint"
VERSION = 1
_META_KEY = "gradgraph"
_HEADER_LEN_BYTES = 8


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not fit the session."""


def write_checkpoint(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                     meta: Mapping[str, Any]) -> None:
    doc = {"format": FORMAT, "version": VERSION, **meta}
    arrays = {k: np.array(v, order="C", copy=None) for k, v in tensors.items()}
    data = st_save(arrays, metadata={_META_KEY: json.dumps(doc, sort_keys=True)})
    atomic_write_bytes(path, data)


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"checkpoint {str(file)!r} does not exist")
    data = file.read_bytes()
    try:
        (header_len,) = struct.unpack("<Q", data[:_HEADER_LEN_BYTES])
        header = json.loads(data[_HEADER_LEN_BYTES:_HEADER_LEN_BYTES + header_len])
        meta = json.loads(header["__metadata__"][_META_KEY])
        tensors = st_load(data)
    except Exception as exc:  # noqa: BLE001 - struct, json, safetensors raise several types
        raise CheckpointError(f"checkpoint {str(file)!r} is not a gradgraph checkpoint ({exc})") from exc
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {str(file)!r} has format {meta.get('format')!r} "
                              f"version {meta.get('version')!r}; expected {FORMAT!r} {VERSION}")
    return tensors, meta
