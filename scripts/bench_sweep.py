"""Sweep benchmark (issue 16 item 5): a sweep spec planned as one `partopt.sweep.sweep` (one ILP cache per
(model, cluster)) against the same grid points planned by separate `optimize` calls (no shared cache).

Prints one row per point: the layer ILPs each way, the planning time each way, and whether both found the
same iteration time; then both wall times. Every point runs in this process, one after the other.

    python scripts/bench_sweep.py scripts/sweep-gpt-p3.json
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from partopt import sweep
from partopt.errors import InfeasibleError, SolverError
from partopt.inter import optimize


def separately(spec: sweep.Spec) -> list[tuple[int | None, float, float | None]]:
    """(ILPs solved, planning seconds, iteration time) of each grid point planned alone."""
    results = []
    for p in sweep.points(spec):
        start = time.perf_counter()
        try:
            plan = optimize(p.graph, p.cluster, **{**spec.options, **p.varied})
            results.append((plan.solver["ilps"], time.perf_counter() - start, plan.iteration_time_s))
        except (InfeasibleError, SolverError):
            results.append((None, time.perf_counter() - start, None))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="a partopt.sweep spec file")
    args = parser.parse_args()
    spec = sweep.read_spec(args.spec)
    start = time.perf_counter()
    rows = sweep.sweep(spec)
    shared_wall = time.perf_counter() - start
    start = time.perf_counter()
    alone = separately(spec)
    alone_wall = time.perf_counter() - start
    table = Table(title=f"partopt sweep {args.spec}: shared ILP cache vs separate optimize calls")
    for column in ("model", "cluster", "GPUs", "ILPs shared", "ILPs alone", "planning shared", "planning alone",
                   "same plan time"):
        table.add_column(column, justify="left" if column in ("model", "cluster") else "right")
    for row, (ilps, seconds, iteration) in zip(rows, alone):
        same = "no plan" if row.no_plan and iteration is None else str(row.iteration_time_s == iteration)
        table.add_row(row.model, row.cluster, str(row.gpus), str(row.ilps_solved or "—"), str(ilps or "—"),
                      f"{row.planning_s:.1f} s", f"{seconds:.1f} s", same)
    out = Console(width=None if Console().is_terminal else 200)  # piped: whole cells, not "gpt-1.…"
    out.print(table)
    out.print(f"wall: sweep {shared_wall:.1f} s, separate calls {alone_wall:.1f} s")


if __name__ == "__main__":
    main()
