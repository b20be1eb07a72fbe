"""LossScalePass: multiply the loss by a ``loss_scale`` input before differentiation.

Reference: onnxruntime's mixed-precision transformer (``loss_scale`` input, ``scaled_loss =
Mul(loss, loss_scale)``, backprop from ``scaled_loss``); the unscaling and the dynamic scaler
are in :class:`passes.optimizer.optimizer_pass.OptimizerPass` (``UpdateOptions.loss_scale``).

1. adds the float scalar input ``scale`` (marked ``loss_scale``) and the output
   ``scaled = loss * Cast(scale)`` (marked ``scaled_loss``), the loss staying an output;
2. a model that already has the ``scaled`` output is left alone (idempotent).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.builder import OpBuilder, scope_taken_names
from passes.marks import OUTPUT_KEY, STAGE_KEY, OutputRole, Role


class LossScalePass(InPlacePass):
    def __init__(self, loss: str, scale: str = "loss_scale", scaled: str = "scaled_loss") -> None:
        super().__init__()
        self.loss, self.scale, self.scaled = loss, scale, scaled

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if any(v.name == self.scaled for v in graph.outputs):
            return PassResult(model, False)
        loss = next((v for v in graph.outputs if v.name == self.loss), None)
        if loss is None:
            raise ValueError(f"loss {self.loss!r} is not a graph output")
        opset = model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx", 13)
        b = OpBuilder(opset, dict(model.opset_imports))
        b.prefix = "loss_scale"
        b.marks = {STAGE_KEY: Role.OPTIMIZER.value}
        scale = ir.Value(name=self.scale, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([]))
        scale.metadata_props[OUTPUT_KEY] = OutputRole.LOSS_SCALE.value
        graph.inputs.append(scale)
        scaled = b.Mul(b.wrap(loss), b.cast_to(b.wrap(scale), loss.dtype)).value
        scaled.name = self.scaled
        scaled.type, scaled.shape = loss.type, loss.shape
        scaled.metadata_props[OUTPUT_KEY] = OutputRole.SCALED_LOSS.value
        scope_taken_names(graph, b.nodes, b.prefix)
        graph.extend(b.nodes)
        graph.outputs.append(scaled)
        return PassResult(model, True)
