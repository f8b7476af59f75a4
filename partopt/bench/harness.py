"""Runs the Alpa benchmark cases (`alpa.cases`) with each planner, checks the paper's ordering
claims on the results, and runs the inter-op ablation (paper §8.5). Results are dataclasses;
`partopt reproduce` and scripts/reproduce_alpa.py print them. Nothing here prints.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from partopt.bench.alpa import (ABLATION_METHODS, ABLATION_REPORTED, ERROR_BAND, MODELS, PLANNER_TITLES,
                                Case, Efficiency, cases, cluster_for, format_meshes, load, model_options, plan_with,
                                tflops_per_gpu)
from partopt.baselines import megatron_grid_point
from partopt.cluster import Cluster
from partopt.errors import InfeasibleError
from partopt.evaluate import price
from partopt.graph import Graph
from partopt.inter import Options, optimize
from partopt.stages import StageSpec
from partopt.layering import Layering, build_layers
from partopt.plan import Plan


# ---------------------------------------------------------------- running the cases

@dataclass
class Cell:
    """One planner's outcome on one case: TFLOP/s (None: out of memory), its plan and wall time."""

    planner: str
    tflops: float | None
    plan: Plan | None
    seconds: float
    detail: str = ""  # the Megatron grid point, or why nothing fits


@dataclass
class CaseResult:
    case: Case
    cells: dict[str, Cell]
    cache: dict = dataclasses.field(default_factory=dict, repr=False)  # layer ILP solutions, for the ablation

    @property
    def error(self) -> float | None:
        """partopt's relative error against Alpa's reported figure (None when either is missing)."""
        ours, theirs = self.cells["partopt"].tflops, self.case.reported.get("partopt")
        return None if ours is None or not theirs else ours / theirs - 1


Progress = Callable[[Case, str], None]


def run_case(case: Case, planners: Sequence[str] | None = None, microbatches: int | str | None = None,
             graph: Graph | None = None, efficiency: Efficiency | None = None, cache: dict | None = None) -> CaseResult:
    """Plan one case with each planner (default: the case's four) and price each plan's TFLOP/s;
    `microbatches` None searches the counts of Alpa's suite (`Case.microbatches`). The planners
    share one cache of layer ILP solutions (a restricted search re-solves nothing the full one solved)."""
    graph = graph or load(case.instance)
    cluster = cluster_for(case.gpus, efficiency)
    counts = case.microbatches(graph.dims[graph.batch_dim]) if microbatches is None else microbatches
    cache = {} if cache is None else cache
    cells = {}
    for planner in planners or case.planners:
        start = time.perf_counter()
        try:
            plan = plan_with(planner, graph, cluster, counts, case.model, cache)
        except InfeasibleError as err:
            cells[planner] = Cell(planner, None, None, time.perf_counter() - start, err.line())
            continue
        detail = megatron_grid_point(plan) if planner == "megatron" else ""
        cells[planner] = Cell(planner, tflops_per_gpu(case.model, graph, plan), plan, time.perf_counter() - start, detail)
    return CaseResult(case, cells, cache)


def run(selected: Sequence[Case], progress: Progress | None = None, microbatches: int | str | None = None,
        efficiency: Efficiency | None = None) -> list[CaseResult]:
    """Run every case with its planners; `progress(case, planner)` is called before each plan."""
    results = []
    for case in selected:
        graph = load(case.instance)
        cells: dict[str, Cell] = {}
        cache: dict = {}
        for planner in case.planners:
            if progress:
                progress(case, planner)
            cells.update(run_case(case, [planner], microbatches, graph, efficiency, cache).cells)
        results.append(CaseResult(case, cells, cache))
    return results


def median_error(results: Sequence[CaseResult]) -> float | None:
    """Median of |partopt / Alpa - 1| over the cases that have both figures."""
    errors = [abs(r.error) for r in results if r.error is not None]
    return statistics.median(errors) if errors else None


# ---------------------------------------------------------------- the claims of issue 7

@dataclass(frozen=True)
class Check:
    """One claim of the paper's ordering, evaluated on the results."""

    name: str
    passed: bool
    detail: str


