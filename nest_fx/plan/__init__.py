"""Plan: what the solver chooses and the runtime applies (``format: nest-fx-plan/1``).

``settings`` (every plan setting, declared once), ``plan`` (the :class:`Plan` data object:
stages, degrees, schedule, rank layout, validation and file form), ``constraints`` (what a user
fixes or bounds) and ``summary`` (the one-line description the runtime prints). See
docs/plan_format.md. Nothing here imports torch: the command line reads the declarations before
it imports it (``support``, the runtime's verdict on a model, does, and is imported by name).
"""
from nest_fx.plan.plan import (PLACEMENTS, PLAN_FORMAT, SCHEDULES, Plan, PlanError, StagePlan, check_device_order,
                               uniform_plan)
from nest_fx.plan.summary import plan_summary

__all__ = ["PLACEMENTS", "PLAN_FORMAT", "SCHEDULES", "Plan", "PlanError", "StagePlan", "chain_fingerprint",
           "check_device_order", "plan_summary", "uniform_plan"]


def __getattr__(name: str):
    if name == "chain_fingerprint":
        # in nest_fx.workload.types, whose package imports torch: imported on first use to keep `import nest_fx.plan` light
        from nest_fx.workload.types import chain_fingerprint
        return chain_fingerprint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
