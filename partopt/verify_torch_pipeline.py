"""Prove a plan's pipeline split in PyTorch: the model cut at the plan's stage boundaries with
`torch.distributed.pipelining` (one gloo CPU process per stage, GPipe over the plan's
microbatches) must give the unsharded step's loss and every parameter's gradient.

Stages run unsharded here: their shardings are what `verify_torch`'s per-stage DTensor runs check.
The split points are the modules the stages begin at (`export --to dtensor`'s `begins_at`); the
whole batch is the plan's microbatch count times its microbatch, and GPipe averages the
microbatches' losses (its default gradient scaling), as the unsharded step's mean loss does.
"""

from __future__ import annotations

import json
import math
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partopt.errors import PartoptError
from partopt.export import to_dtensor
from partopt.plan import Plan, plan_from_dict, plan_to_dict
from partopt.verify_torch import ATOL, MAX_PROCESSES, RTOL, Check, _build, _step, rendezvous


@dataclass
class PipelineReport:
    """The pipelined step against the unsharded one (no checks, and a note, when it could not run)."""

    stages: int
    microbatches: int
    boundaries: list[str]
    checks: list[Check] = field(default_factory=list)
    note: str | None = None

    def lines(self) -> list[str]:
        head = (f"pipeline: {self.stages} stages split at {', '.join(self.boundaries)}, {self.microbatches} "
                f"microbatch{'' if self.microbatches == 1 else 'es'} (GPipe, {self.stages} gloo processes)")
        if self.note:
            return [head, f"  not run: {self.note}"]
        return [head] + [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]


def boundaries(plan: Plan) -> list[str]:
    """The module FQN each stage after the first begins at."""
    return [stage["begins_at"] for stage in to_dtensor(plan)["stages"][1:]]


def _output(out: Any) -> Any:
    """The tensor a pipeline stage hands on: a Hugging Face model's logits, else the (first) output."""
    import torch

    if hasattr(out, "logits"):
        return out.logits
    return out if isinstance(out, torch.Tensor) else out[0]


def _worker(rank: int, world: int, source: str, plan_data: dict, cuts: list[str], out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    warnings.filterwarnings("ignore")  # the library never prints; the pipeline tracer warns
    dist.init_process_group("gloo", init_method=rendezvous(out_dir), rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        plan = plan_from_dict(plan_data)
        n = plan.num_microbatches
        model, inputs, loss_fn = _build(source, plan, microbatches=n)
        ref_loss, ref_grads = _step(model, inputs, loss_fn)
        hf = source.endswith(".json")

        class Whole(torch.nn.Module):
            def __init__(self, inner: Any):
                super().__init__()
                self.inner = inner

            def forward(self, *xs: Any) -> Any:
                return _output(self.inner(*xs))

        def microbatch_loss(out: Any, target: Any) -> Any:
            if hf:
                return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
            return out.square().mean()

        pipe = pipeline(Whole(model), mb_args=tuple(x.chunk(n)[0] for x in inputs),
                        split_spec={f"inner.{cut}": SplitPoint.BEGINNING for cut in cuts})
        if pipe.num_stages != world:
            raise PartoptError(f"the split gave {pipe.num_stages} stages, not {world}", "verify")
        schedule = ScheduleGPipe(pipe.build_stage(rank, torch.device("cpu")), n_microbatches=n, loss_fn=microbatch_loss)
        losses: list[Any] = []
        if rank == 0:
            schedule.step(*inputs)
        elif rank == world - 1:
            schedule.step(target=inputs[0], losses=losses)
        else:
            schedule.step()
        mismatch, params = [], 0
        for name, p in pipe.get_stage_module(rank).named_parameters():
            fqn = name.removeprefix("inner.")
            params += 1
            ref = ref_grads[fqn]
            if p.grad is None or not torch.allclose(p.grad, ref, rtol=RTOL, atol=ATOL):
                worst = float("inf") if p.grad is None else float((p.grad - ref).abs().max())
                mismatch.append((fqn, worst))
        result = {"params": params, "grad_mismatch": mismatch, "ref_loss": float(ref_loss)}
        if losses:
            result["loss"] = float(sum(float(x) for x in losses) / n)
        Path(out_dir, f"stage{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def verify_pipeline(plan: Plan, source: str) -> PipelineReport:
    """Run `plan`'s stage split with torch.distributed.pipelining and compare with the unsharded step."""
    import torch.multiprocessing as mp

    world = len(plan.stages)
    report = PipelineReport(world, plan.num_microbatches, boundaries(plan))
    if world > MAX_PROCESSES:
        report.note = f"{world} stages; verify starts one CPU process per stage, at most {MAX_PROCESSES}"
        return report
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_worker, args=(world, source, plan_to_dict(plan), report.boundaries, tmp),
                     nprocs=world, join=True)
        except Exception as err:  # a worker's failure arrives as ProcessRaisedException with its traceback
            report.note = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            return report
        results = [json.loads(Path(tmp, f"stage{k}.json").read_text()) for k in range(world)]
    last = results[-1]
    close = math.isclose(last["loss"], last["ref_loss"], rel_tol=RTOL, abs_tol=ATOL)
    report.checks.append(Check("loss", close, f"pipelined {last['loss']:.6g}, unsharded {last['ref_loss']:.6g}"))
    bad = [m for r in results for m in r["grad_mismatch"]]
    total = sum(r["params"] for r in results)
    report.checks.append(Check("gradients", not bad, f"{total - len(bad)} of {total} parameters match"
                               + (f"; worst {bad[0][0]} (max abs diff {bad[0][1]:.3g})" if bad else "")))
    return report
