"""HiGHS with the LP relaxation first (`solvers.solve(..., relaxation_first=True)`): an integral relaxation is the
optimum, a fractional one falls back to the MIP; both against brute force."""

import itertools
import random

import numpy as np
import pytest

from partopt import ilp, solvers
from partopt.solvers import highs


def model_of(graph: ilp.CostGraph) -> tuple[solvers.Model, list[np.ndarray]]:
    """The pairwise ILP of `graph` over all its strategies, no memory row (what `ilp.solve` hands the solver)."""
    return ilp.build_model(graph, [np.ones(len(c), dtype=bool) for c in graph.costs], None)


def seconds(result: solvers.Result, model: solvers.Model) -> float:
    """A result's objective in the graph's own units (the model's are scaled; no node here is fixed)."""
    return result.objective / model.scale


def brute_force(graph: ilp.CostGraph) -> float:
    return min(graph.total(list(c)) for c in itertools.product(*[range(len(c)) for c in graph.costs]))


@pytest.fixture
def paths(monkeypatch) -> list[bool]:
    """Which way each relaxation-first solve went: True when the integral relaxation was the answer."""
    seen: list[bool] = []
    relaxation = highs._integral_relaxation

    def recorded(*args):
        found = relaxation(*args)
        seen.append(found is not None)
        return found

    monkeypatch.setattr(highs, "_integral_relaxation", recorded)
    return seen


def test_a_frustrated_triangle_relaxes_to_halves_and_falls_back_to_the_mip(paths):
    # three nodes of two strategies, each edge costing 1 when its ends agree: some edge of an odd cycle must agree
    # (optimum 1), while the local polytope's marginals of 1/2 everywhere pay nothing (LP optimum 0)
    g = ilp.CostGraph()
    for name in "abc":
        g.add_node(name, [0.0, 0.0])
    for u, v in ((0, 1), (1, 2), (0, 2)):
        g.add_edge(u, v, [[1.0, 0.0], [0.0, 1.0]])
    model, _ = model_of(g)
    result = solvers.solve(model, "highs", relaxation_first=True)
    assert paths == [False]
    assert result.status == "optimal" and seconds(result, model) == pytest.approx(1.0) == brute_force(g)


def test_a_chain_relaxes_to_its_integral_optimum(paths):
    # the local polytope of a tree is integral: the LP's vertex is the optimum itself
    rng = random.Random(3)
    g = ilp.CostGraph()
    for i in range(6):
        g.add_node(f"n{i}", [rng.uniform(0, 1) for _ in range(3)])
    for i in range(5):
        g.add_edge(i, i + 1, [[rng.uniform(0, 1) for _ in range(3)] for _ in range(3)])
    model, _ = model_of(g)
    result = solvers.solve(model, "highs", relaxation_first=True)
    assert paths == [True]
    assert result.status == "optimal" and result.work == 0
    assert seconds(result, model) == pytest.approx(brute_force(g), rel=1e-12)
    assert all(v in (0, 1) for v in result.values)


def dense(seed: int) -> ilp.CostGraph:
    """A random cost graph with cycles: its relaxation is integral for some seeds and fractional for others."""
    rng = random.Random(seed)
    g = ilp.CostGraph()
    n = rng.randint(3, 6)
    for i in range(n):
        g.add_node(f"n{i}", [rng.choice([0.0, 1.0, 2.0, 0.5]) for _ in range(rng.randint(2, 3))])
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < 0.7:
            g.add_edge(u, v, [[rng.choice([0.0, 1.0, 3.0]) for _ in g.costs[v]] for _ in g.costs[u]])
    return g


def test_dense_graphs_reach_the_brute_force_optimum_either_way(paths):
    for seed in range(40):
        g = dense(seed)
        model, _ = model_of(g)
        first = solvers.solve(model, "highs", relaxation_first=True)
        plain = solvers.solve(model, "highs")
        assert first.status == plain.status == "optimal"
        assert seconds(first, model) == pytest.approx(brute_force(g), abs=1e-9) == seconds(plain, model)
    assert any(paths) and not all(paths)  # both ways were taken: the fallback and the integral relaxation
