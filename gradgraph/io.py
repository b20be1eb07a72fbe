"""Reading models and writing files safely."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
from onnx import version_converter

from gradgraph.model_check import check_model_proto
from passes.autodiff import GradientError

MIN_OPSET = 13


def _upgrade(proto: onnx.ModelProto, source: str) -> onnx.ModelProto:
    """Check the graph's structure, then convert models below opset 13 (the oldest the rules
    target) with onnx's version converter."""
    check_model_proto(proto, source)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), MIN_OPSET)
    if opset >= MIN_OPSET:
        return proto
    warnings.warn(f"{source} uses ONNX opset {opset}; converting it to opset {MIN_OPSET}", stacklevel=3)
    try:
        return version_converter.convert_version(proto, MIN_OPSET)
    except Exception as exc:  # noqa: BLE001 - the converter raises RuntimeError/ValueError
        raise GradientError(
            f"{source} uses ONNX opset {opset} and could not be converted to opset {MIN_OPSET} "
            f"({exc}); re-export it at opset {MIN_OPSET} or newer"
        ) from exc


def _from_proto(proto: onnx.ModelProto, source: str) -> ir.Model:
    try:
        return ir.from_proto(_upgrade(proto, source))
    except GradientError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnx_ir's deserializer raises several types
        root: BaseException = exc
        while root.__cause__ is not None:
            root = root.__cause__
        raise GradientError(f"{source} is not a valid ONNX model: {type(root).__name__}: "
                            f"{str(root)[:300]}") from exc


def load_model(model: onnx.ModelProto | ir.Model | str | os.PathLike | bytes | Any) -> ir.Model:
    """An ``ir.Model`` from a ModelProto, an ``onnx_ir.Model`` or ``torch.onnx.ONNXProgram``
    (copied, never edited), serialized bytes or a file path.

    A missing or malformed file raises :class:`GradientError` naming it; models below
    opset 13 are converted to opset 13.
    """
    program_model = getattr(model, "model", None)  # torch.onnx.ONNXProgram
    if isinstance(program_model, ir.Model):
        model = program_model
    if isinstance(model, ir.Model):  # passes edit in place: work on a copy
        return _from_proto(ir.to_proto(model), "the model")
    if isinstance(model, onnx.ModelProto):
        return _from_proto(model, "the model")
    if isinstance(model, bytes):
        try:
            proto = onnx.load_from_string(model)
        except Exception as exc:  # noqa: BLE001 - protobuf raises several types
            raise GradientError(f"the bytes given are not a serialized ONNX model ({exc})") from exc
        return _from_proto(proto, "the model")
    path = Path(model)
    if not path.is_file():
        raise GradientError(f"model file {str(path)!r} does not exist")
    try:
        proto = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001
        raise GradientError(
            f"model file {str(path)!r} is not a valid ONNX model: {type(exc).__name__}: {exc}"
        ) from exc
    if not proto.graph.node and not proto.graph.output:
        raise GradientError(f"model file {str(path)!r} holds no graph (is it an ONNX model?)")
    return _from_proto(proto, f"model file {str(path)!r}")


TEMP_SUFFIX = ".tmp"


def temp_prefix(target: Path) -> str:
    """The name prefix of ``target``'s temp files (``.<name>.`` + a random part + ``.tmp``)."""
    return f".{target.name}."


def remove_stale_temps(target: str | os.PathLike) -> list[Path]:
    """Delete temp files a killed write of ``target`` left beside it; returns them.

    Only files named like :func:`atomic_write_bytes`' temp files of that very target are
    touched; call it when no other process writes ``target``.
    """
    target = Path(target)
    if not target.parent.is_dir():
        return []
    stale = [p for p in target.parent.glob(temp_prefix(target) + "*" + TEMP_SUFFIX)
             if p.is_file() and not p.is_symlink()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path`` (a new, unique name: never a file or link
    that exists), fsync, rename over ``path``, then fsync the folder."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target), suffix=TEMP_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# protobuf cannot serialize a message of 2 GiB or more: larger models keep weights beside them.
PROTOBUF_LIMIT = 2**31 - 1


def save_model(model: onnx.ModelProto | ir.Model, path: str | os.PathLike) -> None:
    """Save a model atomically: one file with weights inline, or, for a model over protobuf's
    2 GiB limit, ``path`` plus ``<path name>.data`` holding the weights (both renamed into
    place once complete)."""
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    if proto.ByteSize() < PROTOBUF_LIMIT:
        atomic_write_bytes(path, proto.SerializeToString())
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data_name = target.name + ".data"
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        onnx.save_model(copy, str(Path(tmp) / target.name), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        os.replace(Path(tmp) / data_name, target.parent / data_name)
        os.replace(Path(tmp) / target.name, target)
