"""The pluggable cost model: `optimize(..., cost_model=...)`, the measured-table model `Profiled`
and its file format. Expected values are the table's own measurements and hand formulas."""

import json

import pytest
from test_intra import FAST, PEAK, mlp

from partopt import costmodel
from partopt.cluster import Cluster, Link
from partopt.errors import InstanceError
from partopt.evaluate import uniform
from partopt.inter import optimize
from partopt.pricing import Pricer
from partopt.profiled import Profiled, read_profile

BW = 10e9


def cluster(devices: int) -> Cluster:
    return Cluster("row", 1, devices, FAST, Link(BW, 0.0), Link(BW, 0.0))


def test_an_empty_table_prices_as_the_analytical_model():
    graph = mlp(2, 64, 256)
    analytical = optimize(graph, cluster(2), microbatches=2, workers=1)
    profiled = optimize(graph, cluster(2), microbatches=2, workers=1, cost_model=Profiled())
    assert profiled.iteration_time_s == pytest.approx(analytical.iteration_time_s, rel=1e-12)


def test_a_measured_op_time_replaces_the_roofline_at_its_local_shape():
    """One device, one microbatch: the stage's compute is the sum of its ops' times. Both GEMMs of
    the MLP have the measured local shape; with only batch 32 measured, they keep the roofline."""
    graph = mlp(2, 64, 256)
    shapes = ((64, 256), (256, 256), (64, 256))  # x[b, h0] (or y0), w[h, h'], y[b, h'] whole on one device
    measured = 0.125
    plan = optimize(graph, cluster(1), microbatches=1, workers=1,
                    cost_model=Profiled({("einsum", shapes, "fp32"): measured}))
    assert plan.stages[0].breakdown["compute_s"] == pytest.approx(2 * measured, rel=1e-12)
    other = Profiled({("einsum", ((32, 256), (256, 256), (32, 256)), "fp32"): measured})
    plan = optimize(graph, cluster(1), microbatches=1, workers=1, cost_model=other)
    roofline = 3 * 2 * 64 * 256 * 256 / PEAK  # forward + backward GEMM FLOPs at peak (memory is instant)
    assert plan.stages[0].breakdown["compute_s"] == pytest.approx(2 * roofline, rel=1e-12)


def test_a_measured_collective_bandwidth_prices_the_gradient_all_reduce():
    """Plain data parallelism on 2 devices: each weight's fp32 gradient G is all-reduced once per
    iteration, bucketed: ring bytes 2·(2−1)/2·G = G over the measured bus bandwidth, no latency."""
    graph = mlp(2, 64, 256)
    busbw = 1e9
    model = Profiled(collectives={("all_reduce", 2, False): (busbw, 1e-3)})
    plan = uniform(graph, cluster(2), tp=1, pp=1, dp=2, microbatches=1, cost_model=model)
    gradient = 256 * 256 * 4
    assert plan.stages[0].breakdown["sync_s"]["all_reduce"] == pytest.approx(2 * gradient / busbw, rel=1e-12)


def test_the_model_reaches_the_ilp_workers(monkeypatch):
    """Layer ILPs solved in worker processes price with the caller's model, not the default."""
    monkeypatch.setattr(Pricer, "WARM_S", 0.0)  # a pool even for this small graph
    graph = mlp(2, 64, 256)
    slow = Profiled({("einsum", ((64, 256), (256, 256), (64, 256)), "fp32"): 1.0})
    plan = optimize(graph, cluster(1), microbatches=1, workers=2, cost_model=slow)
    assert plan.stages[0].breakdown["compute_s"] >= 1.0


def test_cached_layer_solutions_are_kept_apart_by_model():
    graph, cache = mlp(2, 64, 256), {}
    fast = optimize(graph, cluster(1), microbatches=1, workers=1, cache=cache)
    slow = optimize(graph, cluster(1), microbatches=1, workers=1, cache=cache,
                    cost_model=Profiled({("einsum", ((64, 256), (256, 256), (64, 256)), "fp32"): 1.0}))
    assert slow.iteration_time_s > fast.iteration_time_s + 0.9


