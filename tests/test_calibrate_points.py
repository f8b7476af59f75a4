"""The shipped A100 and H100 calibration points (partopt/bench/points): they parse, carry the
published figures of REFERENCE.md §5, never include the held-out SC'21 Tables 1 and 2, and the
procedure recovers a known efficiency from one of their plans priced by the model itself."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from partopt import calibrate
from partopt.bench.alpa import gpt_flops, gpt_shape
from partopt.cluster import nominal_preset, preset

ROOT = Path(__file__).resolve().parent.parent
POINTS = ROOT / "partopt" / "bench" / "points"
FILES = {"dgx-a100.json": "dgx-a100", "dgx-a100-unfitted.json": "dgx-a100", "dgx-h100.json": "dgx-h100",
         "dgx-h100-unfitted.json": "dgx-h100", "p3.16xlarge.json": "p3.16xlarge",
         "p3.16xlarge-unfitted.json": "p3.16xlarge"}


def _heldout():
    spec = importlib.util.spec_from_file_location("heldout_a100", ROOT / "scripts" / "heldout_a100.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(FILES))
def test_points_file_parses_and_names_its_preset(name):
    points = calibrate.read_points(POINTS / name)
    assert {p.preset for p in points.points} == {FILES[name]}
    for p in points.points:
        assert p.source and p.gpus == p.nodes * (p.devices_per_node or preset(p.preset).devices_per_node), p.label
    assert sorted(p.name for p in POINTS.glob("*.json")) == sorted(FILES)  # every shipped file is checked here


def test_a100_points_carry_the_published_figures():
    fitted = calibrate.read_points(POINTS / "dgx-a100.json")
    assert fitted.fit == ("matmul_efficiency",)
    mtnlg = [p for p in fitted.points if p.label.startswith("MT-NLG")]
    assert [(p.gpus, p.iteration_s) for p in mtnlg] == [(2240, 60.1), (2800, 50.2), (3360, 44.4)]  # REFERENCE §5
    assert all(p.graph.dims["b"] == 1920 and p.microbatches * p.dp * 2 == 1920 for p in mtnlg)  # microbatch size 2
    for p in fitted.points:
        assert p.tp <= 8, p.label  # cross-node tensor parallelism is kept out (dgx-a100-unfitted.json)
        if p.source.startswith("Korthikanti"):
            continue
        assert not p.overlap and p.recompute == "full", p.label  # Megatron-LM 2021 / DeepSpeed: reduce after backward
        if p.tflops_per_gpu is not None:
            assert p.flops == pytest.approx(gpt_flops(*gpt_shape(p.graph)), rel=1e-12)  # Megatron's 96 closed form, REFERENCE §2
    figure_13 = {(p.pp, p.tp): p.tflops_per_gpu for p in fitted.points if p.label.startswith("162B")}
    assert figure_13 == {(8, 8): 166, (32, 2): 147}
    # Megatron-LM's runs drop attention probabilities (--attention-dropout, 0.1 by default), a kernel of its own
    # on their math-path attention: one dropout op per layer, as Korthikanti et al. count its mask (§4.1)
    for p in fitted.points:
        drops = [op for op in p.graph.ops if op.attrs.get("fn") == "dropout"]
        assert len(drops) == sum(op.kind == "softmax" for op in p.graph.ops), p.label  # one per layer
        assert all(p.graph.producers[op.inputs[0]].kind == "softmax" for op in drops), p.label


def test_mtnlg_times_scale_as_the_bubble_at_microbatch_size_2():
    """MT-NLG's source does not state its microbatch size; its three times say it (COSTMODEL §7, "Twenty-seventh
    session"): at a fixed batch, GPU-seconds per iteration go as 1F1B's (m + p − 1) / m with m microbatches per
    replica, which at microbatch size 2 matches the measured ratios within 1.1 %, and at size 1 misses by 4.2 %."""
    mtnlg = [p for p in calibrate.read_points(POINTS / "dgx-a100.json").points if p.label.startswith("MT-NLG")]
    gpu_s = [p.iteration_s * p.gpus for p in mtnlg]
    measured = [g / gpu_s[0] for g in gpu_s]

    def bubble(size: int) -> list[float]:
        slots = [(1920 // (p.dp * size) + p.pp - 1) / (1920 // (p.dp * size)) for p in mtnlg]
        return [x / slots[0] for x in slots]

    assert all(abs(b / m - 1) < 0.011 for b, m in zip(bubble(2), measured))
    assert abs(bubble(1)[-1] / measured[-1] - 1) > 0.04


def test_the_bloom_point_is_the_run_its_log_line_measured():
    """BigScience's BLOOM 176B log line (104.70 s, 149.77 TFLOPs on 384 GPUs) is Megatron's 96 closed form with
    V/16lh for the configuration priced: 70 layers, h 14336, vocabulary 250,880, global batch 2048 at sequence 2048;
    tp 4 × pp 12 × dp 8 at microbatch size 2, the 12 stages as DeepSpeed's partition cut them."""
    bloom = next(p for p in calibrate.read_points(POINTS / "dgx-a100.json").points if p.label.startswith("BLOOM"))
    assert (bloom.tp, bloom.pp, bloom.dp, bloom.nodes, bloom.iteration_s) == (4, 12, 8, 48, 104.70)
    assert bloom.graph.dims["b"] == 2048 and bloom.graph.dims["b"] // (bloom.dp * bloom.microbatches) == 2
    assert bloom.stage_layers == (5, *[6] * 10, 5) and sum(bloom.stage_layers) == 70
    assert gpt_flops(*gpt_shape(bloom.graph)) / bloom.iteration_s / bloom.gpus / 1e12 == pytest.approx(149.77, abs=0.02)
    assert (bloom.inter_node.bandwidth, bloom.inter_node.shared_by_node) == (4 * 100e9 / 8, True)  # 4 × 100 Gbit/s


