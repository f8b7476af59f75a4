"""Run a plan in JAX: apply each stage's shardings on host CPU devices and check what they compute.

For every stage of the plan, `verify` builds a `jax.sharding.Mesh` of the stage's logical shape,
places the stage's parameters and data by the `export --to jax` PartitionSpecs (keyed by the
caller's pytree paths), pins every activation of the stage to its planned spec with
`with_sharding_constraint` (other stages' ops run replicated) and differentiates each pinned op where
it runs (its backward recomputed from its pinned operands), compiles one training step
(`jax.value_and_grad` of the imported function) on random inputs of one microbatch, and compares:

* loss and every gradient with the unsharded run (`numpy.allclose`);
* the collectives in the compiled HLO (kind, mesh axis from the replica groups, bytes of the full
  buffer as partopt counts it) with those the plan implies: the resharding of every edge forward
  and backward, and the gradient synchronisation of the parameters.

A step has no optimizer, so a ZeRO reduce-scatter + all-gather pair counts as the all-reduce it
splits; a parameter read by several ops counts XLA's all-reduce of each read's partial gradient;
collectives over the whole mesh count as partopt's steps on x and y (docs/FRONTENDS.md, "Conventions
of the comparison"). JAX must see enough devices: set
`XLA_FLAGS=--xla_force_host_platform_device_count=N` before importing jax (`partopt verify` runs
itself in a subprocess that does).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from partopt.errors import PartoptError
from partopt.export import AXIS_NAMES, TensorPlacement, stage_tensors
from partopt.frontends.jax import CALLS, Traced, _sub_jaxpr, trace
from partopt.graph import Graph
from partopt.plan import Plan, StagePlan
from partopt.sharding import SMALL_BYTES, MeshShape, Partial, Placement, R, Shard, as_gradient_target, \
    gradient_placement, reshard_collectives

COLLECTIVES = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
               "all-to-all": "all_to_all", "collective-permute": "permute"}
HLO_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
_COLLECTIVE_LINE = re.compile(r"=\s*(?P<type>\([^=]*\)|\S+)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_GROUPS = re.compile(r"replica_groups=(?P<groups>\{[{}0-9, ]*\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?"
                     r"|mesh\[[^\]]*\]\s*\{[^}]*\})")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')


@dataclass(frozen=True)
class Collective:
    """One collective: kind (partopt's names), mesh axis ("x", "y", "x,y"), bytes of the full buffer, where."""

    kind: str
    axis: str
    bytes: float
    where: str


@dataclass
class StageCheck:
    """What running one stage's shardings showed."""

    stage: int
    mesh: tuple[int, int]
    loss: float
    reference_loss: float
    max_grad_error: float  # largest |sharded - unsharded| over all gradient elements
    numerics_ok: bool
    compiled: list[Collective]
    planned: list[Collective]
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.numerics_ok and not self.mismatches


def microbatch_args(args: Sequence[Any], params_argnum: int, microbatch: int) -> tuple[Any, ...]:
    """The abstract arguments with every data leaf's leading (batch) axis cut to one microbatch."""
    def cut(leaf: Any) -> Any:
        return jax.ShapeDtypeStruct((microbatch, *leaf.shape[1:]), leaf.dtype) if leaf.shape else leaf

    return tuple(a if i == params_argnum else jax.tree_util.tree_map(cut, a) for i, a in enumerate(args))


def verify(plan: Plan, fn: Callable[..., Any], args: Sequence[Any], params_argnum: int = 0, seed: int = 0,
           rtol: float = 1e-4, atol: float = 1e-5) -> list[StageCheck]:
    """Check every stage of `plan` against `fn` (see the module docstring); one StageCheck per stage."""
    needed = max(math.prod(s.logical_mesh) for s in plan.stages)
    if len(jax.devices()) < needed:
        raise PartoptError(f"JAX sees {len(jax.devices())} devices, the plan's largest stage needs {needed}",
                           "verify", f"set XLA_FLAGS=--xla_force_host_platform_device_count={needed} before jax starts")
    small = microbatch_args(args, params_argnum, plan.microbatch_size)
    traced = trace(fn, *small, params_argnum=params_argnum)
    _check_same_graph(plan, traced.graph)
    concrete = _random_args(traced, small, seed)
    flat, tree = jax.tree_util.tree_flatten(tuple(concrete))
    grad_of = jax.value_and_grad(fn, argnums=params_argnum)
    with jax.default_device(jax.devices()[0]):
        reference = jax.jit(grad_of)(*concrete)
    results = []
    for index, stage in enumerate(plan.stages):
        results.append(_check_stage(plan, index, stage, traced, flat, tree, params_argnum, reference, rtol, atol))
    return results


def _check_same_graph(plan: Plan, graph: Graph) -> None:
    missing = [t for s in plan.stages for t in (*s.params, *(i.tensor for i in s.ops.values())) if t not in graph.tensors]
    if missing:
        raise PartoptError(f"the plan names {len(missing)} tensors the model lacks, e.g. {missing[0]!r}", "verify",
                           "solve a graph imported from this model (partopt import jax) and verify that plan")


def _random_args(traced: Traced, args: Sequence[Any], seed: int) -> tuple[Any, ...]:
    """Random arrays for the abstract arguments: floats ~ N(0, 0.02²), ids below the vocabulary they index."""
    graph = traced.graph
    limits: dict[str, int] = {}
    for op in graph.ops:
        if op.kind == "embedding":
            table = graph.tensors[op.inputs[1]]
            vocab = next(d for d in table.dims if d not in graph.tensors[op.output].dims)
            limits[op.inputs[0]] = graph.dims[vocab]
        elif op.kind == "cross_entropy":
            logits, labels = graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]]
            limits[op.inputs[1]] = graph.dims[next(d for d in logits.dims if d not in labels.dims)]
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = []
    for key, leaf, (name, _) in zip(keys, leaves, traced.leaves):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            made.append(jax.random.randint(key, leaf.shape, 0, limits.get(name, 2), leaf.dtype))
        else:
            made.append((0.02 * jax.random.normal(key, leaf.shape)).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(tree, made)


# ---------------------------------------------------------------- one stage

def _spec(dims: Sequence[str | None], t: TensorPlacement) -> PartitionSpec:
    """A PartitionSpec per array axis (dims None: size 1 or broadcast) from the tensor's planned placement."""
    entries: list[Any] = []
    for d in dims:
        axes = tuple(AXIS_NAMES[k] for k, p in enumerate(t.placement) if d is not None and p == Shard(d))
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def _check_stage(plan: Plan, index: int, stage: StagePlan, traced: Traced, flat: list[Any], tree: Any,
                 params_argnum: int, reference: Any, rtol: float, atol: float) -> StageCheck:
    shape = (stage.logical_mesh[0], stage.logical_mesh[1])
    mesh = Mesh(np.array(jax.devices()[:shape[0] * shape[1]]).reshape(shape), AXIS_NAMES)
    placed = {t.name: t for t in stage_tensors(plan, index)}
    inputs_of = _input_placements(plan, stage, traced.graph)
    specs = []
    for name, dims in traced.leaves:
        t = placed.get(name) or inputs_of.get(name) or _stacked(placed, name, dims)
        specs.append(PartitionSpec() if t is None else _spec(dims, t) if not isinstance(t, PartitionSpec) else t)
    arrays = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(flat, specs)]
    constraints = {}
    for tensor, (where, dims) in traced.origins.items():
        t = placed.get(tensor)
        if t is None:  # made by another stage's op: replicated here, so only this stage's collectives show
            constraints[where] = NamedSharding(mesh, PartitionSpec())
        elif t.role == "activation" and not any(isinstance(p, Partial) for p in t.placement):
            constraints[where] = NamedSharding(mesh, _spec(dims, t))
    operands = {}  # pin each op's operands to the layout the plan gives them (other stages': replicated)
    replicated = [R] * len(AXIS_NAMES)
    for op in traced.graph.ops:
        info = stage.ops.get(op.name)
        needs = info.inputs if info else [tuple(replicated)] * len(op.inputs)
        for t, need in zip(op.inputs, needs):
            if any(isinstance(p, Partial) for p in need):
                continue
            holder = TensorPlacement(t, "operand", traced.graph.tensors[t].dims, (), need)
            for where in traced.equations.get(op.name, ()):
                for j, (tensor, dims) in enumerate(traced.reads.get(where, ())):
                    if tensor == t:
                        operands[(*where, "in", j)] = NamedSharding(mesh, _spec(dims, holder))
    run = _constrained(traced.closed, {**constraints, **operands})
    args = jax.tree_util.tree_unflatten(tree, list(range(len(flat))))
    param_leaves = set(jax.tree_util.tree_leaves(args[params_argnum]))

    def loss_of(params_flat: list[Any], others: list[Any]) -> Any:
        merged, p, o = [], iter(params_flat), iter(others)
        for k in range(len(flat)):
            merged.append(next(p) if k in param_leaves else next(o))
        return run(*merged)[0]

    p_in = [a for k, a in enumerate(arrays) if k in param_leaves]
    o_in = [a for k, a in enumerate(arrays) if k not in param_leaves]
    p_shardings = [NamedSharding(mesh, s) for k, s in enumerate(specs) if k in param_leaves]
    jitted = jax.jit(jax.value_and_grad(loss_of), out_shardings=(NamedSharding(mesh, PartitionSpec()), p_shardings))
    compiled = jitted.lower(p_in, o_in).compile()
    loss, grads = compiled(p_in, o_in)
    ref_loss, ref_grads = reference
    ref_flat = jax.tree_util.tree_leaves(ref_grads)
    errors = [float(np.max(np.abs(np.asarray(g) - np.asarray(r)), initial=0.0)) for g, r in zip(grads, ref_flat)]
    numerics = bool(np.allclose(float(loss), float(ref_loss), rtol=rtol, atol=atol)) and all(
        np.allclose(np.asarray(g), np.asarray(r), rtol=rtol, atol=atol) for g, r in zip(grads, ref_flat))
    found = hlo_collectives(compiled.as_text(), shape)
    planned = as_run_on_cpu(planned_collectives(plan, index, traced.graph), found)
    return StageCheck(index, shape, float(loss), float(ref_loss), max(errors, default=0.0), numerics, found, planned,
                      compare(found, planned))


