"""One line per plan for logs: the mesh, the schedule and the stages (what rank 0 prints)."""

from __future__ import annotations

from nest_fx.plan.plan import Plan
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES


def plan_summary(plan: Plan, num_microbatches: int) -> str:
    """The plan as the runtime prints it before training (and checkpoints record it)."""
    stages = ", ".join(
        f"[{s.start},{s.end}) tp{s.tp}" + (f" rc={s.recompute}" if s.recompute != "none" else "") for s in plan.stages
    )
    extras = [
        name
        for name, on in (
            ("loss_parallel", plan.loss_parallel),
            ("compile", plan.compile),
            ("float8", plan.float8),
            ("pp_shard_grads", plan.pp_shard_grads and plan.pp > 1 and plan.zero >= 2),
        )
        if on
    ]
    return (
        f"nest-fx plan: {plan.devices_used} ranks = pp{plan.pp} x dp{plan.dp}"
        f"{f' x cp{plan.cp}' if plan.cp > 1 else ''} x tp{plan.uniform_tp}"
        f"{f' (ep{plan.ep})' if plan.ep > 1 else ''}; zero={plan.zero}"
        f"{f' (HSDP: shard {plan.shard_degree} x replicate {plan.replicate_degree})' if plan.replicate_degree > 1 else ''}"
        f"; schedule={plan.schedule}"
        f"{f' v={plan.virtual_stages}' if plan.schedule in CHUNKED_SCHEDULES else ''}; "
        f"microbatches {num_microbatches} x {plan.microbatch_size}; sp={plan.sequence_parallel}; "
        f"placement={plan.placement}{f'; precision={plan.precision}' if plan.precision else ''}"
        f"{''.join('; ' + e for e in extras)}\n  stages: {stages}"
    )
