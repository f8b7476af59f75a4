"""Cost model: ring collectives against closed forms and a brute-force ring, roofline compute, memory."""

from __future__ import annotations

import numpy as np
import pytest

from partopt import costmodel as cm
from partopt.cluster import Link, MeshAxis, preset
from partopt.errors import InstanceError

V100 = preset("p3.16xlarge").device


def _axis(n: int, bw: float = 1e10, latency: float = 0.0) -> MeshAxis:
    return MeshAxis(size=n, bandwidth=bw, latency_s=latency, crosses_nodes=False)


# ---------------------------------------------------------------- collectives


@pytest.mark.parametrize("n, fraction", [(2, 1.0), (4, 1.5), (8, 1.75)])  # 2(n-1)/n by hand
def test_ring_all_reduce_moves_2_n_minus_1_over_n(n, fraction):
    s = 1e9
    assert cm.collective_bytes("all_reduce", s, n) == pytest.approx(fraction * s)
    assert cm.collective_time("all_reduce", s, _axis(n, bw=1e10)) == pytest.approx(cm.COLLECTIVE_LAUNCH_S + fraction * s / 1e10)


def _ring_all_reduce_bytes_sent(n: int, chunk: int = 3) -> tuple[int, np.ndarray, np.ndarray]:
    """Run a real ring all-reduce (reduce-scatter, then all-gather) and count elements each device sends."""
    rng = np.random.default_rng(n)
    data = [rng.integers(0, 100, size=(n, chunk)) for _ in range(n)]  # n chunks per device
    expected = sum(data)
    held = [d.copy() for d in data]
    sent = [0] * n
    for step in range(n - 1):  # reduce-scatter: device i passes chunk (i - step) to i + 1, which adds it
        msgs = [(i, (i - step) % n, held[i][(i - step) % n].copy()) for i in range(n)]
        for i, c, payload in msgs:
            held[(i + 1) % n][c] += payload
            sent[i] += payload.size
    for step in range(n - 1):  # all-gather: device i passes its complete chunk (i + 1 - step) to i + 1
        msgs = [(i, (i + 1 - step) % n, held[i][(i + 1 - step) % n].copy()) for i in range(n)]
        for i, c, payload in msgs:
            held[(i + 1) % n][c] = payload
            sent[i] += payload.size
    assert len(set(sent)) == 1
    return sent[0], np.array(held), expected


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_collective_bytes_matches_a_brute_force_ring(n):
    chunk = 3
    sent, held, expected = _ring_all_reduce_bytes_sent(n, chunk)
    for device in held:
        np.testing.assert_array_equal(device, expected)  # the simulated ring really all-reduces
    assert cm.collective_bytes("all_reduce", n * chunk, n) == pytest.approx(sent)
    assert cm.collective_bytes("reduce_scatter", n * chunk, n) == pytest.approx(sent / 2)
    assert cm.collective_bytes("all_gather", n * chunk, n) == pytest.approx(sent / 2)


def test_latency_terms():
    s, bw, a = 1e6, 1e9, 1e-5
    axis = _axis(4, bw, a)
    assert cm.collective_time("all_reduce", s, axis) == pytest.approx(cm.COLLECTIVE_LAUNCH_S + 1.5e-3 + 6 * a)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert cm.collective_time(kind, s, axis) == pytest.approx(cm.COLLECTIVE_LAUNCH_S + 0.75e-3 + 3 * a)


def test_size_one_axis_and_empty_buffer_cost_nothing():
    for kind in cm.COLLECTIVES:
        assert cm.collective_time(kind, 1e9, _axis(1, latency=1.0)) == 0.0
        assert cm.collective_time(kind, 0.0, _axis(8, latency=1.0)) == 0.0
        assert cm.collective_bytes(kind, 1e9, 1) == 0.0


def test_bad_collective_arguments():
    with pytest.raises(InstanceError, match="all_reduce"):
        cm.collective_time("broadcast", 1.0, _axis(2))
    with pytest.raises(ValueError):
        cm.collective_bytes("all_reduce", -1.0, 2)


def test_all_reduce_across_p3_nodes_uses_the_shared_nic():
    # (2, 8) submesh as logical (2, 8): 8 pairs cross the two nodes at once, each gets 3.125e9 / 8 B/s.
    axis0, axis1 = preset("p3.16xlarge").logical_mesh((2, 8), (2, 8)).axes
    s = 1e9
    assert cm.collective_time("all_reduce", s, axis0) == pytest.approx(cm.COLLECTIVE_LAUNCH_S + s / (3.125e9 / 8) + 2 * 20e-6)
    assert cm.collective_time("all_reduce", s, axis1) == pytest.approx(cm.COLLECTIVE_LAUNCH_S + 1.75 * s / 150e9 + 14 * 5e-6)


