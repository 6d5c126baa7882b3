"""Checks run before any collective: a mismatch fails on every rank with the same clear message.

Each check raises :class:`ApplyError` naming what does not fit and how to fix it, instead of
letting a rank hang in a collective or die inside a reshape.
"""
from __future__ import annotations

import torch.nn as nn

from nest_fx.plan.support import parallel_support, unimplemented_fields
from nest_fx.plan.plan import Plan, PlanError
from nest_fx.workload.types import chain_fingerprint


class ApplyError(PlanError):
    """The plan does not fit the model, the batch or the launched world."""


def check_world(plan: Plan, world_size: int) -> None:
    used = plan.devices_used
    if world_size != used:
        raise ApplyError(
            f"world size mismatch: the plan uses {used} devices (dp={plan.dp} x {plan.devices_per_replica} "
            f"per replica: stage tp={[s.tp for s in plan.stages]}) but {world_size} processes were launched; "
            f"fix: run torchrun --nproc_per_node={used} (or nnodes x nproc = {used}), or re-plan for "
            f"{world_size} devices (idle ranks are not supported by the runtime)")


def check_tp(plan: Plan, model: nn.Module, graph=None) -> None:
    """ApplyError when a stage's TP degree cannot shard the model (``ParallelSupport.tp_problem``)."""
    support = parallel_support(model, graph)
    for tp in sorted({s.tp for s in plan.stages if s.tp > 1}):
        problem = support.tp_problem(tp)
        if problem:
            raise ApplyError(problem)


def check_ep(plan: Plan, model: nn.Module) -> None:
    """ApplyError when ``plan.ep`` cannot split the model's experts (``ParallelSupport.ep_problem``)."""
    problem = parallel_support(model, None).ep_problem(plan.ep, plan.dp)
    if problem:
        raise ApplyError(problem)


def check_pipeline(plan: Plan, model: nn.Module, graph) -> None:
    """ApplyError when the model cannot be cut into ``plan.pp`` stages (``ParallelSupport.pp_problem``)."""
    problem = parallel_support(model, graph).pp_problem(plan.pp)
    if problem:
        raise ApplyError(problem)


def check_batch(plan: Plan, global_batch_size: int) -> int:
    """Validate the batch; return the number of microbatches per step (scaled up if the batch is a
    multiple of the plan's global batch)."""
    unit = plan.dp * plan.microbatch_size * plan.num_microbatches
    if global_batch_size <= 0 or global_batch_size % unit:
        raise ApplyError(
            f"global batch {global_batch_size} is not divisible by dp * microbatch_size * num_microbatches = "
            f"{plan.dp} * {plan.microbatch_size} * {plan.num_microbatches} = {unit}; fix: use a global batch "
            f"that is a multiple of {unit}, or a plan with num_microbatches = global_batch / (dp * microbatch_size)")
    return global_batch_size // (plan.dp * plan.microbatch_size)


def check_layers(plan: Plan, graph) -> None:
    n = len(graph.blocks)
    if plan.num_layers and plan.num_layers != n:
        raise ApplyError(
            f"plan.num_layers={plan.num_layers} but the traced model has {n} layers in its workload chain "
            f"(head + {n - 2} blocks + tail); fix: plan for this model (a plan for another model?)")
    plan.validate(num_layers=n)
    try:
        plan.check_model(chain_fingerprint((b.kind, b.num_params) for b in graph.blocks), "the traced model")
    except PlanError as exc:
        raise ApplyError(str(exc)) from None
    if plan.pp > 1 and any(b.kind == "head" for b in graph.blocks) and n < plan.pp:
        raise ApplyError(f"pp={plan.pp} stages but only {n} layers")


def check_supported(plan: Plan) -> None:
    """ApplyError for a plan field the runtime cannot run yet (never silently ignored)."""
    unsupported = unimplemented_fields(plan)
    if unsupported:
        raise ApplyError(f"{', '.join(unsupported)}: the runtime does not run this yet; use a plan without it")


def check_loss(plan: Plan, model_loss: bool) -> None:
    """ApplyError when the model's own loss (``loss_fn=None``) is asked of a pipeline, whose last
    stage computes the loss from ``loss_fn(output, target)``."""
    if model_loss and plan.pp > 1:
        raise ApplyError(f"loss_fn=None (the model's own loss) with pp={plan.pp}: the pipeline's last stage computes "
                         "the loss as loss_fn(output, target); fix: give auto_parallelize a loss_fn and train_step the "
                         "targets, or use a plan with pp=1")


def check_microbatches(plan: Plan, model: nn.Module, microbatches: int) -> None:
    """ApplyError when the model's numbers depend on the microbatch split (``ParallelSupport.microbatch_problem``)."""
    problem = parallel_support(model, None).microbatch_problem(microbatches)
    if problem:
        raise ApplyError(problem)


def run_all(plan: Plan, model: nn.Module, graph, world_size: int, global_batch_size: int, *,
            model_loss: bool = False, batch_statistics: bool = True) -> int:
    """Every check, cheapest first; returns the number of microbatches per step. ``model_loss``:
    the model computes its own loss (``loss_fn=None``); ``batch_statistics``: BatchNorm must see the
    whole batch (``sync_batchnorm=True``)."""
    check_supported(plan)
    check_world(plan, world_size)
    if graph is not None:
        check_layers(plan, graph)
    check_tp(plan, model, graph)
    check_ep(plan, model)
    if graph is not None:
        check_pipeline(plan, model, graph)
    nmb = check_batch(plan, global_batch_size)
    if plan.schedule == "interleaved" and nmb % plan.pp:
        raise ApplyError(f"the interleaved schedule needs num_microbatches ({nmb}) to be a multiple of pp={plan.pp}")
    check_loss(plan, model_loss)
    if batch_statistics:
        check_microbatches(plan, model, nmb)
    if plan.pp > 1 and plan.schedule == "1f1b" and nmb < plan.pp:
        raise ApplyError(
            f"1F1B with pp={plan.pp} stages needs at least {plan.pp} microbatches per step, got {nmb}; "
            f"fix: raise num_microbatches to >= {plan.pp} or use schedule 'gpipe'")
    return nmb
