"""The stage accountant: a stage's time, memory, sends and sync from its layers' costs.

One set of sums serves the stage DP's table (`stage_table`), plan assembly and `evaluate`, so a
plan priced again adds up to the same number. A stage runs DP layers [first, last] on one mesh;
its latency is the sum of its base layers' times plus the send of its boundary activations; its
memory is the parameter state plus in-flight × kept activations plus the largest working set;
parameters read by several base layers are held once (`partopt.shared`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from partopt import costmodel, intra, schedules, sharding, stagedp
from partopt.cluster import Cluster, Link, MeshAxis
from partopt.graph import Graph, Op
from partopt.layering import Layering
from partopt.ops import is_matmul, is_weight_matmul
from partopt.pricing import REDUCTIONS, LayerCost
from partopt.shared import Correction, correction


@dataclass(frozen=True)
class StageSpec:
    """A stage as the plan fixes it: DP layers [first, last], submesh, logical shape, in-flight
    microbatches, recomputation mode."""

    first: int
    last: int
    submesh: tuple[int, int]
    shape: tuple[int, int]
    inflight: float  # of the stage's devices (interleaved: chunk-microbatches / v, `schedules.inflight`)
    recompute: str = "none"


@dataclass(frozen=True)
class End:
    """One end of a pipeline send: the stage's submesh, its logical shape (data-parallel ×
    tensor-parallel) and the nodes its devices sit on (None in the stage DP: not placed yet)."""

    submesh: tuple[int, int]
    shape: tuple[int, int]
    nodes: frozenset[int] | None = None


@dataclass(frozen=True)
class Pipeline:
    """What every stage of one plan shares: DP layers, boundary bytes, microbatch and batch size,
    the shared parameters and the cluster (its links and devices per node)."""

    layering: Layering
    boundary: list[float]  # bytes leaving each DP layer at the full batch
    mb: int
    batch: int
    shared: dict[str, tuple[int, ...]]
    cluster: Cluster
    overlap: bool = False  # reductions hide under the last backward, weight gathers the next forward (`exposed_*`)
    graph: Graph | None = None  # the model at full batch: FLOP shares of forward and weight passes (`split_table`)
    # send_s by (first, last, end, receiver, cost model): the DP's tables ask for the same stages' sends many times
    _sends: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # a row of layer costs' columns and stage sums by (table, id(row), …), see `_row_spans`, `_stage_sums`,
    # `_entries` and `_chunk_sums`; an end's sends (`_end_sends`, `_end_p2p`); a mesh's tensor-parallel axis
    # (`_tensor_axis`); the FLOP shares of a recomputation mode (`_flop_shares`); where the shared parameters'
    # readers change (`_reader_changes`) and which base layers read them (`_holds_shared`)
    _sums: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def link(self) -> Link:
        """The link between stages for shared-parameter corrections: intra-node on one node, else inter-node."""
        return self.cluster.intra_node if self.cluster.nodes == 1 else self.cluster.inter_node

    @property
    def per_node(self) -> int:
        return self.cluster.devices_per_node

    def send_s(self, first: int, last: int, end: End, receiver: End | None = None) -> float:
        """Seconds per microbatch of a stage's pipeline sends (docs/COSTMODEL.md §5b "Pipeline sends"):
        what it sends out and gathers back (`out_s`) plus what it gathers in (`in_s`)."""
        model = costmodel.active()
        key = (first, last, end, receiver, id(model))  # the entry holds the model: its id is not reused meanwhile
        if key not in self._sends:
            self._sends[key] = (model, self.out_s(last, end, receiver) + self.in_s(first, end))
        return self._sends[key][1]

    def out_s(self, last: int, end: End, receiver: End | None = None) -> float:
        """The boundary activations of DP layer `last` out and their gradients back (`p2p_s`), plus this
        end's all-gather of the gradient slices."""
        if last >= len(self.boundary) - 1:
            return 0.0
        return self.p2p_s(last, end, receiver) + self._gather_s(self._microbatch_bytes(last), end)

    def p2p_s(self, last: int, end: End, receiver: End | None = None) -> float:
        """The point-to-point part of `out_s`: the activations out and their gradients back, each split over
        min(paths of the two ends) parallel paths. `receiver` is the next stage placed; None (the stage DP)
        prices it as wide as this end and, on several nodes, across nodes (`Pipeline.link`)."""
        if last >= len(self.boundary) - 1:
            return 0.0
        nbytes = self._microbatch_bytes(last)
        if receiver is None:
            crosses = self.cluster.nodes > 1
            paths = self._paths(end, crosses)
        else:  # two stages share a node only when both sit on that one node
            crosses = not (end.nodes == receiver.nodes and len(end.nodes) == 1)
            paths = min(self._paths(end, crosses), self._paths(receiver, crosses))
        link = self.cluster.inter_node if crosses else self.cluster.intra_node
        return 2 * costmodel.active().p2p_time(nbytes / paths, link)

    def in_s(self, first: int, end: End) -> float:
        """This end's all-gather of the activation slices that arrive from the stage before (0 on the first)."""
        return self._gather_s(self._microbatch_bytes(first - 1), end) if first > 0 else 0.0

    def _microbatch_bytes(self, layer: int) -> float:
        """Bytes leaving DP layer `layer` for one microbatch."""
        return self.boundary[layer] * self.mb / self.batch

    def _paths(self, end: End, crosses: bool) -> int:
        """Parallel paths an end offers: one per device (each sends or receives its own slice),
        across nodes capped at one per node when the node's devices share a NIC (p3.16xlarge)."""
        devices = end.shape[0] * end.shape[1]
        if crosses and self.cluster.inter_node.shared_by_node:
            return min(devices, end.submesh[0])
        return devices

    def _gather_s(self, nbytes: float, end: End) -> float:
        """All-gather by an end's t tensor-parallel ranks of the 1/t slices of their data-parallel
        share (nbytes / d) that each received (Megatron's scatter/gather; 0 when t = 1)."""
        d, t = end.shape
        if t == 1 or nbytes == 0:
            return 0.0
        return costmodel.active().collective_time("all_gather", nbytes / d, self._tensor_axis(end))

    def _tensor_axis(self, end: End) -> MeshAxis:
        """The tensor-parallel axis of an end's logical mesh, kept per mesh: the DP's tables price many stages on it."""
        key = ("axis", end.submesh, end.shape)  # a value, as the sends' keys
        if key not in self._sums:
            self._sums[key] = self.cluster.logical_mesh(end.submesh, end.shape).axes[1]
        return self._sums[key]


