"""The optimizer part of a training graph.

Update rules as standard-ONNX subgraphs (one module per optimizer family: ``sgd``, ``adam``,
``lamb``; shared helpers in ``base``), the pass that inserts them (``optimizer_pass``:
accumulation, clipping, non-finite skipping, loss-scale unscaling and the dynamic scaler) and
``loss_scale`` (the scaled loss differentiated under mixed precision). Reference:
onnxruntime ``orttraining/core/graph/optimizer_graph_builder.cc`` and ``amp/loss_scaler.py``.
"""

from passes.optimizer.adam import AdamConfig, AdamWConfig
from passes.optimizer.base import (
    ParamGroup,
    StepScalars,
    config_type,
    optimizer_rule,
    resolve,
    rule_for,
)
from passes.optimizer.lamb import LambConfig
from passes.optimizer.sgd import SGDConfig

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
