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

import functools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from partopt import bounds, costmodel, intra, pricing, stagedp
from partopt.assemble import assemble, pipeline_of
from partopt.cluster import Cluster, LogicalMesh
from partopt.errors import InfeasibleError, InstanceError, PartoptError
from partopt.graph import Graph, Op
from partopt.layering import Layering, build_layers, tagged_layers
from partopt.options import DEFAULT_MAX_LAYERS, Options, microbatch_counts, restrictions
from partopt.plan import Plan
from partopt.pricing import Dropped, Expired, Job, Pricer, Stats, tighten
from partopt.schedules import SEARCHED, inflight, interleaved_shapes
from partopt.stages import End, Pipeline, StageSpec, chunks, fits, interleaved_table, split_table, stage_table
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
    """The logical shapes searched on `submesh`: the options' family (mirrors pruned per count, `_outpriced`)."""
    devices = submesh[0] * submesh[1]
    if options.data_parallel_only or options.stage_data_parallel:
        return [(devices, 1)]
    shapes = cluster.logical_shapes(submesh)
    if options.logical_shapes == "node_local":  # Alpa's benchmark space: the second axis stays in a node
        return [s for s in shapes if submesh[0] == 1 or cluster.devices_per_node % s[1] == 0]
    if isinstance(options.logical_shapes, str):
        if options.logical_shapes != "all":
            raise InstanceError(f"unknown logical shape family {options.logical_shapes!r}", "logical_shapes",
                                "use node_local, all, or a list of (a, b) shapes")
        return shapes
    return [s for s in shapes if tuple(s) in {tuple(x) for x in options.logical_shapes}]


