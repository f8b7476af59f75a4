"""Placements on a logical mesh, sharding strategies per op and parameter, resharding costs.

Vocabulary of PyTorch DTensor / GSPMD: each mesh axis of a tensor's placement is `Shard(dim)`,
`Replicate()` or `Partial()` (a pending sum). A strategy assigns each mesh axis to at most one
of an op's dims (DESIGN §4); its placements, work and memory follow from the dims' behaviour,
so one rule covers every op kind.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from partopt import costmodel
from partopt import ops as opkinds
from partopt.cluster import Device, LogicalMesh, MeshAxis
from partopt.errors import InstanceError
from partopt.graph import DTYPE_BYTES, Graph, Op, Tensor
from partopt.ops import Behaviour


class _Interned:
    """An immutable value of which equal instances are one object, so that it hashes and compares by identity, in
    C. Placements key the resharding tables, looked up hundreds of thousands of times per search: a frozen
    dataclass's generated `__hash__` and `__eq__` run Python code on every lookup."""

    __slots__ = ()
    _made: dict = {}

    def __new__(cls, *fields):
        key = (cls, *fields)
        made = _Interned._made.get(key)
        if made is None:
            made = _Interned._made[key] = object.__new__(cls)
            for name, value in zip(cls.__slots__, fields):
                object.__setattr__(made, name, value)
        return made

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self):  # unpickled (a worker's results) through `__new__`: the same interned object
        return type(self), tuple(getattr(self, name) for name in self.__slots__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__slots__)})"


class Shard(_Interned):
    """Split along the tensor dim `dim` over one mesh axis (DTensor's `Shard`)."""

    __slots__ = ("dim",)

    def __new__(cls, dim: str) -> Shard:
        return super().__new__(cls, dim)

    def __str__(self) -> str:
        return f"S({self.dim})"


class Replicate(_Interned):
    """A full copy on every device of the axis."""

    __slots__ = ()

    def __str__(self) -> str:
        return "R"


class Partial(_Interned):
    """A partial sum on every device of the axis, awaiting a reduction."""

    __slots__ = ()

    def __str__(self) -> str:
        return "P"


R = Replicate()
P = Partial()
AxisPlacement = Shard | Replicate | Partial
Placement = tuple[AxisPlacement, ...]  # one entry per mesh axis


def fmt(placement: Placement) -> str:
    """`[S(b), R]` style text of a placement (the plan file's form; `parse_placement` reads it back)."""
    return "[" + ", ".join(str(p) for p in placement) + "]"


_AXIS_TEXT = re.compile(r"^(?:S\((?P<dim>[^()\s,]+)\)|(?P<r>R)|(?P<p>P))$")


def parse_placement(text: str, where: str = "placement") -> Placement:
    """The inverse of `fmt`: "[S(b), R]" -> (Shard("b"), R); InstanceError naming `where` if malformed."""
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        raise InstanceError(f"malformed placement {text!r}", where, "write it like [S(b), R] (S(dim), R or P per mesh axis)")
    result: list[AxisPlacement] = []
    for part in body[1:-1].split(","):
        match = _AXIS_TEXT.match(part.strip())
        if match is None:
            raise InstanceError(f"malformed placement {text!r}: {part.strip()!r}", where,
                                "each mesh axis is S(dim), R or P")
        result.append(Shard(match["dim"]) if match["dim"] else (R if match["r"] else P))
    return tuple(result)


def shards(placement: Placement, mesh: LogicalMesh, skip_axis: int | None = None) -> int:
    """How many pieces a placement cuts a tensor into (optionally ignoring one axis)."""
    pieces, shape = 1, mesh.shape
    for i, p in enumerate(placement):
        if i != skip_axis and isinstance(p, Shard):
            pieces *= shape[i]
    return pieces


def local_bytes(nbytes: float, placement: Placement, mesh: LogicalMesh) -> float:
    """Bytes one device holds of a tensor under `placement` (Partial holds the full size)."""
    return nbytes / shards(placement, mesh)


def split_ways(placement: Placement, shape: Sequence[int]) -> dict[str, int]:
    """Per dim `placement` splits on a mesh of `shape`, into how many pieces: the product of its axes' sizes."""
    return _ways([p.dim if isinstance(p, Shard) else None for p in placement], shape)


def _ways(axes: Sequence[str | None], shape: Sequence[int]) -> dict[str, int]:
    """`split_ways` of the dim each mesh axis splits (`axes`: None where it splits none)."""
    split: dict[str, int] = {}
    for d, size in zip(axes, shape):
        if d is not None:
            split[d] = split.get(d, 1) * size
    return split


