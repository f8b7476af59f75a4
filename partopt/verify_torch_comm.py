"""The collectives a plan implies for `verify --against torch`'s DTensor step, module by module, and their
comparison with those the step ran (`verify_torch._recorder`).

DTensor propagates its own layouts from the parameters' and inputs' placements, and reduces a pending
sum only when an op needs it whole; it does not take the plan's layouts unless told. So the step pins
them at module boundaries (`pins`): each activation entering a module (read by an op inside it, made
outside it) is redistributed to the layout the plan's first reader inside the module requires (other
stages' ops: replicated, so only this stage's collectives show); a pending sum leaving its op's module
is reduced there for its reader outside; and at an activation's first entry its readers' summed
gradient goes back to the layout it arrived in. The collectives that implies, in the run's fp32 bytes
as partopt counts them (all-gather: the gathered buffer; the others: the input buffer), are
`planned_calls`: each pin's forward redistribution, the backward ones, and each parameter's gradient
synchronisation as the step runs it (to its optimizer-state shard and back). `compare` then checks, per module, the
forward calls by (kind, mesh axis): count and bytes; the backward calls and the synchronisation by
(kind, mesh axis) over the stage (CommDebugMode attributes a backward call to the module its
hooks last saw, not to where the plan prices it: docs/FRONTENDS.md).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from partopt.errors import PartoptError
from partopt.export import AXIS_NAMES, TensorPlacement, optimizer_placement
from partopt.plan import Plan, StagePlan
from partopt.verify_torch_moe import expert_modules
from partopt.sharding import SMALL_BYTES, MeshShape, Partial, Placement, R, Shard, as_gradient_target, \
    gradient_placement, reshard_collectives

TOP_LEVEL = "(top level)"  # the loss, gradient synchronisation: outside every module
MATMULS = ("linear", "matmul", "mm", "bmm", "addmm", "einsum")  # aten ops whose input gradient reads the weight
NORMS = ("layernorm", "rmsnorm", "layer_norm", "rms_norm", "batch_norm")  # their input gradient reads the scale
BACKWARD = "(backward)"  # the backward's calls, compared over the stage
FP32 = 4  # bytes per element: verify runs in fp32 whatever dtype the plan was priced in
_INPUT = re.compile(r"(\S+) \[[^\]]*\]")


@dataclass(frozen=True)
class Pin:
    """Where the step redistributes an activation: entering `module` (leaving it: `exit`, a pending sum
    reduced for its reader outside), `tensor` goes to `placement`; `gradient`: its first entry on the way to
    its readers, where their summed gradient goes back to the layout the tensor arrived in."""

    module: str
    tensor: str
    placement: Placement
    exit: bool = False
    gradient: bool = False


def op_inputs(explanation: str) -> list[str]:
    """An op's input tensors, in order, from its plan explanation (`op: … — in A [S(b), R], W [R, R]; out …`)."""
    _, _, tail = explanation.partition(" — in ")
    return _INPUT.findall(tail.partition("; out ")[0])


def module_of(op: str) -> str:
    """The module FQN of an op named `<module path>.<aten op>` (TOP_LEVEL for the loss and other bare names)."""
    return op.rpartition(".")[0] if "." in op else TOP_LEVEL


def _contains(module: str, op: str) -> bool:
    return module != TOP_LEVEL and op.startswith(module + ".")


def _entries(producer: str | None, consumer: str) -> list[str]:
    """The modules the consumer op is inside and the producer op is not, outermost first: where the
    tensor enters the consumer's modules."""
    module = module_of(consumer)
    if module == TOP_LEVEL:  # the loss: the step pins its inputs where it computes it
        return [TOP_LEVEL]
    parts = module.split(".")
    prefixes = [".".join(parts[:k]) for k in range(1, len(parts) + 1)]
    return [m for m in prefixes if producer is None or not _contains(m, producer)]


def _numel(plan: Plan, tensor: str) -> int:
    return math.prod(plan.tensors[tensor]["shape"])


def _reads(plan: Plan, index: int) -> list[tuple[str, str, Placement, tuple]]:
    """(op, tensor, placement it reads the tensor in, the op's axes) for every activation read of the model,
    in plan order: this stage's ops as planned, the other stages' replicated."""
    stage = plan.stages[index]
    none = (None,) * len(stage.logical_mesh)
    replicated = (R,) * len(stage.logical_mesh)
    result = []
    for k, s in enumerate(plan.stages):
        for op, info in s.ops.items():
            names = op_inputs(info.explanation)
            if len(names) != len(info.inputs):
                raise PartoptError(f"stages[{k}].ops.{op}: its explanation names {len(names)} inputs where its "
                                   f"strategy places {len(info.inputs)}; verify reads the op's inputs from it",
                                   "verify", "verify a plan as `partopt solve` wrote it")
            for t, need in zip(names, info.inputs):
                if plan.tensors.get(t, {}).get("role") not in ("param", None):
                    result.append((op, t, need, info.axes) if k == index else (op, t, replicated, none))
    return result


