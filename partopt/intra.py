"""Intra-operator parallelism: the best sharding of a stage's ops on one logical mesh (DESIGN §4–§5).

`build` turns (graph, ops, mesh) into an `ilp.CostGraph` — one node per op and per parameter,
one edge per tensor use — whose costs are per microbatch (forward + backward + resharding)
plus the per-iteration gradient synchronisation and optimizer step divided by the number of
microbatches. `shard_stage` solves it and decodes the choice into strategies, a cost breakdown
and a readable explanation per op.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from partopt import costmodel, gradients, ilp
from partopt.cluster import LogicalMesh
from partopt.errors import InfeasibleError
from partopt.graph import Graph, Op
from partopt.units import fmt_bytes, fmt_seconds
from partopt.sharding import (
    ParamStrategy, Placement, Strategy, as_gradient_target, collectives_time, fmt,
    gradient_placement, op_strategies, param_strategies, param_sync_collectives,
    Shard, reshard_collectives, shards, tensor_placements,
)

def with_batch(graph: Graph, batch: int) -> Graph:
    """The same graph with its batch dim resized (a microbatch's view of the model).

    Dims a reshape derives from the batch (MoE's tokens `bs = b·s`, its groups `g`) scale with
    it: a whole dim scales with a scaled part, and an outermost part with a scaled whole.
    """
    if graph.batch_dim is None or graph.dims[graph.batch_dim] == batch:
        return graph
    old = graph.dims[graph.batch_dim]
    scaled = {graph.batch_dim}
    changed = True
    while changed:
        changed = False
        for op in graph.ops:
            for direction in ("split", "merge"):
                for whole, parts in (op.attrs.get(direction) or {}).items():
                    if whole not in scaled and any(p in scaled for p in parts):
                        scaled.add(whole)
                        changed = True
                    elif whole in scaled and not any(p in scaled for p in parts):
                        scaled.add(parts[0])
                        changed = True
    dims = dict(graph.dims)
    for d in scaled:
        if dims[d] * batch % old:
            raise InfeasibleError(f"dim {d!r} ({dims[d]}) does not scale with a microbatch of {batch}",
                                  graph.name, "use a microbatch count that keeps derived dims whole")
        dims[d] = dims[d] * batch // old
    return dataclasses.replace(graph, dims=dims)


@dataclass(frozen=True)
class Use:
    """One edge of the stage: tensor `tensor` flows from node `src` into input `slot` of op node `dst`."""

    tensor: str
    src: int
    dst: int
    slot: int
    param: bool
    gradient: bool = True  # False: the gradient travels through the tensor's gradient-sum node


@dataclass
class StageModel:
    """The cost graph of a stage together with what its nodes and edges mean."""

    graph: Graph
    mesh: LogicalMesh
    ops: list[Op]
    params: list[str]
    strategies: list[list]  # per node: list[Strategy] for ops, list[ParamStrategy] for params
    uses: list[Use]
    costs: ilp.CostGraph
    microbatches: int
    inflight: int
    flows: list[gradients.Flow] = field(default_factory=list)  # gradients into and out of sum nodes


def _is_float(graph: Graph, tensor: str) -> bool:
    return not graph.dtype_of(tensor).startswith(("int", "bool"))


def _use_collectives(model_graph: Graph, use: Use, src_strategy, dst_strategy: Strategy,
                     mesh: LogicalMesh) -> tuple[list, list]:
    """(collectives per microbatch, collectives per iteration) of one tensor use."""
    nbytes = model_graph.nbytes(use.tensor)
    required = dst_strategy.inputs[use.slot]
    differentiable = _is_float(model_graph, use.tensor)
    grad = gradient_placement(required, dst_strategy.axes)
    if use.param:
        p: ParamStrategy = src_strategy
        gather = reshard_collectives(p.placement, required, nbytes, mesh)
        per_mb = gather * 2  # gathered for the forward and again for the backward (FSDP-style)
        per_it = param_sync_collectives(grad, p, nbytes, mesh) if differentiable else []
        return per_mb, per_it
    out: Placement = src_strategy.output
    per_mb = reshard_collectives(out, required, nbytes, mesh)
    if differentiable and use.gradient:
        per_mb = per_mb + reshard_collectives(grad, as_gradient_target(out), nbytes, mesh)
    return per_mb, []


def _sizes(graph: Graph, tensor: str) -> tuple[int, ...]:
    return tuple(graph.dims[d] for d in graph.tensors[tensor].dims)


def _boundary_pairs(graph: Graph, ops: Sequence[Op], inside: set[str]) -> dict[str, str]:
    """Outputs leaving the ops paired with an incoming activation of the same shape (in order).

    A layer of a repeated block hands its output to the next copy of itself: pricing the pair
    as one tensor whose layout the ILP chooses makes a layer's cost include its boundary
    resharding exactly once, so per-layer costs add up to a stage's.
    """
    incoming = [t for op in ops for t in op.inputs
                if graph.tensors[t].role == "activation" and t in graph.producers
                and graph.producers[t].name not in inside and _is_float(graph, t)]
    incoming = list(dict.fromkeys(incoming))
    pairs: dict[str, str] = {}
    for op in ops:
        consumers = graph.consumers[op.output]
        if consumers and not any(c.name in inside for c in consumers):
            match = next((t for t in incoming if _sizes(graph, t) == _sizes(graph, op.output)), None)
            if match is not None:
                pairs[op.output] = match
                incoming.remove(match)
    return pairs


def _leaving(graph: Graph, op: Op, strategy: Strategy, mesh: LogicalMesh) -> list[tuple[str, int, float]]:
    """Collectives that complete an output leaving the stage (or the graph): pending sums are reduced."""
    out = strategy.output
    return reshard_collectives(out, as_gradient_target(out), graph.nbytes(op.output), mesh)


def _edge_cost(model_graph: Graph, use: Use, src_list: list, dst_list: list[Strategy],
               mesh: LogicalMesh, microbatches: int) -> np.ndarray:
    cache: dict[tuple, float] = {}
    matrix = np.zeros((len(src_list), len(dst_list)))
    for a, s in enumerate(src_list):
        skey = (s.placement, s.zero_axes) if use.param else s.output
        for b, d in enumerate(dst_list):
            key = (skey, d.inputs[use.slot], d.axes)
            if key not in cache:
                per_mb, per_it = _use_collectives(model_graph, use, s, d, mesh)
                cache[key] = collectives_time(per_mb, mesh) + collectives_time(per_it, mesh) / microbatches
            matrix[a, b] = cache[key]
    return matrix


def optimizer_step_time(graph: Graph, tensor: str, strategy: ParamStrategy, mesh: LogicalMesh) -> float:
    """Seconds of the per-iteration optimizer update of one parameter (memory bound)."""
    state = costmodel.param_memory(graph.numel(tensor), graph.dtype_of(tensor)).total
    local = state / shards(strategy.placement, mesh) / max(1, np.prod([mesh.shape[i] for i in strategy.zero_axes]))
    return costmodel.compute_time(0.0, 2 * local, mesh.device, graph.dtype_of(tensor), matmul=False)


@dataclass(frozen=True)
class Restriction:
    """Which strategies a stage may use: a predicate per op and per parameter (default: all).

    Evaluating a given plan pins each op to one strategy; a Megatron-style plan fixes one axis to
    data parallelism. A node left with no strategy is an error that names it.
    """

    op: Callable[[Op, Strategy], bool] = lambda op, strategy: True
    param: Callable[[str, ParamStrategy], bool] = lambda tensor, strategy: True
    reason: str = "the requested strategy"


def _kept(options: list, keep, name: str, restriction: Restriction) -> list:
    options = [s for s in options if keep(s)]
    if not options:
        raise InfeasibleError(f"{name} has no strategy allowed by {restriction.reason}", name,
                              "check the plan's placements against the op's dims and the mesh")
    return options


def build(graph: Graph, mesh: LogicalMesh, ops: Sequence[Op] | None = None, microbatches: int = 1,
          inflight: int = 1, allow_zero: bool = True, data_parallel: bool = False,
          restriction: Restriction | None = None) -> StageModel:
    """The stage's cost graph; `graph` must already be at microbatch size (see `with_batch`).

    `data_parallel` restricts every op to splitting the batch dim and every parameter to copies;
    `restriction` filters strategies further.
    """
    restriction = restriction or Restriction()
    force_dim = graph.batch_dim if data_parallel else None
    ops = list(graph.order if ops is None else ops)
    costs = ilp.CostGraph()
    strategies: list[list] = []
    node_of_op: dict[str, int] = {}
    inside = {op.name for op in ops}
    boundary = _boundary_pairs(graph, ops, inside)
    for op in ops:
        options = _kept(op_strategies(graph, op, mesh, force_dim), lambda s: restriction.op(op, s), op.name, restriction)
        leaves = op.output not in boundary and not any(c.name in inside for c in graph.consumers[op.output])
        node_of_op[op.output] = costs.add_node(
            op.name, [s.compute_s + s.comm_s + (collectives_time(_leaving(graph, op, s, mesh), mesh) if leaves else 0.0)
                      for s in options],
            [s.memory_bytes * inflight for s in options])
        strategies.append(options)

    params: list[str] = []
    node_of_param: dict[str, int] = {}
    uses: list[Use] = []
    for op in ops:
        for slot, tensor in enumerate(op.inputs):
            if graph.tensors[tensor].role == "param":
                if tensor not in node_of_param:
                    options = _kept(param_strategies(graph, graph.tensors[tensor], mesh, allow_zero, data_parallel),
                                    lambda s: restriction.param(tensor, s), tensor, restriction)
                    node_of_param[tensor] = costs.add_node(
                        tensor, [optimizer_step_time(graph, tensor, s, mesh) / microbatches for s in options],
                        [s.memory_bytes for s in options])
                    strategies.append(options)
                    params.append(tensor)
                uses.append(Use(tensor, node_of_param[tensor], node_of_op[op.output], slot, True))
            elif tensor in node_of_op:
                uses.append(Use(tensor, node_of_op[tensor], node_of_op[op.output], slot, False))
            # other stage inputs (data, activations of an earlier stage) arrive in any layout for free

    producer = dict(node_of_op)  # tensor -> the node that makes it inside the stage
    for output, incoming in boundary.items():
        # the layout the next copy of this layer receives, and this layer received: one shared choice
        # dims correspond by position: a layout of the incoming tensor is the same layout of the output
        rename = dict(zip(graph.tensors[incoming].dims, graph.tensors[output].dims))
        options = [Strategy(tuple(None for _ in mesh.shape), (tuple(Shard(rename[x.dim]) if isinstance(x, Shard) else x
                                                                    for x in p),), p, 0.0)
                   for p in tensor_placements(graph, incoming, mesh)]
        node = costs.add_node(f"{incoming} ~ {output}", [0.0] * len(options))
        producer[incoming] = node
        strategies.append(options)
        uses.append(Use(output, node_of_op[output], node, 0, False))
        for op in ops:
            for slot, tensor in enumerate(op.inputs):
                if tensor == incoming:
                    uses.append(Use(incoming, node, node_of_op[op.output], slot, False))

    sums = gradients.plan(graph, uses, {n: op for n, op in enumerate(ops)}, producer, len(costs), mesh)
    uses = [dataclasses.replace(u, gradient=False) if i in sums.forward_only else u for i, u in enumerate(uses)]
    for tensor, options in sums.nodes:
        costs.add_node(f"gradient of {tensor}", [0.0] * len(options))
        strategies.append(options)
    for use in uses:
        costs.add_edge(use.src, use.dst, _edge_cost(graph, use, strategies[use.src], strategies[use.dst],
                                                     mesh, microbatches))
    for flow in sums.flows:
        costs.add_edge(flow.src, flow.dst, np.array([[
            collectives_time(gradients.collectives(graph, flow, a, b, mesh), mesh) for b in strategies[flow.dst]]
            for a in strategies[flow.src]]))
    return StageModel(graph, mesh, ops, params, strategies, uses, costs, microbatches, inflight, sums.flows)


# ---------------------------------------------------------------- decoding

STATE_PARTS = ("weights", "gradients", "optimizer")


@dataclass
class Breakdown:
    """Where a stage's time and memory go, under one chosen assignment."""

    compute_s: float = 0.0  # per microbatch, forward + backward
    comm_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # per microbatch, by kind
    sync_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # per iteration, by kind
    optimizer_s: float = 0.0  # per iteration
    param_bytes: float = 0.0  # weights + gradients + optimizer state per device
    state_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATE_PARTS, 0.0))  # param_bytes by part
    activation_bytes: float = 0.0  # kept for backward, one microbatch, per device

    @property
    def per_microbatch_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())

    @property
    def per_iteration_s(self) -> float:
        return self.optimizer_s + sum(self.sync_s.values())

    def memory_bytes(self, inflight: int) -> float:
        return self.param_bytes + self.activation_bytes * inflight


