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

Those that ask for something not implemented (distributed or pipeline training, fp16
moments, the memory-efficient LayerNorm gradient) raise ``NotImplementedError`` naming the
property, instead of being ignored.

Optimizer names: the reference's ``SGDOptimizer``, ``AdamOptimizer``, ``LambOptimizer``, or
gradgraph's ``sgd``, ``adam``, ``adamw``, ``lamb``. ``optimizer_attributes_map`` maps a weight
name to float attributes; the reference's keys ``alpha`` (beta1), ``beta`` (beta2),
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
}


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
        self.sliced_schema: dict[str, list[int]] = {}
        self.sliced_axes: dict[str, int] = {}
        self.sliced_tensor_names: list[str] = []
        # gradgraph extensions
        self.max_grad_norm = DEFAULT_MAX_GRAD_NORM
        self.propagate_cast_ops_strategy = "FLOOD_FILL"
        self.mixed_precision_dtype = "float16"
        self.model_with_training_graph_after_optimization_path = ""
        # Recompute planner: bytes of activations kept for the backward (None: planner off).
        self.recompute_memory_budget: int | None = None
        self.param_groups: tuple[ParamGroup, ...] = ()
        self.optimizer_initial_state: dict[str, dict[str, np.ndarray]] = {}
        for name, off in _UNSUPPORTED.items():
            setattr(self, name, off)
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
            if getattr(self, name) != off:
                raise NotImplementedError(
                    f"TrainingParameters.{name}={getattr(self, name)!r} is not supported by "
                    f"gradgraph yet (leave it at {off!r}); "
                    + ("fp16 optimizer moments are not implemented (moments stay fp32)"
                       if "fp16" in name else "the memory-efficient LayerNorm gradient is not "
                       "implemented" if "memory_efficient" in name
                       else "only single-process training is implemented"))

    def _optimizer(self) -> tuple[Any, tuple[ParamGroup, ...]]:
        name = self.training_optimizer_name or "AdamOptimizer"
        key = _REFERENCE_OPTIMIZERS.get(name.lower(), name.lower())
        ints = {k: v for attrs in self.optimizer_int_attributes_map.values() for k, v in attrs.items()}
        floats = {k: v for attrs in self.optimizer_attributes_map.values() for k, v in attrs.items()}
        decay_after = reference_adam = False
        # onnxruntime's AdamOptimizer decays decoupled in both modes: mode 0 in the same step as
        # the update (torch's AdamW), mode 1 after it (HuggingFace's AdamW).
        if key == "adam" and (ints.get("weight_decay_mode") == 1 or floats.get("lambda", 0.0)):
            key, decay_after, reference_adam = "adamw", ints.get("weight_decay_mode") == 1, True
        cls = config_type(key)
        fields = {f.name for f in dataclasses.fields(cls)}

        def translate(attrs: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
            out = {}
            for k, v in attrs.items():
                field = aliases.get(k, k)
                if field in fields:
                    out[field] = type(getattr(cls(), field))(v)
                elif k not in ("weight_decay_mode", "max_norm_clip"):
                    raise ValueError(f"optimizer attribute {k!r} does not apply to {cls.__name__}")
            return out

        per_weight = {}
        for weight in set(self.optimizer_attributes_map) | set(self.optimizer_int_attributes_map):
            per_weight[weight] = {**translate(self.optimizer_attributes_map.get(weight, {}), _ATTRIBUTE_ALIASES),
                                  **translate(self.optimizer_int_attributes_map.get(weight, {}), _INT_ALIASES)}
        # Defaults from the attributes shared by every weight; the rest become exact-name groups.
        shared = {}
        if per_weight:
            first = next(iter(per_weight.values()))
            shared = {k: v for k, v in first.items() if all(a.get(k) == v for a in per_weight.values())}
        if reference_adam:  # the reference's lambda defaults to 0, not AdamWConfig's 0.01
            shared = {"weight_decay": 0.0, "decay_after_update": decay_after, **shared}
        base = cls(**shared)
        groups = tuple(ParamGroup((w,), {k: v for k, v in a.items() if shared.get(k) != v})
                       for w, a in sorted(per_weight.items()) if any(shared.get(k) != v for k, v in a.items()))
        return base, groups + tuple(self.param_groups)

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
        self._check_supported()
        self._check_values()
        if not self.loss_output_name:
            raise ValueError("TrainingParameters.loss_output_name must name the loss output")
        if self.immutable_weights:
            raise NotImplementedError("TrainingParameters.immutable_weights is not supported; "
                                      "list such weights in weights_not_to_train")
        optimizer, groups = self._optimizer()
        # The reference clips for Adam and LAMB only.
        clip = self.enable_grad_norm_clip and optimizer.name != "sgd"
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

    def _recompute(self) -> Any:
        if not (self.gelu_recompute or self.attn_dropout_recompute or self.transformer_layer_recompute
                or self.recompute_memory_budget is not None):
            return None
        from passes.recompute import RecomputeOptions

        return RecomputeOptions(gelu=bool(self.gelu_recompute),
                                attn_dropout=bool(self.attn_dropout_recompute),
                                transformer_layers=bool(self.transformer_layer_recompute),
                                number_recompute_layers=int(self.number_recompute_layers),
                                memory_budget=self.recompute_memory_budget)

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
