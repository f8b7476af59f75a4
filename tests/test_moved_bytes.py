"""The bytes an op's forward and backward kernels read and write (sharding.moved_bytes), counted by hand
from what each kernel reads and writes (docs/COSTMODEL.md §3, "Bytes moved"), and the forward's share of
an op's time that follows from them."""

from __future__ import annotations

import pytest

from partopt.cluster import preset
from partopt.models.builder import GraphBuilder
from partopt.sharding import forward_share, kept_bytes, moved_bytes

B, S, H, V = 4, 8, 16, 32
WORD = 2  # bf16
N = B * S * H * WORD  # bytes of one activation x[b, s, h]
A100 = preset("dgx-a100").device  # where a relu or an add is memory-bound: its time follows its bytes


def _graph():
    """embedding → x; ln(x) → relu → + bias → + x → a norm over the batch → softmax → · W."""
    g = GraphBuilder("bytes", "bf16", "b", {"b": B, "s": S, "h": H, "f": H, "v": V})
    tokens = g.input("tokens", ("b", "s"), "int32")
    x = g.op("embedding", "embed", [tokens, g.param("table", ("v", "h"))], ("b", "s", "h"))
    y = g.op("layernorm", "ln", [x, g.param("ln.scale", ["h"]), g.param("ln.shift", ["h"])], ("b", "s", "h"))
    y = g.op("elementwise", "relu", [y], ("b", "s", "h"), fn="relu")
    y = g.op("elementwise", "bias", [y, g.param("bias.b", ["h"])], ("b", "s", "h"), fn="add")
    y = g.op("elementwise", "residual", [y, x], ("b", "s", "h"), fn="add")
    y = g.op("layernorm", "bn", [y, g.param("bn.scale", ["h"]), g.param("bn.shift", ["h"])], ("b", "s", "h"),
             axes=["b", "s"])
    y = g.op("softmax", "probs", [y], ("b", "s", "h"), axes=["h"])
    g.mark_output(g.op("einsum", "fc", [y, g.param("fc.w", ("h", "f"))], ("b", "s", "f")))
    return g.build()


def _moved(graph, name):
    op = graph.op_index[name]
    return moved_bytes(graph, op)


@pytest.fixture(scope="module")
def graph():
    return _graph()


def test_a_matmuls_backward_moves_twice_its_forward(graph):
    forward = N + H * H * WORD + N  # read x and W, write y
    # dx = dy·Wᵀ reads dy and W, writes dx; dW = xᵀ·dy reads x and dy, writes dW
    assert _moved(graph, "fc") == pytest.approx((forward, (N + H * H * WORD + N) + (N + N + H * H * WORD)))
    assert forward_share(graph, graph.op_index["fc"], A100) == pytest.approx(1 / 3)


def test_a_relus_backward_reads_its_output_and_the_gradient_and_writes_one(graph):
    assert _moved(graph, "relu") == (2 * N, 3 * N)
    assert forward_share(graph, graph.op_index["relu"], A100) == pytest.approx(2 / 5)


def test_an_add_hands_the_gradient_on_and_reduces_it_for_a_broadcast_input(graph):
    assert _moved(graph, "residual") == (3 * N, 0)  # both inputs take dy as it is: no kernel
    bias = H * WORD
    assert _moved(graph, "bias") == (N + bias + N, N + bias)  # d bias = Σ dy over b, s: read dy, write h
    # recomputing it costs nearly all of it: its backward moves no bytes, only its FLOPs (one per element) remain
    forward = 3 * N / (A100.memory_bandwidth * A100.memory_efficiency)
    backward = B * S * H / A100.peak("fp32")
    assert forward_share(graph, graph.op_index["residual"], A100) == pytest.approx(forward / (forward + backward))


def test_a_row_norm_is_one_pass_each_way_and_a_batch_norm_adds_a_statistics_pass(graph):
    params = 2 * H * WORD
    # forward: read x and the scale and shift, write y; backward: read dy and x, write dx, d scale, d shift
    assert _moved(graph, "ln") == (N + params + N, N + N + N + params)
    # statistics over the batch span the whole tensor: a reduction pass reads x before the normalising one,
    # and the backward's reduction reads dy and x before its elementwise pass
    assert _moved(graph, "bn") == (2 * N + params + N, (N + N + N + params) + (N + N))


def test_softmax_reads_its_output_back(graph):
    assert _moved(graph, "probs") == (2 * N, 3 * N)  # backward: y, dy in; dx out


