"""`partopt verify --against torch` of a Mixtral plan whose experts are split over e: the experts run
expert parallel (tokens to their experts' processes by all-to-all over gloo) and must reproduce the
unsharded step of transformers' own experts loop; placements the run cannot express are refused."""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: configs are built here

import pytest
from click.testing import CliRunner

from partopt.cli import main
from partopt.cluster import preset
from partopt.errors import PartoptError
from partopt.frontends.torch import from_hf_config, read_hf_config
from partopt.inter import optimize
from partopt.plan import ParamPlacement, write_plan
from partopt.sharding import R, Shard
from partopt.verify_torch import verify_plan
from partopt.verify_torch_moe import ExpertSplit, expert_modules, expert_splits

MIXTRAL = {"model_type": "mixtral", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32,
           "num_local_experts": 8, "num_experts_per_tok": 2}
EXPERTS = "model.layers.0.mlp.experts"
WEIGHTS = [f"{EXPERTS}.gate_up_proj[0/2]", f"{EXPERTS}.gate_up_proj[1/2]", f"{EXPERTS}.down_proj"]


def place_experts(plan, placement):
    """`plan` with its experts' three weights placed `placement` (no ZeRO)."""
    params = dict(plan.stages[0].params)
    for name in WEIGHTS:
        params[name] = ParamPlacement(placement, ())
    return dataclasses.replace(plan, stages=[dataclasses.replace(plan.stages[0], params=params)])


def compute_experts(plan, axes, matmuls=("gate", "up", "down")):
    """`plan` with its experts' `matmuls` split `axes` (a dim per mesh axis) and their layouts left as they were."""
    ops = dict(plan.stages[0].ops)
    for name in matmuls:
        ops[f"{EXPERTS}.{name}"] = dataclasses.replace(ops[f"{EXPERTS}.{name}"], axes=axes)
    return dataclasses.replace(plan, stages=[dataclasses.replace(plan.stages[0], ops=ops)])


def solved(directory, config, batch, seq):
    """The config file, written in `directory`, and its plan on a 1 x 2 mesh of a p3 node, priced additively
    (`overlap=False`): with the weights' gathers hidden by prefetching, these small models' cheapest plans
    store the experts' weights split over e but compute data parallel (FSDP), not expert parallel."""
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    graph = from_hf_config(read_hf_config(path), batch=batch, seq=seq)
    cluster = preset("p3.16xlarge", 1).narrowed(2)
    return path, optimize(graph, cluster, workers=1, microbatches=[1], logical_shapes=[(1, 2)], overlap=False)


@pytest.fixture(scope="module")
def mixtral_plan(tmp_path_factory):
    """The small Mixtral (batch 8, seq 32): the solver replicates the tokens and splits the experts on y."""
    return solved(tmp_path_factory.mktemp("moe"), MIXTRAL, 8, 32)


@pytest.fixture(scope="module")
def all_to_all_plan(tmp_path_factory):
    """A wider Mixtral on a larger batch (hidden 256, batch 32, seq 64): the solver splits the tokens by
    the batch and the experts on y, and reshards the dispatched tokens between them (an all-to-all)."""
    return solved(tmp_path_factory.mktemp("moe-a2a"), {**MIXTRAL, "hidden_size": 256, "max_position_embeddings": 64},
                  32, 64)


def test_the_experts_module_and_its_split_are_read_from_the_plan(mixtral_plan):
    _, plan = mixtral_plan
    assert expert_modules(plan) == [EXPERTS]
    e = plan.tensors[WEIGHTS[2]]["dims"][0]
    split = lambda p: expert_splits(plan, p.stages[0], {0})[EXPERTS]
    assert split(plan) == ExpertSplit((1,), ())  # the solved plan: experts on y, tokens replicated
    # the split is the experts' matmuls': weights stored split more widely are gathered for them (FSDP)
    assert split(place_experts(plan, (Shard(e), Shard(e)))) == ExpertSplit((1,), ())
    assert split(compute_experts(place_experts(plan, (Shard(e), Shard(e))), (e, e))) == ExpertSplit((0, 1), ())
    assert split(compute_experts(plan, (None, None))) == ExpertSplit((), ())
    with pytest.raises(PartoptError, match="different mesh axes"):
        expert_splits(plan, compute_experts(plan, (None, None), ("down",)).stages[0], set())



def test_the_solved_plans_split_the_experts_over_e(mixtral_plan, all_to_all_plan):
    """What the verify tests run is the solver's own choice: GShard's expert parallelism on mesh axis y,
    fed by replicated tokens in one plan and by batch-split tokens through an all-to-all in the other."""
    for (_, plan), tokens in [(mixtral_plan, ()), (all_to_all_plan, (1,))]:
        e = plan.tensors[WEIGHTS[2]]["dims"][0]
        assert all(plan.stages[0].params[name].placement == (R, Shard(e)) for name in WEIGHTS)
        assert plan.stages[0].ops[f"{EXPERTS}.gate"].axes == (None, e)
        assert expert_splits(plan, plan.stages[0], set())[EXPERTS] == ExpertSplit((1,), tokens)
    assert "→ all-to-all" in all_to_all_plan[1].stages[0].ops[f"{EXPERTS}.dispatch"].explanation


