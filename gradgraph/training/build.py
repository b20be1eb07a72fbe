"""The training build: a declared pipeline of passes from a forward model to training graphs.

``training_pipeline(config)`` declares the stages (each an onnx_ir pass list, each stage's
model savable; see :mod:`gradgraph.pipeline`):

1. ``forward``: forward clean-up (inline, recover torch parameters, classify weights, fold,
   expose dropout masks and running statistics, reduce a non-scalar loss, an exported GELU
   formula as one Gelu node (:class:`passes.kernels.GeluFusionPass`), a loss over sliced
   scores taken over all of them: :class:`passes.kernels.WholeScoresLossPass`; the rows a
   cross-entropy ignores not computed: :class:`passes.kernels.ValidRowsLossPass`);
2. ``graph_transforms``: clean-up, cast propagation, mixed precision (those enabled);
   saved at ``debug.graph_save_paths.model_after_graph_transforms_path``;
3. ``gradient``: the loss scale (fp16), the gradient graph, then the trained set: gradient
   outputs of weights not trained are dropped;
4. ``recompute``: recompute under the configured patterns / memory budget; saved at
   ``model_with_gradient_graph_path``;
5. ``training``: held tensors become inputs, the optimizer is added, ops onnxruntime runs
   slowly are written in their fast equivalent form (:mod:`passes.kernels`); saved at
   ``model_with_training_graph_path``. onnxruntime's own optimized graph is the session's
   fifth file (``model_with_training_graph_after_optimization_path``).

Stages find what earlier ones made through the IR (:mod:`passes.marks`): gradient outputs by
their ``gradient_of`` mark, roles of nodes by their stage mark.

``build_training_artifacts(model, config)`` returns the ``train`` graph (forward + gradient +
(accumulation) + clipping + optimizer; every held tensor ``X`` is a graph input with an output
``X.out`` where it changes), the ``accumulate`` graph (only with ``accumulation_steps > 1``:
the training stage without the update) and the ``eval`` graph (the transformed forward graph,
Dropout off and BatchNormalization in inference mode, weights as inputs).

``inference_model(artifacts, weights)`` bakes given weights back into the eval graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx_ir.passes import InPlacePass, PassBase, PassResult

from gradgraph.io import load_model, model_proto, staged_folder
from gradgraph.pipeline import Pipeline, Stage, StageReport, is_stage_file
from gradgraph.runtime.compat import provider_names
from gradgraph.training.options import TrainingConfig
from gradgraph.validate import check_names, close_matches, unknown_names
from passes.autodiff import GradientError, GradientOptions
from passes.autodiff.gradient_pass import GradientPass
from passes.exports import KIND_KEY, WeightKind
from passes.exports.classify import running_stat_names
from passes.exports.signature import torch_parameter_names
from passes.forward.eval_mode import EvalModePass
from passes.forward.expose_running_stats import ExposeRunningStatsPass
from passes.forward.params_to_inputs import ParamsToInputsPass
from passes.forward.prepare import PrepareForGradientPass
from passes.forward.reduce_loss import ReduceLossPass
from passes.kernels import (
    DecomposeTrainingBatchNormPass,
    GeluFusionPass,
    ValidRowsLossPass,
    WholeScoresLossPass,
    kernel_passes,
)
from passes.marks import HELD_KEY, gradient_outputs
from passes.optimizer import resolve
from passes.optimizer.loss_scale import LossScalePass
from passes.optimizer.optimizer_pass import OptimizerPass

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
# Where each reference graph_save_path is written: after this stage.
SAVE_PATH_STAGES = {
    "model_after_graph_transforms_path": "graph_transforms",
    "model_with_gradient_graph_path": "recompute",
    "model_with_training_graph_path": "training",
}


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
    # What each stage changed, in order (for summaries).
    reports: list[StageReport] = dataclasses.field(default_factory=list)
    # The model after the recompute stage (forward + backward), for activation analyses; its
    # tensors are the source model's (shared, never copied into a protobuf).
    gradient_ir: ir.Model | None = None
    # (known bytes, tensors of symbolic size) the backward kept before recompute (when on).
    stash_before_recompute: tuple[int, int] | None = None

    @property
    def gradient(self) -> onnx.ModelProto | None:
        """``gradient_ir`` as a self-contained ModelProto (built on each call: the weights are
        copied into it; under 2 GiB only)."""
        return None if self.gradient_ir is None else model_proto(self.gradient_ir)

    @property
    def params(self) -> list[str]:
        """Every held model tensor: trained, frozen and running statistics."""
        return self.trained + self.frozen + self.buffers


class TrainedSetPass(InPlacePass):
    """Decide the held tensors from the gradient outputs and the weight marks.

    1. trained: values with a gradient output, minus ``excluded`` and the running statistics
       (a BatchNormalization input "reaches" the loss, but BatchNormalization updates it);
       gradient outputs of the others are dropped;
    2. frozen: float initializers that are neither trained, statistics nor exporter constants;
    3. each is marked on its initializer (``gradgraph.held``); the lists are also kept on the
       pass (``trained``, ``frozen``, ``buffers``).
    """

    def __init__(self, excluded: set[str], suffix: str) -> None:
        super().__init__()
        self.excluded, self.suffix = excluded, suffix
        self.trained: list[str] = []
        self.frozen: list[str] = []
        self.buffers: list[str] = []

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        outputs = {v.name for v in graph.outputs}
        stats = running_stat_names(graph)
        self.buffers = sorted(name for name in graph.initializers if name + self.suffix in outputs
                              and name in stats)
        gradients = gradient_outputs(graph)
        self.trained = sorted(w for w in gradients if w not in self.excluded and w not in self.buffers)
        if not self.trained:
            raise GradientError("no weight is left to train (check weights_to_train / "
                                "weights_not_to_train)")
        modified = False
        for w, grad in gradients.items():
            if w not in self.trained:
                graph.outputs.remove(grad)
                modified = True
        self.frozen = [name for name, v in graph.initializers.items() if v.dtype in _FLOATS
                       and v.metadata_props.get(KIND_KEY) != WeightKind.CONSTANT.value
                       and name not in self.trained and name not in self.buffers]
        for kind, names in (("trained", self.trained), ("frozen", self.frozen),
                            ("buffer", self.buffers)):
            for name in names:
                props = graph.initializers[name].metadata_props
                modified = modified or props.get(HELD_KEY) != kind
                props[HELD_KEY] = kind
        common.RemoveUnusedNodesPass()(model)
        return PassResult(model, modified)


class FinishPass(InPlacePass):
    """Drop what no output needs and sort the nodes (the last pass of a runnable graph)."""

    def call(self, model: ir.Model) -> PassResult:
        removed = common.RemoveUnusedNodesPass()(model).modified
        common.TopologicalSortPass()(model)
        return PassResult(model, removed)


def kernel_support(providers: Sequence[Any] | None, dtype: str) -> Any:
    """Which (op, domain, dtype) the session's providers run, forward and gradient (see
    :class:`gradgraph.runtime.kernels.TrainingKernelProbe`): the precision passes keep the others in
    fp32 (``None``: assume all, as on a GPU build).

    onnxruntime's CPU provider has bf16 kernels for a handful of forward ops and none for the
    gradient ops they lead to (ReduceMean, Mul, ...), so on CPU bf16 is emulated throughout:
    values rounded to bf16, arithmetic in fp32.
    """
    if not providers:
        return None
    names = provider_names(providers)
    import onnxruntime as ort

    if not any(name in ort.get_available_providers() for name in names):
        return None  # none can be probed here (graphs made for CUDA on a CPU machine): assume all
    if dtype == "bfloat16" and names[0] == "CPUExecutionProvider":
        return lambda op_type, domain, value_type: False
    from gradgraph.runtime.kernels import training_kernel_predicate

    return training_kernel_predicate(names)


def _graph_transforms(config: TrainingConfig, providers: Sequence[Any] | None) -> list[PassBase]:
    gt, mp = config.graph_transformer, config.mixed_precision
    passes: list[PassBase] = []
    if gt.cleanup:
        from passes.cleanup import CleanupPass

        passes.append(CleanupPass())
    low = mp.dtype or "float16"
    supported = kernel_support(providers, low)
    if mp.dtype is not None:
        from passes.precision import MixedPrecisionOptions, MixedPrecisionPass

        passes.append(MixedPrecisionPass(MixedPrecisionOptions(dtype=mp.dtype, loss=config.loss),
                                         supported=supported))
    if gt.propagate_cast_ops.enabled:
        from passes.precision import CastPropagationPass

        cast = gt.propagate_cast_ops
        low_type = ir.DataType.BFLOAT16 if low == "bfloat16" else ir.DataType.FLOAT16
        passes.append(CastPropagationPass(int(cast.strategy), cast.level, tuple(cast.allow),
                                          low=low_type, supported=supported))
    return passes


def training_pipeline(config: TrainingConfig, wanted: list[str] | None,
                      trained_set: TrainedSetPass, apply: bool = True,
                      providers: Sequence[Any] | None = None) -> Pipeline:
    """The declared stages of the training build (see the module docstring)."""
    names, paths = config.names, config.debug.graph_save_paths
    forward: list[PassBase] = [PrepareForGradientPass(strict_parameters=config.weights_to_train is None,
                                                      frozen=frozenset(config.weights_not_to_train)),
                               ReduceLossPass(config.loss, config.loss_reduction),
                               GeluFusionPass(contrib=config.graph_transformer.contrib_ops,
                                              keep=config.weights_to_train or ()),
                               WholeScoresLossPass(), ValidRowsLossPass(),
                               ExposeRunningStatsPass(names.out_suffix)]
    gradient: list[PassBase] = []
    if provider_names(providers)[:1] == ["CUDAExecutionProvider"]:
        # onnxruntime's CUDA kernel refuses training-mode BatchNormalization at opset >= 14; here,
        # after the graph transforms, whose model the eval graph is made from (inference BatchNorm)
        gradient.append(DecomposeTrainingBatchNormPass())
    loss = config.loss
    if config.mixed_precision.scales_loss:
        gradient.append(LossScalePass(config.loss, names.loss_scale, names.scaled_loss))
        loss = names.scaled_loss
    gradient += [GradientPass(loss, wanted, GradientOptions()), trained_set]
    recompute: list[PassBase] = []
    if config.graph_transformer.recompute is not None:
        from passes.recompute import RecomputePass

        recompute.append(RecomputePass(config.graph_transformer.recompute))
    return Pipeline([
        Stage("forward", forward),
        Stage("graph_transforms", _graph_transforms(config, providers),
              paths.model_after_graph_transforms_path),
        Stage("gradient", gradient),
        Stage("recompute", recompute, paths.model_with_gradient_graph_path),
        training_stage(config, apply),
    ])


def training_stage(config: TrainingConfig, apply: bool) -> Stage:
    """Held tensors become inputs; the optimizer (``apply``) or only accumulation is added."""
    passes = [ParamsToInputsPass(), _OptimizerFromIR(config, apply), *kernel_passes(), FinishPass()]
    if apply:
        return Stage("training", passes, config.debug.graph_save_paths.model_with_training_graph_path)
    return Stage("accumulate", passes)


class _OptimizerFromIR(InPlacePass):
    """OptimizerPass over the gradient outputs the gradient stage marked (the loss output is
    checked for finiteness with the update)."""

    def __init__(self, config: TrainingConfig, apply: bool) -> None:
        super().__init__()
        self.config, self.apply = config, apply

    def call(self, model: ir.Model) -> PassResult:
        gradients = gradient_outputs(model.graph)
        loss = next((v for v in model.graph.outputs if v.name == self.config.loss), None)
        return OptimizerPass(self.config.optimizer_settings(), gradients, apply=self.apply,
                             loss=loss)(model)


def _check_update(config: TrainingConfig) -> None:
    """Numbers no update could use: refused here, not silently never applied."""
    steps, clip = config.update.accumulation_steps, config.update.max_grad_norm
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise GradientError(f"accumulation_steps must be a positive integer (micro-steps per "
                            f"optimizer step); got {steps!r}")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float, np.number))
                             or not math.isfinite(clip) or clip <= 0):
        raise GradientError(f"max_grad_norm must be a finite number > 0, or None for no clipping; "
                            f"got {clip!r}")


def symbolic_dims(model: ir.Model) -> set[str]:
    """The names of the symbolic dimensions of the model's values."""
    values = [*model.graph.inputs, *model.graph.outputs,
              *(o for n in ir.traversal.RecursiveGraphIterator(model.graph) for o in n.outputs)]
    return {str(d.value) for v in values if v.shape is not None for d in v.shape
            if isinstance(d, ir.SymbolicDim) and d.value}


