"""EvalModePass: the inference form of a training-mode forward graph.

1. Dropout loses its ``training_mode`` input (inference Dropout is the identity);
2. BatchNormalization gets ``training_mode = 0`` and only its ``Y`` output (running
   statistics are read, not updated); its extra outputs must be unused by nodes (graph
   outputs of the top graph are removed, with the correction of the running variance to
   torch's: an eval graph updates no statistics);
3. LayerNormalization loses its Mean and InvStdDev outputs when nothing reads them (they were
   exposed for the gradient; without them onnxruntime may fuse it with the Add before it).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.forward.expose_running_stats import remove_corrections


class EvalModePass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Dropout" and len(node.inputs) > 2 and node.inputs[2] is not None:
                node.resize_inputs(2)
                modified = True
            elif (node.op_type == "BatchNormalization"
                  and node.attributes.get_int("training_mode", 0) != 0):
                if node.graph is model.graph:  # torch's unbiased update of the running variance
                    remove_corrections(model.graph, node)
                for extra in node.outputs[1:]:
                    if extra.is_graph_output() and not extra.uses() and extra in model.graph.outputs:
                        model.graph.outputs.remove(extra)
                    if extra.uses() or extra.is_graph_output():
                        raise ValueError(
                            f"BatchNormalization {node.name!r}: running-statistic output "
                            f"{extra.name!r} is used, cannot switch it to inference mode "
                            f"(by {[(u.node.op_type, u.node.name) for u in extra.uses()]})")
                node.attributes["training_mode"] = ir.AttrInt64("training_mode", 0)
                node.resize_outputs(1)
                modified = True
            elif (node.op_type == "LayerNormalization" and len(node.outputs) > 1
                  and not any(o.uses() or o.is_graph_output() for o in node.outputs[1:])):
                node.resize_outputs(1)  # the statistics the gradient read (ExposeNormStatsPass)
                modified = True
        return PassResult(model, modified)
