"""Intra-op sharding: the closed forms of REFERENCE §4, derived by hand for this cost model.

The test device is compute bound (HBM bandwidth unbounded) and the links have no per-step
latency, so every cost is a product of FLOPs or bytes with a rate, plus one launch cost per
collective call: the expected objectives below are written out from the formulas of
docs/COSTMODEL.md, not read from the code.
"""

from pathlib import Path

import pytest

from partopt import costmodel, intra
from partopt.cluster import Cluster, Device, Link, preset
from partopt.errors import InfeasibleError
from partopt.graph import Graph, Op, Tensor
from partopt.io import read_graph
from partopt.sharding import P, R, Shard
from partopt.solvers import BACKENDS

PEAK = 1e12  # FLOP/s of the test device, matmul efficiency 1
LAUNCH = costmodel.COLLECTIVE_LAUNCH_S
FAST = Device("test-device", {"fp32": PEAK}, 2**40, 1e30, matmul_efficiency=1.0)
INSTANCES = Path(__file__).parent.parent / "instances"


def mlp(layers: int, batch: int, hidden: int) -> Graph:
    """x[b,h0] -> fc0 -> ... -> fc{n-1}: square fp32 weights, no bias (REFERENCE §4's MLP)."""
    dims = {"b": batch, **{f"h{i}": hidden for i in range(layers + 1)}}
    tensors = {"x": Tensor("x", ("b", "h0"), "input")}
    ops, prev = [], "x"
    for i in range(layers):
        tensors[f"w{i}"] = Tensor(f"w{i}", (f"h{i}", f"h{i + 1}"), "param")
        tensors[f"y{i}"] = Tensor(f"y{i}", ("b", f"h{i + 1}"))
        ops.append(Op(f"fc{i}", "einsum", (prev, f"w{i}"), f"y{i}", i))
        prev = f"y{i}"
    return Graph(f"mlp{layers}", dims, tensors, ops, "b", "fp32")


def row_mesh(n=4, bw=10e9):
    """n devices in a row (one node), links with bandwidth `bw` and no per-step latency."""
    return Cluster("row", 1, n, FAST, Link(bw, 0.0), Link(bw, 0.0)).logical_mesh((1, n), (1, n))


def all_reduce(nbytes, n, bw):
    return LAUNCH + 2 * (n - 1) / n * nbytes / bw


def gradient_all_reduce(nbytes, n, bw):
    """Per-iteration gradient synchronisation rides in buckets: only its bandwidth term counts."""
    return 2 * (n - 1) / n * nbytes / bw


def matmul_time(batch, hidden, split):
    return 3 * 2 * batch * hidden * hidden / split / PEAK  # forward + backward (2x)


def axes_of(stage):
    return {c.op: c.strategy.axes for c in stage.ops}


def test_two_layer_mlp_large_batch_is_data_parallel():
    b, h, bw = 1024, 128, 10e9
    stage = intra.shard_stage(mlp(2, b, h), row_mesh(bw=bw))
    assert axes_of(stage) == {"fc0": (None, "b"), "fc1": (None, "b")}
    assert all(p.strategy.placement == (R, R) for p in stage.params)
    # the two weight-gradient all-reduces, once per iteration
    expected = 2 * matmul_time(b, h, 4) + 2 * gradient_all_reduce(h * h * 4, 4, bw)
    assert stage.objective == pytest.approx(expected, rel=1e-9)
    # an all-reduce, or ZeRO's reduce-scatter + all-gather of the same bytes (bucketed, the same time)
    assert sum(stage.breakdown.sync_s.values()) == pytest.approx(2 * gradient_all_reduce(h * h * 4, 4, bw), rel=1e-9)


def test_two_layer_mlp_small_batch_is_megatron_column_then_row():
    b, h, bw = 128, 1024, 10e9
    stage = intra.shard_stage(mlp(2, b, h), row_mesh(bw=bw))
    assert axes_of(stage) == {"fc0": (None, "h1"), "fc1": (None, "h1")}
    by_op = {c.op: c.strategy for c in stage.ops}
    assert by_op["fc0"].output == (R, Shard("h1"))  # column parallel
    assert by_op["fc1"].inputs[1] == (R, Shard("h1")) and by_op["fc1"].output == (R, P)  # row parallel
    # the output leaves in the data-parallel layout: its pending sum is reduce-scattered over the
    # batch, and its gradient all-gathered back: the bytes of one all-reduce, two launches
    expected = 2 * matmul_time(b, h, 4) + all_reduce(b * h * 4, 4, bw) + LAUNCH
    assert stage.objective == pytest.approx(expected, rel=1e-9)
    assert "reduce-scatter" in stage.ops[1].explanation and "all-gather" in stage.ops[1].explanation


