"""Whether memory binds for a count is decided by DPs that look no higher than its memory-free plan
(`inter._unbound`): a slower plan that fits only says that it binds, so the searches that could
only find such stop at once. Checked against the search whose DPs look under the best plan alone."""

import math

import pytest

from partopt import inter, stagedp
from partopt.inter import optimize
from partopt.models.gpt import gpt

from test_ladder import four_devices


def dp_result(total: float, floor: float | None = None):
    return stagedp.DPResult(total, [], total, 0, floor), "1f1b", 1, {}


def assert_same_plan(plan, other) -> None:
    """The two plans have one iteration time, schedule and stages (layers, submesh, logical mesh)."""
    assert plan.iteration_time_s == pytest.approx(other.iteration_time_s, rel=1e-12)
    assert plan.schedule == other.schedule
    assert [(s.layers, s.submesh, s.logical_mesh) for s in plan.stages] == \
        [(s.layers, s.submesh, s.logical_mesh) for s in other.stages]


@pytest.mark.parametrize("free_total", [1.0, 3.7e-3, 123.456])
def test_the_cutoff_keeps_exactly_the_plans_with_which_memory_does_not_bind(free_total):
    free = dp_result(free_total)
    cutoff = inter._unbound_cutoff(free)
    for total in [free_total, free_total * (1 + 1e-12), cutoff, math.nextafter(cutoff, -math.inf),
                  free_total * (1 + 2e-12)]:
        assert (total < cutoff) == (not inter._binds(dp_result(total), free))
    # a search stopped at its work limit stands for its floor: a plan at its total binds
    stopped = dp_result(free_total, floor=free_total / 2)
    assert inter._binds(dp_result(free_total), stopped)
    assert inter._unbound_cutoff(stopped) < free_total


@pytest.mark.parametrize("mib", [80, 100])
def test_the_plan_is_the_one_of_dps_that_look_under_the_best_plan_alone(mib, monkeypatch):
    """A small GPT on four devices of 80 or 100 MiB: memory binds at 4, 8 and 16 microbatches, and ZB-H1 is
    searched. At 100 MiB the closing count's ZB-H1 plan (4.790 ms) lies between its memory-free plan and the
    1F1B plan that fits (4.942 ms); a DP told to look under the first and asked again under the best plan must
    search again, not keep the 1F1B plan it fell back on (the DPs' cache)."""
    graph = gpt(hidden=256, layers=8, heads=8, seq=256, vocab=2048, batch=32)
    cluster = four_devices(mib)
    plan = optimize(graph, cluster, workers=1)
    monkeypatch.setattr(inter, "_unbound_cutoff", lambda free: math.inf)  # the DPs look under the best plan alone
    under_best = optimize(graph, cluster, workers=1)
    assert_same_plan(plan, under_best)
