"""Prove a plan in PyTorch: each stage's parameter shardings applied with DTensor on gloo CPU
processes, one training step, compared with the unsharded step (loss, every gradient) and with
the collectives the plan implies, module by module (`verify_torch_comm`).

The model is a Hugging Face config.json or `pkg.mod:make` / `file.py:make` (see
`partopt.frontends.torch.load_source`), built with random weights from a fixed seed in every
process. A stage runs the whole model on its own mesh: its parameters take the plan's
placements, the others are replicated, each model input is placed as its first reader requires,
activations are redistributed to the plan's layouts where modules begin (and the model's output
where the loss reads it), and gradients are then reduced to the placement the plan's
synchronisation gives them (reduce-scatter to the optimizer-state shard and all-gather back
under ZeRO, else all-reduce). torch is imported lazily.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from partopt import costmodel
from partopt.errors import PartoptError
from partopt.frontends.torch_axes import torch_placements
from partopt.export import AXIS_NAMES, TensorPlacement, optimizer_placement
from partopt.plan import Plan, plan_from_dict, plan_to_dict
from partopt.sharding import SMALL_BYTES, R, Shard, fmt, parse_placement
from partopt.verify_torch_comm import TOP_LEVEL, Pin, compare, compared, input_placements, pins, \
    planned_calls
from partopt.verify_torch_moe import expert_modules, expert_parallel, expert_splits

MAX_PROCESSES = 8  # one CPU process per device of a stage
RTOL, ATOL = 1e-4, 1e-5  # fp32 on CPU: a sharded sum differs from the unsharded one by rounding only
SEED = 0
DONE_WAIT_S = 60.0  # how long a finished rank waits for its peers before it exits anyway


@dataclass
class Check:
    """One comparison: what, whether it held, and the numbers."""

    name: str
    ok: bool
    detail: str


@dataclass
class StageReport:
    stage: int
    mesh: list[int]
    checks: list[Check] = field(default_factory=list)
    placements: dict[str, str] = field(default_factory=dict)  # parameter FQN -> the DTensor placements applied
    notes: list[str] = field(default_factory=list)  # plan placements DTensor cannot express, replaced
    calls: list[dict[str, Any]] = field(default_factory=list)  # the DTensor step's collectives: module, kind, …
    planned: list[dict[str, Any]] = field(default_factory=list)  # those the plan implies (verify_torch_comm)
    differences: list[str] = field(default_factory=list)  # per (module, kind, axis): count or bytes differ


@dataclass
class VerifyReport:
    plan: str
    stages: list[StageReport]
    pipeline: Any = None  # a verify_torch_pipeline.PipelineReport when the plan has several stages

    @property
    def ok(self) -> bool:
        pipelined = self.pipeline.checks if self.pipeline is not None else []
        return all(c.ok for s in self.stages for c in s.checks) and all(c.ok for c in pipelined)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan, "ok": self.ok, "stages": [asdict(s) for s in self.stages],
                "pipeline": None if self.pipeline is None else asdict(self.pipeline)}

    def lines(self) -> list[str]:
        out = []
        for s in self.stages:
            out.append(f"stage {s.stage} on a {s.mesh[0]} x {s.mesh[1]} mesh ({s.mesh[0] * s.mesh[1]} gloo processes)")
            for c in s.checks:
                out.append(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
                if c.name == "collectives":
                    out += [f"    {d}" for d in s.differences]
            out += [f"  note {n}" for n in s.notes]
        if self.pipeline is not None:
            out += self.pipeline.lines()
        out.append("loss, gradients and collectives match" if self.ok else "MISMATCH: see the FAIL lines")
        return out


# ---------------------------------------------------------------- placements

def _placement_text(spec: list[tuple[str, int | None]]) -> str:
    return "[" + ", ".join(f"Shard({a})" if kind == "shard" else "Replicate()" for kind, a in spec) + "]"


# ---------------------------------------------------------------- the model

def _build(source: str, plan: Plan | None, microbatches: int = 1) -> tuple[Any, list[Any], Any]:
    """(model with seeded random weights, its inputs, loss(model output, inputs)); `plan` gives a
    Hugging Face model its microbatch shape (verify_plan checked it has input_ids), `microbatches`
    of them make the batch."""
    import torch

    from partopt.frontends.torch import load_source, read_hf_config

    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    if source.endswith(".json"):
        from transformers import AutoModelForCausalLM

        config = read_hf_config(source)
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        _init_experts(model, config.initializer_range)
        if plan is None or "input_ids" not in plan.tensors:
            raise PartoptError("a Hugging Face model is verified against a plan with input_ids", "verify")
        shape = plan.tensors["input_ids"]["shape"]
        ids = torch.randint(0, config.vocab_size, (shape[0] * microbatches, *shape[1:]), generator=gen)

        def hf_loss(out: Any, inputs: list[Any]) -> Any:
            logits = out.logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs[0].reshape(-1))
        model.eval()  # no dropout: both runs see the same function
        return model, [ids], hf_loss
    with torch.device("cpu"):
        model, examples = _call_source(source, load_source)
    inputs = [torch.randn(tuple(x.shape), generator=gen) if x.is_floating_point() else torch.zeros_like(x, device="cpu")
              for x in examples]
    model.eval()

    def square_loss(out: Any, inputs: list[Any]) -> Any:
        return (out if isinstance(out, torch.Tensor) else out[0]).square().mean()
    return model, inputs, square_loss


def _init_experts(model: Any, std: float) -> None:
    """Seeded normal weights for the 3-D expert parameters, which from_config leaves uninitialised."""
    import torch

    from partopt.frontends.torch_moe import is_experts

    for module in model.modules():
        if is_experts(module):
            for p in module.parameters(recurse=False):
                torch.nn.init.normal_(p, std=std)


def _call_source(source: str, load: Any) -> tuple[Any, list[Any]]:
    """load_source's module and inputs, materialised on the CPU with seeded weights."""
    import torch

    module, inputs = load(source)
    module = module.to_empty(device="cpu")
    torch.manual_seed(SEED)
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return module, [torch.empty(tuple(x.shape), dtype=x.dtype) for x in inputs]


