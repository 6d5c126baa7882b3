"""nest-fx: trace a PyTorch model, plan hybrid parallelism with the NEST dynamic program, run it.

    from nest_fx import auto_parallelize, trace, solve, simulate, Plan, Cluster, Constraints
"""
from nest_fx.apply import ParallelModule, auto_parallelize
from nest_fx.cluster import Cluster
from nest_fx.cost.step_time import simulate
from nest_fx.graph import OpGraph, trace
from nest_fx.plan import Plan
from nest_fx.plan.constraints import Constraints
from nest_fx.solver import solve

__version__ = "0.1.0"
__all__ = ["auto_parallelize", "ParallelModule", "trace", "OpGraph", "solve", "simulate", "Plan", "Cluster",
           "Constraints"]
