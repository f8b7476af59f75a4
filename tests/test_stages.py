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
