"""optimize() and `partopt solve`: end-to-end plans, infeasible requests, the plan file."""

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from partopt import costmodel
from partopt.cli import main
from partopt.cluster import preset
from partopt.errors import InfeasibleError
from partopt.baselines import megatron
from partopt.evaluate import uniform
from partopt.inter import Options, microbatch_counts, optimize
from partopt.models.gpt import gpt
from partopt.pricing import Dropped, Job, LayerCost, Stats, longest_stage, objectives, price
from partopt.plan import plan_from_dict, plan_text, plan_to_dict, read_plan
from partopt.sharding import R, Shard
from partopt.simulate import StageTimes, closed_form
from test_intra import mlp

INSTANCES = Path(__file__).parent.parent / "instances"


def test_microbatch_candidates_are_the_power_of_two_divisors():
    assert microbatch_counts(24, "auto") == [1, 2, 4, 8]
    assert microbatch_counts(1024, 16) == [16]
    assert microbatch_counts(1520, [40, 38, 40]) == [38, 40]
    with pytest.raises(InfeasibleError, match="not divisible into 3"):
        microbatch_counts(1024, 3)
    with pytest.raises(InfeasibleError, match="not divisible into 3"):
        microbatch_counts(1024, [2, 3])


def test_a_shared_cache_reuses_the_full_searchs_layer_solutions():
    graph, cluster = mlp(4, 4096, 1024), preset("p3.16xlarge", 2)
    fresh = optimize(graph, cluster, microbatches=4, intra_only=True)
    cache: dict = {}
    full = optimize(graph, cluster, microbatches=4, cache=cache)
    again = optimize(graph, cluster, microbatches=4, intra_only=True, cache=cache)
    assert full.solver["ilps"] > 0 and again.solver["ilps"] == 0  # the whole-cluster submesh was priced already
    assert again.iteration_time_s == fresh.iteration_time_s
    assert [s.ops for s in again.stages] == [s.ops for s in fresh.stages]
    other = dataclasses.replace(graph, optimizer="sgd")  # another graph: nothing is shared
    assert optimize(other, cluster, microbatches=4, intra_only=True, cache=cache).solver["ilps"] > 0


def test_a_list_of_counts_finds_the_best_of_planning_each_alone():
    graph, cluster = mlp(4, 4096, 1024), preset("p3.16xlarge", 1)
    alone = {b: optimize(graph, cluster, microbatches=b).iteration_time_s for b in (1, 4, 16)}
    plan = optimize(graph, cluster, microbatches=[16, 1, 4])
    assert plan.iteration_time_s == pytest.approx(min(alone.values()), rel=1e-12)
    assert plan.num_microbatches == min(alone, key=alone.get)
    assert plan.options["microbatches"] == [16, 1, 4]


def test_model_larger_than_the_cluster_says_by_how_much():
    graph = mlp(2, 8, 65536)  # 2 × 2^32 fp32 weights: 16 B each of Adam state = 128 GiB
    cluster = preset("p3.16xlarge", 1)
    usable = costmodel.memory_budget(cluster.device) * 8 / 2**30
    with pytest.raises(InfeasibleError) as err:
        optimize(graph, cluster, microbatches=1)
    line = err.value.line()
    assert "parameter state alone is 128 GiB" in line
    assert f"short by {128 - usable:.3g} GiB" in line
    assert "--memory-reserve" in line and "microbatches" not in line  # no microbatch count shrinks the state


def test_activations_larger_than_the_cluster_point_to_smaller_microbatches():
    graph = mlp(2, 2**28, 64)  # one microbatch: every fp32 activation is 2^28 · 64 · 4 B = 64 GiB, the state 128 KiB
    cluster = preset("p3.16xlarge", 1)
    with pytest.raises(InfeasibleError) as err:
        optimize(graph, cluster, microbatches=1)
    line = err.value.line()
    assert "activations do not fit" in line and "more microbatches" in line and "--memory-reserve" not in line


