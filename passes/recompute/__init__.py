"""Recompute: trade stashed activations for recomputation in forward+backward graphs.

1. :mod:`.analysis`: the stashed activations and their bytes;
2. :mod:`.options`: :class:`RecomputeOptions`, every switch and heuristic;
3. :mod:`.planner`: the min-cut planner over an abstract problem (torch
   ``_functorch/partitioners.py``);
4. :mod:`.patterns`: the reference's Gelu / attention-Dropout / transformer-layer patterns
   (ORT ``orttraining/core/optimizer/*recompute*.cc``); :mod:`.residual` finds transformer
   layers by structure when the reference's anchors and module scopes are missing;
5. :mod:`.recompute_pass`: :class:`RecomputePass`, which clones, rewires and places.
"""

from passes.recompute.analysis import Stash, stashed_values, total_stash_bytes, value_bytes
from passes.recompute.options import RecomputeOptions
from passes.recompute.patterns import RecomputeGroup
from passes.recompute.planner import RecomputePlan, RecomputeProblem, plan_recompute
from passes.recompute.recompute_pass import (
    AttentionDropoutRecomputePass,
    GeluRecomputePass,
    RecomputePass,
    TransformerLayerRecomputePass,
    plan_for_model,
    planner_problem,
    recomputed_counts,
)
from passes.recompute.residual import residual_layers

__all__ = [
    "AttentionDropoutRecomputePass",
    "GeluRecomputePass",
    "RecomputeGroup",
    "RecomputeOptions",
    "RecomputePass",
    "RecomputePlan",
    "RecomputeProblem",
    "Stash",
    "TransformerLayerRecomputePass",
    "plan_for_model",
    "plan_recompute",
    "planner_problem",
    "recomputed_counts",
    "residual_layers",
    "stashed_values",
    "total_stash_bytes",
    "value_bytes",
]
