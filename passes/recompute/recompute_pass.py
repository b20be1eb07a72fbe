"""RecomputePass: trade stashed activations for recomputation in a forward+backward graph.

Runs on a model whose nodes carry the marks of :mod:`passes.marks` (forward / backward). It

1. picks groups of forward nodes to recompute: the reference patterns of
   :mod:`passes.recompute.patterns` (Gelu, attention Dropout, transformer layers) selected by
   :class:`RecomputeOptions`, then, with ``memory_budget``, the min-cut planner of
   :mod:`passes.recompute.planner` over the stashes that remain;
2. clones each group's nodes that a backward-read value depends on (``<node>_recompute``
   nodes, ``<value>_recompute`` outputs, marked ``recompute`` with ``recompute_of``); a clone
   reads the clones of producers in its group and the original values otherwise (those stay
   stashed). A training Dropout is cloned as ``Where(mask, x / (1 - ratio), 0)`` over the
   forward's mask, ``1 - ratio`` in float32: onnxruntime's kernel divides (``x * (1 / (1 -
   ratio))`` differs in the last bit), so the clone is bit-exact;
3. rewires only **backward** consumers to the clones; values that existing clones read, and
   values a layer hands to later layers, are never rewired (they stay stashed anyway);
4. places each clone just before its first consumer (a backward node or another clone) in the
   graph's node order.

It is idempotent: forward nodes that already have a clone are not cloned again, and the
planner does not run on a graph that holds planner clones. References: ORT
``orttraining/core/optimizer/{localized_recompute,dropout_recompute,
transformer_layer_recompute}.cc``, ``memory_optimizer/*``; torch
``_functorch/partitioners.py`` (min-cut).

**What onnxruntime needs** (stock onnxruntime 1.32, CPU; measured on a synthetic chain of six
64 MiB activations read back in reverse, arena off, peak RSS growth of one run: 384 MiB
without recompute; see also tools/bench_recompute.py):

1. an execution order that runs clones late. With the default order onnxruntime may run a
   clone as soon as its inputs exist (the clones depend only on forward values): on the
   synthetic chain all are alive at the start of the backward and nothing is saved (384 MiB),
   while ``ExecutionOrder.PRIORITY_BASED`` follows the graph's node order, where this pass
   puts each clone just before its first consumer (128 MiB). On the BERT- and GPT-2-like
   models of tools/bench_recompute.py the default order did as well for layer recompute
   (activation growth x0.79 / x0.75 vs x0.75 / x0.79 with PRIORITY_BASED) and better for the
   planner (x0.80 / x0.79 vs x1.02 / x0.96), so sessions keep the default order (a user's
   ``sess_options`` may choose PRIORITY_BASED);
2. no common-subexpression elimination: ``graph_optimization_level >= ORT_ENABLE_BASIC``
   merges every clone back into its original (320 MiB). Either ``ORT_DISABLE_ALL`` or
   ``InferenceSession(..., disabled_optimizers=["CommonSubexpressionElimination"])`` with
   the other optimizations on (128 MiB).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from passes.autodiff.engine import captured_values
from passes.autodiff.errors import GradientError
from passes.marks import RECOMPUTE_OF_KEY, STAGE_KEY, Role, mark, role_of
from passes.names import free_name
from passes.recompute.analysis import SHAPE_ONLY_READERS, is_activation_producer, value_bytes
from passes.recompute.options import RecomputeOptions
from passes.recompute.patterns import (
    LAYER_SEARCHES,
    RecomputeGroup,
    attn_dropout_groups,
    const_scalar,
    find_layers,
    gelu_groups,
    recomputable,
    transformer_layer_groups,
)
from passes.recompute.planner import RecomputePlan, RecomputeProblem, plan_recompute

RECOMPUTE_BY_KEY = "gradgraph.recompute_by"
SUFFIX = "_recompute"
PLANNER = "planner"  # recompute_by of the planner's clones
DROPOUT_DEFAULT_RATIO = 0.5  # ONNX Dropout's default ratio
# Session settings recompute needs on stock onnxruntime (module docstring).
SESSION_DISABLED_OPTIMIZERS = ("CommonSubexpressionElimination",)


# ---- cloning -------------------------------------------------------------------------------


def _clone_outputs(node: ir.Node) -> list[ir.Value]:
    """The outputs of ``node`` that a clone recomputes (a Dropout's mask is reused, not cloned)."""
    return list(node.outputs[:1]) if node.op_type == "Dropout" else list(node.outputs)


def _dropout_keep(node: ir.Node, dtype: ir.DataType) -> np.ndarray:
    """``1 - ratio`` in float32, as onnxruntime's Dropout kernel divides by it."""
    ratio = const_scalar(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None \
        else DROPOUT_DEFAULT_RATIO
    if ratio is None:
        raise ValueError(f"Dropout {node.name!r}: ratio is not a constant")
    return np.asarray(np.float32(1.0) - np.float32(ratio)).astype(dtype.numpy())


def _clone(node: ir.Node, inputs: Sequence[ir.Value | None], by: str) -> list[ir.Node]:
    """Nodes recomputing ``node`` from ``inputs``; the last one's outputs match ``_clone_outputs``."""
    name = node.name or node.op_type
    meta = {k: v for k, v in node.metadata_props.items() if not k.startswith("gradgraph.")}
    if node.op_type == "Dropout":
        x = inputs[0]
        out = node.outputs[0]
        assert x is not None and out.dtype is not None
        keep = ir.node("Constant", [], {"value": ir.tensor(_dropout_keep(node, out.dtype))},
                       name=f"{name}_keep{SUFFIX}")
        zero = ir.node("Constant", [], {"value": ir.tensor(np.zeros((), out.dtype.numpy()))},
                       name=f"{name}_zero{SUFFIX}")
        scaled = ir.node("Div", [x, keep.outputs[0]], name=f"{name}_scaled{SUFFIX}")
        where = ir.node("Where", [node.outputs[1], scaled.outputs[0], zero.outputs[0]],
                        name=f"{name}{SUFFIX}")
        made = [keep, zero, scaled, where]
        for helper in made[:-1]:
            helper.outputs[0].name = helper.name
    else:
        attrs = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        made = [ir.Node(node.domain, node.op_type, inputs, attrs, overload=node.overload,
                        num_outputs=len(node.outputs), version=node.version, name=f"{name}{SUFFIX}")]
    for new in made:
        new.metadata_props.update(meta)
        mark(new, Role.RECOMPUTE, recompute_of=node.name or "", recompute_by=by)
    for old, new_out in zip(_clone_outputs(node), made[-1].outputs):
        new_out.name = f"{old.name}{SUFFIX}" if old.name else None
        new_out.type = old.type
        new_out.shape = old.shape
    return made


def _backward_uses(value: ir.Value, graph: ir.Graph) -> list[tuple[ir.Node, int]]:
    return [(u.node, u.idx) for u in value.uses()
            if role_of(u.node) == Role.BACKWARD and u.node.graph is graph]


def _needed(group: RecomputeGroup, member: dict[int, int], index: int,
            rewire: Iterable[ir.Value]) -> list[ir.Node]:
    """Group nodes the rewired values depend on through the group, in group order."""
    seen: set[int] = set()
    todo = [v.producer() for v in rewire]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or member.get(id(node)) != index:
            continue
        seen.add(id(node))
        todo.extend(v.producer() for v in node.inputs if v is not None)
    return [n for n in group.nodes if id(n) in seen]


def apply_groups(graph: ir.Graph, groups: Sequence[RecomputeGroup], by: str) -> int:
    """Clone, rewire and place the groups (module docstring, cases 2-4); returns #clones.

    Clones are marked ``recompute_by`` with their group's ``option``, else ``by``."""
    member: dict[int, int] = {}
    for index, group in enumerate(groups):
        for node in group.nodes:
            member.setdefault(id(node), index)
    kept = {id(v) for n in graph if role_of(n) == Role.RECOMPUTE for v in n.inputs if v is not None}
    rewire: list[list[ir.Value]] = []
    for index, group in enumerate(groups):
        values = []
        for node in group.nodes:
            if member[id(node)] != index:
                continue
            for value in _clone_outputs(node):
                if id(value) in kept or not _backward_uses(value, graph):
                    continue
                if group.keep_outputs and any(
                        role_of(u.node) == Role.FORWARD and member.get(id(u.node)) != index
                        for u in value.uses()):
                    continue
                values.append(value)
        rewire.append(values)
    while True:  # a value another group's clones read stays stashed: do not rewire it
        needed = [_needed(g, member, i, rewire[i]) for i, g in enumerate(groups)]
        saved_in = {id(v) for i, nodes in enumerate(needed) for n in nodes for v in n.inputs
                    if v is not None and member.get(id(v.producer())) != i}
        dropped = [[v for v in values if id(v) not in saved_in] for values in rewire]
        if dropped == rewire:
            break
        rewire = dropped
    clones: dict[int, ir.Value] = {}
    made: list[ir.Node] = []
    for i, nodes in enumerate(needed):
        for node in nodes:
            inputs = [None if v is None else clones.get(id(v), v) if member.get(id(v.producer())) == i
                      else v for v in node.inputs]
            new = _clone(node, inputs, groups[i].option or by)
            made.extend(new)
            for old, value in zip(_clone_outputs(node), new[-1].outputs):
                clones[id(old)] = value
    for values in rewire:
        for value in values:
            for user, idx in _backward_uses(value, graph):
                user.replace_input_with(idx, clones[id(value)])
    _place(graph, made)
    return len(made)


def _place(graph: ir.Graph, made: list[ir.Node]) -> None:
    """Insert each clone just before its first consumer (a graph node or a later clone)."""
    nodes = list(graph)
    position = {id(n): i for i, n in enumerate(nodes)}
    anchor: dict[int, int] = {}
    for node in reversed(made):
        users = [u.node for o in node.outputs for u in o.uses()]
        spots = [anchor[id(u)] if id(u) in anchor else position.get(id(u), len(nodes)) for u in users]
        anchor[id(node)] = min(spots, default=len(nodes))
    by_anchor: dict[int, list[ir.Node]] = {}
    for node in made:
        by_anchor.setdefault(anchor[id(node)], []).append(node)
    for spot, group in by_anchor.items():
        if spot < len(nodes):
            graph.insert_before(nodes[spot], group)
        else:
            graph.extend(group)


# ---- planner mapping -----------------------------------------------------------------------


def planner_problem(graph: ir.Graph, options: RecomputeOptions) -> tuple[RecomputeProblem, dict[str, ir.Node]]:
    """The abstract problem of :mod:`passes.recompute.planner` for ``graph`` and its id map."""
    dims = options.dim_values()
    outputs = {id(v) for v in graph.outputs}
    ids: dict[int, str] = {}
    forward: dict[str, ir.Node] = {}
    for index, node in enumerate(graph):
        ids[id(node)] = f"{index}:{node.name or node.op_type}"
        if is_activation_producer(node):
            forward[ids[id(node)]] = node
    sizes, costs, must_save = {}, {}, set()
    backward = set()
    edges = []
    for node in graph:
        nid = ids[id(node)]
        stage = role_of(node)
        if stage == Role.BACKWARD and node.op_type in SHAPE_ONLY_READERS and node.domain in ("", "ai.onnx"):
            continue  # reads only the shape: runs in the forward of a split graph (analysis.py)
        if stage == Role.BACKWARD:
            backward.add(nid)
        reads = [v for v in node.inputs if v is not None] + captured_values(node)
        for value in reads:
            producer = value.producer()
            pid = ids.get(id(producer)) if producer is not None else None
            if pid not in forward or stage == Role.FORWARD and nid not in forward:
                continue
            if stage in (Role.FORWARD, Role.BACKWARD):
                edges.append((pid, nid))
            else:  # read by clones, optimizer or precision nodes: alive anyway
                must_save.add(pid)
    def stored_bytes(values: list[ir.Value]) -> int:
        return sum(options.unknown_bytes if (known := value_bytes(v, dims)) is None else known
                   for v in values)

    for nid, node in forward.items():
        cloned = _clone_outputs(node)
        size = stored_bytes([v for v in cloned if id(v) not in outputs])
        sizes[nid] = size
        costs[nid] = options.cost_weight(node.op_type) * size
        heavy = node.op_type in options.compute_intensive_ops and not options.recompute_compute_intensive
        if heavy or not recomputable(node, options):
            must_save.add(nid)
        # A Dropout is recomputed from its saved mask: the mask stays whichever way the node goes.
        kept = [v for v in node.outputs[len(cloned):] if v.uses() and id(v) not in outputs]
        if kept:
            mask_id = f"{nid}/kept"
            sizes[mask_id] = stored_bytes(kept)
            costs[mask_id] = 0.0
            must_save.add(mask_id)
            edges.append((mask_id, nid))
    problem = RecomputeProblem(sizes, frozenset(backward), edges, frozenset(must_save), costs=costs)
    return problem, forward


def plan_for_model(model: ir.Model, options: RecomputeOptions) -> RecomputePlan:
    """The planner's plan for ``model`` as it stands (nothing is changed)."""
    problem, _ = planner_problem(model.graph, options)
    return plan_recompute(problem, options.memory_budget, options.max_recompute_chain)


# ---- the pass ------------------------------------------------------------------------------


def _warn_unsized(graph: ir.Graph, nodes: list[ir.Node], options: RecomputeOptions) -> None:
    """A budget over activations of symbolic size the planner cannot count (no size in
    ``dims``): they count as ``unknown_bytes`` (0 by default), so the budget says little. The
    dims the model's inputs name can be sized (``dims``, the CLI's ``--dim``); those shape
    inference made up (``unk__3``: a size computed at run time) cannot."""
    if options.unknown_bytes:
        return
    dims = dict(options.dims)
    unsized = [v for n in nodes for v in n.outputs if v.uses() and value_bytes(v, dims) is None]
    names = sorted({str(d.value) for v in unsized for d in (v.shape or ())
                    if isinstance(d, ir.SymbolicDim) and d.value and d.value not in dims})
    if not names:
        return
    named = {d.value for v in graph.inputs for d in (v.shape or ()) if isinstance(d, ir.SymbolicDim)}
    sizable = [n for n in names if n in named]
    computed = [n for n in names if n not in named]
    said = [f"activations of symbolic size (dims {names}) count as 0 bytes"]
    if sizable:
        said.append(f"give the sizes of {sizable} (RecomputeOptions.dims, CLI --dim {sizable[0]}=N)")
    if computed:
        said.append(f"{computed} are sizes computed at run time, which no input names (set "
                    "RecomputeOptions.unknown_bytes to count them)")
    warnings.warn(f"RecomputePass: memory_budget={options.memory_budget}: " + "; ".join(said)
                  + ", for a budget that means what it says", stacklevel=3)


class RecomputePass(InPlacePass):
    """Recompute forward activations in the backward as ``options`` select (module docstring)."""

    def __init__(self, options: RecomputeOptions) -> None:
        super().__init__()
        self.options = options

    def call(self, model: ir.Model) -> PassResult:
        graph, options = model.graph, self.options
        if not any(STAGE_KEY in n.metadata_props for n in graph):
            return PassResult(model, False)  # no backward: nothing is stashed
        groups: list[RecomputeGroup] = []
        if options.transformer_layers:
            groups += transformer_layer_groups(graph, options)
        if options.attn_dropout:
            groups += attn_dropout_groups(graph, options)
        if options.gelu:
            groups += gelu_groups(graph, options)
        made = apply_groups(graph, groups, "pattern")
        planned = any(n.metadata_props.get(RECOMPUTE_BY_KEY) == PLANNER for n in graph)
        plan = None
        if options.memory_budget is not None and not planned:
            problem, nodes = planner_problem(graph, options)
            _warn_unsized(graph, list(nodes.values()), options)
            plan = plan_recompute(problem, options.memory_budget, options.max_recompute_chain)
            if not plan.feasible:
                warnings.warn(f"RecomputePass: memory_budget={options.memory_budget}: {plan.reason}",
                              stacklevel=2)
            chosen = tuple(nodes[n] for n in problem.nodes if n in plan.recomputed)
            made += apply_groups(graph, [RecomputeGroup("planner", chosen)], PLANNER)
        if made:
            _unique_clone_names(graph)
        _report_nothing(graph, options, groups, plan)
        return PassResult(model, made > 0)


def recomputed_counts(model: ir.Model | ir.Graph) -> dict[str, int]:
    """Forward nodes recomputed, by the :class:`RecomputeOptions` field that asked for it
    (``gelu``, ``attn_dropout``, ``transformer_layers``, ``memory_budget``)."""
    graph = model.graph if isinstance(model, ir.Model) else model
    recomputed: dict[str, set[str]] = {}
    for node in graph:
        if role_of(node) == Role.RECOMPUTE:
            by = node.metadata_props.get(RECOMPUTE_BY_KEY, "")
            option = "memory_budget" if by == PLANNER else by
            recomputed.setdefault(option, set()).add(node.metadata_props.get(RECOMPUTE_OF_KEY, ""))
    return {option: len(nodes) for option, nodes in recomputed.items()}


# How each option is set, for the warning (the API's field, TrainingParameters, the CLI).
_SET_BY = {"gelu": ("gelu_recompute", "--recompute gelu"),
           "attn_dropout": ("attn_dropout_recompute", "--recompute attn_dropout"),
           "transformer_layers": ("transformer_layer_recompute", "--recompute transformer_layers"),
           "memory_budget": ("recompute_memory_budget", "--memory-budget")}
_LOOKED_FOR = {
    "gelu": "a Gelu, FastGelu or BiasGelu, or the erf form x * 0.5 * (1 + Erf(x / sqrt 2)) or "
            "the tanh form 0.5 * x * (1 + Tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), whose "
            "output's first forward consumer is one of gelu_consumers",
    "attn_dropout": "a training Dropout (constant ratio, a mask output) fed by Softmax whose "
                    "output's first forward consumer is a MatMul",
}


def _report_nothing(graph: ir.Graph, options: RecomputeOptions, groups: Sequence[RecomputeGroup],
                    plan: RecomputePlan | None) -> None:
    """Warn (or raise, ``nothing_recomputed='error'``) for each option that recomputes nothing."""
    counts = recomputed_counts(graph)
    asked = [o for o in ("transformer_layers", "attn_dropout", "gelu") if getattr(options, o)]
    if options.memory_budget is not None:
        asked.append("memory_budget")
    for option in asked:
        if counts.get(option):
            continue
        found = sum(1 for g in groups if g.option == option)
        if option == "transformer_layers":
            layers, search = find_layers(graph, options)
            why = (f"it looked for layers by {'; by '.join(LAYER_SEARCHES)}, and found none"
                   if not layers else
                   f"it found {len(layers)} layer(s) by {search}, and recomputes all but the last "
                   f"(number_recompute_layers={options.number_recompute_layers}): the backward "
                   "reads nothing of those it may recompute")
        elif option == "memory_budget":
            why = ("the activations the backward keeps already fit the budget "
                   f"({plan.save_all_bytes} bytes)" if plan is not None and plan.feasible
                   else plan.reason if plan is not None else "the graph already holds planner clones")
        else:
            why = (f"it looked for {_LOOKED_FOR[option]}; found "
                   + (f"{found}, but the backward reads none of their outputs" if found else "none"))
        field, flag = _SET_BY[option]
        value = options.memory_budget if option == "memory_budget" else True
        message = (f"RecomputePass: RecomputeOptions.{option}={value} (TrainingParameters.{field}, "
                   f"CLI {flag}) recomputed nothing: {why}")
        if options.nothing_recomputed == "error":
            raise GradientError(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _unique_clone_names(graph: ir.Graph) -> None:
    """Give clone outputs (and clone nodes) names no other value (node) of the graph has: a value
    cloned by two groups, or a model already holding ``<x>_recompute``, would repeat one."""
    clones = [n for n in graph if role_of(n) == Role.RECOMPUTE]
    ids = {id(n) for n in clones}
    values: set[str] = {v.name for v in graph.inputs if v.name} | set(graph.initializers)
    values |= {o.name for n in graph if id(n) not in ids for o in n.outputs if o.name}
    nodes = {n.name for n in graph if id(n) not in ids and n.name}
    for node in clones:
        node.name = free_name(node.name, nodes) if node.name else node.name
        for out in node.outputs:
            if out.name:
                out.name = free_name(out.name, values)


class GeluRecomputePass(RecomputePass):
    def __init__(self, options: RecomputeOptions | None = None) -> None:
        super().__init__(_only(options, gelu=True))


class AttentionDropoutRecomputePass(RecomputePass):
    def __init__(self, options: RecomputeOptions | None = None) -> None:
        super().__init__(_only(options, attn_dropout=True))


class TransformerLayerRecomputePass(RecomputePass):
    def __init__(self, options: RecomputeOptions | None = None) -> None:
        super().__init__(_only(options, transformer_layers=True))


def _only(options: RecomputeOptions | None, **switch: bool) -> RecomputeOptions:
    base = dataclasses.replace(options or RecomputeOptions(), gelu=False, attn_dropout=False,
                               transformer_layers=False, memory_budget=None)
    return dataclasses.replace(base, **switch)  # type: ignore[arg-type]
