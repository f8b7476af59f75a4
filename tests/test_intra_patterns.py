"""The parallelisation patterns the intra-op ILP must find on its own (REFERENCE §4, issue 4).

Same conventions as test_intra.py: a compute-bound test device (HBM unbounded, matmul efficiency
1) and latency-free links, so every expected cost below is written out by hand from the formulas
of docs/COSTMODEL.md: FLOPs of each op over the devices that split it, plus ring collectives.
"""

from pathlib import Path

import pytest
from test_intra import LAUNCH, PEAK, row_mesh

from partopt import intra
from partopt.io import read_graph
from partopt.models import bert, gpt
from partopt.sharding import P, R, Shard

INSTANCES = Path(__file__).parent.parent / "instances"
BW = 10e9
FP16 = 2


def all_reduce(nbytes, n):
    return LAUNCH + 2 * (n - 1) / n * nbytes / BW


def gradient_all_reduce(nbytes, n):
    """Per-iteration gradient synchronisation rides in buckets: only its bandwidth term counts."""
    return 2 * (n - 1) / n * nbytes / BW


def all_to_all(local_bytes, n):
    """Pairwise exchange: each device keeps 1/n of its local buffer and sends the rest once."""
    return LAUNCH + (n - 1) / n * local_bytes / BW


def by_op(stage):
    return {c.op: c.strategy for c in stage.ops}


# ---------------------------------------------------------------- 1. BERT layer, Megatron tensor parallelism

B, S, H, HEADS, T = 4, 128, 1024, 16, 4  # few tokens: splitting the norms saves less than 4 launches


def bert_middle_layer():
    """The middle layer of a 3-layer BERT: its input comes from, and its output goes to, a copy of itself."""
    graph = bert(hidden=H, layers=3, heads=HEADS, seq=S, batch=B)
    return graph, [op for op in graph.ops if op.layer == 1]


def bert_layer_flops():
    """Forward FLOPs of one BERT layer: (matmuls, elementwise ops Megatron splits, ops it replicates)."""
    bsh = B * S * H
    matmuls = 24 * bsh * H + 4 * B * S * S * H  # Q, K, V, proj (h²), fc1, fc2 (4h²); scores, context
    split = 3 * bsh + 5 * B * HEADS * S * S + 4 * bsh + 4 * bsh  # Q/K/V biases, softmax, fc1 bias, gelu
    replicated = bsh + bsh + 8 * bsh + bsh + bsh + 8 * bsh  # proj bias, res1, ln1, fc2 bias, res2, ln2
    return matmuls, split, replicated


def bert_layer_params():
    h = H
    return [h * h] * 4 + [h] * 4 + [h, h] + [4 * h * h, 4 * h, 4 * h * h, h] + [h, h]


def test_bert_layer_small_batch_is_megatron_with_two_all_reduces_forward_and_two_backward():
    graph, ops = bert_middle_layer()
    stage = intra.shard_stage(graph, row_mesh(T, BW), ops, backend="highs")
    s = by_op(stage)
    for name in ("l1.q", "l1.k", "l1.v"):  # column parallel: heads split, output sharded, no communication
        assert s[name].axes == (None, "n") and s[name].output == (R, Shard("n")), name
    assert s["l1.proj"].axes == (None, "n") and s["l1.proj"].output == (R, P)  # row parallel: pending sum
    assert s["l1.fc1"].axes == (None, "f") and s["l1.fc1"].output == (R, Shard("f"))
    assert s["l1.fc2"].axes == (None, "f") and s["l1.fc2"].output == (R, P)
    for name in ("l1.ln1", "l1.ln2", "l1.res1", "l1.res2"):
        assert s[name].axes == (None, None), name
    params = {p.tensor: p.strategy.placement for p in stage.params}
    assert params["l1.q.w"] == (R, Shard("n")) and params["l1.fc2.w"] == (R, Shard("f"))

    matmuls, split, replicated = bert_layer_flops()
    compute = (3 * matmuls / T + 2 * split / T + 2 * replicated) / PEAK
    activation = B * S * H * FP16
    # forward: after proj and fc2; backward: before the Q/K/V projections and before fc1 (Megatron's f)
    comm = 4 * all_reduce(activation, T)
    assert stage.breakdown.comm_s == {"all_reduce": pytest.approx(comm, rel=1e-12)}
    assert stage.breakdown.compute_s == pytest.approx(compute, rel=1e-12)
    assert stage.objective == pytest.approx(compute + comm, rel=1e-9)

    # in this regime data parallelism is dearer by hand: every op split 4 ways, 16 weight all-reduces
    dp = (3 * matmuls + 2 * split + 2 * replicated) / T / PEAK + sum(gradient_all_reduce(n * FP16, T) for n in bert_layer_params())
    assert compute + comm < dp
    forced = intra.shard_stage(graph, row_mesh(T, BW), ops, backend="highs", data_parallel=True)
    assert forced.objective == pytest.approx(dp, rel=1e-9)