def fmt_tflops(x: float | None) -> str:
    """A predicted figure: 'no plan' when the planner found none that fits (its reason is in Cell.detail)."""
    return "no plan" if x is None else f"{x:.2f}"


def checks(results: Sequence[CaseResult]) -> list[Check]:
    """The ordering claims (issue 7) on the cases present: each becomes a PASS/FAIL line, none is adjusted."""
    found: list[Check] = []
    by_key = {(r.case.model, r.case.gpus): r for r in results}
    worse = []
    for r in results:
        ours = r.cells["partopt"].tflops
        for planner, cell in r.cells.items():
            if planner == "partopt" or cell.tflops is None:
                continue
            if ours is None or cell.tflops > ours * (1 + 1e-9):
                worse.append(f"{r.case.model} {r.case.gpus}: {planner} {fmt_tflops(cell.tflops)} > partopt {fmt_tflops(ours)}")
    if results:
        found.append(Check("partopt ≥ every baseline on every case", not worse,
                           "; ".join(worse) or f"{len(results)} cases"))

    def ratio_check(key, planner, limit, name):
        r = by_key.get(key)
        if r is None:
            return
        ours, theirs = r.cells["partopt"].tflops, r.cells[planner].tflops
        ok = ours is not None and (theirs is None or theirs < limit * ours)
        found.append(Check(name, ok, f"{PLANNER_TITLES[planner]} {fmt_tflops(theirs)} vs partopt {fmt_tflops(ours)}"))

    ratio_check(("gpt", 64), "intra_only", 0.25, "GPT 64 GPUs: intra-op only < 1/4 of partopt")
    for gpus in (16, 32):
        ratio_check(("moe", gpus), "deepspeed", 0.5, f"MoE {gpus} GPUs: DeepSpeed far behind (< 1/2 of partopt)")
    r = by_key.get(("wresnet", 32))
    if r is not None:
        cell = r.cells["ppdp"]
        found.append(Check("Wide-ResNet 32 GPUs: PP-DP out of memory", cell.tflops is None,
                           "out of memory" if cell.tflops is None else f"PP-DP fits at {cell.tflops:.2f} TFLOP/s"))
    for model in MODELS:
        rows = [r for r in results if r.case.model == model and r.error is not None]
        if rows:
            band = ERROR_BAND[model]
            outside = [f"{r.case.gpus} GPUs {r.error:+.0%}" for r in rows if abs(r.error) > band]
            found.append(Check(f"{model}: partopt within ±{band:.0%} of Alpa on every row", not outside,
                               "; ".join(outside) or f"{len(rows)} rows"))
    return found


# ---------------------------------------------------------------- the inter-op ablation (paper §8.5)

@dataclass(frozen=True)
class _OneSubmesh(Cluster):
    """A cluster whose stage DP may use only submeshes of one shape (the 'equal mesh' ablation)."""

    only: tuple[int, int] = (1, 1)

    def submesh_shapes(self, family: str = "auto") -> list[tuple[int, int]]:
        return [self.only]


@dataclass
class AblationResult:
    """Per method: per-GPU TFLOP/s (None: nothing fits) and the best even split's description."""

    model: str
    gpus: int
    instance: str
    tflops: dict[str, float | None]
    detail: dict[str, str]
    reported: dict[str, float]
    seconds: float


