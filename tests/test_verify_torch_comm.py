"""The collectives a plan implies for `verify --against torch` (partopt/verify_torch_comm.py), checked against
hand derivations on the tiny Llama, and the comparison's verdicts. No processes start here."""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from partopt.cluster import preset
from partopt.frontends.torch import from_hf_config, read_hf_config
from partopt.inter import optimize
from partopt.export import AXIS_NAMES
from partopt.plan import ParamPlacement
from partopt.sharding import MeshShape, Partial, R, Shard, reshard_collectives
from partopt.verify_torch_comm import BACKWARD, TOP_LEVEL, compare, dtensor_order, input_placements, op_inputs, \
    planned_calls, planned_reshard

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 8}
BATCH, SEQ, HIDDEN, VOCAB, FFN = 4, 8, 32, 64, 64


def solved_llama(directory):
    """The tiny Llama's config file, written in `directory`, and its plan on a 1 x 2 mesh of a p3 node."""
    config = directory / "config.json"
    config.write_text(json.dumps(LLAMA))
    graph = from_hf_config(read_hf_config(config), batch=BATCH, seq=SEQ)
    cluster = preset("p3.16xlarge", 1).narrowed(2)
    return config, optimize(graph, cluster, workers=1, microbatches=[1], logical_shapes=[(1, 2)])


def data_parallel_plan(directory):
    """The tiny Llama (batch 4 of 8 tokens) on a 1 x 2 mesh, every op up to the final norm splitting the batch
    on axis y and the LM head and loss replicated (so the norm's output is gathered for the head: the
    worked example's plan), parameters replicated with ZeRO over y; and its config file."""
    config, plan = solved_llama(directory)
    stage = plan.stages[0]
    split = (R, Shard("b"))
    head = False
    for name, info in list(stage.ops.items()):
        head = head or name == "lm_head.linear"
        if head:
            continue
        ins = tuple((R, R) if plan.tensors[t]["role"] == "param" else split for t in op_inputs(info.explanation))
        stage.ops[name] = dataclasses.replace(info, axes=(None, "b"), inputs=ins, output=split)
    for name in stage.params:  # set here: over the p3's 25 GB/s pair the solver keeps this tiny model's state whole
        stage.params[name] = ParamPlacement((R, R), (1,))
    return plan, config


def megatron_plan(directory):
    """The tiny Llama on a 1 x 2 mesh with its MLP split Megatron's way on y (gate and up by their output
    features, down by its input features: a pending sum reduced before the residual add), every other op
    replicated and their parameters replicated with ZeRO over y; and its config file."""
    config, plan = solved_llama(directory)
    stage = plan.stages[0]
    mlp = "model.layers.0.mlp"
    f = plan.tensors[f"{mlp}.up_proj.weight"]["dims"][0]
    split, whole = (R, Shard(f)), (R, R)
    for weight in ("gate_proj", "up_proj", "down_proj"):
        stage.params[f"{mlp}.{weight}.weight"] = ParamPlacement(split, ())
    for name in (f"{mlp}.gate_proj.linear", f"{mlp}.up_proj.linear"):
        stage.ops[name] = dataclasses.replace(stage.ops[name], axes=(None, f), inputs=(whole, split), output=split)
    for name in (f"{mlp}.act_fn.silu", f"{mlp}.mul"):
        info = stage.ops[name]
        stage.ops[name] = dataclasses.replace(info, axes=(None, f), inputs=(split,) * len(info.inputs), output=split)
    stage.ops[f"{mlp}.down_proj.linear"] = dataclasses.replace(
        stage.ops[f"{mlp}.down_proj.linear"], axes=(None, f), inputs=(split, split), output=(R, Partial()))
    assert all(info.axes == (None, None) for name, info in stage.ops.items() if not name.startswith(mlp))
    for name in stage.params:
        if not name.startswith(mlp):
            stage.params[name] = ParamPlacement((R, R), (1,))
    return plan, config


@pytest.fixture(scope="module")
def dp_plan(tmp_path_factory):
    return data_parallel_plan(tmp_path_factory.mktemp("comm"))


