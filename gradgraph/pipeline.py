"""A pipeline is a declared list of stages; each stage's model can be saved for debugging.

A stage is a name and the passes it runs, in order. ``Pipeline.run`` runs them, saving each
stage's model as ``DIR/NN_<stage>.onnx`` when asked (``save_dir``), at the stage's own
``save_to`` path when it has one, and telling ``on_stage`` (which the training build uses to
keep the models later variants start from). ``summary()`` lists what each stage changed.

The stage files of a run appear in ``DIR`` all together once every stage succeeded, or not at
all (:func:`gradgraph.io.staged_folder`); a caller running several pipelines into one ``DIR``
wraps them in one ``staged_folder`` (the training build does). The ``save_to`` files are
written atomically as each stage ends (a failing later stage leaves them, complete).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes import PassBase, PassError

from gradgraph.io import save_model, staged_folder
from passes.autodiff.errors import unwrap_pass_errors


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    passes: tuple[PassBase, ...]
    # Also write this stage's model here (the reference's graph_save_paths); "" for none.
    save_to: str = ""

    def __init__(self, name: str, passes: PassBase | Sequence[PassBase], save_to: str = "") -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "passes", (passes,) if isinstance(passes, PassBase) else tuple(passes))
        object.__setattr__(self, "save_to", save_to)


@dataclasses.dataclass
class StageReport:
    """What one stage did: node counts by op type before and after, and whether it changed."""

    name: str
    modified: bool
    before: collections.Counter[str]
    after: collections.Counter[str]
    index: int = 0  # the stage's number (its saved file is ``<index>_<name>.onnx``)

    def changes(self) -> str:
        added = self.after - self.before
        removed = self.before - self.after
        parts = [f"+{n} {op}" for op, n in sorted(added.items())]
        parts += [f"-{n} {op}" for op, n in sorted(removed.items())]
        return ", ".join(parts) if parts else "no node added or removed"


_STAGE_FILE = re.compile(r"\d{2}_\w+\.onnx(\.data)?")


def is_stage_file(name: str) -> bool:
    """Whether a file name is a saved stage's (``NN_<stage>.onnx``, or its ``.data``)."""
    return _STAGE_FILE.fullmatch(name) is not None


def op_counts(model: ir.Model) -> collections.Counter[str]:
    return collections.Counter(node.op_type for node in model.graph)


class Pipeline:
    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)
        self.reports: list[StageReport] = []

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def run(self, model: ir.Model, *, save_dir: str | os.PathLike | None = None,
            verbose: bool = False, first_index: int = 0,
            on_stage: Callable[[Stage, ir.Model], None] | None = None) -> ir.Model:
        self.reports = []
        staging: contextlib.AbstractContextManager[Path | None] = (
            staged_folder(save_dir) if save_dir is not None else contextlib.nullcontext())
        with staging as folder:
            for index, stage in enumerate(self.stages, start=first_index):
                before = op_counts(model)
                modified = False
                for pass_ in stage.passes:
                    try:
                        result = pass_(model)
                    except PassError as exc:
                        raise unwrap_pass_errors(exc) from exc
                    model, modified = result.model, modified or result.modified
                self.reports.append(StageReport(stage.name, modified, before, op_counts(model), index))
                if folder is not None:
                    name = f"{index:02d}_{stage.name}.onnx"
                    save_model(model, folder / name)
                    if verbose:
                        print(f"saved stage {stage.name!r} as {name} (in {save_dir} once every "
                              "stage succeeded)", file=sys.stderr)
                if stage.save_to:
                    save_model(model, stage.save_to)
                if on_stage is not None:
                    on_stage(stage, model)
        return model
