"""The search options of `optimize` and the microbatch counts it may try."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from partopt import costmodel, intra
from partopt.cluster import divisors
from partopt.errors import InfeasibleError, InstanceError
from partopt.pricing import RUNGS
from partopt.schedules import SCHEDULES, SEARCHED
from partopt.solvers import TIME_LIMIT_S

DEFAULT_MAX_LAYERS = 64  # every block up to 64 (GPT-39B: 48); more are grouped (docs/benchmarks.md)
COUNTED_BATCH = 2**40  # batches up to this have their divisors counted (`divisors`: 2**20 steps at most)


@dataclass(frozen=True)
class Options:
    """Search options of `optimize` (see its docstring)."""

    microbatches: int | str | Sequence[int] = "auto"  # a count, several to search, or auto (powers of two)
    layers: int | None = DEFAULT_MAX_LAYERS
    submesh_family: str = "auto"  # Alpa's family up to 16 nodes, powers of two beyond (`Cluster.submesh_family`)
    logical_shapes: str | Sequence[tuple[int, int]] = "node_local"  # or "all", or the allowed (a, b)
    backend: str = "highs"  # fastest in docs/benchmarks.md
    time_limit_s: float = TIME_LIMIT_S  # per ILP, a safety net: the solvers' work limits stop it first
    memory_reserve: float = costmodel.DEFAULT_MEMORY_RESERVE
    intra_only: bool = False
    inter_only: bool = False
    data_parallel_only: bool = False
    stage_data_parallel: bool = False
    seed: int = 0
    workers: int | None = None  # processes for the ILPs; None: one per available core
    executor: str = "local"  # where the layer ILPs run: local (this machine) or ray (partopt.executors)
    ray_address: str | None = None  # with executor ray: "auto", "HOST:PORT", or None (start a local instance)
    recompute: str = "auto"  # activation recomputation per stage: auto (searched) or one of intra.RECOMPUTE_MODES
    cost_model: costmodel.CostModel | None = None  # None: the analytical model (`costmodel.ANALYTICAL`)
    overlap: bool = True  # gradient reductions overlap the backward, weight gathers and interleaved sends overlap
    # compute (docs/COSTMODEL.md §5b); False: all costs add
    tp_comm_overlap: bool = False  # Megatron-LM's --tp-comm-overlap: tensor-parallel collectives under the GEMMs
    # (Megatron-style plans only, `evaluate.uniform`; docs/COSTMODEL.md §5b)
    state_layout: str = "zero"  # how the runtime lays out parameter state: zero (16 bytes/param with Adam) or
    # megatron (Megatron-LM's fp32 gradients: 18 in bf16, 20 in fp16; `costmodel.STATE_LAYOUTS`, COSTMODEL §5)
    deadline_s: float | None = None  # wall seconds for the whole search: then the best plan found, marked stopped
    schedule: str = "auto"  # pipeline schedule: auto (the best of `schedules.SEARCHED`) or one of them

    def __post_init__(self) -> None:
        if isinstance(self.recompute, bool):  # the former flag: recompute meant full recomputation
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if self.executor not in ("local", "ray"):
            raise InstanceError(f"unknown executor {self.executor!r}", "executor", "use local or ray")
        if self.deadline_s is not None and not self.deadline_s > 0:  # NaN too
            raise InstanceError(f"deadline {self.deadline_s} is not a positive number of seconds", "deadline",
                                "give the seconds the search may take, e.g. 60")
        if self.schedule not in ("auto", *SCHEDULES):
            raise InstanceError(f"unknown pipeline schedule {self.schedule!r}", "schedule",
                                f"use auto or one of {', '.join(SCHEDULES)}")
        if self.schedule == "interleaved" and (self.intra_only or self.data_parallel_only):
            raise InstanceError("the interleaved schedule interleaves pipeline stages, and this search plans one stage "
                                "on the whole cluster", "schedule", "use schedule auto or 1f1b with this search")
        if self.ray_address is not None and self.executor != "ray":
            raise InstanceError(f"a Ray address ({self.ray_address}) is for the ray executor, not {self.executor}",
                                "ray_address", "add --executor ray, or drop --ray-address")
        costmodel.check_state_layout(self.state_layout)
        if self.recompute not in ("auto", *intra.RECOMPUTE_MODES):
            raise InstanceError(f"unknown recomputation mode {self.recompute!r}", "recompute",
                                f"use auto or one of {', '.join(intra.RECOMPUTE_MODES)}")

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules the search plans (auto: every one it can price, `schedules.SEARCHED`)."""
        return SEARCHED if self.schedule == "auto" else (self.schedule,)

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """The modes the search prices, cheapest in time first (auto: all of them)."""
        return intra.RECOMPUTE_MODES if self.recompute == "auto" else (self.recompute,)


def microbatch_counts(batch: int, requested: int | str | Sequence[int]) -> list[int]:
    """Candidate microbatch counts: the requested ones, or ("auto") the powers of two dividing the batch."""
    if requested == "auto":
        return [b for b in (2**e for e in range(batch.bit_length())) if batch % b == 0]
    counts = [int(requested)] if isinstance(requested, (int, str)) else [int(c) for c in requested]
    for count in counts:
        if count < 1 or batch % count:
            raise InfeasibleError(f"batch {batch} is not divisible into {count} microbatches", "microbatches",
                                  f"use divisors of {batch}, or auto")
    if not counts:
        raise InstanceError("no microbatch count to search", "microbatches", "give one or more counts, or auto")
    return sorted(set(counts))


def restrictions(options: Options, batch: int, layers: int, dp_layers: int, *, family: str) -> list[str]:
    """Where the search's space is narrower than every plan of the model: the plan records these
    (`solver.search`) and `partopt solve` prints them; all other pruning is exact (a lower bound).
    `family`: the submesh family searched (`Cluster.submesh_family` of the options' one)."""
    found = []
    if dp_layers < layers:
        found.append(f"stages cut between {dp_layers} groups of the {layers} layers (--layers {options.layers})")
    if options.microbatches == "auto" and batch & (batch - 1):  # not a power of two: other divisors are left out
        of = f"of its {len(divisors(batch))} divisors" if batch <= COUNTED_BATCH else "not its other divisors"
        found.append(f"microbatch counts: the {len(microbatch_counts(batch, 'auto'))} powers of two dividing the "
                     f"batch of {batch} ({of})")
    if not (options.intra_only or options.inter_only or options.data_parallel_only):
        found.append("submeshes: " + ("whole nodes and powers of two within a node" if family == "alpa"
                                      else "powers of two of nodes and of devices within a node")
                     + (" (auto on a cluster this large; --submeshes alpa searches every node count)"
                        if options.submesh_family == "auto" and family != "alpa" else ""))
    if options.logical_shapes == "node_local":
        found.append("logical meshes: the second axis within a node")
    elif not isinstance(options.logical_shapes, str):
        found.append("logical meshes: the given shapes only")
    found.append(f"memory-lean layer options: caps budget / r, r in {', '.join(map(str, RUNGS))}, "
                 "priced where memory binds, each for the stage lengths it serves (from the rung before to r)")
    if len(options.recompute_modes) > 1:
        found.append("recomputation: one mode per stage")
    if "interleaved" in options.schedules:
        found.append("interleaved schedule: Megatron's uniform chunks only")
    return found
