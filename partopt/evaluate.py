"""Price a given plan under the cost model: a plan file (partopt's or hand-edited), or a
Megatron-style uniform plan (P equal stages, each on a (D, T) mesh: batch over D, Megatron's tensor
parallelism over T).

Both fix the stages and restrict the intra-op ILP instead of searching: a plan file pins each
listed op and parameter to its recorded strategy (ops it leaves out are chosen by the ILP), a
uniform plan pins mesh axis 0 to data parallelism and axis 1 to Megatron's layout (the ILP picks among the
few strategies that leaves). The stages are then assembled exactly as
`optimize` assembles its own, so a plan that `solve` wrote evaluates to its own iteration time.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from itertools import accumulate

from partopt import costmodel, intra
from partopt.cluster import Cluster
from partopt.errors import InfeasibleError, InstanceError
from partopt.graph import Graph, Op
from partopt.ops import NORM_KINDS
from partopt.assemble import assemble, pipeline_of
from partopt.options import Options, microbatch_counts
from partopt.pricing import STATUS_RANK, Job, LayerCost, Priced, Pricer, Stats, ladder, rung
from partopt.schedules import check_schedule, inflight, iteration_time
from partopt.stages import End, Pipeline, StageSpec, StageTotals, chunks, combined, totals
from partopt.layering import Layering, build_layers
from partopt.plan import OpStrategy, ParamPlacement, Plan, records, stores_padded, tensor_table
from partopt.sharding import ParamStrategy, Replicate, Shard, Strategy, split_ways
from partopt.units import fmt_bytes


def _check_stages(plan_layers: list[list[int]], count: int, where: str) -> None:
    """Stages must cover DP layers 0..count-1 in order, each exactly once."""
    expected = 0
    for i, (first, last) in enumerate(plan_layers):
        if first != expected or last < first:
            raise InstanceError(f"stage {i} covers layers [{first}, {last}] but the next uncovered layer is {expected}",
                                f"{where}.stages[{i}].layers", f"stages must cover layers 0..{count - 1} in order")
        expected = last + 1
    if expected != count:
        raise InstanceError(f"the stages cover layers 0..{expected - 1} of 0..{count - 1}", f"{where}.stages",
                            "add stages for the remaining layers")


def _check_meshes(cluster: Cluster, specs: list[StageSpec], where: str) -> None:
    """Each submesh exists in the cluster, each logical mesh has its submesh's devices, all fit together."""
    used = 0
    for i, spec in enumerate(specs):
        n, m = spec.submesh
        if not (1 <= n <= cluster.nodes and 1 <= m <= cluster.devices_per_node) or (n > 1 and m != cluster.devices_per_node):
            raise InfeasibleError(f"submesh {spec.submesh} is not a submesh of {cluster.nodes} × {cluster.devices_per_node}",
                                  f"{where}.stages[{i}].submesh",
                                  f"use (1, k) with k ≤ {cluster.devices_per_node} or (n, {cluster.devices_per_node}) with n ≤ {cluster.nodes}")
        if spec.shape[0] * spec.shape[1] != n * m:
            raise InfeasibleError(f"logical mesh {spec.shape} has {spec.shape[0] * spec.shape[1]} devices, "
                                  f"its submesh {spec.submesh} has {n * m}", f"{where}.stages[{i}].logical_mesh",
                                  "make a × b equal the submesh's devices")
        used += n * m
    if used > cluster.num_devices:
        raise InfeasibleError(f"the stages use {used} devices, the cluster has {cluster.num_devices}", f"{where}.stages",
                              "use smaller submeshes or a larger cluster (--nodes)")


def _pinned(op_entries: dict[str, OpStrategy], param_entries: dict[str, ParamPlacement], layering: Layering,
            first: int, last: int, where: str, uneven_params: bool = False) -> intra.Restriction:
    """The restriction that keeps each listed op's recorded axes and each listed parameter's placement
    (`uneven_params`: stored padded where its split does not divide its dim, as a plan of ZeRO-3's layout may).

    A parameter read in two priced layers of the stage (a tied embedding) is priced in each with
    its own placement, of which the plan records one: it is left to the ILP in both."""
    units = [layer for first_unit, last_unit in layering.groups[first:last + 1]
             for layer in layering.base[first_unit:last_unit + 1]]
    names = {op.name for ops in units for op in ops}
    for name in op_entries:
        if name not in names:
            raise InstanceError(f"op {name!r} is not in this stage's layers", f"{where}.ops.{name}",
                                "list each op under the stage that runs it")
    readers = Counter(t for ops in units for t in {t for op in ops for t in op.inputs})
    axes = {name: entry.axes for name, entry in op_entries.items()}
    params = {name: entry for name, entry in param_entries.items() if readers[name] == 1}

    def op_ok(op: Op, s: Strategy) -> bool:
        return op.name not in axes or tuple(s.axes) == axes[op.name]

    def param_ok(tensor: str, s: ParamStrategy) -> bool:
        return tensor not in params or ParamPlacement(s.placement, s.zero_axes) == params[tensor]

    return intra.Restriction(op_ok, param_ok, f"the plan ({where}; a split must divide its dim on the mesh)",
                             uneven_params=uneven_params)


