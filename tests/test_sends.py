"""Pipeline sends priced where the stages sit (`stages.Pipeline.send_s`, docs/COSTMODEL.md §5b
"Pipeline sends"): parallel paths, NICs per GPU or per node, Megatron's scatter/gather.

Expected values are written out from the formula's terms with the presets' datasheet figures
(`nominal_preset`: the links of REFERENCE.md §1), not taken from the code under test.
"""

import dataclasses

import pytest

from partopt.assemble import pipeline_of
from partopt.cluster import nominal_preset
from partopt.layering import build_layers
from partopt.models import gpt
from partopt.stages import End

MIB = 2**20
S = 64 * MIB  # boundary bytes of one microbatch
LAUNCH = 5e-6  # costmodel.COLLECTIVE_LAUNCH_S
NVLINK_A100, IB_A100 = 300e9, 25e9  # GB/s per direction, per GPU (dgx-a100: one 200 Gb/s HDR NIC per GPU)
NVLINK_V100, NIC_P3 = 150e9, 3.125e9  # p3.16xlarge: one 25 Gb/s NIC shared by the node's 8 GPUs
NVLINK_LAT, IB_LAT, ETH_LAT = 5e-6, 10e-6, 20e-6


def p2p(nbytes: float, bandwidth: float, latency: float) -> float:
    return nbytes / bandwidth + latency


