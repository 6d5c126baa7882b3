"""Loss parallel: token cross-entropy from logits sharded by vocabulary over the TP group.

With ``plan.loss_parallel`` the LM head stays column-parallel with *local* outputs: TP rank
``j`` holds the logits of vocabulary rows ``[start_j, start_j + V_j)`` (DTensor's even split,
the first ranks one row more when ``tp`` does not divide ``V``), and the ``[B, S, V]`` logits are
never gathered. The loss is computed from the shards (Megatron's vocabulary-parallel
cross-entropy, Shoeybi et al. 2019):

    m      = max over the vocabulary   (local max, all-reduce MAX; a constant shift)
    Z      = sum exp(logit - m)        (local sums, all-reduce SUM)
    t      = logit[target] - m         (0 on ranks not holding the target row, all-reduce SUM)
    loss   = mean over tokens of log Z - t

and its gradient is local: ``(softmax - onehot) / tokens`` on each shard. It equals
``F.cross_entropy`` of the full logits (fp32; targets equal to ``ignore_index`` are left out
of the sum and the count, as ``nest_fx.apply.losses.lm_loss`` does).

The loss it replaces is the token-mean cross-entropy: ``nest_fx.apply.losses.lm_loss`` or a
``loss_fn`` equal to it in value and gradient on probes (``losses.token_cross_entropy_problem``;
e.g. ``F.cross_entropy(logits.flatten(0, 1), y.flatten())``). A plan with ``loss_parallel`` and
another loss is refused before training, naming the setting that turns it off; the default
planner does not choose loss parallelism for such a loss.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from nest_fx.apply.tensor_parallel import vocab_parallel_modules


def vocab_shard_sizes(vocab: int, tp: int) -> List[int]:
    """Rows of a vocabulary of ``vocab`` held by each of ``tp`` ranks (DTensor's Shard split:
    ``torch.chunk`` sizes, padded with empty shards)."""
    sizes = [len(c) for c in torch.arange(vocab).chunk(tp)]
    return sizes + [0] * (tp - len(sizes))


def _target_logit(logits: torch.Tensor, target: torch.Tensor, start: int, ignore_index: int):
    """(logit of each token's target where this shard holds it else 0, whether it holds it)."""
    local = target - start
    held = (local >= 0) & (local < logits.size(-1)) & (target != ignore_index)
    picked = logits.gather(-1, local.clamp(0, max(logits.size(-1) - 1, 0)).unsqueeze(-1)).squeeze(-1)
    return torch.where(held, picked, torch.zeros_like(picked)), held


def shard_statistics(
    logits: torch.Tensor, target: torch.Tensor, start: int, ignore_index: int = -100
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (max, sum of exp(logit - max), target logit or 0) of one vocabulary shard:
    ``logits`` [N, V_j] holds rows ``[start, start + V_j)``. What each rank contributes."""
    local_max = logits.max(dim=-1).values
    sumexp = (logits - local_max.unsqueeze(-1)).exp().sum(-1)
    return local_max, sumexp, _target_logit(logits, target, start, ignore_index)[0]


def combine_statistics(maxes: torch.Tensor, sumexps: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy from the shards' statistics stacked on dim 0 ([tp, N] each): the
    arithmetic the all-reduces of :func:`vocab_parallel_cross_entropy` perform, in one process."""
    m = maxes.max(dim=0).values
    log_z = (sumexps * (maxes - m).exp()).sum(0).log() + m
    return log_z - picked.sum(0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The loss on one fp32 logit buffer, reused in place (as Megatron-LM's vocabulary-parallel
    cross-entropy does): the upcast copy becomes the shifted logits, their exponentials, the
    softmax kept for backward, and in backward (``in_place``) the gradient. Against separate
    tensors for each step this holds ``4 N`` bytes (``N`` local logits) in forward instead of
    ``16 N``, and no fp32 buffer in backward instead of two (``docs/cost_model.md``, "Loss
    parallel"). ``in_place=False`` (``plan.loss_kernel=eager``): the backward computes the
    gradient in new tensors, as an op-by-op cross-entropy (PyTorch's DTensor ``loss_parallel``) does."""

    @staticmethod
    def forward(ctx, logits, target, start, group, ignore_index, in_place=True):
        work = logits.float()
        if work.data_ptr() == logits.data_ptr():
            work = work.clone()  # fp32 logits: the caller's tensor is never overwritten
        m = work.max(dim=-1).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        work.sub_(m.unsqueeze(-1))
        picked, held = _target_logit(work, target, start, ignore_index)
        work.exp_()
        both = torch.stack([work.sum(-1), picked])
        if group is not None:
            dist.all_reduce(both, group=group)
        sumexp, picked = both[0], both[1]
        valid = target != ignore_index
        count = valid.sum().clamp(min=1)
        losses = torch.where(valid, sumexp.log() - picked, torch.zeros_like(picked))
        work.div_(sumexp.unsqueeze(-1))  # the softmax
        ctx.save_for_backward(work, target - start, held, valid, count)
        ctx.in_place, ctx.spent = in_place, False
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        if ctx.spent and ctx.in_place:
            raise RuntimeError(
                "vocabulary-parallel cross-entropy: backward ran a second time through the same loss; its "
                "first backward overwrote the saved softmax with the gradient. Fix: one backward per forward "
                "(no retain_graph=True through the loss), or run with loss_parallel=false"
            )
        ctx.spent = True
        softmax, local, held, valid, count = ctx.saved_tensors
        if ctx.in_place:  # the softmax is not read again
            grad_logits = softmax.mul_(valid.unsqueeze(-1))
        else:
            grad_logits = softmax * valid.unsqueeze(-1)
        rows = held.nonzero().squeeze(-1)
        grad_logits[rows, local[rows]] -= 1.0
        scale = grad / count
        return grad_logits.mul_(scale) if ctx.in_place else grad_logits * scale, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    group,
    ignore_index: int = -100,
    in_place: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy over tokens from this rank's vocabulary shard ``logits`` [N, V_j]
    (rows ``[start, start + V_j)``) and the full ``target`` [N] (the same on every rank of
    ``group``); the same value on every rank. ``group=None``: one shard holds the whole
    vocabulary (no collective). ``in_place``: backward overwrites the kept softmax with the
    gradient (one backward per forward); False: new tensors, as an op-by-op loss."""
    return _VocabParallelCrossEntropy.apply(logits, target, start, group, ignore_index, in_place)


class VocabParallelLMLoss:
    """``lm_loss`` on vocabulary-sharded logits [B, S, V_j] over the TP ``group`` (rank ``tp_rank``
    of ``tp``, full vocabulary ``vocab``): what the runtime uses for ``plan.loss_parallel``;
    ``in_place``: :func:`vocab_parallel_cross_entropy`'s (``plan.loss_kernel`` other than eager)."""

    def __init__(self, group, tp: int, tp_rank: int, vocab: int, in_place: bool = True):
        sizes = vocab_shard_sizes(vocab, tp)
        self.group, self.width, self.start = group, sizes[tp_rank], sum(sizes[:tp_rank])
        self.vocab, self.in_place = vocab, in_place

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.size(-1) != self.width:
            raise ValueError(
                f"loss parallel: logits have {logits.size(-1)} vocabulary rows, expected this rank's "
                f"shard of {self.width} of {self.vocab}"
            )
        return vocab_parallel_cross_entropy(
            logits.reshape(-1, self.width), targets.reshape(-1), self.start, self.group, in_place=self.in_place
        )


def shard_lm_head(module: nn.Module, graph, start: int, end: int, tp_mesh: DeviceMesh) -> List[str]:
    """Shard the output linears of the tail among blocks ``start:end`` by vocabulary over
    ``tp_mesh`` with *local* outputs (the logits stay sharded); returns their paths."""
    targets = [name for name, kind in vocab_parallel_modules(module, graph, start, end).items() if kind == "colwise"]
    if targets and tp_mesh.size() > 1:
        parallelize_module(module, tp_mesh, {name: ColwiseParallel() for name in targets}, src_data_rank=None)
    return targets