# BigScience's topology trials of 2022-02-28 (chronicles-prequel.md, "Rebalancing layers"): the table's TFLOPs column,
# row by row, as the unfitted file lists them
BIGSCIENCE_TFLOPS = [149.75, 146.90, 143.73, 145.01, 117.91, 136.20, 141.76, 151.71, 128.10, 145.68, 151.18, 146.12,
                     128.92, 153.68, 150.05, 148.08, 153.33]


def test_the_bigscience_trials_are_the_runs_their_table_measured():
    """Each trial's time on 384 GPUs gives its table's TFLOPs by Megatron's 96 closed form with V/16lh, which checks
    hidden, layers, vocabulary 250,880 and the time as transcribed; its stages are the rebalanced partition's, the tied
    embedding a layer on the first and the last stage."""
    trials = [p for p in calibrate.read_points(POINTS / "dgx-a100-unfitted.json").points
              if p.source.startswith("BigScience")]
    assert len(trials) == len(BIGSCIENCE_TFLOPS)
    for p, published in zip(trials, BIGSCIENCE_TFLOPS):
        assert p.gpus == 384 and p.graph.dims["b"] == 2048, p.label
        assert gpt_flops(*gpt_shape(p.graph)) / p.iteration_s / p.gpus / 1e12 == pytest.approx(published, abs=0.02)
        per_stage = (sum(p.stage_layers) + 2) // p.pp  # layers and both embeddings, evenly
        assert p.stage_layers == (per_stage - 1, *[per_stage] * (p.pp - 2), per_stage - 1), p.label


# Korthikanti et al. 2022 (arXiv 2205.05198) at data-parallel size 1: Table 3's (GPUs, pipeline stages,
# batch), REFERENCE §5's MFU with sequence parallelism and selective recomputation, and Table 5's times
# (selective, full recomputation)
KORTHIKANTI = {"22B": (8, 1, 4, 0.415, 1.10, 1.42), "175B": (64, 8, 64, 0.514, 13.75, 18.13),
               "530B": (280, 35, 280, 0.560, 37.83, 49.05), "1T": (512, 64, 512, 0.563, 71.49, 94.42)}


def test_korthikanti_points_carry_reference_figures_and_agree_with_the_paper_times():
    """Each selective run is its MFU × 312 TFLOP/s over the model FLOPs of that MFU (72 form, no
    recomputation counted), which the paper's own times reproduce within 0.5 %; each full-recomputation
    run is its Table 5 time, and 530B's pair is the abstract's "29 % faster" (REFERENCE §5)."""
    points = [p for name in ("dgx-a100.json", "dgx-a100-unfitted.json")
              for p in calibrate.read_points(POINTS / name).points if p.source.startswith("Korthikanti")]
    seen = set()
    for p in points:
        name = p.label.split(",")[0]
        gpus, pp, batch, mfu, selective_s, full_s = KORTHIKANTI[name]
        assert (p.gpus, p.tp, p.pp, p.dp, p.graph.dims["b"], p.microbatches) == (gpus, 8, pp, 1, batch, batch)
        if p.recompute == "selective":
            assert p.sequence_parallel and p.tflops_per_gpu == pytest.approx(mfu * 312, abs=1e-9)
            assert p.flops == pytest.approx(gpt_flops(*gpt_shape(p.graph), recompute=False), rel=1e-12)
            assert p.flops / selective_s / gpus / 312e12 == pytest.approx(mfu, rel=5e-3)
        else:
            assert p.recompute == "full" and not p.sequence_parallel and p.iteration_s == full_s
        seen.add((name, p.recompute))
    assert seen == {(n, m) for n in KORTHIKANTI for m in ("selective", "full")}
    assert KORTHIKANTI["530B"][5] / KORTHIKANTI["530B"][4] == pytest.approx(1.29, abs=0.01)


