"""Cost cutoffs of memory-capped layer ILPs: a solve told that no cost at or above a cutoff is of use answers the
optimum or says that it costs that much (`solvers.solve`, `ilp.solve`), and `pricing.layer_cutoffs` gives each
layer the cost above which no stage the memory ladder prices can use it (docs/COSTMODEL.md §5b)."""

import math
import random

import numpy as np
import pytest

from partopt import ilp, inter, pricing, solvers
from partopt.errors import InfeasibleError
from partopt.inter import optimize
from partopt.solvers import BACKENDS
from test_ilp import CASES, brute_force, random_graph
from test_recompute import block_graph, tight_cluster


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cutoff_keeps_the_optimum_below_it_and_rules_out_one_at_or_above_it(backend):
    seen = {"kept": 0, "ruled out": 0}
    for graph, budget in CASES:
        expected = brute_force(graph, budget) if budget is not None else None
        if expected is None:
            continue
        for cutoff in (expected + 0.5, expected, expected - 0.25):
            try:
                solution = ilp.solve(graph, budget, backend, cutoff=cutoff)
            except InfeasibleError:
                assert expected >= cutoff  # only an optimum of no use is ruled out
                seen["ruled out"] += 1
                continue
            assert solution.objective == pytest.approx(expected, abs=1e-9)  # an answer is the optimum, cutoff or not
            assert graph.peak_memory(solution.choice) <= budget + 1e-9
            seen["kept"] += expected < cutoff
    assert seen["kept"] > 5 and seen["ruled out"] > 5


def _with_transients(graph: ilp.CostGraph, rng: random.Random) -> ilp.CostGraph:
    """`graph` with two transient buffers in each of two pools, each owned by a node and sized by a pair's strategies."""
    for pool in ("a", "b"):
        for owner in rng.sample(range(len(graph)), k=min(2, len(graph))):
            u, v = rng.sample(range(len(graph)), k=2)
            graph.add_transient(pool, owner, u, [[rng.choice([0, 0, 1, 2]) for _ in graph.costs[v]]
                                                 for _ in graph.costs[u]], v)
    return graph


def test_a_cutoff_with_transients_answers_as_enumeration_after_asking_the_relaxation_without_them(monkeypatch):
    """A capped program with transient buffers and a cutoff first asks its relaxation without them (every memory
    drops) for any assignment under the cutoff (`ilp._under_cutoff`). Against enumeration of every assignment: an
    answer is the optimum, and InfeasibleError comes only when the optimum is not under the cutoff. Each outcome of
    the question is met: none under the cutoff (ruled out), one that fits with its transients too (the program's
    start), one that does not (no verdict)."""
    rng = random.Random(20261207)
    seen = {"ruled out": 0, "start": 0, "no verdict": 0}
    question = ilp._under_cutoff

    def recording(*args):
        try:
            choice = question(*args)
        except InfeasibleError:
            seen["ruled out"] += 1
            raise
        seen["start" if choice is not None else "no verdict"] += 1
        return choice

    monkeypatch.setattr(ilp, "_under_cutoff", recording)
    for _ in range(800):
        graph = _with_transients(random_graph(rng), rng)
        budget = (sum(float(m.max()) for m in graph.memory) + 2) * rng.uniform(0.3, 0.9)
        expected = brute_force(graph, budget)
        if expected is None:
            continue
        cutoff = expected + rng.choice([0.5, 0.0, -0.25])
        try:
            solution = ilp.solve(graph, budget, cutoff=cutoff)
        except InfeasibleError:
            assert expected >= cutoff
            continue
        assert solution.objective == pytest.approx(expected, abs=1e-9)  # an answer is the optimum, cutoff or not
        assert graph.peak_memory(solution.choice) <= budget + 1e-9
    assert min(seen.values()) >= 5, seen


