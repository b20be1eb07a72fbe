"""ValidRowsLossPass: the rows a cross-entropy ignores are not computed.

A masked language model's loss reads the logits of the masked positions only: every other
label is the loss's ``ignore_index`` (about 85% of them in BERT's recipe). The exported graph
still computes the whole head for every position, forward and backward: on the BERT-like
benchmark model (8 x 128 positions, vocabulary 8192) the decoder's [1024, 256] x [256, 8192]
MatMul, its two gradient MatMuls and the softmax over [1024, 8192] are about 13 of the step's
34 GFLOP. Here the rows whose label is not ignored are gathered once,

    rows = Reshape(NonZero(Not(Equal(labels, ignore_index))), [-1])

and every node between the loss and the first node that mixes rows (attention, a Dropout, an
op this pass does not know) computes on those rows only (``Gather(Reshape(x, [-1, D]), rows)``
where the rewritten part begins). onnxruntime's ORTModule had the same optimization (its
"label sparsity" compute optimizer: a Gather before the loss, moved upstream).

The loss is the same: an ignored row adds nothing to the sum and nothing to the ``mean``
reduction's denominator, and its scores get an exact zero gradient, so the weights' gradients
are the same sums over the rows kept (float reassociation aside). With every label ignored the
loss is NaN (``mean``) or 0 (``sum``), as before.

Rewritten when all of these hold (anything else is left alone):

* the loss is ``SoftmaxCrossEntropyLoss`` or ``NegativeLogLikelihoodLoss`` of 2-D scores and
  1-D labels, ``reduction`` ``mean`` or ``sum``, with an ``ignore_index`` attribute (torch's
  cross_entropy always exports one) that the labels' dtype can hold, its ``log_prob`` unused;
* the part computed per row contains a MatMul or Gemm (otherwise there is little to save);
* each node of that part works row by row: a unary op, MatMul by a 2-D matrix, Gemm without
  transA, LayerNormalization / Softmax / LogSoftmax over the last axis (input and output of
  the same rank), a binary elementwise op whose row inputs have the output's leading dims
  (known and equal: no broadcasting over rows) and whose other inputs broadcast along the last
  axis only, a Reshape that keeps the last dim; each of its values has a static last dim and
  is read by that part only (not by another node, not a graph output), or by a ``Shape``: that
  gets a constant (static shape) or the leading dims of the value outside the part they come
  from (then no Reshape on the way is rewritten).

The rows gathered are the labelled ones and row 0 once more with its label ignored (it adds
nothing): never an empty batch, which onnxruntime's inlined SoftmaxCrossEntropyLoss cannot
reshape. (Writing the loss as LogSoftmax + NegativeLogLikelihoodLoss before the gradient instead
cost the GPT-2-like step ~15 ms: their gradients take more passes over the scores than the
loss's own.) Rows with NaN or infinite scores but an ignored label used to make the gradient NaN (0 x NaN);
they are no longer computed, so they no longer do.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.builder import OpBuilder, dims_equal, scope_taken_names
from passes.kernels._graph import (
    CONTRIB_GELUS,
    DEFAULT_DOMAINS,
    MS_DOMAIN,
    default_opset,
    holds_label,
    ignore_index_loss,
    only_use,
    take_over,
)

_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
_UNARY = frozenset({
    "Abs", "Cast", "Celu", "Elu", "Erf", "Exp", "Gelu", "HardSigmoid", "HardSwish", "Identity",
    "LeakyRelu", "Log", "Mish", "Neg", "Reciprocal", "Relu", "Selu", "Sigmoid", "Softplus",
    "Softsign", "Sqrt", "Tanh", "ThresholdedRelu",
})
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "PRelu", "Clip"})
_LAST_AXIS = frozenset({"Softmax", "LogSoftmax", "LayerNormalization"})
_MATMUL = frozenset({"MatMul", "Gemm"})


def _dims(value: ir.Value | None) -> list | None:
    if value is None or value.shape is None:
        return None
    return list(value.shape)


def _last_dim(value: ir.Value) -> int | None:
    dims = _dims(value)
    if not dims or len(dims) < 2 or not isinstance(dims[-1], int):
        return None
    return dims[-1]


def _same_rows(a: ir.Value, b: ir.Value) -> bool:
    """Both have known, equal leading dims (the same rows in the same order)."""
    da, db = _dims(a), _dims(b)
    return (da is not None and db is not None and len(da) == len(db) >= 2
            and all(dims_equal(x, y) for x, y in zip(da[:-1], db[:-1])))


def _broadcast_along_last(value: ir.Value, out_rank: int) -> bool:
    """``value`` broadcasts over every leading axis of an output of rank ``out_rank``."""
    dims = _dims(value)
    return dims is not None and len(dims) <= out_rank and all(d == 1 for d in dims[:-1])


def _row_inputs(node: ir.Node, opset: int) -> list[int] | None:
    """Which inputs of ``node`` are row-shaped, when ``node`` works row by row; else None."""
    if (node.domain not in DEFAULT_DOMAINS and not (node.domain == MS_DOMAIN and node.op_type in CONTRIB_GELUS)) \
            or not node.outputs:
        return None
    out = node.outputs[0]
    op = node.op_type
    if _last_dim(out) is None or any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return None
    if node.domain == MS_DOMAIN:  # a contrib GELU: x, and a bias over the last axis
        x = node.inputs[0] if node.inputs else None
        if x is None or len(_dims(x) or []) != len(_dims(out) or [0]) or _last_dim(x) != _last_dim(out) \
                or any(v is not None and len(_dims(v) or [0, 0]) != 1 for v in node.inputs[1:]):
            return None
        return [0]
    if op in _ELEMENTWISE:
        rows: list[int] = []
        rank = len(_dims(out) or [])
        for i, v in enumerate(node.inputs):
            if v is None:
                continue
            if _same_rows(v, out) and _last_dim(v) is not None:
                rows.append(i)
            elif not _broadcast_along_last(v, rank):
                return None
        return rows or None
    x = node.inputs[0] if node.inputs else None
    if x is None or _last_dim(x) is None:
        return None
    if op == "Reshape":
        return [0] if _last_dim(x) == _last_dim(out) else None
    # unary ops, the last-axis ops and MatMul by a matrix keep the rows by definition: only
    # the ranks must agree (an inferred shape may name the same dims differently, or not at all)
    same_rank = len(_dims(x) or []) == len(_dims(out) or [])
    if op in _UNARY:
        return [0] if same_rank and _last_dim(x) == _last_dim(out) else None
    if op in _LAST_AXIS:
        rank = len(_dims(out) or [])
        axis = node.attributes.get("axis")
        default = 1 if op != "LayerNormalization" and opset < 13 else -1
        a = axis.as_int() if axis is not None else default
        if (a + rank if a < 0 else a) != rank - 1 or not same_rank:
            return None
        if any(v is not None and len(_dims(v) or [0, 0]) != 1 for v in node.inputs[1:]):
            return None  # LayerNormalization's scale and bias: 1-D over the last axis
        return [0]
    if op in _MATMUL:
        w = node.inputs[1] if len(node.inputs) > 1 else None
        if w is None or len(_dims(w) or []) != 2 or not same_rank:
            return None
        if op == "Gemm":
            trans_a = node.attributes.get("transA")
            c = node.inputs[2] if len(node.inputs) > 2 else None
            if (trans_a is not None and trans_a.as_int()) or (c is not None and not _broadcast_along_last(c, 2)):
                return None
        return [0]
    return None


class ValidRowsLossPass(InPlacePass):
    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        opset = default_opset(model)
        modified = False
        for node in list(graph):
            if node.op_type in _LOSSES and node.domain in DEFAULT_DOMAINS and node.graph is graph:
                modified = self._rewrite(graph, node, opset) or modified
        return PassResult(model, modified)

    @staticmethod
    def _rewrite(graph: ir.Graph, loss: ir.Node, opset: int) -> bool:
        ignore = ignore_index_loss(loss)
        scores, labels = loss.inputs[0], loss.inputs[1]
        if (ignore is None or scores is None or labels is None or _last_dim(scores) is None
                or len(_dims(scores) or []) != 2 or len(_dims(labels) or [0, 0]) != 1
                or not holds_label(labels, ignore)):
            return False
        assert labels.dtype is not None  # holds_label checked it
        if not only_use(scores, graph, loss):
            return False
        region, boundary = _region(graph, scores, loss, opset)
        if not any(n.op_type in _MATMUL for n in region):
            return False

        b = OpBuilder(opset)
        b.prefix = f"{loss.name or 'loss'}/valid_rows"
        for key in ("namespace", "pkg.torch.onnx.class_hierarchy"):
            if key in loss.metadata_props:
                b.marks[key] = loss.metadata_props[key]
        ignored = b.const(np.array([ignore], dtype=labels.dtype.numpy()))
        keep = b.Not(b.Equal(b.wrap(labels), ignored))
        kept = b.Reshape(b.NonZero(keep), b.const(np.array([-1], dtype=np.int64)))
        # and row 0 once more, its label ignored: never an empty batch (onnxruntime's inlined
        # SoftmaxCrossEntropyLoss cannot reshape empty scores), and it adds nothing: no loss, no
        # count in the mean, an exact zero gradient
        rows = b.Concat(kept, b.const(np.array([0], dtype=np.int64)), axis=0)
        rows.value.shape = ir.Shape([None])
        kept_labels = b.Concat(b.Gather(b.wrap(labels), kept, axis=0), ignored, axis=0)
        kept_labels.value.type, kept_labels.value.shape = labels.type, ir.Shape([None])
        gathered: dict[int, ir.Value] = {}
        for value in boundary:
            width = _last_dim(value)
            assert width is not None
            flat = b.wrap(value)
            if len(_dims(value) or []) != 2:
                flat = b.Reshape(flat, b.const(np.array([-1, width], dtype=np.int64)))
            picked = b.Gather(flat, rows, axis=0)
            picked.value.type, picked.value.shape = value.type, ir.Shape([None, width])
            gathered[id(value)] = picked.value

        copies: list[ir.Node] = []
        for node in region:  # in graph order
            out = node.outputs[0]
            if node.op_type == "Reshape":
                gathered[id(out)] = gathered[id(node.inputs[0])]
                continue
            rows_at = set(_row_inputs(node, opset) or [])
            inputs: list[ir.Value | None] = []
            for i, v in enumerate(node.inputs):
                if v is None or i in rows_at:
                    inputs.append(None if v is None else gathered[id(v)])
                    continue
                if node.op_type not in _MATMUL and len(_dims(v) or []) > 1:  # [1, .., 1, D] -> [D]
                    flat = b.Reshape(b.wrap(v), b.const(np.array([-1], dtype=np.int64)))
                    flat.value.type = v.type
                    v = flat.value
                inputs.append(v)
            attributes = [a for a in node.attributes.values()]
            if node.op_type in _LAST_AXIS:
                attributes = [a for a in attributes if a.name != "axis"] + [ir.AttrInt64("axis", -1)]
            copy = ir.Node(node.domain, node.op_type, inputs, attributes, num_outputs=1,
                           name=f"{b.prefix}/{node.name or node.op_type}_{len(copies)}")
            copy.metadata_props.update(node.metadata_props)
            copy.outputs[0].name = f"{b.prefix}/{out.name or node.op_type}_{len(copies)}"
            copy.outputs[0].type = out.type
            copy.outputs[0].shape = ir.Shape([None, _last_dim(out)])
            copies.append(copy)
            gathered[id(out)] = copy.outputs[0]
        # the builder's nodes (rows, gathers, flattened operands) first: the copies read them
        scope_taken_names(graph, [*b.nodes, *copies], b.prefix)
        graph.insert_before(loss, [*b.nodes, *copies])
        loss.replace_input_with(0, gathered[id(scores)])
        loss.replace_input_with(1, kept_labels.value)
        if len(loss.outputs) > 1:
            loss.outputs[1].shape = ir.Shape([None, _last_dim(scores)])
        _shapes_without_values(graph, region, opset)
        graph.remove(list(reversed(region)), safe=True)
        return True


def _shape_reader(user: ir.Node, value: ir.Value) -> bool:
    """``user`` is a Shape of ``value`` (of known rank and last dim): it needs the shape only,
    which the rewrite gives it without the value (see _shapes_without_values)."""
    dims = _dims(value)
    return (user.op_type == "Shape" and user.domain in DEFAULT_DOMAINS and dims is not None
            and _last_dim(value) is not None and user.graph is value.graph)  # not in an If / Loop body


def _shapes_without_values(graph: ir.Graph, region: list[ir.Node], opset: int) -> None:
    """Each Shape of a region value gets the shape without the value: a constant for a static
    shape, else the leading dims of the value outside the region they come from (the region's
    nodes but Reshape keep their row inputs' leading dims; _region keeps a Reshape out of such
    a path) and the value's static last dim."""
    inside = {id(n) for n in region}
    for node in region:
        value = node.outputs[0]
        for user, _ in list(value.uses()):
            if not _shape_reader(user, value):
                continue
            dims = list(value.shape or [])
            start, end = user.attributes.get("start"), user.attributes.get("end")
            name = user.outputs[0].name or f"{user.name}_shape"
            b = OpBuilder(opset)
            b.prefix = f"{name}/valid_rows"
            if all(isinstance(d, int) for d in dims):
                b.const(np.array(dims, dtype=np.int64)[slice(start.as_int() if start is not None else None,
                                                             end.as_int() if end is not None else None)])
            else:
                source = value
                while source.producer() is not None and id(source.producer()) in inside:
                    producer = source.producer()
                    assert producer is not None and producer.op_type != "Reshape"
                    rows_at = _row_inputs(producer, opset)
                    assert rows_at
                    source = producer.inputs[rows_at[0]]  # type: ignore[assignment]
                lead = (b.Shape(b.wrap(source), end=-1) if opset >= 15 else
                        b.Slice(b.Shape(b.wrap(source)), b.const(np.array([0])), b.const(np.array([-1]))))
                full = b.Concat(lead, b.const(np.array([dims[-1]], dtype=np.int64)), axis=0)
                if start is not None or end is not None:
                    full = b.Slice(full, b.const(np.array([start.as_int() if start is not None else 0])),
                                   b.const(np.array([end.as_int() if end is not None else 2**62])))
            scope_taken_names(graph, b.nodes, b.prefix)
            graph.insert_before(user, b.nodes)
            take_over(graph, user.outputs[0], b.nodes[-1].outputs[0])
            graph.remove(user, safe=True)


