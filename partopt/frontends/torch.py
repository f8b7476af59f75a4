"""PyTorch frontend: an `nn.Module` becomes a partopt Graph through `torch.export` (meta device).

Every axis of a traced tensor is a sequence of *atoms*: sizes that views split and merge without
moving data. Ops unify atoms (a linear's contraction, a broadcast, attention's heads), and the
atoms left at the end are the graph's named dims, so views, transposes, expands and casts need no
op (DESIGN §2). An axis of size 1 has no atom. Single-input elementwise chains are kept *pending*
and become one op when a real op reads them (a rotary embedding, an activation), and a chain that
divides its input by a statistic over the last axis is an RMSNorm. Values computed from neither a
parameter nor a model input (masks, rotary tables, position ids) are constants: no ops.
torch is imported lazily; see docs/FRONTENDS.md for what maps to what.
"""

from __future__ import annotations

import difflib
import json
import math
import operator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from networkx.utils import UnionFind

from partopt.errors import InstanceError, PartoptError, first_line
from partopt.io import at, json_path
from partopt.graph import Graph, Op, Tensor
from partopt.models.builder import require_choice
from partopt.models.gpt import llama_architecture
from partopt.models.transformer import ATTENTION_KERNELS
from partopt.ops import stride_attr

TORCH_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "int64", "int32": "int32",
                "int8": "int8", "bool": "bool"}
# ATen ops that only relabel axes or cast (the IR has no op for them)
_IDENTITY = {"contiguous", "clone", "alias", "detach", "to", "_to_copy", "dropout", "lift_fresh_copy", "type_as",
             "feature_dropout"}
_RESHAPES = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "view_as"}
_PERMUTES = {"transpose", "permute", "t", "swapaxes"}
_ELEMENTWISE = {"add", "sub", "mul", "div", "pow", "silu", "gelu", "relu", "tanh", "sigmoid", "exp", "log", "neg",
                "rsqrt", "sqrt", "abs", "reciprocal", "sin", "cos", "erf", "maximum", "minimum", "where",
                "masked_fill", "softplus", "leaky_relu", "square", "clamp", "hardtanh", "mish", "rsub"}
_NO_OUTPUT = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"}
# a router and its experts map whole or fail: as opaque ops their experts' FLOPs would go unpriced
_ROUTING = {"topk", "experts"}
# the sizes a Hugging Face config gives under transformers' common names (gpt2's n_embd is hidden_size)
HF_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "max_position_embeddings")


class FrontendError(PartoptError):
    """A program the frontend cannot map; the cause names the ATen op and the module path."""


# ---------------------------------------------------------------- atoms

