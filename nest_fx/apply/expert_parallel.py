"""Expert parallelism for MoE blocks: E/ep experts per rank, tokens exchanged with all_to_all.

The zoo MoE (``nest_fx/models/moe.py``) routes each sequence into a fixed-capacity buffer
``[B, E, C, H]`` (``dispatch``), applies expert ``e`` to ``buffer[:, e]`` (``run_experts``) and
gathers back (``combine``). Under expert parallelism, rank ``k`` of an ``ep`` group holds the
experts ``[k * E/ep, (k+1) * E/ep)``; ``run_experts`` becomes

    [B, E, C, H] --split E into ep chunks--> all_to_all --> [ep * B, E/ep, C, H]
       (rank k now has, from every group member, the tokens routed to its experts)
    local experts on their slices --> all_to_all back --> [B, E, C, H]

Routing, dispatch and combine are unchanged and per sequence, so capacity and dropped tokens are
exactly those of the single-device model. ``all_to_all`` is an autograd function: the backward
of an even all_to_all is the same all_to_all applied to the gradient.

Gradients: the router and everything outside the experts is replicated over the whole DP group
(averaged over ``dp``); expert ``e`` is replicated over the ``edp`` group (the replicas owning
the same experts). Its local gradient already sums the contributions of the ``ep`` replicas
whose tokens it processed, so the data-parallel sync *sums* it over ``edp`` and divides by
``dp`` (see ``data_parallel.py``), which equals the single-device gradient of the mean loss.
:func:`expert_parameters` lists them (after TP has replaced them with DTensors).
"""
from __future__ import annotations

import types
import torch
import torch.distributed as dist
import torch.nn as nn

from nest_fx.apply.checks import ApplyError
from nest_fx.graph.moe_modules import find_moe_modules
from nest_fx.apply.pipeline import LayerSubset


class _AllToAll(torch.autograd.Function):
    """Even all_to_all along dim 0: chunk i of the input goes to rank i of ``group``; the output's
    chunk j came from rank j. The backward is the same exchange applied to the gradient."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return None, out


def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """Autograd-aware even all_to_all over dim 0 (``x.size(0)`` divisible by the group size)."""
    size = dist.get_world_size(group)
    if x.size(0) % size:
        raise ValueError(f"all_to_all: dim 0 ({x.size(0)}) must be divisible by the group size {size}")
    if size == 1:
        return x
    return _AllToAll.apply(group, x)


def _ep_run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
    """run_experts under expert parallelism (bound to an MoE instance)."""
    ep, group = self._ep_size, self._ep_group
    bsz, experts, cap, hidden = buffer.shape
    local = experts // ep
    # [B, E, C, H] -> [ep, B, E/ep, C, H]: chunk k holds the slots of rank k's experts
    send = buffer.reshape(bsz, ep, local, cap, hidden).transpose(0, 1)
    recv = all_to_all(send, group)  # [ep (source rank), B, E/ep, C, H]
    outs = []
    for e, expert in enumerate(self.experts):  # local experts in order
        tokens = recv[:, :, e].reshape(ep * bsz, cap, hidden)
        outs.append(expert(tokens).reshape(ep, bsz, cap, hidden))
    out = torch.stack(outs, dim=2)  # [ep, B, E/ep, C, H]
    back = all_to_all(out, group)  # [ep (owner rank), B, E/ep, C, H]
    return back.transpose(0, 1).reshape(bsz, experts, cap, hidden)


def apply_expert_parallel(module: nn.Module, ep: int, ep_rank: int, ep_group) -> int:
    """Keep experts ``[ep_rank * E/ep, (ep_rank+1) * E/ep)`` of every MoE in ``module`` and exchange
    tokens over ``ep_group``. Experts keep their original indices (parameter names unchanged).
    Returns the number of MoE modules converted."""
    moes = find_moe_modules(module)
    for moe in moes:
        experts = len(moe.experts)
        if experts % ep:
            raise ApplyError(f"ep={ep} does not divide the {experts} experts of an MoE layer")
        local = experts // ep
        keep = {ep_rank * local + i: moe.experts[ep_rank * local + i] for i in range(local)}
        moe.experts = LayerSubset(keep)
        moe._ep_size, moe._ep_group = ep, ep_group
        moe.run_experts = types.MethodType(_ep_run_experts, moe)
    if ep > 1 and not moes:
        # HF Mixtral and other MoE implementations hide the buffer; not supported yet.
        raise ApplyError(f"ep={ep} but no MoE module with route/dispatch/run_experts/combine was found; expert "
                         "parallelism supports the nest-fx zoo MoE. fix: use ep=1")
    return len(moes)
