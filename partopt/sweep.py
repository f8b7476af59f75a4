"""Capacity planning: plan a grid of models × clusters × node counts (× varied solve options) and
tabulate each point's best plan, throughput, memory, time to train and GPU-hours.

Every grid point is one `partopt.optimize` call. Points of one (model, cluster) share one ILP cache,
so a layer priced on a mesh at 1 node is not solved again at 2 or 4 nodes, nor for a varied option
that does not change it (the cache key holds every pricing input). A point that has no plan (out of
memory, no microbatch count dividing the batch) becomes a row that says why, not an exception.

Time to train N tokens = N / (batch × seq) × iteration time, where batch is the graph's batch dim and
seq its dim "s" (the sequence of the model zoo and the frontends); a graph without "s" (Wide-ResNet)
counts one token per sample, so N is then a number of samples. GPU-hours = GPUs × time to train / 3600.
"""

from __future__ import annotations

import csv
import itertools
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from partopt import io, models
from partopt.cluster import PRESETS as CLUSTER_PRESETS
from partopt.cluster import Cluster, preset
from partopt.errors import InfeasibleError, InstanceError, PartoptError, SolverError
from partopt.graph import Graph
from partopt.inter import optimize
from partopt.plan import Plan, by_device

FORMAT = "partopt.sweep"
VERSION = 1
SEQ_DIM = "s"  # the sequence dim of the model zoo's and the frontends' graphs
PLOT_FORMATS = (".png", ".svg")
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Spec:
    """A validated sweep: the graphs and clusters built, the grid's axes and the fixed options."""

    models: list[Graph]
    clusters: list[Cluster]
    nodes: list[int] | None = None  # None: each cluster's own node count
    options: dict[str, Any] = field(default_factory=dict)
    vary: dict[str, list[Any]] = field(default_factory=dict)  # option -> values, further grid axes
    tokens: float | None = None
    source: str = "sweep"  # what its errors name: the spec file


@dataclass(frozen=True)
class Row:
    """One grid point: its plan's figures, or (no_plan) why it has none."""

    model: str
    cluster: str
    nodes: int
    gpus: int
    options: str  # the varied options of this point, "recompute=full; layers=8" ("" when none vary)
    plan: str  # stages as "count × (submesh) mesh (logical)", joined by " + "
    recompute: str  # per-stage modes, "full ×2, none ×1"
    microbatches: int | None
    iteration_time_s: float | None
    tflops_per_gpu: float | None
    peak_memory_bytes: float | None
    tokens_per_iteration: int  # batch × seq
    tokens: float | None
    time_to_train_s: float | None
    gpu_hours: float | None
    ilps_solved: int | None  # solved for this point (the rest came from the shared cache)
    planning_s: float  # wall time of this point's optimize call
    no_plan: str  # the InfeasibleError's (or SolverError's) line; "" when there is a plan


# ---------------------------------------------------------------- the spec file

def read_spec(path: str | os.PathLike[str]) -> Spec:
    """Load and validate a sweep spec file; files it names are relative to its directory."""
    return spec_from_dict(io.load_json(path), str(path), Path(path).parent)


def spec_from_dict(data: Any, where: str = "sweep", base: str | os.PathLike[str] = ".") -> Spec:
    """Build a Spec from its file form: the schema, then every model and cluster built (errors name
    `where` and the JSON path), so a bad entry stops the sweep before any planning."""
    if isinstance(data, Mapping) and data.get("format", FORMAT) != FORMAT:
        raise InstanceError(f"expected {FORMAT!r}, got {data['format']!r}", io.at(where, "$.format"),
                            "a sweep spec has \"format\": \"partopt.sweep\" (docs/FORMAT.md)")
    io.validate_against_schema(data, "sweep", where)
    graphs = [_model(entry, io.at(where, f"$.models[{i}]"), Path(base)) for i, entry in enumerate(data["models"])]
    clusters = [_cluster(entry, io.at(where, f"$.clusters[{i}]"), Path(base)) for i, entry in enumerate(data["clusters"])]
    for kind, names, hint in (("model", [g.name for g in graphs], "a named model takes \"params\": {\"name\": ...}"),
                              ("cluster", [c.name for c in clusters], "give each cluster file its own \"name\"")):
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise InstanceError(f"two {kind}s are named {twice!r}", io.at(where, f"$.{kind}s"), hint)
    options, vary = data.get("options", {}), data.get("vary", {})
    both = sorted(set(options) & set(vary))
    if both:
        raise InstanceError(f"option {both[0]!r} is both fixed and varied", io.at(where, f"$.vary.{both[0]}"),
                            "give it in options or in vary, not both")
    return Spec(graphs, clusters, data.get("nodes"), dict(options), {k: list(v) for k, v in vary.items()},
                data.get("tokens"), where)


