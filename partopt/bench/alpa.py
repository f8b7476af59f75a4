"""Alpa's weak-scaling benchmarks (GPT, MoE, Wide-ResNet on 1–64 V100s, REFERENCE.md §3) as data:
the cases with the figures and plans the paper reports, the paper's throughput metric, and each
compared planner as a call into the planner (partopt's searches and `partopt.baselines`).
Nothing here prints; the graphs come from `partopt.models`, so an installed package needs no files.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from partopt import baselines
from partopt import models as zoo
from partopt.cluster import Cluster, preset, preset_calibration
from partopt.errors import InstanceError
from partopt.graph import Graph
from partopt.inter import optimize
from partopt.plan import Plan

MACHINE = "p3.16xlarge"
MODELS: tuple[str, ...] = ("gpt", "moe", "wresnet")
GPU_COUNTS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
QUICK_MAX_GPUS = 8
OOM = None  # a reported or predicted figure that ran out of memory

# The baseline the paper compares against on each model (besides Alpa's own restricted searches).
BASELINE = {"gpt": "megatron", "moe": "deepspeed", "wresnet": "ppdp"}
PLANNER_TITLES = {"partopt": "partopt", "inter_only": "inter-op only", "intra_only": "intra-op only",
                  "megatron": "Megatron-LM", "deepspeed": "DeepSpeed", "ppdp": "PP-DP"}
ERROR_BAND = {"gpt": 0.25, "moe": 0.35, "wresnet": 0.35}  # issue 7: allowed |partopt / Alpa - 1|

# REFERENCE.md §3: instance, then per GPU count the reported per-GPU TFLOP/s of
# (baseline, inter-op only, intra-op only, Alpa); OOM = out of memory, "—" rows are absent (NaN).
_NA = float("nan")
_REPORTED: dict[str, dict[int, tuple[str, tuple]]] = {
    "gpt": {1: ("gpt-350m", (47.53, 44.23, 46.20, 45.07)), 2: ("gpt-760m", (55.53, 57.94, 59.54, 57.92)),
            4: ("gpt-1.3b", (55.89, 53.99, 58.36, 58.21)), 8: ("gpt-2.6b", (50.44, 56.57, 50.82, 61.61)),
            16: ("gpt-6.7b", (56.59, 59.68, 48.42, 60.0)), 32: ("gpt-15b", (58.24, 49.80, 35.07, 59.9)),
            64: ("gpt-39b", (57.84, 50.55, 2.11, 57.0))},
    "moe": {1: ("moe-380m", (34.24, 45.46, 45.46, 45.46)), 2: ("moe-690m", (33.11, 40.75, 42.17, 43.03)),
            4: ("moe-1.3b", (34.67, 37.52, 41.13, 39.92)), 8: ("moe-2.4b", (40.01, 39.80, 46.72, 45.76)),
            16: ("moe-10b", (12.91, 31.12, 22.91, 45.36)), 32: ("moe-27b", (3.82, OOM, 1.50, 38.84)),
            64: ("moe-70b", (_NA, OOM, 0.215, 36.55))},
    "wresnet": {1: ("wresnet-250m", (8.30, 8.30, 8.37, 8.30)), 2: ("wresnet-500m", (8.24, 8.46, 8.48, 8.46)),
                4: ("wresnet-1b", (8.08, 6.47, 8.15, 8.16)), 8: ("wresnet-2b", (7.72, 5.46, 7.71, 8.04)),
                16: ("wresnet-4b", (0.37, 0.37, 4.72, 6.76)), 32: ("wresnet-6.8b", (OOM, OOM, 1.96, 6.60)),
                64: ("wresnet-13b", (OOM, OOM, 0.70, 5.3))},
}


@dataclass(frozen=True)
class PlanSummary:
    """The shape of a pipeline plan: microbatches, stages, submesh and logical mesh per stage."""

    microbatches: int
    stages: int
    submeshes: tuple[tuple[int, int], ...]
    logical_meshes: tuple[tuple[int, int], ...]
    note: str = ""


def _same(shape: tuple[int, int], count: int) -> tuple[tuple[int, int], ...]:
    return (shape,) * count


# REFERENCE.md §3, "Plans Alpa found for GPT on p3.16xlarge".
ALPA_GPT_PLANS: dict[int, PlanSummary] = {
    1: PlanSummary(512, 1, _same((1, 1), 1), _same((1, 1), 1)),
    2: PlanSummary(128, 2, _same((1, 1), 2), _same((1, 1), 2)),
    4: PlanSummary(128, 2, _same((1, 2), 2), _same((2, 1), 2), "data parallel inside each stage"),
    8: PlanSummary(128, 3, ((1, 2), (1, 2), (1, 4)), ((2, 1), (2, 1), (4, 1))),
    16: PlanSummary(64, 2, _same((1, 8), 2), _same((2, 4), 2)),
    32: PlanSummary(128, 4, _same((1, 8), 4), _same((2, 4), 4)),
    64: PlanSummary(1024, 16, _same((1, 4), 16), _same((1, 4), 16)),
}


# The microbatch counts Alpa's benchmark suite searched in each case (alpa-projects/alpa,
# benchmark/alpa/suite_paper_auto_gpt.py, suite_paper_auto_moe.py, suite_paper_wresnet.py). Counts
# that do not divide the instance's batch are dropped (the suite ran Wide-ResNet at 32 and 64 GPUs
# with batches 1520 and 1512 too); a case with none left, or absent from the suites (one GPU),
# searches every power of two.
ALPA_MICROBATCHES: dict[str, dict[int, tuple[int, ...]]] = {
    "gpt": {2: (32, 64, 128, 256), 4: (32, 64, 128), 8: (64, 128, 256), 16: (32, 64, 128, 256),
            32: (64, 128, 256, 512), 64: (128, 256, 512, 1024)},
    "moe": {2: (16, 32, 64), 4: (16, 32, 64), 8: (16, 32, 64), 16: (16, 32, 64), 32: (32, 64, 128), 64: (64,)},
    "wresnet": {1: (24,), 2: (24,), 4: (24,), 8: (24,), 16: (24, 32), 32: (38, 42), 64: (38, 32, 48, 42)},
}


@dataclass(frozen=True)
class Case:
    """One benchmark case: a model instance on `gpus` V100s, with the paper's reported figures."""

    model: str  # gpt | moe | wresnet
    instance: str  # a named model of partopt.models (instances/<name>.json)
    gpus: int
    reported: dict[str, float | None]  # planner -> per-GPU TFLOP/s (None: out of memory; absent: not reported)
    alpa_plan: PlanSummary | None = None
    suite_microbatches: tuple[int, ...] = ()  # the counts Alpa's suite searched (ALPA_MICROBATCHES)

    def microbatches(self, batch: int) -> tuple[int, ...] | str:
        """The counts partopt searches for this case: the suite's that divide `batch`, else auto."""
        counts = tuple(c for c in self.suite_microbatches if batch % c == 0)
        return counts or "auto"

    @property
    def planners(self) -> tuple[str, ...]:
        return ("partopt", "inter_only", "intra_only", BASELINE[self.model])

    @property
    def in_sample(self) -> bool:
        """Whether this case is a calibration point of the V100 preset in use: its error is then fitted, not predicted."""
        return (self.instance, self.gpus) in calibration_cases()


