"""ZB-H1 as a choice of the stage DP (issue 13 item 2): the threshold DP (`stagedp.zero_bubble`) equals brute
force on random tables and on a tiny GPT, its objective is the closed form the simulator checks, auto is never
worse than a forced schedule, and a zero-bubble plan round-trips, re-prices and is refused by the Megatron export."""

from __future__ import annotations

import importlib
import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from partopt import costmodel, io, stagedp
from partopt.assemble import pipeline_of
from partopt.bench import alpa
from partopt.check import differences
from partopt.cli import main
from partopt.cluster import preset
from partopt.inter import _best_schedule, _Count, _Space, optimize
from partopt.layering import build_layers
from partopt.models import gpt
from partopt.options import Options
from partopt.plan import plan_from_dict, plan_to_dict
from partopt.pricing import Job, Pricer, Stats
from partopt.schedules import iteration_time
from partopt.simulate import StageTimes, closed_form, simulate
from partopt.stages import End, recomputed_flops, split_table, stage_table, totals, training_flops, weight_flops
from partopt.validate import check_plan

export = importlib.import_module("partopt.export")

GRAPH = gpt(hidden=64, layers=4, heads=4, seq=32, vocab=128, batch=8, name="tiny-gpt")
CLUSTER = preset("p3.16xlarge", 1)
SUBMESHES = [(1, 1), (1, 2), (1, 4)]


def cuts(layers: int):
    """Every cut of `layers` DP layers into contiguous [first, last] stages."""
    for cut in itertools.product([False, True], repeat=layers - 1):
        ends = [i for i in range(layers - 1) if cut[i]] + [layers - 1]
        yield list(zip([0] + [e + 1 for e in ends[:-1]], ends))


def brute_table(t, extra, omega, sizes, devices, B) -> float:
    """The least ZB-H1 iteration over every cut × submesh × option on exactly `devices` devices, straight from
    its definition: every stage must fit min(S, B) microbatches (t[h, min(S, B)] finite), and the plan costs
    sum t + (B - 1) max t - (S + min(S, B) - 2) min omega + max extra."""
    H, L = t.shape[0], t.shape[2]
    best = math.inf
    for ranges in cuts(L):
        S, held = len(ranges), min(len(ranges), B)
        if held >= t.shape[1]:
            continue
        for picked in itertools.product(range(len(sizes)), range(H), repeat=S):
            pairs = list(zip(picked[::2], picked[1::2]))
            if sum(sizes[s] for s, _ in pairs) != devices:
                continue
            times = [t[h, held, i, j, s] for (i, j), (s, h) in zip(ranges, pairs)]
            if not all(map(math.isfinite, times)):
                continue
            hidden = min(omega[h, i, j, s] for (i, j), (s, h) in zip(ranges, pairs))
            sync = max(extra[h, held, i, j, s] for (i, j), (s, h) in zip(ranges, pairs))
            best = min(best, sum(times) + (B - 1) * max(times) - (S + held - 2) * hidden + sync)
    return best


def every_depth(latency: np.ndarray) -> stagedp.Entries:
    """Entries that fit every in-flight depth, with no sync."""
    return stagedp.Entries(latency, np.zeros_like(latency), np.where(np.isfinite(latency), latency.shape[1], 0))


def random_table(rng, L: int, H: int, sizes: list[int]):
    """A stage table as `stages.stage_table` makes them (and the dense tables it stands for): a latency per
    (option, layers, submesh), finite at the levels k up to a random depth; an omega within [0, t/3]; a sync."""
    S = len(sizes)
    latency = rng.uniform(0.5, 3.0, (H, L, L, S)) * (1 + np.arange(L)[None, None, :, None])
    depth = np.where(np.triu(np.ones((L, L), bool))[None, :, :, None], rng.integers(0, L + 1, (H, L, L, S)), 0)
    sync = rng.uniform(0.0, 2.0, (H, L, L, S))
    omega = np.round(rng.uniform(0.0, 1.0 / 3.0, (H, L, L, S)) * latency, 1)  # rounded: ties between thresholds
    entries = stagedp.Entries(np.where(depth >= 1, latency, np.inf), np.where(depth >= 1, sync, 0.0), depth)
    return entries, *entries.dense(), omega