def gather(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather of a full buffer of `nbytes` over n ranks (COSTMODEL §4)."""
    return (n - 1) / n * nbytes / bandwidth + LAUNCH + (n - 1) * latency


def pipe_on(name: str, nodes: int):
    """A two-DP-layer pipeline on preset `name` whose one boundary carries S bytes per microbatch."""
    graph = gpt(hidden=64, layers=2, heads=4, seq=32, vocab=128, batch=8, name="tiny-gpt")
    pipe = pipeline_of(graph, nominal_preset(name).resized(nodes), build_layers(graph, None), 1, False)
    return dataclasses.replace(pipe, boundary=[S, 0.0], mb=8, batch=8)


def node(*ids: int) -> frozenset[int]:
    return frozenset(ids)


def test_a_full_node_to_a_full_node_across_nodes_dgx_a100_against_p3():
    """(1, 8) → (1, 8) at tp 8, across nodes: DGX sends 1/8 over each of 8 NICs; p3's one NIC
    carries it all. Both then all-gather the slices inside the node, forward and backward."""
    a, b = End((1, 8), (1, 8), node(0)), End((1, 8), (1, 8), node(1))
    dgx = pipe_on("dgx-a100", 2)
    expected = 2 * p2p(S / 8, IB_A100, IB_LAT) + gather(S, 8, NVLINK_A100, NVLINK_LAT)
    assert dgx.send_s(0, 0, a, b) == pytest.approx(expected, rel=1e-12)
    assert dgx.send_s(1, 1, b) == pytest.approx(gather(S, 8, NVLINK_A100, NVLINK_LAT), rel=1e-12)  # the receiver's gather
    p3 = pipe_on("p3.16xlarge", 2)
    assert p3.send_s(0, 0, a, b) == pytest.approx(2 * p2p(S, NIC_P3, ETH_LAT) + gather(S, 8, NVLINK_V100, NVLINK_LAT),
                                                  rel=1e-12)
    # 8 NICs against 1 of an 8× slower kind: the DGX send is ~2 ms, p3's ~43 ms
    assert dgx.send_s(0, 0, a, b) < p3.send_s(0, 0, a, b) / 20


def test_p3_data_parallel_stages_on_one_node_keep_the_old_formula():
    """On p3.16xlarge a (1, k) stage without tensor parallelism sends the whole microbatch through
    its node's one NIC: exactly the formula before placement, 2 · p2p(S, inter-node), whatever k."""
    p3 = pipe_on("p3.16xlarge", 2)
    old = 2 * (S / NIC_P3 + ETH_LAT)
    for k in (1, 2, 4, 8):
        a, b = End((1, k), (k, 1), node(0)), End((1, k), (k, 1), node(1))
        assert p3.send_s(0, 0, a, b) == pytest.approx(old, rel=1e-12)
        assert p3.send_s(0, 0, a) == pytest.approx(old, rel=1e-12)  # the stage DP's price


def test_tp_8_with_data_parallelism_scatters_over_every_gpu():
    """(2, 8) at dp 2 × tp 8 → the same on two other nodes: 16 paths of S/16, then each tp group
    all-gathers its data-parallel half (S/2). On p3 the paths are the 2 nodes' NICs."""
    a, b = End((2, 8), (2, 8), node(0, 1)), End((2, 8), (2, 8), node(2, 3))
    dgx = pipe_on("dgx-a100", 4)
    assert dgx.send_s(0, 0, a, b) == pytest.approx(
        2 * p2p(S / 16, IB_A100, IB_LAT) + gather(S / 2, 8, NVLINK_A100, NVLINK_LAT), rel=1e-12)
    p3 = pipe_on("p3.16xlarge", 4)
    assert p3.send_s(0, 0, a, b) == pytest.approx(
        2 * p2p(S / 2, NIC_P3, ETH_LAT) + gather(S / 2, 8, NVLINK_V100, NVLINK_LAT), rel=1e-12)


def test_a_narrow_stage_to_a_wide_one_is_limited_by_the_narrow_end():
    """(1, 2) at dp 2 → (2, 8) at dp 16: 2 paths of S/2 (each sender's slice fans out to 8
    receivers, but leaves through its own NIC). On p3 the sender's node has one NIC."""
    a, b = End((1, 2), (2, 1), node(0)), End((2, 8), (16, 1), node(1, 2))
    dgx = pipe_on("dgx-a100", 3)
    assert dgx.send_s(0, 0, a, b) == pytest.approx(2 * p2p(S / 2, IB_A100, IB_LAT), rel=1e-12)
    p3 = pipe_on("p3.16xlarge", 3)
    assert p3.send_s(0, 0, a, b) == pytest.approx(2 * p2p(S, NIC_P3, ETH_LAT), rel=1e-12)
    # the other way round the wide sender is limited by the narrow receiver alike
    assert dgx.send_s(0, 0, b, a) == dgx.send_s(0, 0, a, b)


def test_stages_on_one_node_send_over_nvlink():
    """Two (1, 4) stages on node 0 (dp 4 each): 4 NVLink paths of S/4, even on a multi-node
    cluster, where the stage DP (placement unknown) prices the inter-node link instead."""
    a, b = End((1, 4), (4, 1), node(0)), End((1, 4), (4, 1), node(0))
    for name, nvlink, ib, ib_lat in (("dgx-a100", NVLINK_A100, IB_A100, IB_LAT), ("p3.16xlarge", NVLINK_V100, NIC_P3, ETH_LAT)):
        pipe = pipe_on(name, 2)
        assert pipe.send_s(0, 0, a, b) == pytest.approx(2 * p2p(S / 4, nvlink, NVLINK_LAT), rel=1e-12)
        paths = 4 if name == "dgx-a100" else 1
        assert pipe.send_s(0, 0, a) == pytest.approx(2 * p2p(S / paths, ib, ib_lat), rel=1e-12)
    one_node = pipe_on("dgx-a100", 1)
    assert one_node.send_s(0, 0, a) == one_node.send_s(0, 0, a, b)  # one node: the DP's price is exact


def test_the_dp_price_is_the_exact_send_to_a_twin_across_nodes():
    """The stage DP prices a send as to a stage as wide as the sender on another node: exact for
    Megatron's uniform pipelines, optimistic for a narrower receiver, pessimistic for one on the same node."""
    for name in ("dgx-a100", "p3.16xlarge"):
        pipe = pipe_on(name, 4)
        for submesh, shape in (((1, 8), (1, 8)), ((1, 4), (2, 2)), ((2, 8), (4, 4)), ((1, 1), (1, 1))):
            a = End(submesh, shape, node(*range(submesh[0])))
            twin = End(submesh, shape, node(*range(submesh[0], 2 * submesh[0])))
            assert pipe.send_s(0, 0, a) == pipe.send_s(0, 0, a, twin)
            narrow = End((1, 1), (1, 1), node(3))
            assert pipe.send_s(0, 0, a) <= pipe.send_s(0, 0, a, narrow)


def test_megatron_plan_sends_are_placed_and_scattered():
    """`evaluate.uniform` at tp 8 × pp 2 on 2 × dgx-a100: the stages sit on nodes 0 and 1; stage 0
    sends S/8 over each GPU's NIC and gathers the gradient, stage 1 gathers the activations. S is
    the hidden state of one microbatch, b·s·h·2 bytes (fp16)."""
    from partopt.evaluate import uniform

    graph = gpt(hidden=256, layers=2, heads=8, seq=64, vocab=512, batch=8, name="tiny-gpt")
    plan = uniform(graph, nominal_preset("dgx-a100").resized(2), tp=8, pp=2, dp=1, microbatches=4, recompute="none")
    assert [s.devices for s in plan.stages] == [list(range(8)), list(range(8, 16))]
    s = 2 * 64 * 256 * 2  # a microbatch of 2 sequences
    gathered = gather(s, 8, NVLINK_A100, NVLINK_LAT)
    assert plan.stages[0].send_time_s == pytest.approx(2 * p2p(s / 8, IB_A100, IB_LAT) + gathered, rel=1e-9)
    assert plan.stages[1].send_time_s == pytest.approx(gathered, rel=1e-9)