def test_v100_resnet_runs_are_the_published_throughputs_as_run_and_kept_out_of_the_fit():
    """NVIDIA's ResNet-50 v1.5 on DGX-1 V100 16 GB (DeepLearningExamples, pytorch-21.03): 367 and 2,855 images/s in
    fp32 at 112 per GPU, 1,200 and 8,322 in AMP at 256, on 1 and 8 GPUs; data parallel, one microbatch, no
    recomputation, as PyTorch DDP ran them. A ResNet-50's parameters: 25,557,032 (torchvision's count)."""
    runs = calibrate.read_points(POINTS / "p3.16xlarge-unfitted.json").points
    assert not any(p.label.startswith("ResNet") for p in calibrate.read_points(POINTS / "p3.16xlarge.json").points)
    published = {("fp32", 1): (112, 367), ("fp32", 8): (112, 2855), ("fp16", 1): (256, 1200), ("fp16", 8): (256, 8322)}
    assert len(runs) == 4
    for p in runs:
        per_gpu, images_per_s = published[(p.graph.dtype, p.gpus)]
        assert p.graph.dims["b"] == per_gpu * p.gpus and p.iteration_s == pytest.approx(per_gpu * p.gpus / images_per_s,
                                                                                         rel=1e-5)
        assert (p.tp, p.pp, p.dp, p.microbatches, p.recompute, p.overlap) == (1, 1, p.gpus, 1, "none", True)
        assert p.graph.num_params == 25_557_032 and p.graph.optimizer == "sgd"


def test_h100_points_run_the_schedules_their_sources_name():
    """Llama 3 interleaved its pipeline with chunks of one layer: it took one layer each from the first and last
    stages and "the first model chunk on the first stage has only the embedding" (arXiv 2407.21783 §3.3.2), so
    its 126 layers and the embedding and output chunks fill pp × v = 16 × 8 chunks; the 8B ran without a
    pipeline; the 70B ran virtual pipeline 5. Tensor parallelism ran with sequence parallelism: Megatron-Bridge's
    Llama 3 70B recipe sets it, and Llama 3's tensor parallelism cites Korthikanti et al. 2023; that recipe also
    overlaps the tensor-parallel comm (its CommOverlapConfig), which Llama 3's paper does not say, and shards the
    optimizer state over the data-parallel ranks (its DistributedDataParallelConfig(use_distributed_optimizer=True));
    Llama 3 and the 8B ran FSDP, which shards it too."""
    by_label = {p.label.split(",")[0] + f" {p.gpus}": p for p in calibrate.read_points(POINTS / "dgx-h100.json").points
                if not p.label.startswith("Megatron-LM GPT")}
    assert {label: (p.schedule, p.virtual_stages) for label, p in by_label.items()} == {
        "Llama 3 405B 8192": ("interleaved", 8), "Llama 3 405B 16384": ("interleaved", 8),
        "NeMo Llama3 8B FP8 8": ("1f1b", 1), "NeMo Llama3 70B FP8 64": ("interleaved", 5)}
    for label in ("Llama 3 405B 8192", "Llama 3 405B 16384"):
        p = by_label[label]
        assert p.pp * p.virtual_stages == 126 + 2  # one layer per chunk, the embedding and output chunks alone
        # "without activation checkpointing" (§3.3.2): priced as run, its memory unchecked
        assert p.recompute == "none" and not p.check_memory
    for p in by_label.values():
        assert p.microbatches % p.pp == 0 or p.schedule != "interleaved"  # Megatron's rule for interleaving
        assert p.sequence_parallel == (p.tp > 1)
    assert [label for label, p in by_label.items() if p.tp_comm_overlap] == ["NeMo Llama3 70B FP8 64"]
    assert all(p.zero for p in by_label.values())


