"""How a count is opened (`inter._open_count`, `_memory_free`, `_may_open`): once a plan is known, its memory-free
plan is looked for only under that plan, and the count is dropped when none is; before, ZB-H1's memory-free search
waits while the other schedules' plan does not fit; a count whose floors and memory cannot beat a bar is not opened
under it. Each is checked against the search that opens every count in full."""

import math

import pytest

from partopt import inter
from partopt.inter import optimize
from partopt.models.gpt import gpt

from test_ladder import four_devices
from test_memory_binds import assert_same_plan, dp_result


@pytest.mark.parametrize("mib", [140, 200])
def test_counts_opened_under_a_plan_they_cannot_beat_are_dropped_and_the_plan_stays(mib, monkeypatch):
    """A small GPT on four devices: the first count opened fits, and some opened after it cannot beat it even with
    memory ignored. Their memory-free DPs stop under the plan and the counts go unclosed (listed as priced); the
    plan is the one of the search whose memory-free DPs run to the end."""
    graph = gpt(hidden=256, layers=8, heads=8, seq=256, vocab=2048, batch=32)
    cluster = four_devices(mib)
    opened, open_count = [], inter._open_count

    def recording(space, pricer, count, g_mb, base_ops, work, best, *rest):
        state = open_count(space, pricer, count, g_mb, base_ops, work, best, *rest)
        opened.append((count, best is not None, state is not None and state.free is None))
        return state

    monkeypatch.setattr(inter, "_open_count", recording)
    plan = optimize(graph, cluster, workers=1)
    dropped = [count for count, after_best, none in opened if none]
    assert dropped and all(after_best for _, after_best, none in opened if none)
    assert set(dropped) <= set(plan.solver["microbatch_counts"])

    best = inter._Space.best

    def uncut(self, pipe, costs, count, budget, stats, schedules=None, cutoff=math.inf):
        return best(self, pipe, costs, count, budget, stats, schedules, cutoff if budget < math.inf else math.inf)

    monkeypatch.setattr(inter._Space, "best", uncut)  # memory-free DPs with no cutoff
    full = optimize(graph, cluster, workers=1)
    assert_same_plan(plan, full)


def _in_full(space, state, best, stats):
    """`inter._memory_free` with nothing deferred and no cutoff: the memory-free plan of every schedule."""
    return space.best(state.pipe, state.costs, state.count, math.inf, stats), False


@pytest.mark.parametrize("mib, batch", [(60, 32), (70, 32), (80, 64), (90, 64), (160, 64)])
def test_a_deferred_zero_bubble_search_gives_the_plan_of_the_full_open(mib, batch, monkeypatch):
    """A small GPT on four devices whose first counts do not fit memory-free: their ZB-H1 searches wait (at 70 MiB
    and at 90 MiB with 64 sequences the plan is ZB-H1's, found when a plan that fits lands between the bound and the other schedules' plan). The
    plan is the one of the search that opens every count in full."""
    graph = gpt(hidden=256, layers=8, heads=8, seq=256, vocab=2048, batch=batch)
    cluster = four_devices(mib)
    deferred, memory_free = [], inter._memory_free

    def recording(space, state, best, stats):
        free, later = memory_free(space, state, best, stats)
        deferred.append(later)
        return free, later

    monkeypatch.setattr(inter, "_memory_free", recording)
    plan = optimize(graph, cluster, workers=1)
    assert any(deferred)
    monkeypatch.setattr(inter, "_memory_free", _in_full)
    full = optimize(graph, cluster, workers=1)
    assert_same_plan(plan, full)


@pytest.mark.parametrize("mib, batch", [(150, 32), (90, 64), (140, 32), (120, 64)])
def test_a_count_judged_before_its_ilps_has_no_plan_under_its_bar_and_the_plan_stays(mib, batch, monkeypatch):
    """A small GPT on four devices: some counts are judged, before any of their ILPs, unable to cost at most the
    best plan or a waiting count's rank (`inter._may_open`: their layers' floors and memory), and are dropped or
    closed later. The search of each such count alone finds no plan under that bar, and the plan is the one of the
    search that opens every count and prices every mode and memory rung on every mesh, with fewer ILPs."""
    graph = gpt(hidden=256, layers=8, heads=8, seq=256, vocab=2048, batch=batch)
    cluster = four_devices(mib)
    judged, may_open = [], inter._may_open

    def recording(space, count, *rest):
        opens = may_open(space, count, *rest)
        if not opens:
            judged.append((count, rest[-1]))
        return opens

    monkeypatch.setattr(inter, "_may_open", recording)
    plan = optimize(graph, cluster, workers=1)
    assert judged
    for count, bar in judged:
        alone = optimize(graph, cluster, workers=1, microbatches=count)
        assert "bound_gap" not in alone.solver and alone.iteration_time_s > bar

    monkeypatch.setattr(inter, "_may_open", lambda space, *args: list(space.meshes))
    monkeypatch.setattr(inter, "_reach", _every_stage)
    full = optimize(graph, cluster, workers=1)
    assert_same_plan(plan, full)
    assert plan.solver["ilps"] < full.solver["ilps"]