def test_experts_split_over_e_reproduce_the_unsharded_step(mixtral_plan):
    """The solved plan on two gloo processes, four experts each, every process routing all tokens: loss
    and every gradient (router and experts too) equal transformers' unsharded step."""
    config, plan = mixtral_plan
    report = verify_plan(plan, str(config))
    stage = report.stages[0]
    assert report.ok, report.lines()
    assert stage.placements[f"{EXPERTS}.gate_up_proj"] == "[Replicate(), Shard(0)]"
    assert stage.placements[f"{EXPERTS}.down_proj"] == "[Replicate(), Shard(0)]"
    ran = {c["kind"] for c in stage.calls if c["module"].startswith(EXPERTS)}
    assert "all_to_all" not in ran
    # each process sums its experts' part of the output, by hand: [8, 32, 128] fp32 forward, that and the
    # routing weights' gradient [8, 32, top 2] backward (the plan's gathers of [e, b, c, h] are GShard's form)
    summed = sorted((c["kind"], c["axis"], c["bytes"], c["backward"]) for c in stage.planned if c["module"] == EXPERTS)
    assert summed == [("all_reduce", "y", 8 * 32 * 2 * 4, True), ("all_reduce", "y", 8 * 32 * 128 * 4, False),
                      ("all_reduce", "y", 8 * 32 * 128 * 4, True)]


def test_experts_fed_by_a_batch_split_dispatch_exchange_tokens_by_all_to_all(all_to_all_plan):
    """The solved plan whose dispatch splits the batch over the experts' axis: tokens go to their experts'
    process and back in all-to-alls over gloo; loss and every gradient equal the unsharded step."""
    config, plan = all_to_all_plan
    report = verify_plan(plan, str(config))
    stage = report.stages[0]
    assert report.ok, report.lines()
    ran = {c["kind"] for c in stage.calls if c["module"].startswith(EXPERTS)}
    assert "all_to_all" in ran


def test_an_expert_split_over_f_is_refused_naming_the_parameter(mixtral_plan, tmp_path):
    """Experts' weights split over their hidden f: not expert parallelism; refused in one line before any
    process starts, from the library and from the command line (exit code 2)."""
    config, plan = mixtral_plan
    f = plan.tensors[WEIGHTS[2]]["dims"][2]
    bad = place_experts(plan, (R, Shard(f)))
    with pytest.raises(PartoptError, match=r"gate_up_proj\[0/2\] is placed \[R, S\(.*\)\]: the expert-parallel run"):
        verify_plan(bad, str(config))
    path = tmp_path / "plan.json"
    write_plan(bad, path)
    result = CliRunner().invoke(main, ["verify", str(path), "--against", "torch", "--model", str(config)])
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert f"S({f}) on mesh axis 1" in result.output


def test_experts_weights_placed_differently_are_refused(mixtral_plan):
    config, plan = mixtral_plan
    e = plan.tensors[WEIGHTS[2]]["dims"][0]
    mixed = place_experts(plan, (R, Shard(e)))
    params = dict(mixed.stages[0].params)
    params[WEIGHTS[2]] = ParamPlacement((R, R), ())
    mixed = dataclasses.replace(mixed, stages=[dataclasses.replace(mixed.stages[0], params=params)])
    with pytest.raises(PartoptError, match="placed differently"):
        verify_plan(mixed, str(config))


def test_the_default_plan_of_the_wider_mixtral_verifies_its_weights_gathered_again_in_the_backward(tmp_path):
    """With its default pricing (gathers prefetched under compute, a layer's weights gathered in one call) the
    wider Mixtral's plan stores its weights split and computes data parallel: DTensor's dispatch gathers each
    weight for the forward and again for its input's gradient wherever that gradient reads it (autograd keeps
    the weight as stored), as the plan prices: every matmul weight with an activation operand (q, k, v, o, the
    router, the LM head; the experts' are gathered once, their module's own case) and every norm's scale. The
    verifier predicts those gathers, fp32: q and o 256 x 256, k and v 256 x 128 (2 KV heads of 64), the router
    256 x 8, the LM head 256 x 64, the three RMSNorm scales 256; loss, gradients and collectives match."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MIXTRAL, "hidden_size": 256, "max_position_embeddings": 64}))
    graph = from_hf_config(read_hf_config(path), batch=32, seq=64)
    cluster = preset("p3.16xlarge", 1).narrowed(2)
    plan = optimize(graph, cluster, workers=1, microbatches=[1], logical_shapes=[(1, 2)])
    stage = plan.stages[0]
    split = [n for n in ("q_proj", "o_proj")
             if any(isinstance(p, Shard) for p in stage.params[f"model.layers.0.self_attn.{n}.weight"].placement)]
    assert split == ["q_proj", "o_proj"]  # the case this test is about
    report = verify_plan(plan, str(path))
    assert report.ok, report.lines()
    again = [c for c in report.stages[0].planned if c["kind"] == "all_gather" and c["backward"]]
    assert sorted(c["bytes"] for c in again) == sorted([256 * 256 * 4] * 2 + [256 * 128 * 4] * 2 + [256 * 8 * 4]
                                                       + [256 * 64 * 4] + [256 * 4] * 3)
