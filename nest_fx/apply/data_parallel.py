"""Data parallelism over the plan's ``dp`` dim: replication (zero=0) or FSDP2 (zero>=1).

zero=0  Parameters replicated; after backward, :class:`GradientSync` all-reduces the
        gradients over the DP group in flat buckets (one collective per bucket, works on gloo
        and nccl) and divides by ``dp``. ``torch.distributed._composable.replicate`` would do
        the same through DDP's reducer; the manual sync composes with pipeline schedules,
        DTensor (TP) parameters and expert parameters, whose gradients are summed over the
        ``edp`` group instead (see ``expert_parallel.py``) but still divided by ``dp``.
zero>=1 FSDP2 ``fully_shard`` on every block, then on the stage root: parameters, gradients
        and optimizer state are sharded over ``dp``. zero=3 reshards parameters after forward
        (``reshard_after_forward=True``); zero 1 and 2 keep them unsharded between forward and
        backward (``False``), trading memory for one all-gather less, which is ZeRO-2's
        communication pattern (ZeRO-1 is served by the same, sharding gradients as well).
        Experts are sharded over ``edp`` with the gradient divided by ``dp``.
        With one replica (``dp x cp = 1``) there is nothing to shard: the plan runs without
        FSDP2 (:func:`shards_anything`), as zero=0 does, and without its hooks and warnings.
HSDP   ``dp_shard`` below ``dp``: the FSDP2 mesh is 2-D ``(dp_replicate, dp_shard)``; FSDP2
        shards inside a group, replicates across groups and all-reduces the reduce-scattered
        gradients across them (``mesh.data_parallel_mesh``). With expert parallelism the
        experts' mesh is ``(dp_replicate, edp_shard)``: the shard group's replicas owning the
        same experts shard them, the groups replicate them (``mesh`` module docstring).

With context parallelism the CP ranks of a replica hold the same parameters too: every group
above then spans ``dp x cp`` ranks and the divisor is ``dp * cp`` (the caller passes the mesh
and ``dp_size``).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 25 * 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def broadcast_module(modules: Iterable[nn.Module], group, src_group_rank: int = 0) -> None:
    """Make parameters and buffers of ``modules`` equal to those of group rank ``src_group_rank``."""
    if group is None or dist.get_world_size(group) == 1:
        return
    tensors = []
    seen = set()
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            local = _local(t.data if isinstance(t, nn.Parameter) else t)
            if id(local) in seen or local.device.type == "meta":
                continue
            seen.add(id(local))
            tensors.append(local)
    src = dist.get_global_rank(group, src_group_rank)
    for chunk in _buckets(tensors):
        if len(chunk) == 1:
            dist.broadcast(chunk[0], src=src, group=group)
            continue
        flat = torch._utils._flatten_dense_tensors(chunk)
        dist.broadcast(flat, src=src, group=group)
        for t, v in zip(chunk, torch._utils._unflatten_dense_tensors(flat, chunk)):
            t.copy_(v)


def _buckets(tensors: Sequence[torch.Tensor], limit: int = BUCKET_BYTES) -> List[List[torch.Tensor]]:
    """Group tensors of one dtype/device into buckets of at most ``limit`` bytes."""
    by_kind: Dict[Tuple, List[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    out: List[List[torch.Tensor]] = []
    for group in by_kind.values():
        bucket, size = [], 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > limit:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            out.append(bucket)
    return out


class GradientSync:
    """All-reduce gradients over the DP group (zero=0) after the local backward."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        dp_group,
        dp_size: int,
        edp_group=None,
        expert_params: Sequence[nn.Parameter] = (),
    ):
        self.params = list(params)
        self.expert_ids = {id(p) for p in expert_params}
        self.dp_group, self.dp_size, self.edp_group = dp_group, dp_size, edp_group

    @torch.no_grad()
    def __call__(self) -> None:
        if self.dp_size == 1:
            return
        dense = [p for p in self.params if p.grad is not None and id(p) not in self.expert_ids]
        expert = [p for p in self.params if p.grad is not None and id(p) in self.expert_ids]
        self._reduce([_local(p.grad) for p in dense], self.dp_group)
        if expert:
            self._reduce([_local(p.grad) for p in expert], self.edp_group)

    def _reduce(self, grads: List[torch.Tensor], group) -> None:
        if not grads:
            return
        size = dist.get_world_size(group) if group is not None else 1
        for chunk in _buckets(grads):
            if size > 1:
                flat = torch._utils._flatten_dense_tensors(chunk)
                dist.all_reduce(flat, group=group)
                flat.div_(self.dp_size)
                for g, v in zip(chunk, torch._utils._unflatten_dense_tensors(flat, chunk)):
                    g.copy_(v)
            else:
                for g in chunk:
                    g.div_(self.dp_size)


def shards_anything(zero: int, replicas: int) -> bool:
    """Whether FSDP2 runs: ``zero >= 1`` over more than one rank holding the same parameters
    (``replicas = dp x cp``). On one replica it would shard nothing and only add hooks (and
    FSDP2's warnings about views its hooks may miss) to a run that equals zero=0."""
    return zero >= 1 and replicas > 1


def apply_fsdp(
    module: nn.Module,
    block_names: Sequence[str],
    dp_mesh,
    zero: int,
    *,
    edp_mesh=None,
    dp_size: Optional[int] = None,
    expert_modules: Sequence[nn.Module] = (),
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    fp32_modules: Sequence[nn.Module] = (),
) -> nn.Module:
    """FSDP2 over ``dp_mesh`` (1-D, or 2-D for HSDP): each block, then the root (see module docstring).
    ``mp_policy``: FSDP2's mixed precision (``precision.fsdp_policy``), the same on every unit but
    ``fp32_modules`` (``precision.fp32_modules``: BatchNorm), each its own unit without a cast."""
    reshard = zero >= 3
    policy = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for kept in fp32_modules:
        fully_shard(kept, mesh=dp_mesh, reshard_after_forward=reshard)
    for expert_mod in expert_modules:
        fsdp_experts = fully_shard(expert_mod, mesh=edp_mesh, reshard_after_forward=reshard, **policy)
        fsdp_experts.set_gradient_divide_factor(float(dp_size))
        # a divide factor other than the group size is a PREMUL_SUM reduce-scatter, which gloo lacks:
        # sum, then divide. Not on a shard group of one (1-D, or HSDP's (replicate, 1)): FSDP2 (torch
        # 2.13) divides that copy by the factor and then, under forced sums, divides again
        # (tests/distributed/apply/test_apply_parallel.py EP2 x DP2 x PP2,
        # tests/distributed/apply/test_runtime_features.py HSDP x EP)
        if edp_mesh.size(edp_mesh.ndim - 1) > 1:
            fsdp_experts.set_force_sum_reduction_for_comms(True)
    kept_ids = {id(m) for m in fp32_modules}
    for name in block_names:
        if id(module.get_submodule(name)) not in kept_ids:  # a layer that is a BatchNorm is one already
            fully_shard(module.get_submodule(name), mesh=dp_mesh, reshard_after_forward=reshard, **policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, **policy)
    return module
