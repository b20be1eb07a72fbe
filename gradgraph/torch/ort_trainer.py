"""The legacy ``onnxruntime.capi.ort_trainer.ORTTrainer``: its signature and step semantics.

``ORTTrainer(model, loss_fn, model_desc, training_optimizer_name, map_optimizer_attributes,
learning_rate_description, device, gradient_accumulation_steps=1, world_rank=0, world_size=1,
use_mixed_precision=False, allreduce_post_accumulation=False, global_step=0,
get_lr_this_step=None, loss_scaler=None, deepspeed_zero_stage=0, enable_grad_norm_clip=True,
frozen_weights=(), _opset_version=14, _enable_internal_postprocess=True, _extra_postprocess=None,
_use_deterministic_compute=False, use_memory_efficient_gradient=False,
run_symbolic_shape_infer=False, enable_adasum=False, optimized_model_filepath='')``

A thin layer over :class:`gradgraph.torch.trainer.ORTTrainer` (the newer API): each argument
becomes that trainer's option, and the steps run its machinery (export, training graph,
session, data parallelism). What the legacy API adds:

1. ``model_desc`` is a :class:`ModelDescription` of :class:`IODescription`; the loss is the
   first output (or the one flagged ``is_loss``). An input's ``dtype`` is checked on each step.
2. ``map_optimizer_attributes(weight_name) -> {attribute: number}`` is called for each trained
   weight: ``alpha``, ``beta``, ``lambda``, ``epsilon``, ``do_bias_correction`` (Adam, LAMB),
   ``ratio_min``, ``ratio_max`` (LAMB) per weight; ``max_norm_clip`` (the global gradient-norm
   threshold, default 1.0) and Adam's ``weight_decay_mode`` must be one value for all weights.
   SGD takes none. Missing attributes take onnxruntime's defaults (those of ``AdamConfig`` /
   ``LambConfig``).
3. ``train_step(*inputs, learning_rate[, loss_scale], fetches=None)``: the learning rate (a
   tensor of shape [1], after the inputs or by ``learning_rate_description``'s name) unless
   ``get_lr_this_step(global_step)`` gives it; with ``use_mixed_precision``, the loss scale after
   it (or as ``loss_scale=`` / ``default_loss_scale_input_name=``) unless ``loss_scaler`` holds
   it. Returns model_desc's outputs (one: itself), or ``fetches``; with mixed precision and no
   ``loss_scaler``, the last micro-step of an accumulation also returns ``all_finite``. A step
   whose gradients are not finite is skipped; ``global_step`` counts the applied updates.
4. ``eval_step(*inputs, fetches=None)``: model_desc's outputs (or ``fetches``) of the eval graph.
5. ``state_dict(include_optimizer_state=True)``: a flat dict (weights, ``<kind>_<weight>``
   optimizer state, the shared step); the module's ``save_checkpoint`` / ``load_checkpoint``
   write and read it (``<prefix>.ort.pt``, one file per rank with ZeRO, merged on load).

Refused by name: ``enable_adasum=True``, ``use_memory_efficient_gradient=True``,
``deepspeed_zero_stage`` above 1. Always on: ``run_symbolic_shape_infer`` (ONNX shape inference
runs on every build). ``IODescription.num_classes`` is descriptive: the reference drew sample
inputs with it; gradgraph exports on the first real batch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from gradgraph.torch import optim
from gradgraph.torch.trainer import IODescription, ModelDescription
from gradgraph.torch.trainer import ORTTrainer as _Trainer
from gradgraph.torch.trainer_options import ORTTrainerOptions
from gradgraph.training.session import TrainingSession
from gradgraph.validate import close_matches

__all__ = ["IODescription", "LossScaler", "ModelDescription", "ORTTrainer", "load_checkpoint", "save_checkpoint"]

# onnxruntime's optimizer ops: the attributes a weight may set, and those one value for all
_PER_WEIGHT = {"SGDOptimizer": (),
               "AdamOptimizer": ("alpha", "beta", "lambda", "epsilon", "do_bias_correction"),
               "LambOptimizer": ("alpha", "beta", "lambda", "epsilon", "ratio_min", "ratio_max",
                                 "do_bias_correction")}
_GLOBAL = {"SGDOptimizer": {}, "AdamOptimizer": {"max_norm_clip": 1.0, "weight_decay_mode": 0},
           "LambOptimizer": {"max_norm_clip": 1.0}}
_DEFAULT_LOSS_SCALE_NAME = "default_loss_scale_input_name"
# legacy argument -> the newer trainer's option it becomes (an ORTTrainerOptions key path)
_OPTION_OF = {
    "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
    "device": "device.id",
    "world_rank": "distributed.world_rank",
    "world_size": "distributed.world_size",
    "allreduce_post_accumulation": "distributed.allreduce_post_accumulation",
    "deepspeed_zero_stage": "distributed.deepspeed_zero_optimization.stage",
    "use_mixed_precision": "mixed_precision.enabled",
    "enable_grad_norm_clip": "utils.grad_norm_clip",
    "frozen_weights": "utils.frozen_weights",
    "run_symbolic_shape_infer": "utils.run_symbolic_shape_infer",
    "_use_deterministic_compute": "debug.deterministic_compute",
    "optimized_model_filepath": "debug.graph_save_paths.model_with_training_graph_after_optimization_path",
    "_opset_version": "_internal_use.onnx_opset_version",
    "_enable_internal_postprocess": "_internal_use.enable_internal_postprocess",
    "_extra_postprocess": "_internal_use.extra_postprocess",
}
_SHARED = "shared_optimizer_state"  # the newer trainer's state_dict entry of the shared state


class LossScaler:
    """The legacy loss scaler: ``LossScaler(loss_scale_input_name, is_dynamic_scale,
    loss_scale=2**16, up_scale_window=2000, min_loss_scale=1.0, max_loss_scale=2**24)``.

    ``update_loss_scale(is_all_finite)``: not finite -> the scale halves (at least
    ``min_loss_scale``); finite -> after ``up_scale_window`` finite steps in a row it doubles
    (at most ``max_loss_scale``). A static scaler never changes. The trainer calls it at the end
    of each accumulation when it is given as ``loss_scaler``."""

    def __init__(self, loss_scale_input_name: str, is_dynamic_scale: bool, loss_scale: float = float(1 << 16),
                 up_scale_window: int = 2000, min_loss_scale: float = 1.0,
                 max_loss_scale: float = float(1 << 24)) -> None:
        if not 0 < min_loss_scale <= loss_scale <= max_loss_scale:
            raise ValueError("LossScaler: need 0 < min_loss_scale <= loss_scale <= max_loss_scale; got "
                             f"{min_loss_scale}, {loss_scale}, {max_loss_scale}")
        if isinstance(up_scale_window, bool) or not isinstance(up_scale_window, int) or up_scale_window < 1:
            raise ValueError(f"LossScaler: up_scale_window must be an integer >= 1; got {up_scale_window!r}")
        self.loss_scale_input_name_ = loss_scale_input_name
        self.is_dynamic_scale_ = bool(is_dynamic_scale)
        self.initial_loss_scale_ = float(loss_scale)
        self.up_scale_window_ = up_scale_window
        self.min_loss_scale_ = float(min_loss_scale)
        self.max_loss_scale_ = float(max_loss_scale)
        self.loss_scale_ = float(loss_scale)
        self.stable_steps_ = 0

    def update_loss_scale(self, is_all_finite: Any) -> None:
        if not self.is_dynamic_scale_:
            return
        if bool(is_all_finite):
            if self.stable_steps_ >= self.up_scale_window_:
                self.loss_scale_ = min(self.max_loss_scale_, self.loss_scale_ * 2)
                self.stable_steps_ = 0
            else:
                self.stable_steps_ += 1
        else:
            self.loss_scale_ = max(self.min_loss_scale_, self.loss_scale_ / 2)
            self.stable_steps_ = 0

    def reset(self) -> None:
        self.loss_scale_ = self.initial_loss_scale_
        self.stable_steps_ = 0


def optimizer_config(name: str, attributes: Callable[[str], Mapping[str, Any]] | None,
                     weights: Sequence[str]) -> optim._OptimizerConfig:
    """The newer trainer's config of the legacy ``training_optimizer_name`` and per-weight
    ``map_optimizer_attributes`` over the trained ``weights`` (weights with equal attributes
    share a parameter group; the learning rate comes with each step)."""
    per_weight: dict[str, dict[str, float]] = {}
    allowed = (*_PER_WEIGHT[name], *_GLOBAL[name])
    for weight in weights:
        attrs = attributes(weight) if attributes is not None else {}
        if not isinstance(attrs, Mapping):
            raise ValueError(f"map_optimizer_attributes({weight!r}) must return a dict of attributes; "
                             f"got {type(attrs).__name__}")
        for key, value in attrs.items():
            if key not in allowed:
                raise ValueError(f"map_optimizer_attributes({weight!r}): {key!r} is not an attribute of "
                                 f"{name}{close_matches(str(key), allowed)}; its attributes: {list(allowed)}")
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise ValueError(f"map_optimizer_attributes({weight!r})[{key!r}] must be a float or an "
                                 f"int; got {value!r}")
        per_weight[weight] = {k: float(v) for k, v in attrs.items()}
    shared: dict[str, float] = {}
    for key, default in _GLOBAL[name].items():
        values = {w: a.get(key, default) for w, a in per_weight.items()}
        if len(set(values.values())) > 1:
            shown = dict(list(values.items())[:4])
            raise ValueError(f"map_optimizer_attributes: {key!r} differs between weights ({shown}); "
                             f"gradgraph applies one {key} to the whole update: return the same value "
                             "for every weight")
        shared[key] = next(iter(values.values()), default)
    groups: dict[tuple[tuple[str, float], ...], list[str]] = {}
    for weight, attrs in per_weight.items():
        own = tuple(sorted((k, v) for k, v in attrs.items() if k not in shared))
        if own:
            groups.setdefault(own, []).append(weight)
    params = [{"params": names, **{k: bool(v) if k == "do_bias_correction" else v for k, v in own}}
              for own, names in groups.items()]
    if name == "SGDOptimizer":
        return optim.SGDConfig(lr=0.0)
    if name == "AdamOptimizer":
        mode = shared["weight_decay_mode"]
        if mode not in (0, 1):
            raise ValueError(f"map_optimizer_attributes: 'weight_decay_mode' must be 0 or 1; got {mode:g}")
        return optim.AdamConfig(params, lr=0.0, max_norm_clip=shared["max_norm_clip"],
                                weight_decay_mode=optim.AdamConfig.DecayMode(int(mode)))
    return optim.LambConfig(params, lr=0.0, max_norm_clip=shared["max_norm_clip"])


class _Engine(_Trainer):
    """The newer trainer with the legacy per-weight attribute map resolved at build time."""

    def __init__(self, optimizer_name: str, attributes: Callable[[str], Mapping[str, Any]] | None,
                 *args: Any) -> None:
        self._optimizer_name, self._attributes = optimizer_name, attributes
        super().__init__(*args)

    def _optimizer_for(self, weights: Sequence[str]) -> optim._OptimizerConfig:
        return optimizer_config(self._optimizer_name, self._attributes, weights)


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"ORTTrainer: {name} must be an integer >= {low}; got {value!r}")
    return int(value)


def _legacy_desc(desc: Any) -> ModelDescription:
    """A copy of ``desc`` with its loss flagged: the flagged output, else the first."""
    if not isinstance(desc, ModelDescription) or not desc.outputs:
        raise ValueError("ORTTrainer: model_desc must be a ModelDescription(inputs, outputs) of "
                         "IODescription(name, shape, dtype) with the loss as the first output; got "
                         f"{desc!r}")
    flagged = [o.name for o in desc.outputs if o.is_loss]
    if len(flagged) > 1:
        raise ValueError(f"ORTTrainer: model_desc flags {len(flagged)} outputs is_loss: {flagged}; one "
                         "loss (by default the first output)")
    loss = flagged[0] if flagged else desc.outputs[0].name
    copy = [IODescription(d.name, d.shape, d.dtype, d.num_classes) for d in [*desc.inputs, *desc.outputs]]
    for d in copy[len(desc.inputs):]:
        d.is_loss = d.name == loss
    return ModelDescription.parse({"inputs": copy[:len(desc.inputs)], "outputs": copy[len(desc.inputs):]})


def _options(given: Mapping[str, Any], fixed: Mapping[str, Any]) -> ORTTrainerOptions:
    """The newer trainer's options of the legacy arguments ``given`` (see ``_OPTION_OF``) and the
    ``fixed`` option paths; a bad value is named by its legacy argument."""
    nested: dict[str, Any] = {}
    for path, value in [*((_OPTION_OF[k], v) for k, v in given.items()), *fixed.items()]:
        *groups, key = path.split(".")
        node = nested
        for group in groups:
            node = node.setdefault(group, {})
        node[key] = value
    try:
        return ORTTrainerOptions(nested)
    except ValueError as exc:
        legacy = next((k for k, path in _OPTION_OF.items() if f"'{path}" in str(exc)), None)
        if legacy is None:
            raise
        raise ValueError(f"ORTTrainer: {legacy}={given.get(legacy)!r} is refused ({exc})") from exc


def _device(device: Any) -> str:
    text = str(device) if isinstance(device, (str, torch.device)) else ""
    if text != "cpu" and not (text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise ValueError(f"ORTTrainer: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device; got {device!r}")
    return text


def _in_place(postprocess: Callable[[onnx.ModelProto], Any] | None) -> Callable[[onnx.ModelProto], onnx.ModelProto] | None:
    """The legacy ``_extra_postprocess`` edits the model in place (returns None); a returned
    model is taken too."""
    if postprocess is None:
        return None
    if not callable(postprocess):
        raise ValueError(f"ORTTrainer: _extra_postprocess must be a callable (model -> None, edited in "
                         f"place); got {postprocess!r}")

    def run(model: onnx.ModelProto) -> onnx.ModelProto:
        result = postprocess(model)
        return model if result is None else result

    return run


class ORTTrainer:
    """The legacy ``onnxruntime.capi.ort_trainer.ORTTrainer`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module | onnx.ModelProto, loss_fn: Any, model_desc: ModelDescription,
                 training_optimizer_name: str,
                 map_optimizer_attributes: Callable[[str], Mapping[str, Any]] | None,
                 learning_rate_description: IODescription, device: Any, gradient_accumulation_steps: int = 1,
                 world_rank: int = 0, world_size: int = 1, use_mixed_precision: bool = False,
                 allreduce_post_accumulation: bool = False, global_step: int = 0,
                 get_lr_this_step: Callable[[int], Any] | None = None, loss_scaler: Any = None,
                 deepspeed_zero_stage: int = 0, enable_grad_norm_clip: bool = True,
                 frozen_weights: Sequence[str] = (), _opset_version: int = 14,
                 _enable_internal_postprocess: bool = True,
                 _extra_postprocess: Callable[[onnx.ModelProto], Any] | None = None,
                 _use_deterministic_compute: bool = False, use_memory_efficient_gradient: bool = False,
                 run_symbolic_shape_infer: bool = False, enable_adasum: bool = False,
                 optimized_model_filepath: str = "") -> None:
        if enable_adasum:
            raise NotImplementedError("ORTTrainer: enable_adasum=True is not implemented (gradgraph's data "
                                      "parallelism averages the ranks' gradients with an all-reduce); "
                                      "leave enable_adasum=False")
        if use_memory_efficient_gradient:
            raise NotImplementedError("ORTTrainer: use_memory_efficient_gradient=True is not implemented "
                                      "(gradgraph builds one gradient graph); leave it False, or use "
                                      "gradient_accumulation_steps / recompute to save memory")
        if deepspeed_zero_stage not in (0, 1) or isinstance(deepspeed_zero_stage, bool):
            raise NotImplementedError(f"ORTTrainer: deepspeed_zero_stage={deepspeed_zero_stage!r}: only "
                                      "stage 0 (off) and 1 (optimizer state partitioned) are implemented")
        if training_optimizer_name not in _PER_WEIGHT:
            raise ValueError(f"ORTTrainer: training_optimizer_name={training_optimizer_name!r} is not one of "
                             f"{list(_PER_WEIGHT)}{close_matches(str(training_optimizer_name), list(_PER_WEIGHT))}")
        if map_optimizer_attributes is not None and not callable(map_optimizer_attributes):
            raise ValueError("ORTTrainer: map_optimizer_attributes must be a function of the weight name "
                             f"returning its attributes, or None; got {map_optimizer_attributes!r}")
        if get_lr_this_step is not None and not callable(get_lr_this_step):
            raise ValueError(f"ORTTrainer: get_lr_this_step must be a function of global_step; got "
                             f"{get_lr_this_step!r}")
        world_size = _count("world_size", world_size, 1)
        world_rank = _count("world_rank", world_rank, 0)
        if world_rank >= world_size:
            raise ValueError(f"ORTTrainer: world_rank={world_rank} must be < world_size={world_size}")
        if _opset_version not in range(12, onnx.defs.onnx_opset_version() + 1):
            raise ValueError(f"ORTTrainer: _opset_version={_opset_version!r} must be an opset in "
                             f"[12, {onnx.defs.onnx_opset_version()}]")
        self.model_desc_ = _legacy_desc(model_desc)
        self._lr_name = self._check_lr_description(learning_rate_description)
        self._scaler = self._check_scaler(loss_scaler, use_mixed_precision)
        self._warn_without_effect(world_size, allreduce_post_accumulation=allreduce_post_accumulation,
                                  deepspeed_zero_stage=deepspeed_zero_stage)
        given = {"gradient_accumulation_steps": _count("gradient_accumulation_steps", gradient_accumulation_steps, 1),
                 "device": _device(device), "world_rank": world_rank, "world_size": world_size,
                 "use_mixed_precision": use_mixed_precision, "enable_grad_norm_clip": enable_grad_norm_clip,
                 "frozen_weights": frozen_weights, "run_symbolic_shape_infer": run_symbolic_shape_infer,
                 "_use_deterministic_compute": _use_deterministic_compute,
                 "optimized_model_filepath": optimized_model_filepath, "_opset_version": _opset_version,
                 "_enable_internal_postprocess": _enable_internal_postprocess,
                 "_extra_postprocess": _in_place(_extra_postprocess)}
        if world_size > 1:  # one process: warned above, by their names
            given.update(allreduce_post_accumulation=allreduce_post_accumulation,
                         deepspeed_zero_stage=deepspeed_zero_stage)
        fixed: dict[str, Any] = {
            "distributed.data_parallel_size": world_size,
            # the legacy trainer had no cast propagation (the newer options' default level is 1)
            "graph_transformer.propagate_cast_ops_config.level": -1}
        if use_mixed_precision:  # a fixed scale in the graph, set before each step, unless the graph's own
            fixed["mixed_precision.loss_scaler"] = loss_scaler if isinstance(loss_scaler, optim.LossScaler) \
                else optim.LossScaler(loss_scale=1.0, automatic_update=False)
        options = _options(given, fixed)
        self.training_optimizer_name_ = training_optimizer_name
        self.map_optimizer_attributes_ = map_optimizer_attributes
        self.learning_rate_description_ = learning_rate_description
        self.use_mixed_precision = bool(use_mixed_precision)
        self.gradient_accumulation_steps = options.batch.gradient_accumulation_steps
        self.world_rank, self.world_size = world_rank, world_size
        self.deepspeed_zero_stage_ = deepspeed_zero_stage
        self.global_step_ = _count("global_step", global_step, 0)
        self.get_lr_this_step_ = get_lr_this_step
        self.loss_scaler_ = loss_scaler
        self.current_step = 0  # train_step calls
        self.is_train = True
        self.loss_scale_input_name = "loss_scale"
        self._engine = _Engine(training_optimizer_name, map_optimizer_attributes, model, self.model_desc_,
                               optim.SGDConfig(lr=0.0), loss_fn, options)

    # ---- argument checks --------------------------------------------------------------------
    def _check_lr_description(self, desc: Any) -> str:
        if not isinstance(desc, IODescription):
            raise ValueError("ORTTrainer: learning_rate_description must be an IODescription(name, [1], "
                             f"torch.float32); got {desc!r}")
        taken = [d.name for d in [*self.model_desc_.inputs, *self.model_desc_.outputs]]
        if desc.name in taken:
            raise ValueError(f"ORTTrainer: learning_rate_description's name {desc.name!r} is a model_desc "
                             "input or output; give the learning rate a name of its own")
        if list(desc.shape) not in ([1], []):
            raise ValueError(f"ORTTrainer: learning_rate_description {desc.name!r} has shape {desc.shape}; "
                             "the learning rate is one number (shape [1])")
        return desc.name

    @staticmethod
    def _check_scaler(scaler: Any, mixed: bool) -> LossScaler | None:
        if scaler is None:
            return None
        if not mixed:
            raise ValueError("ORTTrainer: loss_scaler is given but use_mixed_precision is False (a loss "
                             "scale applies to mixed precision only)")
        if isinstance(scaler, optim.LossScaler):
            return None  # the graph keeps and updates that scale itself
        if not isinstance(scaler, LossScaler):
            raise ValueError("ORTTrainer: loss_scaler must be a gradgraph.torch.ort_trainer.LossScaler or a "
                             f"gradgraph.torch.optim.LossScaler / DynamicLossScaler; got {scaler!r}")
        return scaler

    @staticmethod
    def _warn_without_effect(world_size: int, **asked: Any) -> None:
        if world_size == 1:
            on = [f"{k}={v!r}" for k, v in asked.items() if v]
            if on:
                warnings.warn(f"ORTTrainer: {', '.join(on)} has no effect with world_size=1 (one "
                              "process trains alone)", RuntimeWarning, stacklevel=3)
            env = int(os.environ.get("WORLD_SIZE", "1"))
            if env > 1:
                warnings.warn(f"ORTTrainer: world_size=1, but the environment says WORLD_SIZE={env} "
                              "(torchrun): each process trains alone; pass world_size and world_rank "
                              "for data parallelism", RuntimeWarning, stacklevel=3)

    # ---- steps --------------------------------------------------------------------------------
    def train(self) -> None:
        self.is_train = True

    def eval(self) -> None:
        self.is_train = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.train_step(*args, **kwargs) if self.is_train else self.eval_step(*args, **kwargs)

    def _split(self, args: tuple, kwargs: dict, extras: Sequence[str]) -> tuple[list, dict, dict, Any]:
        """Model inputs (positional, by name), the ``extras`` (after the inputs or by name) and
        ``fetches`` from a step's arguments."""
        kwargs = dict(kwargs)
        fetches = kwargs.pop("fetches", None)
        given = list(args[0]) if len(args) == 1 and isinstance(args[0], list) else list(args)
        names = [d.name for d in self.model_desc_.inputs]
        positional = [n for n in names if n not in kwargs]
        if len(given) > len(positional) + len(extras):
            raise ValueError(f"ORTTrainer: {len(given)} positional arguments; this step takes "
                             f"{positional + list(extras)}")
        inputs = dict(zip(positional, given))
        extra = dict(zip(extras, given[len(positional):]))
        for key in list(kwargs):
            target = extras[-1] if key == _DEFAULT_LOSS_SCALE_NAME and extras else key
            if target in extras:
                if target in extra:
                    raise ValueError(f"ORTTrainer: {target!r} given twice (by position and by name)")
                extra[target] = kwargs.pop(key)
        if fetches is not None:
            outputs = [o.name for o in self.model_desc_.outputs]
            if isinstance(fetches, str) or not all(f in outputs for f in fetches):
                raise ValueError(f"ORTTrainer: fetches={fetches!r} must be a list of model_desc outputs "
                                 f"{outputs}")
        return [inputs[n] for n in positional if n in inputs], {**kwargs}, extra, fetches

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        """One micro-step: ``train_step(*inputs, learning_rate[, loss_scale], fetches=None)``."""
        feeds_scale = self.use_mixed_precision and self._scaler is None and not isinstance(
            self.loss_scaler_, optim.LossScaler)
        extras = ([self._lr_name] if self.get_lr_this_step_ is None else []) + \
            ([self.loss_scale_input_name] if feeds_scale else [])
        if self.get_lr_this_step_ is not None and self._lr_name in kwargs:
            raise ValueError(f"ORTTrainer.train_step: {self._lr_name}= is given, but the learning rate "
                             "comes from get_lr_this_step (pass one or the other)")
        inputs, named, extra, fetches = self._split(args, kwargs, extras)
        if self.get_lr_this_step_ is not None:
            lr = _number("get_lr_this_step(global_step)", self.get_lr_this_step_(self.global_step_))
        elif self._lr_name in extra:
            lr = _number(f"the learning rate {self._lr_name!r}", extra[self._lr_name])
        else:
            raise ValueError(f"ORTTrainer.train_step: no learning rate: pass it after the inputs (a "
                             f"tensor of shape [1]) or as {self._lr_name}=..., or give get_lr_this_step")
        scale = None
        if self._scaler is not None:
            scale = self._scaler.loss_scale_
        elif feeds_scale:
            if self.loss_scale_input_name not in extra:
                raise ValueError("ORTTrainer.train_step: use_mixed_precision needs the loss scale: pass it "
                                 f"after the learning rate, as {self.loss_scale_input_name}=..., or give "
                                 "loss_scaler")
            scale = _number("the loss scale", extra[self.loss_scale_input_name])

        def set_scale(session: TrainingSession) -> None:
            if scale is not None:
                session.load_state({session.names.loss_scale: np.asarray(scale, np.float32)}, strict=False)

        out = self._engine._train(tuple(inputs), named, lr, set_scale)
        self.current_step += 1
        session = self._engine._session
        assert session is not None
        ending = session.micro_step == 0
        results = [out[f] for f in fetches] if fetches is not None else [out[o.name] for o in self.model_desc_.outputs]
        tensors: list[torch.Tensor] = [torch.from_numpy(np.array(r)) for r in results]
        if ending:
            finite = session.last_step_finite
            if self._scaler is not None:
                self._scaler.update_loss_scale(finite)
            self.global_step_ += int(finite)
            if self.use_mixed_precision and self.loss_scaler_ is None and fetches is None:
                tensors.append(torch.tensor(finite))
        return tensors[0] if len(tensors) == 1 else tensors

    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Model_desc's outputs (or ``fetches``) of the eval graph; the state is not changed."""
        inputs, named, _, fetches = self._split(args, kwargs, ())
        out = self._engine._eval(tuple(inputs), named)
        names = fetches if fetches is not None else [o.name for o in self.model_desc_.outputs]
        tensors = [torch.from_numpy(np.array(out[n])) for n in names]
        return tensors[0] if len(tensors) == 1 else tensors

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self, include_optimizer_state: bool = True) -> dict[str, torch.Tensor]:
        """The weights by name (a torch model's: the keys of its own ``state_dict()``) and, with
        ``include_optimizer_state``, each weight's optimizer state as ``<kind>_<weight>``
        (``Moment_1_fc1.weight``, ``Moment_2_...``, ``Gradient_Accumulation_Buffer_...``) and the
        shared state (``step``, ``loss_scale``) under its name."""
        engine = self._engine
        state = dict(engine.state_dict(pytorch_format=True))
        if include_optimizer_state and engine._session is not None:
            for key, (weight, kind) in self._optimizer_keys().items():
                entry = engine.state_dict()["optimizer"][weight]
                state[key] = torch.from_numpy(np.array(entry[kind]))
        return state

    def _optimizer_keys(self) -> dict[str, tuple[str, str]]:
        """``state_dict()``'s optimizer keys -> (the newer trainer's weight entry, its kind)."""
        engine = self._engine
        keys = {}
        for weight, entry in engine.state_dict()["optimizer"].items():
            for kind in entry:
                if kind != "Update_Count":  # Adam's: the shared step, read back from it
                    name = kind if weight == _SHARED else f"{kind}_{engine._torch_names.get(weight, weight)}"
                    keys[name] = (weight, kind)
        return keys

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = False) -> None:
        """Load what ``state_dict()`` gives (before the first step too: applied once built);
        ``strict``: all of it. A key the model does not hold is refused, named."""
        engine = self._engine
        session = engine._session
        if session is None:
            engine._pending = lambda: self.load_state_dict(state_dict, strict)
            return
        graph_of = {torch_name: graph for graph, torch_name in engine._torch_names.items()}
        held = set(session.artifacts.params) | engine._frozen_graph_names()
        module_only = set(engine._torch_model.state_dict()) if engine._torch_model is not None else set()
        optimizer_keys = self._optimizer_keys()
        weights: dict[str, np.ndarray] = {}
        optimizer: dict[str, dict[str, np.ndarray]] = {}
        unknown = []
        for key, value in state_dict.items():
            array = np.array(value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value)
            if graph_of.get(key, key) in held:
                weights[graph_of.get(key, key)] = array
            elif key in optimizer_keys:
                weight, kind = optimizer_keys[key]
                optimizer.setdefault(weight, {})[kind] = array
            elif key in module_only:  # the module's own (num_batches_tracked): not in the graph
                assert engine._torch_model is not None
                with torch.no_grad():
                    engine._torch_model.state_dict()[key].copy_(torch.from_numpy(array))
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"ORTTrainer.load_state_dict: {unknown[:4]} are neither weights nor optimizer "
                             f"state of this trainer{close_matches(unknown[0], list(self.state_dict()))}")
        if strict:
            missing = sorted(set(self.state_dict(include_optimizer_state=bool(optimizer))) - set(state_dict))
            if missing:
                raise ValueError(f"ORTTrainer.load_state_dict(strict=True): {missing[:4]} are missing")
        nested: dict[str, Any] = {"model": {"full_precision": weights}}
        if optimizer:
            nested["optimizer"] = optimizer
        engine.load_state_dict(nested, strict=False)

    def save_as_onnx(self, path: str | os.PathLike) -> None:
        """The training graph with the current state (see the newer trainer's ``save_as_onnx``)."""
        self._engine.save_as_onnx(path)


def _number(what: str, value: Any) -> float:
    """A learning rate or loss scale: a number or a one-element tensor / array."""
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.size != 1 or array.dtype.kind not in "iuf":
        raise ValueError(f"ORTTrainer: {what} must be one number (a tensor of shape [1]); got {value!r}")
    return float(array.reshape(-1)[0])


# ---- the legacy module's checkpoint functions ------------------------------------------------------
def _checkpoint_name(prefix: str, trainer: ORTTrainer) -> str:
    """``<prefix>.ort.pt``, or one file per rank with ZeRO: ``<prefix>.ZeRO.<rank>.<size>.ort.pt``."""
    if trainer.deepspeed_zero_stage_ > 0 and trainer.world_size > 1:
        return f"{prefix}.ZeRO.{trainer.world_rank}.{trainer.world_size}.ort.pt"
    return f"{prefix}.ort.pt"


def save_checkpoint(model: ORTTrainer, checkpoint_dir: str | os.PathLike, checkpoint_prefix: str = "ORT_checkpoint",
                    checkpoint_state_dict: dict[str, Any] | None = None, include_optimizer_state: bool = True) -> None:
    """Write ``{'model': model.state_dict(include_optimizer_state), **checkpoint_state_dict}`` to
    ``checkpoint_dir/<prefix>.ort.pt`` (with ZeRO, each rank its own file), atomically; an
    existing file is replaced with a warning, as the reference did."""
    from gradgraph.io import atomic_output_path

    if not Path(checkpoint_dir).is_dir():
        raise FileNotFoundError(f"save_checkpoint: checkpoint directory {str(checkpoint_dir)!r} does not exist")
    state = {**(checkpoint_state_dict or {}), "model": model.state_dict(include_optimizer_state)}
    path = Path(checkpoint_dir) / _checkpoint_name(checkpoint_prefix, model)
    if path.exists():
        warnings.warn(f"save_checkpoint: {str(path)!r} exists; it is replaced", RuntimeWarning, stacklevel=2)
    with atomic_output_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(model: ORTTrainer, checkpoint_dir: str | os.PathLike, checkpoint_prefix: str = "ORT_checkpoint",
                    strict: bool = False) -> dict[str, Any]:
    """Load the checkpoint of ``save_checkpoint`` (the ranks' ZeRO files merged) into ``model``;
    returns what was saved beside the model."""
    files = sorted(Path(checkpoint_dir).glob(f"{checkpoint_prefix}.ort.pt")) or sorted(
        Path(checkpoint_dir).glob(f"{checkpoint_prefix}.ZeRO.*.ort.pt"))
    if not files:
        raise FileNotFoundError(f"load_checkpoint: no {checkpoint_prefix}.ort.pt (or ZeRO rank files) in "
                                f"{str(checkpoint_dir)!r}")
    merged: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for file in files:
        try:
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - pickle and torch raise many types
            raise ValueError(f"load_checkpoint: {str(file)!r} is not a checkpoint of save_checkpoint "
                             f"({type(exc).__name__}: {str(exc)[:200]})") from exc
        if not isinstance(loaded, dict) or "model" not in loaded:
            raise ValueError(f"load_checkpoint: {str(file)!r} has no 'model' entry (not written by save_checkpoint)")
        merged.update(loaded.pop("model"))  # ZeRO: each rank's optimizer partition, the same weights
        rest = loaded
    model.load_state_dict(merged, strict=strict)
    return rest
