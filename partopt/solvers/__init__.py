"""Mixed 0-1 linear programs and the backends that solve them, behind one interface.

`Model` holds binary variables (and bounded continuous ones) with objective costs and sparse rows
`lo <= a·x <= hi`;
`solve(model, backend=...)` hands it to HiGHS (default: the fastest, docs/benchmarks.md), OR-Tools CP-SAT or CBC (via PuLP)
and returns a `Result` with status, objective, best bound, gap and time. Every backend is
seeded and single-threaded, and stops at a deterministic work limit (`WORK_UNITS`: the solver's
own measure, not the clock), so the same model gives the same answer whatever the machine's load;
the wall-clock `time_limit_s` is only a safety net. A solve stopped by either limit returns its
incumbent, if it has one (a model's `start` is one), with the best bound and gap.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from partopt.errors import PartoptError

# limit: stopped at the work limit (the same answer whatever the load); timeout: stopped by the wall clock;
# cutoff: no solution costs less than the solve's cutoff (`solve(cutoff=...)`)
STATUSES = ("optimal", "feasible", "infeasible", "limit", "timeout", "cutoff")
WORK_UNITS = {"highs": "branch-and-bound nodes", "cpsat": "deterministic seconds", "cbc": "branch-and-bound nodes"}
# HiGHS proves 15 of the 16 memory-capped GPT-39B block ILPs optimal at the root node and the last in 9 nodes,
# the root taking up to 7 s here (22 s with the CPU loaded), so 1000 nodes binds only on ILPs unlike those;
# CBC gets the same count (PuLP does not report CBC's nodes). CP-SAT spent about 2 s of wall time per
# deterministic second on that block on this loaded 2-core machine, so 20 binds before the 60 s clock.
# scripts/bench_solver_limits.py, docs/benchmarks.md ("Deterministic solver limits").
DEFAULT_WORK_LIMITS = {"highs": 1000, "cpsat": 20.0, "cbc": 1000}
# the wall-clock safety net per ILP, for a solver that runs away; the work limits above are what stop an ILP. At
# 60 s the net fell before them: memory-capped GPT-39B block ILPs whose transient peak binds take 19-45 s of CPU
# here (HiGHS: 259 nodes in 45 s), so a default solve beside one other job stopped one at 60 s, a plan that
# depended on the load (docs/benchmarks.md, "Where the large defaults spend their time")
TIME_LIMIT_S = 600.0
# rows and continuous columns larger than this reach the floating-point backends scaled down to about it
# (`Model.shrunk`): memory rows in bytes (coefficients to 1e10) made HiGHS's dual simplex crawl, a capped
# Llama-2 70B block ILP taking 80 s at 13 nodes against 7.5 s scaled (docs/benchmarks.md). A backend's
# absolute feasibility tolerance (1e-6) then stands for about 1e-12 of a row's largest coefficient: under a
# tenth of a byte of an 80 GB memory row, so rows of whole bytes stay exact
MAGNITUDE = 2.0**20


@dataclass
class Model:
    """Minimise `objective · x` subject to `lo <= row · x <= hi` for every row, x binary except the
    continuous variables, which range over [0, upper]."""

    objective: list[float] = field(default_factory=list)
    rows: list[tuple[list[int], list[float], float, float]] = field(default_factory=list)
    continuous: dict[int, float] = field(default_factory=dict)  # variable -> its upper bound
    scale: float = 1.0  # objective units per second (see ilp.build_model)
    # values of some variables in a feasible solution: the solver starts from it, so a solve stopped by a limit
    # still returns an incumbent (HiGHS completes a partial start itself; CP-SAT takes it as a hint, CBC as a MIP start)
    start: dict[int, float] = field(default_factory=dict)
    offset: float = 0.0  # seconds of constant cost the objective leaves out (see ilp.build_model)

    @property
    def num_vars(self) -> int:
        return len(self.objective)

    def add_var(self, cost: float) -> int:
        """A new binary variable; returns its index."""
        self.objective.append(float(cost))
        return len(self.objective) - 1

    def add_vars(self, costs: np.ndarray) -> np.ndarray:
        """New binary variables, one per entry of `costs` (any shape); returns their indices in that shape."""
        first = len(self.objective)
        self.objective.extend(np.asarray(costs, dtype=float).ravel().tolist())
        return np.arange(first, len(self.objective)).reshape(np.shape(costs))

    def add_continuous(self, upper: float, cost: float = 0.0) -> int:
        """A new continuous variable in [0, upper]; returns its index."""
        if not 0 <= upper < math.inf:
            raise PartoptError(f"a continuous variable needs a finite upper bound >= 0, got {upper}", "model")
        index = self.add_var(cost)
        self.continuous[index] = float(upper)
        return index

    def add_row(self, index: list[int], coef: list[float], lo: float, hi: float) -> None:
        self.rows.append((list(index), [float(c) for c in coef], float(lo), float(hi)))

    def value(self, x: list[float]) -> float:
        """Objective of an assignment, in the model's own (unscaled) units."""
        return math.fsum(c * v for c, v in zip(self.objective, x) if v)

    def shrunk(self) -> tuple[Model, list[float]]:
        """The same program with every continuous column and row whose magnitude exceeds MAGNITUDE scaled
        down to about it by a power of two (exact in floating point), and each column's scale: a solution
        x' of the shrunk model is x_j = x'_j · scale[j] of this one."""
        scale = [1.0] * self.num_vars
        for j, upper in self.continuous.items():
            scale[j] = _shrink(upper)
        rows = []
        for index, coef, lo, hi in self.rows:
            row = [c * scale[i] for i, c in zip(index, coef)] if self.continuous else coef
            s = _shrink(max(map(abs, row), default=0.0))
            rows.append((index, row, lo, hi) if s == 1.0 else (index, [c / s for c in row], lo / s, hi / s))
        return Model([c * k for c, k in zip(self.objective, scale)], rows,
                     {j: upper / scale[j] for j, upper in self.continuous.items()}, self.scale,
                     {j: v / scale[j] for j, v in self.start.items()}), scale


