"""Megatron-LM's grid (`partopt solve --search megatron`, `baselines.megatron`) with and without the interleaved
schedule: the best grid point, its iteration time and the planning time, beside partopt's default in Megatron-LM's
state layout (what the grid is compared against), with the ILPs each solved (the grid's: every layout's).

    python scripts/bench_megatron_grid.py                   # every case
    python scripts/bench_megatron_grid.py --case gpt-39b    # one
    python scripts/bench_megatron_grid.py --no-default      # the grid only
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from partopt import baselines, io, optimize
from partopt.cluster import preset

CASES = {  # name -> (instance file, cluster preset, nodes)
    "gpt-1.3b": ("instances/gpt-1.3b.json", "p3.16xlarge", 1),
    "gpt-39b": ("instances/gpt-39b.json", "p3.16xlarge", 8),
    "llama-70b": ("instances/llama-70b.json", "dgx-a100", 8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), action="append")
    parser.add_argument("--no-default", action="store_true", help="skip partopt's own solve")
    args = parser.parse_args()
    table = Table(title="Megatron-LM's grid, layout megatron")
    for column in ("case", "planner", "iteration", "grid point", "planning", "ILPs"):
        table.add_column(column, justify="right" if column in ("iteration", "planning", "ILPs") else "left")
    for name in args.case or CASES:
        path, cluster_name, nodes = CASES[name]
        graph, cluster = io.read_graph(path), preset(cluster_name, nodes)
        runs = [("grid, 1f1b only", lambda: baselines.megatron(graph, cluster, schedule="1f1b")),
                ("grid, with interleaved", lambda: baselines.megatron(graph, cluster))]
        if not args.no_default:
            runs.append(("partopt default", lambda: optimize(graph, cluster, state_layout="megatron")))
        for label, run in runs:
            start = time.perf_counter()
            plan = run()
            wall = time.perf_counter() - start
            point = (baselines.megatron_grid_point(plan) if "megatron" in plan.options else
                     f"{len(plan.stages) // plan.virtual_stages} stages · B {plan.num_microbatches} · {plan.schedule}")
            table.add_row(name, label, f"{plan.iteration_time_s:.3f} s", point, f"{wall:.0f} s", str(plan.solver["ilps"]))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
