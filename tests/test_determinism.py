"""The same inputs give the same plan file, byte for byte, whatever the number of workers: the layer
ILPs stop at deterministic work limits and the file holds no wall times (docs/FORMAT.md)."""

import pytest
from click.testing import CliRunner

from partopt.cli import main
from partopt.pricing import Pricer


def test_one_and_two_workers_write_the_same_plan_file(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(Pricer, "WARM_S", 0.0)  # two workers really run a pool, even for the tiny graph
    files = []
    for workers in (1, 2):
        path = tmp_path / f"plan-{workers}.json"
        result = CliRunner().invoke(main, ["solve", tiny.graph_file, "--cluster", tiny.cluster_file,
                                           "--workers", str(workers), "-o", str(path)])
        assert result.exit_code == 0, result.output + result.stderr
        files.append(path.read_bytes())
    assert files[0] == files[1]
    assert b'"time_s"' not in files[0]  # the plan's bytes do not depend on the clock


def test_the_ray_executor_writes_the_same_plan_file(tiny, tmp_path):
    """The layer ILPs on a local Ray instance (started and shut down by the executor): the same bytes."""
    pytest.importorskip("ray")
    files = []
    for executor in ("local", "ray"):
        path = tmp_path / f"plan-{executor}.json"
        result = CliRunner().invoke(main, ["solve", tiny.graph_file, "--cluster", tiny.cluster_file, "--workers", "2",
                                           "--executor", executor, "-o", str(path)])
        assert result.exit_code == 0, result.output + result.stderr
        files.append(path.read_bytes())
    assert files[0] == files[1]
