"""Pipeline simulation: hand-traced schedules, closed forms (uniform, GPipe flow shop), bounds, memory, errors.

Random instances use multiples of 1/4 s so that float sums are exact and equalities can be asserted exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partopt.errors import InstanceError
from partopt.schedules import inflight, iteration_time
from partopt.simulate import Event, StageTimes, closed_form, closed_form_inputs, simulate

QUARTERS = st.integers(0, 40).map(lambda q: q / 4)
FAST = settings(max_examples=40, deadline=None)


@st.composite
def pipelines(draw, max_stages: int = 6, max_microbatches: int = 16, sends: bool = True):
    """A random pipeline (with sends on all but the last stage, if asked) and a microbatch count."""
    n = draw(st.integers(1, max_stages))
    stages = [StageTimes(draw(QUARTERS), draw(QUARTERS), draw(QUARTERS) if sends and i < n - 1 else 0.0,
                         activation_bytes=draw(st.integers(0, 100)), static_bytes=draw(st.integers(0, 1000)))
              for i in range(n)]
    return stages, draw(st.integers(1, max_microbatches))


def _times(sim, stage: int) -> list[tuple[str, int, float, float]]:
    """One stage's events in execution order."""
    return [(e.kind, e.microbatch, e.start_s, e.end_s) for e in sim.events if e.stage == stage]


def _lower_bound(stages: list[StageTimes], b: int) -> float:
    """max_k sum_{j<k} t_j + B (f_k + b_k): reach stage k, do its work, send the last gradient home."""
    return max(sum(s.latency_s for s in stages[:k]) + b * (stages[k].forward_s + stages[k].backward_s)
               for k in range(len(stages)))


# ---------------------------------------------------------------- closed forms


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("f, b, microbatches", [(1.0, 2.0, 1), (0.5, 1.5, 7), (3.0, 0.0, 4)])
def test_single_stage_runs_every_microbatch_back_to_back(schedule, f, b, microbatches):
    sim = simulate([StageTimes(f, b)], microbatches, schedule)
    assert sim.iteration_time_s == microbatches * (f + b)
    assert closed_form([StageTimes(f, b)], microbatches) == microbatches * (f + b)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages, microbatches", [(2, 1), (4, 4), (4, 9), (6, 3)])
def test_uniform_stages_take_s_plus_b_minus_1_slots(schedule, num_stages, microbatches):
    # sum t_i + (B-1) max t_i = S t + (B-1) t = (S + B - 1)(f + b)
    stages = [StageTimes(1.25, 2.5)] * num_stages
    expected = (num_stages + microbatches - 1) * 3.75
    assert closed_form(stages, microbatches) == expected
    assert simulate(stages, microbatches, schedule).iteration_time_s == expected


def test_closed_form_counts_each_send_twice():
    stages = [StageTimes(1.0, 2.0, 0.5), StageTimes(3.0, 1.0)]  # t = (4, 4)
    assert closed_form(stages, 3) == 4 + 4 + 2 * 4


@FAST
@given(pipelines(), st.sampled_from(["1f1b", "gpipe"]))
def test_one_microbatch_takes_the_sum_of_stage_latencies(case, schedule):
    stages, _ = case
    assert simulate(stages, 1, schedule).iteration_time_s == sum(s.latency_s for s in stages)


@FAST
@given(pipelines())
def test_gpipe_is_two_flow_shops(case):
    # forward phase: B identical jobs through stages and links: sum + (B-1) * largest machine; backward alike
    stages, b = case
    sends = [s.send_s for s in stages[:-1]]
    expected = (sum(s.latency_s for s in stages)
                + (b - 1) * (max([s.forward_s for s in stages] + sends) + max([s.backward_s for s in stages] + sends)))
    assert simulate(stages, b, "gpipe").iteration_time_s == expected


# ---------------------------------------------------------------- how 1F1B compares with the closed form


@FAST
@given(pipelines(sends=False), st.integers(1, 4))
def test_1f1b_with_equal_backward_forward_ratio_is_bounded_by_the_closed_form(case, ratio):
    stages, b = case
    stages = [StageTimes(s.forward_s, ratio * s.forward_s) for s in stages]
    sim = simulate(stages, b).iteration_time_s
    assert _lower_bound(stages, b) <= sim <= closed_form(stages, b)


