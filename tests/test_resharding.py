"""Resharding on both mesh axes: each step's buffer is the layout the previous step left."""

import pytest
from test_intra import FAST

from partopt.cluster import Cluster, Link
from partopt.sharding import P, R, Shard, reshard_collectives

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
