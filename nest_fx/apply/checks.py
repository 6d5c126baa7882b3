"""Checks run before any collective: a mismatch fails on every rank with the same clear message.

Each check raises :class:`ApplyError` naming what does not fit and how to fix it, instead of
letting a rank hang in a collective or die inside a reshape.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from nest_fx.apply.async_tp import async_tp_problem
from nest_fx.apply.compile import compile_problem
from nest_fx.apply.float8 import float8_problem
from nest_fx.apply.losses import lm_loss, token_cross_entropy_problem
from nest_fx.plan.may_run import (
    may_run,
    schedule_microbatch_problem,
    unrun_fields,
    unrun_kernels,
    unrun_norm_kernel,
)
from nest_fx.plan.support import model_dims, parallel_support
from nest_fx.plan.plan import Plan, PlanError
from nest_fx.workload.types import chain_fingerprint


class ApplyError(PlanError):
    """The plan does not fit the model, the batch or the launched world."""


def check_world(plan: Plan, world_size: int) -> None:
    used = plan.devices_used
    if world_size != used:
        raise ApplyError(
            f"world size mismatch: the plan uses {used} devices (dp={plan.dp} x {plan.devices_per_replica} "
            f"per replica: stage tp={[s.tp for s in plan.stages]}{f' x cp={plan.cp}' if plan.cp > 1 else ''}) "
            f"but {world_size} processes were launched; "
            f"fix: run torchrun --nproc_per_node={used} (or nnodes x nproc = {used}), or re-plan for "
            f"{world_size} devices (idle ranks are not supported by the runtime)"
        )


def check_may_run(plan: Plan, model: nn.Module, graph=None) -> None:
    """ApplyError with the first reason this model cannot run the plan's TP (and SP), EP and
    pipeline degrees: ``nest_fx.plan.may_run``, the question the planner asks too."""
    _raise_first(may_run(model, graph).model_problems(plan))


def check_tp(plan: Plan, model: nn.Module, graph=None) -> None:
    """ApplyError when a stage's TP degree cannot shard the model, or SP cannot run under it."""
    runs = may_run(model, graph)
    tps = sorted({s.tp for s in plan.stages})
    _raise_first(
        [runs.degree_problem("tp", tp) for tp in tps]
        + [runs.degree_problem("sequence_parallel", tp) for tp in tps if plan.sequence_parallel and tp > 1]
    )


def check_ep(plan: Plan, model: nn.Module) -> None:
    """ApplyError when ``plan.ep`` cannot split the model's experts."""
    _raise_first([may_run(model).degree_problem("ep", plan.ep, plan.dp)])


def check_pipeline(plan: Plan, model: nn.Module, graph) -> None:
    """ApplyError when the model cannot be cut into ``plan.pp`` stages."""
    _raise_first([may_run(model, graph).degree_problem("pp", plan.pp)])


def _raise_first(problems) -> None:
    problem = next((p for p in problems if p), "")
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
            f"that is a multiple of {unit}, or a plan with num_microbatches = global_batch / (dp * microbatch_size)"
        )
    return global_batch_size // (plan.dp * plan.microbatch_size)


def check_layers(plan: Plan, graph) -> None:
    n = len(graph.blocks)
    if plan.num_layers and plan.num_layers != n:
        raise ApplyError(
            f"plan.num_layers={plan.num_layers} but the traced model has {n} layers in its workload chain "
            f"(head + {n - 2} blocks + tail); fix: plan for this model (a plan for another model?)"
        )
    plan.validate(num_layers=n)
    try:
        plan.check_model(chain_fingerprint((b.kind, b.num_params) for b in graph.blocks), "the traced model")
    except PlanError as exc:
        raise ApplyError(str(exc)) from None
    if plan.pp > 1 and any(b.kind == "head" for b in graph.blocks) and n < plan.pp:
        raise ApplyError(f"pp={plan.pp} stages but only {n} layers")


def check_supported(plan: Plan) -> None:
    """ApplyError for a plan field the runtime cannot run (never silently ignored)."""
    unsupported = unrun_fields(plan)
    if unsupported:
        raise ApplyError("; ".join(unsupported))


def check_context_parallel(plan: Plan, model: nn.Module, graph, loss_fn: Optional[Callable]) -> None:
    """ApplyError when ``plan.cp`` cannot split the model's sequences (``ParallelSupport.cp_problem``)
    or ``loss_fn`` is not a mean over tokens (each CP rank computes it on its part of every sequence)."""
    if plan.cp == 1:
        return
    problem = parallel_support(model, graph).cp_problem(plan.cp)
    if problem:
        raise ApplyError(problem)
    if loss_fn is not None and loss_fn is not lm_loss:
        _check_token_mean(loss_fn, plan.cp, model_dims(model)["vocab"] or 8)


