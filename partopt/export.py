"""Exports of a plan for runtimes: JAX PartitionSpecs, PyTorch DTensor placements, Megatron-LM arguments.

Mesh axis k of a stage's logical mesh is named AXIS_NAMES[k] ("x" = axis 0, "y" = axis 1, whose
devices are consecutive). Every export carries what the plan's prices assume besides placements:
the schedule (and its virtual stages), microbatch size and count, activation recomputation, optimizer-state sharding
and sequence parallelism. docs/FORMAT.md "Exports" documents every field and the Megatron rules.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from partopt import costmodel
from partopt.cluster import PRESETS, Device, nominal_preset
from partopt.errors import InstanceError, PartoptError
from partopt.ops import NORM_KINDS
from partopt.plan import OpStrategy, Plan, StagePlan
from partopt.sharding import Partial, Placement, Replicate, Shard, fmt, split_ways

AXIS_NAMES = ("x", "y")
TARGETS = ("jax", "dtensor", "megatron")
UNSUPPORTED_BY_MEGATRON = ("conv2d", "pool")  # Megatron-LM trains transformers


class NotExpressibleError(PartoptError):
    """A plan a target cannot express (Megatron-LM's uniform (tp, pp, dp) form, JAX's even shardings, a runtime the
    plan's devices do not run); the cause names why."""


# ---------------------------------------------------------------- a stage's tensors and their placements

@dataclass(frozen=True)
class TensorPlacement:
    """One tensor of one stage, resolved: its dims, microbatch shape and placement per mesh axis."""

    name: str
    role: str  # "param" or "activation" (an op's output)
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    placement: Placement
    zero_axes: tuple[int, ...] = ()  # params: mesh axes their optimizer state is sharded over


def _mesh(stage: StagePlan, where: str) -> tuple[int, ...]:
    shape = tuple(stage.logical_mesh)
    if len(shape) != len(AXIS_NAMES) or any(n < 1 for n in shape):
        raise InstanceError(f"logical mesh {list(shape)} is not a 2-D mesh", f"{where}.logical_mesh")
    if len(stage.devices) != shape[0] * shape[1]:
        raise InstanceError(f"{len(stage.devices)} devices for a {shape[0]} x {shape[1]} mesh", f"{where}.devices")
    return shape


def _check_ops(stage: StagePlan, ndims: int, where: str) -> None:
    """InstanceError unless every op has one axis entry per mesh axis."""
    for op, info in stage.ops.items():
        if len(info.axes) != ndims:
            raise InstanceError(f"op {op} has {len(info.axes)} axis entries for a {ndims}-axis mesh",
                                f"{where}.ops.{op}.axes")


def _tensor_info(plan: Plan, name: str, where: str) -> dict[str, Any]:
    info = plan.tensors.get(name)
    if info is None:
        raise InstanceError(f"tensor {name!r} is missing from the plan's tensors", where,
                            "write the plan with a partopt that records tensors (partopt solve -o)")
    return info


def _resolve(plan: Plan, name: str, role: str, placement: Placement, where: str, ndims: int,
             zero_axes: Sequence[int] = ()) -> TensorPlacement:
    info = _tensor_info(plan, name, where)
    if len(placement) != ndims:
        raise InstanceError(f"placement {fmt(placement)} has {len(placement)} entries for a {ndims}-axis mesh", where)
    dims = tuple(info["dims"])
    for p in placement:
        if isinstance(p, Shard) and p.dim not in dims:
            raise InstanceError(f"placement {fmt(placement)} splits {p.dim!r}, which {name!r} {list(dims)} lacks", where)
    return TensorPlacement(name, role, dims, tuple(info["shape"]), placement, tuple(zero_axes))


def stage_tensors(plan: Plan, index: int) -> Iterator[TensorPlacement]:
    """The parameters (first) and op outputs of stage `index`, with their placements resolved."""
    stage = plan.stages[index]
    where = f"stages[{index}]"
    ndims = len(_mesh(stage, where))
    _check_ops(stage, ndims, where)
    for name, info in stage.params.items():
        yield _resolve(plan, name, "param", info.placement, f"{where}.params.{name}", ndims, info.zero_axes)
    for op, info in stage.ops.items():
        yield _resolve(plan, info.tensor, "activation", info.output, f"{where}.ops.{op}", ndims)


def dim_axes(t: TensorPlacement) -> list[tuple[int, ...]]:
    """Per tensor dim, the mesh axes splitting it, in mesh-axis order (the first is the major split)."""
    return [tuple(k for k, p in enumerate(t.placement) if p == Shard(d)) for d in t.dims]


def optimizer_placement(t: TensorPlacement, mesh: Sequence[int]) -> tuple[Placement, tuple[int, ...]]:
    """Placement of a parameter's optimizer state (ZeRO), and the zero axes no dim could take.

    Each zero axis shards the first dim whose local size it divides and that no later mesh axis
    already splits (so that mesh order stays major-to-minor in JAX and DTensor alike); a zero axis
    that fits no dim is returned as flat (the runtime shards the flattened buffer, as ZeRO does).
    """
    placement = list(t.placement)
    flat = []
    for axis in t.zero_axes:
        if not 0 <= axis < len(mesh):
            raise InstanceError(f"optimizer state of {t.name!r} is sharded over axis {axis}, which the "
                                f"{len(mesh)}-axis mesh lacks", f"params.{t.name}.zero_axes")
        if not isinstance(placement[axis], Replicate):
            raise InstanceError(f"optimizer state of {t.name!r} is sharded over axis {axis}, where the parameter "
                                f"is {placement[axis]}, not replicated", f"params.{t.name}.zero_axes")
        ways = split_ways(placement, mesh)
        for i, d in enumerate(t.dims):
            splits = [k for k, p in enumerate(placement) if p == Shard(d)]
            local = t.shape[i] // ways.get(d, 1)
            if local % mesh[axis] == 0 and all(k < axis for k in splits):
                placement[axis] = Shard(d)
                break
        else:
            flat.append(axis)
    return tuple(placement), tuple(flat)


def _devices_grid(stage: StagePlan) -> list[list[int]]:
    a, b = stage.logical_mesh
    return [stage.devices[i * b:(i + 1) * b] for i in range(a)]


def platform(plan: Plan) -> str:
    """What the plan's devices run (`cluster.PLATFORMS`): its record, else (a plan written before it) its cluster
    preset's; a cluster file that names no platform holds GPUs (`Device.platform`)."""
    if plan.platform is not None:
        return plan.platform
    return nominal_preset(plan.cluster).device.platform if plan.cluster in PRESETS else Device.platform


# ---------------------------------------------------------------- settings besides placements

RECOMPUTATION: dict[str, dict[str, Any] | None] = {
    "none": None,
    # the attention core (scores, softmax, context) reruns: Megatron's selective granularity
    "selective": {"granularity": "selective"},
    # each layer (the unit each ILP prices: a tagged layer, one transformer block in the model zoo) keeps only
    # what it receives and reruns its forward: Megatron's full granularity, uniform method, one layer per chunk
    "full": {"granularity": "full", "method": "uniform", "num_layers": 1},
}


def recomputation(stage: StagePlan) -> dict[str, Any] | None:
    """How a stage recomputes activations, in Megatron-LM's terms, or None when it keeps them all."""
    return RECOMPUTATION[stage.recompute]


def _sequence_split(plan: Plan, i: int, stage: StagePlan) -> bool:
    """Whether some norm of the stage splits a dim besides the batch and its feature dims (the sequence)."""
    for op, info in stage.ops.items():
        if info.kind not in NORM_KINDS:
            continue
        dims = _tensor_info(plan, info.tensor, f"stages[{i}].ops.{op}")["dims"]
        for k, dim in enumerate(info.axes):
            if dim not in (None, plan.batch_dim) and not _is_feature_dim(info, dims, k, dim):
                return True
    return False


def training(plan: Plan) -> dict[str, Any]:
    """What the runtime must do besides placing tensors, for the plan's time and memory to hold."""
    return {"schedule": plan.schedule, "virtual_stages": plan.virtual_stages, "num_microbatches": plan.num_microbatches, "microbatch_size": plan.microbatch_size,
            "global_batch_size": plan.num_microbatches * plan.microbatch_size,
            "recompute": [recomputation(s) for s in plan.stages],
            "overlap_grad_reduce": bool(plan.options.get("overlap", False)),
            "optimizer_state_sharded": any(info.zero_axes for s in plan.stages for info in s.params.values()),
            "sequence_parallel": [i for i, s in enumerate(plan.stages) if _sequence_split(plan, i, s)],
            "fused_attention": fused_attention(plan), "matmul_dtype": plan.matmul_dtype,
            "param_dtypes": param_dtypes(plan), "optimizer": plan.optimizer}


def param_dtypes(plan: Plan) -> list[str] | None:
    """The dtypes the plan's parameters are stored and trained in, sorted; None when its tensor table records no
    dtypes (a plan written before it did). The runtime must keep them: a 16-bit plan run in fp32 moves twice the
    bytes and holds twice the weights it was priced with."""
    dtypes = {t["dtype"] for t in plan.tensors.values() if t.get("role") == "param" and "dtype" in t}
    return sorted(dtypes) if dtypes else None


def fused_attention(plan: Plan) -> bool:
    """Whether the plan priced fused (flash) attention: its `attention` ops keep no scores in memory,
    so the runtime must run a fused kernel for the plan's memory and time to hold."""
    return any(o.kind == "attention" for s in plan.stages for o in s.ops.values())


# ---------------------------------------------------------------- JAX

def jax_spec(t: TensorPlacement) -> list[str | list[str] | None]:
    """PartitionSpec entries, one per tensor dim: None, an axis name, or a list of names (major first).

    Partial axes are ignored: call it on a Partial tensor only for its spec after the reduction.
    """
    entries: list[str | list[str] | None] = []
    for axes in dim_axes(t):
        names = [AXIS_NAMES[k] for k in axes]
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    return entries


def jax_spec_text(spec: Sequence[str | list[str] | None]) -> str:
    """`PartitionSpec('x', None, ('x', 'y'))`, the form people paste into JAX code."""
    def one(e: str | list[str] | None) -> str:
        if e is None:
            return "None"
        if isinstance(e, str):
            return repr(e)
        return "(" + ", ".join(repr(n) for n in e) + ")"
    return "PartitionSpec(" + ", ".join(one(e) for e in spec) + ")"


def _add_optimizer_state(entry: dict[str, Any], t: TensorPlacement, mesh: Sequence[int], key: str,
                         convert: Callable[[TensorPlacement], Any], text: Callable[[Any], str]) -> None:
    """For a ZeRO-sharded parameter, `entry["optimizer_state"]`: the state's placement in the target's terms."""
    if t.role == "param" and t.zero_axes:
        placement, flat = optimizer_placement(t, mesh)
        state = convert(TensorPlacement(t.name, t.role, t.dims, t.shape, placement))
        entry["optimizer_state"] = {key: state, "text": text(state), "flat_axes": [AXIS_NAMES[k] for k in flat]}


def _jax_entry(t: TensorPlacement, mesh: Sequence[int]) -> dict[str, Any]:
    partial = [AXIS_NAMES[k] for k, p in enumerate(t.placement) if isinstance(p, Partial)]
    spec = jax_spec(t)
    entry: dict[str, Any] = {"placement": fmt(t.placement)}
    if partial:  # a pending sum has no PartitionSpec; give the spec it has once summed (psum)
        entry.update(spec=None, text=None, pending_reduction={"axes": partial, "spec": spec, "text": jax_spec_text(spec)})
    else:
        entry.update(spec=spec, text=jax_spec_text(spec))
    _add_optimizer_state(entry, t, mesh, "spec", jax_spec, jax_spec_text)
    return entry


def _check_even(t: TensorPlacement, mesh: Sequence[int], where: str) -> None:
    """NotExpressibleError for a tensor split along a dim its mesh axes do not divide (a parameter ZeRO-3's layout
    stores padded): a JAX sharding must divide every dim it splits."""
    sizes = dict(zip(t.dims, t.shape))
    for d, ways in split_ways(t.placement, mesh).items():
        if sizes[d] % ways:
            raise _not_expressible(f"{t.name} is split {fmt(t.placement)}: {sizes[d]} along {d!r} over {ways} devices, "
                                   "stored padded as ZeRO-3 stores it, and a JAX sharding must divide the dims it "
                                   "splits", where, "export it with --to dtensor (DTensor shards unevenly), or plan "
                                   "a data-parallel size that divides it")


def to_jax(plan: Plan) -> dict[str, Any]:
    """Per stage: the JAX Mesh (axis names, shape, device ids) and a PartitionSpec per parameter and
    per op output, with pending sums and optimizer-state sharding reported separately; and the parameters several
    stages hold a copy of (`shared_copies`), whose gradients the runtime must sum."""
    stages = []
    for i, stage in enumerate(plan.stages):
        mesh = _mesh(stage, f"stages[{i}]")
        params: dict[str, Any] = {}
        activations: dict[str, Any] = {}
        for t in stage_tensors(plan, i):
            if t.role == "param":
                _check_even(t, mesh, f"stages[{i}].params.{t.name}")
            (params if t.role == "param" else activations)[t.name] = _jax_entry(t, mesh)
        stages.append({"stage": i, "mesh": {"axis_names": list(AXIS_NAMES), "shape": list(mesh),
                                            "devices": _devices_grid(stage)},
                       "params": params, "activations": activations})
    return {"format": "partopt.export.jax", "version": 1, "graph": plan.graph, "training": training(plan),
            "shared_params": shared_copies(plan), "stages": stages}


# ---------------------------------------------------------------- PyTorch DTensor

def dtensor_placements(t: TensorPlacement) -> list[dict[str, Any]]:
    """DTensor placements, one per MESH dim: Shard holds the tensor dim's index."""
    result: list[dict[str, Any]] = []
    for p in t.placement:
        if isinstance(p, Shard):
            result.append({"type": "Shard", "dim": t.dims.index(p.dim)})
        else:
            result.append({"type": "Partial" if isinstance(p, Partial) else "Replicate"})
    return result


def dtensor_text(placements: Sequence[dict[str, Any]]) -> str:
    """`[Shard(0), Replicate()]`, the Python text of a placements list."""
    return "[" + ", ".join(f"Shard({p['dim']})" if p["type"] == "Shard" else f"{p['type']}()" for p in placements) + "]"


def _dtensor_entry(t: TensorPlacement, mesh: Sequence[int]) -> dict[str, Any]:
    placements = dtensor_placements(t)
    entry: dict[str, Any] = {"placement": fmt(t.placement), "placements": placements, "text": dtensor_text(placements)}
    _add_optimizer_state(entry, t, mesh, "placements", dtensor_placements, dtensor_text)
    return entry


def _torch_param_entry(t: TensorPlacement, mesh: Sequence[int], shapes: dict[str, tuple[int, ...]],
                       where: str) -> dict[str, Any]:
    """A parameter's DTensor placements in its torch parameter's own axes (frontends.torch_axes)."""
    from partopt.frontends.torch_axes import torch_name, torch_placements

    fqn, _ = torch_name(t.name)
    if fqn not in shapes:
        raise PartoptError(f"the model has no parameter {fqn!r}", where,
                           "give --model the model the plan's graph was imported from")
    sizes = dict(zip(t.dims, t.shape))
    notes: list[str] = []

    def convert(tp: TensorPlacement) -> list[dict[str, Any]]:
        spec, why = torch_placements(t.name, tp.placement, shapes[fqn], t.dims, sizes)
        notes.extend(n for n in why if n not in notes)
        return [{"type": "Shard", "dim": a} if kind == "shard" else {"type": kind.capitalize()} for kind, a in spec]

    placements = convert(t)
    entry: dict[str, Any] = {"placement": fmt(t.placement), "torch_param": fqn, "torch_shape": list(shapes[fqn]),
                             "placements": placements, "text": dtensor_text(placements)}
    _add_optimizer_state(entry, t, mesh, "placements", convert, dtensor_text)
    if notes:
        entry["notes"] = notes
    return entry


def to_dtensor(plan: Plan, torch_shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Per stage: a DeviceMesh (shape, nested device ids, dim names), DTensor placements per
    parameter and per op output (Shard(k) with k the tensor dim index, Replicate(), Partial()),
    a parallelize_module-style plan keyed by module FQN, and the module each stage begins with.
    With `torch_shapes` (each torch parameter's shape, for a graph the PyTorch frontend imported)
    a parameter's Shard(k) indexes its torch axes instead (Replicate, with notes, where a split is
    not the outermost factor of a torch axis)."""
    device_type = torch_device_type(plan)
    stages = []
    for i, stage in enumerate(plan.stages):
        mesh = _mesh(stage, f"stages[{i}]")
        params: dict[str, Any] = {}
        activations: dict[str, Any] = {}
        for t in stage_tensors(plan, i):
            if t.role == "param" and torch_shapes is not None:
                params[t.name] = _torch_param_entry(t, mesh, torch_shapes, f"stages[{i}].params.{t.name}")
            else:
                (params if t.role == "param" else activations)[t.name] = _dtensor_entry(t, mesh)
        first_op = module_of(next(iter(stage.ops), ""))
        entry = re.match(r"^(.*?\.\d+)(\.|$)", first_op)  # inside a ModuleList entry: the entry
        stages.append({"stage": i, "device_mesh": {"device_type": device_type, "shape": list(mesh),
                                                   "mesh": _devices_grid(stage), "mesh_dim_names": list(AXIS_NAMES)},
                       "params": params, "activations": activations,
                       "parallelize_plan": parallelize_plan(plan, i),
                       "begins_at": entry.group(1) if entry else first_op})
    return {"format": "partopt.export.dtensor", "version": 1, "graph": plan.graph, "training": training(plan),
            "shared_params": shared_copies(plan), "stages": stages}


# DeviceMesh's device_type per platform. torch names a TPU "xla" (torch_xla), but an "xla" mesh is no DTensor mesh:
# torch/distributed/device_mesh.py documents device_type as "cpu" or "cuda/cuda-like" and builds no process groups for
# "xla" ("Skip process group initialization if xla device"), and torch/distributed/tensor/_api.py's distribute_tensor
# and distribute_module hand it to torch_xla's experimental SPMD, which returns an XLAShardedTensor, not a DTensor
TORCH_DEVICE_TYPES = {"gpu": "cuda"}


def torch_device_type(plan: Plan) -> str:
    """The DeviceMesh device_type of the plan's devices; NotExpressibleError for devices DTensor does not run on."""
    kind = platform(plan)
    if kind not in TORCH_DEVICE_TYPES:
        raise _not_expressible(f"the plan was made for {plan.cluster}'s {kind.upper()} devices, which DTensor does not "
                               f"run on: torch's {kind.upper()} device type, xla, shards by torch_xla's SPMD, not by "
                               "DTensor placements", "platform", "export it with --to jax")
    return TORCH_DEVICE_TYPES[kind]


def shared_copies(plan: Plan) -> dict[str, dict[str, Any]]:
    """Parameters of which several stages hold a copy (a tied embedding read by the first stage's lookup
    and the last stage's LM head): the stages, and how their gradients meet (the plan prices an
    all-reduce of the copies' gradients between those stages every iteration, as Megatron does)."""
    held: dict[str, list[int]] = {}
    for i, stage in enumerate(plan.stages):
        for name in stage.params:
            held.setdefault(name, []).append(i)
    return {name: {"stages": stages, "gradients": "all_reduce between the stages' copies, once per iteration"}
            for name, stages in held.items() if len(stages) > 1}


def module_of(name: str) -> str:
    """The module FQN of an op or parameter name: all but its last component
    ("model.layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj"; chunks "w[0/3]" alike)."""
    return name.split("[")[0].rpartition(".")[0]


def parallelize_plan(plan: Plan, index: int) -> dict[str, dict[str, str]]:
    """Per module FQN and mesh axis, the torch.distributed.tensor.parallel style its weight's
    placement is: ColwiseParallel when the weight is split along a dim of its matmul's (or
    lookup's) output, RowwiseParallel when along the contracted (or looked-up vocabulary) dim.
    Modules whose weights are replicated, or read by other ops, are left out (their per-parameter
    placements say it all); so is one split along a dim that is not the outermost of its side (a k_proj
    split within each kv group's head width): the style would cut torch's flattened axis into contiguous
    blocks, which is not the plan's split."""
    stage = plan.stages[index]
    result: dict[str, dict[str, str]] = {}
    for name, info in stage.params.items():
        if not name.endswith(".weight"):
            continue
        module = module_of(name)
        readers = [(op, o) for op, o in stage.ops.items()
                   if module_of(op) == module and o.kind in ("einsum", "embedding")]
        if len(readers) != 1:
            continue
        out_dims = set(_tensor_info(plan, readers[0][1].tensor, f"stages[{index}].ops.{readers[0][0]}")["dims"])
        dims = _tensor_info(plan, name, f"stages[{index}].params.{name}")["dims"]
        splits = [(k, p.dim) for k, p in enumerate(info.placement) if isinstance(p, Shard)]
        if any(next(d for d in dims if (d in out_dims) == (dim in out_dims)) != dim for _, dim in splits):
            continue  # not the outermost dim of its side: no contiguous block of torch's axis
        if splits:
            result[module] = {AXIS_NAMES[k]: "ColwiseParallel()" if dim in out_dims else "RowwiseParallel()"
                              for k, dim in splits}
    return result


# ---------------------------------------------------------------- Megatron-LM

@dataclass(frozen=True)
class _StageRoles:
    dp_axes: tuple[int, ...]  # mesh axes (size > 1) that split only the batch dim and dims carrying it
    tp_axes: tuple[int, ...]  # mesh axes (size > 1) that together form the tensor-parallel group
    sequence_parallel: bool
    experts: frozenset[str] = frozenset()  # dims the stage splits as Megatron-LM's experts (`_expert_dims`)
    expert_axes: tuple[int, ...] = ()  # mesh axes that split them: expert parallelism (`_expert_grid`)
    expert_tp_axes: tuple[int, ...] = ()  # mesh axes that split each expert's weights: expert tensor parallelism


def _not_expressible(cause: str, where: str, hint: str = "export it with --to jax or --to dtensor") -> NotExpressibleError:
    return NotExpressibleError(cause, where, hint)


def batch_carriers(plan: Plan) -> frozenset[str]:
    """The batch dim and the dims reshapes carry it in as their outermost part (an MoE layer's tokens (b, s) -> bs,
    then its groups bs -> (g, gs)): splitting one splits the samples, as data parallelism does. Read from the plan's
    reshapes, as `evaluate.batch_dims` reads the graph's: a reshape reading its input split along x and splitting its
    output along y ≠ x over one mesh axis pairs a dim with its outermost part, where shardings live
    (`ops.reshape_outer`)."""
    pairs = {(p.dim, d) for stage in plan.stages for info in stage.ops.values() if info.kind == "reshape"
             for placement in info.inputs[:1] for p, d in zip(placement, info.axes)
             if isinstance(p, Shard) and d not in (None, p.dim)}
    carriers, size = {plan.batch_dim}, 0
    while size < len(carriers):
        size = len(carriers)
        carriers |= {dim for pair in pairs if carriers & set(pair) for dim in pair}
    return frozenset(carriers)


def _runs_experts(info: OpStrategy, axis: int, experts: frozenset[str]) -> bool:
    """Whether an op runs each expert on its own ranks over `axis`: it splits an expert dim there, reading every input
    and writing its output split along it (its tokens came to it by all-to-all, as Megatron-LM's experts' do)."""
    dim = info.axes[axis]
    return dim in experts and info.output[axis] == Shard(dim) and all(p[axis] == Shard(dim) for p in info.inputs)


def _axis_role(plan: Plan, i: int, stage: StagePlan, axis: int, batch: frozenset[str], experts: frozenset[str]) -> str:
    """"dp" when every op splits the batch dim, or a dim carrying it (`batch_carriers`), over `axis` (ops without
    any may run replicated), or runs its experts there (`_runs_experts`: Megatron-LM's expert parallelism over
    data-parallel ranks), else "tp"."""
    where = f"stage {i}"
    expert_ops = {op for op, info in stage.ops.items() if _runs_experts(info, axis, experts)}
    splits_batch = [(op, info.axes[axis]) for op, info in stage.ops.items() if info.axes[axis] in batch]
    splits_other = [(op, info.axes[axis]) for op, info in stage.ops.items()
                    if info.axes[axis] is not None and info.axes[axis] not in batch and op not in expert_ops]
    if splits_batch and splits_other:
        (op, dim), (batch_op, carrier) = splits_other[0], splits_batch[0]
        if dim in experts:
            raise _not_expressible(f"op {op} splits the experts ({dim}) over data-parallel axis {axis} but reads an "
                                   f"input whole or otherwise split; Megatron-LM runs its router on each rank's own "
                                   f"tokens and its experts on the tokens an all-to-all brings them", where)
        what = f"{carrier}, which carries the batch dim" if carrier != plan.batch_dim else "the batch dim"
        raise _not_expressible(f"axis {axis} mixes data and tensor parallelism: op {op} splits {dim} over it, "
                               f"op {batch_op} splits {what} {plan.batch_dim}", where)
    if splits_batch:
        idle = [op for op, info in stage.ops.items() if info.axes[axis] is None
                and batch & set(_tensor_info(plan, info.tensor, f"{where} op {op}")["dims"])]
        if idle:
            raise _not_expressible(f"op {idle[0]} runs replicated over data-parallel axis {axis}; Megatron gives "
                                   f"every data-parallel rank its own samples", where)
        return "dp"
    if not splits_other and not expert_ops:
        raise _not_expressible(f"no op splits anything over axis {axis} ({stage.logical_mesh[axis]} devices): every op "
                               f"runs replicated over it, which Megatron cannot express", where)
    return "tp"


def _is_feature_dim(info: OpStrategy, dims: Sequence[str], axis: int, dim: str) -> bool:
    """Whether a norm's split dim is one of its feature dims (those its scale/shift carry, else its last dim)."""
    params = info.inputs[1:]
    if params:
        return any(p[axis] == Shard(dim) for p in params)
    return dim == dims[-1]


def _tensor_parallel_axes(stage: StagePlan, mesh: Sequence[int], tp: list[int], where: str) -> tuple[int, ...]:
    """The tensor-parallel axes: one, or both when every op and parameter treats them alike (one group of a*b)."""
    if len(tp) > 1:
        for op, info in stage.ops.items():
            if len(set(info.axes)) > 1:
                what = [f"splits {d} over axis {k}" if d else f"runs replicated over axis {k}"
                        for k, d in enumerate(info.axes)]
                raise _not_expressible(f"op {op} {' but '.join(what)}: Megatron has a single tensor-parallel group, "
                                       f"not a 2-D one", where)
        for name, info in stage.params.items():
            if len(set(info.placement)) > 1:
                raise _not_expressible(f"param {name} is {fmt(info.placement)}: Megatron has a single tensor-parallel "
                                       f"group, not a 2-D one", where)
    if tp and tp[0] != len(mesh) - 1 and mesh[-1] > 1 and len(tp) == 1:
        raise _not_expressible(f"tensor parallelism runs over axis {tp[0]}, whose devices are {mesh[-1]} apart; "
                               f"Megatron's tensor-parallel ranks are consecutive", where)
    return tuple(tp)


def _sequence_parallel(plan: Plan, i: int, stage: StagePlan, axis: int) -> bool:
    """Whether the norms split the sequence over tensor-parallel `axis`: all of them (True) or none (False)."""
    where = f"stage {i}"
    sequence_split, replicated = [], []
    for op, info in stage.ops.items():
        if info.kind not in NORM_KINDS:
            continue
        dim = info.axes[axis]
        dims = _tensor_info(plan, info.tensor, f"{where} op {op}")["dims"]
        if dim is None:
            replicated.append(op)
        elif _is_feature_dim(info, dims, axis, dim):
            raise _not_expressible(f"op {op} splits its feature dim {dim} over the tensor-parallel axis {axis}; "
                                   f"Megatron's norms split only the sequence (sequence parallelism)", where)
        else:
            sequence_split.append((op, dim))
    if sequence_split and replicated:
        op, dim = sequence_split[0]
        raise _not_expressible(f"op {op} splits {dim} over the tensor-parallel axis (sequence parallelism) but op "
                               f"{replicated[0]} runs replicated; Megatron's --sequence-parallel splits every norm",
                               where)
    return bool(sequence_split)


def _expert_dims(plan: Plan, i: int, stage: StagePlan, axis: int, batch: frozenset[str]) -> frozenset[str]:
    """The dims the stage splits over `axis` as Megatron-LM's expert parallelism does: an einsum reads every operand
    split along the dim and keeps its output split along it (a stack of weights, each applied to its own slice of
    tokens), and its output lacks the batch dim (the tokens regrouped for their experts: an MoE layer's dispatched
    groups); each rank then holds its experts whole. The attention core reads its heads alike, over the samples; the
    dispatch and combine read the groups alike, which carry the batch (`batch`), over a data-parallel axis."""
    return frozenset(
        info.axes[axis] for op, info in stage.ops.items()
        if info.kind == "einsum" and info.axes[axis] is not None and info.axes[axis] not in batch
        and _runs_experts(info, axis, frozenset({info.axes[axis]}))
        and plan.batch_dim not in _tensor_info(plan, info.tensor, f"stage {i} op {op}")["dims"])


# Megatron-LM's expert grid, innermost first (megatron/core/parallel_state.py:887-895, order tp-ep-dp: global rank
# = etp + ETP·(ep + EP·edp) within a pipeline stage), and what a mesh axis in each place splits of an expert layer
EXPERT_GRID = {"etp": "each expert's weights", "ep": "the experts", "edp": "their tokens"}


def _expert_place(i: int, ops: dict[str, OpStrategy], axis: int, experts: frozenset[str],
                  batch: frozenset[str]) -> tuple[str, str]:
    """Where `axis` sits in Megatron-LM's expert grid (an EXPERT_GRID key) and the dim it splits, read from the ops
    that run the experts; NotExpressibleError for one of them replicated over it (Megatron-LM gives every rank of an
    expert layer its own share) or for two that split unlike places."""
    places: dict[str, tuple[str, str]] = {}
    for op, info in ops.items():
        if info.axes[axis] is None:
            raise _not_expressible(f"op {op} runs its experts replicated over axis {axis}; Megatron-LM gives each rank "
                                   "of an expert layer its own share (expert tensor, expert and expert data "
                                   "parallelism)", f"stage {i}", "split each expert's hidden units over the "
                                   "tensor-parallel axis, or export with --to jax or --to dtensor")
        place = "ep" if _runs_experts(info, axis, experts) else "edp" if info.axes[axis] in batch else "etp"
        places.setdefault(place, (op, info.axes[axis]))
    if len(places) > 1:
        (a, (op_a, dim_a)), (b, (op_b, dim_b)) = list(places.items())[:2]
        raise _not_expressible(f"over axis {axis} op {op_a} splits {dim_a} ({EXPERT_GRID[a]}) but op {op_b} {dim_b} "
                               f"({EXPERT_GRID[b]}); Megatron-LM runs an expert layer's ops on one grid", f"stage {i}")
    place, (_, dim) = next(iter(places.items()))
    return place, dim


def _check_expert_nesting(i: int, grid: dict[int, tuple[str, str]]) -> None:
    """NotExpressibleError unless the mesh axes, axis 1 innermost, nest as Megatron-LM's expert grid (EXPERT_GRID)."""
    order = list(EXPERT_GRID)
    for outer, inner in zip(sorted(grid), sorted(grid)[1:]):
        (o, o_dim), (n, n_dim) = grid[outer], grid[inner]
        if order.index(o) < order.index(n):
            raise _not_expressible(f"axis {outer} splits {EXPERT_GRID[o]} ({o_dim}) and axis {inner} "
                                   f"{EXPERT_GRID[n]} ({n_dim}): Megatron-LM's expert grid orders ranks tp-ep-dp, "
                                   "expert tensor parallelism innermost, then expert parallelism, then expert data "
                                   "parallelism", f"stage {i}", f"split {EXPERT_GRID[o]} over axis {inner} and "
                                   f"{EXPERT_GRID[n]} over axis {outer}, or export with --to jax or --to dtensor")


def _expert_grid(i: int, stage: StagePlan, batch: frozenset[str],
                 experts: dict[int, frozenset[str]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mesh axes over which the ops that run the stage's experts (`_runs_experts`) split them, Megatron-LM's
    expert parallelism, and split each expert's weights, its expert tensor parallelism; the rest split their tokens,
    its expert data parallelism. Checked against its grid (`_expert_place`, `_check_expert_nesting`)."""
    ops = {op: info for k, dims in experts.items() for op, info in stage.ops.items() if _runs_experts(info, k, dims)}
    if not ops:
        return (), ()
    grid = {k: _expert_place(i, ops, k, dims, batch) for k, dims in experts.items()}
    _check_expert_nesting(i, grid)
    return (tuple(k for k, (place, _) in grid.items() if place == "ep"),
            tuple(k for k, (place, _) in grid.items() if place == "etp"))


def _stage_roles(plan: Plan, i: int, stage: StagePlan) -> _StageRoles:
    """Which mesh axes are data parallel and which tensor parallel, checked against Megatron's rules."""
    where = f"stage {i}"
    mesh = _mesh(stage, f"stages[{i}]")
    _check_ops(stage, len(mesh), f"stages[{i}]")
    for op, info in stage.ops.items():
        if info.kind in UNSUPPORTED_BY_MEGATRON:
            raise _not_expressible(f"op {op} is a {info.kind}: Megatron-LM trains transformers, without "
                                   f"convolution or pooling layers", where)
    batch = batch_carriers(plan)
    experts = {k: _expert_dims(plan, i, stage, k, batch) for k in range(len(mesh)) if mesh[k] > 1}
    roles = {k: _axis_role(plan, i, stage, k, batch, dims) for k, dims in experts.items()}
    tp_axes = _tensor_parallel_axes(stage, mesh, [k for k, r in roles.items() if r == "tp"], where)
    dp_axes = tuple(k for k, r in roles.items() if r == "dp")
    for name, info in stage.params.items():
        # an expert's weights split along the experts (Megatron-LM keeps them per expert-parallel rank, their
        # gradients reduced over its expert-data-parallel group: distributed_data_parallel.py:285-287)
        split = [k for k in dp_axes if not isinstance(info.placement[k], Replicate)
                 and info.placement[k] not in {Shard(d) for d in experts[k]}]
        if split:
            raise _not_expressible(f"param {name} is {fmt(info.placement)}, split over data-parallel axis {split[0]}; "
                                   f"Megatron replicates weights across data-parallel ranks (its distributed "
                                   f"optimizer shards only optimizer state)", where)
    sequence_parallel = bool(tp_axes) and _sequence_parallel(plan, i, stage, tp_axes[0])
    return _StageRoles(dp_axes, tp_axes, sequence_parallel, frozenset().union(*experts.values()),
                       *_expert_grid(i, stage, batch, experts))


def _layer_counts(plan: Plan) -> list[int]:
    counts = []
    previous = None
    for i, stage in enumerate(plan.stages):
        first, last = stage.graph_layers
        if not (isinstance(first, int) and isinstance(last, int)):
            raise _not_expressible("the graph's ops carry no integer layer tags; Megatron assigns whole transformer "
                                   "layers to pipeline stages", f"stage {i}", "tag ops with their layer (the model "
                                   "zoo does)")
        if previous is not None and first != previous + 1:
            cause = (f"stages {i - 1} and {i} both hold part of graph layer {first}" if first <= previous else
                     f"stage {i} starts at graph layer {first} but stage {i - 1} ends at {previous}")
            raise _not_expressible(f"{cause}; Megatron cuts pipelines between whole transformer layers", f"stage {i}")
        counts.append(last - first + 1)
        previous = last
    return counts


def _uneven_ends(counts: Sequence[int]) -> tuple[int | None, int | None]:
    """Megatron's --decoder-first/last-pipeline-num-layers for these per-stage layer counts (None: even)."""
    if len(set(counts)) == 1:
        return None, None
    if len(counts) == 2:
        return counts[0], None  # the last stage takes the rest
    middle = counts[1:-1]
    if len(set(middle)) > 1:
        k = next(j for j in range(2, len(counts) - 1) if counts[j] != counts[1])
        raise _not_expressible(f"stage {k} holds {counts[k]} transformer layers but stage 1 holds {counts[1]}; "
                               f"Megatron splits layers evenly (only the first and last stage may differ)",
                               f"stage {k}")
    m = middle[0]
    return (counts[0] if counts[0] != m else None), (counts[-1] if counts[-1] != m else None)


def megatron_config(plan: Plan) -> dict[str, Any]:
    """Megatron-LM's numbers for `plan` (tp, pp, dp, micro/global batch, microbatches, layers, sequence
    parallelism, expert parallelism, distributed optimizer), or NotExpressibleError naming what its uniform form
    cannot hold."""
    if not plan.stages:
        raise InstanceError("the plan has no stages", "stages")
    if platform(plan) != "gpu":
        raise _not_expressible(f"the plan was made for {plan.cluster}'s {platform(plan).upper()} devices, and "
                               "Megatron-LM runs on NVIDIA GPUs only", "platform", "export it with --to jax")
    if plan.batch_dim is None:
        raise _not_expressible("the plan names no batch dim", "batch_dim", "re-solve with a graph that sets batch_dim")
    if plan.schedule not in ("1f1b", "interleaved"):
        raise _not_expressible(f"Megatron-LM runs 1F1B and interleaved 1F1B, not the plan's {plan.schedule} schedule",
                               "schedule", "plan with --schedule 1f1b or interleaved, or export with --to jax or --to dtensor")
    head, S = plan.stages[0], len(plan.stages) // plan.virtual_stages
    for i, stage in enumerate(plan.stages[1:], start=1):
        if stage.logical_mesh != head.logical_mesh:
            raise _not_expressible(f"stage {i} uses logical mesh {tuple(stage.logical_mesh)} but stage 0 uses "
                                   f"{tuple(head.logical_mesh)}", f"stage {i}",
                                   "Megatron runs every pipeline stage on the same (tp, dp) grid")
        if stage.submesh != head.submesh:
            raise _not_expressible(f"stage {i} runs on submesh {tuple(stage.submesh)} but stage 0 on "
                                   f"{tuple(head.submesh)}", f"stage {i}")
    roles = [_stage_roles(plan, i, stage) for i, stage in enumerate(plan.stages)]
    for i, r in enumerate(roles[1:], start=1):
        if (r.dp_axes, r.tp_axes) != (roles[0].dp_axes, roles[0].tp_axes):
            raise _not_expressible(f"stage {i} uses data-parallel axes {list(r.dp_axes)} and tensor-parallel axes "
                                   f"{list(r.tp_axes)} but stage 0 uses {list(roles[0].dp_axes)} and "
                                   f"{list(roles[0].tp_axes)}", f"stage {i}")
        if r.sequence_parallel != roles[0].sequence_parallel:
            on, off = (i, 0) if r.sequence_parallel else (0, i)
            raise _not_expressible(f"stage {on} splits its norms along the sequence but stage {off} does not; "
                                   f"--sequence-parallel holds for every stage", f"stage {i}")
    mesh = head.logical_mesh
    tp = math.prod(mesh[k] for k in roles[0].tp_axes)
    expert_parallel, expert_tp = _expert_sizes(roles, mesh, tp)
    dp = math.prod(mesh[k] for k in roles[0].dp_axes)
    size = tp * dp
    for i, stage in enumerate(plan.stages[:S]):
        expected = list(range(i * size, (i + 1) * size))
        if list(stage.devices) != expected:
            raise _not_expressible(f"stage {i} runs on devices {_span(stage.devices)} but Megatron's pipeline rank {i} "
                                   f"holds global ranks {_span(expected)}", f"stage {i}",
                                   "launch ranks in the plan's device order")
    if plan.microbatch_size % dp:
        raise _not_expressible(f"a microbatch of {plan.microbatch_size} samples does not split over {dp} "
                               f"data-parallel ranks", "microbatch_size")
    modes = [s.recompute for s in plan.stages]
    if len(set(modes)) > 1:
        raise _not_expressible(f"the stages recompute differently ({', '.join(modes)}) but Megatron-LM applies one "
                               "setting to every stage", "stages[*].recompute",
                               "plan with --recompute none, selective or full to export to Megatron-LM, or export "
                               "with --to jax or --to dtensor")
    if plan.virtual_stages > 1 and S == 1:  # Megatron-LM asserts pipeline-model-parallel size > 1 when interleaving
        raise _not_expressible(f"the plan interleaves {plan.virtual_stages} chunks on one pipeline stage, and "
                               "Megatron-LM's interleaved schedule needs at least 2", "schedule",
                               "plan with --schedule 1f1b (one stage runs its layers in order alike), or export "
                               "with --to jax or --to dtensor")
    counts = _layer_counts(plan)
    if plan.virtual_stages > 1 and len(set(counts)) > 1:
        k = counts.index(next(c for c in counts if c != counts[0]))
        raise _not_expressible(f"virtual stage {k} holds {counts[k]} transformer layers but virtual stage 0 holds "
                               f"{counts[0]}; Megatron's interleaved schedule gives every chunk equally many",
                               f"stage {k}", "export with --to jax or --to dtensor")
    first, last = _uneven_ends(counts)
    zero = any(k in roles[0].dp_axes for s in plan.stages for info in s.params.values()
               for k in info.zero_axes)
    return {"tp": tp, "pp": S, "dp": dp,
            "layers_per_virtual_stage": counts[0] if plan.virtual_stages > 1 else None,
            "micro_batch_size": plan.microbatch_size // dp,
            "global_batch_size": plan.microbatch_size * plan.num_microbatches,
            "num_microbatches": plan.num_microbatches,
            "num_layers": sum(counts), "layers_per_stage": counts,
            "first_stage_layers": first, "last_stage_layers": last,
            "sequence_parallel": roles[0].sequence_parallel and tp > 1,
            "expert_parallel": expert_parallel, "expert_tensor_parallel": expert_tp,
            "num_experts": _num_experts(plan, roles),
            "tp_comm_overlap": bool(plan.options.get("megatron", {}).get("tp_comm_overlap")),
            "distributed_optimizer": zero, "recompute": recomputation(plan.stages[0]),
            "overlap_grad_reduce": bool(plan.options.get("overlap", False)),
            # the updated weights gathered under the next forward, as priced (docs/COSTMODEL.md §5b)
            "overlap_param_gather": zero and bool(plan.options.get("overlap", False)),
            "attention_backend": "flash" if fused_attention(plan) else None,
            # Transformer Engine's FP8 GEMMs: E4M3 forward, E5M2 gradients (Megatron's and NeMo's usual recipe)
            "fp8_format": "hybrid" if plan.matmul_dtype == "fp8" else None,
            "precision": _precision(plan), "optimizer": _optimizer(plan),
            "model": _model_arguments(plan, sum(counts), tp)}


def _num_experts(plan: Plan, roles: Sequence[_StageRoles]) -> int | None:
    """The size of the dim the stages split as experts, which Megatron-LM's --expert-model-parallel-size needs as
    --num-experts (arguments.py asserts it is set and a multiple of the expert-parallel size, which the plan's even
    split of it guarantees); None without experts; NotExpressibleError for experts of different counts."""
    sizes = {name: info["shape"][info["dims"].index(d)] for d in sorted(set().union(*(r.experts for r in roles)))
             for name, info in plan.tensors.items() if d in info["dims"]}
    if len(set(sizes.values())) > 1:
        raise _not_expressible(f"the stages split experts of {len(set(sizes.values()))} different counts, and "
                               "Megatron-LM's --num-experts gives every MoE layer one", "tensors")
    return next(iter(sizes.values()), None)


def _expert_sizes(roles: Sequence[_StageRoles], mesh: Sequence[int], tp: int) -> tuple[int, int | None]:
    """Megatron-LM's --expert-model-parallel-size and --expert-tensor-parallel-size: the products of the axes that
    split the experts and each expert's weights (`_expert_grid`); (1, None) without experts split. With them, the
    expert grid ETP × EP × PP divides the world (parallel_state.py:874-884) as the axes' product does, and --num-experts
    is a multiple of EP (arguments.py:1655-1658) as the plan's even split is. NotExpressibleError for stages laid out
    differently (one setting holds for every MoE layer), or tensor parallelism without sequence parallelism: Megatron-LM's
    MoE layer raises when trained so (megatron/core/transformer/moe/moe_layer.py:636-640)."""
    with_experts = [i for i, r in enumerate(roles) if r.expert_axes]
    if not with_experts:
        return 1, None
    i = with_experts[0]
    ep_axes, etp_axes = roles[i].expert_axes, roles[i].expert_tp_axes
    for j in with_experts[1:]:
        if (roles[j].expert_axes, roles[j].expert_tp_axes) != (ep_axes, etp_axes):
            raise _not_expressible(f"stage {j} splits its experts over axes {list(roles[j].expert_axes)} (each expert "
                                   f"over {list(roles[j].expert_tp_axes)}) but stage {i} over {list(ep_axes)} "
                                   f"({list(etp_axes)}); Megatron-LM lays out every MoE layer alike", f"stage {j}")
    if tp > 1 and not roles[i].sequence_parallel:
        raise _not_expressible(f"the plan splits the experts ({', '.join(sorted(roles[i].experts))}) under tensor "
                               "parallelism but no norm splits the sequence, and Megatron-LM's MoE layers train with "
                               "tensor parallelism only under --sequence-parallel", f"stage {i}",
                               "plan with sequence parallelism (partopt evaluate --sequence-parallel), or export with "
                               "--to jax or --to dtensor")
    return math.prod(mesh[k] for k in ep_axes), math.prod(mesh[k] for k in etp_axes)


MEGATRON_OPTIMIZERS = {"adam": None, "sgd": "sgd"}  # partopt's optimizer -> Megatron-LM's --optimizer (adam: its default)


def _optimizer(plan: Plan) -> str | None:
    """Megatron-LM's `--optimizer` for the optimizer whose state the plan priced (None: its default, Adam, or a plan
    that records none); NotExpressibleError for one Megatron-LM does not offer."""
    if plan.optimizer is None or plan.optimizer in MEGATRON_OPTIMIZERS:
        return MEGATRON_OPTIMIZERS.get(plan.optimizer)
    raise _not_expressible(f"the plan priced {plan.optimizer}'s state, and Megatron-LM offers no {plan.optimizer} "
                           f"(its --optimizer takes adam, sgd and others partopt does not price)", "optimizer",
                           "generate the graph with --optimizer adam or sgd, or export with --to jax or --to dtensor")


def _model_arguments(plan: Plan, num_layers: int, tp: int) -> list[str]:
    """Megatron-LM's model arguments for the plan's `architecture` (none when the graph recorded none): the
    shapes the plan priced, so that a runtime given them trains that model and no other. Megatron-LM pads the
    tokenizer's vocabulary up to a multiple of `--make-vocab-size-divisible-by` × tp (128 by default): V / tp makes
    the padded vocabulary the priced V for any tokenizer of at most V tokens (1 when tp does not divide V: the
    nearest multiple of tp)."""
    a = plan.architecture
    if a is None:
        return []
    if a["layers"] != num_layers:
        raise InstanceError(f"the stages hold {num_layers} transformer layers but the architecture records "
                            f"{a['layers']}", "architecture.layers", "re-solve the plan on its graph")
    # Megatron-LM's TransformerConfig: each tensor-parallel rank holds whole heads, and whole query groups or a share
    # of one (it raises otherwise)
    if a["heads"] % tp:
        raise _not_expressible(f"tensor-parallel size {tp} does not divide the {a['heads']} attention heads, and "
                               "Megatron-LM gives each rank whole heads", "architecture.heads",
                               "plan with a tensor-parallel size that divides the heads, or export with --to jax or "
                               "--to dtensor")
    if a["kv_heads"] % tp and tp % a["kv_heads"]:
        raise _not_expressible(f"tensor-parallel size {tp} neither divides nor is divided by the {a['kv_heads']} "
                               "query groups, as Megatron-LM requires", "architecture.kv_heads",
                               "plan with another tensor-parallel size, or export with --to jax or --to dtensor")
    args = ["--hidden-size", str(a["hidden"]), "--ffn-hidden-size", str(a["ffn"]),
            "--num-attention-heads", str(a["heads"]), "--seq-length", str(a["seq"]),
            "--max-position-embeddings", str(a["seq"]), "--attention-dropout", f"{a['attention_dropout']:g}",
            "--hidden-dropout", "0",  # partopt's graphs drop no hidden states (Megatron-LM's default is 0.1)
            "--make-vocab-size-divisible-by", str(a["vocab"] // tp if a["vocab"] % tp == 0 else 1)]
    if "head_dim" in a:
        args += ["--kv-channels", str(a["head_dim"])]
    if a["kv_heads"] != a["heads"]:
        args += ["--group-query-attention", "--num-query-groups", str(a["kv_heads"])]
    if a["norm"] == "rmsnorm":
        args += ["--normalization", "RMSNorm"]
    if a["mlp"] == "swiglu":
        args.append("--swiglu")
    if a["positions"] == "rotary":
        args += ["--position-embedding-type", "rope"]
    if not a["tied"]:
        args.append("--untie-embeddings-and-output-weights")
    if not a["bias"]:
        args.append("--disable-bias-linear")
    if a.get("qkv_bias"):
        args.append("--add-qkv-bias")
    if "rope_base" in a:
        args += ["--rotary-base", str(a["rope_base"])]
    if "norm_eps" in a:
        args += ["--norm-epsilon", f"{a['norm_eps']:g}"]
    if a.get("rope_scaling") == "llama3":
        if "rope_scaling_factor" not in a:
            raise InstanceError("the architecture records Llama 3.1's rotary scaling without its factor",
                                "architecture.rope_scaling_factor", "give the config's rope_scaling factor (8 for Llama 3.1)")
        args += ["--use-rope-scaling", "--rope-scaling-factor", f"{a['rope_scaling_factor']:g}"]
    return args


MEGATRON_PRECISION = {"fp16": "--fp16", "bf16": "--bf16", "fp32": None}  # Megatron-LM trains in fp32 by default


def _precision(plan: Plan) -> str | None:
    """The one dtype Megatron-LM keeps the plan's parameters in (its --fp16 / --bf16 mixed precision, or fp32),
    None when the plan records none; NotExpressibleError for several, or one Megatron cannot train in."""
    dtypes = param_dtypes(plan)
    if dtypes is None:
        return None
    if len(dtypes) > 1 or dtypes[0] not in MEGATRON_PRECISION:
        raise _not_expressible(f"the plan's parameters are {', '.join(dtypes)}; Megatron-LM keeps every parameter "
                               f"in one of {', '.join(MEGATRON_PRECISION)}", "tensors",
                               "generate the graph in one precision, or export with --to jax or --to dtensor")
    return dtypes[0]


def megatron_warnings(plan: Plan) -> list[str]:
    """What Megatron-LM will run differently from how `plan` was priced, or what its line leaves to the user, one line
    each: a graph with no architecture record (the line holds the layout alone); a rotary scaling Megatron-LM has no
    argument for (any but Llama 3.1's); GEMMs priced at another precision than Megatron-LM runs (`_gemm_warnings`); a
    16-bit plan priced in the ZeRO paper's state layout (`_state_layout_warnings`)."""
    layout_only = [] if plan.architecture is not None else [
        "the plan's graph records no transformer architecture: these are the layout's arguments only; add the "
        "model's own (--hidden-size, --num-attention-heads, --seq-length, --max-position-embeddings), which "
        "Megatron-LM requires"]
    scaling = (plan.architecture or {}).get("rope_scaling")
    unscaled = [] if scaling in (None, "llama3") else [
        f"the model's {scaling} rotary scaling has no Megatron-LM argument (its --use-rope-scaling applies Llama 3.1's "
        "bands alone): the line trains unscaled rotary positions; the plan's cost is the same"]
    return [*layout_only, *unscaled, *_gemm_warnings(plan), *_state_layout_warnings(plan)]


def _gemm_warnings(plan: Plan) -> list[str]:
    """The GEMM precision the plan priced where Megatron-LM's line runs another: it runs GEMMs in its parameters'
    dtype (--fp16, --bf16, else fp32) or FP8 (--fp8-format), and has no TF32 argument (megatron/training/arguments.py
    at d98e8a6 names none). Its fp32 GEMMs are TF32 only where Transformer Engine runs them (its cublaslt_gemm.cu
    computes fp32 GEMMs in CUBLAS_COMPUTE_32F_FAST_TF32); torch's own, such as the output layer's torch.matmul
    (megatron/core/tensor_parallel/layers.py), run in full fp32 unless TF32 is allowed, which torch's default is not
    (aten/src/ATen/Context.h: float32_matmul_precision is HIGHEST unless TORCH_ALLOW_TF32_CUBLAS_OVERRIDE is set)."""
    runs = "fp8" if plan.matmul_dtype == "fp8" else _precision(plan) or "fp32"
    priced = plan.matmul_dtype or runs
    if priced == runs:
        return []
    if (priced, runs) == ("tf32", "fp32"):
        return ["the plan priced its fp32 GEMMs in TF32, which Megatron-LM has no argument for: Transformer Engine's "
                "layers run fp32 GEMMs in TF32, but torch's own matmuls (the output layer's) run in full fp32 unless "
                "TF32 is allowed, which torch's default is not: launch with TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, or set "
                "torch.backends.cuda.matmul.allow_tf32 = True in the training script"]
    return [f"the plan priced its GEMMs in {priced}, but Megatron-LM runs them in {runs}, its parameters' precision: "
            "re-plan the graph without matmul_dtype to price the GEMMs it runs"]


def _state_layout_warnings(plan: Plan) -> list[str]:
    """A 16-bit plan priced in the ZeRO paper's state layout, whose gradients Megatron-LM keeps in fp32
    (`costmodel.STATE_LAYOUTS`): the same bytes more per parameter under any optimizer, the totals said with the
    plan's."""
    precision = _precision(plan)
    if precision not in ("fp16", "bf16") or plan.options.get("state_layout", "zero") == "megatron":
        return []
    optimizer = plan.optimizer or "adam"  # a plan written before the record: Megatron-LM's default
    priced, kept = (costmodel.param_memory(1, precision, optimizer, layout).total for layout in ("zero", "megatron"))
    return [f"the plan was priced in the ZeRO paper's state layout (zero), but Megatron-LM keeps {kept - priced} more "
            f"bytes per parameter in {precision} (fp32 gradients; with {optimizer} {kept} bytes where {priced} were "
            "priced; docs/COSTMODEL.md §5): plan with --state-layout megatron to price the memory it will use"]


def _span(ids: Sequence[int]) -> str:
    ids = list(ids)
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}–{ids[-1]}"
    return str(ids)


def to_megatron(plan: Plan) -> list[str]:
    """Megatron-LM command-line arguments for `plan` (see `megatron_config` for when it raises)."""
    c = megatron_config(plan)
    args = ["--tensor-model-parallel-size", str(c["tp"]), "--pipeline-model-parallel-size", str(c["pp"]),
            "--num-layers", str(c["num_layers"]), *c["model"]]
    if c["first_stage_layers"] is not None:
        args += ["--decoder-first-pipeline-num-layers", str(c["first_stage_layers"])]
    if c["last_stage_layers"] is not None:
        args += ["--decoder-last-pipeline-num-layers", str(c["last_stage_layers"])]
    if c["layers_per_virtual_stage"] is not None:
        args += ["--num-layers-per-virtual-pipeline-stage", str(c["layers_per_virtual_stage"])]
    args += ["--micro-batch-size", str(c["micro_batch_size"]), "--global-batch-size", str(c["global_batch_size"])]
    if c["sequence_parallel"]:
        args.append("--sequence-parallel")
    if c["expert_parallel"] > 1:
        args += ["--num-experts", str(c["num_experts"]), "--expert-model-parallel-size", str(c["expert_parallel"]),
                 "--expert-tensor-parallel-size", str(c["expert_tensor_parallel"])]
    if c["tp_comm_overlap"]:
        args.append("--tp-comm-overlap")
    if c["distributed_optimizer"]:
        args.append("--use-distributed-optimizer")
    if c["overlap_grad_reduce"]:
        args.append("--overlap-grad-reduce")
    if c["overlap_param_gather"]:
        args.append("--overlap-param-gather")
    if c["attention_backend"]:
        args += ["--attention-backend", c["attention_backend"]]
    if c["precision"] and MEGATRON_PRECISION[c["precision"]]:
        args.append(MEGATRON_PRECISION[c["precision"]])
    if c["optimizer"]:
        args += ["--optimizer", c["optimizer"]]
    if c["fp8_format"]:
        args += ["--fp8-format", c["fp8_format"]]
    if c["recompute"]:
        r = c["recompute"]
        args += ["--recompute-granularity", r["granularity"]]
        if "method" in r:
            args += ["--recompute-method", r["method"], "--recompute-num-layers", str(r["num_layers"])]
    return args


# ---------------------------------------------------------------- the CLI's text

def export(plan: Plan, target: str, torch_shapes: dict[str, tuple[int, ...]] | None = None) -> str:
    """The text `partopt export` prints: JSON for jax/dtensor, one shell-quoted argument line for megatron."""
    if torch_shapes is not None and target != "dtensor":
        raise PartoptError(f"torch parameter shapes apply to --to dtensor, not --to {target}", "export",
                           "drop --model, or export --to dtensor")
    if target == "jax":
        return json.dumps(to_jax(plan), indent=1)
    if target == "dtensor":
        return json.dumps(to_dtensor(plan, torch_shapes), indent=1)
    if target == "megatron":
        return shlex.join(to_megatron(plan))
    raise PartoptError(f"unknown export target {target!r}", "export", f"targets: {', '.join(TARGETS)}")
