"""Every file a user hands partopt is checked before use: each failure class the issue reported
(tracebacks, silently priced impossible plans, files written before a crash) is now one `error:` line
naming the file, the JSON path and what to do, exit code 2, and nothing written."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt import io, validate
from partopt.cli import main
from partopt.cluster import preset
from partopt.errors import InstanceError
from partopt.graph import DTYPE_BYTES, MATMUL_DTYPES
from partopt.inter import optimize
from partopt.plan import plan_from_dict, plan_to_dict

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "instances" / "mlp-2layer.json")


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result, *fragments: str) -> str:
    """The run failed with exit 2 and exactly one stderr line, `error: …`, holding every fragment."""
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output + result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def mutated(tiny, tmp_path, change, name: str = "bad.json") -> str:
    """The tiny plan's file with `change(data)` applied, written to tmp_path/name."""
    data = json.loads(Path(tiny.plan_file).read_text())
    change(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def commands(tiny, plan: str, tmp_path) -> list[list[str]]:
    """Every command that reads a plan file."""
    where = ["--cluster", tiny.cluster_file]
    return [["evaluate", tiny.graph_file, *where, "--plan", plan], ["explain", plan],
            ["export", plan, "--to", "jax"], ["draw", plan, "-o", tmp_path / "out.svg"],
            ["check", plan, "--graph", tiny.graph_file, *where]]


def assert_refused_everywhere(tiny, tmp_path, change, *fragments: str) -> None:
    plan = mutated(tiny, tmp_path, change)
    for command in commands(tiny, plan, tmp_path):
        one_error_line(run(*command), plan, *fragments)
    assert not (tmp_path / "out.svg").exists()


def test_the_solved_plan_passes_every_check(tiny):
    plan = plan_from_dict(json.loads(Path(tiny.plan_file).read_text()))
    validate.check_plan(plan)
    validate.check_against(plan, tiny.graph, tiny.cluster)
    assert plan_to_dict(plan) == plan_to_dict(tiny.plan)  # round trip


def set_stage(i: int, field: str, value):
    return lambda d: d["stages"][i].__setitem__(field, value)


@pytest.mark.parametrize("value,fragment", [(["a", 2], "$.stages[0].submesh[0]: expected integer, got string"),
                                            ([2], "$.stages[0].submesh: has 1 entries"),
                                            ([1, 2, 3], "$.stages[0].submesh: has 3 entries"),
                                            ([0, 2], "$.stages[0].submesh[0]: must be at least 1")])
def test_malformed_submeshes_are_refused_not_tracebacks(tiny, tmp_path, value, fragment):
    assert_refused_everywhere(tiny, tmp_path, set_stage(0, "submesh", value), fragment)


def test_submeshes_that_do_not_tile_the_cluster_are_refused(tiny, tmp_path):
    def shrink(d):  # stage 1 on one device: 3 of the 4 devices used (was a bare StopIteration)
        d["stages"][1].update(submesh=[1, 1], logical_mesh=[1, 1], devices=[2])
    assert_refused_everywhere(tiny, tmp_path, shrink, "$.stages: the stages use 3 of the cluster's 4 devices")
    too_big = set_stage(0, "submesh", [2, 4])  # two nodes on a one-node cluster
    assert_refused_everywhere(tiny, tmp_path, too_big, "$.stages[0].submesh: submesh [2, 4] is not a submesh")


def test_logical_meshes_must_factor_their_submesh(tiny, tmp_path):
    assert_refused_everywhere(tiny, tmp_path, set_stage(0, "logical_mesh", [3, 1]),
                              "$.stages[0].logical_mesh: logical mesh [3, 1] has 3 devices")


@pytest.mark.parametrize("devices,fragment", [
    ([-1, 0], "$.stages[0].devices[0]: must be at least 0"),
    ([], "$.stages[0].devices: has 0 entries"),
    (["0", 1], "$.stages[0].devices[0]: expected integer"),
    ([0, 0], "$.stages[0].devices: names an entry twice"),
    ([0, 9], "$.stages[0].devices[1]: device 9 does not exist"),
    ([0, 1, 2], "$.stages[0].devices: 3 devices for submesh [1, 2]"),
    ([2, 3], "$.stages[1].devices[0]: device 2 is also used by stage 0"),
])
def test_device_lists_must_be_distinct_existing_and_sized(tiny, tmp_path, devices, fragment):
    assert_refused_everywhere(tiny, tmp_path, set_stage(0, "devices", devices), fragment)


def test_stored_numbers_that_are_not_finite_negative_or_inconsistent_are_refused(tiny, tmp_path):
    def nan(d):
        d["stages"][0]["memory_bytes"] = float("nan")
    path = mutated(tiny, tmp_path, nan)
    assert "NaN" in Path(path).read_text()
    one_error_line(run("explain", path), path, "NaN is not a JSON number")
    negative = lambda d: d["stages"][0]["breakdown"].__setitem__("param_bytes", -1e10)
    assert_refused_everywhere(tiny, tmp_path, negative, "$.stages[0].breakdown.param_bytes: must be at least 0")
    bubble = lambda d: d.__setitem__("iteration_time_s", d["iteration_time_s"] * 24)  # explain showed "bubble 2374 %"
    for command in commands(tiny, mutated(tiny, tmp_path, bubble), tmp_path)[:4]:
        one_error_line(run(*command), "$.iteration_time_s: iteration_time_s is")


def test_a_plan_without_time_is_refused_not_a_division_by_zero(tiny, tmp_path):
    def timeless(d):  # consistent (0 = 0 + 0), but explain's shares divide by the iteration time
        d["iteration_time_s"] = 0
        for s in d["stages"]:
            s.update(stage_time_s=0, forward_s=0, send_time_s=0, sync_time_s=0)
    path = mutated(tiny, tmp_path, timeless)
    one_error_line(run("explain", path), "$.iteration_time_s: must be greater than 0, got 0")


def test_what_explain_reads_must_be_there_and_of_its_type(tiny, tmp_path):  # found by the fuzz suite
    no_line = mutated(tiny, tmp_path, lambda d: d["stages"][0]["ops"][first_op(d)].pop("explanation"))
    one_error_line(run("explain", no_line), f"missing required field 'explanation'")
    scalar = mutated(tiny, tmp_path, lambda d: d["stages"][0]["breakdown"].__setitem__("comm_s", 1.0))
    one_error_line(run("explain", scalar), "$.stages[0].breakdown.comm_s: expected object, got number")


def test_microbatch_counts_that_would_blow_up_draw_are_refused(tiny, tmp_path):
    huge = mutated(tiny, tmp_path, lambda d: d.__setitem__("num_microbatches", 10**18))
    one_error_line(run("draw", huge, "-o", tmp_path / "x.svg"), "$.num_microbatches: must be at most 1048576")
    as_float = mutated(tiny, tmp_path, lambda d: d.__setitem__("num_microbatches", 1e18))
    one_error_line(run("draw", as_float, "-o", tmp_path / "x.svg"), "$.num_microbatches: expected integer")
    assert not (tmp_path / "x.svg").exists()


def test_microbatches_must_make_the_graphs_batch(tiny, tmp_path):
    zero = lambda d: d.__setitem__("microbatch_size", 0)
    assert_refused_everywhere(tiny, tmp_path, zero, "$.microbatch_size: must be at least 1")
    def four(d):  # 4 microbatches of 4 ≠ the batch of 8; the figures stay consistent with B = 4
        d["num_microbatches"] = 4
        times = [s["stage_time_s"] for s in d["stages"]]
        d["iteration_time_s"] = sum(times) + 3 * max(times) + max(s["sync_time_s"] for s in d["stages"])
    other = mutated(tiny, tmp_path, four)
    for command in (commands(tiny, other, tmp_path)[0], commands(tiny, other, tmp_path)[4]):
        one_error_line(run(*command), "$.num_microbatches: 4 microbatches of 4 samples are not the graph's batch of 8")


def test_a_plan_for_another_cluster_or_node_count_says_which(tiny, tmp_path):
    result = run("evaluate", tiny.graph_file, "--cluster", "p3.16xlarge", "--plan", tiny.plan_file)
    one_error_line(result, "$.cluster: the plan was made for 'four-v100' with 1 × 4 devices",
                   "give --cluster four-v100 --nodes 1")
    other = tmp_path / "two-nodes.json"
    io.write_cluster(io.read_cluster(tiny.cluster_file).resized(2), other)
    one_error_line(run("check", tiny.plan_file, "--graph", tiny.graph_file, "--cluster", other), "1 × 4", "2 × 4")


def first_op(d, stage: int = 0) -> str:
    return next(iter(d["stages"][stage]["ops"]))


def test_ops_and_parameters_must_exist_sit_in_their_stage_and_be_legal(tiny, tmp_path):
    def rename(d):
        ops = d["stages"][0]["ops"]
        ops["deleted-op"] = ops.pop(first_op(d))
    wrong_stage = lambda d: d["stages"][0]["ops"].__setitem__(first_op(d, 1), d["stages"][1]["ops"][first_op(d, 1)])
    garbage = lambda d: d["stages"][0]["ops"][first_op(d)].__setitem__("output", "[S(b), Q]")
    three_axes = lambda d: d["stages"][0]["ops"][first_op(d)].__setitem__("axes", ["b", None, None])
    unknown_param = lambda d: d["stages"][0]["params"].__setitem__("nope", {"placement": "[R, R]"})
    where = ["--cluster", tiny.cluster_file]
    cases = [(rename, "ops['deleted-op']: op 'deleted-op' is not in the graph"),
             (wrong_stage, "is not in this stage"),
             (garbage, "malformed placement '[S(b), Q]'"),
             (three_axes, "has 3 axis entries for a 2-axis mesh"),
             (unknown_param, "params['nope']")]
    for change, fragment in cases:
        plan = mutated(tiny, tmp_path, change)
        one_error_line(run("evaluate", tiny.graph_file, *where, "--plan", plan), plan, fragment)


def test_a_parameter_or_op_no_stage_places_is_refused_everywhere_not_dropped(tiny, tmp_path):
    """The plan's `tensors` list every parameter and op output: an export of a plan missing one in its stages
    used to exit 0 without it."""
    d = json.loads(Path(tiny.plan_file).read_text())
    param = next(p for p in d["stages"][1]["params"] if p not in d["stages"][0]["params"])
    op = first_op(d, 1)
    made = d["stages"][1]["ops"][op]["tensor"]
    unplaced = lambda d: d["stages"][1]["params"].pop(param)
    unmade = lambda d: d["stages"][1]["ops"].pop(op)
    for change, fragment in ((unplaced, f"$.tensors['{param}']: parameter '{param}' of the plan's tensors is placed "
                                        "by no stage"),
                             (unmade, f"$.tensors['{made}']: activation '{made}' of the plan's tensors is made by no op")):
        plan = mutated(tiny, tmp_path, change)
        for command in [*commands(tiny, plan, tmp_path)[:-1],  # `check` lists each entry left out (tests/test_check.py)
                        *(["export", plan, "--to", target] for target in ("dtensor", "megatron"))]:
            one_error_line(run(*command), plan, fragment, "partopt solve -o")
        assert not (tmp_path / "out.svg").exists()


def test_a_malformed_placement_is_refused_everywhere_with_its_json_path(tiny, tmp_path):
    """Placements are parsed when the file is read: every command names the op or parameter and the field."""
    d = json.loads(Path(tiny.plan_file).read_text())
    op = next(n for n, o in d["stages"][1]["ops"].items() if len(o["inputs"]) > 1)
    param = next(iter(d["stages"][1]["params"]))
    bad_input = lambda d: d["stages"][1]["ops"][op]["inputs"].__setitem__(1, "[S(h) R]")
    assert_refused_everywhere(tiny, tmp_path, bad_input,
                              f"$.stages[1].ops['{op}'].inputs[1]: malformed placement '[S(h) R]': 'S(h) R'")
    bad_param = lambda d: d["stages"][1]["params"][param].__setitem__("placement", "R, R")
    assert_refused_everywhere(tiny, tmp_path, bad_param,
                              f"$.stages[1].params['{param}'].placement: malformed placement 'R, R' (hint: write it "
                              "like [S(b), R]")


def test_an_op_splitting_a_dim_it_lacks_is_refused_everywhere(tiny, tmp_path):
    """explain, draw and export read the plan alone: an einsum's axes naming a dim none of its tensors is split
    along ('zz', never declared; 'v', the vocabulary, a dim of another op) were accepted."""
    d = json.loads(Path(tiny.plan_file).read_text())
    name, op = next((n, o) for n, o in d["stages"][0]["ops"].items() if o["kind"] == "einsum")
    assert op["axes"] == ["b", None] and op["output"] == "[S(b), R]"  # the tiny plan: data parallel over 2
    for dim in ("zz", "v"):
        foreign = lambda d: d["stages"][0]["ops"][name].__setitem__("axes", [dim, None])
        assert_refused_everywhere(tiny, tmp_path, foreign,
                                  f"$.stages[0].ops['{name}'].axes: op {name} splits '{dim}' on mesh axis 0, but none "
                                  "of its tensors is split along it there", "a dim the op lacks", "partopt solve -o")


def test_a_split_of_a_foreign_dim_is_illegal_against_the_graph(tiny):
    """A dim the op lacks, though its placements split it as the axes say: only the graph can tell."""
    data = plan_to_dict(tiny.plan)
    name, op = next((n, o) for n, o in data["stages"][0]["ops"].items() if o["kind"] == "einsum")
    op.update(axes=["zz", None], inputs=["[S(zz), R]", *op["inputs"][1:]], output="[R, R]")
    plan = plan_from_dict(data, "p.json")
    validate.check_plan(plan, "p.json", figures=False)
    with pytest.raises(InstanceError) as info:
        validate.check_against(plan, tiny.graph, tiny.cluster, "p.json")
    assert info.value.where == f"p.json: $.stages[0].ops['{name}'].axes"
    assert info.value.cause.startswith(f"op {name} cannot split ['zz', None] on mesh [2, 1]")


def test_library_check_plan_refuses_an_op_splitting_a_dim_it_lacks(tiny):
    data = plan_to_dict(tiny.plan)
    name = next(n for n, o in data["stages"][1]["ops"].items() if o["kind"] == "einsum")
    for axes, dim, k in ((["zz", None], "zz", 0), ([None, "b"], "b", 1)):  # its placements split 'b' on axis 0
        data["stages"][1]["ops"][name]["axes"] = axes
        with pytest.raises(InstanceError) as info:
            validate.check_plan(plan_from_dict(data, "p.json"), "p.json")
        assert info.value.where == f"p.json: $.stages[1].ops['{name}'].axes"
        assert info.value.cause.startswith(f"op {name} splits '{dim}' on mesh axis {k}, but none of its tensors is "
                                           "split along it there")


def test_a_plan_priced_at_another_gemm_precision_is_refused(tiny, tmp_path):
    """FP8 GEMMs double the peak: a plan priced so does not hold for the same model at 16 bits, and back."""
    fp8 = mutated(tiny, tmp_path, lambda d: d.__setitem__("matmul_dtype", "fp8"))
    one_error_line(run("check", fp8, "--graph", tiny.graph_file, "--cluster", tiny.cluster_file),
                   "$.matmul_dtype: the plan priced GEMMs at fp8, the graph runs them at their tensors' dtype")


def test_the_graph_and_plan_schemas_name_the_gemm_precisions_the_graph_accepts():
    """The schemas are JSON and list the precisions by hand: they must stay `graph.MATMUL_DTYPES`."""
    schemas = Path(__file__).resolve().parent.parent / "partopt" / "schemas"
    graph = json.loads((schemas / "graph.schema.json").read_text())["properties"]["matmul_dtype"]["enum"]
    plan = json.loads((schemas / "plan.schema.json").read_text())["properties"]["matmul_dtype"]["enum"]
    assert graph == list(MATMUL_DTYPES) and plan == [None, *MATMUL_DTYPES]


def test_the_plan_schema_names_the_tensor_dtypes_the_graph_schema_does():
    """A plan's tensor table records each tensor's dtype from the graph: the two schemas list the same, and
    `graph.DTYPE_BYTES` sizes each."""
    schemas = Path(__file__).resolve().parent.parent / "partopt" / "schemas"
    graph = json.loads((schemas / "graph.schema.json").read_text())["$defs"]["dtype"]["enum"]
    plan = json.loads((schemas / "plan.schema.json").read_text())["$defs"]["tensor"]["properties"]["dtype"]["enum"]
    assert plan == graph and set(graph) == set(DTYPE_BYTES)


def test_a_split_that_does_not_divide_its_dim_is_illegal(tiny):
    cluster = preset("p3.16xlarge", 1)
    plan = optimize(tiny.graph, cluster, microbatches=1, intra_only=True, logical_shapes=[(8, 1)], workers=1)
    stage = plan.stages[0]
    ops = {**stage.ops, "l0.scores": dataclasses.replace(stage.ops["l0.scores"], axes=("n", None))}  # 4 heads: not 8 ways
    bad = dataclasses.replace(plan, stages=[dataclasses.replace(stage, ops=ops)])
    with pytest.raises(InstanceError, match=r"ops\['l0.scores'\].axes: op l0.scores cannot split \['n', None\] on mesh \[8, 1\]"):
        validate.check_against(bad, tiny.graph, cluster)


def test_layers_must_cover_the_graph_once_in_order(tiny, tmp_path):
    gap = set_stage(1, "layers", [2, 2])
    assert_refused_everywhere(tiny, tmp_path, gap, "$.stages[1].layers: stage 1 covers DP layers [2, 2] but the next "
                                                   "uncovered layer is 1")


def test_json_nested_too_deep_is_refused_not_a_recursion_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    one_error_line(run("inspect", deep), "nested deeper than 64 levels")
    one_error_line(run("explain", deep), "nested deeper than 64 levels")
    moderately = tmp_path / "moderate.json"
    moderately.write_text('{"format": "partopt.graph", "x": ' + "[" * 200 + "]" * 200 + "}")
    one_error_line(run("inspect", moderately), "$.x", "nested deeper than 64 levels")


def test_a_lone_surrogate_is_refused_before_anything_is_written(tmp_path):
    data = json.loads(Path(MLP).read_text())
    text = json.dumps(data).replace('"mlp-2layer"', '"mlp\\ud800"')
    bad = tmp_path / "surrogate.json"
    bad.write_text(text)
    out = tmp_path / "plan.json"
    one_error_line(run("solve", bad, "--cluster", "p3.16xlarge", "--nodes", "1", "-o", out), "$.name", "lone surrogate")
    assert not out.exists()


def test_a_name_that_cannot_be_written_is_refused_before_writing(tmp_path):
    out = tmp_path / "g.json"
    result = run("generate", "gpt", "--hidden", "64", "--layers", "1", "--heads", "4", "--seq", "8", "--vocab", "32",
                 "--batch", "4", "--name", "g\udcff", "-o", out)
    one_error_line(result, str(out), "is not valid Unicode")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value,fragment", [("1e300", "$.device.memory_gib: must be at most 1000000000.0, got 1e+300"),
                                            ("Infinity", "$: Infinity is not a JSON number"),
                                            ("1" + "0" * 400, "$.device.memory_gib: must be at most 1000000000.0, got 1000")])
