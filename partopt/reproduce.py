"""Reproduce the Alpa paper's weak-scaling benchmarks (GPT, MoE, Wide-ResNet on 1–64 V100s) as data.

Each case is one model at one GPU count with the figures the paper reports (REFERENCE.md §3);
each planner (partopt's full search, its restricted searches and the paper's baselines) plans
the case under the same cost model. The results, the ordering checks, the inter-op ablation
and the V100 efficiency calibration are returned as dataclasses; `scripts/reproduce_alpa.py`
prints and writes them. Nothing here prints.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from partopt import costmodel, intra
from partopt.cluster import Cluster, preset
from partopt.errors import InfeasibleError, InstanceError
from partopt.evaluate import price, uniform
from partopt.graph import Graph
from partopt.inter import Options, StageSpec, optimize
from partopt.io import read_graph
from partopt.layering import Layering, build_layers
from partopt.plan import Plan

INSTANCES = Path(__file__).resolve().parent.parent / "instances"
MACHINE = "p3.16xlarge"
MODELS: tuple[str, ...] = ("gpt", "moe", "wresnet")
GPU_COUNTS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
QUICK_MAX_GPUS = 8
OOM = None  # a reported or predicted figure that ran out of memory

# The baseline the paper compares against on each model (besides Alpa's own restricted searches).
BASELINE = {"gpt": "megatron", "moe": "deepspeed", "wresnet": "ppdp"}
PLANNER_TITLES = {"partopt": "partopt", "inter_only": "inter-op only", "intra_only": "intra-op only",
                  "megatron": "Megatron-LM", "deepspeed": "DeepSpeed", "ppdp": "PP-DP"}
ERROR_BAND = {"gpt": 0.25, "moe": 0.35, "wresnet": 0.35}  # issue 7: allowed |partopt / Alpa - 1|

# REFERENCE.md §3: instance, then per GPU count the reported per-GPU TFLOP/s of
# (baseline, inter-op only, intra-op only, Alpa); OOM = out of memory, "—" rows are absent (NaN).
_NA = float("nan")
_REPORTED: dict[str, dict[int, tuple[str, tuple]]] = {
    "gpt": {1: ("gpt-350m", (47.53, 44.23, 46.20, 45.07)), 2: ("gpt-760m", (55.53, 57.94, 59.54, 57.92)),
            4: ("gpt-1.3b", (55.89, 53.99, 58.36, 58.21)), 8: ("gpt-2.6b", (50.44, 56.57, 50.82, 61.61)),
            16: ("gpt-6.7b", (56.59, 59.68, 48.42, 60.0)), 32: ("gpt-15b", (58.24, 49.80, 35.07, 59.9)),
            64: ("gpt-39b", (57.84, 50.55, 2.11, 57.0))},
    "moe": {1: ("moe-380m", (34.24, 45.46, 45.46, 45.46)), 2: ("moe-690m", (33.11, 40.75, 42.17, 43.03)),
            4: ("moe-1.3b", (34.67, 37.52, 41.13, 39.92)), 8: ("moe-2.4b", (40.01, 39.80, 46.72, 45.76)),
            16: ("moe-10b", (12.91, 31.12, 22.91, 45.36)), 32: ("moe-27b", (3.82, OOM, 1.50, 38.84)),
            64: ("moe-70b", (_NA, OOM, 0.215, 36.55))},
    "wresnet": {1: ("wresnet-250m", (8.30, 8.30, 8.37, 8.30)), 2: ("wresnet-500m", (8.24, 8.46, 8.48, 8.46)),
                4: ("wresnet-1b", (8.08, 6.47, 8.15, 8.16)), 8: ("wresnet-2b", (7.72, 5.46, 7.71, 8.04)),
                16: ("wresnet-4b", (0.37, 0.37, 4.72, 6.76)), 32: ("wresnet-6.8b", (OOM, OOM, 1.96, 6.60)),
                64: ("wresnet-13b", (OOM, OOM, 0.70, 5.3))},
}


@dataclass(frozen=True)
class PlanSummary:
    """The shape of a pipeline plan: microbatches, stages, submesh and logical mesh per stage."""

    microbatches: int
    stages: int
    submeshes: tuple[tuple[int, int], ...]
    logical_meshes: tuple[tuple[int, int], ...]
    note: str = ""


def _same(shape: tuple[int, int], count: int) -> tuple[tuple[int, int], ...]:
    return (shape,) * count


# REFERENCE.md §3, "Plans Alpa found for GPT on p3.16xlarge".
ALPA_GPT_PLANS: dict[int, PlanSummary] = {
    1: PlanSummary(512, 1, _same((1, 1), 1), _same((1, 1), 1)),
    2: PlanSummary(128, 2, _same((1, 1), 2), _same((1, 1), 2)),
    4: PlanSummary(128, 2, _same((1, 2), 2), _same((2, 1), 2), "data parallel inside each stage"),
    8: PlanSummary(128, 3, ((1, 2), (1, 2), (1, 4)), ((2, 1), (2, 1), (4, 1))),
    16: PlanSummary(64, 2, _same((1, 8), 2), _same((2, 4), 2)),
    32: PlanSummary(128, 4, _same((1, 8), 4), _same((2, 4), 4)),
    64: PlanSummary(1024, 16, _same((1, 4), 16), _same((1, 4), 16)),
}


# The microbatch counts Alpa's benchmark suite searched in each case (alpa-projects/alpa,
# benchmark/alpa/suite_paper_auto_gpt.py, suite_paper_auto_moe.py, suite_paper_wresnet.py). Counts
# that do not divide the instance's batch are dropped (the suite ran Wide-ResNet at 32 and 64 GPUs
# with batches 1520 and 1512 too); a case with none left, or absent from the suites (one GPU),
# searches every power of two.
ALPA_MICROBATCHES: dict[str, dict[int, tuple[int, ...]]] = {
    "gpt": {2: (32, 64, 128, 256), 4: (32, 64, 128), 8: (64, 128, 256), 16: (32, 64, 128, 256),
            32: (64, 128, 256, 512), 64: (128, 256, 512, 1024)},
    "moe": {2: (16, 32, 64), 4: (16, 32, 64), 8: (16, 32, 64), 16: (16, 32, 64), 32: (32, 64, 128), 64: (64,)},
    "wresnet": {1: (24,), 2: (24,), 4: (24,), 8: (24,), 16: (24, 32), 32: (38, 42), 64: (38, 32, 48, 42)},
}


@dataclass(frozen=True)
class Case:
    """One benchmark case: a model instance on `gpus` V100s, with the paper's reported figures."""

    model: str  # gpt | moe | wresnet
    instance: str  # file stem under instances/
    gpus: int
    reported: dict[str, float | None]  # planner -> per-GPU TFLOP/s (None: out of memory; absent: not reported)
    alpa_plan: PlanSummary | None = None
    suite_microbatches: tuple[int, ...] = ()  # the counts Alpa's suite searched (ALPA_MICROBATCHES)

    def microbatches(self, batch: int) -> tuple[int, ...] | str:
        """The counts partopt searches for this case: the suite's that divide `batch`, else auto."""
        counts = tuple(c for c in self.suite_microbatches if batch % c == 0)
        return counts or "auto"

    @property
    def planners(self) -> tuple[str, ...]:
        return ("partopt", "inter_only", "intra_only", BASELINE[self.model])


