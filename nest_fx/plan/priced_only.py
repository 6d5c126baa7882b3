"""Run options that price another system's runtime (for ``nest-fx plan`` / ``simulate``;
``nest_fx.plan.settings.PRICED_ONLY_OPTIONS``): nest-fx's runtime runs only each one's declared
default, and this says why it refuses a plan priced with any other value.

A plan records these options in its constraints (``nest_fx.plan.run_settings``), the cost model
reads them (``CostOptions`` fields of the same names), and ``auto_parallelize`` refuses a plan or
constraints that name another value before it traces, plans or joins a collective
(``nest_fx.plan.may_run``): the runtime would hold or send what it was not priced for.
Torch-free: the plan report (``nest_fx.report.plan_file``) asks it too.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from nest_fx.plan.constraints import Constraints
from nest_fx.plan.settings import PRICED_ONLY_OPTIONS, default

# option -> (what it describes, what nest-fx's runtime does, whatever the option says)
_WHAT_AND_RUNTIME = {
    "expert_dispatch": (
        "expert all-to-all",
        "sends the zoo MoE's capacity slots and HF stacked experts once per owner rank",
    ),
    "stage_outputs": (
        "handling of pipeline stage outputs",
        "keeps each pipeline chunk's output until the chunk's backward (torch's PipelineStage), its sequence "
        "shard where the stage ends on sequence-parallel blocks",
    ),
    "state_buffers": (
        "layout of the data-parallel model states",
        "shards them with FSDP2, which keeps each unit's local shard beside its gathered copy",
    ),
}


def priced_only_problem(name: str, value: Optional[str]) -> str:
    """'' when nest-fx's runtime runs option ``name`` at ``value`` (None: not set), else why a plan
    priced with it does not run, and the fix."""
    runs = default(name)
    if value is None or value == runs:
        return ""
    what, does = _WHAT_AND_RUNTIME[name]
    return (
        f"the plan is priced with {name}={value}, another system's {what} (for nest-fx plan/simulate); "
        f"nest-fx's runtime {does}, whatever the setting says; fix: drop {name} (or set it to {runs!r}) and "
        "plan again"
    )


def priced_only_constraints(constraints: Optional[Constraints]) -> List[Tuple[str, str]]:
    """(the option as the command line writes it, why not and the fix) for each option in
    ``constraints`` that prices another system's runtime; [] when the runtime runs them all."""
    if not constraints:
        return []
    found = []
    for name in PRICED_ONLY_OPTIONS:
        value = getattr(constraints, name)
        problem = priced_only_problem(name, value)
        if problem:
            found.append((f"{name}={value}", problem))
    return found
