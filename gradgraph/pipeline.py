"""A pipeline is a declared list of stages; each stage's model can be saved for debugging."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import onnx_ir as ir
from onnx_ir.passes import PassBase, PassError

from gradgraph.io import save_model
from passes.autodiff.errors import unwrap_pass_errors


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    pass_: PassBase


class Pipeline:
    def __init__(self, stages: list[Stage]) -> None:
        self.stages = stages

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def run(self, model: ir.Model, *, save_dir: str | os.PathLike | None = None,
            verbose: bool = False) -> ir.Model:
        for index, stage in enumerate(self.stages):
            try:
                model = stage.pass_(model).model
            except PassError as exc:
                raise unwrap_pass_errors(exc) from exc
            if save_dir is not None:
                path = Path(save_dir) / f"{index:02d}_{stage.name}.onnx"
                save_model(model, path)
                if verbose:
                    print(f"saved stage {stage.name!r} to {path}", file=sys.stderr)
        return model