# Megatron-LM's H100 weak-scaling table (README, images/model_table.png at f2e5db4), per model size: attention heads,
# hidden size, layers, tensor MP, pipeline MP, data-parallel size, GPUs, batch, per-GPU TFLOP/s, MFU (%), aggregate
# PFLOP/s
MEGATRON_H100 = {
    "1.7B": (16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41, 19.6), "7.1B": (32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47, 44.7),
    "16B": (48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49, 93.9), "32B": (56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46, 176.5),
    "70B": (64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42, 322.3),
    "119B": (80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43, 645.9),
    "177B": (96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44, 997.2),
    "314B": (128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48, 1457.4),
    "462B": (144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47, 2825.6)}


def test_megatron_h100_runs_are_the_readme_table_as_run():
    """Megatron-LM's H100 table, transcribed: its columns agree with each other (TFLOP/s × GPUs is the aggregate,
    over the bf16 peak the MFU), the graphs have the model sizes (untied GPT, vocabulary 131,072, sequence 4096),
    TFLOP/s count Megatron-LM's own formula (training.py at f2e5db4: the 72 closed form with the logits), and the
    plans are what its flags imply: --overlap-param-gather asserts the distributed optimizer and --tp-comm-overlap
    sequence parallelism; assumed, as the table does not say: microbatch size 1 (the batch grows as 192 × pp: four
    microbatches per stage) and Megatron-LM's default schedule, 1F1B. Every row is fitted."""
    runs = [p for p in calibrate.read_points(POINTS / "dgx-h100.json").points if p.label.startswith("Megatron-LM GPT")]
    assert sorted(p.label.split()[2].rstrip(",") for p in runs) == sorted(MEGATRON_H100)
    peak = preset("dgx-h100").device.peak("bf16") / 1e12
    for p in runs:
        size = p.label.split()[2].rstrip(",")
        heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, mfu, aggregate = MEGATRON_H100[size]
        assert tp * pp * dp == gpus and tflops * gpus / 1e3 == pytest.approx(aggregate, abs=0.05)
        assert round(100 * tflops / peak) == mfu
        # the table's sizes are rounded (its "1.7B" has 1,753,862,144 parameters); tied embeddings would miss 7.1B by 7 %
        assert p.graph.num_params == pytest.approx(float(size[:-1]) * 1e9, rel=0.035), size
        assert (p.graph.dims["n"], p.graph.dims["v"], p.graph.dims["s"]) == (heads, 131072, 4096)
        assert gpt_shape(p.graph) == (batch, 4096, layers, hidden, 131072) and p.graph.dtype == "bf16"
        assert p.tflops_per_gpu == tflops and p.flops == pytest.approx(gpt_flops(*gpt_shape(p.graph), recompute=False))
        assert (p.tp, p.pp, p.dp, p.gpus, p.microbatches * dp) == (tp, pp, dp, gpus, batch)
        assert p.zero and p.state_layout == "megatron" and p.overlap and p.schedule == "1f1b"
        assert p.sequence_parallel == p.tp_comm_overlap == (tp > 1)


def test_megatron_h100_strong_scaling_end_points_are_the_readme_text():
    """The README's strong scaling: the table's 177B GPT from 96 to 4,608 H100s at 1,152 sequences per batch, "a
    reduction in MFU from 47% to 42%"; priced with the table's 177B plan (tp 8 × pp 6, its text gives neither) and out of
    sample."""
    table = next(p for p in calibrate.read_points(POINTS / "dgx-h100.json").points if " 177B," in p.label)
    ends = [p for p in calibrate.read_points(POINTS / "dgx-h100-unfitted.json").points if "strong scaling" in p.label]
    peak = preset("dgx-h100").device.peak("bf16") / 1e12
    assert [(p.gpus, round(100 * p.tflops_per_gpu / peak, 6)) for p in ends] == [(96, 47), (4608, 42)]
    for p in ends:
        assert gpt_shape(p.graph)[1:] == gpt_shape(table.graph)[1:] and p.graph.dims["b"] == 1152
        assert p.flops == pytest.approx(gpt_flops(*gpt_shape(p.graph), recompute=False))
        assert (p.tp, p.pp, p.microbatches * p.dp) == (table.tp, table.pp, 1152)  # microbatch size 1, as the table's
        assert (p.zero, p.state_layout, p.schedule, p.sequence_parallel) == (True, "megatron", "1f1b", True)