def test_the_profile_file_round_trips_and_bad_files_name_the_place(tmp_path):
    path = tmp_path / "profile.json"
    entry = {"kind": "einsum", "shapes": [[64, 256], [256, 256], [64, 256]], "dtype": "fp32", "time_s": 0.125}
    path.write_text(json.dumps({"format": "partopt.profile", "version": 1, "ops": [entry],
                                "collectives": [{"kind": "all_reduce", "group": 2, "crosses_nodes": False,
                                                 "bus_bandwidth": 1e9}]}))
    model = read_profile(path)
    assert model.ops == {("einsum", ((64, 256), (256, 256), (64, 256)), "fp32"): 0.125}
    assert model.collectives == {("all_reduce", 2, False): (1e9, 0.0)}
    path.write_text(json.dumps({"format": "partopt.profile", "version": 1, "ops": [entry, {**entry, "time_s": 0.5}]}))
    with pytest.raises(InstanceError, match=r"\$\.ops\[1\]: a second measurement"):
        read_profile(path)
    path.write_text(json.dumps({"format": "partopt.profile", "version": 1, "ops": [{**entry, "time_s": -1}]}))
    with pytest.raises(InstanceError, match=r"ops\[0\]"):
        read_profile(path)
    path.write_text(json.dumps({"format": "partopt.profile", "version": 1, "ops": [{**entry, "kind": "matmul"}]}))
    with pytest.raises(InstanceError, match=r"\$\.ops\[0\]\.kind: unknown op kind 'matmul'"):
        read_profile(path)  # no op is of that kind: the entry would never be read


def test_an_op_entry_no_op_of_any_graph_would_look_up_is_refused(tmp_path):
    """An entry's shapes are its op's inputs then its output: an attention reads q, k, v (4 shapes), a layernorm x and
    up to two parameters (2 to 4), an einsum at least one operand (2 or more). A count no op of the kind has, or a
    reshape (compute 0 s, never priced), would never be read, for any graph: refused, not silently unused."""
    path = tmp_path / "profile.json"

    def read(kind: str, shapes: int):
        entry = {"kind": kind, "shapes": [[4, 8]] * shapes, "dtype": "fp32", "time_s": 0.125}
        einsum = {"kind": "einsum", "shapes": [[2, 4], [4, 8], [2, 8]], "dtype": "fp32", "time_s": 0.5}  # a good one
        path.write_text(json.dumps({"format": "partopt.profile", "version": 1, "ops": [einsum, entry]}))
        return read_profile(path)

    for kind, shapes, words in (("attention", 3, "3 shapes, but an op of kind 'attention' has 3 inputs and an output"),
                                ("attention", 5, "5 shapes, but an op of kind 'attention' has 3 inputs"),
                                ("layernorm", 5, "5 shapes, but an op of kind 'layernorm' has 1 to 3 inputs"),
                                ("einsum", 1, "1 shape, but an op of kind 'einsum' has at least 1 input")):
        with pytest.raises(InstanceError) as info:
            read(kind, shapes)
        assert info.value.where == f"{path}: $.ops[1].shapes" and info.value.cause.startswith(words)
        assert "then of its output" in info.value.hint
    with pytest.raises(InstanceError) as info:
        read("reshape", 2)
    assert info.value.where == f"{path}: $.ops[1].kind" and "'reshape' is never looked up" in info.value.cause
    for kind, shapes in (("attention", 4), ("layernorm", 2), ("layernorm", 4), ("einsum", 5), ("opaque", 1)):
        assert len(read(kind, shapes).ops) == 2


def test_the_analytical_model_is_active_outside_a_solve():
    with costmodel.using(Profiled()):
        assert isinstance(costmodel.active(), Profiled)
    assert costmodel.active() is costmodel.ANALYTICAL
