"""The typed plan (issue 18 item 3): placements are Shard/Replicate/Partial tuples in Python and
text only in the file; reading and writing round-trip exactly, for solved plans and generated ones."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from partopt.cluster import preset
from partopt.errors import InstanceError
from partopt.evaluate import evaluate, uniform
from partopt.inter import optimize
from partopt.io import read_graph
from partopt.models import gpt
from partopt.plan import OpStrategy, ParamPlacement, Plan, StagePlan, plan_from_dict, plan_text, read_plan, write_plan
from partopt.sharding import P, Partial, R, Replicate, Shard, fmt, parse_placement

INSTANCES = Path(__file__).parent.parent / "instances"

# ---------------------------------------------------------------- placement text

# a dim name as the text form allows it: no parentheses, commas or whitespace (nor control characters)
DIM = st.text(st.characters(blacklist_categories=("Z", "C"), blacklist_characters="(),"), min_size=1, max_size=6)
AXIS = st.one_of(st.just(R), st.just(P), DIM.map(Shard))
PLACEMENT = st.lists(AXIS, min_size=1, max_size=3).map(tuple)


def test_placement_text_by_hand():
    assert fmt((Shard("b"), R)) == "[S(b), R]" and fmt((P, Shard("h"))) == "[P, S(h)]"
    assert parse_placement("[S(b), R]") == (Shard("b"), Replicate())
    assert parse_placement(" [ S(h) ,P ] ") == (Shard("h"), Partial())  # spacing is free when reading
    for bad in ["S(b), R", "[S(b) R]", "[X, R]", "[S(), R]", "[]", "[S(b), R, ]"]:
        with pytest.raises(InstanceError, match="malformed placement") as err:
            parse_placement(bad, "ops.fc1")
        assert err.value.where == "ops.fc1"


@given(PLACEMENT)
def test_placement_text_parses_back_to_what_fmt_printed(placement):
    text = fmt(placement)
    assert parse_placement(text) == placement and fmt(parse_placement(text)) == text


# ---------------------------------------------------------------- generated plans

SECONDS = st.floats(0, 1e6, allow_nan=False)
POSITIVE = st.floats(1e-9, 1e6, allow_nan=False)
BYTES = st.floats(0, 1e15, allow_nan=False) | st.integers(0, 2**50)
NAME = st.text(min_size=1, max_size=8)
PAIR = st.lists(st.integers(1, 64), min_size=2, max_size=2)

OPS = st.builds(OpStrategy, kind=NAME, tensor=NAME, axes=st.lists(st.none() | DIM, min_size=2, max_size=2).map(tuple),
                inputs=st.lists(PLACEMENT, max_size=3).map(tuple), output=PLACEMENT, explanation=st.text(max_size=20))
PARAMS = st.builds(ParamPlacement, placement=PLACEMENT,
                   zero_axes=st.lists(st.sampled_from([0, 1]), unique=True).map(tuple))
BREAKDOWN = st.fixed_dictionaries(
    {"compute_s": SECONDS, "comm_s": st.dictionaries(NAME, SECONDS, max_size=2),
     "sync_s": st.dictionaries(NAME, SECONDS, max_size=2), "optimizer_s": SECONDS, "param_bytes": BYTES,
     "activation_bytes": BYTES}, optional={"working_bytes": BYTES, "recompute_s": SECONDS})
STAGES = st.builds(
    StagePlan, layers=st.lists(st.integers(0, 99), min_size=2, max_size=2),
    graph_layers=st.lists(st.none() | st.integers(0, 99) | NAME, min_size=2, max_size=2), submesh=PAIR,
    logical_mesh=PAIR, devices=st.lists(st.integers(0, 999), min_size=1, max_size=4, unique=True),
    stage_time_s=POSITIVE, forward_s=SECONDS, send_time_s=SECONDS, sync_time_s=SECONDS, memory_bytes=BYTES,
    inflight_microbatches=st.integers(1, 64), breakdown=BREAKDOWN, ops=st.dictionaries(NAME, OPS, max_size=3),
    params=st.dictionaries(NAME, PARAMS, max_size=3), recompute=st.sampled_from(["none", "selective", "full"]))
TENSORS = st.dictionaries(NAME, st.fixed_dictionaries(
    {"dims": st.lists(DIM, max_size=3), "shape": st.lists(st.integers(1, 4096), max_size=3),
     "role": st.sampled_from(["input", "param", "activation", "output"])}), max_size=3)
PLANS = st.builds(
    Plan, graph=NAME, cluster=NAME, nodes=st.integers(1, 1000), devices_per_node=st.integers(1, 4096),
    iteration_time_s=POSITIVE, num_microbatches=st.integers(1, 2**20), microbatch_size=st.integers(1, 4096),
    stages=st.lists(STAGES, min_size=1, max_size=3), memory_peak_bytes=BYTES,
    throughput=st.dictionaries(NAME, SECONDS, max_size=2),
    solver=st.fixed_dictionaries({"backend": NAME, "status": NAME, "gap": SECONDS, "ilps": st.integers(0, 99)}),
    options=st.fixed_dictionaries({}, optional={"layers": st.none() | st.integers(1, 64),
                                                "recompute": st.sampled_from(["auto", "none", "selective", "full"]),
                                                "memory_reserve": st.floats(0, 0.99)}),
    batch_dim=st.none() | DIM, tensors=TENSORS)


@given(PLANS)
def test_generated_plans_round_trip_exactly(plan):
    """typed -> text -> typed gives the same objects, and the text read and written again is the same bytes."""
    text = plan_text(plan)
    back = plan_from_dict(json.loads(text))
    assert back == plan
    assert plan_text(back) == text


@given(PLANS, SECONDS, SECONDS)
def test_wall_times_stay_out_of_the_file(plan, planning, solving):
    """A plan found in 1 s or in 1 h is the same file: the run's wall times are not written."""
    timed = dataclasses.replace(plan, solver={**plan.solver, "time_s": planning, "ilp_time_s": solving})
    assert plan_text(timed) == plan_text(plan)


