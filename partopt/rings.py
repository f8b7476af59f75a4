"""How many rings a group of devices can run at once over a node's point-to-point lanes.

A node without a switch (the hybrid cube-mesh of DGX-1 and AWS p3.16xlarge) wires each pair of its devices
with 0, 1 or 2 NVLink lanes. A collective among a group runs as rings through every member (NCCL's
channels); each lane carries one ring per direction, so the group's bandwidth is one lane's times the
number of rings its lanes carry at once (docs/COSTMODEL.md §2, "Lanes").
"""

from __future__ import annotations

from functools import lru_cache
from itertools import permutations

Lanes = tuple[tuple[int, ...], ...]  # lanes[i][j]: lanes between devices i and j of a node, symmetric

MAX_RING_MEMBERS = 8  # the rings of a group are enumerated: (n - 1)! of them, 5,040 for 8 devices
# The most lanes between two devices: a GPU has at most 18 NVLinks (H100). `ring_count` recurses once per ring
# taken, at most a device's lanes (7 · 18) deep; 10**30 lanes overflowed the stack
MAX_LANES = 18


def ring_cycles(lanes: Lanes, members: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every directed ring through all of `members` whose hops each have a lane, as the order of its
    devices from members[0] (a ring of two is the pair there and back)."""
    first, rest = members[0], members[1:]
    return [(first, *order) for order in permutations(rest)
            if all(lanes[a][b] > 0 for a, b in _hops((first, *order)))]


@lru_cache(maxsize=None)
def ring_count(lanes: Lanes, members: tuple[int, ...]) -> int:
    """The most directed rings through every device of `members` that `lanes` carry at once, each lane
    carrying one ring per direction: exact, by a depth-first search over the rings of `ring_cycles` (each taken
    any number of times, in their order), cut where the rings taken plus the fewest lanes any member has left
    cannot beat the best found (pure Python: pricing must not load another solver than the one a solve uses)."""
    if len(members) < 2:
        return 0
    cycles = [_hops(c) for c in ring_cycles(lanes, members)]
    left = {(a, b): lanes[a][b] for a in members for b in members if a != b}
    best = 0

    def room() -> int:  # rings that may still leave every member: its lanes not yet taken
        return min(sum(left[a, b] for b in members if b != a) for a in members)

    def search(start: int, taken: int) -> None:
        nonlocal best
        best = max(best, taken)
        if taken + room() <= best:
            return
        for k in range(start, len(cycles)):
            hops = cycles[k]
            if all(left[hop] > 0 for hop in hops):
                for hop in hops:
                    left[hop] -= 1
                search(k, taken + 1)
                for hop in hops:
                    left[hop] += 1

    search(0, 0)
    return best


def _hops(cycle: tuple[int, ...]) -> list[tuple[int, int]]:
    """The directed hops of a ring: each device to the next, the last back to the first."""
    return [(cycle[k], cycle[(k + 1) % len(cycle)]) for k in range(len(cycle))]
