"""The stage DP against brute force over every cut, submesh assignment and microbatch count,
and against the plain t_max enumeration it replaced (kept here as the reference)."""

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partopt import stagedp


def cuts(n):
    """Every way to cut layers 0..n-1 into contiguous stages, as (first, last) lists."""
    for mask in itertools.product([False, True], repeat=n - 1):
        stages, first = [], 0
        for i, cut in enumerate(mask):
            if cut:
                stages.append((first, i))
                first = i + 1
        stages.append((first, n - 1))
        yield stages


def brute_force(t, extra, sizes, devices, microbatches):
    """Every cut × submesh × option assignment: sum t + (B - 1) max t + max extra."""
    best = None
    H, L = t.shape[0], t.shape[2]
    for stages in cuts(L):
        k = len(stages)
        for subs in itertools.product(range(len(sizes)), repeat=k):
            if sum(sizes[s] for s in subs) != devices:
                continue
            for options in itertools.product(range(H), repeat=k):
                keys = [(h, k - p, i, j, s) for p, ((i, j), s, h) in enumerate(zip(stages, subs, options))]
                lat = [t[key] for key in keys]
                if not np.all(np.isfinite(lat)):
                    continue
                total = sum(lat) + (microbatches - 1) * max(lat) + max(extra[key] for key in keys)
                best = total if best is None else min(best, total)
    return best


def reference_inner(t: np.ndarray, sizes: list[int], devices: int, t_max: float):
    """min over plans with every stage latency <= t_max of sum(t), with argmins."""
    K, L = t.shape[0] - 1, t.shape[1]
    f = np.full((K + 1, L + 1, devices + 1), np.inf)
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
                cand = np.where(ok[:, None], rest + cost[:, None], np.inf)  # (J, D - size + 1)
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


def reference_pipeline(t: np.ndarray, sizes: list[int], devices: int, microbatches: int,
                       bound: float) -> tuple[float, list[tuple[int, int, int, int]], int] | None:
    """min sum t + (B - 1) max t below `bound` (Alpa's t_max enumeration): (total, stages, rounds)."""
    best: tuple[float, list] | None = None
    rounds = 0
    for t_max in np.unique(t[np.isfinite(t)]):
        if microbatches * t_max >= min(bound, best[0] if best else np.inf):
            break
        rounds += 1
        f, arg = reference_inner(t, sizes, devices, float(t_max))
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


def reference_solve(t: np.ndarray, extra: np.ndarray, sizes: list[int], devices: int, microbatches: int):
    """The optimal total, or None: the stage DP before issue 19 (every bound, every t_max, one DP level per k)."""
    levels = np.unique(extra[np.isfinite(t)])
    best: float | None = None
    bound = np.inf
    while True:
        allowed = np.where(extra <= bound, t, np.inf)
        option = allowed.argmin(axis=0)
        table = np.take_along_axis(allowed, option[None], axis=0)[0]
        found = reference_pipeline(table, sizes, devices, microbatches, best if best is not None else np.inf)
        if found is None:
            break
        pipeline, picked, _ = found
        if best is not None and pipeline >= best:
            break  # tighter bounds only raise the pipeline part
        sync = max(float(extra[int(option[k, i, j, s]), k, i, j, s]) for i, j, s, k in picked)
        best = pipeline + sync if best is None else min(best, pipeline + sync)
        lower = levels[levels < sync]
        if len(lower) == 0:
            break
        bound = float(lower[-1])
    return best


def random_instance(rng, mode="memory", max_layers=5):
    """Random tables: "memory" (an entry fits up to a random in-flight count), "uniform" (every k
    alike), or "arbitrary" (latency and per-iteration work vary with k)."""
    L = rng.randint(1, max_layers)
    H = rng.randint(1, 3) if L <= 4 else 1  # logical mesh shapes per submesh (brute force grows as H^stages)
    nodes, per_node = rng.choice([(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)])
    sizes = sorted({2**e for e in range(per_node.bit_length()) if 2**e <= per_node} | {k * per_node for k in range(2, nodes + 1)})
    S = len(sizes)
    t = np.full((H, L + 1, L, L, S), np.inf)
    extra = np.zeros((H, L + 1, L, L, S))
    for h in range(H):
        for i in range(L):
            for j in range(i, L):
                for s in range(S):
                    base = (j - i + 1) * rng.uniform(0.5, 2) / sizes[s] ** rng.uniform(0.3, 1)
                    sync = round(rng.uniform(0, 1.5), 2)  # per iteration: can outweigh the pipeline
                    memory_limit = {"memory": rng.randint(0, L + 1), "uniform": L}.get(mode, L)
                    for k in range(1, L + 1):
                        extra[h, k, i, j, s] = sync
                        if k <= memory_limit:
                            t[h, k, i, j, s] = round(base, 3)
                        if mode == "arbitrary" and rng.random() < 0.8:
                            t[h, k, i, j, s] = round(base * rng.uniform(0.8, 1.2), 3)
                            extra[h, k, i, j, s] = round(sync * rng.uniform(0.5, 1.5), 2)
                        elif mode == "arbitrary":
                            t[h, k, i, j, s] = np.inf
    return t, extra, sizes, nodes * per_node


