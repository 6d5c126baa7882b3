"""nest-fx: trace a PyTorch model, plan hybrid parallelism with the NEST dynamic program, run it.

    from nest_fx import auto_parallelize, trace, solve, simulate, Plan, Cluster, Constraints

The names are imported on first use (``nest_fx.common.lazy``): ``import nest_fx.cli`` must not
load torch, so that ``nest-fx --help`` and argument errors answer at once.
"""

from typing import TYPE_CHECKING

from nest_fx.common.lazy import lazy_exports

__version__ = "0.1.0"
_EXPORTS = {
    "auto_parallelize": "nest_fx.apply",
    "ParallelModule": "nest_fx.apply",
    "trace": "nest_fx.graph",
    "OpGraph": "nest_fx.graph",
    "solve": "nest_fx.solver",
    "simulate": "nest_fx.cost.step_time",
    "Plan": "nest_fx.plan",
    "Cluster": "nest_fx.cluster",
    "Constraints": "nest_fx.plan.constraints",
}
__all__ = [
    "auto_parallelize",
    "ParallelModule",
    "trace",
    "OpGraph",
    "solve",
    "simulate",
    "Plan",
    "Cluster",
    "Constraints",
]  # the keys of _EXPORTS
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from nest_fx.apply import ParallelModule, auto_parallelize
    from nest_fx.cluster import Cluster
    from nest_fx.cost.step_time import simulate
    from nest_fx.graph import OpGraph, trace
    from nest_fx.plan import Plan
    from nest_fx.plan.constraints import Constraints
    from nest_fx.solver import solve