def cases(models: Sequence[str] = MODELS, max_gpus: int = 64) -> list[Case]:
    """The benchmark cases of `models` up to `max_gpus` GPUs, in the paper's order."""
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise InstanceError(f"unknown model family {unknown[0]!r}", "--models", f"use some of {','.join(MODELS)}")
    result = []
    for model in models:
        for gpus in GPU_COUNTS:
            if gpus > max_gpus:
                continue
            instance, figures = _REPORTED[model][gpus]
            names = (BASELINE[model], "inter_only", "intra_only", "partopt")
            reported = {n: v for n, v in zip(names, figures) if v is None or not math.isnan(v)}
            result.append(Case(model, instance, gpus, reported, ALPA_GPT_PLANS.get(gpus) if model == "gpt" else None,
                               ALPA_MICROBATCHES[model].get(gpus, ())))
    return result


Efficiency = tuple[float, float]  # (matmul_efficiency, memory_efficiency) of the V100


def cluster_for(gpus: int, efficiency: Efficiency | None = None) -> Cluster:
    """p3.16xlarge with `gpus` V100s: one node with fewer devices below 8, else gpus / 8 whole nodes;
    `efficiency` overrides the preset device's (matmul, memory) efficiencies."""
    if gpus < 8:
        cluster = dataclasses.replace(preset(MACHINE, 1), devices_per_node=gpus)
    elif gpus % 8:
        raise InstanceError(f"{gpus} GPUs is not a whole number of p3.16xlarge nodes", "--max-gpus", "use 1, 2, 4 or a multiple of 8")
    else:
        cluster = preset(MACHINE, gpus // 8)
    return cluster if efficiency is None else with_efficiency(cluster, *efficiency)


# ---------------------------------------------------------------- the throughput metric

def gpt_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """FLOPs of one GPT training iteration by Megatron's closed form (REFERENCE §2), 96 with recompute, else 72."""
    factor = 96 if recompute else 72
    return factor * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def gpt_shape(graph: Graph) -> tuple[int, int, int, int, int]:
    """(batch, sequence, blocks, hidden, vocabulary) of a zoo GPT graph: one layer tag per block."""
    d = graph.dims
    return d[graph.batch_dim], d["s"], len(graph.layers), d["h"], d["v"]


def tflops_per_gpu(model: str, graph: Graph, plan: Plan) -> float:
    """The paper's per-GPU TFLOP/s of `plan`, counting the recomputed forward as Alpa's runs did: GPT
    by the 96 closed form; MoE and Wide-ResNet by the FLOPs the plan executes (forward, backward and
    recomputation: what `compute_moe_tflops(checkpoint_activations=True)` and XLA's flop count of a
    rematerialised executable count)."""
    gpus = plan.nodes * plan.devices_per_node
    if model == "gpt":
        return gpt_flops(*gpt_shape(graph)) / plan.iteration_time_s / gpus / 1e12
    return float(plan.throughput["hardware_tflops_per_device"])


# ---------------------------------------------------------------- planners

# Alpa's benchmark suites rematerialise activations for all three families (`Remat` is True in the
# fixed parameters of suite_paper_auto_gpt.py, suite_paper_auto_moe.py and suite_paper_wresnet.py),
# not only GPT as REFERENCE §3 says; every planner of a case gets the same setting.
RECOMPUTE_MODELS: tuple[str, ...] = MODELS


def model_options(model: str) -> dict:
    """Planner keywords for the paper's setting of `model`: activation recomputation (Alpa's suites)."""
    return {"recompute": "full" if model in RECOMPUTE_MODELS else "none"}


def megatron(graph: Graph, cluster: Cluster, max_microbatch: int = 32, **options) -> Plan:
    """The best Megatron-style uniform plan over the (tp ≤ node, pp, dp, microbatches) grid.

    For each (tp, pp, dp) the per-rank microbatch grows through the powers of two (1 … `max_microbatch`,
    at least pp microbatches) until the plan stops fitting or gets slower: the iteration time
    (B + pp - 1)·(a + c·mb) + sync with B = batch / mb is convex in mb, and memory only grows with it.
    A grid point whose parameter state split only by tp·pp exceeds the device is skipped unpriced.
    """
    batch, g, m = graph.dims[graph.batch_dim], cluster.num_devices, cluster.devices_per_node
    layers = len(graph.layers)
    state = costmodel.param_memory(graph.num_params, graph.dtype, graph.optimizer).total
    best: Plan | None = None
    last_error: InfeasibleError | None = None
    for tp in (t for t in range(1, min(g, m) + 1) if g % t == 0):
        for pp in (p for p in range(1, g // tp + 1) if (g // tp) % p == 0 and layers % p == 0):
            dp = g // (tp * pp)
            if ((tp * dp) % m and m % (tp * dp)) or state / (tp * pp) > cluster.device.memory_bytes:
                continue
            previous = math.inf
            for count in sorted((c for c in (2**e for e in range(batch.bit_length()))
                                 if c >= pp and batch % c == 0 and (batch // c) % dp == 0
                                 and batch // c // dp <= max_microbatch), reverse=True):
                try:
                    plan = uniform(graph, cluster, tp, pp, dp, count, **options)
                except InfeasibleError as err:
                    last_error = err
                    break
                if plan.iteration_time_s > previous:
                    break
                previous = plan.iteration_time_s
                if best is None or plan.iteration_time_s < best.iteration_time_s:
                    best = plan
    if best is None:
        raise last_error or InfeasibleError("no Megatron grid point fits", graph.name, "use more GPUs")
    return best


def megatron_config(plan: Plan) -> str:
    """'tp 2 · pp 4 · dp 1 · B 64' of a uniform plan."""
    tp_dp = plan.stages[0].logical_mesh
    return f"tp {tp_dp[1]} · pp {len(plan.stages)} · dp {tp_dp[0]} · B {plan.num_microbatches}"


def plan_with(planner: str, graph: Graph, cluster: Cluster, microbatches: int | str | Sequence[int] = "auto",
              model: str = "gpt", cache: dict | None = None) -> Plan:
    """Plan `graph` (a `model` family graph) on `cluster` with one planner (InfeasibleError when nothing fits);
    `cache` shares layer ILP solutions between the planners of one case (see `optimize`)."""
    options = model_options(model)
    if planner == "megatron":
        return megatron(graph, cluster, **options)
    flags = {"partopt": {}, "inter_only": {"inter_only": True}, "intra_only": {"intra_only": True},
             "deepspeed": {"data_parallel_only": True}, "ppdp": {"stage_data_parallel": True}}
    if planner not in flags:
        raise InstanceError(f"unknown planner {planner!r}", "planner", f"use one of {list(PLANNER_TITLES)}")
    return optimize(graph, cluster, microbatches=microbatches, cache=cache, **flags[planner], **options)


def summarize(plan: Plan) -> PlanSummary:
    """The pipeline shape of a partopt plan, comparable with Alpa's reported plans."""
    return PlanSummary(plan.num_microbatches, len(plan.stages),
                       tuple(tuple(s.submesh) for s in plan.stages), tuple(tuple(s.logical_mesh) for s in plan.stages))


def format_meshes(meshes: Sequence[tuple[int, int]]) -> str:
    """'(1,8) ×2, (1,4)': consecutive equal meshes collapsed."""
    parts: list[list] = []
    for mesh in meshes:
        if parts and parts[-1][0] == tuple(mesh):
            parts[-1][1] += 1
        else:
            parts.append([tuple(mesh), 1])
    return ", ".join(f"({a},{b})" + (f" ×{n}" if n > 1 else "") for (a, b), n in parts)


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
    graph = graph or read_graph(INSTANCES / f"{case.instance}.json")
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
        detail = megatron_config(plan) if planner == "megatron" else ""
        cells[planner] = Cell(planner, tflops_per_gpu(case.model, graph, plan), plan, time.perf_counter() - start, detail)
    return CaseResult(case, cells, cache)


def run(selected: Sequence[Case], progress: Progress | None = None, microbatches: int | str | None = None,
        efficiency: Efficiency | None = None) -> list[CaseResult]:
    """Run every case with its planners; `progress(case, planner)` is called before each plan."""
    results = []
    for case in selected:
        graph = read_graph(INSTANCES / f"{case.instance}.json")
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


def _fmt(x: float | None) -> str:
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
                worse.append(f"{r.case.model} {r.case.gpus}: {planner} {_fmt(cell.tflops)} > partopt {_fmt(ours)}")
    if results:
        found.append(Check("partopt ≥ every baseline on every case", not worse,
                           "; ".join(worse) or f"{len(results)} cases"))

    def ratio_check(key, planner, limit, name):
        r = by_key.get(key)
        if r is None:
            return
        ours, theirs = r.cells["partopt"].tflops, r.cells[planner].tflops
        ok = ours is not None and (theirs is None or theirs < limit * ours)
        found.append(Check(name, ok, f"{PLANNER_TITLES[planner]} {_fmt(theirs)} vs partopt {_fmt(ours)}"))

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


# ---------------------------------------------------------------- V100 efficiency calibration (issue 7)

@dataclass(frozen=True)
class CalibrationPoint:
    """A measured V100 throughput the efficiencies are fitted to (REFERENCE.md §3)."""

    label: str
    model: str
    instance: str
    gpus: int
    reported: float  # per-GPU TFLOP/s, in the paper's metric
    batch: int | None = None  # the global batch the measurement ran, when not the instance's
    uniform: tuple[int, int, int, int] | None = None  # (tp, pp, dp, microbatches) of a fixed measured plan


CALIBRATION_POINTS: tuple[CalibrationPoint, ...] = (
    CalibrationPoint("GPT-350M, 1 GPU (Alpa)", "gpt", "gpt-350m", 1, 45.07),
    CalibrationPoint("MoE-380M, 1 GPU (Alpa)", "moe", "moe-380m", 1, 45.46),
    CalibrationPoint("Wide-ResNet-250M, 1 GPU (Alpa)", "wresnet", "wresnet-250m", 1, 8.30),
    CalibrationPoint("GPT-2.6B, batch 32, dp 2 × op 2 × pp 2, B 4, 1 node", "gpt", "gpt-2.6b", 8, 37.01,
                     batch=32, uniform=(2, 2, 2, 4)),
)


def with_efficiency(cluster: Cluster, matmul: float, memory: float) -> Cluster:
    """`cluster` whose device reaches `matmul` of peak on GEMMs and `memory` of HBM bandwidth."""
    device = dataclasses.replace(cluster.device, matmul_efficiency=matmul, memory_efficiency=memory)
    return dataclasses.replace(cluster, device=device)


def predict_point(point: CalibrationPoint, matmul: float, memory: float, graph: Graph | None = None) -> float:
    """partopt's per-GPU TFLOP/s for a calibration point on a V100 with the given efficiencies.

    A point with a fixed plan is priced as that plan (`evaluate.uniform`); the others are planned."""
    graph = graph or read_graph(INSTANCES / f"{point.instance}.json")
    if point.batch is not None:
        graph = intra.with_batch(graph, point.batch)
    cluster = cluster_for(point.gpus, (matmul, memory))
    if point.uniform is not None:
        tp, pp, dp, count = point.uniform
        plan = uniform(graph, cluster, tp, pp, dp, count, **model_options(point.model))
    else:
        plan = plan_with("partopt", graph, cluster, model=point.model)
    return tflops_per_gpu(point.model, graph, plan)


@dataclass(frozen=True)
class Residual:
    label: str
    reported: float
    predicted: float

    @property
    def log_error(self) -> float:
        return math.log(self.predicted / self.reported)


@dataclass(frozen=True)
class Calibration:
    """The fitted efficiencies, each point's residual, and how many grid points were priced."""

    matmul_efficiency: float
    memory_efficiency: float
    residuals: tuple[Residual, ...]
    evaluated: int

    @property
    def rms_log_error(self) -> float:
        return math.sqrt(sum(r.log_error**2 for r in self.residuals) / len(self.residuals))


Predictor = Callable[[CalibrationPoint, float, float], float]


def _grid(low: float, high: float, step: float) -> list[float]:
    return [round(low + i * step, 6) for i in range(round((high - low) / step) + 1)]


def fit_efficiencies(predict: Predictor, points: Sequence[CalibrationPoint], matmul_grid: Sequence[float],
                     memory_grid: Sequence[float]) -> Calibration:
    """The (matmul, memory) efficiency pair of the grids minimising the sum of squared log errors
    of `predict` against the points' reported figures (ties: the first in grid order)."""
    best: tuple[float, float, float, tuple[Residual, ...]] | None = None
    evaluated = 0
    for matmul in matmul_grid:
        for memory in memory_grid:
            residuals = tuple(Residual(p.label, p.reported, predict(p, matmul, memory)) for p in points)
            evaluated += 1
            loss = sum(r.log_error**2 for r in residuals)
            if best is None or loss < best[0] - 1e-12:
                best = (loss, matmul, memory, residuals)
    assert best is not None, "empty calibration grid"
    return Calibration(best[1], best[2], best[3], evaluated)


def calibrate(points: Sequence[CalibrationPoint] = CALIBRATION_POINTS, predict: Predictor | None = None,
              matmul_range: tuple[float, float] = (0.3, 0.9), memory_range: tuple[float, float] = (0.5, 1.0),
              coarse: float = 0.1, fine: float = 0.025) -> Calibration:
    """Fit V100 matmul and memory efficiencies once, by least squares of log error over `points`:
    a coarse grid over the ranges (GEMMs reach 30-90 % of peak, streaming ops 50-100 % of HBM
    bandwidth), then a fine grid ±coarse/2 around the coarse optimum."""
    graphs: dict[str, Graph] = {}

    def default(point: CalibrationPoint, matmul: float, memory: float) -> float:
        if point.instance not in graphs:
            graphs[point.instance] = read_graph(INSTANCES / f"{point.instance}.json")
        return predict_point(point, matmul, memory, graphs[point.instance])

    predict = predict or default
    first = fit_efficiencies(predict, points, _grid(*matmul_range, coarse), _grid(*memory_range, coarse))

    def around(x: float) -> list[float]:
        return [v for v in _grid(x - coarse / 2, x + coarse / 2, fine) if 0 < v <= 1]

    second = fit_efficiencies(predict, points, around(first.matmul_efficiency), around(first.memory_efficiency))
    return dataclasses.replace(second, evaluated=first.evaluated + second.evaluated)


# ---------------------------------------------------------------- the inter-op ablation (paper §8.5)

ABLATION_METHODS: tuple[str, ...] = ("dp", "equal_mesh", "equal_layer", "equal_operator")
ABLATION_TITLES = {"dp": "DP (partopt)", "equal_mesh": "equal mesh", "equal_layer": "equal layer",
                   "equal_operator": "equal operator"}
# REFERENCE.md §3: (model, GPUs) -> reported TFLOP/s of (DP, equal mesh, equal layer, equal operator)
ABLATION_REPORTED: dict[tuple[str, int], tuple[float, float, float, float]] = {
    ("gpt", 8): (61, 61, 61, 40), ("gpt", 16): (60, 60, 60, 41), ("gpt", 32): (60, 60, 60, 40),
    ("wresnet", 8): (8.04, 7.2, 6.6, 7.3), ("wresnet", 16): (6.8, 6.1, 6.3, 3.3), ("wresnet", 32): (6.6, 6.6, 4.1, 2.5),
}


@dataclass(frozen=True)
class _OneSubmesh(Cluster):
    """A cluster whose stage DP may use only submeshes of one shape (the 'equal mesh' ablation)."""

    only: tuple[int, int] = (1, 1)

    def submesh_shapes(self, family: str = "alpa") -> list[tuple[int, int]]:
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
    for shape in cluster.logical_shapes(submesh):
        specs = [StageSpec(first, last, submesh, shape, min(stages - i, count)) for i, (first, last) in enumerate(groups)]
        plan = None
        for fit_memory in (False, True):
            try:
                plan = price(graph, cluster, layering, count, specs, None, Options(layers=None, **options),
                             fit_memory=fit_memory, cache=cache)
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
    graph = read_graph(INSTANCES / f"{case.instance}.json")
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


# ---------------------------------------------------------------- tables (strings for rich and markdown alike)

def _cell(result: CaseResult, planner: str) -> str:
    """'61.23 (61.61)': predicted, then the paper's figure when it reports one."""
    cell = result.cells[planner]
    text = _fmt(cell.tflops)
    if planner in result.case.reported:
        reported = result.case.reported[planner]
        text += f" ({'OOM' if reported is None else f'{reported:.2f}'})"
    return text


def results_rows(model: str, results: list[CaseResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one model's table (strings, for rich and markdown alike)."""
    planners = ("partopt", "inter_only", "intra_only", BASELINE[model])
    header = ["GPUs", "model"] + [PLANNER_TITLES[p] for p in planners] + ["error vs Alpa", "partopt planning s", "all planners s"]
    rows = []
    for r in results:
        if r.case.model != model:
            continue
        error = "—" if r.error is None else f"{r.error:+.1%}"
        rows.append([str(r.case.gpus), r.case.instance] + [_cell(r, p) for p in planners]
                    + [error, f"{r.cells['partopt'].seconds:.1f}", f"{sum(c.seconds for c in r.cells.values()):.1f}"])
    return header, rows


def plan_rows(model: str, results: list[CaseResult]) -> tuple[list[str], list[list[str]]]:
    """partopt's plan of each case beside Alpa's reported one (GPT), and the baseline's configuration."""
    header = ["GPUs", "partopt B", "stages", "submeshes", "logical meshes", "Alpa B", "stages", "submeshes", "logical meshes",
              f"{PLANNER_TITLES[BASELINE[model]]} plan"]
    rows = []
    for r in results:
        if r.case.model != model:
            continue
        plan = r.cells["partopt"].plan
        ours = summarize(plan) if plan else None
        alpa = r.case.alpa_plan
        base = r.cells[BASELINE[model]]
        base_text = base.detail if base.detail and base.plan else (
            f"B {base.plan.num_microbatches}, {format_meshes(summarize(base.plan).logical_meshes)}" if base.plan else "out of memory")
        rows.append([str(r.case.gpus)]
                    + ([str(ours.microbatches), str(ours.stages), format_meshes(ours.submeshes),
                        format_meshes(ours.logical_meshes)] if ours else [r.cells["partopt"].detail or "out of memory", "", "", ""])
                    + ([str(alpa.microbatches), str(alpa.stages), format_meshes(alpa.submeshes),
                        format_meshes(alpa.logical_meshes)] if alpa else ["—", "—", "—", "—"])
                    + [base_text])
    return header, rows


def ablation_rows(ablations: list[AblationResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the ablation table: predicted TFLOP/s per method (paper's in parentheses)."""
    header = ["case", "GPUs"] + [ABLATION_TITLES[m] for m in ABLATION_METHODS] + ["best even splits", "s"]
    rows = [[a.instance, str(a.gpus)] + [f"{_fmt(a.tflops[m])} ({a.reported[m]:g})" for m in ABLATION_METHODS]
            + ["; ".join(f"{ABLATION_TITLES[m]}: {a.detail[m]}" for m in ABLATION_METHODS[1:]), f"{a.seconds:.0f}"]
            for a in ablations]
    return header, rows


def plan_difference(result: CaseResult) -> str | None:
    """Where partopt's plan differs from Alpa's reported one ('same plan' when it does not; None when
    either is missing)."""
    plan, alpa = result.cells["partopt"].plan, result.case.alpa_plan
    if plan is None or alpa is None:
        return None
    ours = summarize(plan)
    parts = []
    if ours.microbatches != alpa.microbatches:
        parts.append(f"B {ours.microbatches} vs {alpa.microbatches}")
    if ours.stages != alpa.stages:
        parts.append(f"{ours.stages} stages vs {alpa.stages}")
    if sorted(ours.submeshes) != sorted(alpa.submeshes):
        parts.append(f"submeshes {format_meshes(ours.submeshes)} vs {format_meshes(alpa.submeshes)}")
    elif ours.submeshes != alpa.submeshes:
        parts.append("the same submeshes in another order")
    if sorted(ours.logical_meshes) != sorted(alpa.logical_meshes):
        parts.append(f"logical meshes {format_meshes(ours.logical_meshes)} vs {format_meshes(alpa.logical_meshes)}")
    return "; ".join(parts) or "same plan"


def replace_marked(path: Path, begin: str, end: str, section: str) -> None:
    """Replace the text between the `begin` and `end` markers of `path` with `section` (append the
    marked block when the markers are absent); the rest of the file stays as it is."""
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
