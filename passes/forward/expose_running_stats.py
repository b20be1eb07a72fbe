"""ExposeRunningStatsPass: output the running statistics a training-mode BatchNormalization updates.

1. for each BatchNormalization with ``training_mode = 1`` whose ``input_mean`` / ``input_var``
   are graph inputs or initializers, outputs 1 and 2 are named ``<input name><suffix>`` and
   appended to the graph outputs (a runtime feeds them back as the next step's inputs);
2. a node marked ``RUNNING_VAR_KEY = "unbiased"`` (torch's BatchNorm, see
   :mod:`passes.exports.conventions`) has its running-variance update corrected to torch's:
   ONNX computes ``new = m * var + (1 - m) * batch_var`` with the biased batch variance, torch
   with the unbiased one, so the exposed value is ``m * var + (new - m * var) * n / (n - 1)``
   (``n`` the elements per channel, computed from the input's shape at run time; ``n = 1`` is
   left uncorrected). onnxruntime may write the updated variance into the input's buffer, so
   the BatchNorm reads ``max(var, min(m * var, var))`` (equal to ``var``) and runs after
   ``m * var`` is taken. The correction nodes carry ``CORRECTION_OF_KEY`` = the BatchNorm's
   name (:func:`remove_corrections` drops them, for an inference graph);
3. ``self.stats`` maps each such statistic name to its output value.

Idempotent: a statistic whose ``<name><suffix>`` is already a graph output is only recorded.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.builder import OpBuilder, scope_taken_names
from passes.exports.conventions import CORRECTION_OF_KEY, RUNNING_VAR_KEY, running_stat_input


class ExposeRunningStatsPass(InPlacePass):
    def __init__(self, suffix: str = ".out") -> None:
        super().__init__()
        self.suffix = suffix
        self.stats: dict[str, ir.Value] = {}

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        exposed = {v.name: v for v in graph.outputs}
        for node in list(graph):
            if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
                continue
            if not node.attributes.get_int("training_mode", 0) or len(node.inputs) < 5:
                continue
            if len(node.outputs) < 3:
                node.resize_outputs(3)
            for index, (stat, out) in enumerate(zip(node.inputs[3:5], node.outputs[1:3], strict=True)):
                stat = running_stat_input(stat)  # corrected by an earlier run: through its Max
                if stat is None or not (stat.is_graph_input() or stat.is_initializer()):
                    continue
                name = stat.name
                assert name is not None, "graph inputs and initializers are named"
                if name in self.stats:
                    raise ValueError(f"running statistic {name!r} is updated by two nodes")
                existing = exposed.get(name + self.suffix)
                if existing is not None:  # exposed by an earlier run
                    self.stats[name] = existing
                    continue
                if index == 1 and node.metadata_props.get(RUNNING_VAR_KEY) == "unbiased":
                    out = _unbiased_update(model, node, stat, out)
                out.name = name + self.suffix
                out.type, out.shape = stat.type, stat.shape
                if not out.is_graph_output():
                    graph.outputs.append(out)
                self.stats[name] = out
                modified = True
        return PassResult(model, modified)


def _unbiased_update(model: ir.Model, node: ir.Node, var: ir.Value, new: ir.Value) -> ir.Value:
    """The value ``m * var + (new - m * var) * n / max(n - 1, 1)``, computed after ``node``."""
    x = node.inputs[0]
    assert x is not None
    if not new.name:
        new.name = f"{node.name}/running_var"
    opset = model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx", 13)
    b = OpBuilder(opset, dict(model.opset_imports))
    b.prefix = f"{node.name}/unbiased_var"
    b.marks = {CORRECTION_OF_KEY: node.name or ""}
    dtype = var.dtype or ir.DataType.FLOAT
    momentum = node.attributes.get_float("momentum", 0.9)
    kept = b.Mul(b.wrap(var), b.const(momentum, dtype))
    # onnxruntime's BatchNormalization may write its running-variance output into its input's
    # buffer (seen: the graph input's), so ``var`` is read before it runs: the node reads
    # max(var, min(kept, var)) = var (0 <= kept <= var), which depends on ``kept``.
    ordered = b.Max(b.wrap(var), b.Min(kept, b.wrap(var)))
    before = list(b.nodes)
    count = b.Div(b.Size(b.wrap(x)), b.Gather(b.Shape(b.wrap(x)), b.const(np.array(1, np.int64)), axis=0))
    less_one = b.Max(b.Sub(count, b.const(np.array(1, np.int64))), b.const(np.array(1, np.int64)))
    factor = b.Div(b.Cast(count, to=int(dtype)), b.Cast(less_one, to=int(dtype)))
    corrected = b.Add(kept, b.Mul(b.Sub(b.wrap(new), kept), factor))
    scope_taken_names(model.graph, b.nodes, b.prefix)
    node.replace_input_with(4, ordered.value)
    model.graph.insert_before(node, before)
    model.graph.insert_after(node, [n for n in b.nodes if n not in before])
    return corrected.value


def _downstream(graph: ir.Graph, seeds: list[ir.Node], stop: ir.Node) -> list[ir.Node]:
    """``seeds`` and every node (but ``stop``) reading their values, transitively: the Casts a
    precision pass put inside the correction go with it."""
    found = {id(n): n for n in seeds}
    frontier = list(seeds)
    while frontier:
        for value in frontier.pop().outputs:
            for use in value.uses():
                user = use.node
                if user is not stop and id(user) not in found and user.graph is graph:
                    found[id(user)] = user
                    frontier.append(user)
    return [n for n in graph if id(n) in found]


def remove_corrections(graph: ir.Graph, node: ir.Node) -> None:
    """Drop the running-variance correction of ``node`` (and its graph output), with whatever
    another pass inserted inside it (Casts of cast propagation)."""
    nodes = [n for n in graph if n.metadata_props.get(CORRECTION_OF_KEY) == node.name]
    if nodes:
        nodes = _downstream(graph, nodes, node)
    read = node.inputs[4] if len(node.inputs) > 4 else None
    producer = read.producer() if read is not None else None
    while producer is not None and producer in nodes and producer.op_type == "Cast":
        producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
    if producer is not None and producer in nodes:  # the ordering Max: the node reads var again
        source = producer.inputs[0]
        if read is not None and source is not None and source.dtype != read.dtype:  # keep the type it read
            cast = ir.node("Cast", [source], attributes={"to": int(read.dtype)})  # type: ignore[arg-type]
            cast.outputs[0].type, cast.outputs[0].shape = read.type, read.shape
            graph.insert_before(node, cast)
            source = cast.outputs[0]
        node.replace_input_with(4, source)
    for n in nodes:
        for out in n.outputs:
            while out in graph.outputs:
                graph.outputs.remove(out)
    if nodes:
        graph.remove(nodes, safe=True)  # detaches their inputs' uses as well
