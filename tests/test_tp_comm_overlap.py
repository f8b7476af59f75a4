"""Megatron-LM's --tp-comm-overlap: tensor-parallel activation collectives hidden under the weights' GEMMs, per side
(forward, backward) up to the GEMMs' compute (docs/COSTMODEL.md §5b "Megatron's layout")."""

import importlib

import pytest

from partopt import intra, models
from partopt.check import differences
from partopt.cluster import preset
from partopt.errors import InstanceError
from partopt.evaluate import _megatron, uniform
from partopt.explain import explain
from partopt.inter import optimize
from partopt.sharding import forward_share

export = importlib.import_module("partopt.export")  # the module: `partopt.export` is also the function


def _layer(hidden: int, seq: int, cluster, tp: int):
    """One GPT layer's sequence-parallel Megatron sharding on a (1, tp) mesh, without and with the overlap."""
    graph = models.gpt(hidden=hidden, layers=1, heads=tp * 2, seq=seq, vocab=1024, batch=1)
    ops = [op for op in graph.order if op.name.startswith("l0.")]
    mesh = cluster.logical_mesh((1, tp), (1, tp))
    restriction = _megatron(graph, tp, 1, False, sequence_parallel=True)
    plain, over = (intra.shard_stage(graph, mesh, ops, restriction=restriction, tp_overlap=on) for on in (False, True))
    return graph, plain, over


def test_collectives_shorter_than_the_gemms_are_hidden_whole():
    """GPT h 4096, seq 2048 on 8 A100s: a layer's GEMMs take far longer than its eight all-gathers and reduce-scatters
    of b·s·h, so the overlap hides all its comm, and the layer costs that much less per microbatch."""
    graph, plain, over = _layer(4096, 2048, preset("dgx-a100", 1), 8)
    comm = sum(plain.breakdown.comm_s.values())
    assert [op.strategy.axes for op in plain.ops] == [op.strategy.axes for op in over.ops]
    assert comm > 0 and over.breakdown.tp_overlapped_s == pytest.approx(comm, rel=1e-12)
    assert over.breakdown.per_microbatch_s == pytest.approx(plain.breakdown.per_microbatch_s - comm, rel=1e-12)


def test_collectives_longer_than_the_gemms_hide_only_the_gemms_time():
    """A tiny layer (h 256, seq 128) on 8 V100s: each collective's ring latency alone (7 steps of 5 µs) outlasts every
    GEMM, so each side hides exactly its weight GEMMs' compute: forward and backward together, all of it."""
    graph, plain, over = _layer(256, 128, preset("p3.16xlarge", 1), 8)
    gemms = [op for op in plain.ops if graph.op_index[op.op].kind == "einsum"
             and any(graph.tensors[t].role == "param" for t in graph.op_index[op.op].inputs)]
    assert {op.op.split(".", 1)[1] for op in gemms} == {"q", "k", "v", "proj", "fc1", "fc2"}
    forward = sum(op.strategy.compute_s * forward_share(graph, graph.op_index[op.op], preset("p3.16xlarge", 1).device)
                  for op in gemms)
    backward = sum(op.strategy.compute_s for op in gemms) - forward
    assert sum(plain.breakdown.comm_s.values()) > 2 * (forward + backward)
    assert over.breakdown.tp_overlapped_s == pytest.approx(forward + backward, rel=1e-12)


def test_a_uniform_plan_with_the_overlap_is_checked_exported_and_needs_sequence_parallelism():
    graph = models.gpt(hidden=256, layers=4, heads=4, seq=128, vocab=1024, batch=16)
    cluster = preset("p3.16xlarge", 1)
    plan = uniform(graph, cluster, 4, 2, 1, 8, sequence_parallel=True, recompute="none", tp_comm_overlap=True)
    assert plan.options["megatron"]["tp_comm_overlap"] is True
    assert all(stage.breakdown["tp_overlapped_s"] > 0 for stage in plan.stages)
    assert differences(plan, graph, cluster) == []
    for stage, account in zip(plan.stages, explain(plan)):  # the account still adds up to the iteration
        hidden = account.time_s["tensor-parallel collectives hidden under the GEMMs"]
        assert hidden == pytest.approx(-plan.num_microbatches * stage.breakdown["tp_overlapped_s"], rel=1e-12)
        assert sum(account.time_s.values()) == pytest.approx(plan.iteration_time_s, rel=1e-12)
    assert "--tp-comm-overlap" in export.to_megatron(plan)
    with pytest.raises(InstanceError, match="needs sequence parallelism"):
        uniform(graph, cluster, 4, 2, 1, 8, recompute="none", tp_comm_overlap=True)
    with pytest.raises(InstanceError, match="the search does not keep"):  # its credit assumes Megatron's layout
        optimize(graph, cluster, tp_comm_overlap=True)