def _every_stage(space, g_mb, ops, modes, count, work, limit, priced, open_meshes):
    """`inter._reach` ruling nothing out: every option priced or open."""
    return {*priced, *((*key, mode) for key in open_meshes for mode in modes)}


class _Answers:
    """A search space whose stage DPs answer with given plans: `fitting` with memory counted, `memory_free`
    without; each only when under the cutoff."""

    budget = 1.0

    def __init__(self, fitting, memory_free):
        self.fitting, self.memory_free = fitting, memory_free

    def best(self, pipe, costs, count, budget, stats, schedules=None, cutoff=math.inf):
        found = self.fitting if budget < math.inf else self.memory_free
        return found if found is not None and found[0].total < cutoff else None


@pytest.mark.parametrize("fitting, zero_bubble, binds", [
    (9.5, 9.2, True),  # a memory-free ZB-H1 plan is faster than the plan that fits
    (9.5, 9.8, False),  # none is: the plan that fits is the memory-free optimum
    (9.5, None, False),
    (10.0, None, False),  # the other schedules' plan itself fits
    (10.5, 9.2, True),  # slower than the other schedules' memory-free plan
    (None, 9.2, True),  # nothing fits
])
def test_with_zero_bubble_deferred_memory_binds_only_when_a_memory_free_plan_is_faster(fitting, zero_bubble, binds):
    """The other schedules' memory-free plan takes 10 s and ZB-H1 could save down to 9 s: a plan that fits within
    them stands unless the ZB-H1 search, run then, finds a memory-free plan faster than it."""
    state = inter._Count(64, None, [], [], ["none"], {}, ({}, {}, {}), None, [], free=dp_result(10.0, floor=9.0),
                         deferred=True)
    space = _Answers(None if fitting is None else dp_result(fitting),
                     None if zero_bubble is None else dp_result(zero_bubble))
    found = inter._unbound(space, state, inter.Stats(), math.inf)
    assert found is None if binds else found[0].total == fitting


@pytest.mark.parametrize("mib, batch, layers", [(50, 32, 8), (60, 64, 12), (100, 64, 12), (180, 64, 16)])
def test_a_count_opened_under_a_waiting_rank_is_widened_when_the_plan_lands_above_it(mib, batch, layers, monkeypatch):
    """A small GPT on four devices: before any plan is known, a count is opened only on the meshes that may hold a
    stage of a plan under the least rank of the counts waiting (`inter._may_open`). A rank is not a bound (a deferred
    count's is its other schedules' plan), and here the plan lands above it: the meshes left out are priced before
    the count is finished or closed (`_Count.limit`). The plan is the one of the search that opens every count on
    every mesh, with fewer ILPs."""
    graph = gpt(hidden=256, layers=layers, heads=8, seq=256, vocab=2048, batch=batch)
    cluster = four_devices(mib)
    opened, open_count = [], inter._open_count

    def recording(space, pricer, count, g_mb, base_ops, work, best, *rest):
        state = open_count(space, pricer, count, g_mb, base_ops, work, best, *rest)
        if state is not None and best is None and len(state.keys) < len(space.meshes):
            opened.append((state, len(state.keys), state.limit))  # opened under a rank
        return state

    monkeypatch.setattr(inter, "_open_count", recording)
    plan = optimize(graph, cluster, workers=1)
    assert any(limit < plan.iteration_time_s and len(state.keys) > keys for state, keys, limit in opened)

    monkeypatch.setattr(inter, "_open_count", open_count)
    monkeypatch.setattr(inter, "_may_open", lambda space, *args: list(space.meshes))
    monkeypatch.setattr(inter, "_reach", _every_stage)
    full = optimize(graph, cluster, workers=1)
    assert_same_plan(plan, full)
    assert plan.solver["ilps"] < full.solver["ilps"]