@dataclass(frozen=True)
class OpChoice:
    op: str
    strategy: Strategy
    explanation: str
    collectives: tuple[tuple[str, int, float], ...] = ()  # (kind, axis, bytes) its output costs, per microbatch


@dataclass(frozen=True)
class ParamChoice:
    tensor: str
    strategy: ParamStrategy


@dataclass(frozen=True)
class StageSharding:
    """The decoded optimum of one stage on one logical mesh."""

    mesh: LogicalMesh
    ops: list[OpChoice]
    params: list[ParamChoice]
    breakdown: Breakdown
    inflight: int
    objective: float  # per-microbatch cost + per-iteration cost / microbatches
    solution: ilp.Solution

    @property
    def memory_bytes(self) -> float:
        return self.breakdown.memory_bytes(self.inflight)


def _axis_label(mesh: LogicalMesh, axis: int) -> str:
    return f"axis {axis} ({'inter-node' if mesh.axes[axis].crosses_nodes else 'intra-node'})"


def describe(graph: Graph, op: Op, strategy: Strategy, outgoing: Sequence[tuple[str, int, float]],
             mesh: LogicalMesh) -> str:
    """One readable line: what `op` splits on each axis, its layouts, and what its output costs to move."""
    behaviour = graph.behaviours(op)
    splits = [f"{d} ({behaviour[d].value}) on axis {i}" for i, d in enumerate(strategy.axes) if d is not None]
    head = f"{op.name}: " + ("split " + ", ".join(splits) if splits else "replicated")
    ins = ", ".join(f"{t} {fmt(p)}" for t, p in zip(op.inputs, strategy.inputs))
    text = f"{head} — in {ins}; out {fmt(strategy.output)}"
    parts = []
    for kind, axis, size in outgoing:
        t = costmodel.collective_time(kind, size, mesh.axes[axis])
        parts.append(f"{kind.replace('_', '-')} {fmt_bytes(size)} on {_axis_label(mesh, axis)}, {fmt_seconds(t)}")
    if strategy.comm:
        parts.append(f"statistics all-reduce {fmt_seconds(strategy.comm_s)}")
    return text + (" → " + "; ".join(parts) if parts else "")


