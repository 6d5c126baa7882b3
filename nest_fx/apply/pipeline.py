"""Pipeline parallelism: the plan's stage ranges, the stage modules and the PP schedule.

Stage modules are built by :mod:`nest_fx.graph.stage_modules`: each stage runs the model's own
forward with the modules other stages own replaced by stand-ins, takes its activation in at its
first layer and stops at the next stage's first layer, so it computes exactly its part of what
the whole model computes (per-layer indexing and root-forward code included). This module
chooses the ranges (one per stage; ``virtual_stages`` chunks per rank laid round-robin for the
interleaved schedules; two chunks per rank laid in a V for ``zbv`` and ``dualpipev``: rank i holds
chunks i and 2p - 1 - i, so rank 0 runs the first and the last), wraps the stage modules in
``PipelineStage`` s with the plan's schedule, and runs a step: every stage gets the model's
inputs (root code recomputes masks and positions from them), the first stage computes from
them, the last one gets the targets.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward  # the backward PipelineStage runs

from nest_fx.apply.checks import ApplyError
from nest_fx.apply.model_loss import model_loss
from nest_fx.graph.stage_modules import arm_stages, pack_inputs, split_stages, tensor_output
from nest_fx.plan.vocabulary import V_SCHEDULES, model_chunks

__all__ = [
    "LayerSubset",
    "ShardedGradStage",
    "chunk_layout",
    "interleaved_ranges",
    "make_schedule",
    "schedule_step",
    "split_stages",
    "stage_blocks",
    "tensor_output",
]


class LayerSubset(nn.ModuleList):
    """Modules kept under their original indices (e.g. the experts an expert-parallel rank holds), so
    parameter names do not change; iterates in index order."""

    def __init__(self, layers: Dict[int, nn.Module]):
        nn.Module.__init__(self)
        for index in sorted(layers):
            self.add_module(str(index), layers[index])

    def __getitem__(self, idx):
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(values[idx])
        return values[idx]

    def indices(self) -> List[int]:
        return [int(k) for k in self._modules]


def stage_blocks(graph, start: int, end: int) -> List[str]:
    """Module paths of the layers in chain range [start, end): a layer's module, or the children
    of a layer that groups children of an ``nn.Sequential`` (``Block.members``)."""
    return [m for group in stage_layer_groups(graph, start, end) for m in group]


def stage_layer_groups(graph, start: int, end: int) -> List[List[str]]:
    """The layer blocks in chain range [start, end), each as the module paths it consists of (one
    path for a layer module, the children for a layer of an ``nn.Sequential`` model)."""
    return [b.modules for b in graph.blocks[start:end] if b.kind == "block"]


def interleaved_ranges(plan, num_layers: int) -> List[List[Tuple[int, int]]]:
    """Chunks per device for the chunked schedules: device i keeps its plan layer count
    ``end_i - start_i`` split into v near-equal chunks (v = ``model_chunks``); chunks are laid
    along the chain in the order of :func:`chunk_layout`. Returns ``chunks[i] = [(start, end) of
    chunk 0, chunk 1, ...]`` for device (stage) i."""
    return [ranges for ranges, _ in chunk_layout(plan, num_layers)]


def chunk_stage_indices(schedule: str, device: int, p: int, v: int) -> List[int]:
    """The pipeline stage index of each of device ``device``'s ``v`` chunks: ``c p + device``
    (round-robin), or ``device`` and ``2p - 1 - device`` for the V schedules (torch's
    ``style="v"`` stage-to-rank mapping)."""
    if schedule in V_SCHEDULES:
        return [device, 2 * p - 1 - device]
    return [c * p + device for c in range(v)]


def chunk_layout(plan, num_layers: int) -> List[Tuple[List[Tuple[int, int]], List[int]]]:
    """Per device (plan stage) i: the chain ranges of its model chunks and their pipeline stage
    indices (:func:`chunk_stage_indices`). One chunk per device, ``[(start_i, end_i)]`` and
    ``[i]``, unless the schedule runs several (``model_chunks``): device i's layer count is then
    split into v near-equal chunks, laid along the chain in stage-index order."""
    p = plan.pp
    v = model_chunks(plan.schedule, plan.virtual_stages) if p > 1 else 1
    if v == 1:
        return [([(s.start, s.end)], [i]) for i, s in enumerate(plan.stages)]
    sizes = []
    for i, s in enumerate(plan.stages):
        count = s.end - s.start
        if count < v:
            if plan.schedule in V_SCHEDULES:
                raise ApplyError(
                    f"stages[{i}] has {count} layer(s), fewer than the 2 model chunks the "
                    f"{plan.schedule} schedule runs per device; fix: give the stage more layers"
                )
            raise ApplyError(
                f"stages[{i}] has {count} layers, fewer than virtual_stages={v} chunks; fix: "
                f"lower virtual_stages or give the stage more layers"
            )
        sizes.append([count * (c + 1) // v - count * c // v for c in range(v)])
    indices = [chunk_stage_indices(plan.schedule, i, p, v) for i in range(p)]
    owner = {stage: (i, c) for i in range(p) for c, stage in enumerate(indices[i])}
    chunks: List[List[Tuple[int, int]]] = [[(0, 0)] * v for _ in range(p)]
    pos = 0
    for stage in range(p * v):
        i, c = owner[stage]
        chunks[i][c] = (pos, pos + sizes[i][c])
        pos += sizes[i][c]
    assert pos == num_layers
    return [(chunks[i], indices[i]) for i in range(p)]


class ShardedGradStage(PipelineStage):
    """A :class:`PipelineStage` whose FSDP2 module keeps its ZeRO stage under pipelining
    (``plan.pp_shard_grads``): torch's stage turns FSDP's gradient reduction off for every
    microbatch's backward and reduces once after the last (``perform_reduce_grad``), so FSDP
    accumulates unsharded gradients in its reduce dtype all step; this stage keeps the reduction
    on, so each microbatch's gradients are reduce-scattered when its backward ends and added to
    the sharded gradients (FSDP2's ``foreach_reduce``), and under ZeRO-3 the parameters are
    resharded after each backward too (``reshard_after_backward``). ``perform_reduce_grad`` then
    finds nothing left to reduce and only waits for the last reductions. Full backwards only: the
    split-backward schedules are refused with it (``plan.may_run.unrun_schedule``)."""

    def __init__(self, *args, reshard_after_backward: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self._reshard_after_backward = reshard_after_backward

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """One microbatch's backward with FSDP's reduction on (torch's own for anything else)."""
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)  # the schedule's perform_reduce_grad finalises
        self.submod.set_reshard_after_backward(self._reshard_after_backward)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


_MULTI = {
    "interleaved": ScheduleInterleaved1F1B,
    "interleaved-zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
_SINGLE = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def make_schedule(
    plan,
    stage_modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    num_stages: int,
    n_microbatches: int,
    loss_fn: Callable,
    pp_group,
    device: torch.device,
):
    """PipelineStages for this rank's chunks and the plan's schedule over them. The V schedules
    set the stages' stage-to-rank mapping themselves (``style="v"``), the one
    :func:`chunk_stage_indices` lays chunks by. ``loss_fn=None``: the model computes its own loss
    (from labels or targets among its inputs, which every stage gets): the last stage returns it
    (:func:`~nest_fx.apply.model_loss.model_loss`) and the schedule backpropagates it as is."""
    arm_stages(stage_modules, last_output=model_loss if loss_fn is None else None)
    loss_fn = loss_fn or _the_output
    if plan.pp_shard_grads and plan.zero >= 2:
        sharded = {"reshard_after_backward": plan.zero >= 3}
        stages = [
            ShardedGradStage(m, idx, num_stages, device, group=pp_group, **sharded)
            for m, idx in zip(stage_modules, stage_indices)
        ]
    else:
        stages = [
            PipelineStage(m, idx, num_stages, device, group=pp_group) for m, idx in zip(stage_modules, stage_indices)
        ]
    # scale_grads=False: schedule_step divides each gradient by m once; torch scales per stage,
    # twice for a tied embedding whose one parameter sits in both V chunks of rank 0
    if plan.schedule in _MULTI:
        return stages, _MULTI[plan.schedule](stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return stages, _SINGLE[plan.schedule](stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)


@torch.no_grad()
def _mean_over_microbatches(stages: Sequence[PipelineStage], m: int) -> None:
    """Divide the summed microbatch gradients by m, once per parameter object of this rank."""
    seen = set()
    for stage in stages:
        for p in stage.submod.parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                p.grad.div_(m)


def _the_output(output: torch.Tensor, _target) -> torch.Tensor:
    """The schedule's loss function when the last stage returns the model's own loss."""
    return output


def schedule_step(
    schedule,
    stages: Sequence[PipelineStage],
    args: tuple,
    kwargs: Dict[str, Any],
    target: Optional[torch.Tensor],
    n_microbatches: int,
) -> Optional[torch.Tensor]:
    """One step of the pipeline schedule over this rank's stages. Every stage gets the model's
    inputs ``(args, kwargs)`` (every tensor split into microbatches by the schedule: several inputs,
    labels or nanoGPT's targets reach the stage whose code reads them), the last one the target
    (``None`` for a model computing its own loss: a placeholder the schedule splits). Returns the
    mean microbatch loss on a rank holding the last stage, else None."""
    is_last = any(s.is_last for s in stages)
    if target is None:
        target = torch.zeros(n_microbatches)
    losses: List[torch.Tensor] = []
    extra = {"target": target, "losses": losses} if is_last else {}
    # return_outputs=False: otherwise the last stage keeps every microbatch's output (the
    # logits) alive until the step ends, m times the memory 1F1B is meant to hold
    schedule.step(return_outputs=False, **pack_inputs(args, kwargs), **extra)
    _mean_over_microbatches(
        stages, schedule._n_microbatches
    )  # the m the schedule was built with (torch keeps no public name)
    return torch.stack([loss.detach().float() for loss in losses]).mean() if is_last else None
