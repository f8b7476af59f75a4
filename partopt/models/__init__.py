"""The model zoo: generators returning validated Graphs, and the named models of the corpus.

`generate("gpt", hidden=..., ...)` builds any generator by name; `preset("gpt-39b")` builds a
named model of Alpa's benchmark suite (REFERENCE §3) or of the other corpus entries.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping

from partopt.errors import InstanceError
from partopt.graph import Graph
from partopt.models.flops import FlopSplit, flop_split
from partopt.models.gpt import bert, gpt, llama
from partopt.models.moe import expert_capacity, moe, moe_layer
from partopt.models.wresnet import wresnet

MODELS: dict[str, Callable[..., Graph]] = {
    "gpt": gpt, "llama": llama, "bert": bert, "moe": moe, "moe-layer": moe_layer, "wresnet": wresnet,
}


def _gpt(hidden: int, layers: int, heads: int) -> tuple[str, dict[str, Any]]:
    return "gpt", dict(hidden=hidden, layers=layers, heads=heads, seq=1024, vocab=51200, batch=1024)


def _moe(hidden: int, layers: int, experts: int) -> tuple[str, dict[str, Any]]:
    return "moe", dict(hidden=hidden, layers=layers, heads=16, experts=experts, seq=1024, vocab=32000,
                       batch=1024, group_size=2048)


def _wresnet(depth: int, base: int, width: int, batch: int = 1536) -> tuple[str, dict[str, Any]]:
    return "wresnet", dict(depth=depth, base_channels=base, width_factor=width, batch=batch)


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> tuple[str, dict[str, Any]]:
    return "llama", dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, seq=4096,
                         vocab=32000, batch=1024)


# Alpa's weak-scaling suite (REFERENCE §3: batch 1024 × seq 1024 for GPT and MoE, 1536 images
# for Wide-ResNet, 1520 for 13B); Llama-2 shapes with 4M-token batches; two small test graphs.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-350m": _gpt(1024, 24, 16),
    "gpt-760m": _gpt(1536, 24, 16),
    "gpt-1.3b": _gpt(2048, 24, 32),
    "gpt-2.6b": _gpt(2560, 32, 32),
    "gpt-6.7b": _gpt(4096, 32, 32),
    "gpt-15b": _gpt(5120, 48, 40),
    "gpt-39b": _gpt(8192, 48, 64),
    "moe-380m": _moe(768, 8, 8),
    "moe-690m": _moe(768, 8, 16),
    "moe-1.3b": _moe(768, 16, 16),
    "moe-2.4b": _moe(1024, 16, 16),
    "moe-10b": _moe(1536, 16, 32),
    "moe-27b": _moe(2048, 16, 48),
    "moe-70b": _moe(2048, 32, 64),
    "wresnet-250m": _wresnet(50, 160, 2),
    "wresnet-500m": _wresnet(50, 224, 2),
    "wresnet-1b": _wresnet(50, 320, 2),
    "wresnet-2b": _wresnet(50, 448, 2),
    "wresnet-4b": _wresnet(50, 640, 2),
    "wresnet-6.8b": _wresnet(50, 320, 16, batch=1520),  # the batch Alpa's suite ran at 32 GPUs
    "wresnet-13b": _wresnet(50, 320, 32, batch=1520),  # Alpa's suite spec; see docs/models.md
    "llama-7b": _llama(4096, 32, 32, 32, 11008),
    "llama-70b": _llama(8192, 80, 64, 8, 28672),
    "bert-layer": ("bert", dict(hidden=1024, layers=1, heads=16, seq=128, batch=8)),
    "moe-layer": ("moe-layer", dict(hidden=1024, experts=8, seq=512, batch=8, group_size=1024)),
}


def parameters(model: str) -> Mapping[str, inspect.Parameter]:
    """The arguments generator `model` takes (name -> inspect.Parameter); InstanceError if unknown."""
    if model not in MODELS:
        raise InstanceError(f"unknown model {model!r}", "generate",
                            f"models: {', '.join(MODELS)}; named models: {', '.join(PRESETS)}")
    return inspect.signature(MODELS[model]).parameters


def generate(model: str, matmul_dtype: str | None = None, **params: Any) -> Graph:
    """Build generator `model` with `params`, its GEMMs at `matmul_dtype` when given (`Graph.matmul_dtype`,
    for any model: FP8 training is a choice of the runtime, not of the architecture); unknown models,
    unknown or missing parameters are InstanceErrors that list what is accepted."""
    accepted = parameters(model)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise InstanceError(f"model {model!r} takes no parameter {', '.join(unknown)}", "generate",
                            f"{model} takes: {', '.join(accepted)}, matmul_dtype")
    missing = [p for p, spec in accepted.items() if spec.default is inspect.Parameter.empty and p not in params]
    if missing:
        raise InstanceError(f"model {model!r} needs {', '.join(missing)}", "generate",
                            f"give {', '.join(missing)}")
    graph = MODELS[model](**params)
    return graph if matmul_dtype is None else dataclasses.replace(graph, matmul_dtype=matmul_dtype)  # Graph checks it


def preset(name: str, **overrides: Any) -> Graph:
    """Build the named model `name` of PRESETS (e.g. "gpt-39b"), with `overrides` applied."""
    if name not in PRESETS:
        raise InstanceError(f"unknown named model {name!r}", "generate", f"named models: {', '.join(PRESETS)}")
    model, params = PRESETS[name]
    return generate(model, **{"name": name, **params, **overrides})


__all__ = ["MODELS", "PRESETS", "FlopSplit", "bert", "expert_capacity", "flop_split", "generate", "gpt", "llama",
           "moe", "moe_layer", "parameters", "preset", "wresnet"]