def _shrink(magnitude: float) -> float:
    """The power of two that brings `magnitude` down to about MAGNITUDE (1 when it is no larger)."""
    return 2.0 ** round(math.log2(magnitude / MAGNITUDE)) if magnitude > MAGNITUDE else 1.0


@dataclass(frozen=True)
class Result:
    status: str  # one of STATUSES
    values: list[float] | None  # per variable (0/1 for binaries), None when no solution was found
    objective: float | None
    bound: float | None  # best proven lower bound on the objective
    time_s: float
    backend: str
    work: float = 0.0  # work done, in the backend's WORK_UNITS

    @property
    def deterministic(self) -> bool:
        """True unless the wall clock stopped the solve (then a loaded machine may answer otherwise)."""
        return self.status != "timeout"

    @property
    def gap(self) -> float | None:
        """Relative optimality gap (0 when proven optimal)."""
        if self.objective is None or self.bound is None:
            return None
        if self.status == "optimal":
            return 0.0
        return max(0.0, (self.objective - self.bound) / max(abs(self.objective), 1e-30))


@dataclass(frozen=True)
class Options:
    time_limit_s: float = TIME_LIMIT_S  # wall-clock safety net
    seed: int = 0
    threads: int = 1
    work_limit: float = math.inf  # in the backend's WORK_UNITS
    relaxation_first: bool = False  # HiGHS: solve the LP relaxation first, and stop there when it is integral
    cutoff: float | None = None  # in objective units: only a solution below it is wanted (`solve`)
    first_under_cutoff: bool = False  # HiGHS: stop at the first solution under the cutoff (`solve`)


BACKENDS = ("cpsat", "highs", "cbc")


def _backend(name: str) -> Callable[[Model, Options], Result]:
    """The named backend's `solve`, its module imported on first use: OR-Tools alone takes about 0.5 s to
    import, paid by every process of a solve (the planner and each spawned worker) that never runs CP-SAT."""
    if name not in BACKENDS:
        raise PartoptError(f"unknown solver backend {name!r}", "solver", f"use one of {list(BACKENDS)}")
    return importlib.import_module(f"partopt.solvers.{name}").solve


def under(value: float, bar: float) -> bool:
    """Whether `value` is under a cutoff `bar` by more than 1e-9 relatively (a solution at the bar, rounded under it,
    is not); everything is under an infinite bar."""
    return bar == math.inf or value < bar - 1e-9 * max(1.0, abs(bar))


def solve(model: Model, backend: str = "highs", time_limit_s: float = TIME_LIMIT_S, seed: int = 0,
          work_limit: float | None = None, relaxation_first: bool = False, cutoff: float | None = None,
          first_under_cutoff: bool = False) -> Result:
    """Solve `model` with the named backend, stopping at `work_limit` (in its WORK_UNITS; None: its
    DEFAULT_WORK_LIMITS entry; math.inf: none) or, as a safety net, after `time_limit_s` seconds.

    `relaxation_first` (HiGHS; the other backends ignore it): solve the LP relaxation first and return its
    solution, proven optimal, when every 0-1 variable comes out integral; else the program as usual. Worth it
    where the relaxation is usually tight, as it is for the pairwise min-sums with no memory row that `ilp.solve`
    leaves of GPT blocks: their LP takes a tenth of the MIP's root (docs/benchmarks.md, "LP relaxation first").

    `cutoff` (objective units): the caller has no use for a solution costing that much or more, so the backend
    may prune every branch whose bound reaches it (HiGHS: `objective_bound`; CP-SAT and CBC: the objective as a
    row). A solve whose best solution is at or above it (within 1e-9 relatively: a MIP may return one at the
    bound, rounded under it), or that finds none, returns status "cutoff" (no
    values) when it ran to its end: the optimum is at least `cutoff`, or the program is infeasible. A solve
    stopped by a limit before any solution under the cutoff keeps its status ("limit", "timeout") with no values:
    it proves nothing (HiGHS stopped at its first node returned its start, above the cutoff). A solution below it
    is the optimum, as without a cutoff.

    `first_under_cutoff` (HiGHS; the other backends solve on to the optimum): only whether a solution under the
    cutoff exists matters, so the solve stops at the first one found, with status "limit" (a solution, no proof)."""
    run = _backend(backend)
    if time_limit_s <= 0:
        raise PartoptError(f"time limit must be positive, got {time_limit_s}", "time limit")
    work = DEFAULT_WORK_LIMITS[backend] if work_limit is None else work_limit
    if not work >= 0:
        raise PartoptError(f"work limit must be non-negative, got {work_limit}", "work limit",
                           f"give {WORK_UNITS[backend]}, or math.inf for none")
    result = run(model, Options(time_limit_s=time_limit_s, seed=seed, work_limit=work,
                                relaxation_first=relaxation_first, cutoff=cutoff,
                                first_under_cutoff=first_under_cutoff and cutoff is not None))
    if cutoff is None or (result.objective is not None and under(result.objective, cutoff)):
        return result
    if result.status in ("optimal", "infeasible"):  # the search ran to its end: nothing is under the cutoff
        return Result("cutoff", None, None, None, result.time_s, result.backend, result.work)
    # stopped by a limit with no solution under the cutoff (its start, say, above it): no verdict, and no solution
    return Result(result.status, None, None, result.bound, result.time_s, result.backend, result.work)
