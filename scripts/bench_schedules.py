"""What the search picks when the pipeline schedule is searched (the default, `--schedule auto`: 1F1B and
ZB-H1 with free cuts, interleaved 1F1B over Megatron's uniform chunks) beside 1F1B alone and zero-bubble alone,
on Alpa's GPT cases: iteration time, the schedule and stage count chosen, and the planning time of each
(median of --repeat runs, the layer ILPs solved once beforehand and shared, so the times are the stage DPs'
and assembly's).

    python scripts/bench_schedules.py                 # the GPT cases from 2 up to 8 GPUs
    python scripts/bench_schedules.py --min-gpus 16 --max-gpus 16 --repeat 1
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from partopt.bench import alpa
from partopt.inter import optimize


def shape(plan) -> str:
    """'interleaved, 2 stages × v 4' or '1f1b, 3 stages'."""
    stages = len(plan.stages) // plan.virtual_stages
    return f"{plan.schedule}, {stages} stage{'s' if stages > 1 else ''}" + (
        f" × v {plan.virtual_stages}" if plan.virtual_stages > 1 else "")


def timed(graph, cluster, repeat: int, **options):
    """The plan and the median wall time of `repeat` runs of `optimize`."""
    times, plan = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        plan = optimize(graph, cluster, **options)
        times.append(time.perf_counter() - start)
    return plan, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-gpus", type=int, default=2, help="one device has no second stage to interleave")
    parser.add_argument("--max-gpus", type=int, default=alpa.QUICK_MAX_GPUS)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    table = Table(title="Pipeline schedule searched (auto) vs 1F1B only and zero-bubble only (full recomputation as "
                        "Alpa ran, one DP layer per block)")
    for column in ("case", "GPUs", "1f1b: iteration", "1f1b: plan", "1f1b: planning", "zero-bubble: iteration",
                   "zero-bubble: plan", "zero-bubble: planning", "auto: iteration", "auto: plan", "auto: planning",
                   "auto / 1f1b"):
        table.add_column(column, justify="left" if column in ("case",) or column.endswith("plan") else "right")
    for case in alpa.cases(["gpt"], args.max_gpus):
        if case.gpus < max(args.min_gpus, 2):
            continue
        graph, cluster = alpa.load(case.instance), alpa.cluster_for(case.gpus)
        cache: dict = {}
        options = dict(microbatches=case.microbatches(graph.dims[graph.batch_dim]), recompute="full", layers=None,
                       cache=cache)
        optimize(graph, cluster, **options)  # the layer ILPs, solved once for both
        one, one_s = timed(graph, cluster, args.repeat, schedule="1f1b", **options)
        zb, zb_s = timed(graph, cluster, args.repeat, schedule="zero-bubble", **options)
        auto, auto_s = timed(graph, cluster, args.repeat, schedule="auto", **options)
        table.add_row(case.instance, str(case.gpus), f"{one.iteration_time_s:.3f} s", shape(one), f"{one_s:.2f} s",
                      f"{zb.iteration_time_s:.3f} s", shape(zb), f"{zb_s:.2f} s",
                      f"{auto.iteration_time_s:.3f} s", shape(auto), f"{auto_s:.2f} s",
                      f"{auto.iteration_time_s / one.iteration_time_s:.3f}")
    Console(width=280).print(table)


if __name__ == "__main__":
    main()
