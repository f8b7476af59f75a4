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

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from partopt.errors import PartoptError
from partopt.frontends.draft import INTEGER_DTYPES, Draft, UnsupportedError

if TYPE_CHECKING:  # pragma: no cover
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


@dataclass(frozen=True)
class _Value:
    """A jaxpr variable: the graph tensor holding its data (None: known at trace time) and a dim id
    per array axis (None for axes of size 1). Axes the tensor lacks are broadcast."""

    tensor: str | None
    axes: tuple[int | None, ...]
    missing: str | None = None  # why the value cannot be used (a scan's stacked outputs)


def from_function(fn: Callable[..., Any], *abstract_args: Any, params_argnum: int = 0, opaque: bool = False,
                  name: str | None = None, arg_names: Sequence[str] | None = None) -> "Graph":
    """The training graph of `fn(*abstract_args)` (the loss, or the forward) as a partopt Graph.

    Leaves of argument `params_argnum` are parameters, the others data inputs; the batch dim is axis 0
    of the first data leaf. Arguments may be arrays or `jax.ShapeDtypeStruct`s (nothing is computed).
    An unmapped primitive raises UnsupportedError naming it and its source line; with `opaque` it
    becomes an `opaque` op priced by XLA's FLOP count for it, never sharded.
    """
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
        raise PartoptError(f"tracing {title} failed: {type(err).__name__}: {str(err).splitlines()[0]}", title,
                           "call the function with these arguments in plain JAX first") from None
    importer = _Importer(opaque)
    args: list[_Value] = []
    batch_dim: int | None = None
    leaves = jax.tree_util.tree_flatten_with_path(tuple(abstract_args))[0]
    for (path, leaf), var in zip(leaves, closed.jaxpr.invars):
        argnum = path[0].idx
        role = "param" if argnum == params_argnum else "input"
        tensor_name = "/".join([names[argnum], *(_key(k) for k in path[1:])])
        value = importer.leaf(tensor_name, var.aval, role)
        if role == "input" and batch_dim is None and value.axes and value.axes[0] is not None:
            batch_dim = value.axes[0]
        args.append(value)
    outs = importer.run(closed.jaxpr, args, ())
    outputs = []
    for i, out in enumerate(outs):
        if out.missing or out.tensor is None:
            raise UnsupportedError(f"output {i} of {title} does not depend on its arguments", title,
                                   "return the loss computed from params and batch")
        outputs.append(out.tensor)
    importer.drop_stacked()
    dtype = _graph_dtype(importer.draft)
    return importer.draft.finish(title, batch_dim, dtype, list(dict.fromkeys(outputs)))


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
    """Where the user's code made this equation (file:line (function)), as JAX reports it."""
    try:
        from jax._src import source_info_util  # JAX's own summary; private, hence the fallback
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001  any failure here must not hide the real error
        return "an unknown line"


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


