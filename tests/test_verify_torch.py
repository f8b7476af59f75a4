"""`partopt verify --against torch`: a plan's parameter placements run with DTensor on gloo CPU
processes must reproduce the unsharded training step."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: configs are built here

import pytest
from click.testing import CliRunner

from partopt.cli import main
from partopt.cluster import preset
from partopt.export import to_dtensor, to_jax
from partopt.frontends.torch import from_hf_config, read_hf_config
from partopt.inter import optimize
from partopt.plan import ParamPlacement, write_plan
from partopt.sharding import R, Shard
from partopt.verify_torch import spawn, verify_plan
from partopt.verify_torch_comm import op_inputs
from test_frontend_torch import mlp_source
from test_verify_torch_comm import LLAMA, data_parallel_plan, megatron_plan



def llama_on_two_devices(directory):
    """The tiny Llama's config file, written in `directory`, and its plan on a 1 x 2 mesh of a p3 node."""
    config = directory / "config.json"
    config.write_text(json.dumps(LLAMA))
    graph = from_hf_config(read_hf_config(config), batch=4, seq=8)
    cluster = preset("p3.16xlarge", 1).narrowed(2)
    return config, optimize(graph, cluster, workers=1, microbatches=[1], logical_shapes=[(1, 2)])


def _abort_after_all_done(rank: int, run_dir: str) -> None:
    Path(run_dir, f"done{rank}").touch()
    while not all(Path(run_dir, f"done{k}").exists() for k in range(2)):
        time.sleep(0.01)
    if rank == 1:
        os.abort()  # what gloo's teardown does when a peer closed its sockets first


def _abort_before_done(rank: int, run_dir: str) -> None:
    if rank == 1:
        os.abort()
    Path(run_dir, f"done{rank}").touch()


def test_a_process_dying_after_every_rank_is_done_does_not_fail_the_run(tmp_path):
    spawn(_abort_after_all_done, (str(tmp_path),), 2, str(tmp_path))


def test_a_process_dying_before_it_is_done_fails_the_run(tmp_path):
    with pytest.raises(Exception, match="SIGABRT"):
        spawn(_abort_before_done, (str(tmp_path),), 2, str(tmp_path))


@pytest.fixture(scope="module")
def split_plan(tmp_path_factory):
    """A Llama plan on a 1 x 2 mesh whose MLP is split column then row, and attention by kv groups."""
    config, plan = llama_on_two_devices(tmp_path_factory.mktemp("verify"))
    params = plan.stages[0].params
    dims = {name: plan.tensors[name]["dims"] for name in params}
    heads = dims["model.layers.0.self_attn.o_proj.weight"][1]  # the kv groups: major part of o_proj's input axis
    f = dims["model.layers.0.mlp.up_proj.weight"][0]
    for name, dim in [("model.layers.0.mlp.up_proj.weight", f), ("model.layers.0.mlp.gate_proj.weight", f),
                      ("model.layers.0.mlp.down_proj.weight", f), ("model.layers.0.self_attn.o_proj.weight", heads),
                      ("model.layers.0.self_attn.k_proj.weight", heads)]:
        params[name] = ParamPlacement((R, Shard(dim)), ())
    return plan, config


def test_dtensor_export_names_modules_and_their_parallel_styles(split_plan):
    plan, _ = split_plan
    stage = to_dtensor(plan)["stages"][0]
    assert stage["begins_at"] == "model.embed_tokens"
    styles = stage["parallelize_plan"]
    assert styles["model.layers.0.mlp.up_proj"] == {"y": "ColwiseParallel()"}
    assert styles["model.layers.0.mlp.gate_proj"] == {"y": "ColwiseParallel()"}
    assert styles["model.layers.0.mlp.down_proj"] == {"y": "RowwiseParallel()"}
    assert styles["model.layers.0.self_attn.o_proj"] == {"y": "RowwiseParallel()"}
    assert styles["model.layers.0.self_attn.k_proj"] == {"y": "ColwiseParallel()"}
    assert all(axis == "y" for module in styles.values() for axis in module)  # axis x splits the batch or nothing


