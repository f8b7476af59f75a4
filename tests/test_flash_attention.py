"""Fused (flash) attention: one `attention` op for the scores, their softmax and the context.

Hand checks follow FlashAttention (Dao et al. 2022; Dao 2023, "FlashAttention-2"): the forward is
the two GEMMs q·kᵀ and p·v, 4·b·s·t·n·d FLOPs; the backward recomputes the scores and runs four
more GEMMs of the same size (dv, dp, dq, dk), 2.5× the forward; a causal kernel skips the blocks
above the diagonal, half the work; the s×t scores never reach memory, so the op moves only q, k,
v and its output, and keeps its output and each query row's fp32 log-sum-exp for the backward.
"""

import dataclasses

import pytest

from partopt import calibrate, costmodel, intra, ops
from partopt.cluster import nominal_preset, preset
from partopt.errors import InstanceError
from partopt.evaluate import uniform
from partopt.graph import Graph, Op, Tensor
from partopt.models.gpt import bert, gpt, llama
from partopt.ops import Behaviour
from partopt.sharding import R, Shard, executed_flops, forward_share, op_strategies

B, S, H, HEADS = 4, 64, 128, 4
D = H // HEADS


def flash_gpt(layers: int = 1, batch: int = B, seq: int = S) -> Graph:
    return gpt(hidden=H, layers=layers, heads=HEADS, seq=seq, vocab=512, batch=batch, attention_kernel="flash")


def the(graph: Graph, suffix: str) -> Op:
    return next(op for op in graph.ops if op.name.endswith(suffix))


def test_the_flash_block_replaces_scores_softmax_and_context_by_one_causal_op():
    math, flash = gpt(hidden=H, layers=1, heads=HEADS, seq=S, vocab=512, batch=B), flash_gpt()
    fused = [op for op in flash.ops if op.kind == "attention"]
    assert [op.name for op in fused] == ["l0.attention"]
    assert fused[0].inputs == ("l0.q.add_bias", "l0.k.add_bias", "l0.v.add_bias")
    assert fused[0].attrs == {"causal": True}
    names = {op.name for op in math.ops} - {"l0.scores", "l0.probs", "l0.context"}
    assert {op.name for op in flash.ops} == names | {"l0.attention"}
    assert the(bert(hidden=H, layers=1, heads=HEADS, seq=S, batch=B, attention_kernel="flash"),
               ".attention").attrs == {"causal": False}  # an encoder attends both ways


def test_forward_flops_are_the_two_gemms_of_the_math_path():
    math, flash = gpt(hidden=H, layers=1, heads=HEADS, seq=S, vocab=512, batch=B), flash_gpt()
    by_hand = 2 * (2 * B * HEADS * S * S * D)  # q·kᵀ and p·v, 2 FLOPs per multiply-add
    assert flash.flops(the(flash, ".attention")) == by_hand
    assert by_hand == math.flops(the(math, ".scores")) + math.flops(the(math, ".context"))


def test_grouped_query_attention_counts_every_query_head():
    g = llama(hidden=256, layers=1, heads=8, kv_heads=2, ffn=512, seq=32, vocab=100, batch=2, attention_kernel="flash")
    op = the(g, ".attention")
    assert [g.tensors[t].dims for t in (*op.inputs, op.output)] == [
        ("b", "s", "g", "r", "d"), ("b", "t", "g", "d"), ("b", "t", "g", "d"), ("b", "s", "g", "r", "d")]
    assert g.flops(op) == 4 * 2 * 32 * 32 * 8 * 32  # 4·b·s·t·heads·d, heads = g·r = 8, d = 256 / 8


def test_executed_flops_recompute_the_scores_and_skip_the_masked_half():
    flash = flash_gpt()
    op = the(flash, ".attention")
    forward = 4 * B * HEADS * S * S * D
    assert executed_flops(flash, op) == pytest.approx(forward * 0.5 * (1 + 2.5))
    encoder = bert(hidden=H, layers=1, heads=HEADS, seq=S, batch=B, attention_kernel="flash")
    assert executed_flops(encoder, the(encoder, ".attention")) == pytest.approx(forward * 3.5)
    assert forward_share(flash, op, preset("dgx-a100").device) == pytest.approx(2 / 7)
    # the model's FLOPs (what TFLOP/s count) stay those of the math path: 3 × forward, nothing skipped
    assert costmodel.training_flops(flash.flops(op), ops.is_matmul(op)) == 3 * forward


def test_only_batch_heads_and_query_positions_may_be_split():
    flash = flash_gpt()
    op = the(flash, ".attention")
    behaviour = ops.behaviours(op, flash)
    assert behaviour == {"b": Behaviour.PARALLEL, "s": Behaviour.PARALLEL, "n": Behaviour.PARALLEL,
                         "d": Behaviour.WINDOWED, "t": Behaviour.WINDOWED}
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 8), (2, 4))
    split = {d for s in op_strategies(flash, op, mesh) for d in s.axes if d is not None}
    assert split == {"b", "s", "n"}


