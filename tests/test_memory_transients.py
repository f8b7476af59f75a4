"""Transient buffers and gradient-accumulation buffers in the memory model (docs/COSTMODEL.md §5).

Every expected figure is derived by hand in the comments from the formulas of §5: the ILP's memory
row (`ilp.CostGraph.peak_memory`) and the decoded breakdown must both reproduce it.
"""

import pytest

from partopt import ilp, intra
from partopt.cluster import Cluster, Link
from partopt.errors import InfeasibleError
from partopt.graph import Graph, Op, Tensor
from partopt.sharding import R, Shard

from test_intra import FAST, LAUNCH, mlp, row_mesh

B, H = 64, 128  # mlp(2, B, H): x[b,h0] -> fc0 (w0[h0,h1]) -> y0 -> fc1 (w1[h1,h2]) -> y1, fp32, Adam
W = H * H * 4  # bytes of one fp32 weight (its gradient too)
Y = B * H * 4  # bytes of one fp32 activation [b, h]


def pinned(ops: dict, params: dict) -> intra.Restriction:
    return intra.Restriction(lambda op, s: s.axes == ops[op.name], lambda t, s: (s.placement, s.zero_axes) == params[t])


def solve_and_model(graph, mesh, restriction, **kw):
    """The stage solved under `restriction`, and its cost graph's memory of that same choice."""
    stage = intra.shard_stage(graph, mesh, restriction=restriction, **kw)
    model = intra.build(graph, mesh, restriction=restriction, inflight=kw.get("inflight", 1))
    return stage, model.costs.peak_memory(stage.solution.choice)


def test_fsdp_gathered_weights_count_once_plus_one_prefetched_and_gradients_accumulate_split():
    """ZeRO-3/FSDP on 4 devices: both ops split the batch, both weights are stored split 4 ways by
    their first dim, so each op all-gathers its weight, forward and backward, and reduce-scatters
    its gradient into the stored split after each microbatch's backward."""
    graph, mesh = mlp(2, B, H), row_mesh(4)
    dp = (None, "b")
    restriction = pinned({"fc0": dp, "fc1": dp}, {"w0": ((R, Shard("h0")), ()), "w1": ((R, Shard("h1")), ())})
    stage, ilp_memory = solve_and_model(graph, mesh, restriction)
    bd = stage.breakdown
    # state per weight, stored split 4 ways: fp32 weights W/4, the gradient W/4 (fc splits b, which the
    # weight lacks, so each device computes a whole partial gradient, W bytes, which is reduce-scattered
    # right away and accumulates as the stored split) and Adam's m, v 2W/4
    assert bd.state_bytes == {"weights": 2 * W / 4, "gradients": 2 * W / 4, "optimizer": 2 * 2 * W / 4}
    assert [p.strategy.state_bytes for p in stage.params] == [(W / 4, W / 4, 2 * W / 4)] * 2
    # transients: while fc1 runs its backward, its gathered w1 (W) and w1's whole partial gradient before
    # the reduce-scatter (W); fc0 the same — the max of the two, not their sum — plus the next op's weight
    # prefetched beside it (at most the largest, W); y0 and y1 stay batch-split (no activation copies)
    assert bd.transient_bytes == 3 * W
    # kept activations: y0 and y1 split 4 ways; one microbatch in flight
    assert bd.activation_bytes == 2 * Y / 4
    expected = 2 * W / 4 + 2 * W / 4 + 4 * W / 4 + 2 * Y / 4 + 3 * W
    assert stage.memory_bytes == expected
    assert ilp_memory == expected  # the ILP's memory row charges the same


