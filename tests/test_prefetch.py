"""Weight gathers prefetched under compute (ZeRO-3/FSDP, docs/COSTMODEL.md §5b "Weight gathers prefetched").

The test device of tests/test_intra.py is compute bound with latency-free links, so each figure is
written out by hand: a matmul of the FSDP MLP computes c = 6·b·h²/4 / peak per device (forward c/3,
backward 2c/3), and each weight (W bytes, stored split 4 ways) is all-gathered forward and backward,
g = launch + (3/4)·W / bw each, and its gradient reduce-scattered into the stored split after the
backward, the same g (a ring moves (3/4)·W either way). Prefetched, the forward's gather costs only
max(0, g − cover) and the backward's gather and reduce-scatter max(0, 2g − cover), the cover being
its consumer's forward or backward compute.
"""

import pytest

from partopt import intra, models
from partopt.cluster import preset
from partopt.sharding import R, Shard

from test_intra import LAUNCH, PEAK, mlp, row_mesh
from test_memory_transients import pinned

B, H = 4096, 1024
W = H * H * 4
C = 6 * B * H * H / 4 / PEAK  # one op's forward + backward compute per device


def fsdp(bw: float, prefetch: bool):
    graph, mesh = mlp(2, B, H), row_mesh(4, bw)
    dp = (None, "b")
    restriction = pinned({"fc0": dp, "fc1": dp}, {"w0": ((R, Shard("h0")), ()), "w1": ((R, Shard("h1")), ())})
    return intra.shard_stage(graph, mesh, restriction=restriction, prefetch=prefetch)


@pytest.mark.parametrize("bw, exposed_per_op", [
    # g = launch + 3 MiB / 1 GB/s ≈ 3.1 ms: above the forward's c/3 ≈ 2.1 ms; 2g above the backward's 2c/3 ≈ 4.3 ms
    (1e9, lambda g: (g - C / 3) + (2 * g - 2 * C / 3)),
    # g ≈ 0.3 ms: both sides hidden
    (1e10, lambda g: 0.0),
    # g ≈ 31 ms: both exposed beyond their covers
    (1e8, lambda g: (g - C / 3) + (2 * g - 2 * C / 3)),
])
def test_a_prefetched_gather_costs_what_its_consumers_compute_does_not_hide(bw, exposed_per_op):
    g = LAUNCH + 3 / 4 * W / bw
    additive, prefetched = fsdp(bw, prefetch=False), fsdp(bw, prefetch=True)
    assert additive.breakdown.per_microbatch_s == pytest.approx(2 * C + 2 * 3 * g, rel=1e-9)
    assert prefetched.breakdown.per_microbatch_s == pytest.approx(2 * C + 2 * exposed_per_op(g), rel=1e-9)
    # the gathers and reductions stay listed in full; what prefetching hides is its own figure
    assert prefetched.breakdown.comm_s == pytest.approx(additive.breakdown.comm_s, rel=1e-12)
    assert prefetched.breakdown.prefetched_s == pytest.approx(2 * (3 * g - exposed_per_op(g)), rel=1e-9)
    # the ILP prices the decoded assignment alike (microbatches = 1: per iteration adds once)
    for stage in (additive, prefetched):
        assert stage.objective == pytest.approx(stage.breakdown.per_microbatch_s + stage.breakdown.per_iteration_s,
                                                rel=1e-9)


def test_a_replicated_weight_has_nothing_to_prefetch():
    graph, mesh = mlp(2, B, H), row_mesh(4, 1e9)
    dp = (None, "b")
    restriction = pinned({"fc0": dp, "fc1": dp}, {"w0": ((R, R), ()), "w1": ((R, R), ())})
    stage = intra.shard_stage(graph, mesh, restriction=restriction, prefetch=True)
    assert stage.breakdown.prefetched_s == 0.0
    assert stage.breakdown.per_microbatch_s == pytest.approx(2 * C, rel=1e-9)


def test_prefetching_never_prices_a_stage_dearer_and_changes_nothing_without_gathers():
    """Costs only fall (a gather's exposed part is at most the gather), so the optimum cannot rise;
    with memory to spare on one device there is no gather and both optima are equal."""
    graph = intra.with_batch(models.gpt(hidden=512, layers=2, heads=8, seq=256, vocab=4096, batch=16), 4)
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 8), (1, 8))
    free = {p: intra.shard_stage(graph, mesh, prefetch=p).objective for p in (False, True)}
    assert free[True] <= free[False] * (1 + 1e-12)
    one = preset("p3.16xlarge", 1).logical_mesh((1, 1), (1, 1))
    assert intra.shard_stage(graph, one, prefetch=True).objective == pytest.approx(
        intra.shard_stage(graph, one, prefetch=False).objective, rel=1e-12)