def input_placements(plan: Plan, index: int) -> dict[str, Placement]:
    """Each model input as the step places it: as its first reader requires (another stage's: replicated)."""
    placed: dict[str, Placement] = {}
    for _, t, need, _ in _reads(plan, index):
        if plan.tensors[t]["role"] == "input":
            placed.setdefault(t, need)
    return placed


def _route(producer: str | None, consumer: str, source: Placement) -> list[tuple[str, bool]]:
    """The (module, leaving) boundaries a tensor crosses from its producer op to a consumer op: the producer's
    own module when the tensor leaves it as a pending sum (DTensor would carry the sum on and reduce it
    later), then the consumer's modules it enters, outermost first."""
    route = []
    if producer is not None and any(isinstance(p, Partial) for p in source):
        home = module_of(producer)
        if home != TOP_LEVEL and not _contains(home, consumer):
            route.append((home, True))
    return route + [(m, False) for m in _entries(producer, consumer)]


def pins(plan: Plan, index: int) -> list[Pin]:
    """Every redistribution the step makes where a module begins or a pending sum leaves one, in plan order
    (see the module doc); the placement is the first reader's beyond it."""
    producer = {info.tensor: op for s in plan.stages for op, info in s.ops.items()}
    made = {info.tensor: info.output for info in plan.stages[index].ops.values()}
    result: dict[tuple[str, str, bool], Pin] = {}
    for op, t, need, _ in _reads(plan, index):
        route = _route(producer.get(t), op, made.get(t, need))
        first = next((k for k, (_, leaving) in enumerate(route) if not leaving), None)
        for k, (module, leaving) in enumerate(route):
            if leaving and any(isinstance(p, Partial) for p in need):
                continue  # the reader takes the pending sum as it is
            result.setdefault((module, t, leaving), Pin(module, t, need, leaving, k == first))
    return list(result.values())


def dtensor_order(src: Placement, dst: Placement, mesh: MeshShape) -> list[Placement]:
    """The layouts DTensor's redistribution passes through from src to dst, one mesh axis a step (torch's
    `generate_greedy_transform_infos`): from a sharded source the axes last to first, then first to last
    for what is left; a Shard whose earlier axes split its dim otherwise than the target's goes through
    Replicate. partopt takes the cheaper order; on a 2-D mesh the per-axis bytes then differ, not the sum."""
    current, steps = list(src), []

    def step(axis: int, to: Any) -> None:
        current[axis] = to
        steps.append(tuple(current))

    if any(isinstance(p, Shard) and mesh.shape[a] > 1 for a, p in enumerate(src)):
        for axis in reversed(range(len(current))):
            target = dst[axis]
            if isinstance(target, Shard) and [k for k in range(axis) if current[k] == target] != \
                    [k for k in range(axis) if dst[k] == target]:
                target = R
            if current[axis] != target:
                step(axis, target)
    for axis in range(len(current)):
        if current[axis] != dst[axis]:
            step(axis, dst[axis])
    return steps


def planned_reshard(src: Placement, dst: Placement, nbytes: float, mesh: MeshShape, module: str = TOP_LEVEL,
                    backward: bool = False) -> list[dict[str, Any]]:
    """The collectives of src -> dst as calls of `module`, in DTensor's order of the axes (`dtensor_order`;
    an axis of size 1 moves nothing)."""
    result, layout = [], src
    for following in dtensor_order(src, dst, mesh):
        result += [{"module": module, "kind": kind, "axis": AXIS_NAMES[axis], "bytes": size, "backward": backward}
                   for kind, axis, size in reshard_collectives(layout, following, nbytes, mesh)
                   if mesh.shape[axis] > 1]
        layout = following
    return result