@dataclass(frozen=True)
class StageTotals:
    """A stage's sums: per-microbatch compute and communication, its send, per-iteration sync,
    parameter state, kept activations per in-flight microbatch, the largest working set, the
    shared-parameter correction already folded in (None when the stage holds none), and, when its
    sends overlap compute (`hidden_send`), their point-to-point part and what of it compute hides."""

    time_s: float
    send_s: float
    sync_s: float
    param_bytes: float
    activation_bytes: float
    working_bytes: float
    fix: Correction | None
    p2p_s: float = 0.0  # the point-to-point part of send_s, where it overlaps compute (else 0)
    hidden_s: float = 0.0  # the part of p2p_s hidden under compute

    @property
    def latency_s(self) -> float:
        return self.time_s + self.send_s - self.hidden_s

    def memory_bytes(self, inflight: float) -> float:
        return self.param_bytes + inflight * self.activation_bytes + self.working_bytes


def combined(parts: Sequence[StageTotals]) -> StageTotals:
    """The sums of one device group running several model chunks (interleaved): times, sends, sync, parameter
    state and kept activations add, the working set is the largest (chunks run one at a time). The sync is the
    sum of the chunks' exposed parts, an over-estimate under overlap (a chunk's reduction may hide behind
    another chunk's backward); the shared-parameter corrections stay per chunk (`fix` is None)."""
    return StageTotals(sum(p.time_s for p in parts), sum(p.send_s for p in parts), sum(p.sync_s for p in parts),
                       sum(p.param_bytes for p in parts), sum(p.activation_bytes for p in parts),
                       max(p.working_bytes for p in parts), None, sum(p.p2p_s for p in parts),
                       sum(p.hidden_s for p in parts))


def hidden_send(p2p_s: float | np.ndarray, forward_s: float | np.ndarray,
                backward_s: float | np.ndarray) -> float | np.ndarray:
    """Seconds of a chunk's round trip `p2p_s` (activations out, their gradient back) that compute hides when
    sends run on their own stream (Megatron's overlapped p2p of the interleaved schedule, docs/COSTMODEL.md
    §5b): in 1F1B's steady state the activations travel while the device runs its next task, a backward
    (`backward_s`, as long as this chunk's), and the gradient while it runs a forward (`forward_s`). Floats or
    arrays of chunks alike."""
    one_way = p2p_s / 2
    return p2p_s - np.maximum(0.0, one_way - backward_s) - np.maximum(0.0, one_way - forward_s)


