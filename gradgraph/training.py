"""Training, eval and inference models from one forward model.

``build_training_artifacts(model, config)`` trains, by default, the model's parameters (see
``passes.exports.classify``: a torch export's PARAMETERs, else float initializers that are not
scalars, masks or BatchNorm statistics); buffers and parameters left out are held fixed,
exporter constants stay initializers. It returns:

1. ``train``: forward + gradient + (accumulation) + clipping + optimizer; every held tensor
   ``X`` (weights, running statistics, optimizer state, ``step``) is a graph input with an
   output ``X.out`` where it changes;
2. ``accumulate`` (only with ``accumulation_steps > 1``): forward + gradient, adding the
   gradients into ``<w>_grad.accumulation.buffer`` (no optimizer);
3. ``eval``: the forward graph with Dropout off and BatchNormalization in inference mode,
   weights as inputs, no gradient.

``inference_model(artifacts, weights)`` bakes given weights back into the eval graph.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from gradgraph.io import load_model, save_model
from gradgraph.validate import check_names, require_scalar_loss, unknown_names
from passes.autodiff import GradientError, GradientOptions
from passes.eval_mode import EvalModePass
from passes.exports import KIND_KEY, WeightKind
from passes.expose_running_stats import ExposeRunningStatsPass
from passes.gradient import GradientPass
from passes.optimizer_pass import OptimizerPass, OptimizerSettings, TrainingNames
from passes.optimizers import AdamWConfig, ParamGroup, resolve
from passes.params_to_inputs import ParamsToInputsPass
from passes.prepare import PrepareForGradientPass

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """What to train and how. ``weights_to_train=None``: every float initializer reaching the loss."""

    loss: str
    optimizer: Any = AdamWConfig()
    weights_to_train: tuple[str, ...] | None = None
    weights_not_to_train: tuple[str, ...] = ()
    groups: tuple[ParamGroup, ...] = ()
    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    clip_eps: float = 1e-6
    keep_gradient_outputs: bool = False
    # A non-scalar loss is refused unless reduced: "sum" or "mean" of its elements.
    loss_reduction: str | None = None
    # A step whose loss, weights or optimizer state turn NaN/inf is skipped (state untouched).
    skip_non_finite: bool = True
    names: TrainingNames = TrainingNames()

    def optimizer_settings(self) -> OptimizerSettings:
        """The optimizer-pass settings: the fields this config shares with OptimizerSettings."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(OptimizerSettings)}
        return OptimizerSettings(**{**shared, "groups": tuple(self.groups)})


@dataclasses.dataclass
class TrainingArtifacts:
    train: onnx.ModelProto
    accumulate: onnx.ModelProto | None
    eval: onnx.ModelProto
    config: TrainingConfig
    trained: list[str]
    frozen: list[str]
    buffers: list[str]
    initial: dict[str, np.ndarray]
    optimizer_state: dict[str, tuple[str, ...]]
    feeds: list[str]
    outputs: list[str]

    @property
    def params(self) -> list[str]:
        """Every held model tensor: trained, frozen and running statistics."""
        return self.trained + self.frozen + self.buffers


def _finish(model: ir.Model) -> onnx.ModelProto:
    common.RemoveUnusedNodesPass()(model)
    common.TopologicalSortPass()(model)
    return ir.to_proto(model)


def _gradients_by_name(model: ir.Model, weights: list[str]) -> dict[str, ir.Value]:
    outputs = {v.name: v for v in model.graph.outputs}
    return {w: outputs[f"{w}_grad"] for w in weights}


def _save(stage_dir: str | os.PathLike | None, name: str, model: onnx.ModelProto | ir.Model) -> None:
    if stage_dir is not None:
        save_model(model, Path(stage_dir) / f"{name}.onnx")