def random_cases(seed: int, least_layers: int = 2, least_devices: int = 1, least_microbatches: int = 1):
    """Twelve random tables of 2-4 layers (at least `least_layers`), one or two options, submeshes of 1 and 2
    devices, with a device count and B drawn from 1 (or the least given) to 4 and 5: (entries, t, extra, omega,
    sizes, devices, B) each."""
    rng = np.random.default_rng(seed)
    for _ in range(12):
        L, H, sizes = int(rng.integers(least_layers, 5)), int(rng.integers(1, 3)), [1, 2]
        devices, B = int(rng.integers(least_devices, 5)), int(rng.integers(least_microbatches, 6))
        yield (*random_table(rng, L, H, sizes), sizes, devices, B)


@pytest.mark.parametrize("seed", range(10))
def test_the_threshold_dp_equals_brute_force_on_random_tables(seed):
    """Exact over cuts × submeshes × options: options differ in omega as well as latency and sync, memory
    caps bind at random depths (so min(S, B) decides what fits), B below and above the stage counts."""
    for entries, t, extra, omega, sizes, devices, B in random_cases(seed):
        expected = brute_table(t, extra, omega, sizes, devices, B)
        found = stagedp.zero_bubble(entries, omega, sizes, devices, B)
        assert (found is None) == math.isinf(expected)
        if found is None:
            continue
        assert found.total == pytest.approx(expected, rel=1e-12)
        # the plan it returns costs what it says, every stage holding min(S, B)
        S = len(found.stages)
        held = min(S, B)
        assert [c.inflight for c in found.stages] == [S] * S
        times = [t[c.option, held, c.first, c.last, c.submesh] for c in found.stages]
        cost = (sum(times) + (B - 1) * max(times)
                - (S + held - 2) * min(omega[c.option, c.first, c.last, c.submesh] for c in found.stages)
                + max(extra[c.option, held, c.first, c.last, c.submesh] for c in found.stages))
        assert cost == pytest.approx(found.total, rel=1e-12)
        # a cutoff below the optimum finds nothing; above it, the same optimum
        assert stagedp.zero_bubble(entries, omega, sizes, devices, B, cutoff=expected * (1 - 1e-9)) is None
        assert stagedp.zero_bubble(entries, omega, sizes, devices, B, cutoff=expected * 1.01).total == found.total


@pytest.mark.parametrize("seed", range(4))
def test_a_search_stopped_at_its_work_limit_brackets_the_optimum(seed):
    """Stopped after `limit` inner DPs, what the search returns (its plan, or the cutoff when it found none) is
    no better than brute force's optimum (or the cutoff) and its floor no worse: floor <= optimum <= returned.
    A search that is not marked (floor None) returns the optimum exactly, whichever stage count it starts from."""
    stopped = 0
    for entries, t, extra, omega, sizes, devices, B in random_cases(100 + seed, 3, 2, 2):
        expected = brute_table(t, extra, omega, sizes, devices, B)
        if math.isinf(expected):
            continue
        onef1b = stagedp.solve(entries, None, sizes, devices, B)
        for cutoff in (math.inf, onef1b.total if onef1b else math.inf):
            for limit, hint in itertools.product((None, 0, 1, 3, 10), (None, 1, 2, 3)):
                found = stagedp.zero_bubble(entries, omega, sizes, devices, B, cutoff, limit, hint)
                best = min(expected, cutoff)  # what an exact search returns: its plan, or the cutoff's
                returned = cutoff if found is None or not found.stages else found.total
                assert best <= returned * (1 + 1e-12)  # never cheaper than the optimum
                if found is None or found.floor is None:  # not marked: exact
                    assert returned == pytest.approx(best, rel=1e-12)
                else:
                    stopped += 1
                    assert found.floor <= best * (1 + 1e-12)
    assert stopped  # the limits do stop some of these searches


