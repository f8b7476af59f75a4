"""`partopt inspect`: every bundled instance and preset, --json against the library and hand
counts, and bad input reported as one `error:` line on stderr with exit code 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from partopt import io
from partopt.models import gpt
from partopt.cli import main
from partopt.cluster import MAX_NODES, PRESETS, preset
from partopt.ops import is_matmul

ROOT = Path(__file__).resolve().parent.parent
INSTANCES = sorted((ROOT / "instances").rglob("*.json"))
BAD = sorted((ROOT / "tests" / "bad").glob("*.json"))

# Parameter counts of the hand-written instances, from their sizes (see each file).
HAND_PARAMS = {
    "mlp-2layer.json": 128 * 512 + 512 + 512 * 128 + 128,                      # h=128 <-> f=512, biases
    "mlp-4layer.json": 4 * 256 * 1024 + 2 * 1024 + 2 * 256,                    # h=256 <-> f=1024, biases
    "attention-block.json": (1000 * 256 + 128 * 256                            # tied wte, wpe
                             + 3 * 2 * 256 + 3 * 256 * 64 + 64 * 256            # 3 layernorms; q, k, v, out
                             + 256 * 1024 + 1024 + 1024 * 256),                 # MLP with one bias
    "cnn-tiny.json": 16 * 3 * 3 * 3 + 2 * 16 + 32 * 16 * 3 * 3 + 2 * 32 + 32 * 10 + 10,
}


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_hand_counts_are_what_the_sizes_say():
    assert HAND_PARAMS == {"mlp-2layer.json": 131712, "mlp-4layer.json": 1051136,
                           "attention-block.json": 881152, "cnn-tiny.json": 5466}


def raw_param_count(data: dict) -> int:
    """Elements of every param tensor, straight from the file's JSON."""
    return sum(math.prod(data["dims"][d] for d in t["dims"]) for t in data["tensors"].values() if t.get("role") == "param")