def check_plan(got, t, extra, sizes, devices, microbatches):
    """The returned stages are a valid plan realising the total they claim."""
    k = len(got.stages)
    keys = [(c.option, c.inflight, c.first, c.last, c.submesh) for c in got.stages]
    lat = [t[key] for key in keys]
    assert [c.inflight for c in got.stages] == list(range(k, 0, -1))
    assert sum(sizes[c.submesh] for c in got.stages) == devices
    assert got.stages[0].first == 0 and got.stages[-1].last == t.shape[2] - 1
    assert all(a.last + 1 == b.first for a, b in zip(got.stages, got.stages[1:]))
    realised = sum(lat) + (microbatches - 1) * max(lat) + max(extra[key] for key in keys)
    assert realised == pytest.approx(got.total, rel=1e-12)
    assert got.max_latency == max(lat)


def agrees(expected, t, extra, sizes, devices, microbatches) -> None:
    """`stagedp.solve` finds `expected` (None: no plan), with a plan that is valid and adds up to its total."""
    got = stagedp.solve(t, extra, sizes, devices, microbatches)
    if expected is None:
        assert got is None
        return
    assert got.total == pytest.approx(expected, rel=1e-12)
    check_plan(got, t, extra, sizes, devices, microbatches)


@pytest.mark.parametrize("mode", ["memory", "uniform", "arbitrary"])
@pytest.mark.parametrize("seed", range(30))
def test_dp_equals_brute_force(seed, mode):
    rng = random.Random(seed)
    t, extra, sizes, devices = random_instance(rng, mode)
    for microbatches in (1, 2, 3, 8, 128):
        agrees(brute_force(t, extra, sizes, devices, microbatches), t, extra, sizes, devices, microbatches)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["memory", "uniform", "arbitrary"]),
       st.sampled_from([1, 4, 32, 128]))
def test_dp_equals_reference_on_medium_instances(seed, mode, microbatches):
    """Up to 9 layers and 8 devices: beyond brute force, within the plain enumeration's reach."""
    rng = random.Random(seed)
    t, extra, sizes, devices = random_instance(rng, mode, max_layers=9)
    agrees(reference_solve(t, extra, sizes, devices, microbatches), t, extra, sizes, devices, microbatches)


@pytest.mark.parametrize("mode", ["memory", "uniform", "arbitrary"])
@pytest.mark.parametrize("seed", range(30))
def test_an_unproven_plan_has_the_least_pipeline_part_at_its_own_cost(seed, mode):
    """`proven=False`: a valid plan at the total it claims, no faster than the optimum, whose pipeline part
    (sum t + (B - 1) max t) is the least of any plan's: brute force on each entry's fastest option, work left out."""
    rng = random.Random(seed)
    t, extra, sizes, devices = random_instance(rng, mode)
    fastest, no_work = t.min(axis=0, keepdims=True), np.zeros((1, *extra.shape[1:]))
    for microbatches in (1, 8, 128):
        got = stagedp.solve(t, extra, sizes, devices, microbatches, proven=False)
        optimum = brute_force(t, extra, sizes, devices, microbatches)
        if optimum is None:
            assert got is None
            continue
        check_plan(got, t, extra, sizes, devices, microbatches)
        assert got.total >= optimum * (1 - 1e-12)
        latencies = [t[c.option, c.inflight, c.first, c.last, c.submesh] for c in got.stages]
        pipeline = sum(latencies) + (microbatches - 1) * max(latencies)
        assert pipeline == pytest.approx(brute_force(fastest, no_work, sizes, devices, microbatches), rel=1e-12)


