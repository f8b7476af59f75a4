"""The model zoo against closed forms, published parameter counts and the file format."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt.cli import main
from partopt.errors import InstanceError
from partopt.io import graph_from_dict, graph_to_dict, read_graph
from partopt.models import (
    PRESETS,
    bert,
    expert_capacity,
    flop_split,
    generate,
    gpt,
    llama,
    moe,
    moe_layer,
    preset,
    wresnet,
)
from partopt.ops import is_matmul

INSTANCES = Path(__file__).resolve().parent.parent / "instances"

# REFERENCE.md §3 (Alpa's benchmark suite): sizes and the printed parameter counts (billions).
GPT_ROWS = [  # hidden, layers, heads, params (B)
    (1024, 24, 16, 0.355), (1536, 24, 16, 0.759), (2048, 24, 32, 1.313), (2560, 32, 32, 2.649),
    (4096, 32, 32, 6.654), (5120, 48, 40, 15.364), (8192, 48, 64, 39.079),
]
MOE_ROWS = [  # hidden, layers, heads, experts, params (B)
    (768, 8, 16, 8, 0.384), (768, 8, 16, 16, 0.686), (768, 16, 16, 16, 1.347), (1024, 16, 16, 16, 2.383),
    (1536, 16, 16, 32, 10.170), (2048, 16, 16, 48, 26.648), (2048, 32, 16, 64, 70.415),
]
WRESNET_ROWS = [  # depth, base channels, width factor, params (B)
    (50, 160, 2, 0.254), (50, 224, 2, 0.495), (50, 320, 2, 1.006), (50, 448, 2, 1.965), (50, 640, 2, 4.001),
    (50, 320, 16, 6.728), (50, 320, 32, 13.267),  # 13B: Alpa's suite spec, not the depth 101 printed beside it
]
GPT_VOCAB, MOE_VOCAB, SEQ = 51200, 32000, 1024


@pytest.fixture(scope="module")
def corpus():
    """Every named model of the corpus, built once."""
    return {name: preset(name) for name in PRESETS}


# ---------------------------------------------------------------- GPT

def megatron_params(h: int, l: int, V: int, s: int) -> int:
    """Megatron's closed form 12lh²(1 + 13/(12h) + (V+s)/(12lh)) = 12lh² + 13lh + (V+s)h."""
    return 12 * l * h * h + 13 * l * h + (V + s) * h


@pytest.mark.parametrize("h, l, n, printed", GPT_ROWS)
def test_gpt_params_are_megatron_closed_form_plus_final_layernorm(h, l, n, printed):
    g = gpt(h, l, n, SEQ, GPT_VOCAB, batch=1)
    assert g.num_params == megatron_params(h, l, GPT_VOCAB, SEQ) + 2 * h


@pytest.mark.parametrize("h, l, n, printed", GPT_ROWS)
def test_gpt_params_in_alpas_convention_match_the_printed_column(h, l, n, printed):
    # Alpa counts l(12h² + 13h) + V(h + 1): no position table, no final LayerNorm, an LM-head bias.
    g = gpt(h, l, n, SEQ, GPT_VOCAB, batch=1)
    alpa = g.num_params - SEQ * h - 2 * h + GPT_VOCAB
    assert alpa == l * (12 * h * h + 13 * h) + GPT_VOCAB * (h + 1)
    assert abs(alpa / 1e9 - printed) <= 0.001  # the column's precision (it rounds 1.3135 down)


def test_untied_head_adds_one_vocabulary_table():
    tied, untied = gpt(256, 2, 4, 64, 1000, 2), gpt(256, 2, 4, 64, 1000, 2, tied=False)
    assert untied.num_params - tied.num_params == 1000 * 256


@pytest.mark.parametrize("h, l, n, s, V, B", [
    (1024, 24, 16, 1024, 51200, 1024), (8192, 48, 64, 1024, 51200, 1024), (96, 3, 3, 40, 1000, 5),
    (256, 2, 8, 512, 777, 3),
])
def test_gpt_iteration_matmul_flops_equal_the_closed_form(h, l, n, s, V, B):
    split = flop_split(gpt(h, l, n, s, V, B))
    closed = 72 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(V, 12 * l * h))
    assert 3 * split.matmul == closed