def planned_calls(plan: Plan, index: int, summed: dict[str, tuple[int, ...]] | None = None,
                  states: dict[str, Placement] | None = None) -> list[dict[str, Any]]:
    """The collectives of the step of stage `index` as the plan implies them (see the module doc); `summed`:
    the experts modules the step runs by summing over their expert axes (`experts_sum_calls`); `states`:
    per torch parameter, the layout the step synchronises its gradient to where DTensor cannot express
    the optimizer-state shard (`sync_calls`)."""
    stage = plan.stages[index]
    mesh = MeshShape((stage.logical_mesh[0], stage.logical_mesh[1]))
    replicated = (R,) * len(stage.logical_mesh)
    made = {info.tensor: info.output for info in stage.ops.values()}
    inputs = input_placements(plan, index)
    producer = {info.tensor: op for s in plan.stages for op, info in s.ops.items()}
    pinned = {(p.module, p.tensor, p.exit): p for p in pins(plan, index)}
    result: list[dict[str, Any]] = []
    done: set[tuple[Any, ...]] = set()
    for op, t, need, axes in _reads(plan, index):
        source = inputs[t] if t in inputs else made.get(t, replicated)
        nbytes = _numel(plan, t) * FP32
        route = [(m, leaving) for m, leaving in _route(producer.get(t), op, source) if (m, t, leaving) in pinned]
        layouts = [source, *(pinned[(m, t, leaving)].placement for m, leaving in route)]
        for k, (module, leaving) in enumerate(route):
            if (module, t, leaving) not in done:
                done.add((module, t, leaving))
                result += planned_reshard(layouts[k], layouts[k + 1], nbytes, mesh, module)
        layout, grad = layouts[-1], gradient_placement(need, axes)
        if layout != need:  # inside one module: DTensor's own rules must reshard as the plan prices
            if (module_of(op), t, need) not in done:  # once per layout: a second reader takes the resharded tensor
                done.add((module_of(op), t, need))
                result += planned_reshard(layout, need, nbytes, mesh, module_of(op))
                if plan.tensors[t]["role"] != "input":
                    result += planned_reshard(grad, as_gradient_target(layout), nbytes, mesh, module_of(op), True)
            grad = as_gradient_target(layout)
        if plan.tensors[t]["role"] == "input":
            continue
        for k in reversed(range(len(route))):  # backward: each redistribution's, and the gradient pin's
            module, leaving = route[k]
            if layouts[k] != layouts[k + 1] or pinned[(module, t, leaving)].gradient:
                if ("backward", module, t, leaving) not in done:
                    done.add(("backward", module, t, leaving))
                    result += planned_reshard(grad, as_gradient_target(layouts[k]), nbytes, mesh, module, True)
                grad = as_gradient_target(layouts[k])
    # a sharded parameter gathered for its reader, inside the op: in the forward, and for a matmul or a norm's
    # scale again in the backward, where its input's gradient reads the weight (DTensor's autograd keeps the op's
    # operands as stored, not what its dispatch gathered: FSDP's second gather, which the plan prices too;
    # docs/FRONTENDS.md); an experts module gathers each torch parameter once, its chunks together
    # (`verify_torch_moe.expert_parallel`)
    experts, chunks, gathered = expert_modules(plan), _torch_params(stage), set()
    for op, info in stage.ops.items():
        inputs, aten = op_inputs(info.explanation), op.rpartition(".")[2]
        for slot, (t, need) in enumerate(zip(inputs, info.inputs)):
            if t not in stage.params:
                continue
            names, expert = [t], _expert_of(t, experts)
            if expert is not None:
                whole = t.partition("[")[0]
                if whole in gathered:
                    continue
                gathered.add(whole)
                names = chunks[whole]
            nbytes = sum(_numel(plan, n) for n in names) * FP32
            result += planned_reshard(stage.params[t].placement, need, nbytes, mesh, module_of(op))
            reads_weight = aten in MATMULS or (aten in NORMS and slot == 1)  # a norm's scale, not its shift
            if (expert is None and reads_weight
                    and any(plan.tensors[u]["role"] not in ("param", "input") for u in inputs if u != t)):
                result += planned_reshard(stage.params[t].placement, need, nbytes, mesh, module_of(op), backward=True)
    for module, axes in (summed or {}).items():
        result = [c for c in result if not (c["module"] == module or c["module"].startswith(module + "."))]
        result += experts_sum_calls(plan, module, axes, mesh)
    return result + sync_calls(plan, stage, states or {}, experts)


def _torch_params(stage: StagePlan) -> dict[str, list[str]]:
    """The stage's parameters by torch parameter: a fused parameter's chunks (`name[k/n]`) together, in order."""
    result: dict[str, list[str]] = defaultdict(list)
    for name in stage.params:
        result[name.partition("[")[0]].append(name)
    return result


def _expert_of(name: str, experts: Sequence[str]) -> str | None:
    """The experts module (of `experts`) whose parameter `name` is, or None."""
    return next((m for m in experts if name.startswith(m + ".")), None)


