"""Resharding on both mesh axes: each step's buffer is the layout the previous step left."""

import math

import numpy as np
import pytest
from test_intra import FAST

from partopt.cluster import Cluster, Link
from partopt.sharding import P, R, ParamStrategy, Shard, param_sync_collectives, reshard_collectives

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


def owners(placement, sizes: dict[str, int], shape: tuple[int, int]) -> np.ndarray:
    """Brute force: the device (row-major index) holding each element of a tensor with dims `sizes`
    under a placement with no Replicate (a dim split on both axes: axis 0 the outer part, as DTensor)."""
    grids = np.meshgrid(*(np.arange(n) for n in sizes.values()), indexing="ij")
    coord = [np.zeros(grids[0].shape, dtype=int) for _ in shape]
    for dim, index in zip(sizes, grids):
        axes = [a for a, p in enumerate(placement) if p == Shard(dim)]
        part = index * math.prod(shape[a] for a in axes) // sizes[dim]  # which of the dim's pieces
        for a in reversed(axes):  # the inner axis takes the fastest-varying digit
            coord[a], part = part % shape[a], part // shape[a]
    return coord[0] * shape[1] + coord[1]


def sent_per_link(src, dst, sizes: dict[str, int], shape: tuple[int, int], itemsize: float,
                  slow: int) -> tuple[float, float]:
    """Brute force: bytes the busiest device sends to devices on another coordinate of axis `slow`
    (crossing its link) and to the others (along the other axis only), each element going from its
    holder to its reader."""
    frm, to = owners(src, sizes, shape).ravel(), owners(dst, sizes, shape).ravel()
    coordinate = (lambda d: d // shape[1]) if slow == 0 else (lambda d: d % shape[1])
    moving = frm != to
    crossing = moving & (coordinate(frm) != coordinate(to))
    devices = math.prod(shape)
    return (itemsize * np.bincount(frm[crossing], minlength=devices).max(),
            itemsize * np.bincount(frm[moving & ~crossing], minlength=devices).max())


def wire(steps, shape) -> list[float]:
    """Bytes each device sends per step: (n-1)/n of the step's buffer on an axis of n devices."""
    return [(shape[axis] - 1) / shape[axis] * size for _, axis, size in steps]


def test_an_all_to_all_over_both_axes_sends_what_each_device_lacks():
    """[S(a), S(a)] -> [S(c), S(c)] of 128 KiB on 4 x 2 devices: each device holds 16 KiB and sends a
    2 KiB block to each of the 7 others (14 KiB), 6 of them in other rows (12 KiB across axis 0: an
    all-to-all of 16 KiB there) and 1 in its own row (2 KiB along axis 1: an all-to-all of 4 KiB),
    not a second all-to-all of the whole 16 KiB (8 KiB on axis 1, what partopt priced before)."""
    sizes, shape = {"a": 128, "c": 256}, (4, 2)  # 128 × 256 fp32 = 128 KiB
    src, dst = (Shard("a"), Shard("a")), (Shard("c"), Shard("c"))
    steps = reshard_collectives(src, dst, 128 * KIB, mesh(4, 2, 1e12, 1e6))  # axis 0 across slow nodes
    assert steps == [("all_to_all", 0, 16 * KIB), ("all_to_all", 1, 4 * KIB)]
    assert wire(steps, shape) == [12 * KIB, 2 * KIB]
    assert sent_per_link(src, dst, sizes, shape, 4.0, slow=0) == (12 * KIB, 2 * KIB)  # brute force agrees
    assert sum(wire(steps, shape)) == 7 / 8 * 16 * KIB  # the pairwise exchange over all 8 devices


def test_the_slower_link_carries_the_blocks_for_devices_differing_on_both_axes():
    """With axis 1 slow, the blocks for the 4 devices of the other column cross it (8 KiB: an all-to-all
    of the whole 16 KiB on axis 1) and the 3 others of the own column take axis 0 (6 KiB: an all-to-all
    of 16/2 KiB). The cheaper order would put 1/2 · 4 KiB on the slow link, below the 8 KiB that must
    leave each device's column."""
    sizes, shape = {"a": 128, "c": 256}, (4, 2)
    src, dst = (Shard("a"), Shard("a")), (Shard("c"), Shard("c"))
    steps = reshard_collectives(src, dst, 128 * KIB, mesh(4, 2, 1e6, 1e12))
    assert steps == [("all_to_all", 1, 16 * KIB), ("all_to_all", 0, 8 * KIB)]
    assert wire(steps, shape) == [8 * KIB, 6 * KIB]
    assert sent_per_link(src, dst, sizes, shape, 4.0, slow=1) == (8 * KIB, 6 * KIB)


def test_fresh_dims_on_each_axis_are_one_all_to_all_too():
    """[S(a), S(b)] -> [S(c), S(d)] on 2 x 2: every device sends a quarter of its shard to each other."""
    sizes, shape = {"a": 4, "b": 4, "c": 4, "d": 4}, (2, 2)
    src, dst = (Shard("a"), Shard("b")), (Shard("c"), Shard("d"))
    steps = reshard_collectives(src, dst, 1024.0, mesh(2, 2, 1e9, 1e9))  # 256 fp32, 256 B per device
    assert steps == [("all_to_all", 0, 256.0), ("all_to_all", 1, 128.0)]
    assert sent_per_link(src, dst, sizes, shape, 4.0, slow=0) == tuple(wire(steps, shape)) == (128.0, 64.0)


def test_a_layout_that_reuses_a_source_dim_keeps_the_axis_steps():
    """[S(a), S(b)] -> [S(b), S(a)] on 2 x 2 is a transpose, not an even exchange: a device off the
    diagonal sends its whole 256 B shard to the one device across both axes, which the two steps'
    128 + 128 B cover (one all-to-all over the mesh would price 128 + 64 B)."""
    sizes, shape = {"a": 4, "b": 4, "c": 16}, (2, 2)
    src, dst = (Shard("a"), Shard("b")), (Shard("b"), Shard("a"))
    steps = reshard_collectives(src, dst, 1024.0, mesh(2, 2, 1e9, 1e9))
    assert steps == [("all_to_all", 0, 256.0), ("all_to_all", 1, 256.0)]
    assert sent_per_link(src, dst, sizes, shape, 1024.0 / 256, slow=0) == (256.0, 0.0)
    assert sum(wire(steps, shape)) == 256.0


def test_a_gradient_sync_that_changes_both_splits_is_the_same_exchange():
    """A parameter stored [S(c), S(c)] whose reader leaves its gradient [S(a), S(a)]: the sync is the
    resharding above (16 KiB on the slow axis 0, 4 KiB on axis 1), not two whole-shard all-to-alls."""
    grid = mesh(4, 2, 1e12, 1e6)
    stored = ParamStrategy((Shard("c"), Shard("c")), (), (0.0, 0.0, 0.0))
    assert param_sync_collectives((Shard("a"), Shard("a")), stored, 128 * KIB, grid) == [
        ("all_to_all", 0, 16 * KIB), ("all_to_all", 1, 4 * KIB)]


def test_a_zero_axis_reduce_scatters_the_gradient_and_gathers_the_weights_at_their_own_widths():
    """Megatron-LM's distributed optimizer on bf16 weights: the gradient (fp32, 4 B per element) is reduce-scattered
    over the data-parallel axis, the updated weights (bf16, 2 B) all-gathered; without `weight_bytes` both move the
    gradient's bytes. A replicated weight of 1 Mi elements on a (4, 2) mesh, its gradient a pending sum on axis 0."""
    grid = mesh(4, 2, 1e12, 1e12)
    stored = ParamStrategy((R, R), (0,), (0.0, 0.0, 0.0))
    elements = 2**20
    assert param_sync_collectives((P, R), stored, 4 * elements, grid, 2 * elements) == [
        ("reduce_scatter", 0, 4 * elements), ("all_gather", 0, 2 * elements)]
    assert param_sync_collectives((P, R), stored, 4 * elements, grid) == [
        ("reduce_scatter", 0, 4 * elements), ("all_gather", 0, 4 * elements)]