def _features(graph: Graph, op: Op) -> set[str]:
    """A norm's features: the dims its scale and shift carry, else its last dim."""
    params = [t for t in op.inputs[1:] if graph.tensors[t].role == "param"]
    return {d for t in params for d in graph.tensors[t].dims} if params else set(graph.tensors[op.output].dims[-1:])


def sequence_dims(graph: Graph, op: Op) -> set[str]:
    """A norm's dims besides the batch and its features: the sequence, which Megatron's sequence parallelism
    splits over the tensor-parallel axis."""
    return set(graph.tensors[op.output].dims) - _features(graph, op) - {graph.batch_dim}


def residual_dims(graph: Graph) -> set[str]:
    """The residual stream's features: the dims the graph's norms carry scales for."""
    return {d for op in graph.ops if op.kind in NORM_KINDS for d in _features(graph, op)}


def tensor_parallel_dims(graph: Graph) -> set[str]:
    """The dims Megatron's tensor parallelism splits: the dims of matmul and embedding weights other than the
    residual stream's and the batch — heads, head features, the MLP's hidden units, the vocabulary."""
    weights = {d for op in graph.ops if op.kind in ("einsum", "embedding") for t in op.inputs
               if graph.tensors[t].role == "param" for d in graph.tensors[t].dims}
    return weights - residual_dims(graph) - batch_dims(graph)


def batch_dims(graph: Graph) -> set[str]:
    """The batch and the dims reshapes carry it in as their outer part (an MoE layer's tokens `(b, s) -> m`, then
    its groups `m -> (g, c)`): splitting one of them on the data-parallel axis splits the batch."""
    carriers, size = {graph.batch_dim}, 0
    while size < len(carriers):
        size = len(carriers)
        for op in graph.ops:
            carriers |= {whole for whole, parts in (op.attrs.get("merge") or {}).items() if parts[0] in carriers}
            carriers |= {parts[0] for whole, parts in (op.attrs.get("split") or {}).items() if whole in carriers}
    return carriers


def expert_dims(graph: Graph) -> set[str]:
    """The dims an einsum applies a stack of weights along, each to its own slice of tokens: in a weight, in its
    other input and in its output (an MoE layer's experts `e` in fc1 and fc2; the router's weight has `e` too, but
    its tokens do not). Megatron-LM's expert parallelism splits them, each rank holding its experts whole."""
    return {d for op in graph.ops if op.kind == "einsum" for w in op.inputs if graph.tensors[w].role == "param"
            for d in graph.tensors[w].dims if d in graph.tensors[op.output].dims
            and any(d in graph.tensors[t].dims for t in op.inputs if graph.tensors[t].role != "param")}


def expert_ops(graph: Graph) -> dict[str, str]:
    """Op name -> expert dim, for the ops an expert runs on its own tokens: the einsums that apply the stacked weights
    (`expert_dims`) and the ops they feed whose every tensor holds the dim (the activation between fc1 and fc2), not
    the router's or the dispatch's, which read the tokens as they were grouped."""
    experts, found = expert_dims(graph), {}
    for op in graph.order:
        tensors = [graph.tensors[t] for t in (*op.inputs, op.output)]
        held = experts.intersection(*(t.dims for t in tensors))
        stacked = op.kind == "einsum" and any(t.role == "param" for t in tensors)
        fed = any(graph.producers[t].name in found for t in op.inputs if t in graph.producers)
        if held and (stacked or fed):
            found[op.name] = min(held)
    return found


