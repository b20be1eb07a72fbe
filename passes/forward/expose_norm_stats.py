"""ExposeNormStatsPass: give every LayerNormalization its Mean and InvStdDev outputs.

LayerNormalization computes the mean and the inverse standard deviation of each normalized
group anyway; as outputs ([..., 1, ...] shaped, float32 for the default ``stash_type``) they
are a few kB. The gradient rule reads them instead of recomputing both from the input (two
reductions and two elementwise passes over the input per LayerNormalization: on the benchmark
models' [1024, 256] activations, ~0.3 ms of a step per LayerNormalization), as onnxruntime-
training's LayerNormalizationGrad does. Unnamed outputs get ``<Y>_mean`` / ``<Y>_inv_std_dev``;
named ones are left as they are. A ``stash_type`` other than float32 is left alone (its
statistics would not be float32, and onnxruntime's CPU kernels refuse them as outputs). The
forward values are unchanged.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

_STASH_FLOAT = 1


class ExposeNormStatsPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        modified = False
        taken = {v.name for v in model.graph.inputs} | set(model.graph.initializers)
        taken |= {o.name for n in ir.traversal.RecursiveGraphIterator(model.graph) for o in n.outputs if o.name}
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx"):
                continue
            x = node.inputs[0]
            if x is None or len(node.outputs) == 0 or not node.outputs[0].name:
                continue
            stash = node.attributes.get("stash_type")
            if stash is not None and stash.as_int() != _STASH_FLOAT:
                # onnxruntime's CPU kernels refuse other stash types with these outputs (float16,
                # float64: type errors, not implemented); the rule recomputes the statistics.
                continue
            if len(node.outputs) < 3:
                node.resize_outputs(3)
            for out, suffix in ((node.outputs[1], "mean"), (node.outputs[2], "inv_std_dev")):
                if out.name:
                    continue
                name, k = f"{node.outputs[0].name}_{suffix}", 0
                while name in taken:
                    k += 1
                    name = f"{node.outputs[0].name}_{suffix}_{k}"
                out.name = name
                taken.add(name)
                out.type = ir.TensorType(ir.DataType.FLOAT)
                modified = True
        return PassResult(model, modified)
