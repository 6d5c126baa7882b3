"""Expert parallelism for MoE blocks: E/ep experts per rank, tokens exchanged with all_to_all.

Two MoE layouts are converted (``nest_fx.graph.moe_modules`` finds them):

**The zoo MoE** (``nest_fx/models/moe.py``) routes each sequence into a fixed-capacity buffer
``[B, E, C, H]`` (``dispatch``), applies expert ``e`` to ``buffer[:, e]`` (``run_experts``) and
gathers back (``combine``). Rank ``k`` of an ``ep`` group keeps the expert modules
``[k * E/ep, (k+1) * E/ep)`` (original indices, so names are unchanged); ``run_experts`` becomes

    [B, E, C, H] --split E into ep chunks--> all_to_all --> [ep * B, E/ep, C, H]
       (rank k now has, from every group member, the tokens routed to its experts)
    local experts on their slices --> all_to_all back --> [B, E, C, H]

Routing, dispatch and combine are unchanged and per sequence, so capacity and dropped tokens are
exactly those of the single-device model.

**HuggingFace stacked experts** (transformers 5: Mixtral, Qwen2/3-MoE, ...): one module with
per-expert weights stacked on dim 0 and ``forward(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])``. Each stacked parameter becomes a DTensor sharded ``Shard(0)`` over the
``ep`` mesh dim (rank ``k`` holds experts ``[k E/ep, (k+1) E/ep)``; checkpoints and
``full_tensors`` see the whole ``[E, ...]`` tensor under its original name), and ``forward``
becomes a token exchange of variable size (no capacity, no drops, as in the single-device model):

    each token goes once to each rank that owns at least one of its k experts (``per-rank``
    dispatch, as DeepEP's: a token whose experts share a rank is not sent twice), with its k
    choices' local expert ids (-1 where another rank owns the expert) and weights (0 there);
    all_to_all with split sizes exchanged first. The owner runs the module's own implementation
    (eager / grouped_mm / batched_mm) on its local experts with its (row, choice) pairs as
    T'=pairs, k=1, sums each row's weighted outputs, and sends one row per (token, rank) back by
    the reverse all_to_all; each token sums its rows.

HF experts compute ``sum_j w_j * expert_{e_j}(h)`` per token, so this is the single-device result
(the same products; only the order of the k-term sum is fixed: by owner rank, then choice).
``nest_fx.workload.expert_dispatch`` prices the rows this sends.

``all_to_all`` is an autograd function: its backward is the reverse exchange of the gradient.

Gradients: the router and everything outside the experts is replicated over the whole DP group
(averaged over ``dp``); expert ``e`` is replicated over the ``edp`` group (the replicas owning
the same experts). Its local gradient already sums the contributions of the ``ep`` replicas
whose tokens it processed, so the data-parallel sync *sums* it over ``edp`` and divides by
``dp`` (see ``data_parallel.py``), which equals the single-device gradient of the mean loss.
``nest_fx.graph.moe_modules.expert_parameters`` lists them.
"""

from __future__ import annotations

import types
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from nest_fx.apply.checks import ApplyError
from nest_fx.apply.pipeline import LayerSubset
from nest_fx.graph.moe_modules import find_moe_modules, find_stacked_experts, stacked_experts_problem


class _AllToAll(torch.autograd.Function):
    """all_to_all along dim 0: ``send[i]`` rows of the input go to rank i of ``group`` (in rank
    order), ``recv[j]`` rows of the output came from rank j; ``None`` splits mean even chunks.
    The backward is the reverse exchange applied to the gradient."""

    @staticmethod
    def forward(
        ctx, group, x: torch.Tensor, send: Optional[List[int]] = None, recv: Optional[List[int]] = None
    ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]) if recv is not None else x.shape)
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]) if ctx.send is not None else grad.shape)
        dist.all_to_all_single(out, grad, output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group)
        return None, out, None, None


