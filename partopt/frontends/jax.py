"""JAX frontend: trace a function of (params, batch) to a jaxpr and map it to a partopt Graph.

`from_function(loss_fn, params, batch)` walks the jaxpr equation by equation (inlining `jit`, `remat`,
`custom_jvp`/`custom_vjp` bodies and unrolling `scan`), names every array axis by the logical dim it
carries (see `partopt.frontends.draft`), and maps `dot_general` to einsum, gathers to embeddings,
elementwise and reduction primitives one by one; softmax, the norms and the softmax cross-entropy
are then recognised as one op each. Parameters are named by their pytree paths in the caller's
params (`params/blocks/3/mlp/w1`); a parameter stacked for `scan` becomes one tensor per step,
`params/blocks/w1[3]`. The graph is the forward: partopt prices the backward itself. Requires jax.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from partopt.errors import PartoptError, first_line
from partopt.frontends.draft import Draft, UnsupportedError
from partopt.frontends.values import NoMapping, Scope, Value, Values
from partopt.graph import Graph

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "integer_pow", "max", "min", "neg", "sign", "abs", "floor", "ceil",
    "round", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "atan2", "sqrt",
    "rsqrt", "cbrt", "square", "erf", "erfc", "erf_inv", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge",
    "and", "or", "not", "xor", "is_finite", "nextafter", "add_any", "sinh", "cosh", "asinh", "acosh", "atanh",
})
ALIASES = frozenset({"convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision",
                     "optimization_barrier", "sharding_constraint", "mesh_cast", "name"})
REDUCES = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
           "argmax": "argmax", "argmin": "argmin", "reduce_and": "all", "reduce_or": "any"}
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
                   "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"})
SUBJAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "int32", "int64": "int64",
          "int8": "int8", "uint8": "int8", "uint32": "int32", "int16": "int32", "bool": "bool"}


@dataclass
class Traced:
    """An imported function: its Graph, and where each graph tensor lives in the jaxpr (for `verify`)."""

    graph: Graph
    closed: Any  # the ClosedJaxpr
    leaves: list[tuple[str, tuple[str | None, ...]]]  # per flattened argument: tensor name, dim name per axis
    origins: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]  # activation -> (equation path, dims)
    equations: dict[str, set[tuple[int, ...]]]  # op -> paths of the equations it stands for
    reads: dict[tuple[int, ...], list[tuple[str | None, tuple[str | None, ...]]]]  # equation -> per operand: tensor, dims


def from_function(fn: Callable[..., Any], *abstract_args: Any, params_argnum: int = 0, opaque: bool = False,
                  name: str | None = None, arg_names: Sequence[str] | None = None) -> Graph:
    """The training graph of `fn(*abstract_args)` (the loss, or the forward) as a partopt Graph.

    Leaves of argument `params_argnum` are parameters, the others data inputs; the batch dim is axis 0
    of the first data leaf. Arguments may be arrays or `jax.ShapeDtypeStruct`s (nothing is computed).
    An unmapped primitive raises UnsupportedError naming it and its source line; with `opaque` it
    becomes an `opaque` op priced by XLA's FLOP count for it, never sharded.
    """
    return trace(fn, *abstract_args, params_argnum=params_argnum, opaque=opaque, name=name, arg_names=arg_names).graph


def trace(fn: Callable[..., Any], *abstract_args: Any, params_argnum: int = 0, opaque: bool = False,
          name: str | None = None, arg_names: Sequence[str] | None = None) -> Traced:
    """`from_function`, keeping the jaxpr and where each tensor comes from."""
    names = list(arg_names) if arg_names is not None else [
        "params" if i == params_argnum else ("batch" if len(abstract_args) == 2 else f"arg{i}")
        for i in range(len(abstract_args))]
    if len(names) != len(abstract_args):
        raise PartoptError(f"{len(names)} argument names for {len(abstract_args)} arguments", "from_function",
                           "give one name per argument")
    title = name or getattr(fn, "__name__", "jax-function")
    try:
        closed = jax.make_jaxpr(fn)(*abstract_args)
    except Exception as err:  # the user's function fails to trace: say so in one line
        raise PartoptError(f"tracing {title} failed: {type(err).__name__}: {first_line(err)}", title,
                           "call the function with these arguments in plain JAX first") from None
    importer = _Importer(opaque)
    args: list[Value] = []
    batch_dim: int | None = None
    leaves = jax.tree_util.tree_flatten_with_path(tuple(abstract_args))[0]
    for (path, leaf), var in zip(leaves, closed.jaxpr.invars):
        argnum = path[0].idx
        role = "param" if argnum == params_argnum else "input"
        tensor_name = "/".join([names[argnum], *(_key(k) for k in path[1:])])
        value = importer.leaf(tensor_name, var.aval.shape, role, _dtype(var.aval.dtype))
        if role == "input" and batch_dim is None and value.axes and value.axes[0] is not None:
            batch_dim = value.axes[0]
        args.append(value)
    outs = importer.run(closed.jaxpr, args, (), path=())
    outputs = []
    for i, out in enumerate(outs):
        if out.missing or out.tensor is None:
            raise UnsupportedError(f"output {i} of {title} does not depend on its arguments", title,
                                   "return the loss computed from params and batch")
        outputs.append(out.tensor)
    importer.drop_stacked()
    draft = importer.draft
    graph = draft.finish(title, batch_dim, _graph_dtype(draft), list(dict.fromkeys(outputs)))
    return Traced(graph, closed,
                  [(a.tensor or "", tuple(draft.name_of(d) for d in a.axes)) for a in args],
                  {t: (where, tuple(draft.name_of(d) for d in axes))
                   for t, (where, axes) in importer.origins.items() if t in graph.tensors},
                  {op.name: {p for p in op.origins if p is not None} for op in draft.ops},
                  {where: [(t, tuple(draft.name_of(d) for d in axes)) for t, axes in operands]
                   for where, operands in importer.reads.items()})


def _key(entry: Any) -> str:
    """One step of a pytree path as text: a dict key, a sequence index or an attribute name."""
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _dtype(dtype: Any) -> str:
    text = str(np.dtype(dtype))
    if text not in DTYPES:
        raise UnsupportedError(f"element type {text} has no partopt dtype", "from_function",
                               f"trace with one of {', '.join(DTYPES)}")
    return DTYPES[text]


def _graph_dtype(draft: Draft) -> str:
    """The graph's dtype: that of the parameters (the most common), else fp32."""
    kinds = [t.dtype for t in draft.tensors.values() if t.role == "param"]
    return max(set(kinds), key=kinds.count) if kinds else "fp32"