def test_one_device_time_is_the_roofline_of_q_k_v_and_the_output():
    flash = flash_gpt(seq=1024)
    op = the(flash, ".attention")
    mesh = preset("dgx-a100", 1).logical_mesh((1, 1), (1, 1))
    (strategy,) = op_strategies(flash, op, mesh)
    device = mesh.device
    flops = 4 * B * HEADS * 1024 * 1024 * D * 0.5 * 3.5
    moved = 2 * (4 * 2 * B * 1024 * H)  # forward and backward each stream q, k, v and the output, fp16
    rate = device.peak("fp16") * costmodel.matmul_efficiency(flops, device, attention=True)
    by_hand = max(flops / rate, moved / (device.memory_bandwidth * device.memory_efficiency))
    assert strategy.compute_s == pytest.approx(by_hand)
    assert strategy.forward_s == pytest.approx(by_hand / 3.5)
    assert strategy.inputs == ((R, R), (R, R), (R, R)) and strategy.output == (R, R)
    # kept for the backward: the output [b, s, n, d] in fp16 and one fp32 log-sum-exp per (b, s, n)
    assert strategy.memory_bytes == 2 * B * 1024 * H + 4 * B * 1024 * HEADS


def test_fused_attention_runs_at_its_own_efficiency_and_gemms_at_theirs():
    """FlashAttention reaches less of the peak than a GEMM (FlashAttention-3, arXiv 2407.08608: FlashAttention-2
    at 35 % of an H100's): with `attention_efficiency` 0.3 the attention op takes its executed FLOPs over
    0.3 of the peak, and the GEMMs of the same layer are priced as before."""
    flash = flash_gpt(seq=1024)
    cluster = preset("dgx-a100", 1)
    flat = dataclasses.replace(cluster.device, matmul_half_flops=0.0, matmul_efficiency=0.7)
    apart = dataclasses.replace(flat, attention_efficiency=0.3)

    def priced(device, suffix):
        mesh = dataclasses.replace(cluster, device=device).logical_mesh((1, 1), (1, 1))
        return op_strategies(flash, the(flash, suffix), mesh)[0].compute_s

    flops = 4 * B * HEADS * 1024 * 1024 * D * 0.5 * 3.5  # compute-bound: q, k, v, o stream in a third of it
    assert priced(apart, ".attention") == pytest.approx(flops / (312e12 * 0.3))
    assert priced(flat, ".attention") == pytest.approx(flops / (312e12 * 0.7))
    gemm = next(op.name for op in flash.ops if op.kind == "einsum" and len(op.inputs) == 2)
    assert priced(apart, gemm) == priced(flat, gemm)
    with pytest.raises(InstanceError):
        dataclasses.replace(flat, attention_efficiency=0.0)


def test_the_fit_tells_the_gemm_and_the_attention_efficiency_apart():
    """Points the model itself prices at known efficiencies give them back: a GEMM-heavy layer (short sequence,
    wide) and attention-heavy ones (long sequence, narrow) pin the two apart."""
    truth = {"matmul_efficiency": 0.7, "attention_efficiency": 0.35}
    shapes = [dict(hidden=2048, heads=16, seq=256), dict(hidden=256, heads=2, seq=2048),
              dict(hidden=512, heads=4, seq=4096)]

    def points(seconds: list[float]) -> calibrate.Points:
        return calibrate.points_from_dict({"format": "partopt.points", "version": 1, "points": [
            {"label": f"{i}", "source": "generated by the model (test)",
             "model": {"generator": "gpt", "args": {**args, "layers": 1, "vocab": 512, "batch": 8, "dtype": "bf16",
                                                     "attention_kernel": "flash"}},
             "cluster": {"preset": "dgx-h100", "nodes": 1, "devices_per_node": 1},
             "plan": {"tp": 1, "pp": 1, "dp": 1, "microbatches": 1, "recompute": "none"},
             "measured": {"iteration_s": s}} for i, (args, s) in enumerate(zip(shapes, seconds))]})

    base = calibrate.with_values(preset("dgx-h100"), nominal_preset("dgx-h100"), truth)
    times = [uniform(p.graph, calibrate.point_cluster(p, base), 1, 1, 1, 1, recompute="none").iteration_time_s
             for p in points([1.0] * len(shapes)).points]
    result = calibrate.fit(points(times), "dgx-h100", list(truth), leave_one_out=False,
                           start={"matmul_efficiency": 0.5, "attention_efficiency": 0.6}, workers=1)
    for name, value in truth.items():
        assert result.values[name] == pytest.approx(value, rel=1e-3), name


