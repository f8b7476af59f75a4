"""Event simulation of a pipeline schedule (DESIGN §6): checks the stage DP's closed form, gives memory over time.

Works on numbers only: per-stage forward/backward/send times and bytes, which other code derives
from a plan. Each stage is one device group running one task at a time, in the order its schedule
fixes; a task starts as soon as its stage is free and its input has arrived (list scheduling in
dependency order, so every start is the earliest the schedule allows). Sends are asynchronous
point-to-point transfers: they delay the receiver and queue on their link, but occupy no stage.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from partopt.errors import InstanceError

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")


@dataclass(frozen=True)
class StageTimes:
    """One pipeline stage, per microbatch: compute times, the send to the next stage, and memory."""

    forward_s: float  # one microbatch's forward on this stage
    backward_s: float  # one microbatch's backward
    send_s: float = 0.0  # boundary activation to stage i+1, and its gradient back; 0 on the last stage
    activation_bytes: float = 0.0  # kept per in-flight microbatch (from its forward's end to its backward's end)
    static_bytes: float = 0.0  # parameters, gradients, optimizer state (always resident)

    @property
    def latency_s(self) -> float:
        """t_i of the stage DP: forward + backward + the send out and the gradient back (2 * send_s)."""
        return self.forward_s + self.backward_s + 2.0 * self.send_s


@dataclass(frozen=True)
class Event:
    """One task that ran: a forward or backward of one microbatch on one stage."""

    stage: int
    microbatch: int
    kind: str  # "forward" | "backward"
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """A simulated iteration: its time, every task, and each stage's memory over time."""

    schedule: str
    iteration_time_s: float
    events: list[Event]  # sorted by (start_s, stage, position in the stage's order)
    memory: list[list[tuple[float, float]]]  # per stage: (time, bytes) after each change, from (0, static)
    peak_memory_bytes: list[float]  # per stage
    max_inflight: list[int]  # per stage: most microbatches whose forward is done and backward not


