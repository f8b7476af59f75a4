"""Pipeline schedules as a choice of the search (issue 13 items 2, 6, 8): the interleaved table is the stage
accountant, the search over cuts × submeshes × options × schedule is exact (brute force on a tiny GPT), auto is
never worse than a forced schedule, and plans, `evaluate --virtual-stages`, checks and exports carry the schedule."""

from __future__ import annotations

import importlib
import itertools
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from partopt import costmodel, io, stagedp
from partopt.assemble import pipeline_of
from partopt.check import differences
from partopt.cli import main
from partopt.cluster import preset
from partopt.errors import InstanceError
from partopt.evaluate import uniform
from partopt.inter import _best_schedule, optimize
from partopt.layering import build_layers
from partopt.models import gpt
from partopt.options import Options
from partopt.plan import plan_from_dict, plan_to_dict
from partopt.pricing import Job, Pricer, Stats
from partopt.schedules import inflight, interleaved_shapes, iteration_time
from partopt.stages import End, chunks, combined, interleaved_table, totals
from partopt.validate import check_plan

export = importlib.import_module("partopt.export")

GRAPH = gpt(hidden=64, layers=4, heads=4, seq=32, vocab=128, batch=8, name="tiny-gpt")
CLUSTER = preset("p3.16xlarge", 1)
SUBMESHES = [(1, 1), (1, 2), (1, 4)]


@pytest.fixture(scope="module")
def priced():
    """The tiny GPT's layers priced on (1, 1), (1, 2), (1, 4) submeshes, one logical shape each (and a second,
    data-parallel one on (1, 2)): the cost rows the search's tables are built from."""
    layering, count = build_layers(GRAPH, None), 4
    budget = costmodel.memory_budget(CLUSTER.device)
    costs = {}
    with Pricer(GRAPH, Options(workers=1)) as pricer:
        for sub, shape in [((1, 1), (1, 1)), ((1, 2), (1, 2)), ((1, 2), (2, 1)), ((1, 4), (1, 4))]:
            mesh = CLUSTER.logical_mesh(sub, shape)
            costs[(sub, shape, "none")] = [[pricer.one(Job(GRAPH.dims["b"] // count, count, tuple(op.name for op in ops),
                                                            mesh, "none", budget), Stats()) for ops in layering.base]]
    return layering, count, costs


def test_interleaved_shapes_are_megatrons_uniform_chunkings():
    # 8 layers, B = 4, 8 devices: S = 2 with chunks of 2 or 1 layers (v = 2, 4); S = 4 with v = 2
    assert interleaved_shapes(8, 4, 8) == [(2, 4), (2, 2), (4, 2)]
    assert interleaved_shapes(8, 2, 8) == [(2, 4), (2, 2)]  # B must be a multiple of S
    assert interleaved_shapes(4, 4, 1) == []  # one device: no second stage
    assert chunks(8, 2, 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]  # chunk j on stage j mod 2


def test_the_interleaved_table_is_the_accountant_entry_by_entry(priced):
    """Each entry is the sum of `totals` over the stage's chunks (plan assembly's accountant), inf exactly
    where the devices' memory with the stage's interleaved in-flight count does not fit; the budget is set
    between stage 0's need (S + (S - 1)/v = 2.5 microbatches when B > S) and stage 1's (1.5)."""
    layering, count, costs = priced
    S, v = 2, 2
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    row = costs[((1, 1), (1, 1), "none")][0]
    assert [inflight(i, S, count, "interleaved", v) for i in range(S)] == [2.5, 1.5]
    probe = [combined([totals(row, pipe, a, b, End((1, 1), (1, 1)), chunk=True) for a, b in chunks(4, S, v)[i::S]])
             for i in range(S)]
    tight = (probe[0].memory_bytes(2.5) + probe[1].memory_bytes(1.5)) / 2
    assert probe[1].memory_bytes(1.5) <= tight < probe[0].memory_bytes(2.5)  # binds for stage 0 only
    for budget in (math.inf, tight):
        t, extra, fill, options = interleaved_table(pipe, costs, SUBMESHES, count, budget, S, v)
        for s, sub in enumerate(SUBMESHES):
            for h, (shape, mode, r) in enumerate(options[s]):
                for i in range(S):
                    sums = combined([totals(costs[(sub, shape, mode)][r], pipe, a, b, End(sub, shape), chunk=True)
                                     for a, b in chunks(4, S, v)[i::S]])
                    fits = sums.memory_bytes(inflight(i, S, count, "interleaved", v)) <= budget
                    assert t[h, 1, i, i, s] == (sums.latency_s if fits else np.inf)
                    assert extra[h, 1, i, i, s] == (sums.sync_s if fits else 0.0)
                    assert fill[h, 1, i, i, s] == (sums.p2p_s if fits else 0.0)
                    # the fill is the same for every option of a stage: the DP's rebate keeps it exact
                    assert fill[h, 1, i, i, s] in (0.0, fill[:, 1, i, i, s].max())
        assert np.isinf(t[:, :, 0, 1]).all() and np.isinf(t[:, 0]).all()  # only the diagonal, level 1
    assert np.isinf(interleaved_table(pipe, costs, SUBMESHES, count, tight, S, v)[0][0, 1, 0, 0, 0])


