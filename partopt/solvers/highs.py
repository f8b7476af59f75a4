"""HiGHS backend (highspy): the model as a sparse MIP with binary and bounded continuous columns."""

from __future__ import annotations

import os
import sys
import time

import highspy
import numpy as np

from partopt.solvers import Model, Options, Result

MAX_NODES = 2**31 - 1  # HiGHS's integer options are 32-bit; this is its "no limit"
INTEGRALITY_TOLERANCE = 1e-6  # HiGHS's mip_feasibility_tolerance: how far from 0 or 1 its MIP accepts a 0-1 value


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
    n = model.num_vars
    inf = highspy.kHighsInf
    col_upper = np.ones(n)
    kinds = np.full(n, highspy.HighsVarType.kInteger)
    for j, bound in model.continuous.items():
        col_upper[j], kinds[j] = bound, highspy.HighsVarType.kContinuous
    h.addVars(n, np.zeros(n), col_upper)
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
    binary = np.ones(model.num_vars, dtype=bool)
    binary[list(model.continuous)] = False
    if np.any(np.abs(x[binary] - np.round(x[binary])) > INTEGRALITY_TOLERANCE):
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


def solve(original: Model, options: Options) -> Result:
    start = time.perf_counter()
    model, scale = original.shrunk()
    if options.relaxation_first:
        found = _integral_relaxation(original, model, scale, options, start)
        if found is not None:
            return found
    h = _load(model, options, relaxed=False)
    if model.start:
        index = np.fromiter(model.start, dtype=np.int32)
        h.setSolution(len(index), index, np.fromiter(model.start.values(), dtype=float))
    h.run()
    elapsed = time.perf_counter() - start
    status = h.getModelStatus()
    info = h.getInfo()
    nodes = float(info.mip_node_count)
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