def test_fsdp_reduces_each_microbatch_and_plain_data_parallelism_once_per_iteration():
    """The collectives of those two plans at 3 microbatches, priced by hand on 4 devices in a row at 10 GB/s with no
    latency: a weight stored split (FSDP) is reduce-scattered after every microbatch, W bytes over 4 devices,
    (4 - 1) / 4 · W / bw each (ring), and nothing is left for the iteration; a replicated weight's partial sums
    are all-reduced once per iteration, 2 (4 - 1) / 4 · W / bw, in the gradient buckets (no launch of their own)."""
    graph, mesh = mlp(2, B, H), row_mesh(4)
    dp = (None, "b")
    bw = 10e9
    fsdp = pinned({"fc0": dp, "fc1": dp}, {"w0": ((R, Shard("h0")), ()), "w1": ((R, Shard("h1")), ())})
    bd = intra.shard_stage(graph, mesh, restriction=fsdp, microbatches=3).breakdown
    assert bd.comm_s["reduce_scatter"] == pytest.approx(2 * (LAUNCH + 3 / 4 * W / bw), rel=1e-12)
    assert bd.comm_s["all_gather"] == pytest.approx(2 * 2 * (LAUNCH + 3 / 4 * W / bw), rel=1e-12)  # forward, backward
    assert not any(bd.sync_s.get(kind) for kind in ("reduce_scatter", "all_reduce"))
    plain = pinned({"fc0": dp, "fc1": dp}, {"w0": ((R, R), ()), "w1": ((R, R), ())})
    bd = intra.shard_stage(graph, mesh, restriction=plain, microbatches=3).breakdown
    assert not any(bd.comm_s.get(kind) for kind in ("reduce_scatter", "all_reduce", "all_gather"))
    assert bd.sync_s["all_reduce"] == pytest.approx(2 * (2 * 3 / 4 * W / bw), rel=1e-12)


def _two_weights(layers: tuple[int, int]) -> Graph:
    """x[b,h0] -> fc0 (w0[h0,h1], W bytes) -> fc1 (w1[h1,h2], 3W bytes) -> y1, fp32; `layers`: the ops' layer tags."""
    dims = {"b": B, "h0": H, "h1": H, "h2": 3 * H}
    tensors = {"x": Tensor("x", ("b", "h0"), "input"), "w0": Tensor("w0", ("h0", "h1"), "param"),
               "w1": Tensor("w1", ("h1", "h2"), "param"), "y0": Tensor("y0", ("b", "h1")),
               "y1": Tensor("y1", ("b", "h2"), "output")}
    ops = [Op("fc0", "einsum", ("x", "w0"), "y0", layers[0]), Op("fc1", "einsum", ("y0", "w1"), "y1", layers[1])]
    return Graph("two-weights", dims, tensors, ops, "b", "fp32")


def test_fsdp_moves_a_layers_weights_in_one_call_per_collective():
    """FSDP on 4 devices in a row at 10 GB/s and 2 µs per ring step: a layer's weights are gathered (forward, and
    again backward) and their gradients reduce-scattered as one flat buffer, so the layer pays one call's fixed part,
    LAUNCH + 3 · 2 µs, per collective, each weight its share by bytes (1/4 and 3/4 here), and every byte as before,
    3/4 · (W + 3W) / bw. Two layers of one weight each pay the fixed part twice."""
    bw, step = 10e9, 2e-6
    mesh = Cluster("row", 1, 4, FAST, Link(bw, step), Link(bw, step)).logical_mesh((1, 4), (1, 4))
    fsdp = pinned({"fc0": (None, "b"), "fc1": (None, "b")},
                  {"w0": ((R, Shard("h0")), ()), "w1": ((R, Shard("h1")), ())})
    fixed, moved = LAUNCH + 3 * step, 3 / 4 * (W + 3 * W) / bw
    for layers, calls in (((0, 0), 1), ((0, 1), 2)):
        bd = intra.shard_stage(_two_weights(layers), mesh, restriction=fsdp, microbatches=3).breakdown
        assert bd.comm_s["all_gather"] == pytest.approx(2 * (calls * fixed + moved), rel=1e-12)  # forward, backward
        assert bd.comm_s["reduce_scatter"] == pytest.approx(calls * fixed + moved, rel=1e-12)


def test_replicated_data_parallel_has_no_transient_and_its_gradient_matches_the_stored_layout():
    graph, mesh = mlp(2, B, H), row_mesh(4)
    dp = (None, "b")
    restriction = pinned({"fc0": dp, "fc1": dp}, {"w0": ((R, R), ()), "w1": ((R, R), ())})
    stage, ilp_memory = solve_and_model(graph, mesh, restriction)
    # a replicated weight is read in place; its partial gradient is W either way
    assert stage.breakdown.transient_bytes == 0
    assert stage.breakdown.state_bytes == {"weights": 2 * W, "gradients": 2 * W, "optimizer": 4 * W}
    assert stage.memory_bytes == ilp_memory == 2 * (W + W + 2 * W) + 2 * Y / 4


