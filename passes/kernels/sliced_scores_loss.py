"""WholeScoresLossPass: a cross-entropy over a slice of the scores, computed on all of them with
the labels of the cut-away positions ignored.

A causal language model's loss takes the logits of all positions but the last,
``cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))``. Exported, the
``Slice`` copies the [B, S-1, V] logits (the model's largest activation) in the forward, and its
gradient pads the scores' gradient back with a ``Pad`` in the backward: on the GPT-2-like
benchmark model (V = 8192, B x S = 8 x 128), 7.0 ms and 4.5 ms of a ~420 ms training step
(tools/profile_training.py) and a second copy of the logits alive between them. Written as

    loss(Reshape(logits, [-1, V]), Reshape(Pad(Reshape(labels, sliced dims), cut, ignore_index), [-1]))

the scores are a view of the logits, the labels of the positions the slice dropped are the
loss's ``ignore_index`` and the loss is the same: an ignored position adds nothing to the sum
and nothing to the ``mean`` reduction's denominator (the sum of the weights of the positions not
ignored), and its scores get an exact zero gradient.

Rewritten when all of these hold (anything else is left alone):

* the loss is ``SoftmaxCrossEntropyLoss``, or ``NegativeLogLikelihoodLoss`` of a
  ``LogSoftmax`` over the last axis of 2-D scores, with ``reduction`` ``mean`` or ``sum`` and an
  ``ignore_index`` attribute (torch's cross_entropy always exports one), its ``log_prob`` output
  unused;
* its scores are ``Reshape(Slice(X), [n, C])`` (constant shape without a 0, ``C`` the known last
  dim of ``X``), each used only there (torch's legacy and dynamo exports both write this);
* the ``Slice`` has constant starts/ends/axes, steps of 1, and does not cut the last (class)
  axis; a cut axis of unknown length needs a start >= 0 and an end < 0 (or "to the end"), and
  must be at least ``start - end`` long at run time (shorter, the original's slice would be
  empty: the rewritten labels' Reshape fails instead).

The cut-away rows' scores are now read: NaN or infinite scores there (which the original never
read) give a NaN gradient instead of zero, and the step is then skipped as non-finite.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.builder import OpBuilder, scope_taken_names
from passes.kernels._graph import (
    DEFAULT_DOMAINS,
    const_array,
    default_opset,
    holds_label,
    ignore_index_loss,
    only_use,
    producer,
)

_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
_TO_END = 2**62  # a Slice end at least this large means "to the end"


def _pads(slice_node: ir.Node, x: ir.Value) -> tuple[list[int], list[int]] | None:
    """Per leading axis of ``x``, how many positions the Slice cut at the start and the end."""
    if x.shape is None:
        return None
    rank = len(x.shape)
    starts, ends = const_array(slice_node.inputs[1]), const_array(slice_node.inputs[2])
    inputs = list(slice_node.inputs) + [None] * (5 - len(slice_node.inputs))
    axes = const_array(inputs[3]) if inputs[3] is not None else np.arange(rank if starts is None else len(starts))
    steps = const_array(inputs[4]) if inputs[4] is not None else None
    if starts is None or ends is None or axes is None or (inputs[4] is not None and steps is None):
        return None
    if steps is not None and not np.all(steps == 1):
        return None
    begin, end = [0] * (rank - 1), [0] * (rank - 1)
    for axis, s, e in zip(axes.reshape(-1).tolist(), starts.reshape(-1).tolist(), ends.reshape(-1).tolist()):
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis < rank - 1:
            return None  # the class axis, or out of range
        dim = x.shape[axis]
        if isinstance(dim, int):
            s = min(max(s + dim if s < 0 else s, 0), dim)
            e = min(max(e + dim if e < 0 else e, 0), dim)
            if e <= s:
                return None  # an empty slice: left to the runtime
            begin[axis], end[axis] = s, dim - e
        elif s >= 0 and (-_TO_END < e < 0 or e >= _TO_END):
            begin[axis], end[axis] = s, (-e if e < 0 else 0)
        else:
            return None
    return begin, end


class WholeScoresLossPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        opset = default_opset(model)
        modified = False
        for node in list(graph):
            if node.op_type in _LOSSES and node.domain in DEFAULT_DOMAINS:
                modified = self._rewrite(graph, node, opset) or modified
        return PassResult(model, modified)

    @staticmethod
    def _rewrite(graph: ir.Graph, loss: ir.Node, opset: int) -> bool:
        ignore = ignore_index_loss(loss)
        if ignore is None:
            return False
        scores_user, scores = loss, loss.inputs[0]
        if loss.op_type == "NegativeLogLikelihoodLoss":
            log_softmax = producer(scores, "LogSoftmax")
            if log_softmax is None or not only_use(scores, graph, loss):
                return False
            axis = log_softmax.attributes.get("axis")  # on 2-D scores every default is the last
            if axis is not None and axis.as_int() not in (1, -1):
                return False
            scores_user, scores = log_softmax, log_softmax.inputs[0]
        reshape = producer(scores, "Reshape")
        if reshape is None or not only_use(scores, graph, scores_user):
            return False
        target = const_array(reshape.inputs[1])  # [n, C]; a 0 (copy a dim, or an empty tensor) is not
        sliced = reshape.inputs[0]
        slice_node = producer(sliced, "Slice")
        if (slice_node is None or target is None or target.shape != (2,) or target[1] <= 0
                or target[0] == 0 or not only_use(sliced, graph, reshape)):
            return False
        x = slice_node.inputs[0]
        assert x is not None
        if x.shape is None or len(x.shape) < 2 or x.shape[-1] != int(target[1]):
            return False
        pads = _pads(slice_node, x)
        labels = loss.inputs[1]
        if pads is None or not holds_label(labels, ignore):
            return False  # also: no label of this dtype can be the ignore_index
        assert labels is not None and labels.dtype is not None
        begin, end = pads
        b = OpBuilder(opset)
        b.prefix = f"{loss.name or 'loss'}/whole_scores"
        for key in ("namespace", "pkg.torch.onnx.class_hierarchy"):
            if key in loss.metadata_props:
                b.marks[key] = loss.metadata_props[key]
        whole = b.Reshape(b.wrap(x), b.const(np.array([-1, int(target[1])], dtype=np.int64)))
        whole.value.type = x.type
        whole.value.shape = ir.Shape([None, int(target[1])])
        lead = b.Slice(b.Shape(b.wrap(x)), b.const(np.array([0])), b.const(np.array([-1])))
        cut = b.const(np.array([p + q for p, q in zip(begin, end)], dtype=np.int64))
        kept = b.Reshape(b.wrap(labels), b.Sub(lead, cut))
        fill = b.const(np.array(ignore, dtype=labels.dtype.numpy()))
        padded = b.Pad(kept, b.const(np.array(begin + end, dtype=np.int64)), fill)
        flat = b.Reshape(padded, b.const(np.array([-1], dtype=np.int64)))
        flat.value.type = labels.type
        flat.value.shape = ir.Shape([None])
        scope_taken_names(graph, b.nodes, b.prefix)
        graph.insert_before(scores_user, b.nodes)
        scores_user.replace_input_with(0, whole.value)
        loss.replace_input_with(1, flat.value)
        if scores_user is not loss:
            scores_user.outputs[0].shape = ir.Shape([None, int(target[1])])
        if len(loss.outputs) > 1:  # an unread log_prob output now has every row
            loss.outputs[1].shape = ir.Shape([None, int(target[1])])
        graph.remove([reshape, slice_node], safe=True)
        return True