def test_absurd_cluster_memory_is_refused_not_an_overflow(tiny, tmp_path, value, fragment):
    data = json.loads(Path(tiny.cluster_file).read_text())
    data["device"]["memory_gib"] = 12345
    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps(data).replace('"memory_gib": 12345', f'"memory_gib": {value}'))
    one_error_line(run("solve", MLP, "--cluster", bad), str(bad), fragment)


def test_an_output_directory_is_checked_before_the_work(tiny, tmp_path, monkeypatch):
    import partopt.cli
    monkeypatch.setattr(partopt.cli, "optimize", lambda *a, **k: pytest.fail("solved before checking the output"))
    monkeypatch.setattr(partopt.cli, "evaluate_plan", lambda *a, **k: pytest.fail("priced before checking"))
    import partopt.draw
    monkeypatch.setattr(partopt.draw, "draw", lambda *a, **k: pytest.fail("drawn before checking the output"))
    for command in (["solve", MLP, "--cluster", "p3.16xlarge", "-o"], ["generate", "gpt-350m", "-o"],
                    ["evaluate", tiny.graph_file, "--cluster", tiny.cluster_file, "--plan", tiny.plan_file, "-o"],
                    ["draw", tiny.plan_file, "-o"]):
        one_error_line(run(*command, tmp_path / "missing" / "dir" / "out.svg"), "does not exist")
    one_error_line(run("solve", MLP, "--cluster", "p3.16xlarge", "-o", tmp_path), "is a directory")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("limit", ["nan", "inf", "-1", "0"])
