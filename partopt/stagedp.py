"""The stage DP (DESIGN §6): cut L layers into stages on submeshes, least iteration time.

Pure arithmetic on arrays, so it can be checked against brute force: `t[h, k, i, j, s]` is the
per-microbatch latency of a stage of layers i..j on submesh shape s run in its option h (a
logical mesh shape) when k stages (itself included) run from it to the end of the pipeline — k
sets its 1F1B in-flight microbatches and so its memory; infeasible entries are inf.
`extra[h, k, i, j, s]` is the stage's per-iteration work (gradient synchronisation, optimizer
step), which stages do in parallel on their own devices. The planner's tables repeat each entry at every
level its memory fits, so it hands them over as `Entries` (latency, sync and deepest level per entry),
which the DP collapses over options one level at a time without building t. The DP minimises

    sum_i t_i + (B - 1) * max_i t_i + max_i extra_i

over cuts, submeshes and options whose devices sum to exactly `devices` (1F1B). The interleaved schedule
over Megatron's uniform chunks is the same problem on a diagonal table of stages
(`stages.interleaved_table`), solved on t / v with v·B microbatches; ZB-H1 (`zero_bubble`) is this DP once
per stage count and threshold on its coupled term min omega (docs/COSTMODEL.md §5b). Why it is exact:

* Per-iteration work. For a bound b on it, an entry's best option is its fastest one with extra
  <= b. The bound starts unlimited and drops below the per-iteration work of each plan found,
  until the pipeline part alone costs more than the best plan: each bound's plan is optimal among
  plans within it, so the best of them is optimal overall.
* Pipeline part. Let g(c) be the least sum t over plans whose stages all have t <= c (the inner
  DP). Every plan with max t = m costs at least g(m) + (B - 1) m, and the inner DP's plan at m
  costs at most that, so the optimum is the minimum of g(c) + (B - 1) c over the distinct
  latencies c (Alpa's t_max enumeration). g is non-increasing, so instead of evaluating every c
  we branch and bound over the sorted latencies: with g known at c_hi, every c in an interval
  [c_lo, c_hi) costs at least g(c_hi) + (B - 1) c_lo, and the interval is dropped once that
  reaches the best plan found. Each evaluation at c returns a plan whose max latency m <= c, so
  g is constant on [m, c] and only latencies below m stay open on that side; an infeasible c
  closes every latency below it. Evaluating the middle of an open interval splits it in two,
  and the interval with the least bound goes first, so rounds are spent only where g can still
  beat the best plan. From one bound on the per-iteration work to the next (tighter) one, every entry
  only gets slower, so each g evaluated before bounds g on the new table at every latency up to its own
  (`_floor`): an interval costs at least the least of max(g(c_hi), that floor) + (B - 1) c over its
  latencies; and the new search evaluates first at the previous plan's largest latency, near the optimum.
* In-flight depth. Stages are numbered k from the end, k <= min(L, devices). When the tables'
  slices for every k >= k0 are equal, one DP level stands for "k0 or more stages to the end"
  (its stages may continue into that level or drop to level k0 - 1), so the inner DP has k0
  levels instead of L; the planner's tables stop changing with k once memory no longer binds.
* Relaxation. Each evaluation first runs the inner DP on one level holding every entry's least
  latency over k: a lower bound on g(c). When its plan's stages cost exactly that at the depths
  they land on, that plan is feasible with the same sum, so it attains g(c). Otherwise the next
  relaxation keeps levels 1 … m - 1 exact and lets level m hold each entry's least latency over
  k >= m ("m or more"), still a lower bound, with m past every level a stage fell short at and at
  least twice the last; the full DP runs only once m reaches k0. Memory that binds only for plans
  far from the optimum then costs one level, not L, and a plan of n stages deep in memory-bound
  levels a DP of about n levels (Llama-2 70B on 64 A100s: 5 to 14 of 64).
* Inner DP. f[k, i, d] is the least sum t of stages covering layers i..L-1 on exactly d devices
  (level k as above); each first layer i is one vectorised step over (last layer, level, submesh, d),
  or one per submesh when that block outgrows the cache, reading only rows after i.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

INF = np.inf
# table cells (layers² × devices × submeshes per inner DP) a zero-bubble search may visit before it stops with
# a floor (`zero_bubble_limit`): 99 DPs of GPT-1T's table on 384 DGX A100 (its near-tied
# stage counts took about 2,800), and more than any smaller case of docs/benchmarks.md needs
ZERO_BUBBLE_WORK = 1.5e10
# the inner DP's candidate block (last layers × levels × submeshes × devices, float64) up to which a first layer's
# submeshes are one numpy step (`_steps`), else one step each. Per `_inner` call on recorded tables (CPU, old per-submesh
# loop / this, 64K … 2M swept): 256K gains 1.3-2.2x from 24 layers × 8 devices to 128 × 512; 1M and more lose at
# 64 × 512 and 128 × 512 (0.6-0.9x: the block outgrows the 1 MiB L2 and pays every submesh the widest's columns)
BLOCK_BYTES = 1 << 18


def zero_bubble_limit(t: np.ndarray, devices: int) -> int:
    """The inner DPs `zero_bubble` may run on a table `t` ([..., i, j, s]: `Entries.latency`) over `devices`:
    ZERO_BUBBLE_WORK's share."""
    return max(1, int(ZERO_BUBBLE_WORK / (t.shape[-2] ** 2 * devices * t.shape[-1])))


