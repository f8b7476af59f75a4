"""Inter-operator parallelism: stage candidates, the stage DP per microbatch count, the plan.

Every base layer (a layer tag) is priced by the intra-op ILP on every logical mesh of every
submesh shape, once per structure: layers that hash alike share one solve. A stage's cost is
the sum of its layers' costs plus the point-to-point send of its boundary activations; the
resharding between two layers of one stage is priced inside each layer's ILP as free input
layout (see docs/COSTMODEL.md, "Stage composition"). The stage DP (`stagedp`) then cuts the DP
layers into stages for each candidate microbatch count, and the best plan wins.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from partopt import costmodel, intra, stagedp
from partopt.cluster import Cluster, LogicalMesh
from partopt.errors import InfeasibleError, InstanceError, PartoptError, SolverError
from partopt.graph import Graph, Op
from partopt.layering import Layering, build_layers
from partopt.ops import is_matmul
from partopt.plan import OpStrategy, ParamPlacement, Plan, StagePlan, tensor_table
from partopt.sharding import Shard
from partopt.shared import correction, shared_params
from partopt.units import fmt_bytes

DEFAULT_MAX_LAYERS = 64  # every block up to 64 (GPT-39B: 48); more are grouped (docs/benchmarks.md)
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Options:
    """Search options of `optimize` (see its docstring)."""

    microbatches: int | str | Sequence[int] = "auto"  # a count, several to search, or auto (powers of two)
    layers: int | None = DEFAULT_MAX_LAYERS
    submesh_family: str = "alpa"
    logical_shapes: str | Sequence[tuple[int, int]] = "node_local"  # or "all", or the allowed (a, b)
    backend: str = "highs"  # fastest in docs/benchmarks.md
    time_limit_s: float = 60.0
    memory_reserve: float = costmodel.DEFAULT_MEMORY_RESERVE
    intra_only: bool = False
    inter_only: bool = False
    data_parallel_only: bool = False
    stage_data_parallel: bool = False
    seed: int = 0
    workers: int | None = None  # processes for the ILPs; None: one per available core
    recompute: str = "auto"  # activation recomputation per stage: auto (searched) or one of intra.RECOMPUTE_MODES

    def __post_init__(self) -> None:
        if isinstance(self.recompute, bool):  # the former flag: recompute meant full recomputation
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if self.recompute not in ("auto", *intra.RECOMPUTE_MODES):
            raise InstanceError(f"unknown recomputation mode {self.recompute!r}", "recompute",
                                f"use auto or one of {', '.join(intra.RECOMPUTE_MODES)}")

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """The modes the search prices, cheapest in time first (auto: all of them)."""
        return intra.RECOMPUTE_MODES if self.recompute == "auto" else (self.recompute,)


def microbatch_counts(batch: int, requested: int | str | Sequence[int]) -> list[int]:
    """Candidate microbatch counts: the requested ones, or ("auto") the powers of two dividing the batch."""
    if requested == "auto":
        return [b for b in (2**e for e in range(batch.bit_length())) if batch % b == 0]
    counts = [int(requested)] if isinstance(requested, (int, str)) else [int(c) for c in requested]
    for count in counts:
        if count < 1 or batch % count:
            raise InfeasibleError(f"batch {batch} is not divisible into {count} microbatches", "--microbatches",
                                  f"use divisors of {batch}, or auto")
    if not counts:
        raise InstanceError("no microbatch count to search", "--microbatches", "give one or more counts, or auto")
    return sorted(set(counts))


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


@dataclass(frozen=True)
class LayerCost:
    """One base layer solved on one mesh: what the stage table adds up."""

    time_s: float  # per microbatch
    sync_s: float  # per iteration
    param_bytes: float
    activation_bytes: float  # kept per in-flight microbatch
    working_bytes: float  # transient, once (recomputation)
    sharding: intra.StageSharding

    @classmethod
    def of(cls, sharding: intra.StageSharding) -> LayerCost:
        b = sharding.breakdown
        return cls(b.per_microbatch_s, b.per_iteration_s, b.param_bytes, b.activation_bytes, b.working_bytes, sharding)

    @property
    def memory_bytes(self) -> float:
        """Per device with one microbatch in flight."""
        return self.param_bytes + self.activation_bytes + self.working_bytes


def _boundary_bytes(graph: Graph, layering: Layering) -> list[float]:
    """Bytes leaving each DP layer for later layers (activations at the graph's batch size)."""
    position = {}
    for g in range(len(layering.groups)):
        for op in layering.ops(g):
            position[op.name] = g
    sent = [0.0] * len(layering.groups)
    for op in graph.ops:
        later = [position[c.name] for c in graph.consumers[op.output] if position[c.name] > position[op.name]]
        if later:
            for g in range(position[op.name], max(later)):
                sent[g] += graph.nbytes(op.output)
    return sent


def _devices_of(cluster: Cluster, submeshes: list[tuple[int, int]]) -> list[list[int]]:
    """Alpa's placement: whole-node submeshes take nodes in order, then (1, m) pieces pack the rest."""
    m = cluster.devices_per_node
    order = sorted(range(len(submeshes)), key=lambda s: (-submeshes[s][0] * submeshes[s][1], s))
    free = [m] * cluster.nodes  # free devices per node, filled left to right
    result: list[list[int]] = [[] for _ in submeshes]
    for s in order:
        n, k = submeshes[s]
        if k == m:
            nodes = [i for i, f in enumerate(free) if f == m][:n]
            for node in nodes:
                free[node] = 0
                result[s].extend(range(node * m, node * m + m))
        else:
            node = next(i for i, f in enumerate(free) if f >= k)
            start = node * m + (m - free[node])
            result[s] = list(range(start, start + k))
            free[node] -= k
    return result


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
    "selective" | "full"). Give them as keywords or as one `options=Options(...)`, not both.
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
    start = time.perf_counter()
    if graph.batch_dim is None:
        raise InstanceError("the graph names no batch dim", "batch_dim", "set `batch_dim` to plan data parallelism and microbatches")
    batch = graph.dims[graph.batch_dim]
    counts = microbatch_counts(batch, options.microbatches)
    layering = build_layers(graph, options.layers)
    budget = costmodel.memory_budget(cluster.device, options.memory_reserve)
    submeshes = _submeshes(cluster, options)
    meshes = {(s, shape): cluster.logical_mesh(s, shape) for s in submeshes for shape in _shapes(cluster, s, options)}
    link = cluster.intra_node if cluster.nodes == 1 else cluster.inter_node
    boundary = _boundary_bytes(graph, layering)
    shared = shared_params(graph, layering.base)

    sizes = [n * m for n, m in submeshes]
    ilp_stats = {"ilps": 0, "status": "optimal", "gap": 0.0, "solve_time_s": 0.0, "counts": []}
    best: tuple[float, int, list[StageSpec], list] | None = None
    # cheapest first by a lower bound, so that later counts can be skipped without pricing them
    views = _microbatch_views(graph, counts)
    bounds = {count: _lower_bound(view, count, cluster) for count, view in views.items()}
    candidates = [c for c in sorted(views, key=lambda c: (bounds[c], c))
                  if _fits_at_all(graph, views[c], cluster, budget, options.recompute != "none")]
    if not candidates:
        raise _no_plan(graph, cluster, budget)
    done = 0
    with _Pricer(graph, options, cache) as pricer:
        for n, count in enumerate(candidates):
            if best is not None and bounds[count] >= best[0]:
                continue  # its lower bound already loses: no ILP needed
            mb, g_mb = batch // count, views[count]
            pricer.views[mb] = g_mb
            base_ops = [[g_mb.op_index[op.name] for op in ops] for ops in layering.base]
            hashes = [g_mb.structural_hash(ops) for ops in base_ops]
            names = [[op.name for op in ops] for ops in base_ops]
            modes = _distinct_modes(g_mb, base_ops, options.recompute_modes)
            # one option per (submesh, logical shape, recomputation mode): a list of rows of layer costs
            costs: dict = {}
            result = free = None
            for m, mode in enumerate(modes):
                jobs = {(hashes[b], (*key, mode)): (mb, count, names[b], meshes[key], mode, budget)
                        for key in meshes for b in range(len(base_ops))}
                total = done + len(jobs) * (len(candidates) - n)  # an estimate: later counts may be skipped
                priced = pricer.run(jobs, ilp_stats, lambda k: progress(done + k, total) if progress else None)
                done += len(jobs)
                rows_of = {(*key, mode): [[priced[(hashes[b], (*key, mode))] for b in range(len(base_ops))]]
                           for key in meshes}
                costs.update(rows_of)
                _tighten(rows_of, priced, jobs, hashes, budget, len(base_ops), count,
                         best[0] if best else math.inf, pricer, ilp_stats)
                t, extra, options_of = _stage_table(layering, costs, submeshes, boundary, count, mb, batch, link,
                                                    budget, shared, cluster.devices_per_node)
                result = stagedp.solve(t, extra, sizes, cluster.num_devices, count)
                if result is not None:
                    ilp_stats["dp_rounds"] = ilp_stats.get("dp_rounds", 0) + result.rounds
                if m == len(modes) - 1:
                    break
                if free is None:  # the first mode's plan with memory ignored: what recomputation could recover
                    free = stagedp.solve(*_stage_table(layering, costs, submeshes, boundary, count, mb, batch, link,
                                                       math.inf, shared, cluster.devices_per_node)[:2],
                                         sizes, cluster.num_devices, count)
                if result is not None and result.total <= free.total * (1 + 1e-12):
                    break  # memory does not bind: recomputing more only adds time
            ilp_stats["counts"].append(count)
            ilp_stats.setdefault("recompute_modes", {})[count] = modes[:m + 1]
            if result is None:
                continue
            if best is None or result.total < best[0] - 1e-15:
                chosen = [options_of[c.submesh][c.option] for c in result.stages]
                specs = [StageSpec(c.first, c.last, submeshes[c.submesh], shape, min(c.inflight, count), mode)
                         for c, (shape, mode, _) in zip(result.stages, chosen)]
                rows = [costs[(spec.submesh, spec.shape, spec.recompute)][r]
                        for spec, (_, _, r) in zip(specs, chosen)]
                best = (result.total, count, specs, rows)
    if best is None:
        raise _no_plan(graph, cluster, budget)
    _, count, specs, rows = best
    return assemble(graph, cluster, layering, options, count, specs, rows, ilp_stats, time.perf_counter() - start)


