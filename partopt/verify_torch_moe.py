"""Expert parallelism for `verify --against torch`: a Hugging Face experts module (3-D
`gate_up_proj [e, 2f, h]`, `down_proj [e, h, f]`, see partopt.frontends.torch_moe) run as the plan
splits it.

DTensor cannot run transformers' experts loop (data-dependent `nonzero`, `index_add_`), so in the
sharded step each experts module computes on local tensors, each process holding the experts of its
shard of e. Where the plan splits the tokens over the expert axes too (data parallel dispatch), an
all-to-all sends every (token, chosen expert) pair to the process holding the expert and a second one
brings the results back; where the tokens are replicated, each process takes its experts' pairs from
all tokens and the results are summed over the expert axes. Dropless, every routed token as
transformers computes it (the plan prices capacity c = top_k·s/e, a balanced routing). A plan that
splits the experts' weights over anything but e, or the three weights differently, is refused before
any process starts. torch is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from partopt.errors import PartoptError
from partopt.sharding import Replicate, Shard, fmt

CHUNKS = ("gate_up_proj[0/2]", "gate_up_proj[1/2]")  # the frontend's [gate; up] chunks of gate_up_proj
WEIGHTS = (*CHUNKS, "down_proj")
WHERE = "verify --against torch"


def expert_modules(plan: Any) -> list[str]:
    """Module paths of the plan's experts modules (those whose gate_up_proj the frontend cut in two chunks)."""
    suffix = "." + CHUNKS[0]
    return [name.removesuffix(suffix) for name in plan.tensors if name.endswith(suffix)]


@dataclass(frozen=True)
class ExpertSplit:
    """How a stage runs one experts module: the mesh axes its experts are split over (by e) and the
    mesh axes its tokens are split over (the batch) where the plan dispatches them."""

    experts: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def exchanges(self) -> bool:
        """Whether tokens go to their experts' processes (all-to-all): the tokens are split over every expert
        axis; else, with the experts split, every process routes all tokens and the outputs are summed."""
        return bool(self.experts) and set(self.experts) <= set(self.tokens)


def expert_splits(plan: Any, stage: Any, batch_axes: set[int]) -> dict[str, ExpertSplit]:
    """Per experts module, how the stage runs it (its experts replicated, its tokens split over
    `batch_axes`, when it is another stage's); a PartoptError naming the parameter or op for a
    placement the run cannot express."""
    result = {}
    for module in expert_modules(plan):
        names = [f"{module}.{w}" for w in WEIGHTS]
        placed = {n: stage.params[n].placement for n in names if n in stage.params}
        dispatch = stage.ops.get(f"{module}.dispatch")
        if not placed or dispatch is None:
            result[module] = ExpertSplit((), tuple(sorted(batch_axes)))
            continue
        for name, placement in placed.items():
            e = plan.tensors[name]["dims"][0]
            for axis, p in enumerate(placement):
                if not isinstance(p, Replicate) and p != Shard(e):
                    raise PartoptError(
                        f"{name} is placed {fmt(placement)}: the expert-parallel run splits the experts' weights "
                        f"over their expert dim {e} only, not {p} on mesh axis {axis}", WHERE,
                        "verify a plan whose experts' weights are replicated or split over e")
        if len(set(placed.values())) > 1 or len(placed) < len(names):
            text = ", ".join(f"{n} {fmt(p)}" for n, p in placed.items())
            raise PartoptError(f"{module}: its weights are placed differently ({text}); one expert-parallel run "
                               "holds an expert's gate, up and down projections together", WHERE,
                               "verify a plan that places an experts module's weights alike")
        experts = _computed_split(plan, stage, module)
        tokens = tuple(a for a, d in enumerate(dispatch.axes) if d is not None and d == plan.batch_dim)
        if experts and 0 < len(set(experts) & set(tokens)) < len(experts):
            raise PartoptError(f"{module}.dispatch: the plan splits the experts over mesh axes {list(experts)} and "
                               f"the tokens over {list(tokens)}; the run exchanges tokens over all expert axes or "
                               "over none", WHERE,
                               "verify a plan whose experts and tokens share all or none of their axes")
        result[module] = ExpertSplit(experts, tokens)
    return result


