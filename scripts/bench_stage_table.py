"""Stage-table benchmark: building the tables the stage DP reads, from priced layer rows.

A GPT of 64 DP layers on 16 × dgx-a100 (the `auto` submeshes: powers of two; every node-local logical
shape), its layers priced once, uncapped, without recomputation (identical blocks share one ILP; not
timed). Then timed, median of `--repeat`: the 1F1B table (`stages.stage_table`) and every interleaved
table the search builds for one microbatch count (`stages.interleaved_table` over
`schedules.interleaved_shapes`), each on a fresh `Pipeline` as the search makes one per count.

    python scripts/bench_stage_table.py            # --layers 64 --nodes 16 --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from partopt import costmodel
from partopt.assemble import pipeline_of
from partopt.cluster import preset
from partopt.inter import _shapes, _submeshes
from partopt.layering import build_layers
from partopt.models import gpt
from partopt.options import Options
from partopt.pricing import Job, Pricer, Stats
from partopt.schedules import interleaved_shapes
from partopt.stages import interleaved_table, stage_table


def priced_rows(graph, cluster, options: Options, layering, count: int) -> tuple[dict, list]:
    """Each (submesh, shape, mode) option's one row of layer costs, and the submeshes."""
    submeshes = _submeshes(cluster, options)
    meshes = {(s, shape): cluster.logical_mesh(s, shape) for s in submeshes for shape in _shapes(cluster, s, options)}
    mb = graph.dims[graph.batch_dim] // count
    names = [tuple(op.name for op in ops) for ops in layering.base]
    jobs = {(b, key): Job(mb, count, names[b], mesh, "none", None) for key, mesh in meshes.items() for b in range(len(names))}
    with Pricer(graph, options) as pricer:
        priced = pricer.run(jobs, Stats())
    costs = {(*key, "none"): [[priced[(b, key)] for b in range(len(names))]] for key in meshes}
    return costs, submeshes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    graph = gpt(hidden=4096, layers=args.layers, heads=32, seq=2048, vocab=51200, batch=512, name="gpt")
    cluster = preset("dgx-a100", args.nodes)
    options = Options(layers=args.layers)
    layering = build_layers(graph, options.layers)
    count = 64
    budget = costmodel.memory_budget(cluster.device, options.memory_reserve)
    costs, submeshes = priced_rows(graph, cluster, options, layering, count)
    shapes = interleaved_shapes(len(layering.groups), count, cluster.num_devices)

    def one_f_one_b() -> None:
        stage_table(pipeline_of(graph, cluster, layering, count, True), costs, submeshes, count, budget)

    def interleaved() -> None:
        pipe = pipeline_of(graph, cluster, layering, count, True)
        for S, v in shapes:
            interleaved_table(pipe, costs, submeshes, count, budget, S, v)

    table = Table(title=f"stage tables: GPT of {len(layering.groups)} DP layers on {args.nodes} × dgx-a100, "
                        f"{len(submeshes)} submeshes, {len(costs)} options, {count} microbatches")
    for column in ("table", f"median of {args.repeat}", "runs"):
        table.add_column(column)
    for name, build in ((f"1F1B (stage_table)", one_f_one_b), (f"interleaved, {len(shapes)} (S, v)", interleaved)):
        runs = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            build()
            runs.append(time.perf_counter() - start)
        table.add_row(name, f"{statistics.median(runs):.2f} s", ", ".join(f"{r:.2f}" for r in runs))
    Console().print(table)


if __name__ == "__main__":
    main()