LEAN_TIME_LIMIT_S = 10.0
MEMORY_RUNGS = (2, 4, 8, 16, 32, 64)  # per-layer caps budget / r that a stage of about r layers needs


def _tighten(costs: dict, priced: dict, jobs: dict, hashes: list, budget: float, layers: int, count: int,
             bound: float, pricer: _Pricer, stats: dict) -> None:
    """Add memory-leaner options: re-price layers whose optimum overflows budget / r, r = 2, 4, …

    Each layer's ILP alone sees only its own memory; a stage of r such layers needs each to fit
    about budget / r, with the in-flight microbatches of a stage that leads about layers / r
    stages (the most it could have). A layer whose optimum already fits the tighter cap keeps it
    (the same ILP with a tighter, non-binding constraint has the same optimum), so small models
    cost nothing. The cap of rung r serves stages of more than r / 2 layers (smaller ones fit the
    rung before); a mesh on which every such stage costs more than `bound` (the iteration time of
    the best plan known, from another microbatch count; see `_longest_stage`) is not refined at
    that rung or beyond.
    Each mesh gets one more row of layer costs per cap at which any of its layers changed.
    """
    last = dict(priced)
    stuck = {key for key, cost in last.items() if cost is None}
    longest_stage = {mesh: _longest_stage(rows[0], count, bound) for mesh, rows in costs.items()}
    for r in MEMORY_RUNGS:
        if r > layers:
            break
        cap = budget / r
        for key in jobs:  # no ILP where the cap is below the leanest assignment, or serves no stage that can win
            if key not in stuck and (last[key].sharding.least_memory_bytes > cap or longest_stage[key[1]] <= r // 2):
                stuck.add(key)
        # stages of r layers are the first of about layers / r: weigh activations by that many in flight
        inflight = {key: min(count, math.ceil(layers / r)) for key in jobs}
        tight = {key: (*job[:5], cap, inflight[key]) for key, job in jobs.items()
                 if key not in stuck and last[key].param_bytes + inflight[key] * last[key].activation_bytes
                 + last[key].working_bytes > cap}
        if not tight:
            break
        for key, cost in pricer.run(tight, stats, lambda k: None).items():
            if not isinstance(cost, LayerCost):
                stuck.add(key)  # cannot fit this cap: keep its leanest option, stop refining it
            else:
                last[key] = cost
        for key, rows in costs.items():
            row = [last[(h, key)] for h in hashes]
            if any(new is not old for new, old in zip(row, rows[-1])):
                rows.append(row)


def _longest_stage(row: list[LayerCost | None], count: int, limit: float) -> int:
    """The most consecutive base layers a stage on this mesh can hold and still cost under `limit`.

    A plan's iteration time is at least B · t + sync of each of its stages (B microbatches, t its
    latency, sync its per-iteration work), and no option of a layer on a mesh costs less than its
    unconstrained optimum `row[b]`, count · time + sync, which is what its ILP minimises.
    """
    costs = [None if c is None else count * c.time_s + c.sync_s for c in row]
    longest, start, total = 0, 0, 0.0
    for end, cost in enumerate(costs):
        if cost is None:  # cannot run on this mesh at all: no stage spans it
            start, total = end + 1, 0.0
            continue
        total += cost
        while total >= limit and start <= end:
            total -= costs[start]
            start += 1
        longest = max(longest, end - start + 1)
    return longest


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
    more than D_i; communication only adds).
    """
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


@dataclass(frozen=True)
class Dropped:
    """A leaner option whose ILP found no solution within its time limit: not priced, and counted
    in the plan (`solver.dropped_options`) so that the search says what it could not look at."""

    time_limit_s: float


def _price(g_mb: Graph, ops: list[Op], mesh: LogicalMesh, count: int, recompute: str, budget: float,
           options: Options, inflight: int = 1) -> LayerCost | Dropped | None:
    """One base layer's optimal sharding on `mesh`, or None when it cannot fit the memory budget.

    Under a cap tighter than the device's budget (a leaner option, see `_tighten`) the solver gets
    at most LEAN_TIME_LIMIT_S: such ILPs can be slow to find any solution, and the option is
    optional: one that finds none in time is `Dropped`.
    """
    lean = budget < costmodel.memory_budget(mesh.device, options.memory_reserve)
    limit = min(options.time_limit_s, LEAN_TIME_LIMIT_S) if lean else options.time_limit_s
    try:
        sharding = intra.shard_stage(g_mb, mesh, ops, microbatches=count, inflight=inflight, memory_budget=budget,
                                     backend=options.backend, time_limit_s=limit, seed=options.seed,
                                     data_parallel=options.data_parallel_only or options.stage_data_parallel,
                                     allow_zero=not options.stage_data_parallel, recompute=recompute)
    except InfeasibleError:
        return None
    except SolverError:
        if lean:
            return Dropped(limit)  # no leaner option found in time
        raise
    return LayerCost.of(sharding)


def _price_job(graph: Graph, options: Options, job: tuple, views: dict[int, Graph]) -> LayerCost | None:
    """One pricing job; `views` caches the graph's microbatch views by size across jobs."""
    mb, count, names, mesh, recompute, cap, *inflight = job
    if mb not in views:
        views[mb] = intra.with_batch(graph, mb)
    g_mb = views[mb]
    return _price(g_mb, [g_mb.op_index[n] for n in names], mesh, count, recompute, cap, options, *inflight)


