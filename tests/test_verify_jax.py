"""`partopt verify --against jax`: plans run on host CPU devices, collectives read from compiled HLO."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt.cli import main
from partopt.cluster import preset
from partopt.frontends.jax import from_function
from partopt.inter import optimize
from partopt.plan import plan_to_dict, read_plan, write_plan
from partopt.verify_jax import Collective, as_run_on_cpu, compare, hlo_collectives, mesh_axis, planned_collectives

sys.path.insert(0, str(Path(__file__).parent))
import jax_models as jm  # noqa: E402

MLP = f"{Path(__file__).parent / 'jax_models.py'}:make_mlp"
TIED = f"{Path(__file__).parent / 'jax_models.py'}:make_tied"
WEIGHT_BYTES = 64 * 256 * 4  # each of the MLP's two fp32 weights
TABLE_BYTES = 128 * 32 * 4  # the tied model's fp32 embedding table

HLO = """
  %all-reduce = f32[] all-reduce(%r), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, to_apply=%add, metadata={op_name="jit(f)/reduce_sum"}
  %all-reduce.3 = (f32[], /*index=1*/f32[32,64]{1,0}) all-reduce(%a, %d), channel_id=2, replica_groups={{0,2},{1,3}}, to_apply=%add
  %all-gather = f32[8,64]{1,0} all-gather(%p), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}
  %reduce-scatter = f32[4,64]{1,0} reduce-scatter(%g), channel_id=4, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}
  %all-reduce.9 = f32[16]{0} all-reduce(%z), channel_id=5, replica_groups={{0},{1},{2},{3}}, to_apply=%add
