"""Devices, links and clusters; presets; submesh shapes and logical meshes (DESIGN §2, §6).

Everything is in SI units (bytes, bytes/s, FLOP/s, seconds). The cluster file uses GB/s,
TFLOP/s, GiB and µs; `cluster_from_dict` / `cluster_to_dict` convert. docs/COSTMODEL.md
explains the logical-mesh placement rule and how groups share a node's NIC.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from contextlib import contextmanager
from importlib import resources
from importlib.resources.abc import Traversable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Iterator, Mapping

from partopt.errors import InfeasibleError, InstanceError
from partopt.rings import MAX_LANES, MAX_RING_MEMBERS, Lanes, ring_count

FORMAT = "partopt.cluster"
VERSION = 1
GB = 1e9  # the file's "gbps" fields are GIGABYTES per second (per direction)
TERA = 1e12
GIGA = 1e9  # FLOPs per GFLOP
GIB = 2**30
MICRO = 1e6  # µs per second
DICT_DIGITS = 12  # significant digits of floats written by cluster_to_dict (so round trips are exact)

PEAK_DTYPES: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")
# Where peak() looks when a dtype has no figure of its own; every chain ends at fp32 (required).
PEAK_FALLBACK: Mapping[str, tuple[str, ...]] = {
    "fp32": ("fp32",),
    "tf32": ("tf32", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp8": ("fp8", "fp16", "bf16", "fp32"),
    "int8": ("int8", "fp8", "fp16", "bf16", "fp32"),
    "int32": ("fp32",),
    "int64": ("fp32",),
    "bool": ("fp32",),
}
# What a device runs, in JAX's words (`jax.Device.platform`): a "gpu" runs CUDA (Megatron-LM, PyTorch on "cuda"),
# a "tpu" runs XLA; the exports read it to refuse a runtime the devices cannot run
PLATFORMS: tuple[str, ...] = ("gpu", "tpu")
SUBMESH_FAMILIES: tuple[str, ...] = ("auto", "alpa", "power_of_two")
# "auto" searches Alpa's family (every node count) up to this many nodes, powers of two beyond: the stage DP's
# table and work grow with the number of submesh shapes, and Alpa's family at 384 nodes has 387 of them
AUTO_ALPA_NODES = 16
MAX_NODES = 10**6  # the most nodes a cluster, sweep or plan file (their schemas) and `--nodes` may give


def _check(condition: bool, cause: str, hint: str) -> None:
    if not condition:
        raise InstanceError(cause, hint=hint)


def _fraction_ok(x: float) -> bool:
    return 0.0 < x <= 1.0


@dataclass(frozen=True)
class Device:
    """One accelerator: peak FLOP/s per dtype, memory, HBM bandwidth and reachable fractions."""

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)  # FLOP/s per dtype; "fp32" is required
    memory_bytes: int
    memory_bandwidth: float  # bytes/s (HBM)
    matmul_efficiency: float = 0.75  # fraction of peak a large GEMM reaches (placeholder, see COSTMODEL.md)
    memory_efficiency: float = 0.8  # fraction of HBM bandwidth streaming ops reach (placeholder)
    matmul_half_flops: float = 0.0  # GEMM size (FLOPs per call) reaching half of matmul_efficiency; 0: no curve
    fp8_matmul_efficiency: float | None = None  # fraction of the fp8 peak a large fp8 GEMM reaches; None: as 16-bit
    attention_efficiency: float | None = None  # fraction of peak a large fused-attention kernel reaches; None: as a GEMM
    platform: str = "gpu"  # one of PLATFORMS: which runtimes the device runs (a cluster file without one: a GPU)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))
        who = f"device {self.name!r}"
        for dtype, value in self.peak_flops.items():
            _check(dtype in PEAK_DTYPES, f"{who}: peak for unknown dtype {dtype!r}", f"use {list(PEAK_DTYPES)}")
            _check(value > 0, f"{who}: peak {dtype} must be > 0, got {value}", "give FLOP/s per device")
        _check("fp32" in self.peak_flops, f"{who}: no fp32 peak",
               "give the fp32 rate (it also prices non-matmul arithmetic)")
        _check(self.memory_bytes > 0, f"{who}: memory must be > 0, got {self.memory_bytes}", "give the device memory")
        _check(self.memory_bandwidth > 0, f"{who}: memory bandwidth must be > 0", "give the HBM bandwidth")
        _check(_fraction_ok(self.matmul_efficiency), f"{who}: matmul_efficiency {self.matmul_efficiency} is not in (0, 1]",
               "a fraction of peak, e.g. 0.75")
        _check(_fraction_ok(self.memory_efficiency), f"{who}: memory_efficiency {self.memory_efficiency} is not in (0, 1]",
               "a fraction of HBM bandwidth, e.g. 0.8")
        _check(self.fp8_matmul_efficiency is None or _fraction_ok(self.fp8_matmul_efficiency),
               f"{who}: fp8_matmul_efficiency {self.fp8_matmul_efficiency} is not in (0, 1]",
               "a fraction of the fp8 peak, e.g. 0.6, or omit it to use matmul_efficiency")
        _check(self.attention_efficiency is None or _fraction_ok(self.attention_efficiency),
               f"{who}: attention_efficiency {self.attention_efficiency} is not in (0, 1]",
               "a fraction of peak, e.g. 0.4, or omit it to use matmul_efficiency")
        _check(self.platform in PLATFORMS, f"{who}: unknown platform {self.platform!r}",
               f"use one of {list(PLATFORMS)}")
        _check(self.matmul_half_flops >= 0, f"{who}: matmul_half_flops {self.matmul_half_flops} is negative",
               "give the GEMM size in FLOPs at which matmuls reach half their efficiency, or 0 for none")

    def large_kernel_efficiency(self, dtype: str, attention: bool = False) -> float:
        """Fraction of peak(`dtype`) a large matmul kernel reaches: `attention_efficiency` for fused attention
        when set (its softmax and reductions between the GEMMs keep it below a GEMM), `fp8_matmul_efficiency`
        for fp8 GEMMs when set (they reach less of their doubled peak than 16-bit ones of theirs), else
        `matmul_efficiency`."""
        if attention and self.attention_efficiency is not None:
            return self.attention_efficiency
        if dtype == "fp8" and self.fp8_matmul_efficiency is not None:
            return self.fp8_matmul_efficiency
        return self.matmul_efficiency

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`, falling back along PEAK_FALLBACK (fp16 <-> bf16, int8/fp8 -> 16-bit, -> fp32)."""
        if dtype not in PEAK_FALLBACK:
            raise InstanceError(f"unknown dtype {dtype!r}", f"device {self.name!r}", f"use one of {sorted(PEAK_FALLBACK)}")
        return next(self.peak_flops[d] for d in PEAK_FALLBACK[dtype] if d in self.peak_flops)


