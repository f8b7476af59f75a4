"""GEMM precision apart from storage (`Graph.matmul_dtype`): FP8 training as Transformer Engine runs it.

TE's fp8 Linear casts its 16-bit inputs to fp8 and runs the GEMM on the fp8 tensor cores; every
tensor the graph names stays in 16 bits, and fused attention stays in bf16 (`fp8_dpa` off by
default). Hand checks: a GEMM's roofline at the fp8 peak over 2-byte tensors, everything else
exactly as in the bf16 graph.
"""

import dataclasses
import json

import pytest

from partopt import calibrate, costmodel, io, models
from partopt.cluster import Device, cluster_from_dict, cluster_to_dict, nominal_preset, preset
from partopt.errors import InstanceError
from partopt.evaluate import uniform
from partopt.graph import Graph, Op, Tensor
from partopt.sharding import op_strategies

ARGS = dict(hidden=256, layers=1, heads=8, kv_heads=2, ffn=512, seq=512, vocab=1000, batch=4,
            attention_kernel="flash")


def fp8_and_bf16() -> tuple[Graph, Graph]:
    return models.generate("llama", matmul_dtype="fp8", **ARGS), models.generate("llama", **ARGS)


def one_device(graph: Graph, op: Op):
    (strategy,) = op_strategies(graph, op, preset("dgx-h100", 1).logical_mesh((1, 1), (1, 1)))
    return strategy


def the(graph: Graph, suffix: str) -> Op:
    return next(op for op in graph.ops if op.name.endswith(suffix))


def test_gemms_compute_at_the_matmul_dtype_and_the_rest_at_their_tensors():
    fp8, bf16 = fp8_and_bf16()
    assert fp8.matmul_dtype == "fp8" and bf16.matmul_dtype is None
    kinds = {op.kind: fp8.compute_dtype(op) for op in fp8.ops}
    assert kinds["einsum"] == "fp8"  # the projections (the elementwise einsums with one input stay bf16)
    assert kinds["attention"] == "bf16" and kinds["rmsnorm"] == "bf16"
    assert all(fp8.nbytes(t) == bf16.nbytes(t) for t in fp8.tensors)  # storage unchanged: 16 bits
    assert {bf16.compute_dtype(op) for op in bf16.ops} == {"bf16"}


def test_a_projection_runs_at_the_fp8_peak_over_two_byte_tensors():
    big = {**ARGS, "hidden": 2048, "heads": 16, "kv_heads": 4, "ffn": 4096}  # GEMMs compute-bound on an H100
    fp8, bf16 = models.generate("llama", matmul_dtype="fp8", **big), models.generate("llama", **big)
    name = next(op.name for op in fp8.ops if op.kind == "einsum" and len(op.inputs) == 2
                and fp8.tensors[op.inputs[1]].role == "param")
    op = fp8.op_index[name]
    device = preset("dgx-h100", 1).device
    flops = 3 * fp8.flops(op)  # forward, dX and dW
    moved = 2 * sum(bf16.nbytes(t) for t in (*op.inputs, op.output))  # forward and backward, 2 bytes
    streaming = moved / (device.memory_bandwidth * device.memory_efficiency)
    for graph, dtype, peak in ((fp8, "fp8", 1979e12), (bf16, "bf16", 989e12)):
        compute = flops / (peak * costmodel.matmul_efficiency(flops, device, dtype))
        assert compute > streaming  # the peak, not the bytes, sets the time
        assert one_device(graph, op).compute_s == pytest.approx(compute)
    assert one_device(fp8, op).memory_bytes == one_device(bf16, op).memory_bytes


def test_attention_and_elementwise_ops_price_as_in_the_bf16_graph():
    fp8, bf16 = fp8_and_bf16()
    for op in fp8.ops:
        if fp8.compute_dtype(op) == "bf16":
            assert one_device(fp8, op).compute_s == one_device(bf16, op).compute_s, op.name


def test_the_matmul_dtype_survives_a_file_and_changes_the_structural_hash(tmp_path):
    fp8, bf16 = fp8_and_bf16()
    path = tmp_path / "g.json"
    io.write_graph(fp8, path)
    assert json.loads(path.read_text())["matmul_dtype"] == "fp8"
    back = io.read_graph(path)
    assert back.matmul_dtype == "fp8" and back.structural_hash() == fp8.structural_hash()
    assert fp8.structural_hash() != bf16.structural_hash()  # the layer caches must not mix them


