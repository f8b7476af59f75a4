"""Try parameter sets on one points file with the calibration procedure (docs/COSTMODEL.md §7):
for each `--fit` set, `partopt.calibrate.fit` with exactly those parameters (the procedure's own
identifiability check applies; a set it rejects is reported, not fitted), then each point's fitted
and leave-one-out error, the leave-one-out median and max, the predictions made and the wall time.
Nothing is written: `partopt calibrate ... -o FILE` writes a preset from the points file's `fit`.
Usage (one fit at a time; an A100 set takes 10-30 min on the shared 2-core machine):

    python scripts/calibrate_trials.py partopt/bench/points/dgx-a100.json --preset dgx-a100 \
        --fit matmul_efficiency,matmul_half_gflop --fit matmul_efficiency,intra_bus_efficiency
"""

from __future__ import annotations

import statistics
import sys
import time

import click
from rich.console import Console
from rich.table import Table

from partopt import calibrate
from partopt.errors import PartoptError


@click.command()
@click.argument("points_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--preset", "preset_name", required=True, help="The cluster preset to fit.")
@click.option("--fit", "sets", multiple=True, required=True, help="Comma-separated parameters to fit together.")
def main(points_file: str, preset_name: str, sets: tuple[str, ...]) -> None:
    """Fit each parameter set to POINTS_FILE and print its per-point and leave-one-out errors."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        points = calibrate.read_points(points_file)
    except PartoptError as err:
        click.echo(f"error: {err.line()}", err=True)
        sys.exit(2)
    for chosen in sets:
        names = [n.strip() for n in chosen.split(",") if n.strip()]
        start = time.perf_counter()
        try:
            result = calibrate.fit(points, preset_name, names)
        except PartoptError as err:
            console.print(f"{', '.join(names)}: not fitted: {err.line()}", markup=False)
            continue
        fitted = ", ".join(f"{n} {result.values[n]:.4g}" for n in result.fitted)
        table = Table(title=f"{preset_name}, fit {fitted}", title_justify="left")
        for column in ("point", "fitted error", "leave-one-out error"):
            table.add_column(column)
        for r in result.results:
            table.add_row(r.label, f"{r.error:+.1%}", f"{r.loo_error:+.1%}" if r.loo_error is not None else "—")
        console.print(table)
        loo = [abs(r.loo_error) for r in result.results if r.loo_error is not None]
        console.print(f"leave-one-out |error| median {statistics.median(loo):.1%}, max {max(loo):.1%}; "
                      f"{result.evaluations} point predictions, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
