"""Intra-operator parallelism: the best sharding of a stage's ops on one logical mesh (DESIGN §4–§5).

`build` turns (graph, ops, mesh) into an `ilp.CostGraph` — one node per op and per parameter,
one edge per tensor use — whose costs are per microbatch (forward + backward + resharding)
plus the per-iteration gradient synchronisation and optimizer step divided by the number of
microbatches. `shard_stage` solves it and decodes the choice into strategies, a cost breakdown
and a readable explanation per op.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from partopt import costmodel, gradients, ilp, solvers
from partopt.cluster import Device, LogicalMesh
from partopt.errors import InfeasibleError
from partopt.graph import Graph, Op
from partopt.ops import is_weight_matmul
from partopt.units import fmt_bytes, fmt_seconds
from partopt.sharding import (
    PairPrices, ParamStrategy, Placement, Strategy, as_gradient_target, collectives_time, fmt, forward_share,
    gradient_placement, local_bytes, op_strategies, pair_table, param_eager_collectives, param_strategies,
    param_sync_collectives, R, Shard, reshard_collectives, reshard_copy_bytes, shards, tensor_placements,
)

RECOMPUTE_MODES = ("none", "selective", "full")


def recomputed_ops(graph: Graph, ops: Sequence[Op], mode: str) -> frozenset[str]:
    """The ops of `ops` whose forward a recomputation `mode` reruns in backward.

    none: nothing. full: every op but a loss (the stage keeps only what leaves it). selective: the
    attention core of Korthikanti et al. (2022) — each softmax over the product of two
    activations (the scores), that product, the one-input elementwise ops after the softmax
    (the attention dropout), and the products of their output with another activation (the
    context): large activations (quadratic in the sequence), few FLOPs.
    """
    if mode == "none":
        return frozenset()
    if mode == "full":  # but the loss: its backward follows its forward at once, and no runtime checkpoints it
        return frozenset(op.name for op in ops if op.kind != "cross_entropy")
    if mode != "selective":
        raise ValueError(f"unknown recomputation mode {mode!r}")
    inside = {op.name for op in ops}

    def activation_product(op: Op) -> bool:
        return op.kind == "einsum" and all(graph.tensors[t].role == "activation" for t in op.inputs)

    core: set[str] = set()
    for op in ops:
        scores = graph.producers.get(op.inputs[0]) if op.kind == "softmax" else None
        if scores is None or scores.name not in inside or not activation_product(scores):
            continue
        core.update((op.name, scores.name))
        probs = op.output
        while (len(after := graph.consumers[probs]) == 1 and after[0].name in inside
               and after[0].kind == "elementwise" and len(after[0].inputs) == 1):
            core.add(after[0].name)
            probs = after[0].output
        core.update(c.name for c in graph.consumers[probs] if c.name in inside and activation_product(c))
    return frozenset(core)


def kept_recomputed(graph: Graph, ops: Sequence[Op], rerun: frozenset[str]) -> frozenset[str]:
    """The recomputed ops of `ops` (`rerun`) whose output is kept for the backward all the same: read by an op
    not recomputed, or by nobody (what leaves the layer)."""
    def kept(op: Op) -> bool:
        readers = graph.consumers[op.output]
        return not readers or any(c.name not in rerun for c in readers)

    return frozenset(op.name for op in ops if op.name in rerun and kept(op))


def with_batch(graph: Graph, batch: int) -> Graph:
    """The same graph with its batch dim resized (a microbatch's view of the model), and with it the dims a
    reshape derives from the batch (`Graph.batch_scaled_dims`). The view is the graph's memoized one
    (`Graph.resized`): asked again at the same size, it is the same object, its hashes already known.
    """
    if graph.batch_dim is None or graph.dims[graph.batch_dim] == batch:
        return graph
    old = graph.dims[graph.batch_dim]
    dims = dict(graph.dims)
    for d in sorted(graph.batch_scaled_dims()):
        if dims[d] * batch % old:
            raise InfeasibleError(f"dim {d!r} ({dims[d]}) does not scale with a microbatch of {batch}",
                                  graph.name, "use a microbatch count that keeps derived dims whole")
        dims[d] = dims[d] * batch // old
    return graph.resized(dims)


@dataclass(frozen=True)
class Use:
    """One edge of the stage: tensor `tensor` flows from node `src` into input `slot` of op node `dst`."""

    tensor: str
    src: int
    dst: int
    slot: int
    param: bool
    gradient: bool = True  # False: the gradient travels through the tensor's gradient-sum node
    calls: float = 1.0  # a weight's share of the calls that gather the layer's weights (`weight_call_shares`)
    grad_bytes: float | None = None  # a weight's gradient as accumulated and reduced, when not its own bytes (`build`)


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
    hubs: dict[int, int] = field(default_factory=dict)  # layout node -> the node making its tensor
    leaving: set[str] = field(default_factory=set)  # ops whose pending-sum output is completed on leaving
    kept: set[str] = field(default_factory=set)  # recomputed ops whose output is kept (read by an op not recomputed)
    recompute: frozenset[str] = frozenset()  # ops whose forward is rerun in backward (`recomputed_ops`)
    prefetch: bool = False  # parameter gathers hide under their consumer's compute (`prefetch_cover`)
    tp_overlap: bool = False  # tensor-parallel activation collectives hide under the weights' GEMMs (`decode`)
    state_layout: str = "zero"  # how the runtime lays out parameter state (`costmodel.STATE_LAYOUTS`)
    sync_bound_s: float = math.inf  # per iteration, at most, whatever the assignment (`build`)
    per_iteration: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # (src, dst, seconds) of weights' uses


def _grad_nbytes(use: Use, nbytes: float) -> float:
    """Bytes of a use's tensor as its gradient accumulates and is reduced: a weight's `grad_bytes` when set, else
    the tensor's own `nbytes`."""
    return nbytes if use.grad_bytes is None else use.grad_bytes


def weight_call_shares(graph: Graph, ops: Sequence[Op], uses: list[Use]) -> list[Use]:
    """`uses` with each weight's use carrying its share of one collective call: its bytes over the bytes of all the
    weight uses of its reader's layer. Runtimes move a layer's weights together, not one call per tensor: FSDP
    gathers a layer's flat parameter in one all-gather per pass and reduce-scatters its gradient in one call, ZeRO-3
    and XLA's collective combiners coalesce alike. So a layer whose weights are all gathered pays one call's fixed
    part per collective (docs/COSTMODEL.md §4), and one gathering some of them a share of it (a call it pays at least)."""
    total: Counter = Counter()
    for u in uses:
        if u.param:
            total[ops[u.dst].layer] += graph.nbytes(u.tensor)
    return [dataclasses.replace(u, calls=graph.nbytes(u.tensor) / total[ops[u.dst].layer]) if u.param else u
            for u in uses]


def _reruns(use: Use, ops: Sequence[Op], recompute: frozenset[str]) -> bool:
    """Whether recomputation runs this use's forward resharding again: it feeds a recomputed op,
    or leaves one for a layout node (a boundary or hub layout, not another op). Op nodes come first."""
    def op_at(node: int) -> str | None:
        return ops[node].name if node < len(ops) else None

    return op_at(use.dst) in recompute or (op_at(use.dst) is None and op_at(use.src) in recompute)


def _is_float(graph: Graph, tensor: str) -> bool:
    return not graph.dtype_of(tensor).startswith(("int", "bool"))


@dataclass(frozen=True)
class UseCollectives:
    """The collectives of one tensor use: per microbatch forward and backward, per iteration."""

    forward: list
    backward: list
    per_iteration: list

    @property
    def per_microbatch(self) -> list:
        return self.forward + self.backward

    def recomputed(self, param: bool) -> list:
        """What recomputation runs again: the forward resharding of an activation. A gathered
        weight is not: the backward's own gather (already priced) serves the recomputation too."""
        return [] if param else self.forward


def _use_collectives(model_graph: Graph, use: Use, src_strategy, dst_strategy: Strategy,
                     mesh: LogicalMesh) -> UseCollectives:
    """The collectives of one tensor use under the chosen strategies of its two ends."""
    nbytes = model_graph.nbytes(use.tensor)
    required = dst_strategy.inputs[use.slot]
    differentiable = _is_float(model_graph, use.tensor)
    grad = gradient_placement(required, dst_strategy.axes)
    if use.param:
        p: ParamStrategy = src_strategy
        gather = reshard_collectives(p.placement, required, nbytes, mesh)
        # gathered for the forward and again for the backward, its partial sums reduced into the stored split (FSDP)
        reduced = _grad_nbytes(use, nbytes)
        eager = param_eager_collectives(grad, p, reduced, mesh) if differentiable else []
        per_it = param_sync_collectives(grad, p, reduced, mesh, nbytes) if differentiable else []
        return UseCollectives(gather, gather + eager, per_it)
    out: Placement = src_strategy.output
    backward = []
    if differentiable and use.gradient:
        backward = reshard_collectives(grad, as_gradient_target(out), nbytes, mesh)
    return UseCollectives(reshard_collectives(out, required, nbytes, mesh), backward, [])


BUFFERS, PREFETCH = "buffers", "prefetch"  # pools of transients (docs/COSTMODEL.md §5)


def _ends(use: Use, src_list: list, dst_list: list[Strategy]) -> tuple[list[Placement], list[Placement], list[Placement]]:
    """Per strategy of a use's ends: the source's layout (a parameter's placement, an op's output), and
    the layout the consumer requires and the placement of the gradient it sends back."""
    sources = [s.placement for s in src_list] if use.param else [s.output for s in src_list]
    required = [d.inputs[use.slot] for d in dst_list]
    return sources, required, [gradient_placement(q, d.axes) for q, d in zip(required, dst_list)]


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


def canonical(graph: Graph, tensor: str, mesh: LogicalMesh) -> Placement:
    """The layout activations cross an unpaired layer boundary in: the batch split over every axis
    that divides it (data parallel), else replicated. Both sides of such a boundary are priced
    against it, so neither gets the other's layout for free (see docs/COSTMODEL.md §5b)."""
    dims, batch = graph.tensors[tensor].dims, graph.batch_dim
    placement, split = [], 1
    for size in mesh.shape:
        if batch in dims and size > 1 and graph.dims[batch] % (split * size) == 0:
            placement.append(Shard(batch))
            split *= size
        else:
            placement.append(R)
    return tuple(placement)


Steps = list[tuple[str, int, float]]


def _leaving(graph: Graph, op: Op, strategy: Strategy, mesh: LogicalMesh) -> tuple[Steps, Steps]:
    """(forward, backward) collectives of an output leaving the ops unpaired: into the canonical
    layout (pending sums are reduced on the way), and its gradient back from it."""
    out, target, nbytes = strategy.output, canonical(graph, op.output, mesh), graph.nbytes(op.output)
    forward = reshard_collectives(out, target, nbytes, mesh)
    backward = reshard_collectives(target, as_gradient_target(out), nbytes, mesh) if _is_float(graph, op.output) else []
    return forward, backward


def _leaving_copy(graph: Graph, op: Op, strategy: Strategy, mesh: LogicalMesh) -> float:
    """Bytes of the copy an output leaving unpaired is resharded into (forward) or its gradient
    back from the canonical layout (backward), the larger: a transient of its op."""
    out, target, nbytes = strategy.output, canonical(graph, op.output, mesh), graph.nbytes(op.output)
    forward = reshard_copy_bytes(out, target, nbytes, mesh)
    backward = reshard_copy_bytes(target, as_gradient_target(out), nbytes, mesh) if _is_float(graph, op.output) else 0.0
    return max(forward, backward)


_TABLES: dict[tuple, tuple[np.ndarray, ...]] = {}  # see `_use_tables` and `_flow_table`
_TABLES_KEPT = 4096


def _kept_tables(key: tuple, compute: Callable[[], tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """The tables kept under `key`, computed (and made read-only) the first time."""
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.clear()
        tables = _TABLES[key] = compute()
        for table in tables:
            table.flags.writeable = False
    return tables


Cover = tuple[tuple[float, ...], tuple[float, ...]]  # per consumer strategy: (forward, backward) seconds


def prefetch_cover(graph: Graph, op: Op, strategies: Sequence[Strategy], device: Device) -> Cover:
    """Per strategy of `op`, the (forward, backward) compute each gather of its weights hides under when
    prefetched (docs/COSTMODEL.md §5b): the op's compute split by `forward_share`, shared equally by its weights."""
    weights = sum(graph.tensors[t].role == "param" for t in op.inputs)
    share = forward_share(graph, op, device)
    return (tuple(s.compute_s * share / weights for s in strategies),
            tuple(s.compute_s * (1.0 - share) / weights for s in strategies))


def _use_tables(model_graph: Graph, use: Use, src_list: list, dst_list: list[Strategy], prices: PairPrices,
                microbatches: int, rerun: bool, cover: Cover | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(seconds, copy bytes, gathered weight bytes) of one use for every pair of its ends' strategies
    (`_use_cost`, `_use_copies`), and a weight's seconds per iteration for every pair (else a 0-d zero), read-only.
    Repeated layers and the pricing jobs of one layer (other caps, in-flight counts) ask for the same tables:
    they are kept under all they depend on. `cover`: a weight's use whose gathers are prefetched
    (`prefetch_cover` of its consumer)."""
    sources, required, grads = _ends(use, src_list, dst_list)
    nbytes = model_graph.nbytes(use.tensor)
    differentiable = _is_float(model_graph, use.tensor)
    zero = tuple(p.zero_axes for p in src_list) if use.param else ()
    key = (use.param, differentiable, use.gradient, use.calls, rerun, microbatches, nbytes, _grad_nbytes(use, nbytes),
           tuple(sources), tuple(required), tuple(grads), zero, prices.mesh, prices.model, cover)

    def compute() -> tuple[np.ndarray, ...]:
        cost, iteration = _use_cost(use, src_list, sources, required, grads, nbytes, differentiable, prices,
                                    microbatches, rerun, cover)
        return cost, *_use_copies(use, src_list, sources, required, grads, nbytes, differentiable, prices), iteration

    return _kept_tables(key, compute)


def _flow_table(graph: Graph, flow: gradients.Flow, src_list: list, dst_list: list, prices: PairPrices) -> np.ndarray:
    """Seconds of one gradient flow for every pair of its ends' choices (`gradients.collectives`).
    A contribution or a sink is a plain resharding of the tensor: priced by `PairPrices.reshard_seconds`
    (summed collective by collective, the same floats) and kept like a use's table."""
    if flow.kind == "relay":  # renames dims: not worth keeping (reshapes are few)
        return _relay_table(graph, flow, src_list, dst_list, prices)
    sources, targets = gradients.plain_ends(flow, src_list, dst_list)
    nbytes = graph.nbytes(flow.tensor)
    key = ("flow", nbytes, tuple(sources), tuple(targets), prices.mesh, prices.model)
    return _kept_tables(key, lambda: (sum(prices.reshard_seconds(sources, targets, nbytes)),))[0]


def _relay_table(graph: Graph, flow: gradients.Flow, src_list: list, dst_list: list, prices: PairPrices) -> np.ndarray:
    """`_flow_table` of a relay: its first steps depend on the source choice alone (`gradients.relay_ends`), priced
    once per source, then its resharding to each destination is a `reshard_seconds` table, added collective by
    collective after them (the order of `gradients.collectives`: the same floats)."""
    steps, relabelled, nbytes = gradients.relay_ends(graph, flow, src_list, prices.mesh)
    first = np.array([prices.seconds(s) for s in steps], dtype=float)[:, None]
    return functools.reduce(np.add, prices.reshard_seconds(relabelled, dst_list, nbytes), first)


def _use_cost(use: Use, src_list: list, sources: list[Placement], required: list[Placement], grads: list[Placement],
              nbytes: float, differentiable: bool, prices: PairPrices, microbatches: int, rerun: bool,
              cover: Cover | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Seconds of one use for every pair of its ends' strategies, as `_use_collectives` prices a pair:
    its collectives per microbatch (and the recomputed ones) plus its per-iteration ones over the
    microbatches, each sum taken collective by collective in the same order (the same floats); and the
    per-iteration seconds alone (a 0-d zero when there are none). A weight's gathers with a `cover` cost only
    what its consumer's compute does not hide (`exposed`)."""
    gather = list(prices.reshard_seconds(sources, required, nbytes, use.calls))
    per_iteration: list[np.ndarray] = []
    if use.param:
        reduced = _grad_nbytes(use, nbytes)
        eager = list(_eager_table(src_list, grads, reduced, prices, use.calls)) if differentiable else []
        if cover is None:  # gathered for the forward and again for the backward, then its partial sums reduced
            per_microbatch = gather + gather + eager
        else:
            zero = np.zeros((len(sources), len(required)))
            sides = (functools.reduce(np.add, gather, zero), functools.reduce(np.add, gather + eager, zero))
            per_microbatch = [exposed(side, np.asarray(c)[None, :]) for side, c in zip(sides, cover)]
        if differentiable:  # the same for every microbatch count: kept apart from the use's tables
            def sync() -> tuple[np.ndarray, ...]:
                return (prices.step_table(lambda p, g: param_sync_collectives(g, p, reduced, prices.mesh, nbytes),
                                          src_list, grads, 2 * len(prices.mesh.shape), calls=0),)

            key = ("sync", reduced, nbytes, tuple(src_list), tuple(grads), prices.mesh, prices.model)
            per_iteration = list(_kept_tables(key, sync)[0])
    else:
        backward: list[np.ndarray] = []
        if differentiable and use.gradient:
            targets = [as_gradient_target(o) for o in sources]
            backward = list(prices.reshard_seconds(grads, targets, nbytes).transpose(0, 2, 1))
        per_microbatch = gather + backward + (gather if rerun else [])
    start = np.zeros((len(sources), len(required)))
    iteration = functools.reduce(np.add, per_iteration, start)
    return (functools.reduce(np.add, per_microbatch, start) + iteration / microbatches,
            iteration if per_iteration else np.zeros(()))


def _eager_table(src_list: list[ParamStrategy], grads: list[Placement], nbytes: float, prices: PairPrices,
                 calls: float) -> np.ndarray:
    """Seconds of the i-th per-microbatch reduction of a weight's gradient (`param_eager_collectives`) for every pair
    of its strategies and its consumer's gradient layouts, as [i, a, b]; kept like the sync tables."""
    def eager() -> tuple[np.ndarray, ...]:
        return (prices.step_table(lambda p, g: param_eager_collectives(g, p, nbytes, prices.mesh), src_list, grads,
                                  len(prices.mesh.shape), calls),)

    return _kept_tables(("eager", nbytes, calls, tuple(src_list), tuple(grads), prices.mesh, prices.model), eager)[0]


def exposed(gather_s: np.ndarray | float, cover_s: np.ndarray | float) -> np.ndarray:
    """Seconds of a prefetched gather that its cover does not hide: max(0, gather - cover)."""
    return np.maximum(0.0, gather_s - cover_s)


def _use_copies(use: Use, src_list: list, sources: list[Placement], required: list[Placement],
                grads: list[Placement], nbytes: float, differentiable: bool,
                prices: PairPrices) -> tuple[np.ndarray, np.ndarray]:
    """(copy, gathered weight) bytes per device one use materialises while its consumer runs, per
    strategy pair: transients of the consumer (docs/COSTMODEL.md §5).

    A parameter gathered for the op (stored sharded where the op needs more of it: FSDP/ZeRO-3)
    is a copy of the needed layout, forward and again backward; it also counts as the weight a
    prefetch gathers one op ahead. In the backward its gradient, in the op's layout, sits beside it
    until it is reduce-scattered into the stored split (`param_eager_collectives`). An activation
    resharded by an all-gather or all-to-all is a copy beside the source, forward; its gradient
    likewise, backward (the larger of the two, which never coexist). In-place collectives and local
    slices copy nothing (`reshard_copy_bytes`).
    """
    copies = prices.copy_table(sources, required, nbytes)
    if use.param:
        if not differentiable:
            return copies, copies
        mesh, grad_bytes = prices.mesh, _grad_nbytes(use, nbytes)
        reduced = pair_table(lambda p, g: local_bytes(grad_bytes, g, mesh)
                             if param_eager_collectives(g, p, grad_bytes, mesh) else 0.0, src_list, grads)
        return copies + reduced, copies
    if differentiable and use.gradient:
        targets = [as_gradient_target(o) for o in sources]
        copies = np.maximum(copies, prices.copy_table(grads, targets, nbytes).T)
    return copies, np.zeros_like(copies)


def optimizer_step_time(graph: Graph, tensor: str, strategy: ParamStrategy, mesh: LogicalMesh,
                        layout: str = "zero") -> float:
    """Seconds of the per-iteration optimizer update of one parameter (memory bound), its state in `layout`."""
    return optimizer_step_times(graph, tensor, [strategy], mesh, layout)[0]


def optimizer_step_times(graph: Graph, tensor: str, strategies: Sequence[ParamStrategy],
                         mesh: LogicalMesh, layout: str = "zero") -> list[float]:
    """`optimizer_step_time` of each of a parameter's strategies, each distinct (shards, ZeRO axes) priced once:
    all that the step's bytes read of a strategy (its ZeRO variants and placements repeat them)."""
    dtype = graph.dtype_of(tensor)
    state = costmodel.param_memory(graph.numel(tensor), dtype, graph.optimizer, layout).total
    model = costmodel.active()
    keys = [(shards(s.placement, mesh), s.zero_axes) for s in strategies]
    seconds = {}
    for n, zero in dict.fromkeys(keys):
        local = state / n / max(1, np.prod([mesh.shape[i] for i in zero]))
        seconds[(n, zero)] = model.op_time("optimizer", (), dtype, 0.0, 2 * local, mesh.device, False)
    return [seconds[key] for key in keys]


@dataclass(frozen=True)
class Restriction:
    """Which strategies a stage may use: a predicate per op and per parameter (default: all).

    Evaluating a given plan pins each op to one strategy; a Megatron-style plan fixes one axis to
    data parallelism. A node left with no strategy is an error that names it.
    """

    op: Callable[[Op, Strategy], bool] = lambda op, strategy: True
    param: Callable[[str, ParamStrategy], bool] = lambda tensor, strategy: True
    reason: str = "the requested strategy"
    # set when the predicates read only a layer's structure (op kinds, dim roles, the mesh), never op or tensor
    # names: layers that hash alike under one key are allowed the same strategies and share a solve without
    # listing them (`pricing`); () for no restriction at all. None: the allowed strategies are the key.
    key: tuple | None = None
    # parameters may also be stored split along dims the mesh axes do not divide, padded: ZeRO-3's and FSDP's
    # storage of the weights they gather for each use (`sharding.param_strategies`'s `uneven`)
    uneven_params: bool = False


UNRESTRICTED = Restriction(key=())


def _kept(options: list, keep, name: str, restriction: Restriction) -> list:
    options = [s for s in options if keep(s)]
    if not options:
        raise InfeasibleError(f"{name} has no strategy allowed by {restriction.reason}", name,
                              "check the plan's placements against the op's dims and the mesh")
    return options


def _hub_layouts(graph: Graph, tensor: str, made: list, mesh: LogicalMesh) -> list[Placement]:
    """Layouts a tensor can be materialised in: every complete placement, and every layout its
    maker can produce it in (a Partial output among them: then consumers reshard on their own)."""
    return list(dict.fromkeys([*tensor_placements(graph, tensor, mesh), *(s.output for s in made)]))


def _add_layout_hubs(graph: Graph, mesh: LogicalMesh, costs: ilp.CostGraph, strategies: list[list],
                     uses: list[Use]) -> dict[int, int]:
    """Give every tensor read by several uses one node choosing the layout it is materialised in.

    Forward, a runtime reshards a tensor once per layout and lets every consumer that needs that
    layout (or a slice of it) reuse the copy. The layout node prices this: `reshard(made -> m)`
    once, then `reshard(m -> required)` per use, which is 0 when the use needs `m` itself or a
    slice of it (Replicate -> Shard is local). Choosing `m` = the maker's own layout gives back
    independent resharding per use, so the model never prices more than before.

    Exact for gathers: per mesh axis the collective's kind follows from (source, target) and its
    buffer from the source's other axes (`sharding.buffer_divisor`). If some use needs Replicate on
    an axis the maker shards or leaves Partial, every schedule gathers (reduces) that axis at least
    once, from the maker's layout at best — what `reshard(made -> m*)` charges, for m* the most
    replicated needed layout (per axis: the common need, or Replicate where needs differ); every
    need is then a free slice of m*. Exact too when every use needs one and the same layout, or
    the maker is Partial (each use must reduce: all-reduce once, or reduce-scatter once and
    re-cut). Not exact: one node cannot both hand the maker's own layout to some uses and a
    shared copy to others. When a use reads the maker's Shard for free and two others need
    another Shard of that axis, the best is one all-to-all shared by the two; the node pays the
    cheaper of one all-gather (m = Replicate) and an all-to-all per use (m = maker's layout) —
    an upper bound, never above independent resharding (tests/test_intra.py checks all of this
    by brute force on one axis).

    Memory: the materialised copy is transient. What is kept for backward is the maker's output
    in its own layout (as for every edge; Megatron's sequence parallelism likewise keeps the
    sequence-sharded input and all-gathers it again in the backward, a re-gather this model does
    not price, like the input any consumer re-reads in backward). Returns hub node -> maker node.
    """
    idle = tuple(None for _ in mesh.shape)
    by_tensor: dict[str, list[int]] = defaultdict(list)
    for i, use in enumerate(uses):
        if not use.param:
            by_tensor[use.tensor].append(i)
    hubs: dict[int, int] = {}
    for tensor, idx in by_tensor.items():
        if len(idx) < 2:
            continue
        maker = uses[idx[0]].src
        options = [Strategy(idle, (m,), m, 0.0) for m in _hub_layouts(graph, tensor, strategies[maker], mesh)]
        hub = costs.add_node(f"layout of {tensor}", [0.0] * len(options))
        strategies.append(options)
        hubs[hub] = maker
        for i in idx:
            uses[i] = dataclasses.replace(uses[i], src=hub)
        uses.append(Use(tensor, maker, hub, 0, False, gradient=False))
    return hubs


def build(graph: Graph, mesh: LogicalMesh, ops: Sequence[Op] | None = None, microbatches: int = 1,
          inflight: int = 1, allow_zero: bool = True, data_parallel: bool = False,
          restriction: Restriction | None = None, *, recompute: str = "none", prefetch: bool = False,
          tp_overlap: bool = False, state_layout: str = "zero") -> StageModel:
    """The stage's cost graph; `graph` must already be at microbatch size (see `with_batch`).

    `data_parallel` restricts every op to splitting the batch dim and every parameter to copies;
    `restriction` filters strategies further. `recompute` (a mode of `recomputed_ops`) picks ops
    that keep for backward only the outputs read by ops not recomputed, and rerun their forward
    (compute and forward collectives) once during their backward, holding all their outputs
    once while they do. Memory (docs/COSTMODEL.md §5): op nodes hold their kept output, parameter
    nodes weights, optimizer state and a gradient buffer per read, in the stored placement, and each
    use's copies (gathered weights and their gradients before the reduction, all-gather/all-to-all and
    layout-hub copies) are transients of its consumer.
    `prefetch`: a weight's gathers run ahead of its consumer, under compute (`prefetch_cover`, `exposed`).
    `tp_overlap`: Megatron-LM's `--tp-comm-overlap` on a (dp, tp) mesh, priced when the stage is decoded (`decode`).
    `state_layout`: how the runtime lays out parameter state (`costmodel.STATE_LAYOUTS`): the bytes of each
    parameter's state and of its gradient as accumulated and reduced.
    """
    restriction = restriction or Restriction()
    force_dim = graph.batch_dim if data_parallel else None
    ops = list(graph.order if ops is None else ops)
    costs = ilp.CostGraph()
    prices = PairPrices.on(mesh)
    strategies: list[list] = []
    node_of_op: dict[str, int] = {}
    inside = {op.name for op in ops}
    rerun = recomputed_ops(graph, ops, recompute)
    boundary = _boundary_pairs(graph, ops, inside)
    leaving: set[str] = set()
    kept = set(kept_recomputed(graph, ops, rerun))
    for op in ops:
        options = _kept(op_strategies(graph, op, mesh, force_dim), lambda s: restriction.op(op, s), op.name, restriction)
        readers = graph.consumers[op.output]
        if op.output not in boundary and not any(c.name in inside for c in readers):
            leaving.add(op.name)
        cost, memory, copies = [], [], []
        for s in options:
            forward, backward = _leaving(graph, op, s, mesh) if op.name in leaving else ([], [])
            done = collectives_time(forward, mesh)  # recomputation reruns the forward part
            cost.append(s.compute_s + s.comm_s + done + collectives_time(backward, mesh)
                        + ((s.forward_s + done) if op.name in rerun else 0.0))
            if op.name in rerun:  # kept per microbatch in flight if read on, and once in the working set
                memory.append(s.memory_bytes * ((inflight if op.name in kept else 0) + 1))
            else:
                memory.append(s.memory_bytes * inflight)
            copies.append(_leaving_copy(graph, op, s, mesh) if op.name in leaving else 0.0)
        node_of_op[op.output] = costs.add_node(op.name, cost, memory)
        if any(copies):
            costs.add_transient(BUFFERS, node_of_op[op.output], node_of_op[op.output], copies)
        strategies.append(options)

    params: list[str] = []
    node_of_param: dict[str, int] = {}
    reads = Counter(t for op in ops for t in op.inputs if graph.tensors[t].role == "param")  # each accumulates apart
    sync_bound = 0.0  # per iteration: each parameter's slowest optimizer step and each use's slowest reduction
    per_iteration = []
    paired = set(boundary.values())
    reads_arriving: list[tuple[str, int, int]] = []  # (tensor, reader node, slot)
    uses: list[Use] = []
    for op in ops:
        for slot, tensor in enumerate(op.inputs):
            if (tensor not in node_of_op and tensor not in paired and graph.tensors[tensor].role == "activation"
                    and tensor in graph.producers):
                reads_arriving.append((tensor, node_of_op[op.output], slot))
            elif graph.tensors[tensor].role == "param":
                if tensor not in node_of_param:
                    options = _kept(param_strategies(graph, graph.tensors[tensor], mesh, allow_zero, data_parallel,
                                                     state_layout, restriction.uneven_params),
                                    lambda s: restriction.param(tensor, s), tensor, restriction)
                    steps = optimizer_step_times(graph, tensor, options, mesh, state_layout)
                    sync_bound += max(steps)
                    node_of_param[tensor] = costs.add_node(  # weights, optimizer state, a gradient buffer per read
                        tensor, [t / microbatches for t in steps],
                        [s.state_bytes[0] + reads[tensor] * s.state_bytes[1] + s.state_bytes[2] for s in options])
                    strategies.append(options)
                    params.append(tensor)
                uses.append(Use(tensor, node_of_param[tensor], node_of_op[op.output], slot, True))
            elif tensor in node_of_op:
                uses.append(Use(tensor, node_of_op[tensor], node_of_op[op.output], slot, False))
            # data inputs arrive in any layout for free (the loader shards them as asked)

    arriving: dict[str, int] = {}  # unpaired activations of earlier layers: fixed in their canonical layout
    for tensor, reader, slot in reads_arriving:
        if tensor not in arriving:
            layout = canonical(graph, tensor, mesh)
            arriving[tensor] = costs.add_node(f"{tensor} arriving", [0.0])
            strategies.append([Strategy(tuple(None for _ in mesh.shape), (layout,), layout, 0.0)])
        uses.append(Use(tensor, arriving[tensor], reader, slot, False))
    producer = {**node_of_op, **arriving}  # tensor -> the node that makes it in this model
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
    uses = weight_call_shares(graph, ops, uses)
    if state_layout != "zero":  # a weight's gradient accumulates and is reduced in the layout's dtype
        uses = [dataclasses.replace(u, grad_bytes=graph.numel(u.tensor) * costmodel.grad_width(
            graph.dtype_of(u.tensor), state_layout)) if u.param and _is_float(graph, u.tensor) else u for u in uses]
    for tensor, options in sums.nodes:
        costs.add_node(f"gradient of {tensor}", [0.0] * len(options))
        strategies.append(options)
    hubs = _add_layout_hubs(graph, mesh, costs, strategies, uses)
    for use in uses:
        cover = (prefetch_cover(graph, ops[use.dst], strategies[use.dst], mesh.device) if prefetch and use.param
                 else None)
        cost, *transients, iteration = _use_tables(graph, use, strategies[use.src], strategies[use.dst], prices,
                                                   microbatches, _reruns(use, ops, rerun), cover)
        if iteration.ndim:
            sync_bound += float(iteration.max())
            per_iteration.append((use.src, use.dst, iteration))
        costs.add_edge(use.src, use.dst, cost)
        for pool, table in zip((BUFFERS, PREFETCH), transients):  # the consumer's, where they coexist
            if table.any():
                costs.add_transient(pool, use.dst, use.src, table, use.dst)
    for flow in sums.flows:
        costs.add_edge(flow.src, flow.dst, _flow_table(graph, flow, strategies[flow.src], strategies[flow.dst], prices))
    return StageModel(graph, mesh, ops, params, strategies, uses, costs, microbatches, inflight, sums.flows,
                      hubs, leaving, kept, rerun, prefetch, tp_overlap, state_layout, sync_bound, per_iteration)


# ---------------------------------------------------------------- decoding

STATE_PARTS = ("weights", "gradients", "optimizer")


@dataclass
class Breakdown:
    """Where a stage's time and memory go, under one chosen assignment."""

    compute_s: float = 0.0  # per microbatch, forward + backward (recomputation apart)
    backward_compute_s: float = 0.0  # per microbatch: the backward's share of compute_s
    comm_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # per microbatch, by kind
    sync_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # per iteration, by kind
    gather_s: float = 0.0  # per iteration: the part of sync_s gathering updated weights over a ZeRO axis
    optimizer_s: float = 0.0  # per iteration
    param_bytes: float = 0.0  # weights + gradients + optimizer state per device
    state_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATE_PARTS, 0.0))  # param_bytes by part
    activation_bytes: float = 0.0  # kept for backward, one microbatch, per device
    recompute_s: float = 0.0  # per microbatch: the forward compute and collectives recomputation reruns
    prefetched_s: float = 0.0  # per microbatch: the part of comm_s (weights' gathers) hidden under compute
    tp_overlapped_s: float = 0.0  # per microbatch: the part of comm_s (tensor-parallel activations) hidden under GEMMs
    # per device, held once: one microbatch's full activations while recomputing (0 without) plus
    # the transient buffers at their peak (`transient_bytes`, docs/COSTMODEL.md §5)
    working_bytes: float = 0.0
    transient_bytes: float = 0.0  # the part of working_bytes that is transient buffers (ilp.CostGraph.transient_peak)
    # per iteration, by parameter: its gradient synchronisation by collective kind, and its "optimizer" step
    param_sync_s: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def per_microbatch_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values()) - self.prefetched_s - self.tp_overlapped_s + self.recompute_s

    @property
    def per_iteration_s(self) -> float:
        return self.optimizer_s + sum(self.sync_s.values())

    def memory_bytes(self, inflight: int) -> float:
        return self.param_bytes + self.activation_bytes * inflight + self.working_bytes


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
    least_memory_bytes: float  # a lower bound of any assignment's memory as charged (`ilp.min_memory`; exact without transients)
    least_transient_bytes: float = 0.0  # the transient peak with every buffer at its least (the whole peak, not a share)
    sync_bound_s: float = math.inf  # per iteration, the most any assignment costs (`StageModel.sync_bound_s`)
    time_floor_s: float = 0.0  # per microbatch, the least any assignment takes, memory aside (`time_floor`; 0: not asked)

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
        t = costmodel.active().collective_time(kind, size, mesh.axes[axis])
        parts.append(f"{kind.replace('_', '-')} {fmt_bytes(size)} on {_axis_label(mesh, axis)}, {fmt_seconds(t)}")
    if strategy.comm:
        parts.append(f"statistics all-reduce {fmt_seconds(strategy.comm_s)}")
    return text + (" → " + "; ".join(parts) if parts else "")


TENSOR_AXIS = 1  # the tensor-parallel axis of Megatron's (dp, tp) meshes (`evaluate._megatron`)


def tp_overlap_hidden(graph: Graph, ops: Sequence[Op], chosen: Sequence[Strategy], tensor_parallel: Sequence[list],
                      mesh: LogicalMesh) -> float:
    """Seconds per microbatch of tensor-parallel activation collectives that Megatron-LM's `--tp-comm-overlap`
    (Transformer Engine's userbuffers) hides under the GEMMs of the weights: on each side, forward and backward,
    min(the collectives' time, the weight GEMMs' compute), pooled over the layer (docs/COSTMODEL.md §5b)."""
    gemms = [0.0, 0.0]
    for op, s in zip(ops, chosen):
        if is_weight_matmul(graph, op):
            share = forward_share(graph, op, mesh.device)
            gemms[0] += s.compute_s * share
            gemms[1] += s.compute_s * (1.0 - share)
    return sum(min(collectives_time(steps, mesh), gemm) for steps, gemm in zip(tensor_parallel, gemms))


def decode(model: StageModel, solution: ilp.Solution) -> StageSharding:
    """Strategies, cost breakdown and explanations of a solved stage."""
    g, mesh, choice = model.graph, model.mesh, solution.choice
    chosen = [model.strategies[n][k] for n, k in enumerate(choice)]
    breakdown = Breakdown()
    outgoing: dict[int, list] = defaultdict(list)

    prices = costmodel.active()

    def pay(steps, into: dict[str, float], calls: float = 1.0) -> None:
        for kind, axis, size in steps:
            into[kind] += prices.collective_time(kind, size, mesh.axes[axis], calls)

    tensor_parallel = [[], []]  # forward, backward: activation collectives on the tensor-parallel axis

    def on_tensor_axis(side: int, steps: list) -> None:
        if model.tp_overlap:  # only the overlap reads them
            tensor_parallel[side].extend(step for step in steps if step[1] == TENSOR_AXIS)

    for use in model.uses:
        c = _use_collectives(g, use, chosen[use.src], chosen[use.dst], mesh)
        pay(c.per_microbatch, breakdown.comm_s, use.calls)
        if not use.param:
            on_tensor_axis(0, c.forward)
            on_tensor_axis(1, c.backward)
        pay(c.per_iteration, breakdown.sync_s, calls=0)
        if use.param:
            pay(c.per_iteration, breakdown.param_sync_s.setdefault(use.tensor, defaultdict(float)), calls=0)
            zero_axes = chosen[use.src].zero_axes
            breakdown.gather_s += sum(prices.collective_time(kind, size, mesh.axes[axis], 0)
                                      for kind, axis, size in c.per_iteration if kind == "all_gather" and axis in zero_axes)
            if model.prefetch:  # each side's gathers (and the backward's reduction) under that side's compute
                covers = prefetch_cover(g, model.ops[use.dst], [chosen[use.dst]], mesh.device)
                for steps, cover in zip((c.forward, c.backward), covers):
                    side = collectives_time(steps, mesh, use.calls)
                    breakdown.prefetched_s += side - float(exposed(side, cover[0]))
        if _reruns(use, model.ops, model.recompute):
            breakdown.recompute_s += collectives_time(c.recomputed(use.param), mesh)
        if not use.param:
            outgoing[model.hubs.get(use.src, use.src)].extend(c.per_microbatch)
    for flow in model.flows:
        steps = gradients.collectives(g, flow, chosen[flow.src], chosen[flow.dst], mesh)
        pay(steps, breakdown.comm_s)
        on_tensor_axis(1, steps)
        if flow.owner is not None:
            outgoing[flow.owner].extend(steps)
    op_choices = []
    for n, op in enumerate(model.ops):
        s: Strategy = chosen[n]
        if op.name in model.leaving:
            forward, backward = _leaving(g, op, s, mesh)
            outgoing[n].extend(forward + backward)
            pay(forward + backward, breakdown.comm_s)
            on_tensor_axis(0, forward)
            on_tensor_axis(1, backward)
            if op.name in model.recompute:
                breakdown.recompute_s += collectives_time(forward, mesh)
        breakdown.compute_s += s.compute_s
        breakdown.backward_compute_s += s.compute_s * (1.0 - forward_share(g, op, mesh.device))
        for kind, t in s.comm.items():
            breakdown.comm_s[kind] += t
        if op.name in model.recompute:
            breakdown.recompute_s += s.forward_s
            breakdown.working_bytes += s.memory_bytes
            breakdown.activation_bytes += s.memory_bytes if op.name in model.kept else 0.0
        else:
            breakdown.activation_bytes += s.memory_bytes
        op_choices.append(OpChoice(op.name, s, describe(g, op, s, outgoing[n], mesh), tuple(outgoing[n])))
    if model.tp_overlap:
        breakdown.tp_overlapped_s = tp_overlap_hidden(g, model.ops, chosen, tensor_parallel, mesh)
    breakdown.transient_bytes = model.costs.transient_peak(choice)
    breakdown.working_bytes += breakdown.transient_bytes
    reads = Counter(use.tensor for use in model.uses if use.param)  # a gradient buffer per read
    param_choices = []
    for i, tensor in enumerate(model.params):
        n = len(model.ops) + i
        p: ParamStrategy = chosen[n]
        p = dataclasses.replace(p, state_bytes=(p.state_bytes[0], reads[tensor] * p.state_bytes[1], p.state_bytes[2]))
        breakdown.param_bytes += p.memory_bytes
        for part, size in zip(STATE_PARTS, p.state_bytes):
            breakdown.state_bytes[part] += size
        step = optimizer_step_time(g, tensor, p, mesh, model.state_layout)
        breakdown.optimizer_s += step
        breakdown.param_sync_s.setdefault(tensor, defaultdict(float))["optimizer"] += step
        param_choices.append(ParamChoice(tensor, p))
    breakdown.comm_s = dict(breakdown.comm_s)
    breakdown.sync_s = dict(breakdown.sync_s)
    breakdown.param_sync_s = {t: dict(kinds) for t, kinds in breakdown.param_sync_s.items()}
    return StageSharding(mesh, op_choices, param_choices, breakdown, model.inflight, solution.objective, solution,
                         ilp.min_memory(model.costs), model.costs.least_transient_peak(), model.sync_bound_s)


def _memory_error(model: StageModel, budget: float) -> InfeasibleError:
    """Name the liveness point, the tensors that dominate it, the bytes needed and the budget."""
    labels = ([f"{op.output} (activation)" for op in model.ops]
              + [f"{p} (weights, gradient and optimizer state)" for p in model.params])
    least = [(float(m.min()), label) for label, m in zip(labels, model.costs.memory)]
    least.append((model.costs.least_transient_peak(), "transient buffers"))
    need = ilp.min_memory(model.costs)
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
                memory_budget: float | None = None, backend: str = "highs", time_limit_s: float = solvers.TIME_LIMIT_S,
                seed: int = 0, allow_zero: bool = True, data_parallel: bool = False,
                restriction: Restriction | None = None, reduce_first: bool = True,
                recompute: str = "none", peak_shared_by: int = 1, prefetch: bool = False, tp_overlap: bool = False,
                cutoff: float | None = None, free: tuple[tuple[int, ...], float] | None = None,
                time_floor: bool = False, state_layout: str = "zero") -> StageSharding:
    """The optimal sharding of `ops` (default: the whole graph) on `mesh` for one microbatch;
    `recompute` (none | selective | full, see `recomputed_ops`) reruns those ops' forward in backward;
    `memory_budget` is charged 1/`peak_shared_by` of the transient peak (`ilp.CostGraph`); `prefetch`: see `build`;
    `cutoff` (seconds of time + sync / microbatches, the ILP's objective): with a budget, InfeasibleError when
    the optimum costs that much or more (`ilp.solve`); `free`: its memory-free optimum, when known (`ilp.solve`);
    `time_floor`: also find the least time per microbatch of any strategy (`_time_floor`); `state_layout`: see
    `build`."""
    g = with_batch(graph, microbatch) if microbatch is not None else graph
    if ops is not None and g is not graph:
        ops = [g.op_index[op.name] for op in ops]
    model = build(g, mesh, ops, microbatches, inflight, allow_zero, data_parallel, restriction, recompute=recompute,
                  prefetch=prefetch, tp_overlap=tp_overlap, state_layout=state_layout)
    model.costs.peak_shared_by = peak_shared_by
    if memory_budget is not None and ilp.min_memory(model.costs) > memory_budget:
        raise _memory_error(model, memory_budget)
    solution = ilp.solve(model.costs, memory_budget, backend, time_limit_s, seed, reduce_first, cutoff, free)
    sharding = decode(model, solution)
    return dataclasses.replace(sharding, time_floor_s=_time_floor(model)) if time_floor else sharding


def _time_floor(model: StageModel) -> float:
    """The least time per microbatch of any assignment of `model`, memory aside: its cost graph less the per-iteration
    parts (each parameter's optimizer step, each weight's reduction), solved exactly (`ilp.least_cost`); 0 when that
    elimination is too large. A hair under, for the rounding of taking those parts back out."""
    g, params = model.costs, range(len(model.ops), len(model.ops) + len(model.params))
    edges = dict(g.edges)
    for u, v, table in model.per_iteration:
        key, oriented = ((u, v), table) if u < v else ((v, u), table.T)
        edges[key] = edges[key] - oriented / model.microbatches
    costs = [np.zeros_like(c) if n in params else c for n, c in enumerate(g.costs)]
    least = ilp.least_cost(ilp.CostGraph(g.names, costs, [np.zeros_like(c) for c in costs], edges))
    return 0.0 if least is None else max(0.0, least * (1 - 1e-9))
