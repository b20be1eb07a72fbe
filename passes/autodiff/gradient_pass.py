"""GradientPass: add the gradient graph of a loss to a model (see passes.autodiff)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff import GradientOptions, build_gradient
from passes.marks import Role, mark_unmarked


class GradientPass(InPlacePass):
    """Adds ``<w>_grad`` outputs holding d loss / d w for each trained value ``w``.

    The model's own nodes are marked ``forward``, the new ones ``backward`` (with the forward
    node each differentiates, see :mod:`passes.marks`); unnamed nodes get names first.
    """

    def __init__(self, loss: str, weights: Sequence[str] | None = None,
                 options: GradientOptions | None = None) -> None:
        super().__init__()
        self.loss = loss
        self.weights = None if weights is None else list(weights)
        self.options = options or GradientOptions()
        self.gradients: dict[str, ir.Value] = {}

    def call(self, model: ir.Model) -> PassResult:
        common.NameFixPass()(model)
        mark_unmarked(model.graph, Role.FORWARD)
        self.gradients = build_gradient(model, self.loss, self.weights, self.options)
        return PassResult(model, bool(self.gradients))