def optimize(graph: Graph, cluster: Cluster, progress: Progress | None = None, cache: dict | None = None,
             options: Options | None = None, **kwargs) -> Plan:
    """The best pipeline + sharding plan of `graph` on `cluster` under the cost model.

    Options (keywords): microbatches ("auto": the powers of two dividing the batch; a count; or
    several counts to search), layers (most DP layers, default 64),
    submesh_family ("auto" | "alpa" | "power_of_two"), logical_shapes ("node_local": the second mesh axis
    within a node, as Alpa's benchmarks; "all"; or a list of allowed (a, b) shapes), backend
    ("highs" | "cpsat" | "cbc"), time_limit_s (per ILP), memory_reserve (fraction of device
    memory kept free), intra_only / inter_only / data_parallel_only / stage_data_parallel
    (restricted searches, the benchmarks' baselines: one stage on the whole cluster; stages of
    one device; one data-parallel stage with ZeRO allowed, like DeepSpeed; pipeline stages that
    are each plain data parallel, like PP-DP), seed, workers, recompute ("auto" | "none" |
    "selective" | "full"), cost_model (a `costmodel.CostModel`; default analytical), state_layout ("zero" |
    "megatron": parameter state as the runtime keeps it, `costmodel.STATE_LAYOUTS`). Give them as keywords or as one
    `options=Options(...)`, not both.
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
    if options.tp_comm_overlap:
        raise InstanceError("tensor-parallel comm overlap prices Megatron's layout, which the search does not keep",
                            "tp_comm_overlap", "price a Megatron-style plan: uniform(..., tp_comm_overlap=True) or "
                            "partopt evaluate --tp-comm-overlap")
    with costmodel.using(options.cost_model):
        return _search(graph, cluster, options, progress, cache)


@dataclass(frozen=True)
class _Space:
    """What every microbatch count is searched over: the meshes, the memory budget, the options."""

    graph: Graph
    cluster: Cluster
    options: Options
    layering: Layering
    budget: float
    submeshes: list[tuple[int, int]]
    meshes: dict[tuple, LogicalMesh]  # (submesh, logical shape) -> its mesh
    alike: list[int] = field(default_factory=list)  # per base layer, the first alike (`bounds.alike_layers`)
    solved: dict = field(default_factory=dict)  # `best`'s results by what they depend on
    outpriced: dict = field(default_factory=dict)  # per count, the meshes no stage of it needs (`_outpriced`)
    pipes: dict = field(default_factory=dict)  # per count, its `Pipeline` (`pipe`)

    def pipe(self, count: int) -> Pipeline:
        """The pipeline of `count` microbatches (`assemble.pipeline_of`), made once: its stage sums are kept in it."""
        if count not in self.pipes:
            self.pipes[count] = pipeline_of(self.graph, self.cluster, self.layering, count, self.options.overlap)
        return self.pipes[count]

    def best(self, pipe: Pipeline, costs: dict, count: int, budget: float, stats: Stats,
             schedules: Sequence[str] | None = None, cutoff: float = math.inf):
        """The stage DP's best plan over `schedules` (default: the searched ones; `_best_schedule`), or None;
        `cutoff`: only a plan costing less is wanted (another count's plan beats the rest), and None may then
        also mean that none costs less.

        Solved once per state of `costs`: its rows are only ever appended (a new mode's key, a leaner cap's
        row), so the rows per key stand for its content, and asking again with nothing added (a mode with no
        mesh left to price, a ladder that changed no row) returns the same plan without running the DPs (what
        was found under a cutoff, when it is under it or, for no larger cutoff, when it is not: None, or the
        incumbent the DPs did not beat). For the same reason a plan found before, on fewer rows, under these
        schedules or some of them, is still a plan: the best of them is the DPs' incumbent."""
        schedules = tuple(schedules or self.options.schedules)
        key = (count, budget, schedules, tuple((option, len(rows)) for option, rows in costs.items()))
        if key in self.solved:
            found, under = self.solved[key]
            if cutoff > under and (found is None or found[0].total >= under):
                del self.solved[key]  # a plan no longer cutoff may cost less than what was found
        if key not in self.solved:
            before = [found for (c, b, among, _), (found, _) in self.solved.items()
                      if c == count and b == budget and set(among) <= set(schedules) and found is not None
                      and found[0].stages]
            incumbent = min(before, key=lambda found: found[0].total, default=None)
            self.solved[key] = (self.run_dps(pipe, costs, count, budget, schedules, stats, incumbent, cutoff), cutoff)
        return self.solved[key][0]

    def run_dps(self, pipe: Pipeline, costs: dict, count: int, budget: float, schedules: Sequence[str],
                stats: Stats, incumbent: tuple | None = None, cutoff: float = math.inf, proven: bool = True,
                bounds_only: bool = False):
        """`_best_schedule` on this space's submeshes and cluster, uncached."""
        return _best_schedule(pipe, costs, self.submeshes, [n * m for n, m in self.submeshes],
                              self.cluster.num_devices, count, budget, schedules, stats, incumbent, cutoff, proven,
                              bounds_only)

    def upper(self, pipe: Pipeline, costs: dict, count: int, budget: float, stats: Stats, cutoff: float) -> float:
        """The iteration time of a plan of the searched schedules but ZB-H1 (whose search is the slowest; ZB-H1 alone
        when it is the only one) that fits, or `cutoff` when it finds none under it: a bound to prune by, found
        without proving it the least (`_best_schedule`'s `proven`), so not cached. The interleaved plans count: a
        count whose best plan is interleaved gets it as its bound at once, and its ladder prunes by it."""
        quick = [s for s in self.options.schedules if s != "zero-bubble"] or self.options.schedules[:1]
        found = self.run_dps(pipe, costs, count, budget, quick, stats, cutoff=cutoff, proven=False)
        return min(cutoff, found[0].total if found else math.inf)

    def each_mode(self, state: _Count, found, modes: list[str], stats: Stats, cutoff: float = math.inf):
        """`found` (the stage DP's plan over the rows of every mode in `modes`), or a faster plan of the search
        over one mode's rows alone (what `--recompute MODE` searches). Only a zero-bubble search stopped at its
        work limit can miss one (the other DPs are exact, and so is a search that ran to the end): a table of one
        mode has fewer options per entry, so the same limit takes its search further, and the default must be
        no slower than a mode forced (issue 13 item 7). The floor stays the whole table's: it bounds them all."""
        if found is None or found[0].floor is None or len(modes) < 2:
            return found
        alone = [self.run_dps(state.pipe, {option: rows for option, rows in state.costs.items() if option[2] == mode},
                              state.count, self.budget, self.options.schedules, stats, cutoff=cutoff) for mode in modes]
        best = min([found, *(a for a in alone if a is not None)], key=lambda f: f[0].total)  # ties keep `found`
        floor = found[0].floor
        return (replace(best[0], floor=floor if floor < best[0].total else None), *best[1:])


@dataclass
class _Tally:
    """Layer ILPs priced so far, told to the caller's progress callback."""

    progress: Progress | None
    done: int = 0

    def running(self, jobs: int, counts_left: int) -> Callable[[int], None]:
        """The callback for `jobs` more, with an estimated total (later counts may be skipped)."""
        first, total = self.done, self.done + jobs * counts_left
        self.done += jobs
        return lambda k: self.progress(first + k, total) if self.progress else None


def _search(graph: Graph, cluster: Cluster, options: Options, progress: Progress | None, cache: dict | None) -> Plan:
    """`optimize` under its cost model."""
    start = time.perf_counter()
    if graph.batch_dim is None:
        raise InstanceError("the graph names no batch dim", "batch_dim", "set `batch_dim` to plan data parallelism and microbatches")
    if options.schedule not in ("auto", *SEARCHED):
        raise InstanceError(f"the search does not plan the {options.schedule} schedule", "schedule",
                            f"use auto or one of {', '.join(SEARCHED)}; `partopt evaluate --schedule` prices any "
                            "(docs/COSTMODEL.md §5b says why)")
    batch = graph.dims[graph.batch_dim]
    layering = build_layers(graph, options.layers)
    budget = costmodel.memory_budget(cluster.device, options.memory_reserve)
    submeshes = _submeshes(cluster, options)
    meshes = {(s, shape): cluster.logical_mesh(s, shape) for s in submeshes for shape in _shapes(cluster, s, options)}
    # layers alike share their bounds' work in every view
    space = _Space(graph, cluster, options, layering, budget, submeshes, meshes, bounds.alike_layers(graph, layering.base))
    stats, tally = Stats(), _Tally(progress)
    best: tuple | None = None  # (iteration time, count, stage specs, their rows of layer costs, schedule, v)
    finished: list[tuple] = []  # each count's plan found, as `best`: the one returned is the fastest assembled
    views = _microbatch_views(graph, microbatch_counts(batch, options.microbatches))
    room = cluster.num_devices * budget - _state_bytes(graph)  # activation bytes all devices can hold together
    base, work, lower = {}, {}, {}  # per count: the base layers' ops, their roofline work; the iteration's lower bound
    for count, view in views.items():
        base[count] = [[view.op_index[op.name] for op in ops] for ops in layering.base]
        work[count] = bounds.roofline_work(view, base[count], cluster.device, space.alike)
        rerun = bounds.least_rerun_s(bounds.footprints(view, base[count], options.recompute_modes, cluster.device,
                                                       space.alike), room)
        lower[count] = count * (sum(work[count]) + rerun) / cluster.num_devices if work[count] is not None else (
            0.0 if rerun < math.inf else math.inf)
    # counts that cannot fit skipped; each is opened (its fastest options, memory ignored: `_open_count`), the
    # least bound first, and closed (`_close_count`) only when its memory binds. Uncapped ILPs cost alike at every
    # count, and the plans that fit found early let the bounds skip counts before any of their ILPs run. A count
    # whose memory binds waits, bounded by its memory-free plan too; once no unopened count has a lower bound,
    # the waiting count with the most microbatches is closed first: small microbatches need least memory, so it
    # is the cheapest to refine and gives the incumbent that lets the bounds skip the rest
    candidates = sorted((c for c in views if lower[c] < math.inf), key=lambda c: (lower[c], -c))
    if not candidates:
        raise _no_plan(graph, cluster, budget)
    left = {c: lower[c] for c in candidates}  # the counts not finished, by their lower bounds
    # what the waiting counts are ranked by: their bound, or with ZB-H1 deferred the other schedules' memory-free
    # plan (ZB-H1's bound is loosest at few microbatches, and would rank such a count ahead of those it cannot beat)
    rank = dict(left)
    stopped = None
    floor = math.inf  # the least floor of a stage DP stopped at its work limit
    deadline = start + options.deadline_s if options.deadline_s is not None else math.inf

    def finish(count: int, found, costs: dict, modes: list[str]) -> None:
        nonlocal best, floor
        if found is not None and found[0].floor is not None:
            floor = min(floor, found[0].floor)
        stats.counts.append(count)
        stats.recompute_modes[count] = modes
        del left[count]
        if found is None:
            return
        finished.append((found[0].total, count, *_stages_of(found, costs, count, space)))
        if best is None or found[0].total < best[0] - 1e-15 or (
                abs(found[0].total - best[0]) <= 1e-15 and count < best[1]):  # ties: the fewest microbatches
            best = finished[-1]

    def place(state: _Count) -> None:  # a count whose memory-free plan is known: finished, or waiting to close
        if state.free is not None:  # no plan with a stage on a mesh left out costs under its limit
            left[state.count] = max(left[state.count], min(_lower(state.free), state.limit))
            rank[state.count] = (max(left[state.count], min(state.free[0].total, state.limit)) if state.deferred
                                 else left[state.count])
        else:
            left[state.count] = max(left[state.count], state.limit)
        if state.found is not None or (state.free is None and best is not None):
            needed = min(best[0] if best is not None else math.inf,
                         state.found[0].total if state.found is not None else math.inf)
            if state.limit < needed:  # a mesh left out may hold a stage of a faster plan
                widen(state, needed)
                place(state)
            else:
                finish(state.count, state.found, state.costs, state.modes[:1])  # found, or none beats the best
        else:
            waiting[state.count] = state

    def widen(state: _Count, limit: float) -> None:  # price the meshes left out that may hold a stage under `limit`
        count = state.count
        added = [key for key in _may_open(space, count, views[count], base[count], work[count], fastest, limit)
                 if key not in state.keys]
        if added:
            _price_mode(space, pricer, state, added, state.modes[0], stats, running)
            state.keys = [key for key in space.meshes if key in state.keys or key in added]
            fastest[count] = {key: state.costs[(*key, state.modes[0])][0] for key in state.keys}
            _set_free(space, state, best, stats)
        state.limit = limit

    def running(jobs: int) -> Callable[[int], None]:  # the progress callback of `jobs` more, the counts left counted
        return tally.running(jobs, len(unopened) + len(waiting) + 1)

    def loses(count: int) -> bool:  # its lower bound already loses: no more ILPs for it
        return best is not None and (left[count], count) > best[:2]

    try:
        with Pricer(graph, options, cache, deadline) as pricer:
            unopened, waiting = list(candidates), {}  # waiting: count -> its opened state
            fastest = {}  # count opened -> per mesh priced, its layers' fastest costs (what bounds its multiples)
            while unopened or waiting:
                for count in [c for c in (*unopened, *waiting) if loses(c)]:
                    if count in waiting:
                        finish(count, None, waiting[count].costs, waiting[count].modes[:1])
                        del waiting[count]
                    else:
                        del left[count]
                        unopened.remove(count)
                if not unopened and not waiting:
                    break
                if time.perf_counter() > deadline:
                    raise Expired
                if unopened and (not waiting or left[unopened[0]] <= min(rank[c] for c in waiting)):
                    count = unopened[0]
                    # what opening it must beat: the best plan, and the waiting counts closed first when it cannot
                    # beat their rank (its memory counted; `_may_open`). It is opened on the meshes that may; a rank
                    # is no bound, so those left out are priced should the best land above it (`widen`)
                    bar = min([rank[c] for c in waiting] + [best[0] if best is not None else math.inf])
                    judged = (_may_open(space, count, views[count], base[count], work[count], fastest, bar)
                              if bar < math.inf else None)
                    if judged is not None and not judged:
                        if best is not None and bar == best[0]:
                            del left[count]
                            unopened.remove(count)
                        else:
                            left[count] = math.nextafter(bar, math.inf)
                            unopened.sort(key=lambda c: (left[c], -c))
                        continue
                    if best is not None and work[count] is not None and _fill_binds(space, count) and not (
                            _relaxed_may_win(space, count, space.pipe(count),
                                             _roofline_rows(space, count, views[count], base[count], work[count]),
                                             _wanted(best))):
                        del left[count]  # no plan of it beats the best, its layers at their rooflines: not opened
                        unopened.remove(count)
                        continue
                    unopened.pop(0)
                    state = _open_count(space, pricer, count, views[count], base[count], work[count], best,
                                        fastest, stats, running, judged, bar)
                    if state is None:  # no mesh may win
                        del left[count]
                        continue
                    fastest[count] = {key: state.costs[(*key, state.modes[0])][0] for key in state.keys}
                    place(state)
                    continue
                state = waiting.pop(max(waiting))
                incumbent = best[0] if best is not None else math.inf
                if state.limit < incumbent:  # its meshes judged under a rank
                    widen(state, incumbent)
                    place(state)
                    continue
                if state.deferred and best is not None and (state.free[0].total, state.count) > best[:2] and not (
                        _zero_bubble_may_win(space, state, best, stats)):
                    finish(state.count, None, state.costs, state.modes[:1])  # no plan of it beats the best
                    continue
                found, modes = _close_count(space, pricer, state, best, stats, running)
                finish(state.count, space.each_mode(state, found, modes, stats, _wanted(best)), state.costs, modes)
    except (Expired, KeyboardInterrupt) as err:
        stopped = "deadline" if isinstance(err, Expired) else "interrupted"
        if best is None:
            if stopped == "interrupted":
                raise
            raise PartoptError(f"no plan found within the deadline of {options.deadline_s:g} s", "--deadline",
                               "give the search more time") from None
    if best is None:
        raise _no_plan(graph, cluster, budget)
    # The stage DP prices a send before its neighbour is placed (COSTMODEL §5b "Pipeline sends"); assembly prices it
    # placed. Of the plans found, one per count, the fastest assembled is returned (ties: the fewest microbatches).
    plan = min((assemble(graph, cluster, layering, options, count, specs, rows, stats, time.perf_counter() - start,
                         schedule, v, space.pipe(count)) for _, count, specs, rows, schedule, v in finished),
               key=lambda p: (p.iteration_time_s, p.num_microbatches))
    total = plan.iteration_time_s
    plan.solver["search"] = restrictions(options, batch, len(tagged_layers(graph)), len(layering.groups),
                                         family=cluster.submesh_family(options.submesh_family))
    if floor < total:  # a zero-bubble search stopped at its work limit: how much better a plan could be
        plan.solver.update(lower_bound_s=floor, bound_gap=(total - floor) / total)
    if stopped:  # the counts not finished could still win, down to their lower bounds
        bound = min([total, floor, *left.values()])
        plan.solver.update(stopped=stopped, lower_bound_s=bound, bound_gap=(total - bound) / total)
    return plan


@dataclass
class _Count:
    """One microbatch count part-way through its pricing (`_open_count`, then `_close_count`)."""

    count: int
    pipe: Pipeline
    hashes: list[str]  # per base layer: its structural hash (the pricing cache's key)
    names: list[tuple[str, ...]]  # per base layer: its ops
    modes: list[str]  # the recomputation modes that differ, least recomputing first
    costs: dict  # (submesh, shape, mode) -> rows of layer costs
    lean: tuple[dict, dict, dict]  # the modes priced, for `pricing.tighten` when memory binds: rows, costs, jobs
    work: list[float] | None  # per base layer: its roofline work (`bounds.roofline_work`)
    keys: list[tuple]  # the meshes (submesh, logical shape) where a stage may win, the others skipped unpriced
    limit: float = math.inf  # what a plan with a stage on a mesh left out costs at least (`_may_open`; inf: none)
    free: tuple | None = None  # the plan of the modes priced with memory ignored (of `_best_schedule`); None: none yet
    deferred: bool = False  # `free` is the plan of the schedules but ZB-H1, its floor ZB-H1's bound (`_open_count`)
    found: tuple | None = None  # the count's best plan, once known to be it


def _open_count(space: _Space, pricer: Pricer, count: int, g_mb: Graph, base_ops: list[list[Op]],
                work: list[float] | None, best: tuple | None, fastest: dict[int, dict], stats: Stats,
                running: Callable[[int], Callable[[int], None]], keys: list[tuple] | None = None,
                limit: float = math.inf) -> _Count | None:
    """Price `count` (`g_mb`: its microbatch view; `base_ops`: its base layers' ops; `work`: their roofline
    work) as far as its fastest options go: the least recomputing mode's layer optima on every mesh where a
    stage may still belong to a plan faster than `best` (the best plan so far, of `_search`: `_may_open` at it, or
    `keys` when the caller has judged them so under `limit`), and the stage DP's plan of them with memory ignored
    (`_memory_free`), looked for only under `best`: with none there (`free` None) no plan of the count beats
    `best` on these meshes, as it bounds every option of them (`_lower`). When that plan fits, it is the best on
    them (`found`); the count's best when it costs no more than `limit`. None when no mesh may win."""
    if keys is None:
        keys = ([key for key in space.meshes if key not in _outpriced(space, count)] if best is None else
                _may_open(space, count, g_mb, base_ops, work, fastest, best[0]))
        limit = math.inf if best is None else best[0]
    if not keys:
        return None
    pipe = space.pipe(count)
    state = _Count(count, pipe, bounds.per_layer(base_ops, space.alike, g_mb.structural_hash),
                   [tuple(op.name for op in ops) for ops in base_ops],
                   _distinct_modes(g_mb, base_ops, space.options.recompute_modes), {}, ({}, {}, {}), work, keys,
                   limit)
    _price_mode(space, pricer, state, keys, state.modes[0], stats, running)
    _set_free(space, state, best, stats)
    return state


def _set_free(space: _Space, state: _Count, best: tuple | None, stats: Stats) -> None:
    """Set `state`'s memory-free plan (`_memory_free`) and, when that plan fits, its best plan (`found`)."""
    state.free, state.deferred = _memory_free(space, state, best, stats)
    if not state.deferred and _fitting(space, state, state.free):
        state.found = state.free  # memory does not bind: the plan that ignores it fits


def _zero_bubble_may_win(space: _Space, state: _Count, best: tuple, stats: Stats) -> bool:
    """Whether a ZB-H1 plan of `state`'s rows, memory ignored, may beat `best`, by ZB-H1's bounds and its seed alone
    (`_best_schedule`'s `bounds_only`): asked of a count whose other schedules' memory-free plan does not beat it.
    A full search here would only say so more often at the price of its work limit, and the count it leaves open
    is closed as deferred (`_unbound`)."""
    return space.run_dps(state.pipe, state.costs, state.count, math.inf, ("1f1b", "zero-bubble"), stats,
                         cutoff=_wanted(best), proven=False, bounds_only=True) is not None


def _fitting(space: _Space, state: _Count, found) -> bool:
    """Whether the stage DP's plan `found` (of `_best_schedule`, on `state`'s rows) fits with memory counted."""
    return found is not None and bool(found[0].stages) and fits(state.pipe, state.costs, space.submeshes, found[3],
                                                                found[0].stages, state.count, space.budget,
                                                                *found[1:3])


def _memory_free(space: _Space, state: _Count, best: tuple | None, stats: Stats) -> tuple[tuple | None, bool]:
    """The stage DP's plan of `state`'s rows with memory ignored, under `best` (`_wanted`), and whether its ZB-H1
    search is deferred. With no plan known yet it is, when the other schedules' plan does not fit: until a plan that
    fits comes near, the count needs only a bound, and a ZB-H1 plan is a 1F1B cut that saves at most
    `stagedp.zero_bubble_saving` of the 1F1B optimum, so that plan with its floor lowered by that share stands for
    the memory-free optimum (`_unbound` searches ZB-H1 when a plan that fits lands between them)."""
    schedules = space.options.schedules
    if best is None and {"1f1b", "zero-bubble"} <= set(schedules):
        others = space.best(state.pipe, state.costs, state.count, math.inf, stats,
                            [s for s in schedules if s != "zero-bubble"])
        if others is not None and not _fitting(space, state, others):
            share = stagedp.zero_bubble_saving(state.count, min(len(space.layering.groups), space.cluster.num_devices))
            return (replace(others[0], floor=others[0].total * (1 - share)), *others[1:]), True
    return space.best(state.pipe, state.costs, state.count, math.inf, stats, cutoff=_wanted(best)), False


def _price_mode(space: _Space, pricer: Pricer, state: _Count, keys: list[tuple], mode: str, stats: Stats,
                running: Callable[[int], Callable[[int], None]]) -> None:
    """Price every base layer of `state`'s count on the meshes `keys` under `mode`, uncapped (within the budget)."""
    mb = space.graph.dims[space.graph.batch_dim] // state.count
    layers = range(len(state.hashes))
    floors = _fill_binds(space, state.count)  # the rows `_relaxed_may_win` asks about carry their time floors
    jobs = {(state.hashes[b], (*key, mode)): Job(mb, state.count, state.names[b], space.meshes[key], mode, space.budget,
                                                 time_floor=floors)
            for key in keys for b in layers}
    priced = {key: None if isinstance(cost, Dropped) else cost  # counted in stats; no option here
              for key, cost in pricer.run(jobs, stats, running(len(jobs))).items()}
    rows_of = {(*key, mode): [[priced[(state.hashes[b], (*key, mode))] for b in layers]] for key in keys}
    state.costs.update(rows_of)
    for lean, new in zip(state.lean, (rows_of, priced, jobs)):
        lean.update(new)


def _close_count(space: _Space, pricer: Pricer, state: _Count, best: tuple | None, stats: Stats,
                 running: Callable[[int], Callable[[int], None]]):
    """The best plan of a count whose memory-free plan does not fit (`_open_count`), or None when none fits or
    it cannot beat `best`; with the recomputation modes tried (`running(jobs)`: a progress callback).

    The plan that fits with the fastest options first; the next mode only while memory binds and only on
    meshes where it may win (`_may_win`); when memory binds under every mode, memory-lean caps
    (`pricing.tighten`) of every mode on one ladder. Its DPs look only for plans under the best plan so far
    (`_best_schedule`'s cutoff), and those that decide whether memory binds no higher than the memory-free plan
    (`_unbound`)."""
    options, budget = space.options, space.budget
    count, pipe, costs, modes = state.count, state.pipe, state.costs, state.modes
    incumbent, work, wanted = best[0] if best else math.inf, state.work, _wanted(best)

    def bound() -> float:  # the best plan so far, or one of this count's on the rows priced yet when it is faster
        return space.upper(pipe, costs, count, budget, stats, incumbent)

    view = intra.with_batch(space.graph, space.graph.dims[space.graph.batch_dim] // count)
    ops = [[view.op_index[name] for name in names] for names in state.names]

    def relaxed_loses() -> bool:  # `_relaxed_may_win` on rows nothing undercuts finds no plan under the best
        return _fill_binds(space, count) and not _relaxed_may_win(space, count, pipe,
                                                                   _undercut_rows(space, state, view, ops), wanted)

    def reach(keys: list[tuple], limit: float) -> set[tuple]:  # `_reach`, the modes not priced on `keys` too
        roofline = {key: _floors([None] * len(ops), count, count, work, key[0][0] * key[0][1]) for key in keys}
        return _reach(space, view, ops, modes, count, work, limit, costs, roofline)

    if (found := _unbound(space, state, stats, wanted)) is not None:
        return found, modes[:1]  # memory does not bind: recomputing more only adds time
    keys = state.keys
    for m in range(1, len(modes)):
        limit = bound()
        keys = [key for key in keys if _may_win(_floors(costs[(*key, modes[m - 1])][0], count, count, work,
                                                        key[0][0] * key[0][1]),
                                                key, count, limit, work, space.cluster, options.overlap)]
        reaching = reach(keys, limit)  # the next mode only on meshes where a stage of it or a later one may be in a plan
        if best is not None and (limit == best[0] and not reaching or m == 1 and relaxed_loses()):
            return None, modes[:m]  # no plan of this count, memory counted, can beat the best: no more modes priced
        keys = [key for key in keys if any((*key, mode) in reaching for mode in modes[m:])]
        _price_mode(space, pricer, state, keys, modes[m], stats, running)
        if state.free is None:  # no plan ran on the modes before: what this one's fastest options could do
            state.free = space.best(pipe, costs, count, math.inf, stats)
        if state.free is not None and best is not None and (_lower(state.free), count) > best[:2]:
            return None, modes[:m + 1]  # even with memory ignored this count loses
        if (found := _unbound(space, state, stats, wanted)) is not None:
            return found, modes[:m + 1]  # memory does not bind: recomputing more only adds time

    in_reach = functools.lru_cache(maxsize=None)(lambda limit: reach([], limit))  # asked again when the bound moves
    if best is not None and (not in_reach(best[0]) or relaxed_loses()):
        return None, modes  # no plan of this count, memory counted, can beat the best: no capped ILPs for it

    # memory binds under every mode: one ladder for them all, each rung's ILPs of every mode priced together, only on
    # the options that may hold a stage of a plan under the ladder's bound
    tighten(*state.lean, state.hashes, budget, len(state.hashes), count, bound, pricer, stats, work,
            space.cluster.num_devices, options.overlap, in_reach)
    return space.best(pipe, costs, count, budget, stats, cutoff=wanted), modes


def _unbound(space: _Space, state: _Count, stats: Stats, wanted: float):
    """`state`'s best plan if memory does not bind, else None (`wanted`: see `_wanted`). Its DPs look only for a plan
    that fits as fast as the memory-free plan: a slower one is of no use here, and a search that can only find such
    (ZB-H1's above all, the longest of them) stops at once. With ZB-H1's memory-free search deferred
    (`_memory_free`), the memory-free optimum lies between `free`'s floor and its plan: a plan that fits within
    them is the count's best unless a memory-free plan is faster, searched then, under it."""
    pipe, costs, count, budget, free = state.pipe, state.costs, state.count, space.budget, state.free
    if free is None:
        return None
    plan = (replace(free[0], floor=None), *free[1:]) if state.deferred else free  # the bound's top when deferred
    found = space.best(pipe, costs, count, budget, stats, cutoff=min(wanted, _unbound_cutoff(plan)))
    if _binds(found, plan):
        return None
    if not state.deferred:
        return found
    faster = space.best(pipe, costs, count, math.inf, stats, cutoff=found[0].total)
    return found if faster is None or not _binds(found, faster) else None


def _wanted(best: tuple | None) -> float:
    """The iteration time a count's plan must get under to matter (`best`: the best plan so far, of `_search`):
    a hair above the best, as `_search` keeps a tie at fewer microbatches."""
    return best[0] + 2e-15 if best is not None else math.inf


def _meshes_may_win(space: _Space, count: int, base_ops: list[list[Op]], work: list[float] | None,
                    fastest: dict[int, dict], limit: float) -> dict[tuple, list[float]]:
    """The meshes where a stage of `count` may belong to a plan under `limit` before any of its ILPs (`_may_win`),
    each with its layers' floors under the least recomputing mode (`_divisor_floors`, from the rows of the counts
    opened that divide it: `fastest`, of `_search`)."""
    divisors = {c: rows for c, rows in fastest.items() if count % c == 0}
    outpriced = _outpriced(space, count)
    floors = {key: _divisor_floors(key, count, len(base_ops), work, divisors) for key in space.meshes
              if key not in outpriced}
    return {key: f for key, f in floors.items()
            if limit == math.inf or _may_win(f, key, count, limit, work, space.cluster, space.options.overlap)}


def _outpriced(space: _Space, count: int) -> frozenset[tuple]:
    """The meshes no stage of a `count`-microbatch plan needs: each is another mesh of the space with its axes
    swapped that outprices it (`LogicalMesh.outprices`: every layer's sharding as cheap or cheaper there, with the
    same memory) and sends no slower at this count (the received slices' all-gather over the second axis, at every
    DP boundary's microbatch bytes; the point-to-point part is alike). Moving a stage there slows no layer and no
    send, so the search over the others finds the plan of the search over all, but for a shared parameter's
    correction, which follows the sharding each mesh's ILP returns (docs/COSTMODEL.md §2, "Mirrored and
    outpriced logical meshes").
    Of two that outprice each other, the first in the space's order stays."""
    if count not in space.outpriced:
        pipe = space.pipe(count)
        edges = range(len(pipe.boundary) - 1)

        def beats(key: tuple, other: tuple) -> bool:  # `key`'s mesh outprices `other`'s, its sends no slower
            mine, theirs = End(*key), End(*other)
            return space.meshes[key].outprices(space.meshes[other]) and all(
                pipe.out_s(e, mine) <= pipe.out_s(e, theirs) and pipe.in_s(e + 1, mine) <= pipe.in_s(e + 1, theirs)
                for e in edges)

        order = {key: k for k, key in enumerate(space.meshes)}
        mirror = {key: (key[0], key[1][::-1]) for key in order}  # the only mesh that can outprice a mesh
        space.outpriced[count] = frozenset(
            key for key, other in mirror.items() if other != key and other in order and beats(other, key)
            and not (beats(key, other) and order[key] < order[other]))
    return space.outpriced[count]


def _may_open(space: _Space, count: int, g_mb: Graph, base_ops: list[list[Op]], work: list[float] | None,
              fastest: dict[int, dict], limit: float) -> list[tuple]:
    """The meshes where a stage of `count`, under some mode, may belong to a plan costing at most `limit`, judged
    before any of its ILPs by its layers' floors (`_meshes_may_win`) and with the other stages and memory counted
    (`_reach`); none proves that no plan of the count can, and the count need not be opened under `limit`."""
    floors = _meshes_may_win(space, count, base_ops, work, fastest, limit)
    modes = _distinct_modes(g_mb, base_ops, space.options.recompute_modes)
    reaching = _reach(space, g_mb, base_ops, modes, count, work, limit, {}, floors)
    return [key for key in floors if any((*key, mode) in reaching for mode in modes)]


def _reach(space: _Space, g_mb: Graph, ops: list[list[Op]], modes: list[str], count: int,
           work: list[float] | None, limit: float, priced: dict, open_meshes: dict[tuple, list[float]]
           ) -> set[tuple]:
    """The options (submesh, shape, mode) that may hold a stage of a plan of `count` (`g_mb`: its microbatch view;
    `ops`: its base layers' ops) costing at most `limit` once memory is counted (`bounds.options_in_reach`); one
    left out proves that no row not priced yet helps it: not the memory-lean ones, not those of the `modes` still
    to price. None at all: the count has no plan under `limit`.

    A layer costs (count · time + sync) at least its uncapped optimum on each option priced (`priced`: (submesh,
    shape, mode) -> rows). On the meshes still open to pricing (`open_meshes`: each with its layers' floors under
    the least recomputing mode), a mode not priced costs it at least that floor, the floor of each mode priced there
    before it (`_floors`: recomputing more never makes a layer faster), and its roofline work with the mode's
    rerun forward."""
    options, device = space.options, space.cluster.device
    prints = bounds.footprints(g_mb, ops, modes, device, space.alike)
    kept = {mode: [per_mode[m].kept_bytes for per_mode in prints] for m, mode in enumerate(modes)}
    objectives = {option: pricing.objectives(rows[0], count) for option, rows in priced.items()}
    for key, floor in open_meshes.items():
        devices = key[0][0] * key[0][1]
        for m, mode in enumerate(modes):
            if (*key, mode) in priced:
                floor = [max(a, b) for a, b in zip(floor, _floors(priced[(*key, mode)][0], count, count, work, devices))]
            elif work is not None:
                objectives[(*key, mode)] = [max(f, count * (w + per_mode[m].rerun_s) / devices)
                                            for f, w, per_mode in zip(floor, work, prints)]
            else:  # no roofline under this cost model: the floors alone
                objectives[(*key, mode)] = floor
    L, devices = len(space.layering.groups), space.cluster.num_devices
    interleaved = [[([g for a, b in chunks(L, S, v)[i::S] for g in range(a, b + 1)],
                     inflight(i, S, count, "interleaved", v)) for i in range(S)]
                   for S, v in interleaved_shapes(L, count, devices)] if "interleaved" in options.schedules else []
    return bounds.options_in_reach(limit, objectives, bounds.resident_bytes(g_mb, ops, space.alike), kept,
                                   space.layering.groups, space.submeshes, devices, space.budget, count,
                                   options.overlap, contiguous=bool({"1f1b", "zero-bubble"} & set(options.schedules)),
                                   interleaved=interleaved, shared=bounds.shared_state(g_mb, ops))


def _fill_binds(space: _Space, count: int) -> bool:
    """Whether a plan of `count` microbatches may have more stages than microbatches (as many as the DP's layers), so
    that its pipeline fill may outweigh its steady state: the counts `_relaxed_may_win` is asked about (before an open
    once a plan is known, and in a close), whose rows carry the time floors it needs (one more elimination per ILP,
    which no larger count pays for)."""
    return count <= len(space.layering.groups)


def _relaxed_may_win(space: _Space, count: int, pipe: Pipeline, rows: dict, limit: float) -> bool:
    """Whether a plan of `count` microbatches may cost under `limit` with memory counted, whatever rows are still to
    be priced for it: the stage DPs of the searched schedules run on `rows`, one per option (submesh, shape, mode)
    that no row of the option undercuts (`_undercut_rows` in a close, `_roofline_rows` before an open), with no
    shared-parameter correction (those only add sync once the shared state is left out, as `resident_bytes` does).
    1F1B's and the interleaved DPs are exact on those rows and their closed forms never fall as a stage's latency
    or sync rises, so no plan costs less than they find; ZB-H1 is asked for its bounds alone
    (`stagedp.zero_bubble_may_beat`), which never fall either (docs/COSTMODEL.md §5b)."""
    options = space.options
    pipe = replace(pipe, shared={})
    sizes, devices = [a * b for a, b in space.submeshes], space.cluster.num_devices

    def under(found) -> bool:
        return found is not None and found.total < limit

    if {"1f1b", "zero-bubble"} & set(options.schedules):
        entries, options_of = stage_table(pipe, rows, space.submeshes, count, space.budget)
        if "1f1b" in options.schedules and under(stagedp.solve(entries, None, sizes, devices, count, cutoff=limit)):
            return True
        if "zero-bubble" in options.schedules and stagedp.zero_bubble_may_beat(
                entries, split_table(pipe, entries, options_of), sizes, devices, count, limit):
            return True
    if "interleaved" in options.schedules:
        for S, v in interleaved_shapes(len(space.layering.groups), count, devices):
            if under(_interleaved(pipe, rows, space.submeshes, sizes, devices, count, space.budget, S, v, limit)[0]):
                return True
    return False


def _undercut_rows(space: _Space, state: _Count, g_mb: Graph, ops: list[list[Op]]) -> dict:
    """Per option of `state`'s count (`g_mb`: its microbatch view; `ops`: its base layers' ops), one row of layer
    costs that none of its rows undercuts, priced or not (`_undercut_row`), for `_relaxed_may_win`."""
    resident = bounds.resident_bytes(g_mb, ops, space.alike)
    prints = bounds.footprints(g_mb, ops, state.modes, space.cluster.device, space.alike)
    return {(*key, mode): [_undercut_row(state, key, m, resident, prints)]
            for key in state.keys for m, mode in enumerate(state.modes)}


def _roofline_rows(space: _Space, count: int, g_mb: Graph, ops: list[list[Op]], work: list[float]) -> dict:
    """Per option of a count not opened yet (`g_mb`: its microbatch view; `ops`: its base layers' ops; `work`: their
    roofline work), one row of layer costs no strategy undercuts (`bounds.floor_cost`), for `_relaxed_may_win`: each
    layer at its roofline with its mode's rerun forward, its state and kept activations over the option's devices."""
    modes = _distinct_modes(g_mb, ops, space.options.recompute_modes)
    resident = bounds.resident_bytes(g_mb, ops, space.alike)
    prints = bounds.footprints(g_mb, ops, modes, space.cluster.device, space.alike)
    rows, outpriced = {}, _outpriced(space, count)
    for sub, shape in (key for key in space.meshes if key not in outpriced):
        n = sub[0] * sub[1]
        for m, mode in enumerate(modes):
            rows[(sub, shape, mode)] = [[bounds.floor_cost((w + p[m].rerun_s) / n, r / n, p[m].kept_bytes / n)
                                         for w, r, p in zip(work, resident, prints)]]
    return rows


def _undercut_row(state: _Count, key: tuple, m: int, resident: list[float], prints: list) -> list:
    """`bounds.undercut` of each base layer of `state`'s count on mesh `key` under its `m`-th mode (`resident`,
    `prints`: `bounds.resident_bytes`, `bounds.footprints` of its modes): from the option's first row, bounded below by
    its ILP within the budget (`_within_budget`); or, for a mode not priced yet, from the least recomputing mode's
    row, slowed by at least the forward it also reruns. Rooflines count under the analytical model only, as in `_reach`."""
    count, n, mode = state.count, key[0][0] * key[0][1], state.modes[m]
    if state.work is None:  # a measured cost model: no roofline, no rerun bound
        roofline, rerun = [0.0] * len(prints), [0.0] * len(prints)
    else:
        roofline = [(w + p[m].rerun_s) / n for w, p in zip(state.work, prints)]
        rerun = [max(0.0, (p[m].rerun_s - p[0].rerun_s) / n) for p in prints]
    if (*key, mode) in state.costs:
        row, added = state.costs[(*key, mode)][0], [0.0] * len(prints)
        least = [f if c is None else max(f, _within_budget(c, count))
                 for c, f in zip(row, _floors(row, count, count, state.work, n))]
    else:
        row, added = state.costs[(*key, state.modes[0])][0], rerun
        least = [f + count * a for f, a in zip(_floors(row, count, count, state.work, n), added)]
    return [None if c is None else bounds.undercut(c, f, count, w, r / n, p[m].kept_bytes / n, a)
            for c, f, w, r, p, a in zip(row, least, roofline, resident, prints, added)]


def _within_budget(cost: pricing.LayerCost, count: int) -> float:
    """A lower bound on the count · time + sync of any strategy of the layer of `cost` (a row's first, priced within
    the device budget at one microbatch in flight) that fits a stage: such a strategy fits that budget too (a stage
    holds its layers' parameters, kept activations and largest working set, each at least the layer's own, and the
    memory-lean rows' caps imply the budget: `pricing.tighten`), so its ILP's proven bound holds (0 when it has none)."""
    bound = cost.sharding.solution.lower_bound
    return count * bound if bound is not None else 0.0


def _stages_of(found, costs: dict, count: int, space: _Space) -> tuple[list[StageSpec], list, str, int]:
    """The stage specs of the DP's plan `found` (of `_best_schedule`), their rows of layer costs, its schedule and v."""
    result, schedule, v, options_of = found
    submeshes = space.submeshes
    chosen = [options_of[c.submesh][c.option] for c in result.stages]
    if schedule == "interleaved":  # stage i runs chunks i, i + S, …: the plan lists the chunks
        S = len(result.stages)
        specs = [StageSpec(first, last, submeshes[result.stages[j % S].submesh], chosen[j % S][0],
                           inflight(j % S, S, count, schedule, v), chosen[j % S][1])
                 for j, (first, last) in enumerate(chunks(len(space.layering.groups), S, v))]
        picked = [chosen[j % S][2] for j in range(len(specs))]
    else:
        specs = [StageSpec(c.first, c.last, submeshes[c.submesh], shape, min(c.inflight, count), mode)
                 for c, (shape, mode, _) in zip(result.stages, chosen)]
        picked = [r for _, _, r in chosen]
    rows = [costs[(spec.submesh, spec.shape, spec.recompute)][r] for spec, r in zip(specs, picked)]
    return specs, rows, schedule, v


def _best_schedule(pipe: Pipeline, costs: dict, submeshes: list[tuple[int, int]], sizes: list[int], devices: int,
                   count: int, budget: float, schedules: Sequence[str], stats: Stats, incumbent: tuple | None = None,
                   cutoff: float = math.inf, proven: bool = True, bounds_only: bool = False):
    """The stage DP's best plan over `schedules` for one microbatch count: (result, schedule, v, options per
    submesh), or None. 1F1B cuts the layers freely; interleaved takes the best (S, v) of Megatron's uniform
    chunking (`schedules.interleaved_shapes`, `stages.interleaved_table`); zero-bubble (ZB-H1) cuts freely on
    1F1B's table (`stagedp.zero_bubble`, from 1F1B's stage count outwards, seeded with 1F1B's plan run as ZB-H1,
    stopped at its work limit); ties keep 1F1B, then interleaved. The result's `floor` is set when a stopped
    search leaves room below its total.
    `incumbent`: a plan of this table found before (one of these results on a table with fewer rows); each DP
    then looks only for a faster plan, and the incumbent stays when none is (ties keep it). `cutoff`: each DP
    looks only for a plan costing less; with none found and no incumbent, None, or, when a stopped search
    leaves a floor under the cutoff, a result of no stages and infinite cost carrying that floor (so that the
    search's reported lower bound still counts it). `proven=False`: 1F1B's and the interleaved DPs return their
    first plan, not proven the least (`stagedp.solve`). `bounds_only`: ZB-H1's search runs no DP past its bounds (a
    work limit of 0): its seed when that beats the bar, else None when the bounds rule every plan out, else its
    floor."""
    found = []
    own = incumbent[0].total if incumbent is not None else math.inf
    bar = min(cutoff, own)  # what a plan found here must beat
    # ZB-H1's search is seeded and ordered by the plans of 1F1B and the interleaved shapes, and stops at a work
    # limit: with it searched, those DPs look under the incumbent alone, so that its start does not depend on `cutoff`,
    # or under `rules_out` when that is lower: a 1F1B optimum there leaves no ZB-H1 plan under the bar
    # (`stagedp.zero_bubble_saving`), and the search does not run
    rules_out = bar / (1 - stagedp.zero_bubble_saving(count, min(len(pipe.layering.groups), devices)))
    lead = min(own, rules_out) if "zero-bubble" in schedules else bar
    table = stage_table(pipe, costs, submeshes, count, budget) if {"1f1b", "zero-bubble"} & set(schedules) else None
    if "1f1b" in schedules:
        entries, options_of = table
        found.append((stagedp.solve(entries, None, sizes, devices, count, cutoff=lead, proven=proven), "1f1b", 1,
                      options_of))
    if "interleaved" in schedules:  # each shape only where it beats the plans before it (ties keep those)
        for S, v in interleaved_shapes(len(pipe.layering.groups), count, devices):
            beat = min([lead, *(f[0].total for f in found if f[0] is not None)])
            result, options_of = _interleaved(pipe, costs, submeshes, sizes, devices, count, budget, S, v, beat, proven)
            found.append((result, "interleaved", v, options_of))
    if "zero-bubble" in schedules:  # only a plan faster than the others found counts (ties keep them)
        entries, options_of = table
        done = [f[0] for f in found if f[0] is not None]
        beat = min([bar, *(r.total for r in done)])
        hint = len(min(done, key=lambda r: r.total).stages) if done else None
        # 1F1B's plan, run as ZB-H1, seeds the search (forced, 1F1B's DP runs for it alone)
        seed_bar = lead if "1f1b" in schedules else rules_out
        onef1b = found[0][0] if "1f1b" in schedules else stagedp.solve(entries, None, sizes, devices, count,
                                                                      cutoff=seed_bar)
        if "1f1b" not in schedules and onef1b is not None:
            stats.dp_rounds += onef1b.rounds
        # the 1F1B optimum is at least this (exact under the DP's cutoff); no 1F1B plan at all: no ZB-H1 plan either
        least = min(onef1b.total, seed_bar) if onef1b is not None else seed_bar
        if least < rules_out:
            limit = 0 if bounds_only else stagedp.zero_bubble_limit(entries.latency, devices)  # 0: its bounds alone
            found.append((stagedp.zero_bubble(entries, split_table(pipe, entries, options_of), sizes, devices, count,
                                              beat, limit, hint, onef1b.stages if onef1b is not None else None),
                          "zero-bubble", 1, options_of))
    found = [f for f in found if f[0] is not None]
    stats.dp_rounds += sum(f[0].rounds for f in found)
    # what the DPs prove: a stopped search's floor, an exact DP's total, or, past the bar, that it was not beaten
    stopped = any(f[0].floor is not None for f in found)
    floor = min([min(f[0].total, bar) if f[0].floor is None else f[0].floor for f in found], default=math.inf)
    # a zero-bubble search stopped with no plan leaves only its floor; a plan not under the incumbent is not exact
    found = [f for f in found if f[0].stages and f[0].total < bar] or ([incumbent] if incumbent is not None else [])
    if not found:  # no plan under the bar; a search stopped short of proving that leaves its floor
        if stopped and floor < bar < math.inf:
            return stagedp.DPResult(math.inf, [], math.inf, 0, floor), "zero-bubble", 1, {}
        return None
    best = min(found, key=lambda f: f[0].total)
    return (replace(best[0], floor=floor if stopped and floor < best[0].total else None), *best[1:])


def _interleaved(pipe: Pipeline, costs: dict, submeshes: list[tuple[int, int]], sizes: list[int], devices: int,
                 count: int, budget: float, S: int, v: int, cutoff: float, proven: bool = True):
    """The interleaved stage DP of shape (S, v) on `costs` (`stages.interleaved_table`): `stagedp.solve` on its
    table's t / v with v · count microbatches and its fill rebated, under `cutoff`; and its options per submesh."""
    t, extra, fill, options_of = interleaved_table(pipe, costs, submeshes, count, budget, S, v)
    return stagedp.solve(t / v, extra, sizes, devices, v * count, rebate=-fill, cutoff=cutoff, proven=proven), options_of


def _floors(row: list, priced: int, count: int, work: list[float] | None, devices: int) -> list[float]:
    """Lower bounds on each layer's count · time + sync on a mesh of `devices`, at `count` microbatches under any
    mode that recomputes at least as much as the one of `row` (its layers' costs there, priced at `priced`
    microbatches: `count` itself or a divisor of it; `work`: the layers' roofline work at `count`).

    Recomputing more never makes a strategy faster, and memory only removes strategies, so a layer costs at
    least the optimum it had with memory ignored (`ilp.Solution.free_bound`, per microbatch). With k times
    the microbatches, each strategy's per-microbatch time is at least 1/k of what it was: its FLOPs, bytes and
    collective volumes split k ways, a smaller GEMM runs no more efficiently (`costmodel.matmul_efficiency`
    rises with FLOPs) and latencies stay; its per-iteration work is the same, and every strategy of the
    smaller microbatch is one of the larger's. So count · time + sync does not fall. No layer costs less than
    its roofline work either, the only bound of a layer that fitted no option of the mesh."""
    floors = []
    for b, cost in enumerate(row):
        free = cost.sharding.solution.free_bound if cost is not None else None
        floor = count * work[b] / devices if work is not None else 0.0
        floors.append(max(floor, priced * free) if free is not None else floor)
    return floors


def _divisor_floors(key: tuple, count: int, layers: int, work: list[float] | None,
                    divisors: dict[int, dict]) -> list[float]:
    """Per layer, the best lower bound on its count · time + sync on mesh `key` at `count` microbatches that its
    roofline work and the counts `divisors` (each dividing `count`: per mesh priced, its layers' fastest costs)
    give (`_floors`)."""
    devices = key[0][0] * key[0][1]
    rows = [_floors([None] * layers, count, count, work, devices)]
    rows += [_floors(priced[key], c, count, work, devices) for c, priced in divisors.items() if key in priced]
    return [max(column) for column in zip(*rows)]


def _may_win(floors: list[float], key: tuple, count: int, limit: float, work: list[float] | None,
             cluster: Cluster, overlap: bool) -> bool:
    """Whether a stage on mesh `key` = (submesh, shape) whose layers cost at least `floors` (`_floors`) could
    belong to a plan under `limit` (`pricing.longest_stage`)."""
    devices = key[0][0] * key[0][1]
    return pricing.longest_stage(floors, count, limit, work, cluster.num_devices - devices, overlap) > 0


def _binds(found, free) -> bool:
    """Whether memory costs time: nothing fits, or the best plan that fits (`found`, of `_best_schedule`)
    is slower than the plan of the fastest options with memory ignored (`free`; None: some layer fits no
    mesh uncapped).

    Leaner options (memory caps, recomputation) cost a layer at least as much B · t + sync as its
    unconstrained optimum, so when the fastest options' memory-free plan fits they are not priced
    (docs/COSTMODEL.md: the one trade this leaves out)."""
    return free is None or found is None or found[0].total > _lower(free) * (1 + 1e-12)


def _unbound_cutoff(free) -> float:
    """The least cutoff under which `_best_schedule` still finds every plan with which memory does not bind
    (`_binds`): the first float past the memory-free plan's bound, within its tolerance."""
    return math.nextafter(_lower(free) * (1 + 1e-12), math.inf)


def _lower(found) -> float:
    """A lower bound on the plans `found` (of `_best_schedule`) stands for: its total, or a stopped search's floor."""
    return found[0].total if found[0].floor is None else found[0].floor


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


def _state_bytes(graph: Graph) -> float:
    """Parameter state of the whole model: weights, gradients, optimizer (`costmodel.param_memory`)."""
    return sum(bounds.state_bytes(graph, t.name) for t in graph.params)


def _no_plan(graph: Graph, cluster: Cluster, budget: float) -> InfeasibleError:
    """Why no plan fits, with what helps: the parameter state needs more memory (more nodes, less kept in
    reserve); activations need more room or smaller microbatches."""
    state = _state_bytes(graph)
    total = budget * cluster.num_devices
    short = state > total
    return InfeasibleError(
        f"no plan fits: the model's parameter state alone is {fmt_bytes(state)} against "
        f"{fmt_bytes(total)} usable on {cluster.num_devices} devices "
        f"({'short by ' + fmt_bytes(state - total) if short else 'activations do not fit'})",
        f"{graph.name} on {cluster.name}",
        "use more nodes (--nodes) or keep less device memory in reserve (--memory-reserve)" if short
        else "use more nodes (--nodes), a smaller batch, or more microbatches")
