"""Marks that passes leave on the nodes they emit, so that later passes read roles from the IR.

Every node carries, in ``node.metadata_props``:

1. ``gradgraph.stage``: the role of the node in a training graph, one of :class:`Role`
   (``forward`` for the model's own nodes, ``backward`` for gradient nodes, ``recompute`` for
   forward nodes cloned into the backward, ``optimizer`` for update, clipping, accumulation and
   loss-scaling nodes, ``precision`` for casts inserted by the precision passes);
2. ``gradgraph.grad_of`` (backward nodes emitted by a node's gradient rule): the name of the
   forward node they differentiate;
3. ``gradgraph.recompute_of`` (recompute clones): the name of the forward node they copy.

Unmarked nodes of a model are forward nodes (:func:`role_of`).

Values that later stages look for carry ``gradgraph.gradient_of`` (a gradient output: the name
of the value it is the gradient of) or ``gradgraph.output`` (one of :class:`OutputRole`: the
optimizer's finite flag, the global gradient norm, the loss scale) in ``value.metadata_props``;
:func:`find_output` and :func:`gradient_outputs` read them.
"""

from __future__ import annotations

import enum

import onnx_ir as ir

STAGE_KEY = "gradgraph.stage"
GRAD_OF_KEY = "gradgraph.grad_of"
RECOMPUTE_OF_KEY = "gradgraph.recompute_of"
GRADIENT_OF_KEY = "gradgraph.gradient_of"
# On initializers a training graph holds as state: "trained", "frozen" or "buffer".
HELD_KEY = "gradgraph.held"
OUTPUT_KEY = "gradgraph.output"


class Role(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"
    PRECISION = "precision"


def role_of(node: ir.Node) -> Role:
    """The node's mark; an unmarked node is a forward node."""
    value = node.metadata_props.get(STAGE_KEY)
    return Role(value) if value else Role.FORWARD


def mark(node: ir.Node, role: Role, **extra: str) -> None:
    """Set ``node``'s role (and ``grad_of=`` / ``recompute_of=`` style extra marks)."""
    node.metadata_props[STAGE_KEY] = role.value
    for key, value in extra.items():
        node.metadata_props[f"gradgraph.{key}"] = value


def mark_unmarked(graph: ir.Graph, role: Role) -> int:
    """Mark every node of ``graph`` that has no role yet; returns how many were marked."""
    count = 0
    for node in graph:
        if STAGE_KEY not in node.metadata_props:
            node.metadata_props[STAGE_KEY] = role.value
            count += 1
    return count


class OutputRole(str, enum.Enum):
    STEP_FINITE = "step_finite"
    ALL_GRADIENTS_FINITE = "all_gradients_finite"
    GRAD_NORM = "global_gradient_norm"
    LOSS_SCALE = "loss_scale"
    SCALED_LOSS = "scaled_loss"


def gradient_outputs(graph: ir.Graph) -> dict[str, ir.Value]:
    """{name of x: the graph output holding d loss / d x}, from the ``gradient_of`` marks."""
    return {v.metadata_props[GRADIENT_OF_KEY]: v for v in graph.outputs
            if GRADIENT_OF_KEY in v.metadata_props}


def find_output(graph: ir.Graph, role: OutputRole) -> ir.Value | None:
    """The graph output marked with ``role``, if any."""
    return next((v for v in graph.outputs if v.metadata_props.get(OUTPUT_KEY) == role.value), None)
