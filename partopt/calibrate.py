"""Calibrate a cluster preset's physical parameters on measured runs (docs/COSTMODEL.md §7).

A points file (docs/FORMAT.md, `partopt.points`) lists measured training runs: the model, the
cluster, the plan as run (priced by `evaluate.uniform`) and the measured iteration time or
TFLOP/s per GPU. `fit` finds the parameters (PARAMETERS) minimising the sum of squared log
errors of the predicted throughput by Levenberg-Marquardt on the logarithms of the parameters,
fits only those the points identify, and reports each point's fitted and leave-one-out error.
`Calibration.to_dict` is a cluster file with the fitted values, which the package reads as the
preset's data file (`partopt.cluster.preset_file`). Nothing here prints.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from partopt import io, models
from partopt.cluster import GB, MICRO, PRESETS, Cluster, Link, cluster_to_dict, file_number, nominal_preset, preset
from partopt.errors import InstanceError, PartoptError
from partopt.evaluate import uniform
from partopt.executors import make_executor
from partopt.graph import Graph

POINTS_FORMAT = "partopt.points"

# Levenberg-Marquardt on z = log(parameter): stop when a step moves no parameter by more than
# STEP_TOL (relative: the Jacobian's own step, finer than any point resolves), or the damping
# needed for progress exceeds MAX_DAMPING.
MAX_ITERATIONS = 60
STEP_TOL = 1e-6
COST_TOL = 1e-6  # ... or a step lowers the cost by less than this fraction
MAX_DAMPING = 1e10
# a trial step moves no parameter by more than this factor (a trust region in log space): a parameter the
# points hardly feel (a GEMM curve far below every GEMM's size) would otherwise be sent to 0 or infinity
MAX_LOG_STEP = math.log(10)
JACOBIAN_STEP = 1e-6  # forward-difference step in log(parameter)
# A parameter is identified when some point's log prediction moves by SENSITIVE per unit of
# log(parameter), and the column-scaled Jacobian of the points (and of every leave-one-out subset)
# has a condition number below MAX_CONDITION.
SENSITIVE = 1e-3
MAX_CONDITION = 1e3


# ---------------------------------------------------------------- parameters

@dataclass(frozen=True)
class Parameter:
    """A physical parameter of a cluster the calibration may fit: how to read and set it."""

    name: str
    unit: str
    doc: str
    at_most_one: bool  # a fraction: the fit keeps it ≤ 1
    start_if_zero: float  # where the fit starts when the preset has 0 (a curve switched off)
    get: Callable[[Cluster, Cluster], float]  # (cluster, nominal preset) -> value
    put: Callable[[Cluster, Cluster, float], Cluster]


def _device(**changes: Any) -> Callable[[Cluster], Cluster]:
    return lambda c: dataclasses.replace(c, device=dataclasses.replace(c.device, **changes))


def _link(cluster: Cluster, key: str, **changes: Any) -> Cluster:
    link: Link = getattr(cluster, key)
    return dataclasses.replace(cluster, **{key: dataclasses.replace(link, **changes)})


PARAMETERS: dict[str, Parameter] = {p.name: p for p in (
    Parameter("matmul_efficiency", "fraction", "fraction of peak large GEMMs reach", True, 0.0,
              lambda c, n: c.device.matmul_efficiency,
              lambda c, n, v: _device(matmul_efficiency=v)(c)),
    Parameter("fp8_matmul_efficiency", "fraction", "fraction of the fp8 peak large fp8 GEMMs reach", True, 0.0,
              lambda c, n: c.device.large_kernel_efficiency("fp8"),
              lambda c, n, v: _device(fp8_matmul_efficiency=v)(c)),
    Parameter("memory_efficiency", "fraction", "fraction of HBM bandwidth streaming ops reach", True, 0.0,
              lambda c, n: c.device.memory_efficiency,
              lambda c, n, v: _device(memory_efficiency=v)(c)),
    Parameter("intra_bus_efficiency", "fraction", "fraction of the nominal intra-node bandwidth collectives reach",
              True, 0.0, lambda c, n: c.intra_node.bandwidth / n.intra_node.bandwidth,
              lambda c, n, v: _link(c, "intra_node", bandwidth=n.intra_node.bandwidth * v)),
    Parameter("inter_bus_efficiency", "fraction", "fraction of the nominal inter-node bandwidth collectives reach",
              True, 0.0, lambda c, n: c.inter_node.bandwidth / n.inter_node.bandwidth,
              lambda c, n, v: _link(c, "inter_node", bandwidth=n.inter_node.bandwidth * v)),
    Parameter("matmul_half_gflop", "GFLOP", "GEMM size (FLOPs per call and device) reaching half the efficiency",
              False, 1.0, lambda c, n: c.device.matmul_half_flops / 1e9,
              lambda c, n, v: _device(matmul_half_flops=v * 1e9)(c)),
    Parameter("intra_latency_us", "µs", "latency per message (ring step) inside a node", False, 1.0,
              lambda c, n: c.intra_node.latency_s * MICRO, lambda c, n, v: _link(c, "intra_node", latency_s=v / MICRO)),
    Parameter("inter_latency_us", "µs", "latency per message (ring step) between nodes", False, 1.0,
              lambda c, n: c.inter_node.latency_s * MICRO, lambda c, n, v: _link(c, "inter_node", latency_s=v / MICRO)),
    # last, so that `identifiable` tries the parameters it tried before this one first
    Parameter("attention_efficiency", "fraction", "fraction of peak large fused-attention kernels reach", True, 0.0,
              lambda c, n: c.device.large_kernel_efficiency("bf16", attention=True),
              lambda c, n, v: _device(attention_efficiency=v)(c)),
)}


def values_of(cluster: Cluster, nominal: Cluster) -> dict[str, float]:
    """Every parameter's value on `cluster` (bus efficiencies relative to `nominal`'s links)."""
    return {name: p.get(cluster, nominal) for name, p in PARAMETERS.items()}


def with_values(cluster: Cluster, nominal: Cluster, values: Mapping[str, float]) -> Cluster:
    """`cluster` with the given parameters set (InstanceError for an unknown name)."""
    for name, value in values.items():
        if name not in PARAMETERS:
            raise InstanceError(f"unknown calibration parameter {name!r}", "fit", f"use some of {', '.join(PARAMETERS)}")
        cluster = PARAMETERS[name].put(cluster, nominal, value)
    return cluster


# ---------------------------------------------------------------- points

@dataclass(frozen=True)
class Point:
    """One measured run: the graph, where it ran, the plan as run, what was measured, the source."""

    label: str
    source: str
    graph: Graph
    preset: str
    nodes: int
    devices_per_node: int | None  # None: the preset's
    inter_node: Link | None  # the network between nodes, nominal, when not the preset's (latency: the preset's)
    tp: int
    pp: int
    dp: int
    microbatches: int | None  # None: pp
    recompute: str
    zero: bool
    sequence_parallel: bool  # every norm split along its sequence over the tensor-parallel axis (Megatron's flag)
    shard_weights: bool  # every parameter split over the data-parallel axis, gathered for each use (ZeRO-3, FSDP)
    tp_comm_overlap: bool  # tensor-parallel collectives hidden under the GEMMs (Megatron's --tp-comm-overlap)
    state_layout: str  # how the run's runtime kept parameter state (`costmodel.STATE_LAYOUTS`)
    overlap: bool
    memory_reserve: float | None  # the fraction of device memory kept free when pricing it (None: partopt's default)
    check_memory: bool  # False: the run is priced as run, each layer at its fastest, whatever memory the model gives it
    schedule: str  # the pipeline schedule as run (`schedules.SCHEDULES`) ...
    virtual_stages: int  # ... with this many model chunks per stage (interleaved)
    stage_layers: tuple[int, ...] | None  # each stage's layers when the run split them unevenly; None: equally
    iteration_s: float | None  # the measured figure: an iteration time ...
    tflops_per_gpu: float | None  # ... or per-GPU TFLOP/s counted with `flops`
    flops: str | float = "executed"  # the plan's FLOPs with recomputation, "model" without, or the source's count
    where: str = "point"  # its place in the points file, for errors

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Points:
    """A points file: its points and the parameters it asks to fit (None: those the points identify)."""

    name: str
    points: tuple[Point, ...]
    fit: tuple[str, ...] | None = None


def _model(entry: Mapping[str, Any], base: Path, where: str) -> Graph:
    """The graph of a point's `model` object: a named model, a generator with arguments, or a graph file."""
    kinds = [k for k in ("preset", "generator", "graph") if k in entry]
    if len(kinds) != 1:
        raise InstanceError(f"the model names {' and '.join(kinds) or 'nothing'}", where,
                            "give exactly one of \"preset\", \"generator\" or \"graph\"")
    args = dict(entry.get("args", {}))
    if kinds[0] == "graph":
        if args:
            raise InstanceError("a graph file takes no args", f"{where}.args", "drop \"args\" or use a generator")
        try:
            return io.read_graph(base / entry["graph"])
        except PartoptError as err:  # it names the graph file; the point names which of them
            raise err.located(f"{where}.graph") from None
    try:
        if kinds[0] == "preset":
            return models.preset(entry["preset"], **args)
        return models.generate(entry["generator"], **args)
    except InstanceError as err:
        raise InstanceError(err.cause, where, err.hint) from None
    except (TypeError, ValueError) as err:  # an argument of the wrong type or size
        raise InstanceError(f"bad model arguments: {err}", f"{where}.args", "check the generator's arguments") from None