def zero_bubble_saving(microbatches: int, deepest: int) -> float:
    """The largest share of its 1F1B cost F that a ZB-H1 plan of at most `deepest` stages can save: a plan of S stages
    costs F − c(S) min ω with ω_i ≤ t_i / 3 (the least of three parts of t_i) and F ≥ (S + B − 1) min t (sync ≥ 0), so
    c(S) min ω ≤ F · c(S) / (3 (S + B − 1)), a share that grows with S. No ZB-H1 plan then costs under (1 − share) ·
    the 1F1B optimum (its cut, each stage holding min(S, B), is a 1F1B plan)."""
    S, B = max(deepest, 1), microbatches
    return (S + min(S, B) - 2) / (3 * (S + B - 1))


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
    rounds: int  # inner DPs run (relaxed and full, per t_max value evaluated per bound)
    floor: float | None = None  # a search stopped at its work limit: a lower bound on the optimum (None: exact)


@dataclass(frozen=True)
class Entries:
    """A stage table whose memory binds through the in-flight depth alone, as `stages.stage_table` makes it: entry
    [h, i, j, s] runs in `latency` with per-iteration `sync` at every level k ≤ `depth` and not above. It stands for
    the dense t[h, k, i, j, s] and extra of k = 0 … L (`dense`) without building them: those repeat each entry at
    every level, a table of options × layers³ × submeshes (Llama-2 70B on 64 A100s: 0.9 GB each)."""

    latency: np.ndarray  # [h, i, j, s]; inf where the entry runs at no depth
    sync: np.ndarray  # [h, i, j, s]
    depth: np.ndarray  # [h, i, j, s]: the deepest level the entry fits, 0 … L (L: every level)

    @property
    def layers(self) -> int:
        return self.latency.shape[1]

    def dense(self) -> tuple[np.ndarray, np.ndarray]:
        """The t[h, k, i, j, s] and extra[h, k, i, j, s] it stands for (level 0 unused)."""
        k = np.arange(self.layers + 1)[None, :, None, None, None]
        fits = (k >= 1) & (k <= self.depth[:, None])
        return np.where(fits, self.latency[:, None], INF), np.where(fits, self.sync[:, None], 0.0)

    def levels(self, deepest: int) -> int:
        """`_levels` of the dense tables: one more than the deepest depth short of `deepest` (1 when none is)."""
        short = self.depth[(self.depth >= 1) & (self.depth < deepest)]
        return int(short.max()) + 1 if short.size else 1

    def held(self, level: int, depth: int, admitted: np.ndarray | bool = True) -> Entries:
        """The entries that fit `level`, and are `admitted`, each set to fit every level up to `depth` instead."""
        keep = (self.depth >= level) & admitted
        return Entries(np.where(keep, self.latency, INF), np.where(keep, self.sync, 0.0), np.where(keep, depth, 0))


def _levels(deepest: int, *tables: np.ndarray) -> int:
    """The least k0 >= 1 such that slices k0..deepest of every table are equal (DP levels needed)."""
    k0 = deepest
    while k0 > 1 and all(np.array_equal(x[:, k0 - 1], x[:, deepest]) for x in tables):
        k0 -= 1
    return k0


