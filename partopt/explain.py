"""Where a plan's time and memory go, stage by stage (what `partopt explain` prints).

Each stage's rows add up to the plan's iteration time: its microbatches' compute, collectives
and sends (B × per microbatch), less the weight gathers prefetching hides and the sends compute
hides, its gradient synchronisation and optimizer step, less what the backward hides of it, and
the time it waits — the pipeline bubble and the wait for slower stages' synchronisation. Memory
rows add up to the stage's per-device memory: weights, gradients, optimizer state, and the
activations of its in-flight microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass

from partopt import costmodel, intra
from partopt.cluster import Cluster
from partopt.errors import InstanceError
from partopt.graph import Graph
from partopt.plan import Plan, by_device
from partopt.sharding import op_strategies
from partopt.validate import check_plan


@dataclass(frozen=True)
class StageExplanation:
    """One stage: seconds per iteration and bytes per device by cause, and each op's line."""

    index: int
    time_s: dict[str, float]  # cause -> seconds per iteration; sums to the iteration time
    memory_bytes: dict[str, float]  # cause -> bytes per device; sums to the stage's memory
    ops: list[str]  # one explanation line per op, in plan order


def _label(kind: str) -> str:
    return kind.replace("_", "-")


def explain(plan: Plan) -> list[StageExplanation]:
    """The time and memory accounts of every stage of `plan`, which must be consistent (`check_plan`):
    its stored figures are shown, so figures that disagree are refused, not printed."""
    check_plan(plan)
    B = plan.num_microbatches
    result = []
    for i, stage in enumerate(by_device(plan).stages):  # interleaved: one account per device group
        bd = stage.breakdown
        time_s = {"compute": B * bd["compute_s"]}
        if bd.get("recompute_s"):
            time_s["recomputation (per microbatch)"] = B * bd["recompute_s"]
        for kind, seconds in sorted(bd["comm_s"].items()):
            time_s[f"{_label(kind)} (per microbatch)"] = B * seconds
        if bd.get("prefetched_s"):
            time_s["weight gathers hidden by prefetch"] = -B * bd["prefetched_s"]
        if bd.get("tp_overlapped_s"):
            time_s["tensor-parallel collectives hidden under the GEMMs"] = -B * bd["tp_overlapped_s"]
        if stage.send_time_s:
            time_s["point-to-point send"] = B * stage.send_time_s
        if bd.get("send_hidden_s"):
            time_s["sends hidden under compute"] = -B * bd["send_hidden_s"]
        for kind, seconds in sorted(bd["sync_s"].items()):
            time_s[f"gradient {_label(kind)} (per iteration)"] = seconds
        time_s["optimizer step"] = bd["optimizer_s"]
        if bd.get("overlapped_s"):
            time_s["gradient reductions and weight gathers hidden under compute"] = -bd["overlapped_s"]
        idle = plan.iteration_time_s - B * stage.stage_time_s - stage.sync_time_s
        time_s["pipeline bubble and waiting"] = 0.0 if abs(idle) < 1e-12 * plan.iteration_time_s else idle
        memory = {f"{part} state" if part == "optimizer" else part: size
                  for part, size in (bd.get("state_bytes") or {"parameter state": bd["param_bytes"]}).items()}
        memory[f"activations × {stage.inflight_microbatches:g} in flight"] = (
            stage.inflight_microbatches * bd["activation_bytes"])
        if bd.get("working_bytes"):
            memory["recomputation working set and transient buffers"] = bd["working_bytes"]
        result.append(StageExplanation(i, time_s, memory, [op.explanation for op in stage.ops.values()]))
    return result


@dataclass(frozen=True)
class OpTime:
    """One op of a stage priced again at the plan's strategy: per microbatch on one device, its compute (forward and
    backward), its in-op collectives, and the FLOPs its kernels run."""

    stage: int
    op: str
    kind: str
    compute_s: float
    comm_s: float
    flops: float

    @property
    def flop_rate(self) -> float:
        """FLOP/s its kernels reach (0 for an op with no compute time, a view)."""
        return self.flops / self.compute_s if self.compute_s else 0.0


def op_times(plan: Plan, graph: Graph, cluster: Cluster, cost_model: costmodel.CostModel | None = None,
             ) -> list[list[OpTime]]:
    """Per stage (per device group, as `explain`), each op priced again on the graph and cluster the plan was made
    for, costliest first: where a stage's compute goes, which the plan's totals do not say. The plan must hold on
    them (`validate.check_against`) and have been priced by `cost_model` (None: the analytical model)."""
    priced_by, model = plan.options.get("cost_model", "analytical"), (cost_model or costmodel.ANALYTICAL).key
    if priced_by != model:
        raise InstanceError(f"the plan was priced by the {priced_by} cost model, not the {model} one",
                            "$.options.cost_model", "give the profile it was priced with (--profile)")
    g_mb = intra.with_batch(graph, graph.dims[graph.batch_dim] // plan.num_microbatches) if graph.batch_dim else graph
    result = []
    with costmodel.using(cost_model):
        for i, stage in enumerate(by_device(plan).stages):
            mesh = cluster.logical_mesh(tuple(stage.submesh), tuple(stage.logical_mesh))
            times = []
            for name, info in stage.ops.items():
                op = g_mb.op_index[name]
                chosen = next(s for s in op_strategies(g_mb, op, mesh) if s.axes == tuple(info.axes))
                times.append(OpTime(i, name, op.kind, chosen.compute_s, chosen.comm_s, chosen.flops))
            result.append(sorted(times, key=lambda t: -(t.compute_s + t.comm_s)))
    return result
