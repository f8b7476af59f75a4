"""The installed library is the planner: no planner module loads partopt.bench, every package-data
glob ships a file, and the benchmark cases need no file outside the package."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import partopt
from partopt.bench import alpa
from partopt.io import graph_to_dict, read_graph

ROOT = Path(__file__).resolve().parent.parent


def test_no_planner_module_imports_the_benchmarks():
    planner = sorted(m.name for m in pkgutil.walk_packages(partopt.__path__, "partopt.")
                     if not m.name.startswith("partopt.bench"))
    assert "partopt.inter" in planner and "partopt.baselines" in planner and "partopt.cli" in planner
    code = f"import importlib, sys\nfor m in {planner!r}: importlib.import_module(m)\nprint('partopt.bench' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"


def test_every_package_data_glob_matches_a_file():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package, globs in config["tool"]["setuptools"]["package-data"].items():
        for pattern in globs:
            assert list((ROOT / package).glob(pattern)), f"{package}: {pattern} matches no file"


def test_the_cases_graphs_are_the_instance_files():
    for instance in sorted({c.instance for c in alpa.cases()}):
        assert graph_to_dict(alpa.load(instance)) == graph_to_dict(read_graph(ROOT / "instances" / f"{instance}.json"))
