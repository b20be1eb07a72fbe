"""The training build as a declared pipeline: stages, node marks, debug graphs, options."""

from __future__ import annotations

import collections
from pathlib import Path

import onnx
import pytest
import torch
from _training_models import MLP, export_training, mlp_batches

from gradgraph import (
    GraphSavePaths,
    TrainingConfig,
    TrainingParameters,
    TrainingSession,
    UpdateOptions,
    build_training_artifacts,
)
from gradgraph.training.build import training_pipeline
from gradgraph.training.options import DebugOptions
from passes.marks import GRADIENT_OF_KEY, HELD_KEY, STAGE_KEY
from passes.optimizer import AdamWConfig, SGDConfig

CPU = ["CPUExecutionProvider"]
STAGES = ["forward", "graph_transforms", "gradient", "recompute", "training"]


@pytest.fixture(scope="module")
def mlp_model() -> bytes:
    torch.manual_seed(0)
    return export_training(MLP(), (torch.zeros(8, 6), torch.zeros(8, dtype=torch.long)), ["x", "y"])


def _roles(model: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(next((p.value for p in n.metadata_props if p.key == STAGE_KEY), "")
                               for n in model.graph.node)


def test_declared_stages_in_order() -> None:
    from gradgraph.training.build import TrainedSetPass

    pipeline = training_pipeline(TrainingConfig("loss"), None, TrainedSetPass(set(), ".out"))
    assert [s.name for s in pipeline.stages] == STAGES


def test_every_stage_saved_and_valid(mlp_model: bytes, tmp_path: Path) -> None:
    config = TrainingConfig("loss", AdamWConfig(), update=UpdateOptions(accumulation_steps=2))
    art = build_training_artifacts(mlp_model, config, save_stages=tmp_path)
    saved = sorted(p.name for p in tmp_path.glob("*.onnx"))
    assert [name[3:-5] for name in saved] == STAGES + ["accumulate", "eval"]
    for path in tmp_path.glob("*.onnx"):
        onnx.checker.check_model(onnx.load(path), full_check=True)
    assert [r.name for r in art.reports] == STAGES + ["accumulate", "eval"]
    gradient = next(r for r in art.reports if r.name == "gradient")
    assert gradient.modified and sum(gradient.after.values()) > sum(gradient.before.values())


def test_nodes_carry_their_role(mlp_model: bytes) -> None:
    art = build_training_artifacts(mlp_model, TrainingConfig("loss", SGDConfig()))
    roles = _roles(art.train)
    assert "" not in roles, "every node of a training graph has a role"
    assert roles["forward"] and roles["backward"] and roles["optimizer"]
    # each backward node made by a rule names the forward node it differentiates
    forward_names = {n.name for n in art.train.graph.node
                     if any(p.key == STAGE_KEY and p.value == "forward" for p in n.metadata_props)}
    grad_of = {p.value for n in art.train.graph.node for p in n.metadata_props
               if p.key == "gradgraph.grad_of"}
    assert grad_of and grad_of <= forward_names
    # the gradient stage's outputs carry the name they differentiate; held tensors their kind
    assert art.gradient is not None
    marked = {p.value for o in art.gradient.graph.output for p in o.metadata_props
              if p.key == GRADIENT_OF_KEY}
    assert marked == set(art.trained)
    # onnx_ir keeps a value's metadata in value_info
    held = {i.name: p.value for i in art.gradient.graph.value_info for p in i.metadata_props
            if p.key == HELD_KEY}
    assert {n for n, k in held.items() if k == "trained"} == set(art.trained)


def _losses(model: bytes, config: TrainingConfig | TrainingParameters, steps: int = 4) -> list[float]:
    session = TrainingSession(model, config, providers=CPU)
    return [session.train_step(f, lr=0.05) for f in mlp_batches(steps)]


def test_graph_save_paths_write_files_and_train_identically(mlp_model: bytes, tmp_path: Path) -> None:
    params = TrainingParameters()
    params.loss_output_name = "loss"
    params.training_optimizer_name = "SGDOptimizer"
    names = ["model_after_graph_transforms_path", "model_with_gradient_graph_path",
             "model_with_training_graph_path", "model_with_training_graph_after_optimization_path"]
    for name in names:
        setattr(params, name, str(tmp_path / f"{name}.onnx"))
    plain = TrainingParameters()
    plain.loss_output_name = "loss"
    plain.training_optimizer_name = "SGDOptimizer"
    assert _losses(mlp_model, params) == _losses(mlp_model, plain)
    for name in names:
        model = onnx.load(tmp_path / f"{name}.onnx")
        assert len(model.graph.node) > 0
    training = onnx.load(tmp_path / "model_with_training_graph_path.onnx")
    assert "optimizer" in _roles(training)
    gradient = onnx.load(tmp_path / "model_with_gradient_graph_path.onnx")
    assert "backward" in _roles(gradient) and "optimizer" not in _roles(gradient)
    transformed = onnx.load(tmp_path / "model_after_graph_transforms_path.onnx")
    assert "backward" not in _roles(transformed)


def test_graph_save_paths_on_the_config(mlp_model: bytes, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "training.onnx"
    config = TrainingConfig("loss", SGDConfig(), debug=DebugOptions(GraphSavePaths(
        model_with_training_graph_path=str(path))))
    art = build_training_artifacts(mlp_model, config)
    saved = onnx.load(path)
    assert [n.op_type for n in saved.graph.node] == [n.op_type for n in art.train.graph.node]


def test_unknown_cast_strategy_is_named() -> None:
    params = TrainingParameters()
    params.loss_output_name = "loss"
    params.propagate_cast_ops_level = 1
    params.propagate_cast_ops_strategy = "FLOOD"
    with pytest.raises(ValueError, match="propagate_cast_ops_strategy.*FLOOD_FILL"):
        params.to_config()


def test_loss_scale_without_mixed_precision_is_refused() -> None:
    params = TrainingParameters()
    params.loss_output_name = "loss"
    params.loss_scale = 128.0
    with pytest.raises(ValueError, match="use_mixed_precision"):
        params.to_config()


def test_gradient_and_optimizer_passes_are_idempotent(mlp_model: bytes) -> None:
    """A second GradientPass / OptimizerPass on their own result changes nothing."""
    import onnx_ir as ir

    from passes.autodiff.gradient_pass import GradientPass
    from passes.forward.params_to_inputs import ParamsToInputsPass
    from passes.forward.prepare import PrepareForGradientPass
    from passes.marks import gradient_outputs
    from passes.optimizer.optimizer_pass import OptimizerPass, OptimizerSettings

    model = PrepareForGradientPass()(ir.from_proto(onnx.load_from_string(mlp_model))).model
    first = GradientPass("loss")
    assert first(model).modified
    count = len(model.graph)
    again = GradientPass("loss")
    assert not again(model).modified and len(model.graph) == count
    assert again.gradients == first.gradients
    ParamsToInputsPass(list(first.gradients))(model)
    settings = OptimizerSettings(SGDConfig())
    assert OptimizerPass(settings, gradient_outputs(model.graph))(model).modified
    count, inputs = len(model.graph), len(model.graph.inputs)
    assert not OptimizerPass(settings, {})(model).modified
    assert (len(model.graph), len(model.graph.inputs)) == (count, inputs)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_gradient_of_another_loss_is_still_built() -> None:
    """Idempotence is per loss: a graph holding d a / d w still gets d b / d w."""
    import onnx_ir as ir

    from passes.autodiff.gradient_pass import GradientPass

    model = ir.from_onnx_text('''<ir_version: 9, opset_import: ["" : 18]>
g (float[3] x) => (float a, float b) <float[3] w = {1, 2, 3}> {
 y = Mul (x, w)
 a = ReduceSum <keepdims=0> (y)
 t = Tanh (y)
 b = ReduceSum <keepdims=0> (t)
}''')
    assert GradientPass("a", ["w"])(model).modified
    second = GradientPass("b", ["w"])
    assert second(model).modified
    assert second.gradients["w"].name == "w_grad_1"