def source_line(eqn: Any) -> str:
    """Where the user's code made this equation (file:line (function)), as JAX reports it ("" if unknown)."""
    try:
        from jax._src import source_info_util  # JAX's own summary; private, hence the fallback
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001  any failure here must not hide the real error
        return ""


def _scope(eqn: Any) -> tuple[str, ...]:
    """The user's named scopes around an equation (einsum specs and transforms left out)."""
    parts = str(eqn.source_info.name_stack).split("/")
    return tuple(p for p in parts if p and "->" not in p and "(" not in p)


def _sub_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]]:
    for key in SUBJAXPR_PARAMS:
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            return sub.jaxpr, sub.consts
        if isinstance(sub, jcore.Jaxpr):
            return sub, ()
    raise UnsupportedError(f"{eqn.primitive.name} carries no jaxpr", source_line(eqn), "report this primitive")


class _Importer(Values):
    """Walks jaxprs into a Draft."""

    def __init__(self, opaque: bool):
        super().__init__()
        self.opaque_ok = opaque
        self.stacked: set[str] = set()  # params handed to scan as per-step slices
        self._scans = itertools.count()
        self.origins: dict[str, tuple[tuple[int, ...], tuple[int | None, ...]]] = {}  # activation -> where, axes
        self.lines: list[str] = []  # source lines of the equations being mapped, outermost first
        self.reads: dict[tuple[int, ...], list[tuple[str | None, tuple[int | None, ...]]]] = {}  # path -> operands

    def unsupported(self, eqn: Any, why: str = "") -> UnsupportedError:
        name = eqn.primitive.name
        cause = f"JAX primitive {name!r} has no partopt mapping" + (f" ({why})" if why else "")
        return UnsupportedError(cause, self.lines[-1] if self.lines else source_line(eqn),
                                "import with opaque=True (--opaque) to keep it as an unsharded opaque op, "
                                "or express it with mapped primitives (docs/FRONTENDS.md)")

    def drop_stacked(self) -> None:
        """Forget stacked parameters that only scan slices read (their steps stand for them)."""
        read = {t for op in self.draft.ops for t in op.inputs}
        for name in self.stacked - read:
            del self.draft.tensors[name]

    # ------------------------------------------------------------ walking
    def run(self, jaxpr: Any, args: Sequence[Value], scope: Scope, consts: Sequence[Any] = (),
            path: tuple[int, ...] = ()) -> list[Value]:
        """Map a jaxpr's equations; `path` locates it (equation indices, scan steps) for `origins`."""
        env: dict[Any, Value] = {}
        for var in jaxpr.constvars:
            env[var] = self.constant(var.aval.shape)
        for var, value in zip(jaxpr.invars, args):
            env[var] = value

        def read(atom: Any) -> Value:
            return self.constant(getattr(atom.aval, "shape", ())) if isinstance(atom, jcore.Literal) else env[atom]

        for k, eqn in enumerate(jaxpr.eqns):
            inner = _scope(eqn)
            here = inner if inner[:len(scope)] == scope and inner else scope + inner
            ins = [read(a) for a in eqn.invars]
            blocked = next((v.missing for v in ins if v.missing), None)
            line = source_line(eqn)
            self.lines.append(line if line else self.lines[-1] if self.lines else "an unknown line")
            if blocked:
                raise UnsupportedError(f"{eqn.primitive.name} reads {blocked}", self.lines[-1],
                                       "carry the value through the scan instead of stacking it")
            self.draft.origin = (*path, k)
            self.reads[(*path, k)] = [(v.tensor, v.axes) for v in ins]
            try:
                outs = self.equation(eqn, ins, here, (*path, k))
            except NoMapping as err:
                if not self.opaque_ok:
                    raise self.unsupported(eqn, str(err)) from None
                outs = self.opaque_op(eqn, ins, here)
            self.lines.pop()
            for o, (var, value) in enumerate(zip(eqn.outvars, outs)):
                env[var] = value
                if value.tensor and value.tensor not in self.origins \
                        and self.draft.tensors[value.tensor].role not in ("param", "input"):
                    self.origins[value.tensor] = ((*path, k, o), value.axes)
        return [read(a) for a in jaxpr.outvars]

    def equation(self, eqn: Any, ins: list[Value], scope: Scope, path: tuple[int, ...]) -> list[Value]:
        prim, params = eqn.primitive.name, eqn.params
        out = eqn.outvars[0].aval if eqn.outvars else None
        name = "/".join([*scope, prim])
        if prim in CALLS:
            sub, consts = _sub_jaxpr(eqn)
            return self.run(sub, ins[len(ins) - len(sub.invars):], scope, consts, path)
        if prim == "scan":
            return self.scan(eqn, ins, scope, path)
        if all(v.tensor is None for v in ins):
            return [self.constant(getattr(v.aval, "shape", ())) for v in eqn.outvars]  # known at trace time
        if prim in ALIASES:
            return [Value(v.tensor, v.axes) for v in ins[:len(eqn.outvars)]]
        if prim in ELEMENTWISE:
            return [self.elementwise(ins, out.shape, _dtype(out.dtype), name, scope, prim)]
        if prim in REDUCES:
            return [self.reduce(ins[0], params["axes"], _dtype(out.dtype), name, scope, REDUCES[prim])]
        if prim == "broadcast_in_dim":
            return [self.broadcast(ins[0], eqn.invars[0].aval.shape, params["shape"], params["broadcast_dimensions"])]
        if prim == "transpose":
            return [Value(ins[0].tensor, tuple(ins[0].axes[p] for p in params["permutation"]))]
        if prim == "squeeze":
            drop = {d % len(ins[0].axes) for d in params["dimensions"]}
            return [Value(ins[0].tensor, tuple(a for i, a in enumerate(ins[0].axes) if i not in drop))]
        if prim == "reshape":
            return [self.reshape(ins[0], eqn.invars[0].aval.shape, params["new_sizes"], name, scope)]
        if prim == "dot_general":
            (lc, rc), (lb, rb) = params["dimension_numbers"]
            return [self.contract(ins[0], ins[1], lc, rc, lb, rb, _dtype(out.dtype), name, scope)]
        if prim == "gather":
            return [self.gather(eqn, ins, name, scope)]
        if prim == "concatenate":
            return [self.concatenate(ins, params["dimension"], out.shape, _dtype(out.dtype), name, scope)]
        raise NoMapping("")

    # ------------------------------------------------------------ primitives
    def broadcast(self, value: Value, in_shape: Sequence[int], shape: Sequence[int], dims: Sequence[int]) -> Value:
        axes: list[int | None] = [None] * len(shape)
        for i, target in enumerate(dims):
            if in_shape[i] == shape[target]:
                axes[target] = value.axes[i]
        axes = [a if a is not None or s == 1 else self.draft.new_dim(s) for a, s in zip(axes, shape)]
        return Value(value.tensor, tuple(axes))

    def gather(self, eqn: Any, ins: list[Value], name: str, scope: Scope) -> Value:
        table, ids = ins
        numbers = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        sizes = tuple(eqn.params["slice_sizes"])
        collapsed = tuple(numbers.collapsed_slice_dims)
        lookup = (len(collapsed) == 1 and tuple(numbers.start_index_map) == collapsed
                  and not getattr(numbers, "operand_batching_dims", ()) and eqn.invars[1].aval.shape[-1:] == (1,)
                  and all(sizes[k] == shape[k] for k in range(len(shape)) if k != collapsed[0]))
        if not lookup:
            raise NoMapping("only whole-row lookups ids -> table[id] (embeddings) map")
        out = eqn.outvars[0].aval
        return self.lookup(table, collapsed[0], ids, ids.axes[:-1], tuple(numbers.offset_dims), len(out.shape),
                           _dtype(out.dtype), name, scope)

    def scan(self, eqn: Any, ins: list[Value], scope: Scope, path: tuple[int, ...]) -> list[Value]:
        """Unroll a scan: each step's body runs on the step's slices of the stacked inputs."""
        p = eqn.params
        body, consts = _sub_jaxpr(eqn)
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
        fixed, carry, stacked = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        label = f"scan{next(self._scans)}"
        steps = range(length - 1, -1, -1) if p.get("reverse") else range(length)
        for i in steps:
            sliced = [self.step_slice(v, i, eqn) for v in stacked]
            outs = self.run(body, [*fixed, *carry, *sliced], (*scope, f"{label}[{i}]"), consts, (*path, i))
            carry = outs[:n_carry]
        where = f"the stacked outputs of the scan at {source_line(eqn)}"
        ys = [Value(None, (), missing=where) for _ in eqn.outvars[n_carry:]]
        return [*carry, *ys]

    def step_slice(self, value: Value, i: int, eqn: Any) -> Value:
        """Step i of a stacked scan input: a parameter's slice becomes a parameter of its own."""
        if not self.held(value, 0):
            return Value(value.tensor, value.axes[1:])
        info = self.draft.tensors[value.tensor]
        if info.role != "param":
            raise self.unsupported(eqn, "a scan over stacked activations (only stacked parameters unroll)")
        lead = self.draft.find(value.axes[0])
        name = f"{value.tensor}[{i}]"
        if name not in self.draft.tensors:
            self.draft.tensor(name, [d for d in self.draft.dims_of(value.tensor) if d != lead], "param", info.dtype)
            self.stacked.add(value.tensor)
        return Value(name, value.axes[1:])

    def opaque_op(self, eqn: Any, ins: list[Value], scope: Scope) -> list[Value]:
        """An unmapped primitive as opaque ops (one per result), priced by XLA's FLOPs, never sharded."""
        flops = _xla_flops(eqn)
        name = "/".join([*scope, eqn.primitive.name])
        return [self.opaque(ins, var.aval.shape, _dtype(var.aval.dtype), name, scope, eqn.primitive.name,
                            flops if k == 0 else 0) for k, var in enumerate(eqn.outvars)]