def training_flops(graph: Graph, ops: Sequence[Op] | None = None) -> float:
    """Forward + backward FLOPs of `ops` (default: the whole graph)."""
    return sum(costmodel.training_flops(graph.flops(op), is_matmul(op)) for op in (graph.ops if ops is None else ops))


def executed_flops(graph: Graph, ops: Sequence[Op] | None = None) -> float:
    """Forward + backward FLOPs the kernels of `ops` (default: the whole graph) run, recomputation aside:
    `training_flops` but for fused attention (`sharding.executed_flops`)."""
    return sum(sharding.executed_flops(graph, op) for op in (graph.ops if ops is None else ops))


def recomputed_flops(graph: Graph, units: Sequence[Sequence[Op]], mode: str) -> float:
    """Forward FLOPs that recomputation `mode` runs again in these base layers (priced one by one)."""
    total = 0.0
    for ops in units:
        rerun = intra.recomputed_ops(graph, ops, mode)
        total += sum(sharding.forward_executed(graph, op) for op in ops if op.name in rerun)
    return total


def weight_flops(graph: Graph, ops: Sequence[Op]) -> float:
    """Weight-gradient FLOPs of `ops`: a matmul reading a parameter computes dW, a GEMM of its forward's FLOPs
    (the other ops' parameter gradients are left in the input-gradient pass)."""
    return sum(graph.flops(op) for op in ops if is_weight_matmul(graph, op))


def split(latency: np.ndarray | float, forward: np.ndarray | float, weight: np.ndarray | float):
    """(forward_s, weight_s) of a stage of latency t whose forward and weight passes are these FLOP shares of
    what it executes: t · forward, and t · weight capped at the rest t - t · forward (plan assembly's split)."""
    forward_s = latency * forward
    return forward_s, np.minimum(latency * weight, latency - forward_s)


def split_table(pipe: Pipeline, t: stagedp.Entries, options: list[list[tuple]]) -> np.ndarray:
    """omega[h, i, j, s] = min(w, f, t - f - w) of every entry of `stage_table`'s table (its latency t split as
    plan assembly does, `split`): what ZB-H1 hides per drain slot (`schedules.iteration_time`); 0 where the entry
    cannot run."""
    omega = np.zeros(t.latency.shape)
    for s, choices in enumerate(options):
        for h, (_, mode, _) in enumerate(choices):
            latency = t.latency[h, :, :, s]
            runs = np.isfinite(latency)
            forward, weight = split(np.where(runs, latency, 0.0), *_flop_shares(pipe, mode))
            hidden = np.minimum(np.minimum(weight, forward), np.where(runs, latency, 0.0) - forward - weight)
            omega[h, :, :, s] = np.where(runs, hidden, 0.0)
    return omega


