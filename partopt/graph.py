"""Graph IR: named dims, tensors over them, operators; validation and structural hashing.

A `Graph` is valid by construction: building one checks every rule of DESIGN §2 and raises
`InstanceError` naming the JSON path and the op or tensor at fault.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Literal, Mapping, Sequence

import networkx as nx

from partopt import ops as opkinds
from partopt.errors import InstanceError, short

Role = Literal["input", "param", "activation", "output"]
ROLES: tuple[str, ...] = ("input", "param", "activation", "output")
DTYPE_BYTES: Mapping[str, int] = {
    "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int32": 4, "int64": 8, "bool": 1,
}
MATMUL_DTYPES: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")  # what `Graph.matmul_dtype` may name
OPTIMIZERS: tuple[str, ...] = ("adam", "sgd", "adafactor")  # their state bytes: costmodel.OPTIMIZER_STATE
# Size limits (docs/FORMAT.md), far above any model (the zoo's largest: a dim of 2^20, a tensor of 2^40 elements, an op
# of 2^51 FLOPs) and low enough that every product and sum the cost model forms stays finite in float64 (a dim of 10^160
# made `inspect` fail with OverflowError)
MAX_DIM = 2**53  # a dim's size: float64 holds every integer up to it exactly
MAX_ELEMENTS = 2**63 - 1  # a tensor's elements: int64, the frameworks' size type
MAX_OP_FLOPS = 10**30  # an op's forward FLOPs over the batch (an opaque op's `flops`, an einsum of many operands)


@dataclass(frozen=True)
class Tensor:
    """A named tensor whose axes are named dims; `dtype` None means the graph's dtype."""

    name: str
    dims: tuple[str, ...]
    role: Role = "activation"
    dtype: str | None = None


