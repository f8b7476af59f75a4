"""Fit the V100's matmul and memory efficiencies once, from the measured single-GPU points and the
measured GPT-2.6B point (REFERENCE.md §3), and write the result into docs/COSTMODEL.md's
"Calibration" section (between marker comments). Usage:

    python scripts/calibrate_v100.py [--no-write]

It does not change the p3.16xlarge preset: that is the lead's decision (issue 7).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from partopt.bench import alpa, calibrate, report
from partopt.cluster import preset
from partopt.errors import InfeasibleError

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "COSTMODEL.md"
BEGIN, END = "<!-- calibration:begin -->", "<!-- calibration:end -->"


@click.command()
@click.option("--write/--no-write", default=True, help="Write the Calibration section of docs/COSTMODEL.md.")
def main(write: bool) -> None:
    """Grid-search the two efficiencies by least squares of log error over the measured points."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    start = time.perf_counter()
    device = preset(alpa.MACHINE).device
    points, skipped = [], []
    for point in calibrate.CALIBRATION_POINTS:
        try:
            calibrate.predict_point(point, device.matmul_efficiency, device.memory_efficiency)
            points.append(point)
        except InfeasibleError as err:
            skipped.append((point, err.line()))
    fit = calibrate.calibrate(points)
    wall = time.perf_counter() - start
    table = Table(title=f"V100 calibration: matmul_efficiency {fit.matmul_efficiency:.3f}, "
                        f"memory_efficiency {fit.memory_efficiency:.3f}", title_justify="left")
    for column in ("point", "measured TFLOP/s", "predicted", "log error", "error"):
        table.add_column(column)
    rows = [[r.label, f"{r.reported:.2f}", f"{r.predicted:.2f}", f"{r.log_error:+.3f}", f"{r.predicted / r.reported - 1:+.1%}"]
            for r in fit.residuals]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for point, why in skipped:
        console.print(f"[yellow]not used[/] {point.label}: {why}")
    console.print(f"rms log error {fit.rms_log_error:.3f}; {fit.evaluated} grid points priced in {wall:.0f} s")
    if not write:
        return
    lines = ["### Fitted V100 efficiencies (`python scripts/calibrate_v100.py`)", "",
             (f"Fitted once by `partopt.bench.calibrate.calibrate` in {wall / 60:.1f} min: a grid over "
              "matmul_efficiency 0.3–0.9 × memory_efficiency 0.5–1.0 (step 0.1, then step 0.025 within ±0.05 of "
              "the coarse optimum), minimising the sum of squared log errors of the predicted per-GPU TFLOP/s against "
              "the measured points below, and nothing else. Single-GPU points are planned by `optimize` with "
              "recomputation, as Alpa's suites ran them; the GPT-2.6B point is priced as the plan "
              "that was measured (`evaluate.uniform`, tp 2 × pp 2 × dp 2, 4 microbatches, batch 32). GPT figures "
              "use the 96 closed form, the others the FLOPs the plan executes (recomputation included)."), "",
             (f"**Result: matmul_efficiency = {fit.matmul_efficiency:.3f}, memory_efficiency = "
             f"{fit.memory_efficiency:.3f}** (rms log error {fit.rms_log_error:.3f})."), "",
             "| point | measured TFLOP/s | predicted | log error | error |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if skipped:
        lines += [""] + [f"Not used (it could not be priced, so the fit is over the other points): {p.label} — {why}"
                         for p, why in skipped]
    device = preset("p3.16xlarge").device
    adopted = (round(device.matmul_efficiency, 3), round(device.memory_efficiency, 3)) == (
        round(fit.matmul_efficiency, 3), round(fit.memory_efficiency, 3))
    lines += ["", (f"The p3.16xlarge preset {'uses these values' if adopted else 'holds other values'} "
                   f"(matmul {device.matmul_efficiency}, memory {device.memory_efficiency}, "
                   "`partopt/cluster.py`); the benchmark tables in docs/benchmarks.md say which values they ran with.")]
    report.replace_marked(DOC, BEGIN, END, "\n".join(lines))
    console.print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