@FAST
@given(pipelines(sends=False), st.integers(1, 4))
def test_1f1b_equals_closed_form_when_the_last_stage_is_the_bottleneck(case, ratio):
    stages, b = case
    slowest = max(s.forward_s for s in stages)
    stages = [StageTimes(s.forward_s, ratio * s.forward_s) for s in stages[:-1]] + [StageTimes(slowest, ratio * slowest)]
    assert simulate(stages, b).iteration_time_s == closed_form(stages, b)


@FAST
@given(pipelines(), st.data())
def test_1f1b_never_exceeds_closed_form_when_one_machine_is_slowest_both_ways(case, data):
    stages, b = case
    k = data.draw(st.integers(0, len(stages) - 1))
    sends = [s.send_s for s in stages]
    slow = StageTimes(max([s.forward_s for s in stages] + sends), max([s.backward_s for s in stages] + sends),
                      stages[k].send_s)
    stages = stages[:k] + [slow] + stages[k + 1:]
    assert simulate(stages, b).iteration_time_s <= closed_form(stages, b)


@FAST
@given(pipelines(), st.sampled_from(["1f1b", "gpipe"]))
def test_no_schedule_beats_the_per_stage_lower_bound(case, schedule):
    stages, b = case
    assert simulate(stages, b, schedule).iteration_time_s >= _lower_bound(stages, b)


@FAST
@given(pipelines(sends=False))
def test_without_sends_1f1b_is_never_slower_than_gpipe(case):
    stages, b = case
    assert simulate(stages, b, "1f1b").iteration_time_s <= simulate(stages, b, "gpipe").iteration_time_s


def test_early_bottleneck_hides_downstream_latency():
    # f = (2, 1), b = (4, 2), B = 2, by hand. Stage 0: F0 0-2, F1 2-4, then waits for B0 from stage 1.
    # Stage 1: F0 2-3, B0 3-5, F1 5-6, B1 6-8. Stage 0: B0 5-9, B1 9-13. Closed form 9 + 6 = 15.
    stages = [StageTimes(2.0, 4.0), StageTimes(1.0, 2.0)]
    sim = simulate(stages, 2)
    assert _times(sim, 0) == [("forward", 0, 0, 2), ("forward", 1, 2, 4), ("backward", 0, 5, 9), ("backward", 1, 9, 13)]
    assert _times(sim, 1) == [("forward", 0, 2, 3), ("backward", 0, 3, 5), ("forward", 1, 5, 6), ("backward", 1, 6, 8)]
    assert sim.iteration_time_s == 13.0
    assert closed_form(stages, 2) == 15.0


def test_1f1b_can_exceed_closed_form_when_forward_and_backward_bottlenecks_differ():
    # f = (0, 1, 0), b = (3, 1, 0), B = 2: stage 1 runs F0 0-1, F1 1-2, B0 2-3, B1 3-4; stage 0 then
    # B0 3-6, B1 6-9. Closed form: t = (3, 2, 0) -> 5 + 3 = 8.
    stages = [StageTimes(0.0, 3.0), StageTimes(1.0, 1.0), StageTimes(0.0, 0.0)]
    sim = simulate(stages, 2)
    assert _times(sim, 0)[2:] == [("backward", 0, 3, 6), ("backward", 1, 6, 9)]
    assert sim.iteration_time_s == 9.0
    assert closed_form(stages, 2) == 8.0


def test_sends_serialise_on_their_link_and_can_make_1f1b_slower_than_gpipe():
    # f = (0, 1), b = (1, 1), send 1, B = 3, traced by hand. The forward link is busy 0-1 with
    # microbatch 0, so microbatch 1 (ready at 0) arrives at 2, not 1.
    stages = [StageTimes(0.0, 1.0, 1.0), StageTimes(1.0, 1.0)]
    pipelined = simulate(stages, 3, "1f1b")
    assert _times(pipelined, 0) == [("forward", 0, 0, 0), ("forward", 1, 0, 0), ("backward", 0, 4, 5),
                                    ("forward", 2, 5, 5), ("backward", 1, 6, 7), ("backward", 2, 9, 10)]
    assert _times(pipelined, 1) == [("forward", 0, 1, 2), ("backward", 0, 2, 3), ("forward", 1, 3, 4),
                                    ("backward", 1, 4, 5), ("forward", 2, 6, 7), ("backward", 2, 7, 8)]
    flushed = simulate(stages, 3, "gpipe")
    assert _times(flushed, 1) == [("forward", 0, 1, 2), ("forward", 1, 2, 3), ("forward", 2, 3, 4),
                                  ("backward", 0, 4, 5), ("backward", 1, 5, 6), ("backward", 2, 6, 7)]
    assert _times(flushed, 0)[3:] == [("backward", 0, 6, 7), ("backward", 1, 7, 8), ("backward", 2, 8, 9)]
    assert (pipelined.iteration_time_s, flushed.iteration_time_s) == (10.0, 9.0)