def _step(model: Any, inputs: list[Any], loss_fn: Any) -> tuple[Any, dict[str, Any]]:
    loss = loss_fn(model(*inputs), inputs)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


# ---------------------------------------------------------------- one process

def _worker(rank: int, world: int, source: str, plan_data: dict, stage_index: int, run_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor, init_device_mesh
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.experimental import implicit_replication

    warnings.filterwarnings("ignore")  # the library never prints; torch warns about DTensor's module hooks
    dist.init_process_group("gloo", init_method=rendezvous(run_dir), rank=rank, world_size=world)
    # DTensor has sharding rules for attention's math kernel, not for the CPU flash kernel
    math_attention = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
    math_attention.__enter__()
    try:
        torch.set_num_threads(1)
        plan = plan_from_dict(plan_data)
        stage = plan.stages[stage_index]
        model, inputs, loss_fn = _build(source, plan)
        ref_loss, ref_grads = _step(model, inputs, loss_fn)
        mesh = init_device_mesh("cpu", tuple(stage.logical_mesh), mesh_dim_names=AXIS_NAMES)
        sizes = _dim_sizes(plan)

        def as_torch(spec: list[tuple[str, int | None]]) -> list[Any]:
            return [TShard(a) if kind == "shard" else Replicate() for kind, a in spec]

        applied, notes, grad_targets, states = {}, [], {}, {}
        names_of: dict[int, list[str]] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(fqn)
        for fqn, p in list(model.named_parameters()):
            spec, sync = _param_specs(plan, stage, fqn, tuple(p.shape), sizes, notes, states)
            param = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, as_torch(spec)))
            for name in names_of[id(p)]:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner) if owner else model, leaf, param)
            applied[fqn] = _placement_text(spec)
            if fqn in stage.params or any(k.startswith(fqn + "[") for k in stage.params):
                grad_targets[fqn] = (as_torch(sync), as_torch(spec))
        batch_axes = _batch_axes(stage, plan.batch_dim)
        for path, split in expert_splits(plan, stage, batch_axes).items():
            expert_parallel(model.get_submodule(path), mesh, split)
        placed = input_placements(plan, stage_index)
        names = [t for t, info in plan.tensors.items() if info["role"] == "input" and t != "labels"]
        replicated = (R,) * len(AXIS_NAMES)

        def as_placed(name: str, x: Any) -> Any:
            spec, _ = torch_placements(name, placed.get(name, replicated), tuple(x.shape),
                                       plan.tensors[name]["dims"], sizes)
            return distribute_tensor(x, mesh, as_torch(spec))
        dinputs = [as_placed(name, x) for name, x in zip(names, inputs)]
        labels = [as_placed("labels", inputs[0])] if "labels" in plan.tensors else dinputs
        place = _pin(model, pins(plan, stage_index), plan, mesh, sizes, skip=tuple(expert_modules(plan)))
        with implicit_replication():
            with _recorder(mesh) as comm:
                loss = loss_fn(_placed_output(model(*dinputs), place), labels)
                loss.backward()
            with _recorder(mesh, TOP_LEVEL) as sync:
                for fqn, p in model.named_parameters():  # the stage's gradient synchronisation, as priced
                    if fqn in grad_targets:
                        shard, back = grad_targets[fqn]
                        p.grad = p.grad.redistribute(mesh, shard).redistribute(mesh, back)
        calls = comm.calls + sync.calls
        loss_value = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        grads = {fqn: p.grad.full_tensor() for fqn, p in model.named_parameters()}
        if rank == 0:
            worst = []
            for fqn, g in grads.items():
                ref = ref_grads[fqn]
                if not torch.allclose(g, ref, rtol=RTOL, atol=ATOL):
                    worst.append((fqn, float((g - ref).abs().max())))
            Path(run_dir, "result.json").write_text(json.dumps({
                "loss": float(loss_value), "ref_loss": float(ref_loss), "grad_mismatch": worst,
                "params": len(grads), "calls": calls, "placements": applied, "states": states,
                "notes": notes}))
        finish(rank, world, run_dir)
    finally:
        math_attention.__exit__(None, None, None)
        dist.destroy_process_group()


