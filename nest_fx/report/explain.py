"""``nest-fx explain``: a plan in words and pictures.

Sections: the mesh and where every TP/DP/EP group and pipeline boundary sits on the network,
the stages and their layers, memory per device by category as text bars against the device's
memory, the step-time breakdown, and the pipeline timeline (an event simulation of the
schedule from the simulator's stage times; :func:`write_timeline_png` draws it).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from nest_fx.report import layout, timeline
from nest_fx.report import tables as report
from nest_fx.report.gantt import draw_gantt
from nest_fx.report.plan_file import not_for_training
from nest_fx.report.plotting import require_pyplot
from nest_fx.cluster.ordered import placed
from nest_fx.cost import memory
from nest_fx.cost.error_bands import ErrorBand
from nest_fx.cost.options import CostOptions
from nest_fx.cost.optimizers import resolved_kernel
from nest_fx.cost.precision import priced_options
from nest_fx.cost.step_time import pipeline_time, stage_tail
from nest_fx.plan.plan import PlanError
from nest_fx.plan.vocabulary import CHUNKED_SCHEDULES

GiB = 2**30
BAR_WIDTH = 32
MEMORY_TERMS = (
    ("weights", "weights"),
    ("grads", "gradients"),
    ("optimizer", "optimizer states"),
    ("activations", "activations"),
    ("buffers", "p2p buffers"),
    ("fsdp_unsharded", "FSDP unsharded"),
    ("optimizer_step", "optimizer scratch"),
    ("allocator_cache", "allocator cache"),
)
TIME_TERMS = (
    ("compute", "compute"),
    ("recompute", "recompute"),
    ("tp_comm", "TP comm"),
    ("ep_comm", "EP all-to-all"),
    ("cp_comm", "CP K/V exchange"),
    ("p2p", "PP p2p"),
    ("bubble", "pipeline bubble"),
    ("dp_sync_exposed", "DP sync (exposed)"),
    ("tied_grad_sync", "tied-weight grads"),
    ("optimizer", "optimizer step"),
)
DETAIL_STAGES = 4  # per-category memory bars for every stage up to this depth, else the peak stage
MAX_TIMELINE_EVENTS = 1_000_000


# -- text bars ------------------------------------------------------------------------------------


def text_bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """``█████░░░``: ``fraction`` of ``width`` filled (over 1: full, with a '!' at the end)."""
    if fraction > 1:
        return "█" * (width - 1) + "!"
    filled = int(round(max(fraction, 0.0) * width))
    return "█" * filled + "░" * (width - filled)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def _amount(n: float, capacity: float) -> str:
    """'61.2/80 GiB', or '12.83 MiB/80 GiB' for amounts too small to show in GiB."""
    cap = f"{capacity / GiB:.0f} GiB"
    return f"{_gib(n):>6}/{cap}" if n == 0 or n >= 0.05 * GiB else f"{report.fmt_bytes(n)}/{cap}"


# -- sections -------------------------------------------------------------------------------------


def _title(text: str) -> List[str]:
    return ["", text, "-" * len(text)]


def header_lines(plan, workload, cluster, result) -> List[str]:
    """Model, cluster, plan and the predicted figures."""
    levels = " > ".join(f"{lv.name} {lv.group_size} @ {report.fmt_si(lv.bandwidth, 'B/s')}" for lv in cluster.levels)
    idle = cluster.num_devices - plan.devices_used
    status = "fits in memory" if result.feasible else f"DOES NOT FIT: {result.binding}"
    return [
        f"model {workload.model}: {len(workload)} layers, {report.fmt_si(workload.num_params)} params",
        f"cluster {cluster.name}: {cluster.num_devices} x {cluster.device.name} "
        f"({_gib(cluster.device.memory_bytes)} GiB); levels {levels}",
        f"plan: {report.plan_summary(plan)}",
        f"devices: {plan.devices_used} used"
        + (f", {idle} idle" if idle else "")
        + f"; global batch {plan.global_batch} x {workload.dims.seq_len} tokens; precision {plan.precision}",
        f"predicted: step {report.fmt_seconds(result.step_s)}, {report.fmt_si(result.tokens_per_s)} tokens/s, "
        f"{report.fmt_si(result.model_flops_per_device, 'FLOP/s')} model FLOPs per device; {status}",
    ] + [f"not for training with nest-fx: {why}" for why in [not_for_training(plan)] if why]


def layout_lines(plan, cluster) -> List[str]:
    """Mesh, groups and the first group of every network level."""
    mesh = plan.mesh()
    if mesh:
        dims = ", ".join(mesh["dims"])
        shape = ", ".join(str(n) for n in mesh["shape"])
        lines = [f"mesh ({dims}) = ({shape}), placement {plan.placement}"]
    else:
        lines = [f"no regular mesh (TP differs per stage: {[s.tp for s in plan.stages]}), placement {plan.placement}"]
    lines += layout.group_lines(plan, cluster)
    lines.append("network levels (what the first group of each holds):")
    lines += ["  " + x for x in layout.level_map_lines(plan, cluster)]
    return lines


def memory_lines(plan, cluster, result, options: CostOptions) -> List[str]:
    """Per-category bars for each stage (the peak stage only for deep pipelines), then totals."""
    capacity = cluster.device.memory_bytes
    usable = capacity * options.usable_memory_fraction
    cap = f"{capacity / GiB:.0f} GiB"
    stages = result.stages
    peak = max(range(len(stages)), key=lambda k: stages[k].memory["total"])
    detail = range(len(stages)) if len(stages) <= DETAIL_STAGES else [peak]
    lines = [
        f"device memory {cap}, usable {_gib(usable)} GiB ({options.usable_memory_fraction:.0%}); the caching "
        f"allocator ({options.allocator_segments} segments) keeps {options.allocator_peak_share:.2f} x the largest "
        f"layer working set cached and reserves the total x {1 + options.allocator_overhead:.2f}, so a stage fits "
        f"when its total is at most {_gib(memory.usable_bytes(capacity, options))} GiB"
    ]
    for k in detail:
        s = stages[k]
        head = f"stage {k}: layers {s.layers[0]}-{s.layers[1] - 1}, tp {s.tp}, recompute {s.recompute}"
        lines.append(head + (" (the stage with the most memory)" if len(detail) == 1 and len(stages) > 1 else ""))
        for key, name in MEMORY_TERMS:
            amount = s.memory.get(key, 0.0)
            lines.append(f"  {name:<17} {text_bar(amount / capacity)} {_amount(amount, capacity)}")
        lines.append(f"  {'total':<17} {text_bar(s.memory['total'] / capacity)} {_amount(s.memory['total'], capacity)}")
        lines.append(
            f"  {'reserved':<17} {text_bar(s.reserved / capacity)} {_amount(s.reserved, capacity)}"
            + ("" if s.fits else f"  > {_gib(usable)} GiB usable: DOES NOT FIT")
        )
    if len(detail) < len(stages):
        lines.append("totals per stage:")
        for s in stages:
            lines.append(
                f"  stage {s.index:<11} {text_bar(s.memory['total'] / capacity)} "
                f"{_amount(s.memory['total'], capacity)}" + ("" if s.fits else "  DOES NOT FIT")
            )
    return lines


def time_lines(plan, cluster, result, options: CostOptions) -> List[str]:
    """Breakdown bars (terms of the slowest stage) and the DP sync that overlap hides."""
    b, step = result.breakdown, result.step_s
    v = plan.virtual_stages  # model chunks per device
    times = [s.per_microbatch(v) for s in result.stages]
    slow = max(range(len(times)), key=times.__getitem__)
    lines = [
        f"step {report.fmt_seconds(step)}; per-microbatch terms are stage {slow}'s "
        f"(the slowest: {report.fmt_seconds(times[slow])} per microbatch) x {plan.num_microbatches} microbatches"
    ]
    for key, name in TIME_TERMS:
        value = b.get(key, 0.0)
        lines.append(
            f"  {name:<18} {text_bar(value / step if step else 0.0)} {report.fmt_seconds(value):>10} "
            f"{100 * value / step if step else 0.0:5.1f}%"
        )
    tails = [stage_tail(s, plan, cluster, options) for s in result.stages]
    sync = max(s.dp_sync for s in result.stages)
    if sync > 0:
        exposed = max(t[0] for t in tails)
        lines.append(
            f"DP gradient sync: up to {report.fmt_seconds(sync)} per stage per step, "
            f"{report.fmt_seconds(exposed)} exposed after the last backward"
            + f" (overlap share {float(options.overlap_grad_sync):g})"
        )
    lines.append(
        f"kernels {plan.kernels or ('compile' if plan.compile else 'eager')}; "
        f"error band of the step time: {band_text(result)}"
    )
    runs = resolved_kernel(options.optimizer_kernel, cluster.device)
    lines.append(
        f"optimizer {options.optimizer}, {runs}" + ("" if options.optimizer_kernel else " (torch's default here)")
    )
    return lines


def band_text(result) -> str:
    """The prediction's error band in words (``cost.error_bands``)."""
    return ErrorBand(result.error_band, result.error_basis or "not recorded").text()


