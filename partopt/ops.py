"""Operator kinds: how each kind's dims behave, what its tensors must look like, its FLOPs.

Every rule here is keyed by dim *names*: an op's dims are the names on its tensors, and
the kind says how each one behaves (DESIGN §2). The sharding code reads only these
behaviours, so a new kind needs a rule here and nothing anywhere else.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from partopt.graph import Graph, Op


class Behaviour(str, Enum):
    """What sharding one of an op's dims does (DESIGN §2)."""

    PARALLEL = "parallel"  # in the output: divides the work, no communication
    CONTRACTED = "contracted"  # summed away (einsum contraction, reduce): output is Partial
    NORMALISED = "normalised"  # softmax/norm axis: a small all-reduce of statistics
    GATHERED = "gathered"  # embedding table rows: output is Partial (vocab-parallel)
    WINDOWED = "windowed"  # convolution/pooling window: cannot be sharded


KINDS = (
    "einsum", "elementwise", "softmax", "layernorm", "rmsnorm", "reduce",
    "embedding", "cross_entropy", "conv2d", "pool", "reshape", "opaque", "attention",
)

NORM_KINDS = ("layernorm", "rmsnorm")  # what Megatron's sequence parallelism splits along the sequence

# The attrs each kind reads, then those it records for a reader (informational, docs/FORMAT.md): graph validation
# refuses any other, which would be silently ignored (an attribute meant for another kind).
KIND_ATTRS: Mapping[str, tuple[str, ...]] = {
    "einsum": (), "elementwise": ("fn",), "softmax": ("axes",), "layernorm": ("axes",), "rmsnorm": ("axes",),
    "reduce": ("fn",), "embedding": (), "cross_entropy": ("fused",), "conv2d": ("stride",),
    "pool": ("kernel", "stride", "fn"),
    "reshape": ("split", "merge"), "opaque": ("flops", "primitive"), "attention": ("causal",),
}

# How many inputs each kind reads (fewest, most; None: no bound), in the order its tensor rules below expect them.
INPUTS: Mapping[str, tuple[int, int | None]] = {
    "einsum": (1, None), "elementwise": (1, None), "softmax": (1, 1), "layernorm": (1, 3), "rmsnorm": (1, 2),
    "reduce": (1, 1), "embedding": (2, 2), "cross_entropy": (2, 2), "conv2d": (2, 2), "pool": (1, 1),
    "reshape": (1, 1), "opaque": (0, None), "attention": (3, 3),
}

# Kinds whose compute is 0 s (a view): no cost model is asked their time.
UNPRICED_KINDS = frozenset({"reshape"})

# Forward FLOPs per output (or input) element of the cheap kinds; documented in COSTMODEL.md.
FLOPS_PER_ELEMENT = {"softmax": 5, "layernorm": 8, "rmsnorm": 4, "cross_entropy": 5}


class OpShapeError(ValueError):
    """An op whose tensors do not fit its kind; graph validation adds the place."""


def _dims(graph: "Graph", tensor: str) -> tuple[str, ...]:
    return graph.tensors[tensor].dims


def _prod(graph: "Graph", dims: Sequence[str]) -> int:
    return math.prod(graph.dims[d] for d in dims)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise OpShapeError(message)


def stride_attr(strides: Sequence[int]) -> int | list[int]:
    """A window's (height, width) stride as a conv2d or pool records it (`attrs.stride`, informational): one integer
    when the two agree, else the pair."""
    h, w = (int(s) for s in strides)
    return h if h == w else [h, w]


def takes(kind: str, count: int) -> bool:
    """Whether an op of `kind` may read `count` inputs (`INPUTS`)."""
    fewest, most = INPUTS[kind]
    return fewest <= count and (most is None or count <= most)


def input_count(kind: str) -> str:
    """How many inputs `kind` reads, in words: "2 inputs", "1 to 3 inputs", "at least 1 input"."""
    fewest, most = INPUTS[kind]
    if most is None:
        return f"at least {fewest} input{'s' * (fewest != 1)}"
    return f"{fewest}{f' to {most}' * (most != fewest)} input{'s' * (most != 1)}"


