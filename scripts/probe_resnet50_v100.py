"""NVIDIA's published ResNet-50 v1.5 training throughput on V100s, priced by the V100 model (a probe, not a fit).

Why: the p3.16xlarge calibration's largest leave-one-out error is Alpa's fp32 Wide-ResNet under XLA, predicted too
fast (docs/COSTMODEL.md §7, "MoE counted as Alpa counts it"). These runs are fp32 (and AMP) CNNs on the same GPUs
in PyTorch with cuDNN; if they err the other way, no fp32 efficiency of the device reconciles the two.

Source: NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
performance: NVIDIA DGX-1 16GB (8x V100 16GB)" (pytorch-21.03 container), with the batch per GPU of that
directory's configs.yml (DGX1V: 112 in FP32, 256 in AMP). Each run is data parallel over 1 or 8 GPUs of one
node, priced by `evaluate.uniform` with the gradient reduction overlapped (PyTorch DDP) and no recomputation.
The model keeps every op's output for the backward, so as run (one microbatch) the plans do not fit 16 GB here
(docs/COSTMODEL.md §6); the time is priced at two microbatches, and the as-run plan's memory is shown beside it.
Nothing here changes a parameter. Usage:

    python scripts/probe_resnet50_v100.py [--cluster FILE]
"""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from partopt import io, models
from partopt.cluster import preset
from partopt.errors import InfeasibleError
from partopt.evaluate import uniform
from partopt.units import fmt_bytes

# (precision, GPUs, images per GPU, published images/s)
RUNS = [("fp32", 1, 112, 367), ("fp32", 8, 112, 2855), ("AMP", 1, 256, 1200), ("AMP", 8, 256, 8322)]
PRICED_MICROBATCHES = 2


@click.command()
@click.option("--cluster", "cluster_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A cluster file in place of the p3.16xlarge preset.")
def main(cluster_file: str | None) -> None:
    base = io.read_cluster(cluster_file) if cluster_file else preset("p3.16xlarge")
    table = Table(title=f"ResNet-50 v1.5 on {base.device.name}: published against predicted", title_justify="left")
    for column in ("run", "published img/s", "predicted img/s", "error", "as run (1 microbatch)"):
        table.add_column(column)
    for precision, gpus, per_gpu, published in RUNS:
        graph = models.generate("wresnet", depth=50, base_channels=64, width_factor=1, batch=per_gpu * gpus,
                                classes=1000, dtype="fp32" if precision == "fp32" else "fp16", optimizer="sgd")
        cluster = base.resized(1).narrowed(gpus)
        plan = uniform(graph, cluster, 1, 1, gpus, PRICED_MICROBATCHES, recompute="none", workers=1)
        predicted = per_gpu * gpus / plan.iteration_time_s
        try:
            as_run = fmt_bytes(uniform(graph, cluster, 1, 1, gpus, 1, recompute="none", workers=1).memory_peak_bytes)
        except InfeasibleError as err:
            as_run = err.cause
        table.add_row(f"{precision}, {gpus} GPU{'s' if gpus > 1 else ''}, {per_gpu}/GPU", f"{published:,}",
                      f"{predicted:,.0f}", f"{predicted / published - 1:+.1%}", as_run)
    Console().print(table)


if __name__ == "__main__":
    main()
