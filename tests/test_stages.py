"""The stage accountant: its stage sums (`stages._spans`), its overlap of gradient reductions with the last
backward (`stages.exposed_reduction`) and of the updated weights' gathers with the next forward
(`stages.exposed_gather`)."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from partopt.stages import SUMMED, _spans, exposed_gather, exposed_reduction


def test_hand_examples():
    # layers 0, 1, 2 (backward runs 2, 1, 0); chain from l: Σ_{m ≤ l} reduce − Σ_{m < l} backward
    assert list(exposed_reduction(np.array([3.0, 1.0, 4.0]), np.array([2.0, 5.0, 1.0]))) == [3.0, 3.0, 3.0]
    assert list(exposed_reduction(np.array([1.0, 5.0, 5.0]), np.array([1.0, 1.0, 1.0]))) == [1.0, 5.0, 9.0]
    # nothing to hide behind: every reduction is exposed, in full
    assert list(exposed_reduction(np.array([1.0, 2.0]), np.zeros(2))) == [1.0, 3.0]
    # gathers 3, 1, 5 under forwards 2, 4, 1: layer 0's waits in full, layer 1's hides under layer 0's forward,
    # layer 2's waits 5 − 4 past layer 1's
    assert list(exposed_gather(np.array([3.0, 1.0, 5.0]), np.array([2.0, 4.0, 1.0]))) == [3.0, 3.0, 4.0]
    # nothing to hide behind: every gather waits, in full
    assert list(exposed_gather(np.array([1.0, 2.0]), np.zeros(2))) == [1.0, 3.0]


def simulated(reduce: list[float], backward: list[float]) -> float:
    """Event by event: the backward runs the last layer first; one communication stream sends each
    layer's bucket once its backward is done and the previous bucket is sent. Returns what is left
    after the backward of layer 0 ends."""
    clock, ready = 0.0, {}
    for layer in reversed(range(len(reduce))):
        clock += backward[layer]
        ready[layer] = clock
    stream = 0.0
    for layer in reversed(range(len(reduce))):
        stream = max(stream, ready[layer]) + reduce[layer]
    return stream - ready[0]


def simulated_gathers(gather: list[float], forward: list[float]) -> float:
    """Megatron-LM's `--overlap-param-gather` event by event (megatron/core/optimizer/distrib_optimizer.py at
    r0.8.0): layer 0's gather starts with the iteration; the forward of a layer waits for its gather, and on
    reaching it dispatches the next layer's (one bucket ahead). Returns how much longer the first forward takes
    than its compute alone."""
    clock = gather[0]
    for k, compute in enumerate(forward):
        next_done = clock + gather[k + 1] if k + 1 < len(gather) else 0.0
        clock = max(clock + compute, next_done)
    return clock - sum(forward)


times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@pytest.mark.parametrize("closed_form, simulation", [(exposed_reduction, simulated), (exposed_gather, simulated_gathers)])
@given(pairs=st.lists(st.tuples(times, times), min_size=1, max_size=8))
def test_the_closed_forms_are_the_simulated_streams(closed_form, simulation, pairs):
    """The reductions against the last backward, the gathers against the next forward: (seconds of communication,
    seconds of compute) per layer."""
    comm, compute = (list(x) for x in zip(*pairs))
    exposed = closed_form(np.array(comm), np.array(compute))
    for j in range(len(comm)):  # a stage of layers 0..j
        assert exposed[j] == pytest.approx(simulation(comm[:j + 1], compute[:j + 1]), abs=1e-9)


@pytest.mark.parametrize("overlap", [False, True])
def test_spans_add_each_stage_from_its_first_layer(overlap):
    """`_spans[i, j]` is what a loop adding layers i..j in order gives, bit for bit (the DP's tables, `fits` and
    plan assembly read the same floats), the working set the largest, NaN from a layer that cannot run on, and
    under overlap the sync the other sync plus the exposed parts of the stage's own reductions and gathers."""
    rng = np.random.default_rng(3)
    columns = rng.uniform(0.0, 1.0, (7, 10)) * rng.choice([1e-3, 1.0, 1e9], (7, 10))
    columns[5] = np.nan
    spans = _spans(columns, overlap)
    for i in range(7):
        for j in range(i, 7):
            expected = np.zeros(10)
            for layer in columns[i:j + 1]:
                expected[SUMMED] = expected[SUMMED] + layer[SUMMED]
            expected[4] = np.max(columns[i:j + 1, 4])
            if overlap:
                expected[1] = (expected[5] + exposed_reduction(columns[i:j + 1, 6], columns[i:j + 1, 7])[-1]
                               + exposed_gather(columns[i:j + 1, 9], columns[i:j + 1, 8])[-1])
            if i <= 5 <= j:
                assert np.isnan(spans[i, j]).all()
            else:
                assert spans[i, j].tolist() == expected.tolist()


