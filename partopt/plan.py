"""The plan: what `optimize` returns and `partopt solve -o` writes (format `partopt.plan` v1)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from partopt import io
from partopt.errors import InstanceError
from partopt.graph import Graph
from partopt.sharding import Placement, fmt, parse_placement

FORMAT = "partopt.plan"
VERSION = 1


@dataclass(frozen=True)
class OpStrategy:
    """The sharding a plan chose for one op — the recorded part of its `sharding.Strategy`, prices
    left out — with DTensor's vocabulary: a placement (`Shard(dim)`, `Replicate()`, `Partial()` per
    mesh axis) for each input and the output. The plan file writes placements as text, `[S(b), R]`."""

    kind: str
    tensor: str  # the op's output tensor
    axes: tuple[str | None, ...]  # per mesh axis: the dim it splits, or None (replicated over it)
    inputs: tuple[Placement, ...]  # the placement the op reads each input in, in the op's input order
    output: Placement  # its output's placement (Partial: a pending sum)
    explanation: str  # one readable line: what it splits and what that costs


@dataclass(frozen=True)
class ParamPlacement:
    """Where a plan keeps one parameter: its placement, and the mesh axes its optimizer state is split over (ZeRO)."""

    placement: Placement
    zero_axes: tuple[int, ...] = ()


@dataclass
class StagePlan:
    """One pipeline stage: its layers, devices, logical mesh, time, memory and shardings."""

    layers: list[int]  # [first, last] DP layer, inclusive
    graph_layers: list[Any]  # the graph's layer tags it covers
    submesh: list[int]  # [nodes, devices per node]
    logical_mesh: list[int]  # [a, b]
    devices: list[int]  # global device ids, node-major
    stage_time_s: float  # forward + backward of one microbatch, sends included
    forward_s: float  # the forward's share of stage_time_s (split by FLOPs), for schedules and drawings
    send_time_s: float  # point-to-point of boundary activations and their gradients, per microbatch
    sync_time_s: float  # per iteration: gradient synchronisation + optimizer step
    memory_bytes: float  # per device, with its in-flight microbatches (interleaved: all chunks on its devices)
    inflight_microbatches: float  # of the schedule (`schedules.inflight`); interleaved: chunk-microbatches / v
    breakdown: dict[str, Any]  # compute_s, comm_s by kind, sync_s by kind, optimizer_s, param/activation bytes
    ops: dict[str, OpStrategy]  # op name -> its sharding, in the stage's op order
    params: dict[str, ParamPlacement]  # parameter -> its placement
    recompute: str = "none"  # activation recomputation of its layers: none | selective | full
    weight_s: float | None = None  # the weight-gradient share of stage_time_s (split by FLOPs): zero-bubble's W pass


@dataclass
class Plan:
    graph: str
    cluster: str
    nodes: int
    devices_per_node: int
    iteration_time_s: float
    num_microbatches: int
    microbatch_size: int
    stages: list[StagePlan]
    memory_peak_bytes: float
    throughput: dict[str, float]  # samples_per_s, tflops_per_device
    solver: dict[str, Any]  # backend, status, gap, time_s, ilps, planning_time_s
    schedule: str = "1f1b"  # the pipeline schedule (`schedules.SCHEDULES`); files written before it: 1f1b
    virtual_stages: int = 1  # v: interleaved plans list S·v virtual stages, chunk j on the devices of stage j mod S
    format: str = FORMAT
    version: int = VERSION
    options: dict[str, Any] = field(default_factory=dict)
    batch_dim: str | None = None
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"dims", "shape" (one microbatch), "role", "dtype"}
    matmul_dtype: str | None = None  # the GEMM precision priced (`Graph.matmul_dtype`); None: each op at its tensors'
    architecture: dict[str, Any] | None = None  # the graph's `architecture`, for exports; None: it has none
    optimizer: str | None = None  # the optimizer whose state was priced (`Graph.optimizer`); None: files before it
    platform: str | None = None  # what the cluster's devices run (`Device.platform`); None: files before the record


def _merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Breakdowns of chunks on one device group added up: seconds and bytes sum (by kind where they are
    split by kind), the working set and the largest transient are the largest (chunks run one at a time)."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for bd in parts for k in bd):
        values = [bd[key] for bd in parts if key in bd]
        if isinstance(values[0], dict):
            out[key] = {k: sum(v.get(k, 0.0) for v in values) for k in dict.fromkeys(k for v in values for k in v)}
        else:
            out[key] = max(values) if key in ("working_bytes", "transient_bytes") else sum(values)
    return out


def by_device(plan: Plan) -> Plan:
    """An interleaved plan seen per device group: stage i gathers its chunks i, i + S, … (times, sends, sync
    and breakdowns added, `_merged`; ops and parameters together; layers from its first chunk's first to its
    last chunk's last); any other plan as it is. What `explain` and `draw` show per device."""
    v = plan.virtual_stages
    if v == 1:
        return plan
    S = len(plan.stages) // v
    merged = []
    for i in range(S):
        parts = plan.stages[i::S]
        weights = [p.weight_s for p in parts]
        merged.append(replace(parts[0], **{name: sum(getattr(p, name) for p in parts)
                                           for name in ("stage_time_s", "forward_s", "send_time_s", "sync_time_s")},
                              layers=[parts[0].layers[0], parts[-1].layers[1]],
                              graph_layers=[parts[0].graph_layers[0], parts[-1].graph_layers[1]],
                              breakdown=_merged([p.breakdown for p in parts]),
                              ops={k: op for p in parts for k, op in p.ops.items()},
                              params={k: x for p in parts for k, x in p.params.items()},
                              weight_s=None if None in weights else sum(weights)))
    return replace(plan, stages=merged)


def tensor_table(g_mb: Graph) -> dict[str, dict[str, Any]]:
    """A plan's `tensors` record of a graph at microbatch size (`intra.with_batch`): each tensor's
    dims, one microbatch's shape, role and dtype — what exporters and checks read instead of the graph."""
    return {name: {"dims": list(t.dims), "shape": [g_mb.dims[d] for d in t.dims], "role": t.role,
                   "dtype": g_mb.dtype_of(name)} for name, t in g_mb.tensors.items()}


def records(recorded: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Whether a plan's entry for a tensor says what the graph's (`tensor_table`) does: dims, shape and role, and
    its dtype when it records one (plans written before dtypes were recorded have none)."""
    return all(recorded.get(k) == v for k, v in expected.items() if k != "dtype" or "dtype" in recorded)


def _op_to_dict(op: OpStrategy) -> dict[str, Any]:
    return {"kind": op.kind, "tensor": op.tensor, "axes": list(op.axes), "inputs": [fmt(p) for p in op.inputs],
            "output": fmt(op.output), "explanation": op.explanation}


def _op_from_dict(data: dict[str, Any], where: str) -> OpStrategy:
    inputs = tuple(parse_placement(text, f"{where}.inputs[{j}]") for j, text in enumerate(data["inputs"]))
    return OpStrategy(data["kind"], data["tensor"], tuple(data["axes"]), inputs,
                      parse_placement(data["output"], f"{where}.output"), data["explanation"])


def _param_to_dict(param: ParamPlacement) -> dict[str, Any]:
    return {"placement": fmt(param.placement), "zero_axes": list(param.zero_axes)}


def _param_from_dict(data: dict[str, Any], where: str) -> ParamPlacement:
    return ParamPlacement(parse_placement(data["placement"], f"{where}.placement"), tuple(data.get("zero_axes", ())))


def _stage_to_dict(stage: StagePlan) -> dict[str, Any]:
    data = asdict(replace(stage, ops={}, params={}))  # keeps the fields' order; placements are written as text
    if stage.weight_s is None:  # a plan that does not split the backward (read from an older file)
        del data["weight_s"]
    data["ops"] = {name: _op_to_dict(op) for name, op in stage.ops.items()}
    data["params"] = {name: _param_to_dict(p) for name, p in stage.params.items()}
    return data


def _stage_from_dict(data: dict[str, Any], recompute: str, where: str) -> StagePlan:
    ops = {name: _op_from_dict(op, f"{where}.ops[{name!r}]") for name, op in data["ops"].items()}
    params = {name: _param_from_dict(p, f"{where}.params[{name!r}]") for name, p in data["params"].items()}
    return StagePlan(**{"recompute": recompute, **data, "ops": ops, "params": params})


def stores_padded(plan: Plan) -> bool:
    """Whether `plan` may store a parameter split along a dim its split does not divide, padded: a Megatron-style
    plan in ZeRO-3's layout (`options.megatron.shard_weights`; docs/COSTMODEL.md §5 "Padded shards")."""
    return bool(plan.options.get("megatron", {}).get("shard_weights", False))


# How long planning took is a fact of the run, not of the plan: kept in memory (the CLI prints it),
# left out of the file, so the same inputs give the same file on any machine, load and worker count.
WALL_TIMES = ("time_s", "ilp_time_s")


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The file form of `plan`: format and version first, then the fields in dataclass order, without
    the wall times of the run that found it (`WALL_TIMES`)."""
    data = asdict(replace(plan, stages=[]))
    data["solver"] = {k: v for k, v in data["solver"].items() if k not in WALL_TIMES}
    data["stages"] = [_stage_to_dict(s) for s in plan.stages]
    head = {"format": data.pop("format"), "version": data.pop("version")}
    return {**head, **data}


def plan_from_dict(data: Any, where: str = "plan") -> Plan:
    """A Plan from its file form, checked against the packaged schema (`partopt/schemas/plan.schema.json`),
    its placements parsed; errors name `where` and the JSON path. Semantic checks are `partopt.validate`'s.

    A file partopt wrote reads back to a plan whose `plan_text` is that file, byte for byte."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        found = (data.get("format"), data.get("version")) if isinstance(data, dict) else (None, None)
        raise InstanceError(f"not a {FORMAT} v{VERSION} file (format {found[0]!r}, version {found[1]!r})",
                            f"{where}: $.format", "write plans with `partopt solve -o`")
    io.validate_against_schema(data, "plan", where)
    # plans written before per-stage modes carry one flag in their options: true meant full recomputation
    default = "full" if data.get("options", {}).get("recompute") is True else "none"
    stages = [_stage_from_dict(s, default, io.at(where, f"$.stages[{i}]")) for i, s in enumerate(data["stages"])]
    rest = {k: v for k, v in data.items() if k not in ("stages", "format", "version")}
    return Plan(stages=stages, **rest)


def plan_text(plan: Plan) -> str:
    """The plan file's text (indented JSON); a non-finite number is refused, as the reader would."""
    try:
        return json.dumps(plan_to_dict(plan), indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    except ValueError:
        raise InstanceError("the plan holds a number that is not finite (nan or inf)", "plan",
                            "report this: a plan's figures are finite") from None


def write_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan file atomically (a temporary file renamed onto `path`)."""
    io.write_text(plan_text(plan), path)


def read_plan(path: str | Path) -> Plan:
    """Load a plan file and check it against the plan schema (see `partopt.validate` for the rest)."""
    return plan_from_dict(io.load_json(path), str(path))
