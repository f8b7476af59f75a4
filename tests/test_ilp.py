"""The strategy ILP against exhaustive enumeration on random small cost graphs, for every backend."""

import itertools
import random

import numpy as np
import pytest

from partopt import ilp
from partopt.errors import InfeasibleError
from partopt.solvers import BACKENDS


def random_graph(rng: random.Random) -> ilp.CostGraph:
    g = ilp.CostGraph()
    n = rng.randint(2, 7)
    for i in range(n):
        k = rng.randint(1, 4)
        g.add_node(f"n{i}", [rng.choice([0, 1, 2, 3, 5, 0.5]) for _ in range(k)], [rng.randint(0, 5) for _ in range(k)])
    for i in range(1, n):
        for j in rng.sample(range(i), k=min(i, rng.randint(1, 2))):
            g.add_edge(j, i, [[rng.choice([0, 0, 1, 2, 4, 0.25]) for _ in g.costs[i]] for _ in g.costs[j]])
    return g


def brute_force(g: ilp.CostGraph, budget: float | None) -> float | None:
    best = None
    for choice in itertools.product(*[range(len(c)) for c in g.costs]):
        if budget is not None and g.peak_memory(list(choice)) > budget:
            continue
        value = g.total(list(choice))
        best = value if best is None else min(best, value)
    return best


CASES = []
_rng = random.Random(20261129)
for _ in range(60):
    graph = random_graph(_rng)
    budget = _rng.choice([None, sum(float(m.max()) for m in graph.memory) * _rng.uniform(0.3, 0.8)])
    CASES.append((graph, budget))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce_first", [True, False])
def test_every_backend_matches_exhaustive_enumeration(backend, reduce_first):
    for graph, budget in CASES:
        expected = brute_force(graph, budget)
        if expected is None:
            with pytest.raises(InfeasibleError):
                ilp.solve(graph, budget, backend, reduce_first=reduce_first)
            continue
        solution = ilp.solve(graph, budget, backend, reduce_first=reduce_first)
        assert solution.objective == pytest.approx(expected, abs=1e-9)
        assert solution.result.status == "optimal"
        if budget is not None:
            assert graph.peak_memory(solution.choice) <= budget + 1e-9


def test_reduction_only_removes_dominated_strategies():
    g = ilp.CostGraph()
    a = g.add_node("a", [1.0, 2.0, 1.0], [0, 0, 5])  # #1 is beaten by #0 everywhere; #2 needs more memory
    b = g.add_node("b", [0.0, 0.0])
    g.add_edge(a, b, [[0, 1], [0, 1], [0, 1]])
    alive = ilp.reduce(g)
    assert alive[0].tolist() == [True, False, False]
    assert alive[1].tolist() == [True, False]  # b#1 costs 1 more on the edge whatever a does


def test_memory_budget_below_the_least_footprint_is_infeasible():
    g = ilp.CostGraph()
    g.add_node("a", [0.0, 1.0], [10, 6])
    g.add_node("b", [0.0, 1.0], [10, 6])
    assert ilp.solve(g, budget=16).objective == 1.0
    with pytest.raises(InfeasibleError, match="at least 12"):
        ilp.solve(g, budget=11)


def test_bound_and_gap_of_a_proven_optimum():
    graph, budget = CASES[0]
    solution = ilp.solve(graph, budget)
    assert solution.bound == pytest.approx(solution.objective)
    assert solution.result.gap == 0.0
    assert np.isfinite(solution.result.time_s)


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_a_solve_stopped_at_once_keeps_a_feasible_incumbent(backend):
    """Each program starts from a feasible assignment (the least-cost one without a memory row, the leanest
    one under a budget it fits), so a clock that stops the solver at once still yields a plan that fits,
    priced no lower than the optimum, instead of no solution (issue 16: no option vanishes under load)."""
    stopped = 0
    for graph, budget in CASES:
        if budget is None or graph.peak_memory(ilp._leanest(graph, ilp.reduce(graph))) > budget:
            continue
        expected = brute_force(graph, budget)
        solution = ilp.solve(graph, budget, backend, time_limit_s=1e-9)
        assert graph.peak_memory(solution.choice) <= budget + 1e-9
        assert solution.objective >= expected - 1e-9
        stopped += solution.result.status == "timeout"
    assert stopped > 0  # the clock did stop some solves, and they kept their start


def test_a_start_sets_every_variable_and_satisfies_every_row():
    """The start of a capped model is a whole solution (HiGHS would otherwise complete it by a sub-MIP, which a
    stopped clock cuts short): node, pair and peak variables all set, every row within its bounds."""
    checked = 0
    for graph, budget in CASES:
        if budget is None:
            continue
        alive = ilp.reduce(graph)
        choice = ilp._leanest(graph, alive)
        if graph.peak_memory(choice) > budget:
            continue
        model, _ = ilp.build_model(graph, alive, budget, choice)
        assert sorted(model.start) == list(range(model.num_vars))
        for index, coef, lo, hi in model.rows:
            value = sum(c * model.start[i] for i, c in zip(index, coef))
            assert lo - 1e-6 <= value <= hi + 1e-6
        checked += 1
    assert checked > 10
