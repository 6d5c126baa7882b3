"""``auto_parallelize``: trace, plan, check, build the mesh, then apply PP, EP, TP, CP, AC and DP.

Order of the rewrites on each rank (each one a module of ``nest_fx.apply``):

1. ``pipeline.split_stages``   keep this rank's layer range(s) of the workload chain
2. ``data_parallel.broadcast_module`` make the stage identical on its DP x CP x TP ranks (one
                               rank's weights win, so ranks need not share a seed); tied embeddings: the
                               first stage's values to the last (``tied_weights``)
   ``batchnorm.sync_batchnorm`` BatchNorm statistics over the data-parallel group's batch
3. ``expert_parallel``         keep E/ep experts, exchange tokens with all_to_all
   ``float8``                  torchao Float8 linears in the blocks (plan.float8), before TP
                               shards them
4. ``tensor_parallel``         Colwise/Rowwise on the traced TP pairs (+ sequence parallel);
                               ``loss_parallel`` keeps the LM head's logits sharded
5. ``context_parallel``        K/V all-gathered in attention, positions of the rank's tokens
6. ``precision``               plan.precision: bf16 casts with fp32 masters, or bf16 parameters
7. ``activation_checkpoint``   per-stage recompute
8. ``compile``                 torch.compile per block (plan.compile); ``async_tp``: inductor's
                               micro-pipelined TP over symmetric memory (plan.async_tp, CUDA)
9. ``data_parallel``           gradient all-reduce (zero=0) or FSDP2 / HSDP (zero>=1; FSDP2's
                               MixedPrecisionPolicy under bf16-mixed)
   ``materialize``             a model started on ``meta`` (or ``weights=``): each rank's shards
                               allocated on its device and filled from the file or the model's init
10. ``pipeline.make_schedule`` PipelineStage(s) and the 1F1B / GPipe / interleaved schedule
                               (gradients of tied embeddings summed over the two stages each step)

All plan/model/batch/world checks (``checks.run_all``) run before the first collective. Then the
ranks agree (one small all-gather on the default group, ``agreement.agree``) on the plan, the
model's fingerprint, the batch, the microbatches and the timeout, so ranks started with
different settings fail with a message naming the field before the mesh is built. Every group
the runtime creates gets the job's timeout, and a collective that fails during the setup names
its group (``collective_errors``). ``elastic=True``: a plan made for another world size is
replaced by the planner's plan for the ranks that joined (``docs/runtime.md``, "Elastic").
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Callable, List, Optional, Tuple, Union

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from nest_fx.apply import checks
from nest_fx.apply.activation_checkpoint import apply_checkpointing
from nest_fx.apply.agreement import agree
from nest_fx.apply.checkpoint import load_checkpoint
from nest_fx.apply.batchnorm import sync_batchnorm as sync_batchnorm_modules
from nest_fx.apply.collective_errors import named_collective_failures
from nest_fx.apply.async_tp import enable_async_tp
from nest_fx.apply.compile import compile_blocks
from nest_fx.apply.context_parallel import ContextParallel, apply_context_parallel
from nest_fx.apply.data_parallel import GradientSync, apply_fsdp, broadcast_module, shards_anything
from nest_fx.apply.distributed import apply_job_timeout, init_distributed, job_timeout
from nest_fx.apply.expert_parallel import apply_expert_parallel
from nest_fx.apply.fingerprint import fingerprint, tensor_specs
from nest_fx.apply.float8 import apply_float8
from nest_fx.apply.loss_parallel import VocabParallelLMLoss, shard_lm_head
from nest_fx.apply.losses import token_cross_entropy_problem
from nest_fx.apply.materialize import materialize, prepare_weights
from nest_fx.apply.mesh import build_mesh, data_parallel_mesh, locate, submesh
from nest_fx.graph.moe_modules import expert_modules, expert_parameters
from nest_fx.graph.tp_regions import unsharded_attention
from nest_fx.apply.pipeline import (interleaved_ranges, make_schedule, split_stages, stage_blocks,
                                    stage_layer_groups)
from nest_fx.apply.precision import apply_precision, fp32_modules, fsdp_policy, prepare_parameters
from nest_fx.apply.tied_weights import CrossStageTies
from nest_fx.apply.runtime import ParallelModule
from nest_fx.apply.tensor_parallel import apply_tensor_parallel, apply_vocab_parallel, share_rng_state
from nest_fx.graph import trace
from nest_fx.graph.training_mode import training_config
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.plan import Plan, uniform_plan
from nest_fx.plan.summary import plan_summary
from nest_fx.plan.support import batchnorm_modules, model_dims, parallel_support
from nest_fx.solver.runtime_planner import planner_for

Planner = Callable[[Any, Any, int, int], Plan]


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


def _shapes(args: tuple, kwargs: dict) -> list:
    tensors = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors]


def agreed_settings(plan: Plan, specs, global_batch_size: int, nmb: int, args: tuple, kwargs: dict,
                    loss_fn: Callable) -> dict:
    """The settings every rank must share, as the fields of the setup's agreement."""
    plan_text = json.dumps(plan.to_dict(), sort_keys=True, default=str)
    return {"global_batch_size": global_batch_size, "num_microbatches": nmb, "model fingerprint": fingerprint(specs),
            "example input shapes": _shapes(args, kwargs),
            "loss_fn": getattr(loss_fn, "__qualname__", type(loss_fn).__name__),
            "collective timeout": str(job_timeout()), "torch": torch.__version__,
            "plan": f"{plan_summary(plan, nmb).splitlines()[0]} [{hashlib.sha256(plan_text.encode()).hexdigest()[:12]}]"}


