"""TrainingSession with each recompute and cast-propagation property of TrainingParameters:
recompute trains identically; cast propagation trains within fp16 tolerance; the graphs asked
for are written; `gradgraph build --save-stages` writes every stage and the summary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import gradgraph
from gradgraph.cli.main import main as cli_main

CPU = ["CPUExecutionProvider"]
STEPS = 4
LR = 1e-3
# Recompute may reorder float sums in onnxruntime: losses agree to this relative distance.
RECOMPUTE_RTOL = 1e-6
# Cast propagation computes some ops in fp16: losses agree to this relative distance.
CAST_RTOL = 1e-2


@pytest.fixture(scope="module", params=["bert", "gpt2"])
def tiny(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    """A BERT- or GPT-2-style export in train mode (dropout nodes present, p = 0)."""
    model_zoo = pytest.importorskip("model_zoo")
    path = str(tmp_path_factory.mktemp(request.param) / f"{request.param}.onnx")
    feeds = model_zoo.export_with_feeds(request.param, "legacy", "train_p0", path)
    return path, feeds


def _params(**props: object) -> gradgraph.TrainingParameters:
    params = gradgraph.TrainingParameters()
    params.loss_output_name = "loss"
    params.training_optimizer_name = "AdamOptimizer"
    for key, value in props.items():
        setattr(params, key, value)
    return params


def _losses(path: str, feeds: dict[str, np.ndarray], params: gradgraph.TrainingParameters) -> list[float]:
    session = gradgraph.TrainingSession(path, params, providers=CPU)
    return [session.train_step(feeds, lr=LR) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def baseline(tiny) -> list[float]:
    return _losses(*tiny, _params())


@pytest.mark.parametrize("props", [
    {"gelu_recompute": True},
    {"attn_dropout_recompute": True},
    {"transformer_layer_recompute": True},
    {"transformer_layer_recompute": True, "number_recompute_layers": 1},
    {"recompute_memory_budget": 0},
], ids=["gelu", "attn_dropout", "layers", "layers_1", "planner_min"])
def test_recompute_trains_identically(tiny, baseline, props, tmp_path: Path) -> None:
    path, feeds = tiny
    # GPT-2's gelu is the tanh form, which the gelu pattern does not match (erf form and the
    # Gelu/FastGelu/BiasGelu ops only): nothing to recompute, training unchanged.
    matches = not (props == {"gelu_recompute": True} and "gpt2" in path)
    saved = tmp_path / "gradient.onnx"
    losses = _losses(path, feeds, _params(model_with_gradient_graph_path=str(saved), **props))
    np.testing.assert_allclose(losses, baseline, rtol=RECOMPUTE_RTOL)
    gradient = onnx.load(saved)
    roles = {p.value for n in gradient.graph.node for p in n.metadata_props if p.key == "gradgraph.stage"}
    assert ("recompute" in roles) == matches, f"{props}: recompute clones {sorted(roles)}"


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("strategy", ["INSERT_AND_REDUCE", "FLOOD_FILL"])
def test_cast_propagation_trains_within_fp16_tolerance(tiny, baseline, level, strategy,
                                                      tmp_path: Path) -> None:
    path, feeds = tiny
    saved = tmp_path / "transformed.onnx"
    params = _params(propagate_cast_ops_level=level, propagate_cast_ops_strategy=strategy,
                     propagate_cast_ops_allow=["Transpose", "Reshape"] if level == 0 else [],
                     model_after_graph_transforms_path=str(saved))
    losses = _losses(path, feeds, params)
    np.testing.assert_allclose(losses, baseline, rtol=CAST_RTOL)
    assert saved.exists()
    onnx.checker.check_model(onnx.load(saved), full_check=True)


def test_build_command_writes_stages_and_summary(tiny, tmp_path: Path) -> None:
    path, _ = tiny
    out = tmp_path / "stages"
    code = cli_main(["build", path, "--loss", "loss", "--save-stages", str(out),
                     "--recompute", "transformer_layers", "--dim", "batch=2"])
    assert code == 0
    stages = sorted(p.name[3:-5] for p in out.glob("*.onnx"))
    assert stages == sorted(["forward", "graph_transforms", "gradient", "recompute", "training",
                             "eval"])
    for model in out.glob("*.onnx"):
        onnx.checker.check_model(onnx.load(model), full_check=True)
    summary = (out / "summary.txt").read_text()
    for stage in ("forward", "graph_transforms", "gradient", "recompute", "training", "eval"):
        assert f" {stage} (" in summary
    assert "activations kept for the backward" in summary
    assert "before recompute the backward kept" in summary
    recompute_line = next(line for line in summary.splitlines() if " recompute (" in line)
    assert "changed" in recompute_line and "+" in recompute_line


def test_build_command_option_errors_are_one_line(tiny, tmp_path: Path, capsys) -> None:
    path, _ = tiny
    assert cli_main(["build", path, "--loss", "loss", "--save-stages", str(tmp_path),
                     "--dim", "batch"]) == 2
    assert "--dim 'batch'" in capsys.readouterr().err
    assert cli_main(["build", path, "--loss", "loss", "--save-stages", str(tmp_path),
                     "--memory-budget", "-5"]) == 2
