"""Gradients of control-flow ops: If.

The backward of ``If(cond)`` is another ``If(cond)``. Each of its branches recomputes
the forward branch body (a clone reading the same outer-scope values), differentiates
it with the engine (:class:`~passes.autodiff.engine.GraphGradient`) from the gradients
of the If outputs, and returns one gradient per captured value that needs one (zeros
where the branch does not depend on it), so both branches have the same outputs.
Loop and Scan have no rule (the engine reports the missing rule).
"""

from __future__ import annotations

import onnx_ir as ir

from passes.autodiff.builder import OpBuilder, Var
from passes.autodiff.engine import GraphGradient
from passes.autodiff.registry import grad_rule

_BRANCHES = ("then_branch", "else_branch")
# Index of the first captured value in the rule's input list (after ``cond``).
_FIRST_CAPTURED = 1


def _rename_all(graph: ir.Graph, tag: str) -> None:
    """Prefix every node and value name made inside ``graph`` (recursively) with ``tag``."""
    graph.name = tag
    for k, node in enumerate(ir.traversal.RecursiveGraphIterator(graph)):
        node.name = f"{tag}/{node.name or node.op_type}_{k}"
        for out in node.outputs:
            if out.name:
                out.name = f"{tag}/{out.name}"


def _check_outputs(body: ir.Graph) -> None:
    """Refuse branch outputs that are not produced inside the branch (outer values returned as is).

    onnx_ir loads such an output as a value unconnected to the outer one, so its gradient
    would be lost silently; onnxruntime refuses these models too.
    """
    for value in body.outputs:
        producer = value.producer()
        if producer is None or producer.graph is not body:
            raise ValueError(f"branch {body.name!r} returns {value.name!r}, which it does not compute; "
                             "put an Identity inside the branch (onnxruntime requires it as well)")


def _branch_gradient(b: OpBuilder, body: ir.Graph, out_grads: list[Var | None],
                     wanted: list[ir.Value], tag: str) -> ir.Graph:
    """A graph with no inputs whose outputs are d(loss)/d(wanted) through ``body``."""
    _check_outputs(body)
    clone = body.clone(allow_outer_scope_values=True)
    sub = OpBuilder(b.opset, b.opset_imports)
    sub.prefix = "grad"
    seeds = [(out, None if g is None else sub.wrap(g.value))
             for out, g in zip(clone.outputs, out_grads)]
    grads = GraphGradient(clone, seeds, wanted, sub).gradients()
    outputs = []
    for value, grad in zip(wanted, grads):
        if grad is None:
            grad = sub.zeros_like(sub.wrap(value))
        # Identity: a branch output must be produced inside the branch.
        result = sub.Identity(grad).value
        result.type = value.type
        result.shape = value.shape
        outputs.append(result)
    clone.extend(sub.nodes)
    clone.outputs.clear()
    clone.outputs.extend(outputs)
    _rename_all(clone, tag)
    return clone


@grad_rule("If")
def _if(b, n, g):
    """Gradients of the captured values through whichever branch ``cond`` selects."""
    captured = [v.value for v in n.captured]
    wanted_idx = [k for k in range(len(captured)) if n.needs_grad(_FIRST_CAPTURED + k)]
    result: list[Var | None] = [None] * (_FIRST_CAPTURED + len(captured))
    if not wanted_idx:
        return result
    wanted = [captured[k] for k in wanted_idx]
    branches = {
        name: _branch_gradient(b, n.node.attributes[name].value, g, wanted, b.fresh_name(name))
        for name in _BRANCHES
    }
    outs = b.If(n.inputs[0], _outputs=len(wanted), **branches)
    outs = outs if isinstance(outs, list) else [outs]
    for k, value, out in zip(wanted_idx, wanted, outs):
        out.value.type = value.type
        out.value.shape = value.shape
        result[_FIRST_CAPTURED + k] = out
    return result
