"""partopt: plans inter- and intra-operator parallel training of a graph on a cluster.

    import partopt
    plan = partopt.optimize(partopt.read_graph("instances/gpt-1.3b.json"), partopt.preset("p3.16xlarge", 1))
"""

from partopt.cluster import preset
from partopt.inter import optimize
from partopt.io import read_cluster, read_graph
from partopt.plan import Plan, read_plan, write_plan

__all__ = ["Plan", "optimize", "preset", "read_cluster", "read_graph", "read_plan", "write_plan"]