@dataclass(frozen=True, eq=True)
class Op:
    """One operator: a kind (see `partopt.ops`), input tensors, one output tensor."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    output: str
    layer: int | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass
class Graph:
    """A validated operator graph over named dims."""

    name: str
    dims: dict[str, int]
    tensors: dict[str, Tensor]
    ops: list[Op]
    batch_dim: str | None = None
    dtype: str = "fp16"
    optimizer: str = "adam"  # how the parameters are trained; sets their state bytes (costmodel.OPTIMIZER_STATE)
    matmul_dtype: str | None = None  # the precision GEMMs run at when not their tensors' (FP8 training)
    # the transformer's hyper-parameters as a generator knows them (docs/FORMAT.md, "architecture"), which exports
    # name in a runtime's terms; None: the graph says only what its ops say
    architecture: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.dims = dict(self.dims)
        self.tensors = dict(self.tensors)
        self.ops = list(self.ops)
        _validate(self)
        # what the structure gives at given sizes (structural hashes, `resized` views), keyed by the sizes; views
        # share the structure, so they share this too
        self._memo: dict[tuple, Any] = {}

    def resized(self, dims: Mapping[str, int]) -> Graph:
        """This graph with its dims' sizes set to `dims` (a microbatch's view): checked where sizes enter (every
        dim a positive integer, every op's shape rules); its structure, validated already, and what is derived
        from it (op index, producers, order, …) are shared, not rebuilt (the search makes a view per count)."""
        if dims.keys() != self.dims.keys():
            raise ValueError(f"resized renames no dims: {sorted(set(dims) ^ set(self.dims))}")
        key = ("view", _sizes(dims))
        if key not in self._memo:
            view = copy.copy(self)
            view.dims = dict(dims)
            view._memo = self._memo
            _validate_sizes(view)
            self._memo[key] = view
        return self._memo[key]

    def batch_scaled_dims(self) -> frozenset[str]:
        """The dims that scale with the batch dim: it, and those a reshape derives from it (MoE's tokens `bs = b·s`,
        its groups `g`): a whole dim scales with a scaled part, and an outermost part with a scaled whole.
        Structural, so memoized for the graph and its views alike."""
        key = ("batch-scaled",)
        if key not in self._memo:
            scaled = {self.batch_dim} - {None}
            changed = True
            while changed:
                changed = False
                for op in self.ops:
                    for direction in ("split", "merge"):
                        for whole, parts in (op.attrs.get(direction) or {}).items():
                            if whole not in scaled and any(p in scaled for p in parts):
                                scaled.add(whole)
                                changed = True
                            elif whole in scaled and not any(p in scaled for p in parts):
                                scaled.add(parts[0])
                                changed = True
            self._memo[key] = frozenset(scaled)
        return self._memo[key]

    def __getstate__(self) -> dict:
        """What a pickle carries (to a pricing worker): not the memo, which can be large."""
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _memo={})

    # ------------------------------------------------------------ structure
    @cached_property
    def op_index(self) -> dict[str, Op]:
        return {op.name: op for op in self.ops}

    @cached_property
    def producers(self) -> dict[str, Op]:
        """Tensor name -> the op that produces it."""
        return {op.output: op for op in self.ops}

    @cached_property
    def consumers(self) -> dict[str, list[Op]]:
        """Tensor name -> ops reading it, in graph order (an op reading twice appears once)."""
        result: dict[str, list[Op]] = {name: [] for name in self.tensors}
        for op in self.ops:
            for t in dict.fromkeys(op.inputs):
                result[t].append(op)
        return result

    @cached_property
    def order(self) -> list[Op]:
        """Ops in a topological order, stable: the file's order wherever it is valid."""
        position = {op.name: i for i, op in enumerate(self.ops)}
        dag = _dependency_graph(self)
        names = nx.lexicographical_topological_sort(dag, key=position.__getitem__)
        return [self.op_index[n] for n in names]

    @cached_property
    def saved_for_backward(self) -> frozenset[str]:
        """Op outputs kept for the backward pass (docs/COSTMODEL.md §5): those its producer's or a reader's backward
        reads (`ops.backward_reads`), those read in another layer (a stage's boundary, the checkpoint a recomputed
        layer restarts from) and those nobody reads (what leaves the graph); but not a reshape's output whose
        input is kept (a view of the same elements, as each device holds them)."""
        needed = set()
        for op in self.ops:
            inputs, output = opkinds.backward_reads(op)
            needed.update(t for t, read in zip(op.inputs, inputs) if read)
            if output or any(c.layer != op.layer for c in self.consumers[op.output]) or not self.consumers[op.output]:
                needed.add(op.output)
        return frozenset(t for t in needed if t in self.producers
                         and not (self.producers[t].kind == "reshape" and self.producers[t].inputs[0] in needed))

    @cached_property
    def params(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.role == "param"]

    @property
    def num_params(self) -> int:
        """Exact number of trainable parameters (elements of all `param` tensors)."""
        return sum(self.numel(t.name) for t in self.params)

    @cached_property
    def layers(self) -> list[int | None]:
        """The distinct layer tags in topological order (None for untagged ops)."""
        return list(dict.fromkeys(op.layer for op in self.order))

    # ------------------------------------------------------------ sizes and work
    def dtype_of(self, tensor: str) -> str:
        return self.tensors[tensor].dtype or self.dtype

    def compute_dtype(self, op: Op) -> str:
        """The precision `op` computes at: its output's dtype, except that a GEMM runs at `matmul_dtype`
        when the graph sets one (FP8 training as Transformer Engine runs it: tensors in 16 bits, each
        GEMM's inputs cast to fp8). Fused attention keeps its tensors' precision (TE's `fp8_dpa` is off
        by default)."""
        if self.matmul_dtype is not None and opkinds.is_matmul(op) and op.kind != "attention":
            return self.matmul_dtype
        return self.dtype_of(op.output)

    def numel(self, tensor: str) -> int:
        return math.prod(self.dims[d] for d in self.tensors[tensor].dims)

    def nbytes(self, tensor: str) -> int:
        return self.numel(tensor) * DTYPE_BYTES[self.dtype_of(tensor)]

    def flops(self, op: Op) -> int:
        """Forward FLOPs of `op` over the global batch."""
        return opkinds.forward_flops(op, self)

    def bytes_read(self, op: Op) -> int:
        return sum(self.nbytes(t) for t in op.inputs)

    def bytes_written(self, op: Op) -> int:
        return self.nbytes(op.output)

    def behaviours(self, op: Op) -> dict[str, opkinds.Behaviour]:
        """Each dim of `op` and how sharding it behaves."""
        return opkinds.behaviours(op, self)

    @property
    def forward_flops(self) -> int:
        return sum(self.flops(op) for op in self.ops)

    # ------------------------------------------------------------ hashing
    def structural_hash(self, ops: Iterable[Op] | None = None) -> str:
        """A hash of the ops' structure that ignores op, tensor and dim names.

        Two subgraphs hash alike when they differ only in names: names are replaced by
        their order of first appearance; sizes, dtypes, roles, kinds, attributes, the batch
        dim, the wiring, whether each output is read inside the ops and outside them (a layer
        whose output leaves the graph is priced unlike one that hands it to the next) and kept for
        the backward, the optimizer (it sets parameter memory) and the GEMM precision all count
        (two identical transformer blocks hash alike). Memoized: a graph is not changed once built.
        """
        ops = None if ops is None else list(ops)
        key = ("hash", _sizes(self.dims), None if ops is None else tuple(op.name for op in ops))
        if key not in self._memo:
            self._memo[key] = self._structural_hash(self.order if ops is None else ops)
        return self._memo[key]

    def _structural_hash(self, ops: list[Op]) -> str:
        tensor_ids: dict[str, int] = {}
        dim_ids: dict[str, int] = {}

        def dim(d: str) -> tuple:
            dim_ids.setdefault(d, len(dim_ids))
            return (dim_ids[d], self.dims[d], d == self.batch_dim)

        def tensor(name: str) -> tuple:
            if name not in tensor_ids:
                tensor_ids[name] = len(tensor_ids)
            t = self.tensors[name]
            return (tensor_ids[name], tuple(dim(d) for d in t.dims), t.role, self.dtype_of(name))

        def attr(value: Any) -> Any:
            if isinstance(value, str):
                return ("dim", dim(value)) if value in self.dims else value
            if isinstance(value, Mapping):
                return tuple(sorted((str(attr(k)), attr(v)) for k, v in value.items()))
            if isinstance(value, (list, tuple)):
                return tuple(attr(v) for v in value)
            return value

        inside = {op.name for op in ops}

        def readers(op: Op) -> tuple[bool, bool, bool]:
            """Read inside the ops, outside them (the ILP pairs or completes an output by where it goes,
            `intra.build`), and kept for the backward (its memory)."""
            names = [c.name for c in self.consumers[op.output]]
            return (any(n in inside for n in names), any(n not in inside for n in names),
                    op.output in self.saved_for_backward)

        parts = [(op.kind, tuple(tensor(t) for t in op.inputs), tensor(op.output), readers(op), attr(dict(op.attrs)))
                 for op in ops]
        return hashlib.sha256(repr((self.optimizer, self.matmul_dtype, parts)).encode()).hexdigest()[:16]

    def subgraph_ops(self, layers: Sequence[int | None]) -> list[Op]:
        """Ops whose layer tag is in `layers`, in topological order."""
        wanted = set(layers)
        return [op for op in self.order if op.layer in wanted]


def _sizes(dims: Mapping[str, int]) -> tuple:
    """Dim sizes as a key, whatever the dict's order."""
    return tuple(sorted(dims.items()))


# ---------------------------------------------------------------- validation

def _dependency_graph(graph: Graph) -> nx.DiGraph:
    dag = nx.DiGraph()
    dag.add_nodes_from(op.name for op in graph.ops)
    producers = {op.output: op.name for op in graph.ops}
    for op in graph.ops:
        for t in op.inputs:
            if t in producers:
                dag.add_edge(producers[t], op.name)
    return dag


def _fail(where: str, cause: str, hint: str | None = None) -> None:
    raise InstanceError(cause, where, hint)


def _check_dims(g: Graph) -> None:
    """Every dim's size a positive integer of at most MAX_DIM."""
    for name, size in g.dims.items():
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            _fail(f"dims.{name}", f"size must be a positive integer, got {size!r}", "give every dim a size of at least 1")
        if size > MAX_DIM:
            _fail(f"dims.{name}", f"size must be at most 2^53 = {MAX_DIM}, got {short(size)}",
                  "no model's dim comes near: check the size")


def _check_elements(g: Graph, name: str) -> None:
    """Tensor `name` of at most MAX_ELEMENTS elements (dims each within MAX_DIM can still multiply past it)."""
    if g.numel(name) > MAX_ELEMENTS:
        sizes = " × ".join(f"{d} = {g.dims[d]}" for d in g.tensors[name].dims)
        _fail(f"tensors.{name}", f"{sizes} is more than 2^63 - 1 elements",
              "a tensor's element count must fit in int64: check its dims' sizes")


def _check_work(g: Graph, i: int, op: Op) -> None:
    """Op `i` of at most MAX_OP_FLOPS forward FLOPs (an opaque op's `flops`; the product of many operands' dims)."""
    if opkinds.forward_flops(op, g) > MAX_OP_FLOPS:
        _fail(f"ops[{i}] ({op.name})", f"{op.kind}: more than 10^30 forward FLOPs over the batch",
              "no model's op comes near: check its dims' sizes (an opaque op: its attrs.flops)")


def _check_attrs(i: int, op: Op) -> None:
    """Op `i` carries only attributes its kind reads (`ops.KIND_ATTRS`): another one, meant for another kind, would be
    ignored."""
    known = opkinds.KIND_ATTRS[op.kind]
    for name in op.attrs:
        if name not in known:
            reads = f"reads only {', '.join(known)}" if known else "reads no attribute"
            _fail(f"ops[{i}].attrs.{name} ({op.name})", f"{op.kind} does not read attribute {name!r}",
                  f"{op.kind} {reads}: remove {name!r}, or give the op the kind it is meant for")


def _check_shape(g: Graph, i: int, op: Op) -> None:
    """The tensor rules of op `i`'s kind (`ops.check`), at the graph's sizes."""
    try:
        opkinds.check(op, g)
    except opkinds.OpShapeError as err:
        _fail(f"ops[{i}] ({op.name})", f"{op.kind}: {err}", f"see the tensor rules of kind {op.kind!r} in docs/FORMAT.md")


def _validate_sizes(g: Graph) -> None:
    """The rules of `_validate` that read dims' sizes, for a graph whose structure is known valid (`Graph.resized`)."""
    _check_dims(g)
    for name in g.tensors:
        _check_elements(g, name)
    for i, op in enumerate(g.ops):
        _check_shape(g, i, op)
        _check_work(g, i, op)


def _validate(g: Graph) -> None:
    """Check every rule of DESIGN §2; raise InstanceError at the first broken one."""
    if g.dtype not in DTYPE_BYTES:
        _fail("dtype", f"unknown dtype {g.dtype!r}", f"use one of {sorted(DTYPE_BYTES)}")
    if g.matmul_dtype is not None and g.matmul_dtype not in MATMUL_DTYPES:
        _fail("matmul_dtype", f"unknown GEMM precision {g.matmul_dtype!r}", f"use one of {list(MATMUL_DTYPES)} or omit it")
    if g.optimizer not in OPTIMIZERS:
        _fail("optimizer", f"unknown optimizer {g.optimizer!r}", f"use one of {list(OPTIMIZERS)}")
    _check_dims(g)
    if g.batch_dim is not None and g.batch_dim not in g.dims:
        _fail("batch_dim", f"batch dim {g.batch_dim!r} is not declared in dims", "declare it in `dims` with its size")

    for name, t in g.tensors.items():
        where = f"tensors.{name}"
        if t.name != name:
            _fail(where, f"tensor is registered under another name {t.name!r}")
        for d in t.dims:
            if d not in g.dims:
                _fail(where, f"unknown dim {d!r}", "declare it in `dims` with its size")
        if len(set(t.dims)) != len(t.dims):
            _fail(where, f"dim repeated in {list(t.dims)}", "two axes of one tensor need two dim names")
        _check_elements(g, name)
        if t.role not in ROLES:
            _fail(where, f"unknown role {t.role!r}", f"use one of {list(ROLES)}")
        if t.dtype is not None and t.dtype not in DTYPE_BYTES:
            _fail(where, f"unknown dtype {t.dtype!r}", f"use one of {sorted(DTYPE_BYTES)}")

    if not g.ops:
        _fail("ops", "the graph has no ops", "add at least one op")
    produced_by: dict[str, str] = {}
    seen_ops: set[str] = set()
    for i, op in enumerate(g.ops):
        where = f"ops[{i}] ({op.name})"
        if op.name in seen_ops:
            _fail(where, f"op name {op.name!r} is used twice", "give every op a unique name")
        seen_ops.add(op.name)
        if op.kind not in opkinds.KINDS:
            _fail(where, f"unknown kind {op.kind!r}", f"use one of {list(opkinds.KINDS)}")
        for t in (*op.inputs, op.output):
            if t not in g.tensors:
                _fail(where, f"tensor {t!r} is not declared", "declare it under `tensors`")
        out = g.tensors[op.output]
        if out.role in ("input", "param"):
            _fail(where, f"writes {op.output!r}, whose role is {out.role!r}", "inputs and params are never produced by an op")
        if op.output in produced_by:
            _fail(where, f"tensor {op.output!r} is produced twice (also by {produced_by[op.output]!r})",
                  "every tensor is written by exactly one op: give one of them a new output tensor")
        if op.output in op.inputs:
            _fail(where, f"op reads its own output {op.output!r}", "write the result to a new tensor")
        produced_by[op.output] = op.name
        _check_attrs(i, op)
        _check_shape(g, i, op)
        _check_work(g, i, op)

    read = {t for op in g.ops for t in op.inputs}
    for name, t in g.tensors.items():
        if t.role in ("activation", "output") and name not in produced_by:
            _fail(f"tensors.{name}", f"{t.role} tensor is produced by no op", "produce it with an op, or give it role 'input'")
        if t.role == "param" and name not in read:
            _fail(f"tensors.{name}", "parameter is read by no op: no plan would place it, and its memory would be "
                  "left out", "remove it, or read it in the op that uses it")
    if g.batch_dim is not None and not any(g.batch_dim in t.dims for t in g.tensors.values() if t.role == "input"):
        _fail("batch_dim", f"batch dim {g.batch_dim!r} is on no input tensor, so no microbatch would split the data",
              "name the dim the inputs carry samples along, or omit batch_dim")
    for name, t in g.tensors.items():
        if t.role == "param" and g.batch_dim in t.dims:
            _fail(f"tensors.{name}", f"parameter carries the batch dim {g.batch_dim!r}: each microbatch would hold a "
                  "slice of it, and its memory would be under-counted", f"a weight is shared by every sample: drop "
                  f"{g.batch_dim!r} from its dims (or give it role 'input' if it is data)")

    dag = _dependency_graph(g)
    if not nx.is_directed_acyclic_graph(dag):
        cycle = [edge[0] for edge in nx.find_cycle(dag)]
        _fail(f"ops ({' -> '.join(cycle)})", "the ops form a cycle", "a graph must be acyclic")
    _check_layer_order(g)


def _check_layer_order(g: Graph) -> None:
    """Layers follow the data flow: an op reads only what its own layer or an earlier one writes. Layers run in
    `Graph.layers`' order, and a pipeline's stages send data forward only, so a layer reading a later one has no
    schedule."""
    rank = {tag: k for k, tag in enumerate(g.layers)}
    for i, op in enumerate(g.ops):
        for t in op.inputs:
            producer = g.producers.get(t)
            if producer is not None and rank[producer.layer] > rank[op.layer]:
                _fail(f"ops[{i}] ({op.name})", f"layer {_tag(op.layer)} reads {t!r} from {producer.name!r} of layer "
                      f"{_tag(producer.layer)}, which runs after it (layers run in the order of their first ops)",
                      f"tag the ops so that each layer reads only its own and earlier layers' tensors (e.g. give "
                      f"{op.name!r} {'no layer tag' if producer.layer is None else f'layer {producer.layer}'})")


def _tag(layer: int | None) -> str:
    """A layer tag as errors name it ("untagged": the untagged ops form one layer)."""
    return "untagged" if layer is None else str(layer)
