"""Every pass on exported BERT- and GPT-2-style tiny models (legacy and dynamo exports): outputs
and gradients kept (within each pass's stated tolerance), checker-valid, a second run changes
nothing (tests/pass_harness.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from pass_harness import assert_pass_preserves

from gradgraph.runtime.kernels import training_kernel_predicate
from passes.cleanup import CleanupPass
from passes.precision import (
    CastPropagationPass,
    MixedPrecisionOptions,
    MixedPrecisionPass,
    Strategy,
)
from passes.recompute import RecomputeOptions, RecomputePass

# What the CPU provider runs in fp16, forward and gradient (as the training pipeline asks).
CPU = training_kernel_predicate(["CPUExecutionProvider"])
# (factory, rtol, atol, applied to the gradient graph)
EXACT = (1e-6, 1e-6)
FP16 = (2e-2, 2e-3)  # fp16 compute: relative error of a few ulps of fp16 after accumulation
PASSES: dict[str, tuple[Callable[[], object], tuple[float, float], bool]] = {
    "cleanup": (CleanupPass, EXACT, False),
    "cleanup_on_gradient": (CleanupPass, EXACT, True),
    "cast_flood_fill_1": (lambda: CastPropagationPass(Strategy.FLOOD_FILL, 1, supported=CPU), FP16, False),
    "cast_insert_and_reduce_2": (lambda: CastPropagationPass(Strategy.INSERT_AND_REDUCE, 2, supported=CPU), FP16,
                                 False),
    "mixed_precision_fp16": (lambda: MixedPrecisionPass(MixedPrecisionOptions("float16"), supported=CPU), FP16,
                             False),
    "recompute_layers": (lambda: RecomputePass(RecomputeOptions(transformer_layers=True)), EXACT,
                         True),
    "recompute_attn_dropout": (lambda: RecomputePass(RecomputeOptions(attn_dropout=True)), EXACT,
                               True),
    "recompute_planner": (lambda: RecomputePass(RecomputeOptions(memory_budget=20_000)), EXACT, True),
}


@pytest.fixture(scope="module", params=[("bert", "legacy"), ("gpt2", "legacy"), ("bert", "dynamo")],
                ids=lambda p: "-".join(p))
def export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    model_zoo = pytest.importorskip("model_zoo")
    name, exporter = request.param
    path = str(tmp_path_factory.mktemp(name) / f"{name}.onnx")
    feeds = model_zoo.export_with_feeds(name, exporter, "train_p0", path)
    return onnx.load(path), feeds


@pytest.mark.slow
@pytest.mark.parametrize("which", list(PASSES))
def test_pass_keeps_outputs_and_gradients(export, which: str) -> None:
    model, feeds = export
    factory, (rtol, atol), on_gradient = PASSES[which]
    result = assert_pass_preserves(model, factory, feeds=feeds, rtol=rtol, atol=atol,
                                   on_gradient_graph=on_gradient)
    assert result.compared, "nothing was compared"
