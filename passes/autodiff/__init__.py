"""Reverse-mode autodiff over ONNX graphs, emitting standard ONNX ops."""

from passes.autodiff import rules  # noqa: F401  (registers every rule)
from passes.autodiff.builder import NodeView, OpBuilder, Var
from passes.autodiff.engine import GradientOptions, GradientSweep, build_gradient
from passes.autodiff.errors import GradientError
from passes.autodiff.registry import (
    GradRule,
    grad_rule,
    lookup,
    non_differentiable,
    registered_rules,
)

__all__ = [
    "OpBuilder",
    "GradRule",
    "GradientSweep",
    "GradientError",
    "GradientOptions",
    "NodeView",
    "Var",
    "build_gradient",
    "grad_rule",
    "lookup",
    "non_differentiable",
    "registered_rules",
]
