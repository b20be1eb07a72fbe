"""Checkpoint files: one safetensors file whose header metadata holds a small JSON document.

Tensors and metadata live in one file so a single atomic rename (temp file, fsync, rename;
``gradgraph.io.atomic_write_bytes``) switches from the previous checkpoint to the next: a
process killed while writing leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from gradgraph.io import atomic_write_bytes
from passes.autodiff import GradientError

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
