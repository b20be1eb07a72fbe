"""Optimizer update rules as standard-ONNX subgraphs (one module per optimizer family)."""

from passes.optimizers.adam import AdamConfig, AdamWConfig
from passes.optimizers.base import (
    ParamGroup,
    StepScalars,
    config_type,
    optimizer_rule,
    resolve,
    rule_for,
)
from passes.optimizers.lamb import LambConfig
from passes.optimizers.sgd import SGDConfig

__all__ = [
    "AdamConfig",
    "AdamWConfig",
    "LambConfig",
    "ParamGroup",
    "SGDConfig",
    "StepScalars",
    "config_type",
    "optimizer_rule",
    "resolve",
    "rule_for",
]
