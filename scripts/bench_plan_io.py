"""Time reading and writing a plan file (median of 20 runs) and print a table.

The plan is Megatron's layout of GPT-1.3B on one p3.16xlarge (tp 2, pp 2, dp 2, 128 microbatches,
full recomputation): 509 ops and their parameters. "to text" is `plan_text` (the Python plan to the
file's JSON text), "from dict" is `plan_from_dict` on the parsed JSON (schema check and, since the
typed plan, placement parsing), "read" and "write" are `read_plan` and `write_plan` on a temp file.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from partopt.cluster import preset
from partopt.evaluate import uniform
from partopt.models import preset as model
from partopt.plan import plan_from_dict, plan_text, read_plan, write_plan

RUNS = 20


def median_ms(task: Callable[[], object], runs: int = RUNS) -> float:
    """Median wall time of `runs` calls of `task`, in milliseconds."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        task()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    """Print the plan's size and the median time of each direction."""
    plan = uniform(model("gpt-1.3b"), preset("p3.16xlarge", 1), tp=2, pp=2, dp=2, microbatches=128,
                   recompute="full", workers=1)
    text = plan_text(plan)
    data = json.loads(text)
    ops = sum(len(s.ops) for s in plan.stages)
    params = sum(len(s.params) for s in plan.stages)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        write_plan(plan, path)
        rows = [("to text", median_ms(lambda: plan_text(plan))),
                ("from dict", median_ms(lambda: plan_from_dict(data))),
                ("write", median_ms(lambda: write_plan(plan, path))),
                ("read", median_ms(lambda: read_plan(path)))]
    print(f"plan: {ops} ops, {params} parameters, {len(text) / 1e3:.0f} kB")
    print("| step | median (ms) |")
    print("|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
    main()
