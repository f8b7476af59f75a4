"""Cluster model: presets, file round trips, submesh families, logical-mesh axis pricing."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import jsonschema
import pytest

from partopt.cluster import (
    HYBRID_CUBE_MESH, MAX_NODES, PRESETS, Cluster, Device, Link, cluster_from_dict, cluster_to_dict, divisors, nominal_preset, preset, preset_calibration,
)
from partopt.errors import InfeasibleError, InstanceError
from partopt.io import read_cluster
from partopt.rings import MAX_LANES

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "partopt" / "schemas" / "cluster.schema.json").read_text())

# The example of DESIGN §2 / the brief, optional fields left out.
EXAMPLE = {
    "format": "partopt.cluster", "version": 1, "name": "p3.16xlarge",
    "nodes": 8, "devices_per_node": 8,
    "device": {"name": "V100-SXM2-16GB", "peak_tflops": {"fp16": 125, "fp32": 15.7},
               "memory_gib": 16, "memory_bandwidth_gbps": 900},
    "intra_node": {"bandwidth_gbps": 150, "latency_us": 5,
                   # nvidia-smi topo -m on a p3.16xlarge / DGX-1V: NV1 = 1 lane, NV2 = 2, SYS = 0
                   "lanes": [[0, 1, 1, 2, 2, 0, 0, 0], [1, 0, 2, 1, 0, 2, 0, 0], [1, 2, 0, 2, 0, 0, 1, 0],
                             [2, 1, 2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 1, 1, 2], [0, 2, 0, 0, 1, 0, 2, 1],
                             [0, 0, 1, 0, 1, 2, 0, 2], [0, 0, 0, 1, 2, 1, 2, 0]]},
    "inter_node": {"bandwidth_gbps": 3.125, "latency_us": 20, "shared_by_node": True},
}


def _toy(devices_per_node: int, intra: float, inter: float, shared: bool, nodes: int = 2) -> Cluster:
    device = Device("toy", {"fp32": 1e12}, 2**30, 1e11)
    return Cluster("toy", nodes, devices_per_node, device, Link(intra, 1e-6), Link(inter, 1e-5, shared))


# ---------------------------------------------------------------- submesh shapes


def test_alpa_submesh_family_8x8():
    assert preset("p3.16xlarge").submesh_shapes() == [
        (1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8), (5, 8), (6, 8), (7, 8), (8, 8)]


def test_power_of_two_submesh_family_8x8():
    assert preset("p3.16xlarge").submesh_shapes("power_of_two") == [
        (1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8)]


def test_submesh_families_2x4():
    cluster = preset("tpu-v4", nodes=2)  # hosts of 4 chips
    assert cluster.submesh_shapes() == [(1, 1), (1, 2), (1, 4), (2, 4)]
    assert cluster.submesh_shapes("power_of_two") == [(1, 1), (1, 2), (1, 4), (2, 4)]


def test_submesh_family_keeps_a_non_power_of_two_node_whole():
    assert _toy(6, 1e11, 1e10, True, nodes=3).submesh_shapes() == [(1, 1), (1, 2), (1, 6), (2, 6), (3, 6)]


def test_auto_submesh_family_is_alpa_up_to_16_nodes_and_powers_of_two_beyond():
    # Alpa's family at N nodes of 8 has 4 + (N - 1) shapes: 19 at 16 nodes, 387 at 384; powers of two: 4 + 8 at 384
    assert preset("dgx-a100", nodes=16).submesh_shapes() == preset("dgx-a100", nodes=16).submesh_shapes("alpa")
    assert len(preset("dgx-a100", nodes=16).submesh_shapes()) == 19
    big = preset("dgx-a100", nodes=384)
    assert big.submesh_family("auto") == "power_of_two"
    assert big.submesh_shapes() == [(1, 1), (1, 2), (1, 4), (1, 8)] + [(2 ** k, 8) for k in range(1, 9)]
    assert len(big.submesh_shapes("alpa")) == 387


def test_unknown_submesh_family():
    with pytest.raises(InstanceError, match="alpa"):
        preset("p3.16xlarge").submesh_shapes("hexagonal")


def test_logical_shapes_of_2x8():
    assert preset("p3.16xlarge").logical_shapes((2, 8)) == [(16, 1), (8, 2), (4, 4), (2, 8), (1, 16)]


def test_submesh_larger_than_cluster_is_infeasible():
    with pytest.raises(InfeasibleError, match="does not fit"):
        preset("p3.16xlarge", nodes=2).logical_shapes((3, 8))


def test_logical_shape_with_wrong_device_count_is_infeasible():
    with pytest.raises(InfeasibleError, match="logical_shapes"):
        preset("p3.16xlarge").logical_mesh((1, 8), (2, 8))


# ---------------------------------------------------------------- axis pricing (placement rule)

P3_NIC = 3.125e9  # 25 Gbit/s per node
NVLINK = 150e9
LANE = 25e9  # one NVLink2 lane per direction: a V100's 6 lanes share its 150e9


def test_p3_2x8_as_2x8_axis0_shares_the_nic_among_8_groups():
    # Axis 0 groups are {j, j+8} for j = 0..7: each has one device in node 0 and one in node 1,
    # so all 8 groups cross and all 8 use node 0's NIC at once: 3.125e9 / 8 each.
    mesh = preset("p3.16xlarge").logical_mesh((2, 8), (2, 8))
    a0, a1 = mesh.axes
    assert (a0.size, a0.crosses_nodes) == (2, True)
    assert a0.bandwidth == pytest.approx(P3_NIC / 8)
    assert a0.latency_s == pytest.approx(20e-6)
    # Axis 1 groups are devices 0..7 and 8..15: each a whole node, on all 6 lanes of each GPU.
    assert (a1.size, a1.crosses_nodes, a1.bandwidth, a1.latency_s) == (8, False, NVLINK, 5e-6)


def test_p3_2x8_as_16x1_one_ring_gets_the_whole_nic():
    a0, a1 = preset("p3.16xlarge").logical_mesh((2, 8), (16, 1)).axes
    assert (a0.size, a0.crosses_nodes) == (16, True)
    assert a0.bandwidth == pytest.approx(P3_NIC)
    assert a1.size == 1 and not a1.crosses_nodes


def test_p3_2x8_as_4x4_axis0_four_groups_share_the_nic():
    # Axis 0 groups {j, j+4, j+8, j+12}, j = 0..3: devices j, j+4 on node 0 and j+8, j+12 on node 1.
    a0, a1 = preset("p3.16xlarge").logical_mesh((2, 8), (4, 4)).axes
    assert a0.crosses_nodes and a0.bandwidth == pytest.approx(P3_NIC / 4)
    assert not a1.crosses_nodes and a1.bandwidth == 4 * LANE  # groups 0-3, 4-7, 8-11, 12-15: quads, 4 rings


def test_p3_4x8_as_8x4_axis0_groups_span_four_nodes():
    # 32 devices; axis 0 groups {j, j+4, ..., j+28}, j = 0..3; node 0 holds members of all 4 groups.
    a0, _ = preset("p3.16xlarge").logical_mesh((4, 8), (8, 4)).axes
    assert a0.bandwidth == pytest.approx(P3_NIC / 4)


# Axes inside one p3 node, by hand from the hybrid cube-mesh (tests/test_rings.py derives the ring counts): a pair
# group's slowest member pair has 1 lane; a quad {0-3} or {4-7} carries 4 rings; the stride-2 quads {0,2,4,6} and
# {1,3,5,7} only 2 (one Hamiltonian cycle each way, through their single-lane hops); the whole node 6.
P3_IN_NODE = {
    ((1, 2), (2, 1)): (LANE, None),  # pairs (0,1) 1 lane, (2,3) 2, (4,5) 1, (6,7) 2: the slowest
    ((1, 4), (4, 1)): (4 * LANE, None),
    ((1, 4), (2, 2)): (LANE, LANE),  # axis 0 {0,2} {1,3} (1 lane each), axis 1 {0,1} {2,3}
    ((1, 8), (8, 1)): (NVLINK, None),
    ((1, 8), (4, 2)): (2 * LANE, LANE),
    ((1, 8), (2, 4)): (LANE, 4 * LANE),  # axis 0 {j, j+4}: (2,6) and (3,7) have 1 lane
}


@pytest.mark.parametrize("submesh, shape", list(P3_IN_NODE))
def test_axes_inside_one_p3_node_see_their_lanes(submesh, shape):
    for axis, expected in zip(preset("p3.16xlarge").logical_mesh(submesh, shape).axes, P3_IN_NODE[submesh, shape]):
        assert (axis.latency_s, axis.crosses_nodes) == (5e-6, False)
        if expected is not None:
            assert axis.bandwidth == pytest.approx(expected)


def test_axes_inside_a_switched_node_see_the_whole_link():
    a100 = preset("dgx-a100")
    for submesh in [(1, 2), (1, 4), (1, 8)]:
        for shape in a100.logical_shapes(submesh):
            assert all(axis.bandwidth == 300e9 for axis in a100.logical_mesh(submesh, shape).axes if axis.size > 1)


def test_dgx_crossing_axis_gets_the_per_gpu_link():
    a0, a1 = preset("dgx-a100").logical_mesh((2, 8), (2, 8)).axes
    assert a0.crosses_nodes and a0.bandwidth == pytest.approx(25e9) and a0.latency_s == pytest.approx(10e-6)
    assert a1.bandwidth == pytest.approx(300e9)


def test_axis_is_priced_by_its_slowest_group():
    # 2 nodes x 6 devices as (3, 4): axis 1 groups 0-3 | 4-7 | 8-11; only 4-7 crosses (4,5 | 6,7),
    # alone at the NIC, and it also hops inside a node: min(10e9, 100e9) = 10e9.
    # Axis 0 groups {j, j+4, j+8}, j = 0..3: all 4 cross and all 4 have members in node 0: 10e9 / 4.
    a0, a1 = _toy(6, 100e9, 10e9, True).logical_mesh((2, 6), (3, 4)).axes
    assert a1.crosses_nodes and a1.bandwidth == pytest.approx(10e9)
    assert a0.crosses_nodes and a0.bandwidth == pytest.approx(2.5e9)


def test_a_crossing_group_runs_a_ring_per_member_per_node_on_per_device_nics():
    """NCCL runs a ring (channel) per NIC: a group with k members on each node it spans crosses nodes on k NICs at
    once, each carrying 1/k of the data, so it sees k times one NIC, capped by the node's link its rings also hop.
    By hand on 8 DGX H100 nodes (a 50 GB/s NIC per GPU, NVLink 450 GB/s):"""
    h100 = preset("dgx-h100")
    mesh = h100.logical_mesh((8, 8), (64, 1))
    assert mesh.axes[0].bandwidth == pytest.approx(8 * 50e9)  # all 64: 8 members per node, 8 NICs < 450
    a0, a1 = h100.logical_mesh((8, 8), (16, 4)).axes  # axis 0 groups {j, j+4, ...}: 2 members per node
    assert a0.bandwidth == pytest.approx(2 * 50e9) and a1.bandwidth == pytest.approx(450e9)
    a0, _ = h100.logical_mesh((8, 8), (8, 8)).axes  # stride-8 groups: one member per node, its own NIC
    assert a0.bandwidth == pytest.approx(50e9)
    # 2 nodes x 6 devices as (3, 4), a NIC per device: axis 1 group 4-7 has 2 members on each node (4,5 | 6,7):
    # 2 x 10e9; axis 0 groups {j, j+4, j+8} have 1 member on some node ({0,4} | {8}): 10e9
    a0, a1 = _toy(6, 100e9, 10e9, False).logical_mesh((2, 6), (3, 4)).axes
    assert a1.bandwidth == pytest.approx(20e9) and a0.bandwidth == pytest.approx(10e9)


def test_crossing_ring_with_intra_hops_is_capped_by_the_intra_link():
    cluster = _toy(8, 100e9, 200e9, False)  # a (hypothetical) network faster than the node's link
    a0, _ = cluster.logical_mesh((2, 8), (4, 4)).axes  # groups have 2 members per node
    assert a0.bandwidth == pytest.approx(100e9)
    a0, _ = cluster.logical_mesh((2, 8), (2, 8)).axes  # one member per node: network only
    assert a0.bandwidth == pytest.approx(200e9)


def test_logical_mesh_is_hashable_and_picklable():
    cluster = preset("p3.16xlarge")
    a, b = cluster.logical_mesh((1, 8), (2, 4)), cluster.logical_mesh((1, 8), (2, 4))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert pickle.loads(pickle.dumps(a)) == a
    assert a.num_devices == 8 and a.submesh == (1, 8)


# ---------------------------------------------------------------- devices


def test_peak_fallbacks():
    v100 = preset("p3.16xlarge").device
    assert v100.peak("fp16") == 125e12
    assert v100.peak("bf16") == 125e12  # no bf16 on V100: the 16-bit figure
    assert v100.peak("fp8") == 125e12 and v100.peak("int8") == 125e12
    assert v100.peak("tf32") == pytest.approx(15.7e12)  # no TF32 cores: fp32
    assert v100.peak("int32") == pytest.approx(15.7e12)
    assert preset("dgx-h100").device.peak("fp8") == pytest.approx(1979e12)
    with pytest.raises(InstanceError, match="fp64"):
        v100.peak("fp64")


@pytest.mark.parametrize("change, match", [
    ({"matmul_efficiency": 1.5}, "matmul_efficiency"),
    ({"memory_efficiency": 0.0}, "memory_efficiency"),
    ({"peak_flops": {"fp16": 1e12}}, "fp32"),
    ({"peak_flops": {"fp32": 1e12, "fp64": 1e12}}, "fp64"),
    ({"memory_bytes": 0}, "memory"),
])
def test_device_rejects_bad_values(change, match):
    base = dict(name="d", peak_flops={"fp32": 1e12}, memory_bytes=1, memory_bandwidth=1e9)
    with pytest.raises(InstanceError, match=match):
        Device(**{**base, **change})


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name", PRESETS)
def test_presets_default_to_64_devices_and_round_trip(name):
    cluster = preset(name)
    assert cluster.name == name and cluster.num_devices == 64
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    jsonschema.validate(cluster_to_dict(cluster), SCHEMA)


def test_preset_figures_match_reference():
    p3 = preset("p3.16xlarge")
    assert (p3.nodes, p3.devices_per_node, p3.device.memory_bytes) == (8, 8, 16 * 2**30)
    assert p3.inter_node.bandwidth == 3.125e9 and p3.inter_node.shared_by_node
    assert p3.intra_node.bandwidth == 150e9
    a100 = preset("dgx-a100")
    assert a100.device.peak("bf16") == 312e12 and a100.intra_node.bandwidth == 300e9
    assert a100.inter_node.bandwidth == 25e9 and not a100.inter_node.shared_by_node
    h100 = preset("dgx-h100")
    assert h100.device.peak("bf16") == 989e12 and h100.intra_node.bandwidth == 450e9 and h100.inter_node.bandwidth == 50e9
    tpu = preset("tpu-v4")
    assert tpu.devices_per_node == 4 and tpu.device.peak("bf16") == 275e12 and tpu.device.memory_bytes == 32 * 2**30


def test_preset_resize():
    small = preset("p3.16xlarge", nodes=2)
    assert small.num_devices == 16
    assert small == Cluster(**{**preset("p3.16xlarge").__dict__, "nodes": 2})


@pytest.mark.parametrize("nodes", [0, -3])
def test_preset_rejects_nonpositive_nodes(nodes):
    with pytest.raises(InstanceError, match="nodes"):
        preset("dgx-a100", nodes=nodes)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(InstanceError) as err:
        preset("p4d.24xlarge")
    assert "p4d.24xlarge" in err.value.line()
    for name in PRESETS:
        assert name in err.value.line()


def test_written_preset_files_are_current():
    for name in PRESETS:
        path = ROOT / "instances" / "clusters" / f"{name}.json"
        data = json.loads(path.read_text())
        assert data.pop("calibration", None) == preset_calibration(name), f"rerun scripts/write_cluster_presets.py ({name})"
        assert data == cluster_to_dict(preset(name)), f"rerun scripts/write_cluster_presets.py ({name})"
        assert read_cluster(path) == preset(name)  # schema-valid through partopt.io, and the same cluster


# ---------------------------------------------------------------- cluster files


def test_cluster_from_dict_converts_units_and_fills_defaults():
    jsonschema.validate(EXAMPLE, SCHEMA)
    cluster = cluster_from_dict(EXAMPLE)
    assert cluster.device.peak_flops == {"fp16": 125e12, "fp32": 15.7e12}
    assert cluster.device.memory_bytes == 17_179_869_184
    assert cluster.device.memory_bandwidth == 900e9
    assert (cluster.device.matmul_efficiency, cluster.device.memory_efficiency) == (0.75, 0.8)
    assert cluster.intra_node == Link(150e9, 5e-6, False, lanes=HYBRID_CUBE_MESH)
    assert cluster.inter_node == Link(3.125e9, 20e-6, True)
    # the preset as defined in code is the same machine (its data file adds the fitted efficiencies)
    p3 = preset("p3.16xlarge")
    assert cluster == nominal_preset("p3.16xlarge")
    assert cluster == dataclasses.replace(p3, device=dataclasses.replace(p3.device, matmul_efficiency=0.75,
                                                                         memory_efficiency=0.8))


def test_a_device_names_its_platform_gpu_unless_told():
    """What a device runs is read from its file (exports refuse a runtime it cannot run): the TPU preset says tpu,
    a file that names none holds GPUs and is written back without one; a platform partopt does not know is refused."""
    assert preset("tpu-v4").device.platform == "tpu" and preset("dgx-a100").device.platform == "gpu"
    assert cluster_from_dict(EXAMPLE).device.platform == "gpu" and "platform" not in cluster_to_dict(preset("dgx-a100"))["device"]
    tpu = copy.deepcopy(EXAMPLE)
    tpu["device"]["platform"] = "tpu"
    jsonschema.validate(tpu, SCHEMA)
    assert cluster_to_dict(cluster_from_dict(tpu))["device"]["platform"] == "tpu"
    tpu["device"]["platform"] = "ipu"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(tpu, SCHEMA)
    with pytest.raises(InstanceError, match="unknown platform 'ipu'"):
        cluster_from_dict(tpu)


def test_latency_defaults_when_omitted():
    data = copy.deepcopy(EXAMPLE)
    del data["intra_node"]["latency_us"], data["inter_node"]["latency_us"]
    cluster = cluster_from_dict(data)
    assert cluster.intra_node.latency_s == 5e-6 and cluster.inter_node.latency_s == 10e-6


def test_dict_round_trip_is_exact():
    data = cluster_to_dict(cluster_from_dict(EXAMPLE))
    data["device"]["peak_tflops"]["bf16"] = 12.3  # decimals that binary floats cannot hold exactly
    data["inter_node"]["bandwidth_gbps"] = 1.1
    data["intra_node"]["latency_us"] = 0.7
    data["device"]["memory_gib"] = 15.5
    cluster = cluster_from_dict(data)
    assert cluster_to_dict(cluster) == data
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster


def test_semantic_error_names_the_json_path():
    data = copy.deepcopy(EXAMPLE)
    data["device"]["matmul_efficiency"] = 2.0
    with pytest.raises(InstanceError) as err:
        cluster_from_dict(data, where="$.cluster")
    assert err.value.where == "$.cluster.device"
    assert "matmul_efficiency" in err.value.cause and err.value.hint
    data = copy.deepcopy(EXAMPLE)
    data["nodes"] = 0
    with pytest.raises(InstanceError) as err:
        cluster_from_dict(data)
    assert err.value.where == "$" and "nodes" in err.value.cause


@pytest.mark.parametrize("path, value", [
    (("device", "peak_tflops", "fp64"), 10),
    (("device", "memory_gib"), 0),
    (("inter_node", "bandwidth_gbps"), -1),
    (("nodes",), 1.5),
    (("intra_node", "speed"), 1),
    (("version",), 2),
])
def test_schema_rejects_bad_files(path, value):
    data = copy.deepcopy(EXAMPLE)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)


def test_schema_requires_fp32_peak():
    data = copy.deepcopy(EXAMPLE)
    del data["device"]["peak_tflops"]["fp32"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)


# ---------------------------------------------------------------- lanes in a cluster file

def _with_lanes(lanes, key="intra_node"):
    return {**EXAMPLE, "intra_node": {k: v for k, v in EXAMPLE["intra_node"].items() if k != "lanes"},
            key: {**EXAMPLE[key], "lanes": lanes}}


def test_lanes_round_trip_through_a_cluster_file():
    cluster = cluster_from_dict(EXAMPLE)
    assert cluster.intra_node.lanes == HYBRID_CUBE_MESH and cluster.intra_node.lane_bandwidth == pytest.approx(LANE)
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster
    jsonschema.validate(cluster_to_dict(cluster), SCHEMA)


@pytest.mark.parametrize("lanes, key, where, match", [
    ([[0, 1], [2, 0]], "intra_node", "$.intra_node", "symmetric"),
    ([[1, 1], [1, 0]], "intra_node", "$.intra_node", "diagonal"),
    ([[0, 1], [1, 0]], "intra_node", "$", "2 rows for 8 devices"),
    ([[0, 1], [1, 0]], "inter_node", "$.inter_node", "one node"),
    # 8 devices wired as two rings of four lanes (0-1-2-3 and 4-5-6-7), nothing between them: the whole node
    # as one mesh axis has no ring
    ([[0, 1, 0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0],
      [0, 0, 0, 0, 0, 1, 0, 1], [0, 0, 0, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 1, 0, 1], [0, 0, 0, 0, 1, 0, 1, 0]],
     "intra_node", "$", "no ring"),
])
def test_bad_lanes_say_what_and_where(lanes, key, where, match):
    with pytest.raises(InstanceError, match=match) as err:
        cluster_from_dict(_with_lanes(lanes, key))
    assert err.value.where == where and err.value.hint


def test_a_huge_lane_count_is_refused_at_its_place(tmp_path):
    lanes = [row[:] for row in EXAMPLE["intra_node"]["lanes"]]
    lanes[0][1] = lanes[1][0] = 10**30  # ring_count would recurse once per ring: RecursionError
    path = tmp_path / "lanes-huge.json"
    path.write_text(json.dumps(_with_lanes(lanes)))
    with pytest.raises(InstanceError, match=f"at most {MAX_LANES}") as err:
        read_cluster(path)
    assert err.value.where in (f"{path}: $.intra_node.lanes[0][1]", f"{path}: $.intra_node.lanes[1][0]")
    with pytest.raises(InstanceError, match=f"0 to {MAX_LANES}"):
        Link(150e9, 5e-6, lanes=((0, MAX_LANES + 1), (MAX_LANES + 1, 0)))
    assert SCHEMA["$defs"]["link"]["properties"]["lanes"]["items"]["items"]["maximum"] == MAX_LANES


def test_the_most_lanes_allowed_are_counted_quickly():
    most = [[0 if i == j else MAX_LANES for j in range(4)] for i in range(4)]
    cluster = cluster_from_dict({**_with_lanes(most), "devices_per_node": 4})  # checks every axis has a ring
    whole = cluster.logical_mesh((1, 4), (4, 1)).axes[0]
    assert whole.bandwidth == pytest.approx(cluster.intra_node.bandwidth)  # 3 · MAX_LANES rings, every lane busy


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_a_million_nodes_price_their_axes_as_two_nodes_do(width):
    # a node's NIC is shared by the groups crossing it, whatever the node count: the axes of 10^6 p3 nodes
    # are those of 2 (pricing them group by group took hours)
    big, small = nominal_preset("p3.16xlarge").resized(MAX_NODES), nominal_preset("p3.16xlarge").resized(2)
    assert [dataclasses.replace(a, size=0) for a in big.logical_mesh((MAX_NODES, 8), (MAX_NODES * 8 // width, width)).axes] \
        == [dataclasses.replace(a, size=0) for a in small.logical_mesh((2, 8), (16 // width, width)).axes]


def test_divisors_are_found_in_pairs():
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 500))


def test_the_schemas_bound_nodes_as_the_cli_does():
    plan = json.loads((ROOT / "partopt" / "schemas" / "plan.schema.json").read_text())
    sweep = json.loads((ROOT / "partopt" / "schemas" / "sweep.schema.json").read_text())
    assert SCHEMA["properties"]["nodes"]["maximum"] == plan["properties"]["nodes"]["maximum"] == MAX_NODES
    assert sweep["properties"]["nodes"]["items"]["maximum"] == MAX_NODES


def test_a_run_on_part_of_a_p3_node_keeps_its_lanes():
    p3 = nominal_preset("p3.16xlarge")
    two, four = p3.narrowed(2), p3.narrowed(4)
    assert two.intra_node.lanes == ((0, 1), (1, 0))  # devices 0 and 1: NV1
    assert [a.bandwidth for a in two.logical_mesh((1, 2), (2, 1)).axes][0] == pytest.approx(LANE)
    assert four.logical_mesh((1, 4), (4, 1)).axes[0].bandwidth == pytest.approx(4 * LANE)  # the quad {0,1,2,3}
    assert four.intra_node.lane_bandwidth == pytest.approx(LANE)
    assert p3.narrowed(1).intra_node.lanes is None and p3.narrowed(8) == p3
    with pytest.raises(InstanceError, match="8 devices per node"):
        p3.narrowed(9)
