"""Gradients of control-flow ops: If, Scan and Loop.

If: the backward of ``If(cond)`` is another ``If(cond)``. Each of its branches recomputes
the forward branch body (a clone reading the same outer-scope values), differentiates
it with the engine (:class:`~passes.autodiff.engine.GraphGradient`) from the gradients
of the If outputs, and returns one gradient per captured value that needs one (zeros
where the branch does not depend on it), so both branches have the same outputs.

Scan and Loop: back-propagation through the iterations by *recomputation*; the forward
node is left as it is (rules only read the forward graph) and the backward holds

1. a recording copy of the forward node: the same inputs and body, except that the body
   returns, instead of its scan outputs, the values it starts each iteration from (its
   loop-carried inputs; for Loop also the iteration number and the condition), which the
   copy stacks along a new axis 0 (body nodes that only fed the dropped scan outputs are
   removed from the copy);
2. a reverse sweep whose body is a clone of the forward body followed by its gradient
   (built by the engine, as for If). For iteration k it reads the recorded inputs of k,
   is seeded with the gradient of k's state outputs (loop-carried in the sweep, starting
   from the gradient of the final states) and of k's scan outputs (a slice of the incoming
   gradient), and returns the gradient of k's state inputs (carried on), of k's slices of
   the scan inputs, and of the captured outer-scope values that need one (weights read in
   the body), summed over the iterations in loop-carried accumulators starting at zero.

Scan: the sweep is a Scan over (recorded states, the forward scan inputs, the gradients
of the forward scan outputs) with every direction flipped and the forward axes kept; its
scan outputs are the gradients of the scan inputs (same axes, flipped directions). Any
``scan_input_axes``, ``scan_output_axes`` and directions (opset 9+ semantics, unchanged up
to the newest Scan, whose later versions only add types) are supported; a Scan without
loop-carried state needs no recording copy.

Loop (opset 11+ semantics, unchanged since): the sweep is a Loop of T iterations, T the
number of iterations the recording copy ran (trip-count, condition-driven or both:
the condition only decides T); sweep iteration j reads index T-1-j of the stacks with
Gather, so a loop of zero iterations passes the final-state gradients through. The
gradient of the forward scan outputs (stacked along axis 0) is read the same way.

Rules inside a body read operand ranks, which ONNX shape inference leaves out where a body
declares none (Loop-carried values above all: their shape may change). So the sweep's clone
gets the node's input types and shapes on its untyped inputs (a state: its initial value's;
a scan slice: the scan input's without the scanned axis) and its node outputs get what ONNX
shape inference then finds (outer-scope constants declared with their values).

Refused with ValueError (the engine reports it naming the node): loop-carried values or
scan outputs that are not tensors (sequences, optionals); body outputs that are
outer-scope values, not computed in the body (onnxruntime refuses those too); loop-carried
values whose shape changes between iterations (the recording stacks them) where shape
inference shows it (a state output of another rank or static size than the state input;
where it does not show it, onnxruntime refuses the gradient graph). Scan over a
zero-length sequence is not supported (onnxruntime's Scan refuses those in the forward
already).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from passes.autodiff.builder import NodeView, OpBuilder, Var
from passes.autodiff.engine import GraphGradient, is_float
from passes.autodiff.registry import grad_rule

_BRANCHES = ("then_branch", "else_branch")
# Index of the first captured value in the rule's input list (after ``cond``).
_FIRST_CAPTURED = 1


def _rename_all(graph: ir.Graph, tag: str) -> None:
    """Prefix every node and value name made inside ``graph`` (recursively) with ``tag``."""
    graph.name = tag
    for k, node in enumerate(ir.traversal.RecursiveGraphIterator(graph)):
        node.name = f"{tag}/{node.name or node.op_type}_{k}"
        for out in node.outputs:
            if out.name:
                out.name = f"{tag}/{out.name}"


def _check_outputs(body: ir.Graph) -> None:
    """Refuse branch outputs that are not produced inside the branch (outer values returned as
    is); the branch's own initializers (onnxscript's optimizer folds constants into them) are fine.

    onnx_ir loads such an output as a value unconnected to the outer one, so its gradient
    would be lost silently; onnxruntime refuses these models too.
    """
    initializers = {id(v) for v in body.initializers.values()}  # constants: no gradient, fine
    for value in body.outputs:
        producer = value.producer()
        if id(value) not in initializers and (producer is None or producer.graph is not body):
            raise ValueError(f"branch {body.name!r} returns {value.name!r}, which it does not compute; "
                             "put an Identity inside the branch (onnxruntime requires it as well)")


def _branch_gradient(b: OpBuilder, body: ir.Graph, out_grads: list[Var | None],
                     wanted: list[ir.Value], tag: str) -> ir.Graph:
    """A graph with no inputs whose outputs are d(loss)/d(wanted) through ``body``."""
    _check_outputs(body)
    clone = body.clone(allow_outer_scope_values=True)
    sub = OpBuilder(b.opset, b.opset_imports)
    sub.prefix = "grad"
    seeds = [(out, None if g is None else sub.wrap(g.value))
             for out, g in zip(clone.outputs, out_grads)]
    grads = GraphGradient(clone, seeds, wanted, sub).gradients()
    outputs = []
    for value, grad in zip(wanted, grads):
        if grad is None:
            grad = sub.zeros_like(sub.wrap(value))
        # Identity: a branch output must be produced inside the branch.
        result = sub.Identity(grad).value
        result.type = value.type
        result.shape = value.shape
        outputs.append(result)
    clone.extend(sub.nodes)
    clone.outputs.clear()
    clone.outputs.extend(outputs)
    _rename_all(clone, tag)
    return clone


@grad_rule("If")
def _if(b, n, g):
    """Gradients of the captured values through whichever branch ``cond`` selects."""
    captured = [v.value for v in n.captured]
    wanted_idx = [k for k in range(len(captured)) if n.needs_grad(_FIRST_CAPTURED + k)]
    result: list[Var | None] = [None] * (_FIRST_CAPTURED + len(captured))
    if not wanted_idx:
        return result
    wanted = [captured[k] for k in wanted_idx]
    branches = {
        name: _branch_gradient(b, n.node.attributes[name].value, g, wanted, b.fresh_name(name))
        for name in _BRANCHES
    }
    outs = b.If(n.inputs[0], _outputs=len(wanted), **branches)
    outs = outs if isinstance(outs, list) else [outs]
    for k, value, out in zip(wanted_idx, wanted, outs):
        out.value.type = value.type
        out.value.shape = value.shape
        result[_FIRST_CAPTURED + k] = out
    return result


# ---- Scan and Loop --------------------------------------------------------------------------

# Loop bodies start with (iteration number, condition) and return the condition first.
_LOOP_LEAD_IN = 2
_LOOP_LEAD_OUT = 1
_ITER, _COND = 0, 1


def _typed(value: ir.Value, like: ir.Value) -> ir.Value:
    value.type = like.type
    value.shape = like.shape
    return value


def _body_of(n: NodeView) -> ir.Graph:
    """The node's ``body`` after the checks every sweep needs."""
    body = n.node.attributes["body"].value
    local = {id(v) for v in body.inputs} | {id(v) for v in body.initializers.values()}
    for value in body.outputs:
        producer = value.producer()
        if id(value) not in local and (producer is None or producer.graph is not body):
            raise ValueError(f"the body of {n.name!r} returns {value.name!r}, an outer-scope value "
                             "it does not compute; put an Identity inside the body")
    for value in [*body.inputs, *body.outputs]:
        if value.type is not None and not isinstance(value.type, ir.TensorType):
            raise ValueError(f"{n.op_type} gradient supports tensor loop-carried values and scan "
                             f"outputs only; {value.name!r} in the body of {n.name!r} is {value.type}")
    return body