def points_from_dict(data: Any, where: str = "", base: Path = Path(".")) -> Points:
    """Points from a points-file dict: schema first, then each point's model and plan."""
    io.validate_against_schema(data, "points", where)
    points = []
    for i, p in enumerate(data["points"]):
        at = io.at(where, f"$.points[{i}]")
        measured = p["measured"]
        if ("iteration_s" in measured) == ("tflops_per_gpu" in measured):
            raise InstanceError("the measurement gives " + ("both" if "iteration_s" in measured else "neither") +
                                " iteration_s and tflops_per_gpu", f"{at}.measured", "give exactly one of them")
        if "flops" in measured and "tflops_per_gpu" not in measured:
            raise InstanceError("flops counts TFLOP/s, but the measurement is a time", f"{at}.measured.flops",
                                "drop flops or measure tflops_per_gpu")
        plan, cluster = p["plan"], p["cluster"]
        if cluster["preset"] not in PRESETS:
            raise InstanceError(f"unknown cluster preset {cluster['preset']!r}", f"{at}.cluster.preset",
                                f"known presets: {', '.join(PRESETS)}")
        network = cluster.get("inter_node")
        if network is not None and cluster["nodes"] == 1:  # nothing of the run crossed it
            raise InstanceError("inter_node is the network between nodes, and the run used 1 node",
                                f"{at}.cluster.inter_node", "drop inter_node, or give the nodes the run used")
        points.append(Point(
            label=p["label"], source=p["source"], graph=_model(p["model"], base, f"{at}.model"),
            preset=cluster["preset"], nodes=cluster["nodes"], devices_per_node=cluster.get("devices_per_node"),
            inter_node=None if network is None else Link(network["bandwidth_gbps"] * GB, 0.0, network["shared_by_node"]),
            tp=plan["tp"], pp=plan["pp"], dp=plan["dp"], microbatches=plan.get("microbatches"),
            recompute=plan.get("recompute", "auto"), zero=plan.get("zero", False),
            sequence_parallel=plan.get("sequence_parallel", False), shard_weights=plan.get("shard_weights", False),
            tp_comm_overlap=plan.get("tp_comm_overlap", False), state_layout=plan.get("state_layout", "zero"),
            overlap=plan.get("overlap", True),
            memory_reserve=plan.get("memory_reserve"), check_memory=plan.get("check_memory", True),
            schedule=plan.get("schedule", "1f1b"), virtual_stages=plan.get("virtual_stages", 1),
            stage_layers=tuple(plan["stage_layers"]) if "stage_layers" in plan else None,
            iteration_s=measured.get("iteration_s"), tflops_per_gpu=measured.get("tflops_per_gpu"),
            flops=measured.get("flops", "executed"), where=at))
    labels = [p.label for p in points]
    for i, label in enumerate(labels):
        if label in labels[:i]:
            raise InstanceError(f"label {label!r} is used twice", io.at(where, f"$.points[{i}].label"),
                                "give each point its own label")
    fit = tuple(data["fit"]) if "fit" in data else None
    return Points(where or "points", tuple(points), fit)


