"""A graph being imported by a frontend: dims, tensors and ops, then the passes that make it a partopt Graph.

Frontends see arrays whose axes have sizes but no names. A `Draft` gives every axis a dim id and
unifies ids that an equation says are the same logical dim (an einsum's contracted pair, the axes of
an elementwise op), so names follow the data, not the sizes. A union that would give one tensor two
axes of the same dim is refused; the frontend then renames one operand (a one-part reshape, as
partopt's own generators do for attention's key positions). `finish` recognises softmax, the norms
and the cross-entropy loss among the primitive ops, fuses chains of elementwise ops, drops dead ops,
tags layers from the framework's scopes and returns the validated Graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from networkx.utils import UnionFind

from partopt.errors import PartoptError
from partopt.graph import Graph, Op, Tensor

INTEGER_DTYPES = ("int8", "int32", "int64", "bool")
PREPARING = ("mul", "div", "select_n", "add", "sub")  # by constants: scale, mask, square fold into a norm
NORM_PARAMS = {"rmsnorm": ("mul",), "layernorm": ("mul", "add")}  # fn consuming scale, shift


class UnsupportedError(PartoptError):
    """A framework op or pattern the frontend cannot map; the cause names it and where it is."""


@dataclass
class DraftTensor:
    """A tensor: dim ids (one per axis it holds), role, element type."""

    dims: list[int]
    role: str
    dtype: str


@dataclass
class DraftOp:
    """An op of the draft: `scope` is the framework's name stack (for layers), attrs may hold dim ids."""

    name: str
    kind: str
    inputs: list[str]
    output: str
    scope: tuple[str, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)
    origins: set[Any] = field(default_factory=set)  # the framework ops it stands for (see Draft.origin)


class Draft:
    """Dims as a union-find of axes, the tensors over them and the ops, in program order."""

    def __init__(self) -> None:
        self._classes = UnionFind()
        self.sizes: list[int] = []
        self._members: dict[int, set[str]] = {}  # dim class -> tensors holding it
        self.tensors: dict[str, DraftTensor] = {}
        self.ops: list[DraftOp] = []
        self._counter = itertools.count()
        self.names: dict[int, str] = {}  # dim class -> its name in the Graph (set by finish)
        self.origin: Any = None  # the framework op being mapped: ops made now record it

    # ------------------------------------------------------------ dims
    def new_dim(self, size: int) -> int:
        """A fresh dim of `size` (sizes of 1 carry no dim: callers keep None for them)."""
        self.sizes.append(int(size))
        return len(self.sizes) - 1

    def find(self, d: int) -> int:
        return self._classes[d]

    def unify(self, a: int, b: int) -> bool:
        """Make dims a and b one; False (and nothing changes) when some tensor holds both."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return True
        if self.sizes[ra] != self.sizes[rb]:
            raise ValueError(f"unifying dims of sizes {self.sizes[ra]} and {self.sizes[rb]}")
        ma, mb = self._members.get(ra, set()), self._members.get(rb, set())
        if ma & mb:
            return False
        self._classes.union(ra, rb)
        self._members.pop(ra, None)
        self._members.pop(rb, None)
        self._members[self.find(ra)] = ma | mb
        return True

    # ------------------------------------------------------------ tensors and ops
    def fresh_name(self, base: str) -> str:
        name = base
        while name in self.tensors:
            name = f"{base}_{next(self._counter)}"
        return name

    def name_of(self, d: int | None) -> str | None:
        """The Graph's name of dim `d` (after finish), None for a size-1 axis or a dim no tensor holds."""
        return None if d is None else self.names.get(self.find(d))

    def dims_of(self, tensor: str) -> list[int]:
        return [self.find(d) for d in self.tensors[tensor].dims]

    def tensor(self, name: str, dims: Sequence[int], role: str, dtype: str) -> str:
        """Declare a tensor; its dims must be distinct dims."""
        roots = [self.find(d) for d in dims]
        if len(set(roots)) != len(roots):
            raise ValueError(f"tensor {name!r} would hold one dim twice")
        self.tensors[name] = DraftTensor(roots, role, dtype)
        for r in roots:
            self._members.setdefault(r, set()).add(name)
        return name

    def op(self, kind: str, base: str, inputs: Sequence[str], dims: Sequence[int], dtype: str,
           scope: tuple[str, ...] = (), **attrs: Any) -> str:
        """Add an op writing a new tensor over `dims`; returns the tensor (named like the op)."""
        name = self.fresh_name(base)
        self.tensor(name, dims, "activation", dtype)
        self.ops.append(DraftOp(name, kind, list(dict.fromkeys(inputs)), name, scope, dict(attrs), {self.origin}))
        return name

    def rename(self, tensor: str, old: int, new: int, scope: tuple[str, ...]) -> str:
        """A copy of `tensor` whose dim `old` is called `new` (a one-part reshape merge)."""
        old = self.find(old)
        dims = [new if d == old else d for d in self.dims_of(tensor)]
        return self.op("reshape", f"{tensor}.renamed", [tensor], dims, self.tensors[tensor].dtype, scope,
                       merge={new: [old]})

    # ------------------------------------------------------------ finishing
    def finish(self, name: str, batch_dim: int | None, dtype: str, outputs: Sequence[str]) -> Graph:
        """Recognise norms/softmax/loss, fuse elementwise chains, drop dead ops, tag layers: the Graph."""
        for out in outputs:
            if self.tensors[out].role in ("input", "param"):
                raise UnsupportedError(f"the function returns its argument {out!r} unchanged", name,
                                       "return a value computed from the arguments (the loss)")
            self.tensors[out].role = "output"
        _recognise_normalisations(self)
        _fuse_elementwise(self)
        _drop_dead(self)
        return _to_graph(self, name, batch_dim, dtype)