def _prune(graph: ir.Graph) -> None:
    """Remove the nodes of ``graph`` whose outputs nothing reads (graph outputs are read)."""
    for node in reversed(list(graph)):
        if all(not out.uses() and not out.is_graph_output() for out in node.outputs):
            graph.remove(node, safe=True)


def _recording_body(b: OpBuilder, body: ir.Graph, keep: int, record: Sequence[int],
                    tag: str) -> ir.Graph:
    """``body`` returning its first ``keep`` outputs, then its inputs ``record`` (as scan outputs)."""
    clone = body.clone(allow_outer_scope_values=True)
    sub = OpBuilder(b.opset, b.opset_imports)
    sub.prefix = "record"
    recorded = [_typed(sub.Identity(clone.inputs[i]).value, clone.inputs[i]) for i in record]
    kept = list(clone.outputs[:keep])
    clone.outputs.clear()
    clone.extend(sub.nodes)
    clone.outputs.extend(kept + recorded)
    _prune(clone)
    _rename_all(clone, tag)
    return clone


# Outer constants up to this many elements go into the shape inference of a body as
# initializers (data propagation reads them: Reshape shapes, Unsqueeze axes ...).
_INFER_CONST_LIMIT = 4096


def _infer_shapes(b: OpBuilder, graph: ir.Graph, outer: Sequence[ir.Value]) -> None:
    """Give ``graph``'s node outputs the types and shapes ONNX shape inference finds where they
    have none (rules inside a body read operand ranks). ``outer``: the values the graph reads
    from outside, declared to the inference (small constants with their values)."""
    proto = ir.serde.serialize_graph(graph)
    declared = {v.name for v in proto.input} | {t.name for t in proto.initializer}
    for value in outer:
        if not value.name or value.name in declared:
            continue
        array = b.const_value(b.wrap(value))
        if array is not None and array.size <= _INFER_CONST_LIMIT:
            proto.initializer.append(onnx.numpy_helper.from_array(array, value.name))
        elif value.type is not None:
            proto.input.append(ir.serde.serialize_value(value))
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in b.opset_imports.items()]
    try:
        inferred = onnx.shape_inference.infer_shapes(onnx.helper.make_model(proto, opset_imports=opsets),
                                                     strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is best effort; the rules say what they miss
        return
    found = {vi.name: vi.type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    for node in graph:
        for out in node.outputs:
            type_proto = found.get(out.name or "")
            if type_proto is None or not type_proto.HasField("tensor_type"):
                continue
            if out.type is None:
                out.type = ir.serde.deserialize_type_proto_for_type(type_proto)
            if out.shape is None:
                out.shape = ir.serde.deserialize_type_proto_for_shape(type_proto)


def _shapes_differ(a: ir.Shape | None, b: ir.Shape | None) -> bool:
    """Whether two shapes are known to differ (rank, or a static dim)."""
    if a is None or b is None:
        return False
    return len(a) != len(b) or any(isinstance(x, int) and isinstance(y, int) and x != y
                                   for x, y in zip(a, b))


def _without_axis(shape: ir.Shape | None, axis: int) -> ir.Shape | None:
    if shape is None:
        return None
    dims = list(shape)
    del dims[axis % len(dims)]
    return ir.Shape(dims)


class _Sweep:
    """The body of a reverse sweep: one forward iteration (a clone of the forward body) and its
    gradient. ``bind`` first (Loop: Gathers from the stacks; Scan: none), then ``differentiate``
    and ``finish`` with the sweep body's inputs and outputs."""

    def __init__(self, b: OpBuilder, body: ir.Graph, lead_in: int, lead_out: int, states: int,
                 tag: str) -> None:
        self.clone = body.clone(allow_outer_scope_values=True)
        self.lead_in, self.lead_out, self.states = lead_in, lead_out, states
        self.tag = tag
        self.pre = OpBuilder(b.opset, b.opset_imports)  # nodes that go before the clone's
        self.pre.prefix = "bind"
        self.sub = OpBuilder(b.opset, b.opset_imports)  # the gradient nodes, after the clone's
        self.sub.prefix = "grad"
        # what stands for each clone input in the iteration (the input itself unless bound)
        self.iteration: list[ir.Value] = list(self.clone.inputs)

    def complete(self, b: OpBuilder, outer_like: Sequence[tuple[ir.TypeProtocol | None, ir.Shape | None]],
                 outer: Sequence[ir.Value]) -> None:
        """Type the clone's inputs that the body leaves untyped (``outer_like``: type and shape
        of each input in the iteration, from the node's inputs), then infer the shapes inside."""
        for value, (type_, shape) in zip(self.clone.inputs, outer_like):
            if value.type is None:
                value.type = type_
            if value.shape is None and shape is not None:
                value.shape = shape
        _infer_shapes(b, self.clone, outer)
        for i in range(self.states):
            start, end = self.clone.inputs[self.lead_in + i], self.clone.outputs[self.lead_out + i]
            if _shapes_differ(start.shape, end.shape):
                raise ValueError(f"loop-carried value {start.name!r} changes shape in an iteration "
                                 f"({start.shape} to {end.shape}); the gradient records it per iteration, "
                                 "which needs one shape")

    def new_input(self, hint: str, like: ir.Value) -> ir.Value:
        return ir.Value(name=f"{self.tag}/{hint}", type=like.type, shape=like.shape)

    def used(self, index: int) -> bool:
        value = self.clone.inputs[index]
        return bool(value.uses()) or value.is_graph_output()

    def bind(self, index: int, value: Var) -> None:
        """Clone input ``index`` becomes ``value`` (a node of ``pre``)."""
        old = self.clone.inputs[index]
        _typed(value.value, old)
        old.replace_all_uses_with(value.value, replace_graph_outputs=True)
        self.iteration[index] = value.value

    def state_in(self, i: int) -> ir.Value:
        return self.iteration[self.lead_in + i]

    def differentiate(self, d_states: dict[int, Var], d_scans: dict[int, Var],
                      wrt: Sequence[ir.Value]) -> list[Var | None]:
        """Gradients of ``wrt`` seeded with ``d_states`` (state index: gradient of that state
        output) and ``d_scans`` (scan output index: gradient of this iteration's slice)."""
        outs = self.clone.outputs
        first_scan = self.lead_out + self.states
        seeds = [(outs[self.lead_out + i], g) for i, g in d_states.items()]
        seeds += [(outs[first_scan + k], g) for k, g in d_scans.items()]
        return GraphGradient(self.clone, seeds, list(wrt), self.sub).gradients()

    def output(self, grad: Var | None, like: ir.Value) -> ir.Value:
        """``grad`` (zeros when None) as a body output typed like ``like``."""
        sub = self.sub
        value = sub.zeros_like(sub.wrap(like)) if grad is None else grad
        return _typed(sub.Identity(value).value, like)

    def accumulate(self, acc: ir.Value, grad: Var | None) -> ir.Value:
        sub = self.sub
        total = sub.wrap(acc) if grad is None else sub.Add(acc, grad)
        return _typed(sub.Identity(total).value, acc)

    def finish(self, inputs: Sequence[ir.Value], outputs: Sequence[ir.Value]) -> ir.Graph:
        clone = self.clone
        for value in clone.inputs:  # an unbound input keeps its place in ``inputs``
            value.name = f"{self.tag}/{value.name}"
        if self.pre.nodes:
            if len(clone):
                clone.insert_before(clone.node(0), self.pre.nodes)
            else:
                clone.extend(self.pre.nodes)
        clone.extend(self.sub.nodes)
        clone.inputs.clear()
        clone.inputs.extend(inputs)
        clone.outputs.clear()
        clone.outputs.extend(outputs)
        _prune(clone)  # forward nodes the gradient does not read (e.g. the condition's)
        _rename_all(clone, self.tag)
        return clone


def _attr_ints(n: NodeView, name: str, count: int) -> list[int]:
    values = n.attr(name)
    if values is None:
        return [0] * count
    if len(values) != count:
        raise ValueError(f"{name} of {n.name!r} has {len(values)} entries for {count} values")
    return [int(v) for v in values]


def _final_grads(n: NodeView, g: list[Var | None], states: Sequence[int], first_input: int) -> list[Var]:
    """The gradient of each final state (zeros where none flows back): the sweep's start."""
    result = []
    for i in states:
        grad, start = g[i], n.inputs[first_input + i]
        if grad is None:
            if start is None:
                raise ValueError(f"loop-carried input {first_input + i} of {n.name!r} is missing")
            grad = n.b.zeros_like(start)
        result.append(grad)
    return result


def _outputs(values: Var | list[Var], likes: Sequence[ir.Value | ir.DataType | None]) -> list[Var]:
    """The outputs of a Scan/Loop the rule made, typed like ``likes`` (a value: its type and
    shape; a data type: a tensor of it, shape unknown, for the stacks of the recordings;
    None: unknown)."""
    outs = values if isinstance(values, list) else [values]
    for out, like in zip(outs, likes, strict=True):
        if isinstance(like, ir.Value):
            _typed(out.value, like)
        else:
            out.value.type = None if like is None else ir.TensorType(like)
            out.value.shape = None
    return outs


@grad_rule("Scan", since=9)
def _scan(b, n, g):
    """Recording Scan (the states each iteration starts from), then a reverse Scan sweep."""
    node = n.node
    body = _body_of(n)
    n_scan = int(n.attr("num_scan_inputs"))
    n_states = len(node.inputs) - n_scan
    n_outs = len(node.outputs) - n_states
    in_axes = _attr_ints(n, "scan_input_axes", n_scan)
    in_dirs = _attr_ints(n, "scan_input_directions", n_scan)
    out_axes = _attr_ints(n, "scan_output_axes", n_outs)
    out_dirs = _attr_ints(n, "scan_output_directions", n_outs)
    captured = [v.value for v in n.captured]
    base = len(node.inputs)
    result: list[Var | None] = [None] * (base + len(captured))
    float_states = [i for i in range(n_states) if is_float(node.inputs[i])]
    want_x = [m for m in range(n_scan) if n.needs_grad(n_states + m)]
    want_c = [c for c in range(len(captured)) if n.needs_grad(base + c)]
    if not (any(n.needs_grad(i) for i in float_states) or want_x or want_c):
        return result

    stacks: list[Var] = []
    if n_states:
        recording = _recording_body(b, body, n_states, range(n_states), b.fresh_name("scan_record"))
        finals = list(node.outputs[:n_states])
        outs = _outputs(b.Scan(*node.inputs, _outputs=2 * n_states, body=recording,
                               num_scan_inputs=n_scan, scan_input_axes=in_axes,
                               scan_input_directions=in_dirs, scan_output_axes=[0] * n_states,
                               scan_output_directions=[0] * n_states),
                        finals + [v.dtype for v in finals])
        stacks = outs[n_states:]

    sweep = _Sweep(b, body, 0, 0, n_states, b.fresh_name("scan_sweep"))
    slices = [(v.type, v.shape) for v in node.inputs[:n_states]]
    slices += [(v.type, _without_axis(v.shape, axis)) for v, axis in zip(node.inputs[n_states:], in_axes)]
    sweep.complete(b, slices, captured)
    d_in = {i: sweep.new_input(f"d_state_{i}", sweep.clone.inputs[i]) for i in float_states}
    acc_in = [sweep.new_input(f"acc_{c}", captured[c]) for c in want_c]
    d_scans = [k for k in range(n_outs) if g[n_states + k] is not None
               and is_float(node.outputs[n_states + k])]
    dy_in = {k: sweep.new_input(f"d_out_{k}", sweep.clone.outputs[n_states + k]) for k in d_scans}
    wrt = ([sweep.state_in(i) for i in float_states]
           + [sweep.iteration[n_states + m] for m in want_x] + [captured[c] for c in want_c])
    grads = sweep.differentiate({i: sweep.sub.wrap(v) for i, v in d_in.items()},
                                {k: sweep.sub.wrap(v) for k, v in dy_in.items()}, wrt)
    n_float, n_x = len(float_states), len(want_x)
    g_states, g_x, g_c = grads[:n_float], grads[n_float:n_float + n_x], grads[n_float + n_x:]
    body_outputs = [sweep.output(gr, sweep.state_in(i)) for i, gr in zip(float_states, g_states)]
    body_outputs += [sweep.accumulate(acc, gr) for acc, gr in zip(acc_in, g_c)]
    body_outputs += [sweep.output(gr, sweep.iteration[n_states + m]) for m, gr in zip(want_x, g_x)]
    sweep_body = sweep.finish([*d_in.values(), *acc_in, *sweep.clone.inputs, *dy_in.values()],
                              body_outputs)

    starts = _final_grads(n, g, float_states, 0) + [b.zeros_like(b.wrap(captured[c])) for c in want_c]
    scanned = [*stacks, *node.inputs[n_states:], *(g[n_states + k] for k in d_scans)]
    likes = ([node.inputs[i] for i in float_states] + [captured[c] for c in want_c]
             + [node.inputs[n_states + m] for m in want_x])
    outs = _outputs(b.Scan(
        *starts, *scanned, _outputs=len(body_outputs), body=sweep_body,
        num_scan_inputs=len(scanned),
        scan_input_axes=[0] * len(stacks) + in_axes + [out_axes[k] for k in d_scans],
        scan_input_directions=([1] * len(stacks) + [1 - d for d in in_dirs]
                               + [1 - out_dirs[k] for k in d_scans]),
        scan_output_axes=[in_axes[m] for m in want_x] or None,
        scan_output_directions=[1 - in_dirs[m] for m in want_x] or None), likes)
    for i, out in zip(float_states, outs):
        if n.needs_grad(i):
            result[i] = out
    rest = outs[len(float_states):]
    for c, out in zip(want_c, rest):
        result[base + c] = out
    for m, out in zip(want_x, rest[len(want_c):]):
        result[n_states + m] = out
    return result


@grad_rule("Loop", since=11)
def _loop(b, n, g):
    """Recording Loop (iteration numbers, conditions, states), then a reverse Loop sweep."""
    node = n.node
    body = _body_of(n)
    n_states = len(node.inputs) - _LOOP_LEAD_IN
    n_outs = len(node.outputs) - n_states
    captured = [v.value for v in n.captured]
    base = len(node.inputs)
    result: list[Var | None] = [None] * (base + len(captured))
    float_states = [i for i in range(n_states) if is_float(node.inputs[_LOOP_LEAD_IN + i])]
    want_c = [c for c in range(len(captured)) if n.needs_grad(base + c)]
    if not (any(n.needs_grad(_LOOP_LEAD_IN + i) for i in float_states) or want_c):
        return result

    recording = _recording_body(b, body, _LOOP_LEAD_OUT + n_states,
                                range(_LOOP_LEAD_IN + n_states), b.fresh_name("loop_record"))
    finals = list(node.outputs[:n_states])
    outs = _outputs(b.Loop(*node.inputs, _outputs=n_states + _LOOP_LEAD_IN + n_states, body=recording),
                    [*finals, ir.DataType.INT64, ir.DataType.BOOL, *(v.dtype for v in finals)])
    stacks = outs[n_states:]  # iteration numbers, conditions, then the states
    count = b.Size(stacks[_ITER])
    count.value.shape = ir.Shape([])
    last = b.Sub(count, b.const(np.array(1, np.int64)))

    sweep = _Sweep(b, body, _LOOP_LEAD_IN, _LOOP_LEAD_OUT, n_states, b.fresh_name("loop_sweep"))
    scalar = ir.Shape([])
    sweep.complete(b, [(ir.TensorType(ir.DataType.INT64), scalar), (ir.TensorType(ir.DataType.BOOL), scalar),
                       *((v.type, v.shape) for v in node.inputs[_LOOP_LEAD_IN:])], captured)
    pre = sweep.pre
    step = ir.Value(name=f"{sweep.tag}/j", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond = ir.Value(name=f"{sweep.tag}/cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    k = pre.Sub(last, step)
    if sweep.used(_ITER):
        sweep.bind(_ITER, k)
    for index in range(_COND, _LOOP_LEAD_IN + n_states):
        if index == _COND and not sweep.used(_COND):
            continue
        sweep.bind(index, pre.Gather(stacks[index], k, axis=0))
    d_in = {i: sweep.new_input(f"d_state_{i}", sweep.clone.inputs[_LOOP_LEAD_IN + i])
            for i in float_states}
    acc_in = [sweep.new_input(f"acc_{c}", captured[c]) for c in want_c]
    first_scan = _LOOP_LEAD_OUT + n_states
    d_scans = {}
    for j in range(n_outs):
        grad = g[n_states + j]
        if grad is not None and is_float(node.outputs[n_states + j]):
            d_scans[j] = _typed(pre.Gather(grad, k, axis=0).value, sweep.clone.outputs[first_scan + j])
    wrt = [sweep.state_in(i) for i in float_states] + [captured[c] for c in want_c]
    grads = sweep.differentiate({i: sweep.sub.wrap(v) for i, v in d_in.items()},
                                {j: sweep.sub.wrap(v) for j, v in d_scans.items()}, wrt)
    g_states, g_c = grads[:len(float_states)], grads[len(float_states):]
    body_outputs = [_typed(sweep.sub.Identity(cond).value, cond)]
    body_outputs += [sweep.output(gr, sweep.state_in(i)) for i, gr in zip(float_states, g_states)]
    body_outputs += [sweep.accumulate(acc, gr) for acc, gr in zip(acc_in, g_c)]
    sweep_body = sweep.finish([step, cond, *d_in.values(), *acc_in], body_outputs)

    starts = (_final_grads(n, g, float_states, _LOOP_LEAD_IN)
              + [b.zeros_like(b.wrap(captured[c])) for c in want_c])
    likes = ([node.inputs[_LOOP_LEAD_IN + i] for i in float_states]
             + [captured[c] for c in want_c])
    outs = _outputs(b.Loop(count, b.const(np.array(True)), *starts, _outputs=len(starts),
                           body=sweep_body), likes)
    for i, out in zip(float_states, outs):
        if n.needs_grad(_LOOP_LEAD_IN + i):
            result[_LOOP_LEAD_IN + i] = out
    for c, out in zip(want_c, outs[len(float_states):]):
        result[base + c] = out
    return result
