"""Transformer pieces shared by the GPT, Llama, BERT and MoE generators.

Activations between blocks are x[b, s, h]. Keys and values live over the key positions `t`
(same size as `s`): the normalised x is renamed s -> t by a one-part `reshape` merge.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from partopt.graph import Graph
from partopt.models.builder import GraphBuilder

Sublayer = Callable[[GraphBuilder, str], str]


def tokens_dims(b: GraphBuilder, *rest: str) -> tuple[str, ...]:
    """Dims of a per-token tensor: batch, sequence, then `rest`."""
    return (b.batch_dim, "s", *rest)


def norm(b: GraphBuilder, name: str, x: str, kind: str) -> str:
    """LayerNorm (scale and shift) or RMSNorm (scale only) over the last dim of x."""
    channel = b.dims_of(x)[-1]
    params = [b.param(f"{name}.scale", [channel])]
    if kind == "layernorm":
        params.append(b.param(f"{name}.shift", [channel]))
    return b.op(kind, name, [x, *params], b.dims_of(x))


ATTENTION_KERNELS = ("math", "flash")
LOSS_KERNELS = ("fused", "unfused")  # the cross entropy's op attribute `fused` true or false (`ops.is_unfused_loss`)


def attention(b: GraphBuilder, x: str, q_heads: Sequence[str], kv_heads: Sequence[str],
              bias: bool, rotary: bool, kernel: str = "math", causal: bool = True, dropout: bool = False) -> str:
    """Self-attention on normalised x[b,s,h]: per-head Q over `s`, K and V over `t`.

    `q_heads` are the query-head dims (("n",) for MHA, ("g", "r") for grouped-query attention),
    `kv_heads` the key/value-head dims (("n",) or ("g",)). `kernel` "math": the scores, their softmax
    and the context as three ops (the 1/sqrt(d) scale and the mask belong to the softmax, as in
    Megatron's fused softmax kernel); "flash": one fused `attention` op (FlashAttention: the scores
    never reach memory), `causal` in decoders. `dropout`: the math path drops attention probabilities in a
    kernel of its own (Megatron-LM's `--attention-dropout`), before the context; FlashAttention drops them
    inside its kernel, which costs no bytes, so the flash path has no op for it.
    """
    q = b.linear("q", x, ("h", *q_heads, "d"), tokens_dims(b, *q_heads, "d"), bias)
    x_t = b.op("reshape", "x_t", [x], (b.batch_dim, "t", "h"), merge={"t": ["s"]})
    kv_dims = (b.batch_dim, "t", *kv_heads, "d")
    k = b.linear("k", x_t, ("h", *kv_heads, "d"), kv_dims, bias)
    v = b.linear("v", x_t, ("h", *kv_heads, "d"), kv_dims, bias)
    if rotary:
        q = b.op("elementwise", "q_rope", [q], b.dims_of(q), fn="rotary")
        k = b.op("elementwise", "k_rope", [k], kv_dims, fn="rotary")
    if kernel == "flash":
        context = b.op("attention", "attention", [q, k, v], tokens_dims(b, *q_heads, "d"), causal=causal)
        return b.linear("proj", context, (*q_heads, "d", "h"), tokens_dims(b, "h"), bias)
    score_dims = (b.batch_dim, *q_heads, "s", "t")
    scores = b.op("einsum", "scores", [q, k], score_dims)
    probs = b.op("softmax", "probs", [scores], score_dims, axes=["t"])
    if dropout:
        probs = b.op("elementwise", "attention_dropout", [probs], score_dims, fn="dropout")
    context = b.op("einsum", "context", [probs, v], tokens_dims(b, *q_heads, "d"))
    return b.linear("proj", context, (*q_heads, "d", "h"), tokens_dims(b, "h"), bias)


def gelu_mlp(b: GraphBuilder, x: str) -> str:
    """h -> f (+bias), gelu, f -> h (+bias)."""
    up = b.linear("fc1", x, ("h", "f"), tokens_dims(b, "f"), bias=True)
    act = b.op("elementwise", "gelu", [up], tokens_dims(b, "f"), fn="gelu")
    return b.linear("fc2", act, ("f", "h"), tokens_dims(b, "h"), bias=True)


def swiglu_mlp(b: GraphBuilder, x: str) -> str:
    """SwiGLU: silu(x·W_gate) * (x·W_up), then · W_down; no biases."""
    gate = b.linear("gate", x, ("h", "f"), tokens_dims(b, "f"), bias=False)
    up = b.linear("up", x, ("h", "f"), tokens_dims(b, "f"), bias=False)
    act = b.op("elementwise", "silu", [gate], tokens_dims(b, "f"), fn="silu")
    glu = b.op("elementwise", "glu", [act, up], tokens_dims(b, "f"), fn="mul")
    return b.linear("down", glu, ("f", "h"), tokens_dims(b, "h"), bias=False)


def block(b: GraphBuilder, x: str, norm_kind: str, attn: Sublayer, ffn: Sublayer, pre_norm: bool = True) -> str:
    """One transformer block with two residual sublayers.

    Pre-norm (GPT, Llama): x + attn(norm(x)), then + ffn(norm(.)). Post-norm (BERT):
    norm(x + attn(x)), then norm(. + ffn(.)).
    """
    dims = b.dims_of(x)
    if pre_norm:
        x = b.op("elementwise", "res1", [x, attn(b, norm(b, "ln1", x, norm_kind))], dims, fn="add")
        return b.op("elementwise", "res2", [x, ffn(b, norm(b, "ln2", x, norm_kind))], dims, fn="add")
    x = norm(b, "ln1", b.op("elementwise", "res1", [x, attn(b, x)], dims, fn="add"), norm_kind)
    return norm(b, "ln2", b.op("elementwise", "res2", [x, ffn(b, x)], dims, fn="add"), norm_kind)


def embed_tokens(b: GraphBuilder, tokens: str, positions: bool) -> str:
    """Token embedding wte[v,h] (and, with `positions`, a learned wpe[s,h] added) -> x[b,s,h]."""
    x = b.op("embedding", "tokens", [tokens, b.param("wte", ("v", "h"))], tokens_dims(b, "h"))
    if positions:
        x = b.op("elementwise", "positions", [x, b.param("wpe", ("s", "h"))], tokens_dims(b, "h"), fn="add")
    return x


def lm_head(b: GraphBuilder, x: str, labels: str, norm_kind: str, tied_table: str | None,
            loss_kernel: str = "fused") -> str:
    """Final norm, logits over the vocabulary (tied to the embedding table or a new w[h,v]),
    cross entropy against the labels: the scalar loss (role output), run as `loss_kernel` says (`LOSS_KERNELS`;
    "unfused" writes the op's attribute `fused` false)."""
    x = norm(b, "ln", x, norm_kind)
    table = tied_table if tied_table is not None else b.param("w", ("h", "v"))
    logits = b.op("einsum", "logits", [x, table], tokens_dims(b, "v"))
    attrs = {"fused": False} if loss_kernel == "unfused" else {}
    return b.mark_output(b.op("cross_entropy", "loss", [logits, labels], (), **attrs))


def decoder(b: GraphBuilder, layers: int, norm_kind: str, attn: Sublayer, ffn_of: Callable[[int], Sublayer],
            positions: bool, tied: bool, architecture: dict[str, Any] | None = None, loss_kernel: str = "fused") -> Graph:
    """A language model: token (and position) embedding in layer 0, `layers` pre-norm blocks
    (block k's feed-forward is `ffn_of(k)`), final norm, LM head and loss (`lm_head`'s `loss_kernel`) in the last
    layer; `architecture`: the generator's record of it (`Graph.architecture`)."""
    tokens, labels = b.input("tokens", ("b", "s"), "int32"), b.input("labels", ("b", "s"), "int32")
    with b.scope("embed", 0):
        x = embed_tokens(b, tokens, positions=positions)
    for k in range(layers):
        with b.scope(f"l{k}", k):
            x = block(b, x, norm_kind, attn, ffn_of(k))
    with b.scope("head", layers - 1):
        lm_head(b, x, labels, norm_kind, "embed.wte" if tied else None, loss_kernel)
    return b.build(architecture)
