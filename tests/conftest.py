"""Shared fixtures, and the hypothesis profiles: `ci` (the default) is fixed and sized for the 2-core
machine — derandomized, few examples, a deadline per example — so the fuzz tests stay under ~30 s;
`HYPOTHESIS_PROFILE=deep` searches longer."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings

from partopt import io
from partopt.cluster import Cluster, preset
from partopt.graph import Graph
from partopt.inter import optimize
from partopt.models import gpt
from partopt.plan import Plan, write_plan

settings.register_profile("ci", max_examples=25, deadline=timedelta(seconds=5), derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", max_examples=500, deadline=timedelta(seconds=10))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@dataclasses.dataclass(frozen=True)
class Solved:
    """A tiny graph, a 1 × 4 cluster and the plan partopt solved for them (two stages of (1, 2)), and
    the files they are written to."""

    graph: Graph
    cluster: Cluster
    plan: Plan
    graph_file: str
    cluster_file: str
    plan_file: str


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Solved:
    """Solved once per session (0.5 s): tests mutate copies of its plan."""
    directory = tmp_path_factory.mktemp("tiny")
    cluster = dataclasses.replace(preset("p3.16xlarge", 1).narrowed(4), name="four-v100")
    graph = gpt(hidden=64, layers=2, heads=4, seq=32, vocab=128, batch=8, name="tiny-gpt")
    # 1F1B pinned: tests built on this plan hand-check 1F1B's figures (zero-bubble would win here)
    plan = optimize(graph, cluster, microbatches=2, layers=2, logical_shapes=[(2, 1)], workers=1, schedule="1f1b")
    files = [str(directory / name) for name in ("graph.json", "cluster.json", "plan.json")]
    io.write_graph(graph, files[0])
    io.write_cluster(cluster, files[1])
    write_plan(plan, files[2])
    return Solved(graph, cluster, plan, *files)
