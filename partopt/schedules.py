"""Closed forms of the pipeline schedules (docs/COSTMODEL.md §5b): iteration time and in-flight microbatches.

Plain functions of per-stage numbers, for the stage DP to call; `partopt.simulate` runs the same
schedules event by event, and tests/test_simulate.py checks these formulas against it (equal where
exact, bounds where not). Stages are 0-based, S of them, B microbatches.
"""

from __future__ import annotations

from collections.abc import Sequence

from partopt.errors import InstanceError

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved", "zero-bubble")
SEARCHED: tuple[str, ...] = ("1f1b", "interleaved", "zero-bubble")  # what the stage DP plans (docs/COSTMODEL.md §5b); auto: the best


def check_microbatches(microbatches: int) -> None:
    """Raise InstanceError unless B is an integer >= 1."""
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise InstanceError(f"microbatches must be an integer >= 1, got {microbatches!r}",
                            where="microbatches", hint="split the batch into at least one microbatch")


def check_schedule(schedule: str, virtual_stages: int, num_stages: int, microbatches: int) -> int:
    """The number of virtual stages per stage, v, after checking it and B >= 1 fit `schedule`; InstanceError if not."""
    check_microbatches(microbatches)
    if num_stages < 1:
        raise InstanceError("a pipeline needs at least one stage", where="stages", hint="give one entry per stage")
    if schedule not in SCHEDULES:
        raise InstanceError(f"unknown pipeline schedule {schedule!r}", where="schedule", hint=f"use one of {list(SCHEDULES)}")
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InstanceError(f"virtual stages must be an integer >= 1, got {v!r}", where="virtual_stages",
                            hint="give the number of model chunks per stage")
    if schedule != "interleaved" and v != 1:
        raise InstanceError(f"the {schedule} schedule has one model chunk per stage, not {v}", where="virtual_stages",
                            hint="virtual stages > 1 need the interleaved schedule")
    if schedule == "interleaved":
        if v < 2:
            raise InstanceError("the interleaved schedule needs at least 2 virtual stages per stage",
                                where="virtual_stages", hint="give v >= 2 model chunks per stage (partopt draw --virtual-stages), or use 1f1b")
        if microbatches % num_stages != 0:
            raise InstanceError(f"the interleaved schedule needs microbatches divisible by the {num_stages} stages, "
                                f"got {microbatches}", where="microbatches",
                                hint="Megatron-LM requires it: pick a multiple of the number of stages")
    return v


def interleaved_warmup(stage: int, num_stages: int, microbatches: int, v: int) -> int:
    """Megatron-LM's warm-up forwards (chunk-microbatches) of `stage`: 2 (S - i - 1) + (v - 1) S, all S·v when B = S."""
    total = microbatches * v
    if microbatches == num_stages:
        return total
    return min(2 * (num_stages - stage - 1) + (v - 1) * num_stages, total)


def inflight(stage: int, num_stages: int, microbatches: int, schedule: str, v: int = 1) -> float:
    """Microbatches whose activations `stage` holds at once (interleaved: chunk-microbatches / v, each 1/v of a stage's).

    gpipe B; 1f1b min(S - i, B); zero-bubble (ZB-H1) min(S, B) (held until the weight pass);
    interleaved min(w_i + 1, B v) / v with w_i = `interleaved_warmup` — on stage 0, S + (S - 1) / v
    for B > S, Korthikanti et al.'s p (1 + (p - 1) / (p v)). Memory per stage: static + this × activation.
    """
    v = check_schedule(schedule, v, num_stages, microbatches)
    if not 0 <= stage < num_stages:
        raise InstanceError(f"stage {stage} is not one of the {num_stages} stages", where="stage",
                            hint="stages are numbered from 0")
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(num_stages - stage, microbatches)
    if schedule == "zero-bubble":
        return min(num_stages, microbatches)
    return min(interleaved_warmup(stage, num_stages, microbatches, v) + 1, microbatches * v) / v