def norm_axes(op: "Op", graph: "Graph") -> tuple[str, ...]:
    """The normalised dims of softmax/layernorm/rmsnorm: attr `axes`, default the last dim."""
    axes = op.attrs.get("axes")
    if axes is None:
        return _dims(graph, op.inputs[0])[-1:]
    return tuple(axes)


def _reshape_pairs(op: "Op") -> list[tuple[str, tuple[str, ...], str]]:
    """(whole dim, its parts, direction) for every split/merge of a reshape."""
    pairs = []
    for direction in ("split", "merge"):
        for whole, parts in (op.attrs.get(direction) or {}).items():
            pairs.append((whole, tuple(parts), direction))
    return pairs


# ---------------------------------------------------------------- per-kind checks

def _check_einsum(op: "Op", graph: "Graph") -> None:
    seen = {d for t in op.inputs for d in _dims(graph, t)}
    missing = [d for d in _dims(graph, op.output) if d not in seen]
    _require(not missing, f"output dims {missing} appear in no input of the einsum")


def _check_elementwise(op: "Op", graph: "Graph") -> None:
    out = set(_dims(graph, op.output))
    for t in op.inputs:
        extra = [d for d in _dims(graph, t) if d not in out]
        _require(not extra, f"input {t!r} has dims {extra} not in the output (elementwise ops only broadcast)")


def _check_normalising(op: "Op", graph: "Graph") -> None:
    x, params = op.inputs[0], op.inputs[1:]
    _require(set(_dims(graph, x)) == set(_dims(graph, op.output)),
             f"output dims {list(_dims(graph, op.output))} differ from input dims {list(_dims(graph, x))}")
    axes = norm_axes(op, graph)
    _require(len(axes) > 0, "normalised axes are empty")
    bad = [a for a in axes if a not in _dims(graph, x)]
    _require(not bad, f"normalised axes {bad} are not dims of input {x!r}")
    _require(len(set(axes)) == len(axes), f"normalised axes {list(axes)} name a dim twice")
    for p in params:
        extra = [d for d in _dims(graph, p) if d not in _dims(graph, x)]
        _require(not extra, f"scale/shift {p!r} has dims {extra} not in input {x!r}")


def _check_reduce(op: "Op", graph: "Graph") -> None:
    extra = [d for d in _dims(graph, op.output) if d not in _dims(graph, op.inputs[0])]
    _require(not extra, f"output dims {extra} are not in the input")


def _check_embedding(op: "Op", graph: "Graph") -> None:
    ids, table = (_dims(graph, t) for t in op.inputs)
    gathered = [d for d in table if d not in _dims(graph, op.output)]
    _require(len(gathered) == 1, f"the table {op.inputs[1]!r} must have exactly one dim (the vocabulary) absent from the output, found {gathered}")
    expected = set(ids) | (set(table) - set(gathered))
    _require(set(_dims(graph, op.output)) == expected,
             f"output dims must be the ids' dims plus the table's non-vocabulary dims {sorted(expected)}")


def _check_cross_entropy(op: "Op", graph: "Graph") -> None:
    _require(isinstance(op.attrs.get("fused", True), bool), "fused must be true or false")
    logits, labels = (_dims(graph, t) for t in op.inputs)
    vocab = [d for d in logits if d not in labels]
    _require(len(vocab) == 1, f"logits must have exactly one dim (the vocabulary) beyond the labels' dims, found {vocab}")
    _require(set(labels) <= set(logits), "labels have dims the logits lack")
    _require(set(_dims(graph, op.output)) <= set(labels), "the loss may keep only label dims")


def _check_conv2d(op: "Op", graph: "Graph") -> None:
    x, w, out = _dims(graph, op.inputs[0]), _dims(graph, op.inputs[1]), _dims(graph, op.output)
    _require(len(x) == 4 and len(w) == 4 and len(out) == 4, "conv2d tensors are 4-D: x[N,C,H,W], w[O,C,KH,KW], out[N,O,HO,WO]")
    _require(x[1] == w[1], f"input channels differ: x has {x[1]!r}, w has {w[1]!r}")
    _require(out[0] == x[0] and out[1] == w[0], "output must be [N, O, HO, WO] with N from x and O from w")