def _input_placements(plan: Plan, stage: StagePlan, graph: Graph) -> dict[str, TensorPlacement]:
    """Data inputs read by the stage, placed as the first op reading them requires."""
    result: dict[str, TensorPlacement] = {}
    for op_name, info in stage.ops.items():
        op = graph.op_index.get(op_name)
        if op is None:
            continue
        for t, placement in zip(op.inputs, info.inputs):
            tensor = graph.tensors[t]
            if tensor.role == "input" and t not in result:
                result[t] = TensorPlacement(t, "input", tensor.dims, (), placement)
    return result


def _stacked(placed: dict[str, TensorPlacement], name: str, dims: Sequence[str | None]) -> PartitionSpec | None:
    """A scan's stacked parameter: its steps' common spec behind a replicated step axis (None if none in the stage)."""
    steps = [t for key, t in placed.items() if key.startswith(f"{name}[") and t.role == "param"]
    if not steps or len({t.placement for t in steps}) != 1:
        return None
    return PartitionSpec(None, *_spec(dims[1:], steps[0]))


def _constrained(closed: Any, constraints: dict[tuple[Any, ...], NamedSharding]) -> Callable[..., list[Any]]:
    """The jaxpr as a function that pins values at `constraints`: (equation path, output index) for results,
    (equation path, "in", operand index) for operands (paths as the importer numbers equations)."""
    def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], path: tuple[int, ...]) -> list[Any]:
        env: dict[Any, Any] = {}
        for var, value in (*zip(jaxpr.constvars, consts), *zip(jaxpr.invars, args)):
            env[var] = value

        def read(atom: Any) -> Any:
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        for k, eqn in enumerate(jaxpr.eqns):
            here = (*path, k)
            ins = [read(a) for a in eqn.invars]
            ins = [v if (*here, "in", j) not in constraints else
                   jax.lax.with_sharding_constraint(v, constraints[(*here, "in", j)]) for j, v in enumerate(ins)]
            name = eqn.primitive.name
            if name in CALLS:
                sub, sub_consts = _sub_jaxpr(eqn)
                outs = evaluate(sub, sub_consts, ins[len(ins) - len(sub.invars):], here)
            elif name == "scan":
                outs = _scan(evaluate, eqn, ins, here)
            elif (*here, 0) in constraints and _recomputable(eqn):
                outs = [_pinned_op(eqn, ins, constraints[(*here, 0)])]
            else:
                result = eqn.primitive.bind(*ins, **eqn.params)
                outs = list(result) if eqn.primitive.multiple_results else [result]
            for o, (var, value) in enumerate(zip(eqn.outvars, outs)):
                sharding = constraints.get((*here, o))
                env[var] = value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)
        return [read(a) for a in jaxpr.outvars]

    return lambda *args: evaluate(closed.jaxpr, closed.consts, args, ())


