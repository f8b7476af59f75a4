"""The stage accountant's overlap of gradient reductions with the last backward (`stages.exposed_reduction`)."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from partopt.stages import exposed_reduction


def test_hand_examples():
    # layers 0, 1, 2 (backward runs 2, 1, 0); chain from l: Σ_{m ≤ l} reduce − Σ_{m < l} backward
    assert list(exposed_reduction(np.array([3.0, 1.0, 4.0]), np.array([2.0, 5.0, 1.0]))) == [3.0, 3.0, 3.0]
    assert list(exposed_reduction(np.array([1.0, 5.0, 5.0]), np.array([1.0, 1.0, 1.0]))) == [1.0, 5.0, 9.0]
    # nothing to hide behind: every reduction is exposed, in full
    assert list(exposed_reduction(np.array([1.0, 2.0]), np.zeros(2))) == [1.0, 3.0]


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


times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@given(st.lists(st.tuples(times, times), min_size=1, max_size=8))
def test_the_closed_form_is_the_simulated_stream(pairs):
    reduce, backward = (list(x) for x in zip(*pairs))
    exposed = exposed_reduction(np.array(reduce), np.array(backward))
    for j in range(len(reduce)):  # a stage of layers 0..j
        assert exposed[j] == pytest.approx(simulated(reduce[:j + 1], backward[:j + 1]), abs=1e-9)


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
            t, extra, _ = stage_table(pipe, costs, submeshes, count, cap)
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