def decode(model: StageModel, solution: ilp.Solution) -> StageSharding:
    """Strategies, cost breakdown and explanations of a solved stage."""
    g, mesh, choice = model.graph, model.mesh, solution.choice
    chosen = [model.strategies[n][k] for n, k in enumerate(choice)]
    breakdown = Breakdown()
    outgoing: dict[int, list] = defaultdict(list)
    for use in model.uses:
        per_mb, per_it = _use_collectives(g, use, chosen[use.src], chosen[use.dst], mesh)
        for kind, axis, size in per_mb:
            breakdown.comm_s[kind] += costmodel.collective_time(kind, size, mesh.axes[axis])
        for kind, axis, size in per_it:
            breakdown.sync_s[kind] += costmodel.collective_time(kind, size, mesh.axes[axis])
        if not use.param:
            outgoing[use.src].extend(per_mb)
    for flow in model.flows:
        steps = gradients.collectives(g, flow, chosen[flow.src], chosen[flow.dst], mesh)
        for kind, axis, size in steps:
            breakdown.comm_s[kind] += costmodel.collective_time(kind, size, mesh.axes[axis])
        if flow.owner is not None:
            outgoing[flow.owner].extend(steps)
    op_choices = []
    inside = {op.name for op in model.ops}
    for n, op in enumerate(model.ops):
        s: Strategy = chosen[n]
        if not any(c.name in inside for c in g.consumers[op.output]):
            leaving = _leaving(g, op, s, mesh)
            outgoing[n].extend(leaving)
            for kind, axis, size in leaving:
                breakdown.comm_s[kind] += costmodel.collective_time(kind, size, mesh.axes[axis])
        breakdown.compute_s += s.compute_s
        for kind, t in s.comm.items():
            breakdown.comm_s[kind] += t
        breakdown.activation_bytes += s.memory_bytes
        op_choices.append(OpChoice(op.name, s, describe(g, op, s, outgoing[n], mesh), tuple(outgoing[n])))
    param_choices = []
    for i, tensor in enumerate(model.params):
        n = len(model.ops) + i
        p: ParamStrategy = chosen[n]
        breakdown.param_bytes += p.memory_bytes
        for part, size in zip(STATE_PARTS, p.state_bytes):
            breakdown.state_bytes[part] += size
        breakdown.optimizer_s += optimizer_step_time(g, tensor, p, mesh)
        param_choices.append(ParamChoice(tensor, p))
    breakdown.comm_s = dict(breakdown.comm_s)
    breakdown.sync_s = dict(breakdown.sync_s)
    return StageSharding(mesh, op_choices, param_choices, breakdown, model.inflight, solution.objective, solution)