def _flop_shares(pipe: Pipeline, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """[i, j]: the forward and the weight-gradient FLOPs of the stage of DP layers i..j as shares of what it
    executes under recomputation `mode` (`split`'s shares), kept per mode in `pipe`: every ZB-H1 table asks again."""
    key = ("shares", mode)
    if key not in pipe._sums:
        graph, layering = pipe.graph, pipe.layering
        columns = np.array([(sum(sharding.forward_executed(graph, op) for op in layering.ops(g)),
                             executed_flops(graph, layering.ops(g))
                             + recomputed_flops(graph, layering.base[a:b + 1], mode),
                             weight_flops(graph, layering.ops(g))) for g, (a, b) in enumerate(layering.groups)])
        sums = np.cumsum(columns, axis=0)
        before = np.vstack([np.zeros(3), sums[:-1]])
        ranged = np.triu(np.moveaxis(sums[None, :, :] - before[:, None, :], 2, 0))  # [column, i, j ≥ i]
        executed = np.maximum(ranged[1], 1e-300)
        pipe._sums[key] = (ranged[0] / executed, ranged[2] / executed)
    return pipe._sums[key]


def boundary_bytes(graph: Graph, layering: Layering) -> list[float]:
    """Bytes leaving each DP layer for later layers (activations at the graph's batch size)."""
    position = {}
    for g in range(len(layering.groups)):
        for op in layering.ops(g):
            position[op.name] = g
    sent = [0.0] * len(layering.groups)
    for op in graph.ops:
        later = [position[c.name] for c in graph.consumers[op.output] if position[c.name] > position[op.name]]
        if later:
            for g in range(position[op.name], max(later)):
                sent[g] += graph.nbytes(op.output)
    return sent


def _columns(row: Sequence[LayerCost | None], layering: Layering) -> np.ndarray:
    """Per DP layer: time, sync, parameter and kept activation bytes, working bytes (the max: layers
    recompute one at a time), sync other than gradient reductions and weight gathers, gradient reductions,
    backward time, forward compute, weight gathers (the rest are sums over its base layers); NaN where a base
    layer cannot run."""
    out = np.full((len(layering.groups), 10), np.nan)
    for j, (a, b) in enumerate(layering.groups):
        parts = row[a:b + 1]
        if any(c is None for c in parts):
            continue
        out[j] = (sum(c.time_s for c in parts), sum(c.sync_s for c in parts), sum(c.param_bytes for c in parts),
                  sum(c.activation_bytes for c in parts), max(c.working_bytes for c in parts),
                  sum(c.sync_s - c.reduce_s - c.gather_s for c in parts), sum(c.reduce_s for c in parts),
                  sum(c.backward_s for c in parts), sum(c.forward_s for c in parts), sum(c.gather_s for c in parts))
    return out


SUMMED = [0, 1, 2, 3, 5, 6, 7, 8, 9]


def _spans(columns: np.ndarray, overlap: bool) -> np.ndarray:
    """Totals of every stage [i, j] of a row's `_columns`, as [i, j, column] (j ≥ i; the rest unused), each summed
    from layer i rightwards as a loop would: row i adds its layers to zeros (0 + x is x), so any caller gets the
    same floats for the same stage; stages past a layer that cannot run are NaN. Column 1 is the stage's sync:
    with `overlap`, the other sync plus the exposed parts of its gradient reductions and its weight gathers."""
    L = len(columns)
    upper = np.triu(np.ones((L, L), dtype=bool))[:, :, None]  # [i, j]: j ≥ i
    parts = np.where(upper, columns[None, :, :], 0.0)
    totals = np.empty((L, L, columns.shape[1]))
    totals[..., SUMMED] = np.add.accumulate(parts[..., SUMMED], axis=1)
    totals[..., 4] = np.maximum.accumulate(np.where(upper[..., 0], parts[..., 4], -np.inf), axis=1)
    if overlap:  # the zeros before layer i add nothing, and the reductions are not negative: no max is lost to them
        totals[..., 1] = (totals[..., 5] + exposed_reduction(parts[..., 6], parts[..., 7])
                          + exposed_gather(parts[..., 9], parts[..., 8]))
    return totals


def exposed_reduction(reduce_s: np.ndarray, backward_s: np.ndarray) -> np.ndarray:
    """Seconds of gradient reduction left after the last backward, for the stages [0, j] of these
    layers (the last axis), every j: max over l ≤ j of (Σ_{m ≤ l} reduce_m − Σ_{m < l} backward_m).

    The last microbatch's backward runs layer j down to 0; layer l's gradients are reduced (one
    bucket, one communication stream) once its backward is done and the buckets before it are
    sent — as DDP's and Megatron's overlapped gradient reduction do. The chain that starts at
    layer l ends Σ_{m ≤ l} reduce_m after l's backward, which is Σ_{m < l} backward_m before the
    backward of layer 0 ends; the latest chain is what remains exposed (at least layer 0's own).
    """
    done = np.add.accumulate(backward_s, axis=-1)
    before = np.concatenate((np.zeros_like(done[..., :1]), done[..., :-1]), axis=-1)
    return np.maximum.accumulate(np.add.accumulate(reduce_s, axis=-1) - before, axis=-1)


def exposed_gather(gather_s: np.ndarray, forward_s: np.ndarray) -> np.ndarray:
    """Seconds the next iteration's first forward waits for the updated weights' all-gathers, for the stages
    [0, j] of these layers (the last axis), every j: g_0 + Σ_{1 ≤ k ≤ j} max(0, g_k − f_{k−1}).

    Megatron-LM's `--overlap-param-gather` (its distributed optimizer) starts layer 0's gather before the
    forward and layer k's when the forward reaches layer k − 1 (one bucket ahead, so that no gather queues in
    front of the compute kernels): layer k's gather hides under layer k − 1's forward, and waits for the rest.
    Zeros before a stage's first layer make its own gather the first term.
    """
    before = np.concatenate((np.zeros_like(forward_s[..., :1]), forward_s[..., :-1]), axis=-1)
    return np.add.accumulate(np.maximum(0.0, gather_s - before), axis=-1)


def totals(row: Sequence[LayerCost | None], pipe: Pipeline, first: int, last: int, end: End,
           receiver: End | None = None, chunk: bool = False) -> StageTotals:
    """The sums of a stage of DP layers [first, last] on mesh `end` with its layers' costs `row`;
    its sends priced to `receiver`, the next stage placed (None: the stage DP's bound, `Pipeline.send_s`).
    `chunk`: a model chunk of the interleaved schedule, whose point-to-point sends hide under compute when
    `pipe.overlap` (`hidden_send`)."""
    devices = end.shape[0] * end.shape[1]
    running = _row_spans(pipe, row)[first, last]
    time_s, sync_s, params, acts, working = running[:5]
    fix = _correction(pipe, row, pipe.layering.groups[first][0], pipe.layering.groups[last][1],
                      min(devices, pipe.per_node))
    if fix is not None:
        params, sync_s = params + fix.param_bytes, sync_s + _fix_sync(fix, pipe.overlap)
    p2p_s = hidden_s = 0.0
    if chunk and pipe.overlap:
        p2p_s = pipe.p2p_s(last, end, receiver)
        hidden_s = float(hidden_send(p2p_s, float(running[8]), float(running[7])))
    return StageTotals(float(time_s), pipe.send_s(first, last, end, receiver), float(sync_s), float(params), float(acts),
                       float(working), fix, p2p_s, hidden_s)


def stage_table(pipe: Pipeline, costs: dict, submeshes: list[tuple[int, int]], count: int,
                budget: float) -> tuple[stagedp.Entries, list[list[tuple]]]:
    """The stage DP's table (`stagedp.Entries`, for `stagedp.solve` and `zero_bubble`): per option h, DP layers
    [i, j] as one stage on submesh s, its latency, per-iteration sync and the most in-flight levels k its memory
    fits (1F1B holds min(k, count) microbatches; 0: it cannot run). Option h of submesh s is a logical shape and
    recomputation mode with one row of layer costs (`costs[(submesh, shape, mode)]`: a list of rows, see
    `pricing.tighten`). Returns the table and, per submesh, its (shape, mode, row index) options in order.
    """
    L, S = len(pipe.layering.groups), len(submeshes)
    options = _options(costs, submeshes)
    H = max(len(x) for x in options)
    latency = np.full((H, L, L, S), np.inf)
    sync = np.zeros((H, L, L, S))
    depth = np.zeros((H, L, L, S), dtype=np.int64)
    for s, sub in enumerate(submeshes):
        for h, (shape, mode, r) in enumerate(options[s]):
            latency[h, :, :, s], sync[h, :, :, s], depth[h, :, :, s] = _entries(pipe, costs[(sub, shape, mode)][r],
                                                                               sub, shape, budget, count)
    return stagedp.Entries(latency, sync, depth), options


def _entries(pipe: Pipeline, row: Sequence[LayerCost | None], sub: tuple[int, int], shape: tuple[int, int],
             budget: float, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One option's latency, sync and depth [i, j] in `stage_table`, kept per row in `pipe` with its budget and count
    (a count's searches ask for the same rows' table at every step of its ladder)."""
    key = ("entries", id(row), sub, shape, budget, count)
    if key not in pipe._sums:
        stage_s, sync_s, params, acts, working = _stage_sums(pipe, row, sub, shape)
        deepest = _depth(params, acts, working, budget, count, len(pipe.layering.groups))
        pipe._sums[key] = (row, (np.where(deepest >= 1, stage_s, np.inf), np.where(deepest >= 1, sync_s, 0.0), deepest))
    return pipe._sums[key][1]


def _depth(params: np.ndarray, acts: np.ndarray, working: np.ndarray, budget: float, count: int,
           levels: int) -> np.ndarray:
    """The most levels k ≤ `levels` whose params + min(k, count) · acts + working fits `budget` (0: none, or NaN)."""
    def fits(k: np.ndarray | int) -> np.ndarray:
        return params + np.minimum(k, count) * acts + working <= budget  # false where NaN

    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.where(acts > 0, np.floor((budget - params - working) / acts),
                         np.where(params + working <= budget, levels, 0))
    k = np.clip(np.nan_to_num(guess, nan=0.0, posinf=levels, neginf=0.0), 0, levels).astype(np.int64)
    k = np.where((k < levels) & fits(k + 1), k + 1, k)  # the division may round either way: one step each
    k = np.where((k >= 1) & ~fits(np.maximum(k, 1)), k - 1, k)
    return np.where(fits(count), levels, k)  # holding `count` fits: so does every level


def _stage_sums(pipe: Pipeline, row: Sequence[LayerCost | None], sub: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """[latency, sync, parameter bytes, kept activation bytes, working bytes] of every stage [i, j] of one option's
    `row` on mesh (sub, shape), as [5, i, j] (NaN where j < i or the stage cannot run). Kept per row in `pipe`:
    the DP asks for the same options' stages at every budget and memory rung."""
    key = ("stage", id(row), sub, shape)
    if key in pipe._sums:
        return pipe._sums[key][1]
    L = len(pipe.layering.groups)
    devices = min(sub[0] * sub[1], pipe.per_node)
    spans = _row_spans(pipe, row)
    outs, ins = _end_sends(pipe, End(sub, shape))
    out = np.moveaxis(spans[..., :5], 2, 0).copy()  # NaN where a stage cannot run
    out[0] += outs[None, :] + np.asarray(ins)[:, None]  # the floats `send_s` adds
    out[:, ~np.triu(np.ones((L, L), dtype=bool))] = np.nan
    for i in range(L) if pipe.shared else ():
        n = int(np.argmax(np.isnan(out[0, i, i:]))) if np.isnan(out[0, i, i:]).any() else L - i  # runnable ends
        for lo, hi, fix in _corrections(row, pipe, i, n, devices) if n else ():
            out[2, i, i + lo:i + hi] += fix.param_bytes
            out[1, i, i + lo:i + hi] += _fix_sync(fix, pipe.overlap)
    pipe._sums[key] = (row, out)  # the entry holds the row: its id is not reused meanwhile
    return out


def _end_sends(pipe: Pipeline, end: End) -> tuple[np.ndarray, list[float]]:
    """Per DP layer, an end's `out_s` (its last layer's) and `in_s` (its first's): a stage's sends depend on its
    mesh, not on its option's mode or row, so they are kept per end in `pipe`."""
    key = ("sends", end)  # a value, not an id like the rows' keys: the entry need not hold it
    if key not in pipe._sums:
        L = len(pipe.layering.groups)
        pipe._sums[key] = (np.array([pipe.out_s(j, end) for j in range(L)]), [pipe.in_s(i, end) for i in range(L)])
    return pipe._sums[key]


def _end_p2p(pipe: Pipeline, end: End) -> np.ndarray:
    """Per DP layer, an end's `p2p_s` (the round trip after that layer), kept per end in `pipe` as `_end_sends`: every
    interleaved chunking of every row on the end reads it."""
    key = ("p2p", end)
    if key not in pipe._sums:
        pipe._sums[key] = np.array([pipe.p2p_s(j, end) for j in range(len(pipe.layering.groups))])
    return pipe._sums[key]


def fits(pipe: Pipeline, costs: dict, submeshes: list[tuple[int, int]], options: list[list[tuple]], stages: Sequence,
         count: int, budget: float, schedule: str = "1f1b", v: int = 1) -> bool:
    """Whether the stages of a stage DP's plan (`stagedp.StageChoice`s over `options`, as `stage_table` or, for the
    interleaved schedule, `interleaved_table` gave them) fit `budget`, by the memory those tables check: a plan
    found with memory ignored that fits is the best plan within the budget as well."""
    for i, c in enumerate(stages):
        sub = submeshes[c.submesh]
        shape, mode, r = options[c.submesh][c.option]
        row = costs[(sub, shape, mode)][r]
        if schedule == "interleaved":
            held = schedules.inflight(i, len(stages), count, "interleaved", v)
            if not _chunk_sums(pipe, row, sub, shape, len(stages), v).memory_bytes(held)[i] <= budget:
                return False
        else:
            _, _, params, acts, working = _stage_sums(pipe, row, sub, shape)[:, c.first, c.last]
            if not params + min(c.inflight, count) * acts + working <= budget:
                return False
    return True


def _options(costs: dict, submeshes: list[tuple[int, int]]) -> list[list[tuple]]:
    """Per submesh, its (logical shape, recomputation mode, row index) options in order."""
    return [[(shape, mode, r) for (x, shape, mode) in costs if x == sub for r in range(len(costs[(x, shape, mode)]))]
            for sub in submeshes]


def chunks(layers: int, num_stages: int, v: int) -> list[tuple[int, int]]:
    """Megatron's uniform chunking: the S·v virtual stages' DP layer ranges in model order (chunk j on stage j mod S)."""
    n = layers // (num_stages * v)
    return [(j * n, j * n + n - 1) for j in range(num_stages * v)]


def interleaved_table(pipe: Pipeline, costs: dict, submeshes: list[tuple[int, int]], count: int, budget: float,
                      num_stages: int, v: int):
    """t[h, 1, i, i, s] and extra[h, 1, i, i, s] for the stage DP over Megatron's uniform chunking into S·v
    chunks (`chunks`): stage i, holding chunks i, i + S, …, on submesh s in option h, one shape and mode for
    all its chunks; its latency is the sum of its chunks' (`combined`), inf when its memory does not fit its
    interleaved in-flight count. Only diagonal entries exist, so the DP's plans have exactly S stages, and
    `stagedp.solve(t / v, extra, sizes, devices, v·B, rebate=-fill)` minimises
    sum t / v + sum fill + (B − 1/v) max t + max sync, the interleaved closed form (`schedules.iteration_time`;
    `fill`, the stage's point-to-point round trips when sends overlap compute, depends on its submesh and
    layers only, so the DP stays exact). Returns the tables t, extra, fill and the options per submesh."""
    options = _options(costs, submeshes)
    shape = (max(len(x) for x in options), 2, num_stages, num_stages, len(submeshes))
    t, extra, fill = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    held = np.array([schedules.inflight(i, num_stages, count, "interleaved", v) for i in range(num_stages)])
    for s, sub in enumerate(submeshes):
        for h, (mesh, mode, r) in enumerate(options[s]):
            sums = _chunk_sums(pipe, costs[(sub, mesh, mode)][r], sub, mesh, num_stages, v)
            i = np.flatnonzero(sums.memory_bytes(held) <= budget)  # not where a chunk cannot run (NaN)
            t[h, 1, i, i, s], extra[h, 1, i, i, s], fill[h, 1, i, i, s] = (sums.latency_s[i], sums.sync_s[i],
                                                                           sums.p2p_s[i])
    return t, extra, fill, options


def _chunk_sums(pipe: Pipeline, row: Sequence[LayerCost | None], sub: tuple[int, int], mesh: tuple[int, int],
                num_stages: int, v: int) -> StageTotals:
    """The `combined` sums of each interleaved stage's chunks (`chunks`) for one option's `row` on mesh (sub, mesh):
    every field an array over the S stages (NaN where a chunk cannot run; `fix` None), the same floats as `combined`
    of the chunks' `totals` (summed in chunk order from zero); kept per row in `pipe`, as `_stage_sums`."""
    key = ("interleaved", id(row), sub, mesh, num_stages, v)
    if key in pipe._sums:
        return pipe._sums[key][1]
    groups = np.array(pipe.layering.groups)
    firsts, lasts = np.array(chunks(len(groups), num_stages, v)).T
    running = _row_spans(pipe, row)[firsts, lasts]  # [chunk, column]
    time_s, sync_s, params, acts, working = (running[:, c].copy() for c in range(5))
    end = End(sub, mesh)
    runs = ~np.isnan(running[:, 0])  # a chunk with a layer that cannot run has no correction either
    for c in np.flatnonzero(runs & _holds_shared(pipe, groups[firsts, 0], groups[lasts, 1])):
        fix = _correction(pipe, row, groups[firsts[c], 0], groups[lasts[c], 1], min(mesh[0] * mesh[1], pipe.per_node))
        if fix is not None:
            params[c] += fix.param_bytes
            sync_s[c] += _fix_sync(fix, pipe.overlap)
    outs, ins = _end_sends(pipe, end)
    send_s = outs[lasts] + np.asarray(ins)[firsts]  # the floats `send_s` adds
    p2p_s = hidden_s = np.zeros(len(firsts))
    if pipe.overlap:
        p2p_s = _end_p2p(pipe, end)[lasts]
        hidden_s = hidden_send(p2p_s, running[:, 8], running[:, 7])

    def summed(x: np.ndarray) -> np.ndarray:  # stage i's chunks i, i + S, …, added in that order
        total = np.zeros(num_stages)
        for k in range(v):
            total = total + x[k * num_stages:(k + 1) * num_stages]
        return total

    out = StageTotals(summed(time_s), summed(send_s), summed(sync_s), summed(params), summed(acts),
                      working.reshape(v, num_stages).max(axis=0), None, summed(p2p_s), summed(hidden_s))
    pipe._sums[key] = (row, out)
    return out


def _holds_shared(pipe: Pipeline, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Per range of base layers [first, last], whether it holds a reader of a shared parameter (a correction)."""
    key = ("reader units",)  # a value, as the sends' keys
    if key not in pipe._sums:
        pipe._sums[key] = np.array(sorted({u for readers in pipe.shared.values() for u in readers}), dtype=np.int64)
    units = pipe._sums[key]
    return np.searchsorted(units, last, "right") > np.searchsorted(units, first, "left")


def _row_spans(pipe: Pipeline, row: Sequence[LayerCost | None]) -> np.ndarray:
    """`_spans` of one option's `row`, kept per row in `pipe` for the 1F1B and interleaved tables and plan assembly."""
    key = ("spans", id(row))
    if key not in pipe._sums:
        pipe._sums[key] = (row, _spans(_columns(row, pipe.layering), pipe.overlap))
    return pipe._sums[key][1]


def _corrections(row: Sequence[LayerCost | None], pipe: Pipeline, i: int, n: int, devices: int):
    """(lo, hi, correction) for the stages [i, i + m], lo ≤ m < hi, that hold the same copies of the
    shared parameters (a correction depends only on which of their readers a stage runs)."""
    if not pipe.shared:
        return []
    first, lasts = pipe.layering.groups[i][0], [b for _, b in pipe.layering.groups[i:i + n]]
    changes = [0, *(m for m in _reader_changes(pipe, i) if m < n), n]
    out = []
    for lo, hi in zip(changes, changes[1:]):
        fix = _correction(pipe, row, first, lasts[lo], devices)
        if fix is not None:
            out.append((lo, hi, fix))
    return out


def _correction(pipe: Pipeline, row: Sequence[LayerCost | None], first: int, last: int,
                devices: int) -> Correction | None:
    """`shared.correction` of a stage of base layers [first, last] on `devices`, kept per row in `pipe`: it depends
    only on which readers of the shared parameters the stage runs (the 1F1B and interleaved tables ask for the
    same ones across thousands of stages)."""
    if not pipe.shared:
        return None
    inside = tuple(tuple(u for u in units if first <= u <= last) for units in pipe.shared.values())
    key = ("correction", id(row), inside, devices)
    if key not in pipe._sums:
        pipe._sums[key] = (row, correction(row, first, last, pipe.shared, pipe.link, devices))
    return pipe._sums[key][1]


def _reader_changes(pipe: Pipeline, i: int) -> list[int]:
    """The m ≥ 1 at which the stage [i, i + m] holds other readers of the shared parameters than [i, i + m - 1]
    (`_corrections`): they depend on the layering alone, so they are kept per first DP layer in `pipe`."""
    key = ("readers", i)
    if key not in pipe._sums:
        groups = np.array(pipe.layering.groups[i:])
        first, lasts = groups[0, 0], groups[:, 1]
        inside = np.stack([np.searchsorted(np.array(units), lasts, "right") - np.searchsorted(units, first)
                           for units in pipe.shared.values()])  # readers of each shared tensor inside [i, j]
        pipe._sums[key] = [m for m in range(1, len(lasts)) if (inside[:, m] != inside[:, m - 1]).any()]
    return pipe._sums[key]


def _fix_sync(fix: Correction, overlap: bool) -> float:
    """The per-iteration change of a shared-parameter correction. Under overlap a removed copy's
    gradient reduction and weight gather are not taken back out of the exposed part (they may have been
    hidden anyway): an over-estimate by at most those, never an under-estimate."""
    if not overlap:
        return fix.iteration_s
    return sum(seconds for kind, seconds in fix.sync_s.items() if kind not in (*REDUCTIONS, "all_gather"))
