"""Megatron-style plans with every parameter split over the data-parallel axis (ZeRO-3, FSDP: `evaluate.uniform`'s
`shard_weights`, `partopt evaluate --shard-weights`, a points file's `shard_weights`), against closed forms."""

import json
import math

import pytest
from click.testing import CliRunner

from partopt import costmodel, preset
from partopt.calibrate import read_points
from partopt.check import differences
from partopt.cli import main
from partopt.evaluate import uniform
from partopt.export import NotExpressibleError, to_dtensor, to_jax
from partopt.io import write_graph
from partopt.models.gpt import gpt
from partopt.plan import read_plan, write_plan
from partopt.sharding import Shard


@pytest.fixture(scope="module")
def tiny():
    return gpt(hidden=256, layers=2, heads=4, seq=128, vocab=1024, batch=8)


def _devices(n: int):
    return preset("p3.16xlarge", 1).narrowed(n)


def _state(graph, weights: float, grads: float, optimizer: float) -> float:
    """Σ over the parameters of their training state, each part scaled by the given share."""
    total = 0.0
    for name, tensor in graph.tensors.items():
        if tensor.role == "param":
            m = costmodel.param_memory(graph.numel(name), graph.dtype_of(name), graph.optimizer)
            total += m.weights * weights + m.grads * grads + m.optimizer * optimizer
    return total


@pytest.mark.parametrize("dp", [2, 4])
def test_weights_split_over_the_data_parallel_axis(tiny, dp):
    """Every parameter is stored split along the data-parallel axis 0, with no ZeRO axis besides. Per device: the
    weights, the gradient and the optimizer state at 1/dp (the gradient is reduce-scattered into the stored split
    after each microbatch's backward and accumulates there, as FSDP runs it: docs/COSTMODEL.md, "Gradient
    accumulation buffers"); plain data parallelism holds all three whole, and ZeRO-2 the optimizer state at 1/dp."""
    cluster = _devices(dp)
    sharded = uniform(tiny, cluster, 1, 1, dp, 1, recompute="none", overlap=False, shard_weights=True)
    stage = sharded.stages[0]
    assert stage.params and all(isinstance(p.placement[0], Shard) and not p.zero_axes for p in stage.params.values())
    assert stage.breakdown["param_bytes"] == pytest.approx(_state(tiny, 1 / dp, 1 / dp, 1 / dp), rel=1e-12)
    plain = uniform(tiny, cluster, 1, 1, dp, 1, recompute="none", overlap=False)
    assert plain.stages[0].breakdown["param_bytes"] == pytest.approx(_state(tiny, 1, 1, 1), rel=1e-12)
    zero = uniform(tiny, cluster, 1, 1, dp, 1, recompute="none", overlap=False, zero=True)
    assert zero.stages[0].breakdown["param_bytes"] == pytest.approx(_state(tiny, 1, 1, 1 / dp), rel=1e-12)
    assert sharded.options["megatron"]["shard_weights"] and not plain.options["megatron"]["shard_weights"]


def test_a_parameter_no_rank_count_divides_is_stored_padded():
    """Over 3 ranks none of the tiny GPT's dims (256, 1024, 64, 4, 128, 1024) divides: ZeRO-3 and FSDP still split
    each parameter, padding the shards. Each is stored split along one of its dims, each rank holding the largest
    shard, ceil(size / 3) of the dim's size: its weights, gradient and optimizer state at that fraction, by hand over
    the placements the plan records (before, each stayed a copy with only its optimizer state split)."""
    graph = gpt(hidden=256, layers=2, heads=4, seq=128, vocab=1024, batch=6)
    plan = uniform(graph, _devices(3), 1, 1, 3, 1, recompute="none", overlap=False, shard_weights=True)
    stage, state = plan.stages[0], 0.0
    assert set(stage.params) == {t for t, info in graph.tensors.items() if info.role == "param"}
    for name, p in stage.params.items():
        assert isinstance(p.placement[0], Shard) and not p.zero_axes, name
        size = graph.dims[p.placement[0].dim]
        assert size % 3, name
        state += costmodel.param_memory(graph.numel(name), graph.dtype_of(name), graph.optimizer).total * math.ceil(
            size / 3) / size
    assert stage.breakdown["param_bytes"] == pytest.approx(state, rel=1e-12)
    assert state < _state(graph, 1 / 3, 1 / 3, 1 / 3) * 1.05  # padding, not copies


