"""What the planner picks when recomputation is searched (the default, `--recompute auto`) beside the
Alpa-faithful setting the reproduction keeps (full recomputation, as Alpa's suites ran), on Alpa's
cases: iteration time, the paper's TFLOP/s metric, each stage's mode and the planning time.

    python scripts/bench_recompute.py                  # the GPT cases up to 8 GPUs
    python scripts/bench_recompute.py --models gpt,moe --max-gpus 16
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from partopt.bench import alpa
from partopt.inter import optimize


def modes(plan) -> str:
    """'none ×3, full': each stage's recomputation mode, equal neighbours collapsed."""
    parts: list[list] = []
    for stage in plan.stages:
        if parts and parts[-1][0] == stage.recompute:
            parts[-1][1] += 1
        else:
            parts.append([stage.recompute, 1])
    return ", ".join(f"{mode} ×{n}" if n > 1 else mode for mode, n in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt", help="comma-separated families (gpt, moe, wresnet)")
    parser.add_argument("--max-gpus", type=int, default=alpa.QUICK_MAX_GPUS)
    args = parser.parse_args()
    table = Table(title="Recomputation searched (auto) vs Alpa's full recomputation")
    for column in ("case", "GPUs", "full: iteration", "full: TFLOP/s (paper's)", "auto: iteration", "auto: TFLOP/s (paper's)",
                   "auto: stage modes", "auto / full", "auto planning"):
        table.add_column(column, justify="left" if column in ("case", "auto: stage modes") else "right")
    for case in alpa.cases(args.models.split(","), args.max_gpus):
        graph, cluster = alpa.load(case.instance), alpa.cluster_for(case.gpus)
        counts = case.microbatches(graph.dims[graph.batch_dim])
        full = optimize(graph, cluster, microbatches=counts, recompute="full")
        start = time.perf_counter()
        auto = optimize(graph, cluster, microbatches=counts, recompute="auto")  # its own solves: an honest time
        elapsed = time.perf_counter() - start
        table.add_row(case.instance, str(case.gpus), f"{full.iteration_time_s:.3f} s",
                      f"{alpa.tflops_per_gpu(case.model, graph, full):.2f}", f"{auto.iteration_time_s:.3f} s",
                      f"{alpa.tflops_per_gpu(case.model, graph, auto):.2f}", modes(auto),
                      f"{auto.iteration_time_s / full.iteration_time_s:.3f}", f"{elapsed:.1f} s")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
