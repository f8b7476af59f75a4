"""What the search picks on Alpa's benchmark cases when recomputation and the schedule are its choice
(issue 13 item 9), beside the Alpa-faithful setting the reproduction keeps (1F1B, full recomputation).

Both columns use the reproduction's additive cost model (no overlap) and its microbatch counts, so they
differ only in the choices searched. Prints a table; quote it in docs/benchmarks.md. Usage:

    python scripts/alpa_modes.py [--models gpt,moe,wresnet] [--max-gpus 8]
"""

from __future__ import annotations

import time
from collections import Counter

import click
from rich.console import Console
from rich.table import Table

from partopt.bench import alpa
from partopt.inter import optimize


def _modes(plan) -> str:
    """'full ×3, none': the stages' recomputation modes, counted."""
    counts = Counter(s.recompute for s in plan.stages)
    return ", ".join(f"{mode} ×{n}" if n > 1 else mode for mode, n in counts.items())


@click.command()
@click.option("--models", default=",".join(alpa.MODELS), help="model families, comma-separated")
@click.option("--max-gpus", type=int, default=alpa.QUICK_MAX_GPUS, help="largest case")
def main(models: str, max_gpus: int) -> None:
    table = Table(title="Alpa's cases: the Alpa setting (1F1B, full recomputation) against the search's choices")
    for column in ("case", "GPUs", "Alpa setting: iteration", "searched: iteration", "speed-up", "schedule", "B",
                   "stages", "recomputation", "planning (cache shared)"):
        table.add_column(column, justify="right")
    rows = []
    for case in alpa.cases(models.split(","), max_gpus):
        graph, cluster = alpa.load(case.instance), alpa.cluster_for(case.gpus)
        counts = case.microbatches(graph.dims[graph.batch_dim])
        cache: dict = {}
        fixed = optimize(graph, cluster, microbatches=counts, cache=cache, **alpa.model_options(case.model))
        start = time.perf_counter()
        free = optimize(graph, cluster, microbatches=counts, cache=cache, overlap=False)
        elapsed = time.perf_counter() - start
        schedule = free.schedule + (f" v={free.virtual_stages}" if free.virtual_stages > 1 else "")
        row = [case.instance, str(case.gpus), f"{fixed.iteration_time_s:.4g} s", f"{free.iteration_time_s:.4g} s",
               f"{fixed.iteration_time_s / free.iteration_time_s:.2f}×", schedule, str(free.num_microbatches),
               str(len(free.stages)), _modes(free), f"{elapsed:.0f} s"]
        table.add_row(*row)
        rows.append(row)
    console = Console(width=200)
    console.print(table)
    console.print("\n".join(["| " + " | ".join(c.header for c in table.columns) + " |",
                              "|" + "---|" * len(table.columns)] + ["| " + " | ".join(r) + " |" for r in rows]))


if __name__ == "__main__":
    main()
