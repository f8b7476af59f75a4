"""partopt.draw: stage_times reproduces a plan's closed form; both formats written, sized and counted."""

from __future__ import annotations

import struct
import xml.etree.ElementTree as ET

import pytest

from click.testing import CliRunner

from partopt import models
from partopt.cli import main
from partopt.cluster import preset
from partopt.draw import draw, plan_budget, stage_times
from partopt.errors import InstanceError
from partopt.inter import optimize
from partopt.plan import Plan, StagePlan, write_plan
from partopt.simulate import closed_form, simulate

SVG = "{http://www.w3.org/2000/svg}"
MS = 1e-3
GIB = 2**30


def _stage(i: int, num: int, stage_time: float, forward: float, send: float, sync: float,
           params: float = 2 * GIB, acts: float = 0.5 * GIB, microbatches: int = 4) -> StagePlan:
    inflight = min(num - i, microbatches)
    return StagePlan(layers=[2 * i, 2 * i + 1], graph_layers=[2 * i, 2 * i + 1], submesh=[1, 2], logical_mesh=[2, 1],
                     devices=[2 * i, 2 * i + 1], stage_time_s=stage_time, forward_s=forward, send_time_s=send,
                     sync_time_s=sync, memory_bytes=params + inflight * acts, inflight_microbatches=inflight,
                     breakdown={"param_bytes": params, "activation_bytes": acts}, ops={}, params={})


def _plan(stages: list[StagePlan], microbatches: int, cluster: str = "p3.16xlarge", iteration: float = 0.0) -> Plan:
    """A one-node plan whose node holds exactly its stages' devices (so they tile it, as a valid plan's must)."""
    return Plan(graph="hand", cluster=cluster, nodes=1, devices_per_node=2 * len(stages), iteration_time_s=iteration,
                num_microbatches=microbatches, microbatch_size=2, stages=stages,
                memory_peak_bytes=max(s.memory_bytes for s in stages), throughput={}, solver={},
                options={"memory_reserve": 0.1})


def _four_stages(microbatches: int = 4) -> Plan:
    """Hand-derived: t = (30, 40, 20, 25) ms, syncs (5, 7, 3, 6) ms; sum 115 + (B-1) 40 + 7."""
    times = [(30, 10, 6, 5), (40, 12, 8, 7), (20, 6, 4, 3), (25, 8, 0, 6)]  # stage, forward, send round trip, sync (ms)
    stages = [_stage(i, 4, t * MS, f * MS, s * MS, y * MS, microbatches=microbatches) for i, (t, f, s, y) in enumerate(times)]
    return _plan(stages, microbatches, iteration=(115 + (microbatches - 1) * 40 + 7) * MS)


def _one_stage(microbatches: int = 4) -> Plan:
    return _plan([_stage(0, 1, 30 * MS, 10 * MS, 0.0, 5 * MS, microbatches=microbatches)], microbatches,
                 iteration=(30 * microbatches + 5) * MS)


def _png_height(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])[1]


def _svg_height_pt(path) -> float:
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    return float(root.get("height").removesuffix("pt"))


def _group(root: ET.Element, gid: str) -> ET.Element:
    (group,) = [g for g in root.iter(f"{SVG}g") if g.get("id") == gid]
    return group


# ---------------------------------------------------------------- stage_times


@pytest.mark.parametrize("microbatches", [1, 4, 9])
def test_stage_times_reproduce_the_closed_form(microbatches):
    plan = _four_stages(microbatches)
    times = stage_times(plan)
    latency = [s.latency_s for s in times]
    assert latency == pytest.approx([30 * MS, 40 * MS, 20 * MS, 25 * MS], rel=1e-12)
    total = sum(latency) + (microbatches - 1) * max(latency) + max(s.sync_time_s for s in plan.stages)
    assert total == pytest.approx(plan.iteration_time_s, rel=1e-12)
    assert closed_form(times, microbatches) + 7 * MS == pytest.approx(plan.iteration_time_s, rel=1e-12)


def test_stage_times_split_compute_by_the_forward_share_and_halve_the_round_trip():
    # stage 0: t = 30 ms, forward share 10/30, round trip 6 ms -> send 3 ms each way, compute 24 ms = 8 + 16
    first = stage_times(_four_stages())[0]
    assert first.send_s == pytest.approx(3 * MS)
    assert first.forward_s == pytest.approx(8 * MS)
    assert first.backward_s == pytest.approx(16 * MS)
    assert first.static_bytes == 2 * GIB and first.activation_bytes == 0.5 * GIB
    assert all(s.backward_s >= 0 and s.forward_s >= 0 for s in stage_times(_four_stages()))


def test_stage_times_reject_a_send_longer_than_the_stage():
    plan = _four_stages()
    plan.stages[1].send_time_s = 50 * MS
    with pytest.raises(InstanceError, match=r"stages\[1\]\.send_time_s"):
        stage_times(plan)


