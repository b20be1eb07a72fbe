"""``TrainingParameters``: the reference's (onnxruntime.TrainingParameters) properties.

Properties that gradgraph implements are turned into a :class:`TrainingConfig` by
:meth:`TrainingParameters.to_config`, each onto its option group:

- ``gelu_recompute``, ``attn_dropout_recompute``, ``transformer_layer_recompute``,
  ``number_recompute_layers`` -> ``graph_transformer.recompute``;
- ``propagate_cast_ops_level`` / ``propagate_cast_ops_allow`` (and the gradgraph extension
  ``propagate_cast_ops_strategy``, default FLOOD_FILL as the reference's C++ default) ->
  ``graph_transformer.propagate_cast_ops``;
- ``use_mixed_precision`` (fp16; the extension ``mixed_precision_dtype`` picks bfloat16) and
  ``loss_scale`` (0: dynamic, the default; > 0: a fixed scale) -> ``mixed_precision``;
- the three ``model_*_path`` properties (and the extension
  ``model_with_training_graph_after_optimization_path``) -> ``debug.graph_save_paths``.

Those that ask for something not implemented here (pipeline or tensor parallelism and its
``sliced_*`` tensors, fp16 moments, the memory-efficient LayerNorm gradient) raise
``NotImplementedError`` naming the property, instead of being ignored; the data-parallel ones
(``world_size``, ``data_parallel_size``, ``deepspeed_zero_stage``, ...) say how to run data
parallel instead (one process per rank with ``DistributedConfig``).

Optimizer names: the reference's ``SGDOptimizer``, ``AdamOptimizer``, ``LambOptimizer``, or
gradgraph's ``sgd``, ``adam``, ``adamw``, ``lamb``. ``optimizer_attributes_map`` maps a weight
name to float attributes, ``{weight_name: {attribute: value}}``; they change that weight's
updates only (the others keep the optimizer's defaults), and a name that is no trained weight
is refused by the build. The reference's keys ``alpha`` (beta1), ``beta`` (beta2),
``lambda`` (weight decay) and ``epsilon`` are translated, gradgraph field names pass through.
``optimizer_int_attributes_map`` accepts ``do_bias_correction`` (LAMB) and
``weight_decay_mode`` (Adam's weight decay ``lambda`` is decoupled as in onnxruntime: mode 0
decays in the same step as the update, torch's AdamW; mode 1 decays the updated weight,
HuggingFace's AdamW). As in the reference, global
gradient-norm clipping (``enable_grad_norm_clip``, on by default; threshold ``max_grad_norm``,
a gradgraph extension defaulting to 1.0) applies to Adam and LAMB, not SGD.
"""

from __future__ import annotations

import dataclasses
import glob
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from gradgraph.training.options import (
    CastPropagationConfig,
    CastStrategy,
    DebugOptions,
    GraphSavePaths,
    GraphTransformerOptions,
    MixedPrecisionConfig,
    TrainingConfig,
)
from gradgraph.validate import check_names, close_matches
from passes.autodiff import GradientError
from passes.optimizer import ParamGroup, config_type
from passes.optimizer.optimizer_pass import LossScaleSettings, TrainingNames, UpdateOptions

# Properties that hold a list of names (a single string is a common slip, never split).
_NAME_LISTS = ("weights_to_train", "weights_not_to_train", "propagate_cast_ops_allow",
               "sliced_tensor_names")

_REFERENCE_OPTIMIZERS = {"sgdoptimizer": "sgd", "adamoptimizer": "adam", "lamboptimizer": "lamb"}
_ATTRIBUTE_ALIASES = {"alpha": "beta1", "beta": "beta2", "lambda": "weight_decay", "epsilon": "eps"}
_INT_ALIASES = {"do_bias_correction": "bias_correction"}
# Reference default: clip the global gradient norm to this value when clipping is enabled.
DEFAULT_MAX_GRAD_NORM = 1.0