def test_time_limits_must_be_finite_and_positive(limit):
    result = run("solve", MLP, "--cluster", "p3.16xlarge", "--time-limit", limit)
    assert result.exit_code == 2 and "--time-limit" in result.stderr and "Traceback" not in result.stderr


def test_ctrl_c_exits_130_with_one_line_and_no_file(tmp_path, monkeypatch):
    import partopt.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(partopt.cli, "optimize", interrupted)
    result = run("solve", MLP, "--cluster", "p3.16xlarge", "-o", tmp_path / "plan.json")
    assert result.exit_code == 130
    assert result.stderr.splitlines() == ["error: interrupted (Ctrl-C); nothing was written"]
    assert os.listdir(tmp_path) == []


def test_an_interrupted_write_leaves_neither_the_file_nor_a_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    def half(temporary: str) -> None:
        Path(temporary).write_text("half a fi")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        io.write_atomic(target, half)
    assert os.listdir(tmp_path) == ["out.json"] and target.read_text() == "old"


def test_piped_tables_keep_whole_cells(tiny):
    result = run("solve", tiny.graph_file, "--cluster", tiny.cluster_file, "--microbatches", "2", "--layers", "2")
    assert result.exit_code == 0, result.stderr
    assert "…" not in result.stdout
    assert "sync: gradients and optimizer per iteration; memory: per device, with its in-flight microbatches" in result.stdout
    assert f"Plan for tiny-gpt on four-v100 (1 × 4)" in result.stdout


