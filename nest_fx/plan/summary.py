"""One line per plan for logs: the mesh, the schedule and the stages (what rank 0 prints)."""
from __future__ import annotations

from nest_fx.plan.plan import Plan


def plan_summary(plan: Plan, num_microbatches: int) -> str:
    """The plan as the runtime prints it before training (and checkpoints record it)."""
    stages = ", ".join(f"[{s.start},{s.end}) tp{s.tp}" + (f" rc={s.recompute}" if s.recompute != "none" else "")
                       for s in plan.stages)
    return (f"nest-fx plan: {plan.devices_used} ranks = pp{plan.pp} x dp{plan.dp} x tp{plan.uniform_tp}"
            f"{f' (ep{plan.ep})' if plan.ep > 1 else ''}; zero={plan.zero}; schedule={plan.schedule}"
            f"{f' v={plan.virtual_stages}' if plan.schedule == 'interleaved' else ''}; "
            f"microbatches {num_microbatches} x {plan.microbatch_size}; sp={plan.sequence_parallel}; "
            f"placement={plan.placement}\n  stages: {stages}")
