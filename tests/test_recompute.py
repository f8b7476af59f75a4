"""Activation recomputation as a choice: none, selective (the attention core), full — per stage.

Hand checks follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"): selective recomputation drops exactly the attention core's activations,
which are quadratic in the sequence (their 5·a·s²·b bytes per layer: softmax output, dropout mask
and output). partopt's IR has no dropout; of its core only the probabilities are kept (softmax's backward
reads its output, not the scores), 2 bytes per element in fp16, so selective saves 2·a·s²·b bytes per
layer on one device, and the share of one device under a split of the heads or the batch.
"""

import dataclasses

import pytest

from partopt import intra
from partopt.cluster import preset
from partopt.errors import InfeasibleError
from partopt.evaluate import uniform
from partopt.inter import optimize
from partopt.models.gpt import gpt
from partopt.models.moe import moe
from test_intra import mlp

B, S, H, HEADS = 4, 64, 128, 4


def block_graph(layers: int = 1, batch: int = B):
    return gpt(hidden=H, layers=layers, heads=HEADS, seq=S, vocab=512, batch=batch)


def block_ops(graph):
    return [op for op in graph.ops if op.layer == 0 and op.name.startswith("l0.")]


def test_selective_recomputes_the_attention_core_and_nothing_else():
    graph = block_graph()
    ops = block_ops(graph)
    assert intra.recomputed_ops(graph, ops, "selective") == {"l0.scores", "l0.probs", "l0.context"}
    assert intra.recomputed_ops(graph, ops, "none") == frozenset()
    assert intra.recomputed_ops(graph, ops, "full") == {op.name for op in ops}


def test_full_recomputation_reruns_the_layer_but_not_its_loss():
    """A loss's backward follows its forward at once, and runtimes checkpoint their layers, not the loss
    (Megatron-LM's full recomputation wraps the transformer layers; its cross entropy runs after them): full
    recomputation of the last layer reruns the block, the final norm and the logits, not the cross entropy."""
    graph = block_graph()  # one layer: the block, then the head
    ops = [op for op in graph.ops if op.layer == 0]
    assert {op.name for op in ops if op.kind == "cross_entropy"} == {"head.loss"}
    assert intra.recomputed_ops(graph, ops, "full") == {op.name for op in ops} - {"head.loss"}


def test_a_moe_gate_softmax_is_not_an_attention_core():
    graph = moe(hidden=128, layers=2, heads=4, seq=64, vocab=512, batch=8, experts=4, group_size=128)
    gates = [op for op in graph.ops if op.name.endswith(".gates")]
    assert gates  # the router's softmax reads x · w_gate: a parameter, not two activations
    selective = intra.recomputed_ops(graph, graph.ops, "selective")
    assert not any(op.name in selective for op in gates)
    assert intra.recomputed_ops(mlp(2, 64, 64), mlp(2, 64, 64).ops, "selective") == frozenset()


@pytest.mark.parametrize("mesh_shape, split", [((1, 1), 1), ((2, 1), 2)])
def test_selective_saves_the_probabilities_and_reruns_the_core_forward(mesh_shape, split):
    graph = block_graph()
    ops = block_ops(graph)
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, mesh_shape[0] * mesh_shape[1]), mesh_shape)
    data_parallel = split > 1  # the batch split over the mesh: every activation's local share is 1/split
    plain = intra.shard_stage(graph, mesh, ops, data_parallel=data_parallel)
    selective = intra.shard_stage(graph, mesh, ops, data_parallel=data_parallel, recompute="selective")
    core = 2 * B * HEADS * S * S  # probs, fp16, [b, n, s, t]; the scores are not kept, recomputed or not
    assert plain.breakdown.activation_bytes - selective.breakdown.activation_bytes == pytest.approx(core / split)
    # the working set holds the recomputed outputs a backward reads once: probs and context [b, s, n, d]
    assert selective.breakdown.working_bytes == pytest.approx((core + 2 * B * S * H) / split)
    # recomputation reruns the three ops' forward: the two einsums' 2·b·n·s·t·d FLOPs each and the softmax
    chosen = {oc.op: oc.strategy for oc in selective.ops}
    rerun = sum(chosen[name].forward_s for name in ("l0.scores", "l0.probs", "l0.context"))
    assert selective.breakdown.recompute_s == pytest.approx(rerun)
    assert selective.breakdown.per_microbatch_s == pytest.approx(plain.breakdown.per_microbatch_s + rerun)


def test_full_keeps_less_than_selective_which_keeps_less_than_none():
    graph = block_graph()
    ops = block_ops(graph)
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 1), (1, 1))
    kept = {mode: intra.shard_stage(graph, mesh, ops, recompute=mode).breakdown for mode in intra.RECOMPUTE_MODES}
    assert kept["full"].activation_bytes < kept["selective"].activation_bytes < kept["none"].activation_bytes
    assert kept["none"].recompute_s == 0 < kept["selective"].recompute_s < kept["full"].recompute_s
    # full keeps only what leaves the block: its output x[b, s, h]
    assert kept["full"].activation_bytes == pytest.approx(2 * B * S * H)