def local_shape(graph: Graph, tensor: str, placement: Placement, mesh: LogicalMesh) -> tuple[int, ...]:
    """The shape one device holds of `tensor` under `placement`: each dim divided by the mesh axes that shard it."""
    split = split_ways(placement, mesh.shape)
    return tuple(graph.dims[d] // split.get(d, 1) for d in graph.tensors[tensor].dims)


# ---------------------------------------------------------------- resharding (DESIGN §4 table)

def axis_collective(src: AxisPlacement, dst: AxisPlacement) -> str | None:
    """The collective that turns `src` into `dst` on one mesh axis, or None when free."""
    if src == dst or isinstance(src, Replicate) or isinstance(dst, Partial):
        return None  # same; local slice; a Partial target takes anything for free
    if isinstance(src, Partial):
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter"
    return "all_gather" if isinstance(dst, Replicate) else "all_to_all"


def buffer_divisor(kind: str, src: Placement, mesh: LogicalMesh, axis: int) -> int:
    """What a tensor's bytes are divided by to give the buffer `costmodel.collective_time` prices for `kind` on
    `axis` of a tensor placed `src`.

    All-gather, reduce-scatter and all-reduce act on the buffer gathered along the axis (the
    tensor's bytes over the source's shards on the other axes); an all-to-all exchanges the
    device's local shard, so its buffer is also divided by this axis.
    """
    return shards(src, mesh, skip_axis=None if kind == "all_to_all" else axis)


SMALL_BYTES = 256  # collectives this small (scalars, norm statistics) the verifiers list but do not compare


@dataclass(frozen=True)
class MeshShape:
    """What the collective rules here read of a LogicalMesh: its shape, and axes of one nominal link
    each; for the verifiers, which compare bytes, not times (a reshard on both axes then takes the
    axes in order)."""

    shape: tuple[int, int]

    @property
    def axes(self) -> tuple[MeshAxis, MeshAxis]:
        return tuple(MeshAxis(size, 1.0, 0.0, False) for size in self.shape)


def reshard_collectives(src: Placement, dst: Placement, nbytes: float,
                        mesh: LogicalMesh) -> list[tuple[str, int, float]]:
    """(collective, mesh axis, buffer bytes) needed to move a tensor from src to dst (see `buffer_divisor`).

    One collective per axis that changes, one after the other: each step's buffer is the layout the
    previous steps left (a tensor split on both axes and gathered whole moves the 1/b-gathered buffer
    on axis 0, then the whole tensor on axis 1). Of the two orders the cheaper is taken, except for an
    all-to-all over the whole mesh (`mesh_all_to_all_steps`)."""
    return list(_reshard_steps(src, dst, nbytes, mesh, costmodel.active()))


def is_mesh_all_to_all(src: Placement, dst: Placement, mesh: LogicalMesh) -> bool:
    """Whether src -> dst is one all-to-all over every device of the mesh: each axis (of size > 1) turns
    a Shard into another, and no dim is split in both layouts, so every destination block meets every
    source block in the same 1/(devices) of it (a layout that reuses a source dim, like [S(a), S(b)] ->
    [S(b), S(a)], sends unevenly and keeps the axis steps)."""
    used = [axis for axis, size in enumerate(mesh.shape) if size > 1]
    if len(used) < 2 or any(axis_collective(src[a], dst[a]) != "all_to_all" for a in used):
        return False
    split = {p.dim for p in src if isinstance(p, Shard)}
    return not split & {p.dim for p in dst if isinstance(p, Shard)}


Divided = tuple[tuple[str, int, tuple[int, ...]], ...]  # steps whose buffer is the tensor's bytes / d1 / d2 …
Template = tuple[bool, tuple[Divided, ...]]  # (take the dearer plan?, the candidate plans)


def mesh_all_to_all_steps(src: Placement, mesh: LogicalMesh, order: Sequence[int]) -> Divided:
    """One all-to-all over the whole mesh as the bytes it puts on each axis's link, `order[0]` the link
    that carries the blocks for devices differing on both axes: each device holds S = nbytes / devices
    and sends S / devices to every other device, so (a-1)/a · S crosses axis a = order[0] (an
    all-to-all of S there) and (b-1)/(a·b) · S goes only along axis b (an all-to-all of S / a);
    together (ab-1)/(ab) · S, the pairwise exchange over all a·b devices. Buffers as divisors of nbytes."""
    local = shards(src, mesh)
    first, second = order
    return (("all_to_all", first, (local,)), ("all_to_all", second, (local, mesh.shape[first])))


def _reshard_template(src: Placement, dst: Placement, mesh: LogicalMesh) -> Template:
    """`reshard_collectives` for any size: the candidate plans (one per order of the changing axes), each step's
    buffer as the divisors of the tensor's bytes, and whether the dearer plan is taken (an all-to-all over the
    whole mesh, `mesh_all_to_all_steps`) or the cheaper. The choice between them depends on the size.
    Memoised per `_pattern` of the pair and mesh shape: the thousands of pairs of a search share a few patterns."""
    return _pattern_template(_pattern(src, dst), mesh.shape)


@functools.lru_cache(maxsize=1 << 14)
def _pattern(src: Placement, dst: Placement) -> tuple:
    """src + dst with each Shard's dim replaced by its order of first appearance. A resharding's steps compare
    dims (which are equal, which shared) but never read their names or sizes: pairs of one pattern have one template.
    Memoised (a pure function of two interned placements): a search asks for the same pairs many times."""
    names: dict[str, int] = {}
    return tuple(names.setdefault(p.dim, len(names)) if isinstance(p, Shard) else p for p in (*src, *dst))


def _patterned(pattern: tuple, axes: int) -> tuple[Placement, Placement]:
    """A pair of placements of `_pattern` `pattern` on a mesh of `axes` axes, its dims named anew."""
    src, dst = (tuple(Shard(f"d{p}") if isinstance(p, int) else p for p in half)
                for half in (pattern[:axes], pattern[axes:]))
    return src, dst


@functools.lru_cache(maxsize=1 << 12)
def _pattern_template(pattern: tuple, shape: tuple[int, ...]) -> Template:
    """`_reshard_template` of the placements a `_pattern` stands for, dims named anew, on a mesh of `shape`
    (all the rules read of a mesh)."""
    src, dst = _patterned(pattern, len(shape))
    mesh = MeshShape(shape)
    changing = [axis for axis, (s, d) in enumerate(zip(src, dst))
                if axis_collective(s, d) is not None and mesh.shape[axis] > 1]
    orders = [changing] if len(changing) < 2 else [changing, changing[::-1]]
    if is_mesh_all_to_all(src, dst, mesh):
        return True, tuple(mesh_all_to_all_steps(src, mesh, order) for order in orders)
    return False, tuple(_in_order(src, dst, mesh, order) for order in orders)


def _sized(template: Template, nbytes: float, mesh: LogicalMesh) -> tuple[Step, ...]:
    """The steps of `template` for a tensor of `nbytes`: its plan priced cheapest (dearest for a mesh all-to-all)."""
    dearer, plans = template
    sized = []
    for plan in plans:
        steps = []
        for kind, axis, divisors in plan:
            size = nbytes
            for d in divisors:
                size = size / d
            steps.append((kind, axis, size))
        sized.append(tuple(steps))
    pick = max if dearer else min
    return pick(sized, key=lambda steps: collectives_time(steps, mesh))


@functools.lru_cache(maxsize=1 << 16)
def _reshard_steps(src: Placement, dst: Placement, nbytes: float, mesh: LogicalMesh,
                   model: costmodel.CostModel) -> tuple[tuple[str, int, float], ...]:
    """`reshard_collectives`, memoised: a stage's cost graph asks for the same few (layouts, size)
    tens of thousands of times. The active cost model picks the cheaper order, so it is in the key."""
    return _sized(_reshard_template(src, dst, mesh), nbytes, mesh)


def _in_order(src: Placement, dst: Placement, mesh: LogicalMesh, order: Sequence[int]) -> Divided:
    """The steps of `reshard_collectives` taken axis by axis in `order`, each from the layout so far
    (its buffer divisor: `buffer_divisor`)."""
    now, steps = list(src), []
    for axis in order:
        kind = axis_collective(now[axis], dst[axis])
        steps.append((kind, axis, (buffer_divisor(kind, tuple(now), mesh, axis),)))
        now[axis] = R if kind in ("all_gather", "all_reduce") else dst[axis]
    return tuple(steps)


COPYING = ("all_gather", "all_to_all")  # collectives that write their result into a new buffer


def reshard_copy_bytes(src: Placement, dst: Placement, nbytes: float, mesh: LogicalMesh) -> float:
    """Bytes of the copy that resharding src -> dst writes beside its source, per device (transient).

    An all-gather or all-to-all writes the tensor in the destination layout into a new buffer while
    the source is alive; an all-reduce or reduce-scatter runs in place (NCCL supports both, the
    reduce-scatters going first) and a local slice is a view: 0 when no copying collective is needed.
    """
    steps = reshard_collectives(src, dst, nbytes, mesh)
    return local_bytes(nbytes, dst, mesh) if any(kind in COPYING for kind, _, _ in steps) else 0.0


def collectives_time(steps: Sequence[tuple[str, int, float]], mesh: LogicalMesh, calls: float = 1.0) -> float:
    """Seconds of `steps` in order, each paying `calls` times a call's fixed part (`costmodel.collective_time`)."""
    model = costmodel.active()
    return sum(model.collective_time(kind, size, mesh.axes[axis], calls) for kind, axis, size in steps)


def reshard_time(src: Placement, dst: Placement, nbytes: float, mesh: LogicalMesh) -> float:
    """Seconds to move a tensor of `nbytes` from placement src to dst on `mesh`."""
    return collectives_time(reshard_collectives(src, dst, nbytes, mesh), mesh)


Step = tuple[str, int, float]  # (collective, mesh axis, buffer bytes)


class PairPrices:
    """Collective seconds on one mesh under the active cost model, memoised, over pairs of choices.

    A stage's cost graph prices the same few (source, target, bytes) reshardings tens of thousands
    of times, once per strategy pair of an edge. Here each distinct triple is priced once, and a
    table over two lists of choices is computed per distinct pair and spread by indexing.
    """

    def __init__(self, mesh: LogicalMesh) -> None:
        self.mesh = mesh
        self.model = costmodel.active()
        self._steps: dict[tuple, tuple[Step, ...]] = {}
        self._seconds: dict[tuple, float] = {}
        self._layouts: dict[tuple, tuple[np.ndarray, list[int]]] = {}
        self._pair_kinds: dict[Placement, dict[Placement, int]] = {}  # src -> dst -> its kind (`_kind`)
        self._kind_ids: dict[tuple[Template, int], int] = {}  # a kind's index in `_kinds`
        self._kinds: list[tuple[Template, int]] = []
        self._steps_at: dict[tuple[int, float], tuple[Step, ...]] = {}

    @classmethod
    def on(cls, mesh: LogicalMesh) -> PairPrices:
        """The prices of `mesh` under the active cost model, shared by every stage priced in this process."""
        key = (mesh, costmodel.active())
        if key not in _PAIR_PRICES:
            if len(_PAIR_PRICES) >= 64:
                _PAIR_PRICES.clear()
            _PAIR_PRICES[key] = cls(mesh)
        return _PAIR_PRICES[key]

    def reshard(self, src: Placement, dst: Placement, nbytes: float) -> tuple[Step, ...]:
        """`reshard_collectives(src, dst, nbytes, mesh)`, memoised."""
        key = (src, dst, nbytes)
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = _reshard_steps(src, dst, nbytes, self.mesh, self.model)
        return steps

    def step_seconds(self, steps: Sequence[Step], calls: float = 1.0) -> tuple[float, ...]:
        """Seconds of each collective of `steps`; their sum in order is `collectives_time(steps, mesh, calls)`."""
        times = []
        for kind, axis, size in steps:
            key = (kind, axis, size, calls)
            t = self._seconds.get(key)
            if t is None:
                t = self._seconds[key] = self.model.collective_time(kind, size, self.mesh.axes[axis], calls)
            times.append(t)
        return tuple(times)

    def seconds(self, steps: Sequence[Step], calls: float = 1.0) -> float:
        """`collectives_time(steps, mesh, calls)`, from memoised step times (same order, same sum)."""
        return sum(self.step_seconds(steps, calls))

    def _layout(self, srcs: Sequence[Placement], dsts: Sequence[Placement]) -> tuple[np.ndarray, list[int]]:
        """A resharding table's structure, the same for any size of the tensor: per pair (srcs[a], dsts[b]) the
        index of its kind of resharding (`_reshard_template` and the destination's shards, `self._kinds`) among
        the table's distinct ones, which are few, and those kinds. The microbatch counts of a search ask for the
        same tables at other sizes: each then prices only those few."""
        key = (tuple(srcs), tuple(dsts))
        layout = self._layouts.get(key)
        if layout is None:
            src_values, src_index = _classes(srcs)
            dst_values, dst_index = _classes(dsts)
            ids = np.array([self._kind_row(s, dst_values) for s in src_values], dtype=int)
            kinds, index = np.unique(ids, return_inverse=True)
            layout = self._layouts[key] = (index.reshape(ids.shape)[np.ix_(src_index, dst_index)], kinds.tolist())
        return layout

    def _kind_row(self, src: Placement, dsts: Sequence[Placement]) -> list[int]:
        """`_kind(src, d)` for each d of `dsts`, from the kinds known of `src` (a table asks for hundreds of pairs)."""
        known = self._pair_kinds.setdefault(src, {})
        return [known[d] if d in known else self._kind(src, d) for d in dsts]

    def _kind(self, src: Placement, dst: Placement) -> int:
        """The index in `self._kinds` of the pair's (template, destination shards): all its prices read."""
        value = (_reshard_template(src, dst, self.mesh), shards(dst, self.mesh))
        kind = self._kind_ids.get(value)
        if kind is None:
            kind = self._kind_ids[value] = len(self._kinds)
            self._kinds.append(value)
        self._pair_kinds.setdefault(src, {})[dst] = kind
        return kind

    def _sized_steps(self, kind: int, nbytes: float) -> tuple[Step, ...]:
        """The steps of resharding kind `kind` for a tensor of `nbytes` (`_sized`), memoised."""
        key = (kind, nbytes)
        steps = self._steps_at.get(key)
        if steps is None:
            steps = self._steps_at[key] = _sized(self._kinds[kind][0], nbytes, self.mesh)
        return steps

    def reshard_seconds(self, srcs: Sequence[Placement], dsts: Sequence[Placement], nbytes: float,
                        calls: float = 1.0) -> np.ndarray:
        """Seconds of the i-th resharding collective from srcs[a] to dsts[b], as [i, a, b]
        (one row per mesh axis, 0 past the last collective): each entry `step_seconds(reshard(...), calls)`."""
        index, kinds = self._layout(srcs, dsts)
        depth = len(self.mesh.shape)
        rows = []
        for kind in kinds:
            times = self.step_seconds(self._sized_steps(kind, nbytes), calls)
            rows.append(times + (0.0,) * (depth - len(times)))
        return np.moveaxis(np.array(rows, dtype=float)[index], 2, 0)

    def copy_table(self, srcs: Sequence[Placement], dsts: Sequence[Placement], nbytes: float) -> np.ndarray:
        """`reshard_copy_bytes(srcs[a], dsts[b], nbytes, mesh)` for every pair, as [a, b]."""
        index, kinds = self._layout(srcs, dsts)
        copies = [nbytes / self._kinds[kind][1] if any(k in COPYING for k, _, _ in self._sized_steps(kind, nbytes))
                  else 0.0 for kind in kinds]
        return np.array(copies, dtype=float)[index]

    def step_table(self, steps: Callable[[Any, Any], Sequence[Step]], srcs: Sequence, dsts: Sequence,
                   depth: int, calls: float = 1.0) -> np.ndarray:
        """Seconds of the i-th collective of `steps(s, d)` for every pair, as [i, a, b] (0 past its
        last): summed over i in order, each entry is `collectives_time(steps(s, d))` to the bit."""
        def padded(s, d) -> tuple[float, ...]:
            times = self.step_seconds(steps(s, d), calls)
            return times + (0.0,) * (depth - len(times))

        return np.moveaxis(pair_table(padded, srcs, dsts), 2, 0)


_PAIR_PRICES: dict[tuple, PairPrices] = {}


def _classes(values: Sequence, key: Callable[[Any], Any] | None = None) -> tuple[list, np.ndarray]:
    """The first value of each distinct key (default: the value itself) and each value's class index."""
    first: dict = {}
    index = [first.setdefault(v if key is None else key(v), (len(first), v))[0] for v in values]
    return [v for _, v in first.values()], np.array(index, dtype=int)


def pair_table(price: Callable[[Any, Any], Any], srcs: Sequence, dsts: Sequence,
               src_key: Callable[[Any], Any] | None = None, dst_key: Callable[[Any], Any] | None = None) -> np.ndarray:
    """`price(s, d)` for every pair of choices, as [a, b, ...]: computed once per distinct pair of
    keys (default: the choices themselves; a key holds all that `price` reads of a choice) on the
    first choices having them, and spread by indexing (strategies share layouts: tables repeat)."""
    src_values, src_index = _classes(srcs, src_key)
    dst_values, dst_index = _classes(dsts, dst_key)
    table = np.array([[price(s, d) for d in dst_values] for s in src_values], dtype=float)
    return table[np.ix_(src_index, dst_index)]


@functools.lru_cache(maxsize=1 << 12)
def gradient_placement(required: Placement, assigned: tuple[str | None, ...]) -> Placement:
    """Placement of the gradient a consumer sends back for one of its inputs.

    Where the consumer split a dim the input lacks (the input is Replicate there), each device
    holds a partial sum (Megatron's `f`); elsewhere the gradient has the input's placement.
    Memoised: a pure function of two small tuples, asked for each strategy of each use of every layer ILP.
    """
    return tuple(P if (d is not None and isinstance(q, Replicate)) else q for q, d in zip(required, assigned))


def as_gradient_target(output: Placement) -> Placement:
    """The placement a producer needs its output's gradient in: Partial read as Replicate."""
    return tuple(R if isinstance(p, Partial) else p for p in output)


# ---------------------------------------------------------------- op strategies

@dataclass(frozen=True)
class Strategy:
    """One way to run an op on a mesh: a dim (or None) per mesh axis and what follows from it."""

    axes: tuple[str | None, ...]
    inputs: tuple[Placement, ...]
    output: Placement
    compute_s: float  # forward + backward compute per microbatch
    comm: Mapping[str, float] = field(default_factory=dict)  # in-op collectives per microbatch
    flops: float = 0.0  # forward + backward FLOPs its kernels run on one device per microbatch (`executed_flops`)
    memory_bytes: float = 0.0  # output activation kept for backward, per device
    forward_s: float = 0.0  # the forward part of compute_s + comm_s: what recomputation runs again

    @property
    def comm_s(self) -> float:
        return sum(self.comm.values())

    @property
    def name(self) -> str:
        return "{" + ", ".join(f"{d or '-'}@{i}" for i, d in enumerate(self.axes)) + "}"


STATS_BYTES = 4  # norm/softmax statistics are fp32


def _axis_choices(graph: Graph, op: Op, mesh: LogicalMesh, force_dim: str | None) -> list[list[str | None]]:
    behaviour = graph.behaviours(op)
    if force_dim is not None:  # every axis splits this dim where the op has it (data parallelism)
        has = force_dim in behaviour and behaviour[force_dim] != Behaviour.WINDOWED
        return [[force_dim] if size > 1 and has else [None] for size in mesh.shape]
    if op.kind == "reshape":  # shardings live on the outermost part of a split/merge
        dims = [d for d in graph.tensors[op.output].dims if behaviour[d] != Behaviour.WINDOWED]
    else:
        dims = [d for d, b in behaviour.items() if b != Behaviour.WINDOWED]
    return [[None] + (dims if size > 1 else []) for size in mesh.shape]


def _divisible(graph: Graph, axes: Sequence[str | None], mesh: LogicalMesh) -> bool:
    return all(graph.dims[d] % n == 0 for d, n in _ways(axes, mesh.shape).items())


def _input_placement(tensor: Tensor, axes: Sequence[str | None], rename: Mapping[str, str]) -> Placement:
    placement = []
    for d in axes:
        d = rename.get(d, d) if d is not None and d not in tensor.dims else d
        placement.append(Shard(d) if d is not None and d in tensor.dims else R)
    return tuple(placement)


_STRATEGIES: dict[tuple, tuple] = {}  # op and parameter strategies, see `_kept_strategies`
_STRATEGIES_KEPT = 1 << 14


def _kept_strategies(key: tuple, enumerate_them: Callable[[], list]) -> list:
    """The strategies kept under `key` (which holds all they depend on), enumerated the first time; a new list."""
    kept = _STRATEGIES.get(key)
    if kept is None:
        if len(_STRATEGIES) >= _STRATEGIES_KEPT:
            _STRATEGIES.clear()
        kept = _STRATEGIES[key] = tuple(enumerate_them())
    return list(kept)


def op_strategies(graph: Graph, op: Op, mesh: LogicalMesh, force_dim: str | None = None) -> list[Strategy]:
    """Every valid strategy of `op` on `mesh` (divisible splits only), in a stable order.

    `force_dim` restricts the op to splitting that dim on every axis (data parallelism). Kept under the
    op's signature (`_op_signature`): the repeated layers of a model, and the search, its plan's validation
    and its check, ask for the same strategies again and again.
    """
    key = ("op", _op_signature(graph, op), mesh, force_dim, costmodel.active())
    return _kept_strategies(key, lambda: _strategies(graph, op, mesh, force_dim))


def _op_signature(graph: Graph, op: Op) -> tuple:
    """All that `_strategies` reads of an op: its kind and attributes, its tensors' dims, dtypes and roles,
    those dims' sizes, its compute precision and whether a backward keeps its output, but no name of the op or
    its tensors (strategies name dims, never tensors)."""
    tensors = tuple((graph.tensors[t].dims, graph.dtype_of(t), graph.tensors[t].role) for t in (*op.inputs, op.output))
    return (op.kind, repr(sorted(op.attrs.items())), tensors, tuple(graph.dims[d] for t in tensors for d in t[0]),
            graph.compute_dtype(op), op.output in graph.saved_for_backward)


def _strategies(graph: Graph, op: Op, mesh: LogicalMesh, force_dim: str | None) -> list[Strategy]:
    """`op_strategies`, enumerated."""
    behaviour = graph.behaviours(op)
    out_tensor = graph.tensors[op.output]
    rename = opkinds.reshape_outer(op) if op.kind == "reshape" else {}
    dtype = graph.compute_dtype(op)
    matmul = opkinds.is_matmul(op)
    flops = executed_flops(graph, op)
    share = forward_share(graph, op, mesh.device)
    model = costmodel.active()
    in_bytes, out_bytes, kept = [graph.nbytes(t) for t in op.inputs], graph.nbytes(op.output), kept_bytes(graph, op)
    kept_softmax = unfused_loss_kept(graph, op)
    strategies = []
    for axes in itertools.product(*_axis_choices(graph, op, mesh, force_dim)):
        if not _divisible(graph, axes, mesh):
            continue
        inputs = tuple(_input_placement(graph.tensors[t], axes, rename) for t in op.inputs)
        output = []
        comm: dict[str, float] = {}
        for axis, d in enumerate(axes):
            if d is None:
                output.append(R)
            elif d in out_tensor.dims:
                output.append(Shard(d))
                if behaviour[d] == Behaviour.NORMALISED:  # statistics all-reduce, forward and backward
                    stats = STATS_BYTES * graph.numel(op.output) / graph.dims[d] / _split(axes, mesh, besides=d)
                    t = 2 * model.collective_time("all_reduce", stats, mesh.axes[axis])
                    comm["all_reduce"] = comm.get("all_reduce", 0.0) + t
            elif behaviour[d] == Behaviour.NORMALISED:  # vocab-parallel loss: output complete after stats
                output.append(R)
                stats = STATS_BYTES * 3 * graph.numel(op.inputs[0]) / graph.dims[d] / _split(axes, mesh, besides=d)
                t = 2 * model.collective_time("all_reduce", stats, mesh.axes[axis])
                comm["all_reduce"] = comm.get("all_reduce", 0.0) + t
            else:  # contracted, reduced, gathered: a pending sum
                output.append(P)
        output_t = tuple(output)
        split = _split(axes, mesh)
        moved = sum(moved_bytes(graph, op, [local_bytes(b, p, mesh) for b, p in zip(in_bytes, inputs)],
                                local_bytes(out_bytes, output_t, mesh)))
        shapes = tuple(local_shape(graph, t, p, mesh) for t, p in zip((*op.inputs, op.output), (*inputs, output_t)))
        compute = 0.0 if op.kind in opkinds.UNPRICED_KINDS else model.op_time(
            op.kind, shapes, dtype, flops / split, moved, mesh.device, matmul)
        strategies.append(Strategy(
            axes=tuple(axes), inputs=inputs, output=output_t, compute_s=compute, comm=comm, flops=flops / split,
            memory_bytes=local_bytes(kept, output_t, mesh) + local_bytes(kept_softmax, inputs[0], mesh),
            forward_s=compute * share + sum(comm.values()) / 2))
    return strategies


PASS_THROUGH_FNS = frozenset({"add", "sub"})  # backward hands the output gradient on as each input's, no kernel


def moved_bytes(graph: Graph, op: Op, in_bytes: Sequence[float] | None = None,
                out_bytes: float | None = None) -> tuple[float, float]:
    """(forward, backward) bytes the op's kernels read and write, from its tensors' bytes (on one device: their
    local bytes; none given: the whole tensors) (docs/COSTMODEL.md §3, "Bytes moved").

    Forward: its inputs and output, `F`; a norm with batch statistics reads its input once more (a
    reduction pass, then the normalising pass). Backward: a matmul's two GEMMs each read the output
    gradient and one operand and write one gradient, `2F`; an add or subtract hands the output gradient
    on, except to an input it broadcast, whose gradient is a reduction (read the output gradient, write
    the input's); any other op reads the output gradient and what its backward reads
    (`ops.backward_reads`) and writes a gradient per differentiable input (a param or activation, not
    data), and a norm with batch statistics makes a reduction pass more (output gradient and input). A
    dropout writes its one-byte mask forward and reads it backward.
    """
    if in_bytes is None:
        in_bytes, out_bytes = [graph.nbytes(t) for t in op.inputs], graph.nbytes(op.output)
    forward = sum(in_bytes) + out_bytes
    if opkinds.is_matmul(op):
        return forward, 2 * forward
    needs_grad = [graph.tensors[t].role in ("param", "activation") and graph.dtype_of(t) in costmodel.TRAINABLE_DTYPES
                  for t in op.inputs]
    if op.kind == "elementwise" and op.attrs.get("fn") in PASS_THROUGH_FNS:
        out_numel = graph.numel(op.output)
        return forward, sum(out_bytes + b for t, b, grad in zip(op.inputs, in_bytes, needs_grad)
                            if grad and graph.numel(t) < out_numel)
    if opkinds.is_unfused_loss(op):
        return unfused_loss_bytes(graph, op, in_bytes, out_bytes)
    reads_in, reads_out = opkinds.backward_reads(op)
    backward = (out_bytes * (1 + reads_out) + sum(b for b, read in zip(in_bytes, reads_in) if read)
                + sum(b for b, grad in zip(in_bytes, needs_grad) if grad))
    mask = opkinds.mask_bytes(op, out_bytes / DTYPE_BYTES[graph.dtype_of(op.output)])
    forward += mask
    backward += mask
    if op.kind in opkinds.NORM_KINDS and graph.batch_dim in opkinds.norm_axes(op, graph):
        forward += in_bytes[0]
        backward += out_bytes + in_bytes[0]
    return forward, backward


def unfused_loss_bytes(graph: Graph, op: Op, in_bytes: Sequence[float], out_bytes: float) -> tuple[float, float]:
    """(forward, backward) bytes of Megatron-LM's vocab-parallel cross entropy (`tensor_parallel/cross_entropy.py`)
    on logits of `x` bytes, `X` as fp32: forward, the cast to fp32 (read x, write X; nothing for fp32 logits),
    then max (read X), subtract, exp (each read and write X in place), sum (read X) and divide (read and write X),
    and the labels and the loss; backward, the output gradient and one multiply in place (read and write X), and
    the gradient cast back (read X, write x)."""
    x = in_bytes[0]
    fp32 = x * DTYPE_BYTES["fp32"] / DTYPE_BYTES[graph.dtype_of(op.inputs[0])]
    cast = x + fp32 if fp32 != x else 0.0
    return cast + 8 * fp32 + sum(in_bytes[1:]) + out_bytes, out_bytes + 2 * fp32 + cast


def unfused_loss_kept(graph: Graph, op: Op) -> float:
    """Bytes an unfused cross entropy keeps for its backward (whole batch, in its logits' layout): the fp32 softmax
    it computed in place; 0 for any other op."""
    if not opkinds.is_unfused_loss(op):
        return 0.0
    return graph.numel(op.inputs[0]) * DTYPE_BYTES["fp32"]


def _flop_kind(op: Op) -> str:
    """The key of `costmodel.BACKWARD_FACTOR` an op's backward follows."""
    return "attention" if op.kind == "attention" else "matmul" if opkinds.is_matmul(op) else "other"


def forward_executed(graph: Graph, op: Op) -> float:
    """Forward FLOPs the op's kernel runs: its FLOPs, but a causal fused attention skips the masked half."""
    return graph.flops(op) * (0.5 if op.kind == "attention" and op.attrs.get("causal") else 1.0)


def executed_flops(graph: Graph, op: Op) -> float:
    """Forward + backward FLOPs the op's kernels run (docs/COSTMODEL.md §3): `costmodel.training_flops`,
    except fused attention, whose backward recomputes the scores (2.5× its forward) and whose causal
    kernel skips the masked half of both passes."""
    return forward_executed(graph, op) * (1.0 + costmodel.BACKWARD_FACTOR[_flop_kind(op)])


def kept_bytes(graph: Graph, op: Op) -> float:
    """Bytes an op keeps for its backward (whole batch): its output when a backward reads it
    (`Graph.saved_for_backward`), else nothing; a dropout adds its one-byte mask; fused attention adds each
    query row's fp32 log-sum-exp, from which its backward recomputes the scores (the value head dim is never split)."""
    mask = opkinds.mask_bytes(op, graph.numel(op.output))
    if op.output not in graph.saved_for_backward:
        return mask
    if op.kind != "attention":
        return graph.nbytes(op.output) + mask
    return graph.nbytes(op.output) + STATS_BYTES * graph.numel(op.output) / graph.dims[opkinds.attention_dims(op, graph)[1]]


def forward_share(graph: Graph, op: Op, device: Device) -> float:
    """The forward pass's share of an op's training compute time, applied to its whole roofline: a matmul's
    FLOP split (1/3, 1/3.5 for fused attention), which its bytes follow; any other op's passes each priced on
    their own roofline, FLOPs split evenly and bytes as `moved_bytes` counts them (memory-bound: 2/5 of a
    relu; nearly all of an add, whose backward moves no bytes)."""
    if opkinds.is_matmul(op):
        return 1.0 / (1.0 + costmodel.BACKWARD_FACTOR[_flop_kind(op)])
    flops = executed_flops(graph, op) / (1.0 + costmodel.BACKWARD_FACTOR["other"])
    passes = moved_bytes(graph, op)
    forward, backward = (costmodel.compute_time(flops, b, device, graph.compute_dtype(op), False) for b in passes)
    return forward / (forward + backward) if forward + backward else 0.5


def _split(axes: Sequence[str | None], mesh: LogicalMesh, besides: str | None = None) -> int:
    """How many ways the op's work is divided: the product of the assigned axes' sizes (leaving
    out the axes that split `besides`: statistics over a normalised dim are per row of the others)."""
    return math.prod(size for d, size in zip(axes, mesh.shape) if d is not None and d != besides)


def tensor_placements(graph: Graph, tensor: str, mesh: LogicalMesh, partial: bool = False) -> list[Placement]:
    """Every placement of a tensor: Replicate or a divisible Shard on each axis (complete ones),
    and with `partial` also Partial (a pending sum, as a gradient sum may be)."""
    dims = graph.tensors[tensor].dims
    per_axis = [[R] + ([P] if partial else []) + ([Shard(d) for d in dims] if size > 1 else [])
                for size in mesh.shape]
    return [tuple(p) for p in itertools.product(*per_axis)
            if _divisible(graph, [x.dim if isinstance(x, Shard) else None for x in p], mesh)]


# ---------------------------------------------------------------- parameter strategies

@dataclass(frozen=True)
class ParamStrategy:
    """Where a parameter lives: its placement, and the axes its optimizer state is sharded over."""

    placement: Placement
    zero_axes: tuple[int, ...]  # ZeRO: optimizer state split over these replicated axes
    state_bytes: tuple[float, float, float]  # weights, gradients, optimizer state per device

    @property
    def memory_bytes(self) -> float:
        return sum(self.state_bytes)

    @property
    def name(self) -> str:
        zero = f" zero@{','.join(map(str, self.zero_axes))}" if self.zero_axes else ""
        return fmt(self.placement) + zero


def param_strategies(graph: Graph, tensor: Tensor, mesh: LogicalMesh, allow_zero: bool = True,
                     replicated: bool = False, layout: str = "zero", uneven: bool = False) -> list[ParamStrategy]:
    """Every placement of a parameter (Shard on a divisible dim or Replicate per axis) × ZeRO choice, its state
    in the runtime's `layout` (`costmodel.STATE_LAYOUTS`).

    `replicated` keeps only whole copies (data parallelism; ZeRO still allowed). `uneven` also stores it split
    along dims the axes do not divide, as ZeRO-3 and FSDP store the weights they gather for each use: padded,
    each device holding the largest shard (`stored_fraction`). Kept under all they read: the tensor's dims, their
    sizes, its dtype, the optimizer, the layout and the mesh's shape (a model's layers repeat their weights).
    """
    key = ("param", tensor.dims, tuple(graph.dims[d] for d in tensor.dims), graph.dtype_of(tensor.name),
           graph.optimizer, layout, mesh.shape, allow_zero, replicated, uneven)
    return _kept_strategies(key, lambda: _param_strategies(graph, tensor, mesh, allow_zero, replicated, layout,
                                                           uneven))


def stored_fraction(graph: Graph, tensor: str, placement: Placement, mesh: LogicalMesh) -> float:
    """The fraction of a tensor one device stores under `placement`: 1 / shards when the splits divide its dims,
    else the largest shard's, each split dim rounded up (ceil(size / ways) of its size: padding, as FSDP pads)."""
    return math.prod(-(-graph.dims[d] // n) / graph.dims[d] for d, n in split_ways(placement, mesh.shape).items())


def _param_strategies(graph: Graph, tensor: Tensor, mesh: LogicalMesh, allow_zero: bool,
                      replicated: bool, layout: str, uneven: bool) -> list[ParamStrategy]:
    """`param_strategies`, enumerated."""
    per_axis = [[R] + ([Shard(d) for d in tensor.dims] if size > 1 and not replicated else []) for size in mesh.shape]
    memory = costmodel.param_memory(graph.numel(tensor.name), graph.dtype_of(tensor.name), graph.optimizer, layout)
    result = []
    for placement in itertools.product(*per_axis):
        axes = [p.dim if isinstance(p, Shard) else None for p in placement]
        even = _divisible(graph, axes, mesh)
        if not (even or uneven):
            continue
        replicated = [i for i, p in enumerate(placement) if isinstance(p, Replicate) and mesh.shape[i] > 1]
        zero_choices = [()]
        if allow_zero:
            zero_choices = [c for k in range(len(replicated) + 1) for c in itertools.combinations(replicated, k)]
        n = shards(placement, mesh) if even else 1 / stored_fraction(graph, tensor.name, placement, mesh)
        for zero in zero_choices:
            z = math.prod(mesh.shape[i] for i in zero)
            result.append(ParamStrategy(
                placement=tuple(placement), zero_axes=tuple(zero),
                state_bytes=(memory.weights / n, memory.grads / n, memory.optimizer / (n * z))))
    return result


def param_sync_collectives(grad: Placement, param: ParamStrategy, nbytes: float,
                           mesh: LogicalMesh, weight_bytes: float | None = None) -> list[tuple[str, int, float]]:
    """Per-iteration gradient synchronisation of one parameter (DESIGN §4 "Parameters").

    Gradients accumulate over microbatches in the consumer's layout `grad`; once per iteration
    they are reduced into the parameter's placement. On a ZeRO axis the all-reduce becomes a
    reduce-scatter plus an all-gather of the updated weights (and a complete gradient needs
    only that all-gather). A gradient that changes its split on both axes is one all-to-all over the
    mesh, priced as any resharding (`is_mesh_all_to_all`). The partial sums of a weight stored split
    are not here: they are reduce-scattered every microbatch (`param_eager_collectives`). `nbytes` are the
    gradient's as reduced, `weight_bytes` the weights' (default: the same), which a ZeRO axis gathers.
    """
    template = _sync_template(_pattern(grad, param.placement), param.zero_axes, mesh.shape)
    if template is None:
        return reshard_collectives(grad, param.placement, nbytes, mesh)
    weights = nbytes if weight_bytes is None else weight_bytes
    return [(kind, axis, (weights if kind == "all_gather" and axis in param.zero_axes else nbytes) / divisor)
            for kind, axis, divisor, eager in template if not eager]


def param_eager_collectives(grad: Placement, param: ParamStrategy, nbytes: float,
                            mesh: LogicalMesh) -> list[tuple[str, int, float]]:
    """Per-microbatch gradient reduction of one parameter: on each axis where the parameter is stored split and its
    consumer's gradient `grad` holds partial sums (a weight gathered for use: FSDP, ZeRO-3), the reduce-scatter into
    the stored shard, right after the consumer's backward, as PyTorch FSDP and DeepSpeed ZeRO-3 run it; so the
    gradient accumulates over microbatches as that shard (docs/COSTMODEL.md §5, "Gradient accumulation buffers")."""
    template = _sync_template(_pattern(grad, param.placement), param.zero_axes, mesh.shape)
    return [] if template is None else [(kind, axis, nbytes / divisor) for kind, axis, divisor, eager in template
                                        if eager]


@functools.lru_cache(maxsize=1 << 12)
def _sync_template(pattern: tuple, zero_axes: tuple[int, ...],
                   shape: tuple[int, ...]) -> tuple[tuple[str, int, int, bool], ...] | None:
    """The steps of `param_sync_collectives` and `param_eager_collectives` for any size: each step's buffer as the
    divisor of the tensor's bytes, and whether it runs every microbatch; or None for one all-to-all over the mesh (a
    resharding). Memoised per `_pattern` of (gradient, placement), ZeRO axes and mesh shape: all it reads (it
    compares dims, never reads their names)."""
    grad, placement = _patterned(pattern, len(shape))
    mesh = MeshShape(shape)
    if is_mesh_all_to_all(grad, placement, mesh):
        return None
    steps = []
    for axis, (g, p) in enumerate(zip(grad, placement)):
        if shape[axis] == 1:
            continue
        if axis in zero_axes:
            divisor = shards(grad, mesh, skip_axis=axis)
            if isinstance(g, Partial):
                steps.append(("reduce_scatter", axis, divisor, False))
            steps.append(("all_gather", axis, divisor, False))
            continue
        kind = axis_collective(g, p)
        if kind is not None:
            steps.append((kind, axis, buffer_divisor(kind, grad, mesh, axis), kind == "reduce_scatter"))
    return tuple(steps)