def _recorder(mesh: Any, module: str | None = None) -> Any:
    """A CommDebugMode that also lists every collective call as {module, kind, axis, bytes, backward}
    in `.calls`: the innermost module running (its FQN; TOP_LEVEL outside every module, or `module`
    for all), the mesh axis its process group spans ("x", "y", "x,y"), and the bytes partopt prices
    (all-gather: the gathered output; the others: the input buffer)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    coordinate = mesh.get_coordinate()
    ids = mesh.mesh
    spans = {frozenset(ids[:, coordinate[1]].tolist()): "x", frozenset(ids[coordinate[0], :].tolist()): "y"}
    spans.setdefault(frozenset(ids.flatten().tolist()), "x,y")

    def axis_of(args: tuple) -> str:
        group = next((a for a in reversed(args) if isinstance(a, (str, torch.ScriptObject))), None)  # funcol: last
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)
        elif group is not None:
            group = dist.ProcessGroup.unbox(group)
        ranks = frozenset(dist.get_process_group_ranks(group)) if group is not None else frozenset()
        return spans.get(ranks, "ranks " + ",".join(map(str, sorted(ranks))))

    class Recorder(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[dict[str, Any]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if out is not NotImplemented and (packet in self.comm_registry or "c10d." in str(packet)):
                kind = _kind(packet)
                if kind in costmodel.COLLECTIVES:
                    tensors = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
                    buffer = tensors[1] if str(packet).endswith("_base_") else tensors[0]  # c10d's (output, input)
                    nbytes = buffer.numel() * buffer.element_size()
                    axis = axis_of(args)
                    if kind == "all_gather":
                        nbytes *= math.prod(mesh.size(k) for k, a in enumerate(AXIS_NAMES) if a in axis.split(","))
                    self.calls.append({"module": module or _fqn(self.advanced_module_tracker.name), "kind": kind,
                                       "axis": axis, "bytes": nbytes, "floating": buffer.is_floating_point(),
                                       "backward": bool(self.advanced_module_tracker.is_bw)})
            return out

    return Recorder()


def _pin(model: Any, planned: list[Pin], plan: Plan, mesh: Any, sizes: dict[str, int], skip: tuple[str, ...]) -> Any:
    """Redistribute each activation entering a module to the layout the plan pins it in (`verify_torch_comm.pins`)
    by a forward pre-hook, and a pending sum leaving a module by a forward hook, matching the DTensors to the
    pinned tensors by their number of elements (one that matches none, or several, is left as DTensor has it);
    at a tensor's first entry its gradient goes back to the layout it arrived in (a pending gradient reduced
    there, as the plan does, not carried on by DTensor). Experts modules run their own exchange
    (`verify_torch_moe`) and are left alone, with everything inside them. Returns the placing function of the
    loss's pins (TOP_LEVEL), for the model's output."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor import Shard as TShard

    class GradientTo(torch.autograd.Function):
        """The identity, whose backward redistributes the gradient (a pending sum reduced where the plan does)."""

        @staticmethod
        def forward(ctx: Any, x: Any, placements: list[Any]) -> Any:
            ctx.placements = placements
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
            return grad.redistribute(mesh, ctx.placements), None

    by_module: dict[tuple[str, bool], list[Pin]] = {}
    for pin in planned:
        if not any(pin.module == m or pin.module.startswith(m + ".") for m in skip):
            by_module.setdefault((pin.module, pin.exit), []).append(pin)

    def placer(module_pins: list[Pin]) -> Any:
        def place(x: Any) -> Any:
            if not isinstance(x, DTensor):
                return x
            fits = [p for p in module_pins if math.prod(plan.tensors[p.tensor]["shape"]) == x.numel()]
            if len(fits) != 1:
                return x
            spec = _activation_spec(plan.tensors[fits[0].tensor], fits[0].placement, tuple(x.shape), sizes)
            if spec is None:
                return x
            target = [TShard(a) if kind == "shard" else Replicate() for kind, a in spec]
            arrived = [Replicate() if isinstance(p, Partial) else p for p in x.placements]
            y = x if list(x.placements) == target else x.redistribute(mesh, target)
            return GradientTo.apply(y, arrived) if fits[0].gradient and y.requires_grad else y
        return place

    for (name, leaving), module_pins in by_module.items():
        if name == TOP_LEVEL:
            continue
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue  # an op named after no module (a function's result): nothing to hook
        place = placer(module_pins)
        if leaving:
            module.register_forward_hook(lambda m, args, out, place=place: _placed_output(out, place))
        else:
            module.register_forward_pre_hook(
                lambda m, args, kwargs, place=place: (tuple(place(a) for a in args),
                                                      {k: place(v) for k, v in kwargs.items()}), with_kwargs=True)
    return placer(by_module.get((TOP_LEVEL, False), []))