def read_points(path: str | Path) -> Points:
    """Load and validate a points file; graph files it names are read relative to it."""
    data = io.load_json(path)
    if isinstance(data, Mapping) and data.get("format", POINTS_FORMAT) != POINTS_FORMAT:
        raise InstanceError(f"expected {POINTS_FORMAT!r}, got {data['format']!r}", io.at(str(path), "$.format"),
                            "give a points file (docs/FORMAT.md)")
    return points_from_dict(data, str(path), Path(path).parent)


# ---------------------------------------------------------------- prediction

def point_cluster(point: Point, base: Cluster) -> Cluster:
    """The cluster a point ran on: `base` (the calibrated preset) with the point's nodes and devices, and its own
    network between nodes if it names one, at `base`'s fraction of the nominal bandwidth (inter_bus_efficiency)."""
    cluster = base.resized(point.nodes)
    if point.devices_per_node is not None:
        try:
            cluster = cluster.narrowed(point.devices_per_node)
        except PartoptError as err:
            raise err.located(f"{point.where}.cluster.devices_per_node ({point.label})") from None
    if point.inter_node is not None:
        efficiency = cluster.inter_node.bandwidth / nominal_preset(point.preset).inter_node.bandwidth
        cluster = _link(cluster, "inter_node", bandwidth=point.inter_node.bandwidth * efficiency,
                        shared_by_node=point.inter_node.shared_by_node)
    return cluster


