"""The stage DP (DESIGN §6): cut L layers into stages on submeshes, least iteration time.

Pure arithmetic on arrays, so it can be checked against brute force: `t[h, k, i, j, s]` is the
per-microbatch latency of a stage of layers i..j on submesh shape s run in its option h (a
logical mesh shape) when k stages (itself included) run from it to the end of the pipeline — k
sets its 1F1B in-flight microbatches and so its memory; infeasible entries are inf.
`extra[h, k, i, j, s]` is the stage's per-iteration work (gradient synchronisation, optimizer
step), which stages do in parallel on their own devices. The DP minimises

    sum_i t_i + (B - 1) * max_i t_i + max_i extra_i

over cuts, submeshes and options whose devices sum to exactly `devices`. For a bound on the
per-iteration work, the best option of every entry is its fastest one within the bound, and the
pipeline part is Alpa's algorithm: enumerate `t_max` over the distinct latencies in increasing
order, stopping once `B * t_max` reaches the best total found. The bound starts unlimited and
drops below the per-iteration work of each plan found, until the pipeline part alone costs more
than the best plan: each bound's plan is optimal among plans within it, so the best of them is
optimal overall, and there are as few rounds as breakpoints of that trade-off.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INF = np.inf


@dataclass(frozen=True)
class StageChoice:
    first: int
    last: int
    submesh: int  # index into the submesh shapes
    inflight: int  # k: stages from this one to the end
    option: int = 0  # h: which of the entry's options (logical mesh shapes)


@dataclass(frozen=True)
class DPResult:
    total: float
    stages: list[StageChoice]
    max_latency: float
    rounds: int  # inner DPs run (one per t_max value per bound)


def _inner(t: np.ndarray, sizes: list[int], devices: int, t_max: float):
    """min over plans with every stage latency <= t_max of sum(t), with argmins."""
    K, L = t.shape[0] - 1, t.shape[1]
    f = np.full((K + 1, L + 1, devices + 1), INF)
    f[0, L, 0] = 0.0
    arg = np.full((K + 1, L + 1, devices + 1, 2), -1, dtype=np.int64)
    for k in range(1, K + 1):
        for i in range(L - 1, -1, -1):
            best = f[k, i]
            for s, size in enumerate(sizes):
                if size > devices:
                    continue
                cost = t[k, i, i:, s]  # stages i..j for j = i..L-1
                ok = cost <= t_max
                if not ok.any():
                    continue
                rest = f[k - 1, i + 1:L + 1, :devices + 1 - size]  # suffix after j, devices left
                cand = np.where(ok[:, None], rest + cost[:, None], INF)  # (J, D - size + 1)
                j_best = cand.argmin(axis=0)
                value = cand[j_best, np.arange(cand.shape[1])]
                target = best[size:]
                better = value < target
                if better.any():
                    idx = np.flatnonzero(better)
                    target[idx] = value[idx]
                    arg[k, i, idx + size, 0] = i + j_best[idx]
                    arg[k, i, idx + size, 1] = s
    return f, arg


def _pipeline(t: np.ndarray, sizes: list[int], devices: int, microbatches: int,
              bound: float) -> tuple[float, list[tuple[int, int, int, int]], int] | None:
    """min sum t + (B - 1) max t below `bound` (Alpa's t_max enumeration): (total, stages, rounds)."""
    best: tuple[float, list] | None = None
    rounds = 0
    for t_max in np.unique(t[np.isfinite(t)]):
        if microbatches * t_max >= min(bound, best[0] if best else INF):
            break
        rounds += 1
        f, arg = _inner(t, sizes, devices, float(t_max))
        k_best = int(np.argmin(f[:, 0, devices]))
        value = f[k_best, 0, devices]
        if not np.isfinite(value):
            continue
        stages, i, d, k = [], 0, devices, k_best
        while k > 0:
            j, s = (int(x) for x in arg[k, i, d])
            stages.append((i, j, s, k))
            i, d, k = j + 1, d - sizes[s], k - 1
        total = float(value) + (microbatches - 1) * max(float(t[k, i, j, s]) for i, j, s, k in stages)
        if best is None or total < best[0] - 1e-15:
            best = (total, stages)
    return None if best is None else (best[0], best[1], rounds)


def solve(t: np.ndarray, extra: np.ndarray, sizes: list[int], devices: int, microbatches: int) -> DPResult | None:
    """The optimal stages, or None when no plan fits (every entry infeasible or devices not tiled).

    `t` and `extra` are indexed [h, k, i, j, s] (or [k, i, j, s] for entries with one option).
    """
    if t.ndim == 4:
        t, extra = t[None], extra[None]
    levels = np.unique(extra[np.isfinite(t)])
    best: DPResult | None = None
    rounds = 0
    bound = INF
    while True:
        allowed = np.where(extra <= bound, t, INF)
        option = allowed.argmin(axis=0)
        table = np.take_along_axis(allowed, option[None], axis=0)[0]
        found = _pipeline(table, sizes, devices, microbatches, best.total if best else INF)
        if found is None:
            break
        pipeline, picked, used = found
        rounds += used
        if best is not None and pipeline >= best.total:
            break  # tighter bounds only raise the pipeline part
        stages = [StageChoice(i, j, s, k, int(option[k, i, j, s])) for i, j, s, k in picked]
        sync = max(float(extra[c.option, c.inflight, c.first, c.last, c.submesh]) for c in stages)
        if best is None or pipeline + sync < best.total - 1e-15:
            max_latency = max(float(table[c.inflight, c.first, c.last, c.submesh]) for c in stages)
            best = DPResult(pipeline + sync, stages, max_latency, rounds)
        lower = levels[levels < sync]
        if len(lower) == 0:
            break
        bound = float(lower[-1])
    return None if best is None else DPResult(best.total, best.stages, best.max_latency, rounds)
