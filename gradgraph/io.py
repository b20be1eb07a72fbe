"""Reading models and writing files safely.

Every file gradgraph writes goes through :func:`atomic_write_bytes` (or :func:`save_model`):
a temp file with a new, unique name beside the target, fsynced, renamed over it, the folder
fsynced. Folders of files that belong together (a build's stage models) are written with
:func:`staged_folder`: all of them or none. A write the file system refuses (read-only, no
space left, a file where a folder belongs) is a :class:`WriteError` naming the path.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import onnx
import onnx_ir as ir
from onnx import version_converter

from gradgraph.model_check import check_model_proto
from gradgraph.runtime import external
from gradgraph.runtime.compat import proto_graphs
from gradgraph.runtime.stream_proto import write_model
from passes.autodiff import GradientError

MIN_OPSET = 13


def _upgrade(proto: onnx.ModelProto, source: str, external_ok: bool = False) -> onnx.ModelProto:
    """Check the graph's structure, then convert models below opset 13 (the oldest the rules
    target) with onnx's version converter."""
    check_model_proto(proto, source, external_ok=external_ok)
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


def _from_proto(proto: onnx.ModelProto, source: str, folder: Path | None = None) -> ir.Model:
    """The checked, upgraded IR of ``proto``; ``folder``: its external data (checked by the
    caller) stays in the files there, read when used (see :mod:`gradgraph.runtime.external`)."""
    try:
        if folder is None:
            return ir.from_proto(_upgrade(proto, source))
        model = ir.from_proto(_upgrade(proto, source, external_ok=True))
        ir.external_data.set_base_dir(model.graph, folder)
        return model
    except GradientError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnx_ir's deserializer raises several types
        root: BaseException = exc
        while root.__cause__ is not None:
            root = root.__cause__
        raise GradientError(f"{source} is not a valid ONNX model: {type(root).__name__}: "
                            f"{str(root)[:300]}") from exc


def load_model(model: onnx.ModelProto | ir.Model | str | os.PathLike | bytes | Any,
               lazy: bool = False) -> ir.Model:
    """An ``ir.Model`` from a ModelProto, an ``onnx_ir.Model`` or ``torch.onnx.ONNXProgram``
    (copied, never edited), serialized bytes or a file path.

    A missing or malformed file raises :class:`GradientError` naming it; models below
    opset 13 are converted to opset 13. A file's external data stays in its files (read when
    used, see :mod:`gradgraph.runtime.external`) when it holds 1 GiB or more, or with ``lazy`` (for
    callers that never put the weights into a ModelProto, such as the training build).
    """
    program_model = getattr(model, "model", None)  # torch.onnx.ONNXProgram
    if isinstance(program_model, ir.Model):
        model = program_model
    if isinstance(model, ir.Model):  # passes edit in place: work on a copy
        if external.is_large(model):  # a copy sharing the tensors; the graph checked without them
            check_model_proto(external.session_parts(model)[0], "the model", external_ok=True)
            return model.clone(deep_copy=True)
        return _from_proto(ir.to_proto(model), "the model")
    if isinstance(model, onnx.ModelProto):
        return _from_proto(model, "the model")
    if isinstance(model, bytes):
        try:
            proto = onnx.load_from_string(model)
        except Exception as exc:  # noqa: BLE001 - protobuf raises several types
            raise GradientError(f"the bytes given are not a serialized ONNX model ({exc})") from exc
        return _from_proto(proto, "the model")
    if not isinstance(model, (str, os.PathLike)):
        raise GradientError(f"the model must be an onnx.ModelProto, an onnx_ir.Model, a "
                            f"torch.onnx.ONNXProgram, serialized bytes or a file path, not "
                            f"{type(model).__name__}")
    path = Path(model)
    if path.is_dir():
        raise GradientError(f"model file {str(path)!r} is a folder; name the .onnx file in it")
    if not path.is_file():
        raise GradientError(f"model file {str(path)!r} does not exist")
    if is_torch_file(path):
        raise GradientError(
            f"model file {str(path)!r} is a PyTorch file (torch.save), not an ONNX model: load it "
            "into its module, compute the loss in forward, and export that: torch.onnx.export("
            "module, example_args, 'model.onnx', dynamo=True, optimize=False)")
    try:
        proto = onnx.load(str(path), load_external_data=False)
        if external.check_external_data(proto, path) >= (0 if lazy else external.EXTERNAL_DATA_THRESHOLD):
            return _from_proto(proto, f"model file {str(path)!r}", folder=path.parent.resolve())
        onnx.load_external_data_for_model(proto, str(path.parent))
    except GradientError:
        raise
    except Exception as exc:  # noqa: BLE001
        missing = _missing_external_data(path)
        if missing:
            raise GradientError(
                f"model file {str(path)!r} keeps its weights in external data file(s) {missing}, "
                f"missing from {str(path.parent.resolve())!r}: copy them beside the model (an "
                "export's .onnx.data file travels with its .onnx)") from exc
        raise GradientError(
            f"model file {str(path)!r} is not a valid ONNX model: {type(exc).__name__}: {exc}"
        ) from exc
    if not proto.graph.node and not proto.graph.output:
        raise GradientError(f"model file {str(path)!r} holds no graph (is it an ONNX model?)")
    return _from_proto(proto, f"model file {str(path)!r}")


