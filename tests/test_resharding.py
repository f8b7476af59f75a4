"""Resharding on both mesh axes: each step's buffer is the layout the previous step left."""

import pytest
from test_intra import FAST

from partopt.cluster import Cluster, Link
from partopt.sharding import P, ParamStrategy, R, Shard, param_sync_collectives, reshard_collectives

KIB = 1024.0


def mesh(nodes: int, per_node: int, intra: float, inter: float):
    """A (nodes, per_node) logical mesh: axis 0 across nodes, axis 1 inside a node, no latency."""
    return Cluster("grid", nodes, per_node, FAST, Link(intra, 0.0), Link(inter, 0.0)).logical_mesh(
        (nodes, per_node), (nodes, per_node))


def test_a_gather_of_a_tensor_split_on_both_axes_moves_the_growing_buffer():
    """128 KiB split 4 × 2 and gathered whole: on axis 0 the 64 KiB that axis 1 still splits, then
    on axis 1 the whole 128 KiB (not 64 and 32 KiB from the source's layout); the ring bytes add up to
    the 112 KiB every device lacks (3/4 · 64 + 1/2 · 128)."""
    steps = reshard_collectives((Shard("a"), Shard("b")), (R, R), 128 * KIB, mesh(4, 2, 1e9, 1e9))
    assert steps == [("all_gather", 0, 64 * KIB), ("all_gather", 1, 128 * KIB)]
    assert sum((n - 1) / n * size for (_, _, size), n in zip(steps, (4, 2))) == pytest.approx(112 * KIB)


def test_the_cheaper_order_is_taken():
    """The step on the slow axis should carry the smaller buffer. Axis 0 slow: gather on it first
    (3/4 · 64 KiB on the slow link, against 3/4 · 128 KiB if second); axis 1 slow: gather on it first
    (1/2 · 32 KiB, against 1/2 · 128 KiB)."""
    slow_inter = reshard_collectives((Shard("a"), Shard("b")), (R, R), 128 * KIB, mesh(4, 2, 1e12, 1e6))
    assert [axis for _, axis, _ in slow_inter] == [0, 1]
    slow_intra = reshard_collectives((Shard("a"), Shard("b")), (R, R), 128 * KIB, mesh(4, 2, 1e6, 1e12))
    assert [axis for _, axis, _ in slow_intra] == [1, 0]


def test_one_axis_and_in_place_reductions_are_unchanged():
    grid = mesh(4, 2, 1e9, 1e9)
    assert reshard_collectives((Shard("a"), R), (R, R), 128 * KIB, grid) == [("all_gather", 0, 128 * KIB)]
    # an all-reduce keeps its buffer's size: both axes reduce the whole tensor
    assert reshard_collectives((P, P), (R, R), 128 * KIB, grid) == [("all_reduce", 0, 128 * KIB),
                                                                     ("all_reduce", 1, 128 * KIB)]


def zero_sync(grad, placement, zero_axes, grid):
    return param_sync_collectives(grad, ParamStrategy(placement, zero_axes, (0.0, 0.0, 0.0)), 128 * KIB, grid)


def test_zero_over_both_axes_reduce_scatters_the_fast_axis_first_and_gathers_it_last():
    """A Partial gradient of 128 KiB, ZeRO over a slow axis 0 (4 nodes) and a fast axis 1 (2 per node).
    Reduce-scatter on the fast axis first (128 KiB; 1/2 · 128 on the fast link), then the slow one on
    the 64 KiB left (3/4 · 64 on the slow link, against 3/4 · 128 the other way round); gathering
    the updated weights mirrors it: the slow axis on the 64 KiB buffer (its other axis still split),
    then the fast axis on the whole. The ring bytes add up to one flat ring over the 8 devices,
    2 · 7/8 · 128 KiB, where priced axis by axis from the gradient's layout they were
    2 · (3/4 + 1/2) · 128 KiB."""
    steps = zero_sync((P, P), (R, R), (0, 1), mesh(4, 2, 1e9, 1e6))
    assert steps == [("reduce_scatter", 1, 128 * KIB), ("reduce_scatter", 0, 64 * KIB),
                     ("all_gather", 0, 64 * KIB), ("all_gather", 1, 128 * KIB)]
    ring = {0: 3 / 4, 1: 1 / 2}
    assert sum(ring[axis] * size for _, axis, size in steps) == pytest.approx(2 * 7 / 8 * 128 * KIB)


def test_zero_on_one_axis_beside_an_all_reduce_on_the_other_shrinks_the_all_reduce():
    """ZeRO on the fast axis 1 only, a plain copy on the slow axis 0: reduce-scatter the fast axis
    (128 KiB), all-reduce the slow one on the 64 KiB share (2 · 3/4 · 64 on the slow link, against
    2 · 3/4 · 128 first), and all-gather the updated weights on the fast axis (128 KiB)."""
    steps = zero_sync((P, P), (R, R), (1,), mesh(4, 2, 1e9, 1e6))
    assert steps == [("reduce_scatter", 1, 128 * KIB), ("all_reduce", 0, 64 * KIB), ("all_gather", 1, 128 * KIB)]


def test_zero_on_one_axis_alone_and_complete_gradients_are_unchanged():
    grid = mesh(4, 2, 1e9, 1e6)
    # a reduce-scatter and an all-gather of the whole gradient: an all-reduce's bytes
    assert zero_sync((R, P), (R, R), (1,), grid) == [("reduce_scatter", 1, 128 * KIB), ("all_gather", 1, 128 * KIB)]
    # a complete gradient is sliced for free; only the updated weights are gathered
    assert zero_sync((R, R), (R, R), (0,), grid) == [("all_gather", 0, 128 * KIB)]
    # a gradient already split on the ZeRO axis keeps that split; the weights are gathered from it
    assert zero_sync((Shard("a"), P), (R, R), (0,), grid) == [("all_reduce", 1, 32 * KIB), ("all_gather", 0, 128 * KIB)]
