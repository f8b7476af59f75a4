"""Inter-operator parallelism: the search over microbatch counts, stage cuts, submeshes, logical
meshes and recomputation modes.

Every base layer (a layer tag) is priced by the intra-op ILP (`partopt.pricing`) on every logical
mesh of every submesh shape, once per structure: layers that hash alike share one solve. A stage's
cost is the sum of its layers' costs plus the point-to-point send of its boundary activations
(`partopt.stages`); the resharding between two layers of one stage is priced inside each layer's
ILP as free input layout (see docs/COSTMODEL.md, "Stage composition"). The stage DP (`stagedp`)
then cuts the DP layers into stages for each candidate microbatch count, the best plan wins, and
`partopt.assemble` writes it out.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

from partopt import costmodel, intra, stagedp
from partopt.assemble import assemble, pipeline_of
from partopt.cluster import Cluster
from partopt.errors import InfeasibleError, InstanceError, PartoptError
from partopt.graph import Graph, Op
from partopt.layering import build_layers, tagged_layers
from partopt.ops import is_matmul
from partopt.options import DEFAULT_MAX_LAYERS, Options, microbatch_counts, restrictions
from partopt.plan import Plan
from partopt.pricing import Expired, Job, Pricer, Stats, tighten
from partopt.schedules import SEARCHED, inflight, interleaved_shapes
from partopt.stages import Pipeline, StageSpec, chunks, interleaved_table, split_table, stage_table
from partopt.units import fmt_bytes

__all__ = ["DEFAULT_MAX_LAYERS", "Options", "microbatch_counts", "optimize"]
Progress = Callable[[int, int], None]


def _submeshes(cluster: Cluster, options: Options) -> list[tuple[int, int]]:
    whole = (cluster.nodes, cluster.devices_per_node)
    if options.intra_only or options.data_parallel_only:
        return [whole]
    if options.inter_only:
        return [(1, 1)]
    return cluster.submesh_shapes(options.submesh_family)


def _shapes(cluster: Cluster, submesh: tuple[int, int], options: Options) -> list[tuple[int, int]]:
    devices = submesh[0] * submesh[1]
    if options.data_parallel_only or options.stage_data_parallel:
        return [(devices, 1)]
    shapes = cluster.logical_shapes(submesh)
    if options.logical_shapes == "node_local":  # Alpa's benchmark space: the second axis stays in a node
        return [s for s in shapes if submesh[0] == 1 or cluster.devices_per_node % s[1] == 0]
    if options.logical_shapes == "all":
        return shapes
    if isinstance(options.logical_shapes, str):
        raise InstanceError(f"unknown logical shape family {options.logical_shapes!r}", "logical_shapes",
                            "use node_local, all, or a list of (a, b) shapes")
    return [s for s in shapes if tuple(s) in {tuple(x) for x in options.logical_shapes}]


def optimize(graph: Graph, cluster: Cluster, progress: Progress | None = None, cache: dict | None = None,
             options: Options | None = None, **kwargs) -> Plan:
    """The best pipeline + sharding plan of `graph` on `cluster` under the cost model.

    Options (keywords): microbatches ("auto": the powers of two dividing the batch; a count; or
    several counts to search), layers (most DP layers, default 64),
    submesh_family ("alpa" | "power_of_two"), logical_shapes ("node_local": the second mesh axis
    within a node, as Alpa's benchmarks; "all"; or a list of allowed (a, b) shapes), backend
    ("highs" | "cpsat" | "cbc"), time_limit_s (per ILP), memory_reserve (fraction of device
    memory kept free), intra_only / inter_only / data_parallel_only / stage_data_parallel
    (restricted searches, the benchmarks' baselines: one stage on the whole cluster; stages of
    one device; one data-parallel stage with ZeRO allowed, like DeepSpeed; pipeline stages that
    are each plain data parallel, like PP-DP), seed, workers, recompute ("auto" | "none" |
    "selective" | "full"), cost_model (a `costmodel.CostModel`; default analytical). Give them as keywords or as one `options=Options(...)`, not both.
    `cache`: a dict that keeps the per-layer ILP solutions; pass the same one to several calls (a
    full search, then its restricted variants) to solve each distinct layer ILP once.
    """
    if options is not None and kwargs:
        raise PartoptError(f"options given twice: an Options object and keywords {sorted(kwargs)}", "optimize",
                           "put every option in the Options object, or pass keywords only")
    try:
        options = options or Options(**kwargs)
    except TypeError as err:
        raise PartoptError(f"unknown option: {err}", "optimize", f"use one of {list(Options.__dataclass_fields__)}") from None
    with costmodel.using(options.cost_model):
        return _search(graph, cluster, options, progress, cache)


def _search(graph: Graph, cluster: Cluster, options: Options, progress: Progress | None, cache: dict | None) -> Plan:
    """`optimize` under its cost model."""
    start = time.perf_counter()
    if graph.batch_dim is None:
        raise InstanceError("the graph names no batch dim", "batch_dim", "set `batch_dim` to plan data parallelism and microbatches")
    if options.schedule not in ("auto", *SEARCHED):
        raise InstanceError(f"the search does not plan the {options.schedule} schedule", "--schedule",
                            f"use auto or one of {', '.join(SEARCHED)}; `partopt evaluate --schedule` prices any "
                            "(docs/COSTMODEL.md §5b says why)")
    batch = graph.dims[graph.batch_dim]
    counts = microbatch_counts(batch, options.microbatches)
    layering = build_layers(graph, options.layers)
    budget = costmodel.memory_budget(cluster.device, options.memory_reserve)
    submeshes = _submeshes(cluster, options)
    meshes = {(s, shape): cluster.logical_mesh(s, shape) for s in submeshes for shape in _shapes(cluster, s, options)}
    sizes = [n * m for n, m in submeshes]
    stats = Stats()
    best: tuple[float, int, list[StageSpec], list] | None = None
    # cheapest first by a lower bound, so that later counts can be skipped without pricing them
    views = _microbatch_views(graph, counts)
    bounds = {count: _lower_bound(view, count, cluster) for count, view in views.items()}
    candidates = [c for c in sorted(views, key=lambda c: (bounds[c], c))
                  if _fits_at_all(graph, views[c], cluster, budget, options.recompute != "none")]
    if not candidates:
        raise _no_plan(graph, cluster, budget)
    done, unfinished, stopped = 0, list(candidates), None
    deadline = start + options.deadline_s if options.deadline_s is not None else math.inf
    try:
        with Pricer(graph, options, cache, deadline) as pricer:
            for n, count in enumerate(candidates):
                if best is not None and bounds[count] >= best[0]:
                    unfinished.remove(count)
                    continue  # its lower bound already loses: no ILP needed
                if time.perf_counter() > deadline:
                    raise Expired
                mb, g_mb = batch // count, views[count]
                pricer.views[mb] = g_mb
                pipe = pipeline_of(graph, cluster, layering, count, options.overlap)
                base_ops = [[g_mb.op_index[op.name] for op in ops] for ops in layering.base]
                hashes = [g_mb.structural_hash(ops) for ops in base_ops]
                names = [tuple(op.name for op in ops) for ops in base_ops]
                modes = _distinct_modes(g_mb, base_ops, options.recompute_modes)
                # one option per (submesh, logical shape, recomputation mode): a list of rows of layer costs
                costs: dict = {}
                found = free = None
                for m, mode in enumerate(modes):
                    jobs = {(hashes[b], (*key, mode)): Job(mb, count, names[b], meshes[key], mode, budget)
                            for key in meshes for b in range(len(base_ops))}
                    total = done + len(jobs) * (len(candidates) - n)  # an estimate: later counts may be skipped
                    priced = pricer.run(jobs, stats, lambda k: progress(done + k, total) if progress else None)
                    done += len(jobs)
                    rows_of = {(*key, mode): [[priced[(hashes[b], (*key, mode))] for b in range(len(base_ops))]]
                               for key in meshes}
                    costs.update(rows_of)
                    if free is None:  # the first mode's plan with memory ignored: what leaner options could recover
                        free = _best_schedule(pipe, costs, submeshes, sizes, cluster.num_devices, count, math.inf,
                                              options.schedules, stats)
                    if best is not None and free is not None and free[0].total >= best[0]:
                        found = None  # even with memory ignored this count loses: no leaner option can win
                        break
                    found = _best_schedule(pipe, costs, submeshes, sizes, cluster.num_devices, count, budget,
                                           options.schedules, stats)
                    if _binds(found, free):  # memory binds: offer memory-lean options too
                        tighten(rows_of, priced, jobs, hashes, budget, len(base_ops), count,
                                best[0] if best else math.inf, pricer, stats)
                        found = _best_schedule(pipe, costs, submeshes, sizes, cluster.num_devices, count, budget,
                                               options.schedules, stats)
                    if m == len(modes) - 1 or not _binds(found, free):
                        break  # memory does not bind: recomputing more only adds time
                result = found[0] if found else None
                stats.counts.append(count)
                stats.recompute_modes[count] = modes[:m + 1]
                unfinished.remove(count)
                if result is None:
                    continue
                if best is None or result.total < best[0] - 1e-15:
                    _, schedule, v, options_of = found
                    chosen = [options_of[c.submesh][c.option] for c in result.stages]
                    if schedule == "interleaved":  # stage i runs chunks i, i + S, …: the plan lists the chunks
                        S = len(result.stages)
                        specs = [StageSpec(first, last, submeshes[result.stages[j % S].submesh], chosen[j % S][0],
                                           inflight(j % S, S, count, schedule, v), chosen[j % S][1])
                                 for j, (first, last) in enumerate(chunks(len(layering.groups), S, v))]
                        picked = [chosen[j % S][2] for j in range(len(specs))]
                    else:
                        specs = [StageSpec(c.first, c.last, submeshes[c.submesh], shape, min(c.inflight, count), mode)
                                 for c, (shape, mode, _) in zip(result.stages, chosen)]
                        picked = [r for _, _, r in chosen]
                    rows = [costs[(spec.submesh, spec.shape, spec.recompute)][r] for spec, r in zip(specs, picked)]
                    best = (result.total, count, specs, rows, schedule, v)
    except (Expired, KeyboardInterrupt) as err:
        stopped = "deadline" if isinstance(err, Expired) else "interrupted"
        if best is None:
            if stopped == "interrupted":
                raise
            raise PartoptError(f"no plan found within the deadline of {options.deadline_s:g} s", "--deadline",
                               "give the search more time") from None
    if best is None:
        raise _no_plan(graph, cluster, budget)
    total, count, specs, rows, schedule, v = best
    plan = assemble(graph, cluster, layering, options, count, specs, rows, stats, time.perf_counter() - start,
                    schedule, v)
    plan.solver["search"] = restrictions(options, batch, len(tagged_layers(graph)), len(layering.groups))
    if stopped:  # the counts not finished could still win, down to their lower bounds
        bound = min([total, *(bounds[c] for c in unfinished)])
        plan.solver.update(stopped=stopped, lower_bound_s=bound, bound_gap=(total - bound) / total)
    return plan


def _best_schedule(pipe: Pipeline, costs: dict, submeshes: list[tuple[int, int]], sizes: list[int], devices: int,
                   count: int, budget: float, schedules: Sequence[str], stats: Stats):
    """The stage DP's best plan over `schedules` for one microbatch count: (result, schedule, v, options per
    submesh), or None. 1F1B cuts the layers freely; interleaved takes the best (S, v) of Megatron's uniform
    chunking (`schedules.interleaved_shapes`, `stages.interleaved_table`); zero-bubble (ZB-H1) cuts freely on
    1F1B's table (`stagedp.zero_bubble`); ties keep 1F1B, then interleaved."""
    found = []
    table = stage_table(pipe, costs, submeshes, count, budget) if {"1f1b", "zero-bubble"} & set(schedules) else None
    if "1f1b" in schedules:
        t, extra, options_of = table
        found.append((stagedp.solve(t, extra, sizes, devices, count), "1f1b", 1, options_of))
    if "interleaved" in schedules:
        for S, v in interleaved_shapes(len(pipe.layering.groups), count, devices):
            t, extra, options_of = interleaved_table(pipe, costs, submeshes, count, budget, S, v)
            found.append((stagedp.solve(t / v, extra, sizes, devices, v * count), "interleaved", v, options_of))
    if "zero-bubble" in schedules:  # only a plan faster than the others found counts (ties keep them)
        t, extra, options_of = table
        cutoff = min((f[0].total for f in found if f[0] is not None), default=math.inf)
        found.append((stagedp.zero_bubble(t, extra, split_table(pipe, t, options_of), sizes, devices, count, cutoff),
                      "zero-bubble", 1, options_of))
    found = [f for f in found if f[0] is not None]
    stats.dp_rounds += sum(f[0].rounds for f in found)
    return min(found, key=lambda f: f[0].total) if found else None


