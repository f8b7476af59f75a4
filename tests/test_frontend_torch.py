"""The PyTorch frontend: Hugging Face and plain modules imported through torch.export, checked
against torch's own numbers (parameters, FLOPs) and against partopt's generators (plans)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: configs are built here

import pytest
import torch
from click.testing import CliRunner
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from partopt import io, models
from partopt.cli import main
from partopt.cluster import preset
from partopt.errors import InstanceError, PartoptError
from partopt.export import export, megatron_warnings
from partopt.costmodel import training_flops
from partopt.frontends.torch import FrontendError, _Atoms, from_hf_config, from_module, read_hf_config
from partopt.evaluate import uniform
from partopt.inter import optimize
from partopt.ops import Behaviour, behaviours, is_matmul

VOCAB = 128


def llama_config(**over) -> LlamaConfig:
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16)
    return LlamaConfig(**{**sizes, **over})


def gpt2_config(**over) -> GPT2Config:
    return GPT2Config(**{**dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16), **over})


def real_model(config) -> torch.nn.Module:
    config.use_cache = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def llama():
    return from_hf_config(llama_config(), batch=4, seq=16, attention_kernel="math")


@pytest.fixture(scope="module")
def gpt2():
    return from_hf_config(gpt2_config(), batch=4, seq=16)


# ---------------------------------------------------------------- atoms

def test_atoms_split_where_the_other_side_has_a_boundary():
    """[24] against [2, 12]: the 24 splits into its parts 2 and 12, each one with the other side's."""
    atoms = _Atoms()
    a, b, c = atoms.new(24), atoms.new(2), atoms.new(12)
    assert atoms.unify([a], [b, c])
    assert [atoms.size[x] for x in atoms.expand(a)] == [2, 12]
    assert [atoms.find(x) for x in atoms.expand(a)] == [atoms.find(b), atoms.find(c)]


def test_atoms_refine_both_sides_to_their_common_boundaries():
    """[4, 6] against [2, 12] (both 24): 4 -> 2·2, 12 -> 2·6, so both read [2, 2, 6]."""
    atoms = _Atoms()
    x = [atoms.new(4), atoms.new(6)]
    y = [atoms.new(2), atoms.new(12)]
    assert atoms.unify(x, y)
    left = [atoms.find(p) for a in x for p in atoms.expand(a)]
    right = [atoms.find(p) for a in y for p in atoms.expand(a)]
    assert left == right and [atoms.size[p] for p in left] == [2, 2, 6]


def test_atoms_that_do_not_line_up_are_refused():
    atoms = _Atoms()
    assert not atoms.unify([atoms.new(6)], [atoms.new(4)])  # different products
    assert not atoms.unify([atoms.new(6), atoms.new(2)], [atoms.new(4), atoms.new(3)])  # 6 vs 4: no common split


# ---------------------------------------------------------------- names, parameters, layers

@pytest.mark.parametrize("make", [llama_config, gpt2_config])
def test_parameter_count_equals_torch(make):
    config = make()
    graph = from_hf_config(config, batch=4, seq=16)
    assert graph.num_params == sum(p.numel() for p in real_model(make()).parameters())


def test_parameters_keep_their_fully_qualified_names(llama):
    expected = {name for name, _ in real_model(llama_config()).named_parameters()}
    assert {t.name for t in llama.params} == expected
    assert "model.layers.0.mlp.up_proj.weight" in llama.tensors


def test_tied_head_reads_the_embedding_table_once(gpt2):
    names = {t.name for t in gpt2.params}
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    head = gpt2.op_index["lm_head.linear"]
    assert "transformer.wte.weight" in head.inputs


def test_layers_are_module_list_entries(llama):
    layer_of = {op.name: op.layer for op in llama.ops}
    assert set(layer_of.values()) == {0, 1}
    assert layer_of["model.layers.1.self_attn.q_proj.linear"] == 1
    assert layer_of["model.embed_tokens.embedding"] == 0  # before the first block: the first layer
    assert layer_of["loss"] == 1  # after the last block: the last layer