def test_a_padded_plan_checks_and_exports_where_a_runtime_can_hold_it(tmp_path):
    """The padded plan passes `partopt check` (valid for ZeRO-3's layout, priced again alike, from its file); DTensor
    shards unevenly, so it exports; a JAX sharding must divide what it splits, so `--to jax` says why it cannot."""
    graph = gpt(hidden=256, layers=2, heads=4, seq=128, vocab=1024, batch=6)
    cluster = _devices(3)
    write_plan(uniform(graph, cluster, 1, 1, 3, 1, recompute="none", overlap=False, shard_weights=True),
               tmp_path / "plan.json")
    written = read_plan(tmp_path / "plan.json")
    assert differences(written, graph, cluster) == []
    assert to_dtensor(written)["stages"][0]["params"]["l0.q.w"]["placements"][0]["type"] == "Shard"
    with pytest.raises(NotExpressibleError, match="JAX sharding must divide"):
        to_jax(written)


def test_one_device_has_nothing_to_split(tiny):
    """With one data-parallel rank the flag changes nothing: the same plan, iteration and memory."""
    cluster = _devices(1)
    alone = uniform(tiny, cluster, 1, 1, 1, 1, recompute="none", shard_weights=True)
    plain = uniform(tiny, cluster, 1, 1, 1, 1, recompute="none")
    assert alone.iteration_time_s == plain.iteration_time_s
    assert alone.stages[0].memory_bytes == plain.stages[0].memory_bytes


def test_the_cli_prices_it_and_check_derives_it_again(tiny, tmp_path):
    """`partopt evaluate --shard-weights` writes a plan whose layout `partopt check` prices again to the same figures;
    the flag describes a Megatron-style plan, so it is refused beside --plan."""
    graph_file, plan_file = tmp_path / "tiny.json", tmp_path / "plan.json"
    write_graph(tiny, graph_file)
    cluster = ["--cluster", "p3.16xlarge", "--nodes", "1"]
    runner = CliRunner()
    done = runner.invoke(main, ["evaluate", str(graph_file), *cluster, "--tp", "2", "--pp", "1", "--dp", "4",
                                "--shard-weights", "--microbatches", "1", "-o", str(plan_file)])
    assert done.exit_code == 0, done.output
    layout = json.loads(plan_file.read_text())["options"]["megatron"]
    assert layout["shard_weights"] and layout["dp"] == 4
    checked = runner.invoke(main, ["check", str(plan_file), "--graph", str(graph_file), *cluster])
    assert checked.exit_code == 0, checked.output
    refused = runner.invoke(main, ["evaluate", str(graph_file), *cluster, "--plan", str(plan_file), "--shard-weights"])
    assert refused.exit_code != 0 and "--shard-weights" in refused.output


def test_a_points_file_names_it(tmp_path):
    """A calibration point's plan may say `shard_weights` (default false), as Alpa's ZeRO-3 ablation rows ran."""
    point = {"label": "p", "source": "s", "model": {"generator": "gpt", "args": {
        "hidden": 256, "layers": 2, "heads": 4, "seq": 128, "vocab": 1024, "batch": 8}},
             "cluster": {"preset": "p3.16xlarge", "nodes": 1, "devices_per_node": 2},
             "measured": {"tflops_per_gpu": 10.0}}
    path = tmp_path / "points.json"
    path.write_text(json.dumps({"format": "partopt.points", "version": 1, "points": [
        {**point, "label": "sharded", "plan": {"tp": 1, "pp": 1, "dp": 2, "shard_weights": True}},
        {**point, "label": "plain", "plan": {"tp": 1, "pp": 1, "dp": 2}}]}))
    sharded, plain = read_points(path).points
    assert sharded.shard_weights and not plain.shard_weights
