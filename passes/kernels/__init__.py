"""Rewrites for the runtime's kernels: the same values, computed by faster kernels.

Each pass replaces a pattern by an equivalent one (the ONNX definition of the op, or an
algebraic identity) where onnxruntime's CPU kernel for the original is measurably slower; the
measurement is in the pass's docstring. Most run on finished graphs (after the gradient), so
gradient rules see the original ops; WholeScoresLossPass runs on the forward graph, because what
it saves is mostly the gradient of what it removes.
"""

from passes.kernels.sliced_scores_loss import WholeScoresLossPass
from passes.kernels.softmax_cross_entropy import SplitSoftmaxCrossEntropyPass

__all__ = ["SplitSoftmaxCrossEntropyPass", "WholeScoresLossPass"]