def _even_submeshes(cluster: Cluster) -> list[tuple[int, tuple[int, int]]]:
    """(stages, submesh) pairs that split the cluster into equal submeshes of its submesh family."""
    return [(cluster.num_devices // (n * m), (n, m)) for n, m in cluster.submesh_shapes()
            if cluster.num_devices % (n * m) == 0]


def _even_cuts(count: int, parts: int) -> list[tuple[int, int]]:
    """[first, last] ranges cutting `count` items into `parts` runs whose lengths differ by at most one."""
    bounds = [round(i * count / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(parts)]


def _equal_operators(graph: Graph, stages: int) -> Layering:
    """`stages` stages of equally many ops (the graph's order cut evenly). Each stage is priced as
    the DP prices its own: one ILP per run of ops of one layer tag, so that a cut inside a layer
    makes two pieces and the whole layers between share their solves."""
    ops = list(graph.order)
    base: list[list] = []
    groups = []
    for first, last in _even_cuts(len(ops), stages):
        start = len(base)
        base += [list(run) for _, run in itertools.groupby(ops[first:last + 1], key=lambda op: op.layer)]
        groups.append((start, len(base) - 1))
    return Layering(base, groups)


def _best_even_split(graph: Graph, cluster: Cluster, layering: Layering, count: int, stages: int,
                     submesh: tuple[int, int], options: dict, cache: dict) -> tuple[Plan | None, str]:
    """The best plan of `stages` equal stages (layering's groups cut evenly) on equal submeshes,
    one logical shape for all stages, tried in turn; `cache` shares layer solutions across calls.
    Each split is priced with every layer at its fastest sharding, and where that overflows a
    device, with each stage's layers fitted to its memory together (`price(fit_memory=True)`, as
    Megatron's uniform plans are priced)."""
    best: Plan | None = None
    why = ""
    groups = _even_cuts(len(layering.groups), stages)
    settings = Options(layers=None, **options)
    mode = "none" if settings.recompute == "auto" else settings.recompute  # the case's own (Alpa's: full)
    for shape in cluster.logical_shapes(submesh):
        specs = [StageSpec(first, last, submesh, shape, min(stages - i, count), mode)
                 for i, (first, last) in enumerate(groups)]
        plan = None
        for fit_memory in (False, True):
            try:
                plan = price(graph, cluster, layering, count, specs, None, settings, fit_memory=fit_memory, cache=cache)
                break
            except InfeasibleError as err:
                why = err.line()
        if plan is None:
            continue
        if best is None or plan.iteration_time_s < best.iteration_time_s:
            best = plan
    return best, why


def ablation(model: str, gpus: int, dp_plan: Plan | None = None, efficiency: Efficiency | None = None,
             cache: dict | None = None) -> AblationResult:
    """The inter-op ablation of one case: partopt's stage DP against stages split evenly —
    the DP on equal submeshes, equal layers per stage, equal operators per stage (each on
    equal submeshes, the best stage count and logical shape kept), at the DP plan's microbatches;
    `cache`: the case's layer ILP solutions (`CaseResult.cache`), which the equal-mesh DP reuses."""
    start = time.perf_counter()
    case = next(c for c in cases([model]) if c.gpus == gpus)
    graph = load(case.instance)
    cluster = cluster_for(gpus, efficiency)
    dp_plan = dp_plan or plan_with("partopt", graph, cluster, case.microbatches(graph.dims[graph.batch_dim]), model, cache)
    count = dp_plan.num_microbatches
    tflops: dict[str, float | None] = {"dp": tflops_per_gpu(model, graph, dp_plan)}
    detail = {"dp": format_meshes([tuple(s.submesh) for s in dp_plan.stages])}
    tagged = build_layers(graph, None)
    solved: dict = {}  # layer solutions of the even splits, shared by every stage count and shape
    for method in ABLATION_METHODS[1:]:
        best: tuple[float, str] | None = None
        why = "no even split fits"
        for stages, submesh in _even_submeshes(cluster):
            if method == "equal_mesh":
                try:
                    plan = optimize(graph, _OneSubmesh(**vars(cluster), only=submesh), microbatches=count,
                                    cache=cache, **model_options(model))
                except InfeasibleError as err:
                    why = err.line()
                    continue
            else:
                if stages > len(tagged.groups):
                    continue
                layering = tagged if method == "equal_layer" or stages == 1 else _equal_operators(graph, stages)
                plan, why_not = _best_even_split(graph, cluster, layering, count, stages, submesh, model_options(model),
                                                 solved)
                if plan is None:
                    why = why_not or why
                    continue
            value = tflops_per_gpu(model, graph, plan)
            if best is None or value > best[0]:
                best = (value, f"{len(plan.stages)} × {format_meshes([tuple(s.submesh) for s in plan.stages][:1])}")
        tflops[method] = best[0] if best else None
        detail[method] = best[1] if best else why
    reported = dict(zip(ABLATION_METHODS, ABLATION_REPORTED[(model, gpus)]))
    return AblationResult(model, gpus, case.instance, tflops, detail, reported, time.perf_counter() - start)
