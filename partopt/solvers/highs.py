"""HiGHS backend (highspy): the model as a sparse MIP with binary and bounded continuous columns.

A program whose 0-1 columns fall into choice rows (exactly one column of each is 1, as every node's strategy
in `partopt.ilp`) is first branched on those rows over HiGHS's LPs (`_branch`): HiGHS's own MIP spends most
of its root on cuts and heuristics that these programs do not need (docs/benchmarks.md, "Choice branching").
"""

from __future__ import annotations

import heapq
import math
import os
import sys
import time
from dataclasses import dataclass

import highspy
import numpy as np

from partopt.solvers import Model, Options, Result, under

MAX_NODES = 2**31 - 1  # HiGHS's integer options are 32-bit; this is its "no limit"
INTEGRALITY_TOLERANCE = 1e-6  # HiGHS's mip_feasibility_tolerance: how far from 0 or 1 its MIP accepts a 0-1 value
# LPs the choice branching solves before HiGHS's own MIP takes over from its incumbent: the memory-capped GPT-39B
# block programs needed 3 to 97, GPT-1T's a median of 5; on GPT-1T's 20 slowest programs 400 took 48 s, against
# 58 s at 200 (the largest settles at 265 LPs in 6 s, and took 19.7 s handed over at 200), 50 s at 300, 54 s at 600
# (docs/benchmarks.md, "Choice branching"). A root LP that leaves more than half as many choice rows fractional goes
# to the MIP at once: the layer programs leave 1 to 20 of 30, GPT-1.3B capped whole 597 of 701 (whose branching ran
# 200 LPs for nothing, 47 s against 38)
BRANCH_NODES = 400
# LPs a program with a cutoff branches without finding a solution under it before HiGHS's MIP takes over: where
# no solution is under the cutoff, branching must close every node whose LP bound is, and a memory cap's LP bound
# can lie far below (a GPT-39B block under a tight rung: LP bound under the cutoff 367, integer optimum 7,667;
# branching ran 400 LPs in 8.4 s before its handover, where HiGHS's MIP, with its cuts on the memory row, proves
# it in 1.3 s; docs/benchmarks.md, "Cut-off programs handed over")
UNDER_CUTOFF_NODES = 50
# a node LP stopped past this many times the root LP's simplex iterations (plus 1000) has stalled (a deterministic
# stop, unlike the clock). The LPs run without HiGHS's `objective_bound`: with it, a warm-started
# node LP deep in a GPT-1T program's tree ran until the clock stopped it after 245 iterations, and without it
# the same LP took 80 iterations in 0.02 s (docs/benchmarks.md, "Choice branching")
STALLED = 5
# a node LP that ends neither optimal nor infeasible from its parent's basis (stalled, or HiGHS's kUnknown) is solved
# again from scratch, as the root was, under the same limit; only if that fails too does HiGHS's MIP take over. A
# GPT-39B block program (full recomputation under a rung's cap) lost its 19th LP warm after 78 iterations and took
# HiGHS's MIP 4.0 s; from scratch that LP took 695 iterations (the root 781) and branching ended at 23 LPs in 0.7 s
# (docs/benchmarks.md, "A node LP lost from its parent's basis")
SETTLED = (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible)