def _megatron(graph: Graph, tp: int, dp: int, zero: bool, sequence_parallel: bool = False,
              shard_weights: bool = False, expert_parallel: bool = False) -> intra.Restriction:
    """Axis 0 (size dp) splits the batch and holds parameter copies; axis 1 (size tp) is Megatron's tensor
    parallelism (Shoeybi et al. 2019). An op that reads a matmul or embedding weight splits one of
    `tensor_parallel_dims`, whose shard each rank keeps: column-parallel its output, row-parallel the contraction,
    summed by an all-reduce (where tp divides none of them, a vocabulary of 50,257 that Megatron-LM pads, it runs
    whole on every rank, an upper bound). Every other op splits one too or is replicated, as Megatron-LM runs the
    norms, residual adds and biases of the residual stream on every rank, each rank holding their parameters whole.
    With `sequence_parallel` (Korthikanti et al. 2022) the norms split their sequence, and the residual stream's
    other ops may too (the all-reduce becomes a reduce-scatter and an all-gather). With `shard_weights` axis 0 holds
    each parameter split instead (ZeRO-3, FSDP: gathered for each use, its gradient reduce-scattered, so weights,
    gradients and optimizer state are all split dp ways), along a dim dp divides where it has one, else padded as
    ZeRO-3 and FSDP pad their shards (a bias of 96 heads over 384 ranks; every weight of h 20480 over 1,120).
    With `expert_parallel` axis 0 splits the experts instead in the ops that run them (`expert_ops`), and their
    weights, each rank holding dp-th of the experts whole with their optimizer state (Megatron-LM's
    --expert-model-parallel-size dp, which leaves no expert-data-parallel ranks to shard that state over); axis 1
    splits each expert's hidden units as its other weights (--expert-tensor-parallel-size tp, its default), and the
    router's weight, which Megatron-LM holds whole, is kept whole."""
    batch = batch_dims(graph)
    experts = expert_ops(graph) if expert_parallel else {}
    weights = {t: experts[op.name] for op in graph.ops if op.name in experts for t in op.inputs
               if graph.tensors[t].role == "param"}
    split, residual = tensor_parallel_dims(graph) - set(experts.values()), residual_dims(graph)
    sequence = {d for op in graph.ops if op.kind in NORM_KINDS for d in sequence_dims(graph, op)}

    def reads_a_split_weight(op: Op) -> bool:
        return any(graph.tensors[t].role == "param" and split & set(graph.tensors[t].dims) for t in op.inputs)

    def splits_evenly(op: Op) -> bool:
        return any(graph.dims[d] % tp == 0 for d in split & set(graph.behaviours(op)))

    def op_ok(op: Op, s: Strategy) -> bool:
        if op.name in experts:
            if s.axes[0] != experts[op.name]:
                return False
        elif dp > 1 and (s.axes[0] not in batch if batch & set(graph.behaviours(op)) else s.axes[0] is not None):
            return False
        if tp == 1:
            return True
        if sequence_parallel and op.kind in NORM_KINDS:
            return s.axes[1] in sequence_dims(graph, op)
        if reads_a_split_weight(op):  # whole on every rank when tp divides none of its dims (Megatron pads them)
            return s.axes[1] in split or (s.axes[1] is None and not splits_evenly(op))
        in_stream = sequence_parallel and residual <= set(graph.tensors[op.output].dims)
        return s.axes[1] is None or s.axes[1] in split or (in_stream and s.axes[1] in sequence)

    def held_as_megatron_does(tensor: str, s: ParamStrategy) -> bool:  # on the tensor-parallel axis
        dims = [d for d in graph.tensors[tensor].dims if d in split and graph.dims[d] % tp == 0]
        kept = s.placement[1]
        return isinstance(kept, Shard) and kept.dim in dims if dims else isinstance(kept, Replicate)

    def param_ok(tensor: str, s: ParamStrategy) -> bool:
        if tp > 1 and not held_as_megatron_does(tensor, s):
            return False
        if tensor in weights:
            return s.placement[0] == Shard(weights[tensor]) and not s.zero_axes
        if shard_weights and dp > 1:  # split evenly where a dim dp divides allows it, else padded
            even = all(graph.dims[d] % n == 0 for d, n in split_ways(s.placement, (dp, tp)).items())
            return isinstance(s.placement[0], Shard) and not s.zero_axes and (
                even or not any(graph.dims[d] % dp == 0 for d in graph.tensors[tensor].dims))
        copies = dp == 1 or isinstance(s.placement[0], Replicate)
        return copies and (0 in s.zero_axes) == ((zero or shard_weights) and dp > 1) and 1 not in s.zero_axes

    return intra.Restriction(op_ok, param_ok, f"Megatron's layout (data parallel {dp} × tensor parallel {tp}"
                                              f"{', sequence parallel' if sequence_parallel else ''}"
                                              f"{', weights sharded' if shard_weights and dp > 1 else ''}"
                                              f"{', experts over the data-parallel ranks' if experts else ''})",
                             ("megatron", dp, tp, zero and dp > 1, sequence_parallel and tp > 1,
                              shard_weights and dp > 1, bool(experts)), uneven_params=shard_weights and dp > 1)


