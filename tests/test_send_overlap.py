"""Pipeline sends overlapped with compute where the schedule allows (docs/COSTMODEL.md §5b "Pipeline sends"):
the interleaved schedule's point-to-point transfers run on their own stream (Megatron's overlapped p2p, which
Megatron-Bridge turns on exactly when the pipeline is virtual), 1F1B's stay on the critical path.

Per chunk, with a round trip of 2p (activations out, gradient back): the activations travel while the device
runs a backward b, the gradient while it runs a forward f, so compute hides 2p − max(0, p − b) − max(0, p − f);
the pipeline's fill still waits for every chunk boundary's full round trip.
"""

from __future__ import annotations

import random

import pytest

from partopt.cluster import preset
from partopt.evaluate import uniform
from partopt.layering import Layering
from partopt.models import gpt
from partopt.pricing import LayerCost
from partopt.schedules import iteration_time
from partopt.simulate import StageTimes, simulate
from partopt.stages import End, Pipeline, hidden_send, totals


@pytest.mark.parametrize("forward, backward, hidden", [
    (3e-3, 4e-3, 2e-3),  # one way 1 ms under both: all of the 2 ms hidden
    (3e-3, 0.5e-3, 1.5e-3),  # the activations outlast the backward by 0.5 ms
    (0.2e-3, 0.5e-3, 0.7e-3),  # both exposed: 0.8 and 0.5 ms of the 2 ms
])
def test_a_round_trip_hides_under_the_next_backward_and_forward(forward, backward, hidden):
    assert hidden_send(2e-3, forward, backward) == pytest.approx(hidden, rel=1e-12)


def test_a_chunk_hides_its_own_point_to_point_sends_and_only_when_overlapping():
    """Two DP layers on whole p3 nodes (one 3.125 GB/s NIC a node, 20 µs): 512 KiB per microbatch out of layer 0,
    one path (the node's NIC), so 2p = 2 (512 KiB / 3.125 GB/s + 20 µs) by hand, tp 1 (no gathers)."""
    cluster = preset("p3.16xlarge", 2)
    layering = Layering(base=[[], []], groups=[(0, 0), (1, 1)])
    nbytes = 512 * 1024
    rt = 2 * (nbytes / 3.125e9 + 2e-5)
    row = [LayerCost(1e-3, 0.0, 0.0, 0.0, 0.0, None, forward_s=0.1e-3, backward_s=0.3e-3)] * 2
    end = End((1, 8), (8, 1))
    for overlap in (False, True):
        pipe = Pipeline(layering, [8 * nbytes, 0.0], 4, 32, {}, cluster, overlap)
        sums = totals(row, pipe, 0, 0, end, chunk=True)
        assert sums.send_s == pytest.approx(rt, rel=1e-12)
        expected = hidden_send(rt, 0.1e-3, 0.3e-3) if overlap else 0.0  # p ≈ 188 µs: 88 µs and 0 exposed
        assert sums.hidden_s == pytest.approx(expected, rel=1e-12)
        assert sums.p2p_s == (rt if overlap else 0.0)
        assert sums.latency_s == pytest.approx(1e-3 + rt - expected, rel=1e-12)
        assert totals(row, pipe, 0, 0, end).hidden_s == 0.0  # a 1F1B stage: its sends stay exposed
    assert hidden_send(rt, 0.1e-3, 0.3e-3) == pytest.approx(rt - (rt / 2 - 0.1e-3), rel=1e-12)  # the gradient's 88 µs


