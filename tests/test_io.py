"""Instance files: round trips of every bundled instance, the schema's consistency with the IR,
the file layout, and one clear one-line InstanceError per kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from partopt import io
from partopt.cluster import PRESETS, Cluster, cluster_to_dict, preset
from partopt.errors import InstanceError
from partopt.costmodel import OPTIMIZER_STATE
from partopt.graph import DTYPE_BYTES, MAX_DIM, MAX_OP_FLOPS, OPTIMIZERS, ROLES, Graph, Op, Tensor
from partopt.models import preset as model_preset
from partopt.ops import KINDS

ROOT = Path(__file__).resolve().parent.parent
INSTANCES = sorted((ROOT / "instances").rglob("*.json"))
BAD = ROOT / "tests" / "bad"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------- round trips

def test_the_hand_written_instances_are_there():
    names = {p.name for p in INSTANCES}
    assert {"mlp-2layer.json", "mlp-4layer.json", "attention-block.json", "cnn-tiny.json"} <= names


@pytest.mark.parametrize("path", INSTANCES, ids=rel)
def test_every_instance_round_trips(path, tmp_path):
    data = io.load_json(path)
    instance = io.read(path)
    copy = tmp_path / path.name
    if isinstance(instance, Graph):
        assert io.graph_to_dict(instance) == data  # files are canonical
        io.write_graph(instance, copy)
        assert copy.read_text() == path.read_text()  # and written in the canonical layout
    else:
        assert isinstance(instance, Cluster)
        io.write_cluster(instance, copy)
        assert io.read_cluster(copy) == instance
        assert io.load_json(copy) == cluster_to_dict(instance)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_round_trips_through_a_file(name, tmp_path):
    cluster = preset(name)
    io.write_cluster(cluster, tmp_path / "c.json")
    assert io.read(tmp_path / "c.json") == cluster


def test_round_trip_keeps_every_optional_field_and_omits_defaults():
    g = Graph("opt", {"b": 2, "s": 4, "t": 4}, {
        "x": Tensor("x", ("b", "s"), "input", "bf16"),
        "y": Tensor("y", ("b", "t")),
        "z": Tensor("z", ("b", "t"), "output", "fp32"),
    }, [
        Op("rename", "reshape", ("x",), "y", None, {"merge": {"t": ("s",)}}),  # tuples become lists
        Op("act", "elementwise", ("y",), "z", 3, {}),
    ], batch_dim=None, dtype="fp16")
    d = io.graph_to_dict(g)
    assert d == {
        "format": "partopt.graph", "version": 1, "name": "opt", "dtype": "fp16",
        "dims": {"b": 2, "s": 4, "t": 4},
        "tensors": {"x": {"dims": ["b", "s"], "role": "input", "dtype": "bf16"},
                    "y": {"dims": ["b", "t"]},
                    "z": {"dims": ["b", "t"], "role": "output", "dtype": "fp32"}},
        "ops": [{"name": "rename", "kind": "reshape", "inputs": ["x"], "output": "y", "attrs": {"merge": {"t": ["s"]}}},
                {"name": "act", "kind": "elementwise", "inputs": ["y"], "output": "z", "layer": 3}],
    }
    assert list(d) == ["format", "version", "name", "dtype", "dims", "tensors", "ops"]
    back = io.graph_from_dict(d)
    assert back.batch_dim is None and back.tensors["y"].role == "activation" and back.ops[0].layer is None
    assert io.graph_to_dict(back) == d


def test_a_non_default_optimizer_is_written_and_read_back():
    d = io.graph_to_dict(model_preset("moe-380m"))
    assert d["optimizer"] == "adafactor" and list(d)[:5] == ["format", "version", "name", "dtype", "optimizer"]
    assert io.graph_from_dict(d).optimizer == "adafactor"
    assert "optimizer" not in io.graph_to_dict(model_preset("gpt-350m"))  # adam, the default, is omitted


def test_a_graph_file_without_dtype_gets_the_graph_default():
    d = io.load_json(ROOT / "instances" / "mlp-2layer.json")
    del d["dtype"]
    assert io.graph_from_dict(d).dtype == Graph.__dataclass_fields__["dtype"].default


# ---------------------------------------------------------------- layout

def chain(n: int) -> Graph:
    """n elementwise ops in a chain, with realistic long names."""
    tensors = {"input": Tensor("input", ("b", "s", "h"), "input")}
    ops = []
    for i in range(n):
        tensors[f"layer{i:04d}.attention.output"] = Tensor(f"layer{i:04d}.attention.output", ("b", "s", "h"))
        prev = "input" if i == 0 else f"layer{i - 1:04d}.attention.output"
        ops.append(Op(f"layer{i:04d}.attention.dropout", "elementwise", (prev,), f"layer{i:04d}.attention.output",
                      i // 10, {"fn": "dropout"}))
    return Graph("chain", {"b": 8, "s": 2048, "h": 4096}, tensors, ops, "b", "bf16")


def test_layout_is_one_tensor_and_one_op_per_line_and_small(tmp_path):
    g = chain(1000)
    path = tmp_path / "chain.json"
    io.write_graph(g, path)
    text = path.read_text()
    assert text.endswith("}\n") and not text.endswith("\n\n")
    lines = text.splitlines()
    # { format version name dtype batch_dim dims tensors{ ... } ops[ ... ] }
    assert len(lines) == 1 + 6 + (1 + 1001 + 1) + (1 + 1000 + 1) + 1
    assert sum('"kind": "elementwise"' in line for line in lines) == 1000
    assert len(text.encode()) < 1_000_000
    io.write_graph(g, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == text  # deterministic


def test_writing_into_a_missing_directory_is_an_instance_error(tmp_path):
    with pytest.raises(InstanceError, match="does not exist") as info:
        io.write_graph(chain(1), tmp_path / "no" / "such" / "dir.json")
    assert str(tmp_path / "no") in info.value.line()


def test_a_name_as_long_as_the_filesystem_allows_is_written(tmp_path):
    """The temporary file beside the output has a short name of its own: the output's name may use every byte
    its filesystem allows, and one byte more is refused before any work, with the name and the limit."""
    import os

    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = tmp_path / ("g" * (longest - len(".json")) + ".json")
    io.write_graph(chain(1), path)
    assert io.read_graph(path).name == chain(1).name
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    with pytest.raises(InstanceError, match=f"longer than the {longest} bytes") as info:
        io.check_output(tmp_path / ("g" * (longest - len(".json") + 1) + ".json"))
    assert info.value.hint == "use a shorter name"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, which refuses new files even to root")
def test_a_directory_that_refuses_new_files_is_refused_before_any_work():
    """Permission bits say nothing to root, so the check makes a probe file: /proc takes none."""
    with pytest.raises(InstanceError, match="cannot write in /proc") as info:
        io.check_output("/proc/partopt-plan.json")
    assert info.value.where == "/proc/partopt-plan.json"


# ---------------------------------------------------------------- the schema

def enums(schema: dict) -> dict[str, list]:
    defs = schema["$defs"]
    return {"kind": defs["op"]["properties"]["kind"]["enum"], "role": defs["tensor"]["properties"]["role"]["enum"],
            "dtype": defs["dtype"]["enum"], "optimizer": schema["properties"]["optimizer"]["enum"]}


def test_schema_enums_equal_the_ir_constants():
    found = enums(io.load_schema("graph"))
    assert found["kind"] == list(KINDS)
    assert found["role"] == list(ROLES)
    assert found["dtype"] == list(DTYPE_BYTES)
    assert found["optimizer"] == list(OPTIMIZERS) == list(OPTIMIZER_STATE)


def test_schema_size_limits_equal_the_ir_constants():
    """The file's bounds are the IR's (a dim of 10^400 or an opaque op of 10^400 FLOPs overflowed float64)."""
    schema = io.load_schema("graph")
    assert schema["properties"]["dims"]["additionalProperties"]["maximum"] == MAX_DIM == 2**53
    assert schema["$defs"]["attrs"]["properties"]["flops"]["maximum"] == MAX_OP_FLOPS == 10**30


def walk_fields(schema: dict, path: str = "$"):
    """Every (path, subschema) that declares a field: properties, additionalProperties, items."""
    for key in ("properties", "$defs"):
        for name, sub in schema.get(key, {}).items():
            yield f"{path}.{name}", sub
            yield from walk_fields(sub, f"{path}.{name}")
    for key in ("additionalProperties", "items"):
        if isinstance(schema.get(key), dict):
            yield f"{path}[{key}]", schema[key]
            yield from walk_fields(schema[key], f"{path}[{key}]")


def test_schema_is_valid_closed_and_described():
    schema = io.load_schema("graph")
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    undescribed = [p for p, sub in walk_fields(schema) if "description" not in sub and set(sub) != {"$ref"}]
    assert undescribed == []
    records = [sub for _, sub in walk_fields(schema) if "properties" in sub] + [schema]
    assert len(records) == 5  # the file, a tensor, an op, its attrs, the architecture
    assert all(sub["additionalProperties"] is False for sub in records)


def test_schema_rejects_an_integral_float_as_a_size():
    with pytest.raises(InstanceError, match="expected integer, got number"):
        io.validate_against_schema({"format": "partopt.graph", "version": 1, "name": "g",
                                    "dims": {"b": 2.0}, "tensors": {}, "ops": []}, "graph", "f.json")


def test_unknown_attr_inside_attrs_is_rejected_with_its_path():
    d = io.load_json(ROOT / "instances" / "mlp-2layer.json")
    d["ops"][2]["attrs"]["slope"] = 0.1
    with pytest.raises(InstanceError) as info:
        io.graph_from_dict(d, "m.json")
    assert info.value.where == "m.json: $.ops[2].attrs.slope (act1)"
    assert info.value.cause == "unknown field"


def test_a_graph_file_keeps_its_architecture_and_a_bad_one_is_named_with_its_path():
    d = io.load_json(ROOT / "instances" / "llama-7b.json")
    assert io.graph_from_dict(d).architecture == d["architecture"]
    assert io.graph_to_dict(io.graph_from_dict(d)) == d
    d["architecture"]["norm"] = "batchnorm"
    with pytest.raises(InstanceError) as info:
        io.graph_from_dict(d, "l.json")
    assert info.value.where == "l.json: $.architecture.norm" and "batchnorm" in info.value.cause


def test_the_graph_and_plan_schemas_describe_one_architecture():
    """The plan carries the graph's architecture for exports: the two schemas must say the same of it."""
    assert io.load_schema("graph")["$defs"]["architecture"] == io.load_schema("plan")["$defs"]["architecture"]


