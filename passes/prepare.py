"""PrepareForGradientPass: the clean-up every forward graph gets before autodiff.

1. inline model-local functions (exporters emit them; rules see primitive ops);

Initializers and dead nodes are kept: the forward model stays as the user wrote it.
2. expose the masks of training-mode Dropout nodes;
3. sort topologically and infer types and shapes (rules and un-broadcasting read them).
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx_ir.passes import InPlacePass, PassResult, Sequential

from passes.expose_dropout_mask import ExposeDropoutMaskPass
from passes.sequence_types import TypeSequenceOutputsPass


class PrepareForGradientPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        steps = Sequential(
            common.InlinePass(),
            common.RemoveUnusedFunctionsPass(),
            ExposeDropoutMaskPass(),
            common.TopologicalSortPass(),
            TypeSequenceOutputsPass(),
            common.ShapeInferencePass(strict_mode=False),
        )
        result = steps(model)
        return PassResult(result.model, result.modified)
