"""Gradients of sequence and optional ops.

**The gradient of a sequence is one 1-D tensor**: the gradients of its elements, each
flattened, concatenated in sequence order (its length is the sequence's total element
count). A tensor, unlike an ONNX sequence, can be summed, so the engine adds up the
contributions of every reader of a sequence (several ``SequenceAt`` of one split) as it does
for tensors. Rules of ops that read or make sequences (and of ops that carry them through,
such as ``If``) use this representation; :func:`element_sizes` gives the element counts that
locate each element in it (from the ops that built the sequence, else with a ``Loop`` over
the sequence).

The gradient of an optional is the gradient of its element (a tensor, or a sequence's flat
tensor); ``Optional`` and ``OptionalGetElement`` pass it through.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.autodiff.builder import OpBuilder, Var
from passes.autodiff.registry import grad_rule, non_differentiable

_INT64 = ir.DataType.INT64
_END = np.iinfo(np.int64).max

non_differentiable("SequenceEmpty", "SequenceLength", "OptionalHasElement")


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _input(b: OpBuilder, node: ir.Node, index: int) -> Var | None:
    value = node.inputs[index] if index < len(node.inputs) else None
    return None if value is None else b.wrap(value)


def _required(b: OpBuilder, node: ir.Node, index: int) -> Var:
    value = _input(b, node, index)
    if value is None:
        raise ValueError(f"{node.op_type} {node.name!r}: input {index} is missing")
    return value


def _default_op(node: ir.Node | None) -> str | None:
    return node.op_type if node is not None and node.domain in ("", "ai.onnx") else None


def _count(b: OpBuilder, x: Var) -> Var:
    """The element count of ``x`` as a 1-element int64 tensor."""
    return b.Reshape(b.Size(x), [1])


def _scalar(b: OpBuilder, v: Var) -> Var:
    return b.Squeeze(v, [0])


def _position(b: OpBuilder, pos: Var | None, count: Var, default: Var) -> Var:
    """A sequence position input as a 1-element int64 tensor in [0, count] (negative: from the end)."""
    if pos is None:
        return default
    p = b.Reshape(b.Cast(pos, to=_INT64), [1])
    return b.Where(b.Less(p, b.const(np.array(0, np.int64))), p + count, p)


def _offsets(b: OpBuilder, sizes: Var) -> Var:
    """Where each element starts in the flat gradient, plus the total: [0, cumsum(sizes)]."""
    return b.Concat(b.const(np.zeros(1, np.int64)), b.CumSum(sizes, b.const(np.array(0, np.int64))), axis=0)


def _normalized_axis(axis: int, rank: int | None, what: str) -> int:
    if axis >= 0:
        return axis
    if rank is None:
        raise ValueError(f"{what}: negative axis {axis} on an input of unknown rank")
    return axis + rank


def split_lengths(b: OpBuilder, node: ir.Node) -> tuple[Var, int, Var]:
    """SplitToSequence's input, its (non-negative) axis and the chunk lengths along it."""
    x = _required(b, node, 0)
    axis = _normalized_axis(_attr(node, "axis", 0), x.rank, "SplitToSequence")
    length = b.dim(x, axis)
    split = _input(b, node, 1)
    if split is None:
        return x, axis, b.ConstantOfShape(length, value=ir.tensor(np.ones(1, np.int64)))
    rank = split.rank
    if rank is None:
        raise ValueError("SplitToSequence 'split' input of unknown rank")
    split = b.Cast(split, to=_INT64)
    if rank == 1:
        return x, axis, split
    chunk = b.Reshape(split, [1])  # equal chunks of `split` elements, the last one may be shorter
    count = b.Div(length + chunk - b.const(np.array([1], np.int64)), chunk)
    starts = b.Range(b.const(np.array(0, np.int64)), _scalar(b, count), b.const(np.array(1, np.int64))) * chunk
    return x, axis, b.Min(chunk, length - starts)