def _price_layers(pricer: Pricer, cluster: Cluster, pipe: Pipeline, count: int, spec: StageSpec,
                  restriction: intra.Restriction, stats: Stats, budget: float | None = None,
                  whole: float | None = None) -> list[LayerCost | None]:
    """The stage's base layers priced on its mesh under `restriction` (others None: not in this stage); `pipe`: the
    plan's pipeline (`assemble.pipeline_of`), whose stage accountant (`stages.totals`) says what the stage holds.

    With a `budget`, each layer takes its fastest strategy within the budget (the stage DP's first row) when the
    stage fits with all of them; where the budget is a share of the device's (`whole`: an interleaved chunk's) and
    an earlier call priced the layer within the whole, that strategy is taken when it fits the share, being the
    fastest there too (its ILP's feasible set holds the share's). Else the stage's n layers are fitted to it
    together on the search's ladder of caps (`pricing.ladder` of the rung r = `pricing.rung(n)`): each layer
    within its even share budget / r
    with the stage's in-flight microbatches and 1/r of its transient peak (so that together they
    fit: the stage holds one peak), else within the first looser rung it fits (a small embedding
    leaves room to the blocks), and without a cap only if all fail. These are the stage DP's rows
    (`pricing.tighten`) where the DP's in-flight count is the stage's. Should the layers past their
    even share overflow the stage together, each is refitted within what the others leave.
    """
    mb = pricer.graph.dims[pricer.graph.batch_dim] // count
    mesh = cluster.logical_mesh(spec.submesh, spec.shape)
    layering = pipe.layering
    first, last = layering.groups[spec.first][0], layering.groups[spec.last][1]
    names = {b: tuple(op.name for op in layering.base[b]) for b in range(first, last + 1)}

    def held(row: list[LayerCost | None]) -> float:  # the stage's memory per device with these costs
        return totals(row, pipe, spec.first, spec.last, End(spec.submesh, spec.shape)).memory_bytes(spec.inflight)

    def within(b: int) -> Priced:  # layer b's fastest strategy within the budget
        known = pricer.cached(Job(mb, count, names[b], mesh, spec.recompute, whole, 1, restriction)) if (
            whole is not None and whole > budget) else None
        if isinstance(known, LayerCost) and known.memory_bytes(1) <= budget:
            stats.record(known, solved=False)
            return known
        return pricer.one(Job(mb, count, names[b], mesh, spec.recompute, budget, 1, restriction), stats)

    if budget is not None:  # the fastest within the budget, when the stage holds them together (no share binds)
        fastest = [within(b) if b in names else None for b in range(len(layering.base))]
        if all(isinstance(fastest[b], LayerCost) for b in names) and held(fastest) <= budget:
            return fastest
    rungs = ladder(rung(last - first + 1)) if budget is not None else []
    row: list[LayerCost | None] = [None] * len(layering.base)
    loose: list[int] = []  # layers past their even share
    for b in range(first, last + 1):
        even = False
        for r in rungs:  # the even share first, then looser caps
            cost = pricer.one(Job(mb, count, names[b], mesh, spec.recompute, budget / r, spec.inflight, restriction, r),
                              stats)
            if isinstance(cost, LayerCost):
                even = r == rungs[0]
                break
        else:  # the stage will not fit: the check in `price` says by how much
            cost = pricer.one(Job(mb, count, names[b], mesh, spec.recompute, None, 1, restriction), stats)
        if budget is not None and not even:
            loose.append(b)
        row[b] = cost
    if loose and held(row) > budget:
        # layers past their even share overflow together (a block beside an embedding, each given the whole
        # budget): cap them at what the others leave, shared evenly, each with its whole working set, so that
        # the stage fits whenever they do; a layer that does not fit keeps its rung and `price` reports it
        # (a new row: `pipe` keeps the sums of the one `held` read, by its identity)
        others = sum(c.memory_bytes(spec.inflight) for b, c in enumerate(row) if c is not None and b not in loose)
        cap = (budget - others) / len(loose)
        refitted = {b: pricer.one(Job(mb, count, names[b], mesh, spec.recompute, cap, spec.inflight, restriction), stats)
                    for b in (loose if cap > 0 else [])}
        row = [refitted[b] if isinstance(refitted.get(b), LayerCost) else c for b, c in enumerate(row)]
    return row