def test_json_path_quotes_keys_that_are_not_identifiers():
    assert io.json_path(["tensors", "l0.w_fc1", "dims", 1]) == '$.tensors["l0.w_fc1"].dims[1]'
    assert io.json_path([]) == "$"


def test_errors_without_a_file_name_start_at_the_json_root():
    d = io.load_json(ROOT / "instances" / "mlp-2layer.json")
    d["ops"][0]["inputs"] = ["x", "w9"]
    with pytest.raises(InstanceError) as info:
        io.graph_from_dict(d)
    assert info.value.where == "$.ops[0] (fc1)" and "'w9' is not declared" in info.value.cause


# ---------------------------------------------------------------- bad files

# file -> (where the error points, part of its cause)
BAD_CASES = {
    "malformed-json.json": ("line 4 column 2", "invalid JSON: Expecting ',' delimiter"),
    "unknown-field-top.json": ("$.colour", "unknown field"),
    "unknown-field-op.json": ("$.ops[0].stage (act)", "unknown field"),
    "missing-field.json": ("$.ops[0] (act)", "missing required field 'output'"),
    "duplicate-dim.json": ("$.dims", "key 'h' appears twice (values 8 and 16)"),
    "produced-twice.json": ("$.ops[1] (act_again)", "tensor 'y' is produced twice"),
    "produced-never.json": ("$.tensors.orphan", "produced by no op"),
    "param-unread.json": ("$.tensors.w_spare", "parameter is read by no op"),
    "batch-dim-on-no-input.json": ("$.batch_dim", "batch dim 'g' is on no input tensor"),
    "param-carries-batch-dim.json": ("$.tensors.w", "parameter carries the batch dim 'b'"),
    "cycle.json": ("$.ops (first -> second)", "cycle"),
    "einsum-output-dim.json": ("$.ops[0] (fc)", "output dims ['g'] appear in no input"),
    "conv-3d-input.json": ("$.ops[0] (conv)", "conv2d tensors are 4-D"),
    "attr-of-another-kind.json": ("$.ops[0].attrs.kernel (fc)", "einsum does not read attribute 'kernel'"),
    "dim-10-to-400.json": ("$.dims.h", "must be at most 9007199254740992, got 1000"),
    "opaque-flops-10-to-400.json": ("$.ops[1].attrs.flops (opq)", "must be at most 1000000000000000000000000000000"),
    "negative-size.json": ("$.dims.h", "must be greater than 0, got -8"),
    "zero-size.json": ("$.dims.b", "must be greater than 0, got 0"),
    "fractional-size.json": ("$.dims.h", "expected integer, got number"),
    "unknown-kind.json": ("$.ops[1].kind (mystery)", "unknown value 'fft'"),
    "unknown-dtype.json": ("$.tensors.x.dtype", "unknown value 'fp12'"),
    "unknown-optimizer.json": ("$.optimizer", "unknown value 'lion'"),
    "undeclared-tensor.json": ("$.ops[0] (act)", "tensor 'bias' is not declared"),
    "unknown-format.json": ("$.format", "unknown format 'partopt.graf'"),
    "version-2.json": ("$.version", "expected 1, got 2"),
    "not-an-object.json": ("$", "JSON array, not an object"),
    "cluster-unknown-field.json": ("$.device.tdp_watts", "unknown field"),
    "cluster-memory-1e300.json": ("$.device.memory_gib", "must be at most 1000000000.0, got 1e+300"),
    "cluster-memory-infinity.json": ("$", "Infinity is not a JSON number"),
    "cluster-nodes-huge.json": ("$.nodes", "must be at most 1000000, got 1000000000"),
    "cluster-name-lone-surrogate.json": ("$.name", "is not valid Unicode (a lone surrogate escape)"),
    "format-an-object.json": ("$.format", "unknown format {'kind': 'partopt.graph'}"),
    "nested-too-deep.json": ("$", "nested deeper than 64 levels"),
    "plan-as-instance.json": ("$.format", "unknown format 'partopt.plan'"),
    "number-5000-digits.json": ("$", "a number is too long"),
}