@dataclass(frozen=True)
class Link:
    """A network link: per-direction bandwidth and per-message latency; inside a node without a switch,
    the lanes that wire each pair of devices."""

    bandwidth: float  # bytes/s per direction (with lanes: the most any one device has, all its lanes together)
    latency_s: float
    shared_by_node: bool = False  # True: one NIC shared by all devices of a node (p3.16xlarge)
    lanes: Lanes | None = None  # lanes[i][j]: point-to-point lanes between devices i and j of a node; None: a switch

    def __post_init__(self) -> None:
        _check(self.bandwidth > 0, f"link bandwidth must be > 0, got {self.bandwidth}", "give bytes/s per direction")
        _check(self.latency_s >= 0, f"link latency must be >= 0, got {self.latency_s}", "give seconds")
        if self.lanes is not None:
            lanes = tuple(tuple(row) for row in self.lanes)
            object.__setattr__(self, "lanes", lanes)
            n = len(lanes)
            hint = ("give a symmetric matrix of whole lane counts, 0 on the diagonal, one row per device of a node "
                    "(nvidia-smi topo -m's NV#), or omit lanes for a switch")
            _check(2 <= n <= MAX_RING_MEMBERS and all(len(row) == n for row in lanes),
                   f"lanes must be a square matrix of 2 to {MAX_RING_MEMBERS} rows, got {n} rows", hint)
            _check(all(isinstance(x, int) and 0 <= x <= MAX_LANES for row in lanes for x in row),
                   f"lanes must be whole counts from 0 to {MAX_LANES}", hint)
            _check(all(lanes[i][j] == lanes[j][i] for i in range(n) for j in range(n)), "lanes must be symmetric", hint)
            _check(all(lanes[i][i] == 0 for i in range(n)), "lanes must be 0 on the diagonal", hint)
            _check(any(map(any, lanes)), "lanes has no lane", hint)

    @property
    def lane_bandwidth(self) -> float:
        """Bytes/s per direction of one lane: `bandwidth` shared by the most lanes any device has."""
        return self.bandwidth / max(map(sum, self.lanes)) if self.lanes is not None else self.bandwidth

    def group_bandwidth(self, members: tuple[int, ...]) -> float:
        """Bytes/s per direction a ring collective among `members` (devices of one node) sees: `bandwidth`
        through a switch or for a lone device (it sends nothing), else one lane's times the rings its lanes carry
        at once (`rings.ring_count`)."""
        if self.lanes is None or len(members) < 2:
            return self.bandwidth
        return self.lane_bandwidth * ring_count(self.lanes, tuple(members))


