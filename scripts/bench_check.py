"""What `solve`'s self-check costs: solve a few instances once, then time `partopt.check.differences`
(validation + re-pricing with `evaluate`) on the plan, median of 3, and print a table."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from partopt.check import differences
from partopt.cluster import preset
from partopt.inter import optimize
from partopt.io import read_graph

ROOT = Path(__file__).resolve().parent.parent
RUNS = 3
CASES = [("mlp-4layer", 1, {}), ("gpt-350m", 1, {"microbatches": [64]}), ("gpt-350m", 2, {"recompute": True}),
         ("gpt-1.3b", 1, {"microbatches": [128]})]


def main() -> None:
    """Print instance, GPUs, stages, solve time and the median check time with its share of the solve."""
    print("| instance | GPUs | options | stages | solve (s) | check (s, median of 3) | check / solve |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, nodes, options in CASES:
        graph, cluster = read_graph(ROOT / "instances" / f"{name}.json"), preset("p3.16xlarge", nodes)
        start = time.perf_counter()
        plan = optimize(graph, cluster, **options)
        solve = time.perf_counter() - start
        times = []
        for _ in range(RUNS):
            start = time.perf_counter()
            assert differences(plan, graph, cluster) == []
            times.append(time.perf_counter() - start)
        check = statistics.median(times)
        shown = ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"
        print(f"| {name} | {cluster.num_devices} | {shown} | {len(plan.stages)} | {solve:.1f} | {check:.2f} "
              f"| {100 * check / solve:.1f} % |")


if __name__ == "__main__":
    main()
