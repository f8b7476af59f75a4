"""Rings over a node's point-to-point lanes: hand-derived counts on the hybrid cube-mesh of a p3.16xlarge / DGX-1V
node, and brute force on small random wirings."""

import itertools
import random

import pytest

from partopt.cluster import HYBRID_CUBE_MESH as CUBE
from partopt.rings import ring_count, ring_cycles


def test_a_pair_runs_one_ring_per_lane():
    assert ring_count(CUBE, (0, 1)) == 1  # NV1
    assert ring_count(CUBE, (0, 3)) == 2  # NV2
    assert ring_count(CUBE, (0, 5)) == 0  # SYS: no lane


def test_a_quad_runs_four_rings():
    # Inside quad {0,1,2,3}, device 0 has 1 + 1 + 2 = 4 lanes, so at most 4 rings leave it. Four fit: the undirected
    # cycles 0-1-2-3-0 and 0-2-1-3-0 (lanes 0-3 and 1-2 used twice, each has 2), each run in both directions.
    assert ring_count(CUBE, (0, 1, 2, 3)) == 4
    assert ring_count(CUBE, (4, 5, 6, 7)) == 4


def test_a_group_with_one_cycle_runs_two_rings_whatever_its_lanes():
    # {0,1,4,5}: 0-5 and 1-4 have no lane, so 0-1-5-4-0 is the only cycle; every member has 3 lanes in the group,
    # but lanes 0-1 and 4-5 are single: the cycle one way and back, 2 rings.
    assert ring_cycles(CUBE, (0, 1, 4, 5)) == [(0, 1, 5, 4), (0, 4, 5, 1)]
    assert ring_count(CUBE, (0, 1, 4, 5)) == 2
    assert ring_count(CUBE, (0, 2, 4, 6)) == 2  # 0-2-6-4-0, single lanes 0-2, 2-6, 6-4


def test_the_whole_node_runs_six_rings():
    # 6 lanes per device bound it; three lane-disjoint Hamiltonian cycles, each run both ways, reach it.
    cycles = [(0, 1, 2, 3, 7, 5, 6, 4), (0, 2, 6, 7, 4, 5, 1, 3), (0, 3, 2, 1, 5, 6, 7, 4)]
    used = {}
    for cycle in cycles:
        assert sorted(cycle) == list(range(8))
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            used[min(a, b), max(a, b)] = used.get((min(a, b), max(a, b)), 0) + 1
    assert all(n <= CUBE[a][b] for (a, b), n in used.items())
    assert ring_count(CUBE, tuple(range(8))) == 6


def _brute_force(lanes, members):
    """The most rings by trying every number of uses of every directed ring (each at most 2)."""
    cycles = ring_cycles(lanes, members)
    best = 0
    for uses in itertools.product(range(3), repeat=len(cycles)):
        load = {}
        for n, cycle in zip(uses, cycles):
            for a, b in zip(cycle, cycle[1:] + cycle[:1]):
                load[a, b] = load.get((a, b), 0) + n
        if all(n <= lanes[a][b] for (a, b), n in load.items()):
            best = max(best, sum(uses))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_ring_count_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4])
    lanes = [[0] * n for _ in range(n)]
    for i, j in itertools.combinations(range(n), 2):
        lanes[i][j] = lanes[j][i] = rng.choice([0, 1, 1, 2])
    lanes = tuple(map(tuple, lanes))
    assert ring_count(lanes, tuple(range(n))) == _brute_force(lanes, tuple(range(n)))
