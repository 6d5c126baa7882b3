"""Planner: the NEST dynamic program and baselines on one cost model."""

from nest_fx.solver.search import NoFeasiblePlan, SolveResult, solve
from nest_fx.solver.space import GlobalConfig, SolverOptions

__all__ = ["solve", "SolveResult", "SolverOptions", "GlobalConfig", "NoFeasiblePlan"]
