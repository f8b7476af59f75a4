"""Placements of imported PyTorch parameters in their own torch axes (`export --to dtensor --model`)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: configs are built here

import pytest
import torch
from click.testing import CliRunner
from test_verify_torch import LLAMA, llama_on_two_devices
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

from partopt.cli import main
from partopt.export import to_dtensor
from partopt.sharding import R, Shard, parse_placement
from partopt.frontends.torch import from_hf_config, param_shapes
from partopt.frontends.torch_axes import torch_axes, torch_placements
from partopt.plan import ParamPlacement, write_plan

Q = "model.layers.0.self_attn.q_proj.weight"


def test_torch_axes_group_dims_by_size():
    sizes = {"g": 2, "r": 2, "d": 8, "h": 32}
    assert torch_axes((32, 32), ("g", "r", "d", "h"), sizes) == [["g", "r", "d"], ["h"]]
    assert torch_axes((1, 32), ("h",), sizes) == [[], ["h"]]


def test_shard_of_the_outermost_factor_is_a_dtensor_shard_and_of_an_inner_one_is_not():
    sizes = {"g": 2, "r": 2, "d": 8, "h": 32}
    shape, dims = (32, 32), ("h", "g", "r", "d")  # o_proj.weight: [hidden, heads·head_dim]
    spec, notes = torch_placements("o", parse_placement("[S(g), S(h)]"), shape, dims, sizes)
    assert spec == [("shard", 1), ("shard", 0)] and notes == []
    spec, notes = torch_placements("o", parse_placement("[S(d), R]"), shape, dims, sizes)
    assert spec == [("replicate", None), ("replicate", None)]
    assert notes == ["o: S(d) is not the outermost factor of torch axis 1 (factors, major first: g, r, d); "
                     "one DTensor Shard cannot split it: replicated"]


def _plan_shard(weight: torch.Tensor, dims: tuple[str, ...], sizes: dict[str, int], dim: str, k: int) -> torch.Tensor:
    """Block k of 2 of `weight` along the partopt dim `dim`: what the plan gives device k."""
    view = weight.reshape([sizes[d] for d in dims])
    return view.chunk(2, dim=dims.index(dim))[k]


def test_a_shard_matches_the_plans_split_of_a_real_weight_exactly_when_it_is_the_outermost_factor():
    """q_proj.weight [heads·head_dim, hidden] has dims (g, r, d, h): torch's Shard(0) gives device k
    the k-th block of rows, which is the plan's split of g (outermost) and not of r (inside g)."""
    config = LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    graph = from_hf_config(config, batch=2, seq=8)
    dims, sizes = graph.tensors[Q].dims, graph.dims
    torch.manual_seed(0)
    weight = AutoModelForCausalLM.from_config(config).get_parameter(Q).detach()
    g, r, d, h = dims
    spec, notes = torch_placements(Q, parse_placement(f"[S({g}), S({h})]"), tuple(weight.shape), dims, sizes)
    assert spec == [("shard", 0), ("shard", 1)] and notes == []
    for dim, (_, axis) in zip((g, h), spec):
        for k in range(2):
            theirs = weight.chunk(2, dim=axis)[k]
            assert torch.equal(_plan_shard(weight, dims, sizes, dim, k).reshape(theirs.shape), theirs)
    spec, notes = torch_placements(Q, parse_placement(f"[S({r}), R]"), tuple(weight.shape), dims, sizes)
    assert spec == [("replicate", None), ("replicate", None)] and len(notes) == 1
    assert not torch.equal(_plan_shard(weight, dims, sizes, r, 0).reshape(16, 32), weight.chunk(2, dim=0)[0])


def test_chunks_of_fused_expert_weights_map_to_the_fused_parameter():
    """gate_up_proj [e, 2f, h] is imported as chunks [0/2] (gate) and [1/2] (up) over (e, f, h): a split
    of e is Shard(0) of the fused parameter; a split of f lies inside the chunk index: replicated."""
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, num_local_experts=4, num_experts_per_tok=2)
    graph = from_hf_config(config, batch=2, seq=8)
    name = "model.layers.0.mlp.experts.gate_up_proj[1/2]"
    e, f, h = graph.tensors[name].dims
    shape = (4, 96, 32)
    spec, notes = torch_placements(name, parse_placement(f"[S({e}), S({h})]"), shape, (e, f, h), graph.dims)
    assert spec == [("shard", 0), ("shard", 2)] and notes == []
    spec, notes = torch_placements(name, parse_placement(f"[R, S({f})]"), shape, (e, f, h), graph.dims)
    assert spec == [("replicate", None), ("replicate", None)] and "2 chunks" in notes[0]


@pytest.fixture(scope="module")
def llama_plan(tmp_path_factory):
    """A Llama plan on a 1 x 2 mesh whose q_proj is split by its kv groups and o_proj by the hidden dim."""
    config, plan = llama_on_two_devices(tmp_path_factory.mktemp("axes"))
    params = plan.stages[0].params
    q = plan.tensors[Q]["dims"]
    params[Q] = ParamPlacement((R, Shard(q[3])))  # the hidden dim: torch axis 1, IR dim 3
    params["model.layers.0.self_attn.k_proj.weight"] = ParamPlacement((R, Shard(q[2])))  # head_dim
    path = config.parent / "plan.json"
    write_plan(plan, path)
    return plan, config, path


def test_export_with_the_model_indexes_torch_axes(llama_plan):
    plan, config, _ = llama_plan
    params = to_dtensor(plan, param_shapes(str(config)))["stages"][0]["params"]
    assert params[Q]["text"] == "[Replicate(), Shard(1)]" and params[Q]["torch_shape"] == [32, 32]
    k = params["model.layers.0.self_attn.k_proj.weight"]
    assert k["text"] == "[Replicate(), Replicate()]" and "not the outermost factor of torch axis 0" in k["notes"][0]
    assert to_dtensor(plan)["stages"][0]["params"][Q]["text"] == "[Replicate(), Shard(3)]"  # partopt's dims


def test_cli_export_model_option(llama_plan):
    _, config, path = llama_plan
    result = CliRunner().invoke(main, ["export", str(path), "--to", "dtensor", "--model", str(config)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["stages"][0]["params"][Q]["text"] == "[Replicate(), Shard(1)]"
    bad = CliRunner().invoke(main, ["export", str(path), "--to", "jax", "--model", str(config)])
    assert bad.exit_code == 2 and bad.output.count("\n") == 1 and "--to dtensor" in bad.output