# MosaicML LLM Foundry's tables (scripts/train/benchmarking/README.md), per row: (model, seq, GPUs) -> MicroBatchSize,
# GradAccum, GlobalBatchSize, Throughput (T/s), Activation Checkpointing; NumParams by (model, seq)
LLM_FOUNDRY = {
    "dgx-h100-unfitted.json": {  # "H100 80GB BF16", fitted until 2026-12-07 (COSTMODEL §7, "Thirty-first session")
        ("70B", 2048, 64): (8, 4, 2048, 66523, True), ("30B", 4096, 8): (1, 21, 168, 14419, True),
        ("30B", 2048, 8): (3, 21, 504, 16022, True), ("13B", 4096, 8): (10, 3, 240, 37740, True),
        ("13B", 2048, 8): (2, 1, 16, 38336, False), ("7B", 4096, 8): (16, 2, 256, 68893, True),
        ("7B", 2048, 8): (6, 1, 48, 85144, False), ("3B", 4096, 8): (5, 6, 240, 167712, False),
        ("1B", 4096, 8): (7, 4, 224, 308282, False), ("1B", 2048, 8): (14, 1, 112, 363645, False),
        # every other row of "H100 80GB BF16", and "H100 80GB FP8" (the model's " FP8")
        ("70B", 2048, 32): (2, 16, 1024, 28242, True), ("30B", 8192, 8): (1, 21, 168, 11072, True),
        ("30B", 2048, 32): (14, 3, 1344, 73860, True), ("30B", 2048, 16): (10, 3, 480, 36209, True),
        ("30B", 1024, 8): (6, 21, 1008, 16672, True), ("13B", 32768, 8): (1, 3, 24, 15812, True),
        ("13B", 16384, 8): (3, 3, 72, 23881, True), ("13B", 2048, 64): (2, 1, 128, 307209, False),
        ("13B", 2048, 32): (2, 1, 64, 153960, False), ("13B", 2048, 16): (2, 1, 32, 76280, False),
        ("13B", 1024, 8): (40, 3, 960, 44019, True), ("7B", 65536, 8): (1, 2, 16, 15654, True),
        ("7B", 32768, 8): (2, 2, 32, 26550, True), ("7B", 8192, 8): (8, 2, 128, 55481, True),
        ("7B", 1024, 8): (64, 2, 1024, 81628, True), ("3B", 65536, 8): (1, 2, 16, 26099, True),
        ("3B", 32768, 8): (3, 6, 144, 46984, True), ("3B", 16384, 8): (1, 6, 48, 89223, False),
        ("3B", 8192, 8): (3, 6, 144, 132626, False), ("3B", 2048, 64): (6, 3, 1152, 1441663, False),
        ("3B", 2048, 32): (6, 3, 576, 736701, False), ("3B", 2048, 16): (10, 3, 480, 386285, False),
        ("3B", 1024, 8): (20, 6, 960, 216369, False), ("3B", 512, 8): (40, 6, 1920, 223721, False),
        ("1B", 65536, 8): (1, 2, 16, 44050, True), ("1B", 32768, 8): (1, 4, 32, 96203, False),
        ("1B", 16384, 8): (2, 4, 64, 157194, False), ("1B", 8192, 8): (3, 4, 96, 233256, False),
        ("1B", 2048, 64): (20, 1, 1280, 2841754, False), ("1B", 2048, 32): (20, 1, 640, 1444183, False),
        ("1B", 2048, 16): (20, 1, 320, 736596, False), ("1B", 1024, 8): (18, 4, 576, 391287, False),
        ("1B", 512, 8): (56, 4, 1792, 418201, False), ("760M", 32768, 8): (1, 2, 16, 130333, False),
        ("760M", 16384, 8): (3, 2, 48, 222521, False), ("760M", 8192, 8): (6, 2, 96, 334602, False),
        ("760M", 4096, 8): (12, 2, 192, 443674, False), ("760M", 2048, 32): (24, 1, 768, 2175091, False),
        ("760M", 2048, 16): (24, 1, 384, 1096819, False), ("760M", 2048, 8): (24, 2, 384, 505177, False),
        ("760M", 1024, 8): (48, 2, 768, 628648, False), ("760M", 512, 8): (96, 2, 1536, 669998, False),
        ("3B FP8", 32768, 8): (3, 6, 144, 46853, True), ("3B FP8", 8192, 8): (3, 6, 144, 153174, False),
        ("3B FP8", 2048, 8): (10, 6, 480, 244692, False), ("3B FP8", 512, 8): (40, 6, 1920, 292217, False),
        ("1B FP8", 32768, 8): (1, 4, 32, 100643, False), ("1B FP8", 8192, 8): (2, 4, 64, 256087, False),
        ("1B FP8", 512, 8): (56, 4, 1792, 562523, False), ("350M FP8", 32768, 8): (1, 4, 32, 195516, False),
        ("350M FP8", 16384, 8): (2, 4, 64, 343435, False), ("350M FP8", 512, 8): (56, 4, 1792, 1235360, False)},
    "dgx-a100-unfitted.json": {  # "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": every row to 350M
        ("70B", 2048, 64): (8, 4, 2048, 26274, True), ("30B", 4096, 8): (1, 21, 168, 6513, True),
        ("30B", 2048, 8): (3, 21, 504, 7330, True), ("13B", 4096, 8): (10, 3, 240, 16482, True),
        ("13B", 2048, 8): (2, 3, 48, 18097, False), ("7B", 4096, 8): (16, 2, 256, 29472, True),
        ("7B", 2048, 8): (6, 2, 96, 37130, False), ("3B", 4096, 8): (5, 6, 240, 75658, False),
        ("3B", 2048, 8): (10, 2, 160, 86491, False), ("1B", 4096, 8): (7, 4, 224, 142457, False),
        ("1B", 2048, 8): (14, 4, 448, 164109, False),
        ("70B", 2048, 32): (2, 16, 1024, 11962, True), ("30B", 8192, 8): (1, 21, 168, 4594, True),
        ("30B", 1024, 8): (6, 21, 1008, 7571, True), ("30B", 512, 8): (12, 21, 2016, 7739, True),
        ("13B", 32768, 8): (1, 3, 24, 8134, True), ("13B", 16384, 8): (3, 3, 72, 11454, True),
        ("13B", 8192, 8): (5, 3, 120, 14362, True), ("13B", 1024, 8): (40, 3, 960, 18647, True),
        ("7B", 65536, 8): (1, 2, 16, 8108, True), ("7B", 32768, 8): (2, 2, 32, 13382, True),
        ("7B", 16384, 8): (4, 2, 64, 19629, True), ("7B", 8192, 8): (8, 2, 128, 25655, True),
        ("7B", 1024, 8): (64, 2, 1024, 34857, True), ("3B", 65536, 8): (1, 2, 16, 14137, True),
        ("3B", 32768, 8): (3, 6, 144, 24235, True), ("3B", 16384, 8): (1, 6, 48, 44233, False),
        ("3B", 8192, 8): (3, 6, 144, 61567, False), ("3B", 1024, 8): (20, 6, 960, 92643, False),
        ("3B", 512, 8): (40, 6, 1920, 97019, False), ("1B", 65536, 8): (1, 2, 16, 24353, True),
        ("1B", 32768, 8): (1, 4, 32, 50207, False), ("1B", 16384, 8): (2, 4, 64, 79650, False),
        ("1B", 8192, 8): (3, 4, 96, 110516, False), ("1B", 1024, 8): (18, 4, 576, 176898, False),
        ("1B", 512, 8): (56, 4, 1792, 185186, False), ("760M", 65536, 8): (1, 2, 16, 33150, True),
        ("760M", 32768, 8): (1, 2, 16, 70417, False), ("760M", 16384, 8): (3, 2, 48, 114198, False),
        ("760M", 8192, 8): (6, 2, 96, 167471, False), ("760M", 4096, 8): (12, 2, 192, 218808, False),
        ("760M", 2048, 8): (24, 2, 384, 259472, False), ("760M", 1024, 8): (48, 2, 768, 238122, False),
        ("760M", 512, 8): (96, 2, 1536, 235571, False), ("350M", 65536, 8): (1, 2, 16, 60195, False),
        ("350M", 32768, 8): (2, 2, 32, 109222, False), ("350M", 16384, 8): (4, 2, 64, 188478, False),
        ("350M", 8192, 8): (8, 2, 128, 292559, False), ("350M", 4096, 8): (16, 2, 256, 396442, False),
        ("350M", 2048, 8): (32, 2, 512, 470263, False), ("350M", 1024, 8): (64, 2, 1024, 518504, False),
        ("350M", 512, 8): (128, 2, 2048, 554643, False)},
}
MPT_PARAMS = {("70B", 2048): 64862437376, ("30B", 4096): 29989894144, ("30B", 2048): 29975214080,
              ("13B", 4096): 12864440320, ("13B", 2048): 12853954560, ("7B", 4096): 6667247616,
              ("7B", 2048): 6658859008, ("3B", 4096): 2657080320, ("3B", 2048): 2651837440,
              ("1B", 4096): 1320144896, ("1B", 2048): 1315950592,
              ("30B", 8192): 30019254272, ("30B", 1024): 29967874048, ("13B", 32768): 13011240960,
              ("13B", 16384): 12927354880, ("13B", 1024): 12848711680, ("7B", 65536): 6918905856,
              ("7B", 32768): 6784688128, ("7B", 8192): 6684024832, ("7B", 1024): 6654664704,
              ("3B", 65536): 2814366720, ("3B", 32768): 2730480640, ("3B", 16384): 2688537600,
              ("3B", 8192): 2667566080, ("3B", 1024): 2649216000, ("3B", 512): 2647905280,
              ("1B", 65536): 1445974016, ("1B", 32768): 1378865152, ("1B", 16384): 1345310720,
              ("1B", 8192): 1328533504, ("1B", 1024): 1313853440, ("1B", 512): 1312804864,
              ("760M", 32768): 807656448, ("760M", 16384): 782490624, ("760M", 8192): 769907712,
              ("760M", 4096): 763616256, ("760M", 2048): 760470528, ("760M", 1024): 758897664,
              ("760M", 512): 758111232, ("350M", 32768): 387442688, ("350M", 16384): 370665472,
              ("350M", 512): 354412544, ("30B", 512): 29964204032, ("13B", 8192): 12885411840,
              ("7B", 16384): 6717579264, ("760M", 65536): 857988096, ("350M", 65536): 420997120,
              ("350M", 8192): 362276864, ("350M", 4096): 358082560, ("350M", 2048): 355985408,
              ("350M", 1024): 354936832}


