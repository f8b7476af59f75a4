"""Leaves merged into their neighbours before the capped ILP (`ilp.fold_leaves`): exact, and smaller."""

import itertools
import random

import numpy as np
import pytest

from partopt import ilp
from partopt.errors import InfeasibleError


def test_a_leaf_keeps_per_neighbour_strategy_only_the_pairs_nothing_dominates():
    g = ilp.CostGraph()
    q = g.add_node("matmul", [1.0, 1.0], [0.0, 0.0])
    w = g.add_node("weight", [0.0, 0.0, 0.0], [4.0, 2.0, 2.0])  # stored whole, or halved two ways
    x = g.add_node("next", [0.0], [0.0])  # one strategy: not merged
    g.add_edge(q, x, [[0.0], [1.0]])  # q has a second edge: w is its leaf
    # gathering the halved weight costs 1 unless q's strategy reads that half as is
    g.add_edge(q, w, [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    folded = ilp.fold_leaves(g, [np.ones(2, bool), np.ones(3, bool), np.ones(1, bool)])
    # q = 0: whole (cost 0, 4 bytes) and either half (cost 1, 2 bytes, equal: the first kept); q = 1: the first half
    # (cost 0, 2 bytes) beats the rest
    assert folded.nodes == [q, x]
    assert folded.rows[0].tolist() == [0, 0, 1]
    assert folded.leaves[0][w].tolist() == [0, 1, 1]
    assert folded.graph.costs[0].tolist() == [1.0, 2.0, 1.0]
    assert folded.graph.memory[0].tolist() == [4.0, 2.0, 2.0]
    assert folded.unfold([1, 0], 3) == [0, 1, 0]


@pytest.mark.parametrize("on_edge", [True, False])
def test_a_leaf_strategy_alike_but_for_its_transients_is_kept(on_edge):
    """Given q's first strategy the weight's two are alike but for a transient buffer (on the edge, or the weight's
    own), and only the smaller fits; neither beats the other over both of q's strategies, so only the merge's own
    comparison, transients included, can drop the wrong one."""
    g = ilp.CostGraph()
    q = g.add_node("matmul", [0.0, 1.0], [1.0, 0.0])  # a trade-off: neither strategy of q goes before folding
    w = g.add_node("weight", [0.0, 0.0], [0.0, 0.0])
    x = g.add_node("next", [0.0], [0.0])
    g.add_edge(q, x, [[0.0], [0.0]])
    if on_edge:
        g.add_edge(q, w, [[0.0, 0.0], [0.0, 0.0]])
        g.add_transient("buffers", q, q, [[5.0, 1.0], [1.0, 5.0]], w)
    else:
        g.add_edge(q, w, [[0.0, 0.0], [0.0, 1.0]])
        g.add_transient("buffers", w, w, [5.0, 1.0])
    assert all(a.all() for a in ilp.reduce(g))
    solution = ilp.solve(g, 2.0)  # q's first strategy (1 byte) and the weight's second (a 1-byte buffer)
    assert solution.choice == [0, 1, 0]
    assert solution.objective == 0.0


def random_graph(rng: random.Random) -> ilp.CostGraph:
    """A random tree-like cost graph with leaves, transients on leaf edges and nodes, and a shared peak."""
    g = ilp.CostGraph(peak_shared_by=rng.choice([1, 2, 3]))
    n = rng.randint(3, 7)
    for i in range(n):
        k = rng.randint(1, 4)
        g.add_node(f"n{i}", [rng.choice([0, 1, 2, 3, 0.5]) for _ in range(k)], [rng.randint(0, 5) for _ in range(k)])
    for i in range(1, n):
        for j in rng.sample(range(i), k=min(i, rng.randint(1, 2))):
            g.add_edge(j, i, [[rng.choice([0, 0, 1, 2, 0.25]) for _ in g.costs[i]] for _ in g.costs[j]])
            if rng.random() < 0.5:
                owner = rng.choice([j, i])
                g.add_transient("buffers", owner, j, [[rng.randint(0, 4) for _ in g.costs[i]] for _ in g.costs[j]], i)
        if rng.random() < 0.4:
            g.add_transient(rng.choice(["buffers", "prefetch"]), i, i, [rng.randint(0, 3) for _ in g.costs[i]])
    return g


def brute_force(g: ilp.CostGraph, budget: float) -> float | None:
    fitting = [g.total(list(c)) for c in itertools.product(*[range(len(c)) for c in g.costs])
               if g.peak_memory(list(c)) <= budget]
    return min(fitting, default=None)


CASES = []
_rng = random.Random(20261205)
while len(CASES) < 60:
    graph = random_graph(_rng)
    alive = [np.ones(len(c), bool) for c in graph.costs]
    if len(ilp.fold_leaves(graph, alive).nodes) < len(graph):  # some leaf is merged
        most = sum(float(m.max()) for m in graph.memory) + 12
        CASES.append((graph, _rng.uniform(0.3, 0.9) * most))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_capped_program_on_merged_leaves_matches_exhaustive_enumeration(case):
    graph, budget = CASES[case]
    expected = brute_force(graph, budget)
    if expected is None:
        with pytest.raises(InfeasibleError):
            ilp.solve(graph, budget)
        return
    solution = ilp.solve(graph, budget)
    assert solution.objective == pytest.approx(expected, abs=1e-9)
    assert graph.peak_memory(solution.choice) <= budget + 1e-9
    assert graph.total(solution.choice) == pytest.approx(solution.objective, abs=1e-12)


def test_merging_keeps_every_choice_it_maps_back_at_its_cost_and_memory():
    """Each folded strategy maps back to a choice of the same cost and memory (the folded graph prices it right)."""
    for graph, _ in CASES[:20]:
        folded = ilp.fold_leaves(graph, [np.ones(len(c), bool) for c in graph.costs])
        for choice in itertools.product(*[range(len(c)) for c in folded.graph.costs]):
            original = folded.unfold(list(choice), len(graph))
            assert folded.graph.total(list(choice)) == pytest.approx(graph.total(original), abs=1e-12)
            assert folded.graph.peak_memory(list(choice)) == pytest.approx(graph.peak_memory(original), abs=1e-12)
