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


def _layouts(features, layers=4):
    """Every Megatron layout of 4 devices and `layers` layers: (tp, pp, dp, sequence parallel, distributed optimizer,
    v), each feature only where it applies (tp > 1, dp > 1, pp > 1 with v dividing a stage's layers) and is in
    `features`."""
    for tp, pp, dp in [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]:
        for sp in (False, True) if tp > 1 and "sequence_parallel" in features else (False,):
            for zero in (False, True) if dp > 1 and "distributed_optimizer" in features else (False,):
                for v in range(1, layers // pp + 1) if pp > 1 and "interleaved" in features else (1,):
                    if (layers // pp) % v == 0:
                        yield tp, pp, dp, sp, zero, v


def _grid(graph, cluster, features):
    """Every Megatron grid point of a 4-device cluster priced, by brute force, its state as Megatron-LM keeps it:
    (tp, pp, dp, B, sequence parallel, distributed optimizer, v) -> iteration time (interleaved: B a multiple of pp)."""
    times, batch = {}, graph.dims[graph.batch_dim]
    for tp, pp, dp, sp, zero, v in _layouts(features, len(graph.layers)):
        for count in (c for c in (1, 2, 4, 8, 16) if c <= batch):
            if count < pp or (batch // count) % dp or (v > 1 and count % pp):
                continue
            try:
                plan = uniform(graph, cluster, tp, pp, dp, count, zero=zero, sequence_parallel=sp, state_layout="megatron",
                               schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
            except InfeasibleError:
                continue
            times[(tp, pp, dp, count, sp, zero, v)] = plan.iteration_time_s
    return times


def _label(tp, pp, dp, count, sp, zero, v) -> str:
    return (f"tp {tp} · pp {pp} · dp {dp} · B {count}" + " · sequence parallel" * sp + " · distributed optimizer" * zero
            + f" · interleaved v {v}" * (v > 1))


@pytest.mark.parametrize("features", [baselines.MEGATRON_FEATURES, ()])
def test_megatron_finds_the_fastest_grid_point(small, features):
    """With Megatron-LM's features (the default) and without them (Megatron-LM as Alpa ran it)."""
    graph, cluster = small
    times = _grid(graph, cluster, features)
    best = baselines.megatron(graph, cluster, features=features)
    assert best.iteration_time_s == min(times.values())
    assert baselines.megatron_grid_point(best) == _label(*min(times, key=times.get))
    # its account is the grid's: every layout it priced, and more ILPs than its best point's alone
    layouts = len(list(_layouts(features)))
    assert best.solver["search"][0].startswith(f"Megatron-LM's grid: the best of {layouts} layouts")
    m = best.options["megatron"]
    alone = uniform(graph, cluster, m["tp"], m["pp"], m["dp"], best.num_microbatches, zero=m["zero"],
                    sequence_parallel=m["sequence_parallel"], schedule=best.schedule,
                    virtual_stages=best.virtual_stages, state_layout="megatron")
    assert best.solver["ilps"] > alone.solver["ilps"]


def test_megatron_interleaves_when_memory_forces_a_deep_pipeline(tmp_path):
    """Under 0.2 GiB per device an 8-layer GPT fits only as a 4-stage pipeline of 8 microbatches, whose bubble the
    interleaved schedule shrinks ((B + (pp - 1) / v) slots): the grid's best is the brute-force best of every point,
    interleaved ones included, and is interleaved, as it is with the schedule asked for alone; with 1F1B alone
    (`solve --search megatron --schedule 1f1b`) the grid finds the best 1F1B point."""
    from click.testing import CliRunner

    from partopt.cli import main
    from partopt.io import write_cluster, write_graph
    from partopt.plan import read_plan

    graph = models.gpt(hidden=512, layers=8, heads=8, seq=256, vocab=1024, batch=8)
    cluster = preset("p3.16xlarge", 1).narrowed(4)
    lean = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=0.2 * 2**30))
    times = _grid(graph, lean, baselines.MEGATRON_FEATURES)
    fastest = min(times, key=times.get)
    assert fastest[-1] > 1  # an interleaved point is the fastest: the case tests the feature
    best = baselines.megatron(graph, lean)
    assert best.iteration_time_s == times[fastest] and best.schedule == "interleaved"
    assert baselines.megatron_grid_point(best) == _label(*fastest)
    alone = baselines.megatron(graph, lean, schedule="interleaved")
    assert alone.iteration_time_s == times[fastest] and alone.schedule == "interleaved"
    write_graph(graph, tmp_path / "g.json")
    write_cluster(lean, tmp_path / "c.json")
    result = CliRunner().invoke(main, ["solve", str(tmp_path / "g.json"), "--cluster", str(tmp_path / "c.json"),
                                       "--search", "megatron", "--schedule", "1f1b", "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    no_interleaving = read_plan(tmp_path / "plan.json")
    assert no_interleaving.schedule == "1f1b"
    assert no_interleaving.iteration_time_s == pytest.approx(min(t for k, t in times.items() if k[-1] == 1), rel=1e-12)


def _leanest(graph, cluster, features) -> float:
    """The least per-device memory of any grid point of `small` with `features`: full recomputation, one sample per
    microbatch and rank (B = 16 / dp)."""
    return min(uniform(graph, cluster, tp, pp, dp, 16 // dp, zero=zero, sequence_parallel=sp, recompute="full",
                       check_memory=False, state_layout="megatron").memory_peak_bytes
               for tp, pp, dp, sp, zero, v in _layouts(features) if v == 1)


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
    for flag, value in (("--microbatches", "2"), ("--workers", "1"), ("--ray-address", "auto")):  # the grid reads none
        refused = CliRunner().invoke(main, ["solve", str(tmp_path / "g.json"), "--cluster", str(tmp_path / "c.json"),
                                            "--search", "megatron", flag, value])
        assert refused.exit_code == 2 and refused.stderr.splitlines() == [
            f"error: {flag}: --search megatron prices its own grid of layouts in this process, and does not read "
            f"{flag} (hint: drop it, or plan with the default search)"]
