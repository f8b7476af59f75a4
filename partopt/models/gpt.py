"""Dense transformer generators: GPT-3/Megatron decoder, Llama decoder, BERT encoder layers.

Dims: b batch, s query positions, t key positions (= s), h hidden, n heads, d head dim,
f feed-forward width, v vocabulary; Llama adds g (kv-head groups) and r (query heads per group).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from partopt.errors import InstanceError
from partopt.graph import Graph
from partopt.models.builder import GraphBuilder, require_choice, require_divisible, require_positive
from partopt.models.transformer import (ATTENTION_KERNELS, LOSS_KERNELS, attention, block, decoder, gelu_mlp, swiglu_mlp,
                                        tokens_dims)


def gpt(hidden: int, layers: int, heads: int, seq: int, vocab: int, batch: int,
        dtype: str = "fp16", tied: bool = True, optimizer: str = "adam", attention_kernel: str = "math",
        attention_dropout: float = 0.0, loss_kernel: str = "fused", name: str | None = None) -> Graph:
    """GPT-3 / Megatron-LM decoder: learned positions, pre-LayerNorm blocks with biases, 4h MLP;
    `attention_kernel` "math" (scores, softmax, context) or "flash" (one fused causal op);
    `loss_kernel` "fused" (one pass over the logits each way) or "unfused" (Megatron-LM's cross entropy: the
    logits in fp32, six passes; `ops.is_unfused_loss`, docs/COSTMODEL.md §3).
    `attention_dropout`: the probability attention probabilities are dropped with (Megatron-LM's
    `--attention-dropout`, 0.1 by default there; 0 here, as partopt's other generators): above 0 the math
    path runs a dropout op between softmax and context (docs/models.md); its value does not change a price.

    Parameters: 12·l·h² + 13·l·h + (V + s)·h + 2h (the final LayerNorm), + V·h when untied.
    """
    require_positive("gpt", hidden=hidden, layers=layers, heads=heads, seq=seq, vocab=vocab, batch=batch)
    require_divisible("gpt", "hidden", hidden, "heads", heads)
    require_choice("gpt", "attention_kernel", attention_kernel, ATTENTION_KERNELS)
    require_choice("gpt", "loss_kernel", loss_kernel, LOSS_KERNELS)
    if not 0.0 <= attention_dropout < 1.0:
        raise InstanceError(f"attention_dropout {attention_dropout} is not a probability below 1",
                            "gpt(attention_dropout=...)", "give a probability in [0, 1), e.g. Megatron-LM's default 0.1")
    b = GraphBuilder(name or f"gpt-h{hidden}-l{layers}", dtype, "b",
                     dict(b=batch, s=seq, t=seq, h=hidden, n=heads, d=hidden // heads, f=4 * hidden, v=vocab), optimizer)
    attn = partial(attention, q_heads=("n",), kv_heads=("n",), bias=True, rotary=False, kernel=attention_kernel,
                   dropout=attention_dropout > 0)
    return decoder(b, layers, "layernorm", attn, lambda k: gelu_mlp, positions=True, tied=tied, architecture=dict(
        layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, seq=seq, vocab=vocab, norm="layernorm",
        mlp="gelu", positions="learned", tied=tied, bias=True, attention_dropout=attention_dropout),
        loss_kernel=loss_kernel)


def llama(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, seq: int, vocab: int, batch: int,
          dtype: str = "bf16", optimizer: str = "adam", attention_kernel: str = "math", head_dim: int | None = None,
          loss_kernel: str = "fused", name: str | None = None) -> Graph:
    """Llama decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases,
    untied head; `attention_kernel` and `loss_kernel` as gpt's; `head_dim` d, by default h / heads (Mistral-Nemo's and
    Qwen3's are wider: the attention is then heads·d wide, not h).

    Query heads are dims (g, r): `g` = kv_heads groups of `r` = heads / kv_heads query heads that
    share one key/value head. Parameters: l·(2h·n·d + 2h·g·d + 3h·f + 2h) + 2V·h + h, n = heads.
    """
    require_positive("llama", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     seq=seq, vocab=vocab, batch=batch)
    if head_dim is None:
        require_divisible("llama", "hidden", hidden, "heads", heads)
    else:
        require_positive("llama", head_dim=head_dim)
    require_divisible("llama", "heads", heads, "kv_heads", kv_heads)
    require_choice("llama", "attention_kernel", attention_kernel, ATTENTION_KERNELS)
    require_choice("llama", "loss_kernel", loss_kernel, LOSS_KERNELS)
    d = head_dim or hidden // heads
    b = GraphBuilder(name or f"llama-h{hidden}-l{layers}", dtype, "b",
                     dict(b=batch, s=seq, t=seq, h=hidden, g=kv_heads, r=heads // kv_heads, d=d, f=ffn, v=vocab),
                     optimizer)
    attn = partial(attention, q_heads=("g", "r"), kv_heads=("g",), bias=False, rotary=True, kernel=attention_kernel)
    return decoder(b, layers, "rmsnorm", attn, lambda k: swiglu_mlp, positions=False, tied=False,
                   architecture=llama_architecture(layers, hidden, heads, kv_heads, ffn, seq, vocab, head_dim=d),
                   loss_kernel=loss_kernel)


def llama_architecture(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, vocab: int,
                       tied: bool = False, bias: bool = False, head_dim: int | None = None,
                       qkv_bias: bool = False, rope_base: int | None = None, norm_eps: float | None = None,
                       rope_scaling: str | None = None, rope_scaling_factor: float | None = None) -> dict[str, Any]:
    """A Llama's `Graph.architecture`: RMSNorm, SwiGLU, rotary positions, no dropout; the generator's is untied and
    unbiased, a Hugging Face config may say otherwise (`frontends.torch.from_hf_config`). `head_dim` is recorded
    only where it is not hidden / heads (Megatron-LM's default `--kv-channels`), `qkv_bias` only where the query,
    key and value projections alone have biases (Qwen2's, Megatron-LM's `--add-qkv-bias`); `rope_base` (the rotary
    embedding's theta), `norm_eps` and a rotary scaling (`rope_scaling`, the config's rope_type: "llama3" for
    Llama 3.1's, whose fixed frequency bands Megatron-LM's --use-rope-scaling applies; its `rope_scaling_factor`)
    where the model's own are known (a config's): they do not change the cost, but a runtime left to its defaults
    would train another model."""
    record = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, seq=seq, vocab=vocab,
                  norm="rmsnorm", mlp="swiglu", positions="rotary", tied=tied, bias=bias, attention_dropout=0.0)
    if head_dim is not None and head_dim * heads != hidden:
        record["head_dim"] = head_dim
    if qkv_bias and not bias:
        record["qkv_bias"] = True
    if rope_base is not None:
        record["rope_base"] = rope_base
    if norm_eps is not None:
        record["norm_eps"] = norm_eps
    if rope_scaling is not None:
        record["rope_scaling"] = rope_scaling
    if rope_scaling_factor is not None:
        record["rope_scaling_factor"] = rope_scaling_factor
    return record


def bert(hidden: int, layers: int, heads: int, seq: int, batch: int, dtype: str = "fp16",
         optimizer: str = "adam", attention_kernel: str = "math", name: str | None = None) -> Graph:
    """A stack of BERT encoder layers (post-LayerNorm, biases, 4h gelu MLP) from an input
    x[b,s,h] to an output y[b,s,h]; no embeddings or loss (the intra-op test pattern); attention
    unmasked, `attention_kernel` as gpt's.

    Parameters: l·(12h² + 13h).
    """
    require_positive("bert", hidden=hidden, layers=layers, heads=heads, seq=seq, batch=batch)
    require_divisible("bert", "hidden", hidden, "heads", heads)
    require_choice("bert", "attention_kernel", attention_kernel, ATTENTION_KERNELS)
    b = GraphBuilder(name or f"bert-h{hidden}-l{layers}", dtype, "b",
                     dict(b=batch, s=seq, t=seq, h=hidden, n=heads, d=hidden // heads, f=4 * hidden), optimizer)
    attn = partial(attention, q_heads=("n",), kv_heads=("n",), bias=True, rotary=False, kernel=attention_kernel,
                   causal=False)
    x = b.input("x", tokens_dims(b, "h"))
    for k in range(layers):
        with b.scope(f"l{k}", k):
            x = block(b, x, "layernorm", attn, gelu_mlp, pre_norm=False)
    b.mark_output(x)
    return b.build()
