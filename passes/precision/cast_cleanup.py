"""Cast editing shared by the precision passes, and the reference's three cast reductions.

:class:`CastEditor` inserts Casts (marked ``Role.PRECISION``) next to the value they cast,
bypasses Casts, and retypes graph outputs while keeping their name and dtype. The reductions,
repeated by :class:`~passes.precision.cast_propagation.CastPropagationPass` until nothing
changes, each remove at least one Cast:

1. :func:`remove_unnecessary_casts`: a Cast to the type its (float) input already has;
2. :func:`fuse_sibling_casts`: Casts of one value to the same type become one (a Cast whose
   output is a graph output is left alone);
3. :func:`remove_back_to_back_casts`: ``Cast(low->fp32)`` followed by ``Cast(->low)`` cancels;
   followed by ``Cast(->fp32)`` the second Cast is redundant. ``fp32->low->fp32`` rounds, so it
   stays.

Only casts between float32 and the low type are touched (never a Cast from bool).
"""

from __future__ import annotations

import itertools

import onnx_ir as ir
from onnx_ir.passes import common

from passes.kernels._graph import DEFAULT_DOMAINS
from passes.marks import Role, mark
from passes.subgraphs import nested_graphs, node_subgraphs

F32 = ir.DataType.FLOAT
LOW_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def cast_to(node: ir.Node) -> ir.DataType | None:
    """The target type of a default-domain Cast node, else None."""
    if node.op_type != "Cast" or node.domain not in DEFAULT_DOMAINS or "to" not in node.attributes:
        return None
    return ir.DataType(node.attributes["to"].as_int())


def is_float_cast(node: ir.Node, low: ir.DataType, src: ir.DataType | None = None,
                  dst: ir.DataType | None = None) -> bool:
    """A Cast between float32 and ``low`` (``src`` / ``dst`` narrow it down)."""
    to = cast_to(node)
    if to is None or to not in (F32, low) or (dst is not None and to != dst):
        return False
    source = node.inputs[0].dtype if node.inputs and node.inputs[0] is not None else None
    return source in (F32, low) and (src is None or source == src)


def all_values(graph: ir.Graph) -> list[ir.Value]:
    values = list(graph.inputs) + list(graph.initializers.values())
    for node in ir.traversal.RecursiveGraphIterator(graph):
        values.extend(node.outputs)
        for sub in node_subgraphs(node):
            values.extend(list(sub.inputs) + list(sub.initializers.values()))
    return values


def subgraphs(graph: ir.Graph) -> list[ir.Graph]:
    """``graph`` and every graph nested in it."""
    return nested_graphs(graph)


def ensure_types(model: ir.Model) -> None:
    """Run ONNX type and shape inference when a node output of the model has no type."""
    if any(v.type is None for n in ir.traversal.RecursiveGraphIterator(model.graph)
           for v in n.outputs):
        common.ShapeInferencePass(strict_mode=False)(model)


def in_graph(value: ir.Value, graph: ir.Graph) -> bool:
    """Whether ``value`` is produced by a node of ``graph``."""
    producer = value.producer()
    return producer is not None and producer.graph is graph


