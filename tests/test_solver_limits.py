"""Deterministic work limits: a solve stopped by its backend's work limit returns the same incumbent,
status and bound however loaded the machine is, and that incumbent is feasible with a valid bound
(both checked against brute force); the wall clock is only a safety net, and says so ("timeout")."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import numpy as np
import pytest

from partopt import solvers
from partopt.errors import PartoptError

ITEMS, ROWS = 22, 8
TINY = {"highs": 1, "cbc": 1, "cpsat": 0.001}  # a root node; a thousandth of a deterministic second


def knapsack() -> solvers.Model:
    """Pick items of the highest value under 8 capacity rows, each half its row's total weight."""
    rng = random.Random(1)
    model = solvers.Model()
    for _ in range(ITEMS):
        model.add_var(-rng.randint(10, 100) - rng.random())
    for _ in range(ROWS):
        weights = [rng.randint(5, 60) for _ in range(ITEMS)]
        model.add_row(list(range(ITEMS)), weights, -math.inf, sum(weights) // 2)
    return model


def feasible(model: solvers.Model, x: list[int]) -> bool:
    return all(lo <= sum(c * x[i] for i, c in zip(index, coef)) <= hi for index, coef, lo, hi in model.rows)


@pytest.fixture(scope="module")
def optimum() -> float:
    """The knapsack's optimum by enumerating all 2^22 assignments, in chunks of 2^18."""
    model = knapsack()
    weights = np.zeros((ROWS, ITEMS))
    for r, (index, coef, _, _) in enumerate(model.rows):
        weights[r, index] = coef
    caps = np.array([hi for *_, hi in model.rows])
    cost = np.array(model.objective)
    low = ((np.arange(2**18)[:, None] >> np.arange(18)) & 1).astype(float)  # items 0..17
    low_weight, low_cost = low @ weights[:, :18].T, low @ cost[:18]
    best = math.inf
    for high in range(2 ** (ITEMS - 18)):  # items 18..21
        bits = ((high >> np.arange(ITEMS - 18)) & 1).astype(float)
        fits = (low_weight + weights[:, 18:] @ bits <= caps).all(axis=1)
        best = min(best, float((low_cost[fits] + cost[18:] @ bits).min()))
    return best


@pytest.fixture
def busy():
    """Two processes spinning on the CPU (the machine's cores) while the test solves."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for p in spinners:
        p.kill()
        p.wait()


@pytest.mark.parametrize("backend", solvers.BACKENDS)
def test_work_limited_solve_is_identical_under_load_and_keeps_a_valid_incumbent(backend, optimum, busy):
    model = knapsack()
    first = solvers.solve(model, backend, time_limit_s=60, work_limit=TINY[backend])
    second = solvers.solve(model, backend, time_limit_s=60, work_limit=TINY[backend])
    assert first.status == "limit" and first.deterministic
    assert (second.status, second.values, second.objective, second.bound) == \
           (first.status, first.values, first.objective, first.bound)
    assert first.values is not None and feasible(model, first.values)
    assert first.objective >= optimum - 1e-9
    if first.bound is not None:  # CBC's bound is not exposed through PuLP
        assert first.bound <= optimum + 1e-6
        assert first.gap == pytest.approx((first.objective - first.bound) / abs(first.objective))


@pytest.mark.parametrize("backend", solvers.BACKENDS)
def test_default_work_limit_reaches_the_brute_force_optimum(backend, optimum):
    result = solvers.solve(knapsack(), backend)
    assert result.status == "optimal" and result.objective == pytest.approx(optimum, abs=1e-9)


@pytest.mark.parametrize("backend", solvers.BACKENDS)
def test_wall_clock_stop_is_reported_as_timeout(backend):
    """A millisecond is too little to finish, and no work limit binds: the clock stopped it."""
    result = solvers.solve(_copies(knapsack(), 8), backend, time_limit_s=1e-3, work_limit=math.inf)
    assert result.status == "timeout" and not result.deterministic


def _copies(model: solvers.Model, k: int) -> solvers.Model:
    """k independent copies of `model` side by side: k times the variables and rows, same structure."""
    out = solvers.Model()
    n = model.num_vars
    for c in range(k):
        for cost in model.objective:
            out.add_var(cost)
        for index, coef, lo, hi in model.rows:
            out.add_row([c * n + i for i in index], coef, lo, hi)
    return out


@pytest.mark.parametrize("backend", solvers.BACKENDS)
def test_an_infeasible_model_is_infeasible_not_stopped(backend):
    model = solvers.Model()
    for _ in range(3):
        model.add_var(1.0)
    model.add_row([0, 1, 2], [1, 1, 1], 4, math.inf)  # three binaries cannot sum to 4
    result = solvers.solve(model, backend)
    assert result.status == "infeasible" and result.values is None


def test_negative_work_limit_is_a_one_line_error():
    with pytest.raises(PartoptError, match="work limit must be non-negative.*branch-and-bound nodes"):
        solvers.solve(knapsack(), "highs", work_limit=-1)


@pytest.mark.parametrize("backend", solvers.BACKENDS)
def test_a_continuous_peak_is_the_largest_of_its_rows(backend):
    """Two items a, b (memory 2 each) with transients 3 and 5 bytes; peak p >= 3a, p >= 5b, 2a + 2b + p <= cap.
    By hand: at cap 9 both fit (2 + 2 + 5), p = 5; at cap 8 only one does, b (worth more: 2 + 5 <= 8)."""
    def model(cap: float) -> solvers.Model:
        m = solvers.Model()
        a, b = m.add_var(-1.0), m.add_var(-1.5)
        p = m.add_continuous(5.0)
        m.add_row([a, p], [3.0, -1.0], -math.inf, 0.0)
        m.add_row([b, p], [5.0, -1.0], -math.inf, 0.0)
        m.add_row([a, b, p], [2.0, 2.0, 1.0], -math.inf, cap)
        return m

    both = solvers.solve(model(9.0), backend)
    assert both.status == "optimal" and both.values[:2] == [1, 1] and both.values[2] == pytest.approx(5.0)
    assert both.objective == pytest.approx(-2.5)
    one = solvers.solve(model(8.0), backend)
    assert one.status == "optimal" and one.values[:2] == [0, 1] and one.objective == pytest.approx(-1.5)
    with pytest.raises(PartoptError):
        solvers.Model().add_continuous(math.inf)


@pytest.mark.parametrize("backend", ["highs", "cpsat"])
def test_a_memory_row_in_bytes_binds_to_the_byte(backend):
    """The peak model above in GiB-sized bytes (items of 2 GiB, transients 3 and 5 GiB): at a cap of
    9 GiB both fit with the peak at 5 GiB; one byte less and only b does. HiGHS solves such rows shrunk
    (`solvers.Model.shrunk`): the byte must still bind, and the peak come back in bytes. (CBC, scaled or
    not, calls the one-byte-short cap infeasible: its tolerances blur a byte of 9 GiB; 1 KiB short it is right.)"""
    gib = 2.0**30

    def model(cap: float) -> solvers.Model:
        m = solvers.Model()
        a, b = m.add_var(-1.0), m.add_var(-1.5)
        p = m.add_continuous(5 * gib)
        m.add_row([a, p], [3 * gib, -1.0], -math.inf, 0.0)
        m.add_row([b, p], [5 * gib, -1.0], -math.inf, 0.0)
        m.add_row([a, b, p], [2 * gib, 2 * gib, 1.0], -math.inf, cap)
        return m

    both = solvers.solve(model(9 * gib), backend)
    assert both.status == "optimal" and both.values[:2] == [1, 1] and both.values[2] == pytest.approx(5 * gib, abs=1.0)
    one = solvers.solve(model(9 * gib - 1), backend)
    assert one.status == "optimal" and one.values[:2] == [0, 1] and one.objective == pytest.approx(-1.5)


def test_a_highs_solve_imports_no_other_backend():
    """Each backend's library is imported when first used: a HiGHS solve (the default, run by every spawned
    pricing worker) loads neither OR-Tools nor PuLP, which cost about half a second per process."""
    script = ("import sys\nfrom partopt import solvers\nm = solvers.Model()\nm.add_var(-1.0)\n"
              "assert solvers.solve(m, 'highs').status == 'optimal'\n"
              "print(sorted(k for k in ('ortools', 'pulp') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unknown_backend_is_named():
    with pytest.raises(PartoptError, match="unknown solver backend 'gurobi'"):
        solvers.solve(knapsack(), "gurobi")