def _placed_output(out: Any, place: Any) -> Any:
    """A module's output with its tensor (a Hugging Face output's logits, a tuple's first) placed."""
    if hasattr(out, "logits"):
        out["logits"] = place(out.logits)
        return out
    return place(out) if not isinstance(out, (tuple, list)) else type(out)([place(out[0]), *out[1:]])


def _activation_spec(tensor: dict[str, Any], placement: Any, shape: tuple[int, ...],
                     sizes: dict[str, int]) -> list[tuple[str, int | None]] | None:
    """An activation's placement on torch axes: as a parameter's (`torch_placements`) when its dims lay out the
    torch shape; else, when it splits only its leading dim, that dim is torch axis 0 (a module's input seen
    through a reshape: attention's context [b, g, r, s, d] as o_proj's [b, s, g·r·d]); else None."""
    try:
        spec, _ = torch_placements("activation", placement, shape, tensor["dims"], sizes)
        return spec
    except PartoptError:
        lead = tensor["dims"][0] if tensor["dims"] else None
        if all(p == R or (p == Shard(lead) and shape[0] == tensor["shape"][0]) for p in placement):
            return [("shard", 0) if p != R else ("replicate", None) for p in placement]
        return None


def _fqn(tracked: str) -> str:
    """CommDebugMode's module name ("Global", "LlamaForCausalLM.model.norm") as an FQN ("" the model)."""
    return TOP_LEVEL if tracked == "Global" else tracked.partition(".")[2]