@pytest.mark.parametrize("seed", range(4))
def test_a_search_seeded_with_the_1f1b_plan_is_still_exact(seed):
    """Seeded with 1F1B's optimal plan (`inter._best_schedule` does so), the search returns brute force's optimum
    (and the seed itself, run as ZB-H1, when nothing beats it); the seed's ZB-H1 cost is its closed form from the
    definition: every stage in an option holding min(S, B) (its own when it does, else the fastest that does)."""
    seeded = 0
    for entries, t, extra, omega, sizes, devices, B in random_cases(200 + seed):
        onef1b = stagedp.solve(entries, None, sizes, devices, B)
        if onef1b is None:
            continue
        expected = brute_table(t, extra, omega, sizes, devices, B)
        as_zb = stagedp.as_zero_bubble(entries, omega, onef1b.stages, B)
        S, held = len(onef1b.stages), min(len(onef1b.stages), B)
        options = []
        for c in onef1b.stages:
            fit = [h for h in range(t.shape[0]) if entries.depth[h, c.first, c.last, c.submesh] >= held]
            options.append(c.option if c.option in fit else
                           min(fit, key=lambda h: (entries.latency[h, c.first, c.last, c.submesh], h)) if fit else None)
        if None in options:
            assert as_zb is None
        else:
            seeded += 1
            times = [t[h, held, c.first, c.last, c.submesh] for c, h in zip(onef1b.stages, options)]
            hidden = min(omega[h, c.first, c.last, c.submesh] for c, h in zip(onef1b.stages, options))
            sync = max(extra[h, held, c.first, c.last, c.submesh] for c, h in zip(onef1b.stages, options))
            assert as_zb.total == pytest.approx(sum(times) + (B - 1) * max(times) - (S + held - 2) * hidden + sync,
                                                rel=1e-12)
            assert expected <= as_zb.total * (1 + 1e-12)  # a ZB-H1 plan: no better than the optimum
        found = stagedp.zero_bubble(entries, omega, sizes, devices, B, seed=onef1b.stages)
        assert (found is None) == math.isinf(expected)  # a 1F1B plan need not fit ZB-H1's memory
        if found is not None:
            assert found.total == pytest.approx(expected, rel=1e-12)
    assert seeded  # some 1F1B plans fit ZB-H1's memory


