"""The recompute planner: which forward values to save for the backward, which to recompute.

A pure function over an abstract problem (string ids, byte sizes, edges; no ONNX here):

1. **min-cut** (torch ``_functorch/partitioners.py``, ``min_cut_rematerialization_partition``):
   every forward node ``u`` becomes ``u_in -> u_out`` with capacity = bytes to save it
   (infinite for ``must_recompute``), every data edge ``u_out -> v_in`` is infinite,
   ``source -> u_in`` is infinite for ``must_save`` nodes (random ops, ...), and
   ``u_out -> sink`` is infinite for nodes a backward node reads. The minimum cut is the
   cheapest set of values to save; everything between the cut and the backward is recomputed.
   Nodes without a forward producer hang off graph inputs and initializers, which are alive
   anyway: recomputing from them is free of memory;
2. **chain limit**: a value whose recompute chain would clone more than ``max_chain`` nodes is
   saved instead (ORT memory optimizer's node limit);
3. **budget**: when saving every backward-read value fits ``budget``, nothing is recomputed;
   when even the minimum cut does not fit, the minimum is returned with ``feasible=False`` and
   a reason naming the largest values it must save; otherwise, starting from the minimum cut,
   the recomputed nodes are saved greedily by recompute cost per byte (most expensive first)
   as long as the saved bytes stay within the budget (greedy: a saved node also spares the
   recomputation of its ancestors, which the order does not account for);
4. **guard**: the result is never bigger than saving everything that may be saved (every
   backward-read value, and for must-recompute ones the values their recompute reads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import networkx as nx

SOURCE, SINK = "__source__", "__sink__"
# How many of the largest must-save values an infeasibility reason names.
REASON_SHOWN = 5


@dataclasses.dataclass(frozen=True)
class RecomputeProblem:
    """Forward nodes with the bytes of their outputs; backward nodes; data edges between them."""

    nodes: Mapping[str, int]
    backward: frozenset[str]
    edges: Sequence[tuple[str, str]]
    must_save: frozenset[str] = frozenset()
    must_recompute: frozenset[str] = frozenset()
    costs: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        both = self.must_save & self.must_recompute
        if both:
            raise ValueError(f"nodes both must-save and must-recompute: {sorted(both)[:5]}")
        clash = self.backward & set(self.nodes)
        if clash:
            raise ValueError(f"nodes both forward and backward: {sorted(clash)[:5]}")
        for a, b in self.edges:
            for end in (a, b):
                if end not in self.nodes and end not in self.backward:
                    raise ValueError(f"edge ({a!r}, {b!r}) names unknown node {end!r}")
            if a in self.backward and b in self.nodes:
                raise ValueError(f"edge ({a!r}, {b!r}) goes from the backward to the forward")
        negative = [n for n, size in self.nodes.items() if size < 0]
        if negative:
            raise ValueError(f"negative byte sizes for nodes {negative[:5]}")

    def producers(self) -> dict[str, list[str]]:
        preds: dict[str, list[str]] = {n: [] for n in self.nodes}
        for a, b in self.edges:
            if a in self.nodes and b in self.nodes:
                preds[b].append(a)
        return preds

    def needed(self) -> frozenset[str]:
        """Forward nodes some backward node reads (the stash when nothing is recomputed)."""
        return frozenset(a for a, b in self.edges if a in self.nodes and b in self.backward)

    def cost(self, node: str) -> float:
        return self.costs.get(node, float(self.nodes[node]))


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    saved: frozenset[str]
    recomputed: frozenset[str]
    saved_bytes: int
    save_all_bytes: int
    recompute_cost: float
    feasible: bool = True
    reason: str = ""


def recompute_closure(problem: RecomputeProblem, saved: Iterable[str],
                      preds: Mapping[str, list[str]] | None = None) -> frozenset[str]:
    """The forward nodes to recompute so that the backward reads only ``saved`` values."""
    preds = problem.producers() if preds is None else preds
    keep = set(saved)
    todo = [n for n in problem.needed() if n not in keep]
    seen = set(todo)
    while todo:
        node = todo.pop()
        for p in preds[node]:
            if p not in keep and p not in seen:
                seen.add(p)
                todo.append(p)
    return frozenset(seen)


def used_saved(problem: RecomputeProblem, saved: Iterable[str], recomputed: frozenset[str],
               preds: Mapping[str, list[str]]) -> frozenset[str]:
    """The saved nodes that the backward or a recomputed node actually reads."""
    keep = set(saved)
    used = {n for n in problem.needed() if n in keep}
    for node in recomputed:
        used.update(p for p in preds[node] if p in keep)
    return frozenset(used)


def _min_cut(problem: RecomputeProblem, needed: frozenset[str]) -> frozenset[str]:
    graph = nx.DiGraph()
    graph.add_node(SOURCE)
    graph.add_node(SINK)
    for node, size in problem.nodes.items():
        if node in problem.must_recompute:
            graph.add_edge(f"{node}_in", f"{node}_out")  # no capacity: infinite
        else:
            graph.add_edge(f"{node}_in", f"{node}_out", capacity=size)
        if node in problem.must_save:
            graph.add_edge(SOURCE, f"{node}_in")
        if node in needed:
            graph.add_edge(f"{node}_out", SINK)
    for a, b in problem.edges:
        if a in problem.nodes and b in problem.nodes:
            graph.add_edge(f"{a}_out", f"{b}_in")
    _, (reachable, _) = nx.minimum_cut(graph, SOURCE, SINK)
    return frozenset(n for n in problem.nodes
                     if f"{n}_in" in reachable and f"{n}_out" not in reachable)


def _bytes(problem: RecomputeProblem, nodes: Iterable[str]) -> int:
    return sum(problem.nodes[n] for n in nodes)


def _chain(node: str, keep: set[str], preds: Mapping[str, list[str]]) -> set[str]:
    """The nodes recomputing ``node`` clones when ``keep`` is saved."""
    seen, todo = {node}, [node]
    while todo:
        for p in preds[todo.pop()]:
            if p not in keep and p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def _limit_chains(problem: RecomputeProblem, saved: frozenset[str], max_chain: int,
                  preds: Mapping[str, list[str]]) -> frozenset[str]:
    """Save each backward-read value whose own recompute chain exceeds ``max_chain`` nodes."""
    keep = set(saved)
    for node in sorted(problem.needed() - keep - problem.must_recompute):
        if len(_chain(node, keep, preds)) > max_chain:
            keep.add(node)
    return frozenset(keep)


def _plan(problem: RecomputeProblem, saved: frozenset[str], save_all: int,
          preds: Mapping[str, list[str]], feasible: bool = True, reason: str = "") -> RecomputePlan:
    recomputed = recompute_closure(problem, saved, preds)
    saved = used_saved(problem, saved, recomputed, preds)
    return RecomputePlan(saved, recomputed, _bytes(problem, saved), save_all,
                         sum(problem.cost(n) for n in recomputed), feasible, reason)


def _infeasible_reason(problem: RecomputeProblem, plan: RecomputePlan, budget: int) -> str:
    largest = sorted(plan.saved, key=lambda n: (-problem.nodes[n], n))[:REASON_SHOWN]
    forced = ", ".join(f"{n} ({problem.nodes[n]} B{', must save' if n in problem.must_save else ''})"
                       for n in largest)
    return (f"infeasible: the smallest valid set of saved values takes {plan.saved_bytes} bytes, "
            f"more than the budget of {budget} bytes; the largest are {forced}")


def plan_recompute(problem: RecomputeProblem, budget: int | None = None,
                   max_chain: int | None = None) -> RecomputePlan:
    """Choose the saved and the recomputed forward nodes (see the module docstring)."""
    preds = problem.producers()
    # Saving everything that may be saved: no recompute but of must-recompute nodes.
    everything = _plan(problem, frozenset(problem.nodes) - problem.must_recompute, 0, preds)
    save_all = everything.saved_bytes
    everything = dataclasses.replace(everything, save_all_bytes=save_all)
    if budget is not None and save_all <= budget:
        return everything
    saved = _min_cut(problem, problem.needed())
    if max_chain is not None:
        saved = _limit_chains(problem, saved, max_chain, preds)
    plan = _plan(problem, saved, save_all, preds)
    if budget is not None and plan.saved_bytes > budget:
        plan = dataclasses.replace(plan, feasible=False,
                                   reason=_infeasible_reason(problem, plan, budget))
    elif budget is not None:
        plan = _spend_budget(problem, plan, budget, preds)
    if plan.saved_bytes > save_all:
        plan = dataclasses.replace(everything, feasible=plan.feasible, reason=plan.reason)
    return plan


def _spend_budget(problem: RecomputeProblem, plan: RecomputePlan, budget: int,
                  preds: Mapping[str, list[str]]) -> RecomputePlan:
    """Save recomputed nodes, most expensive per byte first, while the saved bytes fit."""
    def priority(node: str) -> tuple[float, str]:
        size = problem.nodes[node]
        return (-(problem.cost(node) / size) if size else float("-inf"), node)

    best = plan
    for node in sorted(plan.recomputed - problem.must_recompute, key=priority):
        if node not in best.recomputed:
            continue
        trial = _plan(problem, best.saved | {node}, best.save_all_bytes, preds)
        if trial.saved_bytes <= budget:
            best = trial
    return best
