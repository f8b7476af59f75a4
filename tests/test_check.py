"""`partopt check`: solved plans re-derive clean; an edited time, memory or device list is reported
(exit 1), as is a plan whose memory no longer fits; `solve` refuses to write a plan that does not
re-derive."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt import check
from partopt.cli import main
from partopt.inter import optimize
from partopt.models import gpt
from partopt.plan import plan_from_dict


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def edited(tiny, tmp_path, change) -> str:
    data = json.loads(Path(tiny.plan_file).read_text())
    change(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return str(path)


def check_cli(tiny, plan: str):
    return run("check", plan, "--graph", tiny.graph_file, "--cluster", tiny.cluster_file)


def test_a_solved_plan_checks_clean(tiny):
    result = check_cli(tiny, tiny.plan_file)
    assert result.exit_code == 0, result.output + result.stderr
    assert "consistent" in result.stdout


@pytest.mark.parametrize("search", [{"inter_only": True}, {"intra_only": True}, {"data_parallel_only": True},
                                    {"stage_data_parallel": True}, {"recompute": True},
                                    {"logical_shapes": "all", "microbatches": [1, 2], "layers": 3}])
def test_solved_plans_of_every_search_re_derive(tiny, search):
    options = {"microbatches": 2, "layers": 2, "workers": 1, **search}
    # inter-only puts each stage on one device: two devices for the tiny graph's two layers
    cluster = tiny.cluster.narrowed(2) if "inter_only" in search else tiny.cluster
    plan = optimize(tiny.graph, cluster, **options)
    assert check.differences(plan, tiny.graph, cluster) == []


def test_an_edited_stage_time_is_reported_with_the_iteration_it_implies(tiny, tmp_path):
    slower = edited(tiny, tmp_path, lambda d: d["stages"][1].__setitem__("stage_time_s", d["stages"][1]["stage_time_s"] * 2))
    result = check_cli(tiny, slower)
    assert result.exit_code == 1
    stored = json.loads(Path(tiny.plan_file).read_text())["stages"][1]["stage_time_s"]
    lines = result.stdout.splitlines()
    assert f"{slower}: $.stages[1].stage_time_s: the plan says {stored * 2!r}, re-derived {stored!r}" in lines
    assert any(line.startswith(f"{slower}: $.iteration_time_s: the plan says") for line in lines)


def test_an_edited_memory_is_reported(tiny, tmp_path):
    def smaller(d):  # consistent on its own (parts and total halved), but not what the graph needs
        s = d["stages"][0]
        s["breakdown"]["param_bytes"] /= 2
        s["memory_bytes"] = s["breakdown"]["param_bytes"] + s["inflight_microbatches"] * s["breakdown"]["activation_bytes"] \
            + s["breakdown"]["working_bytes"]
        d["memory_peak_bytes"] = max(x["memory_bytes"] for x in d["stages"])
    result = check_cli(tiny, edited(tiny, tmp_path, smaller))
    assert result.exit_code == 1
    assert "$.stages[0].memory_bytes: the plan says" in result.stdout


@pytest.mark.parametrize("figure", [("compute_s",), ("state_bytes", "optimizer")])
def test_an_edited_breakdown_figure_is_reported(tiny, tmp_path, figure):
    """What `explain` shows of a stage is re-derived too: a breakdown figure edited alone (its stage's totals left
    as they were) is a difference at its own path."""
    def edit(d):
        record = d["stages"][0]["breakdown"]
        for key in figure[:-1]:
            record = record[key]
        record[figure[-1]] = 99.0
    result = check_cli(tiny, edited(tiny, tmp_path, edit))
    assert result.exit_code == 1
    assert f"$.stages[0].breakdown.{'.'.join(figure)}: the plan says 99.0, re-derived" in result.stdout


def test_a_field_the_schema_does_not_describe_still_gets_a_hint(tiny, tmp_path):
    """Every error line says what to do: where the schema has no description for the field, it points to the format."""
    def bad_axis(d):
        name = next(iter(d["stages"][0]["params"]))
        d["stages"][0]["params"][name]["zero_axes"] = [5]
    result = check_cli(tiny, edited(tiny, tmp_path, bad_axis))
    assert result.exit_code == 2
    assert "zero_axes[0]: must be at most 1, got 5 (hint: fix it as docs/FORMAT.md describes the field)" in result.stderr


def test_edited_graph_layers_are_reported(tiny, tmp_path):
    """A stage's `graph_layers` (which `export --to megatron` counts layers by) must be the layers it covers."""
    stored = json.loads(Path(tiny.plan_file).read_text())["stages"][1]["graph_layers"]
    result = check_cli(tiny, edited(tiny, tmp_path, lambda d: d["stages"][1].__setitem__("graph_layers", [0, 1000])))
    assert result.exit_code == 1
    assert f"$.stages[1].graph_layers: the plan says [0, 1000], re-derived {stored!r}" in result.stdout