"""


def test_hlo_collectives_in_every_replica_group_spelling():
    found = hlo_collectives(HLO, (2, 2))
    assert [(c.kind, c.axis, c.bytes) for c in found] == [
        ("all_reduce", "y", 4.0),  # named mesh axes
        ("all_reduce", "x", 4.0 + 32 * 64 * 4),  # explicit groups {0,2},{1,3}: the first axis; a combined tuple
        ("all_gather", "x", 8 * 64 * 4.0 / 2),  # iota over all four devices: as partopt's steps, x gathers
        ("all_gather", "y", 8 * 64 * 4.0),  # the buffer still split on y (2 devices), then y the whole of it
        ("reduce_scatter", "x", 2 * 4 * 64 * 4.0),  # transposed iota {0,2},{1,3}; buffer = result x group size
    ]  # groups of one device move nothing and are left out
    assert found[0].where == "jit(f)/reduce_sum"


def test_mesh_axis_of_groups():
    assert mesh_axis([[0, 1, 2, 3], [4, 5, 6, 7]], (2, 4)) == "y"
    assert mesh_axis([[0, 4], [1, 5], [2, 6], [3, 7]], (2, 4)) == "x"
    assert mesh_axis([[0, 1], [2, 3], [4, 5], [6, 7]], (2, 4)).startswith("groups")  # half of an axis


def test_compare_reports_each_kind_and_axis():
    found = [Collective("all_reduce", "x", 1000.0, "a"), Collective("all_gather", "y", 5000.0, "b")]
    planned = [Collective("all_reduce", "x", 1005.0, "p"), Collective("all_to_all", "y", 5000.0, "q")]
    lines = compare(found, planned)
    assert len(lines) == 2  # the all-reduce agrees within 1 % / 256 B; the layouts on y differ
    assert lines[0].startswith("all_gather on y: compiled 5,000 B (b), planned 0 B")
    assert lines[1].startswith("all_to_all on y: compiled 0 B (none), planned 5,000 B (q)")
    cpu = as_run_on_cpu([Collective("reduce_scatter", "x", 64.0, "g")], found)
    assert cpu[0].kind == "all_reduce" and "reduce-scatter" in cpu[0].where


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    fn, args = jm.make_mlp()
    graph = from_function(fn, *args)
    cluster = preset("p3.16xlarge").resized(1).narrowed(4)
    plan = optimize(graph, cluster, workers=1, microbatches=[1], data_parallel_only=True)
    return graph, plan


def test_planned_collectives_of_data_parallelism(mlp_plan):
    graph, plan = mlp_plan
    planned = planned_collectives(plan, 0, graph)
    syncs = [c for c in planned if c.where.startswith("gradient sync")]
    assert {(c.kind, c.axis) for c in syncs} == {("all_reduce", "x")}  # ZeRO's pair, counted as one all-reduce
    assert sum(c.bytes for c in syncs) == 2 * WEIGHT_BYTES


def test_verify_runs_a_plan_with_sharded_weights(mlp_plan, tmp_path):
    """The data-parallel plan with w2 sharded over the batch axis (FSDP): XLA all-gathers w2 as planned."""
    graph, plan = mlp_plan
    data = plan_to_dict(plan)
    w2 = data["stages"][0]["params"]["params/w2"]
    w2["placement"] = f"[S({graph.tensors['params/w2'].dims[0]}), R]"
    w2["zero_axes"] = []
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps(data))
    write_plan(read_plan(path), path)  # still a valid plan file
    result = CliRunner().invoke(main, ["verify", str(path), "--against", "jax", "--model", MLP])
    assert result.exit_code == 0, result.output
    assert "match" in result.output and "verified: the plan runs as planned" in result.output
    assert "all_gather" in result.output and "64 KiB" in result.output  # w2 gathered: 64 KiB planned and compiled


def test_verify_rejects_a_plan_of_another_model(tmp_path):
    fn, args = jm.make_model()
    graph = from_function(fn, *args)
    cluster = preset("p3.16xlarge").resized(1).narrowed(2)
    path = tmp_path / "gpt.json"
    write_plan(optimize(graph, cluster, workers=1, microbatches=[1], data_parallel_only=True), path)
    result = CliRunner().invoke(main, ["verify", str(path), "--against", "jax", "--model", MLP])
    assert result.exit_code == 2 and "tensors the model lacks" in result.output and "Traceback" not in result.output


def test_an_all_reduce_over_the_whole_mesh_counts_on_each_axis():
    line = "  %ar = f32[16]{0} all-reduce(%g), replica_groups=[1,4]<=[4], to_apply=%add"
    assert [(c.kind, c.axis, c.bytes) for c in hlo_collectives(line, (2, 2))] == [
        ("all_reduce", "x", 64.0), ("all_reduce", "y", 64.0)]


@pytest.fixture(scope="module")
def tied_plan(tmp_path_factory):
    """The tied model data parallel over 4 devices, written to a plan file."""
    fn, args = jm.make_tied()
    graph = from_function(fn, *args)
    cluster = preset("p3.16xlarge").resized(1).narrowed(4)
    path = tmp_path_factory.mktemp("tied") / "tied.json"
    write_plan(optimize(graph, cluster, workers=1, microbatches=[1], data_parallel_only=True), path)
    return graph, read_plan(path), path


def test_a_table_read_by_two_ops_is_synchronised_per_read(tied_plan):
    """XLA all-reduces the lookup's and the LM head's partial gradients of the table apart: 2 x its bytes."""
    graph, plan, _ = tied_plan
    assert [op.name for op in graph.consumers["params/wte"]] == ["gather", "dot_general"]
    syncs = [c for c in planned_collectives(plan, 0, graph) if c.where.startswith("gradient sync of params/wte")]
    assert [(c.kind, c.axis, c.bytes) for c in syncs] == [("all_reduce", "x", TABLE_BYTES)] * 2
    assert "read 2 of 2" in syncs[1].where
    scale = [c for c in planned_collectives(plan, 0, graph) if c.where.startswith("gradient sync of params/scale")]
    assert [(c.kind, c.axis, c.bytes) for c in scale] == [("all_reduce", "x", 32 * 4)]  # read once: once


def test_verify_runs_the_tied_embedding_as_planned(tied_plan):
    _, _, path = tied_plan
    result = CliRunner().invoke(main, ["verify", str(path), "--against", "jax", "--model", TIED])
    assert result.exit_code == 0, result.output
    assert "verified: the plan runs as planned" in result.output


def test_a_wrong_sync_of_the_tied_table_still_fails(tied_plan):
    """The per-read count is exact, not a tolerance: a third reduction of the table, half a table more, or
    the plan's single sync (what partopt priced before) against XLA's compiled step are all mismatches."""
    graph, plan, path = tied_plan
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-m", "partopt.verify_jax", str(path), TIED], env=env,
                          capture_output=True, text=True, check=True)
    stage = json.loads(done.stdout.strip().splitlines()[-1])["stages"][0]
    found = [Collective(**c) for c in stage["compiled"]]
    planned = planned_collectives(plan, 0, graph)
    assert compare(found, planned) == []
    table = Collective("all_reduce", "x", TABLE_BYTES, "gradient of params/wte")
    assert compare([*found, table], planned)[0].startswith("all_reduce on x: compiled")  # reduced 3 times
    half = Collective("all_reduce", "x", TABLE_BYTES / 2, "half the table")
    assert len(compare([*found, half], planned)) == 1
    once = [c for c in planned if "read 2 of 2" not in c.where]  # the summed gradient synchronised once
    assert len(compare(found, once)) == 1


def test_a_tied_table_with_zero_over_both_axes_is_all_reduced_whole_on_each():
    """On a 2 x 2 mesh with ZeRO over both axes, a step (no optimizer) sums each read's gradient over x and y
    with the whole table on each axis (as XLA's one all-reduce over the mesh counts), once per read."""
    fn, args = jm.make_tied()
    graph = from_function(fn, *args)
    cluster = preset("p3.16xlarge").resized(1).narrowed(4)
    plan = optimize(graph, cluster, workers=1, microbatches=[1], intra_only=True, logical_shapes=[(2, 2)])
    stage = plan.stages[0]
    assert stage.logical_mesh == [2, 2] and stage.params["params/wte"].zero_axes == (0, 1)
    assert [stage.ops[op].axes for op in ("gather", "dot_general")] == [("b", "b")] * 2  # both reads: partial on x, y
    syncs = [c for c in planned_collectives(plan, 0, graph) if c.where.startswith("gradient sync of params/wte")]
    assert [(c.kind, c.axis, c.bytes) for c in syncs] == [("all_reduce", "x", TABLE_BYTES),
                                                          ("all_reduce", "y", TABLE_BYTES)] * 2


def test_an_all_to_all_over_the_whole_mesh_counts_as_partopt_prices_it():
    """XLA's one exchange of a 4 KiB shard over 2 x 2 devices sends 3/4 of it; partopt's steps carry the
    shard on x (1/2 of 4 KiB sent) and the shard over x's size on y (1/2 of 2 KiB): the same 3 KiB."""
    chunk = "f32[2,16,1,8]{3,2,1,0}"  # XLA's tuple form: one 1 KiB chunk per device
    line = (f"  %a2a = ({chunk}, {chunk}, {chunk}, {chunk}) all-to-all(%a, %b, %c, %d), channel_id=1, "
            "replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=4] {'axis_2'}")
    found = hlo_collectives(line, (2, 2))
    assert [(c.kind, c.axis, c.bytes) for c in found] == [("all_to_all", "x", 4096.0), ("all_to_all", "y", 2048.0)]
    assert sum(c.bytes / 2 for c in found) == 3 / 4 * 4096


@pytest.fixture(scope="module")
def tied_2x2(tmp_path_factory):
    """The tied model planned intra-op only on a 2 x 2 mesh, and `verify`'s report of running it."""
    fn, args = jm.make_tied()
    graph = from_function(fn, *args)
    cluster = preset("p3.16xlarge").resized(1).narrowed(4)
    plan = optimize(graph, cluster, workers=1, microbatches=[1], intra_only=True, logical_shapes=[(2, 2)])
    path = tmp_path_factory.mktemp("tied2x2") / "tied.json"
    write_plan(plan, path)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-m", "partopt.verify_jax", str(path), TIED], env=env,
                          capture_output=True, text=True, check=True)
    return graph, read_plan(path), json.loads(done.stdout.strip().splitlines()[-1])


