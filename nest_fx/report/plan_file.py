"""A plan file as the user's handle on a plan: what it was planned for, and what to run next.

A plan records the model spec, the cluster, the sequence length, the precision, the optimizer
(in its constraints) and the global batch it was planned for (docs/plan_format.md).
:func:`plan_inputs` turns them into ``simulate`` / ``explain``'s defaults, each flag given on the
command line overriding the plan's value with one line saying so; :func:`next_step_lines` is
what ``nest-fx plan`` prints last. Torch-free: the command line reads plan files before it
imports torch.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import List, Optional

from nest_fx.plan.plan import Plan, PlanError
from nest_fx.plan.priced_only import priced_only_constraints
from nest_fx.plan.vocabulary import DTYPE_OF_PRECISION, SPLIT_BACKWARD_SCHEDULES


@dataclass
class PlanInputs:
    """What ``simulate`` / ``explain`` cost a plan with; ``notes``: one line per flag that
    overrides what the plan records."""

    cluster: str
    devices: Optional[int]
    model: Optional[str]  # None with a workload table, or when neither the flag nor the plan names one
    seq: Optional[int]  # None: the model's default
    dtype: str  # fp32, bf16 or fp16 (a --dtype value)
    notes: List[str] = field(default_factory=list)


def _is_file(spec: str) -> bool:
    return os.path.exists(spec) or spec.endswith((".yaml", ".yml", ".json"))


def default_cluster(plan: Plan, given: Optional[str], devices: Optional[int]) -> tuple:
    """(cluster spec, device count) for ``cluster.load_cluster``: ``given`` or the plan's
    ``cluster``; a preset name without a count takes ``devices`` or the plan's ``world_size``.
    PlanError when neither names a cluster."""
    spec = given or plan.cluster
    if not spec:
        raise PlanError("the plan does not record its cluster: give --cluster NAME:DEVICES or a cluster file")
    if not given and devices is not None and not _is_file(spec) and ":" in spec:
        spec = spec.partition(":")[0]  # --devices N resizes the plan's preset
    if devices is None and not _is_file(spec) and ":" not in spec and plan.world_size:
        devices = plan.world_size
    return spec, devices


def _same_cluster(spec: str, devices: Optional[int], recorded: str) -> bool:
    if devices is not None and ":" not in spec and not _is_file(spec):
        spec = f"{spec}:{devices}"
    return spec == recorded


def plan_inputs(
    plan: Plan,
    *,
    model: Optional[str],
    workload: Optional[str],
    cluster: Optional[str],
    devices: Optional[int],
    seq: Optional[int],
    dtype: Optional[str],
) -> PlanInputs:
    """The plan's recorded model, cluster, sequence length and precision where the flags leave
    them out (``None``); a note for each flag that differs from a recorded value."""
    spec, count = default_cluster(plan, cluster, devices)
    notes = []
    if (cluster or devices is not None) and plan.cluster and not _same_cluster(spec, count, plan.cluster):
        flag = f"--cluster {cluster}" if cluster else f"--devices {devices}"
        notes.append(f"{flag} overrides the plan's cluster {plan.cluster}")
    if model and plan.model and model != plan.model:
        notes.append(f"--model {model} overrides the plan's model {plan.model}")
    if workload and plan.model:
        notes.append(f"--workload {workload} replaces the plan's model {plan.model}")
    if seq is not None and plan.seq_len and seq != plan.seq_len:
        notes.append(f"--seq {seq} overrides the plan's sequence length {plan.seq_len}")
    planned = DTYPE_OF_PRECISION.get(plan.precision, "bf16")
    if dtype is not None and dtype != planned:
        notes.append(f"--dtype {dtype} overrides the plan's precision {plan.precision}")
    return PlanInputs(
        cluster=spec,
        devices=count,
        model=None if workload else (model or plan.model or None),
        seq=seq if seq is not None else (plan.seq_len or None),
        dtype=dtype or planned,
        notes=notes,
    )


def next_step_lines(path: Optional[str], plan: Plan, nproc_per_node: int) -> List[str]:
    """What ``nest-fx plan`` prints last: the commands that use the plan file at ``path`` (None:
    none was written) and a short training script for it."""
    shown = shlex.quote(path) if path else "PLAN.json"
    lines = []
    if path is None:
        lines.append("no plan file written: add --json PLAN.json to keep this plan, then")
    lines += [
        f"next: nest-fx simulate --plan {shown}            # step time and memory of each stage",
        f"      nest-fx explain {shown}"
        + (
            "                   # rank layout, memory bars, priced bubble"
            if plan.schedule in SPLIT_BACKWARD_SCHEDULES
            # no timeline drawn
            else " --png timeline.png  # rank layout, memory bars, pipeline timeline"
        ),
    ]
    nodes = max(1, -(-plan.world_size // max(1, nproc_per_node)))
    launch = (
        f"torchrun --nproc_per_node={min(nproc_per_node, plan.world_size)}"
        + (f" --nnodes={nodes}" if nodes > 1 else " --standalone")
        + " train.py"
    )
    made_for = f"{plan.model}, " if plan.model else ""
    priced_only = not_for_training(plan)
    if priced_only:  # a prediction of another system: the runtime refuses it before training
        return lines + [f"not for training with nest-fx: {priced_only}"]
    lines += [
        f"train with it ({launch}):",
        "    from nest_fx import Plan, auto_parallelize",
        f"    plan = Plan.load({path or 'PLAN.json'!r})  # {made_for}{plan.global_batch} x {plan.seq_len or '?'} "
        "tokens per step",
        "    pm = auto_parallelize(model, batch, plan=plan, global_batch_size=plan.global_batch, loss_fn=loss_fn)",
        "    loss = pm.train_step(inputs, targets); opt.step(); opt.zero_grad()  # opt over pm.parameters()",
    ]
    return lines


def not_for_training(plan: Plan) -> str:
    """Why ``plan`` predicts another system and nest-fx's runtime refuses it before training (kernels
    it does not run, an option that prices another runtime: ``plan.priced_only``); '' when it runs."""
    from nest_fx.plan.may_run import unrun_kernels  # imports torch: this module must not

    return unrun_kernels(plan.kernels, plan.compile) or next(
        (problem for _, problem in priced_only_constraints(plan.constraints)), ""
    )
