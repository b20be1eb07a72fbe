"""Applies the analysis' edits: new shape entries, rebuilt constants, the batch size N."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from passes.batching.state import (
    Edit,
    N,
    as_numpy,
)


class Emitter:
    """Builds what each edit needs (N is ``Shape(source)[0]``, made once) and rewires the input."""

    def __init__(self, graph: ir.Graph, source: ir.Value) -> None:
        self.graph, self.source = graph, source
        self.taken = {v.name for n in graph for v in n.outputs} | {v.name for v in graph.inputs}
        self.taken |= set(graph.initializers)
        self._n: dict[bool, ir.Value] = {}

    def apply(self, edits: dict[tuple[ir.Node, int], Edit]) -> None:
        order = {node: i for i, node in enumerate(self.graph)}
        built: dict[tuple[ir.Value, Edit], ir.Value] = {}  # consumers of one constant share its rewrite
        for (node, index), edit in sorted(edits.items(), key=lambda item: (order[item[0][0]], item[0][1])):
            old = node.inputs[index]
            assert old is not None
            if (old, edit) not in built:
                built[(old, edit)] = self.build(node, old, edit)
            new = built[(old, edit)]
            node.replace_input_with(index, new)
            if old.is_initializer() and not old.uses() and not old.is_graph_output():
                self.graph.initializers.pop(old.name or "")
            self.remove_dead(old)

    def remove_dead(self, value: ir.Value) -> None:
        """Remove the producer of ``value`` and its constant-only inputs once nothing reads them."""
        producer = value.producer()
        if producer is None or producer.graph is not self.graph or any(
                o.uses() or o.is_graph_output() for o in producer.outputs):
            return
        inputs = [v for v in producer.inputs if v is not None]
        self.graph.remove(producer, safe=True)
        for source in inputs:
            self.remove_dead(source)

    def build(self, node: ir.Node, old: ir.Value, edit: Edit) -> ir.Value:
        dtype = old.dtype.numpy() if old.dtype is not None else np.dtype(np.int64)
        if edit.kind == "affine":
            return self.affine(node, old, edit)
        if edit.kind == "divisor":
            scalar = old.shape is not None and len(old.shape) == 0
            count = self.op(node, "Cast", [self.n(scalar=scalar)], old.name, to=int(old.dtype or 1))
            if edit.scale != 1:
                scale = self.const(node, np.asarray(edit.scale, dtype), f"{old.name}_scale")
                count = self.op(node, "Mul", [count, scale], old.name)
            return self.op(node, "Reciprocal", [count], old.name) if node.op_type == "Mul" else count
        if edit.kind == "scalar":
            factor = self.const(node, np.asarray(edit.factor, np.int64), f"{old.name}_factor")
            count = self.op(node, "Mul", [self.n(scalar=True), factor], old.name)
            return self.op(node, "Cast", [count], old.name, to=int(old.dtype or 7))
        if all(isinstance(e, int) for e in edit.entries):
            return self.const(node, np.asarray(edit.entries, dtype), f"{old.name}_dynamic")
        return self.shape(node, edit.entries, old.name)

    def affine(self, node: ir.Node, old: ir.Value, edit: Edit) -> ir.Value:
        """C0 + arange(N) * D along ``edit.axis`` (C0 alone, expanded if asked, when D is 0)."""
        array = as_numpy(old)
        row = np.take(array, [0], axis=edit.axis)
        step = np.take(array, [1], axis=edit.axis) - row if array.shape[edit.axis] > 1 else row * 0
        initializer, name = old.is_initializer(), f"{old.name}_row"
        if initializer and len(old.uses()) == 1 and not old.is_graph_output():  # the row takes its name
            self.graph.initializers.pop(old.name or "")
            self.taken.discard(name := old.name or name)
        value = self.const(node, row, name, initializer=initializer)
        value.metadata_props.update(old.metadata_props)
        if step.any():
            zero, one = (self.const(node, np.asarray(x, np.int64), f"{old.name}_range") for x in (0, 1))
            index = self.op(node, "Range", [zero, self.n(scalar=True), one], old.name)
            shape = [1] * array.ndim
            shape[edit.axis] = -1
            index = self.op(node, "Reshape", [index, self.const(node, np.asarray(shape, np.int64),
                                                                 f"{old.name}_shape")], old.name)
            index = self.op(node, "Cast", [index], old.name, to=int(ir.DataType.from_numpy(array.dtype)))
            scaled = self.op(node, "Mul", [index, self.const(node, step, f"{old.name}_step")], old.name)
            return self.op(node, "Add", [value, scaled], old.name)
        if not edit.expand:
            return value
        entries: list[int | N] = [1] * row.ndim
        entries[edit.axis] = N(edit.factor)
        return self.op(node, "Expand", [value, self.shape(node, entries, old.name)], old.name)

    def shape(self, node: ir.Node, entries: Sequence[int | N], base: str | None) -> ir.Value:
        parts, fixed = [], []
        for entry in [*entries, None]:
            if isinstance(entry, int):
                fixed.append(entry)
                continue
            if fixed:
                parts.append(self.const(node, np.asarray(fixed, np.int64), f"{base}dims_of"))
                fixed = []
            if isinstance(entry, N) and entry.factor == 1:
                parts.append(self.n())
            elif isinstance(entry, N):
                factor = self.const(node, np.asarray([entry.factor], np.int64), f"{base}_factor")
                parts.append(self.op(node, "Mul", [self.n(), factor], base))
        return self.op(node, "Concat", parts, f"{base}_batch", axis=0)

    def n(self, scalar: bool = False) -> ir.Value:
        """The batch size N (int64, shape [1] or a scalar), computed once at the top of the graph."""
        if scalar not in self._n:
            first = next(iter(self.graph))
            shape = self.op(first, "Shape", [self.source], "batch_size")
            index = self.const(first, np.asarray(0 if scalar else [0], np.int64), "batch_size_index")
            self._n[scalar] = self.op(first, "Gather", [shape, index], "batch_size", axis=0)
            self._n[scalar].type = ir.TensorType(ir.DataType.INT64)
            self._n[scalar].shape = ir.Shape([] if scalar else [1])
        return self._n[scalar]

    def op(self, before: ir.Node, op_type: str, inputs: Sequence[ir.Value], base: str | None,
           **attrs: int) -> ir.Value:
        node = ir.Node("", op_type, inputs, [ir.AttrInt64(k, v) for k, v in attrs.items()], num_outputs=1)
        node.outputs[0].name = self.unique(f"{base or 'batch'}_{op_type.lower()}")
        self.graph.insert_before(before, node)
        return node.outputs[0]

    def const(self, before: ir.Node, array: np.ndarray, base: str, *, initializer: bool = False) -> ir.Value:
        tensor = ir.tensor(array)
        if initializer:
            value = ir.Value(name=self.unique(base), const_value=tensor, shape=ir.Shape(array.shape),
                             type=ir.TensorType(tensor.dtype))
            self.graph.register_initializer(value)
            return value
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], num_outputs=1)
        out = node.outputs[0]
        out.name, out.shape, out.type = self.unique(base), ir.Shape(array.shape), ir.TensorType(tensor.dtype)
        self.graph.insert_before(before, node)
        return out

    def unique(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name
