"""The presets' data files in the package (partopt/presets/*.json) are what `partopt calibrate -o`
wrote: the preset as defined in code with only the fitted values changed, and the errors they
record are still the model's (a cost-model change that moves them asks for a refit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partopt import calibrate
from partopt.cluster import PRESETS, nominal_preset, preset, preset_file
from partopt.io import read_cluster

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = [name for name in PRESETS if preset_file(name).is_file()]

# points cheap to price (a second or less each), repriced against the errors the file records
CHEAP_POINTS = {
    "p3.16xlarge": ["GPT-350M, 1 GPU", "MoE-380M, 1 GPU", "Wide-ResNet-250M, 1 GPU"],
    "dgx-a100": ["22B, 8 GPUs, tp 8 × pp 1 × dp 1, batch 4, sequence parallel + selective recomputation",
                 "22B, 8 GPUs, tp 8 × pp 1 × dp 1, batch 4, full recomputation"],
    "dgx-h100": ["NeMo Llama3 8B FP8, 8 GPUs, FSDP (dp 8, ZeRO)", "Megatron-LM GPT 1.7B, 48 GPUs, tp 1 × pp 1 × dp 48"],
}


def _data(name: str) -> dict:
    return json.loads(preset_file(name).read_text())


def test_the_calibrated_devices_ship_their_data_files():
    assert {"p3.16xlarge", "dgx-a100", "dgx-h100"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_data_file_is_the_nominal_preset_with_its_fitted_values(name):
    fitted = _data(name)["calibration"]["fitted"]
    nominal = nominal_preset(name)
    assert fitted and preset(name) == read_cluster(preset_file(name))
    assert preset(name) == calibrate.with_values(nominal, nominal, fitted)
    assert preset(name, nodes=3).nodes == 3 and preset(name, nodes=3).device == preset(name).device


@pytest.mark.parametrize("name", SHIPPED)
def test_recorded_errors_name_the_points_file_and_each_of_its_points_once(name):
    calibration = _data(name)["calibration"]
    points = calibrate.read_points(ROOT / calibration["points"])
    assert [e["label"] for e in calibration["errors"]] == [p.label for p in points.points]
    assert set(calibration["fitted"]) == set(points.fit)
    assert all(e["loo_error"] is not None for e in calibration["errors"])


@pytest.mark.parametrize("name, label", [(n, label) for n in SHIPPED for label in CHEAP_POINTS.get(n, [])])
def test_recorded_error_is_the_models_prediction_at_the_fitted_values(name, label):
    calibration = _data(name)["calibration"]
    point = next(p for p in calibrate.read_points(ROOT / calibration["points"]).points if p.label == label)
    recorded = next(e["error"] for e in calibration["errors"] if e["label"] == label)
    error = calibrate.ratio(point, calibrate.point_cluster(point, preset(name))) - 1
    assert error == pytest.approx(recorded, abs=1e-3), f"the model moved: refit {name} (docs/COSTMODEL.md §7)"