def test_stage_times_take_a_stage_that_is_all_send_as_rounded():
    """An interleaved plan's stage per device adds its chunks' times and sends apart (`plan.by_device`): a stage that
    is all send may come out with the send a rounding above the stage. It is all send, no compute, not an error."""
    plan = _four_stages()
    plan.stages[1].send_time_s = plan.stages[1].stage_time_s * (1 + 1e-15)
    second = stage_times(plan)[1]
    assert second.forward_s == 0 and second.backward_s == 0
    assert second.send_s == pytest.approx(plan.stages[1].stage_time_s / 2)


def test_one_stage_simulation_is_serial():
    # one stage, B microbatches: forward and backward back to back, B (f + b) = 4 * 30 ms
    assert simulate(stage_times(_one_stage()), 4).iteration_time_s == pytest.approx(120 * MS)


def test_budget_of_a_preset_is_its_memory_minus_the_reserve():
    assert plan_budget(_four_stages()) == pytest.approx(16 * GIB * 0.9)  # V100 16 GiB, reserve 0.1
    assert plan_budget(_plan(_four_stages().stages, 4, cluster="my-own-cluster")) is None


# ---------------------------------------------------------------- files


def test_png_and_svg_are_written(tmp_path):
    plan = _four_stages()
    draw(plan, tmp_path / "t.png")
    draw(plan, tmp_path / "t.svg")
    assert _png_height(tmp_path / "t.png") > 0
    assert (tmp_path / "t.svg").stat().st_size > 0
    assert _svg_height_pt(tmp_path / "t.svg") > 0


def test_more_stages_make_a_taller_picture(tmp_path):
    draw(_one_stage(), tmp_path / "one.png")
    draw(_four_stages(), tmp_path / "four.png")
    draw(_one_stage(), tmp_path / "one.svg")
    draw(_four_stages(), tmp_path / "four.svg")
    assert _png_height(tmp_path / "four.png") > _png_height(tmp_path / "one.png")
    assert _svg_height_pt(tmp_path / "four.svg") > _svg_height_pt(tmp_path / "one.svg")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_svg_has_one_block_per_stage_and_microbatch(tmp_path, schedule):
    microbatches = 5
    draw(_four_stages(microbatches), tmp_path / "t.svg", schedule=schedule)
    root = ET.parse(tmp_path / "t.svg").getroot()
    for kind in ("forward", "backward"):
        counts = [len(_group(root, f"{kind}-{i}").findall(f"{SVG}path")) for i in range(4)]
        assert counts == [microbatches] * 4
    assert [len(_group(root, f"sync-{i}").findall(f"{SVG}path")) for i in range(4)] == [1] * 4
    assert any(g.get("id") == "memory-budget" for g in root.iter(f"{SVG}g"))


def test_no_budget_line_for_an_unknown_cluster(tmp_path):
    draw(_plan(_four_stages().stages, 4, cluster="my-own-cluster", iteration=_four_stages().iteration_time_s),
         tmp_path / "t.svg")
    root = ET.parse(tmp_path / "t.svg").getroot()
    assert not any(g.get("id") == "memory-budget" for g in root.iter(f"{SVG}g"))


def test_output_is_deterministic(tmp_path):
    for suffix in ("svg", "png"):
        draw(_four_stages(), tmp_path / f"a.{suffix}")
        draw(_four_stages(), tmp_path / f"b.{suffix}")
        assert (tmp_path / f"a.{suffix}").read_bytes() == (tmp_path / f"b.{suffix}").read_bytes()
    assert b"Matplotlib" not in (tmp_path / "a.png").read_bytes()
    assert b"<dc:date>" not in (tmp_path / "a.svg").read_bytes()


def _labels(root: ET.Element) -> set[str]:
    return {g.get("id") for g in root.iter(f"{SVG}g") if (g.get("id") or "").startswith("label-")}


def test_microbatch_numbers_only_in_blocks_wide_enough(tmp_path):
    draw(_four_stages(4), tmp_path / "few.svg")
    draw(_four_stages(128), tmp_path / "many.svg")
    few, many = (ET.parse(tmp_path / name).getroot() for name in ("few.svg", "many.svg"))
    # the narrowest block is stage 2's forward, (20 - 4) * 6/20 = 4.8 ms; the axis is 7.2 in = 518 pt wide.
    # 4 microbatches: iteration <= 115 + 3 * 40 + 7 = 242 ms, so >= 10 pt, room for one digit (6 pt)
    assert _labels(few) == {f"label-{k}-{i}-{m}" for k in ("forward", "backward") for i in range(4) for m in range(4)}
    # 128 microbatches: iteration >= 128 * 40 ms (stage 1's work), so 4.8 ms is under 0.5 pt
    assert _labels(many) == set()
    assert len(_group(many, "forward-0").findall(f"{SVG}path")) == 128


@pytest.mark.parametrize("name", ["t.pdf", "t", "t.svg.gz"])
def test_bad_suffix_is_an_instance_error(tmp_path, name):
    with pytest.raises(InstanceError, match=r"\.svg or \*\.png") as info:
        draw(_one_stage(), tmp_path / name)
    assert name in info.value.line()
    assert not (tmp_path / name).exists()


def test_missing_directory_is_an_instance_error(tmp_path):
    with pytest.raises(InstanceError, match="does not exist"):
        draw(_one_stage(), tmp_path / "no" / "such" / "t.png")
    assert not (tmp_path / "no").exists()


