"""What a backward keeps (`Graph.saved_for_backward`, `ops.backward_reads`, `sharding.kept_bytes`).

The expected sets are counted by hand from what each op's backward reads, as autograd saves it:
a product its operands, a norm its input, softmax and ReLU their output, an add nothing. The GPT block's
total is Korthikanti et al.'s 34·s·b·h + 5·a·s²·b (2022, §4.1) less what the IR has no op for: two dropout
masks (s·b·h each) and, unless the generator is asked for it, the attention dropout (3·a·s²·b).
"""

import pytest

from partopt import intra
from partopt import ops as opkinds
from partopt.errors import InstanceError
from partopt.cluster import preset
from partopt.graph import Graph, Op, Tensor
from partopt.models.gpt import gpt
from partopt.models.wresnet import wresnet
from partopt.sharding import kept_bytes, op_strategies

S, B, H, A = 64, 2, 128, 4  # sequence, batch, hidden, heads


def block(graph: Graph) -> list[Op]:
    return [op for op in graph.order if op.name.startswith("l0.")]


def test_a_gpt_block_keeps_what_its_backwards_read():
    graph = gpt(hidden=H, layers=2, heads=A, seq=S, vocab=512, batch=B)
    kept = {op.name for op in block(graph) if op.output in graph.saved_for_backward}
    assert kept == {
        "l0.ln1",  # read by the q/k/v projections (their x_t reshape is a view of it)
        "l0.q.add_bias", "l0.k.add_bias", "l0.v.add_bias",  # operands of the scores and the context
        "l0.probs",  # softmax's backward reads its output
        "l0.context",  # the output projection's input
        "l0.res1",  # the second norm's input
        "l0.ln2",  # the MLP's input
        "l0.fc1.add_bias",  # GELU's input
        "l0.gelu",  # fc2's input
        "l0.res2",  # read in the next layer (its norm's input)
    }
    total = sum(kept_bytes(graph, op) for op in block(graph))
    assert total == 32 * S * B * H + 2 * A * S * S * B  # fp16: 2 bytes per element


def test_attention_dropout_keeps_its_mask_and_output_as_korthikanti_counts_them():
    graph = gpt(hidden=H, layers=2, heads=A, seq=S, vocab=512, batch=B, attention_dropout=0.1)
    kept = {op.name for op in block(graph) if op.output in graph.saved_for_backward}
    # softmax's backward reads its output, the context's its input
    assert "l0.probs" in kept and "l0.attention_dropout" in kept
    total = sum(kept_bytes(graph, op) for op in block(graph))
    # the softmax output (2·a·s²·b), the dropout mask (a·s²·b, one byte), the dropped probabilities (2·a·s²·b):
    # Korthikanti et al.'s 5·a·s²·b; of their 34·s·b·h, the two hidden dropout masks (fused into
    # Megatron's bias-dropout-add, not ops here) are the 2·s·b·h missing
    assert total == 32 * S * B * H + 5 * A * S * S * B


def test_selective_recomputation_reruns_the_attention_dropout_with_the_core():
    graph = gpt(hidden=H, layers=1, heads=A, seq=S, vocab=512, batch=B, attention_dropout=0.1)
    rerun = intra.recomputed_ops(graph, block(graph), "selective")
    assert rerun == {"l0.scores", "l0.probs", "l0.attention_dropout", "l0.context"}  # Korthikanti et al.'s core
    with pytest.raises(InstanceError, match="not a probability"):
        gpt(hidden=H, layers=1, heads=A, seq=S, vocab=512, batch=B, attention_dropout=1.0)


def test_fused_attention_keeps_its_output_and_row_statistics_not_the_scores():
    graph = gpt(hidden=H, layers=2, heads=A, seq=S, vocab=512, batch=B, attention_kernel="flash")
    total = sum(kept_bytes(graph, op) for op in block(graph))
    lse = 4 * B * A * S  # one fp32 log-sum-exp per (batch, head, query)
    assert total == 32 * S * B * H + lse


def test_a_bottleneck_keeps_conv_outputs_and_relu_outputs_not_batch_norms_or_the_residual_add():
    graph = wresnet(depth=50, base_channels=8, width_factor=1, batch=2, image=32)
    layer = next(op.layer for op in graph.order if op.name.endswith(".proj"))  # the first projection shortcut
    first = [op for op in graph.order if op.layer == layer]
    names = {op.name.rsplit(".", 1)[-1]: op.output in graph.saved_for_backward for op in first}
    # conv outputs feed batch norms (which read their input); a batch norm's output feeds a relu
    # (which reads its own output) or the residual add (which reads nothing)
    # the stem shares the first block's layer: conv 7×7, BN, relu, max-pool (read by two convs)
    assert names == {"conv": True, "bn": False, "relu": True, "maxpool": True, "conv1": True, "bn1": False, "relu1": True, "conv2": True, "bn2": False, "relu2": True,
                     "conv3": True, "bn3": False, "proj": True, "bn_proj": False, "residual": False, "relu3": True}