def totals(calls):
    result = {}
    for c in calls:
        key = (c["module"], c["kind"], c["axis"], "backward" if c["backward"] else "forward")
        n, b = result.get(key, (0, 0))
        result[key] = (n + 1, b + c["bytes"])
    return result


def test_an_ops_inputs_are_read_from_its_explanation():
    text = ("lm_head.linear: split b (parallel) on axis 0 — in model.norm.rmsnorm [S(b), R], lm_head.weight [R, R]; "
            "out [S(b), R] → all-gather 128 KiB on axis 0 (intra-node), 10.4 µs")
    assert op_inputs(text) == ["model.norm.rmsnorm", "lm_head.weight"]


def test_the_data_parallel_plan_implies_the_heads_gather_and_zero_sync(dp_plan):
    """By hand, in fp32: the final norm's output [4, 8, 32] is gathered on y entering lm_head (4,096 B),
    its gradient comes back replicated and is sliced (nothing). Every parameter read by a batch-split op
    has a partial gradient: reduce-scatter to its ZeRO shard and all-gather back (the parameters' 11,360
    elements: table 64·32, three norms 32, q 32·32, k and v 16·32, o 32·32, MLP 3 · 64·32); lm_head's,
    read by the replicated head, is whole on each device: only the all-gather (64·32)."""
    plan, _ = dp_plan
    got = totals(planned_calls(plan, 0))
    params = VOCAB * HIDDEN + 3 * HIDDEN + 2 * HIDDEN * HIDDEN + 2 * 16 * HIDDEN + 3 * FFN * HIDDEN
    assert params == 11_360
    assert got == {("lm_head", "all_gather", "y", "forward"): (1, BATCH * SEQ * HIDDEN * 4),
                   (TOP_LEVEL, "reduce_scatter", "y", "forward"): (11, params * 4),
                   (TOP_LEVEL, "all_gather", "y", "forward"): (12, (params + VOCAB * HIDDEN) * 4)}
    assert input_placements(plan, 0) == {"input_ids": (R, Shard("b")), "labels": (R, R)}


def test_a_tensor_entering_another_stages_module_is_gathered_there(dp_plan):
    """Cut before the final norm: verifying the first stage, the second's ops run replicated, so the layer's
    output [4, 8, 32] (batch split on y) is gathered where the next module, model.norm, begins (4,096 B);
    verifying the second, the first's output arrives replicated and is sliced, so its gradient (batch split)
    is gathered in backward (4,096 B), besides lm_head's gather."""
    plan, _ = dp_plan
    first, ops = plan.stages[0], list(plan.stages[0].ops.items())
    cut = [k for k, (name, _) in enumerate(ops) if name == "model.norm.rmsnorm"][0]
    second = dataclasses.replace(first, ops=dict(ops[cut:]), params={k: v for k, v in first.params.items()
                                                                       if k in ("model.norm.weight", "lm_head.weight")})
    two = dataclasses.replace(plan, stages=[dataclasses.replace(first, ops=dict(ops[:cut])), second])
    activation = BATCH * SEQ * HIDDEN * 4
    before = totals(c for c in planned_calls(two, 0) if c["module"] != TOP_LEVEL)
    assert before == {("model.norm", "all_gather", "y", "forward"): (1, activation)}
    after = totals(c for c in planned_calls(two, 1) if c["module"] != TOP_LEVEL)
    assert after == {("model.norm", "all_gather", "y", "backward"): (1, activation),
                     ("lm_head", "all_gather", "y", "forward"): (1, activation)}