@pytest.mark.parametrize("name", sorted(LLM_FOUNDRY))
def test_mpt_runs_are_llm_foundry_rows_as_run(name):
    """LLM Foundry's rows, transcribed: the iteration is the global batch's tokens over the table's throughput, the
    graph has the table's NumParams, and the plan is the run's: FSDP full shard over every GPU, GradAccum
    microbatches, activation checkpointing as full recomputation; kept out of the fits, judged out of sample."""
    table = LLM_FOUNDRY[name]
    runs = [p for p in calibrate.read_points(POINTS / name).points if p.label.startswith("MPT")]
    assert len(runs) == len(table)
    for p in runs:
        model, seq = p.label.split(",")[0][4:], p.graph.dims["s"]
        micro, accum, batch, tokens_per_s, checkpointing = table[(model, seq, p.gpus)]
        assert p.graph.dims["b"] == batch == micro * accum * p.gpus
        assert p.iteration_s == pytest.approx(batch * seq / tokens_per_s, rel=1e-12)
        assert p.graph.num_params == MPT_PARAMS[(model.removesuffix(" FP8"), seq)] and p.graph.dtype == "bf16"
        assert p.graph.matmul_dtype == ("fp8" if model.endswith(" FP8") else None)  # amp_fp8: GEMMs in FP8
        assert (p.tp, p.pp, p.dp, p.microbatches, p.zero, p.shard_weights) == (1, 1, p.gpus, accum, True, True)
        assert p.recompute == ("full" if checkpointing else "none") and p.memory_reserve == 0


