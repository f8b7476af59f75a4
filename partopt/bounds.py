"""Lower bounds that let the search skip work it can prove useless (docs/COSTMODEL.md §5b, "How the
search skips work"): each layer's roofline work, the least recomputation a microbatch count's memory
forces (inf: the count cannot fit at all), which options a plan of a count that reaches a time with its
memory counted may hold a stage on (`options_in_reach`; none: no such plan), and layer costs that no strategy
undercuts, for the stage DPs to bound a whole count by (`undercut`, `floor_cost`).

The work bounds hold under the analytical model only (no split divides FLOPs or bytes by more than the
devices it uses); under another model (measured times) there is no work bound and nothing is skipped by
it. `options_in_reach` uses no roofline (the layer ILPs' own optima, and bytes), so it holds under any model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import numpy as np

from partopt import costmodel, intra
from partopt.cluster import Device
from partopt.graph import Graph, Op
from partopt.ops import is_matmul
from partopt.pricing import LayerCost
from partopt.shared import shared_params
from partopt.sharding import executed_flops, forward_share, kept_bytes, moved_bytes, unfused_loss_kept

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
    return costmodel.compute_time(executed_flops(g_mb, op), sum(moved_bytes(g_mb, op)), device, g_mb.compute_dtype(op),
                                  is_matmul(op), op.kind == "attention")


def alike_layers(graph: Graph, base: list[list[Op]]) -> list[int]:
    """Per base layer, the first base layer that hashes alike (`Graph.structural_hash`): the same in every
    microbatch view, whose batch dim is marked in the hash, so one view's hashes serve them all."""
    first: dict[str, int] = {}
    return [first.setdefault(graph.structural_hash(ops), b) for b, ops in enumerate(base)]


def per_layer(base: list[list[Op]], alike: Sequence[int] | None, of: Callable[[list[Op]], T]) -> list[T]:
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
    return per_layer(base, alike, lambda ops: sum(op_work(g_mb, op, device) for op in ops))


def footprints(g_mb: Graph, base: list[list[Op]], modes: Sequence[str], device: Device,
               alike: Sequence[int] | None = None) -> list[list[Footprint]]:
    """Per base layer, per mode of `modes`: what one microbatch keeps, recomputes and reruns.

    Under a mode a layer keeps each output it does not recompute, and each recomputed output read
    after the layer or by an op not recomputed; recomputing materialises every recomputed output
    once (as `intra.build` and `stages` count them); the rerun forward is each recomputed op's
    forward share of its roofline work."""
    return per_layer(base, alike, lambda ops: _footprint(g_mb, ops, modes, device))


def _footprint(g_mb: Graph, ops: list[Op], modes: Sequence[str], device: Device) -> list[Footprint]:
    """`footprints` of one base layer."""
    per_mode = []
    for mode in modes:
        rerun = intra.recomputed_ops(g_mb, ops, mode)
        also_kept = intra.kept_recomputed(g_mb, ops, rerun)
        kept = working = rerun_s = 0.0
        for op in ops:
            size = kept_bytes(g_mb, op) + unfused_loss_kept(g_mb, op)
            if op.name not in rerun or op.name in also_kept:
                kept += size
            if op.name in rerun:
                working += size
                rerun_s += op_work(g_mb, op, device) * forward_share(g_mb, op, device)
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


def undercut(cost: LayerCost, least: float, count: int, roofline_s: float, params: float, kept: float,
             rerun_s: float = 0.0) -> LayerCost:
    """A layer's cost on one option that no row of the option undercuts, memory-lean rows included, for the stage
    DPs to bound a count's plans with its memory counted before those rows are priced (`inter._relaxed_may_win`).
    `cost` is the option's first row's, or, for a mode not priced yet, that of a mode recomputing less on the same
    mesh, whose strategies are the same and each of which this mode slows by at least `rerun_s` per microbatch.

    Every strategy of the layer costs count · time + sync ≥ `least` (a proven bound: `inter._floors`), with its sync at
    most the layer's `sync_bound_s` (`intra.StageModel`), so its time per microbatch is at least (least − that) /
    count; and at least `roofline_s`, and its least time with memory aside (`time_floor_s`) plus `rerun_s`. Its
    sync is at least 0. It holds at least `params` and `kept` bytes per device (its parameter state and kept
    activations per microbatch over the option's devices: `resident_bytes`, `footprints`), with no working set. Its
    forward and backward are unbounded above, so every send and reduction counts as hidden behind them."""
    return floor_cost(max(roofline_s, cost.sharding.time_floor_s + rerun_s, (least - cost.sharding.sync_bound_s) / count),
                      params, kept)


def floor_cost(time_s: float, params: float, kept: float) -> LayerCost:
    """A layer's cost that no strategy of it undercuts, for the stage DPs to bound plans by (`undercut`): `time_s` per
    microbatch at least, no sync, `params` and `kept` bytes per device (per microbatch in flight) and no working set,
    its forward and backward unbounded above so that every send and reduction counts as hidden. A bound, not a
    solution: no sharding."""
    return LayerCost(time_s, 0.0, params, kept, 0.0, None, reduce_s=0.0, backward_s=math.inf, forward_s=math.inf)


