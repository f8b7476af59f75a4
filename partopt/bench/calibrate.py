"""Fit the V100's matmul and memory efficiencies once, by least squares of log error of
partopt's predicted per-GPU TFLOP/s against measured points (REFERENCE.md §3); used by
scripts/calibrate_v100.py, which writes docs/COSTMODEL.md's Calibration section. Nothing here prints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from partopt import intra
from partopt.bench.alpa import cluster_for, load, model_options, plan_with, tflops_per_gpu
from partopt.evaluate import uniform
from partopt.graph import Graph


@dataclass(frozen=True)
class CalibrationPoint:
    """A measured V100 throughput the efficiencies are fitted to (REFERENCE.md §3)."""

    label: str
    model: str
    instance: str
    gpus: int
    reported: float  # per-GPU TFLOP/s, in the paper's metric
    batch: int | None = None  # the global batch the measurement ran, when not the instance's
    uniform: tuple[int, int, int, int] | None = None  # (tp, pp, dp, microbatches) of a fixed measured plan


CALIBRATION_POINTS: tuple[CalibrationPoint, ...] = (
    CalibrationPoint("GPT-350M, 1 GPU (Alpa)", "gpt", "gpt-350m", 1, 45.07),
    CalibrationPoint("MoE-380M, 1 GPU (Alpa)", "moe", "moe-380m", 1, 45.46),
    CalibrationPoint("Wide-ResNet-250M, 1 GPU (Alpa)", "wresnet", "wresnet-250m", 1, 8.30),
    CalibrationPoint("GPT-2.6B, batch 32, dp 2 × op 2 × pp 2, B 4, 1 node", "gpt", "gpt-2.6b", 8, 37.01,
                     batch=32, uniform=(2, 2, 2, 4)),
)


def predict_point(point: CalibrationPoint, matmul: float, memory: float, graph: Graph | None = None) -> float:
    """partopt's per-GPU TFLOP/s for a calibration point on a V100 with the given efficiencies.

    A point with a fixed plan is priced as that plan (`evaluate.uniform`); the others are planned."""
    graph = graph or load(point.instance)
    if point.batch is not None:
        graph = intra.with_batch(graph, point.batch)
    cluster = cluster_for(point.gpus, (matmul, memory))
    if point.uniform is not None:
        tp, pp, dp, count = point.uniform
        plan = uniform(graph, cluster, tp, pp, dp, count, **model_options(point.model))
    else:
        plan = plan_with("partopt", graph, cluster, model=point.model)
    return tflops_per_gpu(point.model, graph, plan)


@dataclass(frozen=True)
class Residual:
    label: str
    reported: float
    predicted: float

    @property
    def log_error(self) -> float:
        return math.log(self.predicted / self.reported)


@dataclass(frozen=True)
class Calibration:
    """The fitted efficiencies, each point's residual, and how many grid points were priced."""

    matmul_efficiency: float
    memory_efficiency: float
    residuals: tuple[Residual, ...]
    evaluated: int

    @property
    def rms_log_error(self) -> float:
        return math.sqrt(sum(r.log_error**2 for r in self.residuals) / len(self.residuals))


Predictor = Callable[[CalibrationPoint, float, float], float]


def _grid(low: float, high: float, step: float) -> list[float]:
    return [round(low + i * step, 6) for i in range(round((high - low) / step) + 1)]


def fit_efficiencies(predict: Predictor, points: Sequence[CalibrationPoint], matmul_grid: Sequence[float],
                     memory_grid: Sequence[float]) -> Calibration:
    """The (matmul, memory) efficiency pair of the grids minimising the sum of squared log errors
    of `predict` against the points' reported figures (ties: the first in grid order)."""
    best: tuple[float, float, float, tuple[Residual, ...]] | None = None
    evaluated = 0
    for matmul in matmul_grid:
        for memory in memory_grid:
            residuals = tuple(Residual(p.label, p.reported, predict(p, matmul, memory)) for p in points)
            evaluated += 1
            loss = sum(r.log_error**2 for r in residuals)
            if best is None or loss < best[0] - 1e-12:
                best = (loss, matmul, memory, residuals)
    assert best is not None, "empty calibration grid"
    return Calibration(best[1], best[2], best[3], evaluated)


def calibrate(points: Sequence[CalibrationPoint] = CALIBRATION_POINTS, predict: Predictor | None = None,
              matmul_range: tuple[float, float] = (0.3, 0.9), memory_range: tuple[float, float] = (0.5, 1.0),
              coarse: float = 0.1, fine: float = 0.025) -> Calibration:
    """Fit V100 matmul and memory efficiencies once, by least squares of log error over `points`:
    a coarse grid over the ranges (GEMMs reach 30-90 % of peak, streaming ops 50-100 % of HBM
    bandwidth), then a fine grid ±coarse/2 around the coarse optimum."""
    graphs: dict[str, Graph] = {}

    def default(point: CalibrationPoint, matmul: float, memory: float) -> float:
        if point.instance not in graphs:
            graphs[point.instance] = load(point.instance)
        return predict_point(point, matmul, memory, graphs[point.instance])

    predict = predict or default
    first = fit_efficiencies(predict, points, _grid(*matmul_range, coarse), _grid(*memory_range, coarse))

    def around(x: float) -> list[float]:
        return [v for v in _grid(x - coarse / 2, x + coarse / 2, fine) if 0 < v <= 1]

    second = fit_efficiencies(predict, points, around(first.matmul_efficiency), around(first.memory_efficiency))
    return dataclasses.replace(second, evaluated=first.evaluated + second.evaluated)