def price(graph: Graph, cluster: Cluster, layering: Layering, count: int, specs: list[StageSpec],
          restrictions: list[intra.Restriction] | None, options: Options, where: str = "plan",
          fit_memory: bool = False, cache: dict | None = None, schedule: str = "1f1b", virtual_stages: int = 1,
          check_memory: bool = True) -> Plan:
    """The plan of fixed stages (`specs`, run under `schedule`: see `assemble`), each priced by the intra-op ILP under its restriction
    (None: every strategy allowed); `fit_memory` makes each stage's layers choose strategies that
    fit the device memory together (see `_price_layers`), rather than the fastest. `cache` keeps
    the layer solutions across calls (`pricing.Pricer`'s, shared with `optimize`).

    Raises InfeasibleError when a stage's memory exceeds the budget, unless `check_memory` is off: as soon as the
    stage's device group is priced, its first (the most microbatches in flight) first, and the others unpriced.
    """
    start = time.perf_counter()
    stats = Stats()
    restrictions = restrictions or [intra.UNRESTRICTED] * len(specs)
    budget = costmodel.memory_budget(cluster.device, options.memory_reserve)
    groups = len(specs) // virtual_stages  # device groups; group d runs chunks d, d + groups, …
    with costmodel.using(options.cost_model), Pricer(graph, options, cache) as pricer:
        # a device of an interleaved plan holds its v chunks together: each chunk's layers share budget / v
        share = budget / virtual_stages if fit_memory else None
        pipe = pipeline_of(graph, cluster, layering, count, options.overlap)
        rows: list[list[LayerCost | None]] = [[] for _ in specs]
        for d in range(groups):
            chunks = range(d, len(specs), groups)
            for j in chunks:
                rows[j] = _price_layers(pricer, cluster, pipe, count, specs[j], restrictions[j], stats, share,
                                        budget if fit_memory else None)
            if check_memory:  # what the group holds, summed as `assemble` sums it (`stages.combined`)
                held = combined([totals(rows[j], pipe, specs[j].first, specs[j].last,
                                        End(specs[j].submesh, specs[j].shape)) for j in chunks])
                _check_held(held, specs[d].inflight, budget, d, virtual_stages, where)
        plan = assemble(graph, cluster, layering, options, count, specs, rows, stats, time.perf_counter() - start,
                        schedule, virtual_stages, pipe)
    return plan


def _check_held(held: StageTotals, inflight: float, budget: float, stage: int, virtual_stages: int, where: str) -> None:
    """InfeasibleError when device group `stage` holding `held` (its chunks' sums) with `inflight` microbatches
    exceeds the budget: by how much, and its parts."""
    need = held.memory_bytes(inflight)
    if need > budget:
        raise InfeasibleError(
            f"stage {stage} needs {fmt_bytes(need)} per device (parameter state {fmt_bytes(held.param_bytes)} + "
            f"{inflight:g} × {fmt_bytes(held.activation_bytes)} activations + "
            f"{fmt_bytes(held.working_bytes)} working set and transient buffers"
            f"{f', its devices holding {virtual_stages} chunks' if virtual_stages > 1 else ''}), over the budget "
            f"{fmt_bytes(budget)} by {fmt_bytes(need - budget)}", f"{where}.stages[{stage}]",
            "use more devices per stage, more stages, ZeRO (--zero), or more microbatches")


def _least_pipeline(graph: Graph, cluster: Cluster, layering: Layering, ranges: list[tuple[int, int]], pp: int,
                    count: int, mesh: tuple, restriction: intra.Restriction, options: Options, cache: dict) -> float:
    """A lower bound on the iteration time of a uniform 1F1B or interleaved plan of `count` microbatches whose pp·v
    chunks are `ranges` (chunk j on device group j mod pp) on `mesh` = (submesh, shape), whatever its recomputation
    and memory: the schedule's closed form (`schedules.iteration_time`: 1F1B's Σ t + (B − 1) max t, the interleaved
    Σ t / v + (B − 1 / v) max t, here with no fill, sends or sync; docs/COSTMODEL.md §5b), which no t_i lowers, at
    each device group's t_i at its least: the sum of its layers' least times per microbatch under the restriction,
    memory aside (`intra`'s time floor; recomputing only adds time). Not ZB-H1's, whose closed form its weight passes
    lower. One uncapped ILP per distinct layer, shared through `cache`."""
    mb = graph.dims[graph.batch_dim] // count
    logical = cluster.logical_mesh(*mesh)
    with costmodel.using(options.cost_model), Pricer(graph, options, cache) as pricer:
        jobs = {b: Job(mb, count, tuple(op.name for op in ops), logical, options.recompute_modes[0], None, 1,
                       restriction, time_floor=True) for b, ops in enumerate(layering.base)}
        floors = {b: cost.sharding.time_floor_s if isinstance(cost, LayerCost) else 0.0
                  for b, cost in pricer.run(jobs, Stats()).items()}
    t = [sum(floors[b] for first, last in ranges[group::pp]
             for b in range(layering.groups[first][0], layering.groups[last][1] + 1)) for group in range(pp)]
    v = len(ranges) // pp
    return iteration_time(t, [0.0] * pp, 0.0, count, "interleaved" if v > 1 else "1f1b", v)