# ---------------------------------------------------------------- passes

def _consumers(draft: Draft) -> dict[str, list[DraftOp]]:
    result: dict[str, list[DraftOp]] = {t: [] for t in draft.tensors}
    for op in draft.ops:
        for t in op.inputs:
            result[t].append(op)
    return result


def _replace(draft: Draft, region: list[DraftOp], new: DraftOp) -> None:
    """Put `new` where the op writing its output was; drop the region's other tensors."""
    gone = {op.name for op in region}
    draft.ops[next(i for i, op in enumerate(draft.ops) if op.output == new.output)] = new
    draft.ops[:] = [op for op in draft.ops if op.name not in gone or op is new]
    for op in region:
        if op.output != new.output:
            del draft.tensors[op.output]


def _grow_region(draft: Draft, start: DraftOp, consumers: dict[str, list[DraftOp]]) -> tuple[str, list[DraftOp]] | None:
    """The elementwise/reduce ops around a reduce: (root input, ops), or None when they do not close."""
    x = start.inputs[0]
    whole = set(draft.dims_of(x))
    producers = {op.output: op for op in draft.ops}

    def preparing(t: str) -> DraftOp | None:
        """The op making `t` from one tensor by constants (softmax's scale and mask, RMSNorm's square)."""
        p = producers.get(t)
        if p is not None and p.kind == "elementwise" and p.attrs.get("fn") in PREPARING and len(p.inputs) == 1 \
                and set(draft.dims_of(p.inputs[0])) == whole:
            return p
        return None

    chain = [x]
    while preparing(chain[-1]) is not None:
        chain.append(preparing(chain[-1]).inputs[0])  # type: ignore[union-attr]

    def side(t: str) -> bool:
        info = draft.tensors[t]
        return set(draft.dims_of(t)) <= whole and (info.role == "param" or info.dtype in INTEGER_DTYPES)

    region = [start]
    produced = {start.output}
    for op in draft.ops[draft.ops.index(start) + 1:]:
        if op.kind not in ("elementwise", "reduce") or not any(t in produced for t in op.inputs):
            continue
        if all(t in produced or t in chain or side(t) for t in op.inputs) and set(draft.dims_of(op.output)) <= whole:
            region.append(op)
            produced.add(op.output)
    while preparing(x) is not None and all(c in region for c in consumers[x]):
        region.insert(0, preparing(x))  # type: ignore[arg-type]
        x = region[0].inputs[0]
    produced = {op.output for op in region}
    if any(t not in produced and t != x and not side(t) for op in region for t in op.inputs):
        return None  # reads a prepared tensor that other ops read too: not one normalisation
    return x, region


