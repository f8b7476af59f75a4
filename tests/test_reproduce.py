"""Tests of partopt.bench and scripts/reproduce_alpa.py: the paper's metric by hand, the cases
against REFERENCE.md §3, the checks' logic, and a small end-to-end slice."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt import intra
from partopt.bench import alpa, harness, report
from partopt.cli import main
from partopt.errors import InfeasibleError, InstanceError
from partopt.inter import Options
from partopt.stages import StageSpec
from partopt.layering import build_layers
from partopt.io import read_graph
from partopt.plan import Plan, StagePlan

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("reproduce_alpa", ROOT / "scripts" / "reproduce_alpa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(iteration_s: float, nodes: int, per_node: int, tflops: float = 0.0, hardware: float = 0.0) -> Plan:
    return Plan(graph="g", cluster="p3.16xlarge", nodes=nodes, devices_per_node=per_node, iteration_time_s=iteration_s,
                num_microbatches=1, microbatch_size=1, stages=[], memory_peak_bytes=0.0,
                throughput={"samples_per_s": 0.0, "tflops_per_device": tflops, "hardware_tflops_per_device": hardware},
                solver={})


# ---------------------------------------------------------------- the metric (REFERENCE §2)

def test_gpt_closed_form_reproduces_the_measured_point():
    # REFERENCE §3: GPT 2.6B, batch 32, 2.464 s per iteration on 8 GPUs = 37.01 TFLOP/s per GPU.
    flops = alpa.gpt_flops(32, 1024, 32, 2560, 51200)
    by_hand = 96 * 32 * 1024 * 32 * 2560**2 * (1 + 1024 / (6 * 2560) + 51200 / (16 * 32 * 2560))
    assert flops == pytest.approx(by_hand, rel=1e-12)
    assert flops / 2.464 / 8 / 1e12 == pytest.approx(37.01, abs=0.01)
    # without recomputation (Korthikanti et al. 2022's model FLOPs): 72 · B s l h² (1 + s/6h + V/12lh)
    model = 72 * 32 * 1024 * 32 * 2560**2 * (1 + 1024 / (6 * 2560) + 51200 / (12 * 32 * 2560))
    assert alpa.gpt_flops(32, 1024, 32, 2560, 51200, recompute=False) == pytest.approx(model, rel=1e-12)


def test_tflops_per_gpu_gpt_uses_the_96_form_of_the_graph():
    graph = intra.with_batch(read_graph(ROOT / "instances" / "gpt-2.6b.json"), 32)
    assert alpa.gpt_shape(graph) == (32, 1024, 32, 2560, 51200)  # REFERENCE §3 table
    assert alpa.tflops_per_gpu("gpt", graph, _plan(2.464, 1, 8)) == pytest.approx(37.01, abs=0.01)


def test_moe_closed_form_is_alpas_count():
    # alpa-projects/alpa benchmark/alpa/util.py, compute_moe_tflops, term by term for MoE-380M (REFERENCE §3:
    # h 768, 8 layers, 8 experts, group 2048, vocabulary 32,000; FFN 8h, the function's default mlp_factor)
    B, s, L, h, G, V, E, mlp = 1024, 1024, 8, 768, 2048, 32000, 8, 8
    pure = B * s * h**2 * (8 + 4 * mlp) + 4 * B * s**2 * h
    moe = (B * s * h**2 * 8 + 4 * B * s**2 * h + 8 * B * s * h**2 * mlp + 2 * B * s * h * E + 2 * (B * s) * 2 * G
           + 2 * B * s * h * 2 * G * 2)
    for recompute, factor in ((True, 4), (False, 3)):
        by_hand = (pure * factor) * L / 2 + (moe * factor) * L / 2 + 6 * B * s * h * V
        assert alpa.moe_flops(B, s, L, h, mlp * h, G, V, E, recompute) == pytest.approx(by_hand, rel=1e-12)
    graph = read_graph(ROOT / "instances" / "moe-380m.json")
    assert alpa.moe_shape(graph) == (B, s, L, h, mlp * h, G, V, E)


def test_tflops_per_gpu_counts_as_alpa_counts():
    moe = read_graph(ROOT / "instances" / "moe-380m.json")
    flops = alpa.moe_flops(*alpa.moe_shape(moe))
    assert alpa.tflops_per_gpu("moe", moe, _plan(2.0, 1, 4, tflops=12.5, hardware=16.0)) == pytest.approx(
        flops / 2.0 / 4 / 1e12, rel=1e-12)  # the closed form over the iteration, whatever the plan executes
    # Wide-ResNet: what the plan executes, as XLA counts a rematerialised executable: on a real one-GPU plan,
    # the model FLOPs (forward + backward) plus one more forward of every op but the loss (which no remat reruns),
    # over the iteration
    graph = read_graph(ROOT / "instances" / "wresnet-250m.json")
    plan = alpa.plan_with("partopt", graph, alpa.cluster_for(1), 24, "wresnet")
    forward = sum(graph.flops(op) for op in graph.ops if op.kind != "cross_entropy")
    executed = plan.throughput["tflops_per_device"] * plan.iteration_time_s * 1e12 + forward
    assert alpa.tflops_per_gpu("wresnet", graph, plan) == pytest.approx(executed / plan.iteration_time_s / 1e12,
                                                                        rel=1e-9)


# ---------------------------------------------------------------- cases and clusters

def test_cases_follow_reference_section_3():
    every = alpa.cases()
    assert len(every) == 21
    assert [c.gpus for c in alpa.cases(["gpt"], alpa.QUICK_MAX_GPUS)] == [1, 2, 4, 8]
    by = {(c.model, c.gpus): c for c in every}
    assert by[("gpt", 64)].instance == "gpt-39b" and by[("gpt", 64)].reported["intra_only"] == 2.11
    assert by[("moe", 32)].reported["inter_only"] is None  # reported out of memory
    assert "deepspeed" not in by[("moe", 64)].reported  # not reported ("—")
    assert by[("wresnet", 32)].reported["ppdp"] is None
    assert by[("wresnet", 64)].instance == "wresnet-13b"
    assert by[("gpt", 16)].alpa_plan.logical_meshes == ((2, 4), (2, 4))
    assert by[("moe", 8)].alpa_plan is None
    assert by[("wresnet", 4)].planners == ("partopt", "inter_only", "intra_only", "ppdp")
    with pytest.raises(InstanceError):
        alpa.cases(["bert"])


def test_wresnet_13b_runs_batch_1520():
    graph = read_graph(ROOT / "instances" / "wresnet-13b.json")
    assert graph.dims[graph.batch_dim] == 1520


def test_each_case_searches_the_microbatch_counts_of_alpas_suite():
    by = {(c.model, c.gpus): c for c in alpa.cases()}
    assert by[("gpt", 64)].microbatches(1024) == (128, 256, 512, 1024)  # Alpa's reported B = 1024 among them
    assert by[("moe", 64)].microbatches(1024) == (64,)
    assert by[("gpt", 1)].microbatches(1024) == "auto"  # no 1-GPU case in the suite
    assert by[("wresnet", 64)].microbatches(1520) == (38,)  # 32, 48, 42 were run with batches 1536 and 1512
    assert by[("wresnet", 32)].microbatches(1520) == (38,)  # 42 was run with batch 1512
    assert by[("wresnet", 16)].microbatches(1536) == (24, 32)
    for c in alpa.cases():  # every reported Alpa plan's count is one the suite searched
        if c.alpa_plan and c.gpus > 1:
            assert c.alpa_plan.microbatches in c.suite_microbatches


def test_cluster_for_gpu_counts():
    assert (alpa.cluster_for(4).nodes, alpa.cluster_for(4).devices_per_node) == (1, 4)
    assert (alpa.cluster_for(32).nodes, alpa.cluster_for(32).devices_per_node) == (4, 8)
    with pytest.raises(InstanceError):
        alpa.cluster_for(12)


def test_format_meshes_and_even_cuts():
    assert alpa.format_meshes([(1, 8), (1, 8), (1, 4)]) == "(1,8) ×2, (1,4)"
    cuts = harness._even_cuts(10, 3)
    assert cuts[0][0] == 0 and cuts[-1][1] == 9
    assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(cuts))
    lengths = [last - first + 1 for first, last in cuts]
    assert max(lengths) - min(lengths) <= 1 and sum(lengths) == 10


# ---------------------------------------------------------------- checks

def _result(model: str, gpus: int, values: dict[str, float | None]) -> harness.CaseResult:
    case = next(c for c in alpa.cases([model]) if c.gpus == gpus)
    return harness.CaseResult(case, {p: harness.Cell(p, v, None, 0.0) for p, v in values.items()})


def test_checks_fail_when_a_baseline_beats_partopt_and_pass_otherwise():
    good = _result("gpt", 64, {"partopt": 57.0, "inter_only": 50.0, "intra_only": 2.0, "megatron": None})
    found = {c.name: c for c in harness.checks([good])}
    assert found["partopt ≥ every baseline on every case"].passed
    assert found["GPT 64 GPUs: intra-op only < 1/4 of partopt"].passed
    assert found["gpt: partopt within ±25% of Alpa on every row"].passed  # 57 vs 57
    bad = _result("gpt", 64, {"partopt": 40.0, "inter_only": 50.0, "intra_only": 20.0, "megatron": 41.0})
    found = {c.name: c for c in harness.checks([bad])}
    assert not found["partopt ≥ every baseline on every case"].passed
    assert "inter_only 50.00 > partopt 40.00" in found["partopt ≥ every baseline on every case"].detail
    assert not found["GPT 64 GPUs: intra-op only < 1/4 of partopt"].passed
    assert not found["gpt: partopt within ±25% of Alpa on every row"].passed  # 40 / 57 - 1 = -30 %


def test_checks_moe_and_wresnet_claims():
    moe = _result("moe", 16, {"partopt": 45.0, "inter_only": 30.0, "intra_only": 20.0, "deepspeed": 30.0})
    wres = _result("wresnet", 32, {"partopt": 6.6, "inter_only": None, "intra_only": 2.0, "ppdp": None})
    found = {c.name: c for c in harness.checks([moe, wres])}
    assert not found["MoE 16 GPUs: DeepSpeed far behind (< 1/2 of partopt)"].passed
    assert found["Wide-ResNet 32 GPUs: PP-DP out of memory"].passed
    assert harness.median_error([moe, wres]) == pytest.approx((abs(45 / 45.36 - 1) + 0.0) / 2)  # median of two


# ---------------------------------------------------------------- in-sample rows

def test_the_in_sample_cases_are_the_v100_points_alpa_measured_on_one_gpu():
    # partopt/bench/points/p3.16xlarge.json: Alpa's three one-GPU cases of Figure 7, and GPT-2.6B at
    # batch 32 (not a case: the case runs batch 1024)
    assert alpa.calibration_cases() == {("gpt-350m", 1), ("moe-380m", 1), ("wresnet-250m", 1)}
    assert [(c.instance, c.gpus) for c in alpa.cases() if c.in_sample] == [
        ("gpt-350m", 1), ("moe-380m", 1), ("wresnet-250m", 1)]


def test_in_sample_rows_are_marked_and_left_out_of_the_out_of_sample_median():
    fitted = _result("gpt", 1, {"partopt": 45.07 * 1.5, "inter_only": 1.0, "intra_only": 1.0, "megatron": 1.0})
    near = _result("gpt", 2, {"partopt": 57.92 * 1.1, "inter_only": 1.0, "intra_only": 1.0, "megatron": 1.0})
    far = _result("gpt", 4, {"partopt": 58.21 * 0.7, "inter_only": 1.0, "intra_only": 1.0, "megatron": 1.0})
    _, rows = report.results_rows("gpt", [fitted, near, far])
    assert [row[-3] for row in rows] == ["+50.0% (in-sample)", "+10.0%", "-30.0%"]
    sentence = report.median_sentence("Median", [fitted, near, far])
    assert sentence == "Median: 30.0%; out of sample (the 2 rows that are not calibration points): 20.0%."
    assert report.median_sentence("Median", [near, far]) == "Median: 20.0%."


# ---------------------------------------------------------------- end to end: `--quick` (GPT on 1-8 GPUs)

@pytest.fixture(scope="module")
def quick_run():
    """What `partopt reproduce alpa --quick` computes: every planner on GPT at 1, 2, 4 and 8 GPUs."""
    return harness.run(alpa.cases(["gpt"], alpa.QUICK_MAX_GPUS))


@pytest.fixture(scope="module")
def small_run(quick_run):
    return quick_run[:2]


def test_quick_holds_the_papers_ordering_and_error_band(quick_run, monkeypatch):
    assert [r.case.gpus for r in quick_run] == [1, 2, 4, 8]
    found = {c.name: c for c in harness.checks(quick_run)}
    assert found["partopt ≥ every baseline on every case"].passed, found["partopt ≥ every baseline on every case"].detail
    assert found["gpt: partopt within ±25% of Alpa on every row"].passed
    # the CLI prints the same checks and exits 0 only when all pass
    monkeypatch.setattr(harness, "run", lambda selected, progress=None, **kw: quick_run)
    result = CliRunner().invoke(main, ["reproduce", "alpa", "--quick"])
    assert result.exit_code == 0, result.output
    assert "PASS partopt ≥ every baseline on every case" in result.output and "FAIL" not in result.output


def test_small_slice_runs_and_partopt_beats_every_baseline(small_run):
    assert [r.case.gpus for r in small_run] == [1, 2]
    for r in small_run:
        assert set(r.cells) == {"partopt", "inter_only", "intra_only", "megatron"}
        ours = r.cells["partopt"].tflops
        assert ours is not None and ours > 0
        for cell in r.cells.values():
            assert cell.tflops is None or cell.tflops <= ours * (1 + 1e-9)
    assert harness.checks(small_run)[0].passed
    # one GPU: every restricted search is the same single-device plan
    one = small_run[0].cells
    assert one["intra_only"].tflops == pytest.approx(one["partopt"].tflops)


def test_tables_have_a_row_per_case(small_run, tmp_path):
    header, rows = report.plan_rows("gpt", small_run)
    assert len(rows) == 2 and len(header) == len(rows[0])
    assert rows[1][5:9] == ["128", "2", "(1,1) ×2", "(1,1) ×2"]  # Alpa's 2-GPU plan, REFERENCE §3
    header, rows = report.results_rows("gpt", small_run)
    assert [row[0] for row in rows] == ["1", "2"] and "(45.07)" in rows[0][2]
    script = _script()
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nbefore\n\n{script.BEGIN}\nold\n{script.END}\n\nafter\n")
    script.write_docs("## Alpa benchmarks\nnew\n", doc)
    text = doc.read_text()
    assert "old" not in text and "new" in text and text.index("before") < text.index("new") < text.index("after")


def _staged(count: int, meshes: list[tuple[tuple[int, int], tuple[int, int]]]) -> Plan:
    plan = _plan(1.0, 1, 8)
    plan.num_microbatches = count
    plan.stages = [StagePlan([0, 0], [0], list(sub), list(logical), [], 0.0, 0.0, 0.0, 0.0, 0.0, 1, {}, {}, {})
                   for sub, logical in meshes]
    return plan


def test_plan_difference_names_each_difference():
    case = next(c for c in alpa.cases(["gpt"]) if c.gpus == 8)  # Alpa: B 128, (1,2) (1,2) (1,4), (2,1) (2,1) (4,1)
    same = _staged(128, [((1, 2), (2, 1)), ((1, 2), (2, 1)), ((1, 4), (4, 1))])
    assert report.plan_difference(harness.CaseResult(case, {"partopt": harness.Cell("partopt", 1.0, same, 0.0)})) == "same plan"
    other = _staged(512, [((1, 2), (2, 1)), ((1, 4), (2, 2)), ((1, 2), (2, 1))])
    text = report.plan_difference(harness.CaseResult(case, {"partopt": harness.Cell("partopt", 1.0, other, 0.0)}))
    assert text == ("B 512 vs 128; the same submeshes in another order; "
                    "logical meshes (2,1), (2,2), (2,1) vs (2,1) ×2, (4,1)")


# ---------------------------------------------------------------- the ablation's even splits

def test_even_cuts_and_even_submeshes():
    assert harness._even_cuts(10, 3) == [(0, 2), (3, 6), (7, 9)]  # lengths 3, 4, 3
    assert harness._even_cuts(4, 4) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # 32 GPUs: every submesh of Alpa's family that tiles 4 nodes of 8 — not (3, 8)
    assert set(harness._even_submeshes(alpa.cluster_for(32))) == {
        (32, (1, 1)), (16, (1, 2)), (8, (1, 4)), (4, (1, 8)), (2, (2, 8)), (1, (4, 8))}


def test_even_splits_share_their_layer_solutions():
    from test_intra import mlp

    graph, cluster = mlp(4, 1024, 512), alpa.cluster_for(8)
    layering = build_layers(graph, None)
    cache: dict = {}
    first, _ = harness._best_even_split(graph, cluster, layering, 4, 2, (1, 4), {}, cache)
    again, _ = harness._best_even_split(graph, cluster, layering, 4, 2, (1, 4), {}, cache)
    alone, _ = harness._best_even_split(graph, cluster, layering, 4, 2, (1, 4), {}, {})
    assert first.solver["ilps"] > 0 and again.solver["ilps"] == 0
    assert again.iteration_time_s == alone.iteration_time_s == first.iteration_time_s
    assert [s.layers for s in first.stages] == [[0, 1], [2, 3]]


def test_equal_operators_cut_the_order_evenly_into_pieces_of_one_layer_each():
    from partopt import models

    graph = models.gpt(hidden=64, layers=3, heads=2, seq=16, vocab=32, batch=4)
    order = list(graph.order)
    for stages in (2, 3, 5):
        layering = harness._equal_operators(graph, stages)
        assert [op for piece in layering.base for op in piece] == order  # every op once, in order
        cuts = harness._even_cuts(len(order), stages)
        assert [len(layering.ops(g)) for g in range(stages)] == [last - first + 1 for first, last in cuts]
        for first, last in layering.groups:
            pieces = layering.base[first:last + 1]
            assert all(len({op.layer for op in piece}) == 1 for piece in pieces)
            assert all(a[-1].layer != b[0].layer for a, b in zip(pieces, pieces[1:]))  # maximal runs
    # six blocks in two stages: the whole middle blocks of either stage are one structure (one ILP)
    graph = models.gpt(hidden=64, layers=6, heads=2, seq=16, vocab=32, batch=4)
    block = graph.subgraph_ops([2])
    whole = [piece for piece in harness._equal_operators(graph, 2).base if len(piece) == len(block)]
    assert len(whole) >= 3 and {graph.structural_hash(piece) for piece in whole} == {graph.structural_hash(block)}


def test_an_even_split_whose_fastest_shardings_overflow_is_priced_to_fit_memory(monkeypatch):
    from test_intra import mlp

    from partopt import costmodel
    from partopt.evaluate import price

    # 20 layers of 8192² fp32 weights on a data-parallel (8, 1) mesh: at their fastest under the additive
    # model (the reproduction's: no gather hidden by prefetching) the weights and gradients are replicated
    # (11.2 GiB of parameter state, 16.2 GiB in all, over the 14.4 GiB budget)
    graph, cluster = mlp(20, 65536, 8192), alpa.cluster_for(8)
    monkeypatch.setattr(type(cluster), "logical_shapes", lambda self, submesh: [(8, 1)])
    layering, budget = build_layers(graph, None), costmodel.memory_budget(cluster.device)
    specs = [StageSpec(0, 19, (1, 8), (8, 1), 1)]
    additive = Options(layers=None, overlap=False)
    with pytest.raises(InfeasibleError):
        price(graph, cluster, layering, 1, specs, None, additive)
    plan, _ = harness._best_even_split(graph, cluster, layering, 1, 1, (1, 8), {"overlap": False}, {})
    assert plan is not None and plan.memory_peak_bytes <= budget
    fitted = price(graph, cluster, layering, 1, specs, None, additive, fit_memory=True)
    assert plan.iteration_time_s == fitted.iteration_time_s


def test_the_ablations_even_splits_recompute_as_the_case_does():
    """Alpa's suites recompute (full): an even split priced without it would run less work than the DP's plans."""
    from partopt.layering import build_layers
    from test_intra import mlp

    graph, cluster = mlp(4, 64, 256), alpa.cluster_for(8)
    layering = build_layers(graph, None)
    full, _ = harness._best_even_split(graph, cluster, layering, 1, 1, (1, 8), {"recompute": "full"}, {})
    plain, _ = harness._best_even_split(graph, cluster, layering, 1, 1, (1, 8), {"recompute": "none"}, {})
    assert {s.recompute for s in full.stages} == {"full"} and {s.recompute for s in plain.stages} == {"none"}
    assert full.stages[0].breakdown["recompute_s"] > 0 == plain.stages[0].breakdown["recompute_s"]