def test_a_chunk_that_cannot_run_leaves_its_stage_out(priced):
    """A layer that fits no strategy on a mesh (None in its row) rules out the interleaved stages holding it, and
    only those, even where that layer reads a shared parameter (the tied embedding: no correction is priced for a
    chunk that cannot run); the other stages are the accountant's."""
    layering, count, costs = priced
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    reader = min(pipe.shared["embed.wte"])
    S, v = 2, 2
    key = ((1, 1), (1, 1), "none")
    row = list(costs[key][0])
    row[reader] = None
    t, extra, _, options = interleaved_table(pipe, {**costs, key: [row]}, SUBMESHES, count, math.inf, S, v)
    h = options[0].index(((1, 1), "none", 0))
    for i in range(S):
        parts = chunks(len(layering.groups), S, v)[i::S]
        holds = any(layering.groups[a][0] <= reader <= layering.groups[b][1] for a, b in parts)
        expected = np.inf if holds else combined([totals(row, pipe, a, b, End((1, 1), (1, 1)), chunk=True)
                                                  for a, b in parts]).latency_s
        assert t[h, 1, i, i, 0] == expected
    assert np.isinf(t[h, 1, 0, 0, 0])  # the embedding is in stage 0's first chunk


def brute_force(pipe, costs, count: int, budget: float, devices: int) -> float:
    """The least iteration time over every plan: 1F1B over every cut × submesh × option per stage, and
    interleaved over every uniform chunking (S, v) × submesh × option per stage, on exactly `devices`
    devices, each priced from `totals` and the closed forms of `partopt.schedules` directly."""
    L = len(pipe.layering.groups)
    choices = [(sub, key, r) for sub in SUBMESHES for key in costs if key[0] == sub for r in range(len(costs[key]))]
    best = math.inf
    for cut in itertools.product([False, True], repeat=L - 1):  # 1F1B: a cut after layer i or not
        ends = [i for i in range(L - 1) if cut[i]] + [L - 1]
        ranges = list(zip([0] + [e + 1 for e in ends[:-1]], ends))
        S = len(ranges)
        for picked in itertools.product(choices, repeat=S):
            if sum(sub[0] * sub[1] for sub, _, _ in picked) != devices:
                continue
            sums = [totals(costs[key][r], pipe, a, b, End(sub, key[1])) for (a, b), (sub, key, r) in zip(ranges, picked)]
            if any(x.memory_bytes(min(S - i, count)) > budget for i, x in enumerate(sums)):
                continue
            times = [x.latency_s for x in sums]
            best = min(best, iteration_time(times, times, max(x.sync_s for x in sums), count, "1f1b"))
    for S, v in interleaved_shapes(L, count, devices):
        for picked in itertools.product(choices, repeat=S):
            if sum(sub[0] * sub[1] for sub, _, _ in picked) != devices:
                continue
            sums = [combined([totals(costs[key][r], pipe, a, b, End(sub, key[1]), chunk=True)
                              for a, b in chunks(L, S, v)[i::S]]) for i, (sub, key, r) in enumerate(picked)]
            if any(x.memory_bytes(inflight(i, S, count, "interleaved", v)) > budget for i, x in enumerate(sums)):
                continue
            times = [x.latency_s for x in sums]
            best = min(best, iteration_time(times, times, max(x.sync_s for x in sums), count, "interleaved", v,
                                            fill_s=sum(x.p2p_s for x in sums)))
    return best