@functools.cache
def calibration_cases() -> frozenset[tuple[str, int]]:
    """(instance, GPUs) of the points the V100 preset's data file was fitted to (docs/COSTMODEL.md §7) that
    are a case: the case's model, unchanged, on as many GPUs; empty without a data file."""
    calibration = preset_calibration(MACHINE)
    if calibration is None:
        return frozenset()
    fitted = {e["label"] for e in calibration["errors"]}
    points = json.loads(resources.files("partopt").parent.joinpath(calibration["points"]).read_text())["points"]
    return frozenset((p["model"]["preset"], p["plan"]["tp"] * p["plan"]["pp"] * p["plan"]["dp"])
                     for p in points if p["label"] in fitted and "preset" in p["model"] and not p["model"].get("args"))


def cases(models: Sequence[str] = MODELS, max_gpus: int = 64) -> list[Case]:
    """The benchmark cases of `models` up to `max_gpus` GPUs, in the paper's order."""
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise InstanceError(f"unknown model family {unknown[0]!r}", "--models", f"use some of {','.join(MODELS)}")
    result = []
    for model in models:
        for gpus in GPU_COUNTS:
            if gpus > max_gpus:
                continue
            instance, figures = _REPORTED[model][gpus]
            names = (BASELINE[model], "inter_only", "intra_only", "partopt")
            reported = {n: v for n, v in zip(names, figures) if v is None or not math.isnan(v)}
            result.append(Case(model, instance, gpus, reported, ALPA_GPT_PLANS.get(gpus) if model == "gpt" else None,
                               ALPA_MICROBATCHES[model].get(gpus, ())))
    return result


