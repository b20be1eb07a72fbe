"""``list_weights``: every float initializer of a model, whether it is trained, and why."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from gradgraph.io import load_model
from passes.autodiff import GradientOptions, build_gradient
from passes.exports import KIND_KEY, REASON_KEY, WeightKind
from passes.exports.classify import FLOATS
from passes.exports.recover import LOST_KEY, REEXPORT_HINT, UNREAD_KEY
from passes.exports.refusal import UNREAD_REASON
from passes.forward.prepare import PrepareForGradientPass


@dataclasses.dataclass(frozen=True)
class WeightInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str  # "parameter", "buffer" or "constant"
    trained: bool
    reason: str


def list_weights(model: Any, loss: str | None = None) -> list[WeightInfo]:
    """Classify every float initializer of ``model`` (path, bytes, ModelProto, onnx_ir.Model or
    ONNXProgram). ``trained`` is the default trained set: parameters that reach ``loss``
    (every parameter when ``loss`` is None). Parameters the exporter folded irreversibly are
    listed too, with no shape, untrained, and so are torch parameters the export does not hold
    and no node reads (unused, tied to another, or removed as ``x*1``)."""
    forward = PrepareForGradientPass(strict_parameters=False)(load_model(model)).model
    reaching: set[str] | None = None
    if loss is not None:
        # a copy of the graph sharing the tensors (a model over 1 GiB keeps them in its files)
        reaching = set(build_gradient(forward.clone(deep_copy=True), loss, None,
                                      GradientOptions(allow_unused=True)))
    rows = []
    lost = list(filter(None, forward.graph.metadata_props.get(LOST_KEY, "").split(",")))
    folded = f"folded into other constants by the exporter; {REEXPORT_HINT}"
    for name, value in forward.graph.initializers.items():
        if value.dtype not in FLOATS:
            continue
        kind = value.metadata_props.get(KIND_KEY, WeightKind.PARAMETER.value)
        reason = value.metadata_props.get(REASON_KEY, "")
        trained = kind == WeightKind.PARAMETER.value
        if name in lost:  # kept its name, holds folded values (Conv+BatchNorm): not the parameter
            trained, reason = False, folded
        elif trained and reaching is not None and name not in reaching:
            trained, reason = False, f"{reason}; does not reach loss {loss!r}"
        shape = tuple(d if isinstance(d, int) else -1 for d in value.shape) if value.shape is not None else ()
        nbytes = int(int(np.prod(shape, dtype=np.int64)) * value.dtype.itemsize)
        rows.append(WeightInfo(name, shape, value.dtype.name.lower(), nbytes, kind, trained, reason))
    for name in lost:
        if name not in forward.graph.initializers:
            rows.append(WeightInfo(name, (), "?", 0, WeightKind.PARAMETER.value, False, folded))
    for name in filter(None, forward.graph.metadata_props.get(UNREAD_KEY, "").split(",")):
        rows.append(WeightInfo(name, (), "?", 0, WeightKind.PARAMETER.value, False, UNREAD_REASON))
    return rows


def format_weights(rows: list[WeightInfo]) -> str:
    """The table ``--list-weights`` prints, with totals."""
    width = max([len(r.name) for r in rows] + [4])
    lines = [f"{'name':<{width}}  {'shape':<16} {'dtype':<8} {'kind':<9} {'trained':<7}  reason"]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {str(list(r.shape)):<16} {r.dtype:<8} {r.kind:<9} "
                     f"{'yes' if r.trained else 'no':<7}  {r.reason}")
    trained = [r for r in rows if r.trained]
    present = [r for r in rows if r.dtype != "?"]
    gone = len(rows) - len(present)
    lines.append(f"{len(trained)} trained ({sum(r.nbytes for r in trained):,} bytes) of {len(present)} "
                 f"float initializers ({sum(r.nbytes for r in present):,} bytes)"
                 + (f"; {gone} torch parameter(s) not in the export (see their reasons)" if gone else ""))
    return "\n".join(lines)


__all__ = ["WeightInfo", "format_weights", "list_weights"]