def _check_pool(op: "Op", graph: "Graph") -> None:
    x, out = _dims(graph, op.inputs[0]), _dims(graph, op.output)
    _require(len(x) == 4 and len(out) == 4, "pool tensors are 4-D: x[N,C,H,W] -> out[N,C,HO,WO]")
    _require(out[:2] == x[:2], "pool keeps N and C")
    kernel = op.attrs.get("kernel", [1, 1])
    _require(len(kernel) == 2 and all(isinstance(k, int) and k > 0 for k in kernel), "kernel must be two positive ints")


def _check_reshape(op: "Op", graph: "Graph") -> None:
    pairs = _reshape_pairs(op)
    _require(bool(pairs), "reshape needs a `split` or `merge` attribute")
    src, dst = list(_dims(graph, op.inputs[0])), list(_dims(graph, op.output))
    for whole, parts, direction in pairs:
        for d in (whole, *parts):
            _require(d in graph.dims, f"unknown dim {d!r} in {direction}")
        _require(graph.dims[whole] == _prod(graph, parts),
                 f"{direction} {whole!r} ({graph.dims[whole]}) != product of {list(parts)} ({_prod(graph, parts)})")
        before, after = (src, dst) if direction == "split" else (dst, src)
        _require(whole in before and all(p in after for p in parts),
                 f"{direction} of {whole!r} into {list(parts)} does not match the tensors' dims")
    consumed: set[str] = set()  # input dims that a split or merge takes apart
    produced: set[str] = set()  # output dims that a split or merge makes
    for whole, parts, direction in pairs:
        ins, outs = ((whole,), parts) if direction == "split" else (parts, (whole,))
        consumed.update(ins)
        produced.update(outs)
    _require([d for d in src if d not in consumed] == [d for d in dst if d not in produced],
             "dims outside the split/merge must pass through unchanged")


def attention_dims(op: "Op", graph: "Graph") -> tuple[str, str, str]:
    """(query-key head dim, value head dim, key positions) of a fused attention op: the last dims of
    q and v, and the one dim of k absent from q (`t`)."""
    q, k, v = (_dims(graph, t) for t in op.inputs)
    return q[-1], v[-1], next(d for d in k if d not in q)


def _check_attention(op: "Op", graph: "Graph") -> None:
    q, k, v = (_dims(graph, t) for t in op.inputs)
    _require(all(len(x) >= 2 for x in (q, k, v)), "q, k and v need a position dim and a head dim (last)")
    _require(q[-1] == k[-1], f"q and k must end with the same head dim, got {q[-1]!r} and {k[-1]!r}")
    keys = [d for d in k if d not in q]
    _require(len(keys) == 1, f"k must have exactly one dim (the key positions) absent from q, found {keys}")
    _require(set(k[:-1]) == set(v[:-1]), "k and v must share every dim but the last (the head dims)")
    expected = (set(q) - {q[-1]}) | {v[-1]}
    _require(set(_dims(graph, op.output)) == expected,
             f"output dims must be q's with v's head dim last in place of q's, {sorted(expected)}")
    _require(isinstance(op.attrs.get("causal", False), bool), "causal must be true or false")


def _check_opaque(op: "Op", graph: "Graph") -> None:
    flops = op.attrs.get("flops", 0)
    _require(isinstance(flops, int) and not isinstance(flops, bool) and flops >= 0,
             f"flops must be a non-negative integer, got {flops!r}")


CHECKS: Mapping[str, Callable[["Op", "Graph"], None]] = {
    "einsum": _check_einsum,
    "elementwise": _check_elementwise,
    "softmax": _check_normalising,
    "layernorm": _check_normalising,
    "rmsnorm": _check_normalising,
    "reduce": _check_reduce,
    "embedding": _check_embedding,
    "cross_entropy": _check_cross_entropy,
    "conv2d": _check_conv2d,
    "pool": _check_pool,
    "reshape": _check_reshape,
    "opaque": _check_opaque,
    "attention": _check_attention,
}


def check(op: "Op", graph: "Graph") -> None:
    """Raise OpShapeError when op's tensors do not fit its kind: first their count, then the kind's own rules."""
    _require(takes(op.kind, len(op.inputs)), f"{op.kind} takes {input_count(op.kind)}, got {len(op.inputs)}")
    CHECKS[op.kind](op, graph)


