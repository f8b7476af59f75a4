"""Lower bounds that let the search skip work it can prove useless (docs/COSTMODEL.md §5b, "How the
search skips work"): each layer's roofline work, and the least recomputation a microbatch count's memory
forces (inf: the count cannot fit at all).

All of them hold under the analytical model only (no split divides FLOPs or bytes by more than the
devices it uses); under another model (measured times) there is no work bound and nothing is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from partopt import costmodel, intra
from partopt.cluster import Device
from partopt.graph import Graph, Op
from partopt.ops import is_matmul
from partopt.sharding import executed_flops, forward_share, kept_bytes

T = TypeVar("T")


@dataclass(frozen=True)
class Footprint:
    """One base layer under one recomputation mode, for one microbatch on all devices together."""

    kept_bytes: float  # outputs kept for the backward
    working_bytes: float  # recomputed outputs, materialised once while the layer recomputes
    rerun_s: float  # device-seconds of the recomputed forward, at least


def op_work(g_mb: Graph, op: Op, device: Device) -> float:
    """An op's single-device roofline time for forward and backward: a lower bound on its device-seconds."""
    if op.kind == "reshape":
        return 0.0
    moved = sum(g_mb.nbytes(t) for t in op.inputs) + g_mb.nbytes(op.output)
    return costmodel.compute_time(executed_flops(g_mb, op), 2 * moved, device, g_mb.compute_dtype(op), is_matmul(op))


def alike_layers(graph: Graph, base: list[list[Op]]) -> list[int]:
    """Per base layer, the first base layer that hashes alike (`Graph.structural_hash`): the same in every
    microbatch view, whose batch dim is marked in the hash, so one view's hashes serve them all."""
    first: dict[str, int] = {}
    return [first.setdefault(graph.structural_hash(ops), b) for b, ops in enumerate(base)]


def _per_layer(base: list[list[Op]], alike: Sequence[int] | None, of: Callable[[list[Op]], T]) -> list[T]:
    """`of(ops)` per base layer, computed once for layers alike (`alike`, from `alike_layers`; None: all differ)."""
    done: dict[int, T] = {}
    for a in alike or range(len(base)):
        if a not in done:
            done[a] = of(base[a])
    return [done[a] for a in alike or range(len(base))]


def roofline_work(g_mb: Graph, base: list[list[Op]], device: Device,
                  alike: Sequence[int] | None = None) -> list[float] | None:
    """Each base layer's device-seconds per microbatch on any mesh, at least (`g_mb`: the microbatch view):
    its ops' `op_work`; communication only adds. None under a measured cost model."""
    if not isinstance(costmodel.active(), costmodel.Analytical):
        return None
    return _per_layer(base, alike, lambda ops: sum(op_work(g_mb, op, device) for op in ops))


def footprints(g_mb: Graph, base: list[list[Op]], modes: Sequence[str], device: Device,
               alike: Sequence[int] | None = None) -> list[list[Footprint]]:
    """Per base layer, per mode of `modes`: what one microbatch keeps, recomputes and reruns.

    Under a mode a layer keeps each output it does not recompute, and each recomputed output read
    after the layer or by an op not recomputed; recomputing materialises every recomputed output
    once (as `intra.build` and `stages` count them); the rerun forward is each recomputed op's
    forward share of its roofline work."""
    return _per_layer(base, alike, lambda ops: _footprint(g_mb, ops, modes, device))


def _footprint(g_mb: Graph, ops: list[Op], modes: Sequence[str], device: Device) -> list[Footprint]:
    """`footprints` of one base layer."""
    per_mode = []
    for mode in modes:
        rerun = intra.recomputed_ops(g_mb, ops, mode)
        also_kept = intra.kept_recomputed(g_mb, ops, rerun)
        kept = working = rerun_s = 0.0
        for op in ops:
            size = kept_bytes(g_mb, op)
            if op.name not in rerun or op.name in also_kept:
                kept += size
            if op.name in rerun:
                working += size
                rerun_s += op_work(g_mb, op, device) * forward_share(op)
        per_mode.append(Footprint(kept, working, rerun_s))
    return per_mode


def least_rerun_s(layers: list[list[Footprint]], room: float) -> float:
    """A lower bound on the recomputed forward's device-seconds of any mode choice whose activations fit
    `room` bytes (kept plus the largest working set), inf when none does.

    For each threshold W on the working set, the choice within W is a multiple-choice knapsack
    (least rerun with kept bytes ≤ room − W); its Lagrangian relaxation, Σ_l min_m (rerun + λ · kept)
    − λ · (room − W), bounds it from below for every λ ≥ 0 and is concave in λ, so its best is at a
    breakpoint, where some layer's two modes tie."""
    best = math.inf
    for limit in sorted({f.working_bytes for per_mode in layers for f in per_mode}):
        allowed = [[f for f in per_mode if f.working_bytes <= limit] for per_mode in layers]
        if not all(allowed):
            continue
        capacity = room - limit
        if sum(min(f.kept_bytes for f in fs) for fs in allowed) > capacity:
            continue  # not even the leanest choice within W fits
        ties = {0.0} | {(a.rerun_s - b.rerun_s) / (b.kept_bytes - a.kept_bytes) for fs in allowed
                        for a in fs for b in fs if b.kept_bytes > a.kept_bytes and a.rerun_s > b.rerun_s}
        dual = max(sum(min(f.rerun_s + lam * f.kept_bytes for f in fs) for fs in allowed) - lam * capacity
                   for lam in ties)
        best = min(best, max(dual, 0.0))
    return best