def test_grouped_query_attention_has_the_generators_head_dims(llama):
    """Query heads become (kv groups g, repeats r), as partopt's llama generator writes them."""
    q = llama.tensors["model.layers.0.self_attn.q_proj.weight"].dims
    k = llama.tensors["model.layers.0.self_attn.k_proj.weight"].dims
    sizes = [llama.dims[d] for d in q]
    assert sizes == [2, 2, 16, 64]  # g, r, head dim, hidden
    assert q[0] == k[0] and q[2] == k[1] and q[3] == k[2]
    kinds = [op.kind for op in llama.ops if op.layer == 0 and ".self_attn." in op.name]
    assert kinds.count("einsum") == 6  # q, k, v, scores, context, o
    assert kinds.count("softmax") == 1


def test_rmsnorm_pattern_becomes_one_op(llama):
    norms = [op for op in llama.ops if op.kind == "rmsnorm"]
    assert len(norms) == 5  # two per block and the final norm
    assert norms[0].inputs[1] == "model.layers.0.input_layernorm.weight"


def test_views_and_transposes_need_no_op():
    """A linear, a view into heads and a transpose back: one einsum, dims unified through the views."""
    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 12, bias=False)

        def forward(self, x):
            y = self.proj(x).view(x.shape[0], x.shape[1], 3, 4).transpose(1, 2)
            return y.transpose(1, 2).reshape(x.shape[0], x.shape[1], 12) * 2.0 + x.sum(-1, keepdim=True)

    with torch.device("meta"):
        module = Heads()
        x = torch.empty(5, 6, 8)
    graph = from_module(module, (x,))
    assert [op.kind for op in graph.ops].count("reshape") == 0
    einsum = next(op for op in graph.ops if op.kind == "einsum")
    assert graph.flops(einsum) == 2 * 5 * 6 * 8 * 12  # closed form of x·Wᵀ
    assert sorted(graph.dims[d] for d in graph.tensors["proj.weight"].dims) == [3, 4, 8]


class GroupedAttention(torch.nn.Module):
    """8 query heads sharing 2 key/value heads through `enable_gqa`, head dim 4, hidden 32."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 8, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, 4).permute(3, 0, 2, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(b, s, 32)


def test_enable_gqa_splits_query_heads_into_kv_groups():
    with torch.device("meta"):
        module, x = GroupedAttention(), torch.empty(3, 5, 32)
    graph = from_module(module, (x,), attention_kernel="math")
    scores = graph.op_index["scores"]
    q, k = (graph.tensors[t].dims for t in scores.inputs)
    assert sorted(graph.dims[d] for d in q if d not in k) == [4, 5]  # repeats r = 8 / 2, query positions
    assert graph.flops(scores) == 2 * 3 * 8 * 5 * 5 * 4  # b · heads · s · t · d, closed form
    assert graph.op_index["probs"].attrs["axes"] == [d for d in k if graph.dims[d] == 5]
    # `k, v = kv(x)...unbind` is a fused projection: one einsum per chunk of kv.weight, as two layers
    assert {"kv.weight[0/2]", "kv.weight[1/2]"} <= set(graph.tensors)
    assert graph.num_params == 32 * 32 + 32 * 16


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 1)
        self.pool = torch.nn.MaxPool2d(2)
        self.avg = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.pool(torch.relu(self.conv2(y)))
        return self.fc(torch.flatten(self.avg(y), 1))


def test_convolutions_map_as_the_wide_resnet_generator_writes_them():
    """3x3 stride 2 -> conv2d, 1x1 -> einsum over channels, BatchNorm -> layernorm over (N, H, W);
    forward matmul FLOPs equal FlopCounterMode's forward count."""
    with torch.device("meta"):
        module, x = SmallCNN(), torch.empty(4, 3, 32, 32)
    graph = from_module(module, (x,))
    kinds = {op.name: op.kind for op in graph.ops}
    assert kinds["conv1.conv2d"] == "conv2d" and kinds["conv2.conv2d"] == "einsum"
    assert kinds["bn1.batch_norm"] == "layernorm" and kinds["pool.max_pool2d"] == "pool"
    assert graph.op_index["bn1.batch_norm"].attrs["axes"] == ["b", *graph.tensors["conv1.conv2d"].dims[2:]]
    assert graph.op_index["avg.adaptive_avg_pool2d"].attrs["kernel"] == [8, 8]
    real = SmallCNN().eval()
    assert graph.num_params == sum(p.numel() for p in real.parameters())
    with FlopCounterMode(display=False) as counter:
        real(torch.randn(4, 3, 32, 32))
    assert sum(graph.flops(op) for op in graph.ops if is_matmul(op)) == counter.get_total_flops()
    assert graph.flops(graph.op_index["conv1.conv2d"]) == 2 * 4 * 8 * 16 * 16 * (3 * 3 * 3)  # closed form