@pytest.mark.parametrize("name", sorted(FILES))
def test_runs_of_megatron_lms_model_code_price_its_cross_entropy(name):
    """Megatron-LM (SC'21, Korthikanti et al., its H100 README table) and Megatron-DeepSpeed (MT-NLG, BLOOM and
    BigScience's trials) compute the loss with vocab_parallel_cross_entropy on the logits cast to fp32, unfused unless
    --cross-entropy-loss-fusion, which none of them sets: those points price it unfused (docs/COSTMODEL.md §3). The
    runs of other code (Alpa's JAX, LLM Foundry, Llama 3, NeMo's recipes) keep the one-pass kernel, their loss kernel
    unstated."""
    data = json.loads((POINTS / name).read_text())
    for point in data["points"]:
        megatron = point["source"].startswith(("Megatron-LM README", "Narayanan et al., SC'21", "Korthikanti et al.",
                                               "Smith et al., Megatron-Turing NLG", "BigScience"))
        expected = "unfused" if megatron else None
        assert point["model"].get("args", {}).get("loss_kernel") == expected, point["label"]


def test_no_held_out_run_is_a_calibration_point():
    """SC'21 Tables 1 and 2 judge the model: none of their runs (shape and plan) may be fitted."""
    heldout = _heldout()
    runs = {(r.hidden, r.tp, r.pp, r.gpus, r.batch) for r in heldout.TABLE_1 + heldout.TABLE_2}
    assert len(heldout.TABLE_1) == 10 and len(heldout.TABLE_2) == 12
    for name in FILES:
        for p in calibrate.read_points(POINTS / name).points:
            assert (p.graph.dims.get("h"), p.tp, p.pp, p.gpus, p.graph.dims["b"]) not in runs, (name, p.label)


