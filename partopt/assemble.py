"""Plan assembly: fixed stages with their layers' solved shardings become a `Plan`.

The stages' devices are placed (Alpa's order), each op's and parameter's strategy is written in the
names of its own layer (structurally identical layers share one solve), and times and memory come
from the stage accountant (`partopt.stages`), so the plan adds up as the stage DP's table did.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from partopt import costmodel, intra
from partopt.cluster import Cluster
from partopt.graph import Graph, Op
from partopt.layering import Layering
from partopt.plan import OpStrategy, ParamPlacement, Plan, StagePlan, tensor_table
from partopt.pricing import LayerCost, Stats
from partopt.sharding import Shard, forward_executed
from partopt.shared import shared_params
from partopt.schedules import plan_iteration
from partopt.stages import (End, Pipeline, StageSpec, boundary_bytes, combined, executed_flops, recomputed_flops, split,
                            totals, training_flops, weight_flops)


def place(cluster: Cluster, submeshes: list[tuple[int, int]]) -> list[list[int]]:
    """Alpa's placement: whole-node submeshes take nodes in order, then (1, m) pieces pack the rest."""
    m = cluster.devices_per_node
    order = sorted(range(len(submeshes)), key=lambda s: (-submeshes[s][0] * submeshes[s][1], s))
    free = [m] * cluster.nodes  # free devices per node, filled left to right
    result: list[list[int]] = [[] for _ in submeshes]
    for s in order:
        n, k = submeshes[s]
        if k == m:
            nodes = [i for i, f in enumerate(free) if f == m][:n]
            for node in nodes:
                free[node] = 0
                result[s].extend(range(node * m, node * m + m))
        else:
            node = next(i for i, f in enumerate(free) if f >= k)
            start = node * m + (m - free[node])
            result[s] = list(range(start, start + k))
            free[node] -= k
    return result


def _dim_map(graph: Graph, solved: Sequence[Op], ops: Sequence[Op]) -> dict[str, str]:
    """Dim names of the solved layer's ops -> the same positions in `ops` (a structurally identical layer)."""
    rename: dict[str, str] = {}
    for a, b in zip(solved, ops):
        for ta, tb in zip((*a.inputs, a.output), (*b.inputs, b.output)):
            rename.update(zip(graph.tensors[ta].dims, graph.tensors[tb].dims))
    return rename


def _renamed_placement(placement, rename: dict[str, str]):
    return tuple(Shard(rename.get(p.dim, p.dim)) if isinstance(p, Shard) else p for p in placement)


def _renamed(strategy, rename: dict[str, str]):
    return dataclasses.replace(strategy, axes=tuple(rename.get(d, d) if d else d for d in strategy.axes),
                               inputs=tuple(_renamed_placement(p, rename) for p in strategy.inputs),
                               output=_renamed_placement(strategy.output, rename))


def params_of(graph: Graph, ops: Sequence[Op]) -> list[str]:
    """Parameters in order of first use by `ops` (the order `intra.build` gives them nodes)."""
    return list(dict.fromkeys(t for op in ops for t in op.inputs if graph.tensors[t].role == "param"))


def pipeline_of(graph: Graph, cluster: Cluster, layering: Layering, count: int, overlap: bool) -> Pipeline:
    """What the stages of a plan with `count` microbatches share (see `stages.Pipeline`)."""
    batch = graph.dims[graph.batch_dim]
    return Pipeline(layering, boundary_bytes(graph, layering), batch // count, batch,
                    shared_params(graph, layering.base), cluster, overlap, graph)