def all_to_all(
    x: torch.Tensor, group=None, send: Optional[Sequence[int]] = None, recv: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """Autograd-aware all_to_all over dim 0: even chunks (``x.size(0)`` divisible by the group
    size) or ``send``/``recv`` rows per rank."""
    size = dist.get_world_size(group)
    if send is None and x.size(0) % size:
        raise ValueError(f"all_to_all: dim 0 ({x.size(0)}) must be divisible by the group size {size}")
    if size == 1:
        return x
    return _AllToAll.apply(group, x, None if send is None else list(send), None if recv is None else list(recv))


# -- the zoo MoE ----------------------------------------------------------------------------------


def _ep_run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
    """run_experts under expert parallelism (bound to a zoo MoE instance)."""
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


def _convert_zoo_moe(moe: nn.Module, ep: int, ep_rank: int, ep_group) -> None:
    experts = len(moe.experts)
    if experts % ep:
        raise ApplyError(f"ep={ep} does not divide the {experts} experts of an MoE layer")
    local = experts // ep
    keep = {ep_rank * local + i: moe.experts[ep_rank * local + i] for i in range(local)}
    moe.experts = LayerSubset(keep)
    moe._ep_size, moe._ep_group = ep, ep_group
    moe.run_experts = types.MethodType(_ep_run_experts, moe)


# -- HuggingFace stacked experts -----------------------------------------------------------------


def _run_local_experts(
    module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The module's own forward (its class's, whatever ``experts_implementation`` it dispatches
    to) on this rank's expert shards: the DTensor parameters are swapped for their local tensors
    for the call (``to_local`` is differentiable, so gradients reach the DTensors)."""
    params = module._parameters
    saved = {name: p for name, p in params.items() if isinstance(p, DTensor)}
    try:
        for name, p in saved.items():
            params[name] = p.to_local()
        return type(module).forward(module, hidden, index, weights)
    finally:
        params.update(saved)


def _ep_stacked_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """forward of a HF stacked-experts module under expert parallelism (see the module docstring):
    each token goes once to each rank owning one of its experts (``per-rank`` dispatch)."""
    ep, group, local = self._ep_size, self._ep_group, self.num_experts
    tokens, k = top_k_index.shape
    owner = torch.div(top_k_index, local, rounding_mode="floor")  # [T, k]
    hit = torch.zeros(tokens, ep, dtype=torch.bool, device=owner.device)
    hit[torch.arange(tokens, device=owner.device).unsqueeze(1), owner] = True
    rank, token = hit.t().nonzero(as_tuple=True)  # one row per (owner rank, token), grouped by rank
    send_counts = torch.bincount(rank, minlength=ep)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    owned = owner[token] == rank.unsqueeze(1)  # [rows, k]: the row's choices its destination runs
    choice_expert = torch.where(owned, top_k_index[token] - rank.unsqueeze(1) * local, -1)
    row_hidden = all_to_all(hidden_states[token], group, send, recv)
    row_expert = all_to_all(choice_expert, group, send, recv)
    row_weight = all_to_all(top_k_weights[token] * owned, group, send, recv)
    row, choice = (row_expert >= 0).nonzero(as_tuple=True)  # this rank's (row, choice) pairs
    pair_expert = row_expert[row, choice].unsqueeze(-1)
    pair_weight = row_weight[row, choice].unsqueeze(-1)
    out = _run_local_experts(self, row_hidden[row], pair_expert, pair_weight)  # [pairs here, H], weighted
    summed = out.new_zeros(row_hidden.shape[0], out.shape[-1]).index_add(0, row, out)  # one row per (token, rank)
    back = all_to_all(summed, group, recv, send)  # this rank's rows, each summed over its owner's choices
    combined = back.new_zeros(tokens, back.shape[-1]).index_add(0, token, back)
    return combined.to(hidden_states.dtype)


def _convert_stacked(name: str, module: nn.Module, ep: int, ep_rank: int, ep_mesh) -> None:
    problem = stacked_experts_problem(name, module)
    if problem:
        raise ApplyError(f"expert parallelism: {problem}; fix: use ep=1")
    experts = module.num_experts
    if experts % ep:
        raise ApplyError(
            f"ep={ep} does not divide the {experts} experts of {name}; fix: use ep in "
            f"{[d for d in range(1, experts + 1) if experts % d == 0]}"
        )
    local = experts // ep
    for pname, p in list(module.named_parameters(recurse=False)):
        shard = p.detach()[ep_rank * local : (ep_rank + 1) * local].clone()
        dt = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
        setattr(module, pname, nn.Parameter(dt, requires_grad=p.requires_grad))
    module._nest_fx_global_experts = experts
    module.num_experts = local
    module._ep_size, module._ep_group = ep, ep_mesh.get_group()
    module.forward = types.MethodType(_ep_stacked_forward, module)


def apply_expert_parallel(module: nn.Module, ep: int, ep_rank: int, ep_mesh) -> int:
    """Keep experts ``[ep_rank * E/ep, (ep_rank+1) * E/ep)`` of every MoE in ``module`` and exchange
    tokens over the 1-D ``ep_mesh``. Zoo experts keep their original indices, HF stacked experts
    become ``Shard(0)`` DTensors (parameter names unchanged either way). Returns the number of MoE
    layers converted."""
    moes = find_moe_modules(module)
    for moe in moes:
        _convert_zoo_moe(moe, ep, ep_rank, ep_mesh.get_group())
    stacked = find_stacked_experts(module)
    for name, experts in stacked:
        _convert_stacked(name, experts, ep, ep_rank, ep_mesh)
    # a pipeline chunk may hold no MoE layer (the embedding alone, dense layers): nothing to convert.
    # A model without one is refused before training, on every rank (ParallelSupport.ep_problem);
    # raising here, on the ranks of one stage only, left the others waiting in a collective
    return len(moes) + len(stacked)
