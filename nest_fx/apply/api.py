"""``auto_parallelize``: trace, plan, check, build the mesh, then apply PP, EP, TP, AC and DP.

Order of the rewrites on each rank (each one a module of ``nest_fx.apply``):

1. ``pipeline.split_stages``   keep this rank's layer range(s) of the workload chain
2. ``data_parallel.broadcast_module`` make the stage identical on its DP x TP ranks (one rank's
                               weights win, so ranks need not share a seed)
   ``batchnorm.sync_batchnorm`` BatchNorm statistics over the data-parallel group's batch
3. ``expert_parallel``         keep E/ep experts, exchange tokens with all_to_all
4. ``tensor_parallel``         Colwise/Rowwise on the traced TP pairs (+ sequence parallel)
5. ``activation_checkpoint``   per-stage recompute
6. ``data_parallel``           gradient all-reduce (zero=0) or FSDP2 (zero>=1)
7. ``pipeline.make_schedule``  PipelineStage(s) and the 1F1B / GPipe / interleaved schedule

All plan/model/batch/world checks (``checks.run_all``) run before the first collective.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from nest_fx.apply import checks
from nest_fx.apply.activation_checkpoint import apply_checkpointing
from nest_fx.apply.batchnorm import sync_batchnorm as sync_batchnorm_modules
from nest_fx.apply.data_parallel import GradientSync, apply_fsdp, broadcast_module
from nest_fx.apply.distributed import init_distributed
from nest_fx.apply.expert_parallel import apply_expert_parallel
from nest_fx.apply.mesh import build_mesh, locate, submesh
from nest_fx.graph.moe_modules import expert_modules, expert_parameters
from nest_fx.apply.pipeline import interleaved_ranges, make_schedule, split_stages, stage_blocks
from nest_fx.apply.runtime import ParallelModule
from nest_fx.apply.tensor_parallel import apply_tensor_parallel, apply_vocab_parallel
from nest_fx.graph import trace
from nest_fx.plan.plan import Plan, uniform_plan
from nest_fx.plan.summary import plan_summary
from nest_fx.plan.support import batchnorm_modules
from nest_fx.solver.runtime_planner import planner_for

Planner = Callable[[Any, Any, int, int], Plan]


DEFAULT_TIMEOUT_S = 600.0
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


def auto_parallelize(model: nn.Module, example_inputs, *, cluster=None, global_batch_size: int,
                     loss_fn: Optional[Callable] = None, plan: Optional[Plan] = None,
                     planner: Optional[Planner] = None, graph=None, verbose: bool = True,
                     timeout_s: Optional[float] = None, sync_batchnorm: bool = True) -> ParallelModule:
    """Parallelise ``model`` for training under torchrun and return a :class:`ParallelModule`.

    ``example_inputs``: a tensor, a tuple of tensors, or a dict of keyword tensors (HF
    ``{"input_ids": ...}``) with the per-step shapes (only shapes/dtypes are used).
    ``plan``: a :class:`~nest_fx.plan.Plan`; when None, ``planner(graph, cluster, world_size,
    global_batch_size)`` chooses one; the default planner is the NEST DP
    (``nest_fx.solver.runtime_planner.planner_for``) on ``cluster`` or, when None, a preset for
    the detected device and world size. ``loss_fn(output, target)`` must average over its batch;
    ``None`` trains on the model's own loss (HF ``output.loss`` from ``labels`` among the inputs).
    ``sync_batchnorm``: BatchNorm layers normalise over the batch of all data-parallel replicas
    (``nest_fx.apply.batchnorm``), which equals the single-device run with one microbatch per step
    (plans with more are refused); ``False`` keeps per-replica, per-microbatch statistics (DDP's
    behaviour), with a warning naming the layers.
    ``graph``: an OpGraph of the model when already traced. Every rank must call this with the
    same arguments. The model is modified in place (its stage is kept, the rest dropped).
    ``timeout_s``: collective timeout when this call creates the process group (default
    ``$NEST_FX_TIMEOUT_S`` or 600 s). Every check runs before the first collective, so a plan
    that does not fit fails on every rank with the same :class:`ApplyError`.
    """
    world, rank = init_distributed(timeout_s, plan.device_order if plan is not None else None)
    args, kwargs = _split_example(example_inputs)
    if graph is None:
        graph = trace(model, args, kwargs, name=type(model).__name__)
    if plan is None:
        if planner is None:
            planner = planner_for(model, one_microbatch=sync_batchnorm)
        plan = planner(graph, cluster, world, global_batch_size)
        init_distributed(timeout_s, plan.device_order)  # a placed plan needs the group numbered for it
    nmb = checks.run_all(plan, model, graph, world, global_batch_size, model_loss=loss_fn is None,
                         batch_statistics=sync_batchnorm)
    if rank == 0 and verbose:
        print(plan_summary(plan, nmb), flush=True)
    norms = batchnorm_modules(model)
    if norms and not sync_batchnorm and (plan.dp > 1 or nmb > 1) and rank == 0:
        warnings.warn(f"sync_batchnorm=False: BatchNorm layers {norms[:4]}{' ...' if len(norms) > 4 else ''} normalise "
                      f"each microbatch of {plan.microbatch_size} samples on its own replica, not the global batch of "
                      f"{global_batch_size} (the numbers differ from the single-device run)", stacklevel=2)

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
    # one stage keeps the model whole (its own output type: a HF ModelOutput keeps its .loss)
    chunks = split_stages(model, graph, ranges) if plan.pp > 1 else [model]
    device = torch.device("cuda", torch.cuda.current_device()) if mesh_device == "cuda" else torch.device("cpu")
    if not on_meta:
        chunks = [c.to(device) for c in chunks]

    # 2. identical replicas inside the stage (DP x TP ranks)
    if not on_meta and plan.dp * stage_plan.tp > 1:
        names = ("edp", "ep", "tp") if plan.ep > 1 else ("dp", "tp")
        stage_group = mesh[names]._flatten("stage").get_group()
        broadcast_module(chunks, stage_group, 0)
    if norms and sync_batchnorm and plan.dp > 1:
        for chunk in chunks:
            sync_batchnorm_modules(chunk, submesh(mesh, "dp").get_group())

    for chunk, (start, end) in zip(chunks, ranges):
        blocks = stage_blocks(graph, start, end)
        # 3. expert parallel
        if plan.ep > 1:
            apply_expert_parallel(chunk, plan.ep, info.ep_rank, mesh["ep"])
        # 4. tensor (+ sequence) parallel
        if stage_plan.tp > 1:
            apply_tensor_parallel(chunk, graph, blocks, mesh["tp"], sequence_parallel=plan.sequence_parallel)
            apply_vocab_parallel(chunk, graph, start, end, mesh["tp"])
        # 5. activation checkpointing
        apply_checkpointing(chunk, blocks, stage_plan.recompute)
        # 6b. FSDP
        if plan.zero >= 1:
            apply_fsdp(chunk, blocks, submesh(mesh, "dp"), plan.zero, edp_mesh=mesh["edp"] if plan.ep > 1 else None,
                       dp_size=plan.dp, expert_modules=expert_modules(chunk) if plan.ep > 1 else ())

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
