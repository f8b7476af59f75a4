"""The least-cost strategy per node of a cost graph with no memory row, by bucket elimination.

`ilp.solve` first eliminates the nodes with at most two neighbours, which keeps the graph pairwise;
what is left of a transformer layer (about 18 nodes, treewidth 4) still went to an ILP solver. Here
the rest goes too: each node in turn is minimised out of the sum of the tables that name it, leaving
one table over its neighbours (a factor of any arity), and the choices are read back in reverse. It is
exact (the optimum of the sum, no tolerance) and, when the tables stay small, far quicker than an
ILP solver (docs/benchmarks.md, "Exact elimination of the rest"); when they would not, `solve` says
so before doing any work and the caller runs the ILP.
"""

from __future__ import annotations

import math

import numpy as np

# table entries all the elimination steps together may build: at about 10⁷ a solve takes as long as
# HiGHS's (0.2 s on the largest GPT block ILPs of docs/benchmarks.md), below it far less
MAX_ENTRIES = 10_000_000


def order(sizes: list[int], edges: list[tuple[int, int]]) -> tuple[list[int], int]:
    """An elimination order (greedy: the node whose table over itself and its neighbours is least,
    the lowest index on ties) and the table entries it builds in all."""
    adj: dict[int, set[int]] = {n: set() for n in range(len(sizes))}
    for u, v in edges:
        adj[u].add(v)
        adj[v].add(u)
    out, entries = [], 0
    while adj:
        table = {n: sizes[n] * math.prod(sizes[m] for m in adj[n]) for n in adj}
        v = min(adj, key=lambda n: (table[n], n))
        entries += table[v]
        for m in adj[v]:
            adj[m].discard(v)
            adj[m].update(adj[v] - {m})
        del adj[v]
        out.append(v)
    return out, entries


def solve(costs: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray],
          max_entries: int | None = None) -> list[int] | None:
    """The strategy per node minimising sum costs[n][x_n] + sum edges[(u, v)][x_u, x_v] (ties: the lowest
    strategy index as eliminated), or None when the elimination would build more than `max_entries` entries
    (default `MAX_ENTRIES`)."""
    sizes = [len(c) for c in costs]
    sequence, entries = order(sizes, list(edges))
    if entries > (MAX_ENTRIES if max_entries is None else max_entries):
        return None
    factors: list[tuple[tuple[int, ...], np.ndarray]] = [((n,), np.asarray(c, dtype=float)) for n, c in enumerate(costs)]
    factors += [((u, v), np.asarray(m, dtype=float)) for (u, v), m in edges.items()]
    steps: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    for v in sequence:
        mine = [f for f in factors if v in f[0]]
        factors = [f for f in factors if v not in f[0]]
        scope = tuple(sorted({m for names, _ in mine for m in names} - {v})) + (v,)
        total = np.zeros([sizes[m] for m in scope])
        for names, table in mine:
            axes = sorted(range(len(names)), key=lambda a: scope.index(names[a]))
            shape = [sizes[m] if m in names else 1 for m in scope]
            np.add(total, np.transpose(table, axes).reshape(shape), out=total)
        best = total.argmin(axis=-1)  # the least read back through it: one pass over the table, not two
        steps.append((v, scope[:-1], best))
        factors.append((scope[:-1], np.take_along_axis(total, best[..., None], axis=-1)[..., 0]))
    choice: dict[int, int] = {}
    for v, neighbours, best in reversed(steps):
        choice[v] = int(best[tuple(choice[m] for m in neighbours)])
    return [choice[n] for n in range(len(costs))]
