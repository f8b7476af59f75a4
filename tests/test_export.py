"""Exports: JAX PartitionSpecs, DTensor placements and Megatron-LM arguments, on hand-made plans with
answers derived by hand and on real solves checked for consistency."""

import dataclasses
import importlib
import json
import math
import shlex
from pathlib import Path

import pytest

from partopt.cluster import preset
from partopt.errors import InstanceError, PartoptError
from partopt.inter import optimize
from partopt.io import read_graph
from partopt.models import gpt, llama
from partopt.evaluate import evaluate
from partopt.validate import check_against
from partopt.plan import OpStrategy, ParamPlacement, Plan, StagePlan, plan_from_dict, plan_to_dict

ex = importlib.import_module("partopt.export")  # the module: the name `partopt.export` is the export function
from partopt.sharding import R, Shard, fmt, parse_placement

INSTANCES = Path(__file__).parent.parent / "instances"


# ---------------------------------------------------------------- hand-made plans

def op(kind, tensor, axes, inputs, output):
    """An op's strategy, its placements written as in a plan file for brevity."""
    return OpStrategy(kind, tensor, tuple(axes), tuple(map(parse_placement, inputs)), parse_placement(output), "")


def param(placement, zero_axes=()):
    return ParamPlacement(parse_placement(placement), tuple(zero_axes))


def stage(mesh, devices, ops, params, graph_layers=(0, 0)):
    return StagePlan(layers=[0, 0], graph_layers=list(graph_layers), submesh=[1, len(devices)],
                     logical_mesh=list(mesh), devices=list(devices), stage_time_s=1.0, forward_s=0.3,
                     send_time_s=0.0, sync_time_s=0.0, memory_bytes=0.0, inflight_microbatches=1,
                     breakdown={}, ops=ops, params=params)


def plan(stages, tensors, microbatch_size=16, num_microbatches=8):
    return Plan(graph="hand", cluster="test", nodes=1, devices_per_node=8, iteration_time_s=1.0,
                num_microbatches=num_microbatches, microbatch_size=microbatch_size, stages=stages,
                memory_peak_bytes=0.0, throughput={}, solver={}, batch_dim="b", tensors=tensors)


def tensor(dims, shape, role="activation"):
    return {"dims": list(dims), "shape": list(shape), "role": role}


# A pre-norm MLP block x[b,s,h] -> ln -> fc1 (h->f) -> gelu -> fc2 (f->h); b=16 per microbatch.
MLP_TENSORS = {
    "x": tensor("bsh", [16, 8, 64], "input"),
    "ln.scale": tensor("h", [64], "param"),
    "w1": tensor("hf", [64, 256], "param"),
    "w2": tensor("fh", [256, 64], "param"),
    "ln": tensor("bsh", [16, 8, 64]),
    "h1": tensor("bsf", [16, 8, 256]),
    "a1": tensor("bsf", [16, 8, 256]),
    "y": tensor("bsh", [16, 8, 64]),
}


def data_parallel_stage(devices=range(8), zero=()):
    """Mesh (8, 1): every op splits the batch dim over axis 0; weights replicated."""
    ops = {
        "ln": op("layernorm", "ln", ["b", None], ["[S(b), R]", "[R, R]"], "[S(b), R]"),
        "fc1": op("einsum", "h1", ["b", None], ["[S(b), R]", "[R, R]"], "[S(b), R]"),
        "gelu": op("elementwise", "a1", ["b", None], ["[S(b), R]"], "[S(b), R]"),
        "fc2": op("einsum", "y", ["b", None], ["[S(b), R]", "[R, R]"], "[S(b), R]"),
    }
    params = {p: param("[R, R]", zero) for p in ("ln.scale", "w1", "w2")}
    return stage((8, 1), devices, ops, params)


def megatron_stage(mesh=(2, 4), norm_axes=("b", "s"), norm_scale="[R, R]", devices=range(8), graph_layers=(0, 0)):
    """Axis 0 data parallel, axis 1 Megatron's column (fc1 splits f) then row (fc2 contracts f) MLP;
    the norm splits the sequence over axis 1 (sequence parallelism) unless told otherwise."""
    norm_out = fmt(tuple(Shard(d) if d else R for d in norm_axes))
    ops = {
        "ln": op("layernorm", "ln", norm_axes, [norm_out, norm_scale], norm_out),
        "fc1": op("einsum", "h1", ["b", "f"], ["[S(b), R]", "[R, S(f)]"], "[S(b), S(f)]"),
        "gelu": op("elementwise", "a1", ["b", "f"], ["[S(b), S(f)]"], "[S(b), S(f)]"),
        "fc2": op("einsum", "y", ["b", "f"], ["[S(b), S(f)]", "[R, S(f)]"], "[S(b), P]"),
    }
    params = {"ln.scale": param(norm_scale, [0]), "w1": param("[R, S(f)]", [0]), "w2": param("[R, S(f)]", [0])}
    return stage(mesh, devices, ops, params, graph_layers)


def test_jax_spec_of_a_bh_tensor_by_hand():
    # [S(b), S(h)]: b over x, h over y. [S(h), S(h)]: h over both, x the major split; b whole.
    both = ex.TensorPlacement("t", "activation", ("b", "h"), (16, 64), (Shard("b"), Shard("h")))
    assert ex.jax_spec(both) == ["x", "y"]
    assert ex.jax_spec_text(ex.jax_spec(both)) == "PartitionSpec('x', 'y')"
    h_twice = ex.TensorPlacement("t", "activation", ("b", "h"), (16, 64), (Shard("h"), Shard("h")))
    assert ex.jax_spec(h_twice) == [None, ["x", "y"]]
    assert ex.jax_spec_text(ex.jax_spec(h_twice)) == "PartitionSpec(None, ('x', 'y'))"
    # DTensor: one placement per MESH dim, Shard holding the tensor dim's index
    assert ex.dtensor_text(ex.dtensor_placements(both)) == "[Shard(0), Shard(1)]"
    assert ex.dtensor_text(ex.dtensor_placements(h_twice)) == "[Shard(1), Shard(1)]"


def test_partial_outputs_have_no_partition_spec_only_a_pending_reduction():
    jax = ex.to_jax(plan([megatron_stage()], MLP_TENSORS))["stages"][0]
    y = jax["activations"]["y"]  # fc2's output [S(b), P]: a pending sum over y
    assert y["spec"] is None and y["text"] is None
    assert y["pending_reduction"] == {"axes": ["y"], "spec": ["x", None, None], "text": "PartitionSpec('x', None, None)"}
    assert "pending_reduction" not in jax["activations"]["h1"]
    dt = ex.to_dtensor(plan([megatron_stage()], MLP_TENSORS))["stages"][0]
    assert dt["activations"]["y"]["text"] == "[Shard(0), Partial()]"
    assert dt["activations"]["h1"]["text"] == "[Shard(0), Shard(2)]"  # h1[b, s, f]: f is dim 2


def test_meshes_name_their_axes_and_lay_devices_out_row_major():
    data = ex.to_jax(plan([megatron_stage(devices=range(8, 16))], MLP_TENSORS))["stages"][0]["mesh"]
    assert data == {"axis_names": ["x", "y"], "shape": [2, 4], "devices": [[8, 9, 10, 11], [12, 13, 14, 15]]}
    mesh = ex.to_dtensor(plan([megatron_stage(devices=range(8, 16))], MLP_TENSORS))["stages"][0]["device_mesh"]
    assert mesh["mesh"] == [[8, 9, 10, 11], [12, 13, 14, 15]] and mesh["mesh_dim_names"] == ["x", "y"]