def test_all_to_all_and_gathered_gradient_copies_of_one_op_add_up():
    """fc0 splits the batch, fc1 the contracted h1 (Megatron's row-parallel form): y0 goes S(b) -> S(h1)."""
    graph, mesh = mlp(2, B, H), row_mesh(4)
    restriction = pinned({"fc0": (None, "b"), "fc1": (None, "h1")},
                         {"w0": ((R, R), ()), "w1": ((R, Shard("h1")), ())})
    stage, ilp_memory = solve_and_model(graph, mesh, restriction)
    # owned by fc1, coexisting while it runs:
    # * y0's all-to-all S(b) -> S(h1) writes a Y/4 copy beside its source (forward); its gradient
    #   goes back S(h1) -> S(b) the same way (backward): the larger of the two, Y/4;
    # * fc1's output is a pending sum leaving for the canonical batch split: reduce-scattered in place
    #   forward, but its gradient comes back S(b) -> Replicate by an all-gather: a whole Y copy.
    # fc0 has none; no weight is gathered (w1 is stored as fc1 reads it), so no prefetch
    assert stage.breakdown.transient_bytes == Y / 4 + Y
    # gradients: w0's in fc0's batch split layout is Partial (W); w1's in fc1's layout S(h1) (W/4)
    assert stage.breakdown.state_bytes["gradients"] == W + W / 4
    activations = Y / 4 + Y  # y0 batch-split, y1 a full pending sum
    state = (W + W + 2 * W) + (W / 4 + W / 4 + 2 * W / 4)
    assert stage.memory_bytes == ilp_memory == state + activations + Y / 4 + Y


def test_transients_are_held_once_however_many_microbatches_are_in_flight():
    graph, mesh = mlp(2, B, H), row_mesh(4)
    dp = (None, "b")
    restriction = pinned({"fc0": dp, "fc1": dp}, {"w0": ((R, Shard("h0")), ()), "w1": ((R, Shard("h1")), ())})
    one, _ = solve_and_model(graph, mesh, restriction)
    four, ilp_memory = solve_and_model(graph, mesh, restriction, inflight=4)
    # only the kept activations (2·Y/4 per microbatch) grow with the microbatches in flight
    assert four.memory_bytes - one.memory_bytes == 3 * 2 * Y / 4
    assert ilp_memory == four.memory_bytes


# ---------------------------------------------------------------- the ILP's memory row (abstract graphs)

def three_nodes() -> ilp.CostGraph:
    """Three independent nodes: strategy 0 costs 0 with a transient of 10, 20, 30 bytes; strategy 1
    costs 1 with none. No node memory: the memory is the transient peak alone."""
    g = ilp.CostGraph()
    for i, t in enumerate((10, 20, 30)):
        n = g.add_node(f"n{i}", [0.0, 1.0])
        g.add_transient("buffers", n, n, [t, 0.0])
    return g


@pytest.mark.parametrize("reduce_first", [True, False])
@pytest.mark.parametrize("budget,choice,objective", [
    (None, [0, 0, 0], 0.0),  # peak max(10, 20, 30) = 30
    (30, [0, 0, 0], 0.0),  # a sum (60) would not fit: transients of different owners do not coexist
    (25, [0, 0, 1], 1.0),  # only n2's 30 is too much: peak 20
    (19, [0, 1, 1], 2.0),  # peak 10
    (9, [1, 1, 1], 3.0),  # no transient
])
def test_the_memory_row_charges_the_largest_transient_not_the_sum(budget, choice, objective, reduce_first):
    g = three_nodes()
    solution = ilp.solve(g, budget, reduce_first=reduce_first)
    assert solution.choice == choice and solution.objective == objective
    assert g.peak_memory(choice) == max([0] + [t for t, k in zip((10, 20, 30), choice) if k == 0])