def _region(graph: ir.Graph, scores: ir.Value, loss: ir.Node,
            opset: int) -> tuple[list[ir.Node], list[ir.Value]]:
    """The nodes computed per row above the loss's ``scores`` (graph order) and the row-shaped
    values they read from outside it (where the gathering happens)."""
    order = {id(n): i for i, n in enumerate(graph)}
    region: dict[int, ir.Node] = {}
    # a Shape of a region value does not need the value (_shapes_without_values); a value whose
    # dynamic leading dims a Shape reads is anchored: so is the row input they come from
    anchored: set[int] = set()
    reads: dict[int, ir.Value] = {id(scores): scores}  # row-shaped values read by the region
    row_uses: dict[int, set[tuple[int, int]]] = {id(scores): {(id(loss), 0)}}
    pending = [scores]
    while pending:
        # the latest producer first: the popped producers' graph positions only go down, so
        # every node that reads a value and joins the region has joined before it is popped
        pending.sort(key=lambda v: order.get(id(v.producer()), -1))
        value = pending.pop()
        node = value.producer()
        if node is None or node.graph is not graph or value.is_graph_output() or node.outputs[0] is not value:
            continue
        others = {(id(user), i) for user, i in value.uses() if not _shape_reader(user, value)}
        if others != row_uses[id(value)]:
            continue  # also read elsewhere (or as a matrix): computed whole, gathered here
        rows_at = _row_inputs(node, opset)
        if rows_at is None:
            continue
        dims = _dims(value) or []
        if len(others) < len(value.uses()) and not all(isinstance(d, int) for d in dims):
            anchored.add(id(value))  # its Shape is read: its leading dims must come from outside
        if id(value) in anchored and node.op_type == "Reshape":
            continue  # the leading dims a Shape reads would be lost: the reshaped value is gathered
        if id(value) in anchored:
            anchored.add(id(node.inputs[rows_at[0]]))
        region[id(node)] = node
        for i in rows_at:
            v = node.inputs[i]
            assert v is not None
            if id(v) not in reads:
                reads[id(v)] = v
                pending.append(v)
            row_uses.setdefault(id(v), set()).add((id(node), i))
    nodes = sorted(region.values(), key=lambda n: order[id(n)])
    boundary = [v for v in reads.values() if v.producer() is None or id(v.producer()) not in region]
    return nodes, boundary