@dataclass(frozen=True)
class MeshAxis:
    """One axis of a logical mesh: its size and the link one of its groups sees."""

    size: int
    bandwidth: float  # bytes/s per direction available to ONE group of this axis (after NIC sharing)
    latency_s: float
    crosses_nodes: bool


@dataclass(frozen=True)
class LogicalMesh:
    """A 2-D logical view `shape` of a physical submesh (nodes, devices per node)."""

    shape: tuple[int, int]
    axes: tuple[MeshAxis, MeshAxis]
    device: Device
    submesh: tuple[int, int]

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def outprices(self, other: LogicalMesh) -> bool:
        """Whether `other` is this mesh with its two axes swapped, each of its axes no faster than this mesh's
        axis of the same size (as many nodes crossed, no more bandwidth, no less latency; an axis of size 1 costs
        nothing, whatever its link): every sharding on `other` is a sharding on this mesh with the same memory and
        no more cost, as every collective's time falls with bandwidth and rises with latency."""
        def no_slower(mine: MeshAxis, theirs: MeshAxis) -> bool:
            if mine.size == 1 or theirs.size == 1:
                return mine.size == theirs.size
            return (mine.size == theirs.size and mine.crosses_nodes == theirs.crosses_nodes
                    and mine.bandwidth >= theirs.bandwidth and mine.latency_s <= theirs.latency_s)

        return (self.device == other.device and self.submesh == other.submesh
                and all(no_slower(a, b) for a, b in zip(self.axes, reversed(other.axes))))


