"""HiGHS's choice branching (`partopt.solvers.highs._branch`): on memory-capped strategy programs it reaches the
brute-force optimum, settling them alone or handing over to HiGHS's own MIP at its node budget."""

from __future__ import annotations

import math
import random

import highspy
import numpy as np
import pytest

from partopt import ilp, solvers
from partopt.errors import InfeasibleError
from partopt.solvers import highs
from test_ilp import brute_force
from test_solver_limits import knapsack


def capped_graph(rng: random.Random) -> tuple[ilp.CostGraph, float]:
    """A chain-like cost graph of 5-8 nodes with 2-5 strategies each, fast strategies heavy, and a budget between
    its leanest and its heaviest assignment: the capped programs `ilp.solve` hands the solver."""
    g = ilp.CostGraph()
    n = rng.randint(5, 8)
    for i in range(n):
        k = rng.randint(2, 5)
        memory = [rng.randint(1, 20) for _ in range(k)]
        g.add_node(f"n{i}", [round(30 / m + rng.random(), 3) for m in memory], memory)
    for i in range(1, n):
        for j in {i - 1, rng.randrange(i)}:
            g.add_edge(j, i, [[rng.choice([0, 0, 0.5, 1, 3]) for _ in g.costs[i]] for _ in g.costs[j]])
    least = sum(float(m.min()) for m in g.memory)
    most = sum(float(m.max()) for m in g.memory)
    return g, least + (most - least) * rng.uniform(0.1, 0.6)


CASES = [capped_graph(random.Random(seed)) for seed in range(40)]


@pytest.fixture
def settled(monkeypatch) -> list[tuple[bool, int]]:
    """Per solve that branched: whether the branching settled it (False: it handed over to HiGHS's MIP), and its LPs."""
    seen: list[tuple[bool, int]] = []
    branch = highs._branch

    def spy(*args):
        found = branch(*args)
        seen.append((found[0] is not None, found[2]))
        return found

    monkeypatch.setattr(highs, "_branch", spy)
    return seen


def _check_optimal(graph: ilp.CostGraph, budget: float) -> None:
    solution = ilp.solve(graph, budget, "highs", reduce_first=False)
    assert solution.result.status == "optimal"
    assert solution.objective == pytest.approx(brute_force(graph, budget), abs=1e-9)
    assert graph.peak_memory(solution.choice) <= budget + 1e-9


def test_the_branching_alone_reaches_the_brute_force_optimum(settled):
    for graph, budget in CASES:
        _check_optimal(graph, budget)
    assert len(settled) == len(CASES) and all(alone for alone, _ in settled)  # none needed HiGHS's MIP


@pytest.mark.parametrize("nodes", [0, 1, 3])
def test_a_handover_at_the_node_budget_keeps_the_optimum(monkeypatch, settled, nodes):
    """With a budget of 0, 1 or 3 LPs the branching stops short and HiGHS's MIP finishes from its incumbent."""
    monkeypatch.setattr(highs, "BRANCH_NODES", nodes)
    for graph, budget in CASES:
        _check_optimal(graph, budget)
    assert [alone for alone, _ in settled].count(False) > len(CASES) // 2


class _LosesOneWarmLP(highspy.Highs):
    """HiGHS that reports the first LP it runs from a given basis as lost (`kUnknown`), as it did on a GPT-39B block
    program (docs/benchmarks.md, "A node LP lost from its parent's basis"); every later LP as HiGHS solves it."""

    lost = 0  # LPs reported lost, over every instance

    def __init__(self):
        super().__init__()
        self.warm = self.losing = self.spent = False

    def setBasis(self, *args):
        self.warm = True
        return super().setBasis(*args)

    def clearSolver(self):
        self.warm = False
        return super().clearSolver()

    def run(self):
        self.losing = self.warm and not self.spent
        self.spent |= self.losing
        _LosesOneWarmLP.lost += self.losing
        return super().run()

    def getModelStatus(self):
        return highspy.HighsModelStatus.kUnknown if self.losing else super().getModelStatus()


def test_a_node_lp_lost_from_its_parents_basis_is_solved_again_from_scratch(monkeypatch, settled):
    """A node LP that ends neither optimal nor infeasible warm is solved again cold: the branching still settles
    every program alone (it handed such a program over to HiGHS's MIP before) at the brute-force optimum."""
    monkeypatch.setattr(highs, "_new_highs", _LosesOneWarmLP)
    monkeypatch.setattr(_LosesOneWarmLP, "lost", 0)
    for graph, budget in CASES:
        _check_optimal(graph, budget)
    assert _LosesOneWarmLP.lost >= 10  # the programs that branched past their root lost an LP each
    assert len(settled) == len(CASES) and all(alone for alone, _ in settled)


def test_a_cutoff_at_the_optimum_leaves_no_solution_and_one_above_keeps_it():
    for graph, budget in CASES[:15]:
        optimum = brute_force(graph, budget)
        with pytest.raises(InfeasibleError):
            ilp.solve(graph, budget, "highs", reduce_first=False, cutoff=optimum)
        above = ilp.solve(graph, budget, "highs", reduce_first=False, cutoff=optimum + 1e-3)
        assert above.objective == pytest.approx(optimum, abs=1e-9)


