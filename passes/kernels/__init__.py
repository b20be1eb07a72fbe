"""Rewrites for the runtime's kernels: the same values, computed by faster kernels.

Each pass replaces a pattern by an equivalent one (the ONNX definition of the op, or an
algebraic identity) where onnxruntime's CPU kernel for the original is measurably slower; the
measurement is in the pass's docstring. They run on finished graphs (after the gradient), so
gradient rules see the original ops.
"""

from passes.kernels.softmax_cross_entropy import SplitSoftmaxCrossEntropyPass

__all__ = ["SplitSoftmaxCrossEntropyPass"]
