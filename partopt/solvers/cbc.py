"""CBC backend through PuLP (the solver Alpa used)."""

from __future__ import annotations

import math
import time
import warnings

import pulp

from partopt.solvers import Model, Options, Result


def solve(model: Model, options: Options) -> Result:
    with warnings.catch_warnings():  # PuLP 3 deprecates the API and bundled CBC that it still ships
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(model, options)


def _solve(original: Model, options: Options) -> Result:
    start = time.perf_counter()
    model, scale = original.shrunk()
    prob = pulp.LpProblem("partopt", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x{i}", 0, model.continuous[i], cat="Continuous") if i in model.continuous
         else pulp.LpVariable(f"x{i}", cat="Binary") for i in range(model.num_vars)]
    objective = pulp.lpSum(c * v for c, v in zip(model.objective, x) if c)
    prob += objective
    if options.cutoff is not None:  # a hair above: the solutions below the cutoff all stay
        prob += objective <= options.cutoff + 1e-9 * abs(options.cutoff), "cutoff"
    for k, (index, coef, lo, hi) in enumerate(model.rows):
        expr = pulp.lpSum(c * x[i] for i, c in zip(index, coef))
        if lo == hi:
            prob += expr == lo, f"r{k}"
        else:
            if hi < float("inf"):
                prob += expr <= hi, f"u{k}"
            if lo > float("-inf"):
                prob += expr >= lo, f"l{k}"
    for i, value in model.start.items():
        x[i].setInitialValue(value)
    nodes = None if math.isinf(options.work_limit) else int(options.work_limit)
    cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=options.time_limit_s, threads=options.threads, maxNodes=nodes,
                            warmStart=bool(model.start),
                            options=[f"randomSeed {options.seed + 1}", "ratioGap 0", "allowableGap 0"])
    prob.solve(cmd)
    elapsed = time.perf_counter() - start
    # PuLP reads CBC's "Stopped on nodes" and "Stopped on time" alike: the clock stopped it if its limit passed
    clock_ran_out = elapsed >= options.time_limit_s
    stopped = "timeout" if clock_ran_out else "limit"
    if pulp.LpStatus[prob.status] == "Infeasible":
        # CBC can write "Integer infeasible" when its clock ran out before any integer solution: no proof then
        return Result("timeout" if clock_ran_out else "infeasible", None, None, None, elapsed, "cbc")
    values = [(v.value() or 0.0) * scale[i] if i in model.continuous else int(round(v.value() or 0))
              for i, v in enumerate(x)]
    solution_ok = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if not solution_ok:
        return Result(stopped, None, None, None, elapsed, "cbc")
    objective = original.value(values)
    optimal = prob.sol_status == pulp.LpSolutionOptimal
    # PuLP exposes neither CBC's dual bound nor its node count; without proof of optimality the bound is unknown.
    return Result("optimal" if optimal else stopped, values, objective,
                  objective if optimal else None, elapsed, "cbc")