@pytest.mark.parametrize("field", ["ops", "params"])
def test_an_op_or_parameter_left_out_is_reported(tiny, tmp_path, field):
    """A stage that lists no entry for one of its ops or parameters re-derives the same figures (pricing chooses
    one) but does not say how that one is sharded, and an export would drop it: reported by name."""
    data = json.loads(Path(tiny.plan_file).read_text())
    name = next(iter(data["stages"][0][field]))
    result = check_cli(tiny, edited(tiny, tmp_path, lambda d: d["stages"][0][field].pop(name)))
    assert result.exit_code == 1
    assert f"$.stages[0].{field}.{name}: the plan says 'no entry'" in result.stdout


def test_swapped_devices_are_reported(tiny, tmp_path):
    def swap(d):
        d["stages"][0]["devices"], d["stages"][1]["devices"] = d["stages"][1]["devices"], d["stages"][0]["devices"]
    result = check_cli(tiny, edited(tiny, tmp_path, swap))
    assert result.exit_code == 1
    assert "$.stages[0].devices: the plan says [2, 3], re-derived [0, 1]" in result.stdout


def test_memory_over_the_device_budget_is_reported(tiny, tmp_path):
    # a reserve leaving 1e-9 of the 16 GiB (17 bytes) to a stage that needs megabytes
    squeezed = edited(tiny, tmp_path, lambda d: d["options"].__setitem__("memory_reserve", 1 - 1e-9))
    result = check_cli(tiny, squeezed)
    assert result.exit_code == 1
    assert "$.stages[0].memory_bytes" in result.stdout and "over the device's budget of" in result.stdout


def test_a_figure_at_odds_with_the_plan_s_own_says_so(tiny, tmp_path):
    """A stage's memory edited alone: the peak the file keeps is then at odds with the stages it is the max of, which
    the line says as such (not as a re-derivation), beside the edited stage's own re-derived figure."""
    data = json.loads(Path(tiny.plan_file).read_text())
    peak = data["memory_peak_bytes"]
    stages = [s["memory_bytes"] for s in data["stages"]]
    top = stages.index(max(stages))
    result = check_cli(tiny, edited(tiny, tmp_path, lambda d: d["stages"][top].__setitem__("memory_bytes", 1.0)))
    assert result.exit_code == 1
    others = max([1.0, *(m for i, m in enumerate(stages) if i != top)])
    assert f"$.memory_peak_bytes: the plan says {peak!r}, its other figures give {others!r}" in result.stdout
    assert f"$.stages[{top}].memory_bytes: the plan says 1.0, re-derived" in result.stdout


def test_a_megatron_layout_that_cannot_run_here_is_named_by_its_record(tiny, tmp_path):
    """A uniform plan whose recorded degrees do not multiply to the cluster's devices cannot be priced again: the line
    names the record and the cause, not a figure."""
    from partopt.evaluate import uniform
    from partopt.plan import write_plan

    plan = uniform(tiny.graph, tiny.cluster, tp=2, pp=2, dp=1, microbatches=2)
    plan.options["megatron"]["tp"] = 4
    path = tmp_path / "megatron.json"
    write_plan(plan, path)
    result = check_cli(tiny, str(path))
    assert result.exit_code == 1
    devices = tiny.cluster.num_devices
    assert (f"$.options.megatron: cannot be priced again: tp × pp × dp = 8 but the cluster has {devices} devices"
            in result.stdout), result.stdout