@pytest.mark.parametrize("layers", [4, 6])
def test_n_layer_mlp_alternates_column_and_row(layers):
    b, h, bw = 128, 1024, 10e9
    stage = intra.shard_stage(mlp(layers, b, h), row_mesh(bw=bw), backend="highs")
    for i, choice in enumerate(stage.ops):
        assert choice.strategy.axes == (None, f"h{i + 1 - i % 2}")  # fc0 splits its output, fc1 its input, …
    # forward: one all-reduce after every row layer; backward: one before every column layer but the
    # first; the last row layer's sum leaves batch-split instead (reduce-scatter + gradient all-gather)
    expected = layers * matmul_time(b, h, 4) + (layers - 1) * all_reduce(b * h * 4, 4, bw) + LAUNCH
    assert stage.objective == pytest.approx(expected, rel=1e-9)


def test_n_layer_mlp_large_batch_pays_one_gradient_all_reduce_per_weight():
    b, h, bw, layers = 1024, 128, 10e9, 4
    stage = intra.shard_stage(mlp(layers, b, h), row_mesh(bw=bw))
    expected = layers * matmul_time(b, h, 4) + layers * gradient_all_reduce(h * h * 4, 4, bw)
    assert stage.objective == pytest.approx(expected, rel=1e-9)


def test_2d_mesh_puts_batch_on_the_slow_axis_and_megatron_on_the_fast_one():
    # activations (per microbatch) outweigh the weights: the batch goes on the slow axis, whose
    # all-reduce then carries only half-sharded weight gradients once per iteration
    b, h, fast_bw, slow_bw = 2048, 512, 10e9, 5e9
    cluster = Cluster("two", 2, 2, FAST, Link(fast_bw, 0.0), Link(slow_bw, 0.0))
    mesh = cluster.logical_mesh((2, 2), (2, 2))
    assert mesh.axes[0].crosses_nodes and not mesh.axes[1].crosses_nodes
    stage = intra.shard_stage(mlp(2, b, h), mesh)
    assert axes_of(stage) == {"fc0": ("b", "h1"), "fc1": ("b", "h1")}
    # row-parallel output, half the batch per device: it leaves batch-split over both axes, so its
    # pending sum is reduce-scattered and its gradient all-gathered (an all-reduce's bytes, 2 launches)
    activation = all_reduce(b // 2 * h * 4, 2, fast_bw) + LAUNCH
    gradients = 2 * gradient_all_reduce(h * h * 4 / 2, 2, slow_bw)  # each weight half-sharded, summed over the batch axis
    assert stage.objective == pytest.approx(2 * matmul_time(b, h, 4) + activation + gradients, rel=1e-9)


def test_memory_budget_below_data_parallel_footprint_shards_weights_or_optimizer_state():
    b, h = 1024, 128
    graph, mesh = mlp(2, b, h), row_mesh()
    free = intra.shard_stage(graph, mesh)
    assert axes_of(free) == {"fc0": (None, "b"), "fc1": (None, "b")}
    dp_bytes = 2 * 16 * h * h + 2 * (b // 4) * h * 4  # replicated fp32 Adam state + batch-split activations
    assert free.memory_bytes <= dp_bytes  # bucketed ZeRO costs the same time as the all-reduce: either may win
    budget = 0.8 * dp_bytes
    tight = intra.shard_stage(graph, mesh, memory_budget=budget)
    assert tight.memory_bytes <= budget
    assert all(p.strategy.zero_axes or any(isinstance(x, Shard) for x in p.strategy.placement) for p in tight.params)
    assert tight.objective >= free.objective


def test_budget_below_the_smallest_footprint_names_the_point_tensors_bytes_and_budget():
    graph, mesh = mlp(2, 1024, 128), row_mesh()
    with pytest.raises(InfeasibleError) as err:
        intra.shard_stage(graph, mesh, memory_budget=2**16)
    line = err.value.line()
    assert "end of the forward pass" in line and "budget is 64 KiB" in line
    # the least footprint: each weight's Adam state split 4 ways, each output split 4 ways
    need = 2 * 16 * 128 * 128 / 4 + 2 * 1024 * 128 * 4 / 4
    assert f"at least {need / 1024:.3g} KiB" in line
    # an op's least: its output split 4 ways (128 KiB); a weight's: fp32 weights, their gradient (accumulated
    # in the stored split) and Adam's m, v, each split 4 ways (64 KiB)
    assert ("largest: y1 (activation) 128 KiB, y0 (activation) 128 KiB, "
            "w1 (weights, gradient and optimizer state) 64 KiB") in line


def test_merging_never_changes_the_optimum_on_instances():
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 4), (2, 2))
    for name in ("mlp-2layer.json", "attention-block.json"):
        graph = read_graph(INSTANCES / name)
        merged = intra.shard_stage(graph, mesh, backend="highs")
        plain = intra.shard_stage(graph, mesh, backend="highs", reduce_first=False)
        assert merged.objective == pytest.approx(plain.objective, rel=1e-9)