_WORKER: dict = {}


def _worker_init(graph: Graph, options: Options) -> None:
    _WORKER.update(graph=graph, options=options)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the planner's to handle (the CLI ends its workers)
    parent = os.getppid()

    def orphaned() -> None:  # a killed planner must not leave its workers running
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()


def _worker_job(job: tuple) -> LayerCost | None:
    return _price_job(_WORKER["graph"], _WORKER["options"], job, _WORKER.setdefault("views", {}))


class _Pricer:
    """Runs the per-layer ILPs: in this process, or on a pool of worker processes for many of them.
    Results are kept in `cache` under the graph, the pricing options and the job, so that later
    `optimize` calls given the same dict (restricted searches after a full one) reuse them."""

    MIN_OPS = 500  # below this many ops over all jobs, starting worker processes costs more than it saves

    def __init__(self, graph: Graph, options: Options, cache: dict | None = None):
        self.graph, self.options = graph, options
        self.views: dict[int, Graph] = {}
        self.workers = options.workers or len(os.sched_getaffinity(0))
        self.pool: ProcessPoolExecutor | None = None
        self.cache = {} if cache is None else cache
        self.prefix = (graph.name, graph.structural_hash(), options.backend, options.time_limit_s, options.seed,
                       options.memory_reserve, options.data_parallel_only,
                       options.stage_data_parallel)

    def _key(self, job: tuple) -> tuple:
        mb, count, names, *rest = job
        return (self.prefix, mb, count, tuple(names), *rest)

    def __enter__(self) -> _Pricer:
        return self

    def __exit__(self, kind, *exc) -> None:
        if self.pool is not None:  # interrupted: do not wait for running ILPs (their workers exit with us)
            self.pool.shutdown(wait=kind is None, cancel_futures=True)

    def run(self, jobs: dict, stats: dict, progress: Callable[[int], None]) -> dict:
        """Results of `jobs` (key -> job) by key; statistics of the ILPs solved (not cached) added to `stats`."""
        cache_keys = {key: self._key(job) for key, job in jobs.items()}
        out = {key: self.cache[ck] for key, ck in cache_keys.items() if ck in self.cache}
        keys = [key for key in jobs if key not in out]
        for n, cost in enumerate(out.values(), 1):
            _record(stats, cost, solved=False)
            progress(n)
        if self.workers > 1 and self.pool is None and sum(len(jobs[k][2]) for k in keys) >= self.MIN_OPS:
            # spawned, not forked: the solvers' threads in this process must not be copied mid-lock
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_worker_init, initargs=(self.graph, self.options))
        if self.pool is not None:
            results = self.pool.map(_worker_job, [jobs[k] for k in keys], chunksize=1)
        else:
            results = (_price_job(self.graph, self.options, jobs[k], self.views) for k in keys)
        for n, (key, cost) in enumerate(zip(keys, results), len(out) + 1):
            out[key] = self.cache[cache_keys[key]] = cost
            _record(stats, cost, solved=True)
            progress(n)
        return {key: out[key] for key in jobs}