# property -> value that means "feature off"; anything else raises NotImplementedError.
_UNSUPPORTED = {
    "use_fp16_moments": False,
    "world_size": 1, "world_rank": 0, "data_parallel_size": 1, "horizontal_parallel_size": 1,
    "pipeline_parallel_size": 1, "num_pipeline_micro_batches": 1, "deepspeed_zero_stage": 0,
    "enable_adasum": False, "allreduce_post_accumulation": False,
    "use_memory_efficient_gradient": False, "pipeline_cut_info_string": "",
    "sliced_schema": {}, "sliced_axes": {}, "sliced_tensor_names": [],
}


@dataclasses.dataclass(frozen=True)
class WeightAttributes(ParamGroup):
    """The attributes the optimizer maps give one weight: an exact name that must be a trained
    weight (the build refuses it otherwise, naming ``source``)."""

    weight: str = ""
    source: str = "TrainingParameters.optimizer_attributes_map / optimizer_int_attributes_map"


_DATA_PARALLEL = ("data-parallel training runs one process per rank: `gradgraph train MODEL ... "
                  "--nproc N` on the command line, or, under torchrun, TrainingSession(model, "
                  "params, distributed=DistributedConfig.from_env()) from "
                  "gradgraph.training.distributed; TrainingParameters describes one rank")
_PARALLEL_HINT = {"world_size": _DATA_PARALLEL, "world_rank": _DATA_PARALLEL,
                  "data_parallel_size": _DATA_PARALLEL,
                  "deepspeed_zero_stage": "ZeRO stage 1 is DistributedConfig(zero_stage=1) of "
                                          "gradgraph.training.distributed (data parallel)",
                  "allreduce_post_accumulation": "it is DistributedConfig(allreduce_post_"
                                                 "accumulation=True) of gradgraph.training.distributed",
                  "sliced_schema": "pipeline-parallel tensor slicing is not implemented",
                  "sliced_axes": "pipeline-parallel tensor slicing is not implemented",
                  "sliced_tensor_names": "pipeline-parallel tensor slicing is not implemented"}


def _strategy(value: Any) -> CastStrategy:
    """PropagateCastOpsStrategy from a name ("FLOOD_FILL") or its bit value."""
    try:
        return CastStrategy[value.upper()] if isinstance(value, str) else CastStrategy(int(value))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"TrainingParameters.propagate_cast_ops_strategy={value!r} is not one of "
                         f"{[s.name for s in CastStrategy]}") from exc