def test_the_dp_objective_is_the_simulated_time_on_uniform_layers():
    """Eight identical layers (f = 1, b = 2 of which w = 1, no sends), four one-device stages, B = 8: the DP
    cuts them evenly, and its least ZB-H1 iteration is the event simulation of that plan (exact on uniform stages
    without sends, docs/COSTMODEL.md §5b). By hand, stages of F = 2, B = 2, W = 2: the ideal 8 · 6 = 48 plus
    the paper's bubble (S − 1)(F + B − W) = 6: 54, against 1F1B's (S + B − 1) · 6 = 66; the uneven cut
    1-2-2-3 would cost 24 + 7 · 9 − 6 · 1 = 81."""
    L, B = 8, 8
    t = np.full((1, L, L, 1), np.inf)
    omega = np.zeros((1, L, L, 1))
    for i, j in itertools.product(range(L), range(L)):
        if j >= i:
            t[0, i, j, 0] = 3.0 * (j - i + 1)
            omega[0, i, j, 0] = 1.0 * (j - i + 1)
    found = stagedp.zero_bubble(every_depth(t), omega, [1], 4, B)
    assert [(c.first, c.last) for c in found.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    stages = [StageTimes(2.0, 4.0, weight_s=2.0)] * 4
    assert found.total == 54.0 == closed_form(stages, B, "zero-bubble") == simulate(stages, B, "zero-bubble").iteration_time_s
    assert simulate(stages, B, "1f1b").iteration_time_s == 66.0


@pytest.mark.parametrize("seed", range(4))
def test_the_dp_objective_bounds_the_simulated_time_on_uneven_layers(seed):
    """Layers of random forward time f, b = 2f and w = b/2 (the matmul split), no sends, one-device stages: the
    plan the DP picks, run event by event, takes no longer than the DP's closed form (docs/COSTMODEL.md §5b: T <= C
    when b_i = r f_i and w_i = b_i / 2), and at least its reach bound (stage k reached by the forwards before it, then B of its F + B + W)."""
    rng = np.random.default_rng(seed)
    L, devices = 6, 3
    f = rng.uniform(0.5, 2.0, L)
    t = np.full((1, L, L, 1), np.inf)
    omega = np.zeros((1, L, L, 1))
    for i, j in itertools.product(range(L), range(L)):
        if j >= i:
            t[0, i, j, 0] = 3.0 * f[i:j + 1].sum()
            omega[0, i, j, 0] = f[i:j + 1].sum()
    for B in (1, 2, 3, 8):
        found = stagedp.zero_bubble(every_depth(t), omega, [1], devices, B)
        stages = [StageTimes(f[c.first:c.last + 1].sum(), 2 * f[c.first:c.last + 1].sum(),
                             weight_s=f[c.first:c.last + 1].sum()) for c in found.stages]
        assert found.total == pytest.approx(closed_form(stages, B, "zero-bubble"), rel=1e-12)
        simulated = simulate(stages, B, "zero-bubble").iteration_time_s
        reach = max(sum(x.forward_s for x in stages[:k]) + B * stages[k].latency_s for k in range(len(stages)))
        assert reach <= simulated <= found.total * (1 + 1e-12)


@pytest.fixture(scope="module")
def priced():
    """The tiny GPT's layers priced on (1, 1), (1, 2), (1, 4) submeshes with no recomputation and with full
    recomputation on (1, 2) (an option whose FLOP shares, and so whose omega, differ): the search's cost rows."""
    layering, count = build_layers(GRAPH, None), 4
    budget = costmodel.memory_budget(CLUSTER.device)
    costs = {}
    with Pricer(GRAPH, Options(workers=1)) as pricer:
        for sub, shape, mode in [((1, 1), (1, 1), "none"), ((1, 2), (1, 2), "none"), ((1, 2), (2, 1), "full"),
                                 ((1, 4), (1, 4), "none")]:
            mesh = CLUSTER.logical_mesh(sub, shape)
            costs[(sub, shape, mode)] = [[pricer.one(Job(GRAPH.dims["b"] // count, count, tuple(op.name for op in ops),
                                                          mesh, mode, budget), Stats()) for ops in layering.base]]
    return layering, count, costs


def stage_split(layering, first: int, last: int, mode: str, latency: float) -> tuple[float, float]:
    """(f, w) of a stage as plan assembly splits its latency: the forward's and the dW GEMMs' FLOP shares of what
    the stage executes (forward + backward + recomputation), summed over the stage's ops directly."""
    ops = [op for g in range(first, last + 1) for op in layering.ops(g)]
    base = layering.base[layering.groups[first][0]:layering.groups[last][1] + 1]
    executed = training_flops(GRAPH, ops) + recomputed_flops(GRAPH, base, mode)
    f = latency * sum(GRAPH.flops(op) for op in ops) / executed
    return f, min(latency * weight_flops(GRAPH, ops) / executed, latency - f)


def test_omega_is_the_plan_assemblys_split_entry_by_entry(priced):
    layering, count, costs = priced
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    entries, options = stage_table(pipe, costs, SUBMESHES, count, math.inf)
    omega = split_table(pipe, entries, options)
    L = len(layering.groups)
    for s, sub in enumerate(SUBMESHES):
        for h, (shape, mode, r) in enumerate(options[s]):
            for i, j in itertools.combinations_with_replacement(range(L), 2):
                latency = totals(costs[(sub, shape, mode)][r], pipe, i, j, End(sub, shape)).latency_s
                f, w = stage_split(layering, i, j, mode, latency)
                assert entries.latency[h, i, j, s] == latency
                assert omega[h, i, j, s] == pytest.approx(min(w, f, latency - f - w), rel=1e-12)
                assert 0 < omega[h, i, j, s] < latency / 3 + 1e-18  # three shares of one latency


def brute_force(pipe, layering, costs, count: int, budget: float, devices: int) -> float:
    """The least ZB-H1 iteration over every cut × submesh × option per stage on exactly `devices` devices, each
    stage priced by `totals`, split as plan assembly does, fitting min(S, B) microbatches, and the plan by
    `schedules.iteration_time`."""
    choices = [(sub, key, r) for sub in SUBMESHES for key in costs if key[0] == sub for r in range(len(costs[key]))]
    best = math.inf
    for ranges in cuts(len(layering.groups)):
        S = len(ranges)
        for picked in itertools.product(choices, repeat=S):
            if sum(sub[0] * sub[1] for sub, _, _ in picked) != devices:
                continue
            sums = [totals(costs[key][r], pipe, a, b, End(sub, key[1])) for (a, b), (sub, key, r) in zip(ranges, picked)]
            if any(x.memory_bytes(min(S, count)) > budget for x in sums):
                continue
            times = [x.latency_s for x in sums]
            splits = [stage_split(layering, a, b, key[2], x.latency_s) for (a, b), (_, key, _), x in zip(ranges, picked, sums)]
            best = min(best, iteration_time(times, [f for f, _ in splits], max(x.sync_s for x in sums), count,
                                            "zero-bubble", weight_times=[w for _, w in splits]))
    return best


@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("binds", [False, True])
def test_the_search_equals_brute_force_and_auto_takes_the_best_schedule(priced, devices, binds):
    """`inter._best_schedule` with zero-bubble forced finds the brute force's least ZB-H1 iteration over cuts ×
    submeshes × options, with memory free and with a budget under which the whole model on one device fits 3
    microbatches but not 4 (so min(S, B) rules out plans 1F1B may run); auto is the least of the schedules forced."""
    layering, count, costs = priced
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    sizes = [a * b for a, b in SUBMESHES]
    whole = totals(costs[((1, 1), (1, 1), "none")][0], pipe, 0, len(layering.groups) - 1, End((1, 1), (1, 1)))
    budget = whole.memory_bytes(3.5) if binds else math.inf
    expected = brute_force(pipe, layering, costs, count, budget, devices)
    found = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, ("zero-bubble",), Stats())
    assert math.isfinite(expected)
    assert found[1] == "zero-bubble"
    assert found[0].total == pytest.approx(expected, rel=1e-12)
    forced = [_best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, (s,), Stats())
              for s in ("1f1b", "interleaved", "zero-bubble")]
    auto = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, Options().schedules, Stats())
    assert auto[0].total == pytest.approx(min(x[0].total for x in forced if x is not None), rel=1e-12)
    assert auto[0].total <= forced[0][0].total  # ZB-H1 on 1F1B's stages is never slower, when it fits
    # an incumbent (`inter._Space.best` hands over a plan found on fewer rows): the optimum still, found or kept
    for schedules in [("1f1b",), ("zero-bubble",), Options().schedules]:
        exact = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, schedules, Stats())
        slower = (replace(forced[0][0], total=forced[0][0].total * 1.5), *forced[0][1:])  # the DPs must beat it
        found = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, schedules, Stats(), slower)
        assert found[0].total == pytest.approx(exact[0].total, rel=1e-12)
        kept = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, schedules, Stats(), exact)
        assert kept[0].total == pytest.approx(exact[0].total, rel=1e-12)
        assert (kept[0].stages, kept[1:]) == (exact[0].stages, exact[1:])  # nothing beats it: kept