def _record(stats: dict, cost: LayerCost | Dropped | None, solved: bool) -> None:
    """Add one priced layer to the ILP statistics: counted and timed when solved here; a
    non-optimal status (time limit) and a dropped option are reported whether solved here or taken
    from the cache."""
    if isinstance(cost, Dropped):
        stats["dropped"] = stats.get("dropped", 0) + 1
    if not isinstance(cost, LayerCost):
        return
    result = cost.sharding.solution.result
    if solved:
        stats["ilps"] += 1
        stats["solve_time_s"] += result.time_s
    if result.status != "optimal":
        stats["status"] = result.status
        stats["gap"] = max(stats["gap"], result.gap or 0.0)


@dataclass(frozen=True)
class StageSpec:
    """A stage as the plan fixes it: DP layers [first, last], submesh, logical shape, in-flight
    microbatches, recomputation mode."""

    first: int
    last: int
    submesh: tuple[int, int]
    shape: tuple[int, int]
    inflight: int
    recompute: str = "none"


def _group_sums(row: list[LayerCost | None], group: tuple[int, int]) -> tuple[float, ...] | None:
    """time, sync, parameter bytes, kept activation bytes (sums) and working bytes (max) of one DP
    layer's base layers; None if one cannot run. Layers recompute one at a time, so working sets do not add."""
    parts = row[group[0]:group[1] + 1]
    if any(c is None for c in parts):
        return None
    return (sum(c.time_s for c in parts), sum(c.sync_s for c in parts), sum(c.param_bytes for c in parts),
            sum(c.activation_bytes for c in parts), max(c.working_bytes for c in parts))