def _records_graph(plan: Plan, graph: Graph) -> bool:
    """True when the plan's tensor table is `graph`'s (names, dims, one microbatch's shape, roles, dtypes):
    the plan was made for this graph under another name (a renamed or copied graph file)."""
    try:
        table = tensor_table(intra.with_batch(graph, plan.microbatch_size))
        return (bool(plan.tensors) and plan.tensors.keys() == table.keys()
                and all(records(t, table[name]) for name, t in plan.tensors.items()))
    except InfeasibleError:  # a microbatch this graph cannot have (its derived dims do not scale)
        return False


def evaluate(graph: Graph, cluster: Cluster, plan: Plan, where: str = "plan", **kwargs) -> Plan:
    """`plan` priced on `graph` and `cluster` as written: its stages, meshes, microbatches and strategies.

    Keywords are `optimize`'s options (backend, time_limit_s, memory_reserve, seed); the plan's
    own `layers` option rebuilds its DP layers.
    """
    if plan.graph != graph.name and not _records_graph(plan, graph):
        raise InstanceError(f"the plan was made for graph {plan.graph!r}, not {graph.name!r}, and its tensors "
                            "differ from this graph's", f"{where}.graph", "evaluate a plan on the graph it was made for")
    if graph.batch_dim is None:
        raise InstanceError("the graph names no batch dim", "batch_dim", "set `batch_dim` to plan microbatches")
    options = Options(**{"layers": plan.options.get("layers"), "recompute": plan.options.get("recompute", False),
                         "overlap": plan.options.get("overlap", False),
                         "state_layout": plan.options.get("state_layout", "zero"), **kwargs})
    count = microbatch_counts(graph.dims[graph.batch_dim], plan.num_microbatches)[0]
    layering = build_layers(graph, options.layers)
    _check_stages([s.layers for s in plan.stages], len(layering.groups), where)
    v = plan.virtual_stages
    S = len(plan.stages) // v
    check_schedule(plan.schedule, v, S, count)
    specs = [StageSpec(s.layers[0], s.layers[1], tuple(s.submesh), tuple(s.logical_mesh),
                       inflight(i % S, S, count, plan.schedule, v), s.recompute) for i, s in enumerate(plan.stages)]
    _check_meshes(cluster, specs[:S], where)
    restrictions = [_pinned(s.ops, s.params, layering, s.layers[0], s.layers[1], f"{where}.stages[{i}]",
                            stores_padded(plan))
                    for i, s in enumerate(plan.stages)]
    return price(graph, cluster, layering, count, specs, restrictions, options, where,
                 schedule=plan.schedule, virtual_stages=v)


def _stage_ranges(layers: int, pp: int, v: int, stage_layers: Sequence[int] | None, where: str) -> list[tuple[int, int]]:
    """The (first, last) layer of each of the pp·v chunks: Megatron's equal split, or the `stage_layers` given."""
    if stage_layers is None:
        if layers % (pp * v):
            raise InfeasibleError(f"{layers} layers do not split into {pp * v} equal {'chunks' if v > 1 else 'stages'}",
                                  where, f"choose pp{' × virtual stages' if v > 1 else ''} dividing {layers}, or give "
                                  "each stage its layer count")
        return chunks(layers, pp, v)
    counts = list(stage_layers)
    if v != 1 or len(counts) != pp or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in counts) \
            or sum(counts) != layers:
        raise InstanceError(f"stage layer counts {counts} do not split {layers} layers into {pp} stages of at least one "
                            "layer" + (" (one chunk per stage only)" if v != 1 else ""), f"{where} stage_layers",
                            f"give {pp} positive counts summing to {layers}")
    ends = list(accumulate(counts))
    return [(end - n, end - 1) for n, end in zip(counts, ends)]


