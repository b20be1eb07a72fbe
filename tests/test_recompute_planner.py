"""The recompute planner on random DAG problems (hypothesis) and on small hand-made ones."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.recompute.options import RecomputeOptions
from passes.recompute.planner import (
    RecomputePlan,
    RecomputeProblem,
    plan_recompute,
    recompute_closure,
)


@st.composite
def problems(draw, max_forward: int = 10) -> RecomputeProblem:
    n = draw(st.integers(1, max_forward))
    k = draw(st.integers(1, 4))
    forward = [f"f{i}" for i in range(n)]
    backward = [f"b{i}" for i in range(k)]
    edges = [(forward[i], forward[j]) for i in range(n) for j in range(i + 1, n)
             if draw(st.booleans()) and draw(st.booleans())]
    edges += [(f, b) for f in forward for b in backward if draw(st.integers(0, 3)) == 0]
    if not any(b in backward for _, b in edges):
        edges.append((forward[-1], backward[0]))
    sizes = {f: draw(st.integers(0, 100)) for f in forward}
    flags = {f: draw(st.sampled_from(["free", "free", "save", "recompute"])) for f in forward}
    costs = {f: draw(st.floats(0, 50)) for f in forward}
    return RecomputeProblem(sizes, frozenset(backward), edges,
                            frozenset(f for f in forward if flags[f] == "save"),
                            frozenset(f for f in forward if flags[f] == "recompute"), costs)


def assert_valid(problem: RecomputeProblem, plan: RecomputePlan) -> None:
    preds = problem.producers()
    assert not plan.saved & plan.recomputed
    assert not plan.recomputed & problem.must_save, "a must-save (banned) node is recomputed"
    assert not plan.saved & problem.must_recompute
    for node in problem.needed():
        assert node in plan.saved or node in plan.recomputed, f"backward input {node} neither saved nor recomputed"
    for node in plan.recomputed:
        for p in preds[node]:
            assert p in plan.saved or p in plan.recomputed, f"{node} recomputed but its input {p} is lost"
    assert plan.saved_bytes == sum(problem.nodes[n] for n in plan.saved)
    assert plan.saved_bytes <= plan.save_all_bytes


def brute_force_min(problem: RecomputeProblem) -> int:
    choices = [n for n in problem.nodes if n not in problem.must_recompute]
    best = None
    for r in range(len(choices) + 1):
        for saved in itertools.combinations(choices, r):
            closure = recompute_closure(problem, saved)
            if closure & problem.must_save:
                continue
            size = sum(problem.nodes[n] for n in saved)
            best = size if best is None else min(best, size)
    assert best is not None
    return best


@settings(max_examples=150, deadline=None)
@given(problems())
def test_min_cut_is_a_valid_cut_no_bigger_than_saving_everything(problem):
    plan = plan_recompute(problem)
    assert_valid(problem, plan)
    assert plan.feasible


@settings(max_examples=60, deadline=None)
@given(problems(max_forward=7))
def test_min_cut_is_the_minimum(problem):
    assert plan_recompute(problem).saved_bytes == brute_force_min(problem)


@settings(max_examples=150, deadline=None)
@given(problems(), st.integers(0, 600))
def test_budget_is_met_when_feasible_else_explained(problem, budget):
    plan = plan_recompute(problem, budget=budget)
    assert_valid(problem, plan)
    minimum = plan_recompute(problem).saved_bytes
    if minimum <= budget:
        assert plan.feasible and plan.saved_bytes <= budget
        assert plan.recompute_cost <= plan_recompute(problem).recompute_cost + 1e-9
    else:
        assert not plan.feasible
        assert plan.reason.startswith("infeasible") and str(budget) in plan.reason
        assert plan.saved_bytes == minimum


@settings(max_examples=100, deadline=None)
@given(problems(), st.integers(1, 4))
def test_chain_limit_keeps_a_valid_cut(problem, limit):
    plan = plan_recompute(problem, max_chain=limit)
    assert_valid(problem, plan)


def chain(n: int, size: int = 10) -> RecomputeProblem:
    """f0 -> f1 -> ... -> f{n-1}, every node read by the backward node b."""
    nodes = {f"f{i}": size for i in range(n)}
    edges = [(f"f{i}", f"f{i + 1}") for i in range(n - 1)] + [(f"f{i}", "b") for i in range(n)]
    return RecomputeProblem(nodes, frozenset({"b"}), edges)


def test_chain_is_recomputed_from_the_inputs():
    plan = plan_recompute(chain(4))
    assert plan.saved == frozenset() and plan.recomputed == frozenset({"f0", "f1", "f2", "f3"})
    assert plan.save_all_bytes == 40 and plan.saved_bytes == 0


def test_banned_node_is_saved_and_cuts_the_chain():
    problem = RecomputeProblem(chain(4).nodes, frozenset({"b"}), chain(4).edges, frozenset({"f1"}))
    plan = plan_recompute(problem)
    assert plan.saved == frozenset({"f1"}) and plan.recomputed == frozenset({"f0", "f2", "f3"})


def test_small_bottleneck_is_saved_instead_of_big_values():
    # f0 (big) -> f1 (small) -> f2 (big); the backward reads f0 and f2; f0 must be saved
    nodes = {"f0": 100, "f1": 1, "f2": 100}
    edges = [("f0", "f1"), ("f1", "f2"), ("f0", "b"), ("f2", "b")]
    problem = RecomputeProblem(nodes, frozenset({"b"}), edges, must_save=frozenset({"f0"}))
    plan = plan_recompute(problem)
    assert plan.saved == frozenset({"f0"}) and plan.recomputed == frozenset({"f1", "f2"})


def test_budget_keeps_the_most_expensive_per_byte():
    nodes = {"f0": 10, "f1": 10, "f2": 10}
    edges = [("f0", "f1"), ("f1", "f2")] + [(n, "b") for n in nodes]
    costs = {"f0": 1.0, "f1": 500.0, "f2": 2.0}
    plan = plan_recompute(RecomputeProblem(nodes, frozenset({"b"}), edges, costs=costs), budget=10)
    assert plan.saved == frozenset({"f1"}) and plan.feasible


def test_budget_above_save_all_recomputes_nothing():
    plan = plan_recompute(chain(3), budget=10**6)
    assert plan.recomputed == frozenset() and plan.saved_bytes == 30


def test_infeasible_budget_names_the_forcing_values():
    problem = RecomputeProblem({"f0": 64}, frozenset({"b"}), [("f0", "b")], must_save=frozenset({"f0"}))
    plan = plan_recompute(problem, budget=10)
    assert not plan.feasible and "f0 (64 B, must save)" in plan.reason


def test_chain_limit_saves_long_chains():
    plan = plan_recompute(chain(6), max_chain=3)
    assert all(len(recompute_closure(chain(6), plan.saved) & {f"f{j}" for j in range(i + 1)}) <= 6
               for i in range(6))
    assert plan.saved, "a 6-node chain with limit 3 must save something"


@pytest.mark.parametrize("bad", [
    lambda: RecomputeProblem({"a": 1}, frozenset({"b"}), [("a", "b")], frozenset({"a"}), frozenset({"a"})),
    lambda: RecomputeProblem({"a": 1}, frozenset({"b"}), [("a", "zz")]),
    lambda: RecomputeProblem({"a": -1}, frozenset({"b"}), [("a", "b")]),
    lambda: RecomputeProblem({"a": 1}, frozenset({"b"}), [("b", "a")]),
])
def test_bad_problems_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


@pytest.mark.parametrize("field,value", [
    ("number_recompute_layers", -1), ("memory_budget", -5), ("dims", (("batch", -1),)),
    ("max_recompute_chain", 0), ("cost_weights", (("MatMul", -1.0),)), ("unknown_bytes", -1),
    ("banned_ops", "Dropout"), ("default_cost_weight", -0.5), ("layer_start_edges", 0),
])
def test_options_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        RecomputeOptions(**{field: value})
