"""A count opened once a plan is known looks for its memory-free plan only under that plan (`inter._open_count`):
the memory-free plan bounds every option of the count, so when none is under the best the count is dropped there.
Checked against the search whose memory-free DPs look with no cutoff."""

import math

import pytest

from partopt import inter
from partopt.inter import optimize
from partopt.models.gpt import gpt

from test_ladder import four_devices


@pytest.mark.parametrize("mib", [140, 200])
def test_counts_opened_under_a_plan_they_cannot_beat_are_dropped_and_the_plan_stays(mib, monkeypatch):
    """A small GPT on four devices: the first count opened fits, and some opened after it cannot beat it even with
    memory ignored. Their memory-free DPs stop under the plan and the counts go unclosed; the plan is the one of
    the search whose memory-free DPs run to the end."""
    graph = gpt(hidden=256, layers=8, heads=8, seq=256, vocab=2048, batch=32)
    cluster = four_devices(mib)
    opened, open_count = [], inter._open_count

    def recording(space, pricer, count, g_mb, base_ops, work, best, *rest):
        state = open_count(space, pricer, count, g_mb, base_ops, work, best, *rest)
        opened.append((count, best is not None, state is None))
        return state

    monkeypatch.setattr(inter, "_open_count", recording)
    plan = optimize(graph, cluster, workers=1)
    assert any(after_best and dropped for _, after_best, dropped in opened)
    assert not any(dropped and not after_best for _, after_best, dropped in opened)

    best = inter._Space.best

    def uncut(self, pipe, costs, count, budget, stats, schedules=None, cutoff=math.inf):
        return best(self, pipe, costs, count, budget, stats, schedules, cutoff if budget < math.inf else math.inf)

    monkeypatch.setattr(inter._Space, "best", uncut)  # memory-free DPs with no cutoff
    full = optimize(graph, cluster, workers=1)
    assert plan.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert plan.schedule == full.schedule
    assert [(s.layers, s.submesh, s.logical_mesh) for s in plan.stages] == \
        [(s.layers, s.submesh, s.logical_mesh) for s in full.stages]
