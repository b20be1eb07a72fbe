"""Where a TrainingSession's setup goes: wall time of each stage of the build and the session.

    python tools/profile_setup.py MODEL.onnx [--optimizer adamw] [--runs 2] [--loss loss]

Timers are wrapped around the stages (a nested stage also counts in its parent's line: the
build's lines are inside ``build (total)``): the build (``build_training_artifacts``), its
model load, IR clones, IR -> ModelProto conversions and the shape inferences of the scatter-add
rewrite; the session's onnxruntime sessions, the weights copied into its store, the index-input
check and the release of freed memory. HF GPT-2 small, as ``tools/bench_scale.py --model gpt2
--out DIR`` exports it: ``python tools/profile_setup.py DIR/model.onnx``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

import gradgraph.index_inputs as index_inputs
import gradgraph.training.build as build
import gradgraph.training.ort_state as ort_state
import gradgraph.training.session as session
import passes.kernels.scatter_accumulate as scatter_accumulate

TIMES: collections.Counter[str] = collections.Counter()


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - start
    return wrapper


def _install() -> None:
    session.build_training_artifacts = _timed("build (total)", build.build_training_artifacts)  # type: ignore[assignment]
    build.load_model = _timed("build: load the model", build.load_model)  # type: ignore[assignment]
    build.model_proto = _timed("build: IR -> ModelProto", build.model_proto)  # type: ignore[assignment]
    ir.Model.clone = _timed("build: IR model clones", ir.Model.clone)  # type: ignore[method-assign]
    for name in ("infer_shapes_for", "infer_missing_shapes"):
        if hasattr(scatter_accumulate, name):
            setattr(scatter_accumulate, name, _timed(f"build: scatter-add shapes ({name})",
                                                     getattr(scatter_accumulate, name)))
    ort_state.GraphRunner.__init__ = _timed(  # type: ignore[method-assign]
        "session: onnxruntime sessions", ort_state.GraphRunner.__init__)
    index_inputs.IndexCheck.__init__ = _timed(  # type: ignore[method-assign]
        "session: index-input check", index_inputs.IndexCheck.__init__)
    session.TrainingSession._init_state = _timed(  # type: ignore[method-assign]
        "session: weights into the store", session.TrainingSession._init_state)
    session.release_free_memory = _timed(  # type: ignore[attr-defined]
        "session: release freed memory (gc)", session.release_free_memory)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--loss", default="loss")
    parser.add_argument("--optimizer", default="adamw", choices=["sgd", "adam", "adamw", "lamb"])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    _install()
    from gradgraph import TrainingConfig, TrainingSession
    from passes.optimizer import config_type

    for run in range(args.runs):
        TIMES.clear()
        start = time.perf_counter()
        made = TrainingSession(args.model, TrainingConfig(args.loss, config_type(args.optimizer)()),
                               providers=["CPUExecutionProvider"])
        total = time.perf_counter() - start
        print(f"run {run}: setup {total:.2f} s")
        for label, seconds in TIMES.most_common():
            print(f"   {label:<48} {seconds:6.2f}")
        del made


if __name__ == "__main__":
    main()
