"""Framework arrays as values over a Draft: the mapping of array operations that every frontend shares.

A `Value` is an array of the framework's program: the graph tensor holding its data (None when it is
known at trace time, a constant) and a dim id per array axis (None for axes of size 1). Axes the
tensor lacks are broadcast: broadcasts, transposes and squeezes are free and make no op. `Values`
maps elementwise ops (numpy broadcasting), reductions, reshapes, contractions and lookups onto the
Draft's ops, unifying the dims the operation says are the same. It raises `NoMapping` with the reason
when an operation has no honest mapping; the frontend adds the framework's location.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from partopt.frontends.draft import INTEGER_DTYPES, Draft

Scope = tuple[str, ...]


class NoMapping(ValueError):
    """An operation the IR cannot express as asked; the message says why."""


@dataclass(frozen=True)
class Value:
    """An array: the tensor holding it (None: a constant) and a dim id per axis (None: size 1)."""

    tensor: str | None
    axes: tuple[int | None, ...]
    missing: str | None = None  # why the value cannot be used (a scan's stacked outputs)


class Values:
    """Array operations onto a Draft."""

    def __init__(self) -> None:
        self.draft = Draft()

    # ------------------------------------------------------------ values
    def axes(self, shape: Sequence[int]) -> tuple[int | None, ...]:
        return tuple(self.draft.new_dim(s) if s != 1 else None for s in shape)

    def constant(self, shape: Sequence[int]) -> Value:
        return Value(None, self.axes(shape))

    def leaf(self, name: str, shape: Sequence[int], role: str, dtype: str) -> Value:
        """A parameter or data input of the program."""
        axes = self.axes(shape)
        self.draft.tensor(name, [a for a in axes if a is not None], role, dtype)
        return Value(name, axes)

    def held(self, value: Value, axis: int) -> bool:
        """Whether the value's tensor holds array axis `axis` (rather than broadcasting it)."""
        d = value.axes[axis]
        return value.tensor is not None and d is not None and self.draft.find(d) in self.draft.dims_of(value.tensor)

    def held_dims(self, values: Sequence[Value], axes: Sequence[int | None]) -> list[int]:
        """The axes some input tensor holds (the rest stay broadcast)."""
        have = {d for v in values if v.tensor is not None for d in self.draft.dims_of(v.tensor)}
        return [a for a in axes if a is not None and self.draft.find(a) in have]

    def conform(self, value: Value, axis: int, target: int, scope: Scope) -> Value | None:
        """`value` with axis `axis` made dim `target`: unified, or its tensor renamed when unifying would
        give some tensor one dim twice; None when its tensor already holds `target` on another axis."""
        d = value.axes[axis]
        if d is None or self.draft.unify(target, d):
            return value
        tensor = value.tensor
        if self.held(value, axis):
            if self.draft.find(target) in self.draft.dims_of(value.tensor):
                return None
            tensor = self.draft.rename(value.tensor, d, target, scope)
        return Value(tensor, tuple(target if i == axis else a for i, a in enumerate(value.axes)))

    def pair(self, lhs: Value, a: int, rhs: Value, b: int, scope: Scope) -> tuple[Value, Value]:
        """Make lhs axis a and rhs axis b one dim, renaming whichever operand can take the other's name."""
        if lhs.axes[a] is None or rhs.axes[b] is None:
            return lhs, rhs
        done = self.conform(rhs, b, lhs.axes[a], scope)
        if done is not None:
            return lhs, done
        done = self.conform(lhs, a, rhs.axes[b], scope)
        if done is not None:
            return done, rhs
        raise NoMapping("its operands pair one dim with two different axes")

    # ------------------------------------------------------------ operations
    def elementwise(self, ins: Sequence[Value], shape: Sequence[int], dtype: str, name: str, scope: Scope,
                    fn: str) -> Value:
        """An elementwise op with numpy broadcasting (axes aligned from the right)."""
        rank = len(shape)
        axes: list[int | None] = [None] * rank
        conformed = []
        for value in ins:
            shift = rank - len(value.axes)
            for i, d in enumerate(value.axes):
                if d is None:
                    continue
                if axes[shift + i] is None:
                    axes[shift + i] = d
                else:
                    probe = Value(None, (None,) * i + (axes[shift + i],))
                    _, value = self.pair(probe, i, value, i, scope)
                    axes[shift + i] = value.axes[i]
            conformed.append(value)
        axes = [a if a is not None or s == 1 else self.draft.new_dim(s) for a, s in zip(axes, shape)]
        tensors = [v.tensor for v in conformed if v.tensor is not None]
        if not tensors:
            return Value(None, tuple(axes))
        if dtype in INTEGER_DTYPES and all(self.draft.tensors[t].dtype in INTEGER_DTYPES for t in tensors):
            return Value(tensors[0], tuple(axes))  # index arithmetic on integer inputs: the same ids
        out = self.draft.op("elementwise", name, tensors, self.held_dims(conformed, axes), dtype, scope, fn=fn)
        return Value(out, tuple(axes))

    def reduce(self, value: Value, reduced: Sequence[int], dtype: str, name: str, scope: Scope, fn: str,
               keepdims: bool = False) -> Value:
        """A reduction over axes `reduced` (kept as size-1 axes with `keepdims`)."""
        gone = set(reduced)
        kept = tuple(None if i in gone else a for i, a in enumerate(value.axes) if keepdims or i not in gone)
        if value.tensor is None or not any(self.held(value, i) for i in gone):
            return Value(value.tensor, kept)  # summing a broadcast: a scale, no work worth an op
        out = self.draft.op("reduce", name, [value.tensor], self.held_dims([value], kept), dtype, scope, fn=fn)
        return Value(out, kept)

    def reshape(self, value: Value, in_shape: Sequence[int], out_shape: Sequence[int], name: str,
                scope: Scope) -> Value:
        """A reshape: axes kept, split or merged (size-1 axes come and go freely)."""
        src = [i for i, s in enumerate(in_shape) if s != 1]
        dst = [j for j, s in enumerate(out_shape) if s != 1]
        axes: list[int | None] = [None] * len(out_shape)
        split: dict[int, list[int]] = {}
        merge: dict[int, list[int]] = {}
        i = j = 0
        while i < len(src) and j < len(dst):
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
                raise NoMapping(f"a reshape of {tuple(in_shape)} into {tuple(out_shape)} regroups several axes at once")
            held = [self.held(value, k) for k in a]
            if any(held) and not all(held):
                raise NoMapping("a reshape merges held and broadcast axes")
            for k in b:
                axes[k] = self.draft.new_dim(out_shape[k])
            if all(held):
                if len(a) == 1:
                    split[self.draft.find(value.axes[a[0]])] = [axes[k] for k in b]  # type: ignore[misc]
                else:
                    merge[axes[b[0]]] = [self.draft.find(value.axes[k]) for k in a]  # type: ignore[index,arg-type]
        if not split and not merge or value.tensor is None:
            return Value(value.tensor, tuple(axes))
        first_part = {parts[0]: whole for whole, parts in merge.items()}
        merged = {p for parts in merge.values() for p in parts}
        dims: list[int] = []
        for d in self.draft.dims_of(value.tensor):  # the tensor's order: parts replace their whole in place
            if d in split:
                dims += split[d]
            elif d in first_part:
                dims.append(first_part[d])
            elif d not in merged:
                dims.append(d)
        attrs = {k: v for k, v in (("split", split), ("merge", merge)) if v}
        out = self.draft.op("reshape", name, [value.tensor], dims, self.draft.tensors[value.tensor].dtype, scope, **attrs)
        return Value(out, tuple(axes))

    def contract(self, lhs: Value, rhs: Value, lc: Sequence[int], rc: Sequence[int], lb: Sequence[int],
                 rb: Sequence[int], dtype: str, name: str, scope: Scope) -> Value:
        """dot_general: output axes are the batch axes, lhs's free axes, then rhs's free axes (an einsum)."""
        if lhs.tensor is None or rhs.tensor is None:
            raise NoMapping("a product with a constant array")
        for a, b in (*zip(lb, rb), *zip(lc, rc)):
            lhs, rhs = self.pair(lhs, a, rhs, b, scope)
        lfree = [i for i in range(len(lhs.axes)) if i not in lc and i not in lb]
        rfree = [j for j in range(len(rhs.axes)) if j not in rc and j not in rb]
        taken = {self.draft.find(a) for a in lhs.axes if a is not None}
        for j in rfree:  # q·kᵀ over one sequence dim: the keys' positions become a dim of their own
            d = rhs.axes[j]
            if d is not None and self.draft.find(d) in taken:
                fresh = self.draft.new_dim(self.draft.sizes[self.draft.find(d)])
                tensor = self.draft.rename(rhs.tensor, d, fresh, scope) if self.held(rhs, j) else rhs.tensor
                rhs = Value(tensor, tuple(fresh if k == j else x for k, x in enumerate(rhs.axes)))
        axes = tuple([lhs.axes[i] for i in lb] + [lhs.axes[i] for i in lfree] + [rhs.axes[j] for j in rfree])
        out = self.draft.op("einsum", name, [lhs.tensor, rhs.tensor], self.held_dims([lhs, rhs], axes), dtype, scope)
        return Value(out, axes)

    def lookup(self, table: Value, vocab: int, ids: Value, ids_axes: Sequence[int | None], row_positions: Sequence[int],
               rank: int, dtype: str, name: str, scope: Scope) -> Value:
        """An embedding: rows of `table` (axis `vocab` indexed) at `ids`; the rows' other axes land at
        `row_positions` of the output, the ids' axes (`ids_axes`) fill the rest in order."""
        if ids.tensor is None or table.tensor is None or not self.held(table, vocab):
            raise NoMapping("only lookups of ids computed from the inputs into a table map (embeddings)")
        rows = iter(a for k, a in enumerate(table.axes) if k != vocab)
        index = iter(ids_axes)
        axes = tuple(next(rows) if k in row_positions else next(index) for k in range(rank))
        out = self.draft.op("embedding", name, [ids.tensor, table.tensor], self.held_dims([ids, table], axes), dtype, scope)
        return Value(out, axes)

    def opaque(self, ins: Sequence[Value], shape: Sequence[int], dtype: str, name: str, scope: Scope,
               primitive: str, flops: int, keep: Sequence[tuple[int, int]] = ()) -> Value:
        """An op the IR cannot see into: priced by `flops`, never sharded. `keep` pairs (input index, axis)
        with output axes known to be the same dim (a concatenation's other axes); the rest are new dims."""
        axes = list(self.axes(shape))
        for out_axis, (k, axis) in enumerate(keep):
            if k >= 0 and ins[k].axes[axis] is not None:
                axes[out_axis] = ins[k].axes[axis]
        tensors = [v.tensor for v in ins if v.tensor is not None]
        out = self.draft.op("opaque", name, tensors, [a for a in axes if a is not None], dtype, scope,
                            primitive=primitive, flops=int(flops))
        return Value(out, tuple(axes))

    def concatenate(self, ins: Sequence[Value], axis: int, shape: Sequence[int], dtype: str, name: str,
                    scope: Scope) -> Value:
        """A concatenation: an opaque op (the IR has none, 0 FLOPs) whose other axes are the inputs' dims."""
        ins = list(ins)
        for k in range(1, len(ins)):
            for a in range(len(shape)):
                if a != axis:
                    ins[0], ins[k] = self.pair(ins[0], a, ins[k], a, scope)
        keep = [(-1, 0) if k == axis else (0, k) for k in range(len(shape))]
        return self.opaque(ins, shape, dtype, name, scope, "concatenate", 0, keep)