def test_p2p_time():
    link = Link(25e9, 10e-6)
    assert cm.p2p_time(50e6, link) == pytest.approx(2e-3 + 10e-6)
    assert cm.p2p_time(0, link) == 0.0


# ---------------------------------------------------------------- compute


def test_large_fp16_matmul_on_v100_is_compute_bound():
    flops = 2 * 8192**3  # one 8192^3 GEMM
    nbytes = 3 * 8192**2 * 2  # read A, B, write C in fp16
    assert cm.compute_time(flops, nbytes, V100, "fp16", matmul=True) == pytest.approx(flops / (125e12 * V100.matmul_efficiency))
    assert cm.compute_time(flops, nbytes, V100, "bf16", matmul=True) == pytest.approx(flops / (125e12 * V100.matmul_efficiency))


def test_streaming_op_is_memory_bound():
    nbytes = 4e9
    assert cm.compute_time(1e9, nbytes, V100, "fp16", matmul=False) == pytest.approx(nbytes / (900e9 * V100.memory_efficiency))


def test_non_matmul_arithmetic_runs_at_fp32_peak():
    flops = 1e12
    assert cm.compute_time(flops, 1.0, V100, "fp16", matmul=False) == pytest.approx(flops / 15.7e12)


def test_fp32_matmul_uses_fp32_peak():
    assert cm.compute_time(1e12, 0, V100, "fp32", matmul=True) == pytest.approx(1e12 / (15.7e12 * V100.matmul_efficiency))


def test_training_flops():
    assert cm.training_flops(10.0, matmul=True) == 30.0  # forward + 2x backward
    assert cm.training_flops(10.0, matmul=False) == 20.0


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("dtype, split", [("fp16", (2, 2, 12)), ("bf16", (2, 2, 12)), ("fp32", (4, 4, 8)),
                                          ("fp8", (1, 1, 12))])
def test_param_memory_split(dtype, split):
    numel = 1_000_000
    mem = cm.param_memory(numel, dtype)
    assert (mem.weights, mem.grads, mem.optimizer) == tuple(numel * b for b in split)
    assert mem.total == numel * sum(split)


def test_mixed_precision_adam_is_16_bytes_per_param():
    assert cm.param_memory(1.3e9, "fp16").total == pytest.approx(16 * 1.3e9)
    assert cm.param_memory(1.3e9, "fp32").total == pytest.approx(16 * 1.3e9)


@pytest.mark.parametrize("optimizer, dtype, split", [
    ("sgd", "fp16", (2, 2, 8)),  # 16-bit weights and grads + fp32 master + momentum
    ("sgd", "fp32", (4, 4, 4)),  # momentum only
    ("adafactor", "bf16", (2, 2, 4)),  # fp32 master; factored moments not counted
    ("adafactor", "fp32", (4, 4, 0)),
])
def test_param_memory_of_other_optimizers(optimizer, dtype, split):
    mem = cm.param_memory(1000, dtype, optimizer)
    assert (mem.weights, mem.grads, mem.optimizer) == tuple(1000 * b for b in split)


def test_unknown_optimizer_is_an_instance_error():
    with pytest.raises(InstanceError, match="lion"):
        cm.param_memory(10, "fp16", "lion")


def test_integer_params_cannot_be_trained():
    with pytest.raises(InstanceError, match="int32"):
        cm.param_memory(10, "int32")


def test_memory_budget():
    assert cm.memory_budget(V100) == pytest.approx(0.9 * 16 * 2**30)
    assert cm.memory_budget(V100, reserve_fraction=0.0) == 16 * 2**30
    with pytest.raises(InstanceError, match="reserve"):
        cm.memory_budget(V100, reserve_fraction=1.0)


def test_inflight_microbatches_under_1f1b():
    assert [cm.inflight_microbatches(i, 4, 16) for i in range(4)] == [4, 3, 2, 1]
    assert [cm.inflight_microbatches(i, 4, 2) for i in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError):
        cm.inflight_microbatches(4, 4, 16)


@pytest.mark.parametrize("dtype, split", [("fp16", (2, 2, 16)), ("bf16", (2, 4, 12)), ("fp32", (4, 4, 8))])
def test_megatron_lm_state_layout(dtype, split):
    """Megatron-LM's bytes per parameter with Adam (docs/user-guide/features/dist_optimizer.md: 20, 18, 16): bf16
    gradients accumulate in fp32, fp16 ones are copied to fp32 main gradients kept with the optimizer state."""
    mem = cm.param_memory(1000, dtype, "adam", "megatron")
    assert (mem.weights, mem.grads, mem.optimizer) == tuple(1000 * b for b in split)
    assert cm.grad_width(dtype, "megatron") == split[1]
    assert cm.grad_width(dtype) == cm.DTYPE_BYTES[dtype]


def test_unknown_state_layout_is_an_instance_error():
    with pytest.raises(InstanceError, match="deepspeed"):
        cm.param_memory(10, "bf16", "adam", "deepspeed")
