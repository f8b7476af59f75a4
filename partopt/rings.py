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


def ring_cycles(lanes: Lanes, members: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every directed ring through all of `members` whose hops each have a lane, as the order of its
    devices from members[0] (a ring of two is the pair there and back)."""
    first, rest = members[0], members[1:]
    return [(first, *order) for order in permutations(rest)
            if all(lanes[a][b] > 0 for a, b in _hops((first, *order)))]


@lru_cache(maxsize=None)
def ring_count(lanes: Lanes, members: tuple[int, ...]) -> int:
    """The most directed rings through every device of `members` that `lanes` carry at once, each lane
    carrying one ring per direction (an integer program over the rings of `ring_cycles`, exact)."""
    if len(members) < 2:
        return 0
    cycles = ring_cycles(lanes, members)
    if not cycles:
        return 0
    from ortools.sat.python import cp_model  # here, not at import: every command loads clusters, few price lanes

    model = cp_model.CpModel()
    uses = [model.new_int_var(0, min(lanes[a][b] for a, b in _hops(c)), f"ring{k}") for k, c in enumerate(cycles)]
    load: dict[tuple[int, int], list] = {}
    for use, cycle in zip(uses, cycles):
        for hop in _hops(cycle):
            load.setdefault(hop, []).append(use)
    for (a, b), users in load.items():
        model.add(sum(users) <= lanes[a][b])
    model.maximize(sum(uses))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # deterministic, and the programs are tiny
    status = solver.solve(model)
    assert status == cp_model.OPTIMAL, solver.status_name(status)  # a bounded program with 0 feasible
    return round(solver.objective_value)


def _hops(cycle: tuple[int, ...]) -> list[tuple[int, int]]:
    """The directed hops of a ring: each device to the next, the last back to the first."""
    return [(cycle[k], cycle[(k + 1) % len(cycle)]) for k in range(len(cycle))]
