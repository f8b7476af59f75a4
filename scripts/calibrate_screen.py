"""Screen one candidate parameter before paying for its fit (docs/COSTMODEL.md §7): price every point
once per value of the candidate (the others at the preset's values, `matmul_efficiency` at --matmul),
then refit `matmul_efficiency` alone by its linearised effect — each point's log prediction moves by
s_i · log(m / m0), s_i measured by pricing the points once more at m0 · e^{-STEP} — and print, per
value, the fitted m, the sum of squared log errors and the leave-one-out errors with the candidate
held at that value. This is a screen, not the procedure: the procedure's leave-one-out refits the
candidate too, so its errors are larger (on the A100, intra_bus_efficiency 0.3: a leave-one-out
median of 10.7 % screened, 11.9 % by the procedure's fit at 0.303). Usage:

    python scripts/calibrate_screen.py partopt/bench/points/dgx-a100.json --preset dgx-a100 \
        --parameter inter_bus_efficiency --values 1,0.7,0.5,0.3
"""

from __future__ import annotations

import math
import statistics
import sys

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from partopt import calibrate
from partopt.cluster import nominal_preset, preset
from partopt.errors import PartoptError

STEP = 0.25  # log step of matmul_efficiency for the sensitivities (0.75 -> 0.584)


def log_errors(points: calibrate.Points, name: str, values: dict[str, float]) -> np.ndarray:
    """log(predicted / measured) of every point with `values` set on preset `name`."""
    base = calibrate.with_values(preset(name), nominal_preset(name), values)
    return np.array([math.log(calibrate.ratio(p, calibrate.point_cluster(p, base))) for p in points.points])


def shift(r: np.ndarray, s: np.ndarray, rows: list[int]) -> float:
    """The log(m / m0) minimising the squared log errors of `rows` when each moves by s_i per unit."""
    return float(-np.sum(r[rows] * s[rows]) / np.sum(s[rows] ** 2))


@click.command()
@click.argument("points_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--preset", "name", required=True, help="The cluster preset.")
@click.option("--parameter", required=True, help="The candidate parameter (partopt.calibrate.PARAMETERS).")
@click.option("--values", required=True, help="Comma-separated values of the candidate to price.")
@click.option("--matmul", default=0.75, show_default=True, help="matmul_efficiency m0 to price at.")
def main(points_file: str, name: str, parameter: str, values: str, matmul: float) -> None:
    """Screen PARAMETER at VALUES on POINTS_FILE: errors after refitting matmul_efficiency alone."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        points = calibrate.read_points(points_file)
        grid = [float(v) for v in values.split(",")]
        r0 = log_errors(points, name, {"matmul_efficiency": matmul})
        s = (log_errors(points, name, {"matmul_efficiency": matmul * math.exp(-STEP)}) - r0) / -STEP
        rows = {v: log_errors(points, name, {"matmul_efficiency": matmul, parameter: v}) for v in grid}
    except (PartoptError, ValueError) as err:
        click.echo(f"error: {err.line() if isinstance(err, PartoptError) else err}", err=True)
        sys.exit(2)
    table = Table(title=f"{name}: screen of {parameter} (matmul_efficiency refitted alone, linearised)",
                  title_justify="left")
    for column in (parameter, "matmul", "cost", *(f"#{i + 1}" for i in range(len(points.points))), "LOO median", "LOO max"):
        table.add_column(column)
    every = list(range(len(points.points)))
    for v, r in rows.items():
        dz = shift(r, s, every)
        loo = [math.exp(r[i] + s[i] * shift(r, s, [k for k in every if k != i])) - 1 for i in every]
        table.add_row(f"{v:g}", f"{matmul * math.exp(dz):.3f}", f"{float(np.sum((r + s * dz) ** 2)):.4f}",
                      *(f"{e:+.1%}" for e in loo), f"{statistics.median(abs(e) for e in loo):.1%}",
                      f"{max(abs(e) for e in loo):.1%}")
    console.print(table)
    console.print("leave-one-out errors of points " + "; ".join(f"#{i + 1} {p.label}" for i, p in enumerate(points.points)))
    console.print("sensitivities s_i: " + " ".join(f"{x:.3f}" for x in s))


if __name__ == "__main__":
    main()
