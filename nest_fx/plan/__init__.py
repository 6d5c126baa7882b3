"""Plan: what the solver chooses and the runtime applies (``format: nest-fx-plan/1``).

``plan`` (the :class:`Plan` data object: stages, degrees, schedule, rank layout, validation and
file form) and ``summary`` (the one-line description the runtime prints). See
docs/plan_format.md.
"""
from nest_fx.plan.plan import (PLACEMENTS, PLAN_FORMAT, SCHEDULES, Plan, PlanError, StagePlan, check_device_order,
                               uniform_plan)
from nest_fx.plan.summary import plan_summary
from nest_fx.workload.types import chain_fingerprint

__all__ = ["PLACEMENTS", "PLAN_FORMAT", "SCHEDULES", "Plan", "PlanError", "StagePlan", "chain_fingerprint",
           "check_device_order", "plan_summary", "uniform_plan"]
