"""A cost model from measurements: op times and collective bandwidths read from a table
(`partopt.profile` files, docs/FORMAT.md), the analytical model wherever the table has no entry.

The way Alpa profiled: a user with hardware measures the ops of their model at the local shapes
the planner asks about and the collectives of their cluster, and plans with those numbers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Mapping

from partopt import costmodel
from partopt.cluster import Device, Link, MeshAxis
from partopt.errors import InstanceError
from partopt.io import FilePath, at, load_json, validate_against_schema
from partopt.ops import KINDS, UNPRICED_KINDS, input_count, takes

PROFILE_FORMAT = "partopt.profile"
OpKey = tuple[str, tuple[tuple[int, ...], ...], str]  # kind, local shapes (inputs then output), dtype
CollectiveKey = tuple[str, int, bool]  # kind, group size, crosses nodes


@dataclass(frozen=True)
class Profiled:
    """Measured op seconds (forward + backward at a local shape) and collective bus bandwidths;
    `fallback` prices the rest. Hashable and picklable, so it travels to ILP worker processes."""

    ops: Mapping[OpKey, float] = field(default_factory=dict, hash=False)
    collectives: Mapping[CollectiveKey, tuple[float, float]] = field(default_factory=dict, hash=False)  # busbw, latency
    fallback: costmodel.CostModel = costmodel.ANALYTICAL
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:  # layer solutions are cached under the table's content
            text = json.dumps([sorted(map(repr, self.ops.items())), sorted(map(repr, self.collectives.items())),
                               self.fallback.key])
            object.__setattr__(self, "key", "profiled:" + hashlib.sha256(text.encode()).hexdigest()[:16])

    def op_time(self, kind: str, shapes: tuple[tuple[int, ...], ...], dtype: str, flops: float, nbytes: float,
                device: Device, matmul: bool) -> float:
        measured = self.ops.get((kind, shapes, dtype))
        if measured is not None:
            return measured
        return self.fallback.op_time(kind, shapes, dtype, flops, nbytes, device, matmul)

    def collective_time(self, kind: str, nbytes: float, axis: MeshAxis, calls: float = 1.0) -> float:
        """Ring bytes per device / measured bus bandwidth, plus `calls` times the measured latency (0: bucketed)."""
        measured = self.collectives.get((kind, axis.size, axis.crosses_nodes))
        if measured is None:
            return self.fallback.collective_time(kind, nbytes, axis, calls)
        bus_bandwidth, latency_s = measured
        sent = costmodel.collective_bytes(kind, nbytes, axis.size)
        if sent == 0.0:
            return 0.0
        return sent / bus_bandwidth + calls * latency_s

    def p2p_time(self, nbytes: float, link: Link) -> float:
        return self.fallback.p2p_time(nbytes, link)


def read_profile(path: FilePath) -> Profiled:
    """A `partopt.profile` file as a `Profiled` model; a malformed file is an InstanceError with its JSON path."""
    data = load_json(path)
    validate_against_schema(data, "profile", str(path))
    ops: dict[OpKey, float] = {}
    for i, o in enumerate(data.get("ops", [])):
        _check_lookup(o, at(str(path), f"$.ops[{i}]"))
        key = (o["kind"], tuple(tuple(s) for s in o["shapes"]), o["dtype"])
        _once(ops, key, float(o["time_s"]), at(str(path), f"$.ops[{i}]"))
    collectives: dict[CollectiveKey, tuple[float, float]] = {}
    for i, c in enumerate(data.get("collectives", [])):
        key = (c["kind"], c["group"], c["crosses_nodes"])
        _once(collectives, key, (float(c["bus_bandwidth"]), float(c.get("latency_s", 0.0))),
              at(str(path), f"$.collectives[{i}]"))
    return Profiled(ops, collectives)


def _check_lookup(entry: dict, where: str) -> None:
    """An op entry some op of some graph would look up: a known kind that is priced, as many shapes as such an op
    has tensors (its inputs, then its output). Another entry would never be read, whatever the graph."""
    kind, shapes = entry["kind"], len(entry["shapes"])
    if kind not in KINDS:
        raise InstanceError(f"unknown op kind {kind!r}", f"{where}.kind",
                            f"use one of the graph format's op kinds: {', '.join(KINDS)}")
    if kind in UNPRICED_KINDS:
        raise InstanceError(f"kind {kind!r} is never looked up: its compute is 0 s (a view)", f"{where}.kind",
                            "remove the entry: no op of that kind is priced from a profile")
    if not takes(kind, shapes - 1):
        raise InstanceError(f"{shapes} shape{'s' * (shapes != 1)}, but an op of kind {kind!r} has {input_count(kind)} "
                            "and an output: no op would look the entry up", f"{where}.shapes",
                            "list the local shape of each of the op's inputs, in their order, then of its output")


def _once(table: dict, key: tuple, value, where: str) -> None:
    """Enter one measurement; a second one of the same key is refused rather than one silently winning."""
    if key in table:
        raise InstanceError(f"a second measurement of {key}", where, "keep one entry per key (e.g. their median)")
    table[key] = value
