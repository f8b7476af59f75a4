"""partopt.sweep and `partopt sweep`: the grid's rows against separate optimize calls, the time to train
by hand, a point without a plan, bad specs, the CSV round trip and the plot."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from partopt import io, sweep
from partopt.cli import main
from partopt.cluster import SUBMESH_FAMILIES, preset
from partopt.errors import InstanceError
from partopt.inter import optimize
from partopt.costmodel import STATE_LAYOUTS
from partopt.intra import RECOMPUTE_MODES
from partopt.schedules import SEARCHED
from partopt.models import gpt
from partopt.solvers import BACKENDS

BATCH, SEQ = 8, 32
TOKENS = 1e6
# the tiny GPT's meshes restricted to one data-parallel shape per submesh size: the sweep takes < 1 s
OPTIONS = {"microbatches": 2, "layers": 2, "workers": 1, "logical_shapes": [(2, 1), (4, 1), (8, 1)]}


def tiny_graph():
    return gpt(hidden=64, layers=2, heads=4, seq=SEQ, vocab=128, batch=BATCH, name="tiny-gpt")


def four_v100():
    return dataclasses.replace(preset("p3.16xlarge", 1).narrowed(4), name="four-v100")


def starved():
    """Four V100s of 256 KiB: the tiny GPT's parameter state, 16 B × 110,336 parameters (12·l·h² + 13·l·h +
    (V + s)·h + 2h) = 1.68 MiB, exceeds the 4 × 0.9 × 256 KiB = 0.9 MiB usable on one node."""
    cluster = four_v100()
    return dataclasses.replace(cluster, name="starved", device=dataclasses.replace(cluster.device, memory_bytes=2**18))


@pytest.fixture(scope="module")
def rows():
    spec = sweep.Spec([tiny_graph()], [four_v100()], [1, 2], OPTIONS, tokens=TOKENS)
    return sweep.sweep(spec)


def test_rows_equal_separate_optimize_calls(rows):
    assert [(r.nodes, r.gpus) for r in rows] == [(1, 4), (2, 8)]
    for row in rows:
        alone = optimize(tiny_graph(), four_v100().resized(row.nodes), **OPTIONS)
        assert row.no_plan == ""
        assert row.iteration_time_s == alone.iteration_time_s
        assert row.tflops_per_gpu == alone.throughput["tflops_per_device"]
        assert row.peak_memory_bytes == alone.memory_peak_bytes
        assert row.microbatches == alone.num_microbatches
        assert row.plan == sweep.plan_summary(alone)
        assert row.recompute == sweep.recompute_summary(alone)


def test_varied_schedules_and_state_layouts_are_the_plans_optimize_gives_them():
    vary = {"schedule": ["1f1b", "zero-bubble"], "state_layout": ["zero", "megatron"]}
    spec = sweep.Spec([tiny_graph()], [four_v100()], [1], OPTIONS, vary=vary)
    rows = sweep.sweep(spec)
    assert [r.options for r in rows] == [f"schedule={s}; state_layout={m}" for s in vary["schedule"]
                                         for m in vary["state_layout"]]
    for row, point in zip(rows, sweep.points(spec)):
        alone = optimize(tiny_graph(), four_v100(), **OPTIONS, **point.varied)
        assert (row.iteration_time_s, row.peak_memory_bytes) == (alone.iteration_time_s, alone.memory_peak_bytes)


def test_points_share_layer_solutions(rows):
    """The 2-node point reuses the layers priced on meshes inside one node at 1 node: it solves fewer ILPs
    than the same call alone."""
    alone = optimize(tiny_graph(), four_v100().resized(2), **OPTIONS)
    assert rows[1].ilps_solved < alone.solver["ilps"]


def test_time_to_train_and_gpu_hours_by_hand(rows):
    for row in rows:
        assert row.tokens_per_iteration == BATCH * SEQ
        iterations = TOKENS / (BATCH * SEQ)
        assert row.time_to_train_s == pytest.approx(iterations * row.iteration_time_s, rel=1e-12)
        assert row.gpu_hours == pytest.approx(row.gpus * row.time_to_train_s / 3600, rel=1e-12)


def test_summaries_name_stages_and_modes(rows):
    plan = optimize(tiny_graph(), four_v100(), **OPTIONS)
    shapes = [(tuple(s.submesh), tuple(s.logical_mesh)) for s in plan.stages]
    assert sweep.plan_summary(plan) == " + ".join(
        f"{shapes.count(x)} × ({x[0][0]}, {x[0][1]}) mesh ({x[1][0]}, {x[1][1]})" for x in dict.fromkeys(shapes))
    mixed = dataclasses.replace(plan, stages=[dataclasses.replace(s, recompute=m)
                                              for s, m in zip(plan.stages * 2, ["full", "none", "full", "full"])])
    assert sweep.recompute_summary(mixed) == "full ×3, none ×1"


def test_a_point_without_plan_is_a_row_not_an_error():
    spec = sweep.Spec([tiny_graph()], [starved(), four_v100()], [1], OPTIONS, tokens=TOKENS)
    bad, good = sweep.sweep(spec)
    assert "no plan fits" in bad.no_plan and "tiny-gpt on starved" in bad.no_plan and "short by" in bad.no_plan
    assert (bad.plan, bad.iteration_time_s, bad.time_to_train_s, bad.gpu_hours) == ("", None, None, None)
    assert good.no_plan == "" and good.iteration_time_s > 0


def test_varied_options_multiply_the_grid():
    spec = sweep.spec_from_dict({"format": "partopt.sweep", "version": 1, "models": ["gpt-350m", "gpt-760m"],
                                 "clusters": ["p3.16xlarge", "dgx-a100"], "nodes": [4, 1, 2],
                                 "vary": {"recompute": ["none", "full"], "layers": [8, 16, 24]}})
    grid = sweep.points(spec)
    assert len(grid) == 2 * 2 * (2 * 3) * 3
    assert [p.cluster.nodes for p in grid[:3]] == [1, 2, 4]  # node counts ascending within a combination
    assert {tuple(p.varied.items()) for p in grid} == {(("recompute", r), ("layers", n))
                                                       for r in ("none", "full") for n in (8, 16, 24)}


def test_csv_round_trip(rows, tmp_path):
    spec = sweep.Spec([tiny_graph()], [starved()], [1], OPTIONS)
    table = [*rows, *sweep.sweep(spec)]  # a row without a plan holds empty cells
    path = tmp_path / "sweep.csv"
    sweep.write_csv(table, path)
    assert sweep.read_csv(path) == table
    path.write_text("model,gpus\ngpt,8\n")
    with pytest.raises(InstanceError, match="not a sweep table"):
        sweep.read_csv(path)


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot_written(rows, tmp_path, suffix, magic):
    path = tmp_path / f"plot{suffix}"
    sweep.plot(rows, path)
    assert path.read_bytes().startswith(magic)


def test_plot_refuses_other_formats(rows, tmp_path):
    with pytest.raises(InstanceError, match="png or \\*.svg"):
        sweep.plot(rows, tmp_path / "plot.pdf")
    assert not (tmp_path / "plot.pdf").exists()


def test_schema_names_the_code_choices():
    defs = io.load_schema("sweep")["$defs"]
    assert defs["backend"]["enum"] == list(BACKENDS)
    assert defs["recompute"]["enum"] == ["auto", *RECOMPUTE_MODES]
    assert defs["submesh_family"]["enum"] == list(SUBMESH_FAMILIES)
    assert defs["schedule"]["enum"] == ["auto", *SEARCHED]  # the schedules the search plans
    assert defs["state_layout"]["enum"] == list(STATE_LAYOUTS)


# ---------------------------------------------------------------- the command

def write_files(directory, **spec):
    io.write_graph(tiny_graph(), directory / "tiny.json")
    io.write_cluster(four_v100(), directory / "four.json")
    data = {"format": "partopt.sweep", "version": 1, "models": ["tiny.json"], "clusters": ["four.json"],
            "nodes": [1], "options": {"microbatches": 2, "layers": 2, "workers": 1}, **spec}
    (directory / "spec.json").write_text(json.dumps(data))
    return str(directory / "spec.json")


def test_command_writes_csv_and_plot(tmp_path):
    spec = write_files(tmp_path, tokens=1e9)
    result = CliRunner().invoke(main, ["sweep", spec, "-o", str(tmp_path / "t.csv"), "--plot", str(tmp_path / "p.png"),
                                       "--tokens", "2e9"])
    assert result.exit_code == 0, result.output
    (row,) = sweep.read_csv(tmp_path / "t.csv")
    assert (row.model, row.cluster, row.gpus, row.no_plan) == ("tiny-gpt", "four-v100", 4, "")
    assert row.tokens == 2e9  # --tokens overrides the spec's
    assert row.time_to_train_s == pytest.approx(2e9 / (BATCH * SEQ) * row.iteration_time_s, rel=1e-12)
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    assert "1 grid points, 1 planned" in result.output


def test_tokens_are_refused_and_documented_as_a_count_not_seconds(tmp_path):
    spec = write_files(tmp_path)
    result = CliRunner().invoke(main, ["sweep", spec, "--tokens", "0"])
    assert result.exit_code == 2 and "'0' is not a finite positive count of tokens" in result.stderr
    assert "seconds" not in result.stderr.lower()
    help_text = CliRunner().invoke(main, ["sweep", "--help"]).output
    assert "--tokens TOKENS" in help_text and "SECONDS" not in help_text


@pytest.mark.parametrize("change, place", [
    ({"nodes": [0]}, "$.nodes[0]"),
    ({"models": ["no-such-model"]}, "$.models[0]"),
    ({"models": [{"preset": "gpt-350m", "params": {"depth": 3}}]}, "$.models[0]"),
    ({"clusters": ["no-such.json"]}, "$.clusters[0]"),
    ({"options": {"recompute": "sometimes"}}, "$.options.recompute"),
    ({"options": {"layers": 2}, "vary": {"layers": [2, 4]}}, "$.vary.layers"),
    ({"format": "partopt.plan"}, "$.format"),
    ({"size": 3}, "$.size"),
])
def test_bad_spec_exits_2_with_one_line(tmp_path, change, place):
    spec = write_files(tmp_path, **change)
    result = CliRunner().invoke(main, ["sweep", spec, "-o", str(tmp_path / "t.csv")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {spec}: {place}")
    assert not (tmp_path / "t.csv").exists()


@pytest.mark.parametrize("change, place", [
    ({"options": {"microbatches": 3, "layers": 2, "workers": 1}}, "$.options.microbatches"),
    ({"options": {"layers": 2, "workers": 1}, "vary": {"microbatches": [2, 3]}}, "$.vary.microbatches"),
])
def test_an_option_no_point_can_take_is_placed_in_the_spec(tmp_path, change, place):
    """The tiny GPT's batch of 8 does not split into 3 microbatches: the row names the spec's option, not
    solve's --microbatches flag."""
    spec = write_files(tmp_path, **change)
    bad = sweep.sweep(sweep.read_spec(spec))[-1]
    assert bad.no_plan.startswith(f"{spec}: {place}: batch 8 is not divisible into 3 microbatches"), bad.no_plan


def test_bad_outputs_are_refused_before_the_work(tmp_path):
    spec = write_files(tmp_path)
    for args in (["--plot", str(tmp_path / "p.pdf")], ["-o", str(tmp_path / "missing" / "t.csv")]):
        result = CliRunner().invoke(main, ["sweep", spec, *args])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
