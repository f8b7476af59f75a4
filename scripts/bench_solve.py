"""End-to-end planning benchmark: `partopt solve` wall time and peak memory (issue 5 targets).

Each case runs `partopt solve … --json` in a fresh process; the script samples the resident
memory of that process and its ILP workers every 0.2 s and reports the peak of their sum.

    python scripts/bench_solve.py            # every case
    python scripts/bench_solve.py --case gpt-39b-64
    python scripts/bench_solve.py --case gpt-1.3b-8-auto --repeat 3   # the median of three runs (issue 16's measure)
    python scripts/bench_solve.py --compare gpt-1.3b-b128   # the default against forced modes and Megatron's grid
    python scripts/bench_solve.py --compare gpt-1t-b512 --in-process   # the same, one process, one layer cache
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    name: str
    graph: str  # an instance file, or "generate:<args>" for `partopt generate`
    args: tuple[str, ...]
    target_s: float | None  # the wall-time target


GPT_1P7B = "generate:gpt --hidden 2304 --layers 24 --heads 24 --seq 2048 --vocab 51200 --batch 512 --name gpt-1.7b"
GPT_1T = "generate:gpt --hidden 25600 --layers 128 --heads 160 --seq 2048 --vocab 51200 --batch 3072 --name gpt-1t"
CASES = [
    Case("gpt-1.3b-8", "instances/gpt-1.3b.json", ("--cluster", "p3.16xlarge", "--nodes", "1", "--microbatches", "128"), None),
    # issue 16's targets, with no optional flags
    Case("gpt-1.3b-8-auto", "instances/gpt-1.3b.json", ("--cluster", "p3.16xlarge", "--nodes", "1"), 5.0),
    Case("gpt-39b-64-auto", "instances/gpt-39b.json", ("--cluster", "p3.16xlarge", "--nodes", "8"), 15.0),
    Case("llama-70b-64-auto", "instances/llama-70b.json", ("--cluster", "dgx-a100", "--nodes", "8"), 30.0),
    Case("gpt-1t-3072-auto", GPT_1T, ("--cluster", "dgx-a100", "--nodes", "384"), 60.0),
    Case("gpt-1.7b-32-auto", GPT_1P7B, ("--cluster", "dgx-a100", "--nodes", "4"), None),  # the third row
    # the tuned commands of docs/benchmarks.md
    Case("gpt-39b-64", "instances/gpt-39b.json", ("--cluster", "p3.16xlarge", "--nodes", "8", "--microbatches", "1024", "--recompute"),
         60.0),
    Case("gpt-1t-3072", GPT_1T, ("--cluster", "dgx-a100", "--nodes", "384", "--microbatches", "512", "--submeshes", "power_of_two",
          "--recompute"), 300.0),
]


# issue 13's "the default is never worse than a hand plan": each case with no optional flags, then with one
# mode forced, then Megatron-LM's grid (`--search megatron`: the best uniform (tp, pp, dp, microbatches) point)
COMPARED = {
    "gpt-1.3b-b128": ("generate:gpt --hidden 2048 --layers 24 --heads 32 --seq 1024 --vocab 51200 --batch 128 "
                      "--name gpt-1.3b-b128", ("--cluster", "p3.16xlarge", "--nodes", "1")),
    "gpt-39b-b1024": ("instances/gpt-39b.json", ("--cluster", "p3.16xlarge", "--nodes", "8")),
    "gpt-1t-b512": (GPT_1T.replace("--batch 3072", "--batch 512"), ("--cluster", "dgx-a100", "--nodes", "384")),
}
FORCED = [(), ("--recompute", "none"), ("--recompute", "selective"), ("--recompute", "full"), ("--schedule", "1f1b"),
          ("--schedule", "interleaved"), ("--schedule", "zero-bubble"), ("--search", "megatron")]


def _tree_rss_kb(pid: int) -> int:
    """Resident memory of a process and all its descendants, in KiB (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def graph_file(source: str, name: str, workdir: Path) -> str:
    """The graph file of a case: its instance file, or one `partopt generate` writes from "generate:<args>"."""
    if not source.startswith("generate:"):
        return str(ROOT / source)
    path = str(workdir / f"{name}.json")
    subprocess.run(["partopt", "generate", *source.split(":", 1)[1].split(), "-o", path], check=True,
                   capture_output=True)
    return path


def run(case: Case, workdir: Path, timeout_s: float) -> dict:
    command = ["partopt", "solve", graph_file(case.graph, case.name, workdir), *case.args, "--json"]
    out_path, err_path = workdir / f"{case.name}.out", workdir / f"{case.name}.err"
    start = time.perf_counter()
    with open(out_path, "w") as out_file, open(err_path, "w") as err_file:  # files, not pipes: nothing blocks
        proc = subprocess.Popen(command, stdout=out_file, stderr=err_file, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss_kb(proc.pid))
            if time.perf_counter() - start > timeout_s:
                proc.send_signal(signal.SIGINT)  # Ctrl-C's path: the solve ends its workers and exits
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                stopped = {"case": case.name, "wall_s": time.perf_counter() - start, "peak_gib": peak / 2**20,
                           "target_s": case.target_s, "error": f"not finished within {timeout_s:.0f} s"}
                if proc.returncode != 0 or not out_path.read_text().strip():
                    return stopped
                break  # interrupted with a plan found: reported with its gap to the lower bound
            try:
                proc.wait(timeout=0.2)  # returns as the solve exits: the wall time is not rounded up to a sample
            except subprocess.TimeoutExpired:
                pass
    wall = time.perf_counter() - start
    out, err = out_path.read_text(), err_path.read_text()
    if proc.returncode != 0:
        return {"case": case.name, "wall_s": wall, "peak_gib": peak / 2**20, "error": err.strip().splitlines()[-1]}
    plan = json.loads(out)
    return {"case": case.name, "wall_s": wall, "peak_gib": peak / 2**20, "target_s": case.target_s,
            "stopped": plan["solver"].get("stopped"), "bound_gap": plan["solver"].get("bound_gap"),
            "ilps": plan["solver"]["ilps"],
            "stages": len(plan["stages"]), "microbatches": plan["num_microbatches"],
            "meshes": sorted({(tuple(s["submesh"]), tuple(s["logical_mesh"])) for s in plan["stages"]}),
            "tflops": plan["throughput"]["tflops_per_device"], "iteration_s": plan["iteration_time_s"]}


def compare(names: list[str], timeout_s: float) -> None:
    """Print the default plan beside each forced mode and Megatron's grid, and whether the default is no slower."""
    table = Table(title="partopt solve: the default against one mode forced and Megatron's grid")
    for column in ("case", "flags", "iteration", "TFLOP/s/dev", "stages", "B", "planning", "default no slower"):
        table.add_column(column, justify="left" if column in ("case", "flags") else "right")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            graph, cluster = COMPARED[name]
            default = None
            for flags in FORCED:
                r = run(Case(name, graph, (*cluster, *flags), None), Path(tmp), timeout_s)
                print(json.dumps({**r, "flags": flags}, default=str), file=sys.stderr)
                label = " ".join(flags) or "(defaults)"
                if "error" in r or r.get("stopped"):
                    table.add_row(name, label, r.get("error", f"stopped, gap {r.get('bound_gap')}")[:60], "", "", "",
                                  f"{r['wall_s']:.0f} s", "")
                    continue
                if not flags:
                    default = r["iteration_s"]
                verdict = "" if default is None or not flags else ("yes" if default <= r["iteration_s"] * (1 + 1e-9) else "NO")
                table.add_row(name, label, f"{r['iteration_s']:.3f} s", f"{r['tflops']:.1f}", str(r["stages"]),
                              str(r["microbatches"]), f"{r['wall_s']:.0f} s", verdict)
    Console().print(table)


def compare_in_process(names: list[str]) -> None:
    """`compare` with every run in this process and one cache of layer solutions: each forced run reuses the
    ILPs of the runs before it (the plans are the same as cold runs'; only planning times differ)."""
    from partopt import baselines, io
    from partopt.cluster import preset
    from partopt.inter import optimize

    table = Table(title="partopt: the default against one mode forced and Megatron's grid (one process, one cache)")
    for column in ("case", "flags", "iteration", "TFLOP/s/dev", "stages", "B", "planning", "ILPs",
                   "peak RSS (this process)", "default no slower"):
        table.add_column(column, justify="left" if column in ("case", "flags") else "right")
    for name in names:
        source, cluster_args = COMPARED[name]
        with tempfile.TemporaryDirectory() as tmp:
            graph = io.read_graph(graph_file(source, name, Path(tmp)))
        args = dict(zip(cluster_args[::2], cluster_args[1::2]))
        cluster = preset(args["--cluster"], int(args["--nodes"]))
        cache, default = {}, None
        for flags in FORCED:
            options = {flag.lstrip("-"): value for flag, value in zip(flags[::2], flags[1::2])}
            start = time.perf_counter()
            if options.pop("search", None) == "megatron":
                plan = baselines.megatron(graph, cluster)
            else:
                plan = optimize(graph, cluster, cache=cache, **options)
            wall = time.perf_counter() - start
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # this process, GiB (Linux: KiB)
            r = {"case": name, "flags": flags, "wall_s": wall, "iteration_s": plan.iteration_time_s,
                 "stages": len(plan.stages), "microbatches": plan.num_microbatches, "ilps": plan.solver.get("ilps"),
                 "schedule": plan.schedule, "tflops": plan.throughput["tflops_per_device"], "peak_gib": peak}
            print(json.dumps(r, default=str), file=sys.stderr, flush=True)
            if not flags:
                default = plan.iteration_time_s
            verdict = "" if not flags else ("yes" if default <= plan.iteration_time_s * (1 + 1e-9) else "NO")
            table.add_row(name, " ".join(flags) or "(defaults)", f"{plan.iteration_time_s:.3f} s",
                          f"{r['tflops']:.1f}", str(r["stages"]), str(r["microbatches"]), f"{wall:.0f} s",
                          str(r["ilps"]), f"{peak:.2f} GiB", verdict)
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c.name for c in CASES], help="run only these cases")
    parser.add_argument("--timeout", type=float, default=1800.0, help="stop a solve after this many seconds")
    parser.add_argument("--repeat", type=int, default=1, help="run each case this many times; report the median wall")
    parser.add_argument("--compare", action="append", choices=list(COMPARED),
                        help="instead: this case's default plan against each mode forced and Megatron's grid")
    parser.add_argument("--in-process", action="store_true",
                        help="with --compare: every run in this process, sharing one cache of layer solutions")
    args = parser.parse_args()
    if args.compare:
        if args.in_process:
            compare_in_process(args.compare)
        else:
            compare(args.compare, args.timeout)
        return
    cases = [c for c in CASES if not args.case or c.name in args.case]
    table = Table(title="partopt solve: planning time (median of --repeat runs) and peak memory")
    for column in ("case", "wall", "target", "peak RSS", "ILPs", "stages", "B", "(submesh, mesh)",
                   "TFLOP/s/dev"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            runs = [run(case, Path(tmp), args.timeout) for _ in range(args.repeat)]
            for r in runs:
                print(json.dumps(r, default=str), file=sys.stderr)
            r = dict(runs[0], wall_s=statistics.median(x["wall_s"] for x in runs),
                     peak_gib=max(x["peak_gib"] for x in runs))
            target = f"{r['target_s']:.0f} s" if r.get("target_s") else "—"
            if "error" in r:
                table.add_row(r["case"], f"{r['wall_s']:.1f} s", target, f"{r['peak_gib']:.2f} GiB", r["error"][:60])
                continue
            wall = f"{r['wall_s']:.1f} s" + (f" (stopped; gap {r['bound_gap']:.1%})" if r.get("stopped") else "")
            table.add_row(r["case"], wall, target, f"{r['peak_gib']:.2f} GiB", str(r["ilps"]),
                          str(r["stages"]), str(r["microbatches"]),
                          " ".join(f"{m}{s}" for m, s in r["meshes"]), f"{r['tflops']:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