@pytest.mark.parametrize("op, reads", [
    (Op("m", "einsum", ("x", "w"), "y"), ((True, True), False)),
    (Op("t", "einsum", ("x",), "y"), ((False,), False)),
    (Op("a", "elementwise", ("x", "b"), "y", attrs={"fn": "add"}), ((False, False), False)),
    (Op("r", "elementwise", ("x",), "y", attrs={"fn": "relu"}), ((False,), True)),
    (Op("g", "elementwise", ("x",), "y", attrs={"fn": "gelu"}), ((True,), False)),
    (Op("f", "elementwise", ("x",), "y", attrs={"fn": "gelu+mul"}), ((True,), False)),
    (Op("c", "elementwise", ("x",), "y", attrs={"fn": "mul"}), ((False,), False)),
    (Op("d", "elementwise", ("x",), "y", attrs={"fn": "dropout"}), ((False,), False)),  # its mask, not x or y
    (Op("p", "elementwise", ("x", "z"), "y", attrs={"fn": "mul"}), ((True, True), False)),
    (Op("s", "softmax", ("x",), "y"), ((False,), True)),
    (Op("n", "layernorm", ("x", "g", "b"), "y"), ((True, False, False), False)),
    (Op("sum", "reduce", ("x",), "y", attrs={"fn": "sum"}), ((False,), False)),
    (Op("max", "reduce", ("x",), "y", attrs={"fn": "max"}), ((True,), True)),
    (Op("o", "opaque", ("x",), "y"), ((True,), True)),
])
def test_backward_reads_by_kind(op, reads):
    assert opkinds.backward_reads(op) == reads


def chain(*kinds: tuple[str, dict, int]) -> Graph:
    """x[b,h] through one-input ops of the given (kind, attrs, layer): fp32, 4 bytes per element. A reshape
    renames h to g (`merge`), and the ops after it run on [b, g]."""
    tensors = {"x": Tensor("x", ("b", "h"), "input")}
    ops, prev, dims = [], "x", ("b", "h")
    for i, (kind, attrs, layer) in enumerate(kinds):
        if kind == "reshape":
            dims, attrs = ("b", "g"), {"merge": {"g": ["h"]}}
        tensors[f"y{i}"] = Tensor(f"y{i}", dims)
        ops.append(Op(f"op{i}", kind, (prev,), f"y{i}", layer, attrs))
        prev = f"y{i}"
    return Graph("chain", {"b": 8, "h": 16, "g": 16}, tensors, ops, "b", "fp32")


def test_a_reshape_of_a_kept_tensor_is_a_view_and_of_a_dropped_one_is_kept():
    relu, view, tanh = ("elementwise", {"fn": "relu"}, 0), ("reshape", {}, 0), ("elementwise", {"fn": "tanh"}, 0)
    add, gelu = ("elementwise", {"fn": "add"}, 0), ("elementwise", {"fn": "gelu"}, 0)
    # relu keeps its output; the reshape of it is the same elements; tanh keeps its own output
    assert chain(relu, view, tanh).saved_for_backward == {"y0", "y2"}
    # an add's output nobody's backward reads, but gelu's backward reads the reshape of it
    assert chain(add, view, gelu).saved_for_backward == {"y1", "y2"}


def test_an_output_read_in_another_layer_or_by_nobody_is_kept():
    graph = chain(("elementwise", {"fn": "add"}, 0), ("elementwise", {"fn": "add"}, 1), ("elementwise", {"fn": "add"}, 1))
    assert graph.saved_for_backward == {"y0", "y2"}  # y0 crosses into layer 1; y2 leaves the graph
    assert [kept_bytes(graph, op) for op in graph.ops] == [4 * 8 * 16, 0, 4 * 8 * 16]


def test_two_alike_ops_that_differ_only_in_what_reads_them_price_their_own_memory():
    # op0 and op2 are the same add of one tensor; gelu reads op0's output, a sum reads op2's
    graph = chain(("elementwise", {"fn": "add"}, 0), ("elementwise", {"fn": "gelu"}, 0),
                  ("elementwise", {"fn": "add"}, 0), ("reduce", {"fn": "mean"}, 0))
    graph.tensors["y3"] = Tensor("y3", ("b",))
    graph = Graph("chain", graph.dims, graph.tensors, graph.ops, "b", "fp32")
    mesh = preset("p3.16xlarge", 1).logical_mesh((1, 1), (1, 1))
    kept, dropped = (op_strategies(graph, graph.op_index[name], mesh)[0].memory_bytes for name in ("op0", "op2"))
    assert (kept, dropped) == (4 * 8 * 16, 0.0)
