"""The backward half of a stage's edges: gradient contributions are summed, then completed once.

A tensor read by several ops receives one gradient from each. Frameworks add them locally and
reduce the sum once (Megatron: one all-reduce for the input of the Q, K and V projections, not
three). For each such tensor a *gradient-sum* node chooses the placement of the sum (Partial
allowed); the ILP pays `reshard(contribution -> sum)` per consumer and `reshard(sum -> what the
producer needs)` once, the DESIGN §4 table applied to the sum. A reshape only relabels dims, so
its output's gradient sum passes on to its input's sum, renamed, Partial or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from partopt.cluster import LogicalMesh
from partopt.graph import Graph, Op
from partopt.ops import reshape_outer
from partopt.sharding import (
    PairPrices,
    Placement,
    R,
    Shard,
    Step,
    as_gradient_target,
    gradient_placement,
    reshard_collectives,
    tensor_placements,
)

class EdgeUse(Protocol):
    tensor: str
    src: int
    dst: int
    slot: int
    param: bool


@dataclass(frozen=True)
class Flow:
    """A gradient moving along one ILP edge.

    kind "contribute": consumer op node `src` (input `slot`) -> sum node `dst` of `tensor`;
    "relay": sum node of a reshape's output `tensor` -> sum node of its input (dims renamed);
    "sink": sum node of `tensor` -> its producer node. `owner` is the op node whose output the
    gradient belongs to (for explanations), or None.
    """

    kind: str
    tensor: str
    src: int
    dst: int
    slot: int = 0
    rename: tuple[tuple[str, str], ...] = ()
    owner: int | None = None


@dataclass(frozen=True)
class Sums:
    """Sum nodes to add (tensor, placements; node ids from `first_node` on), their flows, and the
    uses whose gradient now travels through them instead of along the use's own edge."""

    nodes: list[tuple[str, list[Placement]]]
    flows: list[Flow]
    forward_only: set[int]


def _relaying(graph: Graph, op: Op, uses_of: Mapping[str, list[int]]) -> bool:
    """A reshape whose float output is read inside the stage passes gradients on without a reduction."""
    return op.kind == "reshape" and bool(uses_of.get(op.output)) and _is_float(graph, op.output)


def _is_float(graph: Graph, tensor: str) -> bool:
    return not graph.dtype_of(tensor).startswith(("int", "bool"))


def plan(graph: Graph, uses: Sequence[EdgeUse], op_of_node: Mapping[int, Op], producer: Mapping[str, int],
         first_node: int, mesh: LogicalMesh) -> Sums:
    """Which tensors get a gradient-sum node and how gradients flow into and out of them.

    `producer` maps each tensor made inside the stage to its node (op or boundary node);
    `op_of_node` maps op nodes to their ops. A tensor gets a sum node when two or more gradients
    reach it, when a reshape reads it, or when a relaying reshape makes it.
    """
    uses_of: dict[str, list[int]] = {}
    for i, use in enumerate(uses):
        if not use.param and _is_float(graph, use.tensor):
            uses_of.setdefault(use.tensor, []).append(i)
    relays = {n for n, op in op_of_node.items() if _relaying(graph, op, uses_of)}
    made_by_relay = {op_of_node[n].output: n for n in relays}
    needs = [t for t, idx in uses_of.items()
             if len(idx) > 1 or t in made_by_relay or any(uses[i].dst in relays for i in idx)]
    sum_node = {t: first_node + k for k, t in enumerate(needs)}
    nodes = [(t, tensor_placements(graph, t, mesh, partial=True)) for t in needs]
    flows: list[Flow] = []
    forward_only: set[int] = set()
    for t in needs:
        owner = producer.get(t)
        for i in uses_of[t]:
            use = uses[i]
            forward_only.add(i)
            if use.dst not in relays:
                flows.append(Flow("contribute", t, use.dst, sum_node[t], use.slot, owner=owner))
        if t in made_by_relay:
            reshape = op_of_node[made_by_relay[t]]
            source = reshape.inputs[0]
            if source in sum_node:
                rename = reshape_outer(reshape)
                pairs = tuple((d, d if d in graph.tensors[source].dims else rename.get(d, d))
                              for d in graph.tensors[t].dims)
                flows.append(Flow("relay", t, sum_node[t], sum_node[source], rename=pairs,
                                  owner=producer.get(source)))
        elif owner is not None:
            flows.append(Flow("sink", t, sum_node[t], owner, owner=owner))
    return Sums(nodes, flows, forward_only)


