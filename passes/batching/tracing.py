"""The batch analysis' bookkeeping: constants, trace-back to where batch-free values come from,
shape tensors and sums (see :mod:`passes.batching.dynamic_batch` for the rules)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from passes.batching.state import (
    BROADCAST,
    GENERATORS,
    RANDOM,
    SAME,
    SUM_PASS,
    UNKNOWN,
    Batch,
    Edit,
    N,
    Refusal,
    dims_of,
    int_list,
    leading,
    rank_of,
    static_dims,
)
from passes.forward.fold_constants import evaluate_node
from passes.subgraphs import has_subgraphs


class Tracer:
    def __init__(self, model: ir.Model, size: int, inputs: list[ir.Value]) -> None:
        self.graph, self.B = model.graph, size
        self.opset = model.opset_imports.get("", 13)
        self.inputs: dict[ir.Value, Batch | None] = {v: Batch(0) for v in inputs}
        self.forced: dict[ir.Value, Batch] = {}  # made batched by rewriting where they come from
        self.fixed: dict[tuple[ir.Node, int], Edit] = {}  # those rewrites
        self.edits: dict[tuple[ir.Node, int], Edit] = {}  # rewrites found by the last sweep
        self.state: dict[ir.Value, Batch | None] = {}
        self.sums: dict[ir.Value, tuple[int, int]] = {}  # value -> (summed elements, factor)
        self.shapes: dict[ir.Value | None, dict[int, int]] = {}  # shape tensor -> {position: factor of N}
        self._consts: dict[ir.Value, np.ndarray | None] = {}

    def run(self) -> None:
        for node in self.graph:  # shapes of values computed from constants, where inference has none
            for value in node.outputs:
                array = self.const(value) if static_dims(value) is None and len(node.outputs) == 1 else None
                if array is not None:
                    value.shape, value.dtype = ir.Shape(array.shape), ir.DataType.from_numpy(array.dtype)
        for _ in range(len(self.graph) + 2):
            grown = (len(self.forced), len(self.fixed))
            self.sweep()
            for out in self.graph.outputs:
                if self.state.get(out) is None and leading(out) == self.B and self.B > 1:
                    self.resolve(out, 0, 1, None, 0, soft=True)
            if (len(self.forced), len(self.fixed)) == grown:
                return

    def visit(self, node: ir.Node) -> list[Batch | None]:
        """The batch of each output of ``node`` (the op rules, in :mod:`passes.batching.op_rules`)."""
        raise NotImplementedError("Tracer is the base of passes.batching.op_rules.Analysis")

    def sweep(self) -> None:
        self.state, self.edits, self.sums, self.shapes = dict(self.inputs), {}, {}, {}
        for node in self.graph:
            outs = self.visit(node)
            for value, batch in zip(node.outputs, outs):
                self.state[value] = self.forced.get(value, batch)

    # -- helpers ------------------------------------------------------------------------------
    def const(self, value: ir.Value | None) -> np.ndarray | None:
        """The value's array when it is computed from constants only (not from graph inputs)."""
        if value is None or value.is_graph_input():
            return None
        if value not in self._consts:
            self._consts[value] = None
            node, out = value.producer(), None
            if node is None:
                out = value.const_value.numpy() if value.const_value is not None else None
            elif node.op_type == "Constant":
                tensor = ir.convenience.get_const_tensor(value)
                out = tensor.numpy() if tensor is not None else None
            elif node.domain in ("", "ai.onnx") and node.op_type not in RANDOM and len(node.outputs) == 1 \
                    and not has_subgraphs(node):
                arrays = [self.const(v) for v in node.inputs]
                if all((a is not None and a.size <= 4096) or v is None for a, v in zip(arrays, node.inputs)):
                    with np.errstate(all="ignore"):  # e.g. casting a -inf mask: the value is not needed
                        out = evaluate_node(node, arrays, self.opset)
            self._consts[value] = out
        return self._consts[value]

    def holds(self, array: np.ndarray | None, factor: int = 1) -> bool:
        if array is None or array.dtype.kind not in "iu" or array.ndim > 1:
            return False
        return bool(np.isin(array, [self.B, factor * self.B]).any())

    def refuse_if_holds(self, node: ir.Node, indices: Sequence[int], factor: int = 1) -> None:
        for i in indices:
            if i < len(node.inputs) and self.holds(self.const(node.inputs[i]), factor):
                raise Refusal(f"{node.op_type} node {node.name!r} takes {self.const(node.inputs[i])!s} "
                               f"(holding the batch size {self.B}) but where its input holds the batch "
                               "is not known")

    def affine(self, array: np.ndarray, axis: int, factor: int) -> bool:
        """Slices along ``axis`` all equal, or (integers, factor 1) C0 + b*D: batch indices."""
        rows = np.moveaxis(array, axis, 0)
        if self.B > 1 and (rows == rows[:1]).all():
            return True
        if factor != 1 or array.dtype.kind not in "iu" or len(rows) < 2:
            return False
        steps = np.arange(len(rows)).reshape((-1,) + (1,) * (rows.ndim - 1))
        return bool((rows == rows[0] + steps * (rows[1] - rows[0])).all())

    def meet(self, node: ir.Node, index: int, axis: int, factor: int, expand: bool) -> None:
        """A batch-free input of ``node`` meets the batch on its ``axis``: rewrite its source."""
        dims = dims_of(node.inputs[index])
        if axis < 0 or dims is None or dims[axis] is None or (node, index) in self.fixed:
            return
        if dims[axis] == 1 and not (expand and factor * self.B == 1):  # it broadcasts
            return
        self.resolve(node.inputs[index], axis, factor, node, index, expand=expand)

    def resolve(self, value: ir.Value | None, axis: int, factor: int, consumer: ir.Node | None,
                index: int, *, expand: bool = False, soft: bool = False) -> bool:
        """Make ``value`` carry the batch on ``axis`` by rewriting where it comes from (a constant
        whose slices are C0 + b*D, a generator's shape, or the sources of an op that passes the
        axis through). ``soft``: report failure instead of refusing."""
        if value is None or value in self.forced:
            return True
        node, array = value.producer(), self.const(value)
        what = f"{value.name!r} (shape {list(value.shape or [])})"
        if node is None or node.op_type == "Constant":
            if soft or array is None or consumer is None:
                if soft:
                    return False
                raise Refusal(f"{what} meets the batch on axis {axis} but is not computed from it")
            if self.affine(array, axis, factor) or (expand and factor * self.B == 1):
                self.fixed[(consumer, index)] = Edit("affine", axis=axis, factor=factor, expand=expand)
                return True
            raise Refusal(f"the constant {what} has one row per batch entry on axis {axis} and its "
                           "rows differ (a parameter or table of the batch's size)")
        edit = self.generator(node, value, axis, factor)
        if edit is not None:
            self.fixed[(node, edit[0])] = edit[1]
            self.forced[value] = Batch(axis, factor)
            return True
        sources = self.sources(node, value, axis)
        if sources and not (soft and len(sources) > 1) and all(
                self.resolve(source, k, factor, user, i, expand=True, soft=soft)
                for source, k, user, i in sources):
            self.forced[value] = Batch(axis, factor)
            return True
        if soft:
            return False
        raise Refusal(f"{what} meets the batch on axis {axis} but its {node.op_type} node {node.name!r} "
                       "computes it without the batch")

    def generator(self, node: ir.Node, value: ir.Value, axis: int, factor: int) -> tuple[int, Edit] | None:
        """The rewrite that makes an Expand / ConstantOfShape / Tile / Range output N*k long on ``axis``."""
        if node.op_type == "Range":
            start, limit, delta = (self.const(v) for v in node.inputs)
            if axis == 0 and start is not None and delta is not None and limit is not None and start == 0 \
                    and delta == 1 and limit == factor * self.B:
                return 1, Edit("scalar", factor=factor)
            return None
        if node.op_type not in GENERATORS:
            return None
        at, rank = GENERATORS[node.op_type], rank_of(value)
        shape = self.const(node.inputs[at])
        if shape is None or shape.ndim != 1:
            return None
        pos = axis - (rank - len(shape))
        data = dims_of(node.inputs[0]) if node.op_type != "ConstantOfShape" else []
        data_axis = axis - (rank - len(data or []))
        data_dim = (data or [None])[data_axis] if data is not None and 0 <= data_axis < len(data) else 1
        if 0 <= pos < len(shape) and shape[pos] == factor * self.B and data_dim == 1:
            entries: list[int | N] = [int(x) for x in shape]
            entries[pos] = N(factor)
            return at, Edit("entries", tuple(entries))
        return None

    def sources(self, node: ir.Node, value: ir.Value, axis: int) -> list[tuple[ir.Value, int, ir.Node, int]]:
        """(source, its axis, the node reading it, input index) for what makes ``axis`` of
        ``value``, for the ops a batch-sized value is traced back through (the source of an
        Expand whose shape is ``Shape(u)`` is u); empty for other ops."""
        found = [(node.inputs[i], k, node, i) for i, k in self._input_axes(node, value, axis)]
        if node.op_type == "Expand" and not found:
            shape = node.inputs[1]
            producer = shape.producer() if shape is not None else None
            if producer is not None and producer.op_type == "Shape" and producer.inputs[0] is not None:
                length, source = (static_dims(shape) or [0])[0], producer.inputs[0]
                start = producer.attributes.get_int("start", 0) % max(rank_of(source), 1)
                found = [(source, axis - (rank_of(value) - length) + start, producer, 0)]
        return [(v, k, user, i) for v, k, user, i in found if v is not None]

    def _input_axes(self, node: ir.Node, value: ir.Value, axis: int) -> list[tuple[int, int]]:
        op, rank = node.op_type, rank_of(value)
        if op in SAME or op == "CastLike":
            return [(0, axis)]
        if op in BROADCAST or op == "Concat":
            found = []
            for i, v in enumerate(node.inputs):
                dims = dims_of(v)
                k = axis - (rank - len(dims or []))
                if dims is not None and 0 <= k < len(dims) and dims[k] != 1:
                    found.append((i, k))
            return found
        if op == "Transpose":
            return [(0, (int_list(node, "perm") or list(reversed(range(rank))))[axis])]
        if op in ("Unsqueeze", "Squeeze"):
            axes = self._axes(node) or []
            if op == "Unsqueeze":
                inserted = {a % rank for a in axes}
                return [] if axis in inserted else [(0, axis - sum(a < axis for a in inserted))]
            removed = {a % max(rank_of(node.inputs[0]), 1) for a in axes}
            return [(0, [p for p in range(rank_of(node.inputs[0])) if p not in removed][axis])]
        if op == "Gather":
            gather_axis = node.attributes.get_int("axis", 0) % max(rank_of(node.inputs[0]), 1)
            width = rank_of(node.inputs[1])
            if gather_axis <= axis < gather_axis + width:
                return [(1, axis - gather_axis)]
            return [(0, axis if axis < gather_axis else axis - width + 1)]
        if op == "Expand":
            data = dims_of(node.inputs[0]) or []
            k = axis - (rank - len(data))
            return [(0, k)] if 0 <= k < len(data) and data[k] != 1 else []
        if op == "Slice":  # a slice of other axes
            starts = self.const(node.inputs[1])
            given = len(node.inputs) > 3 and node.inputs[3] is not None
            slice_axes = self.const(node.inputs[3]) if given else None
            if starts is None or (slice_axes is None and given):
                return []
            sliced = [int(a) % rank for a in (slice_axes if slice_axes is not None else range(len(starts)))]
            return [] if axis in sliced else [(0, axis)]
        return []

    def _axes(self, node: ir.Node) -> list[int] | None:
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            array = self.const(node.inputs[1])
            return None if array is None else [int(x) for x in array.reshape(-1)]
        return int_list(node, "axes")

    # -- the walk -----------------------------------------------------------------------------
    def follow_sums(self, node: ir.Node) -> None:
        source = node.inputs[0] if node.inputs else None
        if source is None or source not in self.sums:
            return
        if node.op_type in ("Div", "Mul"):
            numel, factor = self.sums[source]
            c = self.const(node.inputs[1])
            if c is not None and c.size == 1 and c.ndim <= 1 and c.dtype.kind == "f" and (
                    self.B > 1 or node.op_type == "Div"):
                value = float(c.reshape(-1)[0])
                target = value if node.op_type == "Div" else (1.0 / value if value else 0.0)
                if any(math.isclose(target, k, rel_tol=1e-6) for k in (self.B, factor * self.B, numel)):
                    self.edits[(node, 1)] = Edit("divisor", scale=target / self.B)
                    return
        elif node.op_type not in SUM_PASS:
            return
        self.sums[node.outputs[0]] = self.sums[source]

    def follow_shapes(self, node: ir.Node, ins: list[Batch | None]) -> None:
        """Record which entries of shape tensors (from Shape of batched values) hold N * k."""
        op, out = node.op_type, node.outputs[0] if node.outputs else None
        if out is None:
            return
        if op == "Shape" and ins[0] is not None and ins[0] is not UNKNOWN:
            rank = rank_of(node.inputs[0])
            start = node.attributes.get_int("start", 0) % max(rank, 1)
            end = node.attributes.get_int("end", rank)
            end = end % rank if end < 0 else min(end, rank)
            if start <= ins[0].axis < end:
                self.shapes[out] = {ins[0].axis - start: ins[0].factor}
            return
        held = self.shapes.get(node.inputs[0]) if node.inputs else None
        if op == "Concat":
            found, offset = {}, 0
            for v in node.inputs:
                for pos, factor in self.shapes.get(v, {}).items():
                    found[offset + pos] = factor
                offset += (static_dims(v) or [1])[0] if rank_of(v) else 1
            if found:
                self.shapes[out] = found
        elif held is None:
            return
        elif op in ("Cast", "Identity") or (op in ("Squeeze", "Unsqueeze", "Reshape") and set(held) == {0}
                                            and math.prod(static_dims(node.inputs[0]) or [2]) == 1):
            self.shapes[out] = held
        elif op == "Gather" and node.attributes.get_int("axis", 0) == 0:
            index = self.const(node.inputs[1])
            length = (static_dims(node.inputs[0]) or [0])[0]
            if index is not None and length:
                picked = {i: held[int(x) % length] for i, x in enumerate(index.reshape(-1)) if int(x) % length in held}
                if picked:
                    self.shapes[out] = picked
        elif op == "Slice":
            starts, ends = self.const(node.inputs[1]), self.const(node.inputs[2])
            length = (static_dims(node.inputs[0]) or [0])[0]
            steps = self.const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
            if starts is not None and ends is not None and starts.size == 1 and length and (
                    steps is None or int(steps.reshape(-1)[0]) == 1):
                lo = max(0, min(length, int(starts[0]) % length if starts[0] < 0 else int(starts[0])))
                hi = max(0, min(length, int(ends[0]) + length if ends[0] < 0 else int(ends[0])))
                picked = {p - lo: f for p, f in held.items() if lo <= p < hi}
                if picked:
                    self.shapes[out] = picked
        elif op == "Mul":
            k = self.const(node.inputs[1])
            if k is not None and k.size == 1 and k.dtype.kind in "iu":
                self.shapes[out] = {p: f * int(k.reshape(-1)[0]) for p, f in held.items()}

    def made_from_shape(self, node: ir.Node) -> Batch | None:
        """Expand / ConstantOfShape / Range whose shape (limit) is a shape tensor holding N * k."""
        at = {"Expand": 1, "ConstantOfShape": 0, "Range": 1}.get(node.op_type)
        if at is None or at >= len(node.inputs) or node.inputs[at] not in self.shapes:
            return None
        held = self.shapes[node.inputs[at]]
        if len(held) != 1:
            return UNKNOWN
        (pos, factor), = held.items()
        if node.op_type == "Range":
            start, delta = self.const(node.inputs[0]), self.const(node.inputs[2])
            return Batch(0, factor) if start is not None and delta is not None and start == 0 and delta == 1 \
                else UNKNOWN
        length = (static_dims(node.inputs[at]) or [0])[0]
        return Batch(pos + rank_of(node.outputs[0]) - length, factor)