def _check_expert_parallel(graph: Graph, tp: int, dp: int, expert_parallel: int, sequence_parallel: bool,
                           where: str) -> None:
    """InstanceError unless `expert_parallel` is 1, or dp with experts dp splits and, when tp > 1, sequence
    parallelism: Megatron-LM (d98e8a6) asserts its experts a multiple of --expert-model-parallel-size
    (megatron/training/arguments.py:1655-1658), and its MoE layer raises when trained with tensor but not sequence
    parallelism (megatron/core/transformer/moe/moe_layer.py:636-640)."""
    if expert_parallel == 1:
        return
    if expert_parallel != dp:
        raise InstanceError(f"expert parallelism {expert_parallel} is not the data-parallel degree {dp}", where,
                            f"give --expert-parallel {dp}: the uniform layout places the experts over the whole "
                            "data-parallel axis")
    experts = sorted(expert_dims(graph))
    if not experts:
        raise InstanceError("the graph has no experts (no einsum applies a stack of weights along a dim of its "
                            "tokens)", where, "drop --expert-parallel")
    uneven = [d for d in experts if graph.dims[d] % dp]
    if uneven:
        raise InstanceError(f"{graph.dims[uneven[0]]} experts ({uneven[0]}) do not split over {dp} data-parallel "
                            "ranks", where, "choose dp dividing the experts, as Megatron-LM asserts")
    if tp > 1 and not sequence_parallel:
        raise InstanceError("an MoE model with tensor parallelism trains only with sequence parallelism (Megatron-LM's "
                            "MoE layer refuses otherwise)", where, "add --sequence-parallel")