# ---------------------------------------------------------------- schedule structure and dependencies


@pytest.mark.parametrize("num_stages, microbatches", [(4, 6), (4, 2), (1, 3)])
def test_1f1b_order_is_warmup_then_alternate_then_drain(num_stages, microbatches):
    sim = simulate([StageTimes(1.0, 2.0)] * num_stages, microbatches)
    for i in range(num_stages):
        order = [(kind[0], m) for kind, m, _, _ in _times(sim, i)]
        w = min(num_stages - i, microbatches)
        expected = [("f", m) for m in range(w)]
        for m in range(microbatches - w):
            expected += [("b", m), ("f", w + m)]
        expected += [("b", m) for m in range(microbatches - w, microbatches)]
        assert order == expected


def test_gpipe_order_is_all_forwards_then_backwards_in_microbatch_order():
    sim = simulate([StageTimes(1.0, 2.0)] * 3, 4, "gpipe")
    for i in range(3):
        assert [(kind, m) for kind, m, _, _ in _times(sim, i)] == [("forward", m) for m in range(4)] + [
            ("backward", m) for m in range(4)]


def test_events_are_the_documented_dataclass():
    event = simulate([StageTimes(1.0, 2.0)], 1).events[0]
    assert event == Event(stage=0, microbatch=0, kind="forward", start_s=0.0, end_s=1.0)


# ---------------------------------------------------------------- memory


@FAST
@given(pipelines())
def test_inflight_is_s_minus_i_for_1f1b_and_b_for_gpipe(case):
    stages, b = case
    n = len(stages)
    pipelined, flushed = simulate(stages, b, "1f1b"), simulate(stages, b, "gpipe")
    assert pipelined.max_inflight == [min(n - i, b) for i in range(n)]
    assert flushed.max_inflight == [b] * n
    for i, stage in enumerate(stages):
        assert pipelined.peak_memory_bytes[i] == stage.static_bytes + min(n - i, b) * stage.activation_bytes
        assert flushed.peak_memory_bytes[i] == stage.static_bytes + b * stage.activation_bytes
        assert flushed.peak_memory_bytes[i] >= pipelined.peak_memory_bytes[i]
        if b > n and stage.activation_bytes > 0:
            assert flushed.peak_memory_bytes[i] > pipelined.peak_memory_bytes[i]
        for sim in (pipelined, flushed):
            assert sim.memory[i][0] == (0.0, stage.static_bytes)
            assert sim.memory[i][-1][1] == stage.static_bytes  # every activation freed by the end


def test_memory_trace_by_hand():
    # Schedule of test_early_bottleneck_hides_downstream_latency; +10 bytes at each forward's end,
    # -10 at each backward's end.
    stages = [StageTimes(2.0, 4.0, activation_bytes=10, static_bytes=100),
              StageTimes(1.0, 2.0, activation_bytes=10, static_bytes=50)]
    sim = simulate(stages, 2)
    assert sim.memory[0] == [(0.0, 100), (2.0, 110), (4.0, 120), (9.0, 110), (13.0, 100)]
    assert sim.memory[1] == [(0.0, 50), (3.0, 60), (5.0, 50), (6.0, 60), (8.0, 50)]
    assert sim.peak_memory_bytes == [120, 60]
    assert sim.schedule == "1f1b"


# ---------------------------------------------------------------- errors and speed


@pytest.mark.parametrize("stages, microbatches, schedule, where", [
    ([StageTimes(1.0, 1.0)], 0, "1f1b", "microbatches"),
    ([StageTimes(1.0, 1.0)], 2.5, "1f1b", "microbatches"),
    ([StageTimes(1.0, 1.0)], True, "1f1b", "microbatches"),
    ([], 2, "1f1b", "stages"),
    ([StageTimes(1.0, -1.0)], 2, "1f1b", "stages[0].backward_s"),
    ([StageTimes(1.0, 1.0), StageTimes(math.nan, 1.0)], 2, "1f1b", "stages[1].forward_s"),
    ([StageTimes(1.0, 1.0, activation_bytes=math.inf)], 2, "1f1b", "stages[0].activation_bytes"),
    ([StageTimes(1.0, 1.0), StageTimes(1.0, 1.0, send_s=0.5)], 2, "1f1b", "stages[1].send_s"),
    ([StageTimes(1.0, 1.0)], 2, "zb-h2", "schedule"),
    ([StageTimes(1.0, 1.0)], 2, "interleaved", "virtual_stages"),  # v = 1
    ([StageTimes(1.0, 1.0, weight_s=1.5)], 2, "zero-bubble", "stages[0].weight_s"),
])
def test_bad_input_is_an_instance_error_naming_the_place(stages, microbatches, schedule, where):
    with pytest.raises(InstanceError) as caught:
        simulate(stages, microbatches, schedule)
    assert caught.value.where == where
    assert caught.value.hint
    assert "\n" not in caught.value.line()