def element_sizes(b: OpBuilder, seq: Var) -> Var:
    """The element count of each element of the sequence ``seq`` (1-D int64)."""
    producer = seq.value.producer()
    op = _default_op(producer)
    if producer is None or op is None:
        return _sizes_by_loop(b, seq)
    if op == "SequenceConstruct":
        return b.Concat(*[_count(b, _required(b, producer, i)) for i in range(len(producer.inputs))], axis=0)
    if op == "SplitToSequence":
        x, axis, lengths = split_lengths(b, producer)
        per_index = b.Div(_count(b, x), b.Max(b.dim(x, axis), b.const(np.array([1], np.int64))))
        return lengths * per_index
    if op in ("SequenceInsert", "SequenceErase"):
        sizes = element_sizes(b, _required(b, producer, 0))
        count = _count(b, sizes)
        last = op == "SequenceErase"
        pos = _position(b, _input(b, producer, 2 if op == "SequenceInsert" else 1), count,
                        count - b.const(np.array([1], np.int64)) if last else count)
        head = b.Slice(sizes, b.const(np.zeros(1, np.int64)), pos)
        if last:
            return b.Concat(head, b.Slice(sizes, pos + b.const(np.array([1], np.int64)), [_END]), axis=0)
        inserted = _count(b, _required(b, producer, 1))
        return b.Concat(head, inserted, b.Slice(sizes, pos, [_END]), axis=0)
    if op == "SequenceEmpty":
        return b.const(np.zeros(0, np.int64))
    if op == "Identity":
        return element_sizes(b, _required(b, producer, 0))
    if op == "OptionalGetElement":
        wrapper = producer.inputs[0].producer() if producer.inputs[0] is not None else None
        if _default_op(wrapper) == "Optional" and wrapper is not None and wrapper.inputs:
            return element_sizes(b, _required(b, wrapper, 0))
    return _sizes_by_loop(b, seq)


