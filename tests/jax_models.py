"""Models written in plain JAX for the frontend tests and docs/FRONTENDS.md (`tests/jax_models.py:make_model`).

`gpt_loss` is the GPT of `partopt.models.gpt` (learned positions, pre-LayerNorm blocks with biases,
4h gelu MLP, tied LM head, softmax cross-entropy), written the way a JAX user would write it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

CONFIG = dict(hidden=64, layers=2, heads=4, seq=32, vocab=128, batch=8)  # small: tests and docs run it on CPU


def _layernorm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["shift"]


def _block(x: jax.Array, p: dict[str, Any]) -> jax.Array:
    h = _layernorm(x, p["ln1"])
    a = p["attn"]
    q = jnp.einsum("bsh,hnd->bsnd", h, a["wq"]) + a["bq"]
    k = jnp.einsum("bsh,hnd->bsnd", h, a["wk"]) + a["bk"]
    v = jnp.einsum("bsh,hnd->bsnd", h, a["wv"]) + a["bv"]
    seq, head_dim = x.shape[1], q.shape[-1]
    scores = jnp.einsum("bsnd,btnd->bnst", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    context = jnp.einsum("bnst,btnd->bsnd", probs, v)
    x = x + (jnp.einsum("bsnd,ndh->bsh", context, a["wo"]) + a["bo"])
    m = p["mlp"]
    h = jax.nn.gelu(_layernorm(x, p["ln2"]) @ m["w1"] + m["b1"])
    return x + (h @ m["w2"] + m["b2"])


def gpt_loss(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of the GPT on `batch` (tokens, labels: int32 [batch, seq])."""
    x = params["wte"][batch["tokens"]] + params["wpe"][None]
    for i, p in enumerate(params["blocks"]):
        with jax.named_scope(f"block_{i}"):
            x = _block(x, p)
    logits = _layernorm(x, params["ln_f"]) @ params["wte"].T
    logp = jax.nn.log_softmax(logits)
    return -(logp * jax.nn.one_hot(batch["labels"], logits.shape[-1])).sum(-1).mean()


def gpt_scan_loss(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    """The same GPT with its blocks' parameters stacked and the blocks run by `jax.lax.scan`."""
    x = params["wte"][batch["tokens"]] + params["wpe"][None]
    x, _ = jax.lax.scan(lambda carry, p: (_block(carry, p), None), x, params["blocks"])
    logits = _layernorm(x, params["ln_f"]) @ params["wte"].T
    logp = jax.nn.log_softmax(logits)
    return -(logp * jax.nn.one_hot(batch["labels"], logits.shape[-1])).sum(-1).mean()


def gpt_shapes(hidden: int, layers: int, heads: int, seq: int, vocab: int, batch: int,
               dtype: Any = jnp.float32, stacked: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Abstract (params, batch) of the GPT: jax.ShapeDtypeStruct leaves, nothing allocated."""
    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    d = hidden // heads
    norm = {"scale": s(hidden), "shift": s(hidden)}
    block = {"ln1": norm, "ln2": norm,
             "attn": {"wq": s(hidden, heads, d), "bq": s(heads, d), "wk": s(hidden, heads, d), "bk": s(heads, d),
                      "wv": s(hidden, heads, d), "bv": s(heads, d), "wo": s(heads, d, hidden), "bo": s(hidden)},
             "mlp": {"w1": s(hidden, 4 * hidden), "b1": s(4 * hidden), "w2": s(4 * hidden, hidden), "b2": s(hidden)}}
    if stacked:
        blocks: Any = jax.tree_util.tree_map(lambda a: s(layers, *a.shape), block)
    else:
        blocks = [block] * layers
    params = {"wte": s(vocab, hidden), "wpe": s(seq, hidden), "blocks": blocks, "ln_f": norm}
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return params, {"tokens": ids, "labels": ids}


def make_model() -> tuple[Any, tuple[Any, ...]]:
    """The contract of `partopt import jax`: (loss function, abstract arguments with params first)."""
    return gpt_loss, gpt_shapes(**CONFIG)


def make_scan_model() -> tuple[Any, tuple[Any, ...]]:
    """The scanned GPT, for `partopt import jax tests/jax_models.py:make_scan_model`."""
    return gpt_scan_loss, gpt_shapes(**CONFIG, stacked=True)


def mlp_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error of a two-layer ReLU MLP: the smallest model whose plans `verify` checks."""
    h = jax.nn.relu(batch["x"] @ params["w1"])
    return ((h @ params["w2"] - batch["y"]) ** 2).mean()


def make_mlp() -> tuple[Any, tuple[Any, ...]]:
    """A 2-layer MLP, batch 16, 64 -> 256 -> 64 (`partopt verify` tests)."""
    s = jax.ShapeDtypeStruct
    params = {"w1": s((64, 256), jnp.float32), "w2": s((256, 64), jnp.float32)}
    return mlp_loss, (params, {"x": s((16, 64), jnp.float32), "y": s((16, 64), jnp.float32)})


def tied_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Cross-entropy of a tied-embedding bigram model: the table is read by the lookup and the LM head."""
    h = jnp.tanh(params["wte"][batch["tokens"]]) * params["scale"]
    logp = jax.nn.log_softmax(h @ params["wte"].T)
    return -(logp * jax.nn.one_hot(batch["labels"], logp.shape[-1])).sum(-1).mean()


def make_tied() -> tuple[Any, tuple[Any, ...]]:
    """The tied model, batch 8, sequence 16, vocabulary 128, width 32 (`partopt verify` tests)."""
    s = jax.ShapeDtypeStruct
    params = {"wte": s((128, 32), jnp.float32), "scale": s((32,), jnp.float32)}
    ids = s((8, 16), jnp.int32)
    return tied_loss, (params, {"tokens": ids, "labels": ids})