def test_a_convolution_of_two_strides_records_both_and_its_graph_reads_back(tmp_path):
    """Stride (2, 1) is recorded as the pair (one integer only where the two agree), in a file the format reads."""
    with torch.device("meta"):
        module, x = torch.nn.Conv2d(3, 8, 3, stride=(2, 1), padding=1), torch.empty(4, 3, 16, 16)
    graph = from_module(module, (x,))
    conv = next(op for op in graph.ops if op.kind == "conv2d")
    assert conv.attrs["stride"] == [2, 1] and [graph.dims[d] for d in graph.tensors[conv.output].dims[2:]] == [8, 16]
    io.write_graph(graph, tmp_path / "conv.json")
    assert io.read_graph(tmp_path / "conv.json").op_index[conv.name].attrs["stride"] == [2, 1]


# ---------------------------------------------------------------- truth: FLOPs, plans

@pytest.mark.parametrize("make", [llama_config, gpt2_config])
def test_training_matmul_flops_match_flop_counter(make):
    """partopt prices einsums as 3x forward (two backward GEMMs); FlopCounterMode counts exactly the
    matmuls (mm/addmm/bmm, attention through the math kernel) of forward + backward."""
    batch, seq = 4, 16
    graph = from_hf_config(make(), batch=batch, seq=seq)
    model = real_model(make())
    ids = torch.randint(0, VOCAB, (batch, seq))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(ids).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)).backward()
    ours = sum(training_flops(graph.flops(op), True) for op in graph.ops if is_matmul(op))
    assert ours == pytest.approx(counter.get_total_flops(), rel=0.01)


def _iteration(graph) -> float:
    cluster = preset("p3.16xlarge", 1).narrowed(2)
    return optimize(graph, cluster, workers=1, microbatches=[1, 2]).iteration_time_s


def test_imported_llama_plans_like_the_generator():
    config = llama_config(hidden_size=256, intermediate_size=512, vocab_size=1000, max_position_embeddings=128)
    imported = from_hf_config(config, batch=8, seq=128, dtype="fp16", attention_kernel="math")
    generated = models.llama(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, seq=128, vocab=1000, batch=8,
                             dtype="fp16")
    assert imported.num_params == generated.num_params
    assert _iteration(imported) == pytest.approx(_iteration(generated), rel=0.02)
    # what exports say of it (docs/FORMAT.md): the generator's record, and the config's own rotary base and epsilon
    assert imported.architecture == {**generated.architecture, "rope_base": 10000, "norm_eps": config.rms_norm_eps}


def test_an_imported_llama_with_wider_heads_records_its_head_size_as_the_generator_does():
    """Mistral-Nemo's and Qwen3's head_dim is not hidden / heads: the import builds the real model (its parameter
    count is torch's own) and records the head size, as the generator given the same head size does."""
    config = llama_config(head_dim=32)  # 4 heads of 32 on a hidden size of 64: attention twice as wide as h
    imported = from_hf_config(config, batch=4, seq=16, dtype="fp16")
    assert imported.num_params == sum(p.numel() for p in real_model(llama_config(head_dim=32)).parameters())
    generated = models.llama(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=16, vocab=VOCAB, batch=4,
                             dtype="fp16", head_dim=32)
    assert imported.num_params == generated.num_params
    assert imported.architecture == {**generated.architecture, "rope_base": 10000, "norm_eps": config.rms_norm_eps}
    assert imported.architecture["head_dim"] == 32


def qwen2_config(**over) -> Qwen2Config:
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, tie_word_embeddings=True)
    return Qwen2Config(**{**sizes, **over})