def test_a_weight_split_inside_its_side_gets_no_parallel_style(split_plan):
    """k_proj split along each kv group's head width (the inner factor of torch's output axis) is no ColwiseParallel,
    which cuts that axis into contiguous blocks: the module is left out, its placements say how it is split."""
    plan, _ = split_plan
    inner = copy.deepcopy(plan)
    name = "model.layers.0.self_attn.k_proj.weight"
    groups, width, hidden = inner.tensors[name]["dims"]  # torch's [kv groups × head width, hidden]
    inner.stages[0].params[name] = ParamPlacement((R, Shard(width)), ())
    styles = to_dtensor(inner)["stages"][0]["parallelize_plan"]
    assert "model.layers.0.self_attn.k_proj" not in styles
    assert styles["model.layers.0.mlp.up_proj"] == {"y": "ColwiseParallel()"}  # the others as before


def test_parameters_sharded_under_replicated_ops_compute_right_but_fail_the_collectives(split_plan):
    """Two gloo processes run the split plan: loss and every gradient equal the unsharded step, but the plan
    was edited (its parameters sharded, its ops left replicated, so it prices gathering each weight for its
    op) and DTensor runs the weights tensor parallel instead: the collectives check fails, naming modules."""
    plan, config = split_plan
    report = verify_plan(plan, str(config))
    stage = report.stages[0]
    assert [c.name for c in stage.checks] == ["loss", "gradients", "collectives"]
    assert [c.ok for c in stage.checks] == [True, True, False] and not report.ok
    assert stage.placements["model.layers.0.mlp.up_proj.weight"] == "[Replicate(), Shard(0)]"
    assert stage.placements["model.layers.0.mlp.down_proj.weight"] == "[Replicate(), Shard(1)]"
    assert stage.placements["model.layers.0.self_attn.o_proj.weight"] == "[Replicate(), Shard(1)]"
    # the plan gathers k_proj's weight [2, 8, 32] (fp32: 2,048 B) for its replicated op, DTensor never does
    assert "model.layers.0.self_attn.k_proj: all_gather on y: the plan implies 1 (2,048 B), DTensor ran 0 (0 B)" \
        in stage.differences
    assert any(line.startswith("FAIL collectives") for line in map(str.strip, report.lines()))


@pytest.fixture(scope="module")
def dp_plan(tmp_path_factory):
    return data_parallel_plan(tmp_path_factory.mktemp("dp"))


def test_a_data_parallel_plan_runs_the_collectives_it_prices(dp_plan):
    """The batch split on y up to the final norm, the LM head and loss replicated: DTensor, pinned to the
    plan's layout where lm_head begins, gathers the norm's output there (4 x 8 x 32 fp32 = 4,096 B) instead
    of computing the loss on batch shards, and synchronises the gradients as the plan does: 11 reduce-scatters
    and 12 all-gathers (verify_torch_comm's hand-derived test has the bytes), the norms' 128 B ones not compared."""
    plan, config = dp_plan
    report = verify_plan(plan, str(config))
    stage = report.stages[0]
    assert report.ok, report.lines()
    forward = [(c["module"], c["kind"], c["axis"], c["bytes"]) for c in stage.calls
               if not c["backward"] and c["module"] != "(top level)"]
    assert forward == [("lm_head", "all_gather", "y", 4096)]
    sync = [c["kind"] for c in stage.calls if c["module"] == "(top level)"]
    assert (sync.count("reduce_scatter"), sync.count("all_gather")) == (11, 12)
    small = [c for c in stage.calls if c["module"] == "(top level)" and c["bytes"] <= 256]
    assert {c["bytes"] for c in small} == {32 * 4} and len(small) == 6  # the three norms' weights: listed only


