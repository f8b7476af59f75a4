"""partopt.baselines: the Megatron grid search against brute force on a small grid, DeepSpeed-style
and PP-DP plans by their defining shape."""

from __future__ import annotations


import dataclasses

import pytest

from partopt import baselines, models
from partopt.cluster import preset
from partopt.errors import InfeasibleError
from partopt.evaluate import uniform


@pytest.fixture(scope="module")
def small():
    graph = models.gpt(hidden=256, layers=4, heads=4, seq=128, vocab=1024, batch=16)
    return graph, preset("p3.16xlarge", 1).narrowed(4)


def _layouts(features):
    """Every Megatron layout of `small`'s 4 devices: (tp, pp, dp, sequence parallel, distributed optimizer), each
    feature only where it applies (tp > 1, dp > 1) and is in `features`."""
    for tp, pp, dp in [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]:
        for sp in (False, True) if tp > 1 and "sequence_parallel" in features else (False,):
            for zero in (False, True) if dp > 1 and "distributed_optimizer" in features else (False,):
                yield tp, pp, dp, sp, zero


def _grid(graph, cluster, features):
    """Every Megatron grid point of `small` priced, by brute force, its state as Megatron-LM keeps it: (tp, pp, dp, B,
    sequence parallel, distributed optimizer) -> iteration time."""
    times = {}
    for tp, pp, dp, sp, zero in _layouts(features):
        for count in (1, 2, 4, 8, 16):
            if count < pp or (16 // count) % dp:
                continue
            try:
                plan = uniform(graph, cluster, tp, pp, dp, count, zero=zero, sequence_parallel=sp, state_layout="megatron")
            except InfeasibleError:
                continue
            times[(tp, pp, dp, count, sp, zero)] = plan.iteration_time_s
    return times


@pytest.mark.parametrize("features", [baselines.MEGATRON_FEATURES, ()])
def test_megatron_finds_the_fastest_grid_point(small, features):
    """With Megatron-LM's features (the default) and without them (Megatron-LM as Alpa ran it)."""
    graph, cluster = small
    times = _grid(graph, cluster, features)
    best = baselines.megatron(graph, cluster, features=features)
    assert best.iteration_time_s == min(times.values())
    tp, pp, dp, count, sp, zero = min(times, key=times.get)
    expected = f"tp {tp} · pp {pp} · dp {dp} · B {count}" + " · sequence parallel" * sp + " · distributed optimizer" * zero
    assert baselines.megatron_grid_point(best) == expected


def _leanest(graph, cluster, features) -> float:
    """The least per-device memory of any grid point of `small` with `features`: full recomputation, one sample per
    microbatch and rank (B = 16 / dp)."""
    return min(uniform(graph, cluster, tp, pp, dp, 16 // dp, zero=zero, sequence_parallel=sp, recompute="full",
                       check_memory=False, state_layout="megatron").memory_peak_bytes
               for tp, pp, dp, sp, zero in _layouts(features))


def test_megatron_features_fit_a_memory_cap_that_megatron_of_2021_does_not(small):
    """Sequence parallelism splits the norms' activations over tp, the distributed optimizer the optimizer state over
    dp: under a cap between the leanest grid points with and without them, the default search finds a plan and
    Megatron-LM as of 2021 (no features) none."""
    graph, cluster = small
    with_features, without = _leanest(graph, cluster, baselines.MEGATRON_FEATURES), _leanest(graph, cluster, ())
    assert with_features < without
    budget = (with_features + without) / 2
    lean = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device,
                                                                   memory_bytes=budget / (1 - 0.1)))  # 10 % reserve
    with pytest.raises(InfeasibleError):
        baselines.megatron(graph, lean, features=())
    plan = baselines.megatron(graph, lean)
    assert max(s.memory_bytes for s in plan.stages) <= budget * (1 + 1e-9)
    assert plan.options["megatron"]["zero"] or plan.options["megatron"]["sequence_parallel"]


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
