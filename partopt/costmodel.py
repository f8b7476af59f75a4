"""The analytical cost model (DESIGN §3, docs/COSTMODEL.md): roofline compute, ring collectives, memory.

One model for the ILP, the DP, `evaluate` and the simulator, so a plan's predicted time never
depends on who computed it. All inputs and outputs are SI: bytes, FLOP, seconds.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol

from partopt.cluster import Device, Link, MeshAxis
from partopt.errors import InstanceError
from partopt.graph import DTYPE_BYTES

COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# Ring algorithms: each device sends FACTOR·(n-1)/n·S bytes in FACTOR·(n-1) latency steps.
_RING_FACTOR: Mapping[str, float] = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}

VECTOR_DTYPE = "fp32"  # non-matmul arithmetic is priced at the device's fp32 (vector-unit / CUDA-core) peak
# Backward FLOPs / forward FLOPs. A matmul's backward is two GEMMs of its forward's size; fused
# attention's is five against its forward's two (it recomputes the scores: q·k, then dv, dp, dq, dk).
BACKWARD_FACTOR: Mapping[str, float] = {"matmul": 2.0, "attention": 2.5, "other": 1.0}

# Optimizer state in bytes per parameter, (16-bit weights, fp32 weights): a 16-bit model keeps an
# fp32 master copy (4) beside the optimizer's own fp32 buffers. Adam: m and v (8); SGD with
# momentum: one buffer (4); Adafactor (no momentum): only factored second moments, one fp32 row
# and column vector per matrix — 0.06 % (moe-70b) to 0.26 % (moe-380m) of the parameter count in
# the corpus — not counted.
OPTIMIZER_STATE: Mapping[str, tuple[int, int]] = {"adam": (12, 8), "sgd": (8, 4), "adafactor": (4, 0)}
TRAINABLE_DTYPES: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")

# How the training runtime lays out a 16-bit model's gradients (docs/COSTMODEL.md §5, "The runtime's state layout").
# zero: the ZeRO paper's accounting (Rajbhandari et al., SC'20), gradients in the weights' dtype, 16 bytes per
# parameter with Adam. megatron: Megatron-LM's (docs/user-guide/features/dist_optimizer.md; megatron/training/
# arguments.py): bf16 gradients accumulate and reduce in fp32 (18 bytes), and fp16 ones are copied to fp32 main
# gradients that the optimizer keeps beside its master copy (20 bytes, split with the optimizer state).
STATE_LAYOUTS: tuple[str, ...] = ("zero", "megatron")

# Fixed cost of one collective call (kernel launch and group synchronisation), on top of the
# ring's per-step latency. It makes one all-reduce cheaper than the reduce-scatter + all-gather
# pair that moves the same bytes, as it is in NCCL.
COLLECTIVE_LAUNCH_S = 5e-6

DEFAULT_MEMORY_RESERVE = 0.1  # fraction of device memory kept for CUDA context, NCCL buffers, fragmentation


def _check_kind(kind: str) -> None:
    if kind not in _RING_FACTOR:
        raise InstanceError(f"unknown collective {kind!r}", hint=f"use one of {list(COLLECTIVES)}")


def check_state_layout(layout: str) -> None:
    """InstanceError unless `layout` is one of `STATE_LAYOUTS`."""
    if layout not in STATE_LAYOUTS:
        raise InstanceError(f"unknown parameter state layout {layout!r}", "state_layout",
                            f"use one of {', '.join(STATE_LAYOUTS)}")


def _check_nonnegative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def collective_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each of `n` devices sends in a ring `kind` over a full buffer of `nbytes` (2(n-1)/n·S for all-reduce)."""
    _check_kind(kind)
    _check_nonnegative("nbytes", nbytes)
    if n <= 1:
        return 0.0
    return _RING_FACTOR[kind] * (n - 1) / n * nbytes