def uniform(graph: Graph, cluster: Cluster, tp: int, pp: int, dp: int, microbatches: int | None = None,
            zero: bool = False, sequence_parallel: bool = False, schedule: str = "1f1b", virtual_stages: int = 1,
            shard_weights: bool = False, expert_parallel: int = 1, check_memory: bool = True,
            stage_layers: Sequence[int] | None = None, cache: dict | None = None, bar: float = math.inf,
            where: str | None = None, **kwargs) -> Plan | None:
    """Megatron's plan: `pp` stages of equally many layers, each on a (dp, tp) mesh of its devices.

    Axis 0 splits the batch (and ZeRO-shards optimizer state with `zero`, or every parameter with `shard_weights`:
    ZeRO-3, FSDP); axis 1 runs Megatron's tensor parallelism (`_megatron`), inside a node when tp ≤ devices
    per node; `sequence_parallel` splits the norms along their sequence there (else they run on every rank).
    `microbatches` is searched when not given, as users tune it: every power-of-two count of at
    least pp whose microbatch splits over dp; the fastest plan that fits wins. Every stage
    recomputes alike: the `recompute` keyword's mode, or (auto, the default) the fastest that fits.
    `schedule` runs the pipeline (`schedules.SCHEDULES`); interleaved with v = `virtual_stages` is
    Megatron's: pp·v chunks of equally many layers, chunk j on stage j mod pp, B a multiple of pp.
    `check_memory=False` prices a run known to have fit (a calibration point) whatever the memory model says of
    it: each layer at its fastest strategy, no stage refused. The keyword `tp_comm_overlap` (an `Options` field) is
    Megatron-LM's `--tp-comm-overlap`, which needs `sequence_parallel`, as Megatron-LM asserts. `stage_layers` gives
    each stage its own count of layers instead (one schedule chunk per stage), as a run split unevenly did (Megatron-LM's
    `--decoder-first/last-pipeline-num-layers`, DeepSpeed's `partition_method`). `cache` keeps the layer solutions
    across calls (`price`'s). Under 1F1B and interleaved, a microbatch count whose plans cannot cost less than `bar`
    (`_least_pipeline`) is not priced; None when no count is left (a search over layouts passes its best so far).
    `where` names the layout in errors (default: as `partopt evaluate`'s flags; `check` names the plan's record).
    `expert_parallel` = dp places an MoE model's experts over the data-parallel ranks, Megatron-LM's
    --expert-model-parallel-size (`_megatron`, `_check_expert_parallel`).
    """
    where = where or f"--tp {tp} --pp {pp} --dp {dp}"
    if min(tp, pp, dp) < 1:
        raise InstanceError("tp, pp and dp must be at least 1", where, "give positive degrees")
    if kwargs.get("tp_comm_overlap") and not (sequence_parallel and tp > 1):
        raise InstanceError("tensor-parallel comm overlap needs sequence parallelism and tp > 1 (Megatron-LM asserts "
                            "it)", "--tp-comm-overlap", "add --sequence-parallel, or drop --tp-comm-overlap")
    if tp * pp * dp != cluster.num_devices:
        raise InfeasibleError(f"tp × pp × dp = {tp * pp * dp} but the cluster has {cluster.num_devices} devices",
                              where, "choose degrees whose product is the device count")
    per_stage, m = tp * dp, cluster.devices_per_node
    if per_stage % m and m % per_stage:
        raise InfeasibleError(f"a stage of {per_stage} devices neither fills whole nodes of {m} nor divides one",
                              where, f"make tp × dp a divisor or a multiple of {m}")
    submesh = (per_stage // m, m) if per_stage >= m else (1, per_stage)
    if graph.batch_dim is None:
        raise InstanceError("the graph names no batch dim", "batch_dim", "set `batch_dim` to plan data parallelism")
    _check_expert_parallel(graph, tp, dp, expert_parallel, sequence_parallel, where)
    options = Options(layers=None, **kwargs)
    batch = graph.dims[graph.batch_dim]
    try:
        check_schedule(schedule, virtual_stages, pp, microbatches or pp)
    except InstanceError as err:
        raise InstanceError(err.cause, where, err.hint) from None
    if microbatches is None:
        counts = [c for c in microbatch_counts(batch, "auto") if c >= pp and (batch // c) % dp == 0
                  and (schedule != "interleaved" or c % pp == 0)]
        if not counts:
            raise InfeasibleError(f"no power-of-two microbatch count of at least {pp} splits a batch of {batch} "
                                  f"over {dp} data-parallel ranks", where, "give --microbatches, or change the batch")
    else:
        counts = microbatch_counts(batch, microbatches)
        if (batch // counts[0]) % dp:
            raise InfeasibleError(f"a microbatch of {batch // counts[0]} samples does not split over {dp} "
                                  f"data-parallel ranks", where, "choose microbatches so that batch / B is divisible by dp")
    layering = build_layers(graph, None)
    L, v = len(layering.groups), virtual_stages
    ranges = _stage_ranges(L, pp, v, stage_layers, where)
    if schedule == "interleaved" and counts[0] % pp:
        raise InfeasibleError(f"the interleaved schedule needs microbatches divisible by pp = {pp}, got {counts[0]}",
                              where, "Megatron-LM requires it: pick a multiple of pp")
    start = time.perf_counter()
    plans, error, cache = [], None, {} if cache is None else cache
    bounded = bar < math.inf and schedule in ("1f1b", "interleaved") and not options.tp_comm_overlap
    for count in counts:
        restriction = _megatron(intra.with_batch(graph, batch // count), tp, dp, zero, sequence_parallel, shard_weights,
                                expert_parallel > 1)
        if bounded and _least_pipeline(graph, cluster, layering, ranges, pp, count, (submesh, (dp, tp)), restriction,
                                       options, cache) >= bar:
            continue
        for mode in options.recompute_modes:
            specs = [StageSpec(first, last, submesh, (dp, tp), inflight(j % pp, pp, count, schedule, v), mode)
                     for j, (first, last) in enumerate(ranges)]
            try:
                plans.append(price(graph, cluster, layering, count, specs, [restriction] * len(specs), options, where,
                                   fit_memory=check_memory, cache=cache, schedule=schedule, virtual_stages=v,
                                   check_memory=check_memory))
            except InfeasibleError as err:
                error = err  # the smallest microbatch's leanest mode: its overflow is the one worth reporting
    if not plans:
        if error is None:  # every count outpriced by `bar`
            return None
        raise error
    best = min(plans, key=lambda plan: plan.iteration_time_s)
    best.options["megatron"] = {"tp": tp, "pp": pp, "dp": dp, "zero": zero, "sequence_parallel": sequence_parallel,
                                "shard_weights": shard_weights,  # how `partopt check` re-derives it
                                "tp_comm_overlap": options.tp_comm_overlap,
                                **({"stage_layers": list(stage_layers)} if stage_layers is not None else {}),
                                **({"expert_parallel": expert_parallel} if expert_parallel > 1 else {})}
    best.solver.update(ilps=sum(p.solver["ilps"] for p in plans), ilp_time_s=sum(p.solver["ilp_time_s"] for p in plans),
                       time_s=time.perf_counter() - start, microbatch_counts=counts,
                       status=max((p.solver["status"] for p in plans), key=STATUS_RANK.get),
                       gap=None if any(p.solver["gap"] is None for p in plans) else max(p.solver["gap"] for p in plans),
                       timeouts=sum(p.solver["timeouts"] for p in plans))
    return best