def _recomputable(eqn: Any) -> bool:
    """One floating result of a plain primitive: `_pinned_op` can differentiate it by recomputation."""
    return (not eqn.primitive.multiple_results and len(eqn.outvars) == 1
            and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.inexact))


def _pinned_op(eqn: Any, ins: list[Any], sharding: NamedSharding) -> Any:
    """The equation's result pinned to `sharding`, its backward recomputing the op's derivative from its
    operands as read (pinned to their planned layouts) with the incoming gradient pinned to `sharding`.

    The plan differentiates an op where it runs: its gradient arrives in its output's layout and its
    derivative factors (tanh's (1 + y)(1 - y), a product's other operand) live in its operands' layouts. Left to
    JAX, those factors are values of the forward pass that XLA's sharding propagation (Shardy) may place
    in a consumer's layout and reshard back for the backward (tanh's factor computed from the all-to-all
    its consumer reads, then all-to-all'ed back): a collective of XLA's layout choice, not of the plan's.
    """
    slots = [k for k, atom in enumerate(eqn.invars) if not isinstance(atom, jcore.Literal)]  # literals stay

    def bind(*arrays: Any) -> Any:
        given = dict(zip(slots, arrays))
        return eqn.primitive.bind(*(given.get(k, v) for k, v in enumerate(ins)), **eqn.params)

    def run(*arrays: Any) -> Any:
        return jax.lax.with_sharding_constraint(bind(*arrays), sharding)

    def forward(*arrays: Any) -> tuple[Any, tuple[Any, ...]]:
        return run(*arrays), arrays

    def backward(arrays: tuple[Any, ...], grad: Any) -> tuple[Any, ...]:
        _, pull = jax.vjp(bind, *arrays)
        return pull(jax.lax.with_sharding_constraint(grad, sharding))

    op = jax.custom_vjp(run)
    op.defvjp(forward, backward)
    return op(*(ins[k] for k in slots))