class TrainingParameters:
    """Configuration for :class:`gradgraph.TrainingSession` (reference-compatible properties)."""

    def __init__(self) -> None:
        self.weights_to_train: set[str] = set()
        self.weights_not_to_train: set[str] = set()
        self.immutable_weights: dict[str, Any] = {}
        self.loss_output_name = ""
        self.training_optimizer_name = "AdamOptimizer"
        self.lr_params_feed_name = "Learning_Rate"
        self.optimizer_attributes_map: dict[str, dict[str, float]] = {}
        self.optimizer_int_attributes_map: dict[str, dict[str, int]] = {}
        self.gradient_accumulation_steps = 1
        self.enable_grad_norm_clip = True
        self.set_gradients_as_graph_outputs = False
        self.model_after_graph_transforms_path = ""
        self.model_with_gradient_graph_path = ""
        self.model_with_training_graph_path = ""
        self.propagate_cast_ops_level = -1
        self.propagate_cast_ops_allow: list[str] = []
        self.attn_dropout_recompute = False
        self.gelu_recompute = False
        self.transformer_layer_recompute = False
        self.number_recompute_layers = 0
        self.use_mixed_precision = False
        self.loss_scale = 0.0
        # "warn" or "error": a recompute property that recomputes nothing (RecomputeOptions).
        self.recompute_nothing_recomputed = "warn"
        # gradgraph extensions
        self.max_grad_norm = DEFAULT_MAX_GRAD_NORM
        self.propagate_cast_ops_strategy = "FLOOD_FILL"
        self.mixed_precision_dtype = "float16"
        self.model_with_training_graph_after_optimization_path = ""
        # Recompute planner: bytes of activations kept for the backward (None: planner off).
        self.recompute_memory_budget: int | None = None
        # Sizes of symbolic dims for the planner's byte counts ({"batch": 8}; CLI --dim).
        self.recompute_dims: dict[str, int] = {}
        self.param_groups: tuple[ParamGroup, ...] = ()
        self.optimizer_initial_state: dict[str, dict[str, np.ndarray]] = {}
        for name, off in _UNSUPPORTED.items():  # a fresh {} / [] each (never the table's own)
            setattr(self, name, type(off)(off) if isinstance(off, (dict, list)) else off)
        self._sealed = True

    def __setattr__(self, name: str, value: Any) -> None:
        """Unknown properties are an error (a typo must not be silently ignored)."""
        if getattr(self, "_sealed", False) and not hasattr(self, name):
            known = sorted(k for k in vars(self) if not k.startswith("_"))
            raise AttributeError(f"TrainingParameters has no property {name!r}"
                                 f"{close_matches(name, known)}")
        super().__setattr__(name, value)

    def set_optimizer_initial_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Initial optimizer state, laid out like ``TrainingSession.get_optimizer_state()``."""
        self.optimizer_initial_state = {k: dict(v) for k, v in state.items()}

    def _check_supported(self) -> None:
        for name, off in _UNSUPPORTED.items():
            value = getattr(self, name)
            if value == off:
                continue
            if name in _PARALLEL_HINT and "slic" not in name:
                raise NotImplementedError(f"TrainingParameters.{name}={value!r}: "
                                          f"{_PARALLEL_HINT[name]} (leave {name} at {off!r})")
            why = ("fp16 optimizer moments are not implemented (moments stay fp32)" if "fp16" in name
                   else "the memory-efficient LayerNorm gradient is not implemented"
                   if "memory_efficient" in name
                   else _PARALLEL_HINT.get(name, "pipeline and tensor parallelism are not implemented"))
            raise NotImplementedError(f"TrainingParameters.{name}={value!r} is not supported by "
                                      f"gradgraph (leave it at {off!r}): {why}")

    def _maps(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """The two optimizer maps, checked to be ``{weight_name: {attribute: value}}``."""
        maps = []
        for prop in ("optimizer_attributes_map", "optimizer_int_attributes_map"):
            value = getattr(self, prop)
            shape = (f"TrainingParameters.{prop} maps each weight's name to its attributes, "
                     f"{{weight_name: {{attribute: value}}}}, e.g. {{'fc.weight': "
                     f"{{{'alpha' if prop == 'optimizer_attributes_map' else 'do_bias_correction'!r}: "
                     f"{0.9 if prop == 'optimizer_attributes_map' else 1}}}}}")
            if not isinstance(value, Mapping):
                raise ValueError(f"{shape}; got a {type(value).__name__}: {value!r}")
            for weight, attrs in value.items():
                if not isinstance(weight, str) or not isinstance(attrs, Mapping):
                    flat = all(not isinstance(v, Mapping) for v in value.values())
                    raise ValueError(
                        f"{shape}; got {weight!r}: {attrs!r}"
                        + (" (a flat map of attributes is not per weight: name each weight to "
                           "set, or set every weight through TrainingParameters.param_groups = "
                           "(ParamGroup(('*',), {...}),) with the optimizer's field names)"
                           if flat else ""))
            maps.append({w: dict(a) for w, a in value.items()})
        return maps[0], maps[1]

    def _optimizer(self) -> tuple[Any, tuple[ParamGroup, ...]]:
        """The optimizer's config (its defaults) and one group per weight the maps name: an
        attribute given for one weight changes that weight's updates only."""
        name = self.training_optimizer_name or "AdamOptimizer"
        key = _REFERENCE_OPTIMIZERS.get(name.lower(), name.lower())
        floats_map, ints_map = self._maps()
        # onnxruntime's AdamOptimizer decays decoupled in both modes: mode 0 in the same step as
        # the update (torch's AdamW), mode 1 after it (HuggingFace's AdamW).
        reference_adam = key == "adam" and (
            any(a.get("weight_decay_mode") == 1 for a in ints_map.values())
            or any(a.get("lambda", 0.0) for a in floats_map.values()))
        if reference_adam:
            key = "adamw"
        cls = config_type(key)
        fields = {f.name for f in dataclasses.fields(cls)}
        base = cls(weight_decay=0.0) if reference_adam else cls()  # the reference's lambda: 0

        def translate(weight: str, attrs: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
            out = {}
            for k, v in attrs.items():
                field = aliases.get(k, k)
                if k == "weight_decay_mode":
                    if key == "adamw":
                        out["decay_after_update"] = v == 1
                    continue
                if k == "max_norm_clip":
                    raise ValueError(f"optimizer attribute 'max_norm_clip' (weight {weight!r}) is not "
                                     "per weight in gradgraph: set TrainingParameters.max_grad_norm "
                                     "(global gradient-norm clipping, with enable_grad_norm_clip)")
                if field not in fields:
                    raise ValueError(f"optimizer attribute {k!r} (weight {weight!r}) does not apply "
                                     f"to {cls.__name__}; its fields are {sorted(fields)}")
                out[field] = type(getattr(base, field))(v)
            return out

        groups = []
        for weight in sorted(set(floats_map) | set(ints_map)):
            overrides = {**translate(weight, floats_map.get(weight, {}), _ATTRIBUTE_ALIASES),
                         **translate(weight, ints_map.get(weight, {}), _INT_ALIASES)}
            # a group even without overrides: the build refuses a name that is no trained weight
            groups.append(WeightAttributes((glob.escape(weight),), overrides, weight=weight))
        return base, tuple(groups) + tuple(self.param_groups)

    def _check_values(self) -> None:
        """Names lists are lists of names; the accumulation count is a whole number >= 1."""
        for name in _NAME_LISTS:
            check_names(f"TrainingParameters.{name}", getattr(self, name))
        steps = self.gradient_accumulation_steps
        whole = isinstance(steps, (int, np.integer)) or (
            isinstance(steps, (float, np.floating)) and float(steps).is_integer())  # 2.0 is 2
        if isinstance(steps, bool) or not whole or steps < 1:
            raise GradientError(f"TrainingParameters.gradient_accumulation_steps must be a positive "
                                f"integer (micro-batches per optimizer step), got {steps!r}")

    def to_config(self) -> TrainingConfig:
        self._check_values()
        self._check_supported()
        if not self.loss_output_name:
            raise ValueError("TrainingParameters.loss_output_name must name the loss output")
        if self.immutable_weights:
            raise NotImplementedError("TrainingParameters.immutable_weights is not supported; "
                                      "list such weights in weights_not_to_train")
        optimizer, groups = self._optimizer()
        # The reference clips for Adam and LAMB only.
        clip = self.enable_grad_norm_clip and optimizer.name != "sgd"
        self._check_inert(clip)
        update = UpdateOptions(
            groups=groups,
            accumulation_steps=int(self.gradient_accumulation_steps),  # checked integral above
            max_grad_norm=float(self.max_grad_norm) if clip else None,
            keep_gradient_outputs=bool(self.set_gradients_as_graph_outputs),
            names=TrainingNames(learning_rate=self.lr_params_feed_name),
        )
        return TrainingConfig(
            loss=self.loss_output_name,
            optimizer=optimizer,
            weights_to_train=tuple(sorted(self.weights_to_train)) or None,
            weights_not_to_train=tuple(sorted(self.weights_not_to_train)),
            update=update,
            graph_transformer=GraphTransformerOptions(
                propagate_cast_ops=CastPropagationConfig(
                    _strategy(self.propagate_cast_ops_strategy), int(self.propagate_cast_ops_level),
                    tuple(self.propagate_cast_ops_allow)),
                recompute=self._recompute()),
            mixed_precision=self._mixed_precision(),
            debug=DebugOptions(GraphSavePaths(
                str(self.model_after_graph_transforms_path or ""),
                str(self.model_with_gradient_graph_path or ""),
                str(self.model_with_training_graph_path or ""),
                str(self.model_with_training_graph_after_optimization_path or ""))),
        )

    def _check_inert(self, clip: bool) -> None:
        """A property set to a value that the other properties make meaningless: refused where
        it can only be a mistake, else a warning naming what it would need."""
        if self.number_recompute_layers and not self.transformer_layer_recompute:
            raise ValueError(f"TrainingParameters.number_recompute_layers="
                             f"{self.number_recompute_layers!r} sets how many transformer layers "
                             "are recomputed: it needs transformer_layer_recompute = True")
        inert = []
        if int(self.propagate_cast_ops_level) < 0 and (
                self.propagate_cast_ops_allow or str(self.propagate_cast_ops_strategy) != "FLOOD_FILL"):
            inert.append("propagate_cast_ops_allow / propagate_cast_ops_strategy change nothing while "
                         "propagate_cast_ops_level is -1 (off): set it to 0, 1 or 2")
        if not self.use_mixed_precision and self.mixed_precision_dtype != "float16":
            inert.append(f"mixed_precision_dtype={self.mixed_precision_dtype!r} changes nothing while "
                         "use_mixed_precision is False")
        if self.max_grad_norm != DEFAULT_MAX_GRAD_NORM and not clip:
            inert.append(f"max_grad_norm={self.max_grad_norm!r} changes nothing: gradient-norm "
                         "clipping is off (" + ("enable_grad_norm_clip is False" if not
                                                self.enable_grad_norm_clip else
                                                "as in the reference, SGD is not clipped") + ")")
        if self.recompute_dims and self.recompute_memory_budget is None:
            inert.append("recompute_dims size tensors for the recompute planner: they change "
                         "nothing without recompute_memory_budget")
        if self.recompute_nothing_recomputed != "warn" and self._recompute() is None:
            inert.append("recompute_nothing_recomputed changes nothing without a recompute property "
                         "(gelu_recompute, attn_dropout_recompute, transformer_layer_recompute, "
                         "recompute_memory_budget)")
        for message in inert:
            warnings.warn(f"TrainingParameters: {message}", UserWarning, stacklevel=4)

    def _recompute(self) -> Any:
        if not (self.gelu_recompute or self.attn_dropout_recompute or self.transformer_layer_recompute
                or self.recompute_memory_budget is not None):
            return None
        from passes.recompute import RecomputeOptions

        return RecomputeOptions(gelu=bool(self.gelu_recompute),
                                attn_dropout=bool(self.attn_dropout_recompute),
                                transformer_layers=bool(self.transformer_layer_recompute),
                                number_recompute_layers=int(self.number_recompute_layers),
                                memory_budget=self.recompute_memory_budget,
                                dims=tuple(sorted(dict(self.recompute_dims).items())),
                                nothing_recomputed=self.recompute_nothing_recomputed)

    def _mixed_precision(self) -> MixedPrecisionConfig:
        if not self.use_mixed_precision:
            if self.loss_scale:
                raise ValueError("TrainingParameters.loss_scale is set but use_mixed_precision is "
                                 "False (a loss scale applies to mixed precision only)")
            return MixedPrecisionConfig()
        if self.loss_scale < 0:
            raise ValueError(f"TrainingParameters.loss_scale must be >= 0 (0: dynamic), got "
                             f"{self.loss_scale}")
        scaler = LossScaleSettings()
        if self.loss_scale > 0:
            scaler = LossScaleSettings(init_scale=float(self.loss_scale), dynamic=False)
        return MixedPrecisionConfig(dtype=self.mixed_precision_dtype, loss_scaler=scaler)
