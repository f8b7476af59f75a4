"""One ladder of memory-lean caps for the stage DP and `evaluate` (`pricing.RUNGS`, `rung`, `ladder`)."""

import dataclasses

import pytest

from partopt import costmodel
from partopt.cluster import preset
from partopt.errors import InfeasibleError
from partopt.evaluate import price as price_plan
from partopt.evaluate import uniform
from partopt.inter import Options, optimize
from partopt.layering import build_layers
from partopt.models.gpt import gpt as gpt_model
from partopt.pricing import RUNGS, Job, ladder, price, rung
from partopt.stages import StageSpec

from test_intra import mlp

SETTINGS = {"recompute": "none", "overlap": False, "schedule": "1f1b"}


def test_a_stage_takes_the_smallest_rung_that_holds_its_layers():
    assert [rung(n) for n in (1, 2, 6, 16, 17, 20, 21, 57, 64)] == [1, 2, 6, 16, 20, 20, 24, 64, 64]
    assert rung(65) == 65  # past the last rung, its own even share
    assert all(rung(n) / n <= 1.25 for n in range(2, RUNGS[-1] + 1))  # a stage's share is at most 1.25 times too tight
    assert ladder(6) == [6, 5, 4, 3, 2, 1]  # the even share, then each looser rung down to the whole budget
    assert ladder(20) == [20, *range(16, 0, -1)]
    assert ladder(1) == [1]


def four_devices(mib: int):
    cluster = preset("p3.16xlarge", 1).narrowed(4)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=mib * 2**20))


@pytest.mark.parametrize("mib", [28, 32])
def test_the_dp_finds_the_one_stage_plans_evaluate_fits(mib):
    """Six fc layers of 1024² fp32 weights on 4 devices of 28 or 32 MiB: one stage of all six needs each
    layer within about budget / 6. The power-of-two ladder gave such a stage budget / 8, which no layer
    fits, or budget / 4, which lets the six overflow together: intra-op only found no plan while `evaluate`
    fitted the stage. On one ladder the DP has the rows `evaluate` fits (a single stage holds one microbatch,
    as the DP's rung assumes), so its plan is at most evaluate's fitted stage on every logical shape."""
    graph, cluster = mlp(6, 64, 1024), four_devices(mib)
    options = Options(layers=None, **SETTINGS)
    budget = costmodel.memory_budget(cluster.device, options.memory_reserve)
    shapes = cluster.logical_shapes((1, 4))
    for shape in shapes:
        mesh = cluster.logical_mesh((1, 4), shape)
        assert all(price(graph, Job(64, 1, (name,), mesh, "none", budget / 8, 1, None, 8), options) is None
                   for name in ("fc0", "fc1", "fc5"))
    plan = optimize(graph, cluster, microbatches=1, intra_only=True, **SETTINGS)
    layering = build_layers(graph, None)
    fitted = []
    for shape in shapes:
        try:
            fitted.append(price_plan(graph, cluster, layering, 1, [StageSpec(0, 5, (1, 4), shape, 1, "none")], None,
                                     options, fit_memory=True))
        except InfeasibleError:
            continue
    assert fitted and plan.iteration_time_s <= min(p.iteration_time_s for p in fitted) * (1 + 1e-12)
    assert plan.stages[0].memory_bytes <= budget


def test_the_dp_prices_a_stage_as_evaluate_does_where_memory_does_not_bind():
    """With room to spare the DP's single stage is evaluate's stage at its layers' fastest shardings, on every
    logical shape. (Before the structural hash told where an output goes, the last fc — whose output leaves
    the graph, so its input arrives in the canonical layout — shared its solution with the middle ones.)"""
    graph, cluster = mlp(6, 64, 1024), four_devices(160)
    layering = build_layers(graph, None)
    for shape in cluster.logical_shapes((1, 4)):
        plan = optimize(graph, cluster, microbatches=1, intra_only=True, logical_shapes=[shape], **SETTINGS)
        alone = price_plan(graph, cluster, layering, 1, [StageSpec(0, 5, (1, 4), shape, 1, "none")], None,
                           Options(layers=None, **SETTINGS))
        assert plan.iteration_time_s == pytest.approx(alone.iteration_time_s, rel=1e-12)


def test_evaluate_refits_the_layers_that_took_a_looser_rung_when_together_they_overflow():
    """SC'21 Fig. 13's 162B at tp 2 × pp 32 (one block per stage; stage 0 adds the embedding): the block
    fits no cap tighter than the whole budget, and there it chose replicated weights that leave no room
    for the embedding beside it (78.5 GiB against 72). The layers past their even share are refitted to
    what the others leave, so the plan fits: its stage 0 holds at least its sharded parameter state by
    hand (16 bytes per parameter of the embedding and one block, over tp) and at most the budget."""
    h, vocab = 20480, 51200
    graph = gpt_model(hidden=h, layers=32, heads=128, seq=2048, vocab=vocab, batch=128)
    cluster = preset("dgx-a100", 8)
    plan = uniform(graph, cluster, 2, 32, 1, 128, recompute="full", overlap=False)
    budget = costmodel.memory_budget(cluster.device, Options(layers=None).memory_reserve)
    stage = plan.stages[0]
    assert stage.breakdown["param_bytes"] >= 16 * (vocab * h + 12 * h * h) / 2 * (1 - 1e-3)
    assert max(s.memory_bytes for s in plan.stages) <= budget


def test_a_capped_layer_takes_its_memory_free_optimum_from_its_first_pricing(monkeypatch):
    """Each memory-capped job of the ladder carries the memory-free optimum its layer's first pricing found
    (`Job.free`, so `ilp.solve` does not solve it again), and the plan is the one found when every capped job
    solves it itself."""
    from partopt import pricing

    graph, cluster = mlp(6, 64, 1024), four_devices(28)
    jobs, price_one, with_cap = [], pricing.price, pricing._with_cap

    def recording(g_mb, job, options):
        jobs.append(job)
        return price_one(g_mb, job, options)

    monkeypatch.setattr(pricing, "price", recording)
    plan = optimize(graph, cluster, microbatches=1, intra_only=True, workers=1, **SETTINGS)
    capped = [job for job in jobs if job.share > 1]
    assert capped and all(job.free is not None for job in capped)

    monkeypatch.setattr(pricing, "_with_cap", lambda job, cap, inflight, share, cutoff, priced:
                        with_cap(job, cap, inflight, share, cutoff))
    jobs.clear()
    again = optimize(graph, cluster, microbatches=1, intra_only=True, workers=1, **SETTINGS)
    assert [job.free for job in jobs if job.share > 1] == [None] * len(capped)
    assert again.iteration_time_s == plan.iteration_time_s
    assert [s.memory_bytes for s in again.stages] == [s.memory_bytes for s in plan.stages]
