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
from partopt.verify_torch import ATOL, MAX_PROCESSES, RTOL, Check, _build, _step, finish, rendezvous, spawn


@dataclass
class PipelineReport:
    """The pipelined step against the unsharded one (no checks, and a note, when it could not run)."""

    stages: int
    microbatches: int
    boundaries: list[str]
    checks: list[Check] = field(default_factory=list)
    note: str | None = None
    tied: dict[str, list[str]] = field(default_factory=dict)  # tied parameter -> its copies, "stage:name"

    def lines(self) -> list[str]:
        head = (f"pipeline: {self.stages} stages split at {', '.join(self.boundaries)}, {self.microbatches} "
                f"microbatch{'' if self.microbatches == 1 else 'es'} (GPipe, {self.stages} gloo processes)")
        if self.note:
            return [head, f"  not run: {self.note}"]
        tied = [f"  tied {fqn}: copies {', '.join(held)}, gradients summed by an all-reduce between stages "
                f"{' and '.join(sorted({h.partition(':')[0] for h in held}))}" for fqn, held in self.tied.items()]
        return [head] + tied + [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]


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
        first_name = _first_names(model)
        tied = _sum_tied_copies(pipe, world, rank, first_name)
        mismatch, seen = [], set()
        for name, p in pipe.get_stage_module(rank).named_parameters():
            fqn = first_name.get(name.removeprefix("inner."), name.removeprefix("inner."))
            if fqn in seen:  # a stage holding two names of one tied parameter: one copy
                continue
            seen.add(fqn)
            ref = ref_grads[fqn]
            if p.grad is None or not torch.allclose(p.grad, ref, rtol=RTOL, atol=ATOL):
                worst = float("inf") if p.grad is None else float((p.grad - ref).abs().max())
                mismatch.append((fqn, worst))
        result = {"params": len(seen), "grad_mismatch": mismatch, "ref_loss": float(ref_loss), "tied": tied}
        if losses:
            result["loss"] = float(sum(float(x) for x in losses) / n)
        Path(out_dir, f"stage{rank}.json").write_text(json.dumps(result))
        finish(rank, world, out_dir)
    finally:
        dist.destroy_process_group()


def _first_names(model: Any) -> dict[str, str]:
    """Every name of a tied parameter (GPT-2's lm_head.weight) -> its first name (transformer.wte.weight),
    the one the frontend keeps and the unsharded step's gradients are keyed by."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(p), name) for name, p in model.named_parameters(remove_duplicate=False)}


def _sum_tied_copies(pipe: Any, world: int, rank: int, first_name: dict[str, str]) -> dict[str, list[str]]:
    """Sum the gradients of a tied parameter's copies over the stages holding one (Megatron's embedding
    all-reduce between the first and last stage) and give the sum to every copy; returns, per tied
    parameter held by several stages, its copies as "stage:name" (the splitter may leave a stage an
    unused second name of it). Every process calls it: process groups are made collectively."""
    import torch
    import torch.distributed as dist

    copies: dict[str, list[tuple[int, str]]] = {}
    for k in range(world):
        for name, _ in pipe.get_stage_module(k).named_parameters():
            local = name.removeprefix("inner.")
            copies.setdefault(first_name.get(local, local), []).append((k, local))
    tied = {fqn: held for fqn, held in sorted(copies.items()) if len({k for k, _ in held}) > 1}
    params = dict(pipe.get_stage_module(rank).named_parameters())
    for fqn, held in tied.items():
        ranks = sorted({k for k, _ in held})
        group = dist.new_group(ranks)  # every process makes every group, in the same order
        mine = [params["inner." + local] for k, local in held if k == rank]
        if mine:
            total = sum((p.grad for p in mine if p.grad is not None), torch.zeros_like(mine[0]))
            dist.all_reduce(total, group=group)
            for p in mine:
                p.grad = total.clone()
    return {fqn: [f"{k}:{local}" for k, local in held] for fqn, held in tied.items()}


def verify_pipeline(plan: Plan, source: str) -> PipelineReport:
    """Run `plan`'s stage split with torch.distributed.pipelining and compare with the unsharded step."""
    world = len(plan.stages)
    report = PipelineReport(world, plan.num_microbatches, boundaries(plan))
    if world > MAX_PROCESSES:
        report.note = f"{world} stages; verify starts one CPU process per stage, at most {MAX_PROCESSES}"
        return report
    with tempfile.TemporaryDirectory() as tmp:
        try:
            spawn(_worker, (world, source, plan_to_dict(plan), report.boundaries, tmp), world, tmp)
        except Exception as err:  # a worker's failure arrives as ProcessRaisedException with its traceback
            report.note = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            return report
        results = [json.loads(Path(tmp, f"stage{k}.json").read_text()) for k in range(world)]
    last = results[-1]
    report.tied = last["tied"]
    close = math.isclose(last["loss"], last["ref_loss"], rel_tol=RTOL, abs_tol=ATOL)
    report.checks.append(Check("loss", close, f"pipelined {last['loss']:.6g}, unsharded {last['ref_loss']:.6g}"))
    bad = [m for r in results for m in r["grad_mismatch"]]
    total = sum(r["params"] for r in results)
    report.checks.append(Check("gradients", not bad, f"{total - len(bad)} of {total} parameters match"
                               + (f"; worst {bad[0][0]} (max abs diff {bad[0][1]:.3g})" if bad else "")))
    return report