def iteration_time(stage_times: Sequence[float], forward_times: Sequence[float], sync_s: float, microbatches: int,
                   schedule: str, v: int = 1, weight_times: Sequence[float] | None = None, fill_s: float = 0.0) -> float:
    """One iteration's time: the pipeline part of `schedule` plus `sync_s` (gradient sync after the last backward).

    Per stage i: t_i = `stage_times[i]` = f_i + b_i + 2 send_i (interleaved: f_i + b_i + 2 v send_i,
    a chunk boundary per chunk), `forward_times[i]` = f_i + send_i (the forward and its send out),
    `weight_times[i]` = w_i, the weight-gradient part of b_i (zero-bubble only; default 0).
    * gpipe: sum t + (B - 1) (max_i (f_i + send_i) + max_i (t_i - f_i - send_i));
    * 1f1b: sum t + (B - 1) max t (Alpa's);
    * interleaved: sum t / v + fill + (B - 1 / v) max t (the bubble (S - 1) t / v: (S - 1) / (v B) of the ideal
      B t); `fill_s`: the point-to-point round trips of every chunk boundary when sends overlap compute (then t_i
      carries only their exposed part), which the first microbatch's forward and the last one's backward still
      wait for (docs/COSTMODEL.md §5b); 0 when sends add to t;
    * zero-bubble: sum t + (B - 1) max t - (S - 1 + min(S, B) - 1) ω, ω = min_i min(w_i, forward_times[i],
      t_i - forward_times[i] - w_i) (ZB-H1: the deferred W's fill the drain; uniform F = B = W: a third of
      1F1B's bubble (S - 1)(F + B + W)).
    Which of these are exact and which bounds of the simulated schedule: docs/COSTMODEL.md §5b.
    """
    num_stages = len(stage_times)
    if num_stages == 0 or len(forward_times) != num_stages:
        raise InstanceError(f"{num_stages} stage times and {len(forward_times)} forward times", where="stage_times",
                            hint="give one stage time and one forward time per stage")
    v = check_schedule(schedule, v, num_stages, microbatches)
    total, slowest = sum(stage_times), max(stage_times)
    if schedule == "gpipe":
        backward = max(t - f for t, f in zip(stage_times, forward_times))
        pipeline = total + (microbatches - 1) * (max(forward_times) + backward)
    elif schedule == "interleaved":
        pipeline = total / v + fill_s + (microbatches - 1 / v) * slowest
    else:
        pipeline = total + (microbatches - 1) * slowest
        if schedule == "zero-bubble":
            weights = [0.0] * num_stages if weight_times is None else weight_times
            if len(weights) != num_stages:
                raise InstanceError(f"{len(weights)} weight times for {num_stages} stages", where="weight_times",
                                    hint="give one weight-gradient time per stage")
            for i, (t, f, w) in enumerate(zip(stage_times, forward_times, weights)):
                if not 0 <= w <= t - f:
                    raise InstanceError(f"weight time {w!r} is not within [0, the backward {t - f!r}]",
                                        where=f"weight_times[{i}]", hint="w_i is the weight-gradient part of b_i")
            hidden = min(min(w, f, t - f - w) for t, f, w in zip(stage_times, forward_times, weights))
            pipeline -= (num_stages + min(num_stages, microbatches) - 2) * hidden
    return pipeline + sync_s


def per_device(values: Sequence[float], num_stages: int) -> list[float]:
    """Per stage i, the sum of the entries j = i, i + S, i + 2S, …: an interleaved plan lists its S·v virtual
    stages (model chunks) in model order, chunk j on the devices of stage j mod S; else the values themselves."""
    return [sum(values[i::num_stages]) for i in range(num_stages)]


def plan_iteration(stage_times: Sequence[float], forward_times: Sequence[float], weight_times: Sequence[float],
                   sync_times: Sequence[float], microbatches: int, schedule: str, v: int = 1,
                   fill_times: Sequence[float] = ()) -> float:
    """A plan's iteration time from its entries (one per stage, or per virtual stage when interleaved):
    `iteration_time` of the per-device sums, the largest per-device sync added (stages sync in parallel);
    `fill_times`: each entry's overlapped point-to-point round trip (interleaved: their sum is the fill)."""
    num_stages = len(stage_times) // v
    times, forwards, weights = (per_device(x, num_stages) for x in (stage_times, forward_times, weight_times))
    sync = max(per_device(sync_times, num_stages))
    return iteration_time(times, forwards, sync, microbatches, schedule, v, weights if schedule == "zero-bubble" else None,
                          sum(fill_times))


def interleaved_shapes(layers: int, microbatches: int, devices: int) -> list[tuple[int, int]]:
    """The (S, v) of Megatron's uniform chunking of `layers` DP layers the search can plan: S >= 2 stages on
    at most `devices` devices, v >= 2 chunks of equally many layers each (S·v divides the layers), S divides B."""
    return [(S, layers // (S * c)) for S in range(2, min(layers, devices) + 1) if microbatches % S == 0
            for c in range(1, layers // S + 1) if layers % (S * c) == 0 and layers // (S * c) >= 2]
