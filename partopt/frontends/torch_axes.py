"""A partopt placement of an imported PyTorch parameter in the parameter's own torch axes.

The PyTorch frontend may split one torch axis into several dims (Llama's `q_proj.weight`
[heads·head_dim, hidden] has dims (g, r, d, h); a fused `gate_up_proj` is imported as chunks
`gate_up_proj[0/2]`). A DTensor Shard splits a whole torch axis into contiguous blocks, which is
the plan's split only when the split dim is the outermost factor of its axis; any other split is
not one DTensor placement: it becomes Replicate, with a note. Pure Python (no torch import).
"""

from __future__ import annotations

import re
from typing import Sequence

from partopt.errors import PartoptError
from partopt.sharding import Partial, Placement, Shard

_CHUNK = re.compile(r"^(.*)\[(\d+)/(\d+)\]$")


def torch_name(name: str) -> tuple[str, int]:
    """(the torch parameter FQN, how many chunks the frontend cut it into: 1 for a whole one)."""
    m = _CHUNK.match(name)
    return (m.group(1), int(m.group(3))) if m else (name, 1)


def torch_axes(shape: Sequence[int], dims: Sequence[str], sizes: dict[str, int]) -> list[list[str]]:
    """The partopt dims that make up each torch axis (major first): the frontend lays a parameter's
    dims out axis by axis, so consuming them by size recovers the grouping; size-1 axes get none."""
    result, rest = [], list(dims)
    for n in shape:
        group, need = [], n
        while need > 1 and rest and need % sizes[rest[0]] == 0:
            group.append(rest.pop(0))
            need //= sizes[group[-1]]
        if need != 1:
            raise PartoptError(f"dims {list(dims)} do not lay out torch shape {list(shape)}", "torch axes",
                               "use the model the plan's graph was imported from")
        result.append(group)
    if rest:
        raise PartoptError(f"dims {list(dims)} do not lay out torch shape {list(shape)}", "torch axes",
                           "use the model the plan's graph was imported from")
    return result


def _chunk_groups(shape: Sequence[int], chunks: int, dims: Sequence[str],
                  sizes: dict[str, int]) -> tuple[list[list[str]], int]:
    """A chunk's torch-axis grouping and the axis the chunks cut (its chunk index is that axis's major part)."""
    for axis, n in enumerate(shape):
        if n % chunks == 0:
            try:
                return torch_axes([*shape[:axis], n // chunks, *shape[axis + 1:]], dims, sizes), axis
            except PartoptError:
                continue
    raise PartoptError(f"dims {list(dims)} are not a 1/{chunks} chunk of torch shape {list(shape)}", "torch axes",
                       "use the model the plan's graph was imported from")


def torch_placements(name: str, placement: Placement, shape: Sequence[int], dims: Sequence[str],
                     sizes: dict[str, int]) -> tuple[list[tuple[str, int | None]], list[str]]:
    """Per mesh axis ("shard", torch axis), ("replicate", None) or ("partial", None) for the
    partopt parameter `name` (a chunk `FQN[i/n]` too) of torch shape `shape`; plus a note for every
    split replaced by Replicate because it is not the outermost factor of its torch axis."""
    _, chunks = torch_name(name)
    groups, cut = (torch_axes(shape, dims, sizes), None) if chunks == 1 else _chunk_groups(shape, chunks, dims, sizes)
    result: list[tuple[str, int | None]] = []
    notes = []
    for p in placement:
        if isinstance(p, Partial):
            result.append(("partial", None))
        elif not isinstance(p, Shard):
            result.append(("replicate", None))
        else:
            axis = next(i for i, g in enumerate(groups) if p.dim in g)
            if groups[axis][0] == p.dim and axis != cut:
                result.append(("shard", axis))
                continue
            factors = ([f"{chunks} chunks"] if axis == cut else []) + groups[axis]
            notes.append(f"{name}: S({p.dim}) is not the outermost factor of torch axis {axis} (factors, major "
                         f"first: {', '.join(factors)}); one DTensor Shard cannot split it: replicated")
            result.append(("replicate", None))
    return result, notes