def _computed_split(plan: Any, stage: Any, module: str) -> tuple[int, ...]:
    """The mesh axes the module's expert matmuls split their expert dim over: the experts each process
    computes. Weights stored split more widely (FSDP-style, over e) are gathered to this split for the op."""
    e = plan.tensors[f"{module}.{WEIGHTS[-1]}"]["dims"][0]
    splits = {tuple(a for a, d in enumerate(stage.ops[f"{module}.{name}"].axes) if d == e)
              for name in ("gate", "up", "down") if f"{module}.{name}" in stage.ops}
    if len(splits) > 1:
        raise PartoptError(f"{module}: its gate, up and down matmuls split the experts over different mesh axes "
                           f"({sorted(splits)}); one expert-parallel run computes an expert's three together", WHERE,
                           "verify a plan whose experts' matmuls split their expert dim alike")
    return next(iter(splits), ())


def expert_parallel(module: Any, mesh: Any, split: ExpertSplit) -> None:
    """Make the experts `module` (its weights DTensors on `mesh`, split over `split.experts` by dim 0)
    compute as the plan splits it: its tokens split over `split.tokens`; over expert axes that split
    the tokens too, each (token, choice) pair goes to its expert's process in an all-to-all and comes
    back in another; over expert axes that do not, each process takes the pairs routed to its own
    experts from all tokens, and the results are summed over those axes."""
    import torch
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all_single
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard

    ep, split_tokens = split.experts, split.tokens
    exchange_tokens = split.exchanges
    axes = range(mesh.ndim)
    tokens = [TShard(0) if a in split_tokens else TReplicate() for a in axes]
    weights = [TShard(0) if a in ep else TReplicate() for a in axes]
    # a process's experts see only its tokens' pairs, its tokens only its experts: partial gradients
    weight_grads = [TShard(0) if a in ep else Partial() if a in split_tokens else TReplicate() for a in axes]
    token_grads = [TShard(0) if a in split_tokens else Partial() if a in ep else TReplicate() for a in axes]
    if len(ep) == mesh.ndim:  # both axes: the whole mesh, ranks in DTensor's shard order (row major)
        group, size, rank = dist.group.WORLD, mesh.size(), dist.get_rank()
    elif ep:
        group, size, rank = mesh.get_group(ep[0]), mesh.size(ep[0]), mesh.get_local_rank(ep[0])
    else:
        group, size, rank = None, 1, 0

    def exchange(x: Any, send: list[int], recv: list[int]) -> Any:
        """Rows of `x` (sent in blocks of `send` to the group's ranks) as received (`recv` from each)."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        if x.requires_grad:
            return all_to_all_single(out, x, recv, send, group=group)
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    def forward(hidden: Any, index: Any, routing: Any) -> Any:
        x = hidden.redistribute(mesh, tokens).to_local(grad_placements=token_grads)
        idx = index.redistribute(mesh, tokens).to_local()
        w = routing.redistribute(mesh, tokens).to_local(grad_placements=token_grads)
        gate_up = module.gate_up_proj.redistribute(mesh, weights).to_local(grad_placements=weight_grads)
        down = module.down_proj.redistribute(mesh, weights).to_local(grad_placements=weight_grads)
        local, k = gate_up.shape[0], idx.shape[1]
        pairs = idx.reshape(-1)  # (token t, choice j) is pair t·k + j
        owner = pairs // local  # the rank (in the expert group) holding the pair's expert
        if exchange_tokens:
            order = torch.argsort(owner, stable=True)
            send = torch.bincount(owner, minlength=size)
            send_n, recv_n = send.tolist(), exchange(send, [1] * size, [1] * size).tolist()
            got, expert = exchange(x[order // k], send_n, recv_n), exchange(pairs[order] % local, send_n, recv_n)
        else:
            order = torch.nonzero(owner == rank).squeeze(1)
            got, expert = x[order // k], pairs[order] % local
        by_expert = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=local).tolist()
        per_expert = got[by_expert].split(counts)
        gates, ups = zip(*[(rows @ gate_up[j].T).chunk(2, dim=-1) for j, rows in enumerate(per_expert)])
        # the activation module is called once: CommDebugMode's module tracker adds a hook at every call
        inner = module.act_fn(torch.cat(gates)) * torch.cat(ups)
        done = torch.cat([rows @ down[j].T for j, rows in enumerate(inner.split(counts))])[torch.argsort(by_expert)]
        if exchange_tokens:
            back = exchange(done, recv_n, send_n)[torch.argsort(order)]
        else:  # the pairs of other processes' experts are zero here: partial over the expert axes
            back = done.new_zeros((pairs.numel(), done.shape[1])).index_add(0, order, done)
        out = (back.view(-1, k, back.shape[-1]) * w.unsqueeze(-1).to(back.dtype)).sum(1)
        result = DTensor.from_local(out, mesh, token_grads, run_check=False, shape=hidden.shape, stride=hidden.stride())
        return result.redistribute(mesh, hidden.placements)

    module.forward = forward
