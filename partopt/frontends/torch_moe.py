"""Mixture-of-experts blocks of Hugging Face models for the PyTorch frontend.

transformers (≥ 5) stores a block's experts as 3-D parameters (`gate_up_proj [e, 2f, h]`,
`down_proj [e, h, f]`) and runs them with a data-dependent loop (`nonzero`, `index_add_`) that no
static trace can follow. While a module is exported, `experts_as_one_op` makes each such experts
module call the custom op `partopt::experts` instead, whose meta kernel only gives the output
shape; the importer then writes the block in the IR's expert-parallel form (partopt.models.moe):
the router's top-k becomes a routing mask over (tokens, e, c) and the experts einsums over e.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from partopt.frontends.torch import FrontendError


@torch.library.custom_op("partopt::experts", mutates_args=())
def experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, act: str) -> torch.Tensor:
    """Σ_k weights[:, k] · down(act(gate) · up)(x) over each token's experts index[:, k] (dense reference)."""
    from transformers.activations import ACT2FN

    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        share = (weights * (index == e)).sum(-1, keepdim=True).to(x.dtype)
        gate, up = (x @ gate_up[e].T).chunk(2, dim=-1)
        out += share * ((ACT2FN[act](gate) * up) @ down[e].T)
    return out


@experts.register_fake
def _experts_shape(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, act: str) -> torch.Tensor:
    return torch.empty_like(x)


def is_experts(module: Any) -> bool:
    w = getattr(module, "gate_up_proj", None)
    return isinstance(w, torch.nn.Parameter) and w.dim() == 3 and hasattr(module, "down_proj")


def _activation(path: str, module: Any) -> str:
    """The experts' activation as its transformers ACT2FN name (the config's hidden_act)."""
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    if not isinstance(act, str):
        raise FrontendError("the experts module has no config.hidden_act", path,
                           "give the experts module the config it was built from")
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False) or \
            not getattr(module, "is_concatenated", True):
        raise FrontendError("experts with transposed, biased or interleaved weights are not mapped yet", path,
                           "partopt maps gate_up_proj [e, 2f, h] = [gate; up] and down_proj [e, h, f] without bias")
    return act


@contextmanager
def experts_as_one_op(model: Any) -> Iterator[int]:
    """While inside, every experts module of `model` calls partopt::experts; yields how many."""
    patched = []
    for path, module in model.named_modules():
        if is_experts(module):
            act = _activation(path, module)
            module.forward = (lambda h, index, weights, m=module, a=act:
                              experts(h, index, weights, m.gate_up_proj, m.down_proj, a))
            patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward


def capacity(group_size: int, experts: int, top_k: int) -> int:
    """Tokens one expert takes from a group: top_k·group_size / experts (capacity factor 1), the rule of
    partopt.models.moe.expert_capacity for top-k routing; every routed token fits when it divides."""
    return top_k * group_size // experts
