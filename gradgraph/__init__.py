"""gradgraph: gradient and training graphs for ONNX models, in standard ONNX ops."""

from gradgraph.api import GradientGraphBuilder, build_gradient_graph
from gradgraph.batching import make_batch_dynamic
from gradgraph.training.build import build_training_artifacts
from gradgraph.training.options import (
    CastPropagationConfig,
    CastStrategy,
    DebugOptions,
    GraphSavePaths,
    GraphTransformerOptions,
    MixedPrecisionConfig,
    TrainingConfig,
)
from gradgraph.training.parameters import TrainingParameters
from gradgraph.training.session import TrainingSession
from gradgraph.weights import WeightInfo, format_weights, list_weights
from passes.autodiff import GradientError, GradientOptions, grad_rule
from passes.optimizer import AdamConfig, AdamWConfig, LambConfig, ParamGroup, SGDConfig
from passes.optimizer.optimizer_pass import LossScaleSettings, UpdateOptions

__version__ = "0.1.0"

__all__ = [
    "AdamConfig",
    "AdamWConfig",
    "CastPropagationConfig",
    "CastStrategy",
    "DebugOptions",
    "GraphSavePaths",
    "GraphTransformerOptions",
    "LossScaleSettings",
    "MixedPrecisionConfig",
    "UpdateOptions",
    "LambConfig",
    "ParamGroup",
    "SGDConfig",
    "GradientError",
    "GradientGraphBuilder",
    "GradientOptions",
    "TrainingConfig",
    "TrainingParameters",
    "TrainingSession",
    "WeightInfo",
    "format_weights",
    "list_weights",
    "build_training_artifacts",
    "build_gradient_graph",
    "make_batch_dynamic",
    "grad_rule",
    "__version__",
]