def test_every_bad_file_has_a_case():
    assert sorted(p.name for p in BAD.glob("*.json")) == sorted(BAD_CASES)


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_file_is_a_one_line_instance_error_at_its_place(name):
    place, cause = BAD_CASES[name]
    path = BAD / name
    with pytest.raises(InstanceError) as info:
        io.read(path)
    err = info.value
    assert err.where == f"{path}: {place}"
    assert cause in err.cause
    assert err.hint
    assert "\n" not in err.line()


def test_a_graph_file_without_ops_names_the_ops_field(tmp_path):
    path = tmp_path / "empty-ops.json"
    path.write_text(json.dumps({"format": "partopt.graph", "version": 1, "name": "mlp", "dtype": "fp32",
                                "batch_dim": "b", "dims": {"b": 1024, "h": 128},
                                "tensors": {"x": {"dims": ["b", "h"], "role": "input"},
                                            "w": {"dims": ["h"], "role": "param"}}, "ops": []}))
    with pytest.raises(InstanceError) as info:
        io.read_graph(path)
    assert info.value.where == f"{path}: $.ops" and "no ops" in info.value.cause


def test_duplicate_key_deep_inside_names_its_path(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"a": [1, {"b": {"c": 1, "c": 2}}]}')
    with pytest.raises(InstanceError) as info:
        io.load_json(path)
    assert info.value.where == f"{path}: $.a[1].b"


