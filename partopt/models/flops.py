"""Forward FLOPs of a graph split into matrix multiplies and everything else.

The two parts scale differently in training (backward ≈ 2× forward for matmuls, ≈ 1× for the
rest: `partopt.costmodel.training_flops`) and run on different units (tensor cores vs vector).
"""

from __future__ import annotations

from dataclasses import dataclass

from partopt.graph import Graph
from partopt.ops import is_matmul


@dataclass(frozen=True)
class FlopSplit:
    """Exact forward FLOPs of a graph: `matmul` (einsums with two inputs, convolutions) and `other`."""

    matmul: int
    other: int

    @property
    def total(self) -> int:
        return self.matmul + self.other


def flop_split(graph: Graph) -> FlopSplit:
    """Sum the forward FLOPs of the graph's ops, matmuls (`partopt.ops.is_matmul`) apart."""
    matmul = other = 0
    for op in graph.ops:
        if is_matmul(op):
            matmul += graph.flops(op)
        else:
            other += graph.flops(op)
    return FlopSplit(matmul, other)