def build_training_artifacts(model: onnx.ModelProto | str | os.PathLike | bytes,
                             config: TrainingConfig, *,
                             save_stages: str | os.PathLike | None = None) -> TrainingArtifacts:
    """Build the training, accumulation and eval models (see the module docstring)."""
    check_names("weights_not_to_train", config.weights_not_to_train)
    if config.weights_to_train is not None:
        check_names("weights_to_train", config.weights_to_train)
    strict = config.weights_to_train is None
    forward = PrepareForGradientPass(strict_parameters=strict)(load_model(model)).model
    require_scalar_loss(forward, config.loss, config.loss_reduction)
    _save(save_stages, "00_forward", forward)
    feeds = [v.name or "" for v in forward.graph.inputs if not v.is_initializer()]
    outputs = [v.name or "" for v in forward.graph.outputs]
    if config.loss not in outputs:
        raise GradientError(f"loss {config.loss!r} is not a graph output (outputs: {outputs})")
    forward_proto = ir.to_proto(forward)
    names = config.names

    stats_pass = ExposeRunningStatsPass(names.out_suffix)
    stats_pass(forward)
    buffers = list(stats_pass.stats)
    updated = {v.name for v in stats_pass.stats.values()}
    outputs = [o for o in outputs if o not in updated]  # the model's own outputs, not state
    floats = [name for name, v in forward.graph.initializers.items() if v.dtype in _FLOATS
              and v.metadata_props.get(KIND_KEY) != WeightKind.CONSTANT.value]
    known = set(forward.graph.initializers) | {v.name for v in forward.graph.inputs if v.name}
    for what, listed in (("weights_not_to_train", config.weights_not_to_train),
                         ("weights_to_train", config.weights_to_train or ())):
        unknown_names(what, listed, known)
    excluded = set(config.weights_not_to_train)
    wanted = None if config.weights_to_train is None else [
        w for w in config.weights_to_train if w not in excluded]
    grad_pass = GradientPass(config.loss, wanted, GradientOptions())
    grad_pass(forward)
    # Running statistics are BatchNormalization inputs, so they "reach" the loss, but a
    # training-mode output does not depend on them (zero gradient): BatchNormalization updates
    # them, never the optimizer.
    trained = sorted(w for w in grad_pass.gradients if w not in excluded and w not in buffers)
    if not trained:
        raise GradientError("no weight is left to train (check weights_to_train / weights_not_to_train)")
    for w, grad in grad_pass.gradients.items():  # gradients nobody uses: let _finish prune them
        if w not in trained and grad in forward.graph.outputs:
            forward.graph.outputs.remove(grad)
    # Held but not trained: parameters left out and torch buffers. Exporter constants stay
    # initializers of every graph (onnxruntime may fold them).
    frozen = [w for w in floats if w not in trained and w not in buffers]
    _save(save_stages, "01_gradient", forward)

    params = trained + frozen + buffers
    to_inputs = ParamsToInputsPass(params)
    to_inputs(forward)
    gradient_proto = ir.to_proto(forward)
    settings = config.optimizer_settings()

    def variant(apply: bool) -> onnx.ModelProto:
        m = ir.from_proto(gradient_proto)
        loss = next(v for v in m.graph.outputs if v.name == config.loss)
        OptimizerPass(settings, _gradients_by_name(m, trained), apply=apply, loss=loss)(m)
        return _finish(m)

    train = variant(True)
    accumulate = variant(False) if config.accumulation_steps > 1 else None
    _save(save_stages, "02_training", train)
    if accumulate is not None:
        _save(save_stages, "02_accumulate", accumulate)

    eval_ir = ir.from_proto(forward_proto)
    EvalModePass()(eval_ir)
    ParamsToInputsPass(params)(eval_ir)
    eval_model = _finish(eval_ir)
    _save(save_stages, "02_eval", eval_model)
    states = {w: resolve(config.optimizer, config.groups, w)[0].state_names() for w in trained}
    return TrainingArtifacts(train, accumulate, eval_model, config, trained, frozen, buffers,
                             to_inputs.values, states, feeds, outputs)


def inference_model(artifacts: TrainingArtifacts, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The eval model with ``weights`` (all of ``artifacts.params``) as initializers again."""
    model = onnx.ModelProto()
    model.CopyFrom(artifacts.eval)
    graph = model.graph
    params = set(artifacts.params)
    missing = sorted(params - set(weights))
    if missing:
        raise KeyError(f"inference_model needs values for {missing}")
    kept = [i for i in graph.input if i.name not in params]
    del graph.input[:]
    graph.input.extend(kept)
    for name in artifacts.params:
        graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(weights[name]), name))
    return model