def ratio(point: Point, cluster: Cluster, workers: int | None = None) -> float:
    """Predicted / measured throughput of `point` on `cluster` (its plan priced by `evaluate.uniform`, its
    layer ILPs on `workers` processes: default as `optimize`'s)."""
    try:
        plan = uniform(point.graph, cluster, point.tp, point.pp, point.dp, point.microbatches,
                       zero=point.zero, sequence_parallel=point.sequence_parallel, shard_weights=point.shard_weights,
                       tp_comm_overlap=point.tp_comm_overlap, state_layout=point.state_layout,
                       recompute=point.recompute, overlap=point.overlap, workers=workers,
                       check_memory=point.check_memory,
                       **({} if point.memory_reserve is None else {"memory_reserve": point.memory_reserve}),
                       schedule=point.schedule, virtual_stages=point.virtual_stages, stage_layers=point.stage_layers)
    except PartoptError as err:
        raise type(err)(err.cause, f"{point.where} ({point.label}): {err.where}" if err.where else point.where,
                        err.hint) from None
    if point.iteration_s is not None:
        return point.iteration_s / plan.iteration_time_s
    assert point.tflops_per_gpu is not None
    if point.flops == "executed":
        predicted = plan.throughput["hardware_tflops_per_device"]
    elif point.flops == "model":
        predicted = plan.throughput["tflops_per_device"]
    else:
        predicted = float(point.flops) / plan.iteration_time_s / cluster.num_devices / 1e12
    return predicted / point.tflops_per_gpu


