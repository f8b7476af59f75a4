"""Semantic checks of a plan: what its schema cannot say, on its own and against a graph and a cluster.

`check_plan` needs only the plan: stages cover the DP layers once and in order, submeshes are
shapes of the plan's cluster that its stages tile exactly with distinct devices, logical meshes
factor their submesh, placements have one entry per mesh axis and split their tensor's dims (they were
parsed when the file was read, `partopt.plan`), the stages place every parameter and make every activation
of the plan's `tensors`, and the stored figures agree with each other
(memory = state + in-flight activations + working set, iteration = Σt + (B − 1)·max t + max sync).
`check_against` adds the graph and the cluster: the plan was made for them, its microbatches
divide the graph's batch, its stages cover the graph's layers, and every op and parameter it
names exists, sits in its stage and has a strategy that is legal for its dims on that mesh.
Each problem is an InstanceError naming the file, the JSON path, what is wrong and what to do.
`cluster_warnings` and `plan_warnings` list absurd but valid magnitudes (an iteration beyond a year, a link below 1 byte/s),
`solver_warnings` the layer ILPs a time limit stopped.
"""

from __future__ import annotations

from typing import Any

from partopt import intra
from partopt.cluster import Cluster
from partopt.errors import InstanceError
from partopt.graph import Graph
from partopt.io import at
from partopt.layering import build_layers
from partopt.plan import OpStrategy, ParamPlacement, Plan, StagePlan, read_plan, records, stores_padded, tensor_table
from partopt.schedules import check_schedule, inflight, plan_iteration
from partopt.sharding import Placement, Shard, fmt, op_strategies, param_strategies

TOLERANCE = 1e-6  # relative: stored figures are sums of the same floats in the same order
YEAR_S = 365.25 * 24 * 3600
MESH_AXES = 2
_REDO = "re-solve the plan with `partopt solve -o`, or fix the field"
_REPLAN = "write the plan again by `partopt solve -o` or `partopt evaluate --tp --pp --dp -o`"


def close(a: float, b: float, tolerance: float = TOLERANCE) -> bool:
    """Whether two stored figures agree within `tolerance`, relative to the larger."""
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


# ---------------------------------------------------------------- the plan on its own

def _check_layers(plan: Plan, where: str) -> None:
    """Stages cover DP layers 0, 1, … once and in order (how many there are needs the graph)."""
    expected = 0
    for i, stage in enumerate(plan.stages):
        first, last = stage.layers
        if first != expected or last < first:
            raise InstanceError(f"stage {i} covers DP layers [{first}, {last}] but the next uncovered layer is {expected}",
                                at(where, f"$.stages[{i}].layers"), "stages cover the DP layers 0, 1, … once, in order")
        expected = last + 1