def test_solve_refuses_to_write_a_plan_that_does_not_re_derive(tiny, tmp_path, monkeypatch):
    import partopt.cli

    def off_by_a_bit(graph, cluster, **kwargs):
        plan = optimize(graph, cluster, microbatches=2, layers=2, logical_shapes=[(2, 1)], workers=1)
        stages = [dataclasses.replace(plan.stages[0], sync_time_s=plan.stages[0].sync_time_s * 1.01), *plan.stages[1:]]
        return dataclasses.replace(plan, stages=stages)
    monkeypatch.setattr(partopt.cli, "optimize", off_by_a_bit)
    out = tmp_path / "plan.json"
    result = run("solve", tiny.graph_file, "--cluster", tiny.cluster_file, "-o", out)
    assert result.exit_code == 1
    assert "$.stages[0].sync_time_s" in result.stderr and "nothing written" in result.stderr
    assert not out.exists()


def test_differences_of_a_plan_read_back_are_none(tiny):
    plan = plan_from_dict(json.loads(Path(tiny.plan_file).read_text()))
    assert check.compare(plan, tiny.plan) == []


def test_megatron_layouts_re_derive_as_that_layout(tiny, tmp_path):
    """The tiny GPT ties its embedding to the LM head: priced as written, its copies would be free to
    leave Megatron's layout; `check` prices a uniform plan again as the layout it records."""
    from partopt import baselines
    from partopt.evaluate import uniform
    from partopt.plan import write_plan

    plan = uniform(tiny.graph, tiny.cluster, tp=2, pp=2, dp=1, microbatches=2)
    assert plan.options["megatron"] == {"tp": 2, "pp": 2, "dp": 1, "zero": False, "sequence_parallel": False,
                                      "shard_weights": False, "tp_comm_overlap": False}
    assert check.differences(plan, tiny.graph, tiny.cluster) == []
    deeper = gpt(hidden=64, layers=4, heads=4, seq=32, vocab=128, batch=8)
    uneven = uniform(deeper, tiny.cluster, tp=2, pp=2, dp=1, microbatches=2, stage_layers=[1, 3])
    assert [s.layers for s in uneven.stages] == [[0, 0], [1, 3]]
    assert check.differences(uneven, deeper, tiny.cluster) == []  # re-derived with its own split, not [2, 2]
    best = baselines.megatron(tiny.graph, tiny.cluster)
    assert check.differences(best, tiny.graph, tiny.cluster) == []
    path = tmp_path / "megatron.json"
    write_plan(dataclasses.replace(plan, iteration_time_s=plan.iteration_time_s * 2), path)
    result = check_cli(tiny, path)
    assert result.exit_code == 1 and "$.iteration_time_s" in result.stdout
    solved = run("solve", tiny.graph_file, "--cluster", tiny.cluster_file, "--search", "megatron", "--json")
    assert solved.exit_code == 0, solved.output + solved.stderr


@pytest.mark.parametrize("how", ["uniform", "search"])
def test_a_plan_in_megatron_lm_s_state_layout_re_derives_in_it(tiny, how):
    """A plan records its state layout (`state_layout`: Megatron-LM's fp32 gradients) and `check` prices it again
    in that layout: the same plan read as the ZeRO paper's layout (the record dropped) holds less state."""
    from partopt.evaluate import uniform

    if how == "uniform":
        plan = uniform(tiny.graph, tiny.cluster, tp=1, pp=1, dp=4, microbatches=2, zero=True, state_layout="megatron")
    else:
        plan = optimize(tiny.graph, tiny.cluster, microbatches=2, layers=2, workers=1, state_layout="megatron")
    assert plan.options["state_layout"] == "megatron"
    assert check.differences(plan, tiny.graph, tiny.cluster) == []
    options = {k: v for k, v in plan.options.items() if k != "state_layout"}
    found = check.differences(dataclasses.replace(plan, options=options), tiny.graph, tiny.cluster)
    assert any("memory_bytes" in d.line() for d in found)


def test_evaluate_refuses_a_state_layout_beside_a_plan_file(tiny):
    result = run("evaluate", tiny.graph_file, "--cluster", tiny.cluster_file, "--plan", tiny.plan_file,
                 "--state-layout", "megatron")
    assert result.exit_code != 0 and "--state-layout" in result.stderr and "Traceback" not in result.output