def deep_memory_instance(rng, sizes: tuple[int, ...], layers: int = 12, devices: int = 12):
    """One option, `layers` layers: a stage of n layers on s devices holds up to about s · U(4, 12) / n microbatches,
    so that memory binds at every in-flight level, and the plans' stages land on levels where it binds."""
    S = len(sizes)
    t, extra = np.full((1, layers + 1, layers, layers, S), np.inf), np.zeros((1, layers + 1, layers, layers, S))
    for i in range(layers):
        for j in range(i, layers):
            for s, size in enumerate(sizes):
                n = j - i + 1
                depth = min(layers, int(size * rng.uniform(4, 12) / n))
                t[0, 1:depth + 1, i, j, s] = round(n * rng.uniform(0.8, 1.2) / size ** 0.8, 3)
                extra[0, 1:, i, j, s] = round(rng.uniform(0, 0.5), 2)
    return t, extra, list(sizes), devices


@pytest.mark.parametrize("sizes", [(2, 4), (1, 2, 4)])
def test_partial_relaxations_find_the_optimum(monkeypatch, sizes):
    """Relaxations that keep the levels a stage fell short at exact (`_pipeline`'s `relaxed`) find the plain
    enumeration's optimum on tables whose memory binds at all 12 levels; with stages of 2 and 4 devices (at most 6
    stages) they settle on fewer levels than the table's 12, never running the DP of all of them."""
    levels = []
    inner = stagedp._inner
    monkeypatch.setattr(stagedp, "_inner", lambda t, *rest: levels.append(t.shape[1] - 1) or inner(t, *rest))
    for seed in range(6):
        t, extra, sizes_, devices = deep_memory_instance(random.Random(seed), sizes)
        for microbatches in (4, 64):
            agrees(reference_solve(t, extra, sizes_, devices, microbatches), t, extra, sizes_, devices, microbatches)
    assert any(1 < k < 12 for k in levels)
    if sizes == (2, 4):
        assert max(levels) < 12


def test_a_tables_values_are_those_of_every_level():
    """`_values`: the distinct finite values of all levels, sorted, whether a level repeats the one below or not."""
    t = np.array([[[1.0, np.inf]], [[1.0, 3.0]], [[2.0, 3.0]], [[2.0, np.inf]]])
    assert stagedp._values(t).tolist() == [1.0, 2.0, 3.0]
    rng = np.random.default_rng(0)
    t = np.where(rng.random((5, 4, 4)) < 0.3, np.inf, rng.integers(0, 9, (5, 4, 4)).astype(float))
    assert stagedp._values(t).tolist() == np.unique(t[np.isfinite(t)]).tolist()


def test_known_pairs_floor_every_latency_up_to_theirs():
    """`_floor` by hand: a pair (c, g) bounds g at latencies up to c, the largest such g wins, inf is every latency."""
    known = [(5.0, 7.0), (2.0, 10.0), (np.inf, 4.0)]
    assert stagedp._floor(np.array([1.0, 2.0, 3.0, 5.0, 6.0]), known).tolist() == [10.0, 10.0, 7.0, 7.0, 4.0]
    assert stagedp._floor(np.array([1.0, 1.5, 2.0]), [*known, (1.5, np.inf)]).tolist() == [np.inf, np.inf, 10.0]
    assert stagedp._floor(np.array([1.0]), []).tolist() == [-np.inf]


def least_sum(table: np.ndarray, sizes: list[int], devices: int, t_max: float) -> float:
    """g(t_max): the least sum of a plan on `table` [k, i, j, s] whose stages all take at most t_max."""
    return float(reference_inner(table, sizes, devices, t_max)[0][:, 0, devices].min())


@pytest.mark.parametrize("seed", range(40))
def test_g_of_a_looser_bound_floors_g_of_a_tighter_one(seed):
    """What `solve` carries from one bound on per-iteration work to the next: g evaluated on the table of a looser
    bound (each entry's fastest option within it), as `_floor` spreads it, is at most g on a tighter bound's table at
    every latency (checked against the plain DP at each)."""
    rng = random.Random(seed)
    t, extra, sizes, devices = random_instance(rng, "arbitrary", max_layers=4)
    bounds = np.unique(extra[np.isfinite(t)])[::-1]
    tables = [np.where(extra <= b, t, np.inf).min(axis=0) for b in bounds]
    for looser, tighter in zip(tables, tables[1:]):
        levels = np.unique(looser[1:][np.isfinite(looser[1:])])
        known = [(c, least_sum(looser, sizes, devices, c)) for c in levels[:-1]]
        known += [(np.inf, least_sum(looser, sizes, devices, levels[-1]))] if len(levels) else []
        latencies = np.unique(tighter[1:][np.isfinite(tighter[1:])])
        floor = stagedp._floor(latencies, known)
        g = np.array([least_sum(tighter, sizes, devices, c) for c in latencies])
        assert np.all(floor <= g * (1 + 1e-12))