@pytest.mark.parametrize("path", INSTANCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_inspect_every_instance(path):
    result = run("inspect", str(path))
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    if data["format"] == "partopt.graph":
        expected = HAND_PARAMS.get(path.name, raw_param_count(data))
        assert f"{expected:,}" in result.stdout
        assert f"graph {data['name']}" in result.stdout
    else:
        assert data["device"]["name"] in result.stdout
        n, m = data["nodes"], data["devices_per_node"]
        assert f"{n} nodes × {m} = {n * m}" in result.stdout


def test_main_job_command_prints_the_mlp_summary(monkeypatch):
    monkeypatch.chdir(ROOT)  # the README's command: partopt inspect instances/mlp-2layer.json
    result = run("inspect", "instances/mlp-2layer.json")
    assert result.exit_code == 0
    assert "131,712" in result.stdout and "einsum" in result.stdout
    assert "h1 [b, f] 2 MiB" in result.stdout  # 1024 × 512 fp32 = 2 MiB, dims printed literally


def test_console_script_is_the_click_group():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["partopt"] == "partopt.cli:main"


def test_graph_json_equals_the_library_and_hand_derivations():
    path = ROOT / "instances" / "mlp-2layer.json"
    result = run("inspect", str(path), "--json")
    assert result.exit_code == 0
    facts = json.loads(result.stdout)  # nothing but one JSON object on stdout
    g = io.read_graph(path)
    b, h, f = 1024, 128, 512
    matmul = 2 * (2 * b * h * f)            # fc1 and fc2
    other = b * f + b * f + b * h           # bias1, gelu, bias2: one FLOP per output element
    assert facts["params"] == g.num_params == HAND_PARAMS["mlp-2layer.json"]
    assert facts["params_billions"] == pytest.approx(131712 / 1e9)
    assert facts["param_bytes"] == 4 * 131712
    assert facts["forward_flops"] == g.forward_flops == matmul + other
    assert facts["forward_flops_per_sample"] == pytest.approx((matmul + other) / b)
    assert facts["training_flops"] == pytest.approx(3 * matmul + 2 * other)
    assert facts["training_flops"] == pytest.approx(sum(g.flops(op) * (3 if is_matmul(op) else 2) for op in g.ops))
    assert facts["training_flops_per_sample"] == pytest.approx((3 * matmul + 2 * other) / b)
    assert facts["batch_dim"] == "b" and facts["batch_size"] == b
    assert facts["layers"] == 2 and facts["ops"] == 5
    assert facts["ops_by_kind"] == {
        "einsum": {"count": 2, "forward_flops": matmul, "forward_flops_share": pytest.approx(matmul / (matmul + other))},
        "elementwise": {"count": 3, "forward_flops": other, "forward_flops_share": pytest.approx(other / (matmul + other))},
    }
    assert facts["largest_activation"] == {"name": "h1", "dims": ["b", "f"], "bytes": 4 * b * f}


def test_cluster_json_equals_the_preset_and_its_datasheet():
    result = run("inspect", "p3.16xlarge", "--json")
    assert result.exit_code == 0
    facts = json.loads(result.stdout)
    c = preset("p3.16xlarge")
    assert facts["devices"] == c.num_devices == 64
    assert facts["peak_flops_per_s"] == {"fp16": pytest.approx(64 * 125e12), "fp32": pytest.approx(64 * 15.7e12)}
    assert facts["memory_bytes_per_device"] == 16 * 2**30
    assert facts["memory_bytes_total"] == 64 * 16 * 2**30
    assert facts["memory_bandwidth_bytes_per_s"] == pytest.approx(900e9)
    assert facts["intra_node"]["bandwidth_bytes_per_s"] == pytest.approx(150e9)
    assert facts["inter_node"] == {"bandwidth_bytes_per_s": pytest.approx(3.125e9),
                                   "latency_s": c.inter_node.latency_s, "shared_by_node": True}


def test_nodes_resizes_a_preset_and_a_cluster_file(tmp_path):
    facts = json.loads(run("inspect", "dgx-a100", "--nodes", "2", "--json").stdout)
    assert (facts["nodes"], facts["devices"]) == (2, 16)
    io.write_cluster(preset("dgx-h100"), tmp_path / "h.json")
    facts = json.loads(run("inspect", str(tmp_path / "h.json"), "--nodes", "3", "--json").stdout)
    assert (facts["nodes"], facts["devices"], facts["memory_bytes_total"]) == (3, 24, 24 * 80 * 2**30)


def test_inspect_says_where_a_clusters_efficiencies_come_from():
    facts = json.loads(run("inspect", "dgx-a100", "--json").stdout)["calibration"]
    assert facts["measured_runs"] == 21 and facts["points"] == "partopt/bench/points/dgx-a100.json"
    assert facts["fitted"] == {"matmul_efficiency": preset("dgx-a100").device.matmul_efficiency}
    # the fit's own report (docs/COSTMODEL.md §7): leave-one-out median 7.9 %, max 22.1 % (SC'21 Fig. 15, tp 2 × dp 32)
    assert facts["loo_error_median"] == pytest.approx(0.0786, abs=5e-4)
    assert facts["loo_error_max"] == pytest.approx(0.2211, abs=5e-4)
    assert "fitted to 21 measured runs" in run("inspect", "dgx-a100").stdout
    # a cluster file carries its record with it; a preset without a data file has none
    assert json.loads(run("inspect", str(ROOT / "instances/clusters/p3.16xlarge.json"), "--json").stdout)[
        "calibration"]["measured_runs"] == 10
    h100 = json.loads(run("inspect", "dgx-h100", "--json").stdout)
    assert h100["calibration"]["measured_runs"] == 13  # the fit's report: leave-one-out median 6.5 %, max 19.4 %
    assert h100["calibration"]["loo_error_median"] == pytest.approx(0.0645, abs=5e-4)
    assert h100["calibration"]["loo_error_max"] == pytest.approx(0.1945, abs=5e-4)
    assert h100["fp8_matmul_efficiency"] == h100["calibration"]["fitted"]["fp8_matmul_efficiency"]
    assert "in fp8" in run("inspect", "dgx-h100").stdout
    assert json.loads(run("inspect", "tpu-v4", "--json").stdout)["calibration"] is None
    assert "none recorded" in run("inspect", "tpu-v4").stdout


def test_solve_and_evaluate_say_how_far_the_predicted_times_are_calibrated(tmp_path):
    mlp = str(ROOT / "instances" / "mlp-2layer.json")
    fitted = run("solve", mlp, "--cluster", "p3.16xlarge", "--nodes", "1")
    assert fitted.exit_code == 0
    assert "fitted to 10 measured runs" in fitted.stdout and "leave-one-out |error| median 5.7%" in fitted.stdout
    io.write_cluster(preset("p3.16xlarge"), tmp_path / "p3.json")  # the same machine, written without its record
    bare = run("evaluate", mlp, "--cluster", str(tmp_path / "p3.json"), "--nodes", "1", "--tp", "1", "--pp", "1",
               "--dp", "8")
    assert bare.exit_code == 0 and "none recorded" in bare.stdout


@pytest.mark.parametrize("name", PRESETS)
def test_inspect_every_preset(name):
    result = run("inspect", name)
    assert result.exit_code == 0
    assert preset(name).device.name in result.stdout


def assert_one_error_line(result, *needles: str) -> None:
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_each_bad_file_is_one_error_line(path):
    for extra in ([], ["--json"]):
        assert_one_error_line(run("inspect", str(path), *extra), str(path))


DOC_ERRORS = [line for line in (ROOT / "docs" / "FORMAT.md").read_text().splitlines() if line.startswith("tests/bad/")]


@pytest.mark.parametrize("line", DOC_ERRORS, ids=lambda line: line.split(":")[0])
def test_the_errors_docs_quote_are_the_ones_the_files_give(line, monkeypatch):
    """docs/FORMAT.md quotes what `partopt inspect` says of files in tests/bad: each quote is the line it prints."""
    monkeypatch.chdir(ROOT)
    assert run("inspect", line.split(":")[0]).stderr == f"error: {line}\n"


def test_unknown_preset_lists_the_presets():
    assert_one_error_line(run("inspect", "p4d.24xlarge"), "no such file or cluster preset 'p4d.24xlarge'", *PRESETS)


def test_nodes_zero_is_refused():
    result = run("inspect", "p3.16xlarge", "--nodes", "0")
    assert result.exit_code == 2 and "Traceback" not in result.output + result.stderr


@pytest.mark.parametrize("command", [
    ["inspect", "p3.16xlarge"],
    ["solve", str(ROOT / "instances" / "mlp-2layer.json"), "--cluster", "p3.16xlarge"],
    ["evaluate", str(ROOT / "instances" / "mlp-2layer.json"), "--cluster", "p3.16xlarge", "--tp", "1", "--pp", "1"],
    ["check", "plan.json", "--graph", str(ROOT / "instances" / "mlp-2layer.json"), "--cluster", "p3.16xlarge"],
])
def test_nodes_beyond_the_files_limit_are_refused(command):
    # cluster, sweep and plan files hold at most MAX_NODES nodes; --nodes 10^9 made `solve` run for hours
    result = run(*command, "--nodes", str(MAX_NODES + 1))
    assert result.exit_code == 2 and "Traceback" not in result.output + result.stderr
    assert "'--nodes'" in result.stderr and f"{MAX_NODES + 1} is not in the range 1<=x<={MAX_NODES}" in result.stderr


def test_nodes_on_a_graph_is_refused():
    path = str(ROOT / "instances" / "mlp-2layer.json")
    assert_one_error_line(run("inspect", path, "--nodes", "2"), path, "--nodes resizes a cluster")


@pytest.mark.parametrize("nodes", [[], ["--nodes", "1"]])
def test_a_graph_given_as_the_cluster_is_named_as_such(nodes):
    """The cause is the swapped file, with or without --nodes (which would resize the cluster, were it one)."""
    path = str(ROOT / "instances" / "mlp-2layer.json")
    result = run("solve", path, "--cluster", path, *nodes)
    assert_one_error_line(result, path, "--cluster must name a cluster file or preset, not a graph",
                          "hint: give a cluster file or one of the presets: p3.16xlarge")


def test_the_cli_starts_without_matplotlib():
    """matplotlib (0.3 s to import here) is loaded by the commands that draw, not by every `partopt` call."""
    code = "import sys; from partopt.cli import main; print('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_evaluate_prices_an_uneven_split_given_stage_by_stage(tmp_path):
    """--stage-layers gives each stage its layers (an uneven Megatron-LM or DeepSpeed split); malformed counts and
    counts that do not add up to the graph's layers are one error line each."""
    graph = tmp_path / "g.json"
    io.write_graph(gpt(hidden=64, layers=4, heads=4, seq=32, vocab=128, batch=8), graph)
    args = ["evaluate", str(graph), "--cluster", "p3.16xlarge", "--nodes", "1", "--tp", "4", "--pp", "2", "--dp", "1",
            "--microbatches", "2"]
    result = run(*args, "--stage-layers", "1,3", "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [stage["layers"] for stage in plan["stages"]] == [[0, 0], [1, 3]]
    assert plan["options"]["megatron"]["stage_layers"] == [1, 3]
    written = tmp_path / "uneven.json"  # the plan file reads back: check re-derives it with its own split
    written.write_text(result.stdout)
    checked = run("check", str(written), "--graph", str(graph), "--cluster", "p3.16xlarge", "--nodes", "1")
    assert checked.exit_code == 0 and "consistent" in checked.stdout, checked.output + checked.stderr
    assert_one_error_line(run(*args, "--stage-layers", "1,x"), "--stage-layers must be positive counts")
    assert_one_error_line(run(*args, "--stage-layers", "2,1"), "do not split 4 layers into 2 stages")
