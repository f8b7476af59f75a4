"""Exact bounds that let the default search skip work: memory a microbatch count needs at least, stages
that cannot fit beside the rest of the model, and the memory-free optimum a recomputing mode cannot beat.

Each bound is checked by hand on a small case and against what the search or the ILP then does."""

import random

import pytest

from partopt import costmodel, ilp, intra
from partopt.cluster import preset
from partopt.graph import Graph, Op, Tensor
from partopt.inter import _fits_at_all, least_activation_bytes, optimize
from partopt.layering import build_layers
from partopt.pricing import longest_stage
from test_ilp import brute_force, random_graph
from test_recompute import best_forced, block_graph, tight_cluster

B, H = 8, 64
A = B * H * 4  # one fp32 activation [b, h]


def two_layers() -> Graph:
    """Layer 0: y0 = x · w0, g = gelu(y0); layer 1: y1 = g · w1 (fp32)."""
    dims = {"b": B, "h0": H, "h1": H, "h2": H}
    tensors = {"x": Tensor("x", ("b", "h0"), "input"), "w0": Tensor("w0", ("h0", "h1"), "param"),
               "w1": Tensor("w1", ("h1", "h2"), "param"), "y0": Tensor("y0", ("b", "h1")),
               "g": Tensor("g", ("b", "h1")), "y1": Tensor("y1", ("b", "h2"), "output")}
    ops = [Op("fc0", "einsum", ("x", "w0"), "y0", 0), Op("gelu", "elementwise", ("y0",), "g", 0, {"fn": "gelu"}),
           Op("fc1", "einsum", ("g", "w1"), "y1", 1)]
    return Graph("two-layers", dims, tensors, ops, "b", "fp32")


def test_least_activation_bytes_by_hand():
    graph = two_layers()
    base = build_layers(graph, 64).base
    # none: layer 0 keeps y0 and g, layer 1 keeps y1; nothing is recomputed: 3A, no working set.
    assert least_activation_bytes(graph, base, ("none",)) == 3 * A
    # full: layer 0 keeps only g (read by layer 1) and reruns y0 and g (working set 2A); layer 1 keeps
    # y1 (read by nobody) and reruns it (A): kept A + A, largest working set 2A.
    assert least_activation_bytes(graph, base, ("full",)) == 4 * A
    # both: layer 0 under none (2A, 0) and layer 1 under none (A, 0) is the least: 3A
    assert least_activation_bytes(graph, base, ("none", "full")) == 3 * A


