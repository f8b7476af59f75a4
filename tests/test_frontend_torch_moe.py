"""Mixture-of-experts blocks of Hugging Face configs imported in the IR's expert-parallel form."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

from partopt import models
from partopt.cluster import preset
from partopt.costmodel import training_flops
from partopt.frontends.torch import FrontendError, from_hf_config
from partopt.frontends.torch_moe import experts_as_one_op
from partopt.inter import optimize
from partopt.ops import is_matmul
from partopt.sharding import Shard

VOCAB, BATCH, SEQ = 128, 4, 16


def mixtral(**over) -> MixtralConfig:
    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2)
    return MixtralConfig(**{**sizes, **over})


def qwen_moe(**over) -> Qwen2MoeConfig:
    sizes = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, num_experts=8,
                 num_experts_per_tok=4)
    return Qwen2MoeConfig(**{**sizes, **over})


def real_model(config, experts: str = "eager") -> torch.nn.Module:
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation=experts)
    for p in model.parameters():  # from_config leaves the 3-D expert weights uninitialised
        torch.nn.init.normal_(p, std=0.05)
    return model.eval()


@pytest.fixture(scope="module")
def mix():
    return from_hf_config(mixtral(), batch=BATCH, seq=SEQ)


@pytest.mark.parametrize("make", [mixtral, qwen_moe])
def test_parameter_count_equals_torch(make):
    graph = from_hf_config(make(), batch=BATCH, seq=SEQ)
    assert graph.num_params == sum(p.numel() for p in real_model(make()).parameters())


def test_experts_take_the_expert_parallel_form(mix):
    """Per MoE block, as partopt.models.moe: gates over e, a routing mask over (b, s, e, c) with capacity
    c = top_k·s/e = 2·16/4 = 8, dispatch to (e, b, c, h), gated experts over e, combine back to (b, s, h)."""
    layer = {op.name.removeprefix("model.layers.0.mlp."): op for op in mix.ops if op.name.startswith("model.layers.0.mlp.")}
    dims = {name: mix.tensors[op.output].dims for name, op in layer.items()}
    assert mix.dims["e"] == 4 and mix.dims["c"] == 8
    assert dims["gate.route"] == ("b", "s", "e", "c") and mix.tensors[layer["gate.dispatch_mask"].output].dtype == "bool"
    assert dims["experts.dispatch"] == ("e", "b", "c", "d3") and mix.dims["d3"] == 64
    assert dims["experts.combine"] == ("b", "s", "d3")
    gate_w = mix.tensors["model.layers.0.mlp.experts.gate_up_proj[0/2]"]
    assert gate_w.dims[0] == "e" and [mix.dims[d] for d in gate_w.dims] == [4, 96, 64]
    assert [mix.dims[d] for d in mix.tensors["model.layers.0.mlp.experts.down_proj"].dims] == [4, 64, 96]
    assert sum(op.kind == "einsum" and "experts" in op.name for op in mix.ops) == 2 * 5  # dispatch, gate, up, down, combine


def test_routing_and_experts_cost_what_the_generators_moe_layer_costs(mix):
    """partopt's own GShard layer of the same sizes (groups of one sequence, its relu fc1/fc2 where
    Mixtral has gated silu experts): op for op the same FLOPs."""
    gshard = models.moe_layer(hidden=64, experts=4, seq=SEQ, batch=BATCH, group_size=SEQ, ffn=96)
    theirs = {op.name.removeprefix("l0."): gshard.flops(op) for op in gshard.ops}
    ours = {op.name.removeprefix("model.layers.0.mlp."): mix.flops(op) for op in mix.ops}
    pairs = {"gate.linear": "gate", "gate.softmax": "gates", "gate.top2": "top2", "gate.route": "route",
             "gate.dispatch_mask": "dispatch_mask", "experts.dispatch": "dispatch", "experts.gate": "fc1",
             "experts.up": "fc1", "experts.down": "fc2", "experts.combine": "combine"}
    assert {a: ours[a] for a in pairs} == {a: theirs[b] for a, b in pairs.items()}
    assert gshard.dims["c"] == mix.dims["c"]


def test_the_mapped_op_computes_what_hugging_face_computes():
    """While exported, experts call partopt::experts; its reference kernel gives HF's eager logits."""
    model, ids = real_model(mixtral()), torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.no_grad():
        expected = model(ids).logits
        with experts_as_one_op(model) as n:
            got = model(ids).logits
        again = model(ids).logits
    assert n == 2
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)  # the experts' own forward is back


@pytest.mark.parametrize("make", [mixtral, qwen_moe])
def test_training_flops_match_flop_counter_apart_from_dispatch_and_combine(make):
    """FlopCounterMode counts the matmuls HF runs: each token through top_k experts (whatever the routing,
    Σ tokens per expert = top_k·B·S, and capacity·e = top_k·S per sequence makes the IR's expert einsums
    the same FLOPs). GShard's dispatch and combine are einsums over one-hot masks that HF runs as
    gather and index_add (no FLOPs): 2·(2·B·S·e·c·h) forward per block, ×3 for training."""
    config = make()
    graph = from_hf_config(make(), batch=BATCH, seq=SEQ)
    model = real_model(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(ids).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)).backward()
    routing = [op for op in graph.ops if op.name.endswith(("experts.dispatch", "experts.combine"))]
    ours = sum(training_flops(graph.flops(op), True) for op in graph.ops if is_matmul(op) and op not in routing)
    assert ours == pytest.approx(counter.get_total_flops(), rel=0.01)
    e = getattr(config, "num_local_experts", None) or config.num_experts
    c = config.num_experts_per_tok * SEQ // e
    per_block = 3 * 2 * (2 * BATCH * SEQ * e * c * config.hidden_size)
    assert sum(training_flops(graph.flops(op), True) for op in routing) == config.num_hidden_layers * per_block


def test_a_small_mixtral_plans_with_its_experts_split_over_devices():
    """The docs/FRONTENDS.md example: planned on 4 devices as one 1F1B stage, the experts' weights are split
    along e (expert parallelism: the dispatch's tokens move to their experts' devices, an all-to-all)."""
    config = mixtral(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                     num_local_experts=8, vocab_size=1000)
    graph = from_hf_config(config, batch=8, seq=128, dtype="fp16")
    cluster = preset("p3.16xlarge", 1).narrowed(4)
    plan = optimize(graph, cluster, workers=1, microbatches=[1, 2], schedule="1f1b")
    assert math.isfinite(plan.iteration_time_s) and plan.iteration_time_s > 0
    experts = {name: info.placement for stage in plan.stages for name, info in stage.params.items()
               if ".experts." in name}
    assert len(experts) == 2 * 3
    assert any(Shard(graph.tensors[name].dims[0]) in placement for name, placement in experts.items())


def test_capacity_that_is_not_whole_is_refused():
    with pytest.raises(FrontendError) as err:
        from_hf_config(mixtral(num_local_experts=8, num_experts_per_tok=2), batch=BATCH, seq=10)
    assert "aten.topk in module model.layers.0.mlp.gate" in err.value.line()
    assert "expert capacity of 2.5 tokens" in err.value.line()  # 2 · 10 / 8
    with pytest.raises(FrontendError, match="expert capacity"):  # not hidden in an opaque op
        from_hf_config(mixtral(num_local_experts=8, num_experts_per_tok=2), batch=BATCH, seq=10, opaque=True)