def test_an_unknown_matmul_dtype_is_refused_where_it_is_given(tmp_path):
    with pytest.raises(InstanceError) as err:
        models.generate("llama", matmul_dtype="fp4", **ARGS)
    assert "fp4" in err.value.cause and "fp8" in err.value.hint
    with pytest.raises(InstanceError) as err:
        dataclasses.replace(models.generate("llama", **ARGS), matmul_dtype="int32")
    assert err.value.where == "matmul_dtype"
    data = io.graph_to_dict(Graph("g", {"m": 2}, {"x": Tensor("x", ("m",), "input"), "y": Tensor("y", ("m",), "output")},
                                  [Op("neg", "elementwise", ("x",), "y")]))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**data, "matmul_dtype": "fp4"}))
    with pytest.raises(InstanceError) as err:
        io.read_graph(path)
    assert "bad.json" in err.value.where and "matmul_dtype" in err.value.where


# ---------------------------------------------------------------- the fp8 GEMM efficiency

def h100(**changes) -> Device:
    return dataclasses.replace(preset("dgx-h100", 1).device, **{"matmul_half_flops": 0.0, "fp8_matmul_efficiency": None,
                                                                 **changes})


def test_fp8_gemms_reach_their_own_fraction_of_the_fp8_peak():
    plain, apart = h100(matmul_efficiency=0.7), h100(matmul_efficiency=0.7, fp8_matmul_efficiency=0.5)
    flops = 1e12
    assert costmodel.compute_time(flops, 0.0, plain, "fp8", True) == pytest.approx(flops / (1979e12 * 0.7))
    assert costmodel.compute_time(flops, 0.0, apart, "fp8", True) == pytest.approx(flops / (1979e12 * 0.5))
    assert costmodel.compute_time(flops, 0.0, apart, "bf16", True) == pytest.approx(flops / (989e12 * 0.7))
    with pytest.raises(InstanceError):
        h100(fp8_matmul_efficiency=1.5)


def test_the_fp8_efficiency_round_trips_through_the_cluster_file():
    cluster = preset("dgx-h100", 1)
    apart = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, fp8_matmul_efficiency=0.55))
    data = cluster_to_dict(apart)
    assert data["device"]["fp8_matmul_efficiency"] == 0.55 and cluster_from_dict(data) == apart
    assert "fp8_matmul_efficiency" not in cluster_to_dict(nominal_preset("dgx-h100"))["device"]


def _points(measured: list[float]) -> dict:
    shapes = [(dict(hidden=2048, heads=16), None), (dict(hidden=256, heads=2), None),  # GEMM-bound, mixed
              (dict(hidden=2048, heads=16), "fp8"), (dict(hidden=1024, heads=8), "fp8")]
    return {"format": "partopt.points", "version": 1, "points": [
        {"label": f"{i}", "source": "generated by the model (test)",
         "model": {"generator": "gpt", "args": {**args, "layers": 1, "seq": 512, "vocab": 512, "batch": 8,
                                                 "dtype": "bf16", "attention_kernel": "flash",
                                                 **({"matmul_dtype": mm} if mm else {})}},
         "cluster": {"preset": "dgx-h100", "nodes": 1, "devices_per_node": 1},
         "plan": {"tp": 1, "pp": 1, "dp": 1, "microbatches": 1, "recompute": "none"},
         "measured": {"iteration_s": seconds}}
        for i, ((args, mm), seconds) in enumerate(zip(shapes, measured))]}


def test_the_fit_tells_the_16_bit_and_the_fp8_efficiency_apart():
    truth = {"matmul_efficiency": 0.7, "fp8_matmul_efficiency": 0.55}
    dummy = calibrate.points_from_dict(_points([1.0] * 4))
    base = calibrate.with_values(preset("dgx-h100"), nominal_preset("dgx-h100"), truth)
    times = [uniform(p.graph, calibrate.point_cluster(p, base), 1, 1, 1, 1, recompute="none").iteration_time_s
             for p in dummy.points]
    result = calibrate.fit(calibrate.points_from_dict(_points(times)), "dgx-h100", list(truth), leave_one_out=False,
                           start={"matmul_efficiency": 0.5, "fp8_matmul_efficiency": 0.8}, workers=1)
    for name, value in truth.items():
        assert result.values[name] == pytest.approx(value, rel=1e-3), name
