"""Rewrites for the runtime's kernels: the same values, computed by faster kernels.

Each pass replaces a pattern by an equivalent one (the ONNX definition of the op, or an
algebraic identity) where onnxruntime's CPU kernel for the original is measurably slower; the
measurement is in the pass's docstring. Most run on finished graphs (after the gradient), so
gradient rules see the original ops; WholeScoresLossPass runs on the forward graph, because what
it saves is mostly the gradient of what it removes; ValidRowsLossPass too, after it (the rows
a cross-entropy ignores are not computed), and for the same reason GeluFusionPass (a written-out
GELU as one node) before them. DecomposeTrainingBatchNormPass is for a
runtime without the kernel (onnxruntime's CUDA provider), before the gradient. DropoutNoisePass
is for a caller that feeds a training Dropout's noise (ORTModule), before the gradient.
"""

from onnx_ir.passes import PassBase

from passes.kernels.batch_norm_training import DecomposeTrainingBatchNormPass
from passes.kernels.conv_weight_gemm import ConvGemmOptions, ConvWeightGemmPass
from passes.kernels.dropout_noise import NOISE_KEY, DropoutNoisePass, NoiseInput, noise_inputs
from passes.kernels.gelu import GeluFusionPass
from passes.kernels.scatter_accumulate import ScatterAddIntoSumPass
from passes.kernels.sliced_scores_loss import WholeScoresLossPass
from passes.kernels.softmax_cross_entropy import SplitSoftmaxCrossEntropyPass
from passes.kernels.valid_rows_loss import ValidRowsLossPass


def kernel_passes(gradient: bool = True) -> list[PassBase]:
    """The rewrites of finished graphs, in the order they run (``gradient``: those that find
    their pattern in gradient graphs only are left out when False)."""
    if not gradient:
        return [SplitSoftmaxCrossEntropyPass()]
    return [SplitSoftmaxCrossEntropyPass(), ScatterAddIntoSumPass(), ConvWeightGemmPass()]


__all__ = ["ConvGemmOptions", "ConvWeightGemmPass", "DecomposeTrainingBatchNormPass", "DropoutNoisePass", "GeluFusionPass", "ScatterAddIntoSumPass", "SplitSoftmaxCrossEntropyPass", "ValidRowsLossPass", "WholeScoresLossPass",
           "NOISE_KEY", "NoiseInput", "kernel_passes", "noise_inputs"]
