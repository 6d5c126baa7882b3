"""``auto_parallelize``: trace, plan, check, build the mesh, then apply PP, EP, TP, AC and DP.

Order of the rewrites on each rank (each one a module of ``nest_fx.apply``):

1. ``pipeline.split_stages``   keep this rank's layer range(s) of the workload chain
2. ``data_parallel.broadcast_module`` make the stage identical on its DP x TP ranks (one rank's
                               weights win, so ranks need not share a seed)
3. ``expert_parallel``         keep E/ep experts, exchange tokens with all_to_all
4. ``tensor_parallel``         Colwise/Rowwise on the traced TP pairs (+ sequence parallel)
5. ``checkpointing``           per-stage recompute
6. ``data_parallel``           gradient all-reduce (zero=0) or FSDP2 (zero>=1)
7. ``pipeline.make_schedule``  PipelineStage(s) and the 1F1B / GPipe / interleaved schedule

All plan/model/batch/world checks (``checks.run_all``) run before the first collective.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from nest_fx.apply import checks
from nest_fx.apply.checkpointing import apply_checkpointing
from nest_fx.apply.data_parallel import GradientSync, apply_fsdp, broadcast_module
from nest_fx.apply.expert_parallel import apply_expert_parallel, expert_parameters, find_moe_modules
from nest_fx.apply.mesh import build_mesh, locate, submesh
from nest_fx.apply.pipeline import check_untied, interleaved_ranges, make_schedule, split_stages, stage_blocks
from nest_fx.apply.runtime import ParallelModule
from nest_fx.apply.tensor_parallel import apply_tensor_parallel, apply_vocab_parallel
from nest_fx.cost.placement import is_identity
from nest_fx.plan import Plan, check_device_order, uniform_plan

Planner = Callable[[Any, Any, int, int], Plan]


DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "NEST_FX_TIMEOUT_S"


def collective_timeout_s(timeout_s: Optional[float] = None) -> float:
    """The process-group timeout: ``timeout_s`` if given, else ``$NEST_FX_TIMEOUT_S``, else 600 s.

    A collective that waits longer (a peer died or never joined) raises on the waiting rank
    instead of hanging the job.
    """
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; fix: e.g. {TIMEOUT_ENV}=600") \
                from None
    if not timeout_s > 0:
        raise ValueError(f"the collective timeout must be positive, got {timeout_s}; fix: pass timeout_s > 0 or "
                         f"set {TIMEOUT_ENV}")
    return float(timeout_s)


_NUMBERED_FOR: list = [None]  # (device order, default group id) of the group init_distributed numbered


def plan_rank_of(device_order: Optional[Sequence[int]], launched_rank: int) -> int:
    """The plan rank the process launched as global rank ``launched_rank`` plays: r such that
    ``device_order[r] == launched_rank`` (the rank itself without an order)."""
    if is_identity(device_order):
        return launched_rank
    try:
        return list(device_order).index(launched_rank)
    except ValueError:
        raise checks.ApplyError(f"device_order: rank {launched_rank} is not in the plan's device order "
                                f"({len(device_order)} entries); re-plan for this world") from None


def init_distributed(timeout_s: Optional[float] = None,
                     device_order: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """Initialise the default process group from the torchrun environment if needed.

    Reads WORLD_SIZE / RANK / LOCAL_RANK; gloo on CPU, nccl on CUDA. Without a launcher (no
    WORLD_SIZE) a one-rank group on an in-memory store is created, so the same script runs
    as a plain ``python`` process. Collectives time out after :func:`collective_timeout_s`
    (``timeout_s``, ``$NEST_FX_TIMEOUT_S`` or 600 s); a group initialised by the caller keeps
    its own timeout. Returns (world_size, rank).

    ``device_order`` (a plan's, ``Plan.device_order``): the process launched as global rank
    ``device_order[r]`` joins the group as rank r (:func:`plan_rank_of`); it keeps its device
    (``LOCAL_RANK``). The runtime works on plan ranks throughout, so renumbering the group is
    all it takes to run plan rank r on that device. Permuting the DeviceMesh instead would be
    unsafe: ``new_group`` sorts a group's ranks, so along a permuted mesh dim the group rank
    would differ from the mesh coordinate that DTensor, FSDP and PipelineStage index by. A group
    initialised by the caller cannot be renumbered: with a non-identity order that is an
    :class:`~nest_fx.apply.checks.ApplyError`.
    """
    if dist.is_initialized():
        if not is_identity(device_order) and _NUMBERED_FOR[0] != (tuple(device_order), id(dist.group.WORLD)):
            raise checks.ApplyError(
                "device_order: the plan places its ranks on other devices, which the runtime does by numbering the "
                "default process group, but the group was initialised before auto_parallelize; fix: let "
                "auto_parallelize initialise it, or call nest_fx.apply.api.init_distributed(device_order="
                "plan.device_order) first (or init_process_group with rank=plan_rank_of(plan.device_order, RANK))")
        return dist.get_world_size(), dist.get_rank()
    timeout = timedelta(seconds=collective_timeout_s(timeout_s))
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif not is_identity(device_order):
        if len(device_order) != world:
            raise checks.ApplyError(
                f"device_order: lists {len(device_order)} ranks but WORLD_SIZE is {world}; launch "
                f"{len(device_order)} processes or re-plan for {world} devices")
        check_device_order(device_order, world)
        launched = int(os.environ.get("RANK", "0"))
        # the launcher's rendezvous store, hosted as the launcher arranged it (torchrun's agent, or
        # the process launched as rank 0 on MASTER_ADDR), not by whichever process plays plan rank 0
        from torch.distributed.rendezvous import _create_c10d_store

        store = _create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launched, world, timeout)
        dist.init_process_group(backend, store=store, rank=plan_rank_of(device_order, launched), world_size=world,
                                timeout=timeout)
        _NUMBERED_FOR[0] = (tuple(device_order), id(dist.group.WORLD))
    else:
        dist.init_process_group(backend, timeout=timeout)
    return dist.get_world_size(), dist.get_rank()


def default_plan(graph, world_size: int, global_batch_size: int, model_name: str = "") -> Plan:
    """Pure data parallelism over the whole world (the fallback until a planner is passed)."""
    n = len(graph.blocks)
    if global_batch_size % world_size:
        raise checks.ApplyError(
            f"no plan given and the default plan (pure data parallel over {world_size} ranks) needs the global "
            f"batch ({global_batch_size}) divisible by {world_size}; fix: pass plan= or planner=, or a batch "
            f"that is a multiple of {world_size}")
    return uniform_plan(n, pp=1, tp=1, dp=world_size, microbatch_size=global_batch_size // world_size,
                        num_microbatches=1, model=model_name, world_size=world_size,
                        notes="default: pure data parallel")


def _split_example(example_inputs) -> Tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    return tuple(example_inputs), {}


def _device_type_of(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def plan_summary(plan: Plan, num_microbatches: int) -> str:
    stages = ", ".join(f"[{s.start},{s.end}) tp{s.tp}" + (f" rc={s.recompute}" if s.recompute != "none" else "")
                       for s in plan.stages)
    return (f"nest-fx plan: {plan.devices_used} ranks = pp{plan.pp} x dp{plan.dp} x tp{plan.uniform_tp}"
            f"{f' (ep{plan.ep})' if plan.ep > 1 else ''}; zero={plan.zero}; schedule={plan.schedule}"
            f"{f' v={plan.virtual_stages}' if plan.schedule == 'interleaved' else ''}; "
            f"microbatches {num_microbatches} x {plan.microbatch_size}; sp={plan.sequence_parallel}; "
            f"placement={plan.placement}\n  stages: {stages}")


def auto_parallelize(model: nn.Module, example_inputs, *, cluster=None, global_batch_size: int,
                     loss_fn: Callable, plan: Optional[Plan] = None, planner: Optional[Planner] = None,
                     graph=None, verbose: bool = True, timeout_s: Optional[float] = None) -> ParallelModule:
    """Parallelise ``model`` for training under torchrun and return a :class:`ParallelModule`.

    ``example_inputs``: a tensor, a tuple of tensors, or a dict of keyword tensors (HF
    ``{"input_ids": ...}``) with the per-step shapes (only shapes/dtypes are used).
    ``plan``: a :class:`~nest_fx.plan.Plan`; when None, ``planner(graph, cluster, world_size,
    global_batch_size)`` chooses one; the default planner is the NEST DP
    (``nest_fx.solver.runtime_planner.planner_for``) on ``cluster`` or, when None, a preset for
    the detected device and world size. ``loss_fn(output, target)`` must average over its batch.
    ``graph``: an OpGraph of the model when already traced. Every rank must call this with the
    same arguments. The model is modified in place (its stage is kept, the rest dropped).
    ``timeout_s``: collective timeout when this call creates the process group (default
    ``$NEST_FX_TIMEOUT_S`` or 600 s). Every check runs before the first collective, so a plan
    that does not fit fails on every rank with the same :class:`ApplyError`.
    """
    world, rank = init_distributed(timeout_s, plan.device_order if plan is not None else None)
    args, kwargs = _split_example(example_inputs)
    if graph is None:
        from nest_fx.graph import trace

        graph = trace(model, args, kwargs, name=type(model).__name__)
    if plan is None:
        if planner is None:
            from nest_fx.solver.runtime_planner import planner_for

            planner = planner_for(model)
        plan = planner(graph, cluster, world, global_batch_size)
        init_distributed(timeout_s, plan.device_order)  # a placed plan needs the group numbered for it
    nmb = checks.run_all(plan, model, graph, world, global_batch_size)
    check_untied(model, graph, plan.pp)
    if rank == 0 and verbose:
        print(plan_summary(plan, nmb), flush=True)

    device_type = _device_type_of(model)
    on_meta = device_type == "meta"
    mesh_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = build_mesh(plan, mesh_device)
    info = locate(plan, rank)
    stage_plan = plan.stages[info.stage]
    n = len(graph.blocks)

    # 1. pipeline split
    if plan.pp > 1 and plan.schedule == "interleaved":
        ranges = interleaved_ranges(plan, n)[info.stage]
        indices = [c * plan.pp + info.stage for c in range(len(ranges))]
        num_stages = plan.pp * len(ranges)
    else:
        ranges, indices, num_stages = [(stage_plan.start, stage_plan.end)], [info.stage], plan.pp
    chunks = split_stages(model, graph, ranges)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh_device == "cuda" else torch.device("cpu")
    if not on_meta:
        chunks = [c.to(device) for c in chunks]

    # 2. identical replicas inside the stage (DP x TP ranks)
    if not on_meta and plan.dp * stage_plan.tp > 1:
        names = ("edp", "ep", "tp") if plan.ep > 1 else ("dp", "tp")
        stage_group = mesh[names]._flatten("stage").get_group()
        broadcast_module(chunks, stage_group, 0)

    for chunk, (start, end) in zip(chunks, ranges):
        blocks = stage_blocks(graph, start, end)
        # 3. expert parallel
        if plan.ep > 1:
            apply_expert_parallel(chunk, plan.ep, info.ep_rank, mesh["ep"].get_group())
        # 4. tensor (+ sequence) parallel
        if stage_plan.tp > 1:
            apply_tensor_parallel(chunk, graph, blocks, mesh["tp"], sequence_parallel=plan.sequence_parallel)
            apply_vocab_parallel(chunk, graph, start, end, mesh["tp"])
        # 5. activation checkpointing
        apply_checkpointing(chunk, blocks, stage_plan.recompute)
        # 6b. FSDP
        if plan.zero >= 1:
            apply_fsdp(chunk, blocks, submesh(mesh, "dp"), plan.zero, edp_mesh=mesh["edp"] if plan.ep > 1 else None,
                       dp_size=plan.dp, expert_modules=[e for m in find_moe_modules(chunk) for e in m.experts]
                       if plan.ep > 1 else ())

    # 6a. replicated data parallel
    grad_sync = None
    if plan.zero == 0 and plan.dp > 1:
        params = [p for c in chunks for p in c.parameters()]
        experts = [p for c in chunks for p in expert_parameters(c)] if plan.ep > 1 else []
        grad_sync = GradientSync(params, submesh(mesh, "dp").get_group(), plan.dp,
                                 edp_group=mesh["edp"].get_group() if plan.ep > 1 else None, expert_params=experts)

    # 7. pipeline schedule
    schedule, stages = None, []
    if plan.pp > 1:
        stages, schedule = make_schedule(plan, chunks, indices, num_stages, nmb, loss_fn,
                                         mesh["pp"].get_group(), device)
    return ParallelModule(plan=plan, chunks=chunks, mesh=mesh, rank_info=info, loss_fn=loss_fn,
                          num_microbatches=nmb, global_batch_size=global_batch_size, schedule=schedule,
                          pipeline_stages=stages, grad_sync=grad_sync, fsdp=plan.zero >= 1, graph=graph,
                          device=device)
