"""evaluate(): a plan priced as written, Megatron-style uniform plans, and invalid plans."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt import costmodel, io, models
from partopt.cli import main
from partopt.cluster import preset
from partopt.errors import InfeasibleError, InstanceError
from partopt.evaluate import batch_dims, evaluate, uniform
from partopt.export import megatron_config
from partopt.inter import optimize
from partopt.plan import ParamPlacement, read_plan, write_plan
from partopt.sharding import R

INSTANCES = Path(__file__).parent.parent / "instances"


@pytest.fixture(scope="module")
def small_gpt():
    return models.gpt(hidden=256, layers=8, heads=4, seq=128, vocab=1024, batch=64)


@pytest.mark.parametrize("nodes,search", [(2, {}), (1, {"inter_only": True}), (2, {"layers": 2}),
                                          (1, {"recompute": True})])
def test_evaluating_a_solved_plan_reproduces_its_iteration_time(small_gpt, tmp_path, nodes, search):
    cluster = preset("p3.16xlarge", nodes)
    plan = optimize(small_gpt, cluster, microbatches=8, **search)
    write_plan(plan, tmp_path / "plan.json")
    again = evaluate(small_gpt, cluster, read_plan(tmp_path / "plan.json"))
    assert again.iteration_time_s == plan.iteration_time_s
    assert [s.stage_time_s for s in again.stages] == [s.stage_time_s for s in plan.stages]
    assert [s.memory_bytes for s in again.stages] == [s.memory_bytes for s in plan.stages]
    assert [s.ops for s in again.stages] == [s.ops for s in plan.stages]
    groups = len(plan.stages) // plan.virtual_stages  # interleaved: chunk j runs on group j mod S, which holds them all
    for j, s in enumerate(plan.stages):
        b = s.breakdown
        held = [c.breakdown for c in plan.stages[j % groups::groups]]
        assert s.memory_bytes == pytest.approx(sum(c["param_bytes"] for c in held) + s.inflight_microbatches
                                               * sum(c["activation_bytes"] for c in held)
                                               + max(c["working_bytes"] for c in held), rel=1e-12)
        # held once: recomputation's working set (with recompute) and the largest transient buffer
        assert b["working_bytes"] > 0 if search.get("recompute") else b["working_bytes"] >= 0


def _mlp_data_parallel_by_hand(graph, n: int, state_per_param: int = 16, overlap: bool = False,
                               grad_word: int | None = None) -> float:
    """One iteration of the 2-layer MLP data parallel over n NVLink devices of a p3 node, B = 1.

    Each op computes 1/n of the batch with replicated weights (roofline over its FLOPs and the bytes
    it moves, forward + backward); once per iteration each weight gradient, of `grad_word` bytes per element
    (default: the graph's dtype), is all-reduced over the n devices (bucketed) and the optimizer reads and writes
    its state (Adam: 16 B/param).
    With `overlap`, layer 1's reduction (R1) runs during layer 0's backward (B0) and layer 0's (R0)
    after it: R0 + max(0, R1 − B0) stays exposed (docs/COSTMODEL.md §5b).
    """
    cluster = preset("p3.16xlarge", 1)
    dev, link = cluster.device, cluster.intra_node
    grad_word = costmodel.DTYPE_BYTES[graph.dtype] if grad_word is None else grad_word
    times = _mlp_op_times(graph, n)
    compute = sum(t for _, t, _ in times)
    params = _mlp_params(graph)
    # gradients are all-reduced in buckets: only the bandwidth terms count
    reduce = {layer: sum(2 * (n - 1) / n * grad_word * p / link.bandwidth for p in ps) for layer, ps in params.items()}
    optimizer = sum(costmodel.compute_time(0.0, 2 * state_per_param * p, dev, "fp32", False)
                    for ps in params.values() for p in ps)
    if not overlap:
        return compute + reduce[0] + reduce[1] + optimizer
    backward0 = sum(t * share for layer, t, share in times if layer == 0)  # a GEMM's: 2 of 3; the rest: its bytes'
    return compute + reduce[0] + max(0.0, reduce[1] - backward0) + optimizer


def _mlp_params(graph) -> dict[int, list[int]]:
    """Per layer of the 2-layer MLP, its parameters' sizes: the weight and the bias."""
    h, f = graph.dims["h"], graph.dims["f"]
    return {0: [h * f, f], 1: [f * h, h]}


def _mlp_op_times(graph, n: int) -> list[tuple[int, float, float]]:
    """Per op of the 2-layer MLP data parallel over n devices of a p3 node: (layer, roofline seconds forward +
    backward, the backward's share of them)."""
    dev = preset("p3.16xlarge", 1).device
    b, h, f = (graph.dims[d] for d in ("b", "h", "f"))
    word = costmodel.DTYPE_BYTES[graph.dtype]
    act, out = word * b * f / n, word * b * h / n  # one device's fc1 and fc2 outputs
    ops = [  # (layer, training FLOPs, bytes read + written by one device: forward, backward; matmul)
        # a GEMM's backward is two GEMMs, each reading the output gradient and one operand, writing one gradient
        (0, 3 * 2 * b * h * f / n, word * (b * h / n + h * f) + act, 2 * (word * (b * h / n + h * f) + act), True),
        # the bias add hands the gradient on to h1; b1's gradient reduces it (read it, write f)
        (0, 2 * b * f / n, act + word * f + act, act + word * f, False),  # bias1
        (0, 2 * b * f / n, act + act, 3 * act, False),  # act1 (gelu): reads its input and the gradient, writes one
        (1, 3 * 2 * b * f * h / n, act + word * f * h + out, 2 * (act + word * f * h + out), True),  # fc2
        (1, 2 * b * h / n, out + word * h + out, out + word * h, False),  # bias2
    ]
    return [(layer, costmodel.compute_time(fl, fw + bw, dev, graph.dtype, mm), bw / (fw + bw))
            for layer, fl, fw, bw, mm in ops]


@pytest.mark.parametrize("overlap", [False, True])
def test_uniform_pure_data_parallel_equals_the_hand_formula(overlap):
    graph = io.read_graph(INSTANCES / "mlp-2layer.json")
    plan = uniform(graph, preset("p3.16xlarge", 1), tp=1, pp=1, dp=8, microbatches=1, overlap=overlap)
    assert plan.iteration_time_s == pytest.approx(_mlp_data_parallel_by_hand(graph, 8, overlap=overlap), rel=1e-9)
    stage = plan.stages[0]
    assert stage.logical_mesh == [8, 1] and stage.submesh == [1, 8]
    assert all(entry.axes[0] == "b" for entry in stage.ops.values())
    assert all(p == ParamPlacement((R, R), ()) for p in stage.params.values())


def test_zero_under_overlap_gathers_the_updated_weights_under_the_next_forward():
    """The MLP data parallel over 8 devices with its optimizer state split (ZeRO): each layer's gradients are
    reduce-scattered (R) and its updated weights all-gathered (G), (n − 1)/n of their bytes each over NVLink. Additive,
    all four are paid. Under overlap, Megatron-LM's --overlap-grad-reduce and --overlap-param-gather: R1 runs under
    layer 0's backward B0 and R0 after it; G0 waits before the next forward and G1 runs under layer 0's forward F0
    (docs/COSTMODEL.md §5b): R0 + max(0, R1 − B0) + G0 + max(0, G1 − F0) stay exposed."""
    graph = io.read_graph(INSTANCES / "mlp-2layer.json")
    cluster, n = preset("p3.16xlarge", 1), 8
    word = costmodel.DTYPE_BYTES[graph.dtype]
    times = _mlp_op_times(graph, n)
    compute = sum(t for _, t, _ in times)
    forward0 = sum(t * (1 - share) for layer, t, share in times if layer == 0)
    backward0 = sum(t * share for layer, t, share in times if layer == 0)
    ring = {layer: (n - 1) / n * word * sum(ps) / cluster.intra_node.bandwidth
            for layer, ps in _mlp_params(graph).items()}  # a reduce-scatter and an all-gather move the same
    plans = {overlap: uniform(graph, cluster, tp=1, pp=1, dp=n, microbatches=1, zero=True, overlap=overlap)
             for overlap in (False, True)}
    optimizer = plans[False].stages[0].breakdown["optimizer_s"]
    assert plans[True].stages[0].breakdown["optimizer_s"] == optimizer
    assert plans[False].iteration_time_s == pytest.approx(compute + 2 * (ring[0] + ring[1]) + optimizer, rel=1e-9)
    exposed = ring[0] + max(0.0, ring[1] - backward0) + ring[0] + max(0.0, ring[1] - forward0)
    assert plans[True].iteration_time_s == pytest.approx(compute + exposed + optimizer, rel=1e-9)
    assert 0 < ring[1] < forward0  # the case: layer 1's gather hides in full under layer 0's forward


@pytest.mark.parametrize("optimizer, state_per_param", [("sgd", 4 + 4 + 4), ("adafactor", 4 + 4)])
def test_the_optimizer_sets_state_bytes_and_step_time(optimizer, state_per_param):
    # fp32 weights and grads, plus SGD's momentum buffer or (Adafactor) nothing but factored moments
    graph = dataclasses.replace(io.read_graph(INSTANCES / "mlp-2layer.json"), optimizer=optimizer)
    plan = uniform(graph, preset("p3.16xlarge", 1), tp=1, pp=1, dp=8, microbatches=1, overlap=False)
    assert plan.iteration_time_s == pytest.approx(_mlp_data_parallel_by_hand(graph, 8, state_per_param), rel=1e-9)
    assert plan.stages[0].breakdown["param_bytes"] == pytest.approx(graph.num_params * state_per_param)


@pytest.mark.parametrize("dtype, layout, state_per_param, grad_word", [
    ("bf16", "zero", 2 + 2 + 12, 2),  # the ZeRO paper's mixed-precision Adam
    ("bf16", "megatron", 2 + 4 + 12, 4),  # Megatron-LM: bf16 gradients accumulate and all-reduce in fp32 (18 B)
    ("fp16", "megatron", 2 + 2 + 16, 2),  # Megatron-LM: fp16 gradients, copied to fp32 main gradients (20 B)
    ("fp32", "megatron", 4 + 4 + 8, 4),  # fp32: no copies (16 B), as in Megatron-LM's table
])
def test_the_state_layout_sets_state_bytes_and_the_gradient_all_reduce(dtype, layout, state_per_param, grad_word):
    """Megatron-LM's bytes per parameter (docs/user-guide/features/dist_optimizer.md: 20, 18 and 16 without the
    distributed optimizer) and the dtype its gradients are all-reduced in, against the hand formula."""
    graph = dataclasses.replace(io.read_graph(INSTANCES / "mlp-2layer.json"), dtype=dtype)
    plan = uniform(graph, preset("p3.16xlarge", 1), tp=1, pp=1, dp=8, microbatches=1, overlap=False,
                   state_layout=layout)
    assert plan.stages[0].breakdown["param_bytes"] == pytest.approx(graph.num_params * state_per_param)
    assert plan.iteration_time_s == pytest.approx(
        _mlp_data_parallel_by_hand(graph, 8, state_per_param, grad_word=grad_word), rel=1e-9)


@pytest.mark.parametrize("dtype, layout, whole, split", [
    ("fp16", "megatron", 4, 16), ("bf16", "megatron", 6, 12), ("fp32", "megatron", 8, 8), ("bf16", "zero", 4, 12)])
def test_the_distributed_optimizer_splits_what_megatron_lm_says_it_splits(dtype, layout, whole, split):
    """With the distributed optimizer over d ranks, Megatron-LM's table gives 4 + 16/d (fp16), 6 + 12/d (bf16) and
    8 + 8/d (fp32) bytes per parameter; the ZeRO paper 4 + 12/d."""
    graph = dataclasses.replace(io.read_graph(INSTANCES / "mlp-2layer.json"), dtype=dtype)
    plan = uniform(graph, preset("p3.16xlarge", 1), tp=1, pp=1, dp=8, microbatches=1, zero=True, state_layout=layout)
    assert plan.stages[0].breakdown["param_bytes"] == pytest.approx(graph.num_params * (whole + split / 8))
    assert plan.options.get("state_layout") == (None if layout == "zero" else layout)


def test_uniform_zero_shards_optimizer_state_over_data_parallel_ranks():
    graph = io.read_graph(INSTANCES / "mlp-2layer.json")
    cluster = preset("p3.16xlarge", 1)
    plain = uniform(graph, cluster, tp=1, pp=1, dp=8, microbatches=1)
    zero = uniform(graph, cluster, tp=1, pp=1, dp=8, microbatches=1, zero=True)
    assert all(p.zero_axes == (0,) for p in zero.stages[0].params.values())
    # weights + grads stay whole (8 B/param of fp32), Adam's m and v (8 B/param) are split 8 ways
    saved = sum(graph.numel(t.name) for t in graph.params) * 8 * (1 - 1 / 8)
    assert plain.stages[0].breakdown["param_bytes"] - zero.stages[0].breakdown["param_bytes"] == pytest.approx(saved)


def test_uniform_tensor_parallel_keeps_the_batch_off_the_tensor_axis(small_gpt):
    plan = uniform(small_gpt, preset("p3.16xlarge", 1), tp=4, pp=2, dp=1, microbatches=8)
    assert [s.layers for s in plan.stages] == [[0, 3], [4, 7]]
    assert [s.logical_mesh for s in plan.stages] == [[1, 4], [1, 4]]
    assert all(entry.axes[1] != "b" for s in plan.stages for entry in s.ops.values())
    assert [s.inflight_microbatches for s in plan.stages] == [2, 1]


COLLECTIVE = re.compile(r"(all-reduce|reduce-scatter|all-gather|all-to-all) ([\d.]+ [KMG]?i?B) on axis 1")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_uniform_tensor_parallelism_is_megatrons_layout(small_gpt, sequence_parallel):
    """Megatron-LM's tensor parallelism (Shoeybi et al. 2019, Fig. 3): attention splits its heads and the MLP its
    hidden units, so a layer moves its microbatch's activation b·s·h four times: an all-reduce after the
    row-parallel proj and fc2 forward, and one of each norm's output gradient backward; norms and residual adds
    run on every rank. With sequence parallelism (Korthikanti et al. 2022, Fig. 5) each all-reduce becomes a
    reduce-scatter and an all-gather of the same tensor, and the norms and residual adds split the sequence."""
    plan = uniform(small_gpt, preset("p3.16xlarge", 1), tp=4, pp=2, dp=1, microbatches=8,
                   sequence_parallel=sequence_parallel, recompute="none")
    ops = {name.split(".", 1)[1]: entry for name, entry in plan.stages[0].ops.items() if name.startswith("l1.")}
    moved = {name: sorted(COLLECTIVE.findall(entry.explanation)) for name, entry in ops.items()
             if COLLECTIVE.search(entry.explanation)}
    activation = "512 KiB"  # b·s·h·2 bytes: 8 sequences (64 over 8 microbatches) · 128 · 256 · 2
    each = [("all-gather", activation), ("reduce-scatter", activation)] if sequence_parallel else \
        [("all-reduce", activation)]
    assert moved == {name: each for name in ("ln1", "proj", "ln2", "fc2")}
    stream = "s" if sequence_parallel else None
    stream_ops = ("ln1", "res1", "ln2", "res2")
    assert {name: ops[name].axes[1] for name in stream_ops} == dict.fromkeys(stream_ops, stream)
    assert {name: ops[name].axes[1] for name in ("q", "k", "v", "proj", "fc1", "fc2")} == \
        {"q": "n", "k": "n", "v": "n", "proj": "n", "fc1": "f", "fc2": "f"}


def test_a_vocabulary_tensor_parallelism_cannot_split_runs_whole_on_every_rank():
    """GPT-2's 50,257 tokens do not split 2 ways (Megatron-LM pads the table to a multiple of 128 · tp): the embedding
    and the head run whole on every tensor-parallel rank, an upper bound, while the layers keep Megatron's split."""
    graph = models.gpt(hidden=256, layers=4, heads=4, seq=128, vocab=50257, batch=16)
    plan = uniform(graph, preset("p3.16xlarge", 1), tp=2, pp=1, dp=4, microbatches=2)
    axes = {name: entry.axes[1] for name, entry in plan.stages[0].ops.items()}
    assert axes["embed.tokens"] is None and axes["head.logits"] is None
    assert (axes["l0.q"], axes["l0.fc1"]) == ("n", "f")


def test_data_parallelism_follows_the_batch_through_reshapes():
    """An MoE layer carries its batch through reshapes, each time as the outer part: (b, s) -> bs, bs -> (g, gs), and
    back. The data-parallel axis splits whichever of them an op has (before, the flatten had no strategy at all)."""
    graph = io.read_graph(INSTANCES / "moe-layer.json")
    assert batch_dims(graph) == {"b", "bs", "g"}
    plan = uniform(graph, preset("p3.16xlarge", 1), tp=2, pp=1, dp=4)
    assert {entry.axes[0] for entry in plan.stages[0].ops.values()} == {"b", "bs", "g"}


def test_uniform_expert_parallelism_places_the_experts_over_the_data_parallel_ranks(tmp_path):
    """expert_parallel = dp, Megatron-LM's --expert-model-parallel-size: the ops that run the experts (fc1, the
    activation, fc2) split e over axis 0, each rank keeping its 4 / 2 = 2 experts' weights whole with their optimizer
    state, and axis 1 splits each expert's hidden units (expert tensor parallelism of tp, Megatron-LM's default);
    the router, the dispatch and the combine stay data parallel, the router's weight whole. Refused: another degree
    than dp, a graph without experts, experts that dp does not divide, tensor parallelism without sequence
    parallelism (Megatron-LM's MoE layer raises). `partopt check` prices it again alike; `partopt evaluate
    --expert-parallel` says it."""
    from partopt import check
    from partopt.evaluate import expert_ops
    from partopt.sharding import Shard

    graph = models.moe(hidden=256, layers=2, heads=4, experts=4, seq=128, vocab=1024, batch=16, group_size=128)
    assert expert_ops(graph) == {"l1.fc1": "e", "l1.relu": "e", "l1.fc2": "e"}
    cluster = preset("dgx-a100", 1).narrowed(4)
    plan = uniform(graph, cluster, 2, 1, 2, microbatches=2, sequence_parallel=True, zero=True, expert_parallel=2)
    stage = plan.stages[0]
    assert {name: stage.ops[f"l1.{name}"].axes for name in ("gate", "dispatch", "fc1", "relu", "fc2", "combine")} == {
        "gate": ("g", None), "dispatch": ("g", None), "fc1": ("e", "f"), "relu": ("e", "f"), "fc2": ("e", "f"),
        "combine": ("g", None)}
    assert {name: stage.params[f"l1.{name}"] for name in ("wg", "fc1.w", "fc2.w")} == {
        "wg": ParamPlacement((R, R), (0,)), "fc1.w": ParamPlacement((Shard("e"), Shard("f"))),
        "fc2.w": ParamPlacement((Shard("e"), Shard("f")))}
    assert plan.options["megatron"]["expert_parallel"] == 2 and check.differences(plan, graph, cluster) == []
    io.write_graph(graph, tmp_path / "moe.json")
    result = CliRunner().invoke(main, ["evaluate", str(tmp_path / "moe.json"), "--cluster", "dgx-a100", "--nodes", "1",
                                       "--tp", "2", "--pp", "1", "--dp", "4", "--microbatches", "2",
                                       "--sequence-parallel", "--expert-parallel", "4"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "experts split over the 4 data-parallel ranks (--expert-model-parallel-size)" in result.stdout
    with pytest.raises(InstanceError, match="expert parallelism 2 is not the data-parallel degree 4"):
        uniform(graph, cluster, 1, 1, 4, microbatches=2, expert_parallel=2)
    with pytest.raises(InstanceError, match="the graph has no experts"):
        uniform(models.gpt(hidden=256, layers=2, heads=4, seq=128, vocab=1024, batch=16), cluster, 1, 1, 4,
                expert_parallel=4)
    with pytest.raises(InstanceError, match=r"2 experts \(e\) do not split over 4 data-parallel ranks"):
        uniform(models.moe(hidden=256, layers=2, heads=4, experts=2, seq=128, vocab=1024, batch=16,
                           group_size=128), cluster, 1, 1, 4, expert_parallel=4)
    with pytest.raises(InstanceError, match="trains only with sequence parallelism"):
        uniform(graph, cluster, 2, 1, 2, microbatches=2, expert_parallel=2)


def test_sequence_parallel_splits_every_norm_along_the_sequence_on_the_tensor_axis(small_gpt):
    """Megatron-LM's --sequence-parallel: the layernorms of (b, s, h) split s over the tensor-parallel
    axis, and the plan says so to `check` and to the Megatron export."""
    from partopt import check
    from partopt.export import to_megatron

    cluster = preset("p3.16xlarge", 1)
    sp = uniform(small_gpt, cluster, tp=4, pp=2, dp=1, microbatches=8, sequence_parallel=True, recompute="none")
    norms = [entry for s in sp.stages for entry in s.ops.values() if entry.kind == "layernorm"]
    assert norms and all(entry.axes[1] == "s" for entry in norms)
    assert sp.options["megatron"]["sequence_parallel"] is True
    assert "--sequence-parallel" in to_megatron(sp)
    assert check.differences(sp, small_gpt, cluster) == []


def test_full_search_is_at_least_as_fast_as_every_uniform_plan(small_gpt):
    cluster = preset("p3.16xlarge", 1)
    best = optimize(small_gpt, cluster, microbatches=8)
    for tp, pp, dp in [(1, 1, 8), (8, 1, 1), (2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 4, 1), (1, 8, 1)]:
        assert best.iteration_time_s <= uniform(small_gpt, cluster, tp, pp, dp, 8).iteration_time_s * (1 + 1e-12)


# ---------------------------------------------------------------- invalid plans

@pytest.fixture(scope="module")
def solved(small_gpt):
    cluster = preset("p3.16xlarge", 1)
    return optimize(small_gpt, cluster, microbatches=8, inter_only=True), cluster


def test_layers_not_covered_are_reported(small_gpt, solved):
    plan, cluster = solved
    broken = dataclasses.replace(plan, stages=plan.stages[:1] + plan.stages[2:])
    with pytest.raises(InstanceError, match=r"stage 1 covers layers \[\d, \d\] but the next uncovered layer is 1"):
        evaluate(small_gpt, cluster, broken)


def test_a_submesh_larger_than_the_cluster_is_reported(small_gpt, solved):
    plan, cluster = solved
    stage = dataclasses.replace(plan.stages[0], submesh=[2, 8], logical_mesh=[16, 1])
    with pytest.raises(InfeasibleError, match=r"submesh \(2, 8\) is not a submesh of 1 × 8"):
        evaluate(small_gpt, cluster, dataclasses.replace(plan, stages=[stage] + plan.stages[1:]))


def test_a_split_that_does_not_divide_its_dim_names_the_op(small_gpt, solved):
    plan, cluster = solved
    whole = optimize(small_gpt, cluster, microbatches=8, intra_only=True)  # one stage on all 8 devices
    stage = whole.stages[0]
    assert stage.logical_mesh in ([8, 1], [1, 8], [4, 2], [2, 4])
    ops = {**stage.ops, "l0.scores": dataclasses.replace(stage.ops["l0.scores"], axes=("n", "n"))}
    mesh = stage.logical_mesh  # 4 heads cannot split 8 ways
    with pytest.raises(InfeasibleError, match=r"l0.scores has no strategy allowed by the plan"):
        evaluate(small_gpt, cluster, dataclasses.replace(whole, stages=[dataclasses.replace(stage, ops=ops)]))
    assert mesh[0] * mesh[1] == 8


def test_a_stage_over_its_memory_says_by_how_much(small_gpt):
    cluster = preset("p3.16xlarge", 1)
    plan = optimize(small_gpt, cluster, microbatches=8)
    with pytest.raises(InfeasibleError, match=r"stage 0 needs .* over the budget .* by "):
        evaluate(small_gpt, cluster, plan, memory_reserve=0.99999)


def test_an_interleaved_stage_over_its_memory_adds_up_the_chunks_its_devices_hold(small_gpt):
    """The message's parts are the device group's: parameter state and kept activations summed over its
    chunks, the largest working set; they add up to the total it reports (fmt_bytes keeps 3 digits)."""
    cluster = preset("p3.16xlarge", 1)
    kwargs = dict(schedule="interleaved", virtual_stages=2, recompute="none")
    need = uniform(small_gpt, cluster, 1, 2, 4, 8, **kwargs).stages[0].memory_bytes
    tight = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=need / 2 / 0.9))
    with pytest.raises(InfeasibleError) as err:
        uniform(small_gpt, tight, 1, 2, 4, 8, **kwargs)
    text = str(err.value)
    assert "its devices holding 2 chunks" in text
    found = re.search(r"needs (.+?) per device \(parameter state (.+?) \+ ([\d.]+) × (.+?) activations "
                      r"\+ (.+?) working set", text)
    total, param, inflight, kept, working = (_bytes(x) if i != 2 else float(x) for i, x in enumerate(found.groups()))
    assert param + inflight * kept + working == pytest.approx(total, rel=1e-2)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2)])