def test_absurd_magnitudes_are_warnings(tiny, tmp_path):
    data = json.loads(Path(tiny.cluster_file).read_text())
    data["inter_node"]["bandwidth_gbps"] = 1e-12  # 0.001 byte/s
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(data))
    result = run("inspect", slow)
    assert result.exit_code == 0 and "warning: cluster 'four-v100': the inter-node link moves 0.001 bytes/s" in result.stderr
    data["device"]["memory_bandwidth_gbps"] = 1e-10
    slow.write_text(json.dumps(data))
    assert "warning: cluster 'four-v100': the device memory moves 0.1 bytes/s" in run("inspect", slow).stderr

    def centuries(d):  # every time × 1e12: still consistent, but an iteration of ~years
        d["iteration_time_s"] *= 1e12
        for s in d["stages"]:
            for field in ("stage_time_s", "forward_s", "send_time_s", "sync_time_s"):
                s[field] *= 1e12
    result = run("explain", mutated(tiny, tmp_path, centuries), "--no-ops")
    assert result.exit_code == 0, result.stderr
    years = json.loads(Path(tiny.plan_file).read_text())["iteration_time_s"] * 1e12 / validate.YEAR_S
    assert f"warning: one iteration of the plan takes {years:.3g} years" in result.stderr


def timed_out(plan, timeouts: int, gap: float):
    """`plan` as if `timeouts` of its layer ILPs had stopped at the time limit, the largest gap `gap`."""
    return dataclasses.replace(plan, solver={**plan.solver, "status": "timeout", "gap": gap, "timeouts": timeouts})