def _count_searches(monkeypatch) -> list:
    """A list that gets an entry each time `stagedp.zero_bubble` is called (the search itself still runs)."""
    searched = []
    real = stagedp.zero_bubble
    monkeypatch.setattr(stagedp, "zero_bubble", lambda *a, **k: searched.append(1) or real(*a, **k))
    return searched


@pytest.mark.parametrize("devices", [2, 4])
def test_no_1f1b_plan_means_no_zero_bubble_plan_and_no_search(priced, monkeypatch, devices):
    """A ZB-H1 stage holds min(S, B) microbatches, 1F1B's stage k holds min(k, B) <= that: a ZB-H1 plan's cut is a
    1F1B plan. So at budgets where 1F1B has no plan, brute force finds no ZB-H1 plan either, and `_best_schedule`
    answers None without running the zero-bubble search; where 1F1B has one, the search runs as before."""
    layering, count, costs = priced
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    sizes = [a * b for a, b in SUBMESHES]
    whole = totals(costs[((1, 1), (1, 1), "none")][0], pipe, 0, len(layering.groups) - 1, End((1, 1), (1, 1)))
    searched = _count_searches(monkeypatch)
    outcomes = set()
    for budget in [whole.param_bytes * x for x in (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)] + [whole.memory_bytes(3.5)]:
        onef1b = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, ("1f1b",), Stats())
        expected = brute_force(pipe, layering, costs, count, budget, devices)
        searched.clear()
        for schedules in [("zero-bubble",), Options().schedules]:
            found = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, schedules, Stats())
            if onef1b is None:
                assert found is None
            elif schedules == ("zero-bubble",):
                assert found[0].total == pytest.approx(expected, rel=1e-12)
        assert bool(searched) == (onef1b is not None)
        if onef1b is None:
            assert math.isinf(expected)
        outcomes.add(onef1b is None)
    assert outcomes == {True, False}  # the budgets leave some 1F1B plans and rule all of them out for others