# ---------------------------------------------------------------- 2. GShard MoE layer, expert parallelism

def test_moe_layer_splits_experts_and_moves_tokens_by_all_to_all():
    """Expert parallelism on a 1-D mesh. The layer's input x is data: it arrives in any layout for
    free and needs no gradient, so the ILP reads the tokens replicated and dispatches locally; what
    crosses devices is the routing (the int8 dispatch mask, forward only) and the experts' outputs
    on their way back to their groups (forward and backward)."""
    graph = read_graph(INSTANCES / "moe-layer.json")  # e = 8 experts, g = 4 groups, capacity c = 256
    n = 4
    assert graph.dims["e"] % n == 0
    stage = intra.shard_stage(graph, row_mesh(n, BW), backend="highs")
    s = by_op(stage)
    for name in ("l0.dispatch", "l0.fc1", "l0.fc2"):  # expert parallelism
        assert s[name].axes == (None, "e") and s[name].output == (R, Shard("e")), name
    for name in ("l0.gate", "l0.route", "l0.combine"):  # gating and combining stay with the token groups
        assert s[name].axes == (None, "g"), name
    params = {p.tensor: p.strategy.placement for p in stage.params}
    assert params["l0.fc1.w"] == (R, Shard("e")) and params["l0.fc2.w"] == (R, Shard("e"))
    assert params["l0.wg"] == (R, R)

    mask = graph.nbytes("l0.dispatch_mask") / n  # each device's g-quarter, re-cut by experts
    expert_out = graph.nbytes("l0.fc2") / n  # [e, g, c, h]: e-sharded -> g-sharded, and its gradient back
    assert graph.nbytes("l0.fc2") == graph.nbytes("l0.dispatch")
    expected = all_to_all(mask, n) + 2 * all_to_all(expert_out, n)
    # the GShard alternative (tokens g-sharded into the dispatch) would move the dispatched tokens
    # both ways instead of the mask one way: dearer by hand
    assert all_to_all(mask, n) < 2 * all_to_all(graph.nbytes("l0.dispatch") / n, n)
    assert stage.breakdown.comm_s == {"all_to_all": pytest.approx(expected, rel=1e-12)}
    # no expert weight is ever gathered; the only gradient sum is the small replicated gate's
    gate = graph.dims["h"] * graph.dims["e"] * FP16
    assert stage.breakdown.sync_s == {"all_reduce": pytest.approx(gradient_all_reduce(gate, n), rel=1e-12)}

    # forced data parallelism can split only ops that carry the batch dim b (not the token groups
    # after the reshape), so it runs the experts replicated: slower by at least 3/4 of the expert work
    forced = intra.shard_stage(graph, row_mesh(n, BW), backend="highs", data_parallel=True)
    expert_flops = 3 * 2 * graph.flops(graph.op_index["l0.fc1"])  # fc1 and fc2, forward + backward
    assert forced.objective - stage.objective > (1 - 1 / n) * expert_flops / PEAK - expected


# ---------------------------------------------------------------- 3. GPT layer, sequence parallelism

def all_gather(nbytes, n):
    return LAUNCH + (n - 1) / n * nbytes / BW


reduce_scatter = all_gather  # same ring volume and launch


def gpt_middle_layer(batch, seq, hidden=1024, heads=16):
    graph = gpt(hidden=hidden, layers=3, heads=heads, seq=seq, vocab=512, batch=batch)
    return graph, [op for op in graph.ops if op.layer == 1]