# ---------------------------------------------------------------- the fit

@dataclass(frozen=True)
class PointResult:
    """A point's errors (predicted / measured throughput − 1) with the fitted values and without the point."""

    label: str
    source: str
    error: float
    loo_error: float | None  # None: leave-one-out not run


@dataclass(frozen=True)
class Calibration:
    """The fitted parameters of one preset, the values of all parameters, each point's errors."""

    preset: str
    values: dict[str, float]  # every parameter, fitted or kept
    fitted: tuple[str, ...]
    start: dict[str, float]
    results: tuple[PointResult, ...]
    evaluations: int  # point predictions made (each prices one plan)

    @property
    def fitted_values(self) -> dict[str, float]:
        """The fitted values as a cluster file writes numbers (`cluster.file_number`), so that the data file's
        device and its record of the fit say the same."""
        return {n: file_number(self.values[n]) for n in self.fitted}

    def cluster(self) -> Cluster:
        """The preset with the fitted values."""
        return with_values(preset(self.preset), nominal_preset(self.preset), self.fitted_values)

    def to_dict(self, points: str) -> dict[str, Any]:
        """The preset's data file: a cluster file with the fitted values and their provenance."""
        return {**cluster_to_dict(self.cluster()), "calibration": {
            "points": points, "fitted": self.fitted_values,
            "errors": [{"label": r.label, "source": r.source, "error": r.error, "loo_error": r.loo_error}
                       for r in self.results]}}


def _log_residual(points: Sequence[Point], job: tuple[int, Cluster]) -> float:
    """log(predicted / measured) of point `job[0]` on `job[1]`, the preset with trial values: an executor's
    job (`partopt.executors`), whose layer ILPs stay in its process."""
    i, base = job
    return math.log(ratio(points[i], point_cluster(points[i], base), workers=1))