def test_a_megatron_mlp_plan_runs_the_collectives_it_prices(tmp_path):
    """The MLP split Megatron's way on y: DTensor, with the pending sum reduced where it leaves down_proj and the
    input's gradient where it entered the MLP, runs one all-reduce of [4, 8, 32] fp32 (4,096 B) each way and
    reproduces the unsharded step; without those pins it reduced the sum only at model.norm and carried the
    pending gradient into the attention's and embedding's weight gradients."""
    plan, config = megatron_plan(tmp_path)
    report = verify_plan(plan, str(config))
    stage = report.stages[0]
    assert report.ok, report.lines()
    steps = [(c["module"], c["kind"], c["axis"], c["bytes"], c["backward"]) for c in stage.calls
             if c["module"] != "(top level)" and c["bytes"] > 256]
    assert [s for s in steps if not s[4]] == [("model.layers.0.mlp.down_proj", "all_reduce", "y", 4096, False)]
    backward = [(kind, axis, nbytes) for _, kind, axis, nbytes, back in steps if back]
    assert backward == [("all_reduce", "y", 4096)]
    assert stage.placements["model.layers.0.mlp.down_proj.weight"] == "[Replicate(), Shard(1)]"


def test_a_plan_pricing_a_gather_dtensor_does_not_run_fails_naming_the_module(dp_plan, tmp_path):
    """The same plan edited so that the MLP's product reads up_proj's output replicated (an all-gather of
    4 x 8 x 64 fp32 = 8,192 B inside model.layers.0.mlp, where no module begins): the run does not gather
    it (DTensor multiplies the batch shards), so `partopt verify` fails on that module and exits 1."""
    plan, config = dp_plan
    stage = plan.stages[0]
    mul = stage.ops["model.layers.0.mlp.mul"]
    assert op_inputs(mul.explanation) == ["model.layers.0.mlp.act_fn.silu", "model.layers.0.mlp.up_proj.linear"]
    edited = dataclasses.replace(stage, ops={**stage.ops, "model.layers.0.mlp.mul": dataclasses.replace(
        mul, inputs=(mul.inputs[0], (R, R)))})
    path = tmp_path / "edited.json"
    write_plan(dataclasses.replace(plan, stages=[edited]), path)
    result = CliRunner().invoke(main, ["verify", str(path), "--against", "torch", "--model", str(config)])
    assert result.exit_code == 1, result.output
    assert "ok   gradients" in result.output and "FAIL collectives" in result.output
    assert "model.layers.0.mlp: all_gather on y: the plan implies 1 (8,192 B), DTensor ran 0 (0 B)" in result.output


def test_cli_verify_of_a_plan_of_another_graph_is_one_line(tmp_path, split_plan):
    """A plan of partopt's own generator has no input_ids: refused before any process starts."""
    plan, config = split_plan
    foreign = dataclasses.replace(plan, tensors={k: v for k, v in plan.tensors.items() if k != "input_ids"})
    path = tmp_path / "plan.json"
    write_plan(foreign, path)
    result = CliRunner().invoke(main, ["verify", str(path), "--against", "torch", "--model", str(config)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "no tensor input_ids" in result.output


def test_cli_verify_of_a_plan_whose_explanation_lost_an_input_is_one_line(tmp_path, dp_plan):
    """verify reads an op's inputs from its explanation: one that no longer names them is refused, naming the op."""
    plan, config = dp_plan
    stage = plan.stages[0]
    head = stage.ops["lm_head.linear"]
    edited = dataclasses.replace(stage, ops={**stage.ops, "lm_head.linear": dataclasses.replace(
        head, explanation="lm_head.linear: replicated")})
    path = tmp_path / "plan.json"
    write_plan(dataclasses.replace(plan, stages=[edited]), path)
    result = CliRunner().invoke(main, ["verify", str(path), "--against", "torch", "--model", str(config)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "stages[0].ops.lm_head.linear: its explanation names 0 inputs" \
        in result.output


def test_every_process_builds_the_same_model_from_a_torch_source(tmp_path):
    """verify rebuilds `file.py:make` in each process: the weights and inputs must agree bit for bit."""
    import torch

    from partopt.verify_torch import _build

    source = mlp_source(tmp_path, 16, "ReLU", 6)
    (m1, x1, loss_fn), (m2, x2, _) = _build(f"{source}:make", None), _build(f"{source}:make", None)
    assert all(p.device.type == "cpu" for p in m1.parameters())
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert torch.equal(x1[0], x2[0]) and x1[0].shape == (6, 8) and x1[0].abs().sum() > 0
    assert torch.isfinite(loss_fn(m1(*x1), x1))


def test_a_two_stage_plan_runs_pipelined_with_the_unsharded_loss_and_gradients(tmp_path):
    """Stages of one device each (inter_only) on 2 devices: the 2-layer Llama is cut at model.layers.1
    and run with torch.distributed.pipelining (GPipe, 2 microbatches) in two gloo processes."""
    from partopt.verify_torch_pipeline import verify_pipeline

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA, "num_hidden_layers": 2}))
    graph = from_hf_config(read_hf_config(config), batch=4, seq=8)
    cluster = preset("p3.16xlarge", 1).narrowed(2)
    plan = optimize(graph, cluster, workers=1, microbatches=[2], inter_only=True)
    assert len(plan.stages) == 2 and plan.num_microbatches == 2
    report = verify_pipeline(plan, str(config))
    assert report.boundaries == ["model.layers.1"] and report.note is None
    assert [c.name for c in report.checks] == ["loss", "gradients"] and all(c.ok for c in report.checks)
    assert report.checks[1].detail == "21 of 21 parameters match"  # every parameter, each on its stage


GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 8,
        "bos_token_id": 0, "eos_token_id": 0}