def test_the_memory_check_refuses_exactly_the_plans_over_the_budget(small_gpt, schedule, v):
    """Pricing stops at the first device group over the budget (`price` checks each as soon as it is priced): a
    plan evaluated with its own peak as the budget is priced whole and alike, and a hair under it is refused at the
    first stage holding that peak, as the assembled plan's memory says."""
    cluster = preset("p3.16xlarge", 1)
    plan = uniform(small_gpt, cluster, 1, 2, 4, 8, schedule=schedule, virtual_stages=v, recompute="none")
    peak = plan.memory_peak_bytes
    first = next(i for i, stage in enumerate(plan.stages) if stage.memory_bytes == peak)
    memory = cluster.device.memory_bytes
    again = evaluate(small_gpt, cluster, plan, memory_reserve=1 - peak / memory * (1 + 1e-12))
    assert again.iteration_time_s == plan.iteration_time_s
    with pytest.raises(InfeasibleError) as err:
        evaluate(small_gpt, cluster, plan, memory_reserve=1 - peak / memory * (1 - 1e-9))
    assert err.value.where == f"plan.stages[{first}]" and err.value.cause.startswith(f"stage {first} needs ")


@pytest.mark.parametrize("tp, pp, dp, v", [(1, 2, 4, 1), (1, 2, 4, 2), (2, 4, 1, 2), (8, 1, 1, 1)])
def test_uniform_prices_no_count_that_cannot_beat_its_bar(small_gpt, tp, pp, dp, v):
    """`uniform`'s lower bound (the schedule's closed form at each device group's layers' least times) is under the
    plan of every recomputation mode and over half the fastest: given a bar at the bound, nothing is priced (None); a
    hair above it, the plan is priced as without a bar."""
    import math

    from partopt.evaluate import _least_pipeline, _megatron, _stage_ranges
    from partopt.intra import with_batch
    from partopt.layering import build_layers
    from partopt.options import Options

    cluster = preset("p3.16xlarge", 1)
    count, schedule = 8, "interleaved" if v > 1 else "1f1b"
    layering = build_layers(small_gpt, None)
    restriction = _megatron(with_batch(small_gpt, 64 // count), tp, dp, False)
    submesh = (1, tp * dp)
    floor = _least_pipeline(small_gpt, cluster, layering, _stage_ranges(len(layering.groups), pp, v, None, ""), pp,
                            count, (submesh, (dp, tp)), restriction, Options(layers=None), {})
    plans = {mode: uniform(small_gpt, cluster, tp, pp, dp, count, recompute=mode, schedule=schedule, virtual_stages=v)
             for mode in ("none", "selective", "full")}
    assert 0.5 * plans["none"].iteration_time_s < floor <= min(p.iteration_time_s for p in plans.values())
    assert uniform(small_gpt, cluster, tp, pp, dp, count, schedule=schedule, virtual_stages=v, bar=floor) is None
    above = uniform(small_gpt, cluster, tp, pp, dp, count, schedule=schedule, virtual_stages=v,
                    bar=math.nextafter(floor, math.inf))
    assert above.iteration_time_s == uniform(small_gpt, cluster, tp, pp, dp, count, schedule=schedule,
                                             virtual_stages=v).iteration_time_s
    if v == 1:  # ZB-H1's weight passes lower its closed form under 1F1B's: the bar does not bound it
        zero_bubble = uniform(small_gpt, cluster, tp, pp, dp, count, schedule="zero-bubble", bar=floor)
        assert zero_bubble is not None


def _bytes(text: str) -> float:
    """'1.5 KiB' -> 1536.0 (fmt_bytes's form)."""
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


@pytest.mark.parametrize("room", [1.0005, 1.05, 1.2])
def test_a_stage_with_room_for_every_layers_fastest_strategy_is_priced_at_them(room):
    """A uniform plan's stage fits the budget with each layer at its fastest strategy within the budget: evaluate
    prices it so, whatever the budget above that stage's memory. The ladder's even share (budget / rung of the
    stage's layers) binds the larger layer here, so fitting the layers to it first priced the stage slower, and
    the slower the less room: 14.8 % slower at 1.0005 and 1.05, 6.1 % at 1.2."""
    graph = models.gpt(hidden=512, layers=2, heads=8, seq=256, vocab=8192, batch=16)
    cluster = preset("p3.16xlarge", 1).narrowed(4)
    fastest = uniform(graph, cluster, 4, 1, 1, 1, recompute="none")
    need = fastest.stages[0].memory_bytes
    device = dataclasses.replace(cluster.device, memory_bytes=need * room / (1 - costmodel.DEFAULT_MEMORY_RESERVE))
    tight = dataclasses.replace(cluster, device=device)
    budget = costmodel.memory_budget(device)
    plan = uniform(graph, tight, 4, 1, 1, 1, recompute="none")
    assert plan.iteration_time_s == fastest.iteration_time_s
    assert plan.stages[0].memory_bytes == need <= budget


def test_an_interleaved_chunk_takes_the_fastest_strategies_priced_within_the_whole_budget_when_they_fit_its_share(
        small_gpt):
    """A device of pp 2 · v 2 holds two chunks, each priced within half the budget. Where the 1F1B plan of the same
    layout priced a layer's fastest strategy within the whole budget (one cache) and it fits half, it is the fastest
    within half too: the interleaved plan then solves no ILP of its own and prices exactly as with a cache of its
    own (ample memory: every layer fits)."""
    cluster = preset("p3.16xlarge", 1).narrowed(4)
    kwargs = dict(zero=True, recompute="none", schedule="interleaved", virtual_stages=2)
    alone = uniform(small_gpt, cluster, 1, 2, 2, 8, **kwargs)
    cache = {}
    uniform(small_gpt, cluster, 1, 2, 2, 8, zero=True, recompute="none", cache=cache)
    shared = uniform(small_gpt, cluster, 1, 2, 2, 8, cache=cache, **kwargs)
    assert alone.solver["ilps"] > 0 and shared.solver["ilps"] == 0
    assert shared.iteration_time_s == alone.iteration_time_s


def test_a_run_known_to_fit_is_priced_as_run_whatever_memory_the_model_gives_it():
    """`uniform(check_memory=False)` (a calibration point's `check_memory: false`): a stage the memory model puts at
    twice the device's memory is priced as on a device with room for it, each layer at its fastest strategy, where the
    default check refuses it."""
    graph = models.gpt(hidden=512, layers=2, heads=8, seq=256, vocab=8192, batch=16)
    cluster = preset("p3.16xlarge", 1).narrowed(4)
    roomy = uniform(graph, cluster, 4, 1, 1, 1, recompute="none")
    need = roomy.stages[0].memory_bytes
    small = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=need / 2))
    with pytest.raises(InfeasibleError, match="over the budget"):
        uniform(graph, small, 4, 1, 1, 1, recompute="none")
    as_run = uniform(graph, small, 4, 1, 1, 1, recompute="none", check_memory=False)
    assert as_run.iteration_time_s == roomy.iteration_time_s
    assert as_run.stages[0].memory_bytes == need > costmodel.memory_budget(small.device)