def test_an_imported_qwen2_records_its_query_key_value_biases_and_megatron_adds_them():
    """Qwen2 is a Llama whose q, k and v projections alone have biases: h·(h + 2·g·d) + (h + 2·g·d) for them, h² for
    o, 3·h·f for the MLP and 2h for the norms per layer, V·h tied and h for the final norm. Megatron-LM builds it with
    --disable-bias-linear --add-qkv-bias (its examples/post_training/modelopt/conf/Qwen/Qwen2.5-7B-Instruct.sh)."""
    h, f, layers, g, d = 64, 128, 2, 2, 16
    qkv = h + 2 * g * d
    imported = from_hf_config(qwen2_config(), batch=4, seq=16, dtype="bf16")
    assert imported.num_params == VOCAB * h + layers * (h * qkv + qkv + h * h + 3 * h * f + 2 * h) + h
    assert imported.architecture == {**models.llama(hidden=h, layers=layers, heads=4, kv_heads=g, ffn=f, seq=16,
                                                    vocab=VOCAB, batch=4).architecture, "tied": True, "qkv_bias": True,
                                     "rope_base": 10000, "norm_eps": 1e-6}  # Qwen2Config's defaults
    line = export(uniform(imported, preset("dgx-a100", 1).narrowed(2), tp=2, pp=1, dp=1), "megatron")
    assert "--disable-bias-linear" in line and "--add-qkv-bias" in line
    # Qwen2.5's own rotary base and epsilon reach the line: Megatron-LM's defaults are 10000 and 1e-5
    qwen25 = from_hf_config(qwen2_config(rope_theta=1000000.0, rms_norm_eps=1e-6), batch=4, seq=16, dtype="bf16")
    line = export(uniform(qwen25, preset("dgx-a100", 1).narrowed(2), tp=2, pp=1, dp=1), "megatron")
    assert "--rotary-base 1000000" in line and "--norm-epsilon 1e-06" in line


def test_an_imported_mistral_is_a_llama_unless_its_window_is_narrower_than_the_sequence():
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16)
    llama_record = from_hf_config(llama_config(), batch=4, seq=16).architecture
    assert from_hf_config(MistralConfig(**sizes, sliding_window=None), batch=4, seq=16).architecture == llama_record
    assert from_hf_config(MistralConfig(**sizes, sliding_window=16), batch=4, seq=16).architecture == llama_record
    assert from_hf_config(MistralConfig(**sizes, sliding_window=8), batch=4, seq=16).architecture is None


def test_an_imported_config_trains_in_its_own_dtype_unless_told(tmp_path):
    """A Llama 3 config.json says "torch_dtype": "bfloat16": its graph is bf16 (mixed precision), as the model is
    trained, not fp32; --dtype overrides it, and a config naming none gives fp32 (the parameters' on the meta device)."""
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16)
    (tmp_path / "bf16.json").write_text(json.dumps({"model_type": "llama", **sizes, "torch_dtype": "bfloat16"}))
    (tmp_path / "plain.json").write_text(json.dumps({"model_type": "llama", **sizes}))
    assert from_hf_config(read_hf_config(tmp_path / "bf16.json"), batch=4, seq=16).dtype == "bf16"
    assert from_hf_config(read_hf_config(tmp_path / "bf16.json"), batch=4, seq=16, dtype="fp16").dtype == "fp16"
    assert from_hf_config(read_hf_config(tmp_path / "plain.json"), batch=4, seq=16).dtype == "fp32"


def test_importing_a_config_does_not_read_its_deprecated_torch_dtype(tmp_path, monkeypatch):
    """transformers warns on stderr at each read of `torch_dtype` (a deprecated property; most config.json files on
    the Hub name it): the import reads the class's fields by dir(), not by getattr."""
    def read(self):
        raise AssertionError("torch_dtype was read")

    monkeypatch.setattr(LlamaConfig, "torch_dtype", property(read))
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16)
    (tmp_path / "c.json").write_text(json.dumps({"model_type": "llama", **sizes, "torch_dtype": "bfloat16"}))
    assert from_hf_config(read_hf_config(tmp_path / "c.json"), batch=4, seq=16).dtype == "bf16"