def test_optimizer_state_takes_the_zero_axes_on_the_first_dim_they_divide():
    # w1[h=64, f=256] as [R, S(f)] with ZeRO over axis 0 (size 2): h (64 % 2 == 0) takes x.
    w1 = ex.TensorPlacement("w1", "param", ("h", "f"), (64, 256), (R, Shard("f")), (0,))
    assert ex.optimizer_placement(w1, (2, 4)) == ((Shard("h"), Shard("f")), ())
    # b1[f=256] as [R, S(f)]: f is split by the later axis 1, so x cannot go inside it: flat.
    b1 = ex.TensorPlacement("b1", "param", ("f",), (256,), (R, Shard("f")), (0,))
    assert ex.optimizer_placement(b1, (2, 4)) == ((R, Shard("f")), (0,))
    # s[h=8] as [S(h), R], ZeRO over axis 1 (size 2): local h = 4, divisible: h over (x, y).
    s = ex.TensorPlacement("s", "param", ("h",), (8,), (Shard("h"), R), (1,))
    assert ex.optimizer_placement(s, (2, 2)) == ((Shard("h"), Shard("h")), ())
    # v[h=6] as [S(h), R], ZeRO over axis 1 (size 4): local h = 3, not divisible by 4: flat.
    v = ex.TensorPlacement("v", "param", ("h",), (6,), (Shard("h"), R), (1,))
    assert ex.optimizer_placement(v, (2, 4)) == ((Shard("h"), R), (1,))
    jax = ex.to_jax(plan([megatron_stage()], MLP_TENSORS))["stages"][0]["params"]
    assert jax["w1"]["optimizer_state"]["text"] == "PartitionSpec('x', 'y')"
    dt = ex.to_dtensor(plan([megatron_stage()], MLP_TENSORS))["stages"][0]["params"]
    assert dt["w1"]["optimizer_state"]["text"] == "[Shard(0), Shard(1)]"


def test_pure_data_parallel_plan_is_megatron_tp1_pp1_dp8():
    p = plan([data_parallel_stage()], MLP_TENSORS, microbatch_size=16, num_microbatches=8)
    c = ex.megatron_config(p)
    assert (c["tp"], c["pp"], c["dp"]) == (1, 1, 8)
    assert c["micro_batch_size"] == 16 // 8  # Megatron's is per data-parallel rank
    assert c["global_batch_size"] == 16 * 8 and c["num_microbatches"] == 8
    assert not c["sequence_parallel"] and not c["distributed_optimizer"]
    assert ex.to_megatron(p) == ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                                 "--num-layers", "1", "--micro-batch-size", "2", "--global-batch-size", "128"]
    zero = plan([data_parallel_stage(zero=[0])], MLP_TENSORS)
    assert ex.megatron_config(zero)["distributed_optimizer"]
    assert ex.to_megatron(zero)[-1] == "--use-distributed-optimizer"


@pytest.mark.parametrize("zero, overlap, flags", [
    (True, True, ["--overlap-grad-reduce", "--overlap-param-gather"]), (True, False, []),
    (False, True, ["--overlap-grad-reduce"])])
def test_the_overlaps_a_plan_priced_are_the_megatron_flags_it_exports(zero, overlap, flags):
    """Under overlap a plan hides its gradient reductions under the last backward and, with the distributed
    optimizer, its updated weights' gathers under the next forward (docs/COSTMODEL.md §5b): Megatron-LM's
    --overlap-grad-reduce and --overlap-param-gather, which needs the other two (arguments.py asserts both)."""
    from partopt.evaluate import uniform
    args = ex.to_megatron(uniform(gpt(**SMALL_GPT), preset("dgx-a100", 1), 1, 1, 8, microbatches=2, zero=zero,
                                  overlap=overlap))
    assert [a for a in args if a.startswith("--overlap")] == flags
    assert ("--use-distributed-optimizer" in args) == zero


def test_column_then_row_plan_is_megatron_tensor_parallel_with_sequence_parallelism():
    c = ex.megatron_config(plan([megatron_stage()], MLP_TENSORS, microbatch_size=16, num_microbatches=4))
    assert (c["tp"], c["dp"], c["pp"], c["micro_batch_size"], c["global_batch_size"]) == (4, 2, 1, 8, 64)
    assert c["sequence_parallel"] and c["distributed_optimizer"]
    # the norm replicated over the tensor-parallel axis: no sequence parallelism
    plain = ex.megatron_config(plan([megatron_stage(norm_axes=("b", None))], MLP_TENSORS))
    assert plain["tp"] == 4 and not plain["sequence_parallel"]
    # (4, 2) mesh: tp on axis 1 of size 2
    assert ex.megatron_config(plan([megatron_stage(mesh=(4, 2))], MLP_TENSORS))["tp"] == 2


def test_norm_split_on_its_feature_dim_is_not_expressible():
    bad = plan([megatron_stage(norm_axes=("b", "h"), norm_scale="[R, S(h)]")], MLP_TENSORS)
    with pytest.raises(ex.NotExpressibleError, match="op ln splits its feature dim h over the tensor-parallel axis 1"):
        ex.megatron_config(bad)


def test_stages_on_different_meshes_are_not_expressible_and_both_are_named():
    first = megatron_stage(mesh=(1, 8), devices=range(8), graph_layers=(0, 0))
    second = megatron_stage(mesh=(2, 4), devices=range(8, 16), graph_layers=(1, 1))
    with pytest.raises(ex.NotExpressibleError) as err:
        ex.megatron_config(plan([first, second], MLP_TENSORS))
    assert "stage 1 uses logical mesh (2, 4) but stage 0 uses (1, 8)" in err.value.line()


def test_an_axis_mixing_batch_and_model_splits_names_both_ops():
    s = megatron_stage()
    s.ops["gelu"] = dataclasses.replace(s.ops["gelu"], axes=("b", "b"))  # gelu splits the batch over the tensor-parallel axis
    with pytest.raises(ex.NotExpressibleError, match="axis 1 mixes data and tensor parallelism: op ln splits s "
                                                     "over it, op gelu splits the batch dim b"):
        ex.megatron_config(plan([s], MLP_TENSORS))


def test_other_shapes_megatron_cannot_hold():
    strided = megatron_stage(mesh=(4, 2))
    for name, info in strided.ops.items():  # tensor parallel on axis 0 (devices 2 apart), data parallel on axis 1
        strided.ops[name] = dataclasses.replace(info, axes=info.axes[::-1])
    with pytest.raises(ex.NotExpressibleError, match="tensor parallelism runs over axis 0, whose devices are 2 apart"):
        ex.megatron_config(plan([strided], MLP_TENSORS))
    weights_split = data_parallel_stage()
    weights_split.params["w1"] = param("[S(f), R]")
    with pytest.raises(ex.NotExpressibleError, match="param w1 is \\[S\\(f\\), R\\], split over data-parallel axis 0"):
        ex.megatron_config(plan([weights_split], MLP_TENSORS))
    with pytest.raises(ex.NotExpressibleError, match="microbatch of 12 samples does not split over 8"):
        ex.megatron_config(plan([data_parallel_stage()], MLP_TENSORS, microbatch_size=12))
    idle = data_parallel_stage()
    idle.ops["gelu"] = dataclasses.replace(idle.ops["gelu"], axes=(None, None))
    with pytest.raises(ex.NotExpressibleError, match="op gelu runs replicated over data-parallel axis 0"):
        ex.megatron_config(plan([idle], MLP_TENSORS))


