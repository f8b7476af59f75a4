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
    best = None
    L = t.shape[1]
    for stages in cuts(L):
        for subs in itertools.product(range(len(sizes)), repeat=len(stages)):
            if sum(sizes[s] for s in subs) != devices:
                continue
            k = len(stages)
            lat = [t[k - p, i, j, s] for p, ((i, j), s) in enumerate(zip(stages, subs))]
            if not np.all(np.isfinite(lat)):
                continue
            total = sum(lat) + sum(extra[k - p, i, j, s] for p, ((i, j), s) in enumerate(zip(stages, subs))) + (microbatches - 1) * max(lat)
            best = total if best is None else min(best, total)
    return best


def random_instance(rng):
    L = rng.randint(1, 6)
    nodes, per_node = rng.choice([(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)])
    sizes = sorted({2**e for e in range(per_node.bit_length()) if 2**e <= per_node} | {k * per_node for k in range(2, nodes + 1)})
    S = len(sizes)
    t = np.full((L + 1, L, L, S), np.inf)
    extra = np.zeros((L + 1, L, L, S))
    for i in range(L):
        for j in range(i, L):
            for s in range(S):
                base = (j - i + 1) * rng.uniform(0.5, 2) / sizes[s] ** rng.uniform(0.3, 1)
                memory_limit = rng.randint(0, L + 1)  # most in-flight microbatches that fit
                for k in range(1, L + 1):
                    extra[k, i, j, s] = rng.uniform(0, 0.2)
                    if k <= memory_limit:
                        t[k, i, j, s] = round(base, 3)
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
        lat = [t[c.inflight, c.first, c.last, c.submesh] for c in got.stages]
        assert [c.inflight for c in got.stages] == list(range(k, 0, -1))
        assert sum(sizes[c.submesh] for c in got.stages) == devices
        assert got.stages[0].first == 0 and got.stages[-1].last == t.shape[1] - 1
        realised = sum(lat) + sum(extra[c.inflight, c.first, c.last, c.submesh] for c in got.stages) + (microbatches - 1) * max(lat)
        assert realised == pytest.approx(got.total, rel=1e-12)