def _extent(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per (submesh, first layer i) of t[s, k, i, j]: its last finite j + 1 and the levels its step needs (0: none);
    level k needs an entry there and k stages on the L - i layers left."""
    K, L = t.shape[1] - 1, t.shape[2]
    finite = np.isfinite(t[:, 1:])  # (s, k - 1, i, j)
    any_j = finite.any(axis=3)  # (s, k - 1, i)
    found = any_j.any(axis=1)
    reach = np.where(found, L - np.argmax(finite.any(axis=1)[:, :, ::-1], axis=2), 0)
    depth = np.where(found, K - np.argmax(any_j[:, ::-1], axis=1), 0)  # deepest level with an entry
    first = np.arange(L)
    return reach, np.where(reach > first, np.minimum(depth, L - first), 0)


def _steps(reach: np.ndarray, top: np.ndarray, sizes: list[int], live: list[int],
           devices: int) -> list[list[tuple[int, int, int, int, int]]]:
    """The inner DP's vectorised steps per first layer i: (submeshes a..b-1, levels, last layer + 1, device columns).
    All `live` submeshes in one step while its block of candidates (levels × submeshes × last layers × columns)
    is at most BLOCK_BYTES, else one step per submesh; a step computes up to its levels, the rest are inf."""
    first = np.arange(reach.shape[1])
    levels, end = top.max(axis=0), np.where(top > 0, reach, 0).max(axis=0)
    lo, hi, columns = live[0], live[-1] + 1, devices + 1 - min(sizes[s] for s in live)
    whole = (levels * (hi - lo) * (end - first) * columns * 8 <= BLOCK_BYTES).tolist()
    levels, end, top, reach = levels.tolist(), end.tolist(), top.T.tolist(), reach.T.tolist()
    return [[(lo, hi, levels[i], end[i], columns)] if whole[i] else
            [(s, s + 1, top[i][s], reach[i][s], devices + 1 - sizes[s]) for s in live] for i in first]


def _inner(t: np.ndarray, sizes: list[int], devices: int):
    """The inner DP on t[s, k, i, j] (levels k = 1..k0, level k0 meaning "k0 or more"), entries > t_max
    already inf: least sum t per (level, first layer, devices), what each level continues into, and
    where level k0 continues in itself. Choices are not stored: `_plan` finds them again.

    Per first layer i, each step's candidates t[s, k, i, j] + after[k - 1, j + 1, d'] are reduced over j into
    least[k - 1, s, pad + d'], and f[k, i, d] is the least of least[k - 1, s, pad + d - size_s] over s (the pad
    columns inf): min over the same sums as one submesh at a time, so the same values and ties."""
    K, L = t.shape[1] - 1, t.shape[2]
    f = np.full((K + 1, L + 1, devices + 1), INF)
    f[0, L, 0] = 0.0
    after = f[:K].copy()  # after[k - 1]: what a stage at level k continues into
    live = [s for s, size in enumerate(sizes) if size <= devices]
    if live:
        pad = max(sizes[s] for s in live)
        width = pad + devices + 1
        least = np.full((K, len(sizes), width), INF)
        flat = least.reshape(K, -1)
        pick = (np.array(live) * width + pad - np.array(sizes)[live])[:, None] + np.arange(devices + 1)  # [s, d]
        reach, top = _extent(t)
        top[np.array(sizes) > devices] = 0
        levels = top.max(axis=0).tolist()
        steps = _steps(reach, top, sizes, live, devices)
        # last layer j outermost and the candidates C-ordered: the min over j then runs over whole contiguous rows
        cost = t[:, 1:].transpose(2, 3, 1, 0)[..., None]  # [i, j, k - 1, s, 1]
        rest = after.transpose(1, 0, 2)[:, :, None]  # [j, k - 1, 1, d]
        for i in range(L - 1, -1, -1):
            k = levels[i]
            for a, b, upto, end, columns in steps[i] if k else ():
                if upto:
                    candidates = np.add(cost[i, i:end, :upto, a:b], rest[i + 1:end + 1, :upto, :, :columns], order="C")
                    np.minimum.reduce(candidates, axis=0, out=least[:upto, a:b, pad:pad + columns])
                if upto < k:
                    least[upto:k, a:b, pad:] = INF
            if k:
                np.minimum.reduce(flat[:k].take(pick, axis=1), axis=1, out=f[1:k + 1, i])
            after[:K - 1, i] = f[:K - 1, i]
            np.minimum(f[K - 1, i], f[K, i], out=after[K - 1, i])
    return f, after, f[K] < f[K - 1]  # stay: level K continues in level K (else K - 1)


def _plan(t: np.ndarray, f, after, stay, sizes: list[int], devices: int,
          count: int | None = None) -> tuple[float, list[tuple[int, int, int, int]]] | None:
    """The inner DP's best plan on all `devices` (of exactly `count` stages when given, a level below the top
    or the top level itself): (sum t, [(first, last, submesh, level)]), or None.
    Each stage is the (last layer, submesh) whose sum t + rest equals the state's value, as `_inner` added them."""
    K = f.shape[0] - 1
    level = 1 + int(np.argmin(f[1:, 0, devices])) if count is None else count
    value = float(f[level, 0, devices])
    if not np.isfinite(value):
        return None
    stages, i, d = [], 0, devices
    while level > 0:
        j, s = next((i + int(np.argmax(row == f[level, i, d])), s) for s, row in
                    ((s, t[s, level, i, i:] + after[level - 1, i + 1:, d - size]) for s, size in enumerate(sizes)
                     if size <= d) if (row == f[level, i, d]).any())
        stages.append((i, j, s, level))
        i, d = j + 1, d - sizes[s]
        level = K if level == K and stay[i, d] else level - 1
    return value, stages


