"""What the cleanup passes share: random-op and role guards, and a structural fingerprint.

The fingerprint is how the cleanup passes compute a truthful ``modified``: the structure of
the model (nodes, their input and output values, output names, attribute names and marks, the
graph signatures and initializer names, subgraphs included) before and after a step. It holds
the IR objects themselves (compared by identity), so a removed node cannot alias a new one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import onnx_ir as ir

from passes.marks import STAGE_KEY
from passes.subgraphs import node_subgraphs

ONNX_DOMAINS = frozenset({"", "ai.onnx"})
# Ops whose every run draws new numbers (Dropout is random only in training mode; see is_random).
RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})


def known_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's array when it is a constant (Constant node or initializer that no feed overrides)."""
    if value is None or value.is_graph_input():
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def subgraphs(node: ir.Node) -> Iterator[ir.Graph]:
    yield from node_subgraphs(node)


def is_random(node: ir.Node) -> bool:
    """Whether two runs of ``node`` on the same inputs may differ.

    1. RandomNormal(Like), RandomUniform(Like), Bernoulli, Multinomial;
    2. Dropout, unless its ``training_mode`` is absent or a constant false, or its ratio a
       constant 0 (then it is the identity and its mask all true);
    3. a node with a subgraph holding a random node.
    """
    if node.domain in ONNX_DOMAINS and node.op_type in RANDOM_OPS:
        return True
    if node.domain in ONNX_DOMAINS and node.op_type == "Dropout":
        training_input = node.inputs[2] if len(node.inputs) > 2 else None
        if training_input is None:
            return False
        training = known_array(training_input)
        ratio = known_array(node.inputs[1]) if len(node.inputs) > 1 else None
        off = training is not None and not training.any()
        return not (off or (ratio is not None and not ratio.any()))
    return any(is_random(inner) for graph in subgraphs(node) for inner in graph)


def has_role(node: ir.Node, roles: Iterable[str]) -> bool:
    """Whether ``node``'s ``gradgraph.stage`` mark is one of ``roles``."""
    return node.metadata_props.get(STAGE_KEY) in set(roles)


def fingerprint(model: ir.Model) -> tuple[object, ...]:
    """The model's structure, to compare before and after a step (see the module docstring)."""
    graph = model.graph
    return (tuple(graph.inputs), tuple(graph.initializers), _graph_fingerprint(graph))


def _graph_fingerprint(graph: ir.Graph) -> tuple[object, ...]:
    nodes: list[object] = []
    for node in graph:
        nodes.append((node, tuple(node.inputs), tuple((o, o.name) for o in node.outputs),
                      tuple(node.attributes), tuple(node.metadata_props.items()),
                      tuple(_graph_fingerprint(g) for g in subgraphs(node))))
    outputs = tuple((o, o.name, tuple(o.metadata_props.items())) for o in graph.outputs)
    return tuple(nodes), outputs