def test_a_cutoff_program_with_no_solution_under_it_yet_goes_to_the_mip(monkeypatch, settled):
    """Branching proves "nothing under the cutoff" only by closing every node under it; past UNDER_CUTOFF_NODES
    LPs with no solution found it hands over, and HiGHS's MIP gives the same answers."""
    monkeypatch.setattr(highs, "UNDER_CUTOFF_NODES", 1)
    for graph, budget in CASES[:15]:
        optimum = brute_force(graph, budget)
        with pytest.raises(InfeasibleError):  # nothing is under a cutoff at the optimum
            ilp.solve(graph, budget, "highs", reduce_first=False, cutoff=optimum)
        above = ilp.solve(graph, budget, "highs", reduce_first=False, cutoff=optimum + 1e-3)
        assert above.objective == pytest.approx(optimum, abs=1e-9)
    assert settled and all(alone or lps == 1 for alone, lps in settled)  # a handover after one LP, no later
    assert [alone for alone, _ in settled].count(False) >= 15  # each cutoff at an optimum not proved at the root


def test_only_programs_made_of_choice_rows_branch():
    graph, budget = CASES[0]
    alive = ilp.reduce(graph)
    model, _ = ilp.build_model(graph, alive, budget)
    assert len(highs._choice_rows(model)) == sum(int(a.sum()) > 1 for a in alive)
    assert highs._choice_rows(knapsack()) == []  # no choice rows: HiGHS's MIP alone
    before = solvers.solve(model, "highs").objective
    model.add_var(-1.0)  # a 0-1 column outside every choice row and pinned by none, worth taking
    model.add_row([model.num_vars - 1], [1.0], -math.inf, 1)
    assert highs._choice_rows(model) == []
    assert solvers.solve(model, "highs").objective == pytest.approx(before - 1, abs=1e-9)


def test_the_split_row_is_the_widest_mix_on_the_binding_rows_by_hand():
    """Two choice rows {0, 1, 2} and {3, 4}, a memory row (no entry on column 2) and a second row on columns 1
    and 4. With x = (.5, .5, 0, .25, .75) and duals (2, .5), by hand: the first mix has mean 3 and spread 2 on
    the memory row, mean 1.5 and spread 1.5 on the other, so 2·2 + .5·1.5 = 4.75; the second, means 5.75 and
    .75, spreads 1.875 and .375: 2·1.875 + .5·.375 = 3.9375. A row whose dual is 0 does not bind and counts
    nothing."""
    model = solvers.Model()
    model.add_vars(np.zeros(5))
    model.add_row([0, 1, 2], [1.0] * 3, 1, 1)
    model.add_row([3, 4], [1.0] * 2, 1, 1)
    model.add_row([0, 1, 3, 4], [1.0, 5.0, 2.0, 7.0], -math.inf, 10)
    model.add_row([1, 4], [3.0, 1.0], -math.inf, 3)
    groups = highs._choice_rows(model)
    spread = highs._Spread.of(model, [2, 3], groups)
    x = np.array([0.5, 0.5, 0.0, 0.25, 0.75])
    assert spread.widths(x, np.array([2.0, 0.5])) == pytest.approx([4.75, 3.9375])
    assert spread.widths(x, np.array([2.0, 0.0])) == pytest.approx([4.0, 3.75])
    assert highs._split(groups, x, spread.widths(x, np.array([2.0, 0.5]))) == ((0,), (1, 2))


def test_a_root_far_from_integral_goes_to_the_mip_after_one_lp(monkeypatch, settled):
    """Three choice rows {a_k, b_k}, a_k free but 10 bytes against a row of 5, b_k costing 1: the root LP takes
    half of each a_k, three rows fractional. With a budget of 4 LPs (half: 2) the branching hands over after the
    root, and HiGHS's MIP finds the optimum, every b_k (3)."""
    model = solvers.Model()
    for k in range(3):
        a, b = model.add_var(0.0), model.add_var(1.0)
        model.add_row([a, b], [1.0, 1.0], 1, 1)
        model.add_row([a], [10.0], -math.inf, 5)
    monkeypatch.setattr(highs, "BRANCH_NODES", 4)
    assert solvers.solve(model, "highs").objective == pytest.approx(3.0)
    assert settled == [(False, 1)]
    monkeypatch.setattr(highs, "BRANCH_NODES", 8)  # half: 4, not exceeded: the branching settles it, in 7 LPs
    assert solvers.solve(model, "highs").objective == pytest.approx(3.0)
    assert settled[1] == (True, 7)


def test_a_0_1_column_its_row_does_not_make_integral_goes_to_the_mip():
    """A choice row {a, b} and a 0-1 column y held by y − a/2 − b/2 = 0: an equality row of 0 as the pair columns'
    are, yet y = 1/2 whatever is chosen, so no 0-1 solution exists. The root's choice is integral with y at 1/2:
    the branching must not round it into a solution, and HiGHS's MIP proves the program infeasible."""
    model = solvers.Model()
    a, b, y = model.add_var(0.0), model.add_var(1.0), model.add_var(0.0)
    model.add_row([a, b], [1.0, 1.0], 1, 1)
    model.add_row([y, a, b], [1.0, -0.5, -0.5], 0, 0)
    assert len(highs._choice_rows(model)) == 1
    assert solvers.solve(model, "highs").status == "infeasible"