def _binds(found, free) -> bool:
    """Whether memory costs time: nothing fits, or the best plan that fits (`found`, of `_best_schedule`)
    is slower than the plan of the fastest options with memory ignored (`free`; None: some layer fits no
    mesh uncapped).

    Leaner options (memory caps, recomputation) cost a layer at least as much B · t + sync as its
    unconstrained optimum, so when the fastest options' memory-free plan fits they are not priced
    (docs/COSTMODEL.md: the one trade this leaves out)."""
    return free is None or found is None or found[0].total > free[0].total * (1 + 1e-12)


def _distinct_modes(graph: Graph, base_ops: list[list[Op]], modes: Sequence[str]) -> list[str]:
    """`modes` less those that recompute exactly what an earlier one does in every layer (a model
    without attention has no selective recomputation): the same ILPs need not be priced twice."""
    seen, kept = set(), []
    for mode in modes:
        sets = tuple(intra.recomputed_ops(graph, ops, mode) for ops in base_ops)
        if sets not in seen:
            seen.add(sets)
            kept.append(mode)
    return kept


def _microbatch_views(graph: Graph, counts: list[int]) -> dict[int, Graph]:
    """The graph at microbatch size for each count. A count the graph cannot split into (an MoE's
    routing groups) is skipped while another count remains, and an error otherwise."""
    views, errors = {}, []
    for count in counts:
        try:
            views[count] = intra.with_batch(graph, graph.dims[graph.batch_dim] // count)
        except InfeasibleError as err:
            errors.append(err)
    if not views:
        raise errors[0]
    return views


def _lower_bound(g_mb: Graph, count: int, cluster: Cluster) -> float:
    """A lower bound on the iteration time with `count` microbatches (`g_mb`: the microbatch view)
    on any plan of the cluster's devices.

    The pipeline part is at least B · max_i t_i ≥ B · sum_i D_i t_i / N, and a stage's device-time
    D_i t_i is at least its ops' single-device roofline time (no split divides FLOPs or bytes by
    more than D_i; communication only adds). Only the analytical model has that property: under
    another (measured times) the bound is 0 and no microbatch count is skipped unpriced.
    """
    if not isinstance(costmodel.active(), costmodel.Analytical):
        return 0.0
    work = 0.0
    for op in g_mb.ops:
        if op.kind == "reshape":
            continue
        moved = sum(g_mb.nbytes(t) for t in op.inputs) + g_mb.nbytes(op.output)
        flops = costmodel.training_flops(g_mb.flops(op), is_matmul(op))
        work += costmodel.compute_time(flops, 2 * moved, cluster.device, g_mb.dtype_of(op.output), is_matmul(op))
    return count * work / cluster.num_devices


def _fits_at_all(graph: Graph, g_mb: Graph, cluster: Cluster, budget: float, recompute: bool) -> bool:
    """False when even a perfect spread of the parameter state and one microbatch's activations overflows."""
    state = sum(costmodel.param_memory(graph.numel(t.name), graph.dtype_of(t.name), graph.optimizer).total for t in graph.params)
    activations = 0.0 if recompute else sum(g_mb.nbytes(op.output) for op in g_mb.ops)
    return (state + activations) / cluster.num_devices <= budget


def _no_plan(graph: Graph, cluster: Cluster, budget: float) -> InfeasibleError:
    state = costmodel.param_memory(graph.num_params, graph.dtype, graph.optimizer).total
    total = budget * cluster.num_devices
    return InfeasibleError(
        f"no plan fits: the model's parameter state alone is {fmt_bytes(state)} against "
        f"{fmt_bytes(total)} usable on {cluster.num_devices} devices "
        f"({'short by ' + fmt_bytes(state - total) if state > total else 'activations do not fit'})",
        f"{graph.name} on {cluster.name}",
        "use more nodes (--nodes), a smaller batch, or more microbatches")
