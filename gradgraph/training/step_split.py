"""The training step as two runs, the non-finite guard between them, the update in place.

A training graph whose finite check reads only what the update takes (the loss, the learning
rate, the gradients: ``UpdateOptions.guard_before_update``) is cut in two
(:func:`split_at_guard`):

1. the *gradient* run: every node the graph's other outputs need (forward, backward,
   accumulation, unscaling, clipping, the finite flag, the loss scale's update); it also
   outputs the values the update reads from it (``carried``: the gradients as the update takes
   them), which stay on the session's device;
2. the *update* run: the remaining nodes (the optimizer's), which compute the outputs marked
   ``gradgraph.valid_if``. It runs only when the flag is true, so a skipped step changes
   nothing and the update needs no spare buffer to take a bad step back.

:func:`aliasing` decides which updated outputs ``X.out`` a run may write over their input ``X``
(bound to the same OrtValue): only where every node reading ``X`` (or a view of it: Reshape,
Identity, ... may alias their input) is the node writing ``X.out`` or one of its ancestors, and
that node, when it reads ``X`` itself, is elementwise (it reads each element before it writes
it). The others keep a spare buffer, swapped in after the run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import onnx

from passes.optimizer.optimizer_pass import VALID_IF_KEY

logger = logging.getLogger("gradgraph.training")

# Ops whose output onnxruntime may place over their input (an alias, not a copy).
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
# Ops that compute each output element from the same element of their inputs (and scalars or
# broadcast operands): writing the output over one input is safe.
ELEMENTWISE_OPS = frozenset({
    "Abs", "Add", "Cast", "Ceil", "Clip", "Div", "Exp", "Floor", "Identity", "Log", "Max", "Mean",
    "Min", "Mul", "Neg", "Pow", "Reciprocal", "Relu", "Sigmoid", "Sign", "Sqrt", "Sub", "Sum",
    "Tanh", "Where",
})


@dataclasses.dataclass
class StepSplit:
    """The two graphs of a split step (see the module docstring)."""

    gradients: onnx.ModelProto
    update: onnx.ModelProto
    carried: list[str]  # outputs of ``gradients`` that ``update`` takes as inputs
    flag: str | None  # the gradient run's output that says whether to run the update


def _reads(node: onnx.NodeProto) -> set[str]:
    """Every value ``node`` reads: its inputs and what its subgraphs take from outside."""
    names = {n for n in node.input if n}
    for attr in node.attribute:
        graphs = [attr.g] if attr.HasField("g") else list(attr.graphs)
        for graph in graphs:
            inner = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
            inner |= {i.name for i in graph.initializer}
            for sub in graph.node:
                names |= _reads(sub) - inner
    return names


def _ancestors(nodes: Sequence[onnx.NodeProto], producer: Mapping[str, int],
               roots: Iterable[str]) -> set[int]:
    """Indices of the nodes that the values ``roots`` depend on (their producers included)."""
    seen: set[int] = set()
    stack = [producer[r] for r in roots if r in producer]
    while stack:
        index = stack.pop()
        if index in seen:
            continue
        seen.add(index)
        stack.extend(producer[v] for v in _reads(nodes[index]) if v in producer)
    return seen


def valid_if_flags(model: onnx.ModelProto, key: str) -> dict[str, str]:
    """{output: flag output} of the outputs marked ``key`` (``gradgraph.valid_if``)."""
    return {o.name: p.value for o in model.graph.output for p in o.metadata_props if p.key == key}


def split_at_guard(model: onnx.ModelProto, held: Iterable[str], takes: Iterable[str]) -> StepSplit | str:
    """``model`` cut into the gradient and the update run, or why it cannot be (a sentence).

    ``held``: the inputs the session holds (weights, state); ``takes``: the other inputs the
    update may read (the learning rate). The updates conditional on a finite step are the
    outputs marked ``gradgraph.valid_if``.
    """
    graph = model.graph
    conditional = valid_if_flags(model, VALID_IF_KEY)
    flags = set(conditional.values())
    if not conditional:
        return "the graph marks no update as conditional on a finite step"
    if len(flags) > 1:
        return f"the updates depend on several flags {sorted(flags)}"
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    first = [o.name for o in graph.output if o.name not in conditional]
    second = [o.name for o in graph.output if o.name in conditional]
    front = _ancestors(nodes, producer, first)
    back = _ancestors(nodes, producer, second) - front
    made_in_front = [o for o in second if o not in producer or producer[o] in front]
    if made_in_front:
        return f"updated values {made_in_front[:3]} are computed before the finite check"
    inputs = {i.name: i for i in graph.input}
    initializers = {t.name: t for t in graph.initializer}
    read = set().union(*(_reads(nodes[i]) for i in back))
    carried = sorted(v for v in read if v in producer and producer[v] in front)
    allowed = set(held) | set(takes)
    foreign = sorted(v for v in read if v in inputs and v not in allowed)
    if foreign:
        return f"the update reads inputs {foreign[:3]} that are neither held nor the learning rate"
    read_front = set().union(*(_reads(nodes[i]) for i in front)) if front else set()
    values = {v.name: v for v in list(graph.value_info) + list(graph.output) + list(graph.input)}

    def part(name: str, picked: set[int], ins: list[onnx.ValueInfoProto],
             outs: list[onnx.ValueInfoProto], uses: set[str]) -> onnx.ModelProto:
        sub = onnx.ModelProto()  # filled part by part: the whole graph is never copied
        sub.ir_version, sub.producer_name = model.ir_version, model.producer_name
        sub.opset_import.extend(model.opset_import)
        sub.functions.extend(model.functions)
        sub.metadata_props.extend(model.metadata_props)
        sub.graph.name = f"{graph.name}_{name}"
        sub.graph.node.extend(nodes[i] for i in sorted(picked))
        sub.graph.input.extend(ins)
        sub.graph.output.extend(outs)
        sub.graph.initializer.extend(t for n, t in initializers.items() if n in uses)
        sub.graph.value_info.extend(v for v in graph.value_info if v.name in uses)
        return sub

    front_inputs = [i for i in graph.input if i.name in read_front or i.name not in read]
    front_outputs = [o for o in graph.output if o.name not in conditional]
    front_outputs += [values[v] if v in values else onnx.ValueInfoProto(name=v) for v in carried]
    gradients = part("gradients", front, front_inputs, front_outputs,
                     read_front | {o.name for o in front_outputs})
    update_outputs = []
    for output in graph.output:
        if output.name in conditional:
            plain = onnx.ValueInfoProto()
            plain.CopyFrom(output)
            del plain.metadata_props[:]  # the update runs only on a finite step: no flag here
            update_outputs.append(plain)
    update_inputs = [inputs[v] for v in inputs if v in read]
    update_inputs += [values[v] if v in values else onnx.ValueInfoProto(name=v) for v in carried]
    update = part("update", back, update_inputs, update_outputs, read | set(second))
    return StepSplit(gradients, update, carried, flags.pop())


def typed_inputs(model: onnx.ModelProto, types: Mapping[str, onnx.TypeProto]) -> None:
    """Give the inputs of ``model`` named in ``types`` that have no type that type."""
    for value in model.graph.input:
        if value.name in types and not value.HasField("type"):
            value.type.CopyFrom(types[value.name])


def aliasing(model: onnx.ModelProto, updates: Mapping[str, str]) -> dict[str, str | None]:
    """{held input: None where its updated output may be written over it, else why not}."""
    nodes = list(model.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in _reads(node):
            readers.setdefault(name, []).append(index)
    verdicts: dict[str, str | None] = {}
    for held, out in updates.items():
        if out not in producer:
            verdicts[held] = f"{out!r} is not computed by a node"
            continue
        writer = producer[out]
        views, stack = {held}, [held]  # the input and the values that may share its memory
        while stack:
            for index in readers.get(stack.pop(), []):
                node = nodes[index]
                if node.op_type in VIEW_OPS and node.domain in ("", "ai.onnx"):
                    fresh = [o for o in node.output if o and o not in views]
                    views.update(fresh)
                    stack.extend(fresh)
        before = _ancestors(nodes, producer, [out])
        late = sorted({nodes[i].name or nodes[i].op_type for v in views for i in readers.get(v, [])
                       if i not in before})
        node = nodes[writer]
        if late:
            verdicts[held] = f"{late[:3]} read {held!r} and may run after {out!r} is written"
        elif views & set(node.input) and (node.op_type not in ELEMENTWISE_OPS
                                          or node.domain not in ("", "ai.onnx")):
            verdicts[held] = f"{node.op_type} {node.name!r} reads {held!r} while writing {out!r}"
        else:
            verdicts[held] = None
    return verdicts


def writable_in_place(model: onnx.ModelProto, held: Iterable[str], updated: Callable[[str], str],
                      device: str, what: str) -> set[str]:
    """The held inputs of ``model`` whose update a run may write over them (see :func:`aliasing`);
    on a device other than the CPU none (aliasing is verified on onnxruntime's CPU kernels only).
    What keeps a spare buffer, and why, is logged (``gradgraph.training``, INFO)."""
    outputs = {o.name for o in model.graph.output}
    conditional = valid_if_flags(model, VALID_IF_KEY)
    updates = {n: updated(n) for n in held if updated(n) in outputs and updated(n) not in conditional}
    if not updates:
        return set()
    if device != "cpu":
        logger.info("%s: %d updated tensors keep a spare buffer (updates in place are verified on "
                    "the CPU provider only, not on %s)", what, len(updates), device)
        return set()
    verdicts = aliasing(model, updates)
    spared = {n: why for n, why in verdicts.items() if why is not None}
    if spared:
        shown = "; ".join(f"{n}: {why}" for n, why in list(spared.items())[:3])
        logger.info("%s: %d of %d updated tensors keep a spare buffer (%s%s)", what, len(spared),
                    len(updates), shown, " ..." if len(spared) > 3 else "")
    return {n for n, why in verdicts.items() if why is None}


def _shape(model: onnx.ModelProto, name: str) -> list[int | None] | None:
    """The shape of value ``name`` as the graph records it (an input, initializer or
    value_info; None where unrecorded, a dimension None where symbolic)."""
    for value in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        if value.name == name and value.type.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
    for tensor in model.graph.initializer:
        if tensor.name == name:
            return list(tensor.dims)
    return None


def reusable_inputs(model: onnx.ModelProto, names: Iterable[str]) -> dict[str, str]:
    """{intermediate value: input of ``names``} where the run may write that value over the
    input's buffer (the input fed as an OrtValue of its own, dead after): the input's one reader
    is an elementwise node (not a Cast) whose other operands are recorded as single numbers
    (every dimension 1, no higher rank than the input), so its output has the input's shape and
    type. The value becomes a
    graph output of ``model`` (added here), which the runner binds to the input's OrtValue.

    SGD's ``lr * g``: the update's one temporary of a weight's size lands in the gradient."""
    nodes = list(model.graph.node)
    outputs = {o.name for o in model.graph.output}
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in _reads(node):
            readers.setdefault(name, []).append(index)
    try:  # the update graph holds no weights: its shapes are inferred in milliseconds
        shaped = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - onnx raises several types; the recorded shapes then
        shaped = model
    reuse: dict[str, str] = {}
    for name in names:
        found = readers.get(name, [])
        shape = _shape(shaped, name)
        if len(found) != 1 or shape is None:
            continue
        node = nodes[found[0]]
        if (node.op_type not in ELEMENTWISE_OPS or node.op_type == "Cast" or node.domain not in ("", "ai.onnx")
                or len(node.output) != 1 or node.output[0] in outputs or node.output[0] in reuse):
            continue
        others = [i for i in node.input if i and i != name]
        if node.op_type in ("Where", "Pow") and node.input[0 if node.op_type == "Where" else 1] == name:
            continue  # a condition or an exponent: the output's type is another operand's
        shapes = [_shape(shaped, i) for i in others]
        if all(o is not None and len(o) <= len(shape) and all(d == 1 for d in o) for o in shapes):
            reuse[node.output[0]] = name
    model.graph.output.extend(onnx.ValueInfoProto(name=v) for v in reuse)
    return reuse


FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
FLAG = "gradgraph.update_finite"


def finite_check(update: onnx.ModelProto) -> onnx.ModelProto:
    """The update graph computing only whether every new float value is finite (output
    :data:`FLAG`), each value reduced as soon as it is made, then freed: run before the update
    in place, it keeps a step whose update would overflow (finite gradients, a learning rate of
    1e30) from writing non-finite weights or state, at the cost of computing the update twice.

    A float32/float64 value's sum is NaN/inf when an element is (an overflowing sum counts as
    not finite too); other types are multiplied by 0 first (NaN for NaN/inf, else 0)."""
    graph = update.graph
    outputs = {o.name: o.type.tensor_type.elem_type for o in graph.output}
    check = onnx.ModelProto()
    check.CopyFrom(update)
    del check.graph.node[:]
    del check.graph.output[:]
    verdicts: list[str] = []
    for node in graph.node:
        check.graph.node.append(node)
        for out in node.output:
            dtype = outputs.get(out)
            if dtype is None or dtype not in (*FLOATS, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
                continue
            i = len(verdicts)
            source = out
            if dtype not in FLOATS:  # float16's sum of finite values may overflow
                check.graph.node.append(onnx.helper.make_node("Sub", [out, out], [f"{FLAG}/zero{i}"]))
                source = f"{FLAG}/zero{i}"
            check.graph.node.extend([
                onnx.helper.make_node("ReduceSum", [source], [f"{FLAG}/sum{i}"], keepdims=0),
                onnx.helper.make_node("Sub", [f"{FLAG}/sum{i}", f"{FLAG}/sum{i}"], [f"{FLAG}/nan{i}"]),
                onnx.helper.make_node("Cast", [f"{FLAG}/nan{i}"], [f"{FLAG}/v{i}"], to=onnx.TensorProto.FLOAT),
            ])
            verdicts.append(f"{FLAG}/v{i}")
    if not verdicts:
        check.graph.node.append(onnx.helper.make_node(
            "Constant", [], [FLAG], value=onnx.helper.make_tensor(FLAG, onnx.TensorProto.BOOL, [], [True])))
    else:
        check.graph.node.extend([
            onnx.helper.make_node("Sum", verdicts, [f"{FLAG}/all"]),
            onnx.helper.make_node("IsNaN", [f"{FLAG}/all"], [f"{FLAG}/any_nan"]),
            onnx.helper.make_node("Not", [f"{FLAG}/any_nan"], [FLAG]),
        ])
    check.graph.output.append(onnx.helper.make_tensor_value_info(FLAG, onnx.TensorProto.BOOL, []))
    return check