def test_table_1_runs_as_megatron_lms_scripts_ran_them():
    """Megatron-LM's examples/academic_paper_scripts/sc21/run_table_1.sh: the layers per interleaved chunk
    (--num-layers-per-virtual-pipeline-stage) and microbatch sizes it sets, and Megatron-LM's rules for them."""
    heldout = _heldout()
    chunk_layers = {76.1: 5, 145.6: 5, 310.1: 3, 529.6: 1}  # the script's flag; the other rows do not interleave
    microbatch = {1.7: 16, 3.6: 16, 7.5: 16, 18.4: 8, 39.1: 4, 76.1: 2, 145.6: 2}  # the rest: 1
    for run in heldout.TABLE_1:
        size = float(run.label.split("B,")[0])
        assert run.microbatch == microbatch.get(size, 1), run.label
        dp = run.gpus // (run.tp * run.pp)
        assert run.batch % (dp * run.microbatch) == 0, run.label  # whole microbatches per replica
        if size in chunk_layers:
            assert run.layers == run.pp * run.virtual_stages * chunk_layers[size], run.label
            assert (run.batch // (dp * run.microbatch)) % run.pp == 0, run.label  # interleaving's rule
        else:
            assert run.virtual_stages == 1, run.label
        assert run.overlap == (size < 39), run.label  # --DDP-impl torch up to 18.4B, local from 39.1B


def test_heldout_flops_reproduce_the_published_aggregate():
    """Table 1's 1T row: 163 TFLOP/s per GPU on 3072 GPUs is the paper's 502 PFLOP/s (within its rounding)."""
    heldout = _heldout()
    top = heldout.TABLE_1[-1]
    assert top.published * top.gpus / 1e3 == pytest.approx(502, rel=0.01)
    assert gpt_flops(top.batch, heldout.SEQ, top.layers, top.hidden, heldout.VOCAB) > 0


def test_fit_recovers_an_efficiency_from_an_a100_plan():
    """A multi-node A100 plan of the points file (5.9B, pp 2 × dp 32 on 8 nodes, no overlap), 'measured'
    as the model's own time at matmul_efficiency 0.55 and at two batches: the fit gives back 0.55."""
    source = json.loads((POINTS / "dgx-a100.json").read_text())
    entry = next(p for p in source["points"] if p["label"].startswith("5.9B") and p["plan"]["pp"] == 2)
    truth = {"matmul_efficiency": 0.55}
    base = calibrate.with_values(preset("dgx-a100"), nominal_preset("dgx-a100"), truth)
    entries = []
    for batch in (128, 512):
        e = json.loads(json.dumps(entry))
        e["label"], e["model"]["args"]["batch"], e["plan"]["microbatches"] = f"b{batch}", batch, batch // 32
        p = calibrate.points_from_dict({"format": "partopt.points", "version": 1, "points": [
            {**e, "measured": {"iteration_s": 1.0}}]}).points[0]
        # the model's own time, priced as the fit prices the point (its state layout and memory reserve too)
        seconds = 1.0 / calibrate.ratio(p, calibrate.point_cluster(p, base))
        entries.append({**e, "measured": {"iteration_s": seconds}})
    points = calibrate.points_from_dict({"format": "partopt.points", "version": 1, "points": entries})
    result = calibrate.fit(points, "dgx-a100", ["matmul_efficiency"], start={"matmul_efficiency": 0.8})
    assert result.values["matmul_efficiency"] == pytest.approx(0.55, rel=1e-4)
    assert all(abs(r.error) < 1e-5 and abs(r.loo_error) < 1e-5 for r in result.results)