def _kind(op: Any) -> str:
    """A collective's kind in partopt's names (c10d's spellings, c10d.alltoall_base_, as funcol's)."""
    name = str(op).replace("alltoall", "all_to_all").replace("allgather", "all_gather").replace(
        "allreduce", "all_reduce")
    return next((k for k in costmodel.COLLECTIVES if k in name), name)


def _dim_sizes(plan: Plan) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for info in plan.tensors.values():
        sizes.update(zip(info["dims"], info["shape"]))
    return sizes


def _param_specs(plan: Plan, stage: Any, fqn: str, shape: tuple[int, ...], sizes: dict[str, int],
                 notes: list[str], states: dict[str, str]) -> tuple[list, list]:
    """(the parameter's placement, its gradient's synchronised placement) in DTensor terms; an optimizer-state
    shard DTensor cannot express is left replicated, with a note and its run placement in `states`."""
    replicated = [("replicate", None)] * len(AXIS_NAMES)
    name, info = fqn, stage.params.get(fqn)
    if info is None:
        chunks = [k for k in stage.params if k.startswith(fqn + "[")]
        if not chunks:
            return replicated, replicated
        if len({stage.params[k] for k in chunks}) > 1:  # alike chunks are one placement of the whole tensor
            notes.append(f"{fqn}: the plan shards its chunks {', '.join(chunks)} differently; one DTensor cannot: "
                         "replicated")
            return replicated, replicated
        name, info = chunks[0], stage.params[chunks[0]]
    dims = tuple(plan.tensors[name]["dims"])
    spec, why = torch_placements(name, info.placement, shape, dims, sizes)
    notes.extend(why)
    t = TensorPlacement(name, "param", dims, tuple(plan.tensors[name]["shape"]), info.placement, info.zero_axes)
    state, _flat = optimizer_placement(t, tuple(stage.logical_mesh))
    sync, why = torch_placements(name, state, shape, dims, sizes)
    ran = tuple(p if kind == "shard" else q for p, q, (kind, _) in zip(state, info.placement, sync))
    if ran != state:
        notes.extend(f"{text}; its gradient is synchronised to {fmt(ran)}, not the optimizer state's {fmt(state)}"
                     for text in dict.fromkeys(why))  # one note a parameter, not one a mesh axis
        states[fqn] = fmt(ran)
    return spec, sync


def _batch_axes(stage: Any, batch_dim: str | None) -> set[int]:
    """Mesh axes on which the stage's first op splits the batch dim."""
    first = next(iter(stage.ops.values()), None)
    if first is None or batch_dim is None:
        return set()
    return {k for k, d in enumerate(first.axes) if d == batch_dim}


def finish(rank: int, world: int, run_dir: str) -> None:
    """End a worker whose results are written: wait until every rank is done, then exit at once.

    gloo can abort a process at teardown (SIGABRT, "terminate called without an active exception")
    when a peer closes its sockets first. A rank that leaves only once every rank is done, and leaves
    without running destructors, gives that race nothing to break (docs/FRONTENDS.md)."""
    import torch.distributed as dist

    dist.barrier()
    Path(run_dir, f"done{rank}").touch()
    deadline = time.monotonic() + DONE_WAIT_S
    while not _all_done(run_dir, world) and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(0)


def _all_done(run_dir: str, world: int) -> bool:
    return all(Path(run_dir, f"done{k}").exists() for k in range(world))


