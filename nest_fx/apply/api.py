"""``auto_parallelize``: plan, check and agree, build the mesh, then rewrite this rank's part of the model.

The steps, in the order ``auto_parallelize`` runs them on each rank (``prepare`` and ``steps``
hold one function each; each calls a module of ``nest_fx.apply`` to do the work):

0. ``prepare.prepare``          process group, trace, plan (``plan=``, ``planner=`` or the NEST DP;
                                re-planned under ``elastic=True``), every check (``checks.run_all``),
                                the weights' start, the ranks' agreement, warnings, the plan summary
   ``steps.place``              the CUDA allocator's costed segments (apply/allocator.py), the device
                                mesh (the first groups), the rank's place and device
1. ``steps.split_stage``        keep this rank's layer range(s) of the workload chain (``pipeline``),
                                on its device, with the plan's parameter dtype (``precision``)
2. ``steps.replicate``          make the stage identical on its DP x CP x TP ranks (one rank's
                                weights win, so ranks need not share a seed; ``data_parallel``); tied
                                embeddings: the first stage's values to the last (``tied_weights``);
                                BatchNorm statistics over the data-parallel group's batch (``batchnorm``)
   ``steps.context_parallel_group`` the rank's CP group and share of every sequence
   then on each chunk of the stage (several under the interleaved schedule):
3. ``steps.expert_parallel``    keep E/ep experts, exchange tokens with all_to_all
   ``steps.float8_linears``     torchao Float8 linears in the blocks (plan.float8), before TP shards them
4. ``steps.tensor_parallel``    Colwise/Rowwise on the traced TP pairs (+ sequence parallel);
                                ``loss_parallel`` keeps the LM head's logits sharded
   ``steps.fused_norms``        the model's RMSNorms run as F.rms_norm (plan.norm_kernel; not the
                                norms TP shards)
5. ``steps.context_parallel``   K/V all-gathered (or passed around a ring: plan.cp_mode) in attention,
                                positions of the rank's tokens
6. ``steps.precision``          plan.precision: bf16 casts with fp32 masters, or bf16 parameters
7. ``steps.recompute``          per-stage activation checkpointing
8. ``steps.compile_chunk``      torch.compile per block (plan.compile); async TP (plan.async_tp, CUDA)
                                was switched on for the TP group in step 2
9. ``steps.shard_data_parallel`` FSDP2 / HSDP (zero>=1; FSDP2's MixedPrecisionPolicy under bf16-mixed)
   ``steps.compile_loss``       after the chunks: the loss on full logits torch.compile'd (plan.loss_kernel)
   then on the whole stage:
10. ``steps.materialize_weights`` a model started on ``meta`` (or ``weights=``): each rank's shards
                                allocated on its device and filled from the file or the model's init
11. ``steps.gradient_sync``     the tied embeddings' gradients summed over the two stages, then the
                                gradient all-reduce over the replicas (zero=0)
12. ``steps.pipeline_schedule`` PipelineStage(s) and the 1F1B / GPipe / interleaved schedule
    :class:`ParallelModule`     from the layout, the batch schedule and the local model
                                (``parts``); a nest-fx checkpoint given as ``weights=`` is loaded

All plan/model/batch/world checks (``checks.run_all``) run before the first collective. Then the
ranks agree (one small all-gather on the default group, ``agreement.agree``) on the plan, the
model's fingerprint, the batch, the microbatches and the timeout, so ranks started with
different settings fail with a message naming the field before the mesh is built. Every group
the runtime creates gets the job's timeout, and a collective that fails during the setup names
its group (``collective_errors``). ``elastic=True``: a plan made for another world size is
replaced by the planner's plan for the ranks that joined (``docs/runtime.md``, "Elastic").
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch.nn as nn

from nest_fx.apply.checkpoint import load_checkpoint
from nest_fx.apply.parts import LocalModel
from nest_fx.apply.prepare import Planner, Request, prepare
from nest_fx.apply.runtime import ParallelModule
from nest_fx.apply.steps import (
    compile_chunk,
    compile_loss,
    context_parallel,
    context_parallel_group,
    expert_parallel,
    float8_linears,
    fsdp_applied,
    fused_norms,
    gradient_sync,
    materialize_weights,
    pipeline_schedule,
    place,
    precision,
    recompute,
    replicate,
    shard_data_parallel,
    split_stage,
    tensor_parallel,
)
from nest_fx.plan.constraints import Constraints
from nest_fx.plan.plan import Plan


def auto_parallelize(
    model: nn.Module,
    example_inputs,
    *,
    cluster=None,
    global_batch_size: int,
    loss_fn: Optional[Callable] = None,
    plan: Optional[Plan] = None,
    planner: Optional[Planner] = None,
    graph=None,
    verbose: bool = True,
    timeout_s: Optional[float] = None,
    constraints: Union[Constraints, dict, None] = None,
    elastic: bool = False,
    sync_batchnorm: bool = True,
    weights: Optional[str] = None,
    init_seed: int = 0,
) -> ParallelModule:
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
    compare their settings (:func:`~nest_fx.apply.prepare.agreed_settings`): a difference is an
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
    job = prepare(
        Request(
            model,
            example_inputs,
            global_batch_size,
            cluster=cluster,
            loss_fn=loss_fn,
            plan=plan,
            planner=planner,
            graph=graph,
            verbose=verbose,
            timeout_s=timeout_s,
            constraints=constraints,
            elastic=elastic,
            sync_batchnorm=sync_batchnorm,
            weights=weights,
            init_seed=init_seed,
        )
    )  # 0. plan, checks, agreement
    layout = place(job)  # the device mesh: the first collective groups
    stage = split_stage(job, layout)  # 1.
    ties = replicate(stage, job, layout)  # 2.
    cp = context_parallel_group(job, layout)
    loss_fn = job.loss_fn
    for chunk in stage.chunks:
        expert_parallel(chunk, job, layout)  # 3.
        float8_linears(chunk, job)  # 3b.
        loss_fn = tensor_parallel(chunk, job, layout, loss_fn)  # 4. (loss parallel: the vocabulary-parallel loss)
        fused_norms(chunk, job)  # 4b.
        context_parallel(chunk, job, cp)  # 5.
        precision(chunk, job)  # 6.
        recompute(chunk, job, layout)  # 7.
        compile_chunk(chunk, job)  # 8.
        shard_data_parallel(chunk, job, layout)  # 9.
    loss_fn = compile_loss(loss_fn, job)  # 8c. (after every chunk: the loss runs once, on the last stage)
    materialized = materialize_weights(stage, job, layout)  # 10.
    grad_sync = gradient_sync(stage, ties, job, layout)  # 11.
    batching = pipeline_schedule(stage, job, layout, loss_fn, cp)  # 12.
    pm = ParallelModule(
        layout,
        batching,
        LocalModel(
            chunks=tuple(stage.modules),
            graph=job.graph,
            model_specs=job.model_specs,
            grad_sync=grad_sync,
            fsdp=fsdp_applied(job),
            materialized=materialized,
        ),
    )
    if job.weights.loaded is not None and job.weights.loaded.checkpoint:
        load_checkpoint(pm, job.weights.loaded.path)  # DCP reads each rank's own chunks of the checkpoint
    return pm
