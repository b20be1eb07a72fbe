"""GradientPass: add the gradient graph of a loss to a model (see passes.autodiff)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff import GradientOptions, build_gradient


class GradientPass(InPlacePass):
    """Adds ``<w>_grad`` outputs holding d loss / d w for each trained value ``w``."""

    def __init__(self, loss: str, weights: Sequence[str] | None = None,
                 options: GradientOptions | None = None) -> None:
        super().__init__()
        self.loss = loss
        self.weights = None if weights is None else list(weights)
        self.options = options or GradientOptions()
        self.gradients: dict[str, ir.Value] = {}

    def call(self, model: ir.Model) -> PassResult:
        self.gradients = build_gradient(model, self.loss, self.weights, self.options)
        return PassResult(model, bool(self.gradients))
