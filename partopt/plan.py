"""The plan: what `optimize` returns and `partopt solve -o` writes (format `partopt.plan` v1)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partopt.errors import InstanceError

FORMAT = "partopt.plan"
VERSION = 1


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
    memory_bytes: float  # per device, with its in-flight microbatches
    inflight_microbatches: int
    breakdown: dict[str, Any]  # compute_s, comm_s by kind, sync_s by kind, optimizer_s, param/activation bytes
    ops: dict[str, dict[str, Any]]  # op -> {"kind", "tensor", "axes", "inputs", "output", "explanation"}
    params: dict[str, dict[str, Any]]  # param -> {"placement", "zero_axes"}
    recompute: str = "none"  # activation recomputation of its layers: none | selective | full


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
    format: str = FORMAT
    version: int = VERSION
    options: dict[str, Any] = field(default_factory=dict)
    batch_dim: str | None = None
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"dims", "shape" (one microbatch), "role"}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    data = asdict(plan)
    head = {"format": data.pop("format"), "version": data.pop("version")}
    return {**head, **data}


def plan_from_dict(data: dict[str, Any], where: str = "plan") -> Plan:
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise InstanceError(f"not a {FORMAT} v{VERSION} file (format {data.get('format')!r}, "
                            f"version {data.get('version')!r})", where, "write plans with `partopt solve -o`")
    try:
        # plans written before per-stage modes carry one flag in their options: true meant full recomputation
        default = "full" if data.get("options", {}).get("recompute") is True else "none"
        stages = [StagePlan(**{"recompute": default, **s}) for s in data["stages"]]
        rest = {k: v for k, v in data.items() if k not in ("stages", "format", "version")}
        return Plan(stages=stages, **rest)
    except (TypeError, KeyError) as err:
        raise InstanceError(f"malformed plan: {err}", where, "compare with docs/FORMAT.md") from None


def write_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan_to_dict(plan), indent=1) + "\n")


def read_plan(path: str | Path) -> Plan:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise InstanceError(f"cannot read: {err.strerror}", str(path)) from None
    except json.JSONDecodeError as err:
        raise InstanceError(f"line {err.lineno} column {err.colno}: invalid JSON: {err.msg}", str(path)) from None
    return plan_from_dict(data, str(path))
