"""RecomputeOptions: every switch and heuristic of the recompute passes, as named fields.

Selects among the rewrites of :class:`passes.recompute.RecomputePass`:

1. ``gelu``: recompute Gelu outputs read by the backward (ORT ``GeluRecompute``);
2. ``attn_dropout``: recompute attention Dropout outputs from the saved mask
   (ORT ``AttentionDropoutRecompute``);
3. ``transformer_layers``: recompute whole transformer layers from their inputs
   (ORT ``TransformerLayerRecompute``, ``number_recompute_layers`` as there);
4. ``memory_budget``: the min-cut planner (torch ``_functorch/partitioners.py``), which picks
   what to save and what to recompute so that stashed activations fit the budget.

Each of them that ends up recomputing nothing warns, naming itself and what it looked for
(``nothing_recomputed="error"``: raises instead).

Reference: onnxruntime ``orttraining/core/optimizer/{localized_recompute,dropout_recompute,
transformer_layer_recompute}.cc`` and ``memory_optimizer/*`` (see ORT_TRAINING.md section 3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

RANDOM_OPS = ("Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
              "Bernoulli", "Multinomial")
SUBGRAPH_OPS = ("If", "Loop", "Scan", "SequenceMap")
COMPUTE_INTENSIVE_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger",
                         "ConvInteger", "QLinearMatMul", "QLinearConv", "FusedMatMul", "Attention")
GELU_OPS = ("Gelu", "FastGelu", "BiasGelu")
MATMUL_OPS = ("MatMul", "FusedMatMul", "Gemm")
LAYER_NORM_OPS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization")
LAYER_START_OPS = (*LAYER_NORM_OPS, "Dropout", "BiasDropout")
# Cost of recomputing one byte of a node's outputs, by op type (other ops: default_cost_weight).
COST_WEIGHTS = (("MatMul", 16.0), ("Gemm", 16.0), ("Conv", 16.0), ("ConvTranspose", 16.0),
                ("Einsum", 16.0), ("Softmax", 4.0), ("LayerNormalization", 4.0), ("Erf", 2.0),
                ("Gelu", 2.0), ("Tanh", 2.0), ("Exp", 2.0), ("Pow", 2.0))
# Module scopes that number transformer layers: ``encoder.layer.3``, ``layers.3``, ``h.3``.
LAYER_SCOPE_PATTERN = r"(?:^|[./])(?:layer|layers|h|block|blocks)\.(\d+)$"
NOTHING_RECOMPUTED = ("warn", "error")


@dataclasses.dataclass(frozen=True)
class RecomputeOptions:
    """What to recompute and the planner's heuristics (all validated on construction)."""

    gelu: bool = False
    attn_dropout: bool = False
    transformer_layers: bool = False
    # Layers recomputed by ``transformer_layers``: 0 = all but the last; clipped to #layers - 1.
    number_recompute_layers: int = 0
    # Bytes of stashed activations allowed; None = planner off.
    memory_budget: int | None = None
    # Values for symbolic dims, used to size tensors: (("batch", 8), ("seq", 128)).
    dims: tuple[tuple[str, int], ...] = ()
    # Never recomputed (their outputs are saved when the backward needs them). Dropout is the
    # exception: it is recomputed from its saved mask, which gives the same result.
    banned_ops: tuple[str, ...] = RANDOM_OPS + SUBGRAPH_OPS
    # Ops the planner saves rather than recomputes, unless recompute_compute_intensive (torch
    # bans recomputing them by default too); the pattern passes ignore this.
    compute_intensive_ops: tuple[str, ...] = COMPUTE_INTENSIVE_OPS
    recompute_compute_intensive: bool = False
    # Nodes whose outputs are all non-float (shapes, indices, masks) are kept, not recomputed.
    recompute_non_float: bool = False
    # The planner keeps a stashed value when recomputing it would clone more nodes than this
    # (ORT's memory optimizer limit is 50); None = no limit.
    max_recompute_chain: int | None = 50
    # Planner: cost of recomputing a node = weight(op) * its output bytes.
    cost_weights: tuple[tuple[str, float], ...] = COST_WEIGHTS
    default_cost_weight: float = 1.0
    # Planner: bytes assumed for a tensor whose size is unknown (a symbolic dim not in ``dims``).
    unknown_bytes: int = 0
    # Patterns: a Gelu is recomputed only when its first forward consumer is one of these.
    gelu_consumers: tuple[str, ...] = MATMUL_OPS
    # Transformer layers: module scopes (node metadata or node names) that number layers.
    layer_scope_pattern: str = LAYER_SCOPE_PATTERN
    # Transformer layers: output edges a LayerNorm / Dropout start edge has in the reference.
    layer_start_edges: int = 4
    # An option above that recomputes nothing: "warn" (naming it and what it looked for) or
    # "error" (a GradientError with the same words).
    nothing_recomputed: str = "warn"

    def __post_init__(self) -> None:
        for field in ("gelu", "attn_dropout", "transformer_layers", "recompute_compute_intensive",
                      "recompute_non_float"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"RecomputeOptions.{field} must be True or False, not {getattr(self, field)!r}")
        for field, value in (("number_recompute_layers", self.number_recompute_layers),
                             ("memory_budget", self.memory_budget), ("unknown_bytes", self.unknown_bytes),
                             ("max_recompute_chain", self.max_recompute_chain),
                             ("layer_start_edges", self.layer_start_edges)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise ValueError(f"RecomputeOptions.{field} must be a whole number"
                                 f"{' of bytes' if field == 'memory_budget' else ''}, not {value!r}"
                                 + (" (a fraction or percentage of the stash is not a budget: give bytes)"
                                    if field == "memory_budget" and isinstance(value, (float, str)) else ""))
        if isinstance(self.dims, Mapping):
            object.__setattr__(self, "dims", tuple(self.dims.items()))  # {"batch": 8} as pairs
        if isinstance(self.dims, (str, bytes)) or not all(isinstance(p, tuple) and len(p) == 2 for p in self.dims):
            raise ValueError(f"RecomputeOptions.dims must be (name, size) pairs or a dict, not {self.dims!r}")
        if self.number_recompute_layers < 0:
            raise ValueError(f"RecomputeOptions.number_recompute_layers must be >= 0 "
                             f"(0 = all but the last), not {self.number_recompute_layers}")
        if self.memory_budget is not None and self.memory_budget < 0:
            raise ValueError(f"RecomputeOptions.memory_budget must be >= 0 bytes or None, "
                             f"not {self.memory_budget}")
        for name, size in self.dims:
            if not isinstance(name, str) or not isinstance(size, int) or size < 0:
                raise ValueError(f"RecomputeOptions.dims must hold (name, size >= 0) pairs, "
                                 f"not ({name!r}, {size!r})")
        if self.max_recompute_chain is not None and self.max_recompute_chain < 1:
            raise ValueError(f"RecomputeOptions.max_recompute_chain must be >= 1 or None, "
                             f"not {self.max_recompute_chain}")
        for op, weight in self.cost_weights:
            if weight < 0:
                raise ValueError(f"RecomputeOptions.cost_weights[{op!r}] must be >= 0, not {weight}")
        if self.default_cost_weight < 0:
            raise ValueError(f"RecomputeOptions.default_cost_weight must be >= 0, "
                             f"not {self.default_cost_weight}")
        if self.unknown_bytes < 0:
            raise ValueError(f"RecomputeOptions.unknown_bytes must be >= 0, not {self.unknown_bytes}")
        if self.layer_start_edges < 1:
            raise ValueError(f"RecomputeOptions.layer_start_edges must be >= 1, "
                             f"not {self.layer_start_edges}")
        if self.nothing_recomputed not in NOTHING_RECOMPUTED:
            raise ValueError(f"RecomputeOptions.nothing_recomputed must be one of "
                             f"{NOTHING_RECOMPUTED}, not {self.nothing_recomputed!r}")
        for field in ("banned_ops", "compute_intensive_ops", "gelu_consumers"):
            if isinstance(getattr(self, field), str):
                raise ValueError(f"RecomputeOptions.{field} must be a tuple of op types, not a str")

    @property
    def enabled(self) -> bool:
        return self.gelu or self.attn_dropout or self.transformer_layers or self.memory_budget is not None

    def dim_values(self) -> dict[str, int]:
        return dict(self.dims)

    def cost_weight(self, op_type: str) -> float:
        return dict(self.cost_weights).get(op_type, self.default_cost_weight)