def tight_cluster(graph, memory_gib: float, devices: int = 2):
    """One p3.16xlarge-like node of `devices` GPUs (its first) whose devices have `memory_gib` each (small: the
    searches are fast)."""
    cluster = preset("p3.16xlarge", 1)
    return dataclasses.replace(cluster.narrowed(devices),
                               device=dataclasses.replace(cluster.device, memory_bytes=int(memory_gib * 2**30)))


def best_forced(graph, cluster, **kwargs):
    times = {}
    for mode in intra.RECOMPUTE_MODES:
        try:
            times[mode] = optimize(graph, cluster, recompute=mode, **kwargs).iteration_time_s
        except InfeasibleError:
            continue
    return times


@pytest.mark.parametrize("memory_gib", [16.0, 0.0065])
def test_auto_is_never_worse_than_any_forced_mode(memory_gib):
    graph = block_graph(layers=2, batch=16)
    cluster = tight_cluster(graph, memory_gib)
    # under 1F1B, whose in-flight counts differ by stage (what makes a mixed plan win); the schedule search
    # is checked in tests/test_schedules_search.py and tests/test_zero_bubble_search.py
    forced = best_forced(graph, cluster, microbatches=4, schedule="1f1b")
    auto = optimize(graph, cluster, microbatches=4, schedule="1f1b")
    assert forced and auto.iteration_time_s <= min(forced.values()) * (1 + 1e-9)
    assert optimize(graph, cluster, microbatches=4).iteration_time_s <= auto.iteration_time_s * (1 + 1e-9)
    modes = [s.recompute for s in auto.stages]
    if memory_gib > 1:  # ample memory: recomputing only adds time, and the search stops at none
        assert set(modes) == {"none"} and auto.solver["recompute_modes"] == {"4": ["none"]}
    else:  # memory binds: a stage that recomputes fully beside one that does not beats every single mode
        assert auto.solver["recompute_modes"] == {"4": ["none", "selective", "full"]}
        assert set(modes) == {"full", "none"}
        assert auto.iteration_time_s < min(forced.values()) * (1 - 1e-3)


def test_auto_is_never_worse_than_a_megatron_grid_point():
    graph = block_graph(layers=2, batch=16)
    cluster = tight_cluster(graph, 0.007)
    auto = optimize(graph, cluster)
    priced = []
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        dp = 2 // (tp * pp)
        for count in (pp, 2 * pp, 4 * pp):
            try:
                priced.append(uniform(graph, cluster, tp, pp, dp, count).iteration_time_s)
            except InfeasibleError:
                continue
    assert priced and auto.iteration_time_s <= min(priced) * (1 + 1e-9)


def test_a_plan_records_each_stages_mode_and_evaluates_to_itself():
    from partopt.evaluate import evaluate
    from partopt.plan import plan_from_dict, plan_to_dict

    graph = block_graph(layers=2, batch=16)
    cluster = tight_cluster(graph, 0.007)
    plan = optimize(graph, cluster, microbatches=4)
    again = evaluate(graph, cluster, plan_from_dict(plan_to_dict(plan)))
    assert [s.recompute for s in again.stages] == [s.recompute for s in plan.stages]
    assert again.iteration_time_s == pytest.approx(plan.iteration_time_s, rel=1e-12)


def test_the_former_flag_means_full_recomputation():
    from partopt.plan import plan_from_dict, plan_to_dict

    graph = block_graph(layers=2, batch=8)
    cluster = tight_cluster(graph, 16.0)
    plan = optimize(graph, cluster, microbatches=2, recompute=True)
    assert {s.recompute for s in plan.stages} == {"full"}
    old = plan_to_dict(plan)
    old["options"]["recompute"] = True
    for stage in old["stages"]:
        del stage["recompute"]
    assert {s.recompute for s in plan_from_dict(old).stages} == {"full"}


def test_the_cli_flag_alone_means_full_and_takes_a_mode(tmp_path):
    from click.testing import CliRunner

    from partopt.cli import main
    from partopt.io import write_graph
    from partopt.plan import read_plan

    graph_file = tmp_path / "g.json"
    write_graph(block_graph(layers=2, batch=8), graph_file)
    for args, expected in ([["--recompute"], "full"], [["--recompute", "selective"], "selective"]):
        out = tmp_path / f"{expected}.json"
        result = CliRunner().invoke(main, ["solve", str(graph_file), "--cluster", "p3.16xlarge", "--nodes", "1",
                                           "--microbatches", "2", "--search", "intra-only", *args, "-o", str(out)])
        assert result.exit_code == 0, result.output
        plan = read_plan(out)
        assert {s.recompute for s in plan.stages} == {expected} and plan.options["recompute"] == expected