def _model(entry: str | Mapping[str, Any], where: str, base: Path) -> Graph:
    """A named model (with overrides) or a graph file; errors located at `where`."""
    try:
        if isinstance(entry, Mapping):
            return models.preset(entry["preset"], **entry.get("params", {}))
        if entry in models.PRESETS:
            return models.preset(entry)
        path = base / entry
        if not path.exists():
            raise InstanceError(f"{entry!r} is neither a named model nor a graph file",
                                hint=f"named models: {', '.join(models.PRESETS)}; files are relative to the spec")
        return io.read_graph(path)
    except InstanceError as err:
        raise err.located(where) from None


def _cluster(entry: str, where: str, base: Path) -> Cluster:
    """A cluster preset or a cluster file; errors located at `where`."""
    if entry in CLUSTER_PRESETS:
        return preset(entry)
    path = base / entry
    if not path.exists():
        raise InstanceError(f"{entry!r} is neither a cluster preset nor a cluster file", where,
                            f"presets: {', '.join(CLUSTER_PRESETS)}; files are relative to the spec")
    try:
        return io.read_cluster(path)
    except InstanceError as err:
        raise err.located(where) from None


# ---------------------------------------------------------------- the grid

@dataclass(frozen=True)
class Point:
    """One grid point: a model on a cluster of `nodes` nodes with some varied options."""

    graph: Graph
    cluster: Cluster
    varied: dict[str, Any]


def points(spec: Spec) -> list[Point]:
    """The grid in order: model, cluster, varied options, node count (ascending)."""
    combos = [dict(zip(spec.vary, values)) for values in itertools.product(*spec.vary.values())]
    return [Point(graph, cluster.resized(nodes), varied)
            for graph in spec.models for cluster in spec.clusters for varied in combos
            for nodes in sorted(spec.nodes or [cluster.nodes])]


def tokens_per_iteration(graph: Graph) -> int:
    """batch × seq tokens per iteration (seq: dim "s", or 1 for a graph without one)."""
    batch = graph.dims[graph.batch_dim] if graph.batch_dim else 1
    return batch * graph.dims.get(SEQ_DIM, 1)


def sweep(spec: Spec | Mapping[str, Any], point: Callable[[int, int, str], None] | None = None,
          pricing: Callable[[int, int], None] | None = None) -> list[Row]:
    """Plan every grid point of `spec` (a Spec, or its file form with paths relative to the working
    directory); one row per point, in `points` order.

    `point(k, total, label)` is called before point k is planned, `pricing(done, total)` with the ILPs
    of the current point (optimize's progress). One ILP cache per (model, cluster) is shared by its points,
    which `points` keeps together: the cache is dropped when they are done, so memory stays that of one pair.
    """
    spec = spec if isinstance(spec, Spec) else spec_from_dict(spec)
    grid = points(spec)
    pair, cache = None, {}
    rows = []
    for k, p in enumerate(grid):
        if point:
            point(k, len(grid), _label(p))
        if (p.graph.name, p.cluster.name) != pair:
            pair, cache = (p.graph.name, p.cluster.name), {}
        rows.append(_row(p, spec, cache, pricing))
    return rows