def assemble(graph: Graph, cluster: Cluster, layering: Layering, options, count: int,
             specs: list[StageSpec], rows: list[list[LayerCost]], stats: Stats, elapsed: float,
             schedule: str = "1f1b", virtual_stages: int = 1, pipe: Pipeline | None = None) -> Plan:
    """The plan of fixed stages, each with its base layers' costs (`rows[i]`, on the stage's mesh),
    run under `schedule` (interleaved: `specs` are the S·v virtual stages in model order, chunk j on
    the devices of stage j mod S, each spec's `inflight` its devices'). `pipe`: the count's pipeline when the
    caller has it (`pipeline_of`; its stage sums are kept in it), else made here.

    Stage latency and memory come from the stage accountant, as in the stage DP's table, so a plan
    evaluated again prices to the same number.
    """
    pipe = pipe or pipeline_of(graph, cluster, layering, count, options.overlap)
    batch, mb = pipe.batch, pipe.mb
    num_stages = len(specs) // virtual_stages
    placed = place(cluster, [spec.submesh for spec in specs[:num_stages]])
    ends = [End(spec.submesh, spec.shape, frozenset(d // cluster.devices_per_node for d in devices))
            for spec, devices in zip(specs[:num_stages], placed)]
    stages, parts = [], []
    recomputed = 0.0
    for j, (spec, row) in enumerate(zip(specs, rows)):  # chunk j runs on stage j mod S's devices, sends to j + 1's
        devices = placed[j % num_stages]
        receiver = ends[(j + 1) % num_stages] if j + 1 < len(specs) else None
        sums = totals(row, pipe, spec.first, spec.last, ends[j % num_stages], receiver, chunk=virtual_stages > 1)
        parts.append(sums)
        first, last = layering.groups[spec.first][0], layering.groups[spec.last][1]
        comm: dict[str, float] = {}
        sync: dict[str, float] = {}
        ops, param_info = {}, {}
        for b in range(first, last + 1):
            sharding = row[b].sharding
            for k, v in sharding.breakdown.comm_s.items():
                comm[k] = comm.get(k, 0.0) + v
            for k, v in sharding.breakdown.sync_s.items():
                sync[k] = sync.get(k, 0.0) + v
            # a structurally identical layer shares the solve: its choices apply position by position,
            # with the solved layer's dim names translated to this layer's
            rename = _dim_map(graph, [graph.op_index[oc.op] for oc in sharding.ops], layering.base[b])
            for op, oc in zip(layering.base[b], sharding.ops):
                strategy = _renamed(oc.strategy, rename)
                ops[op.name] = OpStrategy(op.kind, op.output, strategy.axes, strategy.inputs, strategy.output,
                                          intra.describe(graph, op, strategy, oc.collectives, sharding.mesh))
            for tensor, pc in zip(params_of(graph, layering.base[b]), sharding.params):
                placement = tuple(_renamed_placement(pc.strategy.placement, rename))
                param_info[tensor] = ParamPlacement(placement, pc.strategy.zero_axes)
        state = {part: sum(row[b].sharding.breakdown.state_bytes[part] for b in range(first, last + 1))
                 for part in intra.STATE_PARTS}
        optimizer_s = sum(row[b].sharding.breakdown.optimizer_s for b in range(first, last + 1))
        if sums.fix is not None:  # a parameter shared by several layers: one copy here, its gradient summed across stages
            for part, delta in zip(intra.STATE_PARTS, sums.fix.state_bytes):
                state[part] += delta
            for kind, delta in sums.fix.sync_s.items():
                if kind == "optimizer":
                    optimizer_s += delta
                else:
                    sync[kind] = sync.get(kind, 0.0) + delta
        stage_ops = [op for j in range(spec.first, spec.last + 1) for op in layering.ops(j)]
        forward_flops = sum(forward_executed(graph, op) for op in stage_ops)
        rerun = recomputed_flops(graph, layering.base[first:last + 1], spec.recompute)
        executed = executed_flops(graph, stage_ops) + rerun
        recomputed += rerun
        forward_s, weight_s = split(sums.latency_s, forward_flops / max(executed, 1e-300),
                                    weight_flops(graph, stage_ops) / max(executed, 1e-300))
        latency = sums.latency_s
        tags = [stage_ops[0].layer, stage_ops[-1].layer]
        stages.append(StagePlan(
            layers=[spec.first, spec.last], graph_layers=tags, submesh=list(spec.submesh),
            logical_mesh=list(spec.shape), devices=devices, stage_time_s=latency, forward_s=float(forward_s),
            send_time_s=sums.send_s, sync_time_s=sums.sync_s, memory_bytes=sums.memory_bytes(spec.inflight),
            inflight_microbatches=spec.inflight, recompute=spec.recompute,
            weight_s=float(weight_s),
            breakdown={"compute_s": sum(row[b].sharding.breakdown.compute_s for b in range(first, last + 1)),
                       "comm_s": comm, "sync_s": sync,
                       "optimizer_s": optimizer_s,
                       "recompute_s": sum(row[b].sharding.breakdown.recompute_s for b in range(first, last + 1)),
                       "prefetched_s": sum(row[b].sharding.breakdown.prefetched_s for b in range(first, last + 1)),
                       **({"tp_overlapped_s": tp_hidden} if (tp_hidden := sum(
                           row[b].sharding.breakdown.tp_overlapped_s for b in range(first, last + 1))) else {}),
                       "param_bytes": sums.param_bytes, "activation_bytes": sums.activation_bytes,
                       "working_bytes": sums.working_bytes,
                       "transient_bytes": max(row[b].sharding.breakdown.transient_bytes for b in range(first, last + 1)),
                       "state_bytes": state,
                       "overlapped_s": max(0.0, sum(sync.values()) + optimizer_s - sums.sync_s) if options.overlap else 0.0,
                       **({"send_p2p_s": sums.p2p_s, "send_hidden_s": sums.hidden_s} if sums.p2p_s else {})},
            ops=ops, params=param_info))
    if virtual_stages > 1:  # a chunk's devices hold every chunk on them
        for j, stage in enumerate(stages):
            stage.memory_bytes = combined(parts[j % num_stages::num_stages]).memory_bytes(specs[j].inflight)
    iteration = plan_iteration([s.stage_time_s for s in stages], [s.forward_s for s in stages],
                               [s.weight_s for s in stages], [s.sync_time_s for s in stages], count, schedule,
                               virtual_stages, [s.breakdown.get("send_p2p_s", 0.0) for s in stages])
    flops = training_flops(graph)
    executed = executed_flops(graph) + recomputed
    tensors = tensor_table(intra.with_batch(graph, mb))
    return Plan(
        graph=graph.name, cluster=cluster.name, nodes=cluster.nodes, devices_per_node=cluster.devices_per_node,
        iteration_time_s=float(iteration), num_microbatches=count, microbatch_size=mb, stages=stages,
        memory_peak_bytes=float(max(s.memory_bytes for s in stages)),
        throughput={"samples_per_s": float(batch / iteration),
                    "tflops_per_device": float(flops / iteration / cluster.num_devices / 1e12),
                    "hardware_tflops_per_device": float(executed / iteration / cluster.num_devices / 1e12)},
        solver={"backend": options.backend, "status": stats.status,
                "gap": stats.gap if math.isfinite(stats.gap) else None,  # None: a layer ILP proved no bound
                "ilps": stats.ilps, "ilp_time_s": stats.solve_time_s, "time_s": elapsed,
                "dp_rounds": stats.dp_rounds, "microbatch_counts": stats.counts or [count],
                "recompute_modes": {str(c): list(m) for c, m in stats.recompute_modes.items()},
                "dropped_options": stats.dropped, "timeouts": stats.timeouts},
        options={"microbatches": options.microbatches if isinstance(options.microbatches, (int, str))
                 else list(options.microbatches), "layers": options.layers,
                 "logical_shapes": options.logical_shapes if isinstance(options.logical_shapes, str)
                 else [list(x) for x in options.logical_shapes],
                 "submesh_family": options.submesh_family, "memory_reserve": options.memory_reserve,
                 "intra_only": options.intra_only, "inter_only": options.inter_only,
                 "data_parallel_only": options.data_parallel_only, "stage_data_parallel": options.stage_data_parallel,
                 "recompute": options.recompute, "schedule": options.schedule, "overlap": options.overlap, "cost_model": (options.cost_model or costmodel.ANALYTICAL).key,
                 **({"state_layout": options.state_layout} if options.state_layout != "zero" else {})},
        schedule=schedule, virtual_stages=virtual_stages, batch_dim=graph.batch_dim, tensors=tensors,
        matmul_dtype=graph.matmul_dtype, architecture=graph.architecture, optimizer=graph.optimizer,
        platform=cluster.device.platform)
