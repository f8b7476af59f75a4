"""Time every model-zoo generator on the named models (median of 5 runs) and print a table.

Generation includes the Graph's validation; writing is `partopt.io.write_graph` to a temp dir.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from partopt.io import write_graph
from partopt.models import PRESETS, preset

RUNS = 5


def median_seconds(task: Callable[[], object], runs: int = RUNS) -> float:
    """Median wall time of `runs` calls of `task`."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        task()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Print name, size and median generation / write times of every named model."""
    print("| model | ops | tensors | params (B) | generate (ms) | write (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in PRESETS:
            graph = preset(name)
            generate = median_seconds(lambda n=name: preset(n))
            write = median_seconds(lambda g=graph, p=Path(tmp) / f"{name}.json": write_graph(g, p))
            print(f"| {name} | {len(graph.ops)} | {len(graph.tensors)} | {graph.num_params / 1e9:.3f} "
                  f"| {generate * 1e3:.1f} | {write * 1e3:.1f} |")


if __name__ == "__main__":
    main()