class _Atoms:
    """Union-find over axis sizes; a root may be split into ordered parts (the major part first)."""

    def __init__(self) -> None:
        self.classes = UnionFind()
        self.size: list[int] = []
        self.parts: dict[int, tuple[int, int]] = {}

    def new(self, size: int) -> int:
        self.size.append(size)
        return len(self.size) - 1

    def find(self, a: int) -> int:
        return self.classes[a]

    def expand(self, a: int) -> list[int]:
        """The unsplit atoms `a` stands for now, major first."""
        r = self.find(a)
        parts = self.parts.get(r)
        return [r] if parts is None else [x for p in parts for x in self.expand(p)]

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        pa, pb = self.parts.pop(ra, None), self.parts.pop(rb, None)
        self.classes.union(ra, rb)
        root = self.find(ra)
        if pa is not None:
            self.parts[root] = pa
        if pb is not None:
            if pa is None:
                self.parts[root] = pb
            else:
                self.unify(list(pa), list(pb))

    def unify(self, xs: Sequence[int], ys: Sequence[int]) -> bool:
        """Make two atom sequences of equal product the same, splitting atoms at each other's
        boundaries; False when they do not line up (every caller then raises a FrontendError)."""
        if math.prod(self.size[self.find(a)] for a in xs) != math.prod(self.size[self.find(a)] for a in ys):
            return False
        xs, ys = list(xs), list(ys)
        while xs and ys:
            x, y = xs[0], ys[0]
            if self.find(x) in self.parts:
                xs[0:1] = self.expand(x)
                continue
            if self.find(y) in self.parts:
                ys[0:1] = self.expand(y)
                continue
            sx, sy = self.size[self.find(x)], self.size[self.find(y)]
            if sx == sy:
                self.union(x, y)
                xs.pop(0)
                ys.pop(0)
            elif sx % sy == 0:
                self._split(x, sy)
            elif sy % sx == 0:
                self._split(y, sx)
            else:
                return False
        return True

    def _split(self, a: int, major: int) -> None:
        r = self.find(a)
        self.parts[r] = (self.new(major), self.new(self.size[r] // major))


Axis = tuple[tuple[int, bool], ...]  # (atom, virtual): a virtual atom is broadcast (expand), not stored


@dataclass
class _Val:
    """What one traced value is: a constant, a real IR tensor, a pending chain over one, or a tuple."""

    kind: str  # "const", "real", "pending", "tuple", "route" (a router's top-k: items = routing weights, mask)
    shape: tuple[int, ...] = ()
    axes: list[Axis] = field(default_factory=list)
    tensor: str | None = None  # real: its IR tensor
    origin: "_Val | None" = None  # pending: the real value it is a function of
    steps: tuple[str, ...] = ()  # pending: the ATen ops applied since
    stat: bool = False  # pending: reduced over the origin's last axis (a norm statistic)
    norm: bool = False  # pending: the origin divided by such a statistic
    items: list["_Val"] = field(default_factory=list)  # tuple
    module: str | None = None  # pending: the module of its last step (the op it becomes is named there)
    reduced_at: int = 0  # pending statistic: the index of its reduction in `steps`


@dataclass
class _RawOp:
    name: str
    kind: str
    inputs: tuple[str, ...]
    output: str
    module: str  # the nn_module_stack path it came from
    attrs: dict[str, Any]


class _AtomRef(tuple):
    """Atoms inside an op attribute, turned into dim names when the graph is built."""


# ---------------------------------------------------------------- the walk

class _Importer:
    """Walks an ExportedProgram's graph once, building tensors and ops over atoms."""

    def __init__(self, module: Any, program: Any, dtype: str | None, opaque: bool, attention_kernel: str,
                 causal_mask: bool):
        self.module = module
        self.program = program
        self.opaque = opaque
        self.attention_kernel = attention_kernel  # what scaled_dot_product_attention becomes
        self.causal_mask = causal_mask  # a mask given to it is the causal one
        self.atoms = _Atoms()
        self.vals: dict[str, _Val] = {}
        self.tensors: dict[str, tuple[list[Axis], str, str | None]] = {}  # name -> (axes, role, dtype)
        self.ops: list[_RawOp] = []
        self.names: set[str] = set()
        self.node: Any = None
        self.module_path = ""
        self.batch_atom: int | None = None
        self.seq_atom: int | None = None
        self.dtype = dtype
        self.user_inputs: list[str] = []
        self.replaced: set[str] = set()  # fused parameters that their chunks stand for
        self.hints: dict[int, str] = {}  # atom -> the generators' name for it (experts e, capacity c)

    # ------------------------------------------------------------ errors and places
    def where(self) -> str:
        target = _aten_name(self.node.target) if self.node is not None else "?"
        return f"aten.{target} in module {self.module_path or '(top level)'} (node {self.node.name})"

    def fail(self, cause: str, hint: str) -> FrontendError:
        return FrontendError(cause, self.where(), hint)

    # ------------------------------------------------------------ building
    def axes_of(self, shape: Sequence[int]) -> list[Axis]:
        return [() if n == 1 else ((self.atoms.new(int(n)), False),) for n in shape]

    def expand_axis(self, axis: Axis) -> list[tuple[int, bool]]:
        return [(p, v) for a, v in axis for p in self.atoms.expand(a)]

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            k += 1
            name = f"{base}_{k}"
        self.names.add(name)
        return name

    def tensor(self, name: str, axes: list[Axis], role: str, dtype: str | None = None) -> str:
        self.names.add(name)
        self.tensors[name] = (axes, role, dtype)
        return name

    def emit(self, kind: str, inputs: Sequence[_Val], out_axes: list[Axis], shape: Sequence[int], step: str,
             **attrs: Any) -> _Val:
        """A new IR op over the real `inputs`; returns its output value."""
        base = f"{self.module_path}.{step}" if self.module_path else step
        name = self.unique(base)
        self.tensor(name, out_axes, "activation")
        tensors = tuple(dict.fromkeys(v.tensor for v in inputs))
        self.ops.append(_RawOp(name, kind, tensors, name, self.module_path, attrs))  # type: ignore[arg-type]
        return _Val("real", tuple(shape), out_axes, tensor=name)

    def real(self, v: _Val) -> _Val:
        """`v` as a real IR tensor: a pending chain becomes one op here."""
        if v.kind == "real":
            return v
        if v.kind == "pending":
            return self.materialize(v, None)
        raise self.fail(f"a {v.kind} value reaches an op that needs a tensor computed from the model's inputs",
                        "partopt maps ops whose data come from parameters and model inputs; a constant table "
                        "here is not supported yet")

    def materialize(self, v: _Val, scale: _Val | None) -> _Val:
        origin = v.origin
        assert origin is not None
        mine = {a for axis in v.axes for a, virt in self.expand_axis(axis) if not virt}
        theirs = {a for axis in origin.axes for a, virt in self.expand_axis(axis) if not virt}
        if v.stat:
            return self.statistic(v)
        if {self.atoms.find(a) for a in mine} != {self.atoms.find(a) for a in theirs}:
            raise self.fail(f"the elementwise chain {'/'.join(v.steps)} changes the shape of its input",
                            "partopt maps elementwise chains that keep their input's shape (rotary, activations, "
                            "norms); rewrite the computation or report the pattern")
        saved = self.module_path
        if v.module is not None and scale is None:
            self.module_path = v.module
        if v.norm:
            last = _AtomRef(a for a, virt in self.expand_axis(origin.axes[-1]) if not virt)
            kind = "layernorm" if "sub" in v.steps else "rmsnorm"
            inputs = [origin] + ([scale] if scale is not None else [])
            result = self.emit(kind, inputs, v.axes, v.shape, kind, axes=last)
        else:
            fn = "+".join(dict.fromkeys(v.steps))
            result = self.emit("elementwise", [origin], v.axes, v.shape, v.steps[-1], fn=fn)
        self.module_path = saved
        return result

    def statistic(self, v: _Val) -> _Val:
        """A pending reduction over the last axis read by a real op: (elementwise), reduce, (elementwise)."""
        origin = v.origin
        assert origin is not None
        pre, fn, post = v.steps[:v.reduced_at], v.steps[v.reduced_at], v.steps[v.reduced_at + 1:]
        x = origin
        if pre:
            x = self.emit("elementwise", [origin], origin.axes, origin.shape, pre[-1], fn="+".join(dict.fromkeys(pre)))
        out = self.emit("reduce", [x], v.axes, v.shape, fn, fn=fn)
        if post:
            out = self.emit("elementwise", [out], v.axes, v.shape, post[-1], fn="+".join(dict.fromkeys(post)))
        return out

    # ------------------------------------------------------------ the walk
    def run(self) -> None:
        import torch
        from torch.export.graph_signature import InputKind

        sig = self.program.graph_signature
        kinds = {spec.arg.name: spec for spec in sig.input_specs}
        canonical = _canonical_params(self.module)
        for node in self.program.graph.nodes:
            self.node = node
            stack = node.meta.get("nn_module_stack") or {}
            self.module_path = _module_path(stack)
            if node.op == "placeholder":
                spec = kinds[node.name]
                val = node.meta["val"]
                shape = tuple(int(n) for n in val.shape)
                if spec.kind == InputKind.PARAMETER:
                    fqn = canonical.get(spec.target, spec.target)
                    if fqn in self.tensors:  # a tied parameter: one tensor under its first name
                        self.vals[node.name] = _Val("real", shape, self.tensors[fqn][0], tensor=fqn)
                        continue
                    if self.dtype is None:
                        self.dtype = TORCH_DTYPES.get(str(val.dtype).removeprefix("torch."), "fp32")
                    axes = self.axes_of(shape)
                    self.vals[node.name] = _Val("real", shape, axes, tensor=self.tensor(fqn, axes, "param"))
                elif spec.kind == InputKind.USER_INPUT and isinstance(val, torch.Tensor):
                    axes = self.axes_of(shape)
                    dtype = TORCH_DTYPES.get(str(val.dtype).removeprefix("torch."))
                    self.vals[node.name] = _Val("real", shape, axes, tensor=self.tensor(node.name, axes, "input", dtype))
                    self.user_inputs.append(node.name)
                    if self.batch_atom is None:
                        if not axes or not axes[0]:
                            raise FrontendError(f"model input {node.name!r} has a batch of size 1", "example_inputs",
                                                "give example inputs a batch of at least 2 (meta tensors cost nothing)")
                        self.batch_atom = axes[0][0][0]
                        if len(axes) == 2 and axes[1]:  # token ids [b, s]
                            self.seq_atom = axes[1][0][0]
                else:
                    self.vals[node.name] = _Val("const", shape)
            elif node.op == "call_function":
                try:
                    self.call(node)
                except PartoptError:
                    raise
                except Exception as err:  # an argument form this mapping does not cover: say where
                    raise self.fail(f"cannot map it: {type(err).__name__}: {err}",
                                    "report the model; the mapping of this op does not cover these arguments") from None
            elif node.op == "output":
                pass
            else:
                raise self.fail(f"unexpected FX node kind {node.op!r}", "report this program")

    def arg(self, a: Any) -> Any:
        import torch.fx

        if isinstance(a, torch.fx.Node):
            return self.vals[a.name]
        if isinstance(a, (list, tuple)):
            return [self.arg(x) for x in a]
        return a

    def call(self, node: Any) -> None:
        name = _aten_name(node.target)
        args = [self.arg(a) for a in node.args]
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        if name in _NO_OUTPUT:
            return
        flat = [v for v in _flatten([*args, *kwargs.values()]) if isinstance(v, _Val)]
        val = node.meta.get("val")
        if name == "getitem":
            src, index = args
            self.vals[node.name] = src.items[index] if src.kind == "tuple" else _Val("const")
            return
        if all(v.kind == "const" for v in flat):
            self.vals[node.name] = _Val("const", _shape(val))
            return
        routes = [v for v in flat if v.kind == "route"]
        if routes and name != "experts":  # arithmetic on the top-k weights and indices folds into the routing ops
            if any(v.kind != "route" for v in flat):
                raise self.fail("a router's top-k output meets an activation outside an experts module",
                                "partopt maps routers whose top-k feeds experts stored as 3-D gate_up_proj/down_proj "
                                "(transformers >= 5)")
            self.vals[node.name] = routes[0]
            return
        handler = getattr(self, f"op_{name}", None)
        if handler is not None:
            try:
                result = handler(node, args, kwargs)
            except FrontendError:  # a form of a mapped op that the mapping does not cover
                if not self.opaque or name in _ROUTING:
                    raise
                result = self.opaque_op(node, name, flat)
        elif name in _IDENTITY:
            result = args[0]
        elif name in _RESHAPES:
            result = self.reshape(args[0], _shape(val))
        elif name in _PERMUTES:
            result = self.permute(node, args)
        elif name in _ELEMENTWISE:
            result = self.elementwise(name, args, kwargs, _shape(val))
        elif self.opaque:
            result = self.opaque_op(node, name, flat)
        else:
            raise self.fail(f"no mapping for aten.{name}",
                            "import with --opaque (opaque=True) to keep it as an unsharded opaque op, or rewrite "
                            "that part of the model with mapped ops (docs/FRONTENDS.md lists them)")
        self.vals[node.name] = result

    def opaque_op(self, node: Any, name: str, flat: list[_Val]) -> _Val:
        """An unmapped ATen op kept whole: an `opaque` op per tensor result over the tensors it reads, with
        new dims (never sharded), priced by FlopCounterMode's count of the op when it counts any,
        else one FLOP per output element (the first result carries the FLOPs)."""
        inputs = [self.real(v) for v in flat if v.kind in ("real", "pending")]
        val = node.meta.get("val")
        results = list(val) if isinstance(val, (list, tuple)) else [val]
        flops = _counted_flops(node)
        vals = []
        for k, out in enumerate(results):
            shape = _shape(out)
            if not hasattr(out, "shape"):
                vals.append(_Val("const"))
                continue
            v = self.emit("opaque", inputs, self.axes_of(shape), shape, name, primitive=f"aten.{name}",
                          flops=0 if k else (math.prod(shape) if flops is None else flops))
            dtype = TORCH_DTYPES.get(str(out.dtype).removeprefix("torch."))
            if dtype not in ("fp32", "fp16", "bf16"):  # floating results take the graph's dtype
                self.tensors[v.tensor] = (self.tensors[v.tensor][0], "activation", dtype)
            vals.append(v)
        return vals[0] if len(vals) == 1 and not isinstance(val, (list, tuple)) else _Val("tuple", items=vals)

    # ------------------------------------------------------------ relabelling ops
    def reshape(self, v: _Val, shape: tuple[int, ...]) -> _Val:
        if v.kind == "const":
            return _Val("const", shape)
        flat = [e for axis in v.axes for e in self.expand_axis(axis)]
        axes: list[Axis] = []
        for n in shape:
            taken: list[tuple[int, bool]] = []
            need = n
            while need > 1:
                if not flat:
                    raise self.fail(f"cannot follow the view from {list(v.shape)} to {list(shape)}", "report the model")
                atom, virt = flat[0]
                size = self.atoms.size[self.atoms.find(atom)]
                if size <= need and need % size == 0:
                    taken.append(flat.pop(0))
                    need //= size
                elif size % need == 0:
                    self.atoms._split(atom, need)
                    flat[0:1] = [(p, virt) for p in self.atoms.expand(atom)]
                else:
                    raise self.fail(f"the view from {list(v.shape)} to {list(shape)} splits an axis unevenly",
                                    "partopt follows views that split or merge whole factors")
            axes.append(tuple(taken))
        return replace(v, shape=shape, axes=axes)

    def permute(self, node: Any, args: list[Any]) -> _Val:
        v = args[0]
        nd = len(v.shape)
        name = _aten_name(node.target)
        order = list(range(nd))
        if name == "permute":
            order = [d % nd for d in args[1]]
        elif name in ("transpose", "swapaxes"):
            i, j = args[1] % nd, args[2] % nd
            order[i], order[j] = order[j], order[i]
        elif nd == 2:  # t
            order = [1, 0]
        if v.kind == "const":
            return _Val("const", tuple(v.shape[i] for i in order))
        return replace(v, shape=tuple(v.shape[i] for i in order), axes=[v.axes[i] for i in order])

    def op_expand(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        v, shape = args[0], _shape(node.meta["val"])
        lead = len(shape) - len(v.shape)
        axes: list[Axis] = []
        for i, n in enumerate(shape):
            j = i - lead
            if j >= 0 and (v.shape[j] == n or n == 1):
                axes.append(v.axes[j])
            else:
                axes.append(((self.atoms.new(n), True),) if n > 1 else ())
        return replace(v, shape=shape, axes=axes)

    # ------------------------------------------------------------ elementwise
    def broadcast(self, vals: Sequence[_Val], shape: tuple[int, ...]) -> list[Axis]:
        """Unify the axes that broadcasting lines up; the output's axes (stored atoms preferred)."""
        axes: list[Axis] = []
        for i in range(1, len(shape) + 1):
            present = [v.axes[-i] for v in vals if len(v.shape) >= i and v.shape[-i] == shape[-i] and shape[-i] > 1]
            for other in present[1:]:
                if not self.atoms.unify([a for a, _ in present[0]], [a for a, _ in other]):
                    raise self.fail("broadcast axes do not line up", "report the model")
            stored = [axis for axis in present if not any(virt for _, virt in axis)]
            axes.insert(0, (stored or present or [()])[0])
        return axes

    def elementwise(self, name: str, args: list[Any], kwargs: dict, shape: tuple[int, ...]) -> _Val:
        tensors = [v for v in _flatten(args) if isinstance(v, _Val) and v.kind != "const"]
        axes = self.broadcast(tensors, shape)
        origins = {_origin(v).tensor for v in tensors}  # one IR tensor, whatever views of it the chain took
        if len(origins) == 1:
            v = tensors[0]
            origin = _origin(v)
            stat = any(t.stat for t in tensors) and not any(t.kind == "real" or not t.stat for t in tensors)
            norm = any(t.norm for t in tensors) or (any(t.stat for t in tensors) and not stat)
            steps = tuple(s for t in tensors for s in t.steps) + (name,)
            reduced_at = next((t.reduced_at for t in tensors if t.stat), 0)
            return _Val("pending", shape, axes, origin=origin, steps=steps, stat=stat, norm=norm,
                        module=self.module_path, reduced_at=reduced_at)
        if name == "mul" and len(tensors) == 2:
            norm = [t for t in tensors if t.kind == "pending" and t.norm]
            scale = [t for t in tensors if t.kind == "real" and self.tensors[t.tensor][1] == "param"]
            if norm and scale:
                return self.materialize(norm[0], scale[0])
        inputs = [self.real(t) for t in tensors]
        return self.emit("elementwise", inputs, axes, shape, name, fn=name)

    def op_mean(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        return self.reduction("mean", node, args, kwargs)

    def op_sum(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        return self.reduction("sum", node, args, kwargs)

    def reduction(self, fn: str, node: Any, args: list[Any], kwargs: dict) -> _Val:
        v = args[0]
        nd = len(v.shape)
        dims = args[1] if len(args) > 1 and args[1] is not None else list(range(nd))
        dims = sorted({d % nd for d in ([dims] if isinstance(dims, int) else dims)})
        keep = bool(args[2]) if len(args) > 2 else bool(kwargs.get("keepdim", False))
        shape = _shape(node.meta["val"])
        if keep and dims == [nd - 1]:  # a statistic over the last axis: part of a norm, kept pending
            return _Val("pending", shape, [*v.axes[:-1], ()], origin=_origin(v), steps=v.steps + (fn,), stat=True,
                        reduced_at=len(v.steps), module=self.module_path)
        real = self.real(v)
        axes = [axis for i, axis in enumerate(real.axes) if i not in dims] if not keep else \
            [() if i in dims else axis for i, axis in enumerate(real.axes)]
        return self.emit("reduce", [real], axes, shape, fn, fn=fn)

    def op_slice(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        v = args[0]
        shape = _shape(node.meta["val"])
        if v.kind == "pending" or (v.kind == "real" and shape != v.shape):
            if v.kind == "real" and shape == v.shape:
                return v
            axes = [axis if a == b else self.axes_of([b])[0] for axis, a, b in zip(v.axes, v.shape, shape)]
            return _Val("pending", shape, axes, origin=_origin(v), steps=v.steps + ("slice",), stat=v.stat, norm=v.norm)
        return v

    def op_cat(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        parts = [v for v in args[0] if v.kind != "const"]
        shape = _shape(node.meta["val"])
        if len({_origin(v).tensor for v in parts}) == 1:
            dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(shape)
            axes = [self.axes_of([n])[0] if i == dim else parts[0].axes[i] for i, n in enumerate(shape)]
            steps = tuple(s for v in parts for s in v.steps) + ("cat",)
            return _Val("pending", shape, axes, origin=_origin(parts[0]), steps=steps)
        raise self.fail("concatenation of different tensors has no mapping yet",
                        "partopt maps cat only inside one elementwise chain (rotate_half); report the model")

    # ------------------------------------------------------------ matmuls
    def contract(self, xs: Axis, ys: Axis) -> None:
        if not self.atoms.unify([a for a, _ in xs], [a for a, _ in ys]):
            raise self.fail("the contracted axes of a matmul differ in size", "report the model")

    def einsum_op(self, inputs: Sequence[_Val], axes: list[Axis], shape: tuple[int, ...], step: str) -> _Val:
        return self.emit("einsum", [self.real(v) for v in inputs], axes, shape, step)

    def op_linear(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        self.contract(x.axes[-1], w.axes[1])
        shape = _shape(node.meta["val"])
        out = self.einsum_op([x, w], [*x.axes[:-1], w.axes[0]], shape, "linear")
        if isinstance(bias, _Val) and bias.kind != "const":
            self.contract(bias.axes[0], w.axes[0])
            out = self.emit("elementwise", [out, self.real(bias)], out.axes, shape, "add_bias", fn="add")
        return out

    def op_addmm(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        bias, x, w = args[0], args[1], args[2]
        self.contract(x.axes[-1], w.axes[0])
        shape = _shape(node.meta["val"])
        out = self.einsum_op([x, w], [x.axes[0], w.axes[1]], shape, "addmm")
        self.broadcast([out, bias], shape)
        return self.emit("elementwise", [out, self.real(bias)], out.axes, shape, "add_bias", fn="add")

    def op_mm(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        a, b = args[0], args[1]
        self.contract(a.axes[1], b.axes[0])
        return self.einsum_op([a, b], [a.axes[0], b.axes[1]], _shape(node.meta["val"]), "mm")

    def op_bmm(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        return self.op_matmul(node, args, kwargs)

    def op_matmul(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        a, b = args[0], args[1]
        if len(a.shape) < 2 or len(b.shape) < 2:
            raise self.fail("matmul with a vector operand has no mapping yet", "use a 2-D operand")
        shape = _shape(node.meta["val"])
        self.contract(a.axes[-1], b.axes[-2])
        batch = self.broadcast([_Val("real", a.shape[:-2], a.axes[:-2]), _Val("real", b.shape[:-2], b.axes[:-2])],
                               shape[:-2])
        return self.einsum_op([a, b], [*batch, a.axes[-2], b.axes[-1]], shape, "matmul")

    def op_embedding(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        table, ids = args[0], args[1]
        big = [i for i, n in enumerate(ids.shape) if n > 1]
        if ids.kind == "const" and table.kind == "real" and len(big) == 1 and ids.shape[big[0]] == table.shape[0]:
            # positions 0..n-1 of an n-row table (GPT-2's wpe at seq = n_positions): the table itself, as
            # partopt's generators add it; its gradient then reaches the parameter once per iteration
            axes = [table.axes[0] if i == big[0] else () for i in range(len(ids.shape))]
            return _Val("real", _shape(node.meta["val"]), [*axes, table.axes[1]], tensor=table.tensor)
        if ids.kind == "const":  # other constant indices become a model input
            axes = self.axes_of(ids.shape)
            ids = _Val("real", ids.shape, axes, tensor=self.tensor(self.unique(node.name + "_ids"), axes, "input", "int64"))
        shape = _shape(node.meta["val"])
        return self.emit("embedding", [ids, self.real(table)], [*ids.axes, table.axes[1]], shape, "embedding")

    def op_layer_norm(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        x = self.real(args[0])
        normalized = len(args[1])
        params = [p for p in args[2:4] if isinstance(p, _Val) and p.kind != "const"]
        for p in params:
            self.contract(_join(x.axes[-normalized:]), _join(p.axes))
        last = _AtomRef(a for axis in x.axes[-normalized:] for a, virt in self.expand_axis(axis) if not virt)
        return self.emit("layernorm", [x, *map(self.real, params)], x.axes, x.shape, "layer_norm", axes=last)

    def op_rms_norm(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        x = self.real(args[0])
        weight = args[2] if len(args) > 2 else kwargs.get("weight")
        params = [weight] if isinstance(weight, _Val) and weight.kind != "const" else []
        last = _AtomRef(a for a, virt in self.expand_axis(x.axes[-1]) if not virt)
        return self.emit("rmsnorm", [x, *map(self.real, params)], x.axes, x.shape, "rms_norm", axes=last)

    def op_softmax(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        x = self.real(args[0])
        dim = args[1] % len(x.shape)
        axes = _AtomRef(a for a, virt in self.expand_axis(x.axes[dim]) if not virt)
        return self.emit("softmax", [x], x.axes, x.shape, "softmax", axes=axes)

    op__softmax = op_softmax

    def op_scaled_dot_product_attention(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        """One fused `attention` op with the flash kernel, causal when the call says `is_causal` or passes a
        mask `causal_mask` vouches for; else the scores einsum, softmax over the key positions and context
        einsum (as partopt's generators build them)."""
        q, k, v = (self.real(x) for x in args[:3])
        nb = len(q.shape) - 3
        for i in range(nb):
            self.contract(q.axes[i], k.axes[i])
            self.contract(q.axes[i], v.axes[i])
        self.contract(k.axes[nb], v.axes[nb])
        self.contract(q.axes[-1], k.axes[-1])
        self.contract(k.axes[-2], v.axes[-2])
        q_heads, k_heads = q.axes[nb], k.axes[nb]
        if q.shape[nb] != k.shape[nb]:  # grouped-query attention: query heads = kv groups x repeats
            ratio = q.shape[nb] // k.shape[nb]
            k_heads = (*k_heads, (self.atoms.new(ratio), True))
        self.contract(q_heads, tuple((a, False) for a, _ in k_heads))
        q_seq = {self.atoms.find(a) for a, _ in self.expand_axis(q.axes[-2])}
        k_seq = {self.atoms.find(a) for a, _ in self.expand_axis(k.axes[-2])}
        if q_seq & k_seq:  # self-attention: key positions need their own dim (t)
            t = ((self.atoms.new(k.shape[-2]), False),)
            old = _AtomRef(a for a, _ in self.expand_axis(k.axes[-2]))
            k, v = (self.emit("reshape", [x], [*x.axes[:-2], t, x.axes[-1]], x.shape, f"{label}_t",
                              merge={_AtomRef(a for a, _ in t): old}) for x, label in ((k, "key"), (v, "value")))
        shape = _shape(node.meta["val"])
        if self.attention_kernel == "flash":
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            causal = bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False)) or \
                (mask is not None and self.causal_mask)
            return self.emit("attention", [q, k, v], [*q.axes[:-1], v.axes[-1]], shape, "attention", causal=causal)
        scores_shape = (*q.shape[:-1], k.shape[-2])
        scores_axes = [*q.axes[:-1], k.axes[-2]]
        scores = self.emit("einsum", [q, k], scores_axes, scores_shape, "scores")
        probs = self.emit("softmax", [scores], scores_axes, scores_shape, "probs",
                          axes=_AtomRef(a for a, _ in self.expand_axis(k.axes[-2])))
        return self.emit("einsum", [probs, v], [*q.axes[:-1], v.axes[-1]], shape, "context")

    # ------------------------------------------------------------ mixture of experts
    def op_topk(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        """A router's top-k over the gates[tokens, e]: GShard's routing ops (partopt.models.moe) over
        groups of one sequence each, g = b and gs = s: the k-th largest gate per token, the routing
        weights over (tokens, e, c) and their nonzero pattern, the dispatch mask."""
        from partopt.frontends.torch_moe import capacity

        gates = self.real(args[0])
        k = args[1]
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", -1)) % len(gates.shape)
        tokens = [a for axis in gates.axes[:-1] for a, virt in self.expand_axis(axis) if not virt]
        if dim != len(gates.shape) - 1 or not tokens or self.batch_atom is None or \
                self.atoms.find(tokens[0]) != self.atoms.find(self.batch_atom):
            raise self.fail("top-k that is not a router's choice over the experts of each token",
                            "partopt maps top-k over the last axis of gates[tokens, experts], tokens = batch x seq")
        group = math.prod(self.atoms.size[self.atoms.find(a)] for a in tokens[1:])
        experts = gates.shape[-1]
        slots = capacity(group, experts, k)
        if slots < 1 or slots * experts != k * group:
            raise self.fail(f"top-{k} routing of {group} tokens per sequence to {experts} experts gives an expert "
                            f"capacity of {k * group / experts:g} tokens", "choose seq so that top_k x seq is a "
                            "multiple of the number of experts")
        c = ((self.atoms.new(slots), False),)
        self.hints[c[0][0]] = "c"
        self.hints[self.expand_axis(gates.axes[-1])[0][0]] = "e"
        kth = self.emit("reduce", [gates], gates.axes[:-1], gates.shape[:-1], f"top{k}", fn=f"top{k}")
        route_axes = [*gates.axes, c]
        route_shape = (*gates.shape, slots)
        weights = self.emit("elementwise", [gates, kth], route_axes, route_shape, "route", fn=f"top{k}_slots")
        mask = self.emit("elementwise", [weights], route_axes, route_shape, "dispatch_mask", fn="nonzero")
        self.tensors[mask.tensor] = (route_axes, "activation", "bool")
        route = _Val("route", _shape(node.meta["val"][0]), items=[weights, mask])
        return _Val("tuple", items=[route, route])

    def op_experts(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        """partopt::experts (torch_moe): dispatch tokens to (e, g, c), the gated experts, combine back."""
        x, _, route, gate_up, down, act = args
        x = self.real(x)
        if route.kind != "route":
            raise self.fail("experts whose routing does not come from a top-k", "report the model")
        weights, mask = route.items
        e_axis, c_axis = weights.axes[-2], weights.axes[-1]
        self.contract(gate_up.axes[0], e_axis)
        self.contract(down.axes[0], e_axis)
        self.contract(gate_up.axes[2], x.axes[-1])
        self.contract(down.axes[1], x.axes[-1])
        chunk, f = self.atoms.new(2), self.atoms.new(gate_up.shape[1] // 2)
        if not self.atoms.unify([a for a, _ in gate_up.axes[1]], [chunk, f]):
            raise self.fail("gate_up_proj's axis 1 is not [gate; up]", "report the model")
        self.contract(down.axes[2], ((f, False),))
        tokens = self.expand_axis(x.axes[0])
        group, f_axis = (tokens[0],), ((f, False),)
        inner = [e_axis, group, c_axis]
        shape = (gate_up.shape[0], self.atoms.size[self.atoms.find(tokens[0][0])], weights.shape[-1])
        hidden = (*shape, x.shape[-1])
        ffn = (*shape, gate_up.shape[1] // 2)
        sent = self.emit("einsum", [mask, x], [*inner, x.axes[-1]], hidden, "dispatch")
        gate = self.emit("einsum", [sent, self.param_chunk(gate_up.tensor, chunk, 0, 2)], [*inner, f_axis], ffn, "gate")
        up = self.emit("einsum", [sent, self.param_chunk(gate_up.tensor, chunk, 1, 2)], [*inner, f_axis], ffn, "up")
        both = self.emit("elementwise", [gate, up], [*inner, f_axis], ffn, act, fn=f"{act}+mul")
        out = self.emit("einsum", [both, down], [*inner, x.axes[-1]], hidden, "down")
        return self.emit("einsum", [weights, out], x.axes, x.shape, "combine")

    def op_conv2d(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        """A 1x1 stride-1 convolution is an einsum over channels (its spatial dims stay shardable), any
        other a `conv2d` with its window, as partopt's Wide-ResNet generator writes them."""
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        stride = _pair(args[3] if len(args) > 3 else kwargs.get("stride", 1))
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        if groups != 1 or len(x.shape) != 4:
            raise self.fail("only 2-D convolutions of 4-D inputs with groups=1 are mapped", "report the model")
        self.contract(x.axes[1], w.axes[1])
        shape = _shape(node.meta["val"])
        if tuple(w.shape[2:]) == (1, 1) and stride == (1, 1):
            out = self.einsum_op([x, w], [x.axes[0], w.axes[0], x.axes[2], x.axes[3]], shape, "conv2d")
        else:
            x = self.windowed(x)
            w = self.windowed(self.real(w))
            axes = [x.axes[0], w.axes[0], *(((self.atoms.new(n), False),) for n in shape[2:])]
            out = self.emit("conv2d", [x, w], axes, shape, "conv2d",
                            stride=stride_attr(stride))
        if isinstance(bias, _Val) and bias.kind != "const":
            self.contract(bias.axes[0], w.axes[0])
            bias_axes = [(), *bias.axes, (), ()]
            out = self.emit("elementwise", [out, self.real(_with(bias, (1, *bias.shape, 1, 1), bias_axes))], out.axes,
                            shape, "add_bias", fn="add")
        return out

    def windowed(self, v: _Val) -> _Val:
        """`v` (real, 4-D) with one atom per axis, as conv2d and pool need: a size-1 axis of a
        parameter (a 1xk kernel) gets its own size-1 dim; an activation's must not have one."""
        v = self.real(v)
        if all(len(axis) == 1 for axis in v.axes):
            return v
        axes_, role, dtype = self.tensors[v.tensor]
        if role != "param" or any(len(axis) > 1 for axis in v.axes):
            raise self.fail(f"a window over a tensor of shape {list(v.shape)} whose axes are not one dim each",
                            "partopt maps convolutions and pooling over [N, C, H, W] with H, W > 1")
        axes = [axis or ((self.atoms.new(1), False),) for axis in v.axes]
        self.tensors[v.tensor] = (axes, role, dtype)
        return replace(v, axes=axes)

    def op_batch_norm(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        """BatchNorm: a `layernorm` over the batch and spatial dims with per-channel scale and shift."""
        x = self.real(args[0])
        params = [p for p in args[1:3] if isinstance(p, _Val) and p.kind != "const"]
        for p in params:
            self.contract(x.axes[1], p.axes[0])
        axes = _AtomRef(a for i, axis in enumerate(x.axes) if i != 1 for a, virt in self.expand_axis(axis) if not virt)
        return self.emit("layernorm", [x, *map(self.real, params)], x.axes, x.shape, "batch_norm", axes=axes)

    def op_max_pool2d(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        return self.pool(node, args[0], _pair(args[1]))

    op_avg_pool2d = op_max_pool2d

    def op_adaptive_avg_pool2d(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        x, out = args[0], _shape(node.meta["val"])
        if x.shape[2] % out[2] or x.shape[3] % out[3]:
            raise self.fail("adaptive pooling to a size that does not divide the input", "pool to a divisor")
        return self.pool(node, x, (x.shape[2] // out[2], x.shape[3] // out[3]))

    def pool(self, node: Any, x: _Val, kernel: tuple[int, int]) -> _Val:
        x = self.windowed(x)
        shape = _shape(node.meta["val"])
        axes = [x.axes[0], x.axes[1], *(((self.atoms.new(n), False),) for n in shape[2:])]
        return self.emit("pool", [x], axes, shape, _aten_name(node.target), kernel=list(kernel))

    def op_split(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        """Equal chunks of one axis. Chunks of a fused projection (GPT-2's c_attn: x·W + b split into
        q, k, v) become one projection per chunk over the parameter's chunk `FQN[i/n]`, as separate
        q, k, v layers are; chunks of anything else are selections (a reduce over the chunk index)."""
        v = self.real(args[0])
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % len(v.shape)
        return self.chunks(node, v, args[1], dim, squeeze=False)

    def op_unbind(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        """`k, v = t` along an axis: chunks of size 1 without that axis (see op_split)."""
        v = self.real(args[0])
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(v.shape)
        return self.chunks(node, v, 1, dim, squeeze=True)

    def chunks(self, node: Any, v: _Val, size: Any, dim: int, squeeze: bool) -> _Val:
        n = v.shape[dim]
        if not isinstance(size, int) or n % size:
            raise self.fail("split into unequal parts has no mapping yet", "split into equal chunks")
        chunk, rest = self.atoms.new(n // size), self.atoms.new(size)
        if not self.atoms.unify([a for a, _ in v.axes[dim]], [chunk, rest]):
            raise self.fail("cannot split this axis into chunks", "report the model")
        axis = ((rest, False),) if size > 1 else ()
        out_axes = [a if j != dim else axis for j, a in enumerate(v.axes) if not (squeeze and j == dim)]
        out_shape = tuple(size if j == dim else s for j, s in enumerate(v.shape) if not (squeeze and j == dim))
        fused = self.fused_projection(node, v, chunk)
        if fused is not None:
            return _Val("tuple", items=[self.projection_chunk(*fused, chunk, i, n // size, out_axes, out_shape)
                                        for i in range(n // size)])
        return _Val("tuple", items=[self.emit("reduce", [v], out_axes, out_shape, f"chunk{i}", fn="select")
                                    for i in range(n // size)])

    def fused_projection(self, node: Any, v: _Val, chunk: int) -> tuple[_RawOp, _RawOp | None] | None:
        """(einsum x·W, bias add or None) when `v` is their result, read by this split alone, and the
        chunks split an output dim of the weight W."""
        source = node.args[0]
        if len(source.users) != 1 or not self.ops:
            return None
        last = self.ops[-1]
        bias = None
        if last.kind == "elementwise" and last.output == v.tensor and last.attrs.get("fn") == "add" and len(self.ops) > 1:
            bias, last = last, self.ops[-2]
            if bias.inputs[0] != last.output or self.tensors[bias.inputs[1]][1] != "param":
                return None
        if last.kind != "einsum" or (bias is None and last.output != v.tensor) or len(last.inputs) != 2:
            return None
        axes, role, _ = self.tensors[last.inputs[1]]
        weight = {self.atoms.find(a) for axis in axes for a, _ in self.expand_axis(axis)}
        if role != "param" or self.atoms.find(chunk) not in weight:
            return None
        return last, bias

    def projection_chunk(self, mm: _RawOp, bias: _RawOp | None, chunk: int, i: int, n: int,
                         out_axes: list[Axis], shape: tuple[int, ...]) -> _Val:
        """Chunk `i` of `n` of a fused projection: x·W[i/n] (+ b[i/n])."""
        if i == 0:  # the fused ops give way to the chunks
            self.ops = [op for op in self.ops if op is not mm and op is not bias]
        saved, self.module_path = self.module_path, mm.module
        x = self.tensors[mm.inputs[0]][0]
        w = self.param_chunk(mm.inputs[1], chunk, i, n)
        out = self.emit("einsum", [_Val("real", (), x, tensor=mm.inputs[0]), w], out_axes, shape, f"chunk{i}")
        if bias is not None:
            b = self.param_chunk(bias.inputs[1], chunk, i, n)
            out = self.emit("elementwise", [out, b], out_axes, shape, f"add_bias{i}", fn="add")
        self.module_path = saved
        return out

    def param_chunk(self, fqn: str, chunk: int, i: int, n: int) -> _Val:
        """The parameter `fqn[i/n]`: chunk i of n along the chunk atom (dropped from its axes)."""
        axes = [tuple(e for e in self.expand_axis(axis) if self.atoms.find(e[0]) != self.atoms.find(chunk))
                for axis in self.tensors[fqn][0]]
        name = f"{fqn}[{i}/{n}]"
        self.replaced.add(fqn)
        return _Val("real", (), axes, tensor=self.tensor(name, axes, "param"))

    def op_chunk(self, node: Any, args: list[Any], kwargs: dict) -> _Val:
        v = args[0]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        return self.op_split(node, [v, v.shape[dim % len(v.shape)] // args[1], dim], {})

    # ------------------------------------------------------------ the graph
    def outputs(self) -> list[_Val]:
        from torch.export.graph_signature import OutputKind

        out = []
        names = [spec.arg.name for spec in self.program.graph_signature.output_specs if spec.kind == OutputKind.USER_OUTPUT]
        for name in names:
            self.node = next(n for n in self.program.graph.nodes if n.name == name)
            self.module_path = ""
            out.append(self.real(self.vals[name]))
        return out

    def add_loss(self, logits: _Val) -> str:
        """Cross entropy of logits[..., v] against integer labels shaped like the first model input."""
        first = self.vals[self.user_inputs[0]]
        if logits.shape[:-1] != first.shape:
            raise FrontendError(f"logits {list(logits.shape)} do not match the first input {list(first.shape)} "
                                f"plus a vocabulary axis", "loss", "drop the loss, or pass token ids as the first input")
        labels = self.tensor("labels", first.axes, "input", self.tensors[self.user_inputs[0]][2])
        self.module_path = ""
        loss = self.emit("cross_entropy", [logits, _Val("real", first.shape, first.axes, tensor=labels)], [], (), "loss")
        return loss.tensor

    def graph(self, name: str, outputs: Iterable[str]) -> Graph:
        """The Graph: atoms named, layers from each op's ModuleList entry."""
        names: dict[int, str] = {}
        if self.batch_atom is not None:
            names[self.atoms.find(self.batch_atom)] = "b"
        if self.seq_atom is not None and self.atoms.find(self.seq_atom) not in names:
            names[self.atoms.find(self.seq_atom)] = "s"

        hinted = {self.atoms.find(a): hint for a, hint in self.hints.items()}

        def dim(atom: int) -> str:
            r = self.atoms.find(atom)
            if r not in names:
                taken = set(names.values())
                hint = hinted.get(r)
                names[r] = f"d{len(names)}" if hint is None else \
                    next(n for k in range(len(names) + 1) if (n := hint if k == 0 else f"{hint}{k}") not in taken)
            return names[r]

        producers = {op.output: op for op in self.ops}
        used = {t for op in self.ops for t in (*op.inputs, op.output)}
        unused = [t for t, (_, role, _) in self.tensors.items() if role == "param" and t not in used | self.replaced]
        if unused:
            raise FrontendError(f"{len(unused)} parameters are not used by the traced forward: {', '.join(unused[:3])}",
                                type(self.module).__name__, "remove them from the module; partopt plans what runs")
        tensors: dict[str, Tensor] = {}
        for tname, (axes, role, dtype) in self.tensors.items():
            if tname not in used:
                continue
            dims = [dim(a) for axis in axes for a, virt in self.expand_axis(axis) if not virt]
            if len(set(dims)) != len(dims):
                op = producers.get(tname)
                raise FrontendError(f"two axes of {tname!r} resolve to one dim", f"op {op.name}" if op else tname,
                                    "partopt tells key from query positions only inside scaled_dot_product_attention")
            tensors[tname] = Tensor(tname, tuple(dims), role, dtype)  # type: ignore[arg-type]
        for out in outputs:
            tensors[out] = Tensor(out, tensors[out].dims, "output", tensors[out].dtype)

        def resolve(value: Any) -> Any:
            if isinstance(value, _AtomRef):
                return [dim(p) for a in value for p in self.atoms.expand(a)]
            if isinstance(value, dict):
                return {(resolve(k)[0] if isinstance(k, _AtomRef) else k): resolve(v) for k, v in value.items()}
            return value

        layers = _layers(self.module, [op.module for op in self.ops])
        ops = [Op(op.name, op.kind, op.inputs, op.output, layer, {k: resolve(v) for k, v in op.attrs.items()})
               for op, layer in zip(self.ops, layers)]
        sizes = {names[r]: self.atoms.size[r] for r in names}
        dims = {d: sizes[d] for t in tensors.values() for d in t.dims}
        return Graph(name, dims, tensors, ops, "b" if self.batch_atom is not None else None, self.dtype or "fp32")


# ---------------------------------------------------------------- helpers

def _aten_name(target: Any) -> str:
    """`aten.linear.default` -> "linear"; operator.getitem -> "getitem"."""
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _counted_flops(node: Any) -> int | None:
    """FlopCounterMode's forward FLOPs of an ATen node run on meta tensors of its shapes (composite ops
    count through their decomposition, aten.conv2d as aten.convolution); None when it counts none."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    def meta(n: Any) -> Any:
        v = n.meta.get("val")
        return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), meta)
    try:
        with FlopCounterMode(display=False) as counter:
            node.target(*args, **kwargs)
    except Exception:  # an op meta tensors cannot run (data-dependent shapes): torch counts nothing
        return None
    return counter.get_total_flops() or None


def _shape(val: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in getattr(val, "shape", ()))


def _flatten(items: Iterable[Any]) -> Iterable[Any]:
    for x in items:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


def _pair(value: Any) -> tuple[int, int]:
    """A conv/pool size argument (an int or a list of one or two) as (height, width)."""
    if isinstance(value, int):
        return value, value
    items = list(value)
    return (items[0], items[-1])


def _with(v: _Val, shape: tuple[int, ...], axes: list[Axis]) -> _Val:
    return replace(v, shape=shape, axes=axes)


def _join(axes: Sequence[Axis]) -> Axis:
    return tuple(e for axis in axes for e in axis)


def _origin(v: _Val) -> _Val:
    return v.origin if v.kind == "pending" and v.origin is not None else v


def _module_path(stack: dict) -> str:
    """The deepest module of an nn_module_stack entry, as an FQN ("model.layers.0.mlp")."""
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("L__self__.")


def _canonical_params(module: Any) -> dict[str, str]:
    """Every parameter FQN (tied ones too) -> the first FQN of the same tensor."""
    first: dict[int, str] = {}
    result = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        result[fqn] = first.setdefault(id(p), fqn)
    return result


def _layers(module: Any, paths: Sequence[str]) -> list[int | None]:
    """Each op's layer: the index of the ModuleList entry its module sits in (ops outside any
    entry join the nearest layer before them, or the first); None for all when there is none."""
    import torch.nn as nn

    keys: list[str | None] = []
    for path in paths:
        parts = path.split(".") if path else []
        key = None
        for i in range(1, len(parts)):
            if parts[i].isdigit():
                try:
                    container = module.get_submodule(".".join(parts[:i]))
                except AttributeError:
                    continue
                if isinstance(container, nn.ModuleList):
                    key = ".".join(parts[:i + 1])
                    break
        keys.append(key)
    index = {k: i for i, k in enumerate(dict.fromkeys(k for k in keys if k is not None))}
    if not index:
        return [None] * len(paths)
    result: list[int | None] = []
    current = 0
    for k in keys:
        if k is not None:
            current = index[k]
        result.append(current)
    return result


# ---------------------------------------------------------------- entry points

def from_module(module: Any, example_inputs: Sequence[Any], *, name: str | None = None, dtype: str | None = None,
                loss: bool = False, opaque: bool = False, attention_kernel: str = "flash",
                causal_mask: bool = False) -> Graph:
    """The Graph of `module` called on `example_inputs` (build both on the meta device: no memory).

    Parameters keep their FQNs (tied ones appear once, under the first), layers come from
    ModuleList entries, the first input's axis 0 is the batch dim `b`. `dtype` defaults to the
    parameters'; `loss` adds a cross entropy of the (single) output against integer `labels`
    shaped like the first input. Experts modules (3-D gate_up_proj/down_proj) run as one op while
    traced and become the expert-parallel form (torch_moe). An op with no mapping is a
    FrontendError naming it and its module, or with `opaque` an unsharded opaque op. Each
    scaled_dot_product_attention becomes one fused `attention` op (`attention_kernel` "flash", the
    default: on a GPU PyTorch runs it as a fused kernel, FlashAttention or its memory-efficient one) or
    the math path's three ops ("math": scores, softmax, context, each in memory), causal when
    called with `is_causal`, or with a mask when `causal_mask` says the masks are causal ones (a
    causal LM's: its masked-out half is skipped as a causal kernel skips it).
    """
    import torch

    require_choice("torch", "attention_kernel", attention_kernel, ATTENTION_KERNELS)

    from partopt.frontends.torch_moe import experts_as_one_op

    try:
        with experts_as_one_op(module):
            program = torch.export.export(module, tuple(example_inputs), strict=False)
    except PartoptError:
        raise
    except Exception as err:  # torch raises many kinds; the user needs its first line
        raise FrontendError(f"torch.export failed: {first_line(err)}", type(module).__name__,
                            "make the module exportable (torch.export docs), with static shapes") from None
    importer = _Importer(module, program, dtype, opaque, attention_kernel, causal_mask)
    importer.run()
    outputs = importer.outputs()
    out_names = [v.tensor for v in outputs]
    if loss:
        if len(outputs) != 1:
            raise FrontendError(f"the module returns {len(outputs)} tensors; a loss needs one (the logits)", "loss")
        out_names = [importer.add_loss(outputs[0])]
    return importer.graph(name or type(module).__name__, out_names)


def read_hf_config(path: str | Path) -> Any:
    """A transformers config object from a config.json (its `model_type` picks the class); no download."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise FrontendError(f"cannot read: {err.strerror}", str(path)) from None
    except json.JSONDecodeError as err:
        raise FrontendError(f"line {err.lineno} column {err.colno}: invalid JSON: {err.msg}", str(path)) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise FrontendError("no model_type in the config", str(path), "give a Hugging Face config.json "
                            "(it names its model_type, e.g. \"llama\" or \"gpt2\")")
    model_type = data.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except StrictDataclassError as err:  # a field's type or a rule between fields: the cause names them
        raise InstanceError(f"transformers refuses the {model_type!r} config: {first_line(err.__cause__ or err)}",
                            str(path), "fix the field it names") from None
    except (ValueError, KeyError, TypeError) as err:
        raise FrontendError(f"transformers cannot build a {model_type!r} config: {err}", str(path),
                            "check model_type and the fields") from None
    _check_hf_sizes(config, data, str(path))
    _check_hf_given(config, data, str(path))
    _check_hf_rope(config, data, str(path))
    return config


HF_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")  # what a model's size rests on


def _check_hf_given(config: Any, data: dict[str, Any], where: str) -> None:
    """Each of HF_SHAPE the config class has is in the file (under its own name or the file's alias, gpt2's n_layer):
    transformers fills a missing one with its class default (Llama's 32 layers of 4096), so a typo'd key would plan
    a model the file does not describe."""
    known = set(dir(type(config)()))  # dir, not hasattr: reading a deprecated property (torch_dtype) warns
    unknown = [key for key in data if key not in known]  # keys the class does not know: typos among them
    for size in HF_SHAPE:
        if hasattr(config, size) and not {size, config.attribute_map.get(size, size)} & data.keys():
            near = difflib.get_close_matches(size, unknown, n=1)
            raise InstanceError(f"the config gives no {size}, and transformers would take its default "
                                f"{getattr(config, size)!r}", where,
                                f"add {size!r}" + (f" (is {near[0]!r} it, misspelt?)" if near else ""))


def _check_hf_sizes(config: Any, data: dict[str, Any], where: str) -> None:
    """Each of HF_SIZES the config has is a positive integer: transformers takes -64 and torch then fails on a
    negative tensor dimension, naming no field. The place is the file's own name of it (gpt2's n_embd)."""
    for size in HF_SIZES:
        value = getattr(config, size, None)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            field = config.attribute_map.get(size, size)
            raise InstanceError(f"{size} must be a positive integer, got {value!r}",
                                at(where, json_path([field if field in data else size])),
                                "give the model's size (the config.json of its Hugging Face repository)")


def _check_hf_rope(config: Any, data: dict[str, Any], where: str) -> None:
    """Every rotary embedding's rope_type is one transformers builds: it warns about an unknown one here and
    fails with a bare KeyError when it builds the model."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = getattr(config, "rope_parameters", None) or {}
    for rope in [parameters] if "rope_type" in parameters else [p for p in parameters.values() if isinstance(p, dict)]:
        if rope.get("rope_type", "default") not in ("default", *ROPE_INIT_FUNCTIONS):
            field = next((k for k in ("rope_parameters", "rope_scaling") if k in data), "rope_parameters")
            raise InstanceError(f"unknown rope_type {rope['rope_type']!r}", at(where, json_path([field])),
                                f"use one of default, {', '.join(ROPE_INIT_FUNCTIONS)}")


def from_hf_config(config: Any, *, batch: int, seq: int, dtype: str | None = None, name: str | None = None,
                   opaque: bool = False, attention_kernel: str = "flash") -> Graph:
    """The training graph (with its cross-entropy loss) of AutoModelForCausalLM.from_config(config),
    built on the meta device and traced on token ids of shape [batch, seq]; attention as `from_module`'s,
    its masks causal (a causal LM's, with no padding); `dtype` by default the config's (`_config_dtype`), else fp32."""
    import torch

    where = f"config ({getattr(config, 'model_type', '?')})"
    if batch < 2 or seq < 2:
        raise FrontendError(f"batch {batch} and seq {seq} must be at least 2", where, "give --batch and --seq of 2 or more")
    model = _hf_model(config, where)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    graph = from_module(model, (ids,), name=name or getattr(config, "model_type", "hf"),
                        dtype=dtype or _config_dtype(config), loss=True,
                        opaque=opaque, attention_kernel=attention_kernel, causal_mask=True)
    architecture = _llama_architecture(config, seq)
    return graph if architecture is None else replace(graph, architecture=architecture)


def _config_dtype(config: Any) -> str | None:
    """The floating-point type a config's checkpoint is stored in (`dtype`; `torch_dtype` before transformers 4.56),
    as partopt names it: what the model trains in, 16-bit in mixed precision. None when the config names none."""
    value = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    dtype = TORCH_DTYPES.get(str(value).removeprefix("torch.")) if value is not None else None
    return dtype if dtype in ("fp32", "fp16", "bf16") else None


LLAMA_LIKE = ("llama", "mistral", "qwen2")  # Hugging Face model types that are Llamas up to the record's fields


def _llama_architecture(config: Any, seq: int) -> dict[str, Any] | None:
    """The `Graph.architecture` of a Llama-like config (RMSNorm, SwiGLU, rotary, grouped-query attention: Llama,
    Mistral, Qwen2), or None for another model type, a sliding window narrower than the sequence (the record has
    none), or biases the record cannot say (Llama's `attention_bias` without `mlp_bias`: four of the seven linear
    layers). Dropout 0: the graph is traced in eval mode, priced without."""
    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_LIKE or getattr(config, "hidden_act", "silu") != "silu":
        return None
    window = getattr(config, "sliding_window", None)  # transformers sets Qwen2's None unless use_sliding_window
    if window is not None and window < seq:
        return None
    qkv_bias = model_type == "qwen2"  # its q, k and v projections are built with biases, no other linear layer
    biases = {bool(getattr(config, "attention_bias", False)), bool(getattr(config, "mlp_bias", False))}
    if len(biases) > 1:
        return None
    heads = config.num_attention_heads
    return llama_architecture(config.num_hidden_layers, config.hidden_size, heads,
                              getattr(config, "num_key_value_heads", None) or heads, config.intermediate_size, seq,
                              config.vocab_size, tied=bool(config.tie_word_embeddings), bias=biases.pop(),
                              head_dim=getattr(config, "head_dim", None), qkv_bias=qkv_bias,
                              rope_base=_rope_base(config), norm_eps=getattr(config, "rms_norm_eps", None),
                              **_rope_scaling(config))


def _rope(config: Any) -> dict[str, Any]:
    """A config's rotary parameters: `rope_parameters` since transformers 5, `rope_theta` and `rope_scaling` before."""
    return getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None),
                                                        **(getattr(config, "rope_scaling", None) or {})}


def _rope_base(config: Any) -> int | None:
    """The rotary embedding's theta where it is a whole number, as Megatron-LM's --rotary-base takes it; else None."""
    theta = _rope(config).get("rope_theta")
    return int(theta) if isinstance(theta, (int, float)) and theta > 0 and float(theta).is_integer() else None


# Llama 3.1's frequency bands, which Megatron-LM's --use-rope-scaling applies and does not take as arguments
# (megatron/core/models/common/embeddings/rotary_pos_embedding.py, RotaryEmbedding._apply_scaling at d98e8a6)
MEGATRON_LLAMA3_BANDS = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}


def _rope_scaling(config: Any) -> dict[str, Any]:
    """`rope_scaling` and `rope_scaling_factor` of the architecture record: none for unscaled rotary positions;
    "llama3" for Llama 3.1's scaling in the bands Megatron-LM applies, or "llama3 (other bands)"; else the config's
    rope_type (yarn, linear, dynamic, …)."""
    rope = _rope(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind == "llama3" and any(rope.get(k) != v for k, v in MEGATRON_LLAMA3_BANDS.items()):
        kind = "llama3 (other bands)"
    factor = rope.get("factor")
    return {"rope_scaling": kind, **({"rope_scaling_factor": float(factor)} if factor is not None else {})}


def _hf_model(config: Any, where: str) -> Any:
    """AutoModelForCausalLM.from_config(config) on the meta device, in eval mode (no dropout: the
    planned step is priced without it, as partopt's generators are)."""
    import torch
    from transformers import AutoModelForCausalLM

    config.use_cache = False
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        except ValueError as err:
            raise FrontendError(f"transformers cannot build the model: {err}", where) from None
        except RuntimeError as err:  # torch refusing a tensor of a size HF_SIZES does not name (gpt2's n_inner -5)
            raise InstanceError(f"transformers cannot build the model: {first_line(err)}", where,
                                "check the config's sizes") from None
    return model.eval()


def param_shapes(source: str) -> dict[str, tuple[int, ...]]:
    """Each torch parameter's shape (a tied one under its first FQN) of a Hugging Face config.json or a
    `pkg.mod:make` / `file.py:make` source, built on the meta device."""
    if source.endswith(".json"):
        config = read_hf_config(source)
        model = _hf_model(config, f"config ({getattr(config, 'model_type', '?')})")
    else:
        model = load_source(source)[0]
    return {fqn: tuple(int(n) for n in p.shape) for fqn, p in model.named_parameters()}


def load_source(source: str) -> tuple[Any, tuple[Any, ...]]:
    """Call `pkg.mod:make` or `path/to/file.py:make` under the meta device; it returns
    (module, example_inputs). FrontendError when it cannot be found or returns something else."""
    import importlib
    import importlib.util

    import torch

    path, sep, attr = source.rpartition(":")
    if not sep or not path or not attr:
        raise FrontendError(f"{source!r} is not of the form pkg.mod:function or file.py:function", "SOURCE",
                            "name a function that returns (module, example_inputs)")
    try:
        if path.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(path).stem, path)
            if spec is None or spec.loader is None or not Path(path).exists():
                raise FrontendError(f"no such file {path!r}", "SOURCE")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(path)
    except ImportError as err:
        raise FrontendError(f"cannot import {path!r}: {err}", "SOURCE", "check the module path and PYTHONPATH") from None
    make = getattr(mod, attr, None)
    if not callable(make):
        raise FrontendError(f"{path!r} has no function {attr!r}", "SOURCE")
    with torch.device("meta"):
        made = make()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise FrontendError(f"{attr}() returned {type(made).__name__}, not (module, example_inputs)", source,
                            "return the module and a tuple of example inputs")
    module, inputs = made
    return module, tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
