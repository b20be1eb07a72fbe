"""Split a forward+backward graph into a forward model and a backward model.

The two models run one after the other, as ORTModule runs its graph on both sides of the
YieldOp: the forward returns the model's outputs and the activations the backward keeps; the
backward takes those activations (and whatever inputs it reads) and returns the gradients.

Where the cut goes is read from the node marks (:mod:`passes.marks`), never from names:

1. the backward side is every node marked backward, recompute or optimizer, and every node that
   reads a value the backward side produces (so a cast of a gradient goes with the backward);
   except a ``Shape`` or ``Size`` of a forward value: it runs in the forward, so that the
   backward keeps a few int64s instead of the whole tensor it only needs the shape of. A graph
   input that only backward-side nodes read (an output gradient's seed) counts as a backward
   value: its ``Shape`` runs in the backward. A node reads what the nodes of its subgraphs
   (If branches, Loop and Scan bodies) read from the outer graph;
2. the forward side is every other node; it reads graph inputs, initializers and its own values
   only, so it runs alone;
3. the forward's outputs are the graph outputs it produces, then the *stash*: every value it
   produces that a backward-side node reads, in node order (the boundary the memory
   optimizer of onnxruntime-training and torch's partitioner call saved activations). A
   ``Constant`` the backward reads is copied into the backward rather than stashed; a view
   (Reshape, Squeeze, Unsqueeze, Flatten, Identity) the backward reads is run again in the
   backward on its stashed input (a view as a graph output is a copy in onnxruntime), as is a
   Transpose of the last two axes that only matrix products read (onnxruntime folds it into
   them unless it is a graph output);
4. the backward's inputs are the stash, the forward graph outputs it reads (the loss, for loss
   scaling), then the graph inputs it reads; its outputs are the graph outputs the backward side
   produces. Each side keeps the initializers it reads (a copy when both read one: make weights
   inputs first, :class:`passes.forward.ParamsToInputsPass`, to share them).
5. a node none of whose values reaches a graph output (the ``vjp`` product and sum that
   :class:`passes.autodiff.VjpSeedPass` adds: only its gradient is used) is on neither side, so
   the forward stashes nothing for it and the backward does not recompute it.

The split is exact: running the forward, then the backward on the forward's stash, gives the
same values as running the whole graph.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from passes.autodiff.engine import captured_values
from passes.marks import Role, role_of
from passes.subgraphs import node_subgraphs

BACKWARD_SIDE = frozenset({Role.BACKWARD, Role.RECOMPUTE, Role.OPTIMIZER})
SHAPE_ONLY = frozenset({"Shape", "Size"})
SPLIT_KEY = "gradgraph.split"


class SplitError(ValueError):
    """The graph cannot be split (no backward node, or a forward output the backward produces)."""


@dataclasses.dataclass(frozen=True)
class ForwardBackwardSplit:
    """The two models and how their values connect."""

    forward: ir.Model
    backward: ir.Model
    #: forward outputs that are the model's own outputs (graph outputs made by the forward)
    user_outputs: tuple[str, ...]
    #: forward outputs kept for the backward (activations), in the forward's output order
    stashed: tuple[str, ...]
    #: backward inputs that come from the forward (stash first, then user outputs it reads)
    from_forward: tuple[str, ...]
    #: backward inputs fed by the caller (graph inputs the backward reads)
    from_caller: tuple[str, ...]


def _is_constant(node: ir.Node) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx") and not node.inputs


def _owners(graph: ir.Graph) -> dict[int, ir.Node]:
    """Each node inside a subgraph (If branches, Loop and Scan bodies, nested) -> the node of
    ``graph`` that holds it: a value an inner node reads is read by that node."""
    return {id(inner): node for node in graph for sub in node_subgraphs(node)
            for inner in ir.traversal.RecursiveGraphIterator(sub)}


def _readers(value: ir.Value, owners: dict[int, ir.Node]) -> list[ir.Node]:
    """The nodes of the top graph that read ``value``, directly or inside their subgraphs."""
    return [owners.get(id(u.node), u.node) for u in value.uses()]


def backward_side(graph: ir.Graph, owners: dict[int, ir.Node] | None = None) -> list[bool]:
    """For each node in graph order: does it belong to the backward side (rule 1)?
    ``owners``: :func:`_owners` of ``graph`` where the caller has it."""
    owners = _owners(graph) if owners is None else owners
    # Graph inputs only backward-side nodes read (the seeds of output gradients) are the
    # backward's: a Shape of one runs there too, the forward is never fed them.
    produced_by_backward: set[int] = {
        id(v) for v in graph.inputs
        if v.uses() and all(role_of(r) in BACKWARD_SIDE for r in _readers(v, owners))}
    sides = []
    for node in graph:
        reads = [v for v in node.inputs if v is not None] + captured_values(node)
        reads_backward = any(id(v) in produced_by_backward for v in reads)
        shape_only = node.op_type in SHAPE_ONLY and node.domain in ("", "ai.onnx")
        back = reads_backward or (role_of(node) in BACKWARD_SIDE and not shape_only)
        if back:
            produced_by_backward.update(id(v) for v in node.outputs)
        sides.append(back)
    return sides


def split_forward_backward(model: ir.Model) -> ForwardBackwardSplit:
    """Split ``model`` (not modified) into forward and backward models (module docstring)."""
    graph = model.graph
    owners = _owners(graph)
    sides = backward_side(graph, owners)
    if not any(sides):
        raise SplitError("the graph has no backward node (no node is marked gradgraph.stage = "
                         "backward): build the gradient graph first (GradientPass)")
    nodes = list(graph)
    dead = _dead_nodes(graph, owners)
    sides = [b and id(n) not in dead for n, b in zip(nodes, sides)]
    back_ids = {id(n) for n, b in zip(nodes, sides) if b}
    graph_outputs = {id(v) for v in graph.outputs}

    replayed = _replayed_views(nodes, sides, dead, back_ids, owners, graph_outputs)
    readers_back = back_ids | {id(nodes[i]) for i in replayed}

    # Which forward values cross the cut, and which Constants are copied instead.
    copied_constants: set[int] = set()  # node indices
    crossing: list[ir.Value] = []  # node outputs are distinct values: no duplicates
    for index, (node, back) in enumerate(zip(nodes, sides)):
        if back or id(node) in dead or index in replayed:
            continue
        for value in node.outputs:
            if not any(id(r) in readers_back for r in _readers(value, owners)):
                continue
            if _is_constant(node):
                copied_constants.add(index)
            else:
                crossing.append(value)
    stashed = [v for v in crossing if id(v) not in graph_outputs]
    user_outputs = [v for v in graph.outputs
                    if v.producer() is None or id(v.producer()) not in back_ids]
    outputs_read = [v for v in crossing if id(v) in graph_outputs]
    back_outputs = [v for v in graph.outputs if v.producer() is not None and id(v.producer()) in back_ids]
    graph_inputs_read = [v for v in graph.inputs
                         if any(id(r) in readers_back for r in _readers(v, owners))]

    proto = ir.to_proto(model)
    if any(v.type is None for v in crossing):  # the halves' inputs and outputs need their types
        proto = _infer_types(proto, crossing)
    _fill_shape_only_shapes(proto, {v.name for v in crossing})
    forward = ir.from_proto(proto)
    backward = ir.from_proto(proto)
    # A replayed view stays in the forward only where a user output or a node the forward keeps
    # reads it (a view read by another replayed view only is not: readers come later, so in
    # reverse order each view's readers are decided before it).
    kept_ids = {id(n) for i, (n, b) in enumerate(zip(nodes, sides))
                if not b and id(n) not in dead and i not in replayed}
    needed_in_forward: set[int] = set()
    for i in sorted(replayed, reverse=True):
        if any(id(v) in graph_outputs or any(id(r) in kept_ids for r in _readers(v, owners))
               for v in nodes[i].outputs):
            needed_in_forward.add(i)
            kept_ids.add(id(nodes[i]))
    keep_in_forward = {i for i, (n, b) in enumerate(zip(nodes, sides)) if not b and id(n) not in dead
                       and (i not in replayed or i in needed_in_forward)}
    keep_in_backward = {i for i, b in enumerate(sides) if b} | copied_constants | replayed

    # Forward: the forward side, outputs = user outputs + stash.
    fwd_nodes = list(forward.graph)
    fwd_values = _values_by_name(forward.graph)
    forward.graph.outputs.clear()
    forward.graph.outputs.extend(fwd_values[v.name] for v in user_outputs + stashed)
    _remove(forward.graph, [n for i, n in enumerate(fwd_nodes) if i not in keep_in_forward])
    _drop_unused_constants(forward.graph, graph_outputs_names={v.name for v in forward.graph.outputs})
    _prune_inputs(forward.graph)

    # Backward: the crossing values become inputs, then the forward side goes.
    bwd_nodes = list(backward.graph)
    bwd_values = _values_by_name(backward.graph)
    backward.graph.outputs.clear()
    backward.graph.outputs.extend(bwd_values[v.name] for v in back_outputs)
    new_inputs: list[ir.Value] = []
    for value in stashed + outputs_read:
        old = bwd_values[value.name]
        new = ir.Value(name=old.name, type=old.type, shape=old.shape)
        old.replace_all_uses_with(new)
        new_inputs.append(new)
    caller_inputs = [bwd_values[v.name] for v in graph_inputs_read]
    _remove(backward.graph, [n for i, n in enumerate(bwd_nodes) if i not in keep_in_backward])
    backward.graph.inputs.clear()
    backward.graph.inputs.extend(new_inputs + caller_inputs)
    _prune_initializers(backward.graph)  # the forward's were pruned with its inputs
    for part, name in ((forward, "forward"), (backward, "backward")):
        part.graph.metadata_props[SPLIT_KEY] = name
    return ForwardBackwardSplit(
        forward=forward, backward=backward,
        user_outputs=tuple(v.name or "" for v in user_outputs),
        stashed=tuple(v.name or "" for v in stashed),
        from_forward=tuple(v.name or "" for v in stashed + outputs_read),
        from_caller=tuple(v.name or "" for v in graph_inputs_read))


# Ops whose output is a view of their data input: onnxruntime aliases the input's buffer, except
# for a graph output, which it copies (ORTModule's forward session, GPT-2-like model: 52
# Reshapes whose outputs the backward kept, 9-14 ms of its ~160 ms, tools/profile_ortmodule.py).
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
# Matrix products onnxruntime folds a Transpose of their input into (MatmulTransposeFusion,
# GemmTransposeFusion) when the Transpose swaps the last two axes and is not a graph output.
# A Transpose reading a Transpose is cancelled by onnxruntime's transpose optimizer (level 1).
_TRANSPOSE_FOLDING = frozenset({"MatMul", "Gemm", "Transpose"})


def _folded_transpose(node: ir.Node, owners: dict[int, ir.Node]) -> bool:
    """``node`` is a Transpose of the last two axes that only matrix products (or Transposes,
    as the gradient of a product writes them) read, directly: replayed, it costs nothing on
    either side (each product reads its input transposed). Stashed,
    it is a pass over the tensor in the forward and a copy of it kept (the GPT-2-like model's
    tied [256, 8192] embedding read by its LM head: 3 ms of ORTModule's forward)."""
    perm = node.attributes.get_ints("perm")
    rank = len(perm) if perm is not None else 0
    if rank < 2 or list(perm) != [*range(rank - 2), rank - 1, rank - 2]:
        return False
    uses = node.outputs[0].uses()
    return bool(uses) and all(u.node.op_type in _TRANSPOSE_FOLDING and u.node.domain in ("", "ai.onnx")
                              and owners.get(id(u.node), u.node) is u.node for u in uses)


def _replayed_views(nodes: list[ir.Node], sides: list[bool], dead: set[int], back_ids: set[int],
                    owners: dict[int, ir.Node], graph_outputs: set[int]) -> set[int]:
    """Indices of the forward view nodes (:data:`VIEW_OPS`, and Transposes that matrix products
    fold, see :func:`_folded_transpose`) the backward reads the output of: run again in the
    backward on their input (stashed instead, the same bytes) rather than stashed themselves.
    In reverse order, so that a chain of views is replayed whole."""
    replayed: set[int] = set()
    readers_back = set(back_ids)
    for index in reversed(range(len(nodes))):
        node = nodes[index]
        if sides[index] or id(node) in dead or node.domain not in ("", "ai.onnx") or node_subgraphs(node):
            continue
        if node.op_type not in VIEW_OPS and not (node.op_type == "Transpose" and _folded_transpose(node, owners)):
            continue
        data = node.inputs[0] if node.inputs else None
        out = node.outputs[0]
        if data is None or id(out) in graph_outputs or len(node.outputs) != 1:
            continue
        if any(id(r) in readers_back for r in _readers(out, owners)):
            replayed.add(index)
            readers_back.add(id(node))
    return replayed


def _dead_nodes(graph: ir.Graph, owners: dict[int, ir.Node]) -> set[int]:
    """Ids of the nodes none of whose values reaches a graph output (rule 5); a value read
    inside a subgraph is read by the subgraph's node. Nodes are in graph order, so a node's
    readers are decided before it."""
    outputs = {id(v) for v in graph.outputs}
    dead: set[int] = set()
    for node in reversed(list(graph)):
        if not any(id(v) in outputs or any(id(r) not in dead for r in _readers(v, owners))
                   for v in node.outputs):
            dead.add(id(node))
    return dead


def _remove(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """``graph.remove(nodes, safe=True)``, the nodes inside their subgraphs first detached from
    what they read (a Loop body reading an outer value another removed node makes)."""
    for node in nodes:
        for sub in node_subgraphs(node):
            for inner in ir.traversal.RecursiveGraphIterator(sub):
                for i in range(len(inner.inputs)):
                    inner.replace_input_with(i, None)
    graph.remove(nodes, safe=True)


def _values_by_name(graph: ir.Graph) -> dict[str | None, ir.Value]:
    values: dict[str | None, ir.Value] = {v.name: v for v in graph.inputs}
    values.update(graph.initializers)
    for node in graph:
        for value in node.outputs:
            values[value.name] = value
    return values


def _drop_unused_constants(graph: ir.Graph, graph_outputs_names: set[str | None]) -> None:
    dead = [n for n in graph if _is_constant(n)
            and not any(o.uses() or o.name in graph_outputs_names for o in n.outputs)]
    if dead:
        graph.remove(dead, safe=False)


def _prune_inputs(graph: ir.Graph) -> None:
    """Drop graph inputs nothing reads (the caller then need not feed them)."""
    outputs = {id(v) for v in graph.outputs}
    kept = [v for v in graph.inputs if v.uses() or id(v) in outputs]
    if len(kept) != len(graph.inputs):
        graph.inputs.clear()
        graph.inputs.extend(kept)
    _prune_initializers(graph)


def _prune_initializers(graph: ir.Graph) -> None:
    outputs = {id(v) for v in graph.outputs}
    for name, value in list(graph.initializers.items()):
        if not value.uses() and id(value) not in outputs and not value.is_graph_input():
            graph.initializers.pop(name)


def _fill_shape_only_shapes(proto, names: set[str | None]) -> None:
    """A crossing ``Shape``/``Size`` output without a shape gets one (graph inputs and outputs
    need a shape field): ``[rank]`` / ``[]``, the rank unknown when its input's is."""
    import onnx

    known = {vi.name for vi in proto.graph.value_info if vi.type.tensor_type.HasField("shape")}
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in
             list(proto.graph.value_info) + list(proto.graph.input) + list(proto.graph.output)
             if vi.type.tensor_type.HasField("shape")}
    for node in proto.graph.node:
        if node.op_type not in SHAPE_ONLY or node.output[0] not in names or node.output[0] in known:
            continue
        if node.op_type == "Size":
            dims: list[int | str | None] = []
        elif node.input[0] in ranks and not any(a.name in ("start", "end") for a in node.attribute):
            dims = [ranks[node.input[0]]]
        else:
            dims = [None]
        proto.graph.value_info.append(onnx.helper.make_tensor_value_info(
            node.output[0], onnx.TensorProto.INT64, dims))


def _infer_types(proto, crossing: list[ir.Value]):
    """ONNX shape inference for a graph whose crossing values lack types; refuses what stays untyped."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - reported with the values that need it
        inferred = proto
        reason = f" (shape inference failed: {str(exc).splitlines()[0][:200]})"
    else:
        reason = ""
    typed = {vi.name for vi in list(inferred.graph.value_info) + list(inferred.graph.output)
             if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
    missing = [v.name for v in crossing if v.type is None and v.name not in typed]
    if missing:
        raise SplitError(f"the values {missing[:5]} cross from the forward to the backward but have no "
                         f"type{reason}; give the model value_info for them")
    return inferred