def test_uniform_degrees_must_multiply_to_the_cluster_and_divide_the_layers(small_gpt):
    cluster = preset("p3.16xlarge", 1)
    with pytest.raises(InfeasibleError, match="tp × pp × dp = 16 but the cluster has 8 devices"):
        uniform(small_gpt, cluster, tp=2, pp=2, dp=4)
    with pytest.raises(InfeasibleError, match="8 layers do not split into 16 equal stages"):
        uniform(small_gpt, preset("p3.16xlarge", 2), tp=1, pp=16, dp=1)


def test_evaluate_cli_prints_the_plan_and_refuses_mixed_arguments(tmp_path):
    graph = str(INSTANCES / "mlp-2layer.json")
    out = tmp_path / "plan.json"
    solved = CliRunner().invoke(main, ["solve", graph, "--cluster", "p3.16xlarge", "--nodes", "1",
                                       "--microbatches", "2", "-o", str(out)])
    assert solved.exit_code == 0, solved.output
    result = CliRunner().invoke(main, ["evaluate", graph, "--cluster", "p3.16xlarge", "--nodes", "1",
                                       "--plan", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["iteration_time_s"] == read_plan(out).iteration_time_s
    mixed = CliRunner().invoke(main, ["evaluate", graph, "--cluster", "p3.16xlarge", "--plan", str(out), "--tp", "2"])
    assert mixed.exit_code == 2 and "give either --plan FILE or --tp and --pp" in mixed.stderr


def test_evaluate_cli_derives_the_data_parallel_degree_as_megatron_does():
    """--dp defaults to the devices / (tp × pp): 8 V100s at tp 2, pp 2 are dp 2; tp 3 divides no 8."""
    graph = str(INSTANCES / "mlp-2layer.json")
    args = ["evaluate", graph, "--cluster", "p3.16xlarge", "--nodes", "1", "--microbatches", "2", "--json"]
    implied = CliRunner().invoke(main, [*args, "--tp", "2", "--pp", "2"])
    given = CliRunner().invoke(main, [*args, "--tp", "2", "--pp", "2", "--dp", "2"])
    assert implied.exit_code == 0, implied.output
    assert json.loads(implied.stdout) == json.loads(given.stdout)
    assert json.loads(implied.stdout)["options"]["megatron"]["dp"] == 2
    odd = CliRunner().invoke(main, [*args, "--tp", "3", "--pp", "1"])
    assert odd.exit_code == 2 and "--dp: tp × pp = 3 does not divide the cluster's 8 devices" in odd.stderr


@pytest.mark.parametrize("flags, says", [
    ([], "norms and residual adds on every tensor-parallel rank (no --sequence-parallel)"),
    (["--sequence-parallel", "--zero"], "split along the sequence (--sequence-parallel); optimizer state split")])
def test_evaluate_cli_says_which_megatron_layout_it_priced(flags, says):
    result = CliRunner().invoke(main, ["evaluate", str(INSTANCES / "mlp-2layer.json"), "--cluster", "p3.16xlarge",
                                       "--nodes", "1", "--tp", "2", "--pp", "1", "--dp", "4", *flags],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "Megatron-LM's: tp 2 × pp 1 × dp 4" in result.stdout and says in result.stdout


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (4, 2, 1)])
def test_megatron_arguments_re_read_into_a_uniform_plan_evaluate_to_the_same_time(tp, pp, dp):
    """A Megatron-style plan, exported as Megatron-LM arguments and read back, prices the same. Its norms split the
    sequence on every stage (--sequence-parallel): left to the ILP, a stage may split some and not others, which
    Megatron-LM cannot run (`NotExpressibleError`)."""
    graph = models.gpt(hidden=2048, layers=4, heads=16, seq=1024, vocab=1024, batch=16)  # big enough for tensor parallelism
    cluster = preset("p3.16xlarge", 1)
    plan = uniform(graph, cluster, tp, pp, dp, microbatches=8, sequence_parallel=True)
    config = megatron_config(plan)
    assert (config["tp"], config["pp"], config["dp"], config["num_microbatches"]) == (tp, pp, dp, 8)
    assert config["micro_batch_size"] * dp * config["num_microbatches"] == config["global_batch_size"] == 16
    assert config["sequence_parallel"]
    again = uniform(graph, cluster, config["tp"], config["pp"], config["dp"], config["num_microbatches"],
                    zero=config["distributed_optimizer"], sequence_parallel=config["sequence_parallel"])
    assert again.iteration_time_s == plan.iteration_time_s


def test_a_plan_evaluates_on_its_graph_under_another_name_but_not_on_another_graph(small_gpt, tmp_path):
    cluster = preset("p3.16xlarge", 1)
    plan = optimize(small_gpt, cluster, microbatches=8)
    write_plan(plan, tmp_path / "plan.json")
    renamed = dataclasses.replace(small_gpt, name="my-copy")  # the same graph saved under another name
    again = evaluate(renamed, cluster, read_plan(tmp_path / "plan.json"))
    assert again.iteration_time_s == plan.iteration_time_s
    wider = models.gpt(hidden=512, layers=8, heads=4, seq=128, vocab=1024, batch=64)  # same tensor names, other sizes
    other = dataclasses.replace(wider, name="my-copy")
    with pytest.raises(InstanceError, match="made for graph .* its tensors differ"):
        evaluate(other, cluster, read_plan(tmp_path / "plan.json"))
    plan.tensors = {}  # a hand-written plan without its tensor table: the names must agree
    with pytest.raises(InstanceError, match="made for graph"):
        evaluate(renamed, cluster, plan)


def test_uniform_searches_the_microbatch_count_when_none_is_given(small_gpt):
    """Users tune the microbatch count: with none given, the fastest that fits over every count that fills the
    pipeline and splits over dp — no slower than any such count priced alone, and one of them."""
    cluster = preset("p3.16xlarge", 1)
    batch = small_gpt.dims[small_gpt.batch_dim]
    searched = uniform(small_gpt, cluster, tp=2, pp=2, dp=2)
    alone = {}
    for count in (2, 4, 8, 16, 32):
        if count <= batch and batch % count == 0 and (batch // count) % 2 == 0:
            alone[count] = uniform(small_gpt, cluster, tp=2, pp=2, dp=2, microbatches=count).iteration_time_s
    assert len(alone) > 1 and searched.num_microbatches in alone
    assert searched.iteration_time_s == pytest.approx(min(alone.values()), rel=1e-12)
    assert searched.solver["microbatch_counts"] == sorted(alone)


def test_evaluate_cli_reads_megatrons_microbatch_size_per_data_parallel_rank(tmp_path, small_gpt):
    from partopt.io import write_graph

    graph_file = tmp_path / "g.json"
    write_graph(small_gpt, graph_file)
    batch = small_gpt.dims[small_gpt.batch_dim]
    out = tmp_path / "p.json"
    run = CliRunner().invoke(main, ["evaluate", str(graph_file), "--cluster", "p3.16xlarge", "--nodes", "1", "--tp", "2",
                                    "--pp", "2", "--dp", "2", "--microbatch-size", "1", "-o", str(out)])
    assert run.exit_code == 0, run.output
    assert read_plan(out).num_microbatches == batch // 2  # one sample on each of the 2 data-parallel ranks
    bad = CliRunner().invoke(main, ["evaluate", str(graph_file), "--cluster", "p3.16xlarge", "--nodes", "1", "--tp",
                                    "2", "--pp", "2", "--dp", "2", "--microbatch-size", "3"])
    assert bad.exit_code == 2 and "--microbatch-size" in bad.output


@pytest.mark.parametrize("kwargs", [dict(tp=4, pp=2, dp=1, sequence_parallel=True), dict(tp=2, pp=1, dp=4, zero=True)])
def test_a_megatron_layout_keyed_by_structure_prices_what_its_listed_strategies_do(small_gpt, monkeypatch, kwargs):
    """Megatron's restriction reads only a layer's structure, so it is keyed by the layer's hash and its own key
    (`intra.Restriction.key`) instead of by listing every allowed strategy: the same plan, the same ILPs."""
    import importlib

    module = importlib.import_module("partopt.evaluate")  # the module: `partopt.evaluate` is also the function
    cluster = preset("p3.16xlarge", 1)
    keyed = uniform(small_gpt, cluster, microbatches=8, **kwargs)
    assert module._megatron(small_gpt, kwargs["tp"], kwargs["dp"], kwargs.get("zero", False)).key is not None
    megatron = module._megatron
    monkeypatch.setattr(module, "_megatron", lambda *a, **k: dataclasses.replace(megatron(*a, **k), key=None))
    listed = uniform(small_gpt, cluster, microbatches=8, **kwargs)
    assert keyed.iteration_time_s == listed.iteration_time_s
    assert keyed.solver["ilps"] == listed.solver["ilps"]
    assert [{op: (e.axes, e.explanation) for op, e in s.ops.items()} for s in keyed.stages] == \
           [{op: (e.axes, e.explanation) for op, e in s.ops.items()} for s in listed.stages]