class CastEditor:
    """Inserts and removes Casts in a model, with fresh value names and precision marks."""

    def __init__(self, model: ir.Model) -> None:
        self._names = {v.name for v in all_values(model.graph) if v.name}
        self._counter = itertools.count()
        self.inserted = 0
        self.removed = 0

    def fresh(self, base: str | None) -> str:
        while True:
            name = f"{base or 'value'}_{next(self._counter)}"
            if name not in self._names:
                self._names.add(name)
                return name

    def _place(self, node: ir.Node, value: ir.Value, graph: ir.Graph) -> None:
        producer = value.producer()
        if producer is not None and producer.graph is graph:
            graph.insert_after(producer, node)
        elif len(graph) > 0:
            graph.insert_before(next(iter(graph)), node)
        else:
            graph.append(node)

    def new_cast(self, value: ir.Value, to: ir.DataType, graph: ir.Graph) -> ir.Value:
        """A new ``Cast(value, to)`` placed right after ``value``'s producer in ``graph``."""
        node = ir.Node("", "Cast", [value], [ir.AttrInt64("to", int(to))], num_outputs=1,
                       name=self.fresh(f"{value.name}_cast"))
        mark(node, Role.PRECISION)
        out = node.outputs[0]
        out.name = self.fresh(f"{value.name}_{to.name.lower()}")
        out.type, out.shape = ir.TensorType(to), value.shape
        self._place(node, value, graph)
        self.inserted += 1
        return out

    def _take_over_output(self, old: ir.Value, new: ir.Value, graph: ir.Graph) -> None:
        """``new`` replaces ``old`` everywhere: consumers, graph output, name and marks."""
        self.move_output(old, new, graph)
        old.replace_all_uses_with(new)

    def bypass(self, cast: ir.Node, replacement: ir.Value, graph: ir.Graph) -> None:
        """Remove ``cast``; its consumers (and graph output) read ``replacement`` instead."""
        out = cast.outputs[0]
        if out.is_graph_output():
            if (in_graph(replacement, graph) and not replacement.is_graph_output()
                    and replacement.dtype == out.dtype):
                self._take_over_output(out, replacement, graph)
            else:
                ident = ir.Node("", "Identity", [replacement], num_outputs=1,
                                name=self.fresh(f"{out.name}_identity"))
                mark(ident, Role.PRECISION)
                ident.outputs[0].type, ident.outputs[0].shape = replacement.type, replacement.shape
                self._place(ident, replacement, graph)
                self._take_over_output(out, ident.outputs[0], graph)
        else:
            out.replace_all_uses_with(replacement)
        graph.remove(cast, safe=True)
        self.removed += 1

    def move_output(self, old: ir.Value, new: ir.Value, graph: ir.Graph) -> None:
        """``new`` takes ``old``'s place among ``graph``'s outputs, its name and its marks."""
        for i, out in enumerate(graph.outputs):
            if out is old:
                graph.outputs[i] = new
        name = old.name
        old.name = self.fresh(name)
        new.name = name
        for key, meta in old.metadata_props.items():
            new.metadata_props[key] = meta

    def retype(self, value: ir.Value, dtype: ir.DataType, graph: ir.Graph) -> None:
        """Give ``value`` type ``dtype``; as a graph output it keeps its name and old type."""
        if value.is_graph_output():
            self.move_output(value, self.new_cast(value, value.dtype or F32, graph), graph)
        value.type = ir.TensorType(dtype)


def _casts(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if cast_to(n) is not None]


def remove_unnecessary_casts(graph: ir.Graph, low: ir.DataType, edit: CastEditor) -> bool:
    modified = False
    for node in _casts(graph):
        if is_float_cast(node, low) and node.inputs[0].dtype == cast_to(node):  # type: ignore[union-attr]
            edit.bypass(node, node.inputs[0], graph)  # type: ignore[arg-type]
            modified = True
    return modified


def fuse_sibling_casts(graph: ir.Graph, low: ir.DataType, edit: CastEditor) -> bool:
    modified = False
    seen: set[int] = set()
    for node in _casts(graph):
        if id(node) in seen or not is_float_cast(node, low) or node.outputs[0].is_graph_output():
            continue
        source = node.inputs[0]
        assert source is not None
        siblings = [u.node for u in source.uses()
                    if u.node is not node and u.node.graph is graph and id(u.node) not in seen
                    and is_float_cast(u.node, low, dst=cast_to(node))
                    and not u.node.outputs[0].is_graph_output()]
        seen.add(id(node))
        for sibling in dict.fromkeys(siblings):  # ``node`` comes first in the sorted graph
            seen.add(id(sibling))
            edit.bypass(sibling, node.outputs[0], graph)
            modified = True
    return modified


def remove_back_to_back_casts(graph: ir.Graph, low: ir.DataType, edit: CastEditor) -> bool:
    modified = False
    for parent in _casts(graph):
        if parent.graph is not graph or not is_float_cast(parent, low, src=low, dst=F32):
            continue
        source, mid = parent.inputs[0], parent.outputs[0]
        assert source is not None
        for child in dict.fromkeys(u.node for u in mid.uses()):
            if child.graph is not graph or cast_to(child) not in (F32, low):
                continue
            edit.bypass(child, source if cast_to(child) == low else mid, graph)
            modified = True
        if not mid.uses() and not mid.is_graph_output():
            graph.remove(parent, safe=True)
            edit.removed += 1
    return modified