def test_gpt_other_flops_by_hand():
    h, l, n, s, V, B = 64, 2, 4, 32, 100, 3
    split = flop_split(gpt(h, l, n, s, V, B))
    tok = B * s * h
    # per block: 2 LayerNorms (8/elem), 6 bias adds (q,k,v,proj,fc2: tok; fc1: 4·tok), gelu 4·tok,
    # 2 residual adds, softmax 5 per score; then position add, final LayerNorm, cross entropy 5/logit.
    per_block = 2 * 8 * tok + (4 * tok + 4 * tok + tok) + 4 * tok + 2 * tok + 5 * B * n * s * s
    assert split.other == l * per_block + tok + 8 * tok + 5 * B * s * V
    assert split.total == split.matmul + split.other


def test_megatron_three_einsums_and_one_rename_per_attention():
    g = gpt(64, 1, 4, 32, 100, 2)
    ops = {op.name: op for op in g.ops}
    assert ops["l0.x_t"].kind == "reshape" and dict(ops["l0.x_t"].attrs) == {"merge": {"t": ["s"]}}
    assert g.tensors["l0.k"].dims == ("b", "t", "n", "d") and g.tensors["l0.q"].dims == ("b", "s", "n", "d")
    assert g.tensors["l0.scores"].dims == ("b", "n", "s", "t")
    assert ops["l0.probs"].attrs["axes"] == ["t"]


# ---------------------------------------------------------------- Llama

def test_llama_params_equal_the_published_llama2_counts():
    # Llama-2-7B and -70B checkpoints hold 6,738,415,616 and 68,976,648,192 parameters.
    assert llama(4096, 32, 32, 32, 11008, 16, 32000, 1).num_params == 6_738_415_616
    assert llama(8192, 80, 64, 8, 28672, 16, 32000, 1).num_params == 68_976_648_192


def test_llama_params_and_flops_by_hand():
    h, l, n, g_, f, s, V, B = 128, 3, 8, 2, 344, 16, 500, 2
    d = h // n
    graph = llama(h, l, n, g_, f, s, V, B)
    assert graph.num_params == l * (2 * h * h + 2 * h * g_ * d + 3 * h * f + 2 * h) + 2 * V * h + h
    tok = B * s
    per_layer = 2 * tok * h * h * 2 + 2 * tok * h * g_ * d * 2 + 2 * 2 * B * s * s * h + 3 * 2 * tok * h * f
    assert flop_split(graph).matmul == l * per_layer + 2 * tok * h * V
    assert graph.tensors["l0.k"].dims == ("b", "t", "g", "d")
    assert graph.tensors["l0.q"].dims == ("b", "s", "g", "r", "d")
    assert graph.dims["r"] == n // g_


