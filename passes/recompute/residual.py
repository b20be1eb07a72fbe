"""Transformer layers found by structure: blocks that repeat along the residual stream.

Transformer-layer recompute uses this search when neither the reference's start / end edges
(Gelu and Dropout anchors) nor module scopes (node metadata, node names) find layers: an
export saved without metadata, with no Dropout nodes and the GELU written out as
Mul/Pow/Tanh, has neither. It reads the forward nodes only:

1. **boundaries**: a residual ``Add`` (both inputs computed, neither a constant) whose output
   a normalization reads, directly or through ``Cast``: ``LayerNormalization``,
   ``SimplifiedLayerNormalization``, ``RMSNormalization`` or their decomposition (a
   ``ReduceMean`` of the value, LayerNorm's mean; a ``ReduceMean`` of ``Pow(x, 2)`` or
   ``Mul(x, x)``, RMSNorm's); a ``SkipLayerNormalization`` /
   ``SkipSimplifiedLayerNormalization`` is a boundary itself (its Add is inside);
2. **streams**: each boundary's next is the first boundary (graph order) its outputs reach
   without passing another; following these links gives the residual streams (an
   encoder-decoder has two);
3. **segments**: the forward nodes on a path from one boundary's outputs to the next
   boundary (included), less those handing a value to a node outside the segment (a mask
   computed once and read by every layer is not part of the first one);
4. **layers**: the segments' op sequences must repeat. The period ``p`` (a pre-LN block has
   two residual Adds: attention and MLP, ``p = 2``) and offset giving the longest run of at
   least two equal groups of ``p`` consecutive segments win (ties: the smaller ``p``); each
   group is one layer. A stream with no such run has no layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from passes.marks import Role, role_of

NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization")
SKIP_NORM_OPS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")
# Ops a value may pass between the residual Add and its normalization.
NORM_PASS_THROUGH = ("Cast", "Identity")
MIN_REPEATS = 2


def _forward_users(value: ir.Value) -> list[ir.Node]:
    return [u.node for u in value.uses() if role_of(u.node) == Role.FORWARD]


def _constant(value: ir.Value | None) -> bool:
    if value is None or value.const_value is not None:
        return True
    producer = value.producer()
    return producer is None and value.graph is not None and value.name in value.graph.initializers \
        or producer is not None and producer.op_type == "Constant"


def _squares(node: ir.Node, value: ir.Value) -> bool:
    """``node`` is ``Pow(value, 2)`` or ``Mul(value, value)``."""
    if node.op_type == "Mul":
        return len(node.inputs) == 2 and node.inputs[0] is value and node.inputs[1] is value
    if node.op_type != "Pow" or len(node.inputs) != 2 or node.inputs[0] is not value:
        return False
    exponent = node.inputs[1]
    tensor = exponent.const_value if exponent is not None else None
    if tensor is None and exponent is not None and (p := exponent.producer()) is not None \
            and p.op_type == "Constant" and "value" in p.attributes:
        tensor = p.attributes["value"].value
    return tensor is not None and tensor.numpy().size == 1 and float(tensor.numpy().reshape(-1)[0]) == 2.0


def normalized_by(value: ir.Value) -> bool:
    """A normalization (op or decomposition, module docstring case 1) reads ``value``."""
    todo, seen = [value], set()
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for user in _forward_users(current):
            if user.op_type in NORM_OPS or user.op_type in SKIP_NORM_OPS:
                return True
            if user.op_type == "ReduceMean":
                return True
            if _squares(user, current) and user.outputs and any(
                    u.op_type == "ReduceMean" for u in _forward_users(user.outputs[0])):
                return True
            if user.op_type in NORM_PASS_THROUGH and user.outputs:
                todo.append(user.outputs[0])
    return False


def is_boundary(node: ir.Node) -> bool:
    """Case 1 of the module docstring."""
    if role_of(node) != Role.FORWARD:
        return False
    if node.op_type in SKIP_NORM_OPS:
        return True
    if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    return not any(_constant(v) for v in node.inputs) and normalized_by(node.outputs[0])


def _successors(node: ir.Node) -> list[ir.Node]:
    return [u for o in node.outputs for u in _forward_users(o)]


def _next_boundary(start: ir.Node, boundaries: set[int], position: dict[int, int]) -> ir.Node | None:
    """The first boundary (graph order) the outputs of ``start`` reach without passing another."""
    seen: set[int] = set()
    todo = _successors(start)
    found: list[ir.Node] = []
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in boundaries:
            found.append(node)
            continue
        todo.extend(_successors(node))
    return min(found, key=lambda n: position[id(n)], default=None)


def _segment(start: ir.Node, end: ir.Node, forward: Sequence[ir.Node]) -> list[ir.Node]:
    """Case 3 of the module docstring, in graph order."""
    above: set[int] = set()
    todo = _successors(start)
    while todo:
        node = todo.pop()
        if id(node) in above:
            continue
        above.add(id(node))
        if node is not end:
            todo.extend(_successors(node))
    below: set[int] = set()
    back = [end]
    while back:
        node = back.pop()
        if id(node) in below or node is start or id(node) not in above:
            continue
        below.add(id(node))
        back.extend(p for v in node.inputs if v is not None and (p := v.producer()) is not None)
    members = above & below
    nodes = [n for n in forward if id(n) in members]
    while True:  # drop nodes handing values outside the segment (the end hands the stream on)
        leaving = {id(n) for n in nodes if n is not end
                   and any(id(u) not in members for u in _successors(n))}
        if not leaving:
            return nodes
        members -= leaving
        nodes = [n for n in nodes if id(n) in members]


def _signature(nodes: Sequence[ir.Node]) -> tuple[tuple[str, str], ...]:
    return tuple((n.domain, n.op_type) for n in nodes)


def repeated_groups(signatures: Sequence[object]) -> tuple[int, int, int]:
    """``(period, offset, count)`` of the longest run of equal groups of ``period`` consecutive
    items (case 4 of the module docstring); ``count`` 0 when nothing repeats."""
    best = (0, 0, 0)
    n = len(signatures)
    for period in range(1, n // MIN_REPEATS + 1):
        for offset in range(period):
            groups = [tuple(signatures[i:i + period]) for i in range(offset, n - period + 1, period)]
            run_start, index = 0, 1
            while index <= len(groups):
                if index == len(groups) or groups[index] != groups[run_start]:
                    count = index - run_start
                    if count >= MIN_REPEATS and count * period > best[2] * best[0]:
                        best = (period, offset + run_start * period, count)
                    run_start = index
                index += 1
    return best


def residual_layers(graph: ir.Graph) -> list[list[ir.Node]]:
    """The layers of every residual stream of ``graph`` (module docstring), in graph order."""
    forward = [n for n in graph if role_of(n) == Role.FORWARD]
    position = {id(n): i for i, n in enumerate(forward)}
    boundaries = [n for n in forward if is_boundary(n)]
    ids = {id(n) for n in boundaries}
    following = {id(b): _next_boundary(b, ids, position) for b in boundaries}
    targets = {id(nxt) for nxt in following.values() if nxt is not None}
    layers: list[list[ir.Node]] = []
    for head in boundaries:
        if id(head) in targets:
            continue  # not the start of a stream
        chain = [head]
        while (nxt := following[id(chain[-1])]) is not None and nxt not in chain:
            chain.append(nxt)
        segments = [_segment(a, b, forward) for a, b in zip(chain, chain[1:])]
        period, start, count = repeated_groups([_signature(s) for s in segments])
        for index in range(count):
            first = start + index * period
            layers.append([n for seg in segments[first:first + period] for n in seg])
    return sorted(layers, key=lambda layer: position[id(layer[0])])
