"""partopt: plans inter- and intra-operator parallel training of a graph on a cluster.

    import partopt
    plan = partopt.optimize(partopt.read_graph("instances/gpt-1.3b.json"), partopt.preset("p3.16xlarge", 1))

docs/API.md walks through the library: build or load a graph, make a cluster, optimize, read the
plan, evaluate, simulate and export, and plug in a cost model of your own.
"""

from partopt.cluster import Cluster, Device, Link, preset
from partopt.evaluate import evaluate, uniform
from partopt.export import export
from partopt.graph import Graph, Op, Tensor
from partopt.inter import Options, optimize
from partopt.io import read_cluster, read_graph, write_graph
from partopt.models.builder import GraphBuilder
from partopt.plan import OpStrategy, ParamPlacement, Plan, StagePlan, read_plan, write_plan
from partopt.profiled import Profiled, read_profile
from partopt.sharding import Partial, Replicate, Shard
from partopt.simulate import StageTimes, simulate

__all__ = ["Cluster", "Device", "Graph", "GraphBuilder", "Link", "Op", "OpStrategy", "Options", "ParamPlacement",
           "Partial", "Plan", "Profiled", "Replicate", "Shard", "StagePlan", "StageTimes", "Tensor", "evaluate", "export",
           "optimize", "preset", "read_cluster", "read_graph", "read_plan", "read_profile", "simulate", "uniform",
           "write_graph", "write_plan"]