@dataclass(frozen=True)
class Cluster:
    """`nodes` identical nodes of `devices_per_node` devices, an intra-node and an inter-node link."""

    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra_node: Link
    inter_node: Link

    def __post_init__(self) -> None:
        _check(isinstance(self.nodes, int) and self.nodes >= 1, f"cluster {self.name!r}: nodes must be >= 1, got {self.nodes}",
               "give a positive number of nodes")
        _check(isinstance(self.devices_per_node, int) and self.devices_per_node >= 1,
               f"cluster {self.name!r}: devices_per_node must be >= 1, got {self.devices_per_node}",
               "give a positive number of devices per node")
        lanes = self.intra_node.lanes
        if lanes is not None:
            _check(len(lanes) == self.devices_per_node,
                   f"cluster {self.name!r}: intra_node.lanes has {len(lanes)} rows for {self.devices_per_node} "
                   f"devices per node", "give one row and column per device of a node")
            ringless = _ringless_group(lanes)
            _check(ringless is None, f"cluster {self.name!r}: devices {ringless} of a node form a mesh axis but "
                   f"intra_node.lanes has no ring through them (every hop needs a lane)",
                   "add the lanes the node has, or omit lanes when a switch connects the devices")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def resized(self, nodes: int) -> Cluster:
        """The same machine type with `nodes` nodes (InstanceError when nodes < 1)."""
        return replace(self, nodes=nodes)

    def narrowed(self, devices_per_node: int) -> Cluster:
        """The same machine using the first `devices_per_node` devices of each node (a run on part of a node, the
        devices numbered as CUDA does): the lanes among those devices, each lane as fast as before."""
        _check(1 <= devices_per_node <= self.devices_per_node,
               f"cluster {self.name!r} has {self.devices_per_node} devices per node, not {devices_per_node}",
               f"use 1 to {self.devices_per_node} devices per node")
        link = self.intra_node
        if link.lanes is not None:
            lanes = tuple(row[:devices_per_node] for row in link.lanes[:devices_per_node])
            link = (replace(link, lanes=None) if devices_per_node == 1 else
                    replace(link, bandwidth=link.lane_bandwidth * max(map(sum, lanes)), lanes=lanes))
        return replace(self, devices_per_node=devices_per_node, intra_node=link)

    def submesh_family(self, family: str = "auto") -> str:
        """The family `family` names on this cluster: "auto" is Alpa's up to `AUTO_ALPA_NODES` nodes, else powers of two."""
        if family not in SUBMESH_FAMILIES:
            raise InstanceError(f"unknown submesh family {family!r}", hint=f"use one of {list(SUBMESH_FAMILIES)}")
        if family == "auto":
            return "alpa" if self.nodes <= AUTO_ALPA_NODES else "power_of_two"
        return family

    def submesh_shapes(self, family: str = "auto") -> list[tuple[int, int]]:
        """Submesh shapes (nodes, devices per node) the stage DP may use, smallest first (DESIGN §6)."""
        family = self.submesh_family(family)
        m = self.devices_per_node
        within = _node_widths(m)
        ks = range(2, self.nodes + 1) if family == "alpa" else [k for k in _powers_of_two(self.nodes) if k >= 2]
        return [(1, t) for t in within] + [(k, m) for k in ks]

    def logical_shapes(self, submesh: tuple[int, int]) -> list[tuple[int, int]]:
        """Logical meshes (D/t, t) of a submesh of D devices, for every divisor t of D ascending."""
        self._check_submesh(submesh)
        d = submesh[0] * submesh[1]
        return [(d // t, t) for t in divisors(d)]

    def logical_mesh(self, submesh: tuple[int, int], shape: tuple[int, int]) -> LogicalMesh:
        """The logical mesh `shape` on `submesh`, each axis priced by the placement rule of COSTMODEL.md."""
        self._check_submesh(submesh)
        if len(shape) != 2 or shape[0] < 1 or shape[1] < 1 or shape[0] * shape[1] != submesh[0] * submesh[1]:
            raise InfeasibleError(f"logical mesh {tuple(shape)} does not have the {submesh[0] * submesh[1]} devices "
                                  f"of submesh {tuple(submesh)}", hint="use one of Cluster.logical_shapes(submesh)")
        shape = (int(shape[0]), int(shape[1]))
        axes = (self._axis(submesh, shape, 0), self._axis(submesh, shape, 1))
        return LogicalMesh(shape=shape, axes=axes, device=self.device, submesh=(int(submesh[0]), int(submesh[1])))

    def _check_submesh(self, submesh: tuple[int, int]) -> None:
        n, m = submesh
        if not (1 <= n <= self.nodes and 1 <= m <= self.devices_per_node):
            raise InfeasibleError(f"submesh {tuple(submesh)} does not fit cluster {self.name!r} of "
                                  f"{self.nodes} x {self.devices_per_node} devices",
                                  hint="use one of Cluster.submesh_shapes()")

    def _axis(self, submesh: tuple[int, int], shape: tuple[int, int], axis: int) -> MeshAxis:
        """Price one axis: its groups' node spans decide the link; crossing groups share a node's NIC, or use
        as many NICs as they have members on a node where each device has its own (COSTMODEL §2).

        Only the groups within the first `period` device ids are built (one node for the default logical
        meshes, not a million): past it the nodes repeat the pattern, each hosting the parts of as many groups
        as its counterpart in the first period. A group of axis 1 lies within one period; one of axis 0 runs
        through every period, so it crosses nodes whenever there are two periods."""
        m = submesh[1]
        period = math.lcm(shape[1], m)
        groups = _groups((period // shape[1], shape[1]), axis)
        node_sets = [[d // m for d in g] for g in groups]
        repeated = axis == 0 and period < submesh[0] * m
        crossing = [nodes for nodes in node_sets if repeated or len(set(nodes)) > 1]
        size = shape[axis]
        if not crossing:
            return MeshAxis(size, self._in_node_bandwidth(m, groups), self.intra_node.latency_s, False)
        if self.inter_node.shared_by_node:  # the most crossing groups any node is in share its one NIC
            bandwidth = self.inter_node.bandwidth / max(Counter(node for nodes in crossing for node in set(nodes)).values())
        else:  # a NIC per device: a group runs a ring per member it has on a node, each leaving by its own NIC
            bandwidth = self.inter_node.bandwidth * min(min(Counter(nodes).values()) for nodes in crossing)
        if any(len(set(nodes)) < len(nodes) for nodes in crossing):  # the ring also hops inside a node
            bandwidth = min(bandwidth, self.intra_node.bandwidth)
        return MeshAxis(size, bandwidth, self.inter_node.latency_s, True)

    def _in_node_bandwidth(self, width: int, groups: list[list[int]]) -> float:
        """The slowest of `groups` (ids of a submesh `width` devices wide, each group on one node) wherever the
        submesh sits in a node (`_placed`, COSTMODEL §2)."""
        if self.intra_node.lanes is None:
            return self.intra_node.bandwidth
        return min(map(self.intra_node.group_bandwidth, set(_placed(groups, width, self.devices_per_node))))


def _groups(shape: tuple[int, int], axis: int) -> list[list[int]]:
    """The device ids of each group of `axis` on logical mesh `shape` (the placement rule, COSTMODEL §2)."""
    a, b = shape
    if axis == 1:  # groups of b consecutive device ids
        return [[i * b + j for j in range(b)] for i in range(a)]
    return [[i * b + j for i in range(a)] for j in range(b)]  # groups of stride b


def _placed(groups: list[list[int]], width: int, per_node: int) -> Iterator[tuple[int, ...]]:
    """Each of `groups` (ids of a submesh `width` devices wide, each group on one node) as devices of a node of
    `per_node`, at every place the submesh may sit: offsets 0, width, 2·width, …, the places that tile a node."""
    for offset in range(0, per_node - width + 1, width):
        for group in groups:
            yield tuple(offset + d % width for d in group)


def _node_widths(m: int) -> list[int]:
    """The widths of the submeshes inside one node of `m` devices: powers of two dividing m, and m."""
    within = [t for t in _powers_of_two(m) if m % t == 0]
    return within if m in within else [*within, m]


@lru_cache(maxsize=None)
def _ringless_group(lanes: Lanes) -> tuple[int, ...] | None:
    """A group of a node's devices that some in-node mesh axis forms and no ring over `lanes` passes through
    (the first found), None when every such group has one."""
    m = len(lanes)
    groups = (members for width in _node_widths(m) for t in divisors(width)
              for axis in (0, 1) for members in _placed(_groups((width // t, t), axis), width, m))
    return next((members for members in groups if len(members) > 1 and ring_count(lanes, members) == 0), None)


def divisors(n: int) -> list[int]:
    """The divisors of the positive integer `n`, ascending, found in pairs up to its square root."""
    small = [t for t in range(1, math.isqrt(n) + 1) if n % t == 0]
    return small + [n // t for t in reversed(small) if t * t != n]


def _powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, … up to `limit` inclusive."""
    return [2**i for i in range(limit.bit_length())]


# ---------------------------------------------------------------- presets (REFERENCE.md §1, COSTMODEL.md "Presets")

NVLINK_LATENCY_S = 5e-6
INFINIBAND_LATENCY_S = 10e-6
ETHERNET_LATENCY_S = 20e-6
ICI_LATENCY_S = 5e-6
# NVLink lanes between the 8 V100s of a DGX-1 / AWS p3.16xlarge node (the hybrid cube-mesh: two quads, each GPU
# with 6 lanes of 25 GB/s per direction; `nvidia-smi topo -m`'s NV1/NV2, COSTMODEL §2 "Lanes")
HYBRID_CUBE_MESH: Lanes = (
    (0, 1, 1, 2, 2, 0, 0, 0),
    (1, 0, 2, 1, 0, 2, 0, 0),
    (1, 2, 0, 2, 0, 0, 1, 0),
    (2, 1, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 1, 1, 2),
    (0, 2, 0, 0, 1, 0, 2, 1),
    (0, 0, 1, 0, 1, 2, 0, 2),
    (0, 0, 0, 1, 2, 1, 2, 0),
)

_PRESETS: dict[str, Cluster] = {
    "p3.16xlarge": Cluster(
        name="p3.16xlarge", nodes=8, devices_per_node=8,
        device=Device("V100-SXM2-16GB", {"fp16": 125 * TERA, "fp32": 15.7 * TERA}, 16 * GIB, 900 * GB),
        intra_node=Link(150 * GB, NVLINK_LATENCY_S, lanes=HYBRID_CUBE_MESH),
        inter_node=Link(3.125 * GB, ETHERNET_LATENCY_S, shared_by_node=True)),
    "dgx-a100": Cluster(
        name="dgx-a100", nodes=8, devices_per_node=8,
        device=Device("A100-SXM4-80GB", {"bf16": 312 * TERA, "fp16": 312 * TERA, "tf32": 156 * TERA,
                                         "fp32": 19.5 * TERA}, 80 * GIB, 2039 * GB),
        intra_node=Link(300 * GB, NVLINK_LATENCY_S),
        inter_node=Link(25 * GB, INFINIBAND_LATENCY_S)),
    "dgx-h100": Cluster(
        name="dgx-h100", nodes=8, devices_per_node=8,
        device=Device("H100-SXM5-80GB", {"bf16": 989 * TERA, "fp16": 989 * TERA, "fp8": 1979 * TERA,
                                         "tf32": 494.5 * TERA, "fp32": 67 * TERA}, 80 * GIB, 3350 * GB),
        intra_node=Link(450 * GB, NVLINK_LATENCY_S),
        inter_node=Link(50 * GB, INFINIBAND_LATENCY_S)),
    "tpu-v4": Cluster(
        name="tpu-v4", nodes=16, devices_per_node=4,
        device=Device("TPU-v4", {"bf16": 275 * TERA, "int8": 275 * TERA, "fp32": 45.8 * TERA}, 32 * GIB, 1200 * GB,
                      platform="tpu"),
        intra_node=Link(45 * GB, ICI_LATENCY_S),
        inter_node=Link(45 * GB, ICI_LATENCY_S)),
}
PRESETS: tuple[str, ...] = tuple(_PRESETS)


def preset_file(name: str) -> Traversable:
    """Where the package keeps preset `name`'s data file (fitted values, `partopt calibrate -o`)."""
    return resources.files("partopt").joinpath("presets", f"{name}.json")


def preset_calibration(name: str) -> dict[str, Any] | None:
    """The provenance in preset `name`'s data file (its `calibration`: points file, fitted values, each
    point's errors; docs/FORMAT.md), None when the preset has no data file."""
    path = preset_file(name)
    return json.loads(path.read_text()).get("calibration") if path.is_file() else None


def nominal_preset(name: str) -> Cluster:
    """Preset `name` as defined in code: datasheet figures and the default efficiencies."""
    if name not in _PRESETS:
        raise InstanceError(f"unknown cluster preset {name!r}", hint=f"known presets: {', '.join(PRESETS)}")
    return _PRESETS[name]


def preset(name: str, nodes: int | None = None) -> Cluster:
    """A preset cluster by name, resized to `nodes` nodes when given: its data file in the package
    (`preset_file`) when there is one, else the definition in code (`nominal_preset`)."""
    cluster = nominal_preset(name)
    path = preset_file(name)
    if path.is_file():
        from partopt import io  # io builds clusters with this module: imported here, once both are loaded
        cluster = io.read_cluster(path)
    return cluster if nodes is None else cluster.resized(nodes)


# ---------------------------------------------------------------- cluster file <-> Cluster

@contextmanager
def _at(path: str) -> Iterator[None]:
    """Re-raise an InstanceError from building one object with that object's JSON path as its place."""
    try:
        yield
    except InstanceError as err:
        raise err.located(path) from None


def cluster_from_dict(data: dict[str, Any], where: str = "") -> Cluster:
    """Build a Cluster from a schema-valid cluster dict; semantic errors name their JSON path.

    `where` is the JSON path of the cluster object ("" for a whole file, i.e. "$").
    """
    root = where or "$"
    dev = data["device"]
    with _at(f"{root}.device"):
        device = Device(
            name=dev["name"],
            peak_flops={k: v * TERA for k, v in dev["peak_tflops"].items()},
            memory_bytes=round(dev["memory_gib"] * GIB),
            memory_bandwidth=dev["memory_bandwidth_gbps"] * GB,
            matmul_efficiency=dev.get("matmul_efficiency", Device.matmul_efficiency),
            memory_efficiency=dev.get("memory_efficiency", Device.memory_efficiency),
            matmul_half_flops=dev.get("matmul_half_gflop", 0.0) * GIGA,
            fp8_matmul_efficiency=dev.get("fp8_matmul_efficiency"),
            attention_efficiency=dev.get("attention_efficiency"),
            platform=dev.get("platform", Device.platform))
    links = {}
    for key, default_latency in (("intra_node", NVLINK_LATENCY_S), ("inter_node", INFINIBAND_LATENCY_S)):
        link = data[key]
        with _at(f"{root}.{key}"):
            _check(key == "intra_node" or "lanes" not in link, "lanes wire the devices of one node",
                   "give lanes on intra_node only")
            links[key] = Link(bandwidth=link["bandwidth_gbps"] * GB,
                              latency_s=link["latency_us"] / MICRO if "latency_us" in link else default_latency,
                              shared_by_node=link.get("shared_by_node", False), lanes=link.get("lanes"))
    with _at(root):
        return Cluster(name=data["name"], nodes=data["nodes"], devices_per_node=data["devices_per_node"],
                       device=device, **links)


def file_number(x: float) -> float | int:
    """A float rounded to DICT_DIGITS significant digits, as an int when whole (clean, exact JSON)."""
    value = float(f"{x:.{DICT_DIGITS}g}")
    return int(value) if value.is_integer() else value


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The cluster-file dict of `cluster` (all optional fields written); inverse of cluster_from_dict."""
    dev = cluster.device

    def link(l: Link) -> dict[str, Any]:
        return {"bandwidth_gbps": file_number(l.bandwidth / GB), "latency_us": file_number(l.latency_s * MICRO),
                "shared_by_node": l.shared_by_node, **({"lanes": [list(row) for row in l.lanes]} if l.lanes else {})}

    return {
        "format": FORMAT, "version": VERSION, "name": cluster.name,
        "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node,
        "device": {
            "name": dev.name,
            "peak_tflops": {k: file_number(v / TERA) for k, v in dev.peak_flops.items()},
            "memory_gib": file_number(dev.memory_bytes / GIB),
            "memory_bandwidth_gbps": file_number(dev.memory_bandwidth / GB),
            "matmul_efficiency": dev.matmul_efficiency,
            "memory_efficiency": dev.memory_efficiency,
            # written only when set, so that files of devices without a curve stay as they were
            **({"matmul_half_gflop": file_number(dev.matmul_half_flops / GIGA)} if dev.matmul_half_flops else {}),
            **({"fp8_matmul_efficiency": dev.fp8_matmul_efficiency} if dev.fp8_matmul_efficiency is not None else {}),
            **({"attention_efficiency": dev.attention_efficiency} if dev.attention_efficiency is not None else {}),
            **({"platform": dev.platform} if dev.platform != Device.platform else {}),
        },
        "intra_node": link(cluster.intra_node),
        "inter_node": link(cluster.inter_node),
    }
