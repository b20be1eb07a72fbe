"""``summary.txt`` of a training build: what each stage changed, what the backward keeps.

1. per stage: nodes added and removed, by op type;
2. the activations the backward reads from the forward (``passes.recompute.analysis``), with
   their bytes for the given dimension values: the memory recompute trades for compute.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
import onnx_ir as ir

from gradgraph.training.build import TrainingArtifacts
from passes.recompute.analysis import stashed_values


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def stash_lines(model: onnx.ModelProto | ir.Model, dims: Mapping[str, int] | None = None) -> list[str]:
    """One line per stashed activation, largest first, and the total."""
    graph = model if isinstance(model, ir.Model) else ir.from_proto(model)
    stashes = stashed_values(graph, dict(dims or {}))
    known = [s for s in stashes if s.nbytes is not None]
    unknown = [s for s in stashes if s.nbytes is None]
    lines = []
    for s in sorted(known, key=lambda s: -(s.nbytes or 0)):
        producer = s.producer.op_type
        lines.append(f"  {s.value.name}  {producer}  {_shape(s.value)}  {_human(s.nbytes or 0)}")
    names: set[str] = set()  # the named dims that would size the unknown ones
    unnamed = 0  # those with a dim no name can give (computed at run time: the rows a loss keeps)
    for s in unknown:
        producer = s.producer.op_type
        missing, anonymous = _unsized(s.value, dims or {})
        names.update(missing)
        unnamed += anonymous
        why = "a dim computed at run time" if anonymous else "symbolic dims " + ", ".join(sorted(missing))
        lines.append(f"  {s.value.name}  {producer}  {_shape(s.value)}  (size depends on {why})")
    total = sum(s.nbytes or 0 for s in known)
    head = f"activations kept for the backward: {len(stashes)} tensors, {_human(total)}"
    if unknown:
        parts = []
        if names:
            parts.append("give --dim " + " ".join(f"{n}=VALUE" for n in sorted(names)) + " to size them")
        if unnamed:
            parts.append(f"{unnamed} with a dim that has no name (computed at run time, e.g. the "
                         "rows a loss keeps), which --dim cannot size")
        head += f" (+{len(unknown)} of symbolic size; " + "; ".join(parts) + ")"
    return [head] + lines


# The names ONNX shape inference makes up for dims it cannot name (``unk__0``, ...).
_GENERATED_DIM = "unk__"


def _unsized(value: ir.Value, dims: Mapping[str, int]) -> tuple[set[str], bool]:
    """The dim names of ``value`` that ``dims`` lacks, and whether a dim has no name at all."""
    if value.shape is None:
        return set(), True
    missing, anonymous = set(), False
    for dim in value.shape:
        if isinstance(dim, int):
            continue
        name = getattr(dim, "value", None)
        if not isinstance(name, str) or not name or name.startswith(_GENERATED_DIM):
            anonymous = True
        elif name not in dims:
            missing.add(name)
    return missing, anonymous


def _shape(value: ir.Value) -> str:
    if value.shape is None:
        return "[?]"
    return "[" + ",".join(str(d) for d in value.shape) + "]"


def summary_text(artifacts: TrainingArtifacts, dims: Mapping[str, int] | None = None) -> str:
    lines = ["gradgraph build summary", ""]
    for report in artifacts.reports:
        state = "changed" if report.modified else "unchanged"
        lines.append(f"{report.index:02d} {report.name} ({state}; {sum(report.after.values())} nodes): "
                     f"{report.changes()}")
    lines.append("")
    if artifacts.stash_before_recompute is not None:
        known, symbolic = artifacts.stash_before_recompute
        lines.append(f"before recompute the backward kept {_human(known)}"
                     + (f" (+{symbolic} tensors of symbolic size)" if symbolic else ""))
    if artifacts.gradient_ir is not None:
        lines += stash_lines(artifacts.gradient_ir, dims)
    lines.append("")
    lines.append(f"trained {len(artifacts.trained)}, frozen {len(artifacts.frozen)}, "
                 f"buffers {len(artifacts.buffers)}")
    return "\n".join(lines) + "\n"