def load(instance: str) -> Graph:
    """The graph of a case's instance, built by `partopt.models` (equal to instances/<name>.json, tested)."""
    return zoo.preset(instance)


Efficiency = tuple[float, float]  # (matmul_efficiency, memory_efficiency) of the V100


def cluster_for(gpus: int, efficiency: Efficiency | None = None) -> Cluster:
    """p3.16xlarge with `gpus` V100s: one node with fewer devices below 8, else gpus / 8 whole nodes;
    `efficiency` overrides the preset device's (matmul, memory) efficiencies."""
    if gpus < 8:
        cluster = preset(MACHINE, 1).narrowed(gpus)
    elif gpus % 8:
        raise InstanceError(f"{gpus} GPUs is not a whole number of p3.16xlarge nodes", "--max-gpus", "use 1, 2, 4 or a multiple of 8")
    else:
        cluster = preset(MACHINE, gpus // 8)
    return cluster if efficiency is None else with_efficiency(cluster, *efficiency)


def with_efficiency(cluster: Cluster, matmul: float, memory: float) -> Cluster:
    """`cluster` whose device reaches `matmul` of peak on GEMMs and `memory` of HBM bandwidth."""
    device = dataclasses.replace(cluster.device, matmul_efficiency=matmul, memory_efficiency=memory)
    return dataclasses.replace(cluster, device=device)


# ---------------------------------------------------------------- the throughput metric

def gpt_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool = True) -> float:
    """FLOPs of one GPT training iteration by Megatron's closed form (REFERENCE §2), 96 with recompute; else
    72, the model FLOPs of Korthikanti et al. 2022's MFU: the blocks lose their recomputed forward (a quarter),
    the logits (6·B·s·h·V, never recomputed) stay."""
    blocks = 24 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden))
    return (4 if recompute else 3) * blocks + 6 * batch * seq * hidden * vocab


def gpt_shape(graph: Graph) -> tuple[int, int, int, int, int]:
    """(batch, sequence, blocks, hidden, vocabulary) of a zoo GPT graph: one layer tag per block."""
    d = graph.dims
    return d[graph.batch_dim], d["s"], len(graph.layers), d["h"], d["v"]


def moe_flops(batch: int, seq: int, layers: int, hidden: int, ffn: int, group: int, vocab: int, experts: int,
              recompute: bool = True) -> float:
    """FLOPs of one GShard MoE training iteration as Alpa's benchmark counts them (`compute_moe_tflops`,
    benchmark/alpa/util.py of alpa-projects/alpa): half the blocks dense, half with top-2 experts (each token's
    FFN twice), its gate's softmax over the experts, top-2 gating over the group and the dispatch and combine
    einsums; 4 × their forward with recompute, else 3 ×; the logits 6·B·s·h·V, never recomputed."""
    tokens = batch * seq
    attention = 8 * tokens * hidden**2 + 4 * batch * seq**2 * hidden
    dense = attention + 4 * tokens * hidden * ffn
    expert = (attention + 8 * tokens * hidden * ffn + 2 * tokens * hidden * experts + 4 * tokens * group
              + 8 * tokens * hidden * group)
    return (4 if recompute else 3) * (dense + expert) * layers / 2 + 6 * tokens * hidden * vocab


def moe_shape(graph: Graph) -> tuple[int, int, int, int, int, int, int, int]:
    """(batch, sequence, blocks, hidden, ffn, group size, vocabulary, experts) of a zoo MoE graph."""
    d = graph.dims
    return d[graph.batch_dim], d["s"], len(graph.layers), d["h"], d["f"], d["gs"], d["v"], d["e"]