def test_the_comparison_names_each_module_kind_and_axis_that_differs():
    planned = [{"module": "lm_head", "kind": "all_gather", "axis": "y", "bytes": 4096, "backward": False},
               {"module": TOP_LEVEL, "kind": "all_reduce", "axis": "y", "bytes": 8192, "backward": False}]
    ran = [{"module": "lm_head", "kind": "all_gather", "axis": "y", "bytes": 4096, "backward": False},
           {"module": TOP_LEVEL, "kind": "all_reduce", "axis": "y", "bytes": 8192, "backward": False},
           {"module": TOP_LEVEL, "kind": "all_reduce", "axis": "y", "bytes": 4, "backward": True}]  # the loss: small
    assert compare(planned, ran) == []
    moved = [dict(ran[0], module="model.norm"), *ran[1:]]
    assert compare(planned, moved) == [
        "lm_head: all_gather on y: the plan implies 1 (4,096 B), DTensor ran 0 (0 B)",
        "model.norm: all_gather on y: the plan implies 0 (0 B), DTensor ran 1 (4,096 B)"]
    other_kind = [dict(ran[0], kind="all_reduce"), *ran[1:]]
    assert len(compare(planned, other_kind)) == 2
    more_bytes = [dict(ran[0], bytes=8192), *ran[1:]]
    assert compare(planned, more_bytes) == ["lm_head: all_gather on y: the plan implies 1 (4,096 B), "
                                            "DTensor ran 1 (8,192 B)"]
    backward = [dict(ran[0], module="model.layers.0.mlp", backward=True), *ran[1:]]
    assert compare([dict(planned[0], module=BACKWARD, backward=True), planned[1]], backward) == []


def test_a_two_axis_reshard_is_predicted_in_dtensors_order_of_the_axes():
    """[S(b), S(b)] -> [R, R] of a 64 KiB tensor on 2 x 2: DTensor gathers y first (the 32 KiB still split on
    x), then x (the whole 64 KiB); partopt's own order on equal links takes x first (y then carries 64 KiB).
    From replicated partial sums [P, P] to a ZeRO shard [S(d), S(d)] it goes x first: a reduce-scatter of
    the whole 64 KiB on x, then of the 32 KiB left on y."""
    mesh = MeshShape((2, 2))
    split, whole = (Shard("b"), Shard("b")), (R, R)
    assert dtensor_order(split, whole, mesh) == [(Shard("b"), R), (R, R)]
    calls = [(c["kind"], c["axis"], c["bytes"]) for c in planned_reshard(split, whole, 65536, mesh)]
    assert calls == [("all_gather", "y", 32768), ("all_gather", "x", 65536)]
    assert [(k, AXIS_NAMES[a], b) for k, a, b in reshard_collectives(split, whole, 65536, mesh)] == \
        [("all_gather", "x", 32768), ("all_gather", "y", 65536)]
    partial, state = (Partial(), Partial()), (Shard("d"), Shard("d"))
    calls = [(c["kind"], c["axis"], c["bytes"]) for c in planned_reshard(partial, state, 65536, mesh)]
    assert calls == [("reduce_scatter", "x", 65536), ("reduce_scatter", "y", 32768)]


def test_a_megatron_mlp_implies_one_all_reduce_each_way_and_no_sync_of_its_weights(tmp_path):
    """By hand, in fp32: down_proj's pending sum [4, 8, 32] is all-reduced on y where it leaves its module
    (4,096 B), and the gradient of the MLP's input, pending from the split gate and up, once where it
    entered model.layers.0.mlp (4,096 B). The MLP's weights are split and their gradients whole: no sync.
    The other parameters, read by replicated ops, have whole gradients: ZeRO slices them and all-gathers
    them back (embedding 64·32, q and o 32·32, k and v 16·32, lm_head 64·32; the three norms, 32 each)."""
    plan, _ = megatron_plan(tmp_path)
    got = totals(planned_calls(plan, 0))
    activation = BATCH * SEQ * HIDDEN * 4
    gathered = (2 * VOCAB * HIDDEN + 2 * HIDDEN * HIDDEN + 2 * 16 * HIDDEN + 3 * HIDDEN) * 4
    assert got == {("model.layers.0.mlp.down_proj", "all_reduce", "y", "forward"): (1, activation),
                   ("model.layers.0.mlp", "all_reduce", "y", "backward"): (1, activation),
                   (TOP_LEVEL, "all_gather", "y", "forward"): (9, gathered)}
