"""partopt.baselines: the Megatron grid search against brute force on a small grid, DeepSpeed-style
and PP-DP plans by their defining shape."""

from __future__ import annotations


import pytest

from partopt import baselines, models
from partopt.cluster import preset
from partopt.errors import InfeasibleError
from partopt.evaluate import uniform


@pytest.fixture(scope="module")
def small():
    graph = models.gpt(hidden=256, layers=4, heads=4, seq=128, vocab=1024, batch=16)
    return graph, preset("p3.16xlarge", 1).narrowed(4)


def test_megatron_finds_the_fastest_grid_point(small):
    graph, cluster = small
    times = {}
    for tp, pp, dp in [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]:
        for count in (1, 2, 4, 8, 16):
            if count < pp or (16 // count) % dp:
                continue
            try:
                times[(tp, pp, dp, count)] = uniform(graph, cluster, tp, pp, dp, count).iteration_time_s
            except InfeasibleError:
                pass
    best = baselines.megatron(graph, cluster)
    assert best.iteration_time_s == min(times.values())
    point = min(times, key=times.get)
    assert baselines.megatron_grid_point(best) == "tp {} · pp {} · dp {} · B {}".format(*point)


def test_deepspeed_is_one_data_parallel_stage_and_ppdp_has_no_zero(small):
    graph, cluster = small
    plan = baselines.deepspeed(graph, cluster, microbatches=1)
    assert len(plan.stages) == 1 and plan.stages[0].logical_mesh in ([4, 1], [1, 4])
    plan = baselines.ppdp(graph, cluster, microbatches=4)
    assert all(not p.zero_axes for s in plan.stages for p in s.params.values())
    assert set(baselines.BASELINES) == {"megatron", "deepspeed", "ppdp"}


def test_solve_search_megatron_writes_the_grid_search_plan(small, tmp_path):
    from click.testing import CliRunner

    from partopt.cli import main
    from partopt.io import write_cluster, write_graph
    from partopt.plan import read_plan

    graph, cluster = small
    write_graph(graph, tmp_path / "g.json")
    write_cluster(cluster, tmp_path / "c.json")
    result = CliRunner().invoke(main, ["solve", str(tmp_path / "g.json"), "--cluster", str(tmp_path / "c.json"),
                                       "--search", "megatron", "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    assert read_plan(tmp_path / "plan.json").iteration_time_s == baselines.megatron(graph, cluster).iteration_time_s
