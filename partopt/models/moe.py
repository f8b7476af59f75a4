"""GShard mixture-of-experts transformer: every second block's MLP becomes top-2 gated experts.

Extra dims: e experts, bs = b·s tokens, g groups of gs = group_size tokens, c expert capacity.
GShard writes the model dim M; here it is h, as in the rest of the zoo.
"""

from __future__ import annotations

from functools import partial

from partopt.errors import InstanceError
from partopt.graph import Graph
from partopt.models.builder import GraphBuilder, require_choice, require_divisible, require_positive
from partopt.models.transformer import ATTENTION_KERNELS, attention, decoder, gelu_mlp, tokens_dims


def expert_capacity(group_size: int, experts: int) -> int:
    """Tokens one expert takes from one group: 2·group_size / experts (top-2, capacity factor 1).

    Each token goes to at most two experts, so 2·N/E is an expert's even share of a group of N
    tokens (GShard, Lepikhin et al. 2020, §2.2; Alpa's `top2_gating` computes C = 2·S // E).
    """
    capacity = 2 * group_size // experts
    if capacity < 1:
        raise InstanceError(f"expert capacity 2·{group_size}/{experts} is below one token", "moe",
                            "use fewer experts or a larger group_size")
    return capacity


def _moe_dims(b: GraphBuilder, model: str, batch: int, seq: int, experts: int, group_size: int) -> None:
    require_divisible(model, "batch·seq", batch * seq, "group_size", group_size)
    b.dim("e", experts)
    b.dim("bs", batch * seq)
    b.dim("g", batch * seq // group_size)
    b.dim("gs", group_size)
    b.dim("c", expert_capacity(group_size, experts))


def moe_ffn(b: GraphBuilder, x: str) -> str:
    """Top-2 gated expert FFN on x[b,s,h] (GShard): group tokens, gate, dispatch, experts, combine.

    The routing mask is built from cheap ops: `top2` reduces the gates over the experts to each
    token's second-largest gate; `route` (elementwise, broadcast over c) keeps the gates that
    reach it, renormalised, each at the token's slot in its expert's buffer (tokens beyond the
    capacity are dropped); `dispatch_mask` is its nonzero pattern as bool.
    """
    flat = b.op("reshape", "flatten", [x], ("bs", "h"), merge={"bs": [b.batch_dim, "s"]})
    grouped = b.op("reshape", "group", [flat], ("g", "gs", "h"), split={"bs": ["g", "gs"]})
    logits = b.op("einsum", "gate", [grouped, b.param("wg", ("h", "e"))], ("g", "gs", "e"))
    gates = b.op("softmax", "gates", [logits], ("g", "gs", "e"), axes=["e"])
    second = b.op("reduce", "top2", [gates], ("g", "gs"), fn="second_max")
    combine = b.op("elementwise", "route", [gates, second], ("g", "gs", "e", "c"), fn="top2_slots")
    dispatch = b.op("elementwise", "dispatch_mask", [combine], ("g", "gs", "e", "c"), "bool", fn="nonzero")
    expert_in = b.op("einsum", "dispatch", [dispatch, grouped], ("e", "g", "c", "h"))
    hidden = b.linear("fc1", expert_in, ("e", "h", "f"), ("e", "g", "c", "f"), bias=False)
    act = b.op("elementwise", "relu", [hidden], ("e", "g", "c", "f"), fn="relu")
    expert_out = b.linear("fc2", act, ("e", "f", "h"), ("e", "g", "c", "h"), bias=False)
    combined = b.op("einsum", "combine", [combine, expert_out], ("g", "gs", "h"))
    flat = b.op("reshape", "ungroup", [combined], ("bs", "h"), merge={"bs": ["g", "gs"]})
    return b.op("reshape", "unflatten", [flat], tokens_dims(b, "h"), split={"bs": [b.batch_dim, "s"]})


def moe(hidden: int, layers: int, heads: int, experts: int, seq: int, vocab: int, batch: int,
        group_size: int = 2048, dtype: str = "fp16", ffn: int | None = None, optimizer: str = "adafactor",
        attention_kernel: str = "math", name: str | None = None) -> Graph:
    """GShard MoE language model: GPT blocks whose MLP is replaced by top-2 experts in every
    odd-numbered block (1, 3, …); feed-forward width `ffn` (default 8·hidden, as Alpa's suite);
    trained with Adafactor by default, as GShard and Alpa's MoE benchmark were; `attention_kernel` as gpt's.

    Parameters: ⌈l/2⌉ dense blocks of 4h² + 2hf + 9h + f, ⌊l/2⌋ MoE blocks of
    4h² + 8h + h·e + 2·e·h·f, plus (V + s)·h + 2h (tied embedding, positions, final LayerNorm).
    """
    ffn = 8 * hidden if ffn is None else ffn
    require_positive("moe", hidden=hidden, layers=layers, heads=heads, experts=experts, seq=seq, vocab=vocab,
                     batch=batch, group_size=group_size, ffn=ffn)
    require_divisible("moe", "hidden", hidden, "heads", heads)
    require_choice("moe", "attention_kernel", attention_kernel, ATTENTION_KERNELS)
    b = GraphBuilder(name or f"moe-h{hidden}-l{layers}-e{experts}", dtype, "b",
                     dict(b=batch, s=seq, t=seq, h=hidden, n=heads, d=hidden // heads, f=ffn, v=vocab), optimizer)
    _moe_dims(b, "moe", batch, seq, experts, group_size)
    attn = partial(attention, q_heads=("n",), kv_heads=("n",), bias=True, rotary=False, kernel=attention_kernel)
    return decoder(b, layers, "layernorm", attn, lambda k: moe_ffn if k % 2 else gelu_mlp, positions=True, tied=True)


def moe_layer(hidden: int, experts: int, seq: int, batch: int, group_size: int = 2048, ffn: int | None = None,
              dtype: str = "fp16", optimizer: str = "adafactor", name: str | None = None) -> Graph:
    """One GShard expert layer alone, x[b,s,h] -> y[b,s,h] (the intra-op test pattern).

    Parameters: h·e + 2·e·h·ffn (ffn defaults to 4·hidden here).
    """
    ffn = 4 * hidden if ffn is None else ffn
    require_positive("moe_layer", hidden=hidden, experts=experts, seq=seq, batch=batch, group_size=group_size,
                     ffn=ffn)
    b = GraphBuilder(name or f"moe-layer-h{hidden}-e{experts}", dtype, "b", dict(b=batch, s=seq, h=hidden, f=ffn), optimizer)
    _moe_dims(b, "moe_layer", batch, seq, experts, group_size)
    x = b.input("x", tokens_dims(b, "h"))
    with b.scope("l0", 0):
        b.mark_output(moe_ffn(b, x))
    return b.build()