class _Problem:
    """The residuals log(predicted / measured) of `points` as a function of z = log(parameters), the points
    priced `workers` at a time (each in its own process; 1: here). A context manager: leaving it stops
    those processes, waiting for running points only when nothing went wrong (Ctrl-C does not wait)."""

    def __init__(self, points: Sequence[Point], name: str, names: Sequence[str], workers: int | None = None):
        self.points, self.names = points, list(names)
        self.base, self.nominal = preset(name), nominal_preset(name)
        self.at_most_one = np.array([PARAMETERS[n].at_most_one for n in names])
        self.cache: dict[tuple[bytes, int], float] = {}  # (z, point) -> residual: fits share their starts
        workers = workers or len(os.sched_getaffinity(0))
        self.executor = make_executor("local", _log_residual, (tuple(points),), min(workers, len(points)))

    def __enter__(self) -> "_Problem":
        return self

    def __exit__(self, kind: type | None, *_: object) -> None:
        self.executor.close(wait=kind is None)

    @property
    def evaluations(self) -> int:
        """Point predictions made (each prices one plan)."""
        return len(self.cache)

    def cluster(self, z: np.ndarray) -> Cluster:
        return with_values(self.base, self.nominal, dict(zip(self.names, np.exp(z).tolist())))

    def _price(self, zs: Sequence[np.ndarray], rows: Sequence[int] | None) -> list[int]:
        """Price every point of `rows` (all when None) at every z of `zs` not priced yet, all at once on the
        executor; the rows."""
        chosen = list(range(len(self.points)) if rows is None else rows)
        jobs = [(z, i) for z in zs for i in chosen if (z.tobytes(), i) not in self.cache]
        clusters = {key: self.cluster(z) for key, z in {z.tobytes(): z for z, _ in jobs}.items()}  # once per z
        for (z, i), residual in zip(jobs, self.executor.map([(i, clusters[z.tobytes()]) for z, i in jobs])):
            self.cache[z.tobytes(), i] = residual
        return chosen

    def residuals(self, z: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        return np.array([self.cache[z.tobytes(), i] for i in self._price([z], rows)])

    def jacobian(self, z: np.ndarray, r: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        shifted = []
        for j in range(len(z)):
            step = -JACOBIAN_STEP if self.at_most_one[j] and z[j] + JACOBIAN_STEP > 0 else JACOBIAN_STEP
            dz = np.zeros_like(z)
            dz[j] = step
            shifted.append((z + dz, step))
        self._price([zj for zj, _ in shifted], rows)
        return np.array([(self.residuals(zj, rows) - r) / step for zj, step in shifted]).T

    def project(self, z: np.ndarray) -> np.ndarray:
        """Fractions stay ≤ 1 (z ≤ 0)."""
        return np.where(self.at_most_one, np.minimum(z, 0.0), z)


def _levenberg_marquardt(problem: _Problem, z: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
    """z minimising the sum of squared residuals over `rows` (all points when None), from `z`."""
    r = problem.residuals(z, rows)
    cost = float(r @ r)
    damping = 1e-3
    for _ in range(MAX_ITERATIONS):
        jac = problem.jacobian(z, r, rows)
        gradient, normal = jac.T @ r, jac.T @ jac
        scale = np.diag(normal) + 1e-12
        while damping <= MAX_DAMPING:
            step = np.linalg.solve(normal + damping * np.diag(scale), -gradient)
            step *= min(1.0, MAX_LOG_STEP / max(float(np.max(np.abs(step))), 1e-300))  # the same direction, shorter
            trial = problem.project(z + step)
            if float(np.max(np.abs(trial - z))) < STEP_TOL:
                return z  # steps this small resolve nothing more: converged (and no predictions spent on them)
            r_trial = problem.residuals(trial, rows)
            cost_trial = float(r_trial @ r_trial)
            if cost_trial < cost:
                break
            damping *= 10
        else:
            return z  # no step lowers the cost: a minimum (to the precision of the predictions)
        moved = float(np.max(np.abs(trial - z)))
        previous = cost
        z, r, cost = trial, r_trial, cost_trial
        damping = max(damping / 10, 1e-12)
        if moved < STEP_TOL or cost < 1e-30 or cost_trial > (1 - COST_TOL) * previous:
            break
    return z


def _condition(jac: np.ndarray) -> float:
    """Condition number of the Jacobian with unit-norm columns (inf when a column is zero)."""
    norms = np.linalg.norm(jac, axis=0)
    if np.any(norms < SENSITIVE):
        return math.inf
    singular = np.linalg.svd(jac / norms, compute_uv=False)
    return float(singular[0] / singular[-1]) if singular[-1] > 0 else math.inf


def _identified(jac: np.ndarray) -> bool:
    """More points than parameters, and the parameters are told apart by all points and by every
    leave-one-out subset (so each leave-one-out fit is determined too)."""
    n, p = jac.shape
    if n < p + 1:
        return False
    return all(_condition(np.delete(jac, rows, axis=0)) <= MAX_CONDITION for rows in [[], *[[i] for i in range(n)]])


def _start(problem: _Problem, names: Sequence[str]) -> np.ndarray:
    values = values_of(problem.base, problem.nominal)
    return np.log([values[n] or PARAMETERS[n].start_if_zero for n in names])


def identifiable(points: Sequence[Point], name: str, candidates: Sequence[str] = tuple(PARAMETERS),
                 workers: int | None = None) -> tuple[str, ...]:
    """The parameters of `candidates` the points identify, chosen greedily in order at the preset's values:
    each is kept when the points (and every leave-one-out subset) still tell all kept ones apart."""
    with _Problem(points, name, candidates, workers) as problem:
        z = _start(problem, candidates)
        jac = problem.jacobian(z, problem.residuals(z))
    kept: list[int] = []
    for j in range(len(candidates)):
        if _identified(jac[:, kept + [j]]):
            kept.append(j)
    return tuple(candidates[j] for j in kept)


def _check_presets(points: Sequence[Point], name: str) -> None:
    nominal_preset(name)  # an unknown preset is an error before any work
    for p in points:
        if p.preset != name:
            raise InstanceError(f"the point ran on preset {p.preset!r}, the fit is for {name!r}",
                                f"{p.where}.cluster.preset", "fit each preset on its own points")


def _check(points: Sequence[Point], parameters: Sequence[str], where: str) -> None:
    for n in parameters:
        if n not in PARAMETERS:
            raise InstanceError(f"unknown calibration parameter {n!r}", where, f"use some of {', '.join(PARAMETERS)}")
    if len(set(parameters)) != len(parameters):
        raise InstanceError("a parameter is named twice", where, "name each parameter once")
    if len(points) < len(parameters) + 1:
        raise InstanceError(f"{len(points)} points cannot fit {len(parameters)} parameters with leave-one-out",
                            where, f"give at least {len(parameters) + 1} points or fit fewer parameters")


def fit(points: Points | Sequence[Point], name: str, parameters: Sequence[str] | None = None,
        leave_one_out: bool = True, start: Mapping[str, float] | None = None, where: str | None = None,
        workers: int | None = None) -> Calibration:
    """Fit preset `name`'s parameters to the points by least squares on log error.

    `parameters` (else the points file's "fit", else `identifiable`) are fitted from the preset's
    values (or `start`); the others keep the preset's. Each point gets its error with the fitted
    values and, with `leave_one_out`, its error when fitted without it (starting from the fitted
    optimum). InstanceError when the points do not identify a parameter asked for; `where` names
    where `parameters` came from (default: the points file's "fit", or "fit"). The points are
    priced `workers` at a time, each in its own process (default: one per core; 1: in this
    process); the result does not depend on it."""
    if isinstance(points, Points):
        if parameters is None:
            where, parameters = where or f"{points.name}: $.fit", points.fit
        points = points.points
    where = where or "fit"
    points = list(points)
    _check_presets(points, name)
    parameters = tuple(parameters if parameters is not None else identifiable(points, name, workers=workers))
    _check(points, parameters, where)
    with _Problem(points, name, parameters, workers) as problem:
        return _fit(problem, points, name, parameters, leave_one_out, start, where)


def _fit(problem: _Problem, points: list[Point], name: str, parameters: tuple[str, ...], leave_one_out: bool,
         start: Mapping[str, float] | None, where: str) -> Calibration:
    z0 = _start(problem, parameters)
    if start:
        z0 = np.log([start.get(n, math.exp(z)) for n, z in zip(parameters, z0)])
    if parameters:
        jac = problem.jacobian(z0, problem.residuals(z0))
        if not _identified(jac):
            loose = [n for n, norm in zip(parameters, np.linalg.norm(jac, axis=0)) if norm < SENSITIVE]
            cause = (f"no point's prediction depends on {', '.join(loose)}" if loose else
                     f"the points do not tell {', '.join(parameters)} apart (with every point and with each left out)")
            raise InstanceError(cause, where, "fit fewer parameters, or add points that exercise them")
    z = _levenberg_marquardt(problem, z0) if parameters else z0
    errors = np.exp(problem.residuals(z)) - 1
    loo: list[float | None] = [None] * len(points)
    if leave_one_out:  # each from the full fit's optimum: the same minimum, reached in a few steps
        for i in range(len(points)):
            rest = [k for k in range(len(points)) if k != i]
            z_i = _levenberg_marquardt(problem, z, rest) if parameters else z0
            loo[i] = float(math.exp(problem.residuals(z_i, [i])[0]) - 1)
    values = values_of(problem.cluster(z), problem.nominal)
    return Calibration(name, values, parameters, dict(zip(parameters, np.exp(z0).tolist())),
                       tuple(PointResult(p.label, p.source, float(e), l) for p, e, l in zip(points, errors, loo)),
                       problem.evaluations)