def experts_sum_calls(plan: Plan, module: str, axes: tuple[int, ...], mesh: MeshShape) -> list[dict[str, Any]]:
    """The collectives of an experts module whose tokens are not split over its expert axes, as the step runs it
    (`verify_torch_moe.expert_parallel`): each process computes its experts' part of every token's output and
    the parts are summed, an all-reduce of combine's output [b, s, h] on each expert axis; backward, the
    hidden states' gradient [b, s, h] and the routing weights' [b, s, top_k] are summed likewise. The plan
    prices the same sums its own way (GShard: an all-gather of the experts' outputs [e, b, c, h] before
    combine, and of the dispatched tokens' gradient); both are in its strategy space (docs/FRONTENDS.md)."""
    out = plan.tensors[f"{module}.combine"]
    dispatch = plan.tensors[f"{module}.dispatch"]
    sizes = dict(zip(dispatch["dims"], dispatch["shape"])) | dict(zip(out["dims"], out["shape"]))
    e, c = sizes[dispatch["dims"][0]], sizes[dispatch["dims"][2]]
    tokens = math.prod(out["shape"][:-1])
    top_k = e * c // out["shape"][1]
    result = []
    for axis in axes:
        if mesh.shape[axis] > 1:
            for nbytes, backward in ((_numel(plan, f"{module}.combine"), False), (tokens * out["shape"][-1], True),
                                     (tokens * top_k, True)):
                result.append({"module": module, "kind": "all_reduce", "axis": AXIS_NAMES[axis],
                               "bytes": nbytes * FP32, "backward": backward})
    return result


def sync_calls(plan: Plan, stage: StagePlan, states: dict[str, Placement],
               experts: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Each stage parameter's gradient synchronisation as the step runs it: from the layout its first reader
    leaves to the optimizer-state placement, then back to the parameter's (a fused parameter's chunks,
    placed alike, as one torch parameter). Where `states` gives the torch parameter another layout (a ZeRO
    shard of an inner factor of a torch axis, which no DTensor Shard expresses), the gradient goes there:
    an all-reduce where the plan reduce-scatters and all-gathers, the same sum and bytes on a ring.
    A weight of an `experts` module computed in another layout than it is stored (gathered FSDP-style for
    its matmul) is reduced to its stored layout in that module's backward, where the expert-parallel run
    (`verify_torch_moe.expert_parallel`) leaves its gradient; the rest of its synchronisation follows."""
    mesh = MeshShape((stage.logical_mesh[0], stage.logical_mesh[1]))
    grads: dict[str, Placement] = {}
    for info in stage.ops.values():
        for t, need in zip(op_inputs(info.explanation), info.inputs):
            if t in stage.params:
                grads.setdefault(t, gradient_placement(need, info.axes))
    result = []
    for names in _torch_params(stage).values():
        name = names[0]
        info = stage.params[name]
        if name not in grads:
            continue
        t = TensorPlacement(name, "param", tuple(plan.tensors[name]["dims"]), tuple(plan.tensors[name]["shape"]),
                            info.placement, info.zero_axes)
        state = states.get(name.partition("[")[0]) or optimizer_placement(t, tuple(stage.logical_mesh))[0]
        nbytes = sum(_numel(plan, n) for n in names) * FP32
        grad = grads[name]
        module = _expert_of(name, experts)
        if module is not None and grad != info.placement:
            result += planned_reshard(grad, info.placement, nbytes, mesh, module, backward=True)
            grad = info.placement
        result += planned_reshard(grad, state, nbytes, mesh)
        result += planned_reshard(state, info.placement, nbytes, mesh)
    return result


def _key(call: dict[str, Any], routed: tuple[str, ...]) -> tuple[str, str, str]:
    module = call["module"]
    inside = next((m for m in routed if module == m or module.startswith(m + ".")), None)
    if inside is not None:
        return inside, call["kind"], call["axis"]
    return (BACKWARD if call["backward"] and module != TOP_LEVEL else module), call["kind"], call["axis"]


def compared(call: dict[str, Any]) -> bool:
    """Whether a call counts: a floating buffer over SMALL_BYTES (scalars, norm statistics and the integer
    routing metadata of the experts' exchange are listed, not compared)."""
    return call["bytes"] > SMALL_BYTES and call.get("floating", True)


def compare(planned: list[dict[str, Any]], ran: list[dict[str, Any]], routed: tuple[str, ...] = ()) -> list[str]:
    """One line per (module, kind, mesh axis) whose count or bytes (by more than 1 %) differ between the plan
    and the run, over the calls that count (`compared`). Calls in `routed` modules (experts), forward and
    backward, count under the module by count only: their bytes are the routing's (see the module doc)."""
    totals: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0])
    for side, calls in ((0, planned), (2, ran)):
        for c in calls:
            if compared(c):
                total = totals[_key(c, routed)]
                total[side] += 1
                total[side + 1] += c["bytes"]
    lines = []
    for (module, kind, axis), (n_plan, b_plan, n_ran, b_ran) in sorted(totals.items()):
        loose = module in routed
        if n_plan != n_ran or (not loose and abs(b_plan - b_ran) > 0.01 * max(b_plan, b_ran)):
            lines.append(f"{module or '(model)'}: {kind} on {axis}: the plan implies {n_plan} ({b_plan:,.0f} B), "
                         f"DTensor ran {n_ran} ({b_ran:,.0f} B)" + (" (bytes: the routing's)" if loose else ""))
    return lines
