"""Benchmark `intra.build`: seconds to build one layer's cost graph (the ILP before solving).

Usage: python scripts/bench_build.py [--repeat 3] [--before PATH]
Each case is built `--repeat` times in one process: "first" is the first build (no tables kept
from earlier builds of that layer), "median" the median of all. With `--before PATH` (a checkout
of an older partopt, e.g. `git archive c320b6c | tar -x -C PATH`) the same cases run again in a
subprocess importing that code, and the table shows both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from partopt import intra
from partopt.cluster import preset
from partopt.io import read_graph

ROOT = Path(__file__).resolve().parent.parent

# name: (instance, microbatch, layers, (nodes, submesh, logical shape), build options)
CASES = {
    "gpt-39b block, (2, 4)": ("gpt-39b.json", 8, (10,), (1, (1, 8), (2, 4)), {}),
    "gpt-39b block, (2, 4), selective, 16 mb": ("gpt-39b.json", 8, (10,), (1, (1, 8), (2, 4)),
                                                dict(recompute="selective", microbatches=16, inflight=4)),
    "gpt-1.3b block, (8, 1)": ("gpt-1.3b.json", 8, (5,), (1, (1, 8), (8, 1)), {}),
    "gpt-350m block, 2 nodes (2, 8)": ("gpt-350m.json", 4, (3,), (2, (2, 8), (2, 8)), dict(microbatches=8)),
    "moe-380m layers 1-2, (2, 4)": ("moe-380m.json", 8, (1, 2), (1, (1, 8), (2, 4)), {}),
    "wresnet-250m layer 3, (2, 4)": ("wresnet-250m.json", 8, (3,), (1, (1, 8), (2, 4)), {}),
}


def measure(repeat: int) -> dict[str, dict[str, float]]:
    """Per case: the first build's seconds, the median over `repeat` builds, and the edge count."""
    results = {}
    for name, (path, microbatch, layers, (nodes, submesh, shape), options) in CASES.items():
        graph = intra.with_batch(read_graph(ROOT / "instances" / path), microbatch)
        ops = [op for op in graph.order if op.layer in layers]
        mesh = preset("p3.16xlarge", nodes).logical_mesh(submesh, shape)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            model = intra.build(graph, mesh, ops, **options)
            times.append(time.perf_counter() - start)
        results[name] = {"first": times[0], "median": statistics.median(times), "edges": len(model.costs.edges)}
    return results


def measure_before(path: str, repeat: int) -> dict[str, dict[str, float]]:
    """`measure` run by a subprocess that imports partopt from `path`."""
    env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
    out = subprocess.run([sys.executable, __file__, "--repeat", str(repeat), "--json"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--before", help="a checkout of an older partopt to compare with")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON (no table)")
    args = parser.parse_args()
    before = measure_before(args.before, args.repeat) if args.before else None
    after = measure(args.repeat)
    if args.json:
        print(json.dumps(after))
        return
    table = Table(title=f"intra.build seconds (first build; median of {args.repeat})")
    table.add_column("case")
    table.add_column("edges", justify="right")
    if before:
        table.add_column("before first", justify="right")
        table.add_column("before median", justify="right")
    table.add_column("first", justify="right")
    table.add_column("median", justify="right")
    if before:
        table.add_column("speed-up (median)", justify="right")
    for name, row in after.items():
        cells = [name, str(row["edges"])]
        if before:
            cells += [f"{before[name]['first']:.3f}", f"{before[name]['median']:.3f}"]
        cells += [f"{row['first']:.3f}", f"{row['median']:.3f}"]
        if before:
            cells.append(f"{before[name]['median'] / row['median']:.1f}×")
        table.add_row(*cells)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