def _check_token_mean(loss_fn: Callable, cp: int, vocab: int) -> None:
    """Probe ``loss_fn`` on random logits: the loss of a batch must equal the mean of the losses of
    its CP ranks' token halves (what the runtime reports and differentiates under CP)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4 * cp, vocab, generator=gen)
    targets = torch.randint(0, vocab, (2, 4 * cp), generator=gen)
    pieces = [(logits[:, k::cp], targets[:, k::cp]) for k in range(cp)]
    fix = (
        "with cp > 1 each CP rank computes loss_fn on its part of every sequence and the runtime averages "
        "them, so loss_fn must be a mean over tokens (like nest_fx.apply.losses.lm_loss); fix: use such a "
        "loss or cp=1"
    )
    try:
        whole = float(loss_fn(logits, targets))
        parts = sum(float(loss_fn(x, y)) for x, y in pieces) / cp
    except Exception as exc:  # noqa: BLE001 - any failure on the probe means it cannot be verified
        raise ApplyError(
            f"cp={cp}: loss_fn failed on a probe of [2, {4 * cp}, {vocab}] logits ({exc}); {fix}"
        ) from None
    if abs(whole - parts) > 1e-5 * max(1.0, abs(whole)):
        raise ApplyError(
            f"cp={cp}: loss_fn is not a mean over tokens (the whole batch gives {whole:.6g}, the "
            f"mean over its token parts {parts:.6g}); {fix}"
        )


def check_loss_parallel(plan: Plan, model: nn.Module, graph, loss_fn: Optional[Callable]) -> None:
    """ApplyError when ``plan.loss_parallel`` cannot run: a loss that is not the token-mean
    cross-entropy (``losses.token_cross_entropy_problem``: ``lm_loss`` or one equal to it), or an
    LM head whose logits cannot stay sharded (``ParallelSupport.loss_parallel_problem``)."""
    if not plan.loss_parallel:
        return
    reason = token_cross_entropy_problem(loss_fn, model_dims(model)["vocab"] or 8) if loss_fn is not None else ""
    if reason:
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        raise ApplyError(
            f"loss_parallel: the plan computes the token-mean cross-entropy "
            f"(nest_fx.apply.losses.lm_loss) from vocabulary-sharded logits, but loss_fn {name} {reason}; "
            "fix: pass loss_fn=lm_loss, or keep your loss on full logits: a plan with "
            "loss_parallel=false (planner: constraints={'fix': {'loss_parallel': False}})"
        )
    problem = parallel_support(model, graph).loss_parallel_problem(plan.stages[-1].tp)
    if problem:
        raise ApplyError(problem)


def check_runtime_options(plan: Plan, model: nn.Module, graph, loss_fn: Optional[Callable], device_type: str) -> None:
    """The runtime features of the plan (context parallel, loss parallel, the kernels it is priced
    with, compile, float8, async TP):
    everything they need, named before any collective."""
    check_context_parallel(plan, model, graph, loss_fn)
    check_loss_parallel(plan, model, graph, loss_fn)
    _raise_first([unrun_kernels(plan.kernels or "", plan.compile), unrun_norm_kernel(plan.norm_kernel, plan.compile)])
    if plan.loss_kernel == "compile" and loss_fn is None:
        raise ApplyError(
            "loss_kernel=compile compiles loss_fn, but the model computes its own loss (loss_fn=None); fix: "
            "pass loss_fn (e.g. nest_fx.apply.losses.lm_loss) or set loss_kernel ''"
        )
    if plan.compile or plan.loss_kernel == "compile":
        problem = compile_problem(device_type)
        if problem:
            raise ApplyError(problem)
    if plan.float8:
        problem = float8_problem(device_type)
        if problem:
            raise ApplyError(problem)
    if plan.async_tp:
        problem = async_tp_problem(device_type)
        if problem:
            raise ApplyError(problem)


def check_microbatches(plan: Plan, model: nn.Module, microbatches: int) -> None:
    """ApplyError when the model's numbers depend on the microbatch split (``ParallelSupport.microbatch_problem``)."""
    problem = parallel_support(model, None).microbatch_problem(microbatches)
    if problem:
        raise ApplyError(problem)


def run_all(
    plan: Plan,
    model: nn.Module,
    graph,
    world_size: int,
    global_batch_size: int,
    *,
    model_loss: bool = False,
    batch_statistics: bool = True,
) -> int:
    """Every check, cheapest first; returns the number of microbatches per step. ``model_loss``:
    the model computes its own loss (``loss_fn=None``); ``batch_statistics``: BatchNorm must see the
    whole batch (``sync_batchnorm=True``)."""
    check_supported(plan)
    check_world(plan, world_size)
    if graph is not None:
        check_layers(plan, graph)
    check_may_run(plan, model, graph)  # TP (and SP), EP, the pipeline cut: nest_fx.plan.may_run
    nmb = check_batch(plan, global_batch_size)
    _raise_first([schedule_microbatch_problem(plan.schedule, plan.pp, nmb)])
    if batch_statistics:
        check_microbatches(plan, model, nmb)
    return nmb