def _classify(draft: Draft, x: str, region: list[DraftOp], consumers: dict[str, list[DraftOp]]) -> DraftOp | None:
    """The one op a region computes (softmax, layernorm, rmsnorm, cross_entropy), or None."""
    inside = {op.name for op in region}
    sinks = [op.output for op in region
             if draft.tensors[op.output].role == "output" or any(c.name not in inside for c in consumers[op.output])]
    if len(sinks) != 1:
        return None
    sink = sinks[0]
    whole, out = set(draft.dims_of(x)), set(draft.dims_of(sink))
    produced = {op.output for op in region}
    sides = list(dict.fromkeys(t for op in region for t in op.inputs if t not in produced and t != x))
    labels = [t for t in sides if draft.tensors[t].dtype in INTEGER_DTYPES]
    params = [t for t in sides if draft.tensors[t].role == "param"]
    fns = {op.attrs.get("fn") for op in region}
    reduced = whole - set(draft.dims_of(region[[op.kind for op in region].index("reduce")].output))
    axes = [d for d in draft.dims_of(x) if d in reduced]
    last = region[-1]
    if len(labels) == 1 and not params and out <= set(draft.dims_of(labels[0])) and "exp" in fns \
            and whole - set(draft.dims_of(labels[0])) == reduced:
        return DraftOp(sink, "cross_entropy", [x, labels[0]], sink, last.scope)
    if labels or out != whole:
        return None
    if "exp" in fns:
        return None if params else DraftOp(sink, "softmax", [x], sink, last.scope, {"axes": axes})
    kind = "layernorm" if sum(op.kind == "reduce" for op in region) >= 2 else "rmsnorm"
    ordered = []
    for fn in NORM_PARAMS[kind]:
        ordered += [p for p in params if any(op.attrs.get("fn") == fn and p in op.inputs for op in region)]
    if sorted(ordered) != sorted(params) or len(ordered) > len(NORM_PARAMS[kind]):
        return None
    if any(set(draft.dims_of(p)) & (whole - reduced) for p in params):
        return None  # a scale over non-normalised dims is not a norm's scale
    return DraftOp(sink, kind, [x, *ordered], sink, last.scope, {"axes": axes})


def _recognise_normalisations(draft: Draft) -> None:
    """Replace each softmax / LayerNorm / RMSNorm / softmax cross-entropy pattern by its one op."""
    consumers = _consumers(draft)
    i = 0
    while i < len(draft.ops):
        op = draft.ops[i]
        if op.kind == "reduce" and op.attrs.get("fn") in ("sum", "max"):
            grown = _grow_region(draft, op, consumers)
            new = _classify(draft, *grown, consumers) if grown else None
            if new is not None:
                new.origins = set().union(*(op.origins for op in grown[1]))
                _replace(draft, grown[1], new)
                consumers = _consumers(draft)
                i = draft.ops.index(new) + 1
                continue
        i += 1


def _fuse_elementwise(draft: Draft) -> None:
    """Merge chains of parameter-free elementwise ops over the same dims into one op (as XLA fuses them)."""
    consumers = _consumers(draft)
    producers = {op.output: op for op in draft.ops}
    removed: set[str] = set()
    for op in draft.ops:
        if op.name in removed or op.kind != "elementwise" or _has_param(draft, op):
            continue
        merged = True
        while merged:
            merged = False
            for t in op.inputs:
                p = producers.get(t)
                if p is None or p.kind != "elementwise" or _has_param(draft, p) or len(consumers[t]) != 1 \
                        or draft.tensors[t].role == "output" or set(draft.dims_of(t)) != set(draft.dims_of(op.output)):
                    continue
                op.inputs = list(dict.fromkeys([u for u in op.inputs if u != t] + p.inputs))
                op.attrs["fn"] = f"{p.attrs.get('fn')}+{op.attrs.get('fn')}"
                op.origins |= p.origins
                for u in p.inputs:  # p's inputs are now read by op
                    consumers[u] = [c for c in consumers[u] if c is not p and c is not op] + [op]
                removed.add(p.name)
                del producers[t], draft.tensors[t]
                merged = True
                break
    draft.ops[:] = [op for op in draft.ops if op.name not in removed]


def _has_param(draft: Draft, op: DraftOp) -> bool:
    return any(draft.tensors[t].role == "param" for t in op.inputs)


def _drop_dead(draft: Draft) -> None:
    """Remove ops whose results nothing reads (and that are no output), and tensors no op touches."""
    while True:
        used = {t for op in draft.ops for t in op.inputs}
        dead = [op for op in draft.ops if op.output not in used and draft.tensors[op.output].role != "output"]
        if not dead:
            break
        for op in dead:
            draft.ops.remove(op)
            del draft.tensors[op.output]
    touched = {t for op in draft.ops for t in (*op.inputs, op.output)}
    for name in [t for t, info in draft.tensors.items() if t not in touched and info.role != "param"]:
        del draft.tensors[name]


