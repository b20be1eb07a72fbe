"""Checking user feeds against a session's inputs before onnxruntime sees them.

A wrong name, dtype, rank or fixed dimension is a user mistake: it gets an
:class:`InputError` naming the input, what was expected and where the data came from,
instead of an onnxruntime traceback.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from passes.autodiff import GradientError

NP_OF_ORT = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(int16)": np.int16,
}


class InputError(GradientError):
    """Feeds that do not fit the model's inputs (missing, wrong dtype, rank or dimension), or a
    bad data file or option: a :class:`GradientError` (so a ``ValueError`` too), like every
    refusal of the API; the CLI prints one line and exits 2."""


def unshaped_inputs(model: onnx.ModelProto) -> frozenset[str]:
    """The graph inputs of ``model`` declared without a shape (any rank is accepted).

    onnxruntime reports such an input's shape as ``[]``, as it does a scalar's: only the model
    tells them apart, so :func:`check_feeds` is given these names."""
    return frozenset(i.name for i in model.graph.input
                     if i.type.HasField("tensor_type") and not i.type.tensor_type.HasField("shape"))


def check_feeds(inputs: Iterable[ort.NodeArg], feeds: Mapping[str, Any], source: str = "the feeds",
                skip: Iterable[str] = (), unshaped: Iterable[str] = ()) -> None:
    """Raise :class:`InputError` unless ``feeds`` fit ``inputs`` (names in ``skip`` are fed
    elsewhere; those in ``unshaped``, see :func:`unshaped_inputs`, take any shape)."""
    skipped, any_shape = set(skip), set(unshaped)
    expected = [i for i in inputs if i.name not in skipped]
    missing = [i.name for i in expected if i.name not in feeds]
    if missing:
        raise InputError(f"model input(s) {missing} missing from {source}; the model needs "
                         f"{[i.name for i in expected]} (got {sorted(feeds)})")
    named: dict[str, tuple[str, int, int]] = {}  # dim_param -> (input, axis, size) first seen
    for arg in expected:
        value = feeds[arg.name]
        if isinstance(value, ort.OrtValue):
            continue
        array = np.asarray(value)
        want = NP_OF_ORT.get(arg.type)
        if want is not None and array.dtype != want and not np.can_cast(array.dtype, want, "same_kind"):
            raise InputError(f"input {arg.name!r} from {source} has dtype {array.dtype}; the model "
                             f"expects {np.dtype(want).name}")
        shape = list(arg.shape) if arg.shape is not None else None
        if shape is None or arg.name in any_shape:
            continue
        if array.ndim != len(shape):
            raise InputError(f"input {arg.name!r} from {source} has shape {list(array.shape)} "
                             f"(rank {array.ndim}); the model expects rank {len(shape)}: {shape}")
        for axis, (got, dim) in enumerate(zip(array.shape, shape)):
            if isinstance(dim, int) and dim >= 0 and got != dim:
                raise InputError(f"input {arg.name!r} from {source} has shape {list(array.shape)}; "
                                 f"dimension {axis} must be {dim} (model input shape {shape})")
            if isinstance(dim, str) and dim:  # a named dimension: one size for every input
                first = named.setdefault(dim, (arg.name, axis, got))
                if first[2] != got:
                    raise InputError(
                        f"inputs {first[0]!r} and {arg.name!r} from {source} disagree on dimension "
                        f"{dim!r}: {first[2]} (axis {first[1]} of {first[0]!r}, shape "
                        f"{list(np.shape(feeds[first[0]]))}) vs {got} (axis {axis} of {arg.name!r}, "
                        f"shape {list(array.shape)}); the model gives both the same size")


def load_npz(path: str, what: str = "inputs file") -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` archive; a missing or unreadable file is an :class:`InputError`."""
    from pathlib import Path

    if Path(path).is_dir():
        raise InputError(f"{what} {path!r} is a folder; name the .npz file")
    if not Path(path).is_file():
        raise InputError(f"{what} {path!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x93NUMPY"):
        raise InputError(f"{what} {path!r} is one .npy array, not an .npz archive; write the arrays "
                         "named after the model inputs with numpy.savez(path, name=array, ...)")
    if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # a zip file (an empty one too)
        raise InputError(f"{what} {path!r} is not an .npz archive (a zip of .npy arrays, as "
                         "numpy.savez writes)")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except Exception as exc:  # noqa: BLE001 - numpy raises several types
        raise InputError(f"{what} {path!r} is not a readable .npz archive: {exc}") from exc