@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("binds", [False, True])
def test_the_search_over_schedules_equals_brute_force(priced, devices, binds):
    """`inter._best_schedule` (the stage DP per schedule, the best kept) finds the brute force's least
    iteration over cuts × submeshes × options × schedule, with memory free and with a budget that rules
    out some stages (the whole model on one device holding 4 microbatches)."""
    layering, count, costs = priced
    pipe = pipeline_of(GRAPH, CLUSTER, layering, count, True)
    sizes = [a * b for a, b in SUBMESHES]
    whole = totals(costs[((1, 1), (1, 1), "none")][0], pipe, 0, len(layering.groups) - 1, End((1, 1), (1, 1)))
    budget = whole.memory_bytes(3.5) if binds else math.inf
    expected = brute_force(pipe, costs, count, budget, devices)
    found = _best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, ("1f1b", "interleaved"), Stats())
    assert math.isfinite(expected)
    assert found[0].total == pytest.approx(expected, rel=1e-12)
    schedules = {"1f1b": ("1f1b",), "interleaved": ("interleaved",)}
    single = [_best_schedule(pipe, costs, SUBMESHES, sizes, devices, count, budget, s, Stats()) for s in schedules.values()]
    assert found[0].total == min(x[0].total for x in single if x is not None)


def test_interleaved_dp_minimises_the_interleaved_closed_form():
    """`stagedp.solve(t / v, extra, sizes, devices, v B)` on a diagonal table is sum t / v + (B - 1/v) max t +
    max sync at its best choice of submeshes: brute force over every assignment (random tables)."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        S, v, B, sizes = 3, int(rng.integers(2, 4)), 6, [1, 2, 3]
        devices = int(rng.integers(3, 8))
        t = np.full((2, 2, S, S, len(sizes)), np.inf)
        extra = np.zeros_like(t)
        for h, i, s in itertools.product(range(2), range(S), range(len(sizes))):
            if rng.random() < 0.8:
                t[h, 1, i, i, s], extra[h, 1, i, i, s] = rng.uniform(1, 10), rng.uniform(0, 5)
        best = math.inf
        for picked in itertools.product(itertools.product(range(2), range(len(sizes))), repeat=S):
            if sum(sizes[s] for _, s in picked) != devices or any(np.isinf(t[h, 1, i, i, s]) for i, (h, s) in enumerate(picked)):
                continue
            times = [t[h, 1, i, i, s] for i, (h, s) in enumerate(picked)]
            sync = max(extra[h, 1, i, i, s] for i, (h, s) in enumerate(picked))
            best = min(best, iteration_time(times, times, sync, B, "interleaved", v))
        found = stagedp.solve(t / v, extra, sizes, devices, v * B)
        assert (found is None) == math.isinf(best)
        if found is not None:
            assert found.total == pytest.approx(best, rel=1e-12)


def test_auto_is_never_worse_than_a_forced_schedule():
    """On an 8-layer GPT on 8 V100s the default plan predicts no slower an iteration than any schedule
    forced, and is one of them."""
    graph = gpt(hidden=256, layers=8, heads=4, seq=64, vocab=512, batch=16, name="gpt-8")
    kwargs = dict(layers=None, microbatches=[4, 8], workers=1)
    auto = optimize(graph, CLUSTER, **kwargs)
    forced = {s: optimize(graph, CLUSTER, schedule=s, **kwargs) for s in ("1f1b", "interleaved", "zero-bubble")}
    assert forced["interleaved"].schedule == "interleaved" and forced["interleaved"].virtual_stages >= 2
    assert auto.iteration_time_s <= min(p.iteration_time_s for p in forced.values())
    assert auto.iteration_time_s in [p.iteration_time_s for p in forced.values()]
    for plan in (auto, *forced.values()):
        assert differences(plan, graph, CLUSTER) == []


def test_the_search_refuses_what_it_does_not_plan():
    with pytest.raises(InstanceError, match="does not plan the gpipe"):
        optimize(GRAPH, CLUSTER, schedule="gpipe")
    with pytest.raises(InstanceError, match="unknown pipeline schedule"):
        Options(schedule="pipedream")
    for single_stage in ("intra_only", "data_parallel_only"):  # one stage: nothing to interleave
        with pytest.raises(InstanceError, match="interleaves pipeline stages") as info:
            Options(schedule="interleaved", **{single_stage: True})
        assert info.value.where == "schedule"


@pytest.fixture(scope="module")
def megatron_interleaved():
    graph = gpt(hidden=512, layers=8, heads=8, seq=128, vocab=1024, batch=32, name="gpt-512")
    return graph, uniform(graph, CLUSTER, 2, 2, 2, 8, sequence_parallel=True, schedule="interleaved", virtual_stages=2,
                          recompute="none")


def test_an_interleaved_chunk_fits_its_share_of_the_device(monkeypatch):
    """A device holds its v chunks together, so `uniform` prices each chunk's layers on the ladder of the
    device's budget / v: every cap is (budget / v) / r for the share r it charges, never budget / r (before, each
    chunk took a whole budget: v budgets a device)."""
    from partopt import costmodel
    from partopt.pricing import Pricer

    graph = gpt(hidden=512, layers=8, heads=8, seq=128, vocab=1024, batch=32, name="gpt-512")
    caps, one = [], Pricer.one

    def recorded(self, job, stats):
        caps.append((job.cap, job.share))
        return one(self, job, stats)

    monkeypatch.setattr(Pricer, "one", recorded)
    uniform(graph, CLUSTER, 2, 2, 2, 8, schedule="interleaved", virtual_stages=2, recompute="none")
    budget = costmodel.memory_budget(CLUSTER.device)
    capped = [(cap, share) for cap, share in caps if cap is not None]
    assert capped and all(cap * share * 2 == pytest.approx(budget, rel=1e-12) for cap, share in capped)


def test_evaluate_prices_megatrons_interleaved_schedule_as_run(megatron_interleaved):
    """pp 2 · v 2 on 8 layers: four chunks of 2 layers in model order, chunk j on stage j mod 2; stage 0
    holds S + (S - 1)/v = 2.5 microbatches (B = 8 > S, Korthikanti et al.), stage 1 holds (w_1 + 1)/v with
    w_1 = (v - 1) S = 2 warm-up chunk forwards: 1.5; the iteration is the interleaved closed form of the
    per-device sums; each chunk's memory is its devices' (both chunks' state, in-flight × both chunks' activations)."""
    graph, plan = megatron_interleaved
    assert (plan.schedule, plan.virtual_stages) == ("interleaved", 2)
    assert [s.layers for s in plan.stages] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [s.devices for s in plan.stages[2:]] == [s.devices for s in plan.stages[:2]]
    assert [s.inflight_microbatches for s in plan.stages] == [2.5, 1.5, 2.5, 1.5]
    times = [plan.stages[i].stage_time_s + plan.stages[i + 2].stage_time_s for i in range(2)]
    sync = max(plan.stages[i].sync_time_s + plan.stages[i + 2].sync_time_s for i in range(2))
    fill = sum(s.breakdown["send_p2p_s"] for s in plan.stages[:3])  # every chunk but the last sends, overlapped
    assert "send_p2p_s" not in plan.stages[3].breakdown and fill > 0
    assert plan.iteration_time_s == pytest.approx(sum(times) / 2 + fill + (8 - 1 / 2) * max(times) + sync, rel=1e-12)
    for i, stage in enumerate(plan.stages):
        mine = plan.stages[i % 2::2]
        bd = [s.breakdown for s in mine]
        assert stage.memory_bytes == pytest.approx(sum(b["param_bytes"] for b in bd) + stage.inflight_microbatches
                                                   * sum(b["activation_bytes"] for b in bd)
                                                   + max(b["working_bytes"] for b in bd), rel=1e-12)
    assert differences(plan, graph, CLUSTER) == []
    args = export.to_megatron(plan)
    assert args[args.index("--pipeline-model-parallel-size") + 1] == "2"
    assert args[args.index("--num-layers-per-virtual-pipeline-stage") + 1] == "2"
    assert export.training(plan)["schedule"] == "interleaved" and export.training(plan)["virtual_stages"] == 2


def test_an_interleaved_plan_of_one_stage_is_not_exported_to_megatron(megatron_interleaved):
    """Megatron-LM asserts pipeline-model-parallel size > 1 under the interleaved schedule (its arguments.py):
    --num-layers-per-virtual-pipeline-stage with --pipeline-model-parallel-size 1 would not start."""
    graph, _ = megatron_interleaved
    plan = uniform(graph, CLUSTER, 1, 1, 8, 4, schedule="interleaved", virtual_stages=2, recompute="none")
    assert len(plan.stages) // plan.virtual_stages == 1
    with pytest.raises(export.NotExpressibleError, match="interleaves 2 chunks on one pipeline stage"):
        export.to_megatron(plan)


def test_zero_bubble_is_priced_with_its_weight_pass_and_not_exported_to_megatron(megatron_interleaved):
    graph, _ = megatron_interleaved
    plan = uniform(graph, CLUSTER, 2, 2, 2, 8, schedule="zero-bubble", recompute="none")
    assert [s.inflight_microbatches for s in plan.stages] == [2, 2]  # min(S, B) on every stage
    for s in plan.stages:  # the dW GEMMs: a third of a matmul-only stage's FLOPs, at most its backward
        assert 0 < s.weight_s <= s.stage_time_s - s.forward_s
    times = [s.stage_time_s for s in plan.stages]
    forwards = [s.forward_s for s in plan.stages]
    omega = min(min(s.weight_s, s.forward_s, s.stage_time_s - s.forward_s - s.weight_s) for s in plan.stages)
    expected = sum(times) + 7 * max(times) - (2 + 2 - 2) * omega + max(s.sync_time_s for s in plan.stages)
    assert plan.iteration_time_s == pytest.approx(expected, rel=1e-12)
    assert forwards == [s.forward_s for s in plan.stages]
    assert differences(plan, graph, CLUSTER) == []
    with pytest.raises(export.NotExpressibleError, match="zero-bubble"):
        export.to_megatron(plan)


def test_old_plan_files_read_as_1f1b(tiny):
    data = plan_to_dict(tiny.plan)
    assert (data["schedule"], data["virtual_stages"]) == ("1f1b", 1)
    for key in ("schedule", "virtual_stages"):
        del data[key]
    for stage in data["stages"]:
        del stage["weight_s"]
    old = plan_from_dict(json.loads(json.dumps(data)))
    assert (old.schedule, old.virtual_stages) == ("1f1b", 1) and old.stages[0].weight_s is None
    check_plan(old)
    assert differences(old, tiny.graph, tiny.cluster) == []  # priced again as 1F1B: the same figures


def test_an_interleaved_chunk_off_its_stages_devices_is_refused(megatron_interleaved):
    _, plan = megatron_interleaved
    data = plan_to_dict(plan)
    data["stages"][2]["devices"] = data["stages"][1]["devices"]
    with pytest.raises(InstanceError, match="virtual stage 2 runs on stage 0's devices") as err:
        check_plan(plan_from_dict(data))
    assert err.value.where == "plan: $.stages[2].devices"
    data = plan_to_dict(plan)
    data["virtual_stages"] = 3
    with pytest.raises(InstanceError, match="4 stage entries are not v = 3"):
        check_plan(plan_from_dict(data))


def test_cli_evaluate_virtual_stages_and_bad_schedules(tmp_path, megatron_interleaved):
    graph, plan = megatron_interleaved
    graph_file, out = tmp_path / "g.json", tmp_path / "p.json"
    io.write_graph(graph, str(graph_file))
    base = ["evaluate", str(graph_file), "--cluster", "p3.16xlarge", "--nodes", "1", "--tp", "2", "--pp", "2",
            "--dp", "2", "--microbatches", "8", "--sequence-parallel", "--recompute", "none"]
    ran = CliRunner().invoke(main, [*base, "--virtual-stages", "2", "-o", str(out)])
    assert ran.exit_code == 0, ran.output
    written = json.loads(out.read_text())
    assert (written["schedule"], written["virtual_stages"]) == ("interleaved", 2)
    assert written["iteration_time_s"] == pytest.approx(plan.iteration_time_s, rel=1e-9)
    bad = CliRunner().invoke(main, [*base, "--virtual-stages", "3"])
    assert bad.exit_code == 2 and "do not split into 6 equal chunks" in bad.output
    odd = CliRunner().invoke(main, [*base[:-5], "--microbatches", "2", "--schedule", "interleaved"])
    assert odd.exit_code == 2 and "at least 2 virtual stages" in odd.output
    refused = CliRunner().invoke(main, ["solve", str(graph_file), "--cluster", "p3.16xlarge", "--nodes", "1",
                                        "--schedule", "gpipe"])
    assert refused.exit_code == 2 and "does not plan the gpipe schedule" in refused.output
    grid = CliRunner().invoke(main, ["solve", str(graph_file), "--cluster", "p3.16xlarge", "--nodes", "1",
                                     "--search", "megatron", "--schedule", "zero-bubble"])
    assert grid.exit_code == 2 and "--search megatron plans 1f1b and Megatron's interleaved schedule, not zero-bubble" in grid.output


def test_explain_and_draw_show_an_interleaved_plan_per_device_group(megatron_interleaved, tmp_path):
    """Two accounts for pp 2 · v 2 (not four): each holds both chunks' ops, and its memory rows add up to
    its devices' memory (both chunks' state, in-flight × both chunks' activations)."""
    from partopt.draw import draw
    from partopt.explain import explain

    _, plan = megatron_interleaved
    accounts = explain(plan)
    assert len(accounts) == 2
    for account in accounts:
        mine = plan.stages[account.index::2]
        assert len(account.ops) == sum(len(s.ops) for s in mine)
        assert sum(account.memory_bytes.values()) == pytest.approx(mine[0].memory_bytes, rel=1e-12)
    draw(plan, tmp_path / "interleaved.svg")  # simulated as interleaved with v = 2 on the two device groups
    assert (tmp_path / "interleaved.svg").stat().st_size > 0