def is_torch_file(path: Path) -> bool:
    """Whether ``path`` is what ``torch.save`` / ``torch.jit.save`` write: a zip archive holding
    ``data.pkl`` or ``constants.pkl``, or a bare pickle (torch's legacy format). An ONNX model
    starts with neither (no ModelProto field is numbered 10, the zip magic's first byte; a
    pickle's first byte 0x80 would be field 16)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return True
    if head != b"PK\x03\x04":
        return False
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return any(n.rsplit("/", 1)[-1] in ("data.pkl", "constants.pkl") for n in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _missing_external_data(path: Path) -> list[str]:
    """The external data files ``path``'s tensors name that are not beside it (none if the
    file does not even parse without them)."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not an ONNX model at all: the caller's message
        return []
    tensors: list[onnx.TensorProto] = []
    for graph in proto_graphs(proto.graph):
        tensors.extend(graph.initializer)
        for attr in (a for node in graph.node for a in node.attribute):
            tensors.extend([attr.t] if attr.HasField("t") else [])
            tensors.extend(attr.tensors)
    locations = {entry.value for tensor in tensors if tensor.data_location == onnx.TensorProto.EXTERNAL
                 for entry in tensor.external_data if entry.key == "location"}
    return sorted(loc for loc in locations if not (path.parent / loc).is_file())


TEMP_SUFFIX = ".tmp"


class WriteError(GradientError):
    """A file or folder could not be written (read-only file system, no space left, a file
    where a folder belongs, no permission); what was there before is left as it was."""


def _write_error(path: str | os.PathLike, exc: OSError) -> WriteError:
    reason = exc.strerror or str(exc)
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
    return WriteError(f"cannot write {str(path)!r}: {reason}{where}; choose a writable location "
                      "(nothing was written there)")


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


def _umask() -> int:
    mask = os.umask(0o022)  # read by setting it; put back at once
    os.umask(mask)
    return mask


