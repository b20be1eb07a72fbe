"""VjpSeedPass: turn a model with several outputs into one whose "loss" is a vector-Jacobian product.

What torch's autograd asks of a function is a VJP: given the gradients ``g_i`` of the outputs
``o_i``, the gradients of the inputs ``sum_i g_i . d o_i / d x``. That is the gradient of the
scalar ``vjp = sum_i ReduceSum(o_i * g_i)`` with the ``g_i`` held constant, so the VJP of any
model is its ordinary gradient graph after this pass:

1. for each floating-point graph output ``o_i`` (or those named), a graph input
   ``<o_i>_grad_output`` of the same type and shape is added (the seed, fed by the caller);
2. nodes computing ``vjp`` are added and marked ``backward`` (:mod:`passes.marks`): they read
   the seeds, which exist only when the backward runs, so a split puts them on the backward side;
3. ``self.seeds`` maps each output to its seed input, ``self.loss`` names the scalar to
   differentiate (pass it to :class:`passes.autodiff.GradientPass`).

The ``vjp`` value itself is not a graph output; only its gradient is used. Outputs that are not
floating point (indices, masks) get no seed: their gradient is zero by definition.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.marks import Role, mark

FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
SEED_SUFFIX = "_grad_output"
VJP_KEY = "gradgraph.vjp"


class VjpSeedPass(InPlacePass):
    def __init__(self, outputs: Sequence[str] | None = None, loss: str = "gradgraph_vjp") -> None:
        super().__init__()
        self.outputs = None if outputs is None else list(outputs)
        self.loss = loss
        self.seeds: dict[str, str] = {}

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        if VJP_KEY in graph.metadata_props:  # idempotent: the seeds are there already
            self.loss = graph.metadata_props[VJP_KEY]
            self.seeds = {o.name or "": (o.name or "") + SEED_SUFFIX for o in graph.outputs
                          if any(i.name == (o.name or "") + SEED_SUFFIX for i in graph.inputs)}
            return PassResult(model, False)
        names = {v.name for v in graph.inputs} | set(graph.initializers)
        for node in graph:
            names.update(v.name for v in node.outputs)
        wanted = None if self.outputs is None else set(self.outputs)
        if wanted is not None:
            missing = wanted - {o.name for o in graph.outputs}
            if missing:
                raise ValueError(f"VjpSeedPass: {sorted(missing)} are not graph outputs; the graph "
                                 f"outputs are {[o.name for o in graph.outputs]}")
        if self.loss in names:
            raise ValueError(f"VjpSeedPass: the model already has a value named {self.loss!r}; "
                             "pass another loss= name")
        terms: list[ir.Value] = []
        for output in graph.outputs:
            if wanted is not None and output.name not in wanted:
                continue
            if output.dtype not in FLOAT_TYPES or output.producer() is None:
                continue
            seed_name = f"{output.name}{SEED_SUFFIX}"
            if seed_name in names:
                raise ValueError(f"VjpSeedPass: the model already has a value named {seed_name!r}")
            seed = ir.Value(name=seed_name, type=output.type, shape=output.shape)
            graph.inputs.append(seed)
            product = self._node(graph, "Mul", [output, seed], f"{output.name}_vjp_mul")
            terms.append(self._node(graph, "ReduceSum", [product], f"{output.name}_vjp_sum",
                                    keepdims=0))
            self.seeds[output.name or ""] = seed_name
        if not terms:
            raise ValueError("VjpSeedPass: no floating-point graph output to differentiate")
        total = terms[0] if len(terms) == 1 else self._node(graph, "Sum", terms, "vjp_total")
        total.name = self.loss
        graph.metadata_props[VJP_KEY] = self.loss
        return PassResult(model, True)

    @staticmethod
    def _node(graph: ir.Graph, op: str, inputs: list[ir.Value], name: str, **attributes: int) -> ir.Value:
        node = ir.node(op, inputs, attributes=attributes, name=name)
        mark(node, Role.BACKWARD)
        graph.append(node)
        out = node.outputs[0]
        out.name = f"{name}_out"
        out.type = inputs[0].type
        out.shape = ir.Shape([]) if op != "Mul" else inputs[0].shape
        return out