def _relabel(graph: Graph, flow: Flow, placement: Placement, mesh: LogicalMesh) -> tuple[list[Step], Placement]:
    """Collectives and target-space placement of a reshape output's gradient sum, seen as its input's.

    A Shard on a dim with no place in the input (an inner part of a split), or one that stops
    dividing, is gathered first.
    """
    target_dims = graph.tensors[_source_of(graph, flow)].dims
    mapping = dict(flow.rename)
    usable: list = []
    split: dict[str, int] = {}
    for p, size in zip(placement, mesh.shape):
        if isinstance(p, Shard):
            d = mapping.get(p.dim)
            if d in target_dims and graph.dims[d] % (split.get(d, 1) * size) == 0:
                split[d] = split.get(d, 1) * size
                usable.append(Shard(d))
                continue
            usable.append(None)
        else:
            usable.append(p)
    kept = tuple(p if u is not None else R for p, u in zip(placement, usable))
    steps = reshard_collectives(placement, kept, graph.nbytes(flow.tensor), mesh)
    return steps, tuple(u if u is not None else R for u in usable)


def _source_of(graph: Graph, flow: Flow) -> str:
    return graph.producers[flow.tensor].inputs[0]


def plain_ends(flow: Flow, srcs: Sequence, dsts: Sequence) -> tuple[list[Placement], list[Placement]]:
    """A contribution's or a sink's gradient, which is one plain resharding: the placement it leaves each
    source choice in, and the one each destination choice needs it in (`collectives`)."""
    if flow.kind == "contribute":  # from the consumer's gradient to the sum node's choice
        return [gradient_placement(s.inputs[flow.slot], s.axes) for s in srcs], list(dsts)
    assert flow.kind == "sink", flow.kind
    return list(srcs), [as_gradient_target(d.output) for d in dsts]  # from the sum to its producer


def relay_ends(graph: Graph, flow: Flow, srcs: Sequence[Placement],
               mesh: LogicalMesh) -> tuple[list[list[Step]], list[Placement], int]:
    """A relay's gradient, per source choice: the steps that gather what its input cannot hold, and the placement
    the sum then has in the input's dims; and the input's bytes (`collectives` reshards it from there)."""
    relabelled = [_relabel(graph, flow, s, mesh) for s in srcs]
    return [steps for steps, _ in relabelled], [p for _, p in relabelled], graph.nbytes(_source_of(graph, flow))


def collectives(graph: Graph, flow: Flow, src, dst, mesh: LogicalMesh, prices: PairPrices | None = None) -> list[Step]:
    """Collectives of one flow, per microbatch, for the source and destination choices (`prices`:
    memoised resharding on `mesh`, as a stage's cost graph asks for it many times)."""
    def reshard(a: Placement, b: Placement, nbytes: float) -> list[Step]:
        return list(prices.reshard(a, b, nbytes)) if prices is not None else reshard_collectives(a, b, nbytes, mesh)

    if flow.kind == "relay":
        (steps,), (relabelled,), nbytes = relay_ends(graph, flow, [src], mesh)
        return steps + reshard(relabelled, dst, nbytes)
    (a,), (b,) = plain_ends(flow, [src], [dst])
    return reshard(a, b, graph.nbytes(flow.tensor))
