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
   onnxruntime's contrib ops too, :mod:`passes.forward.contrib_shapes`). A graph output's
   declared shape is checked against the inferred one: where they contradict each other (a
   rank or a fixed size differs; torch 2.13's dynamo export declares a per-sample loss
   ``[]``), the inferred shape is kept, with a warning naming the output (rules and
   reductions that trusted ``[]`` gave wrong gradients or graphs onnxruntime refused).

Initializers, graph inputs and outputs are kept: the forward model computes what it did.
"""

from __future__ import annotations

import warnings

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx_ir.passes import InPlacePass, PassError, PassResult, Sequential

from passes.autodiff.errors import unwrap_pass_errors
from passes.exports import ClassifyWeightsPass, RecoverParametersPass, TorchConventionsPass
from passes.forward.contrib_shapes import ContribShapesPass, infer_node, opsets_of
from passes.forward.expose_dropout_mask import ExposeDropoutMaskPass
from passes.forward.expose_norm_stats import ExposeNormStatsPass
from passes.forward.expose_running_stats import ExposeRunningStatsPass
from passes.forward.fold_constants import FoldConstantsPass
from passes.forward.sequence_types import TypeSequenceOutputsPass


class PrepareForGradientPass(InPlacePass):
    def __init__(self, strict_parameters: bool = True, frozen: frozenset[str] = frozenset()) -> None:
        super().__init__()
        # Refuse exports whose parameters were folded irreversibly (see RecoverParametersPass),
        # but those held fixed (``frozen``) and gone from the file.
        self.strict_parameters = strict_parameters
        self.frozen = frozen

    def call(self, model: ir.Model) -> PassResult:
        steps = Sequential(
            common.InlinePass(),
            common.RemoveUnusedFunctionsPass(),
            RecoverParametersPass(strict=self.strict_parameters, frozen=self.frozen),
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
        corrected = _check_declared_shapes(result.model)
        return PassResult(result.model, result.modified or corrected)


def _contradicts(declared: ir.Shape, inferred: ir.Shape) -> bool:
    return len(declared) != len(inferred) or any(
        isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(declared, inferred))


def _check_declared_shapes(model: ir.Model) -> bool:
    """A graph output whose producer's inference (that node alone, from its inputs' inferred
    shapes: onnx's graph inference keeps a declared output shape) contradicts its declared
    shape takes the inferred one, with a warning. Changed any?"""
    opsets = opsets_of(model)
    corrected = False
    for value in model.graph.outputs:
        node, shape = value.producer(), value.shape
        if node is None or shape is None or node.domain not in ("", "ai.onnx"):
            continue
        found = infer_node(node, opsets).get(value.name or "")
        inferred = ir.serde.deserialize_type_proto_for_shape(found) if found is not None else None
        if inferred is None or not _contradicts(shape, inferred):
            continue
        value.shape = inferred
        corrected = True
        warnings.warn(f"graph output {value.name!r} is declared with shape {[str(d) for d in shape]} but "
                      f"the graph computes shape {[str(d) for d in value.shape]}; the computed shape is "
                      "used (fix the declaration in the model: torch 2.13's exporter declares a "
                      "per-sample loss as a scalar)", UserWarning, stacklevel=2)
    return corrected
