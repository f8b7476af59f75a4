"""A parameter read by several priced layers (GPT's tied token table: the embedding and the LM head)
is held once per stage, and its gradient is summed across the stages that hold it — by hand."""


import pytest

from partopt.cluster import preset
from partopt.evaluate import evaluate
from partopt.inter import optimize
from partopt.models.gpt import gpt
from partopt.shared import ALL_REDUCE_KEY, shared_params
from partopt.sharding import R

H, V = 64, 512


def tied_gpt():
    return gpt(hidden=H, layers=2, heads=4, seq=32, vocab=V, batch=8)


def two_devices():
    return preset("p3.16xlarge", 1).narrowed(2)


def test_the_tied_table_is_the_only_shared_parameter():
    from partopt.layering import build_layers

    graph = tied_gpt()
    layering = build_layers(graph, None)
    shared = shared_params(graph, layering.base)
    assert list(shared) == ["embed.wte"]
    assert shared["embed.wte"] == (0, len(layering.base) - 1)  # the embedding and the head


def one_device():
    return preset("p3.16xlarge", 1).narrowed(1)


def test_one_stage_holds_the_tied_table_once():
    graph = tied_gpt()
    stage = optimize(graph, one_device(), microbatches=1, workers=1).stages[0]
    # every parameter once, the table included: 16 B (mixed-precision Adam) per parameter on the one device
    assert stage.breakdown["param_bytes"] == pytest.approx(16 * graph.num_params, rel=1e-12)
    assert sum(stage.breakdown["state_bytes"].values()) == pytest.approx(16 * graph.num_params, rel=1e-12)
    assert ALL_REDUCE_KEY not in stage.breakdown["sync_s"]  # nothing to sum with: no other stage holds it


def test_two_stages_each_hold_the_table_and_all_reduce_its_gradient():
    graph, cluster = tied_gpt(), two_devices()
    plan = optimize(graph, cluster, microbatches=2, inter_only=True, workers=1, recompute="none")
    assert len(plan.stages) == 2
    table = 16 * V * H  # each stage keeps a whole copy of the table (one device per stage)
    gradient = 2 * V * H  # fp16 gradient of the table
    for stage in plan.stages:
        assert stage.params["embed.wte"].placement == (R, R)
        # a bucketed ring all-reduce over 2 ranks: 2 (n - 1) / n · S / bw = S / bw on the link between stages
        link = cluster.intra_node
        assert stage.breakdown["sync_s"][ALL_REDUCE_KEY] == pytest.approx(gradient / link.bandwidth, rel=1e-12)
    assert sum(s.breakdown["param_bytes"] for s in plan.stages) == pytest.approx(16 * graph.num_params + table,
                                                                                   rel=1e-12)
    again = evaluate(graph, cluster, plan)
    assert again.iteration_time_s == pytest.approx(plan.iteration_time_s, rel=1e-12)
    assert [s.memory_bytes for s in again.stages] == pytest.approx([s.memory_bytes for s in plan.stages], rel=1e-12)