def _fold(total: tuple[float, ...], sums: tuple[float, ...]) -> tuple[float, ...]:
    """Add one DP layer's sums onto a stage's running totals (the working set is a max)."""
    return (total[0] + sums[0], total[1] + sums[1], total[2] + sums[2], total[3] + sums[3], max(total[4], sums[4]))


def _send(boundary: list[float], last: int, mb: int, batch: int, link) -> float:
    """Point-to-point time of a stage's boundary activations out and their gradients back, per microbatch."""
    return 2 * costmodel.p2p_time(boundary[last] * mb / batch, link) if last < len(boundary) - 1 else 0.0


def _stage_table(layering, costs, submeshes, boundary, count, mb, batch, link, budget, shared, per_node):
    """t[h, k, i, j, s] and extra[h, k, i, j, s] for the stage DP; option h of submesh s is a logical
    shape and recomputation mode with one row of layer costs (`costs[(submesh, shape, mode)]`, see
    `_tighten`).

    An entry is inf when the stage's memory does not fit k in-flight microbatches (1F1B). Parameters
    read by several base layers (`shared`) are held once per stage, their gradients summed across
    stages (`partopt.shared`). Returns the tables and, per submesh, its (shape, mode, row index) options in order.
    """
    L, S = len(layering.groups), len(submeshes)
    options = [[(shape, mode, r) for (x, shape, mode) in costs if x == sub for r in range(len(costs[(x, shape, mode)]))]
               for sub in submeshes]
    H = max(len(x) for x in options)
    t = np.full((H, L + 1, L, L, S), np.inf)
    extra = np.zeros((H, L + 1, L, L, S))
    for s, sub in enumerate(submeshes):
        for h, (shape, mode, r) in enumerate(options[s]):
            row = costs[(sub, shape, mode)][r]
            for i in range(L):
                total = (0.0,) * 5
                for j in range(i, L):
                    sums = _group_sums(row, layering.groups[j])
                    if sums is None:
                        break
                    total = _fold(total, sums)
                    time_s, sync_s, params, acts, working = total
                    fix = correction(row, layering.groups[i][0], layering.groups[j][1], shared, link,
                                     min(sub[0] * sub[1], per_node))
                    if fix is not None:
                        params, sync_s = params + fix.param_bytes, sync_s + fix.iteration_s
                    latency = time_s + _send(boundary, j, mb, batch, link)
                    for k in range(1, L + 1):
                        if params + min(k, count) * acts + working > budget:
                            break
                        t[h, k, i, j, s], extra[h, k, i, j, s] = latency, sync_s
    return t, extra, options