def test_asked_for_any_solution_under_a_cutoff_highs_stops_at_the_first():
    """`first_under_cutoff`: a solution under the cutoff (status "limit": not proven the optimum), or "cutoff" exactly
    when enumeration finds none under it; never more LPs than the solve to the optimum, and fewer where that solve
    goes on to prove its optimum (the solve did stop at the first)."""
    seen = {"fewer LPs": 0, "ruled out": 0}
    for graph, budget in CASES:
        expected = brute_force(graph, budget) if budget is not None else None
        if expected is None:
            continue
        alive = [np.ones(len(c), dtype=bool) for c in graph.costs]
        model, var = ilp.build_model(graph, alive, budget, None)
        for cutoff in (expected + 100.0, expected, expected - 0.25):
            scaled = (cutoff - model.offset) * model.scale
            result = solvers.solve(model, "highs", cutoff=scaled, first_under_cutoff=True)
            if expected >= cutoff:
                assert result.status == "cutoff"
                seen["ruled out"] += 1
                continue
            assert result.status == "limit"
            choice = ilp._chosen(alive, var, result.values)
            assert graph.peak_memory(choice) <= budget + 1e-9
            assert expected - 1e-9 <= graph.total(choice) < cutoff
            optimum = solvers.solve(model, "highs", cutoff=scaled)
            assert result.work <= optimum.work
            seen["fewer LPs"] += result.work < optimum.work
    assert seen["fewer LPs"] >= 3 and seen["ruled out"] > 5, seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_solve_stopped_by_its_limit_above_the_cutoff_rules_nothing_out(backend):
    """Two nodes of three strategies (costs 1, 2, 3; memory 5, 3, 1; at most 6 together): by hand the optimum is 4
    ((1, 3), (2, 2) or (3, 1) in cost), under a cutoff of 5. Stopped at once with only its start (cost 6, over the
    cutoff), a solve has proven nothing: it must not answer "cutoff", the verdict that nothing is under it, which
    would drop the option unseen. Run to its end it finds the optimum, and rules out a cutoff of 4."""
    model = solvers.Model(objective=[1, 2, 3, 1, 2, 3],
                          rows=[([0, 1, 2], [1, 1, 1], 1, 1), ([3, 4, 5], [1, 1, 1], 1, 1),
                                ([0, 1, 2, 3, 4, 5], [5, 3, 1, 5, 3, 1], 0, 6)],
                          start={0: 0, 1: 0, 2: 1, 3: 0, 4: 0, 5: 1})
    stopped = solvers.solve(model, backend, work_limit=0, cutoff=5.0)
    assert stopped.status != "cutoff"
    assert stopped.values is None or model.value(stopped.values) == pytest.approx(4.0)
    whole = solvers.solve(model, backend, cutoff=5.0)
    assert (whole.status, whole.objective) == ("optimal", pytest.approx(4.0))
    assert solvers.solve(model, backend, cutoff=4.0).status == "cutoff"


def test_the_model_offset_is_the_cost_its_objective_leaves_out():
    """The cutoff reaches the solver as (cutoff − offset) · scale: the offset must be every constant cost."""
    checked = 0
    for graph, budget in CASES:
        alive = ilp.reduce(graph)
        choice = ilp._leanest(graph, alive)
        if budget is None or graph.peak_memory(choice) > budget:
            continue
        model, _ = ilp.build_model(graph, alive, budget, choice)
        start = [model.start[i] for i in range(model.num_vars)]
        assert model.offset + model.value(start) / model.scale == pytest.approx(graph.total(choice), abs=1e-9)
        checked += model.offset != 0
    assert checked > 5


def _stage_may_win(costs, first, end, count, limit, work, spare, overlap) -> bool:
    """`stage_lengths`'s test of one stage (layers first..end), written out."""
    if any(c is None for c in costs[first:end + 1]):
        return False
    paid = 1 - 1 / count if overlap else 1
    if paid * sum(costs[first:end + 1]) >= limit:
        return False
    if work is None:
        return True
    if spare == 0:
        return first == 0 and end == len(costs) - 1
    return count * (sum(work) - sum(work[first:end + 1])) / spare < limit