def _label(p: Point) -> str:
    """What the progress bar names a point by: "gpt-1.3b on 2 × p3.16xlarge (recompute=full)"."""
    varied = f" ({_varied_text(p.varied)})" if p.varied else ""
    return f"{p.graph.name} on {p.cluster.nodes} × {p.cluster.name}{varied}"


def _varied_text(varied: Mapping[str, Any]) -> str:
    """The varied options of a point as one cell, "recompute=full; layers=8"."""
    return "; ".join(f"{k}={v}" for k, v in varied.items())


def _row(p: Point, spec: Spec, cache: dict, pricing: Callable[[int, int], None] | None) -> Row:
    """Plan one point; no plan (InfeasibleError, SolverError) is a row with the error's line."""
    per_iteration = tokens_per_iteration(p.graph)
    base = dict(model=p.graph.name, cluster=p.cluster.name, nodes=p.cluster.nodes, gpus=p.cluster.num_devices,
                options=_varied_text(p.varied), tokens_per_iteration=per_iteration, tokens=spec.tokens)
    start = time.perf_counter()
    try:
        plan = _optimize(p, spec, cache, pricing)
    except (InfeasibleError, SolverError) as err:
        return Row(**base, plan="", recompute="", microbatches=None, iteration_time_s=None, tflops_per_gpu=None,
                   peak_memory_bytes=None, time_to_train_s=None, gpu_hours=None, ilps_solved=None,
                   planning_s=time.perf_counter() - start, no_plan=err.line())
    elapsed = time.perf_counter() - start
    train = None if spec.tokens is None else spec.tokens / per_iteration * plan.iteration_time_s
    return Row(**base, plan=plan_summary(plan), recompute=recompute_summary(plan),
               microbatches=plan.num_microbatches, iteration_time_s=plan.iteration_time_s,
               tflops_per_gpu=plan.throughput["tflops_per_device"], peak_memory_bytes=plan.memory_peak_bytes,
               time_to_train_s=train,
               gpu_hours=None if train is None else p.cluster.num_devices * train / SECONDS_PER_HOUR,
               ilps_solved=plan.solver["ilps"], planning_s=elapsed, no_plan="")


def _optimize(p: Point, spec: Spec, cache: dict, pricing: Callable[[int, int], None] | None) -> Plan:
    """Plan one point; an error an option caused (optimize names its keyword) is placed at that option in
    the spec, `$.options.<key>` or `$.vary.<key>`."""
    try:
        return optimize(p.graph, p.cluster, progress=pricing, cache=cache, **{**spec.options, **p.varied})
    except PartoptError as err:
        section = "vary" if err.where in p.varied else "options" if err.where in spec.options else None
        if section is None:
            raise
        raise type(err)(err.cause, io.at(spec.source, f"$.{section}.{err.where}"), err.hint) from None


def _counted(items: list[str]) -> list[tuple[str, int]]:
    """Distinct items in order of first appearance, with how often each occurs."""
    return [(item, items.count(item)) for item in dict.fromkeys(items)]


def plan_summary(plan: Plan) -> str:
    """The stages as "2 × (1, 4) mesh (4, 1) + 1 × (2, 8) mesh (2, 8)": count × submesh and logical mesh."""
    shapes = [f"({s.submesh[0]}, {s.submesh[1]}) mesh ({s.logical_mesh[0]}, {s.logical_mesh[1]})"
              for s in by_device(plan).stages]  # interleaved: its device groups, not its chunks
    return " + ".join(f"{n} × {shape}" for shape, n in _counted(shapes))


def recompute_summary(plan: Plan) -> str:
    """The stages' recomputation modes, "none" when all agree, else "full ×2, none ×1"."""
    counted = _counted([s.recompute for s in plan.stages])
    return counted[0][0] if len(counted) == 1 else ", ".join(f"{mode} ×{n}" for mode, n in counted)


# ---------------------------------------------------------------- CSV

def _parser(name: str) -> Callable[[str], Any]:
    """How a CSV cell of Row field `name` reads back (its annotation: int, float, str, or optional number)."""
    kind = Row.__dataclass_fields__[name].type
    if kind in ("int", "float"):
        return int if kind == "int" else float
    if kind == "str":
        return str
    number = int if kind.startswith("int") else float  # "int | None", "float | None": empty cell is None
    return lambda text: None if text == "" else number(text)