def test_layer_ilps_stopped_at_the_time_limit_are_one_warning_with_the_gap_and_the_hint(tiny):
    assert validate.solver_warnings(tiny.plan) == []  # solved within its limits
    assert validate.solver_warnings(timed_out(tiny.plan, 1, 0.25)) == [
        "solver: 1 layer ILP stopped at the time limit before proven optimal: the plan may be slower than the "
        "optimum by up to 25.0%, the largest gap (hint: raise --time-limit)"]
    assert validate.solver_warnings(timed_out(tiny.plan, 3, None)) == [
        "solver: 3 layer ILPs stopped at the time limit before proven optimal: the plan may be slower than the "
        "optimum by an unknown margin (no bound proven) (hint: raise --time-limit)"]


@pytest.mark.parametrize("command, planner", [("solve", "optimize"), ("evaluate", "uniform")])
def test_solve_and_evaluate_warn_on_stderr_when_a_layer_ilp_stopped_at_the_time_limit(tiny, monkeypatch, command,
                                                                                       planner):
    """Their table said only `highs: timeout, gap inf`: now one warning line says how many and what to do."""
    import partopt.cli

    monkeypatch.setattr(partopt.cli, planner, lambda *args, **kwargs: timed_out(tiny.plan, 2, 0.125))
    degrees = ["--tp", "1", "--pp", "2", "--dp", "2"] if command == "evaluate" else ["--workers", "1"]
    result = run(command, tiny.graph_file, "--cluster", tiny.cluster_file, "--time-limit", "0.001", *degrees)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines() == [
        "warning: solver: 2 layer ILPs stopped at the time limit before proven optimal: the plan may be slower than "
        "the optimum by up to 12.5%, the largest gap (hint: raise --time-limit)"]
    assert "highs: timeout, gap 0.12" in result.stdout