def _new_temp_beside(target: Path) -> tuple[int, str, list[Path]]:
    """(fd, name, folders created) of a new, unique temp file beside ``target``; its folder is
    created if missing (and removed again if the temp file cannot be made: a WriteError)."""
    if target.is_dir():
        raise WriteError(f"cannot write {str(target)!r}: it is a folder; give a file name (nothing was "
                         "written)")
    created = _missing_folders(target.parent)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target), suffix=TEMP_SUFFIX, dir=target.parent)
        # mkstemp makes the file private (0600): give it what open() would, 0666 less the umask
        os.fchmod(fd, 0o666 & ~_umask())
    except OSError as exc:
        _remove_empty(created)
        raise _write_error(target, exc) from exc
    return fd, tmp, created


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path`` (a new, unique name: never a file or link
    that exists), fsync, rename over ``path``, then fsync the folder."""
    with atomic_writer(path) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into, piece by piece: a temp file beside
    it, fsynced and renamed over ``path`` when the ``with`` block completes (removed, ``path``
    left as it was, when it raises)."""
    target = Path(path)
    fd, tmp, created = _new_temp_beside(target)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        _remove_empty(created)
        if isinstance(exc, OSError):
            raise _write_error(target, exc) from exc
        raise
    _fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_output_path(path: str | os.PathLike) -> Iterator[str]:
    """For a writer that takes a file name (onnxruntime's ``optimized_model_filepath``): a new,
    unique temp file name beside ``path``, renamed over ``path`` when the ``with`` block
    completes and the writer wrote something (removed otherwise, ``path`` left as it was). An
    empty ``path`` yields "" and writes nothing."""
    if not str(path):
        yield ""
        return
    target = Path(path)
    fd, tmp, created = _new_temp_beside(target)
    os.close(fd)
    try:
        yield tmp
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        _remove_empty(created)
        raise
    try:
        if os.path.getsize(tmp) == 0:  # the writer wrote nothing: keep what was there
            Path(tmp).unlink()
            _remove_empty(created)
            return
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        _remove_empty(created)
        raise _write_error(target, exc) from exc
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


def _proto_tensor_bytes(proto: onnx.ModelProto) -> int:
    return sum(t.ByteSize() for graph in proto_graphs(proto.graph) for t in graph.initializer)


def save_model(model: onnx.ModelProto | ir.Model, path: str | os.PathLike) -> None:
    """Save a model atomically: one file with the weights inline, or, for a model whose tensors
    hold :data:`gradgraph.runtime.external.EXTERNAL_DATA_THRESHOLD` bytes or more (1 GiB; protobuf
    cannot write 2 GiB), ``path`` plus ``<path name>.data`` with every tensor of 1 KiB or more,
    streamed tensor by tensor (no ModelProto holds them). Each file is renamed into place
    once complete, the data file first."""
    limit = min(external.EXTERNAL_DATA_THRESHOLD, PROTOBUF_LIMIT)
    if isinstance(model, onnx.ModelProto):
        if _proto_tensor_bytes(model) < limit:
            try:
                data = model.SerializeToString()
            except Exception:  # noqa: BLE001 - over 2 GiB after all (a huge graph): below
                data = None
            if data is not None and len(data) < PROTOBUF_LIMIT:
                atomic_write_bytes(path, data)
                return
        model = ir.from_proto(model)
    if external.tensor_bytes(model) < limit:  # the weights streamed, never in a ModelProto
        with atomic_writer(path) as f:
            write_model(model, f)
        return
    _save_external(model, Path(path))


def model_proto(model: ir.Model) -> onnx.ModelProto:
    """``model`` as a self-contained ModelProto: tensors a lazily loaded model left in its
    external data files are read into it (``model`` itself is not changed)."""
    if any(isinstance(t, ir.ExternalTensor) for _, t in external.tensors(model)):
        model = model.clone(deep_copy=True)  # shares the tensors: only the clone's are replaced
        for value, tensor in list(external.tensors(model)):
            if value is not None and isinstance(tensor, ir.ExternalTensor):
                value.const_value = ir.Tensor(external.read_array(tensor), name=tensor.name)
    return ir.to_proto(model)


def _save_external(model: ir.Model, target: Path) -> None:
    """``target`` + ``<name>.data``, written in a temp folder beside them, then renamed."""
    if target.is_dir():
        raise WriteError(f"cannot write {str(target)!r}: it is a folder; give a file name (nothing was "
                         "written)")
    data_name = target.name + ".data"
    created = _missing_folders(target.parent)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=temp_prefix(target), suffix=TEMP_SUFFIX,
                                         dir=target.parent) as tmp:
            ir.save(model, Path(tmp) / target.name, external_data=data_name,
                    size_threshold_bytes=external.EXTERNAL_TENSOR_MIN_BYTES)
            for name in (data_name, target.name):
                with open(Path(tmp) / name, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(Path(tmp) / data_name, target.parent / data_name)
            os.replace(Path(tmp) / target.name, target)
    except OSError as exc:
        _remove_empty(created)
        raise _write_error(target, exc) from exc
    _fsync_dir(target.parent)


# Staging folders of this process now open (absolute paths): a staged_folder call naming one
# of them writes into it directly; the outermost call commits.
_OPEN_STAGING: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "gradgraph_open_staging", default=frozenset())
_STAGING_NAME = re.compile(r"\.staging-(\d+)-[^/]*\.tmp\Z")


