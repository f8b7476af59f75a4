"""Bucket elimination (`partopt.minsum`) against exhaustive enumeration, and its place in `ilp.solve`."""

import itertools
import math
import random

import numpy as np
import pytest

from partopt import ilp, minsum


def dense_graph(rng: random.Random, n: int) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray]]:
    """A random cost graph denser than a tree: eliminating a node there leaves a table over three or more."""
    costs = [np.array([rng.choice([0, 1, 2, 3, 0.5, 7]) for _ in range(rng.randint(1, 4))], dtype=float)
             for _ in range(n)]
    edges = {}
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < 0.6:
            edges[(u, v)] = np.array([[rng.choice([0, 0, 1, 2, 4, 0.25]) for _ in costs[v]] for _ in costs[u]])
    return costs, edges


def total(costs, edges, choice) -> float:
    return sum(c[x] for c, x in zip(costs, choice)) + sum(m[choice[u], choice[v]] for (u, v), m in edges.items())


@pytest.mark.parametrize("seed", range(40))
def test_elimination_finds_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    costs, edges = dense_graph(rng, rng.randint(2, 7))
    choice = minsum.solve(costs, edges)
    best = min(total(costs, edges, c) for c in itertools.product(*[range(len(c)) for c in costs]))
    assert choice is not None and all(0 <= x < len(c) for x, c in zip(choice, costs))
    assert total(costs, edges, choice) == pytest.approx(best, abs=1e-12)


def test_order_counts_the_tables_it_builds():
    # a triangle of 2, 3 and 4 strategies: the greedy takes the node of the least table over itself and its two
    # neighbours (all 24 entries each), the lowest index on ties, then the edge's 12, then the last node's 4
    sequence, entries = minsum.order([2, 3, 4], [(0, 1), (1, 2), (0, 2)])
    assert sequence == [0, 1, 2] and entries == 24 + 12 + 4


def test_declines_when_the_tables_would_be_too_large():
    # a clique of five 10-strategy nodes: eliminating the first builds 10^5 entries
    costs = [np.zeros(10) for _ in range(5)]
    edges = {(u, v): np.zeros((10, 10)) for u, v in itertools.combinations(range(5), 2)}
    _, entries = minsum.order([10] * 5, list(edges))
    assert entries >= 10**5
    assert minsum.solve(costs, edges, max_entries=10**5 - 1) is None
    assert minsum.solve(costs, edges, max_entries=entries) is not None


def k5(seed: int) -> ilp.CostGraph:
    """K5 with three strategies a node: every node has four neighbours, so the exact pairwise elimination
    leaves all of it to the next step."""
    rng = random.Random(seed)
    g = ilp.CostGraph()
    for i in range(5):
        g.add_node(f"n{i}", [rng.uniform(0, 1) for _ in range(3)])
    for u, v in itertools.combinations(range(5), 2):
        g.add_edge(u, v, [[rng.uniform(0, 1) for _ in range(3)] for _ in range(3)])
    return g


def test_ilp_solve_uses_it_for_the_rest_and_agrees_with_highs():
    g = k5(7)
    solution = ilp.solve(g)
    assert solution.result.backend == "elimination" and solution.result.status == "optimal"
    assert solution.variables == 0  # no ILP was built
    best = min(g.total(list(c)) for c in itertools.product(range(3), repeat=5))
    assert solution.objective == pytest.approx(best, abs=1e-12)
    assert solution.lower_bound == solution.objective
    highs = ilp.solve(g, reduce_first=False)  # the ILP without any elimination
    assert highs.result.backend == "highs" and highs.objective == pytest.approx(best, rel=1e-9)


def test_ilp_solve_falls_back_to_the_ilp_past_the_limit(monkeypatch):
    monkeypatch.setattr(minsum, "MAX_ENTRIES", 0)
    g = k5(8)
    solution = ilp.solve(g)
    assert solution.result.backend == "highs" and solution.variables > 0
    assert solution.objective == pytest.approx(min(g.total(list(c)) for c in itertools.product(range(3), repeat=5)),
                                               rel=1e-9)
    assert math.isfinite(solution.objective)