def _xla_flops(eqn: Any) -> int:
    """XLA's forward FLOP count of one equation, compiled alone (0 when XLA counts none)."""
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    lowered = jax.jit(lambda *a: eqn.primitive.bind(*a, **eqn.params)).lower(*args)
    cost = lowered.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return int(max(0.0, cost.get("flops", 0.0)))


def load_model(source: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`pkg.mod:make_model` or `path/file.py:make_model` -> what make_model() returns: (fn, abstract_args)."""
    module_name, _, attr = source.partition(":")
    if not module_name or not attr:
        raise PartoptError(f"model source {source!r} is not MODULE:FUNCTION", source,
                           "write it like mypkg.models:make_model or models/gpt.py:make_model")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.exists():
                raise PartoptError(f"no such file {module_name!r}", source)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except PartoptError:
        raise
    except Exception as err:
        raise PartoptError(f"cannot import {module_name}: {type(err).__name__}: {err}", source,
                           "check the module path (it is imported from the current directory)") from None
    make = getattr(module, attr, None)
    if not callable(make):
        raise PartoptError(f"{module_name} has no function {attr!r}", source)
    try:
        made = make()
    except Exception as err:  # the user's code: one line, not a traceback
        raise PartoptError(f"{attr}() failed: {type(err).__name__}: {err}", source) from None
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0]) and isinstance(made[1], (tuple, list))):
        raise PartoptError(f"{attr}() must return (fn, abstract_args), got {type(made).__name__}", source,
                           "return the loss function and a tuple of its arguments (params first)")
    return made[0], tuple(made[1])


