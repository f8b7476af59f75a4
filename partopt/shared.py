"""Parameters read by several priced layers (a tied embedding: the token table read by the embedding
and by the LM head): each layer's ILP prices its own copy, but a stage holds one.

Within one stage, every copy but the largest is taken back out (its weights, gradient and optimizer
state, its gradient synchronisation and optimizer step). A parameter also read by a layer of
another stage has a copy there too, and the two gradients are summed once per iteration — Megatron's
embedding all-reduce between the first and last pipeline stage — priced as a bucketed ring
all-reduce of the stage's local gradient over a group of 2 on the link between stages (docs/COSTMODEL.md §5).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from partopt import costmodel
from partopt.cluster import Link, MeshAxis
from partopt.graph import Graph, Op

ALL_REDUCE_KEY = "shared-parameter all_reduce"  # its row in a stage's sync breakdown


def shared_params(graph: Graph, units: Sequence[Sequence[Op]]) -> dict[str, tuple[int, ...]]:
    """Parameter -> the priced units (base layers) that read it, for those read by more than one."""
    readers: dict[str, list[int]] = defaultdict(list)
    for u, ops in enumerate(units):
        for tensor in dict.fromkeys(t for op in ops for t in op.inputs if graph.tensors[t].role == "param"):
            readers[tensor].append(u)
    return {t: tuple(us) for t, us in readers.items() if len(us) > 1}


@dataclass
class Correction:
    """What a stage's sums change by: parameter state by part (weights, gradients, optimizer) and
    per-iteration seconds by kind ("optimizer" for the optimizer step)."""

    state_bytes: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    sync_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def param_bytes(self) -> float:
        return sum(self.state_bytes)

    @property
    def iteration_s(self) -> float:
        return sum(self.sync_s.values())


def correction(row: Sequence, first: int, last: int, shared: dict[str, tuple[int, ...]], link: Link,
               devices: int) -> Correction | None:
    """The correction of a stage running units [first, last] whose costs are `row` (LayerCosts), or None.

    `link` joins the stages and `devices` is the stage's device count: when the link is a node's
    NIC shared by its devices, the stage's devices (up to a node's worth) all-reduce at once and share it.
    """
    result = None
    for tensor, units in shared.items():
        inside = [u for u in units if first <= u <= last]
        if not inside:
            continue
        result = result or Correction()
        copies = [_copy(row[u].sharding, tensor) for u in inside]
        keep = max(range(len(copies)), key=lambda k: (sum(copies[k][0]), -k))
        for k, (state, sync) in enumerate(copies):
            if k == keep:
                continue
            for part in range(3):
                result.state_bytes[part] -= state[part]
            for kind, seconds in sync.items():
                result.sync_s[kind] -= seconds
        if len(inside) < len(units):  # held by another stage too: the two gradients are summed
            gradient = copies[keep][0][1]
            sharing = devices if link.shared_by_node else 1
            group = MeshAxis(2, link.bandwidth / sharing, link.latency_s, crosses_nodes=True)
            result.sync_s[ALL_REDUCE_KEY] += costmodel.active().collective_time("all_reduce", gradient, group, calls=0)
    return result


def _copy(sharding, tensor: str) -> tuple[tuple[float, float, float], dict[str, float]]:
    """One unit's copy of `tensor`: its state bytes by part and its per-iteration seconds by kind."""
    state = next(p.strategy.state_bytes for p in sharding.params if p.tensor == tensor)
    return state, sharding.breakdown.param_sync_s.get(tensor, {})
