"""How each op moves the batch axis (one ``v_<Op>`` method per op, op families by table)."""

from __future__ import annotations

import math

import onnx_ir as ir

from passes.batching.state import (
    BROADCAST,
    INT64_MAX,
    RECURRENT,
    REDUCE,
    SAME,
    SPATIAL,
    SUMS,
    TO_THE_END,
    UNKNOWN,
    Batch,
    Edit,
    N,
    Refusal,
    dims_of,
    int_list,
    rank_of,
    regroup,
    reshaped,
    static_dims,
)
from passes.batching.tracing import Tracer
from passes.subgraphs import has_subgraphs


class Analysis(Tracer):
    def visit(self, node: ir.Node) -> list[Batch | None]:
        ins = [self.state.get(v) if v is not None else None for v in node.inputs]
        n = len(node.outputs)
        if has_subgraphs(node):
            return [UNKNOWN] * n  # a subgraph may read batched values of the outer graph
        if node.domain not in ("", "ai.onnx"):
            if any(s is not None for s in ins):
                self.refuse_if_holds(node, range(len(node.inputs)))
                return [UNKNOWN] * n
            return [None] * n
        self.follow_shapes(node, ins)
        made = self.made_from_shape(node) if not ins or ins[0] is None else None
        if made is not None:
            return [made]
        if all(s is None for s in ins):
            self.follow_sums(node)
            return [None] * n
        handler = getattr(self, f"v_{node.op_type}", None)
        if handler is None:
            for group, method in ((SAME, self.same), (BROADCAST, self.broadcast),
                                  (SPATIAL, self.spatial), (REDUCE, self.reduce),
                                  (RECURRENT, self.recurrent)):
                if node.op_type in group:
                    return method(node, ins)
            self.refuse_if_holds(node, range(len(node.inputs)))
            return [UNKNOWN] * n
        if UNKNOWN in ins and node.op_type not in ("Reshape", "Expand", "Tile", "Slice", "Resize"):
            return [UNKNOWN] * n
        result: list[Batch | None] = handler(node, ins)
        return result

    def same(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        return [ins[0] if ins[0] is not None else UNKNOWN] * len(node.outputs)

    def broadcast(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        ranks = [len(v.shape) if v is not None and v.shape is not None else None for v in node.inputs]
        if UNKNOWN in ins or None in ranks:
            return [UNKNOWN] * len(node.outputs)
        r = max(int(x or 0) for x in ranks)
        outs = {s.at(s.axis + r - int(ranks[i] or 0)) for i, s in enumerate(ins) if s is not None}
        if len(outs) != 1:
            return [UNKNOWN] * len(node.outputs)
        out = outs.pop()
        for i, s in enumerate(ins):
            if s is None and node.inputs[i] is not None:
                self.meet(node, i, out.axis - (r - int(ranks[i] or 0)), out.factor, expand=False)
        return [out] * len(node.outputs)

    def spatial(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s = ins[0]
        if s is None or s.axis != 0 or any(x is not None for x in ins[1:]):
            return [UNKNOWN] * len(node.outputs)
        if node.op_type == "BatchNormalization":
            return [s] + [None] * (len(node.outputs) - 1)
        return [s] * len(node.outputs)

    def reduce(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, dims = ins[0], static_dims(node.inputs[0])
        if s is None or s is UNKNOWN or dims is None:
            return [UNKNOWN]
        if node.op_type in ("ArgMax", "ArgMin"):
            axes: list[int] | None = [int(node.attributes.get_int("axis", 0))]
        else:
            axes = self._axes(node)
            if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
                return [UNKNOWN]
            axes = axes or []
        if not axes:
            if node.attributes.get_int("noop_with_empty_axes", 0):
                return [s]
            axes = list(range(len(dims)))
        axes = [a % len(dims) for a in axes]
        if s.axis in axes:
            if node.op_type in SUMS:
                self.sums[node.outputs[0]] = (math.prod(dims[a] for a in axes), s.factor)
            return [None]
        keep = node.attributes.get_int("keepdims", 1)
        return [s.at(s.axis if keep else s.axis - sum(a < s.axis for a in axes))]

    def recurrent(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        """LSTM / GRU / RNN: X is [seq, batch, in] (layout 0) or [batch, seq, in] (layout 1)."""
        layout = node.attributes.get_int("layout", 0)
        x, axis = ins[0], 1 - layout
        if x is None or x != Batch(axis):
            return [UNKNOWN] * len(node.outputs)
        for i in range(4, min(len(node.inputs), 7)):  # sequence_lens, initial_h, initial_c
            want = 0 if i == 4 else axis
            if ins[i] is None and node.inputs[i] is not None:
                self.meet(node, i, want, 1, expand=True)
            elif ins[i] is not None and ins[i] != Batch(want):
                return [UNKNOWN] * len(node.outputs)
        outs: list[Batch | None] = [Batch(2 if layout == 0 else 0)]
        return outs + [Batch(axis)] * (len(node.outputs) - 1)

    # -- ops that move, merge or consume the batch (one method per op type) -------------------
    def v_CastLike(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        return [ins[0]]

    def v_Concat(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        found = {s for s in ins if s is not None}
        rank = rank_of(node.outputs[0])
        if len(found) != 1 or dims_of(node.outputs[0]) is None:
            return [UNKNOWN]
        s = found.pop()
        if s.axis == node.attributes.get_int("axis", 0) % rank:
            return [UNKNOWN]
        for i, x in enumerate(ins):
            if x is None:
                self.meet(node, i, s.axis, s.factor, expand=True)
        return [s]

    def v_MatMul(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        ranks = [len(dims_of(v) or []) for v in node.inputs]
        if ranks[1] == 1 and ins[1] is None and ins[0] is not None and ins[0].axis < ranks[0] - 1:
            return [ins[0]]  # a matrix-vector product keeps the rows
        if min(ranks) < 2:
            return [UNKNOWN]
        r, (a, b) = max(ranks), ins
        rows = a is not None and a.axis == ranks[0] - 1
        cols = b is not None and b.axis == ranks[1] - 2
        if rows or cols:  # the batch is contracted: fine when it is on both sides
            return [None] if rows and cols else [UNKNOWN]
        outs = set()
        if a is not None:
            outs.add(a.at(a.axis + r - ranks[0]))
        if b is not None:
            outs.add(b.at(r - 1 if b.axis == ranks[1] - 1 else b.axis + r - ranks[1]))
        if len(outs) != 1:
            return [UNKNOWN]
        out = outs.pop()
        for i, s in enumerate(ins):
            k = out.axis - (r - ranks[i])
            if s is None and 0 <= k < ranks[i] - 2:
                self.meet(node, i, k, out.factor, expand=False)
        return [out]

    def v_Gemm(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        a, b = ins[0], ins[1]
        ta, tb = node.attributes.get_int("transA", 0), node.attributes.get_int("transB", 0)
        if (a is not None and a.axis != ta) or (b is not None and b.axis != 1 - tb) or (a and b):
            return [UNKNOWN]
        s = a.at(0) if a is not None else (b.at(1) if b is not None else UNKNOWN)
        c = node.inputs[2] if len(node.inputs) > 2 else None
        if c is not None and ins[2] is None and c.shape is not None:
            self.meet(node, 2, s.axis - (2 - len(c.shape)), s.factor, expand=False)
        elif c is not None and ins[2] is not None and ins[2] != s.at(s.axis - 2 + rank_of(c)):
            return [UNKNOWN]
        return [s]

    def v_Reshape(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, dims, target = ins[0], static_dims(node.inputs[0]), self.const(node.inputs[1])
        if s is None or s is UNKNOWN or dims is None:
            self.refuse_if_holds(node, [1])
            return [UNKNOWN]
        allowzero = node.attributes.get_int("allowzero", 0)
        out = static_dims(node.outputs[0]) if target is None else reshaped(dims, target, allowzero)
        found = None if out is None else regroup(dims, s, self.B, out)
        held = self.shapes.get(node.inputs[1], {})
        if found is None and target is None and len(held) == 1:  # a target computed from Shape(...)
            (pos, factor), = held.items()
            found = s.at(pos) if (pos, factor) == (s.axis, s.factor) else Batch(pos, factor)
        if found is None:
            if target is None:
                return [UNKNOWN]
            raise Refusal(f"Reshape node {node.name!r} to {target.tolist()} splits the rows of the batch "
                           f"(axis {s.axis} of shape {dims}) across dimensions")
        if target is not None and out is not None:
            j, entries = found.axis, [int(x) for x in target]
            copies = [i for i, x in enumerate(target) if x == 0 and not allowzero]
            if (s.axis in copies and s.axis != j) or (j in copies and (j != s.axis or found != s.at(j))):
                raise Refusal(f"Reshape node {node.name!r} copies (0) the batch of {dims} into a "
                               f"fixed position of {target.tolist()}")
            if entries[j] == out[j]:
                new: list[int | N] = list(entries)
                if not allowzero and j == s.axis and found == s:
                    new[j] = 0
                else:
                    new[j] = -1 if -1 not in entries else N(found.factor)
                self.edits[(node, 1)] = Edit("entries", tuple(new))
        return [found]

    def v_Flatten(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, dims = ins[0], static_dims(node.inputs[0])
        if s is None or dims is None:
            return [UNKNOWN]
        axis = node.attributes.get_int("axis", 1) % (len(dims) + 1)
        found = regroup(dims, s, self.B, [math.prod(dims[:axis]), math.prod(dims[axis:])])
        return [found if found is not None else UNKNOWN]

    def v_Expand(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, shape, rd = ins[0], self.const(node.inputs[1]), rank_of(node.inputs[0])
        if s is None or s is UNKNOWN or dims_of(node.inputs[0]) is None:
            self.refuse_if_holds(node, [1])
            return [UNKNOWN]
        if shape is None and dims_of(node.outputs[0]) is None:
            return [UNKNOWN]
        r = max(rd, len(shape)) if shape is not None else rank_of(node.outputs[0])
        out = s.at(s.axis + r - rd)
        if shape is not None:
            pos = out.axis - (r - len(shape))
            if 0 <= pos and shape[pos] == s.factor * self.B and self.B > 1:
                entries: list[int | N] = [int(x) for x in shape]
                entries[pos] = 1
                self.edits[(node, 1)] = Edit("entries", tuple(entries))
        return [out]

    def v_Tile(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, repeats = ins[0], self.const(node.inputs[1])
        if s is None or s is UNKNOWN or repeats is None or repeats[s.axis] != 1:
            self.refuse_if_holds(node, [1])
            return [UNKNOWN]
        return [s]

    def v_Slice(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], rank_of(node.inputs[0])
        args = [self.const(v) if i < len(node.inputs) else None for i, v in enumerate(node.inputs[:5])]
        args += [None] * (5 - len(args))
        if s is None or s is UNKNOWN or args[1] is None or args[2] is None or (
                len(node.inputs) > 3 and node.inputs[3] is not None and args[3] is None):
            self.refuse_if_holds(node, [1, 2])
            return [UNKNOWN]
        starts, ends = args[1].tolist(), args[2].tolist()
        axes = [a % rank for a in (args[3].tolist() if args[3] is not None else range(len(starts)))]
        if s.axis not in axes:
            return [s]
        i, size = axes.index(s.axis), s.factor * self.B
        step = int(args[4][i]) if args[4] is not None else 1
        if starts[i] == 0 and step == 1 and (ends[i] == size or ends[i] >= TO_THE_END):
            if ends[i] == size:
                ends[i] = INT64_MAX
                self.edits[(node, 2)] = Edit("entries", tuple(ends))
            return [s]
        if any(abs(x) in (self.B, size) for x in (starts[i], ends[i])):
            raise Refusal(f"Slice node {node.name!r} takes rows {starts[i]}:{ends[i]}:{step} of the batch "
                           f"axis (batch size {self.B})")
        return [UNKNOWN]

    def v_Resize(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s = ins[0]
        if s is None or s is UNKNOWN or s.axis != 0 or any(x is not None for x in ins[1:]):
            self.refuse_if_holds(node, [3])
            return [UNKNOWN]
        sizes = self.const(node.inputs[3]) if len(node.inputs) > 3 else None
        if sizes is not None and sizes.size and sizes[0] == s.factor * self.B:
            self.edits[(node, 3)] = Edit("entries", (N(s.factor), *[int(x) for x in sizes[1:]]))
        return [s]

    def _index_batch(self, node: ir.Node, index: Batch | None) -> Batch | None:
        """Indices into the batch axis of the data: they carry the batch when they are batched or
        have one batch-sized axis (then rewritten as batch indices)."""
        if index is not None:
            return index if index is not UNKNOWN else None
        dims = dims_of(node.inputs[1]) or []
        if node.op_type == "GatherND":
            dims = dims[:-1]
        axes = [k for k, d in enumerate(dims) if d == self.B]
        if len(axes) != 1 or self.B == 1:
            return None
        self.meet(node, 1, axes[0], 1, expand=True)
        return Batch(axes[0])

    def v_Gather(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        (data, index), rank = ins[:2], rank_of(node.inputs[0])
        axis = node.attributes.get_int("axis", 0) % max(rank, 1)
        if rank == 0 or (data is not None and index is not None and data.axis != axis):
            return [UNKNOWN]
        if data is not None and data.axis == axis:  # rows picked by indices
            found = self._index_batch(node, index)
            return [found.at(axis + found.axis)] if found is not None else [UNKNOWN]
        if index is not None:
            return [index.at(axis + index.axis)]
        assert data is not None
        if dims_of(node.inputs[1]) is None:
            return [UNKNOWN]
        return [data.at(data.axis if data.axis < axis else data.axis + rank_of(node.inputs[1]) - 1)]

    def v_GatherND(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        data, index = ins[:2]
        depth = (dims_of(node.inputs[1]) or [None])[-1]
        if node.attributes.get_int("batch_dims", 0) or not isinstance(depth, int):
            return [UNKNOWN]
        width = rank_of(node.inputs[1]) - 1
        if data is not None and data.axis >= depth and index is None:
            return [data.at(width + data.axis - depth)]
        if index is not None and index.axis >= width:
            return [UNKNOWN]
        found = self._index_batch(node, index)
        return [found] if found is not None else [UNKNOWN]

    def v_GatherElements(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        data, index = ins[:2]
        if index is None or index is UNKNOWN or data not in (None, index):
            return [UNKNOWN]
        if data is None:  # the data needs the batch too (its dims bound the indices' dims)
            self.meet(node, 0, index.axis, index.factor, expand=True)
        return [index]

    def v_SoftmaxCrossEntropyLoss(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        scores, labels = ins[:2]
        reduction = node.attributes.get_string("reduction", "mean")
        if labels is None or any(x is not None for x in ins[2:]):
            return [UNKNOWN] * len(node.outputs)
        if reduction == "sum":
            self.sums[node.outputs[0]] = (math.prod(static_dims(node.inputs[1]) or [0]), labels.factor)
        return [labels if reduction == "none" else None, scores][: len(node.outputs)]

    v_NegativeLogLikelihoodLoss = v_SoftmaxCrossEntropyLoss

    def v_Transpose(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], rank_of(node.inputs[0])
        perm = int_list(node, "perm") or list(reversed(range(rank)))
        return [s.at(perm.index(s.axis))] if s is not None else [UNKNOWN]

    def v_Squeeze(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, dims, axes = ins[0], dims_of(node.inputs[0]), self._axes(node)
        if s is None or dims is None:
            return [UNKNOWN]
        axes = [i for i, d in enumerate(dims) if d == 1] if axes is None and all(dims) else axes
        if axes is None or s.axis in [a % len(dims) for a in axes]:
            return [UNKNOWN]
        return [s.at(s.axis - sum(a % len(dims) < s.axis for a in axes))]

    def v_Unsqueeze(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, axes, rank = ins[0], self._axes(node), rank_of(node.inputs[0])
        if s is None or axes is None or dims_of(node.inputs[0]) is None:
            return [UNKNOWN]
        inserted = {a % (rank + len(axes)) for a in axes}
        kept = [p for p in range(rank + len(axes)) if p not in inserted]
        return [s.at(kept[s.axis])]

    def v_Split(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], rank_of(node.inputs[0])
        same = s is not None and rank > 0 and node.attributes.get_int("axis", 0) % rank != s.axis
        return [s if same else UNKNOWN] * len(node.outputs)

    v_SplitToSequence = v_Split

    def v_SequenceAt(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        return [ins[0]]

    def v_Shape(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        return [None]

    v_Size = v_Shape

    def v_OneHot(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], rank_of(node.inputs[0])
        if s is None or ins[1] is not None or dims_of(node.inputs[0]) is None:
            return [UNKNOWN]
        axis = node.attributes.get_int("axis", -1) % (rank + 1)
        return [s.at(s.axis if s.axis < axis else s.axis + 1)]

    def v_TopK(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], rank_of(node.inputs[0])
        same = s is not None and rank > 0 and node.attributes.get_int("axis", -1) % rank != s.axis
        return [s if same else UNKNOWN] * len(node.outputs)

    def v_LayerNormalization(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, rank = ins[0], rank_of(node.inputs[0])
        if s is None or any(x is not None for x in ins[1:]) or rank == 0:
            return [UNKNOWN] * len(node.outputs)
        stats = s if s.axis < node.attributes.get_int("axis", -1) % rank else None
        return [s] + [stats] * (len(node.outputs) - 1)

    def v_Pad(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        s, pads, rank = ins[0], self.const(node.inputs[1]), rank_of(node.inputs[0])
        plain = len(node.inputs) < 4 or node.inputs[3] is None
        if s is None or pads is None or not plain or pads[s.axis] or pads[s.axis + rank]:
            return [UNKNOWN]
        return [s]

    def v_ScatterElements(self, node: ir.Node, ins: list[Batch | None]) -> list[Batch | None]:
        data = ins[0]
        if data is None or data is UNKNOWN or any(x not in (None, data) for x in ins[1:]):
            return [UNKNOWN]
        if node.op_type == "ScatterElements":  # indices and updates match the data's rank
            for i in (1, 2):
                if ins[i] is None:
                    self.meet(node, i, data.axis, data.factor, expand=True)
        return [data]

    v_ScatterND = v_ScatterElements