@pytest.mark.parametrize("seed", range(4))
def test_a_zero_bubble_plan_saves_at_most_its_share_of_the_1f1b_optimum(seed):
    """`stagedp.zero_bubble_saving`: with omega <= t/3 and sync >= 0, brute force's ZB-H1 optimum is at least
    (1 - share) times the 1F1B optimum on random tables; and the share is attained by S uniform stages whose omega is
    t/3 (F = (S + B - 1) t, saving c(S) t / 3), so it is no looser than it must be."""
    checked = 0
    for entries, t, extra, omega, sizes, devices, B in random_cases(300 + seed):
        omega = np.minimum(omega, entries.latency / 3)
        onef1b = stagedp.solve(entries, None, sizes, devices, B)
        expected = brute_table(t, extra, omega, sizes, devices, B)
        if onef1b is None:
            assert math.isinf(expected)  # a ZB-H1 cut is a 1F1B plan
            continue
        share = stagedp.zero_bubble_saving(B, min(entries.layers, devices))
        assert expected >= (1 - share) * onef1b.total * (1 - 1e-12)
        checked += 1
    assert checked
    for S, B in [(1, 1), (2, 8), (4, 4), (8, 3), (48, 1024)]:
        c, latency = S + min(S, B) - 2, 0.3
        uniform = stagedp.Entries(np.full((1, S, S, 1), latency), np.zeros((1, S, S, 1)), np.full((1, S, S, 1), S))
        plan = [stagedp.StageChoice(i, i, 0, S) for i in range(S)]
        zb = stagedp.as_zero_bubble(uniform, np.full((1, S, S, 1), latency / 3), plan, B)
        assert zb.total == pytest.approx((S + B - 1) * latency - c * latency / 3, rel=1e-12)
        assert zb.total == pytest.approx((1 - stagedp.zero_bubble_saving(B, S)) * (S + B - 1) * latency, rel=1e-12)


def test_a_1f1b_optimum_past_the_share_skips_the_zero_bubble_search(priced, monkeypatch):
    """Under a cutoff whose share-bound lies below the 1F1B optimum (cutoff < (1 - share) F1F1B), `_best_schedule`
    does not search ZB-H1 (no ZB-H1 plan can beat the cutoff: brute force agrees) and finds no plan; with the cutoff
    a little higher, it searches as before."""
    layering, count, costs = priced
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    sizes, devices, budget = [a * b for a, b in SUBMESHES], 4, math.inf
    onef1b = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, ("1f1b",), Stats())[0].total
    share = stagedp.zero_bubble_saving(count, min(len(layering.groups), devices))
    searched = _count_searches(monkeypatch)
    for schedules in [("1f1b", "zero-bubble"), ("zero-bubble",)]:
        searched.clear()
        low = (1 - share) * onef1b * (1 - 1e-6)
        assert _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, schedules, Stats(),
                              cutoff=low) is None
        assert not searched
        assert brute_force(pipe, layering, costs, count, budget, devices) >= low
        _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, schedules, Stats(),
                       cutoff=(1 - share) * onef1b * 1.01)
        assert searched


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_a_bounds_only_search_rules_out_only_what_no_plan_beats(priced, monkeypatch, devices):
    """`_best_schedule(proven=False, bounds_only=True)` over 1F1B and ZB-H1, as `inter._zero_bubble_may_win` asks it:
    ZB-H1's search runs no inner DP past its bounds (`stagedp._threshold` is never entered), and None, which drops
    the count, comes only under a cutoff no 1F1B or ZB-H1 plan beats (brute force); a cutoff far enough below the
    optimum is ruled out by the bounds alone."""
    layering, count, costs = priced
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    sizes, budget = [a * b for a, b in SUBMESHES], math.inf
    onef1b = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, ("1f1b",), Stats())[0].total
    optimum = min(onef1b, brute_force(pipe, layering, costs, count, budget, devices))
    searched = []
    real = stagedp._threshold
    monkeypatch.setattr(stagedp, "_threshold", lambda *a, **k: searched.append(1) or real(*a, **k))
    dropped = []
    for cutoff in (optimum * 0.5, optimum * 0.9, optimum * 0.99, optimum * 1.001, optimum * 1.5):
        found = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, ("1f1b", "zero-bubble"), Stats(),
                               cutoff=cutoff, proven=False, bounds_only=True)
        if found is None:
            dropped.append(cutoff)
            assert optimum >= cutoff
        else:
            assert found[0].total >= optimum * (1 - 1e-12)  # a plan found, or a floor's infinite total
    assert not searched
    assert dropped and dropped[0] == optimum * 0.5 and optimum * 1.001 not in dropped