def _staging_prefix(target: Path, inside: bool) -> str:
    return ".staging-" if inside else f".{target.name}.staging-"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: running, someone else's
        return True
    return True


def remove_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Delete staging folders of ``target`` that a killed process left (beside it, or inside
    it when it existed; their process id, part of the name, is not running on this machine);
    returns them. POSIX only."""
    target = Path(os.path.abspath(target))
    if os.name != "posix":
        return []
    stale = []
    for home, inside in ((target.parent, False), (target, True)):
        if not home.is_dir():
            continue
        for p in home.glob(_staging_prefix(target, inside) + "*" + TEMP_SUFFIX):
            match = _STAGING_NAME.search(p.name)
            if match and p.is_dir() and not p.is_symlink() and not _pid_running(int(match.group(1))):
                shutil.rmtree(p, ignore_errors=True)
                stale.append(p)
    return stale


@contextlib.contextmanager
def staged_folder(target: str | os.PathLike,
                  replaces: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """A new temp folder whose files appear in ``target`` only if the ``with`` block ends
    without an exception: all of them, or none.

    - ``target`` does not exist: the temp folder is its sibling
      (``.<name>.staging-<pid>-<random>.tmp``, the same file system), renamed to ``target``
      when the block completes: one atomic rename;
    - ``target`` is a folder: the temp folder is made inside it (``.staging-<pid>-...tmp``:
      writing needs no more than ``target`` itself); when the block completes each file is
      renamed into ``target`` (each replacement atomic), then the files ``replaces(name)``
      selects that this block did not write (an earlier run's outputs) are removed; any other
      file in ``target`` is left untouched.

    On an exception (Ctrl-C included) the temp folder is removed, and ``target`` and any
    parent folder created for it are left as they were. A target that exists and is not a
    folder, or a file system that refuses the writes, is a :class:`WriteError`. Staging
    folders a killed process left for ``target`` are removed first. Called again for a
    staging folder it opened (``staged_folder(folder)`` inside the block), it yields that
    folder and commits nothing: the outermost call commits.
    """
    target = Path(os.path.abspath(target))
    if str(target) in _OPEN_STAGING.get():
        yield target
        return
    if target.exists() and not target.is_dir():
        raise WriteError(f"cannot write the folder {str(target)!r}: a file of that name exists; "
                         "name a folder, or a path that does not exist yet")
    inside = target.is_dir()
    home = target if inside else target.parent
    created = [] if inside else _missing_folders(home)
    try:
        home.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(target)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(target, inside)}{os.getpid()}-",
                                    suffix=TEMP_SUFFIX, dir=home))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's folder is private (0700); the target is not
    except OSError as exc:
        _remove_empty(created)
        raise _write_error(target, exc) from exc
    token = _OPEN_STAGING.set(_OPEN_STAGING.get() | {str(tmp)})
    try:
        try:
            yield tmp
        finally:
            _OPEN_STAGING.reset(token)
        _commit(tmp, target, replaces)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


def _commit(tmp: Path, target: Path, replaces: Callable[[str], bool] | None) -> None:
    try:
        if not target.exists():
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():  # not a folder made meanwhile: a real failure
                    raise
            else:
                _fsync_dir(target.parent)
                return
        written = {tmp.name}
        for item in sorted(tmp.iterdir()):
            os.replace(item, target / item.name)
            written.add(item.name)
        if replaces is not None:
            for old in target.iterdir():
                if old.name not in written and replaces(old.name) and (old.is_file() or old.is_symlink()):
                    old.unlink()
        _fsync_dir(target)
        tmp.rmdir()
    except OSError as exc:
        raise _write_error(target, exc) from exc


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet, deepest first."""
    return [p for p in (folder, *folder.parents) if not p.exists()]


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders (deepest first) if they are empty: parents made for a target."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return