def test_a_tied_embedding_split_across_stages_is_summed_between_its_copies(tmp_path):
    """GPT-2's token table is the LM head's weight: split at transformer.h.1 the first stage holds it for the
    lookup and the last for the head. The export says both stages hold a copy; the pipelined run sums the
    copies' gradients by an all-reduce between them (Megatron's embedding all-reduce) and every gradient
    equals the unsharded step's: the 28 parameters, and the tied one once more on the last stage."""
    from partopt.verify_torch_pipeline import verify_pipeline

    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT2))
    graph = from_hf_config(read_hf_config(config), batch=4, seq=8)
    cluster = preset("p3.16xlarge", 1).narrowed(2)
    plan = optimize(graph, cluster, workers=1, microbatches=[2], inter_only=True)
    shared = {"transformer.wte.weight": {
        "stages": [0, 1], "gradients": "all_reduce between the stages' copies, once per iteration"}}
    assert to_dtensor(plan)["shared_params"] == to_jax(plan)["shared_params"] == shared  # JAX's runtime sums them too
    report = verify_pipeline(plan, str(config))
    assert report.boundaries == ["transformer.h.1"] and report.note is None
    assert report.tied["transformer.wte.weight"][-1] == "1:lm_head.weight"
    assert {h.partition(":")[0] for h in report.tied["transformer.wte.weight"]} == {"0", "1"}
    assert all(c.ok for c in report.checks), report.lines()
    assert report.checks[1].detail == "29 of 29 parameters match"


def test_a_gpt2_plan_with_a_tied_table_and_fused_zero_shards_runs_the_collectives_it_prices(tmp_path):
    """GPT-2 (tied wte / lm_head, fused c_attn) solved on a 2 x 1 mesh, data parallel with ZeRO: the step runs
    the plan's collectives, but for the fused c_attn biases [3 · 32], whose ZeRO shard over d splits an inner
    factor of the torch axis (no DTensor Shard can): replicated with a note, their gradients all-reduced,
    by hand 3 · 32 fp32 = 384 B each, where the plan reduce-scatters and all-gathers them."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT2))
    graph = from_hf_config(read_hf_config(config), batch=4, seq=8)
    # two A100s on their switch: the solver shards every parameter's state (on a p3's 25 GB/s pair, about half)
    cluster = preset("dgx-a100", 1).narrowed(2)
    plan = optimize(graph, cluster, workers=1, microbatches=[1], logical_shapes=[(2, 1)], intra_only=True)
    report = verify_plan(plan, str(config))
    stage = report.stages[0]
    assert report.ok, report.lines()
    reduced = [(c["kind"], c["bytes"]) for c in stage.calls
               if c["module"] == "(top level)" and c["kind"] == "all_reduce" and c["bytes"] > 256]
    assert reduced == [("all_reduce", 384), ("all_reduce", 384)]
    assert [n.partition(":")[0] for n in stage.notes] == ["transformer.h.0.attn.c_attn.bias[0/3]",
                                                          "transformer.h.1.attn.c_attn.bias[0/3]"]