def test_a_head_split_divides_time_and_memory():
    flash = flash_gpt(seq=1024)
    op = the(flash, ".attention")
    one = op_strategies(flash, op, preset("dgx-a100", 1).logical_mesh((1, 1), (1, 1)))[0]
    mesh = preset("dgx-a100", 1).logical_mesh((1, 4), (1, 4))
    heads = next(s for s in op_strategies(flash, op, mesh) if s.axes == (None, "n"))
    assert heads.output == (R, Shard("n")) and not heads.comm
    assert heads.memory_bytes == pytest.approx(one.memory_bytes / 4)
    assert heads.compute_s >= one.compute_s / 4  # a quarter of the work, on smaller GEMMs


def test_selective_recomputation_has_nothing_to_rerun_and_full_reruns_the_forward():
    flash = flash_gpt()
    block = [op for op in flash.ops if op.name.startswith("l0.")]
    assert intra.recomputed_ops(flash, block, "selective") == frozenset()
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 1), (1, 1))
    full = intra.shard_stage(flash, mesh, block, recompute="full")
    chosen = {oc.op: oc.strategy for oc in full.ops}
    assert "l0.attention" in {oc.op for oc in full.ops}
    assert full.breakdown.recompute_s == pytest.approx(sum(s.forward_s for s in chosen.values()))


def test_flash_keeps_no_scores_and_prices_no_score_traffic():
    # The math block keeps the probabilities [b, n, s, t] (fp16; softmax's backward reads them, not the scores)
    # and the context; the fused op keeps its output and the fp32 statistics instead. q, k, v are kept by both.
    math = gpt(hidden=H, layers=1, heads=HEADS, seq=S, vocab=512, batch=B)
    flash = flash_gpt()
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 1), (1, 1))
    kept = [intra.shard_stage(g, mesh, [op for op in g.ops if op.name.startswith("l0.")]).breakdown.activation_bytes
            for g in (math, flash)]
    assert kept[0] - kept[1] == pytest.approx(2 * B * HEADS * S * S - 4 * B * S * HEADS)


def test_a_megatron_plan_of_a_flash_model_evaluates():
    g = gpt(hidden=256, layers=4, heads=8, seq=512, vocab=1024, batch=16, attention_kernel="flash")
    math = gpt(hidden=256, layers=4, heads=8, seq=512, vocab=1024, batch=16)
    cluster = preset("p3.16xlarge", 1)
    fused, plain = (uniform(x, cluster, 2, 2, 2, 4, workers=1) for x in (g, math))
    assert fused.memory_peak_bytes < plain.memory_peak_bytes
    assert fused.throughput["tflops_per_device"] > 0
    # hardware FLOPs: the model's, less the skipped causal half, plus the recomputed scores
    attention = 4 * 16 * 8 * 512 * 512 * 32 * 4  # per layer, times 4 layers
    assert (fused.throughput["hardware_tflops_per_device"] - fused.throughput["tflops_per_device"]) \
        == pytest.approx(attention * (1.75 - 3) / fused.iteration_time_s / 8 / 1e12)


def _graph(q, k, v, out) -> Graph:
    dims = dict(b=2, s=8, t=8, n=2, d=4, e=4)
    tensors = {name: Tensor(name, d, "output" if name == "o" else "input")
               for name, d in (("q", q), ("k", k), ("v", v), ("o", out))}
    return Graph("bad", dims, tensors, [Op("att", "attention", ("q", "k", "v"), "o", 0, {"causal": True})], "b")


@pytest.mark.parametrize("q, k, v, out, words", [
    (("b", "s", "n", "d"), ("b", "t", "n", "e"), ("b", "t", "n", "d"), ("b", "s", "n", "d"), "same head dim"),
    (("b", "s", "n", "d"), ("b", "s", "n", "d"), ("b", "s", "n", "d"), ("b", "s", "n", "d"), "key positions"),
    (("b", "s", "n", "d"), ("b", "t", "n", "d"), ("b", "t", "d"), ("b", "s", "n", "d"), "every dim but the last"),
    (("b", "s", "n", "d"), ("b", "t", "n", "d"), ("b", "t", "n", "d"), ("b", "s", "d"), "output dims"),
])
def test_malformed_attention_is_refused_with_its_op(q, k, v, out, words):
    with pytest.raises(InstanceError, match=words) as err:
        _graph(q, k, v, out)
    assert "att" in str(err.value)


def test_an_unknown_attention_kernel_is_refused():
    with pytest.raises(InstanceError, match="attention_kernel"):
        gpt(hidden=H, layers=1, heads=HEADS, seq=S, vocab=512, batch=B, attention_kernel="sdpa")
