"""Stashed activations of a forward+backward graph, and their sizes.

A stash is a value the runtime keeps alive from the forward until the backward:

1. produced by a forward node (graph inputs, initializers and ``Constant`` outputs are not
   activations: they are alive for the whole run anyway), and
2. read by a backward or a recompute node (:mod:`passes.marks`) for more than its shape (a
   ``Shape``/``Size`` reader runs in the forward of a split graph, :mod:`passes.split`), and
3. not a graph output (those are kept to the end regardless).

Sizes come from the values' static shapes; a symbolic dim is looked up in ``dims``, else the
size is unknown (``None``). Reference: ORT's memory optimizer (``memory_optimizer/*``) takes
as candidates the forward outputs consumed by both forward and backward nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import onnx_ir as ir

from passes.marks import Role, role_of

READS_STASH = frozenset({Role.BACKWARD, Role.RECOMPUTE})


@dataclasses.dataclass(frozen=True)
class Stash:
    value: ir.Value
    producer: ir.Node
    nbytes: int | None
    consumers: tuple[ir.Node, ...]

    @property
    def name(self) -> str:
        return self.value.name or ""


def value_bytes(value: ir.Value, dims: Mapping[str, int] | None = None) -> int | None:
    """Bytes of a tensor value, ``None`` when its dtype or a dim is unknown."""
    if value.dtype is None or value.shape is None:
        return None
    count = 1
    for dim in value.shape:
        if isinstance(dim, int):
            count *= dim
        elif dims is not None and dim.value is not None and dim.value in dims:
            count *= dims[dim.value]
        else:
            return None
    try:
        itemsize = value.dtype.itemsize
    except (AttributeError, TypeError, ValueError):
        return None
    return int(count * itemsize)


def is_activation_producer(node: ir.Node) -> bool:
    """A forward node whose outputs count as activations (not a ``Constant``)."""
    return role_of(node) == Role.FORWARD and not (node.op_type == "Constant" and not node.inputs)


def stashed_values(model: ir.Model | ir.Graph,
                   dims: Mapping[str, int] | None = None) -> list[Stash]:
    """The forward activations that backward (or recompute) nodes read, in node order."""
    graph = model.graph if isinstance(model, ir.Model) else model
    outputs = {id(v) for v in graph.outputs}
    stashes = []
    for node in graph:
        if not is_activation_producer(node):
            continue
        for value in node.outputs:
            if id(value) in outputs:
                continue
            readers = _readers(value)
            if readers:
                stashes.append(Stash(value, node, value_bytes(value, dims), readers))
    return stashes


# Readers that need only a value's shape or dtype: they run in the forward when the graph is
# split (passes.split), so they do not keep the tensor alive.
SHAPE_ONLY_READERS = frozenset({"Shape", "Size"})


def _readers(value: ir.Value) -> tuple[ir.Node, ...]:
    seen: dict[int, ir.Node] = {}
    for use in value.uses():
        node = use.node
        if role_of(node) not in READS_STASH:
            continue
        if node.op_type in SHAPE_ONLY_READERS and node.domain in ("", "ai.onnx"):
            continue
        seen.setdefault(id(node), node)
    return tuple(seen.values())


def total_stash_bytes(stashes: Iterable[Stash] | ir.Model,
                      dims: Mapping[str, int] | None = None) -> tuple[int, int]:
    """(bytes of the stashes of known size, how many have an unknown size)."""
    items = stashed_values(stashes, dims) if isinstance(stashes, ir.Model) else stashes
    known, unknown = 0, 0
    for stash in items:
        if stash.nbytes is None:
            unknown += 1
        else:
            known += stash.nbytes
    return known, unknown


def live_bytes_profile(model: ir.Model | ir.Graph, dims: Mapping[str, int] | None = None,
                       order: Iterable[ir.Node] | None = None) -> list[int]:
    """Bytes of node outputs alive after each node, running in ``order`` (default: graph order).

    A value is alive from its producer until its last reader (graph outputs: to the end);
    inputs and initializers are not counted, nor values of unknown size. This is what a
    runtime that frees each tensor after its last use in this order keeps allocated.
    """
    graph = model.graph if isinstance(model, ir.Model) else model
    nodes = list(graph if order is None else order)
    position = {id(n): i for i, n in enumerate(nodes)}
    outputs = {id(v) for v in graph.outputs}
    frees: dict[int, int] = {}
    live, profile = 0, []
    for index, node in enumerate(nodes):
        for value in node.outputs:
            size = value_bytes(value, dims) or 0
            last = max((position.get(id(u.node), index) for u in value.uses()), default=index)
            if id(value) in outputs:
                last = len(nodes)
            live += size
            frees[last] = frees.get(last, 0) + size
        profile.append(live)
        live -= frees.pop(index, 0)
    return profile
