"""explain(): each stage's time adds up to the iteration, its memory to the stage's; the CLI commands on plans."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt import models
from partopt.cli import main
from partopt.cluster import preset
from partopt.explain import explain
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