def test_layer_cutoffs_match_enumeration_of_the_stages():
    """Layers of a kind (one job) priced at x may join a stage of the rung's lengths that can win exactly when x is
    under their cutoff: every layer of that kind in the stage costs x, the others their least."""
    rng = random.Random(20261205)
    seen = {True: 0, False: 0}
    for _ in range(300):
        layers = rng.randint(1, 8)
        kinds = [rng.choice("abc") for _ in range(layers)]
        least = {kind: None if rng.random() < 0.1 else rng.uniform(0, 3) for kind in "abc"}
        costs = [least[kind] for kind in kinds]
        count, overlap = rng.choice([2, 4, 8]), rng.random() < 0.5
        limit = rng.uniform(1, 10)
        work = [rng.uniform(0, 1) for _ in range(layers)] if rng.random() < 0.7 else None
        spare = rng.choice([0, 1, 3])
        low = rng.randint(0, layers)
        lengths = range(low + 1, rng.randint(low, layers + 1) + 1)
        cutoffs = pricing.layer_cutoffs(costs, count, limit, lengths, work, spare, overlap, kinds)
        for b, cost in enumerate(costs):
            if cost is None:
                continue
            for x in (cost, cost + 0.3, cost + 1, cost + 4):
                priced = [x if kind == kinds[b] else c for kind, c in zip(kinds, costs)]
                wins = any(_stage_may_win(priced, first, first + n - 1, count, limit, work, spare, overlap)
                           for n in lengths for first in range(max(0, b - n + 1), min(b, layers - n) + 1))
                assert wins == (x < cutoffs[b]), (costs, kinds, b, x, cutoffs[b])
                seen[wins] += 1
    assert min(seen.values()) > 100


def test_layer_cutoffs_by_hand():
    """Three blocks and a head, limit 10, stages of 3 or 4 layers, no overlap: blocks 1 and 2 are of use
    below (10 − 2) / 2 = 4 (the stage of blocks 1, 2 and the head), block 0 below 10 / 3 (its only 3-stage
    is the three blocks), the head below 10 − 2 = 8; each layer alone: the head's bound for all."""
    costs, kinds = [1.0, 1.0, 1.0, 2.0], ["block", "block", "block", "head"]
    assert pricing.layer_cutoffs(costs, 4, 10.0, range(3, 5), kinds=kinds) == pytest.approx([10 / 3, 4, 4, 8])
    assert pricing.layer_cutoffs(costs, 4, 10.0, range(3, 5)) == pytest.approx([8, 8, 8, 8])


@pytest.mark.parametrize("layers, batch, memory_gib", [(6, 32, 0.015), (8, 32, 0.01)])
def test_the_search_finds_the_same_plan_with_cutoffs_as_without(monkeypatch, layers, batch, memory_gib):
    """Cutoffs (capped ILPs told the cost of no use, stage DPs told the best plan) rule out work, never a plan."""
    graph = block_graph(layers=layers, batch=batch)
    cluster = tight_cluster(graph, memory_gib, devices=4)
    ruled_out = []
    run = pricing.Pricer.run

    def counted(self, jobs, stats, progress=lambda n: None):
        results = run(self, jobs, stats, progress)
        ruled_out.extend(key for key, job in jobs.items() if job.cutoff is not None and results[key] is None)
        return results

    monkeypatch.setattr(pricing.Pricer, "run", counted)
    cut = optimize(graph, cluster, workers=1)
    assert ruled_out  # the cutoffs did rule capped ILPs out here
    monkeypatch.setattr(pricing, "_cutoffs", lambda keys, *args: {key: math.inf for key in keys})
    monkeypatch.setattr(inter, "_wanted", lambda best: math.inf)
    ruled_out.clear()
    whole = optimize(graph, cluster, workers=1)
    assert not ruled_out
    assert cut.iteration_time_s == pytest.approx(whole.iteration_time_s, rel=1e-12)
    assert cut.num_microbatches == whole.num_microbatches
    assert [(s.graph_layers, s.submesh, s.logical_mesh, s.recompute) for s in cut.stages] == \
        [(s.graph_layers, s.submesh, s.logical_mesh, s.recompute) for s in whole.stages]