@pytest.mark.parametrize("backend", ["highs", "cpsat", "cbc"])
@pytest.mark.parametrize("reduce_first", [True, False])
def test_a_layers_share_of_a_stage_budget_carries_its_share_of_the_transient(backend, reduce_first):
    """One of 4 alike layers of a stage: each node holds 100 bytes; strategy 0 (free) has a 40-byte
    transient, strategy 1 costs 1 and has none. The stage holds 4 × 100 + 40 = 440 bytes at the free
    optimum, so a layer's share of a 440-byte budget (110) must admit it: 100 + 40 / 4 = 110; one byte
    less, and only strategy 1 fits (100 + 0)."""
    g = ilp.CostGraph()
    n = g.add_node("n", [0.0, 1.0], memory=[100.0, 100.0])
    g.add_transient("buffers", n, n, [40.0, 0.0])
    g.peak_shared_by = 4
    assert g.peak_memory([0]) == 110 and g.transient_peak([0]) == 40  # the peak itself stays whole
    assert ilp.min_memory(g) == 100
    assert ilp.solve(g, 110, backend, reduce_first=reduce_first).choice == [0]
    assert ilp.solve(g, 109, backend, reduce_first=reduce_first).choice == [1]


@pytest.mark.parametrize("reduce_first", [True, False])
def test_a_pair_transient_binds_only_its_pair_and_pools_add_up(reduce_first):
    g = ilp.CostGraph()
    u = g.add_node("u", [0.0, 5.0])
    v = g.add_node("v", [2.0, 0.0], memory=[100.0, 100.0])
    g.add_edge(u, v, [[0.0, 0.0], [0.0, 0.0]])
    g.add_transient("buffers", v, u, [[0.0, 50.0], [0.0, 0.0]], v)  # only (u=0, v=1) copies 50 bytes
    w = g.add_node("w", [0.0])
    g.add_transient("prefetch", w, w, [7.0])  # another pool: adds to the peak
    # free optimum (u=0, v=1), cost 0: memory 100 + 50 + 7
    assert g.peak_memory([0, 1, 0]) == 157
    assert ilp.solve(g, 157, reduce_first=reduce_first).choice == [0, 1, 0]
    # one byte less: (0, 0) costs 2, (1, 1) 5, (1, 0) 7 — all at 100 + 0 + 7
    tight = ilp.solve(g, 156, reduce_first=reduce_first)
    assert tight.choice == [0, 0, 0] and tight.objective == 2.0
    assert ilp.min_memory(g) == 107  # every table at its least: a lower bound, reached here
    with pytest.raises(InfeasibleError):
        ilp.solve(g, 106, reduce_first=reduce_first)


@pytest.mark.parametrize("backend", ["highs", "cpsat", "cbc"])
@pytest.mark.parametrize("budget,choice", [(40, [0, 0]), (39, [0, 1])])
def test_an_owners_transients_on_one_variable_make_one_coefficient(backend, budget, choice):
    """v's own copy (30 bytes) and the copy on its edge from the one-strategy node u (10 bytes)
    fall on the same 0-1 variable of v; a row naming a variable twice is refused by HiGHS (it then
    solved the model without any row)."""
    g = ilp.CostGraph()
    u = g.add_node("u", [0.0])
    v = g.add_node("v", [0.0, 1.0])
    g.add_edge(u, v, [[0.0, 0.0]])
    g.add_transient("buffers", v, v, [30.0, 0.0])
    g.add_transient("buffers", v, u, [[10.0, 0.0]], v)
    assert g.peak_memory([0, 0]) == 40
    assert ilp.solve(g, budget, backend, reduce_first=False).choice == choice


def test_check_re_derives_a_plans_transients_and_catches_a_plan_that_leaves_them_out(tiny):
    """`partopt check` prices the plan again: the transient peak held in `working_bytes` comes back
    exactly, and a plan whose stage drops it (consistent on its own) is reported."""
    import dataclasses

    from partopt import check

    plan = tiny.plan
    assert not any(s.recompute != "none" for s in plan.stages)  # no recomputation: working_bytes is transients only
    peaked = [i for i, s in enumerate(plan.stages) if s.breakdown["working_bytes"] > 0]
    assert peaked  # the tiny GPT's plan gathers or copies something somewhere
    assert check.differences(plan, tiny.graph, tiny.cluster) == []
    i = peaked[0]
    stage = plan.stages[i]
    lean = dataclasses.replace(stage, memory_bytes=stage.memory_bytes - stage.breakdown["working_bytes"],
                               breakdown={**stage.breakdown, "working_bytes": 0.0})
    stages = [lean if k == i else s for k, s in enumerate(plan.stages)]
    edited = dataclasses.replace(plan, stages=stages, memory_peak_bytes=max(s.memory_bytes for s in stages))
    found = check.differences(edited, tiny.graph, tiny.cluster)
    assert any(d.place == f"$.stages[{i}].memory_bytes" for d in found)