def _no_plan(graph: Graph, cluster: Cluster, budget: float) -> InfeasibleError:
    state = costmodel.param_memory(graph.num_params, graph.dtype, graph.optimizer).total
    total = budget * cluster.num_devices
    return InfeasibleError(
        f"no plan fits: the model's parameter state alone is {fmt_bytes(state)} against "
        f"{fmt_bytes(total)} usable on {cluster.num_devices} devices "
        f"({'short by ' + fmt_bytes(state - total) if state > total else 'activations do not fit'})",
        f"{graph.name} on {cluster.name}",
        "use more nodes (--nodes), a smaller batch, or more microbatches")


def _dim_map(graph: Graph, solved: Sequence[Op], ops: Sequence[Op]) -> dict[str, str]:
    """Dim names of the solved layer's ops -> the same positions in `ops` (a structurally identical layer)."""
    rename: dict[str, str] = {}
    for a, b in zip(solved, ops):
        for ta, tb in zip((*a.inputs, a.output), (*b.inputs, b.output)):
            rename.update(zip(graph.tensors[ta].dims, graph.tensors[tb].dims))
    return rename


def _renamed_placement(placement, rename: dict[str, str]):
    return tuple(Shard(rename.get(p.dim, p.dim)) if isinstance(p, Shard) else p for p in placement)


