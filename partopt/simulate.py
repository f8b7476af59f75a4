"""Event simulation of a pipeline schedule (DESIGN §6): checks the stage DP's closed forms, gives memory over time.

Works on numbers only: per-stage forward/backward/send times and bytes, which other code derives
from a plan. Each stage is one device group running one task at a time, in the order its schedule
fixes; a task starts as soon as its stage is free and its input has arrived (list scheduling in
dependency order, so every start is the earliest the schedule allows). Sends are asynchronous
point-to-point transfers: they delay the receiver and queue on their link, but occupy no stage.
The closed forms these runs are checked against live in `partopt.schedules`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from partopt.errors import InstanceError
from partopt.schedules import check_microbatches, check_schedule, interleaved_warmup, iteration_time

Task = tuple[str, int, int]  # (kind, chunk, microbatch)


@dataclass(frozen=True)
class StageTimes:
    """One pipeline stage, per microbatch: compute times, the send to the next stage, and memory."""

    forward_s: float  # one microbatch's forward on this stage
    backward_s: float  # one microbatch's backward (input and weight gradients)
    send_s: float = 0.0  # boundary activation to stage i+1, and its gradient back; 0 on the last stage
    activation_bytes: float = 0.0  # kept per in-flight microbatch (from its forward's end to its backward's end)
    static_bytes: float = 0.0  # parameters, gradients, optimizer state (always resident)
    weight_s: float = 0.0  # the weight-gradient part of backward_s: zero-bubble runs it as its own W pass

    @property
    def latency_s(self) -> float:
        """t_i of the stage DP: forward + backward + the send out and the gradient back (2 * send_s)."""
        return self.forward_s + self.backward_s + 2.0 * self.send_s


@dataclass(frozen=True)
class Event:
    """One task that ran: a forward, backward or (zero-bubble) weight-gradient pass of one microbatch."""

    stage: int
    microbatch: int
    kind: str  # "forward" | "backward" | "weight" (zero-bubble: "backward" is then the input gradient only)
    start_s: float
    end_s: float
    chunk: int = 0  # model chunk on this stage (interleaved: 0 … v-1, virtual stage chunk · S + stage)


@dataclass(frozen=True)
class Simulation:
    """A simulated iteration: its time, every task, and each stage's memory over time."""

    schedule: str
    iteration_time_s: float
    events: list[Event]  # sorted by (start_s, stage, position in the stage's order)
    memory: list[list[tuple[float, float]]]  # per stage: (time, bytes) after each change, from (0, static)
    peak_memory_bytes: list[float]  # per stage
    max_inflight: list[float]  # per stage: most microbatches held at once (interleaved: chunk-microbatches / v)
    virtual_stages: int = 1