def test_llama_with_a_head_size_of_its_own_by_hand():
    """head_dim d apart from h / n (Mistral-Nemo: h 5120, 32 heads of 128): q and the output projection are h·n·d,
    k and v h·g·d, scores and context 2·B·s²·n·d each; hidden / heads as head_dim builds the default graph."""
    h, l, n, g_, f, s, V, B, d = 128, 2, 8, 2, 344, 16, 500, 2, 32  # n·d = 256 = 2h
    graph = llama(h, l, n, g_, f, s, V, B, head_dim=d)
    assert graph.num_params == l * (2 * h * n * d + 2 * h * g_ * d + 3 * h * f + 2 * h) + 2 * V * h + h
    tok = B * s
    per_layer = 2 * 2 * tok * h * n * d + 2 * 2 * tok * h * g_ * d + 2 * 2 * B * s * s * n * d + 3 * 2 * tok * h * f
    assert flop_split(graph).matmul == l * per_layer + 2 * tok * h * V
    assert graph.architecture["head_dim"] == d
    default = llama(h, l, n, g_, f, s, V, B)
    assert "head_dim" not in default.architecture
    assert graph_to_dict(llama(h, l, n, g_, f, s, V, B, head_dim=h // n)) == graph_to_dict(default)


# ---------------------------------------------------------------- MoE

def moe_params(h: int, l: int, e: int, V: int, s: int, f: int) -> int:
    """⌈l/2⌉ dense blocks, ⌊l/2⌋ expert blocks (bias-free experts, gate h·e), tied table, positions, final LN."""
    dense = 4 * h * h + 2 * h * f + 9 * h + f
    expert = 4 * h * h + 8 * h + h * e + 2 * e * h * f
    return (l - l // 2) * dense + (l // 2) * expert + (V + s) * h + 2 * h


@pytest.mark.parametrize("h, l, n, e, printed", MOE_ROWS)
def test_moe_params_match_the_printed_column(h, l, n, e, printed):
    g = moe(h, l, n, e, SEQ, MOE_VOCAB, batch=2)
    assert g.num_params == moe_params(h, l, e, MOE_VOCAB, SEQ, 8 * h)
    assert g.num_params / 1e9 == pytest.approx(printed, rel=0.02)


def test_expert_capacity_is_gshard_2n_over_e():
    assert expert_capacity(2048, 8) == 512
    assert expert_capacity(2048, 64) == 64
    with pytest.raises(InstanceError, match="capacity"):
        expert_capacity(4, 16)


def test_moe_layer_flops_and_shapes_by_hand():
    h, e, s, B, gs, f = 64, 4, 32, 4, 64, 256
    g = moe_layer(h, e, s, B, group_size=gs, ffn=f)
    c = 2 * gs // e
    assert (g.dims["g"], g.dims["gs"], g.dims["c"]) == (B * s // gs, gs, c)
    assert g.tensors["l0.dispatch"].dims == ("e", "g", "c", "h")
    flops = {op.name: g.flops(op) for op in g.ops if is_matmul(op)}
    tokens = B * s
    assert flops["l0.gate"] == 2 * tokens * h * e
    # top-2 at capacity factor 1: every expert slot is one token-choice, e·c = 2·gs per group
    assert flops["l0.dispatch"] == flops["l0.combine"] == 2 * tokens * 2 * gs * h
    assert flops["l0.fc1"] + flops["l0.fc2"] == 2 * (2 * 2 * tokens * h * f)  # twice a dense MLP
    assert g.num_params == h * e + 2 * e * h * f


def test_moe_alternates_dense_and_expert_blocks():
    g = moe(64, 4, 4, 4, 32, 100, 4, group_size=64)
    kinds = {op.layer: set() for op in g.ops}
    for op in g.ops:
        kinds[op.layer].add(op.name.split(".")[1])
    assert "dispatch" not in kinds[0] and "dispatch" in kinds[1]
    assert "dispatch" not in kinds[2] and "dispatch" in kinds[3]


def test_moe_group_must_divide_the_tokens():
    with pytest.raises(InstanceError, match="group_size"):
        moe(64, 2, 4, 4, 30, 100, 3, group_size=64)


# ---------------------------------------------------------------- Wide-ResNet

def wresnet_params(depth: int, base: int, width: int, classes: int = 1024) -> int:
    """Hand count of the Flax bottleneck ResNet: convs without bias, 2 BN params per channel, fc with bias."""
    stages = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}[depth]
    total = 3 * base * 7 * 7 + 2 * base
    cin = base
    for i, blocks in enumerate(stages):
        a, wide, out = base * 2**i, base * 2**i * width, 4 * base * 2**i
        for j in range(blocks):
            total += cin * a + 2 * a + a * wide * 9 + 2 * wide + wide * out + 2 * out
            if j == 0:
                total += cin * out + 2 * out
            cin = out
    return total + cin * classes + classes


@pytest.mark.parametrize("depth, base, width, printed", WRESNET_ROWS)
def test_wresnet_params_match_the_printed_column(depth, base, width, printed):
    g = wresnet(depth, base, width, batch=1)
    assert g.num_params == wresnet_params(depth, base, width)
    assert g.num_params / 1e9 == pytest.approx(printed, rel=0.02)


def test_wresnet_13b_is_depth_50_width_32():
    # The printed 13.267 B is depth 50, width 32 (Alpa's suite); the depth 101, width 16 printed
    # beside it would be 12.633 B, 4.8 % short.
    assert preset("wresnet-13b").num_params == wresnet_params(50, 320, 32) == 13_267_137_984
    assert wresnet(101, 320, 16, batch=1).num_params == wresnet_params(101, 320, 16) == 12_633_386_944


def test_width_factor_one_is_torchvision_resnet():
    # torchvision's resnet50 / resnet101 (v1.5, 1000 classes): 25,557,032 and 44,549,160 parameters,
    # 4.09 G multiply-adds per 224×224 image for resnet50.
    r50 = wresnet(50, 64, 1, batch=1, classes=1000)
    assert r50.num_params == 25_557_032
    assert wresnet(101, 64, 1, batch=1, classes=1000).num_params == 44_549_160
    assert flop_split(r50).matmul / 2 == pytest.approx(4.09e9, rel=0.005)


def test_wresnet_spatial_dims_and_strides():
    g = wresnet(50, 16, 2, batch=2)
    assert g.tensors["stem.maxpool"].dims == ("b", "stem", "h56", "w56")
    assert g.tensors["head.avgpool"].dims == ("b", "c4_o")
    assert g.tensors["l3.conv2"].dims == ("b", "c2_b", "h28", "w28")  # first block of stage 2 strides
    assert g.tensors["l0.proj"].dims == ("b", "c1_o", "h56", "w56")  # stage 1 projection: 1×1, stride 1
    ops = {op.name: op for op in g.ops}
    assert ops["l3.proj"].kind == "conv2d" and ops["l3.proj"].attrs["stride"] == 2
    assert ops["l0.bn1"].attrs["axes"] == ["b", "h56", "w56"]
    assert "l1.proj" not in ops


def test_wresnet_rejects_unknown_depth():
    with pytest.raises(InstanceError, match="depth 34"):
        wresnet(34, 64, 1, batch=1)


# ---------------------------------------------------------------- the corpus

ONE_PER_FAMILY = ["gpt-350m", "llama-7b", "moe-380m", "wresnet-250m", "bert-layer", "moe-layer"]


def test_generated_graphs_round_trip_through_the_file_format(corpus):
    # One named model per generator (the rest differ only in sizes and block counts; the
    # corpus files are all read back by tests/test_io.py); schema checks make this the slow part.
    for name in ONE_PER_FAMILY:
        g = corpus[name]
        data = graph_to_dict(g)
        assert graph_to_dict(graph_from_dict(data, name)) == data, name


def test_every_op_has_a_layer_tag_and_scoped_name(corpus):
    for name, g in corpus.items():
        tags = [op.layer for op in g.ops]
        assert None not in tags, name
        assert sorted(set(tags)) == list(range(max(tags) + 1)), name
        for op in g.ops:
            scope = op.name.split(".")[0]
            assert scope in ("embed", "stem", "head") or scope == f"l{op.layer}", (name, op.name)


def test_embedding_and_head_ride_with_the_first_and_last_blocks(corpus):
    g = corpus["gpt-350m"]
    ops = {op.name: op for op in g.ops}
    assert ops["embed.tokens"].layer == 0 and ops["head.loss"].layer == 23
    assert g.tensors["head.loss"].role == "output" and g.tensors["head.loss"].dims == ()


@pytest.mark.parametrize("name, first, second", [
    ("gpt-39b", 1, 2), ("gpt-350m", 5, 17), ("llama-70b", 1, 40), ("moe-70b", 2, 4), ("moe-70b", 1, 29),
    ("wresnet-13b", 8, 11), ("wresnet-250m", 1, 2),
])
def test_middle_blocks_hash_alike(corpus, name, first, second):
    g = corpus[name]
    assert g.structural_hash(g.subgraph_ops([first])) == g.structural_hash(g.subgraph_ops([second]))


def test_different_blocks_hash_differently(corpus):
    def block_hash(name: str, layer: int) -> str:
        return corpus[name].structural_hash(corpus[name].subgraph_ops([layer]))

    assert block_hash("moe-70b", 1) != block_hash("moe-70b", 2)  # expert vs dense block
    assert block_hash("wresnet-13b", 7) != block_hash("wresnet-13b", 8)  # first block of stage 3 projects


def test_instance_files_are_up_to_date(corpus):
    for name, g in corpus.items():
        path = INSTANCES / f"{name}.json"
        assert path.stat().st_size < 2_000_000, name
        with open(path, encoding="utf-8") as f:
            assert json.load(f) == graph_to_dict(g), f"{path} is stale: run scripts/make_instances.py"


def test_corpus_sizes():
    assert preset("wresnet-13b").dims["b"] == preset("wresnet-6.8b").dims["b"] == 1520
    assert preset("gpt-39b").dims["b"] == 1024 and preset("gpt-39b").name == "gpt-39b"
    assert preset("bert-layer").num_params == 12 * 1024**2 + 13 * 1024
    assert bert(1024, 3, 16, 128, 8).num_params == 3 * (12 * 1024**2 + 13 * 1024)


# ---------------------------------------------------------------- errors

def test_unknown_model_lists_the_models():
    with pytest.raises(InstanceError) as err:
        generate("resnet", depth=50)
    assert "gpt" in err.value.line() and "wresnet" in err.value.line()


def test_unknown_and_missing_parameters_are_named():
    with pytest.raises(InstanceError, match="experts"):
        generate("gpt", hidden=64, layers=1, heads=4, seq=8, vocab=10, batch=1, experts=4)
    with pytest.raises(InstanceError, match="needs vocab"):
        generate("gpt", hidden=64, layers=1, heads=4, seq=8, batch=1)
    with pytest.raises(InstanceError, match="unknown named model"):
        preset("gpt-1t")


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=0), "hidden must be a positive integer"),
    (dict(hidden=100, heads=3), "not divisible by heads"),
    (dict(batch=2.5), "batch must be a positive integer"),
    (dict(dtype="fp12"), "unknown dtype"),
    (dict(loss_kernel="chunked"), "loss_kernel"),
])
def test_bad_generator_arguments_are_instance_errors(kwargs, match):
    args = dict(hidden=64, layers=1, heads=4, seq=8, vocab=10, batch=1) | kwargs
    with pytest.raises(InstanceError, match=match):
        gpt(**args)