def _stopped_searches(priced, monkeypatch, binds: bool):
    """The priced table with ZB-H1's work limit at one inner DP (its searches stop short), its pipeline, submesh
    sizes and devices, and a budget under which the whole model on one device fits 3 microbatches (or none)."""
    monkeypatch.setattr(stagedp, "zero_bubble_limit", lambda t, devices: 1)
    layering, count, costs = priced
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    whole = totals(costs[((1, 1), (1, 1), "none")][0], pipe, 0, len(layering.groups) - 1, End((1, 1), (1, 1)))
    budget = whole.memory_bytes(3.5) if binds else math.inf
    return layering, count, costs, pipe, [a * b for a, b in SUBMESHES], CLUSTER.num_devices, budget


@pytest.mark.parametrize("binds", [False, True])
def test_a_stopped_search_is_no_slower_than_a_search_of_one_modes_rows(priced, monkeypatch, binds):
    """With ZB-H1's work limit at one inner DP the searches stop; `_Space.each_mode` then also searches each
    mode's rows alone (what `--recompute MODE` searches, every schedule) and returns a plan no slower than any of
    those searches nor than the whole table's, no faster than brute force's optimum over the whole table, and the whole table's
    floor; an exact result is returned as it is."""
    layering, count, costs, pipe, sizes, devices, budget = _stopped_searches(priced, monkeypatch, binds)
    space = _Space(GRAPH, CLUSTER, Options(), layering, budget, SUBMESHES, {})
    state = _Count(count, pipe, [], [], ["none", "full"], costs, ({}, {}, {}), None, [])
    found = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, Options().schedules, Stats())
    assert found[0].floor is not None  # stopped short of proving its plan optimal
    best = space.each_mode(state, found, state.modes, Stats())
    alone = [_best_schedule(pipe, {k: rows for k, rows in costs.items() if k[2] == mode}, SUBMESHES, sizes, devices,
                            count, budget, Options().schedules, Stats()) for mode in state.modes]
    assert best[0].total <= min([found[0].total, *(a[0].total for a in alone if a is not None)])
    assert best[0].total >= brute_force(pipe, layering, costs, count, budget, devices) * (1 - 1e-12)
    assert best[0].floor == (found[0].floor if found[0].floor < best[0].total else None)
    exact = replace(found[0], floor=None)
    assert space.each_mode(state, (exact, *found[1:]), state.modes, Stats())[0] is exact


@pytest.fixture(scope="module")
def zb_plan():
    graph = gpt(hidden=256, layers=8, heads=4, seq=64, vocab=512, batch=16, name="gpt-8")
    kwargs = dict(layers=None, microbatches=[4, 8], workers=1)
    return graph, {s: optimize(graph, CLUSTER, schedule=s, **kwargs) for s in ("auto", "1f1b", "zero-bubble")}


def test_a_zero_bubble_plan_round_trips_reprices_and_is_not_exported_to_megatron(zb_plan):
    """The plan found with zero-bubble forced: every stage holds min(S, B) microbatches, its iteration is the
    ZB-H1 closed form of its own stage figures, it reads back from its file unchanged, `partopt check`
    (evaluate's pricing of its stages) finds the same figures, and `export --to megatron` refuses it."""
    graph, plans = zb_plan
    plan = plans["zero-bubble"]
    S, B = len(plan.stages), plan.num_microbatches
    assert plan.schedule == "zero-bubble" and plan.virtual_stages == 1 and S >= 2
    assert [s.inflight_microbatches for s in plan.stages] == [min(S, B)] * S
    times, forwards = [s.stage_time_s for s in plan.stages], [s.forward_s for s in plan.stages]
    hidden = min(min(s.weight_s, s.forward_s, s.stage_time_s - s.forward_s - s.weight_s) for s in plan.stages)
    expected = sum(times) + (B - 1) * max(times) - (S + min(S, B) - 2) * hidden + max(s.sync_time_s for s in plan.stages)
    assert plan.iteration_time_s == pytest.approx(expected, rel=1e-12)
    assert plan.iteration_time_s < plans["1f1b"].iteration_time_s
    again = plan_from_dict(json.loads(json.dumps(plan_to_dict(plan))))
    assert plan_to_dict(again) == plan_to_dict(plan)
    check_plan(again)
    assert differences(again, graph, CLUSTER) == []
    with pytest.raises(export.NotExpressibleError, match="zero-bubble"):
        export.to_megatron(again)
    assert not any("zero-bubble" in r for r in plan.solver["search"])