def step_events(plan, result, max_microbatches: Optional[int] = None) -> Tuple[List[timeline.Event], int]:
    """The timeline's events and the microbatch count they use: the plan's m, or at most
    ``max_microbatches`` (rounded up to a multiple of the stage count for interleaved)."""
    v = plan.virtual_stages  # model chunks per device
    m = plan.num_microbatches
    if max_microbatches is not None and m > max_microbatches:
        m = max_microbatches
        if plan.schedule in CHUNKED_SCHEDULES:
            m = min(plan.num_microbatches, plan.pp * math.ceil(m / plan.pp))
    fwd, bwd = timeline.stage_blocks(result, v)
    return timeline.schedule_events(fwd, bwd, m, plan.schedule, v, timeline.stage_delays(result)), m


def timeline_lines(plan, result) -> List[str]:
    """Schedule, event-simulated pipeline time next to the cost model's, busy share per stage."""
    v = plan.virtual_stages  # model chunks per device
    times = [s.per_microbatch(v) for s in result.stages]
    t_pipe, bubble = pipeline_time(times, plan.num_microbatches, plan.schedule, v, [s.span(v) for s in result.stages])
    sched = plan.schedule + (f" (v={v} chunks per device)" if v > 1 else "")
    lines = [
        f"schedule {sched}, {plan.pp} stage(s), {plan.num_microbatches} microbatches of "
        f"{plan.microbatch_size} sequence(s)",
        f"cost model: pipeline {report.fmt_seconds(t_pipe)}, bubble {report.fmt_seconds(bubble)} "
        f"({100 * bubble / result.step_s:.1f}% of the step)",
    ]
    if plan.schedule not in timeline.SCHEDULES:
        lines.append(
            f"event simulation: the timeline does not draw {plan.schedule}'s split backward (the cost "
            'model\'s bubble for it: docs/cost_model.md, "Zero-bubble schedules")'
        )
        return lines
    if 2 * plan.pp * v * plan.num_microbatches > MAX_TIMELINE_EVENTS:
        lines.append("event simulation skipped (too many microbatches x stages); --png draws a shortened one")
        return lines
    events, _ = step_events(plan, result)
    span = timeline.makespan(events)
    lines.append(
        f"event simulation of the schedule: pipeline {report.fmt_seconds(span)} "
        f"({round(100 * (span / t_pipe - 1), 1) + 0.0:+.1f}% vs the cost model)"
    )  # no "-0.0"
    busy = [0.0] * plan.pp
    for e in events:
        busy[e.stage] += e.end - e.start
    shown = ", ".join(f"{i}: {100 * b / span:.0f}%" for i, b in enumerate(busy[:16]))
    lines.append(f"busy share per stage: {shown}" + (" .." if plan.pp > 16 else ""))
    return lines