# ---------------------------------------------------------------- behaviour and FLOPs

def op_dims(op: "Op", graph: "Graph") -> tuple[str, ...]:
    """Every dim the op touches, outputs first, in first-seen order."""
    seen: dict[str, None] = {}
    for t in (op.output, *op.inputs):
        for d in _dims(graph, t):
            seen.setdefault(d, None)
    return tuple(seen)


def behaviours(op: "Op", graph: "Graph") -> dict[str, Behaviour]:
    """Each dim of the op and how sharding it behaves (DESIGN §2's table)."""
    out = set(_dims(graph, op.output))
    dims = op_dims(op, graph)
    kind = op.kind
    if kind == "opaque":  # a framework op partopt cannot see into: it runs whole on every device
        return {d: Behaviour.WINDOWED for d in dims}
    if kind in ("conv2d", "pool"):
        x = _dims(graph, op.inputs[0])
        o = _dims(graph, op.output)
        result = {d: Behaviour.WINDOWED for d in dims}
        result[x[0]] = Behaviour.PARALLEL
        result[o[1]] = Behaviour.PARALLEL
        if kind == "conv2d":
            result[x[1]] = Behaviour.CONTRACTED
        return result
    if kind == "attention":  # one kernel per (batch, head, query block) row: every key, whole heads
        result = {d: Behaviour.PARALLEL if d in out else Behaviour.WINDOWED for d in dims}
        result.update(dict.fromkeys(attention_dims(op, graph), Behaviour.WINDOWED))
        return result
    if kind == "reshape":
        # Only dims that pass through unchanged, and the outermost part of a split/merge,
        # can carry a sharding; the inner parts are windowed (not shardable).
        result = {d: Behaviour.PARALLEL for d in dims}
        for whole, parts, _ in _reshape_pairs(op):
            for p in parts[1:]:
                result[p] = Behaviour.WINDOWED
        return result
    if kind in ("softmax", "layernorm", "rmsnorm"):
        axes = set(norm_axes(op, graph))
        return {d: Behaviour.NORMALISED if d in axes else Behaviour.PARALLEL for d in dims}
    if kind == "embedding":
        return {d: Behaviour.PARALLEL if d in out else Behaviour.GATHERED for d in dims}
    if kind == "cross_entropy":
        labels = set(_dims(graph, op.inputs[1]))
        return {d: (Behaviour.PARALLEL if d in out else
                    Behaviour.CONTRACTED if d in labels else Behaviour.NORMALISED) for d in dims}
    # einsum, elementwise, reduce: output dims parallel, the rest summed away
    return {d: Behaviour.PARALLEL if d in out else Behaviour.CONTRACTED for d in dims}


def reshape_outer(op: "Op") -> dict[str, str]:
    """For a reshape, maps each whole dim to its outermost part and back (where shardings live)."""
    pairs: dict[str, str] = {}
    for whole, parts, _ in _reshape_pairs(op):
        pairs[whole] = parts[0]
        pairs[parts[0]] = whole
    return pairs


def forward_flops(op: "Op", graph: "Graph") -> int:
    """Forward FLOPs of one op for the whole (global) batch."""
    kind = op.kind
    if kind == "einsum":
        work = _prod(graph, op_dims(op, graph))
        return 2 * work if len(op.inputs) >= 2 else work
    if kind == "attention":  # the scores q·k and the context p·v, two GEMMs over (rows × keys)
        qk, value, keys = attention_dims(op, graph)
        rows = _prod(graph, [d for d in _dims(graph, op.output) if d != value]) * graph.dims[keys]
        return 2 * rows * (graph.dims[qk] + graph.dims[value])
    if kind == "conv2d":
        x, w = _dims(graph, op.inputs[0]), _dims(graph, op.inputs[1])
        return 2 * _prod(graph, _dims(graph, op.output)) * _prod(graph, (x[1], w[2], w[3]))
    if kind == "pool":
        kh, kw = op.attrs.get("kernel", [1, 1])
        return _prod(graph, _dims(graph, op.output)) * kh * kw
    if kind == "elementwise":
        return _prod(graph, _dims(graph, op.output)) * max(1, len(op.inputs) - 1)
    if kind == "reduce":
        return _prod(graph, _dims(graph, op.inputs[0]))
    if kind in FLOPS_PER_ELEMENT:
        return FLOPS_PER_ELEMENT[kind] * _prod(graph, _dims(graph, op.inputs[0]))
    if kind == "opaque":
        return int(op.attrs.get("flops", 0))
    return 0  # embedding (a gather) and reshape move bytes, they do no arithmetic


