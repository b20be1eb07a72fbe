"""GradientPass: add the gradient graph of a loss to a model (see passes.autodiff)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff import GradientOptions, build_gradient
from passes.marks import Role, gradient_outputs, mark_unmarked

GRADIENT_LOSS_KEY = "gradgraph.gradient_loss"


class GradientPass(InPlacePass):
    """Adds ``<w>_grad`` outputs holding d loss / d w for each trained value ``w``.

    The model's own nodes are marked ``forward``, the new ones ``backward`` (with the forward
    node each differentiates, see :mod:`passes.marks`); unnamed nodes get names first. The graph
    records the loss it was differentiated for (graph metadata ``gradgraph.gradient_loss``); a
    model that already holds gradient outputs (marked ``gradient_of``) of that loss for every
    requested weight is left alone: the pass is idempotent (``self.gradients`` then holds the
    existing ones).
    """

    def __init__(self, loss: str, weights: Sequence[str] | None = None,
                 options: GradientOptions | None = None) -> None:
        super().__init__()
        self.loss = loss
        self.weights = None if weights is None else list(weights)
        self.options = options or GradientOptions()
        self.gradients: dict[str, ir.Value] = {}

    def call(self, model: ir.Model) -> PassResult:
        existing = gradient_outputs(model.graph)
        same_loss = model.graph.metadata_props.get(GRADIENT_LOSS_KEY) == self.loss
        if existing and same_loss and (self.weights is None or set(self.weights) <= set(existing)):
            self.gradients = existing
            return PassResult(model, False)
        model.graph.metadata_props[GRADIENT_LOSS_KEY] = self.loss
        common.NameFixPass()(model)
        mark_unmarked(model.graph, Role.FORWARD)
        self.gradients = build_gradient(model, self.loss, self.weights, self.options)
        return PassResult(model, bool(self.gradients))
