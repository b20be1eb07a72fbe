"""PrepareForGradientPass: the clean-up every forward graph gets before autodiff.

1. inline model-local functions (exporters emit them; rules see primitive ops);
   recover torch parameters the exporter folded, mark torch's gradient conventions and
   classify float initializers as parameters, buffers or constants (``passes.exports``);
2. fold small nodes computed from Constant nodes only (shape arguments become constants);
3. expose the masks of training-mode Dropout nodes, LayerNormalization's mean and inverse
   standard deviation (its gradient reads them) and the running statistics that
   training-mode BatchNormalization updates (graph outputs ``<stat>.out``: onnxruntime's
   optimizer computes a training-mode BatchNormalization whose statistics go unused as an
   inference one);
4. sort topologically, type sequence outputs, infer types and shapes (rules read them; through
   onnxruntime's contrib ops too, :mod:`passes.forward.contrib_shapes`).

Initializers, graph inputs and outputs are kept: the forward model computes what it did.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx_ir.passes import InPlacePass, PassError, PassResult, Sequential

from passes.autodiff.errors import unwrap_pass_errors
from passes.exports import ClassifyWeightsPass, RecoverParametersPass, TorchConventionsPass
from passes.forward.contrib_shapes import ContribShapesPass
from passes.forward.expose_dropout_mask import ExposeDropoutMaskPass
from passes.forward.expose_norm_stats import ExposeNormStatsPass
from passes.forward.expose_running_stats import ExposeRunningStatsPass
from passes.forward.fold_constants import FoldConstantsPass
from passes.forward.sequence_types import TypeSequenceOutputsPass


class PrepareForGradientPass(InPlacePass):
    def __init__(self, strict_parameters: bool = True) -> None:
        super().__init__()
        # Refuse exports whose parameters were folded irreversibly (see RecoverParametersPass).
        self.strict_parameters = strict_parameters

    def call(self, model: ir.Model) -> PassResult:
        steps = Sequential(
            common.InlinePass(),
            common.RemoveUnusedFunctionsPass(),
            RecoverParametersPass(strict=self.strict_parameters),
            TorchConventionsPass(),
            ClassifyWeightsPass(),
            ExposeRunningStatsPass(),
            common.TopologicalSortPass(),
            FoldConstantsPass(),
            ExposeDropoutMaskPass(),
            ExposeNormStatsPass(),
            TypeSequenceOutputsPass(),
            common.ShapeInferencePass(strict_mode=False),
            ContribShapesPass(),  # through onnxruntime's contrib ops, which onnx does not know
            TypeSequenceOutputsPass(),  # what inference typed as tensors (element dtype unknown before)
        )
        try:
            result = steps(model)
        except PassError as exc:
            raise unwrap_pass_errors(exc) from exc
        return PassResult(result.model, result.modified)