def _pipeline(t: np.ndarray, sizes: list[int], devices: int, microbatches: int, bound: float,
              summed: np.ndarray | None = None, count: int | None = None,
              known: list[tuple[float, float]] | None = None,
              hint: float | None = None) -> tuple[float, list[tuple[int, int, int, int]], int] | None:
    """min sum t + (B - 1) max t over plans on t[k, i, j, s] (of exactly `count` stages when given), by
    branch and bound over t_max (module docstring); exact when below `bound`, None when nothing is. `summed`
    (default t): what the sum adds per entry, t less a rebate, while t_max and the max term stay on t. Returns
    (total, [(first, last, submesh, level)], rounds).

    `known`: pairs (c, g(c)) evaluated on earlier tables whose every entry (t and summed) was no larger, so that g
    here is at least g(c) at every latency up to c (c inf: at every latency); this call's evaluations are added.

    Submeshes with no feasible entry are left out and the device counts divided by the greatest common
    divisor of those left (exact: every sum of their sizes is a multiple of it; GPT-1T's layers fit no
    submesh smaller than a node, so its DP runs over 384 node counts, not 3072 devices)."""
    alive = np.flatnonzero(np.isfinite(t[1:]).reshape(-1, t.shape[-1]).any(axis=0)).tolist()
    unit = math.gcd(*(sizes[s] for s in alive)) if alive else 1
    if devices % unit:
        return None  # no stages of these sizes tile the devices
    t, sizes, devices = t[..., alive], [sizes[s] // unit for s in alive], devices // unit
    summed = None if summed is None else summed[..., alive]
    levels = _values(t[1:])
    same = summed is None
    t = np.ascontiguousarray(np.moveaxis(t, -1, 0))  # [s, k, i, j]: each submesh's rows contiguous
    summed = t if same else np.ascontiguousarray(np.moveaxis(summed, -1, 0))
    if len(levels) == 0:
        return None
    slope = microbatches - 1
    best: tuple[float, list] | None = None
    rounds = 0
    open_: list[tuple[float, int, int, float]] = []  # (lower bound, lo, hi, g(levels[hi]))
    known = [] if known is None else known
    floor = _floor(levels, known) if known else None  # per latency, g there is at least this (earlier tables)
    if floor is not None and float(np.min(floor + slope * levels)) >= bound:
        return None

    K = t.shape[1] - 1
    tails: dict[int, np.ndarray] = {}  # top -> each entry's least latency over levels top … K (`relaxed`, same t)

    def relaxed(top: int, t_max: float, full: np.ndarray | None) -> np.ndarray:
        """Levels 0 … `top` of the table at `t_max`, level `top` holding each entry's least over levels top … K: as
        "top or more" stages to the end, a lower bound on the exact inner DP (levels below it are exact)."""
        if full is not None:
            return np.concatenate([full[:, :top], full[:, top:].min(axis=1, keepdims=True)], axis=1)
        if top not in tails:
            tails[top] = t[:, top:].min(axis=1, keepdims=True)
        table = np.concatenate([t[:, :top], tails[top]], axis=1)
        return np.where(table <= t_max, table, INF)

    def inner(table: np.ndarray):
        return _plan(table, *_inner(table, sizes, devices), sizes, devices, count)

    def evaluate(index: int) -> tuple[float, int] | None:
        """Run the inner DP at t_max = levels[index]; keep its plan if best: (g, index of its max t).
        Relaxations first, from one level up: when a plan costs the same at the levels its stages land on, it is
        exact; else the next relaxation keeps exact every level a stage fell short at (and at least twice as many),
        so that a plan deep in memory-bound levels costs a DP of about its stage count, not of every level."""
        nonlocal best, rounds
        found = None
        t_max = levels[index]
        reach = t_max if index < len(levels) - 1 else INF  # how far up what is found here bounds g on later tables
        full = None if same else np.where(t <= t_max, summed, INF)  # with a rebate the relaxation needs it
        top = 1
        while count is None and top < K:
            table = relaxed(top, t_max, full)
            rounds += 1
            plan = inner(table)
            if plan is None:
                known.append((reach, INF))
                return None
            n = len(plan[1])
            placed = [(i, j, s, min(n - p, K)) for p, (i, j, s, _) in enumerate(plan[1])]
            short = [k for (i, j, s, k), (_, _, _, level) in zip(placed, plan[1])
                     if (summed[s, k, i, j] if t[s, k, i, j] <= t_max else INF) != table[s, level, i, j]]
            if not short:
                found = (plan[0], placed)
                break
            top = max(2 * top, max(short) + 1)
        if found is None:
            rounds += 1
            found = inner(np.where(t <= t_max, summed, INF) if full is None else full)
        known.append((reach, INF if found is None else found[0]))
        if found is None:
            return None
        value, stages = found
        peak = max(float(t[s, k, i, j]) for i, j, s, k in stages)
        total = value + slope * peak
        if best is None or total < best[0] - 1e-15:
            best = (total, stages)
        return value, int(np.searchsorted(levels, peak))

    def push(lo: int, hi: int, g_hi: float) -> None:
        if lo < hi:
            lower = g_hi + slope * float(levels[lo]) if floor is None else \
                float(np.min(np.maximum(g_hi, floor[lo:hi]) + slope * levels[lo:hi]))
            heapq.heappush(open_, (lower, lo, hi, g_hi))

    top = evaluate(len(levels) - 1)
    if top is None:
        return None
    split = int(np.searchsorted(levels, hint, side="right")) - 1 if hint is not None else -1
    if 0 <= split < top[1]:  # the hinted latency first: a plan near the optimum bounds the rest early
        found = evaluate(split)
        push(split + 1, top[1], top[0])
        if found is not None:
            push(0, found[1], found[0])
    else:
        push(0, top[1], top[0])
    while open_:
        lower, lo, hi, g_hi = heapq.heappop(open_)
        if lower >= min(bound, best[0]):
            break
        mid = (lo + hi) // 2
        found = evaluate(mid)
        if found is None:
            push(mid + 1, hi, g_hi)  # infeasible at levels[mid]: so is every latency below it
            continue
        g_mid, peak = found
        push(mid + 1, hi, g_hi)
        push(lo, peak, g_mid)
    return best[0], [(i, j, alive[s], k) for i, j, s, k in best[1]], rounds


def _values(t: np.ndarray) -> np.ndarray:
    """The distinct finite values of t[k, …], sorted: those of level 0 and those that differ from the level below
    (a stage table changes little from one in-flight level to the next, so this sorts far fewer than all of them)."""
    changed = t[1:][t[1:] != t[:-1]]
    values = np.concatenate([t[0].ravel(), changed])
    return np.unique(values[np.isfinite(values)])


def _floor(levels: np.ndarray, known: list[tuple[float, float]]) -> np.ndarray:
    """Per latency of `levels`, the largest g of the `known` pairs (c, g) with c at or above it (-inf: none)."""
    if not known:
        return np.full(len(levels), -INF)
    c, g = np.array(known).T
    order = np.argsort(c, kind="stable")
    c, above = c[order], np.maximum.accumulate(g[order][::-1])[::-1]  # above[n]: the largest g of pairs n, n + 1, …
    at = np.searchsorted(c, levels, side="left")
    return np.where(at < len(c), above[np.minimum(at, len(c) - 1)], -INF)


def _fastest(t: np.ndarray, extra: np.ndarray, bound: float,
             summed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Each entry's least latency over options with extra <= bound, and that option (the first on ties);
    one option at a time, so no copy of all of them is made. With `summed`, also its least summed value
    over those options, taken on its own: the fastest option's when t less the rebate grows with t (a rebate
    the same for all options, or a share of t), else a lower bound (`zero_bubble`'s share of omega)."""
    table = np.full(t.shape[1:], INF)
    low = None if summed is None else np.full(t.shape[1:], INF)
    option = np.zeros(t.shape[1:], dtype=np.int32)
    for h in range(t.shape[0]):
        within = extra[h] <= bound
        better = within & (t[h] < table)
        table[better] = t[h][better]
        option[better] = h
        if low is not None:
            np.minimum(low, np.where(within, summed[h], INF), out=low)
    return table, option, low


def _fastest_entries(entries: Entries, bound: float, top: int,
                     summed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`_fastest` of the dense tables `entries` stands for, levels 0 … `top` (level `top`: "top or deeper").

    Each option goes to the one level where it stops fitting (its depth, at most `top`), then each level takes
    the best of the levels below it (an option fitting a deeper level fits this one): options × layers² ×
    submeshes plus levels × layers² × submeshes, not their product. Ties keep the first option, as `_fastest`."""
    H, L, _, S = entries.latency.shape
    table = np.full((top + 1, L, L, S), INF)
    option = np.zeros((top + 1, L, L, S), dtype=np.int32)
    low = None if summed is None else np.full((top + 1, L, L, S), INF)
    for h in range(H):
        i, j, s = np.nonzero((entries.sync[h] <= bound) & (entries.depth[h] >= 1))
        k = np.minimum(entries.depth[h][i, j, s], top)
        latency = entries.latency[h][i, j, s]
        better = latency < table[k, i, j, s]
        table[k[better], i[better], j[better], s[better]] = latency[better]
        option[k[better], i[better], j[better], s[better]] = h
        if low is not None:
            low[k, i, j, s] = np.minimum(low[k, i, j, s], summed[h][i, j, s])
    for k in range(top - 1, 0, -1):
        deeper = (table[k + 1] < table[k]) | ((table[k + 1] == table[k]) & (option[k + 1] < option[k]))
        table[k] = np.where(deeper, table[k + 1], table[k])
        option[k] = np.where(deeper, option[k + 1], option[k])
        if low is not None:
            np.minimum(low[k], low[k + 1], out=low[k])
    return table, option, low


def _top(k0: int, deepest: int, count: int | None) -> int | None:
    """The DP's levels for plans of exactly `count` stages (any count when None): level `count` must be its own, as
    the top level means "that many or more"; None when `count` is beyond `deepest`."""
    if count is None:
        return k0
    return None if count > deepest else max(k0, count)


def solve(t: np.ndarray | Entries, extra: np.ndarray | None, sizes: list[int], devices: int, microbatches: int,
          rebate: np.ndarray | None = None, cutoff: float = INF, count: int | None = None,
          proven: bool = True) -> DPResult | None:
    """The optimal stages, or None when no plan fits (every entry infeasible or devices not tiled).

    `t` and `extra` are indexed [h, k, i, j, s] (or [k, i, j, s] for entries with one option); or `t` is
    `Entries` (and `extra` None), the same DP without the dense tables.
    `rebate` (broadcast to t; to `Entries.latency`): subtracted from each entry in the sum, not in the max
    (`zero_bubble`'s bound); the total then is sum (t - rebate) + (B - 1) max t + max extra, exact when t - rebate
    grows with t (`_fastest`), else a lower bound. `cutoff`: a plan is exact only when it
    costs less; otherwise the result costs at least `cutoff` (the caller discards it). `count`: plans of
    exactly that many stages (the entries at levels above it should be inf). `proven=False`: the plan of the
    fastest options whatever their per-iteration work, at its cost with that work counted, and none of the search
    that proves it the best or finds a better one (a plan, for callers that only need a bound to prune by: the
    first of the rounds over bounds on that work, and often already the optimum at many microbatches).
    """
    if isinstance(t, Entries):
        entries = t
        summed = None if rebate is None else entries.latency - rebate
        deepest = min(entries.layers, devices)
        k0 = _top(entries.levels(deepest), deepest, count)
        if k0 is None:
            return None
        levels = np.unique(entries.sync[entries.depth >= 1])

        def fastest(bound: float):
            return _fastest_entries(entries, bound, k0, summed)

        def sync_of(c: StageChoice) -> float:
            return float(entries.sync[c.option, c.first, c.last, c.submesh])
    else:
        if t.ndim == 4:
            t, extra = t[None], extra[None]
            rebate = None if rebate is None else np.asarray(rebate)[None]
        summed = None if rebate is None else t - rebate
        deepest = min(t.shape[2], devices, t.shape[1] - 1)
        k0 = _top(_levels(deepest, t, extra, *(() if summed is None else (summed,))), deepest, count)
        if k0 is None:
            return None
        t, extra = t[:, :k0 + 1], extra[:, :k0 + 1]
        summed = None if summed is None else summed[:, :k0 + 1]
        levels = np.unique(np.concatenate([np.unique(e[np.isfinite(x)]) for x, e in zip(t, extra)]))

        def fastest(bound: float):
            return _fastest(t, extra, bound, summed)

        def sync_of(c: StageChoice) -> float:
            return float(extra[c.option, min(c.inflight, k0), c.first, c.last, c.submesh])

    best: DPResult | None = None
    rounds = 0
    bound = INF
    known: list[tuple[float, float]] = []  # g's evaluated so far: each tighter bound only raises the table's entries
    hint = None
    while True:
        table, option, low = fastest(bound)
        found = _pipeline(table, sizes, devices, microbatches, min(cutoff, best.total if best else INF), low, count,
                          known, hint)
        if found is None:
            break
        pipeline, picked, used = found
        rounds += used
        hint = max(float(table[k, i, j, s]) for i, j, s, k in picked)  # the plan's largest latency (levels k ≤ k0)
        if best is not None and pipeline >= best.total:
            break  # tighter bounds only raise the pipeline part
        n = len(picked)
        stages = [StageChoice(i, j, s, n - p, int(option[k, i, j, s])) for p, (i, j, s, k) in enumerate(picked)]
        sync = max(sync_of(c) for c in stages)
        if best is None or pipeline + sync < best.total - 1e-15:
            best = DPResult(pipeline + sync, stages, hint, rounds)
        lower = levels[levels < sync]
        if len(lower) == 0 or pipeline >= cutoff or not proven:
            break
        bound = float(lower[-1])
    return None if best is None else DPResult(best.total, best.stages, best.max_latency, rounds)


def zero_bubble(entries: Entries, omega: np.ndarray, sizes: list[int], devices: int,
                microbatches: int, cutoff: float = INF, limit: int | None = None,
                hint: int | None = None, seed: list[StageChoice] | None = None) -> DPResult | None:
    """The least ZB-H1 iteration (`schedules.iteration_time`) over cuts, submeshes and options, or None when
    no plan fits or none costs less than `cutoff`.

    `entries` from `stages.stage_table` (level k: the entry's memory fits min(k, B) microbatches); `omega[h, i,
    j, s]` the entry's min(w, f, t - f - w) as plan assembly splits its latency
    (`stages.split_table`; any finite number where it cannot run). A plan of S stages costs F - c(S) min_i omega_i, F its 1F1B total and c(S) =
    S + min(S, B) - 2, and holds min(S, B) on every stage. Exact (docs/COSTMODEL.md §5b): per stage count
    S, its level min(S, B) entries and a fixed c, branch and bound over a threshold on min omega
    (`_threshold`), after a one-DP bound that drops S outright when it cannot win.

    `limit`: the inner DPs the search may run (from its start; it stops only once a plan or the cutoff is
    known); past it the search stops, and the result's `floor` is a lower bound on every plan it did not rule out (the plan found or
    the cutoff is then within `total - floor` of the optimum). Stopped before any plan beat the cutoff, the
    result has no stages, an infinite total and the floor below the cutoff (None when the floor does not
    reach below it). Deterministic: a count of DPs, not seconds. `hint`: a stage count to search first and
    outwards from (the caller's 1F1B plan's): where the best plans likely are, for a search that may stop.
    `seed`: a plan on the same table (the caller's 1F1B plan), run as ZB-H1 (`as_zero_bubble`) when its stages fit:
    the first incumbent, so the bounds cut from the start; the result is the same, save a tie with the seed.
    """
    L = entries.layers
    deepest = min(L, devices)
    state = {"best": None, "total": cutoff, "rounds": 0, "floor": INF, "limit": INF if limit is None else limit}
    seeded = as_zero_bubble(entries, omega, seed, microbatches) if seed else None
    if seeded is not None and seeded.total < cutoff:
        state["best"], state["total"] = seeded, seeded.total

    def bound(table: Entries, share: float, count: int | None) -> DPResult | None:
        """`_rebated` under the best plan so far, its DPs counted."""
        found = _rebated(table, omega, share, sizes, devices, microbatches, state["total"], count)
        if found is not None:
            state["rounds"] += found.rounds
        return None if found is None or found.total >= state["total"] else found

    def bound_from(count: int) -> DPResult | None:
        return bound(*_from(entries, count, microbatches, deepest), count)

    def bound_below(count: int) -> DPResult | None:
        """The bound for `count` stages or fewer in one DP: each entry at its least latency and sync over depths
        (what fits any count), any number of stages, the largest share for S <= count."""
        least = Entries(entries.latency, np.where(entries.depth >= L, entries.sync, 0.0),
                        np.where(entries.depth >= 1, L, 0))
        return bound(least, _largest_share(range(1, count + 1), microbatches), None)

    # the stage counts from `hint` outwards (ascending without one): the likeliest first, so that a search
    # stopped at its limit has tried them; from the hint up, one bound drops every larger count at once
    start = hint or 1
    order = sorted(range(1, deepest + 1), key=lambda k: (abs(k - start), k))
    ceiling = deepest  # counts above it are ruled out
    for n, count in enumerate(order):
        if count > ceiling:
            continue
        if _spent(state):  # stopped: bound what is left, one DP a side
            left = [k for k in order[n:] if k <= ceiling]
            above, below = [k for k in left if k >= start], [k for k in left if k < start]
            for rest in (bound_from(min(above)) if above else None,
                         bound_below(max(below)) if below else None):
                if rest is not None:
                    state["floor"] = min(state["floor"], rest.total)
            break
        table, c = _levels_of(entries, count, microbatches)
        if start <= count < deepest and _largest_share(range(count, deepest + 1), microbatches) > 0 and (
                bound_from(count) is None):
            ceiling = count - 1
            continue
        alone = bound(table, c / count, count)
        if alone is not None:
            _threshold(table, omega, c, count, sizes, devices, microbatches, state, alone.total)
    best, floor = state["best"], state["floor"]
    if best is None:  # stopped before any plan beat the cutoff: no stages, and how far below it one may be
        return DPResult(INF, [], INF, state["rounds"], floor) if floor < cutoff else None
    return DPResult(best.total, best.stages, best.max_latency, state["rounds"], floor if floor < best.total else None)


def zero_bubble_may_beat(entries: Entries, omega: np.ndarray, sizes: list[int], devices: int, microbatches: int,
                         cutoff: float) -> bool:
    """Whether `zero_bubble`'s bounds leave a ZB-H1 plan on `entries` that may cost under `cutoff`: per stage count S
    from 1 up, its own bound (`_rebated`), until one for S stages or more at once (`_from`) rules the rest out. The
    bounds never fall as an entry's latency rises (each rebates at most two thirds of it), so a table whose entries
    are at most another's bounds that one's plans too."""
    deepest = min(entries.layers, devices)
    for count in range(1, deepest + 1):
        rest, share = _from(entries, count, microbatches, deepest)
        if not _under(_rebated(rest, omega, share, sizes, devices, microbatches, cutoff, count), cutoff):
            return False  # no plan of `count` stages or more
        table, c = _levels_of(entries, count, microbatches)
        if _under(_rebated(table, omega, c / count, sizes, devices, microbatches, cutoff, count), cutoff):
            return True
    return False


def _under(found: DPResult | None, cutoff: float) -> bool:
    """Whether a DP found a plan costing less than its `cutoff` (over it, the DP's result only says so)."""
    return found is not None and found.total < cutoff


def _levels_of(entries: Entries, count: int, microbatches: int) -> tuple[Entries, int]:
    """The entries of ZB-H1 plans of `count` stages (those fitting min(count, B), at levels 1..count), and c(count)."""
    held = min(count, microbatches)
    return entries.held(held, count), count + held - 2


def _largest_share(counts: range, microbatches: int) -> float:
    """The largest c(S) / S over `counts`: the rebate share a ZB-H1 bound over those stage counts may take."""
    return max((k + min(k, microbatches) - 2) / k for k in counts)


def _from(entries: Entries, count: int, microbatches: int, deepest: int) -> tuple[Entries, float]:
    """The table and share of the ZB-H1 bound for `count` stages or more at once: the entries fitting min(count, B)
    at every level, level `count` as the top ("or more"), the largest share beyond it (entries fitting min(S, B)
    include theirs)."""
    return (entries.held(min(count, microbatches), entries.layers),
            _largest_share(range(count, deepest + 1), microbatches))


def _rebated(table: Entries, omega: np.ndarray, share: float, sizes: list[int], devices: int, microbatches: int,
             cutoff: float, count: int | None) -> DPResult | None:
    """min_i omega_i <= sum omega / S: every ZB-H1 plan of S stages costs at least sum (t - c(S) / S omega) + (B - 1)
    max t + max sync, one DP with `share` c / S of each entry's omega rebated in the sum (of exactly `count` stages
    when given), under `cutoff` (`solve`)."""
    rebate = np.where(np.isfinite(table.latency), omega * share, 0.0) if share > 0 else None
    return solve(table, None, sizes, devices, microbatches, rebate, cutoff, count)


def as_zero_bubble(entries: Entries, omega: np.ndarray, stages: list[StageChoice], microbatches: int) -> DPResult | None:
    """The plan `stages` (cuts and submeshes on `entries`) run as ZB-H1, each stage in its own option when that holds
    min(S, B) microbatches, else in the fastest that does (the lowest on ties); None when some stage has none."""
    S = len(stages)
    held = min(S, microbatches)
    picked = []
    for c in stages:
        fits = np.flatnonzero(entries.depth[:, c.first, c.last, c.submesh] >= held)
        if not len(fits):
            return None
        h = c.option if c.option in fits else int(fits[np.argmin(entries.latency[fits, c.first, c.last, c.submesh])])
        picked.append((h, c.first, c.last, c.submesh))
    times = [float(entries.latency[e]) for e in picked]
    total = (sum(times) + (microbatches - 1) * max(times) - (S + held - 2) * min(float(omega[e]) for e in picked)
             + max(float(entries.sync[e]) for e in picked))
    return DPResult(total, [StageChoice(i, j, s, S, h) for h, i, j, s in picked], max(times), 0)


def _spent(state: dict) -> bool:
    """Whether a zero-bubble search has run its DPs and has something to return (a plan or the cutoff)."""
    return state["rounds"] >= state["limit"] and state["total"] < INF


def _threshold(table: Entries, omega: np.ndarray, c: int, count: int, sizes: list[int],
               devices: int, microbatches: int, state: dict, least: float = -INF) -> None:
    """The least F - c min omega over plans of exactly `count` stages on `table`, kept in `state` when best.

    g(θ) = the least F over plans whose stages all have omega >= θ (one `solve`) never falls as θ rises;
    its plan's own min omega θ' >= θ, so g is constant on [θ, θ'] and the plan costs g(θ) - c θ', the
    least there. On a stretch (θ_lo, θ_hi] of the sorted omegas every plan costs at least g(θ_lo) - c θ_hi,
    so the stretch with the least bound is split first and any reaching the best plan is dropped (as the
    t_max branch and bound of `_pipeline`, mirrored). Past `state["limit"]` DPs it stops, its least open
    bound (at least `least`, a bound on every plan of `count` stages) kept in `state["floor"]`."""
    thetas = np.unique(omega[np.isfinite(table.latency)])
    open_: list[tuple[float, int, int, float]] = []  # (lower bound, lo, hi, g at or below thetas[lo])

    def evaluate(x: int, hi: int) -> tuple[float, int] | None:
        """g(thetas[x]) and the index of its plan's min omega, keeping the plan if best; None when no plan has
        min omega >= thetas[x] costing less than the best plus c thetas[hi] (then no θ in [x, hi] wins)."""
        admitted = table.held(1, count, omega >= thetas[x])
        found = solve(admitted, None, sizes, devices, microbatches, None, state["total"] + c * float(thetas[hi]), count)
        if found is None:
            return None
        state["rounds"] += found.rounds
        picked = [(x.option, x.first, x.last, x.submesh) for x in found.stages]
        least = min(float(omega[e]) for e in picked)
        if found.total >= state["total"] + c * float(thetas[hi]):
            return None
        plan = as_zero_bubble(table, omega, found.stages, microbatches)  # its options all hold min(count, B)
        if plan.total < state["total"] - 1e-15:
            state["best"], state["total"] = plan, plan.total
        return found.total, int(np.searchsorted(thetas, least))

    def push(lo: int, hi: int, g_lo: float) -> None:
        if lo <= hi:
            heapq.heappush(open_, (g_lo - c * float(thetas[hi]), lo, hi, g_lo))

    push(0, len(thetas) - 1, -INF)
    while open_:
        lower, lo, hi, g_lo = heapq.heappop(open_)
        if lower >= state["total"]:
            break
        if _spent(state):  # stopped: the least bound left
            state["floor"] = min(state["floor"], max(lower, least))
            break
        mid = lo if c == 0 else (lo + hi) // 2
        found = evaluate(mid, hi)
        if found is None:  # nothing at thetas[mid] and above wins (or fits)
            push(lo, mid - 1, g_lo)
            continue
        g_mid, reach = found
        push(lo, mid - 1, g_lo)
        if c:
            push(reach + 1, hi, g_mid)