def _cell(value: Any) -> str:
    """A CSV cell: floats in full (repr), so the file reads back exactly; None as an empty cell."""
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)


def write_csv(rows: list[Row], path: str | os.PathLike[str]) -> None:
    """Write the rows as CSV (a header of Row's field names, SI units), atomically."""
    names = [f.name for f in fields(Row)]

    def write(temporary: str) -> None:
        with open(temporary, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(names)
            out.writerows([_cell(getattr(row, n)) for n in names] for row in rows)

    io.write_atomic(path, write)


def read_csv(path: str | os.PathLike[str]) -> list[Row]:
    """Read rows written by `write_csv`; a file with other columns is an InstanceError."""
    names = [f.name for f in fields(Row)]
    parsers = {n: _parser(n) for n in names}
    with open(path, newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))
    if not table or table[0] != names:
        raise InstanceError("not a sweep table (its header differs)", f"{path}: line 1", "read files `partopt sweep -o` wrote")
    rows = []
    for line, cells in enumerate(table[1:], 2):
        try:
            rows.append(Row(**{n: parsers[n](c) for n, c in zip(names, cells, strict=True)}))
        except ValueError as err:
            raise InstanceError(f"bad cell: {err}", f"{path}: line {line}", "read files `partopt sweep -o` wrote") from None
    return rows


# ---------------------------------------------------------------- plot

def check_plot_path(path: str | os.PathLike[str]) -> str:
    """The plot's format (".png" or ".svg") from its suffix; any other is an InstanceError, raised before the work."""
    suffix = Path(path).suffix.lower()
    if suffix not in PLOT_FORMATS:
        raise InstanceError(f"cannot plot to {suffix or 'a file without suffix'!r}", str(path),
                            "name the plot *.png or *.svg")
    io.check_output(path)
    return suffix


def plot(rows: list[Row], path: str | os.PathLike[str]) -> None:
    """Throughput per GPU and time to train (iteration time without tokens) against GPUs, one line
    per model, cluster and varied options; PNG or SVG by suffix, written atomically. Points without
    a plan are left out of their line."""
    suffix = check_plot_path(path)
    trained = any(r.time_to_train_s is not None for r in rows)
    figure = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(figure)
    speed, duration = figure.subplots(1, 2)
    lines: dict[str, list[Row]] = {}
    for row in rows:
        if not row.no_plan:
            label = f"{row.model} on {row.cluster}" + (f" ({row.options})" if row.options else "")
            lines.setdefault(label, []).append(row)
    for label, line in lines.items():
        line.sort(key=lambda r: r.gpus)
        gpus = [r.gpus for r in line]
        speed.plot(gpus, [r.tflops_per_gpu for r in line], marker="o", label=label)
        duration.plot(gpus, [r.time_to_train_s / 86400 if trained else r.iteration_time_s for r in line],
                      marker="o", label=label)
    speed.set(xlabel="GPUs", ylabel="TFLOP/s per GPU", title="Throughput per GPU")
    tokens = next((r.tokens for r in rows if r.tokens is not None), None)
    duration.set(xlabel="GPUs", ylabel="days" if trained else "seconds", yscale="log",
                 title=f"Time to train {tokens:.3g} tokens" if trained else "Iteration time")
    ticks = sorted({r.gpus for line in lines.values() for r in line})
    for axes in (speed, duration):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [str(t) for t in ticks])
        axes.xaxis.set_minor_locator(NullLocator())  # the GPU counts only: no 2^k.5 labels between them
        axes.grid(True, which="both", alpha=0.3)
    if lines:
        speed.legend(fontsize="small")
    figure.tight_layout()
    metadata = {"Date": None} if suffix == ".svg" else {"Software": None}
    io.write_atomic(path, lambda temporary: figure.savefig(temporary, format=suffix[1:], dpi=120, metadata=metadata))