def explain_text(plan, workload, cluster, result, options: Optional[CostOptions] = None) -> str:
    """The whole report as text; ``result`` is ``simulate(plan, workload, cluster, options)``."""
    options = priced_options(plan.precision, options or CostOptions())  # as simulate priced it
    lines = header_lines(plan, workload, cluster, result)
    order = layout.placement_lines(plan, cluster) if plan.device_order is not None else []
    cluster = placed(cluster, plan.device_order)  # groups and levels of the devices the ranks run on
    lines += _title("Mesh and rank layout") + layout_lines(plan, cluster) + order
    lines += _title("Stages") + report.stages_table(plan, workload, result).splitlines()
    lines += _title("Memory per device") + memory_lines(plan, cluster, result, options)
    lines += _title("Step time") + time_lines(plan, cluster, result, options)
    lines += _title("Pipeline timeline") + timeline_lines(plan, result)
    return "\n".join(lines)


def write_timeline_png(
    plan, cluster, result, path: str, options: Optional[CostOptions] = None, max_microbatches: int = 32
) -> int:
    """Draw the schedule (at most ``max_microbatches`` microbatches) with each stage's DP-sync
    and optimizer tail; returns the number of microbatches drawn. ImportError without matplotlib."""
    require_pyplot()  # fail before the simulation work
    if plan.schedule not in timeline.SCHEDULES:
        raise PlanError(
            f"the timeline draws the {', '.join(timeline.SCHEDULES)} schedules, not {plan.schedule}; "
            "fix: leave out --png (the text report prices it)"
        )
    options = priced_options(plan.precision, options or CostOptions())
    events, m = step_events(plan, result, max_microbatches)
    tails: Sequence[Tuple[float, float]] = [stage_tail(s, plan, cluster, options) for s in result.stages]
    v = plan.virtual_stages  # model chunks per device
    t_pipe, _ = pipeline_time(
        [s.per_microbatch(v) for s in result.stages], m, plan.schedule, v, [s.span(v) for s in result.stages]
    )
    shown = (
        f"{m} microbatches"
        if m == plan.num_microbatches
        else f"{m} of {plan.num_microbatches} microbatches (the steady state repeats)"
    )
    title = (
        f"{plan.model or 'plan'} on {cluster.name}:{cluster.num_devices}: {report.plan_summary(plan)}\n"
        f"{shown}; dashed: cost-model pipeline time"
    )
    draw_gantt(events, path, num_stages=plan.pp, title=title, tails=tails, marker=t_pipe)
    return m
