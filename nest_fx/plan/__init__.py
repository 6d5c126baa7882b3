"""Plan: what the solver chooses and the runtime applies (``format: nest-fx-plan/1``).

``settings`` (every plan setting, declared once), ``plan`` (the :class:`Plan` data object:
stages, degrees, schedule, rank layout, validation and file form), ``constraints`` (what a user
fixes or bounds) and ``summary`` (the one-line description the runtime prints). See
docs/plan_format.md. The names are imported on first use (``nest_fx.common.lazy``): reading a
plan file must not load the workload package (and torch) with it.
"""

from typing import TYPE_CHECKING

from nest_fx.common.lazy import lazy_exports

_PLAN = "nest_fx.plan.plan"
_EXPORTS = {
    "PLACEMENTS": _PLAN,
    "PLAN_FORMAT": _PLAN,
    "SCHEDULES": _PLAN,
    "Plan": _PLAN,
    "PlanError": _PLAN,
    "StagePlan": _PLAN,
    "check_device_order": _PLAN,
    "uniform_plan": _PLAN,
    "plan_summary": "nest_fx.plan.summary",
    "chain_fingerprint": "nest_fx.workload.types",
}
__all__ = [
    "PLACEMENTS",
    "PLAN_FORMAT",
    "SCHEDULES",
    "Plan",
    "PlanError",
    "StagePlan",
    "chain_fingerprint",
    "check_device_order",
    "plan_summary",
    "uniform_plan",
]  # the keys of _EXPORTS
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from nest_fx.plan.plan import (
        PLACEMENTS,
        PLAN_FORMAT,
        SCHEDULES,
        Plan,
        PlanError,
        StagePlan,
        check_device_order,
        uniform_plan,
    )
    from nest_fx.plan.summary import plan_summary
    from nest_fx.workload.types import chain_fingerprint