def test_gpt_layer_under_a_memory_budget_is_sequence_parallel_with_reduce_scatter_and_all_gather():
    """Megatron-SP (Korthikanti et al. 2022) on a pre-norm GPT layer, microbatch of one sequence.

    Without a budget the plain tensor-parallel form wins: 4 all-reduces of the [s, h] activation
    (A bytes) per microbatch, layernorms and residual adds replicated. With a budget that the four
    replicated [s, h] tensors kept for the backward (ln1, res1, ln2, res2: the norms' inputs and
    outputs) cannot pay, the six replicated ops (those four and the bias adds after proj and fc2, which
    keep nothing: only a residual add reads them) split the sequence instead (A/T each): proj and fc2 reduce-scatter their pending
    sums into them, and ln1/ln2 are all-gathered once for their readers (q and the s -> t reshape
    feeding k and v: one layout node shares the gather), 4 all-gathers + 4 reduce-scatters per
    microbatch, no all-reduce. The layernorm and bias parameters then get sequence-partial
    gradients: 6 small all-reduces per iteration (bucketed), amortised over 2 microbatches here.
    A batch of one leaves the sequence as the only token dim to split.
    """
    b, s, h, n, mb = 1, 512, 1024, 4, 2
    graph, ops = gpt_middle_layer(b, s, h)
    f, heads = 4 * h, 16
    a = b * s * h * FP16
    scores = b * heads * s * s * FP16  # [b, n, s, t]
    # ZeRO is not the subject: with bucketed gradients it ties with plain copies for the small parameters
    tp = intra.shard_stage(graph, row_mesh(n, BW), ops, backend="highs", microbatches=mb, allow_zero=False)
    t = by_op(tp)
    replicated = ("ln1", "proj.add_bias", "res1", "ln2", "fc2.add_bias", "res2")
    for name in replicated:
        assert t[f"l1.{name}"].axes == (None, None), name
    assert t["l1.proj"].output == (R, P) and t["l1.fc2"].output == (R, P)
    assert tp.breakdown.comm_s == {"all_reduce": pytest.approx(4 * all_reduce(a, n), rel=1e-12)}
    assert tp.breakdown.sync_s == {}

    # memory by hand, Megatron layout, one microbatch in flight: what the backwards read (COSTMODEL §5)
    activations = (a  # ln1, read by q and (through the x_t view) by k and v
                   + 3 * a / n  # q, k and v after their bias adds, head-split (the raw projections: no)
                   + scores / n + a / n  # probs (softmax's backward reads them; the scores: no), context
                   + 2 * a  # res1 and ln2 (the second norm's input and output; proj and its bias add: no)
                   + 2 * f / h * a / n  # fc1's bias add and gelu: f-split (the raw fc1: no)
                   + a)  # res2, read by the next layer (fc2 and its bias add: no)
    params = 16 * ((12 * h * h + 7 * h) / n + 6 * h)  # q,k,v,proj,fc1,fc2 weights and q,k,v,fc1 biases split
    assert tp.memory_bytes == pytest.approx(activations + params, rel=1e-12)

    # the four kept ones at A/n instead of A; plus, once, the largest transient: an A-byte copy — ln1's or ln2's
    # output all-gathered for its readers, or proj's or fc2's output gradient all-gathered back from
    # the sequence split (one at a time; the reduce-scatters run in place)
    budget = activations + params - 4 * (1 - 1 / n) * a + a
    sp = intra.shard_stage(graph, row_mesh(n, BW), ops, backend="highs", microbatches=mb, memory_budget=budget,
                           allow_zero=False)
    q = by_op(sp)
    for name in replicated:
        assert q[f"l1.{name}"].axes == (None, "s") and q[f"l1.{name}"].output == (R, Shard("s")), name
    for name in ("l1.q", "l1.k", "l1.v", "l1.proj"):
        assert q[name].axes == (None, "n"), name
    assert q["l1.x_t"].axes == (None, None)
    assert q["l1.fc1"].axes == (None, "f") and q["l1.fc2"].axes == (None, "f")
    assert sp.memory_bytes == pytest.approx(budget, rel=1e-12)
    assert sp.breakdown.transient_bytes == pytest.approx(a, rel=1e-12) and tp.breakdown.transient_bytes == 0
    assert sp.breakdown.comm_s == {"all_gather": pytest.approx(4 * all_gather(a, n), rel=1e-12),
                                   "reduce_scatter": pytest.approx(4 * reduce_scatter(a, n), rel=1e-12)}
    ln1 = next(c for c in sp.ops if c.op == "l1.ln1")
    assert sorted(k for k, _, _ in ln1.collectives) == ["all_gather", "reduce_scatter"]  # once each, not per reader
    sync = 6 * gradient_all_reduce(h * FP16, n)  # ln1/ln2 scale and shift, proj and fc2 biases
    assert sp.breakdown.sync_s == {"all_reduce": pytest.approx(sync, rel=1e-12)}

    # by hand: the six split ops save (1 - 1/n) of their compute (training = 2 x forward; layernorm
    # 8 FLOP per element, an add 1); SP pays 4 more launches and the per-iteration syncs
    saved = (1 - 1 / n) * 2 * (2 * 8 + 4) * b * s * h / PEAK
    extra = 4 * (all_gather(a, n) + reduce_scatter(a, n) - all_reduce(a, n)) + sync / mb
    assert sp.objective - tp.objective == pytest.approx(extra - saved, rel=1e-6)
    assert extra > saved  # so without a budget the all-reduce form wins, as found