def check_dim_names(names: Sequence[str], known: set[str], what: str) -> None:
    """Dimension sizes given by name (``what``: the option) for the symbolic dimensions ``known``.

    A name the model lacks is a typo (``GradientError``, with close matches) when the model has
    symbolic dimensions; when every dimension is a number it sizes nothing and is only a warning.
    """
    for name in names:
        if name in known:
            continue
        if not known:
            warnings.warn(f"{what}: {name!r} is ignored: every dimension of the model is a number",
                          UserWarning, stacklevel=3)
            continue
        raise GradientError(f"{what}: the model has no symbolic dimension {name!r}"
                            f"{close_matches(name, known)} (its symbolic dimensions: "
                            f"{', '.join(sorted(known))})")


def _check_pass_names(config: TrainingConfig, model: ir.Model) -> None:
    """Names the pass options give that the model lacks: a symbolic dimension is an error, an
    op type of the cast allow list a warning (an op may appear only once functions are inlined)."""
    recompute = config.graph_transformer.recompute
    if recompute is not None and recompute.dims:
        check_dim_names([name for name, _ in recompute.dims], symbolic_dims(model), "recompute dims")
    cast = config.graph_transformer.propagate_cast_ops
    if cast.enabled and cast.allow:
        ops = {n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph)}
        ops |= {n.op_type for f in model.functions.values() for n in f}
        for op in cast.allow:
            if op not in ops:
                warnings.warn(f"propagate_cast_ops allow list: no node of the model is a {op!r}"
                              f"{close_matches(op, ops)}; it allows nothing (op types are "
                              "case-sensitive)", UserWarning, stacklevel=4)