def test_backends_agree_on_small_instances():
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 4), (1, 4))
    for path in sorted(INSTANCES.glob("*.json")):
        graph = read_graph(path)
        if len(graph.ops) > 40:
            continue
        objectives = {b: intra.shard_stage(graph, mesh, backend=b).objective for b in BACKENDS}
        assert max(objectives.values()) == pytest.approx(min(objectives.values()), rel=1e-6), (path.name, objectives)


def test_microbatch_view_scales_dims_derived_from_the_batch():
    graph = read_graph(INSTANCES / "moe-380m.json")  # tokens bs = b·s, groups g = b·s / 2048
    small = intra.with_batch(graph, 8)
    assert (small.dims["b"], small.dims["bs"], small.dims["g"]) == (8, 8 * 1024, 8 * 1024 // 2048)
    assert small.dims["s"] == graph.dims["s"]


# ---------------------------------------------------------------- shared forward resharding

INSTANT = Device("instant", {"fp32": 1e30}, 2**40, 1e30, matmul_efficiency=1.0)  # compute costs nothing


def _fanout_graph(consumers: int) -> Graph:
    """x[b,s,k,r] -> sum over r -> t[b,s,k] -> `consumers` elementwise readers, all int32.

    Integers carry no gradient, so the stage's only costs are the forward resharding of t."""
    dims = {"b": 8, "s": 8, "k": 8, "r": 8}
    tensors = {"x": Tensor("x", ("b", "s", "k", "r"), "input", "int32"), "t": Tensor("t", ("b", "s", "k"), dtype="int32")}
    ops = [Op("make", "reduce", ("x",), "t", 0, {"fn": "sum"})]
    for i in range(consumers):
        tensors[f"y{i}"] = Tensor(f"y{i}", ("b", "s", "k"), "output", "int32")
        ops.append(Op(f"read{i}", "elementwise", ("t",), f"y{i}", 0, {"fn": "neg"}))
    return Graph("fanout", dims, tensors, ops, "b", "fp32")


def _reshard_by_hand(src, dst, nbytes, n, bw):
    """One axis of n devices, DESIGN §4's table written out (a layout is 'R', 'P' or a sharded dim)."""
    if src == dst or src == "R":
        return 0.0
    step = (n - 1) / n / bw
    if src == "P":
        return LAUNCH + (2 if dst == "R" else 1) * step * nbytes  # all-reduce / reduce-scatter
    if dst == "R":
        return LAUNCH + step * nbytes  # all-gather
    return LAUNCH + step * nbytes / n  # all-to-all of the local shard


def _cheapest_materialisation(made, needed, nbytes, n, bw):
    """Brute force over every set of intermediate copies: each copy is made from the maker's
    layout once; each distinct needed layout is taken from the maker or from any copy."""
    layouts = ["R", "b", "s", "k"]
    best = float("inf")
    for mask in range(1 << len(layouts)):
        copies = [m for i, m in enumerate(layouts) if mask >> i & 1]
        cost = sum(_reshard_by_hand(made, m, nbytes, n, bw) for m in copies)
        cost += sum(min(_reshard_by_hand(src, q, nbytes, n, bw) for src in [made, *copies]) for q in set(needed))
        best = min(best, cost)
    return best


def test_a_tensor_read_by_several_ops_is_resharded_once_per_layout_brute_force():
    """Every assignment of the maker (R, S(b), S(s), S(k) or Partial over r) and of three readers
    (R or one of three Shards): the stage's cost equals the cheapest way to materialise the
    needed layouts, found by brute force over sets of intermediate copies — except in the one
    family the single layout node cannot express (intra._add_layout_hubs): a reader takes the
    maker's own Shard for free while two others share an all-to-all to a second Shard. There the
    node pays the cheaper of one all-gather and an all-to-all per reader."""
    import itertools
    n, bw = 4, 10e9
    graph, mesh = _fanout_graph(3), Cluster("row", 1, n, INSTANT, Link(bw, 0.0), Link(bw, 0.0)).logical_mesh((1, n), (1, n))
    nbytes = graph.nbytes("t")
    label = {None: "R", "r": "P"}
    shared = inexpressible = 0
    for made in (None, "b", "s", "k", "r"):
        for reads in itertools.combinations_with_replacement((None, "b", "s", "k"), 3):
            pinned = {"make": (None, made), **{f"read{i}": (None, d) for i, d in enumerate(reads)}}
            stage = intra.shard_stage(graph, mesh, restriction=intra.Restriction(
                lambda op, s: s.axes == pinned[op.name]), backend="highs")
            p, needed = label.get(made, made), [label.get(d, d) for d in reads]
            best = _cheapest_materialisation(p, needed, nbytes, n, bw)
            independent = sum(_reshard_by_hand(p, q, nbytes, n, bw) for q in needed)
            # each reader's output leaves the graph in the data-parallel layout S(b) (int32: no gradient)
            handed = sum(_reshard_by_hand(q, "b", nbytes, n, bw) for q in needed)
            shared += best < independent - 1e-12
            other = [q for q in needed if q != p]
            if p in ("b", "s", "k") and p in needed and len(other) == 2 and other[0] == other[1] != "R":
                inexpressible += 1
                gather, a2a = _reshard_by_hand(p, "R", nbytes, n, bw), _reshard_by_hand(p, other[0], nbytes, n, bw)
                assert best == pytest.approx(a2a)
                assert stage.objective == pytest.approx(min(gather, 2 * a2a) + handed, rel=1e-12), (made, reads)
            else:
                assert stage.objective == pytest.approx(best + handed, rel=1e-12, abs=1e-15), (made, reads)
    assert inexpressible == 6
    assert shared >= 40  # the sharing is exercised: e.g. S(b) read as R, R, S(s) pays one all-gather, not two + an all-to-all


def test_sequence_sharded_norm_output_is_gathered_once_for_q_and_the_key_value_reshape():
    """GPT's ln1 output feeds q and (through the s -> t reshape) k and v; sequence parallelism
    all-gathers it once forward (and reduce-scatters its summed gradient once backward)."""
    from partopt.models import gpt
    graph = gpt(hidden=256, layers=3, heads=4, seq=64, vocab=64, batch=1)
    ops = [op for op in graph.ops if op.layer == 1]
    sp = {"l1.ln1": (None, "s"), "l1.x_t": (None, None), "l1.q": (None, "n"), "l1.k": (None, "n"), "l1.v": (None, "n")}
    stage = intra.shard_stage(graph, row_mesh(4), ops, backend="highs", restriction=intra.Restriction(
        lambda op, s: op.name not in sp or s.axes == sp[op.name]))
    ln1 = next(c for c in stage.ops if c.op == "l1.ln1")
    a = graph.nbytes("l1.ln1")
    assert sorted(ln1.collectives) == [("all_gather", 1, a), ("reduce_scatter", 1, a)]


# ---------------------------------------------------------------- activation recomputation

def mlp_gelu(batch: int, hidden: int) -> Graph:
    """x[b,h0] -> fc0 -> gelu -> fc1 -> y1: fp32, square weights, no bias."""
    dims = {"b": batch, "h0": hidden, "h1": hidden, "h2": hidden}
    tensors = {"x": Tensor("x", ("b", "h0"), "input"), "w0": Tensor("w0", ("h0", "h1"), "param"),
               "w1": Tensor("w1", ("h1", "h2"), "param"), "y0": Tensor("y0", ("b", "h1")),
               "g": Tensor("g", ("b", "h1")), "y1": Tensor("y1", ("b", "h2"), "output")}
    ops = [Op("fc0", "einsum", ("x", "w0"), "y0", 0), Op("gelu", "elementwise", ("y0",), "g", 0, {"fn": "gelu"}),
           Op("fc1", "einsum", ("g", "w1"), "y1", 0)]
    return Graph("mlp-gelu", dims, tensors, ops, "b", "fp32")


def test_recompute_adds_the_forward_compute_and_forward_collectives_and_keeps_only_the_output():
    b, h, bw = 128, 1024, 10e9
    graph, mesh = mlp_gelu(b, h), row_mesh(bw=bw)
    megatron = {"fc0": (None, "h1"), "gelu": (None, "h1"), "fc1": (None, "h1")}
    pin = intra.Restriction(lambda op, s: s.axes == megatron[op.name])
    plain = intra.shard_stage(graph, mesh, restriction=pin)
    again = intra.shard_stage(graph, mesh, restriction=pin, recompute="full")
    assert axes_of(intra.shard_stage(graph, mesh)) == megatron  # the free optimum, without recompute
    matmuls = 2 * matmul_time(b, h, 4)  # forward + backward
    gelu = 2 * b * h / 4 / PEAK  # 1 FLOP per element, forward + backward, split 4 ways
    # the row-parallel output leaves batch-split: its sum is reduce-scattered forward (rerun by
    # recomputation) and its gradient all-gathered backward
    ring = LAUNCH + 3 / 4 * b * h * 4 / bw
    for stage in (plain, again):
        assert stage.breakdown.compute_s == pytest.approx(matmuls + gelu, rel=1e-12)
        assert stage.breakdown.comm_s == {"reduce_scatter": pytest.approx(ring, rel=1e-12),
                                          "all_gather": pytest.approx(ring, rel=1e-12)}
    assert plain.breakdown.recompute_s == 0.0
    assert again.breakdown.recompute_s == pytest.approx(matmuls / 3 + gelu / 2 + ring, rel=1e-12)
    assert again.objective == pytest.approx(plain.objective + matmuls / 3 + gelu / 2 + ring, rel=1e-12)
    assert again.breakdown.per_microbatch_s == pytest.approx(4 / 3 * matmuls + 3 / 2 * gelu + 3 * ring, rel=1e-12)

    quarter = b * h * 4 / 4
    # without recompute every output is kept: y0 and g column-split, y1 a full pending sum
    assert plain.breakdown.activation_bytes == pytest.approx(2 * quarter + 4 * quarter)
    # held once: the transient copy of y1's gradient all-gathered back from the batch split into
    # the full layout of its pending sum (b·h fp32 = 4 quarters; the reduce-scatter runs in place)
    assert plain.breakdown.transient_bytes == pytest.approx(4 * quarter)
    assert plain.breakdown.working_bytes == pytest.approx(4 * quarter)
    # with it only y1, which leaves the ops, in its layout; all three once while recomputing, plus the copy
    assert again.breakdown.activation_bytes == pytest.approx(4 * quarter)
    assert again.breakdown.working_bytes == pytest.approx(2 * quarter + 4 * quarter + 4 * quarter)


def test_recompute_makes_a_budget_feasible_that_is_not_without_it():
    b, h, inflight = 1024, 128, 4
    graph, mesh = mlp_gelu(b, h), row_mesh()
    params = 2 * 16 * h * h / 4  # the least: each weight's Adam state split 4 ways
    out = b * h * 4 / 4  # the least per output: split 4 ways
    without = params + inflight * 3 * out  # all three outputs kept per microbatch in flight
    with_recompute = params + inflight * out + 3 * out  # y1 kept per microbatch; all three once
    budget = (without + with_recompute) / 2
    with pytest.raises(InfeasibleError):
        intra.shard_stage(graph, mesh, inflight=inflight, memory_budget=budget)
    stage = intra.shard_stage(graph, mesh, inflight=inflight, memory_budget=budget, recompute="full")
    bd = stage.breakdown
    assert stage.memory_bytes == pytest.approx(bd.param_bytes + inflight * bd.activation_bytes + bd.working_bytes)
    assert with_recompute <= stage.memory_bytes <= budget
