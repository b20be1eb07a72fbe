"""gradgraph: gradient and training graphs for ONNX models, in standard ONNX ops."""

from gradgraph.api import GradientGraphBuilder, build_gradient_graph
from passes.autodiff import GradientError, GradientOptions, grad_rule

__version__ = "0.1.0"

__all__ = [
    "GradientError",
    "GradientGraphBuilder",
    "GradientOptions",
    "build_gradient_graph",
    "grad_rule",
    "__version__",
]
