"""Stage DP benchmark (issue 19): `stagedp.solve` time and peak memory on seeded random stage-cost tables.

The tables have the planner's shape (`stages.stage_table`): t[h, k, i, j, s] and extra[h, k, i, j, s]
for 5 logical options h, in-flight counts k = 0 … L, layers i ≤ j, and submesh shapes (1, 1), (1, 2),
(1, 4), (1, 8) then (n, 8) for n = 2, 4, … up to the nodes (the power-of-two family of
`Cluster.submesh_shapes`, as the issue's (2, 8), (4, 8), (8, 8)). Every stage is feasible (same
latency for every k), 128 microbatches. A stage's latency is the sum of its layers' random costs on
that submesh and option plus a boundary send; its per-iteration work (gradient sync) is the sum of its
layers' random sync, larger for the faster options, so the DP trades the two.

Each run is a fresh process (its peak RSS includes the tables); a run past the time limit is stopped.

    python scripts/bench_stagedp.py                    # every case, median of 3
    python scripts/bench_stagedp.py --case 64x64 --repeat 1 --timeout 120
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

CASES = [(layers, devices) for layers in (32, 64, 128) for devices in (8, 64, 512)]
OPTIONS = 5
MICROBATCHES = 128
PER_NODE = 8


def sizes_for(devices: int) -> list[int]:
    """Devices of each submesh shape: (1, 1), (1, 2), (1, 4), (1, 8), then (n, 8) for n = 2, 4, … ≤ nodes."""
    within = [t for t in (1, 2, 4, 8) if t <= devices]
    nodes = devices // PER_NODE
    return within + [n * PER_NODE for n in (2 ** e for e in range(1, nodes.bit_length())) if n <= nodes]


def tables(layers: int, devices: int, seed: int, memory: bool = False) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Random t and extra of shape (OPTIONS, layers + 1, layers, layers, S): every stage feasible, or with
    `memory` each stage fits only the in-flight counts k whose weights + min(k, B) activations fit a budget."""
    rng = np.random.default_rng(seed)
    sizes = sizes_for(devices)
    S = len(sizes)
    work = rng.uniform(0.5, 1.5, layers)  # per-layer compute, ms on one device
    size = np.array(sizes, dtype=float)
    overhead = rng.uniform(0.1, 0.5, (OPTIONS, 1, S)) * np.log2(size)  # communication share per option
    noise = rng.uniform(0.9, 1.1, (OPTIONS, layers, S))
    per_layer = work[None, :, None] / size * (1 + overhead) * noise  # (H, L, S)
    sync_layer = rng.uniform(0.0, 0.05, (OPTIONS, layers, S)) / (1 + overhead)  # faster options sync more
    prefix = np.concatenate([np.zeros((OPTIONS, 1, S)), np.cumsum(per_layer, axis=1)], axis=1)
    sync_prefix = np.concatenate([np.zeros((OPTIONS, 1, S)), np.cumsum(sync_layer, axis=1)], axis=1)
    send = rng.uniform(0.001, 0.005, layers)
    send[-1] = 0.0
    i, j = np.arange(layers)[:, None], np.arange(layers)[None, :]
    latency = prefix[:, 1:][:, None, :, :] - prefix[:, :-1][:, :, None, :] + send[None, None, :, None]  # (H, i, j, S)
    sync = sync_prefix[:, 1:][:, None, :, :] - sync_prefix[:, :-1][:, :, None, :]
    latency = np.where((j >= i)[None, :, :, None], latency, np.inf)
    t = np.empty((OPTIONS, layers + 1, layers, layers, S))
    extra = np.zeros_like(t)
    t[:, 0] = np.inf
    t[:, 1:] = latency[:, None]
    extra[:, 1:] = np.where(np.isfinite(latency), sync, 0.0)[:, None]
    if memory:  # weights shard well, activations less; the budget fits all weights on a quarter of the devices
        weights = np.cumsum(np.concatenate([[0.0], rng.uniform(0.5, 1.5, layers)]))
        acts = np.cumsum(np.concatenate([[0.0], rng.uniform(0.01, 0.03, layers)]))
        stage_w = (weights[1:][None, :] - weights[:-1][:, None])[None, :, :, None] / size ** 0.9 * (1 + overhead[:, :, None])
        stage_a = (acts[1:][None, :] - acts[:-1][:, None])[None, :, :, None] / size ** 0.7
        for k in range(1, layers + 1):
            t[:, k][stage_w + min(k, MICROBATCHES) * stage_a > 4.0 * weights[-1] / devices ** 0.9] = np.inf
    return t, extra, sizes


def worker(layers: int, devices: int, seed: int, memory: int) -> None:
    """Build one case's tables, solve once, print the result as JSON (run in its own process)."""
    from partopt import stagedp

    t, extra, sizes = tables(layers, devices, seed, bool(memory))
    start = time.perf_counter()
    result = stagedp.solve(t, extra, sizes, devices, MICROBATCHES)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_bytes": peak, "table_bytes": t.nbytes + extra.nbytes,
                      "total": result.total, "rounds": result.rounds, "stages": len(result.stages)}))


def run(layers: int, devices: int, seed: int, memory: bool, timeout: float) -> dict | None:
    """One solve in a fresh process; None when it ran past `timeout` seconds."""
    command = [sys.executable, __file__, "--worker", str(layers), str(devices), str(seed), str(int(memory))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return None
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[f"{l}x{d}" for l, d in CASES],
                        help="LAYERSxDEVICES; repeat to run several (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (the median is shown)")
    parser.add_argument("--timeout", type=float, default=120.0, help="stop a run after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action="store_true", help="cap each stage's in-flight microbatches by memory")
    parser.add_argument("--worker", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    cases = [(l, d) for l, d in CASES if not args.case or f"{l}x{d}" in args.case]
    table = Table(title=f"stagedp.solve on random tables ({OPTIONS} options, {MICROBATCHES} microbatches, "
                        f"median of {args.repeat}{', memory-capped' if args.memory else ''})")
    for column in ("DP layers", "devices", "submeshes", "time", "peak RSS", "tables", "rounds", "stages",
                   "total"):
        table.add_column(column, justify="right")
    for layers, devices in cases:
        runs = []
        for _ in range(args.repeat):
            r = run(layers, devices, args.seed, args.memory, args.timeout)
            if r is None:
                break
            runs.append(r)
        n = str(len(sizes_for(devices)))
        if len(runs) < args.repeat:
            table.add_row(str(layers), str(devices), n, f"> {args.timeout:.0f} s", "", "", "", "", "")
            continue
        seconds = statistics.median(r["seconds"] for r in runs)
        peak = statistics.median(r["peak_bytes"] for r in runs)
        r = runs[0]
        table.add_row(str(layers), str(devices), n, f"{seconds:.2f} s", f"{peak / 2**30:.2f} GiB",
                      f"{r['table_bytes'] / 2**30:.2f} GiB", str(r["rounds"]), str(r["stages"]),
                      f"{r['total']:.4f}")
        print(json.dumps({"layers": layers, "devices": devices, "seconds": [x["seconds"] for x in runs], **r}),
              file=sys.stderr)
    Console(width=130).print(table)


if __name__ == "__main__":
    main()