def _memory_error(model: StageModel, budget: float) -> InfeasibleError:
    """Name the liveness point, the tensors that dominate it, the bytes needed and the budget."""
    labels = [f"{op.output} (activation)" for op in model.ops] + [f"{p} (parameter state)" for p in model.params]
    least = [(float(m.min()), label) for label, m in zip(labels, model.costs.memory)]
    need = sum(b for b, _ in least)
    top = ", ".join(f"{label} {fmt_bytes(b)}" for b, label in sorted(least, reverse=True)[:3])
    point = (f"end of the forward pass ({model.inflight} microbatch{'es' if model.inflight > 1 else ''} "
             f"in flight, parameter state included)")
    return InfeasibleError(
        f"memory: needs at least {fmt_bytes(need)} per device at the {point}, budget is "
        f"{fmt_bytes(budget)}; largest: {top}",
        f"stage on logical mesh {mesh_text(model.mesh)}",
        "use more devices, fewer microbatches in flight, a smaller microbatch, or a larger budget")


def mesh_text(mesh: LogicalMesh) -> str:
    return f"({mesh.shape[0]}, {mesh.shape[1]})"


def shard_stage(graph: Graph, mesh: LogicalMesh, ops: Sequence[Op] | None = None, *,
                microbatch: int | None = None, microbatches: int = 1, inflight: int = 1,
                memory_budget: float | None = None, backend: str = "cpsat", time_limit_s: float = 60.0,
                seed: int = 0, allow_zero: bool = True, data_parallel: bool = False,
                restriction: Restriction | None = None, reduce_first: bool = True) -> StageSharding:
    """The optimal sharding of `ops` (default: the whole graph) on `mesh` for one microbatch."""
    g = with_batch(graph, microbatch) if microbatch is not None else graph
    if ops is not None and g is not graph:
        ops = [g.op_index[op.name] for op in ops]
    model = build(g, mesh, ops, microbatches, inflight, allow_zero, data_parallel, restriction)
    if memory_budget is not None and ilp.min_memory(model.costs) > memory_budget:
        raise _memory_error(model, memory_budget)
    solution = ilp.solve(model.costs, memory_budget, backend, time_limit_s, seed, reduce_first)
    return decode(model, solution)
