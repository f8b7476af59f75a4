"""The stage DP against brute force over every cut, submesh assignment and microbatch count."""

import itertools
import random

import numpy as np
import pytest

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


def random_instance(rng):
    L = rng.randint(1, 6)
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
                    memory_limit = rng.randint(0, L + 1)  # most in-flight microbatches that fit
                    for k in range(1, L + 1):
                        extra[h, k, i, j, s] = sync
                        if k <= memory_limit:
                            t[h, k, i, j, s] = round(base, 3)
    return t, extra, sizes, nodes * per_node


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    t, extra, sizes, devices = random_instance(rng)
    for microbatches in (1, 2, 3, 8):
        expected = brute_force(t, extra, sizes, devices, microbatches)
        got = stagedp.solve(t, extra, sizes, devices, microbatches)
        if expected is None:
            assert got is None
            continue
        assert got.total == pytest.approx(expected, rel=1e-12)
        # the returned stages realise the total they claim
        k = len(got.stages)
        keys = [(c.option, c.inflight, c.first, c.last, c.submesh) for c in got.stages]
        lat = [t[key] for key in keys]
        assert [c.inflight for c in got.stages] == list(range(k, 0, -1))
        assert sum(sizes[c.submesh] for c in got.stages) == devices
        assert got.stages[0].first == 0 and got.stages[-1].last == t.shape[2] - 1
        realised = sum(lat) + (microbatches - 1) * max(lat) + max(extra[key] for key in keys)
        assert realised == pytest.approx(got.total, rel=1e-12)


def test_per_iteration_work_is_a_max_not_a_sum():
    """Two layers, two single devices: splitting pays each stage's sync once, in parallel."""
    t = np.full((3, 2, 2, 1), np.inf)
    extra = np.zeros((3, 2, 2, 1))
    t[1, 1, 1, 0], t[2, 0, 0, 0] = 1.0, 1.0  # one layer per device
    extra[1, 1, 1, 0], extra[2, 0, 0, 0] = 5.0, 4.0
    got = stagedp.solve(t, extra, [1], 2, microbatches=4)
    assert got.total == pytest.approx(2.0 + 3 * 1.0 + 5.0)
