"""Gradients of ops met in exported real models: SplitToSequence / SequenceAt.

The dynamo exporter writes ``torch.split`` (e.g. GPT-2's q/k/v split) as
``SplitToSequence`` followed by one ``SequenceAt`` per used chunk. The gradient that
flows into such a sequence is kept as a *tensor shaped like the split input*: the
``SequenceAt`` rule pads its output gradient with zeros back to the position of its chunk,
the engine sums the contributions of every ``SequenceAt`` (fan-out), and the
``SplitToSequence`` rule passes that tensor on unchanged. Sequences from any other
producer are refused with a clear error.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.autodiff.registry import grad_rule


def _attr(node, name, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


@grad_rule("SplitToSequence", since=11, diff_inputs=(0,))
def _split_to_sequence(b, n, g):
    # g[0] is already a tensor shaped like the input (see the SequenceAt rule).
    return [g[0], None]


@grad_rule("SequenceAt", since=11, diff_inputs=(0,))
def _sequence_at(b, n, g):
    go = g[0]
    if go is None:
        return [None, None]
    producer = n.inputs[0].value.producer()
    if producer is None or producer.op_type != "SplitToSequence" or producer.domain not in ("", "ai.onnx"):
        source = "a graph input" if producer is None else producer.op_type
        raise ValueError(f"SequenceAt gradient needs a sequence made by SplitToSequence, not by {source}")
    x = b.wrap(producer.inputs[0])
    rank = x.rank
    if rank is None:
        raise ValueError("SplitToSequence input of unknown rank")
    axis = _attr(producer, "axis", 0)
    axis = axis + rank if axis < 0 else axis
    int64 = np.int64
    zero = b.const(np.array(0, int64))
    dim = b.dim(x, axis)  # [1]
    pos = b.Reshape(b.Cast(n.inputs[1], to=ir.DataType.INT64), [1])
    split = producer.inputs[1] if len(producer.inputs) > 1 else None
    if split is None:
        if not _attr(producer, "keepdims", 1):
            go = b.Unsqueeze(go, [axis])
        count = dim
        start_of = None
    else:
        split = b.Cast(b.wrap(split), to=ir.DataType.INT64)
        split_rank = b.wrap(producer.inputs[1]).rank
        if split_rank is None:
            raise ValueError("SplitToSequence 'split' input of unknown rank")
        if split_rank == 0:  # equal chunks of `split` elements, the last one may be shorter
            chunk = b.Reshape(split, [1])
            count = b.Div(dim + chunk - b.const(np.array([1], int64)), chunk)
            start_of = ("scalar", chunk)
        else:
            count = b.Reshape(b.Size(split), [1])
            start_of = ("list", b.CumSum(split, zero, exclusive=1))
    pos = b.Where(b.Less(pos, zero), pos + count, pos)
    if start_of is None:
        start = pos
    elif start_of[0] == "scalar":
        start = pos * start_of[1]
    else:
        start = b.Gather(start_of[1], pos, axis=0)
    length = b.dim(go, axis)
    zeros = b.const(np.zeros(rank, int64))
    where = b.const(np.array([axis], int64))
    pad_begin = b.ScatterElements(zeros, where, start, axis=0)
    pad_end = b.ScatterElements(zeros, where, dim - start - length, axis=0)
    return [b.Pad(go, b.Concat(pad_begin, pad_end, axis=0), mode="constant"), None]
