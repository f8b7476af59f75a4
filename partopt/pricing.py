"""Pricing: each base layer's optimal sharding on a logical mesh, solved by the intra-op ILP.

One service for the search (`inter.optimize`) and for pricing a given plan (`evaluate`): one
cache with one key, one place that records each ILP's status and gap, one ladder of
memory-lean options. Jobs run in this process, or on a pool of worker processes when many.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from partopt import costmodel, ilp, intra
from partopt.cluster import LogicalMesh
from partopt.errors import InfeasibleError, SolverError
from partopt.executors import Executor, make_executor, prepare
from partopt.graph import Graph
from partopt.sharding import op_strategies, param_strategies

# a timeout (the wall clock) outranks a work limit: only the former depends on the machine's load
STATUS_RANK = {"optimal": 0, "limit": 1, "timeout": 2}
REDUCTIONS = ("all_reduce", "reduce_scatter")  # gradient collectives DDP/Megatron overlap with backward
# The one ladder of memory-lean caps budget / r, for the stage DP's rows (`tighten`) and `evaluate`'s fitted
# stages alike: every stage length to 16, then steps of at most 1.25 (see `rung` and `ladder`)
RUNGS = (*range(2, 17), 20, 24, 28, 32, 40, 48, 56, 64)


@dataclass(frozen=True)
class LayerCost:
    """One base layer solved on one mesh: what a stage adds up."""

    time_s: float  # per microbatch
    sync_s: float  # per iteration
    param_bytes: float
    activation_bytes: float  # kept per in-flight microbatch
    working_bytes: float  # transient, once (recomputation)
    sharding: intra.StageSharding
    reduce_s: float = 0.0  # per iteration: the part of sync_s that reduces gradients (overlappable with backward)
    backward_s: float = 0.0  # per microbatch: backward compute and recomputation (what a reduction can hide behind)
    forward_s: float = 0.0  # per microbatch: forward compute (what a gradient send or a weight gather hides behind)
    gather_s: float = 0.0  # per iteration: the part of sync_s gathering updated weights (overlappable with the forward)

    @classmethod
    def of(cls, sharding: intra.StageSharding) -> LayerCost:
        b = sharding.breakdown
        reduce = sum(b.sync_s.get(kind, 0.0) for kind in REDUCTIONS)
        return cls(b.per_microbatch_s, b.per_iteration_s, b.param_bytes, b.activation_bytes, b.working_bytes, sharding,
                   reduce, b.backward_compute_s + b.recompute_s, b.compute_s - b.backward_compute_s, b.gather_s)

    def memory_bytes(self, inflight: float = 1) -> float:
        """Per device with `inflight` microbatches kept and its whole working set."""
        return self.param_bytes + inflight * self.activation_bytes + self.working_bytes


@dataclass(frozen=True)
class Dropped:
    """A memory-capped option whose ILP found no solution within its work or time limit: not priced, and
    counted in the plan (`solver.dropped_options`) so that the search says what it could not look at."""

    time_limit_s: float


Priced = LayerCost | Dropped | None  # None: the layer cannot fit the job's memory cap on that mesh (under its cutoff)


@dataclass(frozen=True)
class Job:
    """One layer ILP: base layer `ops` (names) of the microbatch view of size `mb`, on `mesh`,
    within `cap` bytes per device (None: no cap) with `inflight` microbatches kept, under an
    optional restriction of its strategies (`evaluate`'s pinned plans; such jobs run in this process).
    A cap that is a layer's share of a stage of `share` layers carries 1/share of the layer's
    transient peak: the stage holds one peak (its largest layer's), not one per layer.
    `cutoff` (with a cap; count · time + sync, see `objectives`): an option costing that much or more is of
    no use to the caller (`tighten`), and the job then answers None, as for a cap the layer cannot fit."""

    mb: int
    count: int
    ops: tuple[str, ...]
    mesh: LogicalMesh
    recompute: str
    cap: float | None
    inflight: int = 1
    restriction: intra.Restriction | None = field(default=None, compare=False)
    share: int = 1  # layers of a stage that hold one transient peak together: the cap carries 1/share of it
    cutoff: float | None = None  # with a cap: the least count · time + sync of no use (None: any cost is of use)
    # the layer's memory-free optimum (assignment, bound), found when it was priced at another cap: not solved again
    free: tuple[tuple[int, ...], float] | None = field(default=None, compare=False)
    time_floor: bool = False  # also its least time per microbatch over every strategy (`intra.shard_stage`)


@dataclass
class Stats:
    """What a solve did: ILPs solved here, their time and how many the wall clock stopped, the worst status
    and gap over every layer it used (cached or not), options dropped, and the search's own counts."""

    ilps: int = 0
    solve_time_s: float = 0.0
    status: str = "optimal"
    gap: float = 0.0
    dropped: int = 0
    timeouts: int = 0  # ILPs solved here that stopped at the wall-clock time limit: `solve` and `evaluate` warn of them
    dp_rounds: int = 0
    counts: list[int] = field(default_factory=list)
    recompute_modes: dict[int, list[str]] = field(default_factory=dict)

    def record(self, cost: Priced, solved: bool) -> None:
        """Add one priced layer: counted and timed when solved here; a non-optimal status (time
        limit) and a dropped option are reported whether solved here or taken from the cache."""
        if isinstance(cost, Dropped):
            self.dropped += 1
        if not isinstance(cost, LayerCost):
            return
        result = cost.sharding.solution.result
        if solved:
            self.ilps += 1
            self.solve_time_s += result.time_s
            self.timeouts += stopped(cost)
        if result.status != "optimal":  # a gap no bound proves is unknown: inf (a plan file writes it null)
            self.status = max(self.status, result.status, key=STATUS_RANK.get)
            self.gap = max(self.gap, math.inf if result.gap is None else result.gap)

    def merge(self, other: Stats) -> None:
        """Fold another solve's ILP statistics into this one (a search over several priced plans)."""
        self.ilps += other.ilps
        self.solve_time_s += other.solve_time_s
        self.dropped += other.dropped
        self.timeouts += other.timeouts
        self.status = max(self.status, other.status, key=STATUS_RANK.get)
        self.gap = max(self.gap, other.gap)


def stopped(cost: Priced) -> bool:
    """Whether `cost` is a layer ILP the wall clock stopped before it was proven optimal."""
    return isinstance(cost, LayerCost) and cost.sharding.solution.result.status == "timeout"


def price(g_mb: Graph, job: Job, options) -> Priced:
    """One base layer's optimal sharding on `job.mesh`, or None when it cannot fit the job's cap
    (without a cap, an infeasible layer raises).

    The solvers stop at deterministic work limits (`partopt.solvers.DEFAULT_WORK_LIMITS`), the time
    limit being a safety net, so the answer does not depend on the machine's load. A memory-capped
    option whose ILP finds no solution is `Dropped`: the search has other meshes and caps, and counts
    the drop (a whole search ended by one slow ILP on a loaded machine told the user nothing).
    """
    try:
        with costmodel.using(options.cost_model):
            sharding = intra.shard_stage(g_mb, job.mesh, [g_mb.op_index[n] for n in job.ops], microbatches=job.count,
                                         inflight=job.inflight, memory_budget=job.cap, backend=options.backend,
                                         time_limit_s=options.time_limit_s, seed=options.seed,
                                         data_parallel=options.data_parallel_only or options.stage_data_parallel,
                                         allow_zero=not options.stage_data_parallel, recompute=job.recompute,
                                         restriction=job.restriction, peak_shared_by=job.share, prefetch=options.overlap,
                                         tp_overlap=options.tp_comm_overlap,  # the objective does not see its hiding:
                                         cutoff=None if job.cutoff is None or options.tp_comm_overlap  # no cut-off
                                         else job.cutoff / job.count,
                                         free=job.free, time_floor=job.time_floor, state_layout=options.state_layout)
    except InfeasibleError:
        if job.cap is None:
            raise  # not a memory cap: a restriction that leaves some op no strategy (its message names it)
        return None
    except SolverError:
        if job.cap is not None:
            return Dropped(options.time_limit_s)  # no capped option found within the limits
        raise
    return LayerCost.of(sharding)


def price_job(graph: Graph, options, job: Job) -> Priced:
    """`price` of one job on `graph` at its microbatch size: the function the executors run (`partopt.executors`).
    A worker is given the graph once (its context, the same object each job), whose memo keeps the views."""
    return price(intra.with_batch(graph, job.mb), job, options)


def _restriction_key(g_mb: Graph, job: Job) -> tuple:
    """What a restriction allows, as a key: layers alike under alike pins share one solve."""
    r = job.restriction
    if r is None or r.key == ():
        return ()
    if r.key is not None:  # structural: the layer's hash (beside this key in the cache key) and the key decide
        return ("structural", *r.key)
    ops = [g_mb.op_index[n] for n in job.ops]
    params = list(dict.fromkeys(t for op in ops for t in op.inputs if g_mb.tensors[t].role == "param"))
    return (tuple(tuple(s.axes) for op in ops for s in op_strategies(g_mb, op, job.mesh) if r.op(op, s)),
            tuple(s.name for t in params for s in param_strategies(g_mb, g_mb.tensors[t], job.mesh, uneven=r.uneven_params)
                  if r.param(t, s)))


class Expired(Exception):
    """The search's deadline passed while layers were being priced."""


def prepare_workers(workers: int | None) -> None:
    """Start the fork server of a local pool of `workers` processes (default: one per core) in the background, as a
    `Pricer` does (`executors.prepare`; nothing for one worker): a caller with work of its own before the search,
    such as reading the instance, lets the server import partopt beside it."""
    if (workers or len(os.sched_getaffinity(0))) > 1:
        prepare(price_job)


class Pricer:
    """Runs layer ILPs: in this process, or on an executor (`options.executor`: a local pool of worker
    processes for many of them, or Ray).
    Results are kept in `cache` under the graph, the pricing options and the job (by structure:
    layers that hash alike share one solve), so later calls given the same dict reuse them."""

    # seconds of pricing in this process after which the local pool starts, in the background (`LocalPool.start`):
    # a search that prices for less never starts processes; a longer one runs its later jobs on the workers once
    # one is up, from the job after which one is seen up (mid-call too). Workers fork from a server that imports
    # partopt once, started with the Pricer (`executors.prepare`), so the pool pays off early: `partopt solve` of
    # GPT-1.3B's default took a median 4.87 s with the pool at 1 s, 4.46 s at 0 (five runs each); a search that
    # ends before the server is up waits for it when it closes the pool (docs/benchmarks.md)
    WARM_S = 0.3

    def __init__(self, graph: Graph, options, cache: dict | None = None, deadline: float = math.inf):
        self.graph, self.options = graph, options
        self.deadline = deadline  # time.perf_counter() after which `run` raises Expired
        self.workers = options.workers or len(os.sched_getaffinity(0))
        self.executor: Executor | None = None
        self.local_s = 0.0  # seconds spent pricing in this process
        self.booting = False  # the local pool was started in the background and no worker has been seen up yet
        self.cache = {} if cache is None else cache
        if options.executor == "local":
            prepare_workers(self.workers)  # the pool may start within seconds: its fork server starts now
        self.prefix = (graph.name, graph.structural_hash(), options.backend, options.time_limit_s, options.seed,
                       options.memory_reserve, options.data_parallel_only, options.stage_data_parallel,
                       (options.cost_model or costmodel.ANALYTICAL).key, options.overlap, options.tp_comm_overlap,
                       options.state_layout)

    def _key(self, job: Job) -> tuple:
        g_mb = intra.with_batch(self.graph, job.mb)
        layer = g_mb.structural_hash([g_mb.op_index[n] for n in job.ops])
        return (self.prefix, job.mb, job.count, layer, job.mesh, job.recompute, job.cap, job.inflight, job.share,
                job.cutoff, job.time_floor, _restriction_key(g_mb, job))

    def __enter__(self) -> Pricer:
        return self

    def __exit__(self, kind, *exc) -> None:
        if self.executor is not None:  # interrupted: do not wait for running ILPs; nor for workers still starting
            self.executor.close(wait=kind is None and not self.booting)

    def _results(self, jobs: list[Job]) -> Iterator[Priced]:
        """The jobs' results in order: on the executor once it is ready, else here (the same results either way).
        The local pool starts in the background once this process has priced for WARM_S; the jobs after that
        run here until a worker is up, and the rest of them on the pool, within one call as across calls."""
        if any(job.restriction is not None for job in jobs):  # restrictions are closures: not shipped
            yield from self._here(jobs)
            return
        if self.options.executor != "local" and self.executor is None:
            self.executor = make_executor(self.options.executor, price_job, (self.graph, self.options), self.workers,
                                          self.options.ray_address)
        for n, job in enumerate(jobs):
            if self.executor is None and self.workers > 1 and self.local_s >= self.WARM_S:
                self.executor = make_executor("local", price_job, (self.graph, self.options), self.workers)
                self.executor.start()  # in the background: this process goes on pricing until a worker is up
                self.booting = True
            if self.executor is not None and (not self.booting or self.executor.ready()):
                self.booting = False
                yield from self.executor.map(jobs[n:])
                return
            yield from self._here([job])

    def _here(self, jobs: list[Job]) -> Iterator[Priced]:
        for job in jobs:
            began = time.perf_counter()
            cost = price_job(self.graph, self.options, job)
            self.local_s += time.perf_counter() - began
            yield cost

    def run(self, jobs: dict, stats: Stats, progress: Callable[[int], None] = lambda n: None) -> dict:
        """Results of `jobs` (key -> Job) by key, each recorded in `stats`. Jobs with one cache key
        (layers alike) are solved once: the first of them is counted as solved, the rest as cached."""
        cache_keys = {key: self._key(job) for key, job in jobs.items()}
        solving: dict[tuple, object] = {}  # cache key -> the job key that solves it
        for key, ck in cache_keys.items():
            if ck not in self.cache:
                solving.setdefault(ck, key)
        # the largest first: workers that share the jobs then finish together (the results do not depend on it)
        solving = dict(sorted(solving.items(), key=lambda item: -_size(jobs[item[1]])))
        done = 0
        for key, ck in cache_keys.items():
            if ck in self.cache:
                stats.record(self.cache[ck], solved=False)
                done += 1
                progress(done)
        for (ck, key), cost in zip(solving.items(), self._results([jobs[k] for k in solving.values()])):
            if time.perf_counter() > self.deadline:
                raise Expired  # a finished ILP past the deadline is dropped with the rest of this call
            self.cache[ck] = cost
            stats.record(cost, solved=True)
            done += 1
            progress(done)
        for key, ck in cache_keys.items():
            if solving.get(ck, key) != key:  # alike a job solved in this call
                stats.record(self.cache[ck], solved=False)
                done += 1
                progress(done)
        return {key: self.cache[ck] for key, ck in cache_keys.items()}

    def one(self, job: Job, stats: Stats) -> Priced:
        """The result of a single job."""
        return self.run({0: job}, stats)[0]

    def cached(self, job: Job) -> Priced | None:
        """The result of `job` if an earlier call priced it, else None: nothing is run or recorded."""
        return self.cache.get(self._key(job))


def _size(job: Job) -> int:
    """A job's size for ordering: its ops, times 10 per mesh axis that splits (each multiplies the strategies
    of an op by about its dims, and the edge tables by their square)."""
    return len(job.ops) * 10 ** sum(n > 1 for n in job.mesh.shape)


def rung(n: int) -> int:
    """The ladder's rung for a stage of `n` base layers: the smallest rung r ≥ n (n itself past the last rung)."""
    return next((r for r in RUNGS if r >= n), n) if n > 1 else 1


def ladder(r: int) -> list[int]:
    """The rungs a layer of a stage of rung `r` tries, tightest first: its even share budget / r, then each looser
    rung down to 1 (the budget itself). The first it fits is its leanest option: a narrow layer's unused share is
    room for a wide one (a small embedding beside the blocks)."""
    return [r, *(x for x in reversed(RUNGS) if x < r), 1] if r > 1 else [1]


def tighten(costs: dict, priced: dict, jobs: dict, layer_keys: list, budget: float, layers: int, count: int,
            bound: Callable[[], float], pricer: Pricer, stats: Stats, work: list[float] | None = None,
            devices: int = 0, overlap: bool = False,
            reach: Callable[[float], set[tuple]] | None = None) -> None:
    """Add memory-leaner options: one row of layer costs per rung r of the ladder (`RUNGS`) where a layer overflows it.

    Each layer's ILP alone sees only its own memory; a stage of r such layers needs each to fit its
    even share budget / r, with the in-flight microbatches of a stage that leads about layers / r
    stages (the most it could have), and 1/r of its transient peak (the stage holds one). A layer
    whose optimum already fits the tighter cap keeps it (the same ILP with a tighter, non-binding
    constraint has the same optimum), so small models cost nothing; one that cannot fit it keeps its
    leanest option, the tightest rung it fitted, and is not refined further (as `evaluate` fits a
    stage's layers: the first rung of `ladder` each fits). Rung r serves the stages longer than the
    rung before it and at most r long (shorter ones fit that rung; the last rung priced holds all the
    layers); a mesh on which no stage of those lengths costs under `bound()` (the iteration time of
    the best plan known — another count's, or this count's with the rows added so far; see
    `stage_lengths`) is not refined at that rung, nor at any later one when no longer stage can; with
    `work` (per layer, see `stage_lengths`) a stage must also leave the rest of the model room to run
    under `bound` on the other of the cluster's `devices` (a stage on the whole cluster holds every
    layer, so only the last rung is priced for it); `overlap`: gradient reductions hide behind the
    backward (see `stage_lengths`); `reach(limit)`: the options that may hold a stage of a plan under `limit`
    with the other stages and memory counted (`bounds.options_in_reach`): the others are not refined.
    `costs[option]` is the list of rows of layer costs of one (submesh, shape, mode) option and
    `jobs[(layer key, option)]` its unconstrained job; each option gets one more row per rung at
    which any of its layers changed.
    """
    last = dict(priced)
    stuck = {key for key, cost in last.items() if cost is None}
    # key -> (a cutoff its capped optimum reached at an earlier rung, that rung's r · in-flight count): skipped at a
    # later rung only while its cutoff is no higher and the rung's cap is no looser (a cap budget / r with k in flight
    # is r · param + r · k · activations + peak ≤ budget: it implies the earlier one when r · k is no smaller)
    above: dict = {}
    before, limit = 1, None  # limit: bound() since the rows last changed (asked again only when they have)
    for r in (r for r in RUNGS if r <= rung(layers)):
        cap = budget / r
        inflight = min(count, math.ceil(layers / r))  # stages of r layers are the first of about layers / r
        for key in jobs:  # no ILP where the cap is below the leanest assignment
            if key not in stuck and _charged(last[key].sharding.least_memory_bytes,
                                             last[key].sharding.least_transient_bytes, r) > cap:
                stuck.add(key)
        tight = [key for key in jobs if key not in stuck and _charged(
            last[key].memory_bytes(inflight), last[key].sharding.breakdown.transient_bytes, r) > cap]
        if tight:  # nor where the rung serves no stage that can win
            limit = bound() if limit is None else limit
            least = {option: objectives(costs[option][0], count) for option in {key[1] for key in tight}}
            lengths = {option: stage_lengths(row, count, limit, work, devices - option[0][0] * option[0][1], overlap)
                       for option, row in least.items()}
            if reach is not None:  # an option in no plan under the limit needs no leaner row, for any stage
                allowed = reach(limit)
                lengths = {option: found if option in allowed else set() for option, found in lengths.items()}
            stuck |= {key for key in tight if max(lengths[key[1]], default=0) <= before}  # nor at any later rung
            tight = [key for key in tight if key not in stuck and any(before < n <= r for n in lengths[key[1]])]
            cutoffs = _cutoffs(tight, least, layer_keys, count, limit, range(before + 1, r + 1), work, devices, overlap)
            tight = [key for key in tight if key not in above or cutoffs[key] > above[key][0]
                     or r * inflight < above[key][1]]
        before = r
        if not tight:  # a tighter rung may still bind: fewer microbatches in flight do not offset a smaller cap
            continue
        capped = {key: _with_cap(jobs[key], cap, inflight, r, cutoffs[key], last[key].sharding.solution)
                  for key in tight}
        for key, cost in pricer.run(capped, stats).items():
            if cost is None and capped[key].cutoff is not None:
                above[key] = (cutoffs[key], r * inflight)  # none under this cap costs less: of no use at this rung
            elif not isinstance(cost, LayerCost):
                stuck.add(key)  # cannot fit this cap: keep its leanest option, stop refining it
            else:
                last[key] = cost
        for option, rows in costs.items():
            row = [last[(k, option)] for k in layer_keys]
            if any(new is not old for new, old in zip(row, rows[-1])):
                rows.append(row)
                limit = None


def _with_cap(job: Job, cap: float, inflight: int, share: int, cutoff: float = math.inf,
              priced: ilp.Solution | None = None) -> Job:
    """`job` under `cap`; `priced`: a solution of it at another cap, whose memory-free optimum it need not solve again."""
    free = None if priced is None or priced.free_choice is None else (priced.free_choice, priced.free_bound)
    return Job(job.mb, job.count, job.ops, job.mesh, job.recompute, cap, inflight, job.restriction, share,
               cutoff if cutoff < math.inf else None, free)


def _cutoffs(keys: list, least: dict, layer_keys: list, count: int, limit: float, lengths: range,
             work: list[float] | None, devices: int, overlap: bool) -> dict:
    """Per (layer key, option) of `keys`, the cost at or above which its layers belong to no stage of a length in
    `lengths` on that option's mesh that may cost under `limit` (`layer_cutoffs` of the option's `least` row of
    objectives, the largest over its layers, which share one job: `layer_keys` per layer)."""
    cut = {option: layer_cutoffs(least[option], count, limit, lengths, work, devices - option[0][0] * option[0][1],
                                 overlap, layer_keys)
           for option in {key[1] for key in keys}}
    return {key: max((c for c, k in zip(cut[key[1]], layer_keys) if k == key[0]), default=-math.inf) for key in keys}


def _charged(memory: float, transient: float, share: int) -> float:
    """Memory of a layer priced alone (its whole transient peak counted) as charged to 1/share of a stage's budget."""
    return memory - transient * (1 - 1 / share)


def objectives(row: list[LayerCost | None], count: int) -> list[float | None]:
    """Each layer's count · time + sync (what its ILP minimises, times the count); None where it cannot run."""
    return [None if c is None else count * c.time_s + c.sync_s for c in row]


def layer_cutoffs(costs: list[float | None], count: int, limit: float, lengths: range, work: list[float] | None = None,
                  spare: int = 0, overlap: bool = False, kinds: list | None = None) -> list[float]:
    """Per layer, the cost (count · time + sync) at or above which no stage on this mesh holding it, of a length
    in `lengths`, may cost under `limit`, its other layers costing at least `costs` (their unconstrained optima):
    `stage_lengths`'s test with the layer's own cost left free. Layers of one kind (`kinds`: per layer, a key;
    default: each its own) are priced by one job, so they cost the same in a row and the cost is theirs together.
    -inf where no such stage holds the layer at all; inf where no limit binds.

    A stage is ruled out when paid · (its layers' costs) ≥ limit, or when the layers outside it cannot run
    under `limit` on the `spare` devices it leaves (`stage_lengths`), so the k layers of b's kind in a stage W
    may cost x each only while k · x < limit / paid − (W's other layers). The answer is the largest such bound
    over the stages that hold b, a hair above it so that rounding never rules out a stage `stage_lengths` keeps."""
    paid = 1.0 - 1.0 / count if overlap else 1.0
    if paid <= 0 or limit == math.inf:
        return [math.inf] * len(costs)
    known = np.array([math.inf if c is None else c for c in costs])
    kind = np.arange(len(costs)) if kinds is None else np.unique(kinds, return_inverse=True)[1]
    finite = np.where(np.isinf(known), 0.0, known)
    total = np.concatenate([[0.0], np.cumsum(finite)])
    missing = np.concatenate([[0], np.cumsum(np.isinf(known))])
    leaves_room = _leaves_room(work, count, limit, spare)
    out = np.full(len(costs), -math.inf)
    for end in range(len(costs)):
        for n in lengths:
            first = end - n + 1
            if first < 0 or missing[end + 1] > missing[first]:
                continue  # past the first layer, or a layer that cannot run on this mesh
            if leaves_room is not None and not leaves_room(first, end):
                continue  # the rest of the model cannot run under the limit beside it
            held = kind[first:end + 1]
            alike = np.bincount(held)  # per kind: its layers in the stage, and their costs
            theirs = np.bincount(held, weights=finite[first:end + 1])
            with np.errstate(divide="ignore", invalid="ignore"):
                room = (limit / paid - (total[end + 1] - total[first]) + theirs) / alike
            np.maximum(out[first:end + 1], room[held], out=out[first:end + 1])
    held = np.isfinite(out)
    out[held] += 1e-9 * np.abs(out[held])
    return out.tolist()


def _leaves_room(work: list[float] | None, count: int, limit: float, spare: int) -> Callable[[int, int], bool] | None:
    """Whether the layers outside a stage of layers first..last can still run under `limit` on the `spare` devices
    it leaves, as a function of (first, last): their iteration is at least count · (their roofline `work`) / spare,
    and with no device spare there must be no layer outside. None without `work` (no bound)."""
    if work is None:
        return None
    whole, before = sum(work), [0.0, *itertools.accumulate(work)]  # before[i]: the work of the layers before i
    if spare == 0:
        return lambda first, last: first == 0 and last == len(work) - 1
    return lambda first, last: count * (whole - (before[last + 1] - before[first])) / spare < limit


def longest_stage(costs: list[float | None], count: int, limit: float, work: list[float] | None = None,
                  spare: int = 0, overlap: bool = False) -> int:
    """The most consecutive base layers a stage on this mesh can hold and still cost under `limit` (0: none;
    see `stage_lengths`)."""
    return max(stage_lengths(costs, count, limit, work, spare, overlap), default=0)


def stage_lengths(costs: list[float | None], count: int, limit: float, work: list[float] | None = None,
                  spare: int = 0, overlap: bool = False) -> set[int]:
    """How many consecutive base layers a stage on this mesh can hold and still cost under `limit`: every such length.

    A plan's iteration time is at least B · t + sync of each of its stages (B microbatches, t its
    latency, sync its per-iteration work), and no option of a layer on a mesh costs less than its
    unconstrained optimum, count · time + sync, which is what its ILP minimises: `costs[b]` is that (or a
    lower bound of it; None: the layer cannot run on the mesh). With `overlap` the gradient reductions
    hide behind the last microbatch's backward and the updated weights' gathers behind the first's forward,
    at most t of them together (docs/COSTMODEL.md §5b: exposed ≥ reductions − backward, gathers − forward),
    so the iteration is at least B · t + sync − t ≥ (1 − 1/B)(B · t + sync).
    With `work` (each layer's device-seconds per microbatch, a lower bound: `bounds.roofline_work`),
    the layers outside the stage must also run under `limit` on the `spare` devices it leaves:
    their iteration is at least B · (their work) / spare, and with no device spare there must be
    no layer outside. At each last layer the runs under `limit` start at `start` or later and those
    leaving the rest room start at `room` or earlier (a longer run leaves less outside), so the lengths
    are the runs from `start` to `room`.
    """
    leaves_room = _leaves_room(work, count, limit, spare)
    paid = 1.0 - 1.0 / count if overlap else 1.0  # the share of a stage's count · time + sync surely paid
    lengths: set[int] = set()
    start, total, room = 0, 0.0, -1
    for end, cost in enumerate(costs):
        if cost is None:  # cannot run on this mesh at all: no stage spans it
            start, total = end + 1, 0.0
            continue
        total += cost
        while paid * total >= limit and start <= end:
            total -= costs[start]
            start += 1
        if leaves_room is None:
            room = end
        else:
            while room < end and leaves_room(room + 1, end):
                room += 1
        if start <= room:  # room ≤ end in both branches
            lengths.update(range(end - room + 1, end - start + 2))
    return lengths