# ---------------------------------------------------------------- partopt generate

def test_cli_generate_writes_a_generator_and_a_named_model(tmp_path):
    out = tmp_path / "g.json"
    args = ["generate", "gpt", "--hidden", "64", "--layers", "2", "--heads", "4", "--seq", "16", "--vocab", "100",
            "--batch", "2", "--untied", "-o", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert graph_to_dict(read_graph(out)) == graph_to_dict(gpt(64, 2, 4, 16, 100, 2, tied=False))
    result = CliRunner().invoke(main, ["generate", "moe-380m", "--batch", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert graph_to_dict(read_graph(out)) == graph_to_dict(preset("moe-380m", batch=4))
    result = CliRunner().invoke(main, [*args, "--attention-dropout", "0.1"])
    assert result.exit_code == 0, result.output
    assert graph_to_dict(read_graph(out)) == graph_to_dict(gpt(64, 2, 4, 16, 100, 2, tied=False, attention_dropout=0.1))
    assert sum(op["attrs"].get("fn") == "dropout" for op in graph_to_dict(read_graph(out))["ops"] if "attrs" in op) == 2
    result = CliRunner().invoke(main, [*args, "--loss-kernel", "unfused"])
    assert result.exit_code == 0, result.output
    assert graph_to_dict(read_graph(out)) == graph_to_dict(gpt(64, 2, 4, 16, 100, 2, tied=False, loss_kernel="unfused"))
    losses = [op for op in graph_to_dict(read_graph(out))["ops"] if op["kind"] == "cross_entropy"]
    assert [op.get("attrs") for op in losses] == [{"fused": False}]  # Megatron-LM's loss; the default writes none
    assert [op.get("attrs") for op in graph_to_dict(gpt(64, 2, 4, 16, 100, 2))["ops"]
            if op["kind"] == "cross_entropy"] == [None]


@pytest.mark.parametrize("args, words", [
    (["generate", "resnet"], ["unknown model 'resnet'", "wresnet", "gpt-39b"]),
    (["generate", "gpt", "--hidden", "64", "--experts", "2"], ["takes no parameter experts"]),
    (["generate", "gpt", "--hidden", "64", "--layers", "1", "--heads", "4", "--seq", "16", "--vocab", "100", "--batch",
      "2", "--attention-dropout", "1"], ["attention_dropout 1.0 is not a probability"]),
    (["generate", "llama", "--attention-dropout", "0.1"], ["takes no parameter attention_dropout"]),
    (["generate", "bert", "--loss-kernel", "unfused"], ["takes no parameter loss_kernel"]),
    (["generate", "wresnet", "--depth", "34", "--base-channels", "8", "--width-factor", "1", "--batch", "1"],
     ["depth 34"]),
])
def test_cli_generate_errors_are_one_line(tmp_path, args, words):
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "x.json")])
    assert result.exit_code == 2
    assert "Traceback" not in result.output and result.output.count("\n") == 1
    for word in words:
        assert word in result.output
    assert not (tmp_path / "x.json").exists()
