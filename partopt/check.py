"""Re-derive a plan's figures from scratch and list those that differ (what `partopt check` reports).

The plan is first validated (`partopt.validate`), then priced again by `partopt.evaluate.evaluate`
on the graph and cluster with its own options (backend, memory reserve, layers, recompute): the
devices each stage gets, the graph layers it covers, its latency, forward share, sends, synchronisation, memory and in-flight
microbatches, its breakdown's figures, the iteration time, peak memory and throughput must all come back within a
relative 1e-6, every stage's memory must fit the device's budget, and every op and parameter of a stage's layers
must have its entry (pricing would fill one left out, and an export would drop it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from partopt import costmodel
from partopt.evaluate import evaluate, uniform
from partopt.cluster import Cluster
from partopt.errors import InfeasibleError
from partopt.graph import Graph
from partopt.plan import Plan
from partopt.solvers import BACKENDS
from partopt.io import at
from partopt.validate import check_against, check_plan, close, mismatches

PLAN_FIELDS = ("num_microbatches", "microbatch_size", "iteration_time_s", "memory_peak_bytes")
STAGE_FIELDS = ("layers", "graph_layers", "submesh", "logical_mesh", "devices", "stage_time_s", "forward_s",
                "send_time_s", "sync_time_s", "memory_bytes", "inflight_microbatches")


@dataclass(frozen=True)
class Difference:
    """One figure of the plan file that the re-derivation does not reproduce."""

    place: str  # JSON path in the plan file
    stored: Any
    derived: Any
    basis: str = "re-derived"  # where `derived` comes from: pricing the plan again, or the plan's own other figures
    note: str | None = None  # instead of two figures: why the plan cannot be priced again

    def line(self) -> str:
        if self.note is not None:
            return f"{self.place}: {self.note}"
        return f"{self.place}: the plan says {self.stored!r}, {self.basis} {self.derived!r}"


def _same(stored: Any, derived: Any) -> bool:
    if isinstance(stored, (int, float)) and isinstance(derived, (int, float)) and not isinstance(stored, bool):
        return close(float(stored), float(derived))
    return stored == derived


def _figures(record: dict[str, Any], path: str) -> dict[str, float]:
    """The numbers of a nested record (a stage's breakdown) by their JSON paths."""
    found = {}
    for key, value in record.items():
        if isinstance(value, dict):
            found.update(_figures(value, f"{path}.{key}"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found[f"{path}.{key}"] = value
    return found


def compare(plan: Plan, derived: Plan) -> list[Difference]:
    """The figures of `plan` that `derived` (the same plan priced again) does not reproduce."""
    found = [Difference(f"$.{name}", getattr(plan, name), getattr(derived, name))
             for name in PLAN_FIELDS if not _same(getattr(plan, name), getattr(derived, name))]
    found += [Difference(f"$.throughput.{k}", plan.throughput[k], derived.throughput[k])
              for k in derived.throughput if k in plan.throughput and not _same(plan.throughput[k], derived.throughput[k])]
    for i, (mine, theirs) in enumerate(zip(plan.stages, derived.stages)):
        found += [Difference(f"$.stages[{i}].{name}", getattr(mine, name), getattr(theirs, name))
                  for name in STAGE_FIELDS if not _same(getattr(mine, name), getattr(theirs, name))]
        # the breakdown's figures (what `explain` shows) where the re-derivation has them: older files lack some
        stored, again = (_figures(stage.breakdown, f"$.stages[{i}].breakdown") for stage in (mine, theirs))
        found += [Difference(path, value, again[path]) for path, value in stored.items()
                  if path in again and not _same(value, again[path])]
        # every op and parameter of the stage's layers has its entry: pricing fills one left out, an export drops it
        found += [Difference(f"$.stages[{i}].{field}.{name}", "no entry", f"an entry: {what} has one")
                  for field, what in (("ops", "every op of the stage's layers"), ("params", "every parameter they read"))
                  for name in getattr(theirs, field) if name not in getattr(mine, field)]
    return found


def differences(plan: Plan, graph: Graph, cluster: Cluster, where: str = "plan",
                cost_model: costmodel.CostModel | None = None) -> list[Difference]:
    """Every figure of `plan` that does not hold on `graph` and `cluster` under `cost_model`
    (default analytical; empty: consistent).

    A Megatron-style plan (`evaluate.uniform`, `solve --search megatron`) is priced again as that
    layout; any other as written (`evaluate.evaluate`). An invalid plan raises InstanceError (see
    `partopt.validate`); a plan whose re-derived memory does not fit is a difference, not an error."""
    check_plan(plan, where, figures=False)
    check_against(plan, graph, cluster, where)
    found = [Difference(*mismatch, basis="its other figures give") for mismatch in mismatches(plan)]
    priced_by, model = plan.options.get("cost_model", "analytical"), (cost_model or costmodel.ANALYTICAL).key
    if priced_by != model:
        return [*found, Difference("$.options.cost_model", priced_by,
                                   f"{model} (give the cost model that priced the plan: --profile FILE)")]
    reserve = plan.options.get("memory_reserve", costmodel.DEFAULT_MEMORY_RESERVE)
    budget = costmodel.memory_budget(cluster.device, reserve)
    found += [Difference(f"$.stages[{i}].memory_bytes", stage.memory_bytes, budget, "over the device's budget of")
              for i, stage in enumerate(plan.stages) if stage.memory_bytes > budget * (1 + 1e-12)]
    backend = plan.solver.get("backend")
    options = {"memory_reserve": reserve, "cost_model": cost_model, **({"backend": backend} if backend in BACKENDS else {})}
    try:
        if "megatron" in plan.options:  # a uniform layout: priced again by the procedure that made it
            layout = plan.options["megatron"]
            derived = uniform(graph, cluster, layout["tp"], layout["pp"], layout["dp"], plan.num_microbatches,
                              layout["zero"], layout.get("sequence_parallel", False), plan.schedule, plan.virtual_stages,
                              recompute=plan.stages[0].recompute, shard_weights=layout.get("shard_weights", False),
                              expert_parallel=layout.get("expert_parallel", 1),
                              overlap=plan.options.get("overlap", False),
                              tp_comm_overlap=layout.get("tp_comm_overlap", False),
                              state_layout=plan.options.get("state_layout", "zero"),
                              stage_layers=layout.get("stage_layers"), where=at(where, "$.options.megatron"), **options)
        else:
            derived = evaluate(graph, cluster, plan, where=where, **options)
    except InfeasibleError as err:
        place = (err.where or "$.stages").removeprefix(f"{where}: ")  # the CLI names the file
        return [*found, Difference(place, None, None, note=f"cannot be priced again: {err.cause} (hint: {err.hint})")]
    return found + [d for d in compare(plan, derived) if d not in found]