def _check(stages: Sequence[StageTimes], microbatches: int) -> None:
    """Raise InstanceError on an empty pipeline, B < 1, or a negative / non-finite number."""
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise InstanceError(f"microbatches must be an integer >= 1, got {microbatches!r}",
                            where="microbatches", hint="split the batch into at least one microbatch")
    if len(stages) == 0:
        raise InstanceError("a pipeline needs at least one stage", where="stages", hint="pass one StageTimes per stage")
    for i, stage in enumerate(stages):
        for field in ("forward_s", "backward_s", "send_s", "activation_bytes", "static_bytes"):
            value = getattr(stage, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise InstanceError(f"{field} must be a finite number >= 0, got {value!r}",
                                    where=f"stages[{i}].{field}", hint="times are seconds and sizes bytes, never negative")
    if stages[-1].send_s != 0:
        raise InstanceError(f"the last stage sends nothing, but send_s = {stages[-1].send_s!r}",
                            where=f"stages[{len(stages) - 1}].send_s", hint="set send_s = 0 on the last stage")


def closed_form(stages: Sequence[StageTimes], microbatches: int) -> float:
    """Alpa's pipeline latency sum_i t_i + (B - 1) * max_i t_i, with t_i = f_i + b_i + 2 * send_i.

    t_i is `StageTimes.latency_s` (DESIGN §6 counts the boundary send and its gradient in the
    stage). How it compares with `simulate` is stated in that function's docstring.
    """
    _check(stages, microbatches)
    latencies = [stage.latency_s for stage in stages]
    return sum(latencies) + (microbatches - 1) * max(latencies)


def _order(schedule: str, stage: int, num_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The task order of one stage: ("forward"|"backward", microbatch) pairs."""
    forwards = [("forward", m) for m in range(microbatches)]
    backwards = [("backward", m) for m in range(microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(num_stages - stage, microbatches)
    steady = [task for m in range(microbatches - warmup) for task in (backwards[m], forwards[warmup + m])]
    return forwards[:warmup] + steady + backwards[microbatches - warmup:]


def simulate(stages: Sequence[StageTimes], microbatches: int, schedule: str = "1f1b") -> Simulation:
    """Run one training iteration of B microbatches through the pipeline under `schedule`.

    Dependencies: forward m on stage i starts after forward m on stage i-1 ended plus send_{i-1};
    backward m on stage i < S-1 after backward m on stage i+1 ended plus send_i; the last stage's
    backward m follows its own forward m. Schedules:
    * "1f1b" (PipeDream-flush, Megatron): stage i runs min(S - i, B) warm-up forwards, then one
      backward and one forward alternately, then the remaining backwards; it holds at most
      min(S - i, B) microbatches;
    * "gpipe": every forward 0..B-1, then every backward in the same order 0..B-1; holds B.

    Sends: link i (between stages i and i+1) carries one message at a time per direction, in
    microbatch order, each taking send_i; it delays the receiver and never occupies a stage.

    Against `closed_form` C = sum t_i + (B-1) max t_i (sum over stages; a link counts as a machine
    with forward and backward time send_i):
    * any schedule: T >= max_k (sum_{j<k} t_j + B (f_k + b_k)) — stage k cannot start before the
      first forward chain reaches it, has B (f_k + b_k) of work, and its last backward still has
      to travel back to stage 0;
    * GPipe: T = sum t_i + (B-1) (max(f ∪ send) + max(b ∪ send)) exactly (the forward and the
      backward phase are each a flow shop of B identical jobs); with sends 0, T = C when one
      stage has both the largest forward and the largest backward, else T > C;
    * 1F1B: T <= C whenever one machine has both the largest forward and the largest backward
      time (e.g. b_i = r f_i on every stage and sends 0) — found by exhaustive search on small
      integer instances and random tests, not proven. With the first bullet, T = C if moreover
      the last stage has the largest t_i (one stage, uniform stages: (S+B-1)(f+b)), and B = 1
      gives T = sum t_i. When the bottleneck stage k < S-1, its warm-up forwards hide the
      downstream latency that C charges: T < C, by at most sum_{j>k} t_j + 2 B send_k (f = (2, 1),
      b = (4, 2), B = 2: 13 s against 15 s). Without the condition T can exceed C
      (f = (0, 1, 0), b = (3, 1, 0), B = 2: 9 s against 8 s).
    * With sends 0, 1F1B was never slower than GPipe in those searches; with sends it can be,
      since at most S - i microbatches in flight expose the send round trips (f = (0, 1),
      b = (1, 1), send = (1, 0), B = 3: 10 s against 9 s).
    """
    _check(stages, microbatches)
    if schedule not in SCHEDULES:
        raise InstanceError(f"unknown pipeline schedule {schedule!r}", where="schedule", hint=f"use one of {list(SCHEDULES)}")
    num_stages = len(stages)
    orders = [_order(schedule, i, num_stages, microbatches) for i in range(num_stages)]
    # arrived[kind][i][m]: when task (kind, m) on stage i has its input; stage 0's forwards and the
    # last stage's backwards need nothing from a neighbour. None: not yet sent.
    arrived: dict[str, list[list[float | None]]] = {
        kind: [[None] * microbatches for _ in range(num_stages)] for kind in ("forward", "backward")}
    arrived["forward"][0] = [0.0] * microbatches
    arrived["backward"][num_stages - 1] = [0.0] * microbatches
    link_free = {kind: [0.0] * num_stages for kind in ("forward", "backward")}  # link i joins stages i, i+1
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    ran: list[list[Event]] = [[] for _ in range(num_stages)]
    pending = deque(range(num_stages))
    while pending:
        i = pending.popleft()
        while position[i] < len(orders[i]):
            kind, m = orders[i][position[i]]
            ready = arrived[kind][i][m]
            if ready is None:
                break  # the neighbour that sends it re-queues this stage
            start = max(free_at[i], ready)
            end = free_at[i] = start + (stages[i].forward_s if kind == "forward" else stages[i].backward_s)
            ran[i].append(Event(i, m, kind, start, end))
            position[i] += 1
            target = i + 1 if kind == "forward" else i - 1
            if 0 <= target < num_stages:
                link = min(i, target)
                sent = max(end, link_free[kind][link]) + stages[link].send_s
                arrived[kind][target][m] = link_free[kind][link] = sent
                pending.append(target)
    assert all(position[i] == len(orders[i]) for i in range(num_stages)), "schedule deadlocked"

    memory, peaks, inflight = [], [], []
    for stage, events in zip(stages, ran):
        held, most = 0, 0
        steps = [(0.0, float(stage.static_bytes))]
        for event in events:
            held += 1 if event.kind == "forward" else -1
            most = max(most, held)
            steps.append((event.end_s, float(stage.static_bytes + held * stage.activation_bytes)))
        memory.append(steps)
        peaks.append(max(nbytes for _, nbytes in steps))
        inflight.append(most)
    ordered = sorted(((e.start_s, e.stage, k), e) for events in ran for k, e in enumerate(events))
    return Simulation(
        schedule=schedule,
        iteration_time_s=max(free_at),
        events=[event for _, event in ordered],
        memory=memory,
        peak_memory_bytes=peaks,
        max_inflight=inflight,
    )