def test_pipeline_layers_even_or_uneven_only_at_the_ends():
    def pipeline(*counts):
        stages, first = [], 0
        for i, n in enumerate(counts):
            stages.append(megatron_stage(devices=range(8 * i, 8 * i + 8), graph_layers=(first, first + n - 1)))
            first += n
        return plan(stages, MLP_TENSORS)

    even = ex.megatron_config(pipeline(4, 4, 4))
    assert (even["pp"], even["num_layers"], even["first_stage_layers"], even["last_stage_layers"]) == (3, 12, None, None)
    ends = pipeline(5, 6, 6, 4)
    c = ex.megatron_config(ends)
    assert (c["num_layers"], c["first_stage_layers"], c["last_stage_layers"]) == (21, 5, 4)
    args = ex.to_megatron(ends)
    assert args[args.index("--decoder-first-pipeline-num-layers") + 1] == "5"
    assert args[args.index("--decoder-last-pipeline-num-layers") + 1] == "4"
    two = ex.megatron_config(pipeline(3, 5))  # the last stage takes what the first leaves
    assert (two["first_stage_layers"], two["last_stage_layers"]) == (3, None)
    with pytest.raises(ex.NotExpressibleError, match="stage 2 holds 7 transformer layers but stage 1 holds 6"):
        ex.megatron_config(pipeline(5, 6, 7, 6))
    misplaced = pipeline(4, 4)
    misplaced.stages[1].devices = list(range(16, 24))
    with pytest.raises(ex.NotExpressibleError, match="stage 1 runs on devices 16–23 but Megatron's pipeline rank 1 "
                                                     "holds global ranks 8–15"):
        ex.megatron_config(misplaced)


def test_export_text_per_target_and_unknown_target():
    p = plan([megatron_stage()], MLP_TENSORS)
    assert json.loads(ex.export(p, "jax")) == ex.to_jax(p)
    assert json.loads(ex.export(p, "dtensor")) == ex.to_dtensor(p)
    assert shlex.split(ex.export(p, "megatron")) == ex.to_megatron(p)
    with pytest.raises(PartoptError, match="unknown export target 'xla'.*jax, dtensor, megatron"):
        ex.export(p, "xla")


def test_a_plan_naming_an_unknown_tensor_or_dim_is_an_instance_error():
    missing = megatron_stage()
    missing.ops["fc1"] = dataclasses.replace(missing.ops["fc1"], tensor="nowhere")
    with pytest.raises(InstanceError, match="tensor 'nowhere' is missing"):
        ex.to_jax(plan([missing], MLP_TENSORS))
    wrong_dim = megatron_stage()
    wrong_dim.params["w1"] = param("[R, S(s)]")
    with pytest.raises(InstanceError, match="splits 's', which 'w1'"):
        ex.to_dtensor(plan([wrong_dim], MLP_TENSORS))
    short = megatron_stage()
    short.ops["gelu"] = dataclasses.replace(short.ops["gelu"], axes=("b",))
    with pytest.raises(InstanceError, match="op gelu has 1 axis entries for a 2-axis mesh"):
        ex.megatron_config(plan([short], MLP_TENSORS))


# ---------------------------------------------------------------- real solves: consistency

SMALL_GPT = {"hidden": 1024, "layers": 2, "heads": 16, "seq": 512, "vocab": 4096, "batch": 32}


@pytest.fixture(scope="module")
def solved():
    """Small real plans: a 2-layer GPT pipelined on (2, 2) meshes, and an MLP sharded over 8 devices."""
    cluster = preset("p3.16xlarge", 1)
    graph = gpt(**SMALL_GPT)
    pipelined = optimize(graph, cluster, microbatches=2, layers=2, logical_shapes=[(2, 2)], schedule="1f1b")  # Megatron runs it
    mlp = read_graph(INSTANCES / "mlp-2layer.json")
    sharded = optimize(mlp, cluster, intra_only=True)
    return [(graph, pipelined), (mlp, sharded)]


def assert_valid(t_dims, t_shape, per_dim_axes, mesh):
    for dim, size, axes in zip(t_dims, t_shape, per_dim_axes):
        assert size % math.prod(mesh[k] for k in axes) == 0, (dim, size, axes)


def test_every_parameter_is_exported_with_a_placement_valid_for_its_shape(solved):
    for graph, p in solved:
        jax, dt = ex.to_jax(p), ex.to_dtensor(p)
        assert set().union(*(s["params"] for s in jax["stages"])) == {t.name for t in graph.params}
        assert set().union(*(s["params"] for s in dt["stages"])) == {t.name for t in graph.params}
        for i, (js, ds) in enumerate(zip(jax["stages"], dt["stages"])):
            mesh = js["mesh"]["shape"]
            assert mesh == list(p.stages[i].logical_mesh) == ds["device_mesh"]["shape"]
            assert sorted(d for row in js["mesh"]["devices"] for d in row) == sorted(p.stages[i].devices)
            for kind in ("params", "activations"):
                assert set(js[kind]) == set(ds[kind])
                for name, entry in js[kind].items():
                    dims, shape = p.tensors[name]["dims"], p.tensors[name]["shape"]
                    spec = entry["spec"] if entry["spec"] is not None else entry["pending_reduction"]["spec"]
                    assert len(spec) == len(dims)  # one JAX entry per TENSOR dim
                    names = [[] if e is None else [e] if isinstance(e, str) else e for e in spec]
                    per_dim = [[ex.AXIS_NAMES.index(n) for n in ns] for ns in names]
                    assert_valid(dims, shape, per_dim, mesh)
                    placements = ds[kind][name]["placements"]
                    assert len(placements) == len(mesh)  # one DTensor placement per MESH dim
                    for k, pl in enumerate(placements):  # the two exports agree axis by axis
                        if pl["type"] == "Shard":
                            assert 0 <= pl["dim"] < len(dims) and k in per_dim[pl["dim"]]
                        else:
                            assert all(k not in axes for axes in per_dim)
                        assert (pl["type"] == "Partial") == (ex.AXIS_NAMES[k] in
                                                             (entry.get("pending_reduction") or {}).get("axes", []))
                    if "optimizer_state" in entry:
                        opt = entry["optimizer_state"]["spec"]
                        opt_axes = [[] if e is None else [e] if isinstance(e, str) else e for e in opt]
                        assert_valid(dims, shape, [[ex.AXIS_NAMES.index(n) for n in ns] for ns in opt_axes], mesh)


def assert_megatron_consistent(p):
    try:
        c = ex.megatron_config(p)
    except ex.NotExpressibleError as err:
        assert "\n" not in err.line()
        return None
    devices = sum(len(s.devices) for s in p.stages)
    assert c["tp"] * c["dp"] * c["pp"] == devices
    assert c["pp"] == len(p.stages)
    assert c["micro_batch_size"] * c["dp"] == p.microbatch_size
    assert c["global_batch_size"] == c["micro_batch_size"] * c["dp"] * c["num_microbatches"]
    assert sum(c["layers_per_stage"]) == c["num_layers"]
    return c


def test_megatron_numbers_are_consistent_with_real_plans(solved):
    for _, p in solved:
        assert_megatron_consistent(p)


def test_data_parallel_only_solves_export_as_pure_data_parallelism():
    cluster = preset("p3.16xlarge", 1)
    graph = gpt(**SMALL_GPT)
    p = optimize(graph, cluster, microbatches=2, layers=2, data_parallel_only=True)
    c = assert_megatron_consistent(p)
    devices = len(p.stages[0].devices)
    assert c is not None and c["tp"] == 1 and c["dp"] == devices
    assert c["global_batch_size"] == SMALL_GPT["batch"] and c["num_layers"] == SMALL_GPT["layers"]


# ---------------------------------------------------------------- exports carry what the plan's prices assume

def test_a_plan_of_fused_attention_asks_the_runtime_for_it():
    cluster = preset("p3.16xlarge", 1)
    flash = optimize(gpt(**SMALL_GPT, attention_kernel="flash"), cluster, microbatches=2, layers=2,
                     data_parallel_only=True)
    math = optimize(gpt(**SMALL_GPT), cluster, microbatches=2, layers=2, data_parallel_only=True)
    assert ex.training(flash)["fused_attention"] and not ex.training(math)["fused_attention"]
    args = ex.to_megatron(flash)
    assert args[args.index("--attention-backend") + 1] == "flash"
    assert "--attention-backend" not in ex.to_megatron(math)  # the math path: Megatron-LM's own choice
    assert json.loads(ex.export(flash, "jax"))["training"]["fused_attention"] is True