def _new_highs() -> highspy.Highs:
    """A Highs instance, constructed with stdout muted: HiGHS prints a banner from C++ once."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _load(model: Model, options: Options, relaxed: bool) -> highspy.Highs:
    """A Highs instance holding `model` (its 0-1 columns continuous in [0, 1] when `relaxed`), options set."""
    h = _new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(options.time_limit_s))
    h.setOptionValue("mip_max_nodes", int(min(options.work_limit, MAX_NODES)))
    h.setOptionValue("random_seed", int(options.seed))
    h.setOptionValue("threads", int(options.threads))
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 0.0)
    # the models come reduced (partopt.ilp); HiGHS's own presolve then costs more than it saves
    # (up to 4× on memory-capped block ILPs, 1.5× on GPT-1.3B whole; docs/benchmarks.md)
    h.setOptionValue("presolve", "off")
    if options.cutoff is not None:  # prunes every node whose bound reaches it (a hair above: none below it is lost)
        h.setOptionValue("objective_bound", float(options.cutoff) + 1e-6 * max(1.0, abs(options.cutoff)))
        if options.first_under_cutoff:  # every solution the MIP accepts improves on the bound: the first will do
            h.setOptionValue("mip_max_improving_sols", 1)
    n = model.num_vars
    inf = highspy.kHighsInf
    kinds = np.full(n, highspy.HighsVarType.kInteger)
    for j in model.continuous:
        kinds[j] = highspy.HighsVarType.kContinuous
    h.addVars(n, np.zeros(n), _upper(model))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), np.asarray(model.objective, dtype=float))
    if not relaxed:
        h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), kinds)
    if model.rows:
        starts, index, value, lower, upper = [], [], [], [], []
        for idx, coef, lo, hi in model.rows:
            starts.append(len(index))
            index.extend(idx)
            value.extend(coef)
            lower.append(max(lo, -inf))
            upper.append(min(hi, inf))
        h.addRows(len(model.rows), np.asarray(lower), np.asarray(upper), len(index),
                  np.asarray(starts, dtype=np.int32), np.asarray(index, dtype=np.int32),
                  np.asarray(value, dtype=float))
    return h


def _integral_relaxation(original: Model, model: Model, scale: list[float], options: Options,
                         start: float) -> Result | None:
    """The optimum of `model`'s LP relaxation when every 0-1 column comes out 0 or 1 (within the MIP's own
    integrality tolerance): then it is the program's optimum too, proven by its own bound. None otherwise."""
    h = _load(model, options, relaxed=True)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    x = np.asarray(h.getSolution().col_value)
    if not _integral(x, _binary(model)):
        return None
    values = _values(x, model, scale)
    objective = original.value(values)
    bound = min(objective, h.getInfo().objective_function_value)
    return Result("optimal", values, objective, bound, time.perf_counter() - start, "highs", 0.0)


def _values(x, model: Model, scale: list[float]) -> list[float]:
    """A solution of the shrunk `model` in the original's units: continuous columns scaled back, 0-1 ones rounded."""
    x = np.asarray(x, dtype=float)
    values = np.rint(x).astype(np.int64).tolist()  # half to even, as round()
    for j in model.continuous:
        values[j] = float(x[j]) * scale[j]
    return values


def _binary(model: Model) -> np.ndarray:
    """Per column of `model`, whether it is 0-1 (not continuous)."""
    binary = np.ones(model.num_vars, dtype=bool)
    binary[list(model.continuous)] = False
    return binary


def _upper(model: Model) -> np.ndarray:
    """Per column of `model`, its upper bound: 1 for a 0-1 column, its own bound for a continuous one."""
    upper = np.ones(model.num_vars)
    for j, bound in model.continuous.items():
        upper[j] = bound
    return upper


def _integral(x: np.ndarray, binary: np.ndarray) -> bool:
    """Whether every 0-1 column of the LP solution `x` is 0 or 1 within the MIP's own integrality tolerance."""
    return not np.any(np.abs(x[binary] - np.rint(x[binary])) > INTEGRALITY_TOLERANCE)


def _choice_rows(model: Model) -> list[np.ndarray]:
    """The columns of each choice row (0-1 columns summing to exactly 1), or [] unless every 0-1 column that is
    in no choice row is pinned by equality rows to them (as `ilp.build_model`'s pair columns are to their nodes')."""
    binary = _binary(model)
    groups, covered = [], ~binary  # covered: in a choice row, pinned to others by a row of 0, or continuous
    for index, coef, lo, hi in model.rows:
        if lo == hi == 1 and all(c == 1 for c in coef) and binary[index].all():
            groups.append(np.asarray(index))
            covered[index] = True
        elif lo == hi == 0 and len(index) > 1:
            covered[index] = True
    return groups if groups and covered.all() else []