def test_per_iteration_work_is_a_max_not_a_sum():
    """Two layers, two single devices: splitting pays each stage's sync once, in parallel."""
    t = np.full((3, 2, 2, 1), np.inf)
    extra = np.zeros((3, 2, 2, 1))
    t[1, 1, 1, 0], t[2, 0, 0, 0] = 1.0, 1.0  # one layer per device
    extra[1, 1, 1, 0], extra[2, 0, 0, 0] = 5.0, 4.0
    got = stagedp.solve(t, extra, [1], 2, microbatches=4)
    assert got.total == pytest.approx(2.0 + 3 * 1.0 + 5.0)


def test_block_granularity_finds_a_faster_plan_than_16_groups():
    """18 equal blocks on 8 GPUs: 16 groups of them (two are pairs) cannot cut everywhere a pipeline of
    the blocks can; the default (every block) finds a strictly faster plan that cuts where they cannot."""
    from partopt.cluster import preset
    from partopt.inter import Options, optimize
    from partopt.layering import build_layers
    from test_intra import mlp

    graph, cluster = mlp(18, 512, 8192), preset("p3.16xlarge", 1)
    assert Options().layers >= 18  # the default cuts at every block of this model
    blocks = optimize(graph, cluster, microbatches=32)
    grouped = optimize(graph, cluster, microbatches=32, layers=16)
    assert blocks.iteration_time_s < grouped.iteration_time_s * (1 - 1e-3)
    group_ends = {last for _, last in build_layers(graph, 16).groups}
    assert {s.layers[1] for s in blocks.stages} - group_ends  # a cut 16 groups cannot express


@pytest.mark.parametrize("seed", range(20))
def test_dp_equals_brute_force_when_small_submeshes_fit_nothing(seed):
    """Entries only on whole nodes (sizes 4, 8): the DP counts devices in units of 4 and still finds the optimum."""
    rng = random.Random(seed)
    t, extra, sizes, devices = random_instance(rng, "memory")
    while sizes[-1] < 4:
        t, extra, sizes, devices = random_instance(rng, "memory")
    t[..., [s for s, size in enumerate(sizes) if size < 4]] = np.inf
    for microbatches in (1, 3, 128):
        agrees(brute_force(t, extra, sizes, devices, microbatches), t, extra, sizes, devices, microbatches)


def test_no_plan_when_the_feasible_sizes_cannot_tile_the_devices():
    """Only stages of 2 devices can run, on 3 devices: no plan (the unit 2 does not divide 3)."""
    t = np.full((1, 2, 1, 1, 2), np.inf)
    t[0, 1, 0, 0, 1] = 1.0  # sizes (1, 2): only the 2-device submesh runs the layer
    assert brute_force(t, np.zeros_like(t), [1, 2], 3, 4) is None
    assert stagedp.solve(t, np.zeros_like(t), [1, 2], 3, 4) is None


@pytest.mark.parametrize("seed", range(40))
def test_entries_plan_as_the_dense_tables_they_stand_for(seed):
    """`Entries` (a latency, sync and deepest fitting level per entry) give the DP the plan, option by option, that
    the dense t[h, k, i, j, s] they stand for give it: the same total and stages (ties keep the first option),
    with and without a rebate, and for an exact stage count."""
    rng = np.random.default_rng(seed)
    H, L, sizes = int(rng.integers(1, 4)), int(rng.integers(1, 6)), [1, 2, 4]
    devices = int(rng.integers(1, 8))
    shape = (H, L, L, len(sizes))
    depth = np.where(np.triu(np.ones((L, L), bool))[None, :, :, None], rng.integers(0, L + 1, shape), 0)
    latency = np.where(depth >= 1, np.round(rng.uniform(1, 4, shape)), np.inf)  # rounded: options tie
    sync = np.where(depth >= 1, np.round(rng.uniform(0, 2, shape)), 0.0)
    entries = stagedp.Entries(latency, sync, depth)
    t, extra = entries.dense()
    assert entries.levels(min(L, devices)) == stagedp._levels(min(L, devices), t, extra)
    rebate = np.where(np.isfinite(latency), latency / 4, 0.0)
    for B in (1, 3, 16):
        for count in (None, *range(1, min(L, devices) + 1)):
            for cut in (None, rebate):
                got = stagedp.solve(entries, None, sizes, devices, B, cut, count=count)
                dense = stagedp.solve(np.where(np.arange(L + 1)[None, :, None, None, None] <= (count or L), t, np.inf),
                                      extra, sizes, devices, B, None if cut is None else cut[:, None], count=count)
                assert (got is None) == (dense is None)
                if got is not None:
                    assert (got.total, got.stages, got.max_latency) == (dense.total, dense.stages, dense.max_latency)
