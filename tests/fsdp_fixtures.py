"""FSDP2 modules the tests share (helpers on pytest's pythonpath, not tests themselves)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def bf16_fsdp2_pair(tmp_path) -> torch.nn.Sequential:
    """Two bias-free 64 x 64 linears, each its own FSDP2 unit under a root, bf16 parameters reduced
    in fp32 and not resharded after forward, on a one-rank gloo group (started here; the
    ``single_rank`` fixture ends it)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return model