def tflops_per_gpu(model: str, graph: Graph, plan: Plan) -> float:
    """The paper's per-GPU TFLOP/s of `plan`, counted as Alpa's benchmark counts them, its recomputed forward
    included: GPT by the 96 closed form, MoE by `compute_moe_tflops(checkpoint_activations=True)` (`moe_flops`),
    both over the plan's iteration time; Wide-ResNet by the FLOPs the plan executes (forward, backward and
    recomputation: what XLA's flop count of a rematerialised executable counts)."""
    gpus = plan.nodes * plan.devices_per_node
    if model == "gpt":
        return gpt_flops(*gpt_shape(graph)) / plan.iteration_time_s / gpus / 1e12
    if model == "moe":
        return moe_flops(*moe_shape(graph)) / plan.iteration_time_s / gpus / 1e12
    return float(plan.throughput["hardware_tflops_per_device"])


# ---------------------------------------------------------------- planners

# Alpa's benchmark suites rematerialise activations for all three families (`Remat` is True in the
# fixed parameters of suite_paper_auto_gpt.py, suite_paper_auto_moe.py and suite_paper_wresnet.py),
# not only GPT as REFERENCE §3 says; every planner of a case gets the same setting.
RECOMPUTE_MODELS: tuple[str, ...] = MODELS


def model_options(model: str) -> dict:
    """Planner keywords for the paper's setting of `model`: activation recomputation (Alpa's suites),
    the additive cost model (no overlap) that the reproduction was calibrated and checked with, and
    Alpa's 1F1B schedule (the search's default would also try interleaved and zero-bubble)."""
    return {"recompute": "full" if model in RECOMPUTE_MODELS else "none", "overlap": False, "schedule": "1f1b"}


def plan_with(planner: str, graph: Graph, cluster: Cluster, microbatches: int | str | Sequence[int] = "auto",
              model: str = "gpt", cache: dict | None = None) -> Plan:
    """Plan `graph` (a `model` family graph) on `cluster` with one planner (InfeasibleError when nothing fits);
    `cache` shares layer ILP solutions between the planners of one case (see `optimize`)."""
    options = model_options(model)
    if planner == "megatron":  # Megatron-LM as Alpa ran it (2021): no sequence parallelism, distributed optimizer or
        # interleaved schedule
        return baselines.megatron(graph, cluster, features=(), **options)
    flags = {"partopt": {}, "inter_only": {"inter_only": True}, "intra_only": {"intra_only": True}}
    if planner in baselines.BASELINES:
        return baselines.BASELINES[planner](graph, cluster, microbatches=microbatches, cache=cache, **options)
    if planner not in flags:
        raise InstanceError(f"unknown planner {planner!r}", "planner", f"use one of {list(PLANNER_TITLES)}")
    return optimize(graph, cluster, microbatches=microbatches, cache=cache, **flags[planner], **options)


def summarize(plan: Plan) -> PlanSummary:
    """The pipeline shape of a partopt plan, comparable with Alpa's reported plans."""
    return PlanSummary(plan.num_microbatches, len(plan.stages),
                       tuple(tuple(s.submesh) for s in plan.stages), tuple(tuple(s.logical_mesh) for s in plan.stages))


def format_meshes(meshes: Sequence[tuple[int, int]]) -> str:
    """'(1,8) ×2, (1,4)': consecutive equal meshes collapsed."""
    parts: list[list] = []
    for mesh in meshes:
        if parts and parts[-1][0] == tuple(mesh):
            parts[-1][1] += 1
        else:
            parts.append([tuple(mesh), 1])
    return ", ".join(f"({a},{b})" + (f" ×{n}" if n > 1 else "") for (a, b), n in parts)


# ---------------------------------------------------------------- the inter-op ablation (paper §8.5)

ABLATION_METHODS: tuple[str, ...] = ("dp", "equal_mesh", "equal_layer", "equal_operator")
ABLATION_TITLES = {"dp": "DP (partopt)", "equal_mesh": "equal mesh", "equal_layer": "equal layer",
                   "equal_operator": "equal operator"}
# REFERENCE.md §3: (model, GPUs) -> reported TFLOP/s of (DP, equal mesh, equal layer, equal operator)
ABLATION_REPORTED: dict[tuple[str, int], tuple[float, float, float, float]] = {
    ("gpt", 8): (61, 61, 61, 40), ("gpt", 16): (60, 60, 60, 41), ("gpt", 32): (60, 60, 60, 40),
    ("wresnet", 8): (8.04, 7.2, 6.6, 7.3), ("wresnet", 16): (6.8, 6.1, 6.3, 3.3), ("wresnet", 32): (6.6, 6.6, 4.1, 2.5),
}