def _renamed(strategy, rename: dict[str, str]):
    return dataclasses.replace(strategy, axes=tuple(rename.get(d, d) if d else d for d in strategy.axes),
                               inputs=tuple(_renamed_placement(p, rename) for p in strategy.inputs),
                               output=_renamed_placement(strategy.output, rename))


def params_of(graph: Graph, ops: Sequence[Op]) -> list[str]:
    """Parameters in order of first use by `ops` (the order `intra.build` gives them nodes)."""
    return list(dict.fromkeys(t for op in ops for t in op.inputs if graph.tensors[t].role == "param"))


def _training_flops(graph: Graph, ops: Sequence[Op] | None = None) -> float:
    return sum(costmodel.training_flops(graph.flops(op), is_matmul(op)) for op in (graph.ops if ops is None else ops))


def _recomputed_flops(graph: Graph, units: Sequence[Sequence[Op]], mode: str) -> float:
    """Forward FLOPs that recomputation `mode` runs again in these base layers (priced one by one)."""
    total = 0.0
    for ops in units:
        rerun = intra.recomputed_ops(graph, ops, mode)
        total += sum(graph.flops(op) for op in ops if op.name in rerun)
    return total


def assemble(graph: Graph, cluster: Cluster, layering: Layering, options: Options, count: int,
             specs: list[StageSpec], rows: list[list[LayerCost]], ilp_stats: dict, elapsed: float) -> Plan:
    """The plan of fixed stages, each with its base layers' costs (`rows[i]`, on the stage's mesh).

    Stage latency, memory and the iteration time are summed here, in the same order as the stage
    DP's table, so a plan evaluated again prices to the same number.
    """
    batch = graph.dims[graph.batch_dim]
    mb = batch // count
    link = cluster.intra_node if cluster.nodes == 1 else cluster.inter_node
    boundary = _boundary_bytes(graph, layering)
    shared = shared_params(graph, layering.base)
    placed = _devices_of(cluster, [spec.submesh for spec in specs])
    stages = []
    recomputed_flops = 0.0
    for spec, row, devices in zip(specs, rows, placed):
        total = (0.0,) * 5
        for j in range(spec.first, spec.last + 1):
            total = _fold(total, _group_sums(row, layering.groups[j]))
        time_s, sync_s, params, acts, working = total
        send = _send(boundary, spec.last, mb, batch, link)
        first, last = layering.groups[spec.first][0], layering.groups[spec.last][1]
        comm: dict[str, float] = {}
        sync: dict[str, float] = {}
        ops, param_info = {}, {}
        for b in range(first, last + 1):
            sharding = row[b].sharding
            for k, v in sharding.breakdown.comm_s.items():
                comm[k] = comm.get(k, 0.0) + v
            for k, v in sharding.breakdown.sync_s.items():
                sync[k] = sync.get(k, 0.0) + v
            # a structurally identical layer shares the solve: its choices apply position by position,
            # with the solved layer's dim names translated to this layer's
            rename = _dim_map(graph, [graph.op_index[oc.op] for oc in sharding.ops], layering.base[b])
            for op, oc in zip(layering.base[b], sharding.ops):
                strategy = _renamed(oc.strategy, rename)
                ops[op.name] = OpStrategy(op.kind, op.output, strategy.axes, strategy.inputs, strategy.output,
                                          intra.describe(graph, op, strategy, oc.collectives, sharding.mesh))
            for tensor, pc in zip(params_of(graph, layering.base[b]), sharding.params):
                placement = tuple(_renamed_placement(pc.strategy.placement, rename))
                param_info[tensor] = ParamPlacement(placement, pc.strategy.zero_axes)
        state = {part: sum(row[b].sharding.breakdown.state_bytes[part] for b in range(first, last + 1))
                 for part in intra.STATE_PARTS}
        optimizer_s = sum(row[b].sharding.breakdown.optimizer_s for b in range(first, last + 1))
        fix = correction(row, first, last, shared, link, min(len(devices), cluster.devices_per_node))
        if fix is not None:  # a parameter shared by several layers: one copy here, its gradient summed across stages
            params, sync_s = params + fix.param_bytes, sync_s + fix.iteration_s
            for part, delta in zip(intra.STATE_PARTS, fix.state_bytes):
                state[part] += delta
            for kind, delta in fix.sync_s.items():
                if kind == "optimizer":
                    optimizer_s += delta
                else:
                    sync[kind] = sync.get(kind, 0.0) + delta
        stage_ops = [op for j in range(spec.first, spec.last + 1) for op in layering.ops(j)]
        forward_flops = sum(graph.flops(op) for op in stage_ops)
        rerun = _recomputed_flops(graph, layering.base[first:last + 1], spec.recompute)
        executed = _training_flops(graph, stage_ops) + rerun
        recomputed_flops += rerun
        forward = forward_flops / max(executed, 1e-300)
        latency = time_s + send
        tags = [stage_ops[0].layer, stage_ops[-1].layer]
        stages.append(StagePlan(
            layers=[spec.first, spec.last], graph_layers=tags, submesh=list(spec.submesh),
            logical_mesh=list(spec.shape), devices=devices, stage_time_s=latency, forward_s=latency * forward,
            send_time_s=send, sync_time_s=sync_s, memory_bytes=float(params + spec.inflight * acts + working),
            inflight_microbatches=spec.inflight, recompute=spec.recompute,
            breakdown={"compute_s": sum(row[b].sharding.breakdown.compute_s for b in range(first, last + 1)),
                       "comm_s": comm, "sync_s": sync,
                       "optimizer_s": optimizer_s,
                       "recompute_s": sum(row[b].sharding.breakdown.recompute_s for b in range(first, last + 1)),
                       "param_bytes": params, "activation_bytes": acts, "working_bytes": working,
                       "state_bytes": state},
            ops=ops, params=param_info))
    latencies = [s.stage_time_s for s in stages]
    iteration = sum(latencies) + (count - 1) * max(latencies) + max(s.sync_time_s for s in stages)
    flops = _training_flops(graph)
    executed = flops + recomputed_flops
    tensors = tensor_table(intra.with_batch(graph, mb))
    return Plan(
        graph=graph.name, cluster=cluster.name, nodes=cluster.nodes, devices_per_node=cluster.devices_per_node,
        iteration_time_s=float(iteration), num_microbatches=count, microbatch_size=mb, stages=stages,
        memory_peak_bytes=float(max(s.memory_bytes for s in stages)),
        throughput={"samples_per_s": float(batch / iteration),
                    "tflops_per_device": float(flops / iteration / cluster.num_devices / 1e12),
                    "hardware_tflops_per_device": float(executed / iteration / cluster.num_devices / 1e12)},
        solver={"backend": options.backend, "status": ilp_stats["status"], "gap": ilp_stats["gap"],
                "ilps": ilp_stats["ilps"], "ilp_time_s": ilp_stats["solve_time_s"], "time_s": elapsed,
                "dp_rounds": ilp_stats.get("dp_rounds", 0), "microbatch_counts": ilp_stats.get("counts", [count]),
                "recompute_modes": {str(c): list(m) for c, m in ilp_stats.get("recompute_modes", {}).items()},
                "dropped_options": ilp_stats.get("dropped", 0)},
        options={"microbatches": options.microbatches if isinstance(options.microbatches, (int, str))
                 else list(options.microbatches), "layers": options.layers,
                 "logical_shapes": options.logical_shapes if isinstance(options.logical_shapes, str)
                 else [list(x) for x in options.logical_shapes],
                 "submesh_family": options.submesh_family, "memory_reserve": options.memory_reserve,
                 "intra_only": options.intra_only, "inter_only": options.inter_only,
                 "data_parallel_only": options.data_parallel_only, "stage_data_parallel": options.stage_data_parallel,
                 "recompute": options.recompute},
        batch_dim=graph.batch_dim, tensors=tensors)