def test_closed_form_rejects_bad_input_too():
    with pytest.raises(InstanceError):
        closed_form([StageTimes(1.0, 1.0)], 0)


def test_sixteen_stages_and_1024_microbatches_simulate_every_task():
    """The size the planner simulates (timings belong in benchmarks, not here): one forward and one backward
    per stage and microbatch under 1F1B."""
    stages = [StageTimes(1e-3 * (1 + i % 3), 2e-3 * (1 + i % 3), 1e-4 if i < 15 else 0.0, 1e8, 1e9) for i in range(16)]
    sim = simulate(stages, 1024)
    assert len(sim.events) == 2 * 16 * 1024


@pytest.mark.parametrize("schedule, v, microbatches, where", [
    ("1f1b", 2, 4, "virtual_stages"),
    ("interleaved", 0, 4, "virtual_stages"),
    ("interleaved", 2.0, 4, "virtual_stages"),
    ("interleaved", 2, 3, "microbatches"),  # Megatron-LM: B a multiple of the 2 stages
])
def test_virtual_stages_must_fit_the_schedule(schedule, v, microbatches, where):
    with pytest.raises(InstanceError) as caught:
        simulate([StageTimes(1.0, 1.0, 0.5), StageTimes(1.0, 1.0)], microbatches, schedule, v)
    assert caught.value.where == where and caught.value.hint


def test_a_negative_wrap_send_is_an_instance_error():
    with pytest.raises(InstanceError) as caught:
        simulate([StageTimes(1.0, 1.0, 0.5), StageTimes(1.0, 1.0)], 2, "interleaved", 2, wrap_send_s=-1.0)
    assert caught.value.where == "wrap_send_s"


# ---------------------------------------------------------------- interleaved 1F1B (Megatron-LM)


def _interleaved_lower_bound(stages: list[StageTimes], b: int, v: int) -> float:
    """max_k: chunk 0 reaches stage k through chunk 0 of every earlier stage, k works B (f_k + b_k), chunk 0's
    gradient walks back the same way."""
    return max(sum((s.forward_s + s.backward_s) / v + 2 * s.send_s for s in stages[:k])
               + b * (stages[k].forward_s + stages[k].backward_s) for k in range(len(stages)))