def test_no_plan_holds_less_than_the_least_activation_bytes():
    """The bound against real plans: the summed memory of a plan's devices covers state and the bound."""
    graph = block_graph(layers=2, batch=16)
    for memory_gib in (16.0, 0.007):
        cluster = tight_cluster(graph, memory_gib)
        plan = optimize(graph, cluster, microbatches=4)
        count = plan.num_microbatches
        view = intra.with_batch(graph, graph.dims[graph.batch_dim] // count)
        layering = build_layers(graph, 64)
        base = [[view.op_index[op.name] for op in ops] for ops in layering.base]
        least = least_activation_bytes(view, base, ("none", "selective", "full"))
        held = sum(s.memory_bytes * len(s.devices) for s in plan.stages)
        state = sum(costmodel.param_memory(graph.numel(t.name), graph.dtype_of(t.name), graph.optimizer).total
                    for t in graph.params)
        assert held >= state + least
        budget = costmodel.memory_budget(cluster.device)
        assert _fits_at_all(graph, view, layering, cluster, budget, ("none", "selective", "full"))


def test_a_count_whose_least_memory_overflows_is_not_priced():
    graph = two_layers()
    layering = build_layers(graph, 64)
    cluster = preset("p3.16xlarge", 1)
    state = sum(costmodel.param_memory(graph.numel(t.name), "fp32", graph.optimizer).total for t in graph.params)
    n = cluster.num_devices
    # a budget between (state + 3A) / n and (state + 4A) / n: none fits, full alone does not
    budget = (state + 3.5 * A) / n
    assert _fits_at_all(graph, graph, layering, cluster, budget, ("none", "full"))
    assert not _fits_at_all(graph, graph, layering, cluster, budget, ("full",))


def test_longest_stage_leaves_the_rest_of_the_model_room():
    costs, work = [3.0, 3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]
    # no device spare: only the whole model, 12, which must be under the limit
    assert longest_stage(costs, 1, 13.0, work, spare=0) == 4
    assert longest_stage(costs, 1, 12.0, work, spare=0) == 0
    # two layers cost 6 < 7; the other two need 4 device-seconds on 2 spare devices: 2 < 7
    assert longest_stage(costs, 1, 7.0, work, spare=2) == 2
    heavy = [4.0, 4.0, 4.0, 4.0]
    # on one spare device the other two layers take 8 ≥ 7, one layer leaves 12: nothing fits
    assert longest_stage(costs, 1, 7.0, heavy, spare=1) == 0
    assert longest_stage(costs, 1, 7.0, heavy, spare=2) == 2  # 8 / 2 = 4 < 7
    # the count multiplies the rest's work: B = 2 makes it 2 · 8 / 2 = 8 ≥ 7
    assert longest_stage(costs, 2, 7.0, heavy, spare=2) == 0
    assert longest_stage(costs, 1, 7.0) == 2  # without work: today's rule


def test_the_free_bound_is_the_optimum_with_memory_ignored():
    rng = random.Random(20261201)
    checked = 0
    for _ in range(80):
        graph = random_graph(rng)
        budget = sum(float(m.max()) for m in graph.memory) * rng.uniform(0.3, 0.8)
        if brute_force(graph, budget) is None:
            continue
        solution = ilp.solve(graph, budget)
        free = brute_force(graph, None)
        assert solution.free_bound == pytest.approx(free, abs=1e-9)
        assert solution.free_bound <= solution.objective + 1e-9
        checked += 1
    assert checked > 20


@pytest.mark.parametrize("memory_gib", [16.0, 0.007])
def test_auto_with_skipped_modes_still_equals_the_best_forced_mode_or_beats_it(memory_gib):
    """Modes priced only on meshes where they may win: the plan is still no worse than any forced mode."""
    graph = block_graph(layers=2, batch=16)
    cluster = tight_cluster(graph, memory_gib)
    forced = best_forced(graph, cluster, microbatches=[4, 8, 16])
    auto = optimize(graph, cluster, microbatches=[4, 8, 16])
    assert auto.iteration_time_s <= min(forced.values()) * (1 + 1e-9)


def test_longest_stage_under_overlap_counts_what_the_backward_cannot_hide():
    costs = [3.0, 3.0, 3.0, 3.0]
    assert longest_stage(costs, 4, 7.0) == 2  # 9 ≥ 7
    # with overlap at most one microbatch's time of sync hides: (1 − 1/4) · 9 = 6.75 < 7, 0.75 · 12 = 9 ≥ 7
    assert longest_stage(costs, 4, 7.0, overlap=True) == 3
    assert longest_stage(costs, 1, 0.5, overlap=True) == 4  # one microbatch: its backward may hide all the sync


@pytest.mark.parametrize("count", [1, 2, 8])
def test_an_overlapped_plan_pays_at_least_its_stages_share_the_bound_assumes(count):
    """The premise of the overlap bound on real plans: iteration ≥ (1 − 1/B)(B · t + sync before overlap)."""
    graph = block_graph(layers=2, batch=16)
    cluster = tight_cluster(graph, 16.0)
    for data_parallel in (True, False):
        plan = optimize(graph, cluster, microbatches=count, data_parallel_only=data_parallel)
        for stage in plan.stages:
            additive = count * stage.stage_time_s + stage.sync_time_s + stage.breakdown["overlapped_s"]
            assert plan.iteration_time_s >= (1 - 1 / count) * additive * (1 - 1e-12)
        if data_parallel:
            assert plan.stages[0].breakdown["overlapped_s"] > 0  # the case the bound is for