def _check_devices(plan: Plan, where: str) -> None:
    """Submeshes are (1, k) or (n, M) shapes of the plan's cluster, each stage's devices are one such
    block (k devices of one node, or n whole nodes), and the stages tile the cluster exactly."""
    n_nodes, m = plan.nodes, plan.devices_per_node
    owner: dict[int, int] = {}
    S = _physical_stages(plan, where)
    for j, chunk in enumerate(plan.stages[S:], start=S):  # interleaved: chunk j runs on stage j mod S's devices
        first = plan.stages[j % S]
        for name in ("submesh", "logical_mesh", "devices"):
            if getattr(chunk, name) != getattr(first, name):
                raise InstanceError(f"virtual stage {j} runs on stage {j % S}'s devices, but its {name} differs",
                                    at(where, f"$.stages[{j}].{name}"), f"give it stage {j % S}'s {name}")
    for i, stage in enumerate(plan.stages[:S]):
        place = f"$.stages[{i}]"
        n, k = stage.submesh
        if n > n_nodes or k > m or (n > 1 and k != m):
            raise InstanceError(f"submesh {stage.submesh} is not a submesh of the plan's {n_nodes} × {m} cluster",
                                at(where, f"{place}.submesh"), f"use [1, k] with k ≤ {m}, or [n, {m}] with n ≤ {n_nodes}")
        a, b = stage.logical_mesh
        if a * b != n * k:
            raise InstanceError(f"logical mesh {stage.logical_mesh} has {a * b} devices, its submesh {stage.submesh} "
                                f"has {n * k}", at(where, f"{place}.logical_mesh"), "make a × b equal the submesh's devices")
        if len(stage.devices) != n * k:
            raise InstanceError(f"{len(stage.devices)} devices for submesh {stage.submesh} of {n * k}",
                                at(where, f"{place}.devices"), "list one device id per device of the submesh")
        for j, d in enumerate(stage.devices):
            if d >= n_nodes * m:
                raise InstanceError(f"device {d} does not exist in the plan's {n_nodes} × {m} cluster "
                                    f"(ids 0–{n_nodes * m - 1})", at(where, f"{place}.devices[{j}]"), _REDO)
            if d in owner:
                raise InstanceError(f"device {d} is also used by stage {owner[d]}", at(where, f"{place}.devices[{j}]"),
                                    "give every stage its own devices")
            owner[d] = i
        nodes = sorted({d // m for d in stage.devices})
        if len(nodes) != n:
            raise InstanceError(f"devices {stage.devices} span {len(nodes)} nodes, submesh {stage.submesh} spans {n}",
                                at(where, f"{place}.devices"), f"a [1, k] submesh lies in one node; [n, {m}] takes whole nodes")
    if len(owner) != n_nodes * m:
        raise InstanceError(f"the stages use {len(owner)} of the cluster's {n_nodes * m} devices", at(where, "$.stages"),
                            "a plan's submeshes tile the whole cluster")


def _physical_stages(plan: Plan, where: str) -> int:
    """S, the plan's device groups: its stages, or its S·v virtual stages / v; InstanceError unless the
    schedule, v, the stage count and B fit together (`schedules.check_schedule`)."""
    v = plan.virtual_stages
    if not isinstance(v, int) or v < 1 or len(plan.stages) % v:
        raise InstanceError(f"{len(plan.stages)} stage entries are not v = {v!r} virtual stages per stage",
                            at(where, "$.virtual_stages"), "list S·v virtual stages in model order")
    try:
        check_schedule(plan.schedule, v, len(plan.stages) // v, plan.num_microbatches)
    except InstanceError as err:
        raise InstanceError(err.cause, at(where, f"$.{err.where}"), err.hint) from None
    return len(plan.stages) // v


def _check_placement(placement: Placement, tensor: dict[str, Any] | None, place: str) -> None:
    if len(placement) != MESH_AXES:
        raise InstanceError(f"placement {fmt(placement)} has {len(placement)} entries for a {MESH_AXES}-axis mesh",
                            place, "give one entry (S(dim), R or P) per mesh axis")
    if tensor is not None:
        for p in placement:
            if isinstance(p, Shard) and p.dim not in tensor["dims"]:
                raise InstanceError(f"placement {fmt(placement)} splits {p.dim!r}, which the tensor {tensor['dims']} "
                                    "lacks", place, "split only the tensor's own dims")


def _check_axes(op: str, info: OpStrategy, here: str) -> None:
    """Each dim the op's axes name is split on that mesh axis by an input or the output: a strategy splits every
    tensor of the op that has the dim, so a dim none of them is split along is one the op lacks (the plan does not
    name the op's inputs: which dims they have takes the graph, `check_against`)."""
    for k, d in enumerate(info.axes):
        if d is not None and Shard(d) not in (info.output[k], *(p[k] for p in info.inputs)):
            placed = f"inputs {', '.join(fmt(p) for p in info.inputs)}; output {fmt(info.output)}"
            raise InstanceError(f"op {op} splits {d!r} on mesh axis {k}, but none of its tensors is split along it "
                                f"there ({placed}): a dim the op lacks, or placements that do not follow from its axes",
                                f"{here}.axes",
                                f"name one of the op's own dims (or null) per mesh axis; {_REDO}")


def _check_strategies(plan: Plan, stage: StagePlan, place: str) -> None:
    tensors = plan.tensors or {}
    for op, info in stage.ops.items():
        here = f"{place}.ops[{op!r}]"
        if len(info.axes) != MESH_AXES:
            raise InstanceError(f"op {op} has {len(info.axes)} axis entries for a {MESH_AXES}-axis mesh",
                                f"{here}.axes", "give one dim (or null) per mesh axis")
        if tensors and info.tensor not in tensors:
            raise InstanceError(f"op {op}'s tensor {info.tensor!r} is not in the plan's tensors", f"{here}.tensor", _REDO)
        _check_placement(info.output, tensors.get(info.tensor), f"{here}.output")
        for j, placement in enumerate(info.inputs):
            _check_placement(placement, None, f"{here}.inputs[{j}]")
        _check_axes(op, info, here)
    for name, info in stage.params.items():
        here = f"{place}.params[{name!r}]"
        if tensors and name not in tensors:
            raise InstanceError(f"parameter {name!r} is not in the plan's tensors", here, _REDO)
        _check_placement(info.placement, tensors.get(name), f"{here}.placement")


def _check_covered(plan: Plan, where: str) -> None:
    """Every parameter of the plan's `tensors` is placed by some stage and every tensor an op makes (activation,
    output) is made by an op of some stage: else an export would silently leave the parameter or op out."""
    placed = {name for stage in plan.stages for name in stage.params}
    made = {info.tensor for stage in plan.stages for info in stage.ops.values()}
    for name, t in (plan.tensors or {}).items():
        role = t.get("role")
        if role == "param" and name not in placed:
            raise InstanceError(f"parameter {name!r} of the plan's tensors is placed by no stage (no stages[i].params "
                                "entry)", at(where, f"$.tensors[{name!r}]"), _REPLAN)
        if role in ("activation", "output") and name not in made:
            raise InstanceError(f"{role} {name!r} of the plan's tensors is made by no op of any stage: the op that "
                                "makes it is missing from stages[i].ops", at(where, f"$.tensors[{name!r}]"), _REPLAN)


def mismatches(plan: Plan) -> list[tuple[str, float, float]]:
    """The stored figures that disagree with the others (JSON path, stored, derived from its parts):
    what `explain` and `draw` would show without re-pricing."""
    v, B = plan.virtual_stages, plan.num_microbatches
    S = len(plan.stages) // v
    found = []
    for i, stage in enumerate(plan.stages):
        bd = stage.breakdown
        held = inflight(i % S, S, B, plan.schedule, v)
        if not close(stage.inflight_microbatches, held):
            found.append((f"$.stages[{i}].inflight_microbatches", stage.inflight_microbatches, held))
        for name in ("forward_s", "send_time_s"):
            if getattr(stage, name) > stage.stage_time_s * (1 + TOLERANCE):
                found.append((f"$.stages[{i}].{name}", getattr(stage, name), f"at most stage_time_s {stage.stage_time_s!r}"))
        if stage.forward_s + (stage.weight_s or 0.0) > stage.stage_time_s * (1 + TOLERANCE):
            found.append((f"$.stages[{i}].weight_s", stage.weight_s, "at most stage_time_s - forward_s"))
        chunks = plan.stages[i % S::S]  # the stages on its devices: itself unless interleaved
        memory = (sum(c.breakdown["param_bytes"] for c in chunks)
                  + stage.inflight_microbatches * sum(c.breakdown["activation_bytes"] for c in chunks)
                  + max(c.breakdown.get("working_bytes", 0.0) for c in chunks))
        if not close(stage.memory_bytes, memory):
            found.append((f"$.stages[{i}].memory_bytes", stage.memory_bytes, memory))
    peak = max(s.memory_bytes for s in plan.stages)
    if not close(plan.memory_peak_bytes, peak):
        found.append(("$.memory_peak_bytes", plan.memory_peak_bytes, peak))
    if plan.schedule == "zero-bubble" and any(s.weight_s is None for s in plan.stages):
        return [*found, ("$.stages[0].weight_s", None, "a zero-bubble plan gives each stage's weight_s")]
    iteration = plan_iteration([s.stage_time_s for s in plan.stages], [s.forward_s for s in plan.stages],
                               [s.weight_s or 0.0 for s in plan.stages], [s.sync_time_s for s in plan.stages], B,
                               plan.schedule, v, [s.breakdown.get("send_p2p_s", 0.0) for s in plan.stages])
    if not close(plan.iteration_time_s, iteration):
        found.append(("$.iteration_time_s", plan.iteration_time_s, iteration))
    return found


def check_plan(plan: Plan, where: str = "plan", figures: bool = True) -> None:
    """InstanceError unless `plan` is consistent on its own (see the module docstring); `figures=False`
    leaves the stored figures' agreement and the stages' coverage of `tensors` to the caller (`partopt check`
    lists every mismatch and every op or parameter entry left out)."""
    _check_layers(plan, where)
    _check_devices(plan, where)
    if plan.batch_dim is not None:
        for name, t in (plan.tensors or {}).items():
            if plan.batch_dim in t["dims"] and len(t["shape"]) == len(t["dims"]):
                size = t["shape"][t["dims"].index(plan.batch_dim)]
                if size != plan.microbatch_size:
                    raise InstanceError(f"tensor {name!r} holds {size} samples per microbatch, microbatch_size is "
                                        f"{plan.microbatch_size}", at(where, f"$.tensors[{name!r}].shape"), _REDO)
    for i, stage in enumerate(plan.stages):
        _check_strategies(plan, stage, at(where, f"$.stages[{i}]"))
    if figures:
        _check_covered(plan, where)
    found = mismatches(plan) if figures else []
    if found:
        path, stored, derived = found[0]
        raise InstanceError(f"{path.rsplit('.', 1)[-1]} is {stored!r} but the plan's other figures give {derived!r}",
                            at(where, path), _REDO)


# ---------------------------------------------------------------- the plan against its graph and cluster

def _check_target(plan: Plan, graph: Graph, cluster: Cluster, where: str) -> None:
    if plan.graph != graph.name:
        raise InstanceError(f"the plan was made for graph {plan.graph!r}, not {graph.name!r}", at(where, "$.graph"),
                            "give the graph the plan was made for")
    if (plan.cluster, plan.nodes, plan.devices_per_node) != (cluster.name, cluster.nodes, cluster.devices_per_node):
        raise InstanceError(f"the plan was made for {plan.cluster!r} with {plan.nodes} × {plan.devices_per_node} devices, "
                            f"not {cluster.name!r} with {cluster.nodes} × {cluster.devices_per_node}",
                            at(where, "$.cluster"),
                            f"give --cluster {plan.cluster} --nodes {plan.nodes}, or re-solve for this cluster")
    if plan.batch_dim != graph.batch_dim or graph.batch_dim is None:
        raise InstanceError(f"the plan splits batch dim {plan.batch_dim!r}, the graph's is {graph.batch_dim!r}",
                            at(where, "$.batch_dim"), "re-solve the plan for this graph")
    if plan.matmul_dtype != graph.matmul_dtype:
        raise InstanceError(f"the plan priced GEMMs at {_gemm_precision(plan.matmul_dtype)}, the graph runs them at "
                            f"{_gemm_precision(graph.matmul_dtype)}", at(where, "$.matmul_dtype"),
                            "re-solve the plan for this graph")
    if None not in (plan.architecture, graph.architecture) and plan.architecture != graph.architecture:
        key = next(k for k in {**graph.architecture, **plan.architecture}  # a key may be in one only (head_dim)
                   if plan.architecture.get(k) != graph.architecture.get(k))
        raise InstanceError(f"the plan records {key} {plan.architecture.get(key)!r}, the graph's architecture "
                            f"{graph.architecture.get(key)!r}", at(where, f"$.architecture.{key}"),
                            "re-solve the plan for this graph")
    if plan.optimizer is not None and plan.optimizer != graph.optimizer:
        raise InstanceError(f"the plan priced {plan.optimizer}'s state, the graph trains with {graph.optimizer}",
                            at(where, "$.optimizer"), "re-solve the plan for this graph")
    batch = graph.dims[graph.batch_dim]
    if plan.num_microbatches * plan.microbatch_size != batch:
        raise InstanceError(f"{plan.num_microbatches} microbatches of {plan.microbatch_size} samples are not the graph's "
                            f"batch of {batch}", at(where, "$.num_microbatches"),
                            "make num_microbatches × microbatch_size equal the batch")


def _gemm_precision(matmul_dtype: str | None) -> str:
    return matmul_dtype or "their tensors' dtype"


def _check_tensors(plan: Plan, g_mb: Graph, where: str) -> None:
    table = tensor_table(g_mb)
    for name, t in (plan.tensors or {}).items():
        place = at(where, f"$.tensors[{name!r}]")
        if name not in table:
            raise InstanceError(f"tensor {name!r} is not in the graph", place, _REDO)
        expected = table[name]
        if not records(t, expected):
            said = [k for k in expected if k in t]
            raise InstanceError(f"tensor {name!r} is {' '.join(str(t[k]) for k in said)}, the graph's (one microbatch) is "
                                f"{' '.join(str(expected[k]) for k in said)}", place, _REDO)


def check_against(plan: Plan, graph: Graph, cluster: Cluster, where: str = "plan") -> None:
    """InstanceError unless `plan` (already `check_plan`-ed) fits `graph` and `cluster` (module docstring)."""
    _check_target(plan, graph, cluster, where)
    layering = build_layers(graph, plan.options.get("layers"))
    last = plan.stages[-1].layers[1]
    if last != len(layering.groups) - 1:
        raise InstanceError(f"the stages cover DP layers 0–{last}, the graph has {len(layering.groups)} "
                            f"(with layers = {plan.options.get('layers')})", at(where, "$.stages"),
                            f"cover DP layers 0–{len(layering.groups) - 1}")
    g_mb = intra.with_batch(graph, plan.microbatch_size)
    _check_tensors(plan, g_mb, where)
    padded = stores_padded(plan)
    for i, stage in enumerate(plan.stages):
        place = f"$.stages[{i}]"
        mesh = cluster.logical_mesh(tuple(stage.submesh), tuple(stage.logical_mesh))
        ops = {op.name: op for j in range(stage.layers[0], stage.layers[1] + 1) for op in layering.ops(j)}
        for name, info in stage.ops.items():
            here = at(where, f"{place}.ops[{name!r}]")
            if name not in ops:
                raise InstanceError(f"op {name!r} is {'not in the graph' if name not in graph.op_index else 'not in this stage'}"
                                    f" (layers {stage.layers[0]}–{stage.layers[1]})", here,
                                    "list each op under the stage that runs it")
            op = g_mb.op_index[name]
            if (info.kind, info.tensor) != (op.kind, op.output):
                raise InstanceError(f"op {name} is recorded as a {info.kind} making {info.tensor!r}; the graph's is a "
                                    f"{op.kind} making {op.output!r}", here, _REDO)
            legal = {tuple(s.axes): s for s in op_strategies(g_mb, op, mesh)}
            strategy = legal.get(info.axes)
            if strategy is None:
                raise InstanceError(f"op {name} cannot split {list(info.axes)} on mesh {stage.logical_mesh} (a dim it "
                                    f"lacks, or a split that does not divide its size)", f"{here}.axes",
                                    f"use one of {sorted(map(str, legal), key=len)[:4]} …")
            if (info.inputs, info.output) != (strategy.inputs, strategy.output):
                recorded = ([fmt(x) for x in info.inputs], fmt(info.output))
                raise InstanceError(f"op {name}'s placements {recorded} do not follow from its axes {list(info.axes)}",
                                    here, _REDO)
        for name, info in stage.params.items():
            here = at(where, f"{place}.params[{name!r}]")
            tensor = g_mb.tensors.get(name)
            if tensor is None or tensor.role != "param":
                raise InstanceError(f"{name!r} is not a parameter of the graph", here, _REDO)
            legal = {ParamPlacement(s.placement, s.zero_axes) for s in param_strategies(g_mb, tensor, mesh, uneven=padded)}
            if info not in legal:
                raise InstanceError(f"parameter {name} cannot be placed {fmt(info.placement)} with zero_axes "
                                    f"{list(info.zero_axes)} on mesh {stage.logical_mesh}", here,
                                    "split only its dims, by divisors of their sizes; ZeRO only over replicated axes")


def read_checked(path: str, graph: Graph | None = None, cluster: Cluster | None = None) -> Plan:
    """A plan file, schema- and `check_plan`-checked, and `check_against` the graph and cluster when given."""
    plan = read_plan(path)
    check_plan(plan, path)
    if graph is not None and cluster is not None:
        check_against(plan, graph, cluster, path)
    return plan


# ---------------------------------------------------------------- absurd magnitudes

def cluster_warnings(cluster: Cluster) -> list[str]:
    """Valid but absurd cluster figures: links or device memory slower than 1 byte/s."""
    rates = (("intra-node link", cluster.intra_node.bandwidth), ("inter-node link", cluster.inter_node.bandwidth),
             ("device memory", cluster.device.memory_bandwidth))
    return [f"cluster {cluster.name!r}: the {name} moves {rate:.3g} bytes/s, below 1 byte/s"
            for name, rate in rates if rate < 1]


def plan_warnings(plan: Plan) -> list[str]:
    """Valid but absurd plan figures: an iteration longer than a year."""
    if plan.iteration_time_s > YEAR_S:
        return [f"one iteration of the plan takes {plan.iteration_time_s / YEAR_S:.3g} years"]
    return []


def solver_warnings(plan: Plan) -> list[str]:
    """Layer ILPs of a plan just solved or priced that the wall clock stopped (`solver.timeouts`): the plan may be
    slower than the optimum, which its `timeout, gap …` cell alone does not say nor how to avoid."""
    stopped, gap = plan.solver.get("timeouts", 0), plan.solver["gap"]
    if not stopped:
        return []
    margin = f"by up to {gap:.1%}, the largest gap" if gap is not None else "by an unknown margin (no bound proven)"
    return [f"solver: {stopped} layer ILP{'s' if stopped > 1 else ''} stopped at the time limit before proven optimal: "
            f"the plan may be slower than the optimum {margin} (hint: raise --time-limit)"]
