"""Benchmark the intra-op ILP: ops, strategies, variables, time and gap per backend.

Usage: python scripts/bench_ilp.py [--backends highs,cpsat,cbc] [--time-limit 60] [--whole]
Cases: one GPT-39B transformer block (microbatch 8) on a (2, 4) mesh of one p3.16xlarge node;
with --whole, all of GPT-1.3B (microbatch 8) on (2, 2) and (1, 8).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from partopt import intra
from partopt.cluster import preset
from partopt.io import read_graph

ROOT = Path(__file__).resolve().parent.parent


def cases(whole: bool):
    node = preset("p3.16xlarge", 1)
    g39 = intra.with_batch(read_graph(ROOT / "instances/gpt-39b.json"), 8)
    block = [op for op in g39.order if op.layer == 10]
    yield "gpt-39b block, mb 8", g39, block, node.logical_mesh((1, 8), (2, 4))
    if whole:
        g13 = intra.with_batch(read_graph(ROOT / "instances/gpt-1.3b.json"), 8)
        yield "gpt-1.3b whole, mb 8", g13, None, node.logical_mesh((1, 4), (2, 2))
        yield "gpt-1.3b whole, mb 8", g13, None, node.logical_mesh((1, 8), (1, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="highs,cpsat,cbc")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args()
    table = Table(title="intra-op ILP (median of repeats; wall = build + reduce + solve)")
    for col in ("case", "mesh", "backend", "ops", "strategies", "kept", "ILP vars", "solve s", "wall s", "status", "gap"):
        table.add_column(col, justify="right")
    for name, graph, ops, mesh in cases(args.whole):
        for backend in args.backends.split(","):
            walls, solves = [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                stage = intra.shard_stage(graph, mesh, ops, backend=backend, time_limit_s=args.time_limit)
                walls.append(time.perf_counter() - start)
                solves.append(stage.solution.result.time_s)
            sol = stage.solution
            table.add_row(name, str(mesh.shape), backend, str(len(stage.ops)), str(sol.total), str(sol.kept),
                          str(sol.variables), f"{statistics.median(solves):.2f}", f"{statistics.median(walls):.2f}",
                          sol.result.status, f"{sol.result.gap or 0:.2g}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