class _Importer:
    """Walks jaxprs into a Draft."""

    def __init__(self, opaque: bool):
        self.draft = Draft()
        self.opaque = opaque
        self.stacked: set[str] = set()  # params handed to scan as per-step slices
        self._scans = itertools.count()

    # ------------------------------------------------------------ values
    def axes(self, shape: Sequence[int]) -> tuple[int | None, ...]:
        return tuple(self.draft.new_dim(s) if s != 1 else None for s in shape)

    def constant(self, aval: Any) -> _Value:
        return _Value(None, self.axes(getattr(aval, "shape", ())))

    def leaf(self, name: str, aval: Any, role: str) -> _Value:
        axes = self.axes(aval.shape)
        self.draft.tensor(name, [a for a in axes if a is not None], role, _dtype(aval.dtype))
        return _Value(name, axes)

    def held(self, value: _Value, axis: int) -> bool:
        """Whether the value's tensor holds array axis `axis` (rather than broadcasting it)."""
        d = value.axes[axis]
        return value.tensor is not None and d is not None and self.draft.find(d) in self.draft.dims_of(value.tensor)

    def conform(self, value: _Value, axis: int, target: int, scope: tuple[str, ...]) -> _Value | None:
        """`value` with array axis `axis` made dim `target`: unified, or its tensor renamed when unifying
        would give some tensor one dim twice; None when the tensor already holds `target` elsewhere."""
        d = value.axes[axis]
        if d is None or self.draft.unify(target, d):
            return value
        tensor = value.tensor
        if self.held(value, axis):
            if self.draft.find(target) in self.draft.dims_of(value.tensor):
                return None
            tensor = self.draft.rename(value.tensor, d, target, scope)
        return _Value(tensor, tuple(target if i == axis else a for i, a in enumerate(value.axes)))

    def pair(self, lhs: _Value, a: int, rhs: _Value, b: int, scope: tuple[str, ...], eqn: Any) -> tuple[_Value, _Value]:
        """Make lhs axis a and rhs axis b one dim, renaming whichever operand can take the other's name."""
        if lhs.axes[a] is None or rhs.axes[b] is None:
            return lhs, rhs
        done = self.conform(rhs, b, lhs.axes[a], scope)
        if done is not None:
            return lhs, done
        done = self.conform(lhs, a, rhs.axes[b], scope)
        if done is not None:
            return done, rhs
        raise self.unsupported(eqn, "its operands pair one dim with two different axes")

    def unsupported(self, eqn: Any, why: str = "") -> UnsupportedError:
        name = eqn.primitive.name
        cause = f"JAX primitive {name!r} has no partopt mapping" + (f" ({why})" if why else "")
        return UnsupportedError(cause, source_line(eqn),
                                "import with opaque=True (--opaque) to keep it as an unsharded opaque op, "
                                "or express it with mapped primitives (docs/FRONTENDS.md)")

    def drop_stacked(self) -> None:
        """Forget stacked parameters that only scan slices read (their steps stand for them)."""
        read = {t for op in self.draft.ops for t in op.inputs}
        for name in self.stacked - read:
            del self.draft.tensors[name]

    # ------------------------------------------------------------ walking
    def run(self, jaxpr: Any, args: Sequence[_Value], scope: tuple[str, ...], consts: Sequence[Any] = ()) -> list[_Value]:
        env: dict[Any, _Value] = {}
        for var in jaxpr.constvars:
            env[var] = self.constant(var.aval)
        for var, value in zip(jaxpr.invars, args):
            env[var] = value

        def read(atom: Any) -> _Value:
            return self.constant(atom.aval) if isinstance(atom, jcore.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            inner = _scope(eqn)
            here = inner if inner[:len(scope)] == scope and inner else scope + inner
            ins = [read(a) for a in eqn.invars]
            blocked = next((v.missing for v in ins if v.missing), None)
            if blocked:
                raise UnsupportedError(f"{eqn.primitive.name} reads {blocked}", source_line(eqn),
                                       "carry the value through the scan instead of stacking it")
            outs = self.equation(eqn, ins, here)
            for var, value in zip(eqn.outvars, outs):
                env[var] = value
        return [read(a) for a in jaxpr.outvars]

    def equation(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> list[_Value]:
        prim = eqn.primitive.name
        avals = [v.aval for v in eqn.outvars]
        if prim in CALLS:
            sub, consts = _sub_jaxpr(eqn)
            return self.run(sub, ins[len(ins) - len(sub.invars):], scope, consts)
        if prim == "scan":
            return self.scan(eqn, ins, scope)
        if all(v.tensor is None for v in ins):
            return [self.constant(a) for a in avals]  # computed from constants: known at trace time
        if prim in ALIASES:
            return [_Value(v.tensor, v.axes) for v in ins[:len(avals)]]
        if prim in ELEMENTWISE:
            return [self.elementwise(eqn, ins, scope)]
        if prim in REDUCES:
            return [self.reduce(eqn, ins[0], scope)]
        handler = {"broadcast_in_dim": self.broadcast, "reshape": self.reshape, "transpose": self.transpose,
                   "squeeze": self.squeeze, "expand_dims": self.expand_dims, "dot_general": self.dot,
                   "gather": self.gather}.get(prim)
        if handler is not None:
            return [handler(eqn, ins, scope)]
        if self.opaque:
            return self.opaque_op(eqn, ins, scope)
        raise self.unsupported(eqn)

    # ------------------------------------------------------------ primitives
    def elementwise(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> _Value:
        out = eqn.outvars[0].aval
        axes: list[int | None] = [None] * len(out.shape)
        conformed = []
        for value in ins:
            if len(value.axes) == len(out.shape):
                for i in range(len(axes)):
                    if value.axes[i] is None:
                        continue
                    if axes[i] is None:
                        axes[i] = value.axes[i]
                    else:
                        target = _Value(None, tuple(axes))
                        _, value = self.pair(target, i, value, i, scope, eqn)
                        axes[i] = value.axes[i]
            conformed.append(value)
        axes = [a if a is not None or s == 1 else self.draft.new_dim(s) for a, s in zip(axes, out.shape)]
        tensors = [v.tensor for v in conformed if v.tensor is not None]
        dtype = _dtype(out.dtype)
        if dtype in INTEGER_DTYPES and all(self.draft.tensors[t].dtype in INTEGER_DTYPES for t in tensors):
            return _Value(tensors[0], tuple(axes))  # index arithmetic on integer inputs: the same ids
        held = self.held_dims(conformed, axes)
        name = self.draft.op("elementwise", self.op_name(scope, eqn), tensors, held, dtype, scope,
                             fn=eqn.primitive.name)
        return _Value(name, tuple(axes))

    def held_dims(self, values: Sequence[_Value], axes: Sequence[int | None]) -> list[int]:
        """The output axes some input tensor holds (the rest stay broadcast)."""
        have = {d for v in values if v.tensor is not None for d in self.draft.dims_of(v.tensor)}
        return [a for a in axes if a is not None and self.draft.find(a) in have]

    def op_name(self, scope: tuple[str, ...], eqn: Any) -> str:
        return "/".join([*scope, eqn.primitive.name])

    def reduce(self, eqn: Any, value: _Value, scope: tuple[str, ...]) -> _Value:
        reduced = set(eqn.params["axes"])
        kept = tuple(a for i, a in enumerate(value.axes) if i not in reduced)
        if not any(self.held(value, i) for i in reduced):
            return _Value(value.tensor, kept)  # summing a broadcast: a scale, no work worth an op
        out = eqn.outvars[0].aval
        name = self.draft.op("reduce", self.op_name(scope, eqn), [value.tensor], self.held_dims([value], kept),
                             _dtype(out.dtype), scope, fn=REDUCES[eqn.primitive.name])
        return _Value(name, kept)

    def broadcast(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> _Value:
        value, shape = ins[0], eqn.params["shape"]
        in_shape = eqn.invars[0].aval.shape
        axes: list[int | None] = [None] * len(shape)
        for i, target in enumerate(eqn.params["broadcast_dimensions"]):
            if in_shape[i] == shape[target]:
                axes[target] = value.axes[i]
        axes = [a if a is not None or s == 1 else self.draft.new_dim(s) for a, s in zip(axes, shape)]
        return _Value(value.tensor, tuple(axes))

    def transpose(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> _Value:
        return _Value(ins[0].tensor, tuple(ins[0].axes[p] for p in eqn.params["permutation"]))

    def squeeze(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> _Value:
        drop = {d % len(ins[0].axes) for d in eqn.params["dimensions"]}
        return _Value(ins[0].tensor, tuple(a for i, a in enumerate(ins[0].axes) if i not in drop))

    def expand_dims(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> _Value:
        axes = list(ins[0].axes)
        for d in sorted(eqn.params["dimensions"]):
            axes.insert(d, None)
        return _Value(ins[0].tensor, tuple(axes))

    def reshape(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> _Value:
        value = ins[0]
        in_shape, out_shape = eqn.invars[0].aval.shape, tuple(eqn.params["new_sizes"])
        src = [i for i, s in enumerate(in_shape) if s != 1]
        dst = [j for j, s in enumerate(out_shape) if s != 1]
        axes: list[int | None] = [None] * len(out_shape)
        split: dict[int, list[int]] = {}
        merge: dict[int, list[int]] = {}
        i = j = 0
        while i < len(src) or j < len(dst):
            a, b = [src[i]], [dst[j]]
            pa, pb = in_shape[src[i]], out_shape[dst[j]]
            i, j = i + 1, j + 1
            while pa != pb:
                if pa < pb:
                    a.append(src[i])
                    pa *= in_shape[src[i]]
                    i += 1
                else:
                    b.append(dst[j])
                    pb *= out_shape[dst[j]]
                    j += 1
            if len(a) == 1 and len(b) == 1:
                axes[b[0]] = value.axes[a[0]]
                continue
            if len(a) > 1 and len(b) > 1:
                raise self.unsupported(eqn, f"a reshape of {in_shape} into {out_shape} regroups several axes at once")
            held = [self.held(value, k) for k in a]
            if any(held) and not all(held):
                raise self.unsupported(eqn, "a reshape merges held and broadcast axes")
            for k in b:
                axes[k] = self.draft.new_dim(out_shape[k])
            if all(held):
                if len(a) == 1:
                    split[value.axes[a[0]]] = [axes[k] for k in b]
                else:
                    merge[axes[b[0]]] = [value.axes[k] for k in a]
        if not split and not merge or value.tensor is None:
            return _Value(value.tensor, tuple(axes))
        dims: list[int] = []
        for d in self.draft.dims_of(value.tensor):  # keep the tensor's order: parts replace their whole in place
            if d in split:
                dims += split[d]
            elif any(d == self.draft.find(p[0]) for p in merge.values()):
                dims += [w for w, p in merge.items() if self.draft.find(p[0]) == d]
            elif not any(d in map(self.draft.find, p) for p in merge.values()):
                dims.append(d)
        attrs = {k: v for k, v in (("split", split), ("merge", merge)) if v}
        name = self.draft.op("reshape", self.op_name(scope, eqn), [value.tensor], dims,
                             self.draft.tensors[value.tensor].dtype, scope, **attrs)
        return _Value(name, tuple(axes))

    def dot(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> _Value:
        lhs, rhs = ins
        if lhs.tensor is None or rhs.tensor is None:
            raise self.unsupported(eqn, "a product with a constant array")
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        for a, b in (*zip(lb, rb), *zip(lc, rc)):
            lhs, rhs = self.pair(lhs, a, rhs, b, scope, eqn)
        lfree = [i for i in range(len(lhs.axes)) if i not in lc and i not in lb]
        rfree = [j for j in range(len(rhs.axes)) if j not in rc and j not in rb]
        taken = {self.draft.find(a) for a in lhs.axes if a is not None}
        for j in rfree:  # q·kᵀ over one sequence dim: the keys' positions become a dim of their own
            d = rhs.axes[j]
            if d is not None and self.draft.find(d) in taken:
                fresh = self.draft.new_dim(self.draft.sizes[self.draft.find(d)])
                tensor = self.draft.rename(rhs.tensor, d, fresh, scope) if self.held(rhs, j) else rhs.tensor
                rhs = _Value(tensor, tuple(fresh if k == j else x for k, x in enumerate(rhs.axes)))
        axes = tuple([lhs.axes[i] for i in lb] + [lhs.axes[i] for i in lfree] + [rhs.axes[j] for j in rfree])
        held = self.held_dims([lhs, rhs], axes)
        out = eqn.outvars[0].aval
        name = self.draft.op("einsum", self.op_name(scope, eqn), [lhs.tensor, rhs.tensor], held,
                             _dtype(out.dtype), scope)
        return _Value(name, axes)

    def gather(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> _Value:
        table, ids = ins
        numbers = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        sizes = tuple(eqn.params["slice_sizes"])
        lookup = (len(numbers.collapsed_slice_dims) == 1 and tuple(numbers.start_index_map) == tuple(numbers.collapsed_slice_dims)
                  and not getattr(numbers, "operand_batching_dims", ()) and eqn.invars[1].aval.shape[-1:] == (1,))
        vocab = numbers.collapsed_slice_dims[0] if lookup else -1
        if not lookup or ids.tensor is None or table.tensor is None or not self.held(table, vocab) \
                or any(sizes[k] != shape[k] for k in range(len(shape)) if k != vocab):
            raise self.unsupported(eqn, "only whole-row lookups ids -> table[id] (embeddings) map")
        out = eqn.outvars[0].aval
        rows = iter(a for k, a in enumerate(table.axes) if k != vocab)
        index = iter(ids.axes[:-1])
        offset = set(numbers.offset_dims)
        axes = tuple(next(rows) if k in offset else next(index) for k in range(len(out.shape)))
        held = self.held_dims([ids, table], axes)
        name = self.draft.op("embedding", self.op_name(scope, eqn), [ids.tensor, table.tensor], held,
                             _dtype(out.dtype), scope)
        return _Value(name, axes)

    def scan(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> list[_Value]:
        """Unroll a scan: each step's body runs on the step's slices of the stacked inputs."""
        p = eqn.params
        body, consts = _sub_jaxpr(eqn)
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
        fixed, carry, stacked = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        label = f"scan{next(self._scans)}"
        steps = range(length - 1, -1, -1) if p.get("reverse") else range(length)
        for i in steps:
            sliced = [self.step_slice(v, i, eqn) for v in stacked]
            outs = self.run(body, [*fixed, *carry, *sliced], (*scope, f"{label}[{i}]"), consts)
            carry = outs[:n_carry]
        where = f"the stacked outputs of the scan at {source_line(eqn)}"
        ys = [_Value(None, (), missing=where) for _ in eqn.outvars[n_carry:]]
        return [*carry, *ys]

    def step_slice(self, value: _Value, i: int, eqn: Any) -> _Value:
        """Step i of a stacked scan input: a parameter's slice becomes a parameter of its own."""
        if not self.held(value, 0):
            return _Value(value.tensor, value.axes[1:])
        info = self.draft.tensors[value.tensor]
        if info.role != "param":
            raise self.unsupported(eqn, "a scan over stacked activations (only stacked parameters unroll)")
        lead = self.draft.find(value.axes[0])
        name = f"{value.tensor}[{i}]"
        if name not in self.draft.tensors:
            self.draft.tensor(name, [d for d in self.draft.dims_of(value.tensor) if d != lead], "param", info.dtype)
            self.stacked.add(value.tensor)
        return _Value(name, value.axes[1:])

    def opaque_op(self, eqn: Any, ins: list[_Value], scope: tuple[str, ...]) -> list[_Value]:
        """An unmapped primitive as opaque ops (one per result), priced by XLA's FLOPs, never sharded."""
        tensors = list(dict.fromkeys(v.tensor for v in ins if v.tensor is not None))
        flops = _xla_flops(eqn)
        outs = []
        for k, var in enumerate(eqn.outvars):
            axes = self.axes(var.aval.shape)
            name = self.draft.op("opaque", self.op_name(scope, eqn), tensors, [a for a in axes if a is not None],
                                 _dtype(var.aval.dtype), scope, primitive=eqn.primitive.name,
                                 flops=flops if k == 0 else 0)
            outs.append(_Value(name, axes))
        return outs


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
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

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
    made = make()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0]) and isinstance(made[1], (tuple, list))):
        raise PartoptError(f"{attr}() must return (fn, abstract_args), got {type(made).__name__}", source,
                           "return the loss function and a tuple of its arguments (params first)")
    return made[0], tuple(made[1])