def test_a_plan_of_fp8_gemms_asks_megatron_for_them():
    """A plan priced with FP8 GEMMs (`matmul_dtype`) holds only if the runtime runs them: Megatron-LM gets
    Transformer Engine's FP8 recipe; a plan at its tensors' precision gets no FP8 flag."""
    cluster = preset("dgx-h100", 1)
    graph = gpt(**SMALL_GPT)
    fp8 = optimize(dataclasses.replace(graph, matmul_dtype="fp8"), cluster, microbatches=2, layers=2,
                   data_parallel_only=True)
    plain = optimize(graph, cluster, microbatches=2, layers=2, data_parallel_only=True)
    assert (fp8.matmul_dtype, plain.matmul_dtype) == ("fp8", None)
    assert ex.training(fp8)["matmul_dtype"] == "fp8" and ex.training(plain)["matmul_dtype"] is None
    args = ex.to_megatron(fp8)
    assert args[args.index("--fp8-format") + 1] == "hybrid"
    assert "--fp8-format" not in ex.to_megatron(plain)
    assert plan_from_dict(plan_to_dict(fp8)).matmul_dtype == "fp8"  # the file keeps it


SMALL_LLAMA = {"hidden": 1024, "layers": 2, "heads": 16, "kv_heads": 4, "ffn": 2816, "seq": 512, "vocab": 4096,
               "batch": 32}


def _value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


LLAMA_FLAGS = {"--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"}


@pytest.mark.parametrize("make, sizes, tp, refused", [
    (gpt, dict(SMALL_GPT, hidden=256, heads=4), 8, "does not divide the 4 attention heads"),
    (llama, dict(SMALL_LLAMA, hidden=768, heads=12, kv_heads=3), 4, "neither divides nor is divided by the 3 query"),
    (llama, SMALL_LLAMA, 8, None)])  # 8 ranks over 16 heads, 2 per query group of 4: Megatron-LM takes it
def test_megatron_gets_whole_heads_per_tensor_parallel_rank(make, sizes, tp, refused):
    """Megatron-LM's TransformerConfig raises unless tp divides the heads, and divides or is divided by the query
    groups: such a plan (partopt splits head widths too) is refused by name, not written as a line that fails."""
    from partopt.evaluate import uniform

    plan = uniform(make(**sizes), preset("dgx-a100", 1).narrowed(tp), tp=tp, pp=1, dp=1, microbatches=1,
                   recompute="full", check_memory=False)
    if refused is None:
        assert _value(ex.to_megatron(plan), "--tensor-model-parallel-size") == str(tp)
        return
    with pytest.raises(ex.NotExpressibleError, match=refused) as info:
        ex.to_megatron(plan)
    assert info.value.where.startswith("architecture.")


@pytest.mark.parametrize("make, sizes, flags", [
    (gpt, dict(SMALL_GPT, attention_dropout=0.1), set()),
    (llama, SMALL_LLAMA, LLAMA_FLAGS),
    (llama, dict(SMALL_LLAMA, head_dim=128), LLAMA_FLAGS)])  # heads twice hidden / heads wide
