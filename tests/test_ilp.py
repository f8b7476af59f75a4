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
