"""The published systems partopt is compared against, as plans: Megatron-LM's best uniform
(tp, pp, dp, microbatches) grid point, DeepSpeed-style one data-parallel stage with ZeRO, and
PP-DP (a pipeline of plain data-parallel stages). Each returns a `Plan` under partopt's cost
model, so it can be written, evaluated, explained and compared like partopt's own."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence

from partopt import costmodel, pricing
from partopt.cluster import Cluster, divisors
from partopt.errors import InfeasibleError, InstanceError
from partopt.evaluate import uniform
from partopt.graph import Graph
from partopt.inter import optimize
from partopt.plan import Plan


# Megatron-LM's standard features besides the (tp, pp, dp) grid that the search tries at each grid point: sequence
# parallelism (with tp > 1), the distributed optimizer, ZeRO-1 (with dp > 1), and the interleaved schedule (with pp > 1,
# each v of `--num-layers-per-virtual-pipeline-stage` that splits a stage's layers evenly). Megatron-LM as Alpa ran it
# had none of them (the first two did not exist yet; Alpa's benchmark_gpt_bert_one_case.py passes no virtual stages):
# its reproduction passes none (`partopt.bench.alpa`).
MEGATRON_FEATURES = ("sequence_parallel", "distributed_optimizer", "interleaved")


def megatron(graph: Graph, cluster: Cluster, max_microbatch: int = 32,
             features: Sequence[str] = MEGATRON_FEATURES, **options) -> Plan:
    """The best Megatron-style uniform plan over the (tp ≤ node, pp, dp, microbatches) grid, each grid point with and
    without each of `features` that applies there (`MEGATRON_FEATURES`; the interleaved schedule with each of its v),
    its parameter state laid out as Megatron-LM keeps it (`state_layout` "megatron": fp32 gradients;
    docs/COSTMODEL.md §5) unless `options` say otherwise.

    A grid point whose parameter state split only by tp·pp (and the optimizer's by dp as well, with the distributed
    optimizer) exceeds the device is skipped unpriced; the others search their microbatch count (`_fastest_count`).
    `options` are `evaluate.uniform`'s keywords (backend, time_limit_s, memory_reserve, recompute, state_layout), and
    `schedule`: "auto" (the default: 1F1B, and interleaved with that feature), "1f1b" or "interleaved" alone.
    """
    unknown = sorted(set(features) - set(MEGATRON_FEATURES))
    if unknown:
        raise InstanceError(f"unknown Megatron-LM feature {unknown[0]!r}", "features",
                            f"use some of {', '.join(MEGATRON_FEATURES)}")
    schedule = options.pop("schedule", "auto")
    if schedule not in ("auto", "1f1b", "interleaved"):
        raise InstanceError(f"Megatron's grid runs 1f1b and interleaved, not {schedule}", "schedule",
                            "use auto, 1f1b or interleaved, or price a uniform plan of it by `evaluate.uniform`")
    start = time.perf_counter()
    g, m = cluster.num_devices, cluster.devices_per_node
    layers = len(graph.layers)
    options.setdefault("state_layout", "megatron")
    cache: dict = {}  # every layer ILP of the grid, solved once (its keys hold the layout and options)
    state = costmodel.param_memory(graph.num_params, graph.dtype, graph.optimizer, options["state_layout"])
    points = []  # (tp, pp, dp, sequence parallel, distributed optimizer, v)
    for tp in (t for t in divisors(g) if t <= m):
        for pp in (p for p in divisors(g // tp) if layers % p == 0):
            dp = g // (tp * pp)
            if (tp * dp) % m and m % (tp * dp):
                continue
            for sp, zero in itertools.product((False, True), repeat=2):
                if (sp and (tp == 1 or "sequence_parallel" not in features)
                        or zero and (dp == 1 or "distributed_optimizer" not in features)):
                    continue
                kept = state.weights + state.grads + state.optimizer / (dp if zero else 1)
                if kept / (tp * pp) > cluster.device.memory_bytes:
                    continue
                points += [(tp, pp, dp, sp, zero, v) for v in _virtual_stages(layers, pp, features, schedule)]
    # 1F1B's points first: the best of them is the bar the interleaved ones, priced up to v times as often, must beat
    points.sort(key=lambda point: point[-1] > 1)
    best: Plan | None = None
    last_error: InfeasibleError | None = None
    for tp, pp, dp, sp, zero, v in points:
        plan, error = _fastest_count(graph, cluster, tp, pp, dp, max_microbatch,
                                     best.iteration_time_s if best is not None else math.inf, zero=zero,
                                     sequence_parallel=sp, virtual_stages=v, cache=cache,
                                     schedule="interleaved" if v > 1 else "1f1b", **options)
        last_error = error or last_error
        if plan is not None and (best is None or plan.iteration_time_s < best.iteration_time_s):
            best = plan
    if best is None:
        raise last_error or InfeasibleError("no Megatron grid point fits", graph.name, "use more GPUs")
    # the grid's own account, not its best point's: every ILP it solved, its whole time, what it searched
    best.solver.update(ilps=len(cache), timeouts=sum(map(pricing.stopped, cache.values())),
                       time_s=time.perf_counter() - start, search=[
        f"Megatron-LM's grid: the best of {len(points)} layouts (tp, pp, dp, features), each over its microbatch counts",
        f"features: {', '.join(features) or 'none (Megatron-LM as Alpa ran it)'}; schedule: {schedule}"])
    return best


def _virtual_stages(layers: int, pp: int, features: Sequence[str], schedule: str) -> list[int]:
    """The v a grid point of `pp` stages runs under `schedule` (of `megatron`): 1 (1F1B) but when interleaved alone,
    and, when interleaved alone or with the interleaved feature, every v > 1 that splits each stage's layers into v
    equal chunks (Megatron-LM's `--num-layers-per-virtual-pipeline-stage`; none at pp 1). Every one: the time is
    not unimodal in v, as a device's activations in flight (pp + (pp - 1) / v stages' worth on the first) are the
    most at v = 2 (Llama-2 70B on 8 DGX A100s, tp 4 · pp 4: v 2 is slower than 1F1B, v 4 faster)."""
    interleaved = schedule == "interleaved" or schedule == "auto" and "interleaved" in features
    return ([1] if schedule != "interleaved" else []) + (
        [v for v in divisors(layers // pp) if v > 1] if interleaved and pp > 1 else [])


def _fastest_count(graph: Graph, cluster: Cluster, tp: int, pp: int, dp: int, max_microbatch: int, bar: float,
                   **options) -> tuple[Plan | None, InfeasibleError | None]:
    """One grid point's fastest plan over its microbatch count, and the error that ended the search if any: the
    per-rank microbatch grows through the powers of two (1 … `max_microbatch`, at least pp microbatches, a multiple
    of pp when interleaved, as Megatron-LM requires) until the plan stops fitting or gets slower. The iteration time
    (B + (pp - 1) / v)·(a + c·mb) + sync with B = batch / mb is convex in mb, and memory only grows with it. A count
    whose lower bound does not beat `bar` (the grid's best so far) or this point's best is not priced (`uniform`'s
    `bar`); no plan when every count was so."""
    batch = graph.dims[graph.batch_dim]
    interleaved = options.get("schedule") == "interleaved"
    best, previous = None, math.inf
    for count in sorted((c for c in (2**e for e in range(batch.bit_length()))
                         if c >= pp and batch % c == 0 and (batch // c) % dp == 0
                         and batch // c // dp <= max_microbatch and not (interleaved and c % pp)), reverse=True):
        own = best.iteration_time_s if best is not None else math.inf
        try:
            plan = uniform(graph, cluster, tp, pp, dp, count, bar=min(bar, own), **options)
        except InfeasibleError as err:
            return best, err
        if plan is None:  # its lower bound does not beat the bar
            if own <= bar:
                break  # nor this point's best: past it, as a slower plan is
            continue  # nor the grid's best, which a larger microbatch may still beat
        if plan.iteration_time_s > previous:
            break
        previous = plan.iteration_time_s
        if best is None or plan.iteration_time_s < best.iteration_time_s:
            best = plan
    return best, None


def megatron_grid_point(plan: Plan) -> str:
    """'tp 2 · pp 4 · dp 1 · B 64' of a uniform plan, with its features ('· sequence parallel', '· distributed
    optimizer', '· interleaved v 2') when it uses them."""
    tp_dp = plan.stages[0].logical_mesh
    layout = plan.options.get("megatron", {})
    v = plan.virtual_stages
    features = [name for key, name in (("sequence_parallel", "sequence parallel"), ("zero", "distributed optimizer"))
                if layout.get(key)] + ([f"interleaved v {v}"] if plan.schedule == "interleaved" else [])
    return " · ".join([f"tp {tp_dp[1]} · pp {len(plan.stages) // v} · dp {tp_dp[0]} · B {plan.num_microbatches}",
                       *features])


def deepspeed(graph: Graph, cluster: Cluster, **options) -> Plan:
    """DeepSpeed-style: one stage on every device, data parallel with ZeRO (`optimize`'s keywords)."""
    return optimize(graph, cluster, data_parallel_only=True, **options)


def ppdp(graph: Graph, cluster: Cluster, **options) -> Plan:
    """PP-DP: the stage DP over plain data-parallel stages, no ZeRO (`optimize`'s keywords)."""
    return optimize(graph, cluster, stage_data_parallel=True, **options)


BASELINES: dict[str, Callable[..., Plan]] = {"megatron": megatron, "deepspeed": deepspeed, "ppdp": ppdp}