def test_megatron_gets_the_model_the_plan_priced(make, sizes, flags):
    """Megatron-LM's model arguments say the generator's sizes and structure (GPT: LayerNorm, GELU, learned
    positions, tied head, biases, Megatron's defaults; Llama: RMSNorm, SwiGLU, rotary, grouped-query attention,
    untied head, no biases), and read back into the generator they build a graph of exactly as many parameters."""
    graph = make(**sizes)
    plan = optimize(graph, preset("dgx-a100", 1), microbatches=2, layers=2, data_parallel_only=True)
    args = ex.to_megatron(plan)
    assert _value(args, "--hidden-size") == str(sizes["hidden"])
    assert _value(args, "--num-attention-heads") == str(sizes["heads"])
    assert _value(args, "--ffn-hidden-size") == str(sizes.get("ffn", 4 * sizes["hidden"]))
    assert _value(args, "--seq-length") == _value(args, "--max-position-embeddings") == str(sizes["seq"])
    assert _value(args, "--num-query-groups") == (str(sizes["kv_heads"]) if "kv_heads" in sizes else None)
    assert float(_value(args, "--attention-dropout")) == sizes.get("attention_dropout", 0.0)
    # the graph drops no hidden state (its only dropouts are the attention's), so Megatron-LM's 0.1 is switched off
    assert all(op.name.endswith("attention_dropout") for op in graph.ops if "dropout" in op.name)
    assert float(_value(args, "--hidden-dropout")) == 0.0
    # Megatron-LM pads the tokenizer's vocabulary to a multiple of --make-vocab-size-divisible-by × tp
    # (megatron/training/tokenizer: _vocab_size_with_padding): every tokenizer of at most V tokens pads to V exactly
    multiple = int(_value(args, "--make-vocab-size-divisible-by")) * int(_value(args, "--tensor-model-parallel-size"))
    assert all(-(-tokens // multiple) * multiple == sizes["vocab"] for tokens in (1, sizes["vocab"] - 7, sizes["vocab"]))
    assert (_value(args, "--normalization"), _value(args, "--position-embedding-type")) == (
        ("RMSNorm", "rope") if make is llama else (None, None))
    optional = {"--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"}
    assert optional & set(args) == flags
    shape = {"hidden": int(_value(args, "--hidden-size")), "layers": int(_value(args, "--num-layers")),
             "heads": int(_value(args, "--num-attention-heads")), "seq": int(_value(args, "--seq-length")),
             "vocab": sizes["vocab"], "batch": sizes["batch"]}  # the tokenizer sets the vocabulary, not an argument
    if make is llama:
        shape |= {"kv_heads": int(_value(args, "--num-query-groups")), "ffn": int(_value(args, "--ffn-hidden-size"))}
    if "--kv-channels" in args:  # Megatron-LM's head size, hidden / heads unless given
        shape["head_dim"] = int(_value(args, "--kv-channels"))
    assert (_value(args, "--kv-channels") is None) == ("head_dim" not in sizes)
    assert make(**shape).num_params == graph.num_params


@pytest.mark.parametrize("vocab, padded", [(4000, 4000), (4001, 4004)])  # Megatron-LM's default: 4096 both
def test_megatron_pads_the_vocabulary_to_the_priced_one_where_tensor_parallelism_allows(vocab, padded):
    """On tp 4, Megatron-LM's padding (the tokenizer's size up to a multiple of --make-vocab-size-divisible-by × tp)
    with the exported divisor gives back V when 4 divides it; else the nearest multiple of 4, which is all it can."""
    from partopt.evaluate import uniform

    plan = uniform(gpt(**dict(SMALL_GPT, vocab=vocab)), preset("dgx-a100", 1).narrowed(4), tp=4, pp=1, dp=1,
                   microbatches=1, recompute="none")
    args = ex.to_megatron(plan)
    multiple = int(_value(args, "--make-vocab-size-divisible-by")) * int(_value(args, "--tensor-model-parallel-size"))
    assert -(-vocab // multiple) * multiple == padded


def test_a_graph_without_an_architecture_exports_the_layout_alone_and_a_wrong_one_is_refused(tmp_path):
    graph = gpt(**SMALL_GPT)
    cluster = preset("dgx-a100", 1)
    plain = optimize(dataclasses.replace(graph, architecture=None), cluster, microbatches=2, layers=2,
                     data_parallel_only=True)
    assert plain.architecture is None and "--hidden-size" not in ex.to_megatron(plain)
    assert ex.megatron_warnings(plain)[0].startswith("the plan's graph records no transformer architecture")
    assert not any("architecture" in line for line in ex.megatron_warnings(optimize(graph, cluster, microbatches=2,
                                                                                    layers=2, data_parallel_only=True)))
    plan = optimize(graph, cluster, microbatches=2, layers=2, data_parallel_only=True)
    assert plan_from_dict(plan_to_dict(plan)).architecture == graph.architecture  # the plan file keeps it
    wrong = dataclasses.replace(plan, architecture={**plan.architecture, "layers": 3})
    with pytest.raises(InstanceError, match="stages hold 2 transformer layers but the architecture records 3"):
        ex.to_megatron(wrong)
    with pytest.raises(InstanceError, match="the plan records layers 3, the graph's architecture 2") as err:
        check_against(wrong, graph, cluster)
    assert err.value.where.endswith("$.architecture.layers")
    check_against(plan, dataclasses.replace(graph, architecture=None), cluster)  # a graph recording none: no conflict
    wider = dataclasses.replace(graph, architecture={**graph.architecture, "head_dim": 128})  # a key the plan lacks
    with pytest.raises(InstanceError, match="the plan records head_dim None, the graph's architecture 128") as err:
        check_against(plan, wider, cluster)
    assert err.value.where.endswith("$.architecture.head_dim")


@pytest.mark.parametrize("dtype, flag", [("fp16", "--fp16"), ("bf16", "--bf16"), ("fp32", None)])
def test_megatron_trains_in_the_precision_the_plan_priced(dtype, flag):
    """Megatron-LM trains in fp32 unless told --fp16 or --bf16: the plan's 16-bit weights and activations hold only
    with the flag of the graph's dtype. An FP8 plan keeps its tensors' precision too (Transformer Engine's FP8 runs
    over bf16 or fp16 training)."""
    cluster = preset("dgx-a100", 1)
    graph = gpt(**SMALL_GPT, dtype=dtype)
    plan = optimize(graph, cluster, microbatches=2, layers=2, data_parallel_only=True)
    assert ex.training(plan)["param_dtypes"] == [dtype]
    args = ex.to_megatron(plan)
    assert [a for a in args if a in ("--fp16", "--bf16")] == ([flag] if flag else [])
    if dtype != "fp32":
        fp8 = optimize(dataclasses.replace(graph, matmul_dtype="fp8"), cluster, microbatches=2, layers=2,
                       data_parallel_only=True)
        assert flag in ex.to_megatron(fp8) and "--fp8-format" in ex.to_megatron(fp8)


def test_a_plan_written_before_dtypes_were_recorded_still_reads_checks_and_exports_without_a_precision():
    graph = gpt(**SMALL_GPT)
    cluster = preset("dgx-a100", 1)
    plan = optimize(graph, cluster, microbatches=2, layers=2, data_parallel_only=True)
    data = plan_to_dict(plan)
    for t in data["tensors"].values():
        del t["dtype"]
    old = plan_from_dict(data)
    assert ex.training(old)["param_dtypes"] is None
    assert "--fp16" not in ex.to_megatron(old)
    check_against(old, graph, cluster)
    assert evaluate(graph, cluster, old).iteration_time_s == pytest.approx(plan.iteration_time_s, rel=1e-12)
    data["tensors"]["l0.fc1.w"]["dtype"] = "bf16"  # one dtype that is not the graph's: named, with its path
    with pytest.raises(InstanceError, match=r"fc1\.w.*bf16.*fp16") as err:
        check_against(plan_from_dict(data), graph, cluster)
    assert "$.tensors['l0.fc1.w']" in err.value.where
    mixed = plan_to_dict(plan)
    mixed["tensors"]["l0.fc1.w"]["dtype"] = "bf16"
    with pytest.raises(ex.NotExpressibleError, match="parameters are bf16, fp16"):
        ex.to_megatron(plan_from_dict(mixed))


def megatron_settings(args: list[str], devices: int) -> dict:
    """What Megatron-LM would run, read back from its arguments alone (flags: present or not)."""
    values = {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}
    tp, pp = int(values["--tensor-model-parallel-size"]), int(values["--pipeline-model-parallel-size"])
    dp = devices // (tp * pp)
    micro, total = int(values["--micro-batch-size"]), int(values["--global-batch-size"])
    recompute = values.get("--recompute-granularity", "none")
    if recompute == "full":  # partopt's full recomputation: every layer, in full
        assert (values["--recompute-method"], values["--recompute-num-layers"]) == ("uniform", "1")
    return {"tp": tp, "pp": pp, "dp": dp, "microbatches": total // (micro * dp),
            "zero": "--use-distributed-optimizer" in args, "recompute": recompute,
            "expert_parallel": int(values.get("--expert-model-parallel-size", 1))}


@pytest.mark.parametrize("zero,recompute", [(False, "full"), (True, "full"), (True, "none"), (False, "selective")])
def test_megatron_arguments_re_price_to_the_plans_time_and_memory(zero, recompute):
    """The issue's case: a recomputing plan exported without --recompute-* would need far more memory."""
    from partopt.evaluate import uniform
    graph = gpt(hidden=2048, layers=4, heads=16, seq=1024, vocab=1024, batch=16)
    cluster = preset("p3.16xlarge", 1)
    plan = uniform(graph, cluster, 2, 2, 2, microbatches=4, zero=zero, recompute=recompute)
    read = megatron_settings(ex.to_megatron(plan), cluster.num_devices)
    assert (read["zero"], read["recompute"]) == (zero, recompute)
    again = uniform(graph, cluster, read["tp"], read["pp"], read["dp"], read["microbatches"], zero=read["zero"],
                    recompute=read["recompute"])
    assert again.iteration_time_s == pytest.approx(plan.iteration_time_s, rel=1e-9)
    assert again.memory_peak_bytes == pytest.approx(plan.memory_peak_bytes, rel=1e-9)
    if recompute != "none":  # without the flags the runtime keeps every activation: the export must not drop them
        dropped = uniform(graph, cluster, read["tp"], read["pp"], read["dp"], read["microbatches"], zero=read["zero"],
                          recompute="none")
        assert dropped.memory_peak_bytes > plan.memory_peak_bytes
        # full recomputation keeps a layer's input, 2·s·b·h bytes, of Korthikanti et al.'s s·b·h·(10 + 24/t + 5·a·s/(h·t))
        # = 42·s·b·h here (t 2, a 16, s 1024, h 2048): far more than 1.5 times, whatever the weights' layouts
        kept = [stage.breakdown["activation_bytes"] for stage in (dropped.stages[0], plan.stages[0])]
        assert kept[0] > (1.5 if recompute == "full" else 1.0) * kept[1]


def settings_from_export(plan: Plan, exported: dict, target: str) -> Plan:
    """`plan` with everything the export states put back from the export: microbatches, recompute, each stage's
    mesh, devices, parameter placements and optimizer-state axes (ops keep the plan's own strategies)."""
    data = plan_to_dict(plan)
    t = exported["training"]
    assert t["schedule"] == "1f1b" and t["global_batch_size"] == t["num_microbatches"] * t["microbatch_size"]
    data.update(num_microbatches=t["num_microbatches"], microbatch_size=t["microbatch_size"])
    for stage, out, recompute in zip(data["stages"], exported["stages"], t["recompute"]):
        stage["recompute"] = "none" if recompute is None else recompute["granularity"]
        mesh = out["mesh"] if target == "jax" else out["device_mesh"]
        grid = mesh["devices"] if target == "jax" else mesh["mesh"]
        stage.update(logical_mesh=mesh["shape"], devices=[d for row in grid for d in row])
        params = {}
        for name, entry in out["params"].items():
            state = entry.get("optimizer_state")
            zero = set()
            if state:  # the axes the state is split over beyond the parameter's own, and the flat ones
                zero = (_axes_of(state, target) - _axes_of(entry, target)) | {ex.AXIS_NAMES.index(a) for a in state["flat_axes"]}
            params[name] = {"placement": entry["placement"], "zero_axes": sorted(zero)}
        stage["params"] = params
    return plan_from_dict(data)


def _axes_of(entry: dict, target: str) -> set[int]:
    """Mesh axes that split some tensor dim in a JAX spec or a DTensor placements list."""
    if target == "jax":
        return {ex.AXIS_NAMES.index(n) for e in entry["spec"] if e is not None for n in ([e] if isinstance(e, str) else e)}
    return {k for k, p in enumerate(entry["placements"]) if p["type"] == "Shard"}


@pytest.mark.parametrize("target", ["jax", "dtensor"])
def test_jax_and_dtensor_exports_re_price_to_the_plans_time_and_memory(tiny, target):
    plan = optimize(tiny.graph, tiny.cluster, microbatches=2, layers=2, logical_shapes=[(2, 1)], workers=1, recompute=True,
                    schedule="1f1b")
    assert any(info.zero_axes for s in plan.stages for info in s.params.values())  # ZeRO is exercised too
    exported = json.loads(ex.export(plan, target))
    assert exported["training"]["recompute"] == [{"granularity": "full", "method": "uniform", "num_layers": 1}] * len(plan.stages)
    again = evaluate(tiny.graph, tiny.cluster, settings_from_export(plan, exported, target))
    assert again.iteration_time_s == pytest.approx(plan.iteration_time_s, rel=1e-9)
    assert [s.memory_bytes for s in again.stages] == pytest.approx([s.memory_bytes for s in plan.stages], rel=1e-9)
    exported["training"]["recompute"] = [None] * len(plan.stages)  # what the export used to say: every activation kept
    kept = evaluate(tiny.graph, tiny.cluster, settings_from_export(plan, exported, target))
    # the first stage holds two microbatches: keeping every activation costs it more than recomputing
    # (the last, with one, holds about the same either way: its peak is the head's working set)
    assert kept.stages[0].inflight_microbatches == 2
    assert kept.stages[0].memory_bytes > plan.stages[0].memory_bytes


def test_exports_state_the_schedule_microbatches_and_sequence_parallelism(solved):
    graph, p = solved[0]
    for target in ("jax", "dtensor"):
        t = json.loads(ex.export(p, target))["training"]
        assert (t["schedule"], t["num_microbatches"], t["microbatch_size"]) == ("1f1b", 2, 16)
        assert t["recompute"] == [ex.recomputation(s) for s in p.stages]
        assert t["optimizer_state_sharded"] == any(i.zero_axes for s in p.stages for i in s.params.values())
        assert set(t["sequence_parallel"]) <= set(range(len(p.stages)))
    seq = plan([megatron_stage(norm_axes=("b", "s"))], MLP_TENSORS)
    assert ex.training(seq)["sequence_parallel"] == [0]
    assert ex.training(plan([megatron_stage(norm_axes=("b", None))], MLP_TENSORS))["sequence_parallel"] == []


@pytest.mark.parametrize("dtype, layout, warned", [("bf16", "zero", 2), ("fp16", "zero", 4), ("bf16", "megatron", None),
                                                  ("fp32", "zero", None)])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_megatron_export_warns_when_the_plan_priced_less_state_than_megatron_lm_keeps(tmp_path, dtype, layout, warned,
                                                                                      optimizer):
    """A 16-bit plan priced in the ZeRO paper's layout is warned about, by the bytes Megatron-LM's fp32 gradients add
    whatever the optimizer: bf16 gradients widened to fp32 (4 - 2 = 2 bytes), fp16 ones kept beside fp32 main
    gradients (4); one priced in Megatron-LM's layout, or in fp32 (no difference), is not."""
    from click.testing import CliRunner

    from partopt.cli import main
    from partopt.evaluate import uniform
    from partopt.plan import write_plan

    graph = dataclasses.replace(gpt(**SMALL_GPT, dtype=dtype), optimizer=optimizer)
    plan = uniform(graph, preset("dgx-a100", 1), 2, 1, 4, microbatches=2, zero=True, state_layout=layout)
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    result = CliRunner().invoke(main, ["export", str(path), "--to", "megatron"])
    assert result.exit_code == 0, result.output + result.stderr
    assert "--use-distributed-optimizer" in result.stdout
    assert ("--optimizer sgd" in result.stdout) == (optimizer == "sgd")  # Megatron-LM's default is Adam
    if warned is None:
        assert "warning" not in result.stderr
    else:
        assert f"keeps {warned} more bytes per parameter in {dtype}" in result.stderr
        priced = {"adam": 2 + 2 + 12, "sgd": 2 + 2 + 8}[optimizer]  # 16-bit weights and gradients, fp32 state
        assert f"with {optimizer} {priced + warned} bytes where {priced} were priced" in result.stderr
        assert "--state-layout megatron" in result.stderr


SMALL_MOE = {"hidden": 256, "layers": 2, "heads": 4, "experts": 4, "seq": 128, "vocab": 1024, "batch": 16,
             "group_size": 128, "optimizer": "adam"}  # block 1's MLP is 4 experts; Adam, which Megatron-LM runs


def moe_plan(tp, dp, sequence_parallel=False, expert_parallel=1):
    """SMALL_MOE in Megatron's layout on 4 GPUs, 2 microbatches of 8 samples."""
    from partopt.evaluate import uniform
    from partopt.models.moe import moe

    return uniform(moe(**SMALL_MOE), preset("dgx-a100", 1).narrowed(4), tp, 1, dp, microbatches=2,
                   sequence_parallel=sequence_parallel, expert_parallel=expert_parallel)


def test_a_data_parallel_moe_plan_exports_its_flattened_tokens_as_data_parallel():
    """The MoE layer flattens b·s into bs and groups bs into g: a split of either carries the samples, so the data-
    parallel axis that splits them is data parallelism (it used to read as tensor parallelism mixed with data
    parallelism, and was refused). By hand: 8 samples per microbatch over 4 ranks, 2 each; the experts are whole on
    every rank, Megatron-LM's default (no expert parallelism)."""
    plan = moe_plan(tp=1, dp=4)
    assert ex.batch_carriers(plan) == {"b", "bs", "g"}
    assert shlex.join(ex.to_megatron(plan)) == (
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 2 --micro-batch-size 2 "
        "--global-batch-size 16 --overlap-grad-reduce --fp16")


def test_experts_split_over_the_tensor_parallel_ranks_export_as_megatron_expert_parallelism():
    """Experts split over the tensor-parallel axis, each held whole, are Megatron-LM's expert parallelism of tp ranks
    with no expert tensor parallelism (its --expert-tensor-parallel-size defaults to tp, arguments.py). The line
    meets validate_args and parallel_state by hand: 4 experts are a multiple of the expert-parallel size 2
    (arguments.py: num_experts % expert_model_parallel_size == 0), and the 4 ranks a multiple of ETP 1 × EP 2 × PP 1
    (parallel_state.initialize_model_parallel), leaving 2 expert-data-parallel ranks, the data-parallel size.
    Without sequence parallelism it is refused: Megatron-LM's MoE layer raises when trained with tensor parallelism
    but not sequence parallelism (megatron/core/transformer/moe/moe_layer.py). A dense model's heads, which the
    attention core reads split on both operands too, are no experts."""
    plan = moe_plan(tp=2, dp=2, sequence_parallel=True)
    assert {p.placement for n, p in plan.stages[0].params.items() if n.startswith("l1.fc")} == {(R, Shard("e"))}
    args = shlex.join(ex.to_megatron(plan))
    assert ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --num-layers 2 --micro-batch-size 4 "
            "--global-batch-size 16 --sequence-parallel --num-experts 4 --expert-model-parallel-size 2 "
            "--expert-tensor-parallel-size 1 ") in args
    with pytest.raises(ex.NotExpressibleError, match=r"the plan splits the experts \(e\) under tensor parallelism but no "
                       "norm splits the sequence, and Megatron-LM's MoE layers train with tensor parallelism only "
                       "under --sequence-parallel") as info:
        ex.to_megatron(moe_plan(tp=2, dp=2))
    assert info.value.where == "stage 0" and "--sequence-parallel" in info.value.hint
    from partopt.evaluate import uniform

    dense = uniform(gpt(**SMALL_GPT), preset("dgx-a100", 1), 8, 1, 1, microbatches=2, sequence_parallel=True)
    assert not any("expert" in a for a in ex.to_megatron(dense))


@pytest.mark.parametrize("tp, dp, line", [
    (1, 4, "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 2 --micro-batch-size 2 "
           "--global-batch-size 16 --num-experts 4 --expert-model-parallel-size 4 --expert-tensor-parallel-size 1 "
           "--overlap-grad-reduce --fp16"),
    (2, 2, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --num-layers 2 --micro-batch-size 4 "
           "--global-batch-size 16 --sequence-parallel --num-experts 4 --expert-model-parallel-size 2 "
           "--expert-tensor-parallel-size 2 --overlap-grad-reduce --fp16")])
def test_experts_split_over_the_data_parallel_ranks_export_as_megatron_expert_parallelism(tp, dp, line):
    """Megatron-LM's usual expert parallelism: the experts split over the data-parallel ranks, each rank holding
    E / EP of them whole (their weights not copies: reduced over the expert-data-parallel group), the tokens sent to
    them and back by all-to-all, attention and router data parallel. The plans are uniform's with
    expert_parallel = dp, priced as made (used to be refused: the axis mixed data and tensor parallelism). By hand,
    against Megatron-LM at d98e8a6:
    * tp 1, dp 4: 2 microbatches of 8 samples, 8 / 4 = 2 per rank; the 4 experts split 4 ways, one whole per rank:
      EP 4, a divisor of the 4 experts (arguments.py:1655-1658); each expert unsplit: ETP 1 (its default, tp, is 1
      too); the expert grid ETP 1 × EP 4 × PP 1 divides the 4 ranks, leaving 1 expert-data-parallel rank
      (parallel_state.py:874-884).
    * tp 2, dp 2, sequence parallel: 8 / 2 = 4 samples per rank; the experts split 2 ways over axis 0 (EP 2) and
      each one's hidden units over axis 1 (ETP 2, its default tp); the grid 2 × 2 × 1 divides 4, and its order
      tp-ep-dp (parallel_state.py:887-895: global rank = etp + 2·ep) makes the expert-parallel groups {0, 2} and
      {1, 3}, the plan's axis 0, whose devices are tp = 2 apart.
    The line read back into uniform prices the plan it came from."""
    from partopt.evaluate import uniform
    from partopt.models.moe import moe

    plan = moe_plan(tp=tp, dp=dp, sequence_parallel=tp > 1, expert_parallel=dp)
    assert plan.stages[0].params["l1.fc1.w"].placement == (Shard("e"), Shard("f") if tp > 1 else R)
    args = ex.to_megatron(plan)
    assert shlex.join(args) == line
    read = megatron_settings(args, 4)
    again = uniform(moe(**SMALL_MOE), preset("dgx-a100", 1).narrowed(4), read["tp"], read["pp"], read["dp"],
                    read["microbatches"], sequence_parallel="--sequence-parallel" in args,
                    expert_parallel=read["expert_parallel"])
    assert again.iteration_time_s == pytest.approx(plan.iteration_time_s, rel=1e-9)


def repriced(plan, mesh, axes, placement):
    """`plan` (SMALL_MOE's, one stage) priced again by `evaluate` on logical mesh `mesh`, each op pinned to
    `axes(op, its axes)` and each parameter to `placement(name, its placement)`: a layout uniform does not make, its
    ops' placements derived as any plan's."""
    from partopt.models.moe import moe

    stage = plan.stages[0]
    ops = {name: dataclasses.replace(entry, axes=axes(name, entry.axes)) for name, entry in stage.ops.items()}
    params = {name: ParamPlacement(placement(name, p.placement)) for name, p in stage.params.items()}
    edited = dataclasses.replace(stage, logical_mesh=list(mesh), ops=ops, params=params)
    return evaluate(moe(**SMALL_MOE), preset("dgx-a100", 1).narrowed(4), dataclasses.replace(plan, stages=[edited]))


EXPERT_OPS = ("l1.fc1", "l1.relu", "l1.fc2")  # what runs SMALL_MOE's experts on their tokens (evaluate.expert_ops)


def test_megatron_takes_the_expert_grids_it_runs_and_refuses_the_others():
    """Megatron-LM orders its expert grid tp-ep-dp (parallel_state.py:887-895): expert tensor parallelism innermost,
    then expert parallelism, then expert data parallelism, every rank doing its own share. Plans priced again with
    their experts' ops moved (`repriced`):
    * on a 2 × 2 all-data-parallel mesh (dp 4), experts over axis 1 and their groups over axis 0 are EP 2 over
      consecutive ranks {0, 1} and {2, 3}, ETP 1: Megatron-LM's; experts over axis 0 and groups over axis 1 would
      put expert-parallel ranks 2 apart, outside expert-data-parallel ones, and are refused;
    * tp 2, dp 2 with the experts over both axes, 4 ways, each whole: EP 4 with ETP 1, one expert-parallel group of
      global ranks 0-3 (the grid 1 × 4 × 1 divides the 4 ranks, parallel_state.py:874-884), the plan's whole mesh;
      with the experts over axis 0 but each one whole on both tensor-parallel ranks (not split along its hidden
      units), ETP 1 × EP 2 would make ranks {0, 1} an expert-parallel group, so it is refused.
    On uniform's tp 1 × dp 4 layout, the router splitting the experts over the data-parallel axis (its tokens
    gathered), or an attention projection run whole on every rank, is not Megatron-LM's either."""
    ep4 = moe_plan(tp=1, dp=4, expert_parallel=4)
    router = repriced(ep4, (4, 1), lambda name, kept: ("e", None) if name == "l1.gate" else kept,
                      lambda name, kept: (Shard("e"), R) if name == "l1.wg" else kept)
    with pytest.raises(ex.NotExpressibleError, match=r"op l1.gate splits the experts \(e\) over data-parallel axis 0 "
                       "but reads an input whole or otherwise split; Megatron-LM runs its router on each rank's own"):
        ex.to_megatron(router)
    replicated = repriced(ep4, (4, 1), lambda name, kept: (None, None) if name == "l1.proj" else kept,
                          lambda name, kept: kept)
    with pytest.raises(ex.NotExpressibleError, match="op l1.proj runs replicated over data-parallel axis 0"):
        ex.to_megatron(replicated)

    def grid(expert_axis):
        def axes(name, kept):
            if name in EXPERT_OPS:
                return ("e", "g") if expert_axis == 0 else ("g", "e")
            return (kept[0], kept[0])  # one dim split over both axes: 4 ways

        def placement(name, kept):
            return ((Shard("e"), R) if expert_axis == 0 else (R, Shard("e"))) if name.startswith("l1.fc") else (R, R)

        return repriced(ep4, (2, 2), axes, placement)

    config = ex.megatron_config(grid(1))
    assert (config["tp"], config["dp"], config["expert_parallel"], config["expert_tensor_parallel"]) == (1, 4, 2, 1)
    assert "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1" in shlex.join(ex.to_megatron(grid(1)))
    with pytest.raises(ex.NotExpressibleError, match=r"axis 0 splits the experts \(e\) and axis 1 their tokens \(g\): "
                       "Megatron-LM's expert grid orders ranks tp-ep-dp"):
        ex.to_megatron(grid(0))
    tp2 = moe_plan(tp=2, dp=2, sequence_parallel=True, expert_parallel=2)
    both = repriced(tp2, (2, 2), lambda name, kept: ("e", "e") if name in EXPERT_OPS else kept,
                    lambda name, kept: (Shard("e"), Shard("e")) if name.startswith("l1.fc") else kept)
    assert "--num-experts 4 --expert-model-parallel-size 4 --expert-tensor-parallel-size 1" in shlex.join(
        ex.to_megatron(both))
    whole = repriced(tp2, (2, 2), lambda name, kept: (kept[0], None) if name in EXPERT_OPS else kept,
                     lambda name, kept: (Shard("e"), R) if name.startswith("l1.fc") else kept)
    with pytest.raises(ex.NotExpressibleError, match="op l1.fc1 runs its experts replicated over axis 1") as info:
        ex.to_megatron(whole)
    assert info.value.where == "stage 0"


TF32_SWITCHES = ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1", "torch.backends.cuda.matmul.allow_tf32 = True")


@pytest.mark.parametrize("dtype, matmul_dtype, gemm_warning", [
    ("fp32", "tf32", "the plan priced its fp32 GEMMs in TF32, which Megatron-LM has no argument for"),
    ("bf16", "tf32", "the plan priced its GEMMs in tf32, but Megatron-LM runs them in bf16"),
    ("fp32", "bf16", "the plan priced its GEMMs in bf16, but Megatron-LM runs them in fp32"),
    ("fp32", None, None), ("bf16", "fp8", None)])
def test_megatron_export_warns_of_gemms_it_runs_at_another_precision_than_priced(dtype, matmul_dtype, gemm_warning):
    """Megatron-LM runs GEMMs in its parameters' dtype (--fp16, --bf16 or fp32), or FP8 with --fp8-format, and has no
    TF32 argument (megatron/training/arguments.py at d98e8a6 names none): a plan priced with TF32 GEMMs over fp32
    weights is warned about with the switches that allow TF32 in torch (off by default), and one priced at another
    GEMM precision than Megatron-LM runs is warned about; the line itself is unchanged."""
    from partopt.evaluate import uniform

    graph = dataclasses.replace(gpt(**SMALL_GPT, dtype=dtype), matmul_dtype=matmul_dtype)
    plan = uniform(graph, preset("dgx-h100", 1), 2, 1, 4, microbatches=2, state_layout="megatron")
    warnings = ex.megatron_warnings(plan)
    assert [w for w in warnings if "GEMM" in w] == ([] if gemm_warning is None else warnings) and len(warnings) <= 1
    if gemm_warning is not None:
        assert warnings[0].startswith(gemm_warning)
        assert all(switch in warnings[0] for switch in TF32_SWITCHES) == (matmul_dtype == "tf32" and dtype == "fp32")
    assert ex.to_megatron(plan) == ex.to_megatron(dataclasses.replace(plan, matmul_dtype=None)) or matmul_dtype == "fp8"


def test_torch_runs_fp32_matmuls_without_tf32_unless_a_named_switch_allows_it():
    """The switches the TF32 warning names do what it says, in the installed torch: TF32 is off by default
    (aten/src/ATen/Context.h: float32_matmul_precision is HIGHEST unless TORCH_ALLOW_TF32_CUBLAS_OVERRIDE is set),
    and the environment variable or the flag turns it on."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torch")
    probe = ("import torch; print(torch.backends.cuda.matmul.allow_tf32); "
             "torch.backends.cuda.matmul.allow_tf32 = True; print(torch.get_float32_matmul_precision())")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"}
    default = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert default.stdout.split() == ["False", "high"]  # off, and the flag turns on TF32 ("high" precision)
    allowed = subprocess.run([sys.executable, "-c", probe], env={**env, "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"},
                             capture_output=True, text=True, check=True)
    assert allowed.stdout.split()[0] == "True"


def test_the_plan_records_its_optimizer_and_the_exports_say_it():
    """The optimizer whose state was priced travels with the plan: the training block names it, Megatron-LM gets it
    (Adafactor, which it lacks, is refused), a graph trained otherwise does not take the plan, and a plan written
    before the record exports as before."""
    from partopt.evaluate import uniform

    cluster = preset("dgx-a100", 1)
    graph = dataclasses.replace(gpt(**SMALL_GPT), optimizer="adafactor")
    plan = uniform(graph, cluster, 2, 1, 4, microbatches=2)
    assert plan.optimizer == "adafactor" and plan_from_dict(plan_to_dict(plan)).optimizer == "adafactor"
    assert ex.training(plan)["optimizer"] == "adafactor"
    with pytest.raises(ex.NotExpressibleError, match="Megatron-LM offers no adafactor") as info:
        ex.to_megatron(plan)
    assert info.value.where == "optimizer"
    with pytest.raises(InstanceError, match="the plan priced adafactor's state, the graph trains with adam"):
        check_against(plan, gpt(**SMALL_GPT), cluster)
    before = dataclasses.replace(plan, optimizer=None)
    assert "--optimizer" not in ex.to_megatron(before) and ex.training(before)["optimizer"] is None


def test_a_tpu_plan_is_refused_by_the_gpu_runtimes_and_exported_to_jax(tmp_path):
    """A plan made for TPUs records their platform, and the GPU runtimes refuse it by its file and that field:
    Megatron-LM runs on NVIDIA GPUs only, and DTensor has no TPU mesh (torch's xla device type hands sharding to
    torch_xla's SPMD: torch/distributed/tensor/_api.py distribute_tensor); JAX runs it. A plan written before the
    record is read by its cluster preset; a GPU plan's DeviceMesh is cuda, recorded or not."""
    from click.testing import CliRunner

    from partopt.cli import main
    from partopt.evaluate import uniform
    from partopt.plan import write_plan

    tpu = uniform(gpt(**SMALL_GPT, dtype="bf16"), preset("tpu-v4", 1), 2, 1, 2, microbatches=2)
    assert tpu.platform == "tpu" and plan_from_dict(plan_to_dict(tpu)).platform == "tpu"
    path = tmp_path / "plan.json"
    write_plan(tpu, path)
    megatron = CliRunner().invoke(main, ["export", str(path), "--to", "megatron"])
    assert megatron.exit_code == 2 and megatron.stderr.splitlines() == [
        f"error: {path}: platform: the plan was made for tpu-v4's TPU devices, and Megatron-LM runs on NVIDIA GPUs "
        "only (hint: export it with --to jax)"]
    dtensor = CliRunner().invoke(main, ["export", str(path), "--to", "dtensor"])
    assert dtensor.exit_code == 2 and len(dtensor.stderr.splitlines()) == 1
    assert dtensor.stderr.startswith(f"error: {path}: platform: the plan was made for tpu-v4's TPU devices, which "
                                     "DTensor does not run on") and dtensor.stderr.endswith("(hint: export it with --to jax)\n")
    assert CliRunner().invoke(main, ["export", str(path), "--to", "jax"]).exit_code == 0
    with pytest.raises(ex.NotExpressibleError, match="Megatron-LM runs on NVIDIA GPUs only"):
        ex.to_megatron(dataclasses.replace(tpu, platform=None))
    gpu = uniform(gpt(**SMALL_GPT, dtype="bf16"), preset("dgx-a100", 1), 2, 1, 4, microbatches=2)
    for p in (gpu, dataclasses.replace(gpu, platform=None)):
        assert {s["device_mesh"]["device_type"] for s in ex.to_dtensor(p)["stages"]} == {"cuda"}
        assert ex.to_megatron(p)[:2] == ["--tensor-model-parallel-size", "2"]


@pytest.mark.parametrize("target", ["jax", "megatron"])
def test_a_torch_model_given_to_an_export_that_does_not_read_it_is_refused(tmp_path, target):
    """--model maps parameters onto a PyTorch model's axes: only the DTensor export reads it, the others refuse it
    before loading anything (the model file need not exist)."""
    from click.testing import CliRunner

    from partopt.cli import main
    from partopt.evaluate import uniform
    from partopt.plan import write_plan

    path = tmp_path / "plan.json"
    write_plan(uniform(gpt(**SMALL_GPT), preset("dgx-a100", 1), 2, 1, 4, microbatches=2), path)
    result = CliRunner().invoke(main, ["export", str(path), "--to", target, "--model", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        f"error: --model: --model maps parameters onto a PyTorch model's axes, which --to {target} does not use "
        "(hint: drop --model, or export with --to dtensor)"]
