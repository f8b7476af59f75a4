"""A count ruled out before its memory ladder (`inter._relaxed_may_win`): the stage DPs on rows that no option's rows
undercut (`bounds.undercut`), built from each layer's least time per microbatch (`intra._time_floor`), the most its
sync can be (`intra.StageModel.sync_bound_s`) and its memory over all devices, with ZB-H1 asked for its bounds
alone (`stagedp.zero_bubble_may_beat`). Each piece against brute force, every row priced, or the search that rules
nothing out."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from partopt import inter, intra, stagedp
from partopt.cluster import preset
from partopt.errors import InfeasibleError
from partopt.inter import optimize
from partopt.io import read_graph
from partopt.models.gpt import gpt

from test_memory_binds import assert_same_plan
from test_zero_bubble_search import brute_table, random_cases


def _totals(model: intra.StageModel) -> np.ndarray:
    """The cost graph's total for every assignment, in `itertools.product` order."""
    g = model.costs
    return np.array([g.total(list(choice)) for choice in itertools.product(*(range(len(c)) for c in g.costs))])


@pytest.mark.parametrize("shape, recompute", [((1, 2), "none"), ((2, 1), "full")])
def test_the_time_floor_and_sync_bound_hold_every_assignment(shape, recompute):
    """A two-layer MLP on two devices (62,208 assignments): priced at B and 2B microbatches, an assignment costs
    time + sync / B and time + sync / 2B, which give its time and its sync. The floor is the least time of any
    assignment; the sync bound is at least the most sync of any; the optimum decodes to no less time."""
    graph = read_graph("instances/mlp-2layer.json")
    B = 4
    view = intra.with_batch(graph, graph.dims[graph.batch_dim] // B)
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 2), shape)
    at_b, at_2b = (intra.build(view, mesh, None, n, 1, recompute=recompute, prefetch=True) for n in (B, 2 * B))
    total_b, total_2b = _totals(at_b), _totals(at_2b)
    time_s, sync_s = 2 * total_2b - total_b, 2 * B * (total_b - total_2b)
    assert sync_s.max() > 0 and time_s.min() > 0
    floor = intra._time_floor(at_b)
    assert floor == pytest.approx(time_s.min(), rel=1e-9) and floor <= time_s.min()
    assert at_b.sync_bound_s >= sync_s.max() * (1 - 1e-12)
    sharding = intra.shard_stage(view, mesh, microbatches=B, recompute=recompute, prefetch=True, time_floor=True)
    assert sharding.time_floor_s == floor
    assert sharding.breakdown.per_microbatch_s >= floor
    assert sharding.breakdown.per_iteration_s <= at_b.sync_bound_s * (1 + 1e-12)


def _rescaled(entries: stagedp.Entries, omega: np.ndarray, factor: np.ndarray, depth: np.ndarray):
    """A table every entry of which is `factor` (≥ 1) times as slow, its omega the same share of its latency, with
    the given depths (no deeper): a table the first one undercuts."""
    latency = np.where(depth >= 1, entries.latency * factor, np.inf)
    share = np.where(np.isfinite(entries.latency) & (entries.latency > 0), omega / entries.latency, 0.0)
    return stagedp.Entries(latency, np.where(depth >= 1, entries.sync, 0.0), depth), share * np.where(
        np.isfinite(latency), latency, 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_zero_bubble_bounds_never_rule_out_a_plan_of_a_slower_table(seed):
    """Random tables: a slower table (each entry up to twice the latency, its omega the same share of it, a sync, no
    deeper) whose ZB-H1 optimum (brute force) beats a cutoff is never ruled out on the faster one with no sync; nor is
    the faster table's own optimum. No plan costs 0."""
    rng = np.random.default_rng(seed)
    checked = 0
    for entries, t, extra, omega, sizes, devices, B in random_cases(seed):
        fast = stagedp.Entries(entries.latency, np.zeros_like(entries.sync), entries.depth)
        own = brute_table(*fast.dense(), omega, sizes, devices, B)
        depth = np.minimum(entries.depth, rng.integers(0, entries.layers + 1, entries.depth.shape))
        slow, slow_omega = _rescaled(entries, omega, rng.uniform(1.0, 2.0, entries.latency.shape), depth)
        expected = brute_table(*slow.dense(), slow_omega, sizes, devices, B)
        for target in (own, expected):
            if math.isfinite(target):
                checked += 1
                assert stagedp.zero_bubble_may_beat(fast, omega, sizes, devices, B, target * (1 + 1e-9))
        assert not stagedp.zero_bubble_may_beat(fast, omega, sizes, devices, B, 0.0)
    assert checked


def _devices(count: int, mib: int):
    """One p3.16xlarge node cut to `count` devices of `mib` MiB."""
    cluster = preset("p3.16xlarge", 1).narrowed(count)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=mib * 2**20))