def _device_type_of(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _chunk_ranges(plan: Plan, num_blocks: int) -> List[List[Tuple[int, int]]]:
    """Per pipeline rank, the block ranges of its stage chunks (several under the interleaved schedule)."""
    if plan.pp > 1 and plan.schedule == "interleaved":
        return interleaved_ranges(plan, num_blocks)
    return [[(s.start, s.end)] for s in plan.stages]


def _in_order(syncs: List[Callable[[], None]]) -> Optional[Callable[[], None]]:
    """One callable running the gradient synchronisations ``syncs`` in order (None when there are none)."""
    if not syncs:
        return None
    if len(syncs) == 1:
        return syncs[0]

    def run() -> None:
        for sync in syncs:
            sync()
    return run


def auto_parallelize(model: nn.Module, example_inputs, *, cluster=None, global_batch_size: int,
                     loss_fn: Optional[Callable] = None, plan: Optional[Plan] = None,
                     planner: Optional[Planner] = None, graph=None, verbose: bool = True,
                     timeout_s: Optional[float] = None, constraints: Union[Constraints, dict, None] = None,
                     elastic: bool = False, sync_batchnorm: bool = True, weights: Optional[str] = None,
                     init_seed: int = 0) -> ParallelModule:
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
    ``$NEST_FX_TIMEOUT_S`` or 600 s). ``constraints``: what the default planner's plan must
    satisfy (a :class:`~nest_fx.plan.constraints.Constraints` or its dict form, e.g.
    ``{"fix": {"tp": 2}, "optimizer": "sgd"}``; docs/solver.md#constraints); only with the
    default planner. Every check runs before the first collective, so a plan
    that does not fit fails on every rank with the same :class:`ApplyError`. Then the ranks
    compare their settings (:func:`agreed_settings`): a difference is an
    :class:`~nest_fx.apply.agreement.AgreementError` naming the field and the ranks.
    ``elastic``: when ``plan`` was made for another number of devices than the ranks that joined
    (a node was lost or came back under ``torchrun --nnodes=MIN:MAX``), re-plan for this world
    with the same global batch (more or fewer microbatches) instead of refusing; then
    ``pm.resume(checkpoint_dir, optimizer, ...)`` continues from the latest checkpoint.
    ``weights``: a HF safetensors file or directory (sharded, with its index), a torch
    state-dict file or a nest-fx checkpoint whose values the model starts from; each rank reads
    only the slices it owns. A model built on ``meta`` (``build_model(..., device="meta")``,
    ``with torch.device("meta")``) is materialised on each rank's device only as far as the
    rank owns it, from ``weights`` or, without them, from the model's own initialisation seeded
    by ``init_seed`` (``nest_fx.apply.materialize``; docs/runtime.md, "Start on meta, load
    pretrained weights"). A file that does not fit the model is an :class:`ApplyError` listing
    the missing, unexpected and wrongly shaped tensors, on every rank before the first collective.
    """
    if constraints is not None and (plan is not None or planner is not None):
        raise checks.ApplyError("constraints= shape the default planner's search; with plan= or planner= they "
                                "would be ignored: pass constraints alone, or put them in your planner")
    if isinstance(constraints, dict):
        constraints = Constraints.from_dict(constraints)
    world, rank = init_distributed(timeout_s, plan.device_order if plan is not None else None)
    args, kwargs = _split_example(example_inputs)
    training_config(model)  # HF models as loaded (use_cache=True): no key/value cache while training
    specs = tensor_specs(model)  # the whole model, before it is cut into stages and shards
    if graph is None:
        graph = trace(model, args, kwargs, name=type(model).__name__)
    if elastic and plan is not None and plan.devices_used != world:
        if rank == 0 and verbose:
            print(f"elastic: the plan uses {plan.devices_used} devices, {world} ranks joined: re-planning for {world} "
                  f"with global batch {global_batch_size}", flush=True)
        plan = None
    if plan is None:
        if planner is None:
            vocab = model_dims(model)["vocab"] or 8
            planner = planner_for(model, constraints=constraints, one_microbatch=sync_batchnorm,
                                  loss_parallel=loss_fn is None or not token_cross_entropy_problem(loss_fn, vocab))
        plan = planner(graph, cluster, world, global_batch_size)
        init_distributed(timeout_s, plan.device_order)  # a placed plan needs the group numbered for it
    nmb = checks.run_all(plan, model, graph, world, global_batch_size, model_loss=loss_fn is None,
                         batch_statistics=sync_batchnorm)
    layout = parallel_support(model, graph).stage_layout() if plan.pp > 1 else None
    device_type = _device_type_of(model)
    on_meta = device_type == "meta"
    loaded = prepare_weights(weights, model) if weights is not None else None
    skeleton = copy.deepcopy(model) if on_meta else None  # the whole model's modules, on meta, to initialise from
    settings = agreed_settings(plan, specs, global_batch_size, nmb, args, kwargs, loss_fn)
    settings.update({"weights": str(weights), "start on meta": on_meta, "init_seed": init_seed})
    with named_collective_failures("auto_parallelize, comparing the ranks' settings"):
        agree(settings, what="auto_parallelize, before building the device mesh")
    norms = batchnorm_modules(model)
    if norms and not sync_batchnorm and (plan.dp > 1 or nmb > 1) and rank == 0:
        warnings.warn(f"sync_batchnorm=False: BatchNorm layers {norms[:4]}{' ...' if len(norms) > 4 else ''} normalise "
                      f"each microbatch of {plan.microbatch_size} samples on its own replica, not the global batch of "
                      f"{global_batch_size} (the numbers differ from the single-device run)", stacklevel=2)
    mesh_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    checks.check_runtime_options(plan, model, graph, loss_fn, mesh_device)
    if rank == 0 and verbose:
        print(plan_summary(plan, nmb), flush=True)
    replicated = unsharded_attention(graph) if any(s.tp > 1 for s in plan.stages) else []
    if replicated and rank == 0:
        warnings.warn(f"tensor parallelism shards the linear pairs of each layer, but the attention of {replicated[:3]}"
                      f"{' ...' if len(replicated) > 3 else ''} is no pair nest-fx can shard (e.g. nn.MultiheadAttention): "
                      "it runs whole on every TP rank, as the cost model priced it", stacklevel=2)

    mesh = build_mesh(plan, mesh_device)
    info = locate(plan, rank)
    stage_plan = plan.stages[info.stage]
    n = len(graph.blocks)

    # 1. pipeline split
    ranges = _chunk_ranges(plan, n)[info.stage]
    if layout is not None:
        indices = [c * plan.pp + info.stage for c in range(len(ranges))]
        num_stages = plan.pp * len(ranges)
        chunks = split_stages(model, graph, ranges, layout)
    else:
        indices, num_stages, chunks = [0], 1, [model]
    device = torch.device("cuda", torch.cuda.current_device()) if mesh_device == "cuda" else torch.device("cpu")
    if not on_meta:
        chunks = [c.to(device) for c in chunks]
    prepare_parameters(chunks, plan.precision)  # bf16-true: bf16 parameters; bf16-mixed: fp32 masters

    # 2. identical replicas inside the stage (DP x CP x TP ranks); tied embeddings equal on both stages
    if not on_meta and plan.dp * plan.cp * stage_plan.tp > 1:
        names = tuple(name for name in mesh.mesh_dim_names if name != "pp")
        stage_group = mesh[names]._flatten("stage").get_group()
        apply_job_timeout()
        broadcast_module(chunks, stage_group, 0)
    ties = None
    if layout is not None:
        ties = CrossStageTies(chunks, 0 in indices, num_stages - 1 in indices, layout.shared, mesh["pp"].get_group())
        if not on_meta:  # a meta start gives both copies the same values (materialize)
            ties.sync_values()
    dry_run = dist.get_backend() == "fake"  # a fake process group: no devices, no values (tests/test_apply_fake.py)
    if stage_plan.tp > 1 and not dry_run:
        share_rng_state(mesh["tp"])  # TP ranks must draw the same dropout masks on replicated activations
    if plan.async_tp:
        enable_async_tp(mesh["tp"])  # before the first compiled forward (checks: CUDA, inductor)
    if norms and sync_batchnorm and plan.dp > 1:
        for chunk in chunks:
            sync_batchnorm_modules(chunk, submesh(mesh, "dp").get_group())

    cp = ContextParallel(mesh["cp"].get_group(), plan.cp, info.cp_rank, plan.cp_mode) if plan.cp > 1 else None
    replicas = plan.dp * plan.cp  # ranks holding the same parameters: gradients are averaged over them
    blocks_before = 0  # blocks of this stage in earlier chunks (every:<k> counts through the stage)
    for chunk, index, (start, end) in zip(chunks, indices, ranges):
        blocks = stage_blocks(graph, start, end)
        # 3. expert parallel
        if plan.ep > 1:
            apply_expert_parallel(chunk, plan.ep, info.ep_rank, mesh["ep"])
        # 3b. Float8 linears, before TP shards them (their modules are replaced: TP's hooks would be lost)
        if plan.float8:
            apply_float8(chunk, blocks)
        # 4. tensor (+ sequence) parallel; loss parallel keeps the LM head's logits sharded
        if stage_plan.tp > 1:
            apply_tensor_parallel(chunk, graph, blocks, mesh["tp"], sequence_parallel=plan.sequence_parallel)
            vocab_end = min(end, n - 1) if plan.loss_parallel else end
            apply_vocab_parallel(chunk, graph, start, vocab_end, mesh["tp"])
            if vocab_end < end:
                heads = shard_lm_head(chunk, graph, vocab_end, end, mesh["tp"])
                vocab = chunk.get_submodule(heads[0]).weight.shape[0]  # the DTensor's global shape
                loss_fn = VocabParallelLMLoss(mesh["tp"].get_group(), stage_plan.tp, info.tp_rank, vocab)
        # 5. context parallel
        if cp is not None:
            apply_context_parallel(chunk, graph, cp)
        # 6b. precision casts (docs/runtime.md, "Precision"), inside what checkpointing recomputes
        apply_precision(chunk, blocks, plan.precision, fsdp=plan.zero >= 1, last_stage=index == num_stages - 1)
        # 7. activation checkpointing
        layers = stage_layer_groups(graph, start, end)
        apply_checkpointing(chunk, layers, stage_plan.recompute, blocks_before)
        blocks_before += len(layers)
        # 8. torch.compile
        if plan.compile:
            compile_blocks(chunk, blocks)
        # 9b. FSDP / HSDP
        if shards_anything(plan.zero, replicas):
            apply_fsdp(chunk, blocks, data_parallel_mesh(mesh, plan), plan.zero,
                       edp_mesh=data_parallel_mesh(mesh, plan, experts=True) if plan.ep > 1 else None,
                       dp_size=replicas, expert_modules=expert_modules(chunk) if plan.ep > 1 else (),
                       mp_policy=fsdp_policy(plan.precision), fp32_modules=fp32_modules(chunk, plan.precision))

    # 9. values of a model started on meta, or read from weights=: this rank's shards only (before
    # the gradient sync holds on to the parameters: to_empty may replace them)
    counts = None
    if (on_meta or loaded is not None) and not dry_run:
        failure = None
        try:
            counts = materialize(chunks, skeleton, device, loaded, init_seed)
        except Exception as exc:  # noqa: BLE001 - every rank raises it (or names the rank that did), none hangs
            failure = exc
        del skeleton
        with named_collective_failures("auto_parallelize, after materialising the model"):
            agree({}, what="materialising the model", error=failure, error_cls=checks.ApplyError)
        if rank == 0 and verbose:
            print(f"materialised on {device}: {counts['read']} tensors read from {weights} "
                  f"({counts['bytes_read'] / 2**20:.1f} MiB on rank 0), {counts['initialised']} initialised "
                  "by the model", flush=True)

    # 9a. replicated data parallel (after the tied-embedding gradient sum over the two stages)
    syncs = [ties] if ties else []
    if plan.zero == 0 and replicas > 1:
        params = [p for c in chunks for p in c.parameters()]
        experts = [p for c in chunks for p in expert_parameters(c)] if plan.ep > 1 else []
        syncs.append(GradientSync(params, data_parallel_mesh(mesh, plan).get_group(), replicas,
                                  edp_group=data_parallel_mesh(mesh, plan, experts=True).get_group()
                                  if plan.ep > 1 else None, expert_params=experts))
    grad_sync = _in_order(syncs)

    # 10. pipeline schedule
    schedule, stages = None, []
    if plan.pp > 1:
        stages, schedule = make_schedule(plan, chunks, indices, num_stages, nmb, loss_fn,
                                         mesh["pp"].get_group(), device)
    apply_job_timeout()  # any group created on the way (FSDP, pipelining) gets the job's timeout too
    pm = ParallelModule(plan=plan, chunks=chunks, mesh=mesh, rank_info=info, loss_fn=loss_fn,
                        num_microbatches=nmb, global_batch_size=global_batch_size, schedule=schedule,
                        pipeline_stages=stages, grad_sync=grad_sync, fsdp=shards_anything(plan.zero, replicas), graph=graph,
                        device=device, context_parallel=cp, model_specs=specs)
    pm.materialized = counts  # tensors read / initialised, bytes this rank read (None: started with values)
    if loaded is not None and loaded.checkpoint:
        load_checkpoint(pm, loaded.path)  # DCP reads each rank's own chunks of the checkpoint
    return pm