def test_llama_31s_rotary_scaling_reaches_megatron_and_another_scaling_is_warned_of():
    """Llama 3.1 scales its rotary frequencies in the bands (1, 4, 8192) that Megatron-LM's --use-rope-scaling applies
    (rotary_pos_embedding.py's _apply_scaling), by its factor 8; a YaRN scaling has no Megatron-LM argument."""
    bands = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cluster = preset("dgx-a100", 1).narrowed(2)
    llama31 = llama_config(max_position_embeddings=131072, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, **bands})
    graph = from_hf_config(llama31, batch=4, seq=16, dtype="bf16")
    assert (graph.architecture["rope_scaling"], graph.architecture["rope_scaling_factor"]) == ("llama3", 8.0)
    plan = uniform(graph, cluster, tp=2, pp=1, dp=1)
    assert "--rotary-base 500000" in export(plan, "megatron")
    assert "--use-rope-scaling --rope-scaling-factor 8" in export(plan, "megatron")
    assert not [w for w in megatron_warnings(plan) if "rotary" in w]
    unfactored = dataclasses.replace(plan, architecture={k: v for k, v in plan.architecture.items()
                                                         if k != "rope_scaling_factor"})  # a hand-edited record
    with pytest.raises(InstanceError, match="Llama 3.1's rotary scaling without its factor"):
        export(unfactored, "megatron")
    yarn = llama_config(max_position_embeddings=131072,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    plan = uniform(from_hf_config(yarn, batch=4, seq=16, dtype="bf16"), cluster, tp=2, pp=1, dp=1)
    assert "--use-rope-scaling" not in export(plan, "megatron")
    assert [w for w in megatron_warnings(plan) if w.startswith("the model's yarn rotary scaling has no Megatron-LM")]


def test_an_imported_llama_records_its_architecture_only_where_the_record_can_say_it():
    """Llama's attention_bias without mlp_bias biases four of the seven linear layers, which no one `bias` says; a
    GPT-2 config is not a Llama: neither records an architecture, and its Megatron export gives the layout alone."""
    assert from_hf_config(llama_config(attention_bias=True), batch=4, seq=16).architecture is None
    assert from_hf_config(llama_config(attention_bias=True, mlp_bias=True), batch=4, seq=16).architecture["bias"]
    assert from_hf_config(gpt2_config(), batch=4, seq=16).architecture is None


def test_imported_gpt2_plans_like_the_generator():
    config = gpt2_config(n_embd=256, vocab_size=1000, n_positions=128)
    imported = from_hf_config(config, batch=8, seq=128, dtype="fp16")  # the default: fused attention
    generated = models.gpt(hidden=256, layers=2, heads=4, seq=128, vocab=1000, batch=8, attention_kernel="flash")
    assert imported.num_params == generated.num_params
    assert imported.forward_flops == generated.forward_flops  # fused c_attn became q, k, v projections
    assert _iteration(imported) == pytest.approx(_iteration(generated), rel=0.02)


def test_flash_import_is_one_causal_attention_op_per_layer_as_the_flash_generator_writes():
    config = llama_config(hidden_size=256, intermediate_size=512, vocab_size=1000, max_position_embeddings=128)
    imported = from_hf_config(config, batch=8, seq=128, dtype="fp16")  # the default
    generated = models.llama(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, seq=128, vocab=1000, batch=8,
                             dtype="fp16", attention_kernel="flash")
    fused = [op for op in imported.ops if op.kind == "attention"]
    assert len(fused) == 2 and all(op.attrs == {"causal": True} for op in fused)  # HF calls sdpa with is_causal
    assert not [op for op in imported.ops if op.kind == "softmax"]
    assert [sorted(imported.dims[d] for d in imported.tensors[t].dims) for t in (*fused[0].inputs, fused[0].output)] == [
        sorted(generated.dims[d] for d in generated.tensors[t].dims) for t in (*the_attention(generated).inputs,
                                                                               the_attention(generated).output)]
    math = from_hf_config(config, batch=8, seq=128, dtype="fp16", attention_kernel="math")  # less the softmax's
    assert imported.forward_flops == math.forward_flops - sum(math.flops(op) for op in math.ops if op.kind == "softmax")
    assert _iteration(imported) == pytest.approx(_iteration(generated), rel=0.02)


def the_attention(graph):
    return next(op for op in graph.ops if op.kind == "attention")


def test_an_unknown_attention_kernel_is_refused_before_tracing():
    with pytest.raises(PartoptError) as err:
        from_hf_config(llama_config(), batch=4, seq=16, attention_kernel="xformers")
    assert "xformers" in err.value.cause and "flash" in err.value.hint


# ---------------------------------------------------------------- errors

class Cumsum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cumsum(self.inner(x), dim=1)


def test_unmapped_op_names_the_aten_op_and_module():
    with torch.device("meta"):
        module, x = Cumsum(), torch.empty(3, 4)
    with pytest.raises(FrontendError) as err:
        from_module(module, (x,))
    assert "aten.cumsum" in err.value.line() and "(top level)" in err.value.line()
    assert "--opaque" in err.value.line()


class Unmapped(torch.nn.Module):
    """cumsum (no FLOP formula), sort (two results) and a depthwise convolution (mapped only for groups 1)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.dw = torch.nn.Conv2d(8, 8, 3, groups=8, padding=1)

    def forward(self, x, img):
        values, _ = torch.sort(torch.cumsum(self.inner(x), dim=1), dim=-1)
        return self.inner(values), self.dw(img)


def test_opaque_keeps_unmapped_ops_whole_priced_by_their_flops(tmp_path):
    with torch.device("meta"):
        module, x, img = Unmapped(), torch.empty(3, 4), torch.empty(3, 8, 6, 6)
    graph = from_module(module, (x, img), opaque=True)
    opaque = {op.name: op for op in graph.ops if op.kind == "opaque"}
    assert sorted(opaque) == ["cumsum", "dw.conv2d", "sort", "sort_2"]  # sort's values and indices
    assert opaque["cumsum"].attrs == {"primitive": "aten.cumsum", "flops": 3 * 4}  # one FLOP per output element
    assert graph.tensors["sort_2"].dtype == "int64" and opaque["sort_2"].attrs["flops"] == 0
    real_img = torch.randn(3, 8, 6, 6)
    with FlopCounterMode(display=False) as counter:
        torch.nn.Conv2d(8, 8, 3, groups=8, padding=1)(real_img)
    assert graph.flops(opaque["dw.conv2d"]) == counter.get_total_flops() == 2 * 3 * 8 * 6 * 6 * 9  # closed form
    assert opaque["dw.conv2d"].inputs == ("img", "dw.weight", "dw.bias")
    for op in opaque.values():  # never sharded
        assert set(behaviours(op, graph).values()) == {Behaviour.WINDOWED}
    io.write_graph(graph, tmp_path / "g.json")
    assert io.read_graph(tmp_path / "g.json").num_params == sum(p.numel() for p in Unmapped().parameters())


class Spare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_unused_parameters_are_named_not_dropped():
    with torch.device("meta"):
        module, x = Spare(), torch.empty(3, 4)
    with pytest.raises(FrontendError, match="2 parameters are not used.*spare.weight"):
        from_module(module, (x,))


def test_batch_of_one_is_refused():
    with torch.device("meta"):
        module, x = torch.nn.Linear(4, 4), torch.empty(1, 4)
    with pytest.raises(FrontendError, match="batch of at least 2"):
        from_module(module, (x,))


# ---------------------------------------------------------------- CLI

def test_cli_import_hf_writes_a_graph(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                  "vocab_size": VOCAB, "n_positions": 16}))
    out = tmp_path / "g.json"
    result = CliRunner().invoke(main, ["import", "hf", str(config), "-o", str(out), "--batch", "4", "--seq", "16"])
    assert result.exit_code == 0, result.output
    graph = io.read_graph(out)
    assert graph.num_params == sum(p.numel() for p in real_model(gpt2_config()).parameters())


def test_cli_import_hf_without_model_type_is_one_line(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64}))
    result = CliRunner().invoke(main, ["import", "hf", str(config), "-o", str(tmp_path / "g.json"),
                                       "--batch", "2", "--seq", "2"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "no model_type" in result.output


LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}


@pytest.mark.parametrize("data, place, cause", [
    ({**LLAMA, "num_attention_heads": 3}, "", "hidden size (64) is not a multiple of the number of attention heads (3)"),
    ({**LLAMA, "hidden_size": "big"}, "", "Field 'hidden_size' expected int, got str"),
    ({**LLAMA, "hidden_size": -64}, ": $.hidden_size", "hidden_size must be a positive integer, got -64"),
    ({**LLAMA, "vocab_size": -1}, ": $.vocab_size", "vocab_size must be a positive integer, got -1"),
    ({**LLAMA, "rope_scaling": {"type": "bogus", "factor": 2.0}}, ": $.rope_scaling", "unknown rope_type 'bogus'"),
    ({"model_type": "gpt2", "n_embd": -64}, ": $.n_embd", "hidden_size must be a positive integer"),  # the file's name
])
def test_bad_hf_config_values_are_one_line_at_the_field(tmp_path, data, place, cause):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["import", "hf", str(config), "-o", str(tmp_path / "g.json"),
                                       "--batch", "4", "--seq", "16"])
    assert result.exit_code == 2, result.output
    error = result.stderr.splitlines()[-1]
    assert error.startswith(f"error: {config}{place}: ") and cause in error and "(hint: " in error


@pytest.mark.parametrize("data, hint", [
    ({key: value for key, value in LLAMA.items() if key != "num_hidden_layers"}, "add 'num_hidden_layers')"),
    ({**{key: value for key, value in LLAMA.items() if key != "num_hidden_layers"}, "num_hidden_layer": 2},
     "add 'num_hidden_layers' (is 'num_hidden_layer' it, misspelt?))")])
def test_a_size_the_config_leaves_to_transformers_default_is_refused(tmp_path, data, hint):
    """Without num_hidden_layers transformers builds Llama's default 32 layers: a model the file does not describe,
    planned without a word. The error names the key, and a near miss among the file's unknown keys."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["import", "hf", str(config), "-o", str(tmp_path / "g.json"),
                                       "--batch", "4", "--seq", "16"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {config}: the config gives no num_hidden_layers, and transformers "
                                          f"would take its default 32 (hint: {hint}"]