def test_the_dp_table_is_the_stage_accountant_entry_by_entry():
    """Every entry of the stage DP's table (vectorised) is what `totals` (plan assembly's accountant)
    gives that stage: latency where its memory with min(k, B) microbatches fits, inf where not; on a
    GPT with a tied embedding (shared-parameter corrections) and a budget that binds part-way."""
    from partopt import costmodel
    from partopt.assemble import pipeline_of
    from partopt.cluster import preset
    from partopt.layering import build_layers
    from partopt.models import gpt
    from partopt.options import Options
    from partopt.pricing import Job, Pricer, Stats
    from partopt.stages import End, stage_table, totals

    graph = gpt(hidden=64, layers=4, heads=4, seq=32, vocab=128, batch=8, name="tiny-gpt")
    cluster = preset("p3.16xlarge", 1)
    layering, count = build_layers(graph, None), 4
    budget = costmodel.memory_budget(cluster.device)
    submeshes = [(1, 1), (1, 2)]
    costs = {}
    with Pricer(graph, Options(workers=1)) as pricer:
        for sub in submeshes:
            mesh = cluster.logical_mesh(sub, (1, sub[1]))
            row = [pricer.one(Job(2, count, tuple(op.name for op in ops), mesh, "none", budget), Stats())
                   for ops in layering.base]
            costs[(sub, (1, sub[1]), "none")] = [row]
    for overlap in (False, True):
        pipe = pipeline_of(graph, cluster, layering, count, overlap)
        rows = {sub: costs[(sub, (1, sub[1]), "none")][0] for sub in submeshes}
        probe = totals(rows[(1, 1)], pipe, 0, len(layering.groups) - 1, End((1, 1), (1, 1)))
        tight = probe.param_bytes + 2.5 * probe.activation_bytes + probe.working_bytes  # whole model: k ≤ 2 fit
        for cap in (budget, tight):
            t, extra = stage_table(pipe, costs, submeshes, count, cap)[0].dense()
            L = len(layering.groups)
            for s, sub in enumerate(submeshes):
                for i in range(L):
                    for j in range(i, L):
                        sums = totals(rows[sub], pipe, i, j, End(sub, (1, sub[1])))
                        for k in range(1, L + 1):
                            if sums.memory_bytes(min(k, count)) <= cap:
                                assert t[0, k, i, j, s] == sums.latency_s and extra[0, k, i, j, s] == sums.sync_s
                            else:
                                assert t[0, k, i, j, s] == np.inf
            if cap == tight:  # the budget binds: the whole model on one device holds two microbatches, not three
                assert np.isinf(t[0, 3:, 0, L - 1, 0]).all() and np.isfinite(t[0, 1:3, 0, L - 1, 0]).all()


def test_a_plan_that_ignores_memory_fits_exactly_when_its_entries_survive_the_budget():
    """`stages.fits` (the search's shortcut: a memory-ignored plan that fits is the budget's best plan too) agrees
    with the budgeted table entry by entry, for 1F1B and interleaved plans, at caps from loose to binding."""
    import math

    from partopt import costmodel, stagedp
    from partopt.assemble import pipeline_of
    from partopt.cluster import preset
    from partopt.layering import build_layers
    from partopt.models import gpt
    from partopt.options import Options
    from partopt.pricing import Job, Pricer, Stats
    from partopt.stages import End, fits, interleaved_table, stage_table, totals

    graph = gpt(hidden=64, layers=4, heads=4, seq=32, vocab=128, batch=8, name="tiny-gpt")
    cluster = preset("p3.16xlarge", 1)
    layering, count = build_layers(graph, None), 4
    budget = costmodel.memory_budget(cluster.device)
    submeshes = [(1, 1), (1, 2)]
    sizes = [a * b for a, b in submeshes]
    costs = {}
    with Pricer(graph, Options(workers=1)) as pricer:
        for sub in submeshes:
            mesh = cluster.logical_mesh(sub, (1, sub[1]))
            costs[(sub, (1, sub[1]), "none")] = [[pricer.one(Job(2, count, tuple(op.name for op in ops), mesh, "none",
                                                                 budget), Stats()) for ops in layering.base]]
    pipe = pipeline_of(graph, cluster, layering, count, True)
    whole = totals(costs[((1, 1), (1, 1), "none")][0], pipe, 0, len(layering.groups) - 1, End((1, 1), (1, 1)))
    verdicts, interleaved = set(), set()
    for scale in (100.0, 1.0, 0.6, 0.4, 0.25):
        cap = scale * (whole.param_bytes + count * whole.activation_bytes + whole.working_bytes)
        entries, options = stage_table(pipe, costs, submeshes, count, math.inf)
        free = stagedp.solve(entries, None, sizes, 2, count)
        capped = stage_table(pipe, costs, submeshes, count, cap)[0]
        survive = all(capped.depth[c.option, c.first, c.last, c.submesh] >= c.inflight for c in free.stages)
        assert fits(pipe, costs, submeshes, options, free.stages, count, cap) == survive
        if survive:
            assert stagedp.solve(capped, None, sizes, 2, count).total == free.total
        verdicts.add(survive)
        S, v = 2, 2  # 2 stages of 2 chunks: each stage holds its interleaved in-flight count
        t, extra, fill, options = interleaved_table(pipe, costs, submeshes, count, math.inf, S, v)
        free = stagedp.solve(t / v, extra, sizes, 2, v * count, rebate=-fill)
        if free is None:
            continue
        capped = interleaved_table(pipe, costs, submeshes, count, cap, S, v)[0]
        survive = all(np.isfinite(capped[c.option, 1, i, i, c.submesh]) for i, c in enumerate(free.stages))
        assert fits(pipe, costs, submeshes, options, free.stages, count, cap, "interleaved", v) == survive
        interleaved.add(survive)
    assert verdicts == {True, False} and interleaved == {True, False}  # the caps tried both fit and bind