@pytest.mark.parametrize("devices, mib, batch, layers", [(8, 50, 128, 8), (8, 60, 128, 12), (4, 50, 32, 8)])
def test_a_count_ruled_out_has_no_plan_under_the_best_and_the_plan_stays(devices, mib, batch, layers, monkeypatch):
    """Small GPTs whose memory binds: every count asked before its ladder has, when its own search (nothing ruled
    out) finds a plan, its relaxed DPs find one under that plan's time. The search gives the plan of the search that
    rules nothing out, with no more ILPs (on eight devices some counts are ruled out: 8 microbatches of the first,
    8 and 4 of the second)."""
    graph = gpt(hidden=256, layers=layers, heads=8, seq=256, vocab=2048, batch=batch)
    cluster = _devices(devices, mib)
    asked, relaxed = [], inter._relaxed_may_win

    def recording(space, count, pipe, rows, limit):
        found = relaxed(space, count, pipe, rows, limit)
        asked.append((space, count, pipe, rows, found))
        return found

    monkeypatch.setattr(inter, "_relaxed_may_win", recording)
    plan = optimize(graph, cluster, workers=1)
    monkeypatch.setattr(inter, "_relaxed_may_win", lambda *args: True)
    full = optimize(graph, cluster, workers=1)
    assert_same_plan(plan, full)
    ruled_out = [count for _, count, *_, found in asked if not found]
    assert bool(ruled_out) == (devices == 8)
    assert plan.solver["ilps"] <= full.solver["ilps"]
    for space, count, pipe, rows, _ in asked:
        try:
            alone = optimize(graph, cluster, workers=1, microbatches=[count]).iteration_time_s
        except InfeasibleError:  # the count has no plan that fits
            continue
        assert relaxed(space, count, pipe, rows, alone * (1 + 1e-9))


def test_no_row_of_an_option_undercuts_its_relaxed_row(monkeypatch):
    """A small GPT on eight devices whose memory binds: after the search, every row of every option of each count
    closed (its first, its other modes', its memory ladder's) takes at least the time per microbatch of the option's
    row in `_undercut_rows` and of its row at the rooflines (`_roofline_rows`), and holds at least their parameter
    and kept activation bytes."""
    graph = gpt(hidden=256, layers=16, heads=8, seq=256, vocab=2048, batch=256)
    closed, close = [], inter._close_count

    def recording(space, pricer, state, best, stats, running):
        found = close(space, pricer, state, best, stats, running)
        view = intra.with_batch(graph, graph.dims[graph.batch_dim] // state.count)
        closed.append((space, state, view, [[view.op_index[name] for name in names] for names in state.names]))
        return found

    monkeypatch.setattr(inter, "_close_count", recording)
    monkeypatch.setattr(inter, "_relaxed_may_win", lambda *args: True)  # every close runs its modes and ladder
    optimize(graph, _devices(8, 60), workers=1)
    compared = 0
    for space, state, view, ops in closed:
        undercut = inter._undercut_rows(space, state, view, ops)
        roofline = inter._roofline_rows(space, state.count, view, ops, state.work)
        for option, rows in state.costs.items():
            for row in rows:
                for cost, low, least in zip(row, undercut[option][0], roofline[option][0]):
                    if cost is None:
                        continue
                    compared += 1
                    for bound in (low, least):
                        assert bound.time_s <= cost.time_s * (1 + 1e-9)
                        assert bound.param_bytes <= cost.param_bytes * (1 + 1e-9)
                        assert bound.activation_bytes <= cost.activation_bytes * (1 + 1e-9)
    assert compared > 1000 and any(len(rows) > 1 for _, state, *_ in closed for rows in state.costs.values())