def test_interleaved_hand_example_p4_m8_v2():
    """p = 4 stages, m = 8 microbatches, v = 2 chunks, f = 1, b = 2 per stage (a chunk: 0.5 and 1).

    Ideal (no bubble): m (f + b) = 24 s. 1F1B's bubble (p - 1)(f + b) = 9 s = (p - 1)/m of the ideal:
    33 s. Interleaved: (p - 1)/(v m) = 3/16 of the ideal = 4.5 s, so 28.5 s = (m + (p - 1)/v)(f + b).
    In flight on stage 0: Megatron's warm-up 2 (p - 1) + (v - 1) p = 10 chunk-microbatches, plus the
    one forward of the first steady step: 11 halves = 5.5 = p + (p - 1)/v (Korthikanti et al.'s
    p (1 + (p - 1)/(p v))); stage i: (2 (p - i - 1) + (v - 1) p + 1)/2 = 5.5, 4.5, 3.5, 2.5.
    """
    stages = [StageTimes(1.0, 2.0, activation_bytes=8, static_bytes=100)] * 4
    sim = simulate(stages, 8, "interleaved", 2)
    assert simulate(stages, 8, "1f1b").iteration_time_s == 24 + 9
    assert sim.iteration_time_s == 24 + 4.5
    assert closed_form(stages, 8, "interleaved", 2) == 28.5
    assert sim.max_inflight == [5.5, 4.5, 3.5, 2.5]
    assert [inflight(i, 4, 8, "interleaved", 2) for i in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert sim.peak_memory_bytes == [100 + 5.5 * 8, 100 + 4.5 * 8, 100 + 3.5 * 8, 100 + 2.5 * 8]
    assert len(sim.events) == 2 * 4 * 8 * 2  # every chunk of every microbatch, forward and backward
    assert {e.end_s - e.start_s for e in sim.events} == {0.5, 1.0}


def test_interleaved_order_on_stage_0_by_hand():
    # S = 2, v = 2, B = 4. Forward k runs chunk (k mod 4) // 2 of microbatch (k // 4) 2 + k mod 2; backward k
    # chunk 1 - (k mod 4) // 2. Warm-up on stage 0: 2 (2 - 0 - 1) + (2 - 1) 2 = 4 forwards, then F, B pairs.
    sim = simulate([StageTimes(1.0, 2.0)] * 2, 4, "interleaved", 2)
    order = [(e.kind[0], e.chunk, e.microbatch) for e in sim.events if e.stage == 0]
    assert order == [("f", 0, 0), ("f", 0, 1), ("f", 1, 0), ("f", 1, 1),
                     ("f", 0, 2), ("b", 1, 0), ("f", 0, 3), ("b", 1, 1),
                     ("f", 1, 2), ("b", 0, 0), ("f", 1, 3), ("b", 0, 1),
                     ("b", 1, 2), ("b", 1, 3), ("b", 0, 2), ("b", 0, 3)]


def test_interleaved_with_as_many_microbatches_as_stages_warms_up_completely():
    # Megatron-LM: B = S runs every forward first; each stage then holds all S v chunk-microbatches = S
    sim = simulate([StageTimes(1.0, 1.0)] * 3, 3, "interleaved", 2)
    for i in range(3):
        kinds = [e.kind for e in sim.events if e.stage == i]
        assert kinds == ["forward"] * 6 + ["backward"] * 6
    assert sim.max_inflight == [3.0, 3.0, 3.0] == [inflight(i, 3, 3, "interleaved", 2) for i in range(3)]


def test_interleaved_sends_each_boundary_of_every_chunk():
    """S = 2, v = 2, B = 2, no compute, sends of 1 s (the wrap-around link too): a microbatch crosses
    S v - 1 = 3 boundaries forward and 3 back; link 1 -> 0 carries the wrap-around forwards and the gradients.
    By hand (B = S: every forward first): forwards of chunk 0 reach stage 1 at 1, 2; wrap back at 2, 3; chunk 1
    reaches stage 1 at 3, 4. Stage 1 runs F(c1, m1) at 4 before B(c1, m0), so the gradients leave at 4, 4 and
    arrive at 5, 6 (queued); back to stage 1 at 6, 7; to stage 0 at 7, 8: 8 s. 1F1B: 1 boundary each way, 3 s."""
    stages = [StageTimes(0.0, 0.0, 1.0), StageTimes(0.0, 0.0)]
    assert simulate(stages, 2, "interleaved", 2).iteration_time_s == 8.0
    assert simulate(stages, 2, "1f1b").iteration_time_s == 3.0
    # the closed form charges each stage its v round trips: t = (2 v, 2 (v - 1)) = (4, 2) -> 6/2 + (2 - 1/2) 4
    assert closed_form_inputs(stages, "interleaved", 2)[0] == [4.0, 2.0]
    assert closed_form(stages, 2, "interleaved", 2) == 9.0


def test_one_interleaved_stage_runs_its_chunks_back_to_back_without_sends():
    # S = 1: v chunks on one device, no link: B (f + b) whatever the wrap-around send would cost
    stages = [StageTimes(1.0, 2.0)]
    assert simulate(stages, 3, "interleaved", 2, wrap_send_s=5.0).iteration_time_s == 9.0
    assert closed_form(stages, 3, "interleaved", 2, wrap_send_s=5.0) == 9.0


@st.composite
def interleaved_pipelines(draw, uniform: bool = False, sends: bool = True):
    """A pipeline for the interleaved schedule: v in {2, 4}, B a multiple of S, b = r f on every stage."""
    stages, _ = draw(pipelines(sends=sends))
    n, v, r = len(stages), draw(st.sampled_from([2, 4])), draw(st.integers(1, 3))
    if uniform:
        stages = [StageTimes(stages[0].forward_s, stages[0].backward_s)] * n
    else:
        stages = [StageTimes(s.forward_s, r * s.forward_s, s.send_s, s.activation_bytes, s.static_bytes) for s in stages]
    return stages, n * draw(st.integers(1, 4)), v


@FAST
@given(interleaved_pipelines(uniform=True))
def test_interleaved_uniform_stages_take_b_plus_s_minus_1_over_v_slots(case):
    # the bubble (S - 1)(f + b)/v is (S - 1)/(v B) of the ideal B (f + b)
    stages, b, v = case
    n, work = len(stages), stages[0].forward_s + stages[0].backward_s
    expected = (b + (n - 1) / v) * work
    assert simulate(stages, b, "interleaved", v).iteration_time_s == expected
    assert closed_form(stages, b, "interleaved", v) == expected


@FAST
@given(interleaved_pipelines())
def test_interleaved_is_bounded_by_its_closed_form_with_proportional_backwards(case):
    stages, b, v = case
    sim = simulate(stages, b, "interleaved", v).iteration_time_s
    assert _interleaved_lower_bound(stages, b, v) <= sim <= closed_form(stages, b, "interleaved", v)


@FAST
@given(interleaved_pipelines(sends=False))
def test_interleaving_never_slows_an_equal_ratio_pipeline_without_sends(case):
    stages, b, v = case
    assert simulate(stages, b, "interleaved", v).iteration_time_s <= simulate(stages, b, "1f1b").iteration_time_s


@FAST
@given(interleaved_pipelines())
def test_interleaved_inflight_is_megatrons_warmup_plus_one(case):
    stages, b, v = case
    n = len(stages)
    sim = simulate(stages, b, "interleaved", v)
    assert sim.max_inflight == [inflight(i, n, b, "interleaved", v) for i in range(n)]
    if b > n:  # Korthikanti et al.: the first stage holds p (1 + (p - 1)/(p v)) microbatches' activations
        assert sim.max_inflight[0] == n + (n - 1) / v
    for i, stage in enumerate(stages):
        assert sim.peak_memory_bytes[i] == stage.static_bytes + sim.max_inflight[i] * stage.activation_bytes
        assert sim.memory[i][-1][1] == stage.static_bytes


# ---------------------------------------------------------------- zero bubble (ZB-H1)


def test_zero_bubble_hand_example_a_third_of_1f1bs_bubble():
    """p = 4, m = 8, F = B = W = 1 s (backward 2 s, half of it the weight gradient).

    1F1B: (m + p - 1)(F + B + W) = 33 s, bubble (p - 1) 3 = 9 s. ZB-H1: bubble (p - 1)(F + B - W) = 3 s,
    a third: 24 + 3 = 27 s. Memory: every stage holds p = 4 microbatches at most, 1F1B's stage 0 too.
    """
    stages = [StageTimes(1.0, 2.0, weight_s=1.0)] * 4
    zb, one = simulate(stages, 8, "zero-bubble"), simulate(stages, 8, "1f1b")
    assert (zb.iteration_time_s, one.iteration_time_s) == (27.0, 33.0)
    assert closed_form(stages, 8, "zero-bubble") == 27.0
    assert zb.max_inflight == [4, 4, 4, 4] and max(zb.max_inflight) == max(one.max_inflight)
    assert {(e.kind, e.end_s - e.start_s) for e in zb.events} == {("forward", 1), ("backward", 1), ("weight", 1)}


def test_zero_bubble_order_defers_i_weight_passes_on_stage_i():
    # S = 3, B = 4. Stage 0: 1F1B's 3 warm-up forwards, then B W F in turn. Stage 2: 1 warm-up forward,
    # its first 2 W's deferred: B0 F1 B1 F2 B2 W0 F3 B3 W1, then W2 W3 at the tail.
    sim = simulate([StageTimes(1.0, 2.0, weight_s=1.0)] * 3, 4, "zero-bubble")
    order = {i: [f"{e.kind[0].upper()}{e.microbatch}" for e in sim.events if e.stage == i] for i in range(3)}
    assert order[0] == ["F0", "F1", "F2", "B0", "W0", "F3", "B1", "W1", "B2", "W2", "B3", "W3"]
    assert order[2] == ["F0", "B0", "F1", "B1", "F2", "B2", "W0", "F3", "B3", "W1", "W2", "W3"]


@st.composite
def split_pipelines(draw, uniform: bool = False, sends: bool = True):
    """A pipeline with a weight-gradient part w_i of each backward."""
    stages, b = draw(pipelines(sends=sends))
    if uniform:
        f, b_in, w = (draw(QUARTERS) for _ in range(3))
        return [StageTimes(f, b_in + w, weight_s=w)] * len(stages), b
    r = draw(st.integers(1, 4))  # b = r f, split evenly into B and W (a matmul's dX and dW GEMMs)
    return [StageTimes(s.forward_s, r * s.forward_s, s.send_s, s.activation_bytes, s.static_bytes,
                       weight_s=r * s.forward_s / 2) for s in stages], b


@FAST
@given(split_pipelines(uniform=True))
def test_zero_bubble_uniform_stages_match_the_closed_form(case):
    # (B + S - 1)(F + B + W) - (S - 1 + min(S, B) - 1) W: the 1F1B form less the W's the tails hide; exact
    # when W is no longer than F or B (the paper's F = B = W), else W' = min(F, B, W) is hidden: a bound
    stages, b = case
    n, (f, w) = len(stages), (stages[0].forward_s, stages[0].weight_s)
    b_in = stages[0].backward_s - w
    hidden = min(f, b_in, w)
    expected = (b + n - 1) * (f + b_in + w) - (n - 1 + min(n, b) - 1) * hidden
    assert closed_form(stages, b, "zero-bubble") == expected
    sim = simulate(stages, b, "zero-bubble").iteration_time_s
    assert sim <= expected
    if w <= min(f, b_in):
        assert sim == expected


@FAST
@given(split_pipelines())
def test_zero_bubble_is_bounded_by_its_closed_form_and_by_1f1b(case):
    stages, b = case
    sim = simulate(stages, b, "zero-bubble").iteration_time_s
    reach = max(sum(s.forward_s + s.send_s for s in stages[:k]) + b * (stages[k].forward_s + stages[k].backward_s)
                for k in range(len(stages)))
    assert reach <= sim <= closed_form(stages, b, "zero-bubble") <= closed_form(stages, b)
    assert sim <= simulate(stages, b, "1f1b").iteration_time_s


@FAST
@given(pipelines())
def test_zero_bubble_holds_min_s_b_and_frees_everything(case):
    stages, b = case
    n = len(stages)
    stages = [StageTimes(s.forward_s, s.backward_s, s.send_s, s.activation_bytes, s.static_bytes, s.backward_s / 2)
              for s in stages]
    sim = simulate(stages, b, "zero-bubble")
    assert sim.max_inflight == [min(n, b)] * n == [inflight(i, n, b, "zero-bubble") for i in range(n)]
    assert max(sim.max_inflight) == max(simulate(stages, b, "1f1b").max_inflight)
    for i, stage in enumerate(stages):
        assert sim.peak_memory_bytes[i] == stage.static_bytes + min(n, b) * stage.activation_bytes
        assert sim.memory[i][-1][1] == stage.static_bytes


# ---------------------------------------------------------------- every schedule


SCHEDULE_CASES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 4), ("zero-bubble", 1)]