def collective_time(kind: str, nbytes: float, axis: MeshAxis, calls: float = 1.0) -> float:
    """Seconds of a ring `kind` on one mesh axis; `nbytes` is the full (gathered/reduced) buffer per device.

    all-reduce 2(n-1)/n·S/bw + 2(n-1)·a; all-gather, reduce-scatter, all-to-all (n-1)/n·S/bw + (n-1)·a;
    plus `calls` times a call's fixed part (COLLECTIVE_LAUNCH_S and the ring's latency steps,
    `collective_overhead`): 1 for a call of its own; 0 for a tensor riding in a large bucket (gradient
    synchronisation, which DDP and Megatron fuse into buckets of tens of MB, whose fixed part is negligible
    against its bytes); a fraction for one of the tensors one call moves together (a layer's weights, gathered
    or reduce-scattered as one flat buffer by FSDP, ZeRO-3 or XLA's collective combiners: each pays its share).
    """
    sent = collective_bytes(kind, nbytes, axis.size)
    if sent == 0.0:
        return 0.0
    return sent / axis.bandwidth + calls * collective_overhead(kind, axis)


def collective_overhead(kind: str, axis: MeshAxis) -> float:
    """The fixed part of one ring call on `axis`: launch plus the per-step latency (0 on one device)."""
    _check_kind(kind)
    if axis.size <= 1:
        return 0.0
    return COLLECTIVE_LAUNCH_S + _RING_FACTOR[kind] * (axis.size - 1) * axis.latency_s


def p2p_time(nbytes: float, link: Link) -> float:
    """Seconds to send `nbytes` point to point over `link`: S/bw + a (0 for nothing to send)."""
    _check_nonnegative("nbytes", nbytes)
    if nbytes == 0:
        return 0.0
    return nbytes / link.bandwidth + link.latency_s


def compute_time(flops: float, nbytes: float, device: Device, dtype: str, matmul: bool,
                 attention: bool = False) -> float:
    """Roofline seconds: max(FLOPs / (peak · eff), bytes / (HBM bw · mem eff)).

    Matmuls run at peak(dtype) × `matmul_efficiency(flops, device, dtype, attention)` (fused attention is a
    matmul with an efficiency of its own); other arithmetic at the fp32 (vector) peak, unscaled.
    """
    _check_nonnegative("flops", flops)
    _check_nonnegative("nbytes", nbytes)
    rate = (device.peak(dtype) * matmul_efficiency(flops, device, dtype, attention) if matmul
            else device.peak(VECTOR_DTYPE))
    return max(flops / rate if flops else 0.0, nbytes / (device.memory_bandwidth * device.memory_efficiency))


def matmul_efficiency(flops: float, device: Device, dtype: str = "bf16", attention: bool = False) -> float:
    """Fraction of peak(`dtype`) a GEMM of `flops` (one call on one device) reaches: eff_max · F / (F + F_half).

    Small GEMMs (tensor parallelism makes them small) fill the tensor cores less; the curve rises
    monotonically to eff_max = `device.large_kernel_efficiency(dtype, attention)` (`matmul_efficiency`, or
    `fp8_matmul_efficiency` for fp8 GEMMs, or `attention_efficiency` for fused attention), and is half of it
    at `device.matmul_half_flops`, whatever the dtype. A device without a curve (F_half = 0) runs every GEMM
    at eff_max exactly."""
    top = device.large_kernel_efficiency(dtype, attention)
    if device.matmul_half_flops == 0.0:
        return top
    return top * flops / (flops + device.matmul_half_flops)


def training_flops(forward_flops: float, matmul: bool) -> float:
    """FLOPs of forward plus backward as the model defines them: ×3 for matmuls (two backward GEMMs), ×2
    for the rest. What kernels run may differ (`sharding.executed_flops`: fused attention)."""
    return forward_flops * (1.0 + BACKWARD_FACTOR["matmul" if matmul else "other"])


