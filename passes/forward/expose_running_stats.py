"""ExposeRunningStatsPass: output the running statistics a training-mode BatchNormalization updates.

1. for each BatchNormalization with ``training_mode = 1`` whose ``input_mean`` / ``input_var``
   are graph inputs or initializers, outputs 1 and 2 are named ``<input name><suffix>`` and
   appended to the graph outputs (a runtime feeds them back as the next step's inputs);
2. ``self.stats`` maps each such statistic name to its output value.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult


class ExposeRunningStatsPass(InPlacePass):
    def __init__(self, suffix: str = ".out") -> None:
        super().__init__()
        self.suffix = suffix
        self.stats: dict[str, ir.Value] = {}

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
                continue
            if not node.attributes.get_int("training_mode", 0) or len(node.inputs) < 5:
                continue
            if len(node.outputs) < 3:
                node.resize_outputs(3)
            for stat, out in zip(node.inputs[3:5], node.outputs[1:3], strict=True):
                if stat is None or not (stat.is_graph_input() or stat.is_initializer()):
                    continue
                name = stat.name
                assert name is not None, "graph inputs and initializers are named"
                if name in self.stats:
                    raise ValueError(f"running statistic {name!r} is updated by two nodes")
                out.name = name + self.suffix
                out.type, out.shape = stat.type, stat.shape
                if not out.is_graph_output():
                    graph.outputs.append(out)
                self.stats[name] = out
                modified = True
        return PassResult(model, modified)