def test_missing_file_and_missing_format(tmp_path):
    with pytest.raises(InstanceError, match="no such file"):
        io.read(tmp_path / "absent.json")
    (tmp_path / "f.json").write_text('{"name": "x"}')
    with pytest.raises(InstanceError, match="missing required field 'format'") as info:
        io.read(tmp_path / "f.json")
    assert info.value.where == f"{tmp_path / 'f.json'}: $"


def test_read_graph_rejects_a_cluster_file_by_its_format():
    with pytest.raises(InstanceError, match="expected 'partopt.graph', got 'partopt.cluster'"):
        io.read_graph(BAD / "cluster-unknown-field.json")


def test_a_non_utf8_file_is_an_instance_error(tmp_path):
    (tmp_path / "latin.json").write_bytes('{"name": "café"}'.encode("latin-1"))
    with pytest.raises(InstanceError, match="not UTF-8"):
        io.load_json(tmp_path / "latin.json")


def test_bad_json_error_points_at_line_and_column(tmp_path):
    (tmp_path / "x.json").write_text('{\n "a": 1,\n "b": [1 2]\n}\n')
    with pytest.raises(InstanceError) as info:
        io.load_json(tmp_path / "x.json")
    assert info.value.line().startswith(f"{tmp_path / 'x.json'}: line 3 column 10: invalid JSON: Expecting ',' delimiter")