def _branch(model: Model, original: Model, scale: list[float], groups: list[np.ndarray], options: Options,
            start: float) -> tuple[Result | None, dict[int, float], int]:
    """Best-first branch and bound over the choice rows `groups` of the shrunk `model`, each node an LP that
    HiGHS warm-starts from its parent's optimal basis: (the optimum, {}, LPs solved), or (None, the best start found
    for HiGHS's MIP, LPs solved) when it hands over: at BRANCH_NODES LPs, at UNDER_CUTOFF_NODES with a cutoff and
    no solution under it yet, the work or time limit, a node LP not settled even from scratch (STALLED, SETTLED),
    a root LP far from integral, or a 0-1 column that the choices leave fractional.

    A node whose LP leaves some choice row fractional splits it in two: its columns with the larger LP values
    are forbidden in one child, kept alone in the other. The row split is the one whose mix is widest on the
    binding inequality rows (each weighted by its dual; the memory row, chiefly): the relaxation of a capped
    program is fractional where a lean and a fast strategy mix to meet the cap."""
    h = _load(model, Options(options.time_limit_s, options.seed, options.threads), relaxed=True)  # no cutoff (STALLED)
    n = model.num_vars
    binary, upper = _binary(model), _upper(model)
    inequality = [r for r, (_, _, lo, hi) in enumerate(model.rows) if lo != hi]
    spread = _Spread.of(model, inequality, groups)
    bar = math.inf if options.cutoff is None else float(options.cutoff)  # what a solution must get under
    incumbent = None  # the best solution found, in the shrunk model's units
    if len(model.start) == n:  # a whole start is a feasible solution
        x = np.fromiter((model.start[j] for j in range(n)), dtype=float, count=n)
        incumbent, bar = _better(x, incumbent, bar, original, model, scale)
    current = upper  # the column bounds of the LP in `h`
    # (parent's bound, order, forbidden, parent's basis): a child's LP starts from its parent's optimal basis
    queue: list[tuple[float, int, tuple[int, ...], highspy.HighsBasis | None]] = [(-math.inf, 0, (), None)]
    nodes, pushed, limit = 0, 0, min(BRANCH_NODES, options.work_limit)

    def handover() -> tuple[None, dict[int, float], int]:  # HiGHS's MIP goes on from the best solution found
        return None, dict(enumerate(incumbent.tolist())) if incumbent is not None else model.start, nodes

    while queue and under(queue[0][0], bar):
        if nodes >= limit or time.perf_counter() - start > options.time_limit_s:
            return handover()
        if incumbent is None and options.cutoff is not None and nodes >= UNDER_CUTOFF_NODES:
            return handover()
        _, _, forbidden, basis = heapq.heappop(queue)
        if basis is not None:
            h.setBasis(basis)
        bounds = upper.copy()
        bounds[list(forbidden)] = 0.0
        changed = np.flatnonzero(bounds != current).astype(np.int32)  # only these: HiGHS's cost grows with the count
        h.changeColsBounds(len(changed), changed, np.zeros(len(changed)), bounds[changed])
        current = bounds
        h.run()
        if nodes == 0:  # a node's LP, warm-started, that takes many times the root's iterations has stalled
            h.setOptionValue("simplex_iteration_limit", STALLED * h.getInfo().simplex_iteration_count + 1000)
        nodes += 1
        status = h.getModelStatus()
        if status not in SETTLED and basis is not None:  # stalled, or lost (kUnknown), from its parent's basis
            h.clearSolver()
            h.run()
            status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            continue
        if status != highspy.HighsModelStatus.kOptimal:  # numerical trouble, a stalled LP: HiGHS's MIP takes over
            return handover()
        bound = h.getInfo().objective_function_value
        if not under(bound, bar):
            continue
        solution = h.getSolution()
        x = np.asarray(solution.col_value)
        if nodes == 1 and sum(1.0 - x[g].max() > INTEGRALITY_TOLERANCE for g in groups) > BRANCH_NODES // 2:
            return handover()  # far from integral: each LP settles about one row, too many to branch on
        split = _split(groups, x, spread.widths(x, np.abs(np.asarray(solution.row_dual))[inequality]))
        if split is None:  # every choice integral, and so the pair columns: the node's optimum is a solution
            if not _integral(x, binary):  # a 0-1 column its equality rows do not pin to the choices
                return handover()
            incumbent, bar = _better(np.where(binary, np.rint(x), x), incumbent, bar, original, model, scale)
            if options.first_under_cutoff and incumbent is not None:  # one under the cutoff is all that was asked
                return (Result("limit", _values(incumbent, model, scale), bar, None, time.perf_counter() - start,
                               "highs", float(nodes)), {}, nodes)
            continue
        basis = h.getBasis()
        for child in split:
            pushed += 1
            heapq.heappush(queue, (bound, pushed, forbidden + child, basis))
    elapsed = time.perf_counter() - start
    if incumbent is None:
        return Result("infeasible", None, None, None, elapsed, "highs", float(nodes)), {}, nodes
    return Result("optimal", _values(incumbent, model, scale), bar, bar, elapsed, "highs", float(nodes)), {}, nodes


def _better(x: np.ndarray, incumbent: np.ndarray | None, bar: float, original: Model, model: Model,
            scale: list[float]) -> tuple[np.ndarray | None, float]:
    """The solution `x` of the shrunk `model` and its objective when it gets under `bar`, else the incumbent and bar."""
    objective = original.value(_values(x, model, scale))
    return (x, objective) if objective < bar else (incumbent, bar)


