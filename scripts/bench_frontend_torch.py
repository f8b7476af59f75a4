"""Time `partopt.frontends.torch.from_hf_config` on full-size Hugging Face configs (meta device,
median of 3 runs) and check each import against partopt's generator of the same shape (attention fused,
the import's default)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import GPT2Config, LlamaConfig  # noqa: E402

from partopt.frontends.torch import from_hf_config  # noqa: E402
from partopt.models import gpt, llama  # noqa: E402
from bench_generate import median_seconds  # noqa: E402  (scripts/ is on the path when run as a script)

RUNS = 3
CASES = {
    # name: (config, import sizes, the generator's graph of the same model)
    "gpt2-124m": (lambda: GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
                  dict(batch=8, seq=1024, dtype="fp16"),
                  lambda: gpt(hidden=768, layers=12, heads=12, seq=1024, vocab=50257, batch=8, attention_kernel="flash")),
    "gpt2-1.5b": (lambda: GPT2Config(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024),
                  dict(batch=8, seq=1024, dtype="fp16"),
                  lambda: gpt(hidden=1600, layers=48, heads=25, seq=1024, vocab=50257, batch=8,
                              attention_kernel="flash")),
    "llama-2-7b": (lambda: LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                       max_position_embeddings=4096),
                   dict(batch=8, seq=4096, dtype="bf16"),
                   lambda: llama(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, seq=4096, vocab=32000, batch=8,
                                 attention_kernel="flash")),
    "llama-2-70b": (lambda: LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                                        max_position_embeddings=4096),
                    dict(batch=8, seq=4096, dtype="bf16"),
                    lambda: llama(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, seq=4096, vocab=32000, batch=8,
                                  attention_kernel="flash")),
}


def main() -> None:
    """Print, per config: ops, parameters, import time, and whether parameters and FLOPs equal the generator's."""
    print("| config | ops | params (B) | import (s) | params = generator | forward FLOPs = generator |")
    print("|---|---:|---:|---:|---|---|")
    for name, (config, sizes, generator) in CASES.items():
        graph = from_hf_config(config(), **sizes)
        seconds = median_seconds(lambda c=config, s=sizes: from_hf_config(c(), **s), RUNS)
        ref = generator()
        print(f"| {name} | {len(graph.ops)} | {graph.num_params / 1e9:.3f} | {seconds:.1f} "
              f"| {graph.num_params == ref.num_params} | {graph.forward_flops == ref.forward_flops} |")


if __name__ == "__main__":
    main()