def _closed_form(stages: list[StageTimes], B: int, v: int) -> float:
    """The interleaved closed form with overlapped sends: per stage, each of its chunk boundaries (v, the last
    stage's v − 1 over the wrap-around link) adds its round trip less what the chunk's compute hides; the
    fill adds every boundary's round trip once."""
    wrap = max(s.send_s for s in stages)
    times, fill = [], 0.0
    for i, s in enumerate(stages):
        boundaries, p = (v, s.send_s) if i < len(stages) - 1 else (v - 1, wrap)
        exposed = 2 * p - hidden_send(2 * p, s.forward_s / v, s.backward_s / v)
        times.append(s.forward_s + s.backward_s + boundaries * exposed)
        fill += boundaries * 2 * p
    return iteration_time(times, times, 0.0, B, "interleaved", v, fill_s=fill)


def test_the_overlapped_closed_form_is_the_simulated_time_when_sends_hide():
    """Uniform stages f = 1, b = 2, one-way sends 0.3 under every chunk's f/v = 0.5 and b/v = 1: the steady state
    is the ideal (B + (S − 1)/v)·3 = 28.5 and the fill adds the 2(S·v − 1) = 14 one-way sends, 4.2 (by hand)."""
    stages = [StageTimes(1.0, 2.0, 0.3)] * 3 + [StageTimes(1.0, 2.0)]
    assert simulate(stages, 8, "interleaved", 2).iteration_time_s == pytest.approx(32.7, rel=1e-12)
    assert _closed_form(stages, 8, 2) == pytest.approx(32.7, rel=1e-12)


def test_the_overlapped_closed_form_bounds_the_simulation_when_backward_is_a_multiple_of_forward():
    """T ≤ C on random pipelines with b_i = r·f_i (the condition under which the additive form bounds it, §5b),
    sends of any size, some hidden, some not (random tests, not a proof)."""
    rng = random.Random(7)
    for _ in range(400):
        S, v, r = rng.randint(2, 4), rng.randint(2, 3), rng.choice([1.0, 2.0, rng.uniform(0.5, 3.0)])
        B = S * rng.randint(1, 4)
        stages = [StageTimes(f, r * f, rng.choice([0.0, rng.uniform(0, 0.3), rng.uniform(0, 2)]) if i < S - 1 else 0.0)
                  for i, f in enumerate(rng.uniform(0.2, 2.0) for _ in range(S))]
        assert simulate(stages, B, "interleaved", v).iteration_time_s <= _closed_form(stages, B, v) * (1 + 1e-12)


def test_an_interleaved_plan_across_nodes_hides_sends_and_no_overlap_keeps_them():
    """Megatron's pp 2 · v 2 on two p3 nodes (its sends through each node's one NIC): overlapped, every chunk that
    sends records its round trip and the part hidden, its stage time drops by that part, and the iteration adds the
    round trips once (the fill); with `overlap=False` and under 1F1B the sends stay whole."""
    graph = gpt(hidden=512, layers=8, heads=8, seq=128, vocab=1024, batch=32, name="gpt-512")
    cluster = preset("p3.16xlarge", 2)
    plan = uniform(graph, cluster, 8, 2, 1, 8, schedule="interleaved", virtual_stages=2, recompute="none")
    senders = plan.stages[:-1]
    for s in senders:
        bd = s.breakdown
        assert 0 < bd["send_hidden_s"] <= bd["send_p2p_s"] <= s.send_time_s
    assert "send_p2p_s" not in plan.stages[-1].breakdown
    times = [plan.stages[i].stage_time_s + plan.stages[i + 2].stage_time_s for i in range(2)]
    sync = max(plan.stages[i].sync_time_s + plan.stages[i + 2].sync_time_s for i in range(2))
    fill = sum(s.breakdown["send_p2p_s"] for s in senders)
    assert plan.iteration_time_s == pytest.approx(sum(times) / 2 + fill + (8 - 1 / 2) * max(times) + sync, rel=1e-12)
    for other in (uniform(graph, cluster, 8, 2, 1, 8, schedule="interleaved", virtual_stages=2, recompute="none",
                          overlap=False), uniform(graph, cluster, 8, 2, 1, 8, schedule="1f1b", recompute="none")):
        assert all("send_hidden_s" not in s.breakdown for s in other.stages)
