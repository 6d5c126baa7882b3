"""The rewrites ``auto_parallelize`` applies on each rank, one function per step, in the order
``nest_fx/apply/api.py`` calls them (its module docstring lists them).

Each step reads the agreed :class:`~nest_fx.apply.prepare.Job` and the rank's
:class:`~nest_fx.apply.parts.ParallelLayout`; the per-chunk steps (3-9) take one
:class:`Chunk` of the rank's stage and change its module in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch.nn as nn

from nest_fx.apply import checks
from nest_fx.apply.activation_checkpoint import apply_checkpointing
from nest_fx.apply.agreement import agree
from nest_fx.apply.allocator import use_costed_segments
from nest_fx.apply.batchnorm import sync_batchnorm
from nest_fx.apply.collective_errors import named_collective_failures
from nest_fx.apply.compile import compile_blocks, compiled_loss
from nest_fx.apply.context_parallel import ContextParallel, apply_context_parallel
from nest_fx.apply.data_parallel import GradientSync, apply_fsdp, broadcast_module, shards_anything
from nest_fx.apply.distributed import apply_job_timeout, rank_device
from nest_fx.apply.expert_parallel import apply_expert_parallel
from nest_fx.apply.async_tp import enable_async_tp
from nest_fx.apply.float8 import apply_float8
from nest_fx.apply.fused_norms import swaps_norms, use_fused_norms
from nest_fx.apply.loss_parallel import VocabParallelLMLoss, shard_lm_head
from nest_fx.apply.materialize import materialize
from nest_fx.apply.mesh import build_mesh, data_parallel_mesh, locate, submesh
from nest_fx.apply.parts import BatchSchedule, ParallelLayout
from nest_fx.apply.pipeline import chunk_layout, make_schedule, split_stages, stage_layer_groups
from nest_fx.apply.precision import apply_precision, fp32_modules, fsdp_policy, prepare_parameters
from nest_fx.apply.prepare import Job
from nest_fx.apply.tensor_parallel import (
    apply_tensor_parallel,
    apply_vocab_parallel,
    gather_received,
    share_rng_state,
    sharded_cut,
)
from nest_fx.apply.tied_weights import CrossStageTies
from nest_fx.graph.moe_modules import expert_modules, expert_parameters
from nest_fx.graph.stage_modules import stage_route
from nest_fx.plan.plan import Plan


@dataclass(frozen=True)
class Chunk:
    """One of this rank's stage modules (several under the interleaved schedule) and its place in
    the chain: blocks ``[start, end)`` of the chain, pipeline stage ``index``, ``layers`` (the
    module paths of each layer in the range), ``layers_before`` (layers of the rank's stage in
    earlier chunks: recompute's ``every:<k>`` counts through the stage) and ``last`` (the
    pipeline's last stage, whose output the loss reads)."""

    module: nn.Module
    index: int
    start: int
    end: int
    layers: Tuple[Tuple[str, ...], ...]
    layers_before: int
    last: bool

    @property
    def blocks(self) -> List[str]:
        """Module paths of the chunk's layers (``pipeline.stage_blocks``)."""
        return [m for group in self.layers for m in group]


@dataclass(frozen=True)
class LocalStage:
    """This rank's chunks and the number of pipeline stages they belong to (1 without a pipeline)."""

    chunks: Tuple[Chunk, ...]
    num_stages: int

    @property
    def modules(self) -> List[nn.Module]:
        return [c.module for c in self.chunks]

    @property
    def indices(self) -> List[int]:
        return [c.index for c in self.chunks]


def _replicas(plan: Plan) -> int:
    """Ranks holding the same parameters: gradients are averaged over them."""
    return plan.dp * plan.cp


def place(job: Job) -> ParallelLayout:
    """The CUDA allocator's costed segment mode (``apply/allocator.py``), then the device mesh of
    the plan (the first groups created), this rank's place in it and its device."""
    use_costed_segments(job.plan, job.mesh_device)
    mesh = build_mesh(job.plan, job.mesh_device)
    return ParallelLayout(
        plan=job.plan, mesh=mesh, rank_info=locate(job.plan, job.rank), device=rank_device(job.mesh_device)
    )


def split_stage(job: Job, layout: ParallelLayout) -> LocalStage:
    """1. This rank's layer range(s) of the chain, on its device, with the plan's parameter dtype
    (bf16-true: bf16 parameters; bf16-mixed: fp32 masters)."""
    plan, graph, stage = job.plan, job.graph, layout.rank_info.stage
    ranges, indices = chunk_layout(plan, len(graph.blocks))[stage]
    if job.stage_layout is not None:
        num_stages = plan.pp * len(ranges)
        modules = split_stages(job.model, graph, ranges, job.stage_layout)
    else:
        indices, num_stages, modules = [0], 1, [job.model]
    if not job.weights.on_meta:
        modules = [m.to(layout.device) for m in modules]
    prepare_parameters(modules, plan.precision)
    chunks, layers_before = [], 0
    for module, index, (start, end) in zip(modules, indices, ranges):
        layers = tuple(tuple(group) for group in stage_layer_groups(graph, start, end))
        chunks.append(Chunk(module, index, start, end, layers, layers_before, last=index == num_stages - 1))
        layers_before += len(layers)
    return LocalStage(tuple(chunks), num_stages)


def replicate(stage: LocalStage, job: Job, layout: ParallelLayout) -> Optional[CrossStageTies]:
    """2. The stage identical on its DP x CP x TP ranks (one rank's weights win, so ranks need not
    share a seed); tied embeddings: the first stage's values to the last (returns the ties, whose
    gradients are summed every step); the TP group's shared random state; BatchNorm statistics
    over the data-parallel group's batch."""
    plan, mesh = job.plan, layout.mesh
    stage_tp = plan.stages[layout.rank_info.stage].tp
    if not job.weights.on_meta and plan.dp * plan.cp * stage_tp > 1:
        names = tuple(name for name in mesh.mesh_dim_names if name != "pp")
        stage_group = mesh[names]._flatten("stage").get_group()
        apply_job_timeout()
        broadcast_module(stage.modules, stage_group, 0)
    ties = None
    if job.stage_layout is not None:
        ties = CrossStageTies(
            stage.modules,
            0 in stage.indices,
            stage.num_stages - 1 in stage.indices,
            job.stage_layout.shared,
            mesh["pp"].get_group(),
        )
        if not job.weights.on_meta:  # a meta start gives both copies the same values (materialize)
            ties.sync_values()
    if stage_tp > 1 and not job.dry_run:
        share_rng_state(mesh["tp"])  # TP ranks must draw the same dropout masks on replicated activations
    if plan.async_tp:
        enable_async_tp(mesh["tp"])  # before the first compiled forward (checks: CUDA, inductor)
    if job.batchnorms and job.sync_batchnorm and plan.dp > 1:
        for module in stage.modules:
            sync_batchnorm(module, submesh(mesh, "dp").get_group())
    return ties


def context_parallel_group(job: Job, layout: ParallelLayout) -> Optional[ContextParallel]:
    """The rank's CP group and its share of every sequence (None when cp == 1)."""
    plan = job.plan
    return (
        ContextParallel(layout.mesh["cp"].get_group(), plan.cp, layout.rank_info.cp_rank, plan.cp_mode)
        if plan.cp > 1
        else None
    )


def expert_parallel(chunk: Chunk, job: Job, layout: ParallelLayout) -> None:
    """3. E/ep experts per rank, tokens exchanged with all_to_all."""
    if job.plan.ep > 1:
        apply_expert_parallel(chunk.module, job.plan.ep, layout.rank_info.ep_rank, layout.mesh["ep"])


def float8_linears(chunk: Chunk, job: Job) -> None:
    """3b. torchao Float8 linears in the blocks (``plan.float8``), before TP shards them: the
    modules are replaced, so TP's hooks on the old ones would be lost."""
    if job.plan.float8:
        apply_float8(chunk.module, chunk.blocks)


def tensor_parallel(chunk: Chunk, job: Job, layout: ParallelLayout, loss_fn: Optional[Callable]) -> Optional[Callable]:
    """4. Colwise/Rowwise on the traced TP pairs (+ sequence parallel) and vocabulary-parallel
    embeddings; under loss parallel the LM head's logits stay sharded and the returned loss is
    the vocabulary-parallel cross-entropy (else ``loss_fn`` unchanged)."""
    plan, graph, mesh = job.plan, job.graph, layout.mesh
    stage_plan = plan.stages[layout.rank_info.stage]
    if stage_plan.tp == 1:
        return loss_fn
    start, end = chunk.start, chunk.end
    shard_in, shard_out = sequence_shards_cross(chunk, job)
    apply_tensor_parallel(
        chunk.module,
        graph,
        chunk.blocks,
        mesh["tp"],
        sequence_parallel=plan.sequence_parallel,
        shard_in=shard_in,
        shard_out=shard_out,
    )
    if shard_in:
        stage_route(chunk.module).seq_shards = stage_plan.tp
        if start not in job.stage_layout.layers:  # the stage holds only the tail: it reads full sequences
            gather_received(chunk.module, job.stage_layout.exit_module(max(job.stage_layout.layers)), mesh["tp"])
    vocab_end = min(end, len(graph.blocks) - 1) if plan.loss_parallel else end
    apply_vocab_parallel(chunk.module, graph, start, vocab_end, mesh["tp"])
    if vocab_end < end:
        heads = shard_lm_head(chunk.module, graph, vocab_end, end, mesh["tp"])
        vocab = chunk.module.get_submodule(heads[0]).weight.shape[0]  # the DTensor's global shape
        in_place = plan.loss_kernel != "eager"  # eager: the op-by-op backward (docs/cost_model.md, Loss parallel)
        return VocabParallelLMLoss(mesh["tp"].get_group(), stage_plan.tp, layout.rank_info.tp_rank, vocab, in_place)
    return loss_fn


def sequence_shards_cross(chunk: Chunk, job: Job) -> Tuple[bool, bool]:
    """(whether the chunk receives, whether it sends) the TP ranks' sequence shards at its
    pipeline cuts under sequence parallelism (``tensor_parallel.sharded_cut``); (False, False)
    without a pipeline or sequence parallelism."""
    if job.stage_layout is None or not job.plan.sequence_parallel:
        return False, False
    route = stage_route(chunk.module)
    shard_in = not route.first and sharded_cut(job.graph, route.start, route.side_in)
    shard_out = not route.last and sharded_cut(job.graph, route.end, route.side_out)
    return shard_in, shard_out


def fused_norms(chunk: Chunk, job: Job) -> None:
    """4b. The model's RMSNorms as PyTorch's fused ``F.rms_norm`` (``plan.norm_kernel`` '' or
    fused; ``fused_norms``) or as the output-saving norm (``memory-efficient``), after tensor
    parallelism: the norms it shards (DTensor weights) keep the model's code."""
    if swaps_norms(job.plan.norm_kernel):
        # memory-efficient: prepare checked the weights the norms start from (apply/norm_weights.py)
        # on every rank; the values here may be the model's before weights= replaces them
        use_fused_norms(chunk.module, job.plan.norm_kernel, check_weights=False)


def context_parallel(chunk: Chunk, job: Job, cp: Optional[ContextParallel]) -> None:
    """5. K/V all-gathered in attention, the positions of the rank's tokens."""
    if cp is not None:
        apply_context_parallel(chunk.module, job.graph, cp)


def precision(chunk: Chunk, job: Job) -> None:
    """6. The casts of ``plan.precision`` (docs/runtime.md, "Precision"), inside what
    checkpointing recomputes."""
    plan, blocks = job.plan, chunk.blocks
    apply_precision(chunk.module, blocks, plan.precision, fsdp=plan.zero >= 1, last_stage=chunk.last)


def recompute(chunk: Chunk, job: Job, layout: ParallelLayout) -> None:
    """7. Activation checkpointing as the stage's plan names it."""
    policy = job.plan.stages[layout.rank_info.stage].recompute
    apply_checkpointing(chunk.module, [list(group) for group in chunk.layers], policy, chunk.layers_before)


def compile_chunk(chunk: Chunk, job: Job) -> None:
    """8. ``torch.compile`` per block (``plan.compile``)."""
    if job.plan.compile:
        compile_blocks(chunk.module, chunk.blocks)


def compile_loss(loss_fn: Optional[Callable], job: Job) -> Optional[Callable]:
    """8c. The loss on full logits ``torch.compile``'d (``plan.loss_kernel=compile``); the
    vocabulary-parallel loss of loss parallelism runs as it is, as the cost model prices it."""
    if job.plan.loss_kernel != "compile" or loss_fn is None or isinstance(loss_fn, VocabParallelLMLoss):
        return loss_fn
    return compiled_loss(loss_fn)


def shard_data_parallel(chunk: Chunk, job: Job, layout: ParallelLayout) -> None:
    """9. FSDP2 / HSDP over the replicas when the plan shards anything (zero >= 1; FSDP2's
    MixedPrecisionPolicy under bf16-mixed)."""
    plan, mesh, module = job.plan, layout.mesh, chunk.module
    if not shards_anything(plan.zero, _replicas(plan)):
        return
    apply_fsdp(
        module,
        chunk.blocks,
        data_parallel_mesh(mesh, plan),
        plan.zero,
        edp_mesh=data_parallel_mesh(mesh, plan, experts=True) if plan.ep > 1 else None,
        dp_size=_replicas(plan),
        expert_modules=expert_modules(module) if plan.ep > 1 else (),
        mp_policy=fsdp_policy(plan.precision),
        fp32_modules=fp32_modules(module, plan.precision),
    )


def materialize_weights(stage: LocalStage, job: Job, layout: ParallelLayout) -> Optional[dict]:
    """10. The values of a model started on meta, or read from ``weights=``: this rank's shards only
    (before the gradient sync holds on to the parameters: ``to_empty`` may replace them). A failure
    on any rank raises on every rank. Returns the counts (None: the model started with values)."""
    start = job.weights
    if not start.to_fill or job.dry_run:
        return None
    failure, counts = None, None
    try:
        counts = materialize(stage.modules, start.skeleton, layout.device, start.loaded, start.init_seed)
    except Exception as exc:  # noqa: BLE001 - every rank raises it (or names the rank that did), none hangs
        failure = exc
    with named_collective_failures("auto_parallelize, after materialising the model"):
        agree({}, what="materialising the model", error=failure, error_cls=checks.ApplyError)
    if job.rank == 0 and job.verbose:
        print(
            f"materialised on {layout.device}: {counts['read']} tensors read from {start.path} "
            f"({counts['bytes_read'] / 2**20:.1f} MiB on rank 0), {counts['initialised']} initialised "
            "by the model",
            flush=True,
        )
    return counts


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


def gradient_sync(
    stage: LocalStage, ties: Optional[CrossStageTies], job: Job, layout: ParallelLayout
) -> Optional[Callable[[], None]]:
    """11. What runs after each backward: the tied-embedding gradient sum over the two stages, then
    the replicated data-parallel all-reduce (zero=0; FSDP reduces inside the backward)."""
    plan, mesh = job.plan, layout.mesh
    syncs: List[Callable[[], None]] = [ties] if ties else []
    if plan.zero == 0 and _replicas(plan) > 1:
        params = [p for m in stage.modules for p in m.parameters()]
        experts = [p for m in stage.modules for p in expert_parameters(m)] if plan.ep > 1 else []
        syncs.append(
            GradientSync(
                params,
                data_parallel_mesh(mesh, plan).get_group(),
                _replicas(plan),
                edp_group=data_parallel_mesh(mesh, plan, experts=True).get_group() if plan.ep > 1 else None,
                expert_params=experts,
            )
        )
    return _in_order(syncs)


def pipeline_schedule(
    stage: LocalStage, job: Job, layout: ParallelLayout, loss_fn: Optional[Callable], cp: Optional[ContextParallel]
) -> BatchSchedule:
    """12. The PipelineStage(s) and the plan's 1F1B / GPipe / interleaved schedule (pp > 1), and
    how ``train_step`` runs a batch; then the job's timeout on every group created on the way."""
    schedule, stages = None, []
    if job.plan.pp > 1:
        stages, schedule = make_schedule(
            job.plan,
            stage.modules,
            stage.indices,
            stage.num_stages,
            job.num_microbatches,
            loss_fn,
            layout.mesh["pp"].get_group(),
            layout.device,
        )
    apply_job_timeout()  # any group created on the way (FSDP, pipelining) gets the job's timeout too
    return BatchSchedule(
        global_batch_size=job.global_batch_size,
        num_microbatches=job.num_microbatches,
        loss_fn=loss_fn,
        schedule=schedule,
        pipeline_stages=tuple(stages),
        context_parallel=cp,
    )


def fsdp_applied(job: Job) -> bool:
    """Whether FSDP2 holds the parameters (step 9 sharded anything)."""
    return shards_anything(job.plan.zero, _replicas(job.plan))
