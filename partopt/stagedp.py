"""The stage DP (DESIGN §6): cut L layers into stages on submeshes, least pipeline latency.

Pure arithmetic on arrays, so it can be checked against brute force: `t[k, i, j, s]` is the
per-microbatch latency of a stage of layers i..j on submesh shape s when k stages (itself
included) run from it to the end of the pipeline — k sets its 1F1B in-flight microbatches and
so its memory; infeasible entries are inf. `extra[k, i, j, s]` is per-iteration work of the stage
(gradient synchronisation, optimizer step). The DP minimises

    sum_i (t_i + extra_i) + (B - 1) * max_i t_i

over cuts and submeshes whose devices sum to exactly `devices`, by enumerating the bound
`t_max` over the distinct latencies in increasing order (Alpa's algorithm) and stopping once
`B * t_max` reaches the best total found: every later plan costs at least that.
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


@dataclass(frozen=True)
class DPResult:
    total: float
    stages: list[StageChoice]
    max_latency: float
    rounds: int  # t_max values evaluated


def _inner(t: np.ndarray, extra: np.ndarray, sizes: list[int], devices: int, t_max: float):
    """min over plans with every stage latency <= t_max of sum(t + extra), with argmins."""
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
                total = cost + extra[k, i, i:, s]
                rest = f[k - 1, i + 1:L + 1, :devices + 1 - size]  # suffix after j, devices left
                cand = np.where(ok[:, None], rest + total[:, None], INF)  # (J, D - size + 1)
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


def solve(t: np.ndarray, extra: np.ndarray, sizes: list[int], devices: int, microbatches: int) -> DPResult | None:
    """The optimal stages, or None when no plan fits (every entry infeasible or devices not tiled)."""
    values = np.unique(t[np.isfinite(t)])
    best: DPResult | None = None
    rounds = 0
    for t_max in values:
        if best is not None and microbatches * t_max >= best.total:
            break
        rounds += 1
        f, arg = _inner(t, extra, sizes, devices, float(t_max))
        k_best = int(np.argmin(f[:, 0, devices]))
        value = f[k_best, 0, devices]
        if not np.isfinite(value):
            continue
        stages, i, d, k = [], 0, devices, k_best
        while k > 0:
            j, s = (int(x) for x in arg[k, i, d])
            stages.append(StageChoice(i, j, s, k))
            i, d, k = j + 1, d - sizes[s], k - 1
        max_latency = max(float(t[c.inflight, c.first, c.last, c.submesh]) for c in stages)
        total = float(value) + (microbatches - 1) * max_latency
        if best is None or total < best.total - 1e-15:
            best = DPResult(total, stages, max_latency, rounds)
    if best is not None:
        best = DPResult(best.total, best.stages, best.max_latency, rounds)
    return best