def test_an_hf_size_torch_refuses_names_the_config(tmp_path):
    config = tmp_path / "config.json"  # gpt2's n_inner (its MLP width) has no common name to check up front
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB,
                                  "n_positions": 16, "n_inner": -5}))
    with pytest.raises(InstanceError, match="negative dimension -5") as err:
        from_hf_config(read_hf_config(config), batch=4, seq=16)
    assert err.value.where == "config (gpt2)"


def mlp_source(tmp_path, hidden: int, activation: str, batch: int):
    """A `file.py` whose make() returns an 8 → hidden → 8 MLP and an example input of `batch` rows."""
    source = tmp_path / "mlp.py"
    source.write_text("import torch\n\ndef make():\n"
                      f"    return torch.nn.Sequential(torch.nn.Linear(8, {hidden}), torch.nn.{activation}(), "
                      f"torch.nn.Linear({hidden}, 8)), (torch.empty({batch}, 8),)\n")
    return source


def test_cli_import_torch_from_a_file(tmp_path):
    source = mlp_source(tmp_path, 32, "GELU", 16)
    out = tmp_path / "g.json"
    result = CliRunner().invoke(main, ["import", "torch", f"{source}:make", "-o", str(out)])
    assert result.exit_code == 0, result.output
    graph = io.read_graph(out)
    assert graph.num_params == 8 * 32 + 32 + 32 * 8 + 8
    assert sum(graph.flops(op) for op in graph.ops if op.kind == "einsum") == 2 * (2 * 16 * 8 * 32)
    bad = CliRunner().invoke(main, ["import", "torch", f"{source}:nothing", "-o", str(out)])
    assert bad.exit_code == 2 and "has no function 'nothing'" in bad.output