def _warn_unmatched_groups(config: TrainingConfig, trained: Sequence[str]) -> None:
    """A group that matches no trained weight warns (one that names its weight exactly, from
    TrainingParameters' optimizer maps, is refused); a weight two groups match warns that the
    first one applies."""
    groups = config.update.groups
    for index, group in enumerate(groups):
        if not any(group.matches(w) for w in trained):
            source, weight = getattr(group, "source", ""), getattr(group, "weight", "")
            if source and weight:
                raise GradientError(f"{source} names {weight!r}, which is no trained weight"
                                    f"{close_matches(weight, trained)}; trained weights: {_few(trained)}")
            warnings.warn(f"parameter group {index} {list(group.patterns)} matches no trained weight; its "
                          f"settings apply to nothing (trained weights: {_few(trained)})", UserWarning,
                          stacklevel=3)
    overlaps: dict[tuple[int, int], list[str]] = {}
    for weight in trained:
        hits = [i for i, g in enumerate(groups) if g.matches(weight)]
        if len(hits) > 1:
            overlaps.setdefault((hits[0], hits[1]), []).append(weight)
    for (first, second), weights in overlaps.items():
        warnings.warn(f"weights {_few(weights)} match parameter group {first} "
                      f"{list(groups[first].patterns)} and group {second} "
                      f"{list(groups[second].patterns)}: the first group that matches applies "
                      f"(group {first}'s {dict(groups[first].overrides)}, lr_scale "
                      f"{groups[first].lr_scale}); group {second} is ignored for them",
                      UserWarning, stacklevel=3)


