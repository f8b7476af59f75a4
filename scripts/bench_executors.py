"""Pricing throughput of the executors (issue 16): layer ILPs per second in this process, on the local pool
with 2 workers, and on a local Ray instance with 2 CPUs; every executor must return the same results.

The jobs are the GPT-39B block (microbatch 8 and 2) on the logical meshes of one p3.16xlarge node, under
the device's memory budget and half of it, with no and with full recomputation: 40 intra-op ILPs of
0.02–5 s. Wall time runs from making the executor to closing it (starting the workers included).

    python scripts/bench_executors.py              # median of 3
    python scripts/bench_executors.py --repeat 1 --executors local:1,local:2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from partopt import costmodel, intra
from partopt.cluster import preset
from partopt.errors import InfeasibleError
from partopt.executors import make_executor
from partopt.graph import Graph
from partopt.io import read_graph

ROOT = Path(__file__).resolve().parent.parent
MESHES = [((1, 8), (2, 4)), ((1, 8), (1, 8)), ((1, 8), (4, 2)), ((1, 4), (2, 2)), ((1, 4), (1, 4))]


def jobs() -> list[tuple]:
    return [(mb, submesh, shape, recompute, share) for mb in (8, 2) for submesh, shape in MESHES
            for recompute in ("none", "full") for share in (1, 2)]


def price(graph: Graph, job: tuple) -> tuple[str, float] | None:
    """One block ILP: (status, objective in seconds), or None when the block cannot fit the cap."""
    mb, submesh, shape, recompute, share = job
    node = preset("p3.16xlarge", 1)
    g = intra.with_batch(graph, mb)
    block = [op for op in g.order if op.layer == 10]
    cap = costmodel.memory_budget(node.device, costmodel.DEFAULT_MEMORY_RESERVE) / share
    try:
        sharding = intra.shard_stage(g, node.logical_mesh(submesh, shape), block, microbatches=16,
                                     memory_budget=cap, recompute=recompute)
    except InfeasibleError:
        return None
    return sharding.solution.result.status, sharding.solution.objective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executors", default="local:1,local:2,ray:2", help="kind:workers, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    graph = read_graph(ROOT / "instances/gpt-39b.json")
    work = jobs()
    table = Table(title=f"pricing throughput, {len(work)} GPT-39B block pricing jobs (median of {args.repeat})")
    for col in ("executor", "workers", "jobs", "wall s", "jobs/s", "same results"):
        table.add_column(col, justify="right")
    reference = None
    for spec in args.executors.split(","):
        kind, workers = spec.split(":")
        walls = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            executor = make_executor(kind, price, (graph,), int(workers))
            try:
                results = list(executor.map(work))
            finally:
                executor.close()
            walls.append(time.perf_counter() - start)
        reference = reference or results
        wall = statistics.median(walls)
        table.add_row(kind, workers, str(len(work)), f"{wall:.1f}", f"{len(work) / wall:.2f}",
                      "yes" if results == reference else "NO")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