def test_the_tied_model_on_a_2x2_mesh_runs_its_all_to_alls_as_planned(tied_2x2):
    """The plan splits the batch for tanh and the LM head and the width for `mul` (by the scale, which
    it stores split): tanh's output (8 x 16 x 32 fp32, 16 KiB, a 4 KiB shard per device) is exchanged
    over the mesh into mul, mul's back into the LM head, and both gradients back: 4 exchanges, each
    4 KiB on x and 2 KiB on y (`sharding.mesh_all_to_all_steps`)."""
    graph, plan, report = tied_2x2
    stage = plan.stages[0]
    assert [stage.ops[op].axes for op in ("tanh", "mul", "dot_general")] == [("b", "b"), ("d32", "d32"), ("b", "b")]
    exchanges = [c for c in planned_collectives(plan, 0, graph) if c.kind == "all_to_all"]
    assert sorted((c.axis, c.bytes) for c in exchanges) == [("x", 4096.0)] * 4 + [("y", 2048.0)] * 4
    assert report["ok"], report["stages"][0]["mismatches"]
    compiled = [c for c in report["stages"][0]["compiled"] if c["kind"] == "all_to_all"]
    assert sum(c["bytes"] for c in compiled if c["axis"] == "x") == 4 * 4096  # 4 exchanges, not 5


def test_a_wrong_all_to_all_count_still_fails(tied_2x2):
    """The convention maps XLA's exchange to partopt's bytes, not a tolerance: the two whole-shard steps
    partopt priced before, a fifth exchange (what XLA ran when it resharded tanh's derivative factor) or
    a missing one are all mismatches."""
    graph, plan, report = tied_2x2
    found = [Collective(**c) for c in report["stages"][0]["compiled"]]
    planned = planned_collectives(plan, 0, graph)
    assert compare(found, planned) == []
    before = [dataclasses.replace(c, bytes=4096.0) if c.kind == "all_to_all" else c for c in planned]
    assert [line.split(":")[0] for line in compare(found, before)] == ["all_to_all on y"]
    fifth = [Collective("all_to_all", "x", 4096.0, "tanh's 1 - y"), Collective("all_to_all", "y", 2048.0, "back")]
    assert len(compare([*found, *fifth], planned)) == 2
    missing = [c for c in planned if not (c.kind == "all_to_all" and c.where == "mul reads tanh")]
    assert len(compare(found, missing)) == 2