def test_unknown_schedule_is_an_instance_error(tmp_path):
    with pytest.raises(InstanceError, match="unknown pipeline schedule"):
        draw(_one_stage(), tmp_path / "t.svg", schedule="zb-h2")


def test_interleaved_without_virtual_stages_is_an_instance_error(tmp_path):
    with pytest.raises(InstanceError, match="at least 2 virtual stages") as info:
        draw(_four_stages(), tmp_path / "t.svg", schedule="interleaved")
    assert info.value.where == "virtual_stages"
    assert not (tmp_path / "t.svg").exists()


def test_zero_virtual_stages_are_an_instance_error_not_the_plans(tmp_path):
    with pytest.raises(InstanceError, match="integer >= 1, got 0") as info:
        draw(_one_stage(), tmp_path / "t.svg", virtual_stages=0)  # 0 used to mean "the plan's v"
    assert info.value.where == "virtual_stages"
    assert not (tmp_path / "t.svg").exists()


def test_more_chunk_microbatches_than_drawable_are_an_instance_error(tmp_path):
    # B = 4, v = 1025: 4 · 1025 = 4100 chunk-microbatches per stage row, over 4096 (v = 10^6 never finished)
    with pytest.raises(InstanceError, match="B·v = 4100 chunk-microbatches per stage") as info:
        draw(_four_stages(4), tmp_path / "t.svg", schedule="interleaved", virtual_stages=1025)
    assert info.value.where == "virtual_stages" and "at most 1024 virtual stages" in info.value.hint
    assert not (tmp_path / "t.svg").exists()


def test_interleaved_draws_every_chunk_and_its_extra_inflight(tmp_path):
    # 4 stages, B = 4, v = 2: each stage runs 4 microbatches x 2 chunks of forwards and of backwards.
    # B = S: Megatron warms up completely, so each stage holds all 8 chunk-microbatches = 4 stage-activations.
    draw(_four_stages(4), tmp_path / "t.svg", schedule="interleaved", virtual_stages=2)
    root = ET.parse(tmp_path / "t.svg").getroot()
    for kind in ("forward", "backward"):
        assert [len(_group(root, f"{kind}-{i}").findall(f"{SVG}path")) for i in range(4)] == [8] * 4
    assert not any((g.get("id") or "").startswith("weight-") for g in root.iter(f"{SVG}g"))
    assert "label-forward-0-0-c1" in _labels(root)


def test_zero_bubble_draws_weight_passes_of_half_the_backward(tmp_path):
    times = stage_times(_four_stages())
    assert [s.weight_s for s in times] == [s.backward_s / 2 for s in times]
    draw(_four_stages(5), tmp_path / "t.svg", schedule="zero-bubble")
    root = ET.parse(tmp_path / "t.svg").getroot()
    for kind in ("forward", "backward", "weight"):
        assert [len(_group(root, f"{kind}-{i}").findall(f"{SVG}path")) for i in range(4)] == [5] * 4


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A solved plan on file: GPT of 8 layers on one p3 node, 8 stages, B = 8 (a multiple of S, as interleaved needs)."""
    graph = models.gpt(hidden=256, layers=8, heads=4, seq=128, vocab=1024, batch=64)
    plan = optimize(graph, preset("p3.16xlarge", 1), microbatches=8, inter_only=True)
    assert len(plan.stages) == plan.num_microbatches == 8
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    write_plan(plan, path)
    return path


@pytest.mark.parametrize("args, code", [
    (["--schedule", "interleaved", "--virtual-stages", "2"], 0),
    (["--schedule", "zero-bubble"], 0),
    (["--schedule", "interleaved"], 2),  # v missing: one line, exit 2
    (["--schedule", "1f1b", "--virtual-stages", "2"], 2),
    (["--schedule", "interleaved", "--virtual-stages", "513"], 2),  # B·v = 8 · 513 = 4104 > 4096: one line, exit 2
])
def test_cli_draws_the_new_schedules(plan_file, tmp_path, args, code):
    result = CliRunner().invoke(main, ["draw", str(plan_file), "-o", str(tmp_path / "t.svg"), *args])
    assert result.exit_code == code, result.output
    if code:
        assert result.stderr.startswith("error: --virtual-stages: ")  # the flag, where the library names its keyword
        assert len(result.stderr.strip().splitlines()) == 1
        assert "Traceback" not in result.output and not (tmp_path / "t.svg").exists()
    else:
        assert (tmp_path / "t.svg").stat().st_size > 0


@pytest.mark.parametrize("value", ["0", "-3"])
def test_cli_refuses_fewer_than_one_virtual_stage(plan_file, tmp_path, value):
    """--virtual-stages 0 drew the plan's own v and wrote the file; the option takes 1 or more, as --nodes does."""
    result = CliRunner().invoke(main, ["draw", str(plan_file), "-o", str(tmp_path / "t.svg"),
                                       "--virtual-stages", value])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "'--virtual-stages'" in result.stderr and f"{value} is not in the range x>=1" in result.stderr
    assert not (tmp_path / "t.svg").exists()
