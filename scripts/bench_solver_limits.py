"""Deterministic solver limits (issue 16): the work HiGHS spends on the memory-capped layer ILPs of the
stage search, and whether a busy machine changes their answers.

The ILPs are the GPT-39B block (microbatch 8 and 2) on the logical meshes of one p3.16xlarge node with
no, selective and full recomputation, under the device's memory budget / r (r = 1, 2, 4, 8) with 16 / r
microbatches in flight, as `inter._tighten` asks for them; only those whose memory row binds (the relaxed
optimum overflows the cap) are listed, as in the planner. Each is solved with no work limit on the machine
as it is, then again with two processes spinning on the CPU; "same" compares the two answers (status
and every 0-1 value). One run each.

    python scripts/bench_solver_limits.py
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from partopt import costmodel, ilp, intra, solvers
from partopt.cluster import preset
from partopt.io import read_graph

ROOT = Path(__file__).resolve().parent.parent
MESHES = [((1, 8), (2, 4)), ((1, 8), (1, 8)), ((1, 4), (2, 2))]


def capped_models():
    """(label, model) of every capped block ILP whose memory row binds."""
    graph = read_graph(ROOT / "instances/gpt-39b.json")
    node = preset("p3.16xlarge", 1)
    budget = costmodel.memory_budget(node.device, costmodel.DEFAULT_MEMORY_RESERVE)
    for mb in (8, 2):
        g = intra.with_batch(graph, mb)
        block = [op for op in g.order if op.layer == 10]
        for submesh, shape in MESHES:
            mesh = node.logical_mesh(submesh, shape)
            for recompute in ("none", "selective", "full"):
                for r in (1, 2, 4, 8):
                    costs = intra.build(g, mesh, block, 16, max(1, 16 // r), recompute=recompute).costs
                    cap = budget / r
                    if ilp.min_memory(costs) > cap:
                        continue  # cannot fit: no ILP
                    free = ilp.solve(costs, None)
                    if costs.peak_memory(free.choice) <= cap:
                        continue  # the relaxed optimum fits: no capped ILP
                    model, _ = ilp.build_model(costs, ilp.reduce(costs), cap)
                    yield f"mb {mb} {shape} {recompute} /{r}", model


def solve_loaded(model: solvers.Model) -> solvers.Result:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        return solvers.solve(model, "highs", time_limit_s=600, work_limit=math.inf)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    table = Table(title="memory-capped GPT-39B block ILPs, HiGHS without a work limit (one run each)")
    for col in ("ILP", "vars", "status", "nodes", "wall s", "loaded wall s", "same"):
        table.add_column(col, justify="right")
    for label, model in capped_models():
        idle = solvers.solve(model, "highs", time_limit_s=600, work_limit=math.inf)
        busy = solve_loaded(model)
        same = (idle.status, idle.values) == (busy.status, busy.values)
        table.add_row(label, str(model.num_vars), idle.status, f"{idle.work:.0f}", f"{idle.time_s:.2f}",
                      f"{busy.time_s:.2f}", "yes" if same else "NO")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
