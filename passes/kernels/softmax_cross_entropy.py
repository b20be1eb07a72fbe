"""SplitSoftmaxCrossEntropyPass: ``SoftmaxCrossEntropyLoss`` on 2-D scores as its ONNX function
body, ``LogSoftmax(axis=1)`` then ``NegativeLogLikelihoodLoss``.

onnxruntime (1.32) runs SoftmaxCrossEntropyLoss by inlining its function, whose body reshapes
the [N, C] scores to [N, C, 1] and takes LogSoftmax over axis 1 of that 3-D tensor: a softmax
over a non-innermost axis, which its CPU kernel does through a transpose. On the BERT-like
benchmark model's [1024, 8192] scores that node took 21.0 ms of a ~425 ms training step
(tools/profile_training.py), against 3.2 ms for a Softmax over the innermost axis of the same
scores. Written as LogSoftmax over the last axis of the 2-D scores, the loss is computed by the
fast kernel; the values are the same (the function's definition; ``reduction``,
``ignore_index`` and the optional ``weights`` input go to NegativeLogLikelihoodLoss, the
optional ``log_prob`` output is the LogSoftmax's).

Only 2-D scores of known rank are rewritten (for [N, C, d1, ...] the softmax axis is not the
innermost one either way).

The loss's gradient (passes/autodiff/rules/nn.py) takes ``Softmax(scores)`` again; a Softmax of
the same scores over the same axis after the loss becomes ``Exp(log_prob)``: one pass instead of
the softmax's three, the same values up to rounding (GPT-2-like benchmark model, [1016, 8192]
scores, 2 threads: Softmax 4.9 ms, Exp 3.5 ms, tools/profile_training.py). The scores are then
no longer read after the LogSoftmax (the log-probabilities are kept instead, the same size).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.kernels._graph import take_over


class SplitSoftmaxCrossEntropyPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in list(model.graph):
            if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
                continue
            scores = node.inputs[0]
            if scores is None or scores.shape is None or len(scores.shape) != 2:
                continue
            self._split(model.graph, node)
            modified = True
        return PassResult(model, modified)

    @staticmethod
    def _split(graph: ir.Graph, node: ir.Node) -> None:
        scores, labels = node.inputs[0], node.inputs[1]
        assert scores is not None
        weights = node.inputs[2] if len(node.inputs) > 2 else None
        loss = node.outputs[0]
        log_prob = node.outputs[1] if len(node.outputs) > 1 else None
        if not node.name:  # the values below are named after it
            taken = {n.name for n in graph}
            node.name = next(f"SoftmaxCrossEntropyLoss_{k}" for k in range(len(taken) + 1)
                             if f"SoftmaxCrossEntropyLoss_{k}" not in taken)
        log_softmax = ir.Node("", "LogSoftmax", [scores], [ir.AttrInt64("axis", 1)],
                              name=f"{node.name}/LogSoftmax", metadata_props=dict(node.metadata_props))
        lp = log_softmax.outputs[0]
        lp.name = f"{node.name}/log_prob"
        lp.type, lp.shape = scores.type, scores.shape
        attributes = [a for name, a in node.attributes.items() if name in ("reduction", "ignore_index")]
        nll_inputs = [lp, labels] + ([weights] if weights is not None else [])
        # The loss node keeps the original's name: gradient nodes name it in their grad_of mark.
        nll = ir.Node("", "NegativeLogLikelihoodLoss", nll_inputs, attributes,
                      name=node.name, metadata_props=dict(node.metadata_props))
        node.name = f"{node.name}/replaced"
        graph.insert_before(node, [log_softmax, nll])
        new_loss = nll.outputs[0]
        new_loss.type, new_loss.shape = loss.type, loss.shape
        take_over(graph, loss, new_loss)
        if log_prob is not None:
            take_over(graph, log_prob, lp)
        after = False
        for other in list(graph):
            if other is node:
                after = True
            elif after and _row_softmax_of(other, scores):
                exp = ir.Node("", "Exp", [lp], name=f"{other.name}/from_log_prob" if other.name else None,
                              metadata_props=dict(other.metadata_props))
                exp.outputs[0].type, exp.outputs[0].shape = other.outputs[0].type, other.outputs[0].shape
                graph.insert_before(other, exp)
                take_over(graph, other.outputs[0], exp.outputs[0])
                graph.remove(other, safe=True)
        graph.remove(node, safe=True)


def _row_softmax_of(node: ir.Node, scores: ir.Value) -> bool:
    """``node`` is a Softmax of the 2-D ``scores`` over their last axis (any opset: for 2-D
    inputs the pre-13 "coerce to 2-D at axis" semantics and the default axes agree)."""
    if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx") or not node.inputs \
            or node.inputs[0] is not scores:
        return False
    axis = node.attributes.get("axis")
    return axis is None or axis.as_int() in (1, -1)

