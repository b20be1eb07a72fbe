"""``TrainingConfig``: one options object for the training build, composed of per-pass groups.

It mirrors ORTTrainerOptions' groups; each group is the options of the passes of one stage:

- ``update`` (:class:`UpdateOptions`): accumulation, clipping, parameter groups, non-finite
  steps, the state names: the optimizer stage, with the algorithm's config in ``optimizer``;
- ``graph_transformer`` (:class:`GraphTransformerOptions`): the graph-transform stage
  (clean-up, cast propagation) and recompute (:class:`passes.recompute.RecomputeOptions`);
- ``mixed_precision`` (:class:`MixedPrecisionConfig`): fp16/bf16 compute with fp32 master
  weights and a dynamic loss scaler;
- ``debug`` (:class:`DebugOptions`): the reference's four ``graph_save_paths`` and a
  directory that receives every stage's model.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from gradgraph.validate import check_names
from passes.optimizer import AdamWConfig
from passes.optimizer.base import check_groups
from passes.optimizer.optimizer_pass import LossScaleSettings, OptimizerSettings, UpdateOptions

if TYPE_CHECKING:
    from passes.recompute import RecomputeOptions


class CastStrategy(enum.IntFlag):
    """The reference's PropagateCastOpsStrategy (bit flags: 3 = both)."""

    NONE = 0
    INSERT_AND_REDUCE = 1
    FLOOD_FILL = 2


@dataclasses.dataclass(frozen=True)
class CastPropagationConfig:
    """``propagate_cast_ops_config``: off when ``level < 0`` (the reference's default)."""

    strategy: CastStrategy = CastStrategy.FLOOD_FILL
    level: int = -1
    allow: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.level >= 0 and self.strategy != CastStrategy.NONE

    def __post_init__(self) -> None:
        if isinstance(self.strategy, int) and not isinstance(self.strategy, (bool, CastStrategy)) \
                and 0 <= self.strategy <= 3:
            object.__setattr__(self, "strategy", CastStrategy(self.strategy))  # bit flags: 3 = both
        if not isinstance(self.strategy, CastStrategy):
            raise ValueError(f"propagate_cast_ops strategy must be a CastStrategy "
                             f"({[s.name for s in CastStrategy]}, or their bit flags 0-3: 3 = both), "
                             f"not {self.strategy!r}")
        if isinstance(self.level, bool) or not isinstance(self.level, int):
            raise ValueError(f"propagate_cast_ops level must be a whole number (-1 off, 0, 1, 2), "
                             f"not {self.level!r}")
        if not isinstance(self.allow, (str, bytes)):
            object.__setattr__(self, "allow", tuple(self.allow))  # a generator is read once
        check_names("propagate_cast_ops allow", self.allow)
        if self.level > 2:
            object.__setattr__(self, "level", 2)  # the reference treats levels above 2 as 2


@dataclasses.dataclass(frozen=True)
class GraphTransformerOptions:
    """Graph transforms before the gradient (clean-up, cast propagation) and recompute after it."""

    # Dead code, common subexpressions, constant folding, identities (passes.cleanup).
    cleanup: bool = False
    # onnxruntime's com.microsoft ops where the build writes them for speed (below opset 20, a
    # written-out GELU as com.microsoft Gelu/FastGelu: passes.kernels.GeluFusionPass). False:
    # standard ONNX ops only, for graphs another runtime must load (inference_model() included).
    contrib_ops: bool = True
    propagate_cast_ops: CastPropagationConfig = CastPropagationConfig()
    # None: no recompute.
    recompute: RecomputeOptions | None = None

    def __post_init__(self) -> None:
        from passes.recompute import RecomputeOptions  # noqa: PLC0415 - typing-only at module level

        if self.recompute is not None and not isinstance(self.recompute, RecomputeOptions):
            raise ValueError(f"GraphTransformerOptions.recompute must be a RecomputeOptions (e.g. "
                             f"RecomputeOptions(gelu=True)) or None, not {self.recompute!r}")
        if not isinstance(self.propagate_cast_ops, CastPropagationConfig):
            raise ValueError(f"GraphTransformerOptions.propagate_cast_ops must be a CastPropagationConfig, "
                             f"not {self.propagate_cast_ops!r}")


@dataclasses.dataclass(frozen=True)
class MixedPrecisionConfig:
    """fp16/bf16 compute, fp32 master weights; ``dtype=None``: off (the default)."""

    dtype: str | None = None
    loss_scaler: LossScaleSettings = LossScaleSettings()
    # bf16 has fp32's range: the reference scales fp16 losses only.
    scale_bfloat16: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in (None, "float16", "bfloat16"):
            raise ValueError(f"mixed_precision.dtype must be 'float16', 'bfloat16' or None "
                             f"(got {self.dtype!r})")

    @property
    def scales_loss(self) -> bool:
        return self.dtype == "float16" or (self.dtype == "bfloat16" and self.scale_bfloat16)


@dataclasses.dataclass(frozen=True)
class GraphSavePaths:
    """The reference's ``debug.graph_save_paths``; an empty path writes nothing."""

    model_after_graph_transforms_path: str = ""
    model_with_gradient_graph_path: str = ""
    model_with_training_graph_path: str = ""
    # Written by the session: onnxruntime's optimized graph (``optimized_model_filepath``).
    model_with_training_graph_after_optimization_path: str = ""


@dataclasses.dataclass(frozen=True)
class DebugOptions:
    graph_save_paths: GraphSavePaths = GraphSavePaths()
    # Every stage's model as DIR/NN_<stage>.onnx, plus summary.txt.
    save_stages: str | None = None


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """What to train and how. ``weights_to_train=None``: the model's parameters (see
    :func:`gradgraph.list_weights`)."""

    loss: str
    optimizer: Any = AdamWConfig()
    weights_to_train: tuple[str, ...] | None = None
    weights_not_to_train: tuple[str, ...] = ()
    # A non-scalar loss is refused unless reduced: "sum" or "mean" of its elements.
    loss_reduction: str | None = None
    update: UpdateOptions = UpdateOptions()
    graph_transformer: GraphTransformerOptions = GraphTransformerOptions()
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
    debug: DebugOptions = DebugOptions()

    def __post_init__(self) -> None:
        if dataclasses.is_dataclass(self.optimizer) and isinstance(self.update, UpdateOptions):
            check_groups(self.optimizer, self.update.groups)  # a misspelled override, named
        if isinstance(self.update, UpdateOptions) and self.update.loss_scale is not None:
            # the loss is scaled by the mixed-precision build only: the update would unscale
            # gradients that were never scaled (or the mixed-precision scaler would replace it)
            raise ValueError("TrainingConfig: update.loss_scale is set by mixed precision; give the "
                             "scaler as mixed_precision=MixedPrecisionConfig('float16', "
                             "loss_scaler=LossScaleSettings(...)) and leave update.loss_scale None")

    def optimizer_settings(self) -> OptimizerSettings:
        update = self.update
        if self.mixed_precision.scales_loss:
            update = dataclasses.replace(update, loss_scale=self.mixed_precision.loss_scaler)
        return OptimizerSettings(self.optimizer, update)

    @property
    def names(self) -> Any:
        return self.update.names