def test_cli_import_torch_opaque(tmp_path):
    source = tmp_path / "cum.py"
    source.write_text("import torch\n\nclass Cum(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                      "        self.inner = torch.nn.Linear(4, 4)\n\n    def forward(self, x):\n"
                      "        return torch.cumsum(self.inner(x), dim=1)\n\ndef make():\n"
                      "    return Cum(), (torch.empty(3, 4),)\n")
    out = tmp_path / "g.json"
    bad = CliRunner().invoke(main, ["import", "torch", f"{source}:make", "-o", str(out)])
    assert bad.exit_code == 2 and bad.output.count("\n") == 1
    assert "aten.cumsum in module (top level)" in bad.output and "--opaque" in bad.output
    good = CliRunner().invoke(main, ["import", "torch", f"{source}:make", "-o", str(out), "--opaque"])
    assert good.exit_code == 0, good.output
    assert [op.kind for op in io.read_graph(out).ops] == ["einsum", "elementwise", "opaque"]


def test_help_does_not_import_torch():
    code = "import sys; from partopt.cli import main; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


class Chunks(torch.nn.Module):
    """Chunks of an activation (not of a projection's output): one `select` reduce per chunk, multiplied."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        p, q = torch.relu(self.fc(x)).chunk(2, dim=-1)
        return p * q


def test_chunks_of_an_activation_write_a_graph_that_reads_back(tmp_path):
    """A chunk's op carried `index`, an attribute no kind reads: the written graph did not load."""
    with torch.device("meta"):
        module, x = Chunks(), torch.empty(4, 8)
    graph = from_module(module, (x,))
    chunks = [op for op in graph.ops if op.kind == "reduce"]
    assert [op.attrs for op in chunks] == [{"fn": "select"}, {"fn": "select"}]
    io.write_graph(graph, tmp_path / "g.json")
    assert io.read_graph(tmp_path / "g.json").num_params == 8 * 8 + 8