def _check(stages: Sequence[StageTimes], microbatches: int) -> None:
    """Raise InstanceError on an empty pipeline, B < 1, or a negative / non-finite number."""
    check_microbatches(microbatches)
    if len(stages) == 0:
        raise InstanceError("a pipeline needs at least one stage", where="stages", hint="pass one StageTimes per stage")
    for i, stage in enumerate(stages):
        for field in ("forward_s", "backward_s", "send_s", "activation_bytes", "static_bytes", "weight_s"):
            value = getattr(stage, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise InstanceError(f"{field} must be a finite number >= 0, got {value!r}",
                                    where=f"stages[{i}].{field}", hint="times are seconds and sizes bytes, never negative")
        if stage.weight_s > stage.backward_s:
            raise InstanceError(f"weight_s {stage.weight_s!r} exceeds backward_s {stage.backward_s!r}",
                                where=f"stages[{i}].weight_s", hint="weight_s is the weight-gradient part of backward_s")
    if stages[-1].send_s != 0:
        raise InstanceError(f"the last stage sends nothing, but send_s = {stages[-1].send_s!r}",
                            where=f"stages[{len(stages) - 1}].send_s", hint="set send_s = 0 on the last stage")


def closed_form(stages: Sequence[StageTimes], microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1,
                wrap_send_s: float | None = None) -> float:
    """The closed-form iteration time of `schedule` (`partopt.schedules.iteration_time`, no sync) for these stages.

    For 1F1B it is Alpa's sum_i t_i + (B - 1) * max_i t_i with t_i = `StageTimes.latency_s` =
    f_i + b_i + 2 * send_i (DESIGN §6 counts the boundary send and its gradient in the stage).
    How it compares with `simulate` is stated in that function's docstring and docs/COSTMODEL.md §5b.
    """
    _check(stages, microbatches)
    times, forwards, weights = closed_form_inputs(stages, schedule, virtual_stages, wrap_send_s)
    return iteration_time(times, forwards, 0.0, microbatches, schedule, virtual_stages, weights)


def closed_form_inputs(stages: Sequence[StageTimes], schedule: str = "1f1b", virtual_stages: int = 1,
                       wrap_send_s: float | None = None) -> tuple[list[float], list[float], list[float]]:
    """Per stage (t_i, f_i + send_i, w_i) as `partopt.schedules.iteration_time` takes them for `schedule`.

    t_i = f_i + b_i + 2 send_i; interleaved sends v times per stage, the last stage v - 1 times over
    the wrap-around link (`wrap_send_s`, by default the largest send_i): t_i = f_i + b_i + 2 v send_i.
    """
    v = virtual_stages if schedule == "interleaved" else 1
    wrap = _wrap_send(stages, wrap_send_s)
    times = [stage.forward_s + stage.backward_s + 2 * v * stage.send_s for stage in stages]
    if len(stages) > 1:  # one stage passes its chunks on without a send
        times[-1] += 2 * (v - 1) * wrap
    return times, [stage.forward_s + stage.send_s for stage in stages], [stage.weight_s for stage in stages]


def _wrap_send(stages: Sequence[StageTimes], wrap_send_s: float | None) -> float:
    """The send time from the last stage to stage 0 (interleaved): given, or the largest send_i."""
    if wrap_send_s is None:
        return max(stage.send_s for stage in stages)
    if not isinstance(wrap_send_s, (int, float)) or isinstance(wrap_send_s, bool) or not math.isfinite(wrap_send_s) \
            or wrap_send_s < 0:
        raise InstanceError(f"wrap_send_s must be a finite number >= 0, got {wrap_send_s!r}", where="wrap_send_s",
                            hint="the time of one send from the last stage to the first, in seconds")
    return float(wrap_send_s)


def _order(schedule: str, stage: int, num_stages: int, microbatches: int, v: int) -> list[Task]:
    """The task order of one stage: (kind, chunk, microbatch) triples."""
    forwards = [("forward", 0, m) for m in range(microbatches)]
    backwards = [("backward", 0, m) for m in range(microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(num_stages - stage, microbatches)
    if schedule == "1f1b":
        steady = [task for m in range(microbatches - warmup) for task in (backwards[m], forwards[warmup + m])]
        return forwards[:warmup] + steady + backwards[microbatches - warmup:]
    if schedule == "zero-bubble":
        # ZB-H1: 1F1B's warm-up; stage i defers its first i weight passes, so the W's fill the tail
        order = forwards[:warmup]
        for m in range(microbatches):
            order.append(backwards[m])
            if m >= stage:
                order.append(("weight", 0, m - stage))
            if warmup + m < microbatches:
                order.append(forwards[warmup + m])
        return order + [("weight", 0, m) for m in range(max(0, microbatches - stage), microbatches)]
    # interleaved (Megatron-LM): the k-th forward runs chunk (k mod S·v) // S of microbatch
    # (k // (S·v)) · S + k mod S; backwards walk the chunks in reverse
    total = microbatches * v
    group = num_stages * v

    def task(kind: str, k: int) -> Task:
        chunk = (k % group) // num_stages
        return kind, chunk if kind == "forward" else v - 1 - chunk, (k // group) * num_stages + k % num_stages

    warm = interleaved_warmup(stage, num_stages, microbatches, v)
    order = [task("forward", k) for k in range(warm)]
    for k in range(total - warm):
        order += [task("forward", warm + k), task("backward", k)]
    return order + [task("backward", k) for k in range(total - warm, total)]


def simulate(stages: Sequence[StageTimes], microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1,
             wrap_send_s: float | None = None) -> Simulation:
    """Run one training iteration of B microbatches through the pipeline under `schedule`.

    Dependencies: forward m on stage i starts after forward m on stage i-1 ended plus send_{i-1};
    backward m on stage i < S-1 after backward m on stage i+1 ended plus send_i; the last stage's
    backward m after its own forward m; a weight pass after its own backward. Schedules:
    * "1f1b" (PipeDream-flush, Megatron): stage i runs min(S - i, B) warm-up forwards, then one
      backward and one forward alternately, then the remaining backwards; it holds at most
      min(S - i, B) microbatches;
    * "gpipe": every forward 0..B-1, then every backward in the same order 0..B-1; holds B.
    * "interleaved" (Megatron-LM, Narayanan et al. SC'21), v = `virtual_stages` >= 2 and B a
      multiple of S (as Megatron requires): each stage holds v model chunks of f_i / v, b_i / v;
      virtual stage c·S + i is chunk c of stage i, so a microbatch goes round the stages v times,
      and the last stage sends to stage 0 (`wrap_send_s`, by default the largest send_i: every
      boundary carries the same activation). Stage i runs Megatron's order: 2 (S - i - 1) + (v - 1) S
      warm-up forwards (all S·v when B = S), then forward and backward alternately, then the
      remaining backwards; the k-th forward is chunk (k mod S v) // S of microbatch
      (k // (S v)) S + k mod S. A chunk-microbatch holds activation_bytes / v.
    * "zero-bubble" (ZB-H1, Qi et al. 2023): backward_s splits into the input gradient B
      (backward_s - weight_s), which the previous stage waits for, and the weight gradient W
      (weight_s), which only its own stage needs. 1F1B's warm-up, then B, W, F in turn, except that
      stage i defers its first i weight passes to its tail. A microbatch is held from its forward's
      end to its W's end (B frees part of it; not modelled): at most min(S, B) on every stage.

    Sends: a link (sender, receiver) carries one message at a time, in the sender's order, each
    taking send_i of the boundary it crosses; it delays the receiver and never occupies a stage.

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
    The interleaved and zero-bubble runs against their closed forms: `partopt.schedules`.
    """
    _check(stages, microbatches)
    num_stages = len(stages)
    v = check_schedule(schedule, virtual_stages, num_stages, microbatches)
    wrap = _wrap_send(stages, wrap_send_s)
    last = num_stages * v - 1  # the last virtual stage
    orders = [_order(schedule, i, num_stages, microbatches, v) for i in range(num_stages)]
    split = schedule == "zero-bubble"
    durations = [{"forward": stage.forward_s / v, "weight": stage.weight_s,
                  "backward": (stage.backward_s - stage.weight_s) if split else stage.backward_s / v} for stage in stages]
    # the send from a stage to the one it feeds: the boundary's send_i, the wrap-around (interleaved), none to itself
    sends = {(i, j): stages[min(i, j)].send_s if abs(i - j) == 1 else wrap
             for i in range(num_stages) for j in (i - 1, i + 1, 0, num_stages - 1) if 0 <= j < num_stages and j != i}

    # arrived[(kind, virtual stage, m)]: when that task has its input; stage 0's first forwards need nothing
    arrived: dict[tuple[str, int, int], float] = {("forward", 0, m): 0.0 for m in range(microbatches)}
    link_free: dict[tuple[int, int], float] = {}
    position = [0] * num_stages
    free_at = [0.0] * num_stages
    ran: list[list[Event]] = [[] for _ in range(num_stages)]
    pending = deque(range(num_stages))
    while pending:
        i = pending.popleft()
        order, took, done = orders[i], durations[i], ran[i]
        k, now = position[i], free_at[i]
        while k < len(order):
            kind, chunk, m = order[k]
            u = chunk * num_stages + i
            ready = arrived.get((kind, u, m))
            if ready is None:
                break  # the neighbour that sends it re-queues this stage
            start = now if now > ready else ready
            now = start + took[kind]
            done.append(Event(i, m, kind, start, now, chunk))
            k += 1
            if kind == "weight":
                continue
            if kind == "forward" and u == last:
                arrived["backward", u, m] = now
                continue
            if split and kind == "backward":
                arrived["weight", u, m] = now
            target = u + 1 if kind == "forward" else u - 1
            if 0 <= target <= last:
                receiver = target % num_stages
                if receiver == i:
                    arrived[kind, target, m] = now
                    continue
                link = (i, receiver)
                sent = max(now, link_free.get(link, 0.0)) + sends[link]
                arrived[kind, target, m] = link_free[link] = sent
                pending.append(receiver)
        position[i], free_at[i] = k, now
    assert all(position[i] == len(orders[i]) for i in range(num_stages)), "schedule deadlocked"

    freed_by = "weight" if split else "backward"
    memory, peaks, inflight = [], [], []
    for stage, events in zip(stages, ran):
        held, most = 0, 0
        steps = [(0.0, float(stage.static_bytes))]
        for event in events:
            if event.kind not in ("forward", freed_by):
                continue
            held += 1 if event.kind == "forward" else -1
            most = max(most, held)
            steps.append((event.end_s, float(stage.static_bytes + held * stage.activation_bytes / v)))
        memory.append(steps)
        peaks.append(max(nbytes for _, nbytes in steps))
        inflight.append(most / v if v > 1 else most)
    ordered = sorted((e for events in ran for e in events), key=attrgetter("start_s", "stage"))  # stable: keeps order
    return Simulation(
        schedule=schedule,
        iteration_time_s=max(free_at),
        events=ordered,
        memory=memory,
        peak_memory_bytes=peaks,
        max_inflight=inflight,
        virtual_stages=v,
    )
