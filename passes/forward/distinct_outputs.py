"""DistinctOutputsPass: every graph output its own value, computed by a node.

A module may return the same tensor twice (``return h, h``), or return one of its inputs or
parameters as it is. The ONNX graph then lists one value as several outputs, or an output that
no node computes. Passes that attach something per output (a gradient seed, a name, a mark)
need each output to be a distinct value with a producer:

1. an output that repeats an earlier output's value, or that is a graph input or an initializer,
   is replaced by ``Identity`` of it (named ``<name>_out<k>``, a name the graph does not use);
2. the outputs' order, types and shapes are kept; nothing else changes.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult


class DistinctOutputsPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        taken = {v.name for v in graph.inputs} | set(graph.initializers)
        for node in graph:
            taken.update(o.name for o in node.outputs)
        seen: set[int] = set()
        modified = False
        for index, output in enumerate(list(graph.outputs)):
            if id(output) not in seen and output.producer() is not None:
                seen.add(id(output))
                continue
            base, k = output.name or "output", 0
            name = f"{base}_out{k}"
            while name in taken:
                k += 1
                name = f"{base}_out{k}"
            node = ir.node("Identity", [output], name=f"{name}_identity")
            copy = node.outputs[0]
            copy.name, copy.type, copy.shape = name, output.type, output.shape
            taken.add(name)
            graph.append(node)
            graph.outputs[index] = copy
            seen.add(id(copy))
            modified = True
        return PassResult(model, modified)