def test_auto_is_never_worse_than_zero_bubble_forced(zb_plan):
    _, plans = zb_plan
    assert plans["auto"].iteration_time_s <= min(plans["zero-bubble"].iteration_time_s, plans["1f1b"].iteration_time_s)


def test_solve_plans_zero_bubble_from_the_cli(tmp_path):
    graph_file, plan_file = tmp_path / "g.json", tmp_path / "p.json"
    io.write_graph(GRAPH, str(graph_file))
    result = CliRunner().invoke(main, ["solve", str(graph_file), "--cluster", "p3.16xlarge", "--nodes", "1",
                                       "--schedule", "zero-bubble", "--microbatches", "4", "-o", str(plan_file)])
    assert result.exit_code == 0, result.output
    assert json.loads(plan_file.read_text())["schedule"] == "zero-bubble"
    result = CliRunner().invoke(main, ["export", str(plan_file), "--to", "megatron"])
    assert result.exit_code == 2 and "zero-bubble" in result.output and "Traceback" not in result.output


def test_the_alpa_reproduction_keeps_1f1b():
    """Alpa ran 1F1B: the reproduction's options pin it, whatever the search's default."""
    for model in ("gpt", "moe", "wresnet"):
        assert alpa.model_options(model)["schedule"] == "1f1b"


def test_the_work_limit_binds_only_on_large_tables():
    """1.5·10¹⁰ cells: GPT-1T's table (64 DP layers, 12 submeshes, 3,072 devices) gets 1.5e10 / (64² · 3072 · 12) =
    99.3 → 99 inner DPs; the tiny GPT's (4 layers, 3 submeshes, 4 devices) over a million, so its searches
    stay exact and its plans carry no lower bound."""
    assert stagedp.zero_bubble_limit(np.empty((1, 2, 64, 64, 12)), 3072) == 99
    assert stagedp.zero_bubble_limit(np.empty((1, 2, 4, 4, 3)), 4) == 1.5e10 // (4 * 4 * 4 * 3)
    plan = optimize(GRAPH, CLUSTER, workers=1, microbatches=[4], schedule="zero-bubble")
    assert "lower_bound_s" not in plan.solver and "bound_gap" not in plan.solver


@pytest.mark.parametrize("binds", [False, True])
def test_a_cutoff_keeps_what_a_stopped_search_proves(priced, monkeypatch, binds):
    """Under a cutoff (the best plan of another count) `_best_schedule` returns a plan under it, or None, or — when
    a search stopped at its work limit with a floor under the cutoff — a result of no stages carrying that floor,
    so that the solve's reported lower bound still counts the count; every floor is a lower bound (brute force)."""
    layering, count, costs, pipe, sizes, devices, budget = _stopped_searches(priced, monkeypatch, binds)
    optimum = brute_force(pipe, layering, costs, count, budget, devices)
    free = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, Options().schedules, Stats())
    kinds = set()
    for cutoff in (optimum * 0.9, optimum, optimum * 1.001, free[0].total * 1.01):
        found = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, Options().schedules, Stats(),
                               cutoff=cutoff)
        if found is None:
            kinds.add("none")
            continue
        if found[0].stages:
            kinds.add("plan")
            assert optimum * (1 - 1e-12) <= found[0].total < cutoff
        else:
            kinds.add("floor")
            assert found[0].total == math.inf and found[0].floor < cutoff
        assert found[0].floor is None or found[0].floor <= optimum * (1 + 1e-12)
    assert kinds == {"plan", "none", "floor"}  # each outcome seen here
