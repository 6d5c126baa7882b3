"""BatchNorm under data parallelism: statistics over the whole batch of the data-parallel group.

A ``BatchNorm`` layer normalises with the mean and variance of the batch it sees. Under data
parallelism each replica sees only its shard, so by default its statistics (and running
averages) would be the shard's, and the numbers differ from the single-device run.
:func:`sync_batchnorm` replaces every BatchNorm module with a :class:`DataParallelBatchNorm`,
which sums the per-channel sums and squared deviations over the data-parallel group
(an autograd-aware all-reduce: its backward all-reduces the gradient, which carries the
gradient of the shared statistics to every replica), so a step with one microbatch per replica
normalises exactly as the single-device model does on the whole batch. It works on gloo (CPU)
and NCCL alike (``torch.nn.SyncBatchNorm`` refuses CPU tensors). Parameter and buffer names
and tensors are kept, so checkpoints and optimizers see no difference.

With several microbatches per step (gradient accumulation, pipelining), each forward still sees
one microbatch: statistics are per microbatch, whatever the synchronisation; the runtime's
checks refuse that unless the user asked for per-replica statistics
(``auto_parallelize(..., sync_batchnorm=False)``, the behaviour of DDP).
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from nest_fx.plan.support import batchnorm_modules


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; the backward sums the gradients (every rank's loss depends on the sum)."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return None, grad


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Autograd-aware sum of ``x`` over ``group``."""
    return _AllReduceSum.apply(group, x)


class DataParallelBatchNorm(_BatchNorm):
    """A BatchNorm whose training statistics cover the batch of every rank of ``group``."""

    def __init__(self, bn: _BatchNorm, group) -> None:
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, device="meta")
        self._check_dims = bn._check_input_dim
        # the original tensors, so names, optimizer references and checkpoints are unchanged
        self._parameters = bn._parameters
        self._buffers = bn._buffers
        self.training = bn.training
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self._check_dims(input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training or dist.get_world_size(self.group) == 1:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = x.numel() // x.size(1) * dist.get_world_size(self.group)
        xf = x.float()
        mean = all_reduce(xf.sum(dims), self.group) / count
        centred = xf - mean.view(shape)
        var = all_reduce((centred * centred).sum(dims), self.group) / count
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / max(count - 1, 1))
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)


def sync_batchnorm(module: nn.Module, group) -> List[str]:
    """Replace every BatchNorm of ``module`` by a :class:`DataParallelBatchNorm` over ``group``;
    returns their names."""
    names = batchnorm_modules(module)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, DataParallelBatchNorm(parent.get_submodule(leaf), group))
    return names