def test_a_dropout_writes_its_mask_forward_and_reads_it_backward():
    g = GraphBuilder("dropout", "bf16", "b", {"b": B, "s": S, "h": H})
    x = g.op("elementwise", "act", [g.input("x", ("b", "s", "h"))], ("b", "s", "h"), fn="gelu")
    g.mark_output(g.op("elementwise", "drop", [x], ("b", "s", "h"), fn="dropout"))
    graph = g.build()
    mask = B * S * H  # one byte per element
    assert _moved(graph, "drop") == (2 * N + mask, N + mask + N)  # forward x in, y and mask out; backward dy, mask in
    assert kept_bytes(graph, graph.op_index["drop"]) == N + mask  # its output leaves the graph, and the mask


def test_an_embedding_writes_its_tables_gradient_and_none_for_the_token_ids(graph):
    tokens, table = B * S * 4, V * H * WORD
    assert _moved(graph, "embed") == (tokens + table + N, N + table)  # backward: read dy, write d table


def _loss_graph(dtype: str, kernel: str | None):
    """x · W → logits[b, s, v] → cross entropy against the labels (Megatron-LM's, unfused, or the one-pass kernel)."""
    g = GraphBuilder("loss", dtype, "b", {"b": B, "s": S, "h": H, "v": V})
    logits = g.op("einsum", "logits", [g.input("x", ("b", "s", "h")), g.param("w", ("h", "v"))], ("b", "s", "v"))
    attrs = {} if kernel is None else {"fused": kernel == "fused"}
    g.mark_output(g.op("cross_entropy", "loss", [logits, g.input("labels", ("b", "s"), "int32")], (), **attrs))
    return g.build()


@pytest.mark.parametrize("dtype, word", [("bf16", 2), ("fp32", 4)])
def test_an_unfused_cross_entropy_makes_megatron_lms_passes_over_the_fp32_logits(dtype, word):
    """Megatron-LM's vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py at r0.8.0), kernel by
    kernel over logits of x bytes, X in fp32: forward .float() (read x, write X), max (read X), subtract, exp (read
    and write X each, in place), sum (read X), divide (read and write X), the labels read and the loss written;
    backward the loss's gradient read, mul_ (read and write X) and the cast back to the logits' dtype (read X, write
    x). fp32 logits need no cast. The one-pass kernel reads x and the labels forward, writes the loss; backward reads
    the loss's gradient and x, writes dx."""
    x, X, labels, loss = B * S * V * word, B * S * V * 4, B * S * 4, word
    cast = x + X if word == 2 else 0
    assert _moved(_loss_graph(dtype, "unfused"), "loss") == (cast + X + 2 * X + 2 * X + X + 2 * X + labels + loss,
                                                             loss + 2 * X + cast)
    assert _moved(_loss_graph(dtype, None), "loss") == (x + labels + loss, loss + x + x)


def test_an_unfused_cross_entropy_keeps_its_fp32_softmax_in_place_of_the_logits():
    """Its backward reads the softmax it saved (fp32), not the logits: the logits GEMM keeps nothing for it, and the
    loss keeps B·S·V fp32 values, split as its logits are (a vocab-parallel strategy holds 1/tp of them)."""
    from partopt.cluster import preset as cluster_preset
    from partopt.sharding import op_strategies, unfused_loss_kept

    unfused, fused = _loss_graph("bf16", "unfused"), _loss_graph("bf16", None)
    assert kept_bytes(fused, fused.op_index["logits"]) == B * S * V * 2  # the one-pass kernel reads the logits back
    assert kept_bytes(unfused, unfused.op_index["logits"]) == 0
    assert unfused_loss_kept(unfused, unfused.op_index["loss"]) == B * S * V * 4
    mesh = cluster_preset("dgx-a100", 1).logical_mesh((1, 4), (1, 4))
    split = [s for s in op_strategies(unfused, unfused.op_index["loss"], mesh) if s.axes == (None, "v")]
    assert kept_bytes(unfused, unfused.op_index["loss"]) == WORD  # the loss itself, the graph's output
    assert [s.memory_bytes for s in split] == [B * S * V * 4 / 4 + WORD]


def test_a_cross_entropy_fused_attribute_that_is_not_a_boolean_is_refused():
    from partopt.errors import InstanceError
    from partopt.io import graph_from_dict, graph_to_dict

    data = graph_to_dict(_loss_graph("bf16", "unfused"))
    next(op for op in data["ops"] if op["name"] == "loss")["attrs"]["fused"] = "no"
    with pytest.raises(InstanceError, match="expected boolean") as info:
        graph_from_dict(data)
    assert "loss" in info.value.where