def _sizes_by_loop(b: OpBuilder, seq: Var) -> Var:
    """element_sizes of a sequence of unknown make: ``Loop`` over it, ``Size`` of each element."""
    body = OpBuilder(b.opset, b.opset_imports)
    body.prefix = b.fresh_name("element_sizes")
    index = ir.Value(name=f"{body.prefix}/i", type=ir.TensorType(_INT64), shape=ir.Shape([]))
    cond = ir.Value(name=f"{body.prefix}/cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    size = body.Size(body.SequenceAt(body.wrap(seq.value), body.wrap(index)))
    keep_going = body.Identity(body.wrap(cond))
    graph = ir.Graph([index, cond], [keep_going.value, size.value], nodes=body.nodes, name=body.prefix)
    length = b.SequenceLength(seq)
    length.value.type = ir.TensorType(_INT64)  # the builder would give it the elements' dtype
    return b.Loop(length, None, body=graph)


def chunk_positions(b: OpBuilder, t: Var, axis: int, lengths: Var) -> Var:
    """Where each element of ``t`` sits in the flat gradient of its chunks along ``axis``.

    ``t`` (shape [A, L, B] around ``axis``) is cut along ``axis`` into chunks of ``lengths``
    (summing to L); the flat gradient is the chunks, each flattened, one after the other.
    Returns, in ``t``'s own flat order, each element's index in that flat gradient (a
    permutation of ``range(t.size)``).
    """
    rank = t.rank  # None: shape inference lost it (a Loop's sequence); the axis is >= 0 here
    shape = b.Shape(t)
    one = b.const(np.array([1], np.int64))
    outer = b.reduce("ReduceProd", b.Slice(shape, [0], [axis]), None) if axis > 0 else one
    if rank is None or axis < rank - 1:  # the product of an empty slice is 1
        inner = b.reduce("ReduceProd", b.Slice(shape, [axis + 1], [_END]), None)
    else:
        inner = one
    zero = b.const(np.array(0, np.int64))
    step = b.const(np.array(1, np.int64))
    j = b.Range(zero, _scalar(b, b.dim(t, axis)), step)
    ends = b.CumSum(lengths, zero)
    starts = ends - lengths
    chunk = b.ReduceSum(b.Cast(b.LessOrEqual(b.Unsqueeze(ends, [0]), b.Unsqueeze(j, [1])), to=_INT64),
                        [1], keepdims=0)
    start, length = b.Gather(starts, chunk), b.Gather(lengths, chunk)
    column = outer * inner * start + (j - start) * inner
    rows = b.Range(zero, _scalar(b, outer), step)
    cells = b.Range(zero, _scalar(b, inner), step)
    pos = (b.Reshape(column, [1, -1, 1]) + b.Reshape(rows, [-1, 1, 1]) * b.Reshape(length * inner, [1, -1, 1])
           + b.Reshape(cells, [1, 1, -1]))
    return b.Reshape(pos, [-1])


def _flat_zeros(b: OpBuilder, count: Var, like: Var) -> Var:
    return b.ConstantOfShape(count, value=ir.tensor(np.zeros(1, like.known_dtype.numpy())))


@grad_rule("SplitToSequence", since=11, diff_inputs=(0,))
def _split_to_sequence(b, n, g):
    x, axis, lengths = split_lengths(b, n.node)
    flat = b.Gather(g[0], chunk_positions(b, x, axis, lengths), axis=0)
    return [b.Reshape(flat, b.Shape(x)), None]


@grad_rule("SequenceAt", since=11, diff_inputs=(0,))
def _sequence_at(b, n, g):
    sizes = element_sizes(b, n.inputs[0])
    count = _count(b, sizes)
    offsets = _offsets(b, sizes)
    start = b.Gather(offsets, _position(b, n.inputs[1], count, count))
    total = b.Gather(offsets, count)
    flat = b.Reshape(g[0], [-1])
    return [b.Pad(flat, b.Concat(start, total - start - _count(b, flat), axis=0)), None]


@grad_rule("SequenceConstruct", since=11)
def _sequence_construct(b, n, g):
    grads = []
    start = b.const(np.zeros(1, np.int64))
    for i, x in enumerate(n.inputs):
        end = start + _count(b, x)
        grads.append(b.Reshape(b.Slice(g[0], start, end, [0]), b.Shape(x)) if n.needs_grad(i) else None)
        start = end
    return grads


@grad_rule("SequenceInsert", since=11, diff_inputs=(0, 1))
def _sequence_insert(b, n, g):
    sizes = element_sizes(b, n.inputs[0])
    count = _count(b, sizes)
    pos = _position(b, n.inputs[2] if n.has_input(2) else None, count, count)
    start = b.Gather(_offsets(b, sizes), pos)
    end = start + _count(b, n.inputs[1])
    seq = b.Concat(b.Slice(g[0], [0], start), b.Slice(g[0], end, [_END]), axis=0)
    tensor = b.Reshape(b.Slice(g[0], start, end, [0]), b.Shape(n.inputs[1]))
    return [seq if n.needs_grad(0) else None, tensor if n.needs_grad(1) else None, None]


@grad_rule("SequenceErase", since=11, diff_inputs=(0,))
def _sequence_erase(b, n, g):
    sizes = element_sizes(b, n.inputs[0])
    count = _count(b, sizes)
    pos = _position(b, n.inputs[1] if n.has_input(1) else None, count, count - b.const(np.array([1], np.int64)))
    start = b.Gather(_offsets(b, sizes), pos)
    erased = _flat_zeros(b, b.Gather(sizes, pos), g[0])
    return [b.Concat(b.Slice(g[0], [0], start), erased, b.Slice(g[0], start, [_END]), axis=0), None]


@grad_rule("ConcatFromSequence", since=11, diff_inputs=(0,))
def _concat_from_sequence(b, n, g):
    y = n.outputs[0]
    axis = _normalized_axis(n.attr("axis"), y.rank, "ConcatFromSequence")
    one = b.const(np.array([1], np.int64))
    width = b.dim(y, axis)
    if n.attr("new_axis", 0):
        lengths = b.ConstantOfShape(width, value=ir.tensor(np.ones(1, np.int64)))
    else:  # every element has y's shape but along axis: its size over y's size per index there
        per_index = b.Div(_count(b, y), b.Max(width, one))
        lengths = b.Div(element_sizes(b, n.inputs[0]), b.Max(per_index, one))
    pos = chunk_positions(b, y, axis, lengths)
    flat = b.ScatterElements(_flat_zeros(b, _count(b, y), g[0]), pos, b.Reshape(g[0], [-1]), axis=0)
    return [flat]


@grad_rule("Optional", since=15, diff_inputs=(0,))
def _optional(b, n, g):
    return [g[0]] if n.inputs else []


@grad_rule("OptionalGetElement", since=15, diff_inputs=(0,))
def _optional_get_element(b, n, g):
    return [g[0]]
