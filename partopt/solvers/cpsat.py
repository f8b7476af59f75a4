"""OR-Tools CP-SAT backend: costs are scaled to integers (1e-9 of the largest term); row coefficients are
rounded to integers and continuous variables become integers in [0, upper] (exact for partopt's rows, which
count whole bytes)."""

from __future__ import annotations

import math
import time

from ortools.sat.python import cp_model

from partopt.solvers import Model, Options, Result

RESOLUTION = 1e9  # the largest objective coefficient becomes this many integer units


def solve(model: Model, options: Options) -> Result:
    start = time.perf_counter()
    largest = max((abs(c) for c in model.objective), default=0.0)
    scale = RESOLUTION / largest if largest > 0 else 1.0
    cp = cp_model.CpModel()
    x = [cp.new_int_var(0, math.floor(model.continuous[i]), f"x{i}") if i in model.continuous
         else cp.new_bool_var(f"x{i}") for i in range(model.num_vars)]
    for index, coef, lo, hi in model.rows:
        expr = sum(int(round(c)) * x[i] for i, c in zip(index, coef))
        if lo == hi:
            cp.add(expr == int(round(lo)))
        else:
            if lo > float("-inf"):
                cp.add(expr >= int(round(lo)))
            if hi < float("inf"):
                cp.add(expr <= int(hi // 1))
    objective = sum(int(round(c * scale)) * v for c, v in zip(model.objective, x) if c)
    cp.minimize(objective)
    if options.cutoff is not None:  # each term rounds by at most 1/2 unit: the row keeps every solution below it
        cp.add(objective <= math.ceil(options.cutoff * scale + model.num_vars / 2))
    for i, value in model.start.items():
        cp.add_hint(x[i], int(round(value)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = options.time_limit_s
    solver.parameters.max_deterministic_time = options.work_limit  # reproducible with one worker
    solver.parameters.random_seed = options.seed
    solver.parameters.num_workers = options.threads
    code = solver.solve(cp)
    elapsed = time.perf_counter() - start
    work = solver.deterministic_time
    # CP-SAT reports which limit stopped it only in its log: the clock did if the work limit was not reached
    stopped = "limit" if work >= options.work_limit else "timeout"
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        values = [int(solver.value(v)) for v in x]
        status = "optimal" if code == cp_model.OPTIMAL else stopped
        bound = solver.best_objective_bound / scale
        objective = model.value(values)
        return Result(status, values, objective, min(bound, objective), elapsed, "cpsat", work)
    status = "infeasible" if code == cp_model.INFEASIBLE else stopped
    return Result(status, None, None, None, elapsed, "cpsat", work)
