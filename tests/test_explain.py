"""explain(): each stage's time adds up to the iteration, its memory to the stage's; the CLI commands on plans."""

import dataclasses
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt import io, models
from partopt.cli import main
from partopt.cluster import preset
from partopt.errors import InstanceError
from partopt.explain import explain, op_times
from partopt.inter import optimize
from partopt.plan import write_plan

INSTANCES = Path(__file__).parent.parent / "instances"


@pytest.fixture(scope="module")
def pipeline_plan():
    graph = models.gpt(hidden=256, layers=8, heads=4, seq=128, vocab=1024, batch=64)
    return optimize(graph, preset("p3.16xlarge", 1), microbatches=8, inter_only=True)


def test_each_stage_accounts_for_the_whole_iteration_and_its_memory(pipeline_plan):
    plan = pipeline_plan
    accounts = explain(plan)
    assert len(accounts) == len(plan.stages) == 8
    for stage, account in zip(plan.stages, accounts):
        assert sum(account.time_s.values()) == pytest.approx(plan.iteration_time_s, rel=1e-12)
        assert sum(account.memory_bytes.values()) == pytest.approx(stage.memory_bytes, rel=1e-12)
        assert account.time_s["pipeline bubble and waiting"] >= 0
        assert len(account.ops) == len(stage.ops)
    # 1F1B: the slowest stage waits only for slower syncs; the others idle for the difference in latency
    B = plan.num_microbatches
    slowest = max(range(8), key=lambda i: plan.stages[i].stage_time_s)
    for i, (stage, account) in enumerate(zip(plan.stages, accounts)):
        gap = B * (plan.stages[slowest].stage_time_s - stage.stage_time_s)
        assert account.time_s["pipeline bubble and waiting"] >= gap * (1 - 1e-9)


def test_explain_draw_and_export_commands(pipeline_plan, tmp_path):
    path = tmp_path / "plan.json"
    write_plan(pipeline_plan, path)
    runner = CliRunner()
    explained = runner.invoke(main, ["explain", str(path)])
    assert explained.exit_code == 0, explained.output
    assert explained.output.count("time per iteration") == 8
    assert "l3.fc1: replicated — in l3.ln2 [R, R]" in explained.output  # one device per stage
    drawn = runner.invoke(main, ["draw", str(path), "-o", str(tmp_path / "t.svg")])
    assert drawn.exit_code == 0 and (tmp_path / "t.svg").stat().st_size > 0
    exported = runner.invoke(main, ["export", str(path), "--to", "jax"])
    assert exported.exit_code == 0 and '"PartitionSpec(' in exported.output
    bad = runner.invoke(main, ["draw", str(path), "-o", str(tmp_path / "t.gif")])
    assert bad.exit_code == 2 and "t.gif" in bad.stderr and "Traceback" not in bad.output


def test_each_ops_time_is_priced_again_and_adds_up_to_its_stages_compute(pipeline_plan):
    """op_times prices every op at the plan's strategy: a stage's ops add up to its compute, costliest first."""
    graph = models.gpt(hidden=256, layers=8, heads=4, seq=128, vocab=1024, batch=64)
    times = op_times(pipeline_plan, graph, preset("p3.16xlarge", 1))
    assert len(times) == len(pipeline_plan.stages)
    for stage, ops in zip(pipeline_plan.stages, times):
        assert {t.op for t in ops} == set(stage.ops)
        assert sum(t.compute_s for t in ops) == pytest.approx(stage.breakdown["compute_s"], rel=1e-9)
        assert [t.compute_s + t.comm_s for t in ops] == sorted((t.compute_s + t.comm_s for t in ops), reverse=True)
    measured = dataclasses.replace(pipeline_plan, options={**pipeline_plan.options, "cost_model": "profiled:0123"})
    with pytest.raises(InstanceError, match="priced by the profiled:0123 cost model, not the analytical one"):
        op_times(measured, graph, preset("p3.16xlarge", 1))  # its ops' times are the profile's, not the model's


def test_an_ops_time_is_the_roofline_of_its_flops_and_bytes():
    """fc1 of mlp-2layer (x[1024, 128] · w1[128, 512], fp32) alone on one V100: forward and backward run 3 · 2·b·h·f
    FLOPs at the fp32 peak × matmul_efficiency (no GEMM curve on the V100), and move 3 × the forward's bytes
    (x, w1, h1) at the HBM bandwidth × memory_efficiency: the larger of the two."""
    graph = io.read_graph(INSTANCES / "mlp-2layer.json")
    one = preset("p3.16xlarge", 1).narrowed(1)
    device = one.device
    assert device.matmul_half_flops == 0
    plan = optimize(graph, one, microbatches=1, recompute="none", workers=1)
    (stage,) = op_times(plan, graph, one)
    fc1 = next(t for t in stage if t.op == "fc1")
    b, h, f = 1024, 128, 512
    flops, moved = 3 * 2 * b * h * f, 3 * 4 * (b * h + h * f + b * f)
    expected = max(flops / (device.peak("fp32") * device.matmul_efficiency),
                   moved / (device.memory_bandwidth * device.memory_efficiency))
    assert (fc1.flops, fc1.comm_s) == (flops, 0.0)
    assert fc1.compute_s == pytest.approx(expected, rel=1e-12)
    assert fc1.flop_rate == pytest.approx(flops / expected, rel=1e-12)


def test_explain_lists_the_costliest_ops_given_the_graph_and_cluster(tiny):
    base = ["explain", tiny.plan_file, "--graph", tiny.graph_file]
    result = CliRunner().invoke(main, [*base, "--cluster", tiny.cluster_file, "--top", "2", "--no-ops"])
    assert result.exit_code == 0, result.output
    assert "compute by op kind, per microbatch" in result.output and "costliest 2 of" in result.output
    half = CliRunner().invoke(main, base)
    assert half.exit_code == 2 and "error: --cluster: --graph and --cluster go together" in half.stderr
    profiled = CliRunner().invoke(main, [*base, "--cluster", tiny.cluster_file, "--profile", "no-such-profile.json"])
    assert profiled.exit_code == 2 and "Traceback" not in profiled.output