def test_library_errors_carry_the_json_path(tiny):
    data = plan_to_dict(tiny.plan)
    broken = copy.deepcopy(data)
    broken["stages"][1]["devices"] = [0, 1]
    with pytest.raises(InstanceError, match=r"^p.json: \$.stages\[1\].devices\[0\]: device 0 is also used by stage 0"):
        validate.check_plan(plan_from_dict(broken, "p.json"), "p.json")


def _group(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (from /proc; zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


# a parallel solve's process group once its ILP workers run: the solve, multiprocessing's resource tracker, the
# fork server and two workers
SOLVE_GROUP = 5


def _parallel_solve(out: Path, **popen) -> subprocess.Popen:
    """`partopt solve` of Wide-ResNet-13B on 64 V100s on two workers in a session of its own, returned once its
    workers run (its first plan comes 20 to 45 s after the start on this machine, far later than any test waits;
    GPT-39B's came within 8 s once the backward's bytes were counted, docs/COSTMODEL.md §3)."""
    command = [sys.executable, "-c", "from partopt.cli import main; main()", "solve",
               str(ROOT / "instances" / "wresnet-13b.json"), "--cluster", "p3.16xlarge", "--nodes", "8",
               "--workers", "2",
               "-o", str(out)]
    process = subprocess.Popen(command, start_new_session=True, **popen)
    deadline = time.monotonic() + 120
    while len(_group(process.pid)) < SOLVE_GROUP and time.monotonic() < deadline:
        time.sleep(0.2)
    if len(_group(process.pid)) < SOLVE_GROUP:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("the worker processes never started")
    return process


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc")
def test_ctrl_c_during_a_parallel_solve_ends_every_worker(tmp_path):
    """A real SIGINT to the whole process group (what a terminal's Ctrl-C sends) once the ILP workers run and
    before any plan exists: Wide-ResNet-13B's first plan takes far longer than the 5 s waited (GPT-6.7B's and now
    GPT-39B's first plans come within them, and Ctrl-C then returns it: tests/test_deadline.py)."""
    process = _parallel_solve(tmp_path / "plan.json", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(5)  # past the workers' start-up (a Ctrl-C while Python imports is Python's own traceback)
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130
    assert stderr.splitlines() == ["error: interrupted (Ctrl-C); nothing was written"], stderr
    time.sleep(1)
    assert _group(process.pid) == [] and os.listdir(tmp_path) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc")
def test_a_killed_planner_leaves_no_worker_running(tmp_path):
    """SIGKILL to the planner alone, once its ILP workers run: the workers (children of the fork server, which
    lives as long as they do) see the planner gone and exit, and the server after them."""
    process = _parallel_solve(tmp_path / "plan.json", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        process.kill()
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _group(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group(process.pid) == []
    finally:
        for pid in _group(process.pid):
            os.kill(pid, signal.SIGKILL)