def _layers(draft: Draft) -> list[int | None]:
    """Layer tags from scopes (the first scope level where ops differ), else from repeated structure;
    ops outside every layer join a neighbour."""
    ops = draft.ops
    scoped = [op.scope for op in ops if op.scope]
    if not scoped:
        return _repeated_layers(draft)
    common = 0  # scope levels every scoped op shares, keeping one level below them
    while all(len(s) > common + 1 and s[common] == scoped[0][common] for s in scoped):
        common += 1
    keys = [op.scope[common] if len(op.scope) > common else None for op in ops]
    if all(k is None for k in keys):
        return _repeated_layers(draft)
    index: dict[str, int] = {}
    tags: list[int | None] = []
    for key in keys:
        if key is not None:
            index.setdefault(key, len(index))
        tags.append(index[key] if key is not None else None)
    return _fill(tags)


def _fill(tags: list[int | None]) -> list[int | None]:
    """Untagged ops join the layer before them (the first layer at the start)."""
    current = next((t for t in tags if t is not None), None)
    result = []
    for tag in tags:
        current = tag if tag is not None else current
        result.append(current)
    return result


def _signature(draft: Draft, op: DraftOp) -> tuple:
    """What makes two ops alike for finding repeated blocks: kind, function, sizes, the parameters' sizes."""
    sizes = tuple(draft.sizes[d] for d in draft.dims_of(op.output))
    params = tuple(tuple(draft.sizes[d] for d in draft.dims_of(t)) for t in op.inputs
                   if draft.tensors[t].role == "param")
    return op.kind, op.attrs.get("fn"), sizes, params


def _repeated_layers(draft: Draft) -> list[int | None]:
    """Layers from the longest run of a repeated block of ops (identical blocks, as a transformer's):
    each repetition a layer; None everywhere when nothing repeats."""
    ids: dict[tuple, int] = {}
    seq = [ids.setdefault(_signature(draft, op), len(ids)) for op in draft.ops]
    n = len(seq)
    best = (0, 0, 0, 0)  # coverage, -period, start, count
    for period in range(2, n // 2 + 1):
        run = 0
        for i in range(n - period - 1, -2, -1):  # run[i]: how far seq[i:] equals seq[i + period:]
            run = run + 1 if i >= 0 and seq[i] == seq[i + period] else 0
            if i >= 0 and (i == 0 or seq[i - 1] != seq[i - 1 + period]):
                count = run // period + 1
                if count >= 2 and (count * period, -period) > best[:2]:
                    best = (count * period, -period, i, count)
    coverage, period, start, count = best[0], -best[1], best[2], best[3]
    if not coverage:
        return [None] * n
    tags: list[int | None] = [None] * n
    for k in range(count):
        for j in range(start + k * period, start + (k + 1) * period):
            tags[j] = k
    return _fill(tags)


def _to_graph(draft: Draft, name: str, batch_dim: int | None, dtype: str) -> Graph:
    roots = list(dict.fromkeys(d for t in draft.tensors.values() for d in (draft.find(x) for x in t.dims)))
    names: dict[int, str] = {}
    if batch_dim is not None and draft.find(batch_dim) in roots:
        names[draft.find(batch_dim)] = "b"
    taken: dict[int, int] = {}
    for r in roots:
        if r in names:
            continue
        size = draft.sizes[r]
        k = taken.get(size, 0)
        taken[size] = k + 1
        names[r] = f"d{size}" if k == 0 else f"d{size}_{k}"

    draft.names = names

    def dim(d: int) -> str:
        return names[draft.find(d)]

    def attr(key: str, value: Any) -> Any:
        if key == "axes":
            return [dim(d) for d in value]
        if key in ("split", "merge"):
            return {dim(k): [dim(d) for d in v] for k, v in value.items()}
        return value

    tensors = {t: Tensor(t, tuple(dim(d) for d in info.dims), info.role,  # type: ignore[arg-type]
                         None if info.dtype == dtype else info.dtype)
               for t, info in draft.tensors.items()}
    tags = _layers(draft)
    ops = [Op(op.name, op.kind, tuple(op.inputs), op.output, tag, {k: attr(k, v) for k, v in op.attrs.items()})
           for op, tag in zip(draft.ops, tags)]
    batch = names.get(draft.find(batch_dim)) if batch_dim is not None else None
    return Graph(name, {names[r]: draft.sizes[r] for r in roots}, tensors, ops, batch, dtype)
