"""PrepareForGradientPass: the clean-up every forward graph gets before autodiff.

1. inline model-local functions (exporters emit them; rules see primitive ops);
2. fold small nodes computed from Constant nodes only (shape arguments become constants);
3. expose the masks of training-mode Dropout nodes;
4. sort topologically, type sequence outputs, infer types and shapes (rules read them).

Initializers, graph inputs and outputs are kept: the forward model computes what it did.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx_ir.passes import InPlacePass, PassResult, Sequential

from passes.expose_dropout_mask import ExposeDropoutMaskPass
from passes.fold_constants import FoldConstantsPass
from passes.sequence_types import TypeSequenceOutputsPass


class PrepareForGradientPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        steps = Sequential(
            common.InlinePass(),
            common.RemoveUnusedFunctionsPass(),
            common.TopologicalSortPass(),
            FoldConstantsPass(),
            ExposeDropoutMaskPass(),
            TypeSequenceOutputsPass(),
            common.ShapeInferencePass(strict_mode=False),
        )
        result = steps(model)
        return PassResult(result.model, result.modified)