@settings(max_examples=60, deadline=None)
@given(pipelines(), st.sampled_from(SCHEDULE_CASES))
def test_every_schedule_respects_stages_and_dependencies(case, schedule_v):
    stages, b = case
    schedule, v = schedule_v
    n = len(stages)
    if schedule == "interleaved":
        b = n * (1 + b % 3)
    stages = [StageTimes(s.forward_s, s.backward_s, s.send_s, s.activation_bytes, s.static_bytes, s.backward_s / 4)
              for s in stages]
    wrap = 0.75
    sim = simulate(stages, b, schedule, v, wrap_send_s=wrap)
    split = schedule == "zero-bubble"
    kinds = ("forward", "backward", "weight") if split else ("forward", "backward")
    by_task = {(e.stage, e.chunk, e.kind, e.microbatch): e for e in sim.events}
    assert len(by_task) == len(sim.events) == len(kinds) * n * v * b
    assert [e.start_s for e in sim.events] == sorted(e.start_s for e in sim.events)
    durations = {"forward": lambda s: s.forward_s / v, "weight": lambda s: s.weight_s,
                 "backward": (lambda s: s.backward_s - s.weight_s) if split else (lambda s: s.backward_s / v)}
    last = n * v - 1

    def task(u: int, kind: str, m: int) -> Event:
        return by_task[u % n, u // n, kind, m]

    def send(u: int, w: int) -> float:
        low, high = sorted((u % n, w % n))
        return 0.0 if low == high else stages[low].send_s if high - low == 1 else wrap

    for i, stage in enumerate(stages):
        mine = [e for e in sim.events if e.stage == i]
        for e in mine:
            assert e.end_s - e.start_s == durations[e.kind](stage)
        for before, after in itertools.pairwise(mine):
            assert after.start_s >= before.end_s  # one task at a time
    for u in range(last + 1):
        for m in range(b):
            fwd, bwd = task(u, "forward", m), task(u, "backward", m)
            assert bwd.start_s >= fwd.end_s
            if split:
                assert task(u, "weight", m).start_s >= bwd.end_s
            if u > 0:
                assert fwd.start_s >= task(u - 1, "forward", m).end_s + send(u - 1, u)
            if u < last:
                assert bwd.start_s >= task(u + 1, "backward", m).end_s + send(u, u + 1)
    assert sim.iteration_time_s == max(e.end_s for e in sim.events)


@FAST
@given(pipelines())
def test_gpipe_closed_form_is_exact_without_sends_and_a_bound_with_them(case):
    # schedules.iteration_time charges each send to its stage: max(f ∪ send) <= max (f + send), likewise b
    stages, b = case
    sim = simulate(stages, b, "gpipe").iteration_time_s
    assert sim <= closed_form(stages, b, "gpipe")
    if all(s.send_s == 0 for s in stages):
        assert sim == closed_form(stages, b, "gpipe")


def test_iteration_time_adds_the_sync_and_speaks_the_dps_numbers():
    # t = (4, 4), f + send = (1.5, 3), sync 7, B = 3: 1F1B 8 + 2·4 + 7 = 23
    assert iteration_time([4.0, 4.0], [1.5, 3.0], 7.0, 3, "1f1b") == 23.0
    # GPipe: 8 + 2 (max(1.5, 3) + max(2.5, 1)) + 7 = 26
    assert iteration_time([4.0, 4.0], [1.5, 3.0], 7.0, 3, "gpipe") == 26.0
    # interleaved, B = 4, v = 2: 8/2 + (4 - 1/2) 4 + 7 = 25
    assert iteration_time([4.0, 4.0], [1.5, 3.0], 7.0, 4, "interleaved", 2) == 25.0
    # zero-bubble, w = (1, 0.5): hidden min(w, f, t - f - w) = 0.5 on stage 1, times S - 1 + min(S, B) - 1 = 2
    assert iteration_time([4.0, 4.0], [1.5, 3.0], 7.0, 3, "zero-bubble", weight_times=[1.0, 0.5]) == 22.0


@pytest.mark.parametrize("call, where", [
    (lambda: iteration_time([1.0], [1.0, 2.0], 0.0, 2, "1f1b"), "stage_times"),
    (lambda: iteration_time([], [], 0.0, 2, "1f1b"), "stage_times"),
    (lambda: iteration_time([1.0, 1.0], [0.5, 0.5], 0.0, 2, "zero-bubble", weight_times=[0.1]), "weight_times"),
    (lambda: iteration_time([1.0, 1.0], [0.5, 0.5], 0.0, 3, "interleaved", 2), "microbatches"),
    (lambda: iteration_time([1.0, 1.0], [0.5, 0.5], 0.0, 2, "zero-bubble", weight_times=[0.1, 0.6]),
     "weight_times[1]"),
    (lambda: iteration_time([1.0], [0.5], 0.0, 0, "1f1b"), "microbatches"),
    (lambda: inflight(0, 0, 4, "interleaved", 2), "stages"),
    (lambda: inflight(2, 2, 4, "1f1b"), "stage"),
    (lambda: inflight(0, 2, 4, "zb"), "schedule"),
])
def test_closed_forms_reject_bad_input_naming_the_place(call, where):
    with pytest.raises(InstanceError) as caught:
        call()
    assert caught.value.where == where and caught.value.hint


def test_new_schedules_run_the_tasks_they_split_into():
    # 16 stages, 1024 microbatches: 1F1B runs 32 Ki tasks (F, B), zero-bubble 48 Ki (F, B, W), interleaved (v = 2)
    # 64 Ki (F and B of two chunks per stage)
    stages = [StageTimes(1e-3 * (1 + i % 3), 2e-3 * (1 + i % 3), 1e-4 if i < 15 else 0.0, 1e8, 1e9, 1e-3)
              for i in range(16)]
    assert len(simulate(stages, 1024, "1f1b").events) == 2 * 16 * 1024
    assert len(simulate(stages, 1024, "zero-bubble").events) == 3 * 16 * 1024
    assert len(simulate(stages, 1024, "interleaved", 2).events) == 2 * 2 * 16 * 1024