def resident_bytes(g_mb: Graph, base: list[list[Op]], alike: Sequence[int] | None = None) -> list[float]:
    """Per base layer, the training state (weights, gradients, optimizer) of the parameters only it reads, on all
    devices together: each layer's ILP holds at least its share of it on each of its devices. A parameter read by
    several base layers (a tied embedding) is in `shared_state` instead. Layers alike share the sum over their
    parameters; what they share with other layers is taken out of each one's own."""
    shared = shared_params(g_mb, base)
    held = per_layer(base, alike, lambda ops: sum(state_bytes(g_mb, t) for t in _params(g_mb, ops)))
    return [h - sum(state_bytes(g_mb, t) for t in _params(g_mb, ops) if t in shared) for h, ops in zip(held, base)]


def shared_state(g_mb: Graph, base: list[list[Op]]) -> list[tuple[float, list[int]]]:
    """Each parameter read by several base layers (`shared.shared_params`): its training state on all devices
    together and its readers. A stage holding any of them holds the parameter once (`shared.correction`)."""
    return [(state_bytes(g_mb, t), list(units)) for t, units in shared_params(g_mb, base).items()]


def _params(g_mb: Graph, ops: list[Op]) -> dict[str, None]:
    return dict.fromkeys(t for op in ops for t in op.inputs if g_mb.tensors[t].role == "param")


def state_bytes(graph: Graph, tensor: str) -> float:
    """A parameter's training state (weights, gradients, optimizer) on all devices together
    (`costmodel.param_memory`)."""
    return costmodel.param_memory(graph.numel(tensor), graph.dtype_of(tensor), graph.optimizer).total


def options_in_reach(limit: float, objectives: dict[tuple, list[float | None]], resident: Sequence[float],
                     kept: dict[str, Sequence[float]], groups: Sequence[tuple[int, int]],
                     submeshes: Sequence[tuple[int, int]], devices: int, budget: float, count: int, overlap: bool,
                     contiguous: bool = True, interleaved: Sequence[list[tuple[list[int], float]]] = (),
                     shared: Sequence[tuple[float, Sequence[int]]] = ()) -> set[tuple]:
    """The options of `objectives` with a stage that may belong to a plan of one microbatch count costing at most
    `limit` with its memory counted; an option left out proves that no such plan has a stage on it, whatever
    memory-lean rows (`pricing.tighten`) it would add, and none left proves that the count has no such plan.

    A stage on an option (`objectives` key: submesh, shape, mode) costs at least paid · Σ its base layers'
    objectives (count · time + sync, what the layer ILP minimises with memory free; a memory-capped option costs
    no less; paid = 1 − 1/count with `overlap`, as in `pricing.stage_lengths`), and holds on each of its n
    devices at least 1/n of its layers' parameter state (`resident`, and once each parameter of `shared`, as
    `shared_state` gives them, whose reader base layers it holds) and of their kept activations per microbatch in
    flight (`kept[mode]`; all devices together: no split divides bytes by more than its devices). With
    `contiguous` (1F1B, ZB-H1) a stage of consecutive DP layers (`groups`: base layer ranges) holds as many
    microbatches as stages from it to the end, at most `count` (1F1B's; ZB-H1 holds more): a DP from the last
    layer (`_fewest_after`) and one from the first (`_fewest_before`) find the fewest devices such stages need
    after and before each stage, each under `limit` and `budget`, and the stage belongs to a plan when they and
    it fit the `devices`. An interleaved plan (`interleaved`: per shape, each stage's DP layers and its
    microbatches in flight, `schedules.inflight`) takes for each other stage its smallest submesh that can. Ties
    and rounding lean to reachable."""
    paid = 1.0 - 1.0 / count if overlap else 1.0
    cap, budget = limit * (1 + 1e-9), budget * (1 + 1e-9)
    first = [a for a, _ in groups]

    def per_group(values: Sequence[float | None]) -> np.ndarray:  # summed over each DP layer's base layers
        v = np.array([math.inf if x is None else x for x in values], dtype=float)
        return np.add.reduceat(v, first) if groups else v[:0]

    state = per_group(resident)
    read = [(size, per_group(np.isin(np.arange(len(resident)), layers).astype(float))) for size, layers in shared]
    held_kept = {mode: per_group(kept[mode]) for mode in {mode for _, _, mode in objectives}}
    options = []  # (submesh index, its devices, per DP layer: least cost, mode)
    for (sub, _, mode), objective in objectives.items():
        cost = per_group(objective)
        cost[np.isfinite(cost)] *= paid  # paid may be 0 (one microbatch, overlapped): a layer that cannot run stays inf
        options.append((submeshes.index(sub), sub[0] * sub[1], cost, mode))
    keys, found = list(objectives), set()
    sizes = np.array([a * b for a, b in submeshes], dtype=float)
    if contiguous and options:
        state_ij = _spans(state) + sum((size * (_spans(by) > 0) for size, by in read), np.zeros((len(state),) * 2))
        levels = _levels(options, state_ij, held_kept, cap, budget, count)
        deepest = np.zeros((len(sizes), *levels.shape[1:]))
        for o, (s, *_) in enumerate(options):
            deepest[s] = np.maximum(deepest[s], levels[o])
        after, before = _fewest_after(deepest, sizes), _fewest_before(deepest, sizes)
        # [k - 1, i, j]: the fewest devices beside a stage [i, j] at level k, least over the levels up to k
        beside = np.minimum.accumulate(before[1:-1, :-1, None] + after[:-1, None, 1:], axis=0)
        for key, (_, n, _, _), level in zip(keys, options, levels):
            i, j = np.nonzero(level >= 1)
            if (beside[level[i, j] - 1, i, j] + n <= devices).any():
                found.add(key)
    if not interleaved or not options:
        return found
    cost = np.array([c for _, _, c, _ in options])  # per option, per DP layer
    blocked, cost = np.isinf(cost).astype(float), np.where(np.isinf(cost), 0.0, cost)
    kept_of = np.array([held_kept[mode] for *_, mode in options])
    n = np.array([n for _, n, _, _ in options], dtype=float)
    for stages in interleaved:
        held = np.zeros((len(state), len(stages)))  # per DP layer, per stage: whether the stage holds it
        for s, (layers, _) in enumerate(stages):
            held[layers, s] = 1.0
        in_flight = np.array([f for _, f in stages], dtype=float)
        params = state @ held + sum((size * (by @ held > 0) for size, by in read), np.zeros(len(stages)))
        ok = ((blocked @ held == 0) & (cost @ held <= cap)
              & (params[None, :] + in_flight[None, :] * (kept_of @ held) <= budget * n[:, None]))
        least = np.where(ok, n[:, None], math.inf).min(axis=0)  # per stage its smallest submesh that can
        if not np.isfinite(least).all():
            continue  # a stage no submesh can hold
        fit = ok & (least.sum() - least[None, :] + n[:, None] <= devices)
        found.update(keys[o] for o in np.flatnonzero(fit.any(axis=1)))
    return found


