"""Parameters two pipeline stages hold: tied input and output embeddings, kept as Megatron-LM does.

A parameter that both the head and the tail of the layer chain use (``lm_head.weight`` tied to
``model.embed_tokens.weight``) lives on the first stage, for the embedding, and on the last
stage, for the output layer (``nest_fx.graph.stage_layout`` finds them; no other sharing across
stages is accepted). The two copies start equal (the first stage's values are sent to the last
before training) and stay equal: after every backward each stage adds the other's gradient, so
both hold the whole model's gradient, the sum of its two uses, and any optimizer takes the same
step on both. Under tensor parallelism and FSDP each rank exchanges its local shard with the
rank at the same data- and tensor-parallel coordinates on the other stage, which lays the
parameter out the same way. Both stages name the parameter as the whole model does (the first
name in ``named_parameters()``), so a checkpoint stores it once and loads it into both.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from nest_fx.graph.stand_in import SplitError


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class CrossStageTies:
    """The tied parameters this rank holds and the rank on the other stage holding their twins.

    ``chunks``: this rank's stage modules; ``first``/``last``: which of them (if any) is the
    pipeline's first / last stage; ``shared``: canonical name -> all names of each tied parameter
    (``StageLayout.shared``); ``pp_group``: the pipeline group, whose rank 0 holds the first
    stage and whose last rank the last stage. A rank holding both (the V schedules put the first
    and the last chunk on pipeline rank 0) holds one parameter object in both chunks: autograd
    sums its two uses, and there is nothing to exchange.
    """

    def __init__(
        self, chunks: Sequence[nn.Module], first: bool, last: bool, shared: Dict[str, Tuple[str, ...]], pp_group
    ) -> None:
        self.chunks = list(chunks)
        self.names: List[str] = []
        self.peer = -1
        self.sender = first
        self.group = pp_group
        if not shared or pp_group is None or not (first or last) or (first and last):
            return
        size = dist.get_world_size(pp_group)
        self.peer = dist.get_global_rank(pp_group, size - 1 if first else 0)
        self.names = sorted(shared)
        self.params()  # fail now, not in the first step, if a stage lost one

    def params(self) -> List[nn.Parameter]:
        """The tied parameters as the stage holds them now: TP and FSDP replace parameter objects,
        so they are looked up by name on every use."""
        held = {name: p for chunk in self.chunks for name, p in chunk.named_parameters()}
        missing = [name for name in self.names if name not in held]
        if missing:
            raise SplitError(
                f"tied parameters {missing} are missing from the {'first' if self.sender else 'last'} pipeline stage"
            )
        return [held[name] for name in self.names]

    def __bool__(self) -> bool:
        return bool(self.names)

    @torch.no_grad()
    def sync_values(self) -> None:
        """Copy the first stage's values to the last stage (before TP/FSDP shard them)."""
        if not self.names:
            return
        op = dist.isend if self.sender else dist.irecv
        for req in dist.batch_isend_irecv(
            [dist.P2POp(op, _local(p.data), self.peer, self.group) for p in self.params()]
        ):
            req.wait()

    @torch.no_grad()
    def __call__(self) -> None:
        """Add the other stage's gradient to each tied parameter's (call after the backward)."""
        if not self.names:
            return
        grads = []
        for p in self.params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local(p.grad))
        received = [torch.empty_like(g) for g in grads]
        ops = [dist.P2POp(dist.isend, g.contiguous(), self.peer, self.group) for g in grads]
        ops += [dist.P2POp(dist.irecv, r, self.peer, self.group) for r in received]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        for g, r in zip(grads, received):
            g.add_(r)