@dataclass(frozen=True)
class _Spread:
    """The inequality rows' coefficients on the choice rows' columns, as entries (row, choice row, column,
    coefficient): what `widths` needs, without a dense matrix (a whole-model program has ~10^5 columns)."""

    row: np.ndarray
    group: np.ndarray
    column: np.ndarray
    coef: np.ndarray
    rows: int
    groups: int

    @classmethod
    def of(cls, model: Model, inequality: list[int], groups: list[np.ndarray]) -> _Spread:
        group_of = np.full(model.num_vars, -1)
        for g, columns in enumerate(groups):
            group_of[columns] = g
        parts = []
        for k, r in enumerate(inequality):
            index, coef, _, _ = model.rows[r]
            index, coef = np.asarray(index, dtype=np.int64), np.asarray(coef, dtype=float)
            keep = group_of[index] >= 0
            parts.append((np.full(int(keep.sum()), k), group_of[index[keep]], index[keep], coef[keep]))
        row, group, column, coef = (np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, dtype=int)
                                    for i in range(4))
        return cls(row, group, column, coef.astype(float), len(inequality), len(groups))

    def widths(self, x: np.ndarray, duals: np.ndarray) -> np.ndarray:
        """Per choice row g, the spread of its mix on the binding rows: sum over rows r of |dual_r| ·
        sum_{c in g} x_c · |a_rc − ā_rg|, where ā_rg = sum_{c in g} x_c a_rc is the row's mean over the mix (which
        sums to 1)."""
        live = duals[self.row] > 1e-12
        row, group, share, coef = self.row[live], self.group[live], x[self.column[live]], self.coef[live]
        key = row * self.groups + group
        size = self.rows * self.groups
        mean = np.bincount(key, share * coef, size)
        stored = np.bincount(key, share, size)  # the columns of the mix with no entry in the row: coefficient 0
        deviation = (np.bincount(key, share * np.abs(coef - mean[key]), size)
                     + np.maximum(1.0 - stored, 0.0) * np.abs(mean))
        present = np.flatnonzero(np.bincount(key, minlength=size))
        return np.bincount(present % self.groups, duals[present // self.groups] * deviation[present], self.groups)


def _split(groups: list[np.ndarray], x: np.ndarray, widths: np.ndarray) -> tuple | None:
    """The two children of the LP solution `x`: the columns each forbids, of the fractional choice row whose mix is
    widest on the binding inequality rows (`_Spread.widths`), the most fractional on ties; None when none is."""
    chosen, widest = None, (-1.0, -1.0)
    for g, group in enumerate(groups):
        fraction = 1.0 - x[group].max()
        if fraction > INTEGRALITY_TOLERANCE and (widths[g], fraction) > widest:
            chosen, widest = group, (widths[g], fraction)
    if chosen is None:
        return None
    used = chosen[x[chosen] > INTEGRALITY_TOLERANCE]
    used = used[np.argsort(-x[used], kind="stable")]
    larger = used[: max(1, len(used) // 2)]
    return tuple(larger.tolist()), tuple(np.setdiff1d(chosen, larger).tolist())


def solve(original: Model, options: Options) -> Result:
    start = time.perf_counter()
    model, scale = original.shrunk()
    if options.relaxation_first:
        found = _integral_relaxation(original, model, scale, options, start)
        if found is not None:
            return found
    groups = _choice_rows(model)
    first, branched = model.start, 0
    if groups:
        found, first, branched = _branch(model, original, scale, groups, options, start)
        if found is not None:
            return found
    h = _load(model, options, relaxed=False)
    h.setOptionValue("time_limit", max(options.time_limit_s - (time.perf_counter() - start), 1e-9))
    if first and not options.first_under_cutoff:  # a start at or over the cutoff is no solution to stop at
        index = np.fromiter(first, dtype=np.int32)
        h.setSolution(len(index), index, np.fromiter(first.values(), dtype=float))
    h.run()
    elapsed = time.perf_counter() - start
    status = h.getModelStatus()
    info = h.getInfo()
    nodes = float(branched + info.mip_node_count)
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if status == highspy.HighsModelStatus.kInfeasible:
        return Result("infeasible", None, None, None, elapsed, "highs", nodes)
    optimal = status == highspy.HighsModelStatus.kOptimal
    # the node limit ends a MIP solve with kSolutionLimit; only kTimeLimit comes from the clock
    stopped = "timeout" if status == highspy.HighsModelStatus.kTimeLimit else "limit"
    if not has_solution:
        return Result(stopped, None, None, None, elapsed, "highs", nodes)
    values = _values(h.getSolution().col_value, model, scale)
    objective = original.value(values)
    bound = objective if optimal else min(objective, info.mip_dual_bound)
    return Result("optimal" if optimal else stopped, values, objective, bound, elapsed, "highs", nodes)