def _spans(v: np.ndarray) -> np.ndarray:
    """[i, j]: the sum of `v` over i..j (inf entries as 0: counted apart)."""
    prefix = np.cumsum(np.concatenate(([0.0], np.where(np.isinf(v), 0.0, v))))
    return prefix[None, 1:] - prefix[:-1, None]


def _levels(options: list, state_ij: np.ndarray, kept: dict[str, np.ndarray], cap: float, budget: float,
            count: int) -> np.ndarray:
    """Per option, per stage [i, j] of DP layers: the most levels (stages to the end) it fits at, costing at most
    `cap` and fitting `budget` at its level's microbatches in flight (0: none; `state_ij`: per stage, its parameter
    state; `kept[mode]`: per DP layer; both on all devices together)."""
    L = len(state_ij)
    kept_ij = {mode: _spans(v) for mode, v in kept.items()}
    below = np.triu(np.ones((L, L), dtype=bool))
    out = np.zeros((len(options), L, L), dtype=int)
    for o, (_, n, cost, mode) in enumerate(options):
        ok = below & (_spans(np.isinf(cost).astype(float)) == 0) & (_spans(cost) <= cap)
        held, act = state_ij / n, kept_ij[mode] / n
        with np.errstate(divide="ignore", invalid="ignore"):
            levels = np.where(act > 0, np.floor((budget - held) / act), np.where(held <= budget, L, 0))
        levels = np.where(held + count * act <= budget, L, levels)  # at most `count` in flight
        out[o] = np.where(ok, np.clip(levels, 0, L), 0)
    return out


def _fewest_after(deepest: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """[k, j]: the fewest devices that hold DP layers j.. in k stages, the first at level k, each fitting its level
    (`deepest[s, i, j]`: per submesh, the most levels stage [i, j] fits at); [0, L] = 0, inf where none."""
    L = deepest.shape[1]
    after = np.full((L + 1, L + 1), math.inf)
    after[0, L] = 0.0
    for k in range(1, L + 1):  # the first stage of layers j..e at level k, then k − 1 stages after it
        after[k, :L] = np.where(deepest >= k, sizes[:, None, None] + after[k - 1, None, None, 1:],
                                math.inf).min(axis=(0, 2))
    return after


def _fewest_before(deepest: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """[k, i]: the fewest devices that hold DP layers ..i − 1 in stages before one at level k, each one level above
    the next (0 at i = 0, inf where none): `_fewest_after` from the other end."""
    L = deepest.shape[1]
    before = np.full((L + 2, L + 1), math.inf)
    before[:, 0] = 0.0
    for k in range(L, 0, -1):  # the last stage before it, of layers a..i − 1 at level k + 1
        before[k, 1:] = np.where(deepest >= k + 1, sizes[:, None, None] + before[k + 1, None, :L, None],
                                 math.inf).min(axis=(0, 1))
    return before