def spawn(worker: Any, args: tuple, world: int, run_dir: str) -> None:
    """Run `worker(rank, *args)` in `world` processes and wait for them. A process that dies after every
    rank has written its results and passed the final barrier died in the runtime's teardown, not in the
    step: that is not a failure of the plan (see `finish`)."""
    import torch.multiprocessing as mp

    try:
        mp.spawn(worker, args=args, nprocs=world, join=True)
    except Exception:
        if not _all_done(run_dir, world):
            raise


def rendezvous(directory: str) -> str:
    """The init_method of one run's process group: a file in the run's own directory. A TCP port chosen
    free and released before the processes bind it can be chosen meanwhile by another run on the machine,
    and two runs given one port cross: a worker joins the other run's group (docs/FRONTENDS.md)."""
    return "file://" + os.path.join(directory, "rendezvous")


# ---------------------------------------------------------------- entry point

def verify_plan(plan: Plan, source: str) -> VerifyReport:
    """Run every stage's shardings with DTensor and compare with the unsharded step (see the module doc)."""
    from partopt.frontends.torch import read_hf_config

    if source.endswith(".json"):  # fail here, not in every process
        read_hf_config(source)
        if "input_ids" not in plan.tensors:
            raise PartoptError("the plan has no tensor input_ids: it is not a plan of a graph imported from a "
                               "Hugging Face config", "verify", "solve the graph of `partopt import hf` for this config")
    for i, stage in enumerate(plan.stages):  # refuse what the run cannot express before any process starts
        expert_splits(plan, stage, set())
        pins(plan, i)
    stages = []
    for i, stage in enumerate(plan.stages):
        world = math.prod(stage.logical_mesh)
        if world > MAX_PROCESSES:
            raise PartoptError(f"stage {i} runs on {world} devices; verify starts one CPU process per device, "
                               f"at most {MAX_PROCESSES}", "verify", "verify a plan of a smaller cluster")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                spawn(_worker, (world, source, plan_to_dict(plan), i, tmp), world, tmp)
            except Exception as err:  # a worker's failure arrives as ProcessRaisedException with its traceback
                last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                raise PartoptError(f"stage {i}: the DTensor run failed: {last}", "verify",
                                   "check that the plan was solved for the graph of this model") from None
            result = json.loads(Path(tmp, "result.json").read_text())
        stages.append(_report(plan, i, result))
    pipelined = None
    if len(plan.stages) > 1:
        from partopt.verify_torch_pipeline import verify_pipeline

        pipelined = verify_pipeline(plan, source)
    return VerifyReport(plan.graph, stages, pipelined)


def _report(plan: Plan, i: int, r: dict[str, Any]) -> StageReport:
    stage = plan.stages[i]
    splits = expert_splits(plan, stage, _batch_axes(stage, plan.batch_dim))
    summed = {m: s.experts for m, s in splits.items() if s.experts and not s.exchanges}
    report = StageReport(i, list(stage.logical_mesh), placements=r["placements"], notes=r["notes"],
                         calls=r["calls"], planned=planned_calls(plan, i, summed, {
                             name: parse_placement(text, name) for name, text in r["states"].items()}))
    close = math.isclose(r["loss"], r["ref_loss"], rel_tol=RTOL, abs_tol=ATOL)
    report.checks.append(Check("loss", close, f"sharded {r['loss']:.6g}, unsharded {r['ref_loss']:.6g}"))
    bad = r["grad_mismatch"]
    report.checks.append(Check("gradients", not bad, f"{r['params'] - len(bad)} of {r['params']} parameters match"
                               + (f"; worst {bad[0][0]} (max abs diff {bad[0][1]:.3g})" if bad else "")))
    report.differences = compare(report.planned, report.calls, tuple(expert_modules(plan)))
    counted = [c for c in report.calls if compared(c)]
    n = len(report.differences)
    report.checks.append(Check("collectives", not n, f"{len(counted)} calls of DTensor's step over {SMALL_BYTES} B "
                               + (f"as the plan implies (per module forward, over the stage backward and in "
                                  f"the gradient synchronisation)" if not n else
                                  f"differ from the plan's in {n} (module, kind, axis):")))
    return report
