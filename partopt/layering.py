"""Layers: the units the stage DP cuts between (DESIGN §6 step 1), and the units priced.

A graph's `layer` tags give its natural layers (a transformer block, a residual block). When a
graph has no tags (each op is then a layer), or more layers than asked for, consecutive layers
are grouped as Alpa's layer construction does: balanced FLOPs (within 25 % of the even share)
and the least traffic across the cuts. For pricing, a tagged layer that holds a copy of the
repeated block plus something else (GPT's first block with the embedding, its last with the
head) is split into that copy and the rest, so the copy shares the block's ILP.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partopt.errors import InstanceError
from partopt.graph import Graph, Op


@dataclass(frozen=True)
class Layering:
    """Base layers (each priced by its own ILP) and the DP's layers: [first, last] base-layer ranges.

    A DP layer never splits a tagged layer: the stage DP cuts between tags only."""

    base: list[list[Op]]
    groups: list[tuple[int, int]]

    def ops(self, group: int) -> list[Op]:
        first, last = self.groups[group]
        return [op for layer in self.base[first:last + 1] for op in layer]


def tagged_layers(graph: Graph) -> list[list[Op]]:
    """Ops grouped by their `layer` tag, in topological order; an untagged graph is one op per layer."""
    if all(op.layer is None for op in graph.ops):
        return [[op] for op in graph.order]
    groups: dict[int | None, list[Op]] = {}
    for op in graph.order:
        groups.setdefault(op.layer, []).append(op)
    return list(groups.values())


def balanced_groups(weights: list[float], count: int) -> list[tuple[int, int]]:
    """Cut a sequence into `count` contiguous [first, last] groups of nearly equal weight.

    Each cut falls at the item boundary nearest to a multiple of total/count, so the groups
    differ by at most one item's weight from the ideal share (equal items give equal groups).
    """
    n = len(weights)
    count = max(1, min(count, n))
    cumulative = np.cumsum(weights, dtype=float)
    total = cumulative[-1] if n else 0.0
    cuts, start = [], 0
    for k in range(1, count):
        target = total * k / count
        end = int(np.searchsorted(cumulative, target, side="left"))
        if end > start and target - cumulative[end - 1] <= cumulative[min(end, n - 1)] - target:
            end -= 1  # the boundary before the crossing item is nearer
        end = min(max(end, start), n - (count - k) - 1)  # leave at least one item per later group
        cuts.append((start, end))
        start = end + 1
    cuts.append((start, n - 1))
    return cuts


IMBALANCE = 0.25  # a DP layer may carry up to 25 % more than its even share of the FLOPs
BALANCE_WEIGHT = 1e-3  # among cuts of equal traffic, the more even grouping wins


def traffic_groups(weights: list[float], traffic: list[float], count: int,
                   slack: float = IMBALANCE) -> list[tuple[int, int]]:
    """Alpa's layer construction: `count` contiguous groups whose cuts carry the fewest bytes.

    `traffic[i]` is the bytes crossing a cut after item i. Each group may weigh at most
    (1 + slack) of the even share (or its heaviest item); among plans of equal traffic the most
    even one wins. A DP over (groups, last item); falls back to `balanced_groups` if no grouping
    fits the cap.
    """
    n = len(weights)
    count = max(1, min(count, n))
    w = np.asarray(weights, dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    ideal = prefix[-1] / count
    cap = (1 + slack) * max(ideal, float(w.max(initial=0.0)))
    scale = max(float(np.max(traffic, initial=0.0)), 1e-300)
    cut = np.concatenate([np.asarray(traffic, dtype=float) / scale, [0.0]])  # cost of cutting after item i
    f = np.full((count + 1, n), np.inf)
    back = np.zeros((count + 1, n), dtype=int)
    for j in range(n):
        if prefix[j + 1] <= cap:
            f[1, j] = BALANCE_WEIGHT * ((prefix[j + 1] - ideal) / max(ideal, 1e-300)) ** 2
    for k in range(2, count + 1):
        for j in range(k - 1, n):
            starts = np.arange(k - 2, j)  # the previous group ends at i; this one is i+1 .. j
            load = prefix[j + 1] - prefix[starts + 1]
            cost = f[k - 1, starts] + cut[starts] + BALANCE_WEIGHT * ((load - ideal) / max(ideal, 1e-300)) ** 2
            cost[load > cap] = np.inf
            best = int(np.argmin(cost))
            f[k, j], back[k, j] = cost[best], starts[best]
    if not np.isfinite(f[count, n - 1]):
        return balanced_groups(weights, count)
    groups, j = [], n - 1
    for k in range(count, 0, -1):
        i = int(back[k, j]) if k > 1 else -1
        groups.append((i + 1, j))
        j = i
    return groups[::-1]


def _cut_traffic(graph: Graph, layers: list[list[Op]]) -> list[float]:
    """Bytes of tensors made in layers ≤ i and read in layers > i, for each cut after layer i."""
    where = {op.output: i for i, ops in enumerate(layers) for op in ops}
    traffic = np.zeros(len(layers))
    for i, ops in enumerate(layers):
        for op in ops:
            for t in op.inputs:
                if t in where and where[t] < i:
                    traffic[where[t]:i] += graph.nbytes(t)
    return list(traffic)


def repeated_parts(graph: Graph, layer: list[Op], block: str, size: int) -> list[list[Op]]:
    """`layer` cut into [before, copy, after] around its first run of `size` ops hashing as `block`."""
    for start in range(len(layer) - size + 1):
        if graph.structural_hash(layer[start:start + size]) == block:
            return [part for part in (layer[:start], layer[start:start + size], layer[start + size:]) if part]
    return [layer]


def build_layers(graph: Graph, max_layers: int | None = None) -> Layering:
    """The graph's tagged layers, grouped to at most `max_layers` DP layers by balanced FLOPs."""
    if max_layers is not None and max_layers < 1:
        raise InstanceError(f"layers must be at least 1, got {max_layers}", "--layers", "give a positive count")
    tagged = tagged_layers(graph)
    hashes = [graph.structural_hash(ops) for ops in tagged]
    block = max(set(hashes), key=lambda h: (hashes.count(h), h))
    size = len(tagged[hashes.index(block)])
    split = [[ops] if h == block or hashes.count(block) < 2 or len(ops) <= size else repeated_parts(graph, ops, block, size)
             for ops, h in zip(tagged, hashes)]
    base = [part for parts in split for part in parts]
    first = np.cumsum([0] + [len(parts) for parts in split])  # tag i owns base layers first[i] .. first[i+1]-1
    if max_layers is None or len(tagged) <= max_layers:
        tag_groups = [(i, i) for i in range(len(tagged))]
    else:
        # A split layer weighs as its copy of the block: the embedding or head riding with it would
        # shift every cut by a fraction of a block, and then no uniform split of the blocks is left
        # for the stage DP (GPT-6.7B: 32 blocks and a block-sized head in 16 groups put 3 blocks in
        # one group, so 4 stages of 8 blocks could not be expressed). The DP still prices them.
        weighed = [next((part for part in parts if graph.structural_hash(part) == block), ops) if len(parts) > 1 else ops
                   for ops, parts in zip(tagged, split)]
        weights = [float(sum(graph.flops(op) for op in ops)) or 1.0 for ops in weighed]
        tag_groups = traffic_groups(weights, _cut_traffic(graph, tagged)[:-1], max_layers)
    return Layering(base, [(int(first[a]), int(first[b + 1]) - 1) for a, b in tag_groups])