def _few(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _check_config(config: TrainingConfig, model: ir.Model) -> list[str] | None:
    _check_update(config)
    check_names("weights_not_to_train", config.weights_not_to_train)
    if config.weights_to_train is not None:
        check_names("weights_to_train", config.weights_to_train)
    known = set(model.graph.initializers) | {v.name for v in model.graph.inputs if v.name}
    known |= torch_parameter_names(model)  # parameters the export folded (recovered, or frozen)
    for what, listed in (("weights_not_to_train", config.weights_not_to_train),
                         ("weights_to_train", config.weights_to_train or ())):
        unknown_names(what, listed, known)
    _check_pass_names(config, model)
    excluded = set(config.weights_not_to_train)
    return None if config.weights_to_train is None else [
        w for w in config.weights_to_train if w not in excluded]


def build_training_artifacts(model: onnx.ModelProto | ir.Model | str | os.PathLike | bytes,
                             config: TrainingConfig, *,
                             save_stages: str | os.PathLike | None = None,
                             providers: Sequence[Any] | None = None) -> TrainingArtifacts:
    """Build the training, accumulation and eval models (see the module docstring).

    ``providers``: the onnxruntime execution providers the graphs will run on; mixed precision
    and cast propagation keep ops those lack a low-precision kernel for in fp32 (see
    :func:`kernel_support`). None: every op is assumed to have one.

    ``save_stages`` (else ``config.debug.save_stages``): a folder for every stage's model,
    ``NN_<stage>.onnx``. They appear there all together once the whole build succeeded; a
    failing build leaves the folder as it was (see :func:`gradgraph.io.staged_folder`). In a
    folder that exists, the stage files of an earlier build (``NN_<name>.onnx``) are replaced
    by this build's (ones it does not write are removed) and other files are left alone.
    """
    source = load_model(model, lazy=True)  # external data read once, into the session's buffers
    wanted = _check_config(config, source)
    save_dir = save_stages if save_stages is not None else config.debug.save_stages
    trained_set = TrainedSetPass(set(config.weights_not_to_train), config.names.out_suffix)
    pipeline = training_pipeline(config, wanted, trained_set, providers=providers)
    kept: dict[str, ir.Model] = {}
    before: list[tuple[int, int]] = []
    feeds: list[str] = []
    outputs: list[str] = []

    def keep(stage: Stage, m: ir.Model) -> None:
        if stage.name == "forward":
            feeds.extend(v.name or "" for v in m.graph.inputs if not v.is_initializer())
            state = {n + config.names.out_suffix for n in m.graph.initializers}
            outputs.extend(v.name or "" for v in m.graph.outputs if v.name not in state)
            if config.loss not in outputs:
                raise GradientError(f"loss {config.loss!r} is not a graph output (outputs: {outputs})")
        if stage.name == "graph_transforms":  # a copy of the graph, not of the weights
            kept[stage.name] = m.clone(deep_copy=True)
        if stage.name == "recompute":  # the last stage of the front: its model itself
            kept[stage.name] = m
        if stage.name == "gradient" and config.graph_transformer.recompute is not None:
            from passes.recompute import total_stash_bytes

            before.append(total_stash_bytes(m, dict(config.graph_transformer.recompute.dims)))

    stages, training = pipeline.stages[:-1], pipeline.stages[-1]
    # The stage files appear in save_dir together once the whole build succeeded, or not at all.
    staging: contextlib.AbstractContextManager[Path | None] = (
        staged_folder(save_dir, replaces=is_stage_file) if save_dir is not None
        else contextlib.nullcontext())
    with staging as folder:
        front = Pipeline(stages)
        front.run(source, save_dir=folder, on_stage=keep)
        reports = list(front.reports)
        _warn_unmatched_groups(config, trained_set.trained)
        params = trained_set.trained + trained_set.frozen + trained_set.buffers

        def variant(stage: Stage, index: int) -> onnx.ModelProto:
            run = Pipeline([stage])
            result = run.run(kept["recompute"].clone(deep_copy=True), save_dir=folder, first_index=index)
            reports.extend(run.reports)
            return model_proto(result)  # the weights are inputs now: what stays is small

        train = variant(training, len(stages))
        to_inputs = training.passes[0]
        assert isinstance(to_inputs, ParamsToInputsPass)
        accumulate = None
        if config.update.accumulation_steps > 1:
            accumulate = variant(training_stage(config, apply=False), len(stages) + 1)
        eval_stage = Stage("eval", [EvalModePass(), ParamsToInputsPass(params), *kernel_passes(gradient=False),
                                    FinishPass()])
        eval_run = Pipeline([eval_stage])
        eval_model = model_proto(eval_run.run(kept.pop("graph_transforms"), save_dir=folder,
                                              first_index=len(stages) + 2))
        reports.extend(eval_run.reports)
    states = {w: resolve(config.optimizer, config.update.groups, w)[0].state_names()
              for w in trained_set.trained}
    return TrainingArtifacts(train, accumulate, eval_model, config, trained_set.trained,
                             trained_set.frozen, trained_set.buffers, to_inputs.values, states,
                             feeds, outputs, reports, kept["recompute"], before[0] if before else None)


def inference_ir(artifacts: TrainingArtifacts, weights: Mapping[str, np.ndarray],
                 keep_loss: bool = True) -> ir.Model:
    """The eval model with ``weights`` (all of ``artifacts.params``) as initializers again; the
    arrays are wrapped, not copied (save the model before they change).

    ``keep_loss=False``: when the model has outputs besides the loss, the loss and what only
    it reads (its nodes, and inputs such as the labels) are removed: a model for inference.
    A model whose only output is the loss keeps it (and the inputs it needs).
    """
    missing = sorted(set(artifacts.params) - set(weights))
    if missing:
        raise KeyError(f"inference_model needs values for {missing}")
    model = ir.from_proto(artifacts.eval)
    graph = model.graph
    loss = next((o for o in graph.outputs if o.name == artifacts.config.loss), None)
    if not keep_loss and loss is not None and len(graph.outputs) > 1:
        read = [v for v in graph.inputs if v.uses()]
        graph.outputs.remove(loss)
        common.RemoveUnusedNodesPass()(model)
        for value in read:  # inputs only the loss read (labels, and weights of the loss alone)
            if not value.uses() and value not in graph.outputs:
                graph.inputs.remove(value)
    params = set(artifacts.params)
    for value in [v for v in graph.inputs if v.name in params]:
        graph.inputs.remove(value)
        value.const_value = ir.Tensor(np.asarray(weights[value.name or ""]), name=value.name)
        graph.register_initializer(value)
    return model


def inference_model(artifacts: TrainingArtifacts, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The eval model with ``weights`` (all of ``artifacts.params``) as initializers again."""
    return model_proto(inference_ir(artifacts, weights))


def save_path_of(config: TrainingConfig, stage: str) -> Path | None:
    """Where ``stage``'s model is written by ``debug.graph_save_paths`` (None: nowhere)."""
    paths = config.debug.graph_save_paths
    for field, name in SAVE_PATH_STAGES.items():
        if name == stage and getattr(paths, field):
            return Path(getattr(paths, field))
    return None


def gradient_model(artifacts: TrainingArtifacts) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The forward and gradient graph without the optimizer (data-parallel training runs the
    update itself once the gradients are all-reduced): held tensors are inputs, outputs are the
    model's, the running-statistics updates and one gradient per trained weight.

    Returns the model and ``{weight: gradient output name}``.
    """
    if artifacts.gradient_ir is None:
        raise GradientError("the artifacts hold no gradient-stage model")
    config = artifacts.config
    update = dataclasses.replace(config.update, accumulation_steps=1, keep_gradient_outputs=True,
                                 max_grad_norm=None)
    stage = training_stage(dataclasses.replace(config, update=update), apply=False)
    model = artifacts.gradient_ir.clone(deep_copy=True)
    grads = {w: v.name or "" for w, v in gradient_outputs(model.graph).items() if w in artifacts.trained}
    model = Pipeline([stage]).run(model)
    return model_proto(model), grads


def apply_model(artifacts: TrainingArtifacts, weights: Sequence[str]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The optimizer update of ``weights`` alone, their gradients fed as inputs ``<w>.grad_in``
    (already averaged and clipped by the caller): held inputs are the weights, their state and
    the step counter.

    Returns the model and ``{weight: gradient input name}``.
    """
    config = artifacts.config
    train = artifacts.train
    opset = next((o.version for o in train.opset_import if o.domain in ("", "ai.onnx")), 18)
    graph = ir.Graph([], [], nodes=[], opset_imports={"": opset}, name="apply")
    grads, names = {}, {}
    for w in weights:
        array = artifacts.initial[w]
        dtype = ir.DataType.from_numpy(array.dtype)
        value = ir.Value(name=w, type=ir.TensorType(dtype), shape=ir.Shape(array.shape))
        grad = ir.Value(name=w + ".grad_in", type=ir.TensorType(dtype), shape=ir.Shape(array.shape))
        graph.inputs.extend([value, grad])
        grads[w], names[w] = grad, grad.name or ""
    model = ir.Model(graph, ir_version=train.ir_version)
    update = dataclasses.replace(config.update, accumulation_steps=1, max_grad_norm=None,
                                 keep_gradient_outputs=False)
    settings = dataclasses.replace(config.optimizer_settings(), update=update)
    OptimizerPass(settings, grads, apply=True)(model)
    FinishPass()(model)
    return ir.to_proto(model), names
