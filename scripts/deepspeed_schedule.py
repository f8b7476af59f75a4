"""Does DeepSpeed's pipeline engine run 1F1B? Why MT-NLG's and BLOOM's points are priced as 1F1B (docs/COSTMODEL.md §7).

DeepSpeed's `TrainSchedule` (deepspeed/runtime/pipe/schedule.py, unchanged in its timing since 2020) runs
2 (B + S - 1) steps; at step k stage s runs the forward of microbatch k/2 - s//2 when k and s have the same parity,
else a backward, and exchanges the previous step's activation or gradient with one neighbour before computing
(its `SendActivation`/`RecvGrad` or `SendGrad`/`RecvActivation` pair). Its sends and receives are blocking
(p2p.py: NCCL send/recv or a two-rank broadcast on the compute stream), so an exchange waits for both neighbours to
finish the step before. This script runs that instruction stream with rendezvous exchanges (each costing
`exchange_s`, both messages) and prints its iteration time beside `partopt.simulate`'s 1F1B on the same stages
(sends of half the exchange each way, asynchronous there). Without exchange time the two are equal on every case,
uniform or unbalanced; the blocking exchanges cost at most 1.6 % more here, 1.3 % at an exchange of 5 % of a forward
(MT-NLG's is about 4 %: 10.5 MB per GPU each way over a 25 GB/s NIC and its all-gather over NVLink, against a 3-layer
forward of ~40 ms). So DeepSpeed's schedule needs no model of its own, and it cannot explain MT-NLG's 1.26x.

    python scripts/deepspeed_schedule.py
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from partopt.simulate import StageTimes, simulate


def _task(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """DeepSpeed's `TrainSchedule._step_to_micro_batch`: (microbatch, is_forward) of `stage` at `step`."""
    if step % 2 == stage % 2:
        return (step if step % 2 == 0 else step - 1) // 2 - stage // 2, True
    if step % 2 == 0:
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def deepspeed_time(forward: list[float], backward: list[float], microbatches: int, exchange_s: float = 0.0) -> float:
    """The iteration time of DeepSpeed's TrainSchedule with blocking exchanges (no gradient reduction)."""
    stages = len(forward)
    valid = range(microbatches).__contains__
    end = [0.0] * stages
    for step in range(2 * (microbatches + stages - 1)):
        start = list(end)
        for s in range(stages):
            micro, is_forward = _task(step, s, stages)
            previous = _task(step - 1, s, stages)[0] if step else -1
            neighbour = s - 1 if is_forward else s + 1
            if 0 <= neighbour < stages and (valid(micro) or valid(previous)):
                start[s] = max(end[s], end[neighbour]) + exchange_s
        for s in range(stages):
            micro, is_forward = _task(step, s, stages)
            work = (forward[s] if is_forward else backward[s]) if valid(micro) else 0.0
            end[s] = start[s] + work
    return max(end)


def main() -> None:
    table = Table(title="DeepSpeed TrainSchedule (blocking exchanges) against partopt's 1F1B simulation")
    for column in ("stages", "microbatches", "stages' times", "exchange", "DeepSpeed", "1F1B", "ratio"):
        table.add_column(column, justify="right")
    cases = [(35, b, "uniform", 0.0) for b in (160, 192, 240, 280)] + [
        (35, 240, "last +7 %", 0.0), (35, 240, "first +7 %", 0.0), (35, 240, "uniform", 0.05), (12, 128, "uniform", 0.02),
        (4, 8, "uneven 1,2,3,1", 0.1)]
    for stages, microbatches, shape, exchange in cases:
        scale = [1.0] * stages
        if shape == "last +7 %":
            scale[-1] = 1.07
        elif shape == "first +7 %":
            scale[0] = 1.07
        elif shape.startswith("uneven"):
            scale = [1.0, 2.0, 3.0, 1.0]
        forward, backward = scale, [3.0 * x for x in scale]  # full recomputation: backward = recompute + 2 forwards
        ours = deepspeed_time(forward, backward, microbatches, exchange)
        one_f_one_b = simulate([StageTimes(f, b, exchange / 2 if i < stages - 1 else 0.0)
                                for i, (f, b) in enumerate(zip(forward, backward))], microbatches).iteration_time_s
        table.add_row(str(stages), str(microbatches), shape, f"{exchange:g}", f"{ours:.2f}", f"{one_f_one_b:.2f}",
                      f"{ours / one_f_one_b:.4f}")
    Console().print(table)


if __name__ == "__main__":
    main()