@dataclass(frozen=True)
class ParamMemory:
    """Bytes a set of parameters needs for training: weights, gradients, optimizer state."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


@functools.lru_cache(maxsize=1 << 12, typed=True)
def param_memory(numel: float, dtype: str, optimizer: str = "adam", layout: str = "zero") -> ParamMemory:
    """Training state of `numel` parameters stored in `dtype` under `optimizer` (Adam: 16 bytes/param
    for fp16, bf16 and fp32; SGD with momentum 12; Adafactor 8) in the runtime's `layout` (`STATE_LAYOUTS`;
    Megatron-LM's adds fp32 gradients to a 16-bit model: 18 bytes/param with Adam in bf16, 20 in fp16). Memoised
    (typed: an int count gives int bytes): a pure function of its arguments, asked for each strategy of each
    parameter of every layer ILP."""
    if dtype not in TRAINABLE_DTYPES:
        raise InstanceError(f"parameters of dtype {dtype!r} cannot be trained",
                            hint=f"give parameters one of {list(TRAINABLE_DTYPES)}")
    if optimizer not in OPTIMIZER_STATE:
        raise InstanceError(f"unknown optimizer {optimizer!r}", "optimizer", f"use one of {list(OPTIMIZER_STATE)}")
    _check_nonnegative("numel", numel)
    check_state_layout(layout)
    width = DTYPE_BYTES[dtype]
    low_precision, fp32 = OPTIMIZER_STATE[optimizer]
    state = fp32 if width == 4 else low_precision  # fp8 weights and grads keep the fp32 master too
    grads = grad_width(dtype, layout)
    if layout == "megatron" and width < 4 and grads < 4:
        state += 4  # the fp32 main gradients the optimizer steps on, beside its master weights
    return ParamMemory(weights=numel * width, grads=numel * grads, optimizer=numel * state)


def grad_width(dtype: str, layout: str = "zero") -> int:
    """Bytes per element of a parameter's gradient as it accumulates over microbatches and is reduced across
    data-parallel ranks: the weights' own, but bf16 in Megatron-LM's layout accumulates and reduces in fp32."""
    return 4 if layout == "megatron" and dtype == "bf16" else DTYPE_BYTES[dtype]


def memory_budget(device: Device, reserve_fraction: float = DEFAULT_MEMORY_RESERVE) -> float:
    """Bytes a plan may use on `device`: its memory minus a reserve (runtime context, buffers, fragmentation)."""
    if not 0.0 <= reserve_fraction < 1.0:
        raise InstanceError(f"memory reserve {reserve_fraction} is not in [0, 1)",
                            hint="give the fraction of device memory to keep free, e.g. 0.1")
    return device.memory_bytes * (1.0 - reserve_fraction)


def inflight_microbatches(stage: int, num_stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage `stage` (0-based) of `num_stages` holds at once under 1F1B."""
    if not 0 <= stage < num_stages or microbatches < 1:
        raise ValueError(f"stage {stage} of {num_stages} with {microbatches} microbatches")
    return min(num_stages - stage, microbatches)


class CostModel(Protocol):
    """What prices a plan: an op's training compute under a sharding, a collective on a mesh axis, a
    point-to-point send. `key` names the model and its data (layer solutions are cached under it).
    The analytical model (`ANALYTICAL`, the formulas above) is the default; `partopt.profiled.Profiled`
    reads measured times. Memory is not a model's choice: bytes are bytes (`param_memory`)."""

    key: str

    def op_time(self, kind: str, shapes: tuple[tuple[int, ...], ...], dtype: str, flops: float, nbytes: float,
                device: Device, matmul: bool) -> float:
        """Seconds of one op's forward and backward on one device: `shapes` are its local input and
        output shapes, `flops` its local training FLOPs, `nbytes` the bytes it moves."""

    def collective_time(self, kind: str, nbytes: float, axis: MeshAxis, calls: float = 1.0) -> float:
        """Seconds of collective `kind` over a full buffer of `nbytes` on one mesh axis, paying `calls` times a
        call's fixed part (0: it rides in a bucket; a fraction: its share of a call it makes with others)."""

    def p2p_time(self, nbytes: float, link: Link) -> float:
        """Seconds to send `nbytes` point to point over `link`."""


@dataclass(frozen=True)
class Analytical:
    """The analytical model of this module: roofline compute, ring collectives."""

    key: str = "analytical"

    def op_time(self, kind: str, shapes: tuple[tuple[int, ...], ...], dtype: str, flops: float, nbytes: float,
                device: Device, matmul: bool) -> float:
        return compute_time(flops, nbytes, device, dtype, matmul, kind == "attention")

    def collective_time(self, kind: str, nbytes: float, axis: MeshAxis, calls: float = 1.0) -> float:
        return collective_time(kind, nbytes, axis, calls)

    def p2p_time(self, nbytes: float, link: Link) -> float:
        return p2p_time(nbytes, link)


ANALYTICAL = Analytical()
_ACTIVE: ContextVar[CostModel] = ContextVar("partopt_cost_model", default=ANALYTICAL)


def active() -> CostModel:
    """The cost model pricing now: the one `optimize`, `evaluate` or a layer ILP was given, else analytical."""
    return _ACTIVE.get()


@contextmanager
def using(model: CostModel | None) -> Iterator[CostModel]:
    """Price with `model` (None: the analytical model) inside the block."""
    token = _ACTIVE.set(model or ANALYTICAL)
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)