# Elementwise functions whose backward reads none of the forward's tensors (linear in their inputs: an add,
# a rotation by fixed angles; dropout, given its mask) and those whose backward reads only their output
# (d relu = [y > 0], d exp = y, …).
LINEAR_FNS = frozenset({"add", "sub", "neg", "identity", "rotary", "scale", "dropout"})
MASK_FNS = frozenset({"dropout"})  # keep a one-byte mask per output element, written forward, read backward
MASK_BYTES = 1
OUTPUT_FNS = frozenset({"relu", "sigmoid", "tanh", "exp"})


def mask_bytes(op: "Op", elements: float) -> float:
    """Bytes of the mask the op keeps for `elements` of its output (a dropout's, one byte each); 0 for any other."""
    return elements * MASK_BYTES if op.attrs.get("fn") in MASK_FNS else 0.0


def backward_reads(op: "Op") -> tuple[tuple[bool, ...], bool]:
    """What the op's backward reads of its forward: (per input, whether it reads it; whether it reads the output).

    What autograd saves (docs/COSTMODEL.md §5): a product reads its operands (each one's gradient needs the
    other), a norm its input (a fused cross entropy too; an unfused one its own fp32 softmax, none of these),
    softmax and relu-like functions their output, a fused attention its inputs and output; adds, rotations,
    reshapes, sums and gathers read nothing. An elementwise function not listed
    (gelu, silu, mul, a fused chain, an unknown name) and an opaque op keep all they read, the safe side.
    """
    every, none = tuple(True for _ in op.inputs), tuple(False for _ in op.inputs)
    first = tuple(i == 0 for i in range(len(op.inputs)))
    kind, fn = op.kind, op.attrs.get("fn")
    if kind in ("einsum", "conv2d"):  # a one-operand einsum is a transpose or a sum: linear
        return (every if len(op.inputs) >= 2 else none), False
    if kind == "elementwise":
        if fn in LINEAR_FNS or (fn in ("mul", "div") and len(op.inputs) == 1):  # a constant factor
            return none, False
        return (none, True) if fn in OUTPUT_FNS else (every, False)
    if kind == "softmax":
        return none, True
    if is_unfused_loss(op):  # its own fp32 softmax (`unfused_loss_bytes`), not x
        return none, False
    if kind in ("layernorm", "rmsnorm", "cross_entropy", "pool"):  # x, not the parameters or labels after it
        return first, False
    if kind == "reduce":
        return (every, True) if fn == "max" else (none, False)
    if kind in ("embedding", "reshape"):
        return none, False
    return every, True  # attention (q, k, v, its output and statistics), opaque


def is_unfused_loss(op: "Op") -> bool:
    """A cross entropy run as Megatron-LM runs it (attribute `fused` false; docs/COSTMODEL.md §3, "Bytes moved"):
    the logits cast to fp32, then five kernels forward (max, subtract, exp, sum, divide) and one backward, each a
    pass over the fp32 copy, whose softmax it keeps; by default one pass each way over the logits."""
    return op.kind == "cross_entropy" and op.attrs.get("fused", True) is False


def is_matmul(op: "Op") -> bool:
    """Ops whose FLOPs are tensor-core matrix multiplies (einsum with ≥ 2 inputs, conv2d, fused attention)."""
    return (op.kind == "einsum" and len(op.inputs) >= 2) or op.kind in ("conv2d", "attention")


def is_weight_matmul(graph: "Graph", op: "Op") -> bool:
    """A matmul that reads a parameter (a linear or conv layer): its weight gradient is a GEMM of its own, and the
    GEMM that Megatron-LM's tensor-parallel comm overlap runs its collectives beside."""
    return is_matmul(op) and any(graph.tensors[t].role == "param" for t in op.inputs)