def test_plan_iteration_time_is_the_pipeline_closed_form_of_its_stages():
    graph = mlp(4, 4096, 1024)
    plan = optimize(graph, preset("p3.16xlarge", 1), microbatches=4)
    stages = [StageTimes(s.stage_time_s / 3, 2 * s.stage_time_s / 3) for s in plan.stages]
    sync = max(s.sync_time_s for s in plan.stages)
    assert plan.iteration_time_s == pytest.approx(closed_form(stages, 4) + sync, rel=1e-12)
    assert sum(len(s.devices) for s in plan.stages) == 8
    assert sorted(d for s in plan.stages for d in s.devices) == list(range(8))
    covered = [layer for s in plan.stages for layer in range(s.layers[0], s.layers[1] + 1)]
    assert covered == list(range(4))


def test_solve_json_is_exactly_the_plan_file(tmp_path):
    out = tmp_path / "plan.json"
    args = ["solve", str(INSTANCES / "mlp-2layer.json"), "--cluster", "p3.16xlarge", "--nodes", "1",
            "--microbatches", "2", "-o", str(out), "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(out.read_text())
    plan = read_plan(out)
    assert plan.num_microbatches == 2 and plan.graph == "mlp-2layer"
    assert json.loads(result.stdout) == plan_to_dict(plan)


def test_solve_with_indivisible_microbatches_is_a_one_line_error():
    args = ["solve", str(INSTANCES / "mlp-2layer.json"), "--cluster", "p3.16xlarge", "--microbatches", "3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "not divisible into 3 microbatches" in result.stderr and "Traceback" not in result.output
    assert result.stderr.startswith("error: --microbatches: ")  # the flag, not the library's keyword
    result = CliRunner().invoke(main, args[:-1] + ["2,x"])
    assert result.exit_code == 2 and "--microbatches 64,128,256" in result.stderr


def test_shared_solves_name_each_layers_own_dims():
    """Layers alike up to dim names share one ILP; the plan must speak of each layer's own dims."""
    # small batch, wide layers: tensor parallel, so every op splits a named dim (at width 1024 the p3's 25 GB/s
    # pairs make replicating fc1 the cheaper choice)
    graph = mlp(4, 64, 2048)
    plan = optimize(graph, preset("p3.16xlarge", 1), microbatches=1, intra_only=True)
    ops = {op.name: op for op in graph.ops}
    for stage in plan.stages:
        for name, entry in stage.ops.items():
            op_dims = {d for t in (*ops[name].inputs, ops[name].output) for d in graph.tensors[t].dims}
            assert {d for d in entry.axes if d} <= op_dims, (name, entry.axes)
            assert any(entry.axes), name
        for name, entry in stage.params.items():
            for p in entry.placement:
                if isinstance(p, Shard):
                    assert p.dim in graph.tensors[name].dims


# ---------------------------------------------------------------- known outcomes (issue 5)

def _axes_and_placements(plan):
    axes = {a for s in plan.stages for e in s.ops.values() for a in e.axes}
    return axes, {e.placement for s in plan.stages for e in s.params.values()}


def test_a_model_that_fits_one_device_with_a_large_batch_is_pure_data_parallel():
    plan = optimize(mlp(2, 8192, 256), preset("p3.16xlarge", 1), microbatches=1)
    assert [(s.submesh, s.logical_mesh) for s in plan.stages] == [([1, 8], [8, 1])]
    axes, placements = _axes_and_placements(plan)
    assert axes <= {"b", None} and placements == {(R, R)}


def test_a_model_larger_than_a_node_is_pipelined_across_nodes_with_intra_op_inside_them():
    """4 fp32 layers of 2048² weights: 16 B/param of Adam state is 256 MiB, more than a node of
    8 × 24 MiB devices can hold. The plan spreads stages over both nodes, and no stage splits a
    tensor over the slow inter-node link while a node-local split exists."""
    cluster = preset("p3.16xlarge", 2)
    tiny = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=24 * 2**20))
    graph = mlp(4, 64, 2048)
    state = sum(costmodel.param_memory(graph.numel(t.name), "fp32").total for t in graph.params)
    assert state > 8 * costmodel.memory_budget(tiny.device)
    plan = optimize(graph, tiny, microbatches=4)
    nodes = {d // 8 for s in plan.stages for d in s.devices}
    assert len(plan.stages) > 1 and nodes == {0, 1}
    for stage in plan.stages:
        if stage.submesh[0] > 1:  # a stage spanning nodes: its axis 0 crosses them and may only split the batch
            assert all(e.axes[0] in ("b", None) for e in stage.ops.values())
        assert any(a for e in stage.ops.values() for a in e.axes if a != "b")  # tensor-parallel inside
    assert max(s.memory_bytes for s in plan.stages) <= costmodel.memory_budget(tiny.device)


def test_a_slow_network_means_a_pipeline():
    """Across p3's shared NIC one 16-device stage reduces its gradients slower than a pipeline whose
    stages reduce inside their node. (A flat network no longer means no pipeline: each device sends
    its own slice of the boundary (COSTMODEL §5b "Pipeline sends"), so on NVLink speed everywhere
    two 8-device stages of this latency-bound MLP beat one 16-device ring's latency.)"""
    graph = mlp(4, 512, 512)
    assert len(optimize(graph, preset("p3.16xlarge", 2), microbatches=4).stages) > 1


def test_auto_microbatches_skip_counts_an_moe_cannot_split_into():
    """MoE routing groups of 16 tokens: a microbatch of one 8-token sequence has no whole group."""
    from partopt.models import moe
    graph = moe(hidden=32, layers=2, heads=2, experts=2, seq=8, vocab=16, batch=4, group_size=16)
    with pytest.raises(InfeasibleError, match="does not scale with a microbatch of 1"):
        optimize(graph, preset("p3.16xlarge", 1), microbatches=4)
    assert optimize(graph, preset("p3.16xlarge", 1), microbatches=[1, 4]).num_microbatches == 1
    plan = optimize(graph, preset("p3.16xlarge", 1), microbatches="auto")
    assert plan.microbatch_size * 8 >= 16 and set(plan.solver["microbatch_counts"]) <= {1, 2}


def test_the_returned_pipeline_simulates_to_its_closed_form_and_gpipe_holds_more_memory():
    from partopt.draw import stage_times
    from partopt.simulate import closed_form, simulate
    plan = optimize(mlp(4, 512, 512), preset("p3.16xlarge", 2), microbatches=4, schedule="1f1b")
    assert len(plan.stages) > 1
    stages, B = stage_times(plan), plan.num_microbatches
    pipeline = plan.iteration_time_s - max(s.sync_time_s for s in plan.stages)
    assert closed_form(stages, B) == pytest.approx(pipeline, rel=1e-12)
    one_f_one_b = simulate(stages, B, "1f1b")
    if max(range(len(stages)), key=lambda i: (stages[i].latency_s, i)) == len(stages) - 1:
        assert one_f_one_b.iteration_time_s == pytest.approx(pipeline, rel=1e-9)  # last stage slowest: exact
    assert one_f_one_b.iteration_time_s <= pipeline * (1 + 1e-9)
    gpipe = simulate(stages, B, "gpipe")
    assert all(g >= f for g, f in zip(gpipe.peak_memory_bytes, one_f_one_b.peak_memory_bytes))
    assert gpipe.peak_memory_bytes[0] > one_f_one_b.peak_memory_bytes[0]  # B in flight against min(S, B)


def test_longest_stage_is_the_longest_run_of_layers_costing_under_the_bound():
    def layer(time_s, sync_s):
        return LayerCost(time_s, sync_s, 0.0, 0.0, 0.0, None)

    # with B = 4 the layers cost 4·time + sync = 5, 8, (cannot run), 3, 3, 3
    row = objectives([layer(1.0, 1.0), layer(2.0, 0.0), None, layer(0.5, 1.0), layer(0.5, 1.0), layer(0.5, 1.0)], 4)
    assert row == [5.0, 8.0, None, 3.0, 3.0, 3.0]
    assert longest_stage(row, 4, float("inf")) == 3  # a layer that cannot run splits the runs
    assert longest_stage(row, 4, 14.0) == 3  # 5 + 8 = 13 and 3 + 3 + 3 = 9 both fit
    assert longest_stage(row, 4, 9.0) == 2  # 3 + 3 + 3 = 9 is not under 9
    assert longest_stage(row, 4, 5.0) == 1  # only a 3 alone
    assert longest_stage(row, 4, 3.0) == 0


def test_a_layers_ilp_minimises_its_time_per_microbatch_plus_sync_over_the_count():
    """The premise of `_longest_stage`: no option of a layer costs less than count · time + sync of its optimum."""
    graph, cluster = mlp(2, 4096, 1024), preset("p3.16xlarge", 1)
    mesh = cluster.logical_mesh((1, 4), (2, 2))
    for count in (1, 8):
        cost = price(graph, Job(graph.dims[graph.batch_dim], count, (graph.ops[0].name,), mesh, "none", costmodel.memory_budget(cluster.device)),
                     Options())
        assert cost.sharding.objective == pytest.approx(cost.time_s + cost.sync_s / count, rel=1e-9)


def test_a_leaner_option_that_finds_no_solution_in_time_is_counted_not_silently_dropped(monkeypatch):
    """A memory-capped ILP that times out without a solution is `Dropped`, and the plan says how many."""
    from partopt import intra
    from partopt.errors import SolverError

    graph, cluster = mlp(4, 4096, 4096), preset("p3.16xlarge", 1)
    budget = costmodel.memory_budget(cluster.device)
    solve = intra.shard_stage

    def lean_times_out(*args, memory_budget=None, **kwargs):
        if memory_budget is not None and memory_budget < budget:
            raise SolverError("no solution within the time limit", "test")
        return solve(*args, memory_budget=memory_budget, **kwargs)

    monkeypatch.setattr(intra, "shard_stage", lean_times_out)
    mesh = cluster.logical_mesh((1, 2), (2, 1))
    assert isinstance(price(graph, Job(graph.dims[graph.batch_dim], 1, (graph.ops[0].name,), mesh, "none", budget / 64), Options()), Dropped)
    stats = Stats()
    stats.record(Dropped(10.0), solved=True)
    stats.record(None, solved=True)  # an infeasible cap is not a drop: it is proven
    assert stats.dropped == 1 and stats.ilps == 0


def test_a_search_goes_on_when_an_ilp_at_the_budget_finds_no_solution(monkeypatch):
    """An ILP capped at the device's budget that stops without a solution (a loaded machine's clock) drops that
    option only: the search finds the plan of the other meshes and counts the drop."""
    from partopt import intra
    from partopt.errors import SolverError

    graph, cluster = mlp(4, 4096, 4096), preset("p3.16xlarge", 1)
    solve = intra.shard_stage

    def two_by_one_stalls(g, mesh, *args, memory_budget=None, **kwargs):
        if memory_budget is not None and mesh.shape == (2, 1):
            raise SolverError("no solution within the time limit", "test")
        return solve(g, mesh, *args, memory_budget=memory_budget, **kwargs)

    monkeypatch.setattr(intra, "shard_stage", two_by_one_stalls)
    plan = optimize(graph, cluster, microbatches=1, recompute="none", workers=1)
    assert plan.solver["dropped_options"] >= 1
    assert all(tuple(stage.logical_mesh) != (2, 1) for stage in plan.stages)


def test_layer_ilps_the_wall_clock_stops_are_counted_in_the_plan(monkeypatch):
    """Each ILP solved whose solver the time limit stopped is counted (`solver.timeouts`, which `partopt solve` warns
    of), as is the worst status; a cached one is not counted again."""
    from partopt import intra, solvers

    solve = intra.shard_stage

    def stopped_by_the_clock(*args, **kwargs):  # every layer ILP stops at its time limit with its incumbent
        sharding = solve(*args, **kwargs)
        result = dataclasses.replace(sharding.solution.result, status="timeout")
        return dataclasses.replace(sharding, solution=dataclasses.replace(sharding.solution, result=result))

    monkeypatch.setattr(intra, "shard_stage", stopped_by_the_clock)
    graph, cluster = mlp(2, 64, 64), preset("p3.16xlarge", 1).narrowed(2)
    for plan in (optimize(graph, cluster, microbatches=1, recompute="none", workers=1),
                 uniform(graph, cluster, 1, 1, 2),  # `evaluate --tp --pp --dp`: over the microbatch counts it prices
                 megatron(graph, cluster)):  # `solve --search megatron`: over its grid, not its best point alone
        assert plan.solver["status"] == "timeout" and plan.solver["timeouts"] == plan.solver["ilps"] > 0
    stopped = solvers.Result("timeout", [], 1.0, 0.5, 0.1, "highs")
    cost = LayerCost(0.0, 0.0, 0.0, 0.0, 0.0, SimpleNamespace(solution=SimpleNamespace(result=stopped)))
    stats = Stats()
    stats.record(cost, solved=True)
    stats.record(cost, solved=False)
    assert (stats.timeouts, stats.ilps, stats.status) == (1, 1, "timeout")
    no_bound = LayerCost(0.0, 0.0, 0.0, 0.0, 0.0, SimpleNamespace(solution=SimpleNamespace(
        result=solvers.Result("timeout", [], 1.0, None, 0.1, "highs"))))
    stats.record(no_bound, solved=True)
    assert stats.gap == math.inf  # unknown, not 0


def test_a_plan_whose_layer_ilp_proved_no_bound_is_written_with_its_gap_unknown(monkeypatch):
    """HiGHS stopped with no dual bound gives an infinite gap, which a plan file cannot hold: it writes null, and the
    plan reads back (`partopt solve --time-limit 0.001 -o` refused to write before)."""
    from partopt import intra, solvers

    solve = intra.shard_stage

    def no_bound(*args, **kwargs):
        sharding = solve(*args, **kwargs)
        result = dataclasses.replace(sharding.solution.result, status="timeout", bound=None)
        return dataclasses.replace(sharding, solution=dataclasses.replace(sharding.solution, result=result))

    monkeypatch.setattr(intra, "shard_stage", no_bound)
    plan = optimize(mlp(2, 64, 64), preset("p3.16xlarge", 1).narrowed(2), microbatches=1, recompute="none", workers=1)
    assert plan.solver["gap"] is None
    assert plan_from_dict(json.loads(plan_text(plan))).solver == json.loads(plan_text(plan))["solver"]


def test_of_the_counts_finished_the_fastest_placed_plan_is_returned():
    """The stage DP prices a send before its neighbour is placed: on several nodes, as crossing them (COSTMODEL §5b
    "Pipeline sends"). On four p3 nodes this GPT's 16-microbatch plan has the lower table total (0.118 s against
    8 microbatches' 0.124 s), but placed it takes 0.138 s: the search returns 8 microbatches' plan, the plan of that
    count searched alone."""
    graph = gpt(hidden=1280, layers=16, heads=8, seq=256, vocab=2048, batch=128)
    cluster = preset("p3.16xlarge", 4)
    options = dict(workers=1, schedule="1f1b", recompute="full")
    plan = optimize(graph, cluster, microbatches=[8, 16, 32, 64], **options)
    alone = {c: optimize(graph, cluster, microbatches=[c], **options) for c in (8, 16)}
    assert alone[8].iteration_time_s < alone[16].iteration_time_s
    assert (plan.num_microbatches, plan.iteration_time_s) == (8, alone[8].iteration_time_s)
