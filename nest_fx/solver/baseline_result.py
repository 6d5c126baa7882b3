"""What a baseline planner returns (:class:`Baseline`), and the helpers every baseline shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from nest_fx.cost.results import SimResult
from nest_fx.cost.step_time import simulate
from nest_fx.plan import Plan
from nest_fx.plan.may_run import unrun_fields
from nest_fx.solver.space import SolverOptions
from nest_fx.workload import Workload


@dataclass
class Baseline:
    """One baseline's plan and its predicted result (None when it found no plan that fits)."""

    name: str
    plan: Optional[Plan]
    result: Optional[SimResult]
    evaluations: int
    seconds: float = 0.0
    notes: str = ""  # how the baseline was run where it departs from its authors' practice


def evaluate(plan: Plan, workload: Workload, cluster, options: SolverOptions) -> Optional[SimResult]:
    """The plan's simulated result when it fits in memory and the runtime runs its settings
    (``plan.may_run.unrun_fields``), else None."""
    if unrun_fields(plan):
        return None
    r = simulate(plan, workload, cluster, options.cost)
    return r if r.feasible else None


def best_baseline(baselines: Sequence[Baseline]) -> Optional[Baseline]:
    """The baseline with the shortest step among those that found a plan (None when none did)."""
    found: List[Baseline] = [b for b in baselines if b.result is not None]
    return min(found, key=lambda b: b.result.step_s) if found else None