# ---------------------------------------------------------------- solved plans

@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory) -> list[Path]:
    """Plan files as `partopt solve -o` writes them: the tiny GPT's (pipelined, ZeRO), an MLP on one stage of 8, a recomputing GPT, a Megatron-style plan with ZeRO, and a plan priced again by `evaluate`."""
    cluster = preset("p3.16xlarge", 1)
    small = gpt(hidden=64, layers=2, heads=4, seq=32, vocab=128, batch=8, name="tiny-gpt")
    plans = [optimize(read_graph(INSTANCES / "mlp-2layer.json"), cluster, microbatches=1, intra_only=True, workers=1),
             optimize(small, tiny.cluster, microbatches=2, layers=2, logical_shapes=[(2, 1)], workers=1, recompute="full"),
             uniform(small, cluster, tp=2, pp=2, dp=2, microbatches=2, zero=True, workers=1),
             evaluate(tiny.graph, tiny.cluster, tiny.plan, workers=1)]
    directory = tmp_path_factory.mktemp("corpus")
    files = [Path(tiny.plan_file)]
    for i, plan in enumerate(plans):
        files.append(directory / f"plan-{i}.json")
        write_plan(plan, files[-1])
    return files


def test_every_solved_plan_file_reads_and_writes_back_byte_for_byte(corpus, tmp_path):
    for path in corpus:
        again = tmp_path / "again.json"
        write_plan(read_plan(path), again)
        assert again.read_bytes() == path.read_bytes(), path


def test_solved_plans_hold_typed_placements(corpus):
    """What assembly builds, and what the reader gives back, are placement objects, never text."""
    for path in corpus:
        for stage in read_plan(path).stages:
            mesh_axes = len(stage.logical_mesh)
            for op in stage.ops.values():
                assert isinstance(op, OpStrategy) and len(op.axes) == mesh_axes
                for placement in (*op.inputs, op.output):
                    assert len(placement) == mesh_axes
                    assert all(isinstance(p, (Shard, Replicate, Partial)) for p in placement)
                # the output is split on each mesh axis by the dim that axis splits, when the output has it
                for dim, placed in zip(op.axes, op.output):
                    assert placed == R if dim is None else placed in (Shard(dim), R, P)
            for param in stage.params.values():
                assert isinstance(param, ParamPlacement) and all(isinstance(k, int) for k in param.zero_axes)
                assert all(param.placement[k] == R for k in param.zero_axes)  # ZeRO only where the weight is whole


def test_hand_written_variants_read_as_the_canonical_plan(tiny, tmp_path):
    """Spacing inside a placement and the optional fields are free when reading; writing gives the canonical form."""
    data = json.loads(Path(tiny.plan_file).read_text())
    for stage in data["stages"]:
        del stage["recompute"]  # files before per-stage modes; options.recompute is false here: "none"
        for op in stage["ops"].values():
            op["output"] = op["output"].replace(", ", ",")
        for param in stage["params"].values():
            if not param["zero_axes"]:
                del param["zero_axes"]
    assert all(s.recompute == "none" for s in tiny.plan.stages)
    assert plan_from_dict(data) == read_plan(tiny.plan_file)


def test_an_op_entry_with_an_unknown_field_is_refused_not_dropped(tiny):
    data = json.loads(Path(tiny.plan_file).read_text())
    name = next(iter(data["stages"][1]["ops"]))
    data["stages"][1]["ops"][name]["note"] = "mine"
    with pytest.raises(InstanceError, match="unknown field") as err:
        plan_from_dict(data, "plan.json")
    assert err.value.where.startswith(f'plan.json: $.stages[1].ops["{name}"].note')