def _scan(evaluate: Callable[..., list[Any]], eqn: Any, ins: list[Any], path: tuple[int, ...]) -> list[Any]:
    """A scan unrolled step by step, as the importer unrolls it (so paths match)."""
    p = eqn.params
    body, consts = _sub_jaxpr(eqn)
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    fixed, carry, stacked = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
    steps = list(range(length - 1, -1, -1) if p.get("reverse") else range(length))
    ys: list[list[Any]] = []
    for i in steps:
        outs = evaluate(body, consts, [*fixed, *carry, *(x[i] for x in stacked)], (*path, i))
        carry, y = outs[:n_carry], outs[n_carry:]
        ys.append(y)
    if p.get("reverse"):
        ys.reverse()
    stacked_ys = [jnp.stack([y[k] for y in ys]) for k in range(len(eqn.outvars) - n_carry)]
    return [*carry, *stacked_ys]


# ---------------------------------------------------------------- collectives

def _groups(text: str) -> list[list[int]]:
    """Replica groups as device lists, from any of XLA's three spellings (explicit, iota, mesh axes)."""
    if text.startswith("mesh"):  # mesh['axis_0'=2,'axis_1'=2] {'axis_1'}: groups along the named axes
        axes = re.findall(r"'([^']+)'=([0-9]+)", text)
        used = set(re.findall(r"'([^']+)'", text[text.index("{"):]))
        sizes = [int(n) for _, n in axes]
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        rest = [k for k, (name, _) in enumerate(axes) if name not in used]
        moved = np.moveaxis(ids, rest, list(range(len(rest))))
        return moved.reshape(-1, math.prod(n for (name, _), n in zip(axes, sizes) if name in used)).tolist()
    if text.startswith("{"):
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", text[1:-1])]
    match = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    shape = [int(x) for x in match[1].split(",")]
    dims = [int(x) for x in match[2].split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match[3]:
        ids = ids.transpose([int(x) for x in match[3].split(",")])
    return ids.reshape(shape).tolist()


def mesh_axis(groups: list[list[int]], shape: tuple[int, int]) -> str:
    """The mesh axes a collective's replica groups span ("x", "y", "x,y"), or the groups when no axis fits."""
    ids = np.arange(shape[0] * shape[1]).reshape(shape)
    candidates = {"x": ids.T.tolist(), "y": ids.tolist(), "x,y": [ids.ravel().tolist()]}
    given = {frozenset(g) for g in groups}
    for name, option in candidates.items():
        if given == {frozenset(g) for g in option}:
            return name
    return "groups " + str(groups)


def hlo_collectives(text: str, shape: tuple[int, int]) -> list[Collective]:
    """The collectives of compiled HLO text, with the buffer partopt prices (reduce-scatter: its input).

    An all-reduce over the whole mesh counts once per mesh axis with the same buffer, as partopt prices
    a sum over both axes (hierarchically); an all-gather over the whole mesh as partopt's two steps (x
    gathers the buffer split on y, then y the whole buffer: the same bytes on the wire as one ring over
    all devices); an all-to-all over the whole mesh as partopt prices it (`sharding.mesh_all_to_all_steps`:
    x exchanges the local buffer, y the buffer over x's size: (xy-1)/(xy) of it in all, the bytes the one
    exchange sends); the op names are XLA's metadata (which user ops it serves)."""
    found = []
    for line in text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # XLA's /*index=5*/ comments inside tuple types
        match = _COLLECTIVE_LINE.search(line)
        groups = _GROUPS.search(line)
        if not match or line.lstrip().startswith("ROOT %tuple"):
            continue
        kind = COLLECTIVES[match["op"]]
        members = _groups(groups["groups"]) if groups else [list(range(shape[0] * shape[1]))]
        n = len(members[0]) if members else 1
        if n <= 1:
            continue
        size = sum(HLO_BYTES.get(s["dtype"], 4) * math.prod(int(d) for d in s["dims"].split(",") if d)
                   for s in _SHAPE.finditer(match["type"]))
        if kind == "reduce_scatter":
            size *= n
        where = _OP_NAME.search(line)
        axis = mesh_axis(members, shape)
        name = where["name"] if where else "?"
        name = name if len(name) <= 60 else name[:57] + "..."  # XLA joins every op a fused collective serves
        if kind == "all_reduce" and axis == "x,y":  # partopt prices it per axis: the same buffer on x, then y
            found += [Collective(kind, a, float(size), f"{name} (over the whole mesh)") for a in AXIS_NAMES]
        elif kind == "all_gather" and axis == "x,y":  # partopt's steps: x gathers 1/(y's size) of it, then y all
            found += [Collective(kind, "x", size / shape[1], f"{name} (over the whole mesh)"),
                      Collective(kind, "y", float(size), f"{name} (over the whole mesh)")]
        elif kind == "all_to_all" and axis == "x,y":  # as sharding.mesh_all_to_all_steps on equal links
            found += [Collective(kind, "x", float(size), f"{name} (over the whole mesh)"),
                      Collective(kind, "y", size / shape[0], f"{name} (over the whole mesh)")]
        else:
            found.append(Collective(kind, axis, float(size), name))
    return found


def planned_collectives(plan: Plan, index: int, graph: Graph) -> list[Collective]:
    """The collectives the plan implies for one training step of one microbatch of stage `index`.

    Every input edge of the stage's ops reshards forward (producer's placement -> required) and its
    gradient backward; a tensor made outside the stage arrives replicated and one read outside leaves
    replicated (as `verify` runs other stages' ops: replicated on this stage's mesh). A step has no
    optimizer, so each parameter's gradient goes from the layout its reader leaves straight to the
    parameter's (ZeRO's reduce-scatter + all-gather is the all-reduce it splits). A parameter read by
    k > 1 ops (a tied embedding) has its gradient synchronised once by the plan; XLA all-reduces each
    read's partial gradient before adding them, so reads 2..k add the all-reduces of their partial axes.
    """
    stage = plan.stages[index]
    mesh = MeshShape((stage.logical_mesh[0], stage.logical_mesh[1]))
    produced = {info.tensor: info.output for info in stage.ops.values()}
    params = {name: (info.placement, info.zero_axes) for name, info in stage.params.items()}
    grads: dict[str, list[Placement]] = defaultdict(list)  # per parameter, each reader's gradient layout
    result: list[Collective] = []

    def add(steps: list[tuple[str, int, float]], where: str) -> None:
        result.extend(Collective(kind, AXIS_NAMES[axis], size, where) for kind, axis, size in steps)

    for op_name, info in stage.ops.items():
        op = graph.op_index[op_name]
        axes = info.axes
        for t, required in zip(op.inputs, info.inputs):
            nbytes = graph.nbytes(t)
            floating = graph.dtype_of(t) not in ("int8", "int32", "int64", "bool")
            if t in params:
                add(reshard_collectives(params[t][0], required, nbytes, mesh), f"{op_name} gathers {t}")
                if floating:
                    grads[t].append(gradient_placement(required, axes))
                continue
            source = produced.get(t, (R,) * len(required))
            add(reshard_collectives(source, required, nbytes, mesh), f"{op_name} reads {t}")
            if floating and graph.tensors[t].role != "input":
                back = reshard_collectives(gradient_placement(required, axes), as_gradient_target(source), nbytes, mesh)
                add(back, f"gradient of {t} from {op_name}")
    inside = set(stage.ops)
    for t, placement in produced.items():  # read by another stage's op, which runs replicated here
        if any(c.name not in inside for c in graph.consumers[t]):
            add(reshard_collectives(placement, (R,) * len(placement), graph.nbytes(t), mesh), f"{t} leaves the stage")
    for t, (grad, *others) in grads.items():
        add(reshard_collectives(grad, params[t][0], graph.nbytes(t), mesh), f"gradient sync of {t}")
        for k, other in enumerate(others, start=2):
            add(tied_read_sync(other, grad, params[t][0], graph.nbytes(t), mesh),
                f"gradient sync of {t}, read {k} of {len(others) + 1} (XLA reduces each read's partial gradient)")
    return result


def tied_read_sync(read: Placement, first: Placement, placement: Placement, nbytes: float,
                   mesh: MeshShape) -> list[tuple[str, int, float]]:
    """The all-reduces XLA adds for a further read of a parameter: its partial gradient summed on the
    axes where it is partial and the parameter's synchronisation sums too (each buffer the gradient's
    layout there: the parameter's bytes over its split axes), before it is added to the others."""
    summed = {axis for axis, (g, p) in enumerate(zip(first, placement)) if isinstance(g, Partial) and p == R}
    target = tuple(R if isinstance(g, Partial) and axis in summed else g for axis, g in enumerate(read))
    return reshard_collectives(read, target, nbytes, mesh)


def as_run_on_cpu(planned: Sequence[Collective], found: Sequence[Collective]) -> list[Collective]:
    """Planned reduce-scatters as XLA's CPU backend runs them: an all-reduce of the same buffer, then a
    slice (it has no pass that forms reduce-scatters), on the axes where the compiled program has none."""
    scattered = {c.axis for c in found if c.kind == "reduce_scatter"}
    return [Collective("all_reduce", c.axis, c.bytes, f"{c.where} (a reduce-scatter; XLA:CPU all-reduces and slices)")
            if c.kind == "reduce_scatter" and c.axis not in scattered else c for c in planned]


def compare(found: Sequence[Collective], planned: Sequence[Collective]) -> list[str]:
    """Mismatches per (kind, axis): totals that differ by more than 1 % (and more than SMALL_BYTES)."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for c in found:
        totals[(c.kind, c.axis)][0] += c.bytes
    for c in planned:
        totals[(c.kind, c.axis)][1] += c.bytes
    lines = []
    for (kind, axis), (got, want) in sorted(totals.items()):
        if abs(got - want) > max(SMALL_BYTES, 0.01 * want):
            ops = sorted({c.where for c in found if (c.kind, c.axis) == (kind, axis)})[:3]
            planned_ops = sorted({c.where for c in planned if (c.kind, c.axis) == (kind, axis)})[:3]
            lines.append(f"{kind} on {axis}: compiled {got:,.0f} B ({'; '.join(ops) or 'none'}), "
                         f"planned {want:,.0f} B ({'; '.join(planned_ops) or 'none'})")
    return lines


# ---------------------------------------------------------------- as a process (`partopt verify` runs this)

def report(checks: Sequence[StageCheck]) -> dict[str, Any]:
    """The checks as plain JSON data: per stage, numerics, collectives compiled and planned, mismatches."""
    def rows(items: Sequence[Collective]) -> list[dict[str, Any]]:
        return [{"kind": c.kind, "axis": c.axis, "bytes": c.bytes, "where": c.where} for c in items]

    return {"ok": all(c.ok for c in checks), "stages": [
        {"stage": c.stage, "mesh": list(c.mesh), "loss": c.loss, "reference_loss": c.reference_loss,
         "max_grad_error": c.max_grad_error, "numerics_ok": c.numerics_ok, "compiled": rows(c.compiled),
         "planned": rows(c.planned), "mismatches": c.mismatches} for c in checks]}


def main(argv: Sequence[str]) -> int:
    """`python -m partopt.verify_jax PLAN SOURCE`: print the report as JSON (an error as {"error": line})."""
    import json

    from partopt.frontends.jax import load_model
    from partopt.plan import read_plan

    try:
        plan = read_plan(argv[0])
        fn, args = load_model(argv[1])
        print(json.dumps(report(verify(plan, fn, args))))
    except PartoptError as err:
        print(json.dumps({"error": err.line()}))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
