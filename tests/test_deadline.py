"""A search stopped early (`deadline_s`, Ctrl-C) returns its best plan so far, marked, with a proven
lower bound; with no plan yet it says so. The interruptions are injected at the pricing service."""

import pytest
from test_intra import FAST, PEAK, mlp

from partopt.cluster import Cluster, Link
from partopt.errors import PartoptError
from partopt.inter import optimize
from partopt.pricing import Expired, Pricer

N = 2
CLUSTER = Cluster("row", 1, N, FAST, Link(10e9, 0.0), Link(10e9, 0.0))


def stop_on_call(monkeypatch, calls: int, error: type[BaseException]) -> None:
    """Make the pricing service raise `error` at its `calls`-th call (1-based)."""
    run, seen = Pricer.run, []

    def counted(self, *args, **kwargs):
        seen.append(1)
        if len(seen) == calls:
            raise error
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Pricer, "run", counted)


@pytest.mark.parametrize("error, stopped", [(Expired, "deadline"), (KeyboardInterrupt, "interrupted")])
def test_a_search_stopped_after_one_microbatch_count_returns_that_plan_with_its_bound(monkeypatch, error, stopped):
    graph = mlp(2, 64, 256)
    full = optimize(graph, CLUSTER, microbatches=[1, 2, 4], workers=1, recompute="none")
    stop_on_call(monkeypatch, 2, error)  # the first count is priced (one mode, nothing to tighten), then it stops
    plan = optimize(graph, CLUSTER, microbatches=[1, 2, 4], workers=1, recompute="none")
    assert plan.solver["stopped"] == stopped
    assert plan.iteration_time_s >= full.iteration_time_s * (1 - 1e-12)
    # every unfinished count's bound is the whole batch's training FLOPs spread over the devices at peak
    # (the device moves bytes instantly): 3 · 2 · b · h² per GEMM, two GEMMs
    bound = 2 * 3 * 2 * 64 * 256 * 256 / PEAK / N
    assert plan.solver["lower_bound_s"] == pytest.approx(min(bound, plan.iteration_time_s), rel=1e-9)
    assert plan.solver["bound_gap"] == pytest.approx(1 - plan.solver["lower_bound_s"] / plan.iteration_time_s)
    assert "stopped" not in full.solver


def test_a_deadline_before_any_plan_is_an_error_and_ctrl_c_before_any_plan_propagates(monkeypatch):
    graph = mlp(2, 64, 256)
    stop_on_call(monkeypatch, 1, Expired)
    with pytest.raises(PartoptError, match="no plan found within the deadline of 5 s"):
        optimize(graph, CLUSTER, microbatches=[1, 2], workers=1, deadline_s=5)
    monkeypatch.undo()
    stop_on_call(monkeypatch, 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        optimize(graph, CLUSTER, microbatches=[1, 2], workers=1)


def test_a_real_deadline_of_zero_is_refused_and_a_generous_one_changes_nothing():
    graph = mlp(2, 64, 256)
    with pytest.raises(PartoptError, match="not a positive number"):
        optimize(graph, CLUSTER, microbatches=1, deadline_s=0)
    plan = optimize(graph, CLUSTER, microbatches=[1, 2], workers=1, deadline_s=3600)
    assert "stopped" not in plan.solver
    assert plan.iteration_time_s == optimize(graph, CLUSTER, microbatches=[1, 2], workers=1).iteration_time_s
