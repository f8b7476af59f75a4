"""Graph IR behaviours: stable topological order, exact parameter counts, structural hashing,
FLOPs of einsum and conv — every expected value derived by hand from the sizes."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from partopt.errors import InstanceError
from partopt.graph import Graph, Op, Tensor


def make(dims: dict[str, int], tensors: dict[str, tuple], ops: list[tuple], batch_dim: str | None = None) -> Graph:
    """A Graph from compact specs: tensors name -> (dims, role='activation'); ops (name, kind, inputs, output[, attrs])."""
    ts = {name: Tensor(name, tuple(spec[0]), *spec[1:]) for name, spec in tensors.items()}
    os = [Op(o[0], o[1], tuple(o[2]), o[3], attrs=o[4] if len(o) > 4 else {}) for o in ops]
    return Graph("g", dims, ts, os, batch_dim)


# ---------------------------------------------------------------- topological order

def test_order_keeps_file_order_when_it_is_topological():
    g = make({"b": 2, "h": 3},
             {"x": (["b", "h"], "input"), "p": (["b", "h"],), "q": (["b", "h"],), "r": (["b", "h"],)},
             [("c", "elementwise", ["x"], "p"), ("a", "elementwise", ["x"], "q"), ("b", "elementwise", ["p", "q"], "r")])
    assert [op.name for op in g.order] == ["c", "a", "b"]  # not alphabetical: the file's order


def test_order_moves_only_what_must_move():
    # "use" is listed before its producer "make"; the independent "side" ops keep their relative order.
    g = make({"b": 2},
             {"x": (["b"], "input"), "m": (["b"],), "u": (["b"],), "s1": (["b"],), "s2": (["b"],)},
             [("side1", "elementwise", ["x"], "s1"), ("use", "elementwise", ["m"], "u"),
              ("make", "elementwise", ["x"], "m"), ("side2", "elementwise", ["x"], "s2")])
    assert [op.name for op in g.order] == ["side1", "make", "use", "side2"]
    again = make(g.dims, {n: (t.dims, t.role) for n, t in g.tensors.items()},
                 [(op.name, op.kind, op.inputs, op.output) for op in g.ops])
    assert [op.name for op in again.order] == ["side1", "make", "use", "side2"]


# ---------------------------------------------------------------- parameter counts

def test_mlp_with_biases_counts_weights_and_biases():
    h, f = 6, 10
    g = make({"b": 4, "h": h, "f": f},
             {"x": (["b", "h"], "input"), "w1": (["h", "f"], "param"), "b1": (["f"], "param"),
              "w2": (["f", "h"], "param"), "b2": (["h"], "param"),
              "y1": (["b", "f"],), "z1": (["b", "f"],), "y2": (["b", "h"],), "z2": (["b", "h"], "output")},
             [("fc1", "einsum", ["x", "w1"], "y1"), ("bias1", "elementwise", ["y1", "b1"], "z1"),
              ("fc2", "einsum", ["z1", "w2"], "y2"), ("bias2", "elementwise", ["y2", "b2"], "z2")])
    assert g.num_params == 6 * 10 + 10 + 10 * 6 + 6 == 136


def test_layernorm_scale_and_shift_count_twice_the_hidden_size():
    g = make({"b": 3, "h": 7},
             {"x": (["b", "h"], "input"), "g": (["h"], "param"), "s": (["h"], "param"), "y": (["b", "h"], "output")},
             [("ln", "layernorm", ["x", "g", "s"], "y")])
    assert g.num_params == 2 * 7


def test_conv_kernel_counts_out_in_kh_kw():
    g = make({"n": 2, "c": 3, "o": 5, "kh": 3, "kw": 2, "hh": 8, "ww": 8},
             {"x": (["n", "c", "hh", "ww"], "input"), "w": (["o", "c", "kh", "kw"], "param"),
              "y": (["n", "o", "hh", "ww"], "output")},
             [("conv", "conv2d", ["x", "w"], "y")])
    assert g.num_params == 5 * 3 * 3 * 2 == 90


def test_tied_embedding_used_twice_is_counted_once():
    v, h = 11, 4
    g = make({"b": 2, "s": 3, "v": v, "h": h},
             {"ids": (["b", "s"], "input", "int32"), "labels": (["b", "s"], "input", "int32"),
              "wte": (["v", "h"], "param"), "x": (["b", "s", "h"],), "logits": (["b", "s", "v"],),
              "loss": ([], "output")},
             [("embed", "embedding", ["ids", "wte"], "x"), ("head", "einsum", ["x", "wte"], "logits"),
              ("loss", "cross_entropy", ["logits", "labels"], "loss")])
    assert len(g.consumers["wte"]) == 2
    assert g.num_params == v * h == 44


# ---------------------------------------------------------------- structural hash

def block(prefix: str, dim_names: tuple[str, str, str], h: int = 8, f: int = 32, kind: str = "elementwise",
          swap: bool = False) -> Graph:
    """An MLP block x -> fc1 -> act -> fc2 with the given name prefix and dim names.

    `swap` rewires fc2 to read the pre-activation tensor instead of the activation."""
    b, hd, fd = dim_names
    p = prefix
    act_out = f"{p}a"
    return make({b: 4, hd: h, fd: f},
                {f"{p}x": ([b, hd], "input"), f"{p}w1": ([hd, fd], "param"), f"{p}w2": ([fd, hd], "param"),
                 f"{p}y": ([b, fd],), act_out: ([b, fd],), f"{p}z": ([b, hd], "output")},
                [(f"{p}fc1", "einsum", [f"{p}x", f"{p}w1"], f"{p}y"),
                 (f"{p}act", kind, [f"{p}y"], act_out),
                 (f"{p}fc2", "einsum", [f"{p}y" if swap else act_out, f"{p}w2"], f"{p}z")],
                batch_dim=b)


def test_hash_ignores_op_tensor_and_dim_names():
    assert block("l0.", ("b", "h", "f")).structural_hash() == block("blk7/", ("batch", "hid", "ffn")).structural_hash()


@pytest.mark.parametrize("changed", [
    block("l0.", ("b", "h", "f"), f=64),              # a size
    block("l0.", ("b", "h", "f"), kind="softmax"),    # a kind
    block("l0.", ("b", "h", "f"), swap=True),         # the wiring
    dataclasses.replace(block("l0.", ("b", "h", "f")), optimizer="sgd"),  # the parameters' state
])
def test_hash_changes_with_size_kind_wiring_or_optimizer(changed):
    assert changed.structural_hash() != block("l0.", ("b", "h", "f")).structural_hash()


def test_hash_of_two_identical_layers_inside_one_graph():
    layers = []
    tensors = {"x": (["b", "h"], "input")}
    prev = "x"
    for i in range(4):
        tensors |= {f"l{i}.w": (["h", "h2"], "param"), f"l{i}.v": (["h2", "h"], "param"),
                    f"l{i}.m": (["b", "h2"],), f"l{i}.o": (["b", "h"],)}
        layers += [(f"l{i}.up", "einsum", [prev, f"l{i}.w"], f"l{i}.m"), (f"l{i}.down", "einsum", [f"l{i}.m", f"l{i}.v"], f"l{i}.o")]
        prev = f"l{i}.o"
    g = make({"b": 4, "h": 8, "h2": 16}, tensors, layers, batch_dim="b")
    ops = g.order
    assert g.structural_hash(ops[2:4]) == g.structural_hash(ops[4:6])
    assert g.structural_hash(ops[0:2]) != g.structural_hash(ops[2:4])  # layer 0 reads the input x, not an activation
    # the last layer's output leaves the graph, unread: its ILP cannot pair it with its input as the others do
    assert g.structural_hash(ops[6:8]) != g.structural_hash(ops[4:6])


# ---------------------------------------------------------------- FLOPs

def test_einsum_flops_are_two_times_the_product_of_all_its_dims():
    b, s, h, f = 3, 5, 7, 11
    g = make({"b": b, "s": s, "h": h, "f": f},
             {"x": (["b", "s", "h"], "input"), "w": (["h", "f"], "param"), "y": (["b", "s", "f"], "output")},
             [("fc", "einsum", ["x", "w"], "y")])
    assert g.flops(g.ops[0]) == 2 * b * s * h * f == 2310


def test_attention_scores_flops_count_the_contracted_head_dim():
    b, s, t, d = 2, 4, 4, 8
    g = make({"b": b, "s": s, "t": t, "d": d},
             {"q": (["b", "s", "d"], "input"), "k": (["b", "t", "d"], "input"), "sc": (["b", "s", "t"], "output")},
             [("scores", "einsum", ["q", "k"], "sc")])
    assert g.flops(g.ops[0]) == 2 * b * s * t * d == 512


def test_conv_flops_are_two_times_output_times_in_channels_times_kernel():
    n, c, o, kh, kw, ho, wo = 2, 3, 4, 3, 3, 6, 5
    g = make({"n": n, "c": c, "o": o, "kh": kh, "kw": kw, "hi": 8, "wi": 7, "ho": ho, "wo": wo},
             {"x": (["n", "c", "hi", "wi"], "input"), "w": (["o", "c", "kh", "kw"], "param"),
              "y": (["n", "o", "ho", "wo"], "output")},
             [("conv", "conv2d", ["x", "w"], "y")])
    assert g.flops(g.ops[0]) == 2 * (n * o * ho * wo) * (c * kh * kw) == 12960


def test_graph_rejects_a_dim_repeated_in_one_tensor():
    with pytest.raises(InstanceError, match="dim repeated"):
        make({"s": 4}, {"x": (["s", "s"], "input"), "y": (["s", "s"], "output")},
             [("op", "elementwise", ["x"], "y")])


def test_graph_rejects_a_graph_without_ops():
    with pytest.raises(InstanceError) as info:
        make({"b": 2}, {"x": (["b"], "input"), "w": (["b"], "param")}, [])
    assert info.value.where == "ops" and "no ops" in info.value.cause and info.value.hint


def test_graph_refuses_a_parameter_over_the_batch_dim():
    """A weight w[b, f] would be sliced per microbatch and its memory under-counted; without a batch dim it is fine."""
    tensors = {"x": (["b", "h"], "input"), "w": (["b", "f"], "param"), "y": (["b", "h", "f"], "output")}
    ops = [("fc", "einsum", ["x", "w"], "y")]
    assert make({"b": 4, "h": 8, "f": 16}, tensors, ops).params[0].name == "w"
    with pytest.raises(InstanceError) as info:
        make({"b": 4, "h": 8, "f": 16}, tensors, ops, batch_dim="b")
    assert info.value.where == "tensors.w" and "batch dim 'b'" in info.value.cause and "drop 'b'" in info.value.hint


def chain(*layers):
    """x -> a -> b -> c by three elementwise ops, the i-th tagged layers[i]."""
    ts = {"x": Tensor("x", ("h",), "input"), "a": Tensor("a", ("h",)), "b": Tensor("b", ("h",)),
          "c": Tensor("c", ("h",), "output")}
    wiring = [("f", "x", "a"), ("g", "a", "b"), ("k", "b", "c")]
    return Graph("g", {"h": 8}, ts, [Op(n, "elementwise", (i,), o, layer=t) for (n, i, o), t in zip(wiring, layers)])


def test_graph_refuses_layer_tags_against_the_data_flow():
    """Layers run in the order their first ops take (f, g, k here): a layer reading a later layer's tensor has no
    pipeline schedule. Tags need not be ascending numbers, and one layer may hold consecutive ops."""
    assert chain(5, 3, 1).layers == [5, 3, 1] and chain(0, 0, 1).layers == [0, 1]
    with pytest.raises(InstanceError) as info:
        chain(0, 1, 0)  # layers [0, 1]: k (layer 0) reads b from g of layer 1, which runs after it
    assert info.value.where == "ops[2] (k)"
    assert info.value.cause.startswith("layer 0 reads 'b' from 'g' of layer 1, which runs after it")
    assert "give 'k' layer 1" in info.value.hint
    with pytest.raises(InstanceError, match="layer untagged reads 'b' from 'g' of layer 1"):
        chain(None, 1, None)  # the untagged ops form one layer, first in the order


def test_graph_refuses_a_dim_beyond_2_to_53_and_names_it():
    tensors = {"x": (["b", "h"], "input"), "y": (["b", "h"], "output")}
    ops = [("act", "elementwise", ["x"], "y")]
    assert make({"b": 4, "h": 2**53}, tensors, ops).dims["h"] == 2**53
    with pytest.raises(InstanceError) as info:
        make({"b": 4, "h": 10**160}, tensors, ops)  # 10^160 · 10^160 FLOPs overflowed float64 in `inspect`
    assert info.value.where == "dims.h" and "at most 2^53" in info.value.cause and info.value.hint
    assert "\n" not in info.value.line() and len(info.value.line()) < 200


def test_graph_refuses_a_tensor_of_more_elements_than_int64_holds():
    # 2^40 · 2^30 = 2^70 elements, though each dim is within 2^53
    with pytest.raises(InstanceError) as info:
        make({"b": 2**40, "h": 2**30}, {"x": (["b", "h"], "input"), "y": (["b", "h"], "output")},
             [("act", "elementwise", ["x"], "y")])
    assert info.value.where == "tensors.x" and "more than 2^63 - 1 elements" in info.value.cause


def test_graph_refuses_an_op_of_more_than_10_to_30_flops():
    # an opaque op's own count, and an einsum of 20 operands of 2^53 elements each (2 · 2^1060 FLOPs: no float64)
    with pytest.raises(InstanceError) as info:
        make({"b": 4}, {"x": (["b"], "input"), "y": (["b"], "output")},
             [("opq", "opaque", ["x"], "y", {"flops": 10**30 + 1})])
    assert info.value.where == "ops[0] (opq)" and "more than 10^30 forward FLOPs" in info.value.cause
    names = [f"d{k}" for k in range(20)]
    with pytest.raises(InstanceError) as info:
        make(dict.fromkeys(names, 2**53), {**{n: ([n], "input") for n in names}, "y": ([], "output")},
             [("many", "einsum", names, "y")])
    assert info.value.where == "ops[0] (many)" and "einsum" in info.value.cause


def test_graph_refuses_an_attribute_its_kind_does_not_read_and_says_what_it_reads():
    """A pool's `kernel` on an einsum, an elementwise `fn` on a softmax and `axes` (naming no declared dim) on an
    elementwise op were ignored: each is refused at its JSON path, the hint listing what the kind reads."""
    tensors = {"x": (["b", "h"], "input"), "y": (["b", "h"], "output")}
    cases = [("einsum", {"kernel": [3, 3]}, "kernel", "einsum reads no attribute: remove 'kernel'"),
             ("softmax", {"axes": ["h"], "fn": "exp"}, "fn", "softmax reads only axes: remove 'fn'"),
             ("elementwise", {"fn": "gelu", "axes": ["zz"]}, "axes", "elementwise reads only fn: remove 'axes'"),
             ("pool", {"causal": True}, "causal", "pool reads only kernel, stride, fn: remove 'causal'")]
    for kind, attrs, name, hint in cases:
        with pytest.raises(InstanceError) as info:
            make({"b": 4, "h": 8}, tensors, [("op", kind, ["x"], "y", attrs)])
        assert info.value.where == f"ops[0].attrs.{name} (op)"
        assert info.value.cause == f"{kind} does not read attribute {name!r}"
        assert info.value.hint.startswith(hint)


def test_each_kind_accepts_the_attributes_it_reads():
    """The attributes docs/FORMAT.md lists for a kind pass (a frontend's informational `primitive`, `stride`, pool `fn`)."""
    x = {"x": (["b", "h"], "input"), "y": (["b", "h"], "output")}
    assert make({"b": 4, "h": 8}, x, [("op", "opaque", ["x"], "y", {"flops": 7, "primitive": "aten.sort"})])
    assert make({"b": 4, "h": 8}, x, [("op", "reduce", ["x"], "y", {"fn": "max"})])
    assert make({"b": 4, "h": 8}, x, [("op", "layernorm", ["x"], "y", {"axes": ["b", "h"]})])
    img = {"x": (["n", "c", "h", "w"], "input"), "y": (["n", "c", "ho", "wo"], "output")}
    dims = {"n": 2, "c": 3, "h": 8, "w": 8, "ho": 4, "wo": 4}
    assert make(dims, img, [("op", "pool", ["x"], "y", {"kernel": [2, 2], "stride": 2, "fn": "max"})])


def test_graph_refuses_an_op_with_more_or_fewer_inputs_than_its_kind_reads():
    """One rule for every kind (`ops.INPUTS`, which profiles check their shape counts by): a layernorm reads x and at
    most a scale and a shift, an attention q, k and v, a reduce one tensor."""
    tensors = {"x": (["b", "h"], "input"), "y": (["b", "h"], "output")}
    for kind, inputs, words in (("layernorm", ["x"] * 4, "layernorm takes 1 to 3 inputs, got 4"),
                                ("attention", ["x", "x"], "attention takes 3 inputs, got 2"),
                                ("reduce", ["x", "x"], "reduce takes 1 input, got 2")):
        with pytest.raises(InstanceError) as info:
            make({"b": 4, "h": 8}, tensors, [("n", kind, inputs, "y")])
        assert info.value.where == "ops[0] (n)" and info.value.cause == f"{kind}: {words}"


def test_graph_refuses_normalised_axes_that_are_not_dims_of_the_input():
    """softmax/layernorm/rmsnorm read `axes`: a declared dim the input lacks, or one never declared, is refused."""
    tensors = {"x": (["b", "h"], "input"), "y": (["b", "h"], "output")}
    for kind, axes, bad in (("softmax", ["f"], "['f']"), ("rmsnorm", ["zz"], "['zz']"), ("layernorm", ["h", "f"], "['f']")):
        with pytest.raises(InstanceError) as info:
            make({"b": 4, "h": 8, "f": 2}, tensors, [("n", kind, ["x"], "y", {"axes": axes})])
        assert info.value.where == "ops[0] (n)"
        assert info.value.cause == f"{kind}: normalised axes {bad} are not dims of input 'x'"
    with pytest.raises(InstanceError) as info:  # a dim named twice would count its elements twice
        make({"b": 4, "h": 8}, tensors, [("n", "layernorm", ["x"], "y", {"axes": ["h", "h"]})])
    assert info.value.cause == "layernorm: normalised axes ['h', 'h'] name a dim twice"


# ---------------------------------------------------------------- resized views

def _merge_graph() -> Graph:
    """b·s tokens merged from b and s (a reshape whose rule ties three sizes)."""
    return make({"b": 4, "s": 3, "bs": 12, "h": 2},
                {"x": (["b", "s", "h"], "input"), "y": (["bs", "h"], "output")},
                [("merge", "reshape", ["x"], "y", {"merge": {"bs": ["b", "s"]}})], batch_dim="b")


def test_a_resized_view_checks_the_sizes_and_names_the_op():
    g = _merge_graph()
    view = g.resized({"b": 2, "s": 3, "bs": 6, "h": 2})
    assert view.dims == {"b": 2, "s": 3, "bs": 6, "h": 2} and g.dims["b"] == 4  # the graph itself unchanged
    with pytest.raises(InstanceError, match=r"ops\[0\] \(merge\).*bs.*\(12\) != product"):
        g.resized({"b": 2, "s": 3, "bs": 12, "h": 2})  # 2 · 3 is not 12
    with pytest.raises(InstanceError, match="positive integer"):
        g.resized({"b": 0, "s": 3, "bs": 0, "h": 2})


def test_a_resized_view_shares_the_structure_it_did_not_rebuild():
    g = _merge_graph()
    order = g.order
    view = g.resized({"b": 2, "s": 3, "bs": 6, "h": 2})
    assert view.order is order and view.ops == g.ops and view.tensors == g.tensors
    assert view.numel("y") == 12 and g.numel("y") == 24  # sizes are the view's own


def test_memoized_hashes_and_views_follow_the_sizes():
    """Views share one memo of hashes and views keyed by sizes: each answers as a graph built at its sizes."""
    g = block("l0.", ("b", "h", "f"))
    ops = g.order[:1]
    whole, part = g.structural_hash(), g.structural_hash(ops)
    view = g.resized(g.dims | {"f": 64})
    fresh = block("l0.", ("b", "h", "f"), f=64)  # the same graph built at the view's sizes
    assert view.structural_hash() == fresh.structural_hash() != whole
    assert view.structural_hash(ops) == fresh.structural_hash(fresh.order[:1]) != part
    assert g.structural_hash() == whole and g.structural_hash(ops) == part  # the graph's own entries untouched
    assert g.resized(dict(reversed(list(view.dims.items())))) is view  # one view per sizes, whatever the order
    copied = pickle.loads(pickle.dumps(view))  # a worker's copy: no memo carried, the same answers
    assert copied.structural_hash() == fresh.structural_hash() and copied.dims == view.dims


def test_batch_scaled_dims_follow_the_reshapes_and_views_are_memoized():
    """GShard MoE flattens (b, s) into tokens `bs` (a whole with a scaled part scales) and splits `bs` into groups
    (g, gs) (an outermost part of a scaled whole scales): {b, bs, g}, by hand; a GPT's only scaled dim is b. A
    microbatch view is the graph's memoized one, and its own scaled dims are the graph's."""
    from partopt import intra, models

    moe = models.generate("moe", hidden=64, layers=2, heads=4, experts=4, seq=32, vocab=128, batch=8, group_size=64)
    assert moe.batch_scaled_dims() == {"b", "bs", "g"}
    assert models.generate("gpt", hidden=64, layers=2, heads=4, seq=32, vocab=128, batch=8).batch_scaled_dims() == {"b"}
    view = intra.with_batch(moe, 2)
    assert (view.dims["b"], view.dims["bs"], view.dims["g"]) == (2, 64, 1) and view.dims["gs"] == 64
    assert intra.with_batch(moe, 2) is view and view.batch_scaled_dims() == moe.batch_scaled_dims()
    assert intra.with_batch(view, 8).dims == moe.dims
