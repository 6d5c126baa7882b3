"""Ring attention: the second context-parallel mode (``plan.cp_mode = "ring"``).

The all-gather mode (``context_parallel.py``) gathers every rank's K/V before attending. Here the
K/V blocks travel around the CP ring instead (Liu et al. 2023, "Ring Attention with Blockwise
Transformers"): at step ``s`` rank ``i`` holds the block of rank ``(i - s) mod cp``, starts
sending it to rank ``i + 1`` (and receiving the next one from rank ``i - 1``) and, while that
transfer is in flight, attends its queries to the block it holds. The partial results merge with
the online softmax: per query row a running maximum ``m``, normaliser ``l`` and output ``o``
(``o / l`` at the end). ``m`` only keeps ``exp`` in range; the result does not depend on it, so
it is detached and the gradient is the one of the plain softmax.

Causal load balancing is the all-gather mode's layout (rank ``i`` holds chunks ``i`` and
``2 cp - 1 - i``): for each of its two query chunks ``g`` and each key chunk ``h`` of the block,
``h < g`` is attended whole, ``h = g`` under the causal (lower-triangular) mask and ``h > g`` not
at all, so every rank computes the same ``(2 cp + 1) c^2`` scores as in the all-gather mode.

Backward: autograd runs through the blocks' attention; each received block's gradient is sent
back to the rank it came from (one ring shift per step in reverse, not overlapped). The scores
are computed with matmuls in fp32 (the K/V heads repeated for GQA), not with SDPA's fused kernels
(which do not return the softmax statistics the merge needs): the numbers equal SDPA's to fp32
rounding (``tests/unit/apply/test_context_parallel.py``).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F


class Ring:
    """The CP group as a ring: rank ``i`` sends to ``i + 1`` and receives from ``i - 1``."""

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def start(self, send: torch.Tensor, recv: torch.Tensor, reverse: bool = False) -> List:
        """Start sending ``send`` along the ring (backwards when ``reverse``) and receiving into ``recv``."""
        to, frm = (self.prev, self.next) if reverse else (self.next, self.prev)
        ops = [dist.P2POp(dist.isend, send, to, self.group), dist.P2POp(dist.irecv, recv, frm, self.group)]
        return dist.batch_isend_irecv(ops)


class _Received(torch.autograd.Function):
    """The block received at the next step: forward waits for the transfer started before the
    current block's attention; backward sends the block's gradient back to its sender."""

    @staticmethod
    def forward(ctx, sent: torch.Tensor, received: torch.Tensor, works: list, ring: Ring) -> torch.Tensor:
        for work in works:
            work.wait()
        ctx.ring = ring
        return received.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        back = torch.empty_like(grad)
        for work in ctx.ring.start(grad, back, reverse=True):
            work.wait()
        return back, None, None, None


def _blocks(own: torch.Tensor, ring: Ring):
    """(step, source rank, block) for the ``cp`` blocks of the ring, the next transfer started
    before each block is handed out."""
    current = own
    for step in range(ring.cp):
        pending = None
        if step + 1 < ring.cp:
            send = current.detach().contiguous()
            recv = torch.empty_like(send)
            pending = (send, recv, ring.start(send, recv))
        yield (ring.rank - step) % ring.cp, current
        if pending is not None:
            current = _Received.apply(current, pending[1], pending[2], ring)


def _merge(
    acc: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scores: torch.Tensor,
    values: torch.Tensor,
    dropout_p: float,
):
    """Fold one block's ``scores`` [..., q, k] (masked entries -inf) and ``values`` [..., k, D]
    into the running (max, normaliser, output)."""
    m_block = scores.amax(-1, keepdim=True).detach()
    m_block = torch.where(torch.isfinite(m_block), m_block, torch.zeros_like(m_block))
    if acc is not None:
        m_block = torch.maximum(m_block, acc[0])
    p = torch.exp(scores - m_block)
    l_block = p.sum(-1, keepdim=True)
    o_block = F.dropout(p, dropout_p) @ values if dropout_p else p @ values
    if acc is None:
        return m_block, l_block, o_block
    m, norm, o = acc
    rescale = torch.exp(m - m_block)
    return m_block, norm * rescale + l_block, o * rescale + o_block


def ring_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ring: Ring,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of this rank's queries (its two chunks, [B, H, S/cp, D]) over the whole
    sequence, K/V ([B, H_kv, S/cp, D]) passed around ``ring`` (module docstring)."""
    cp, rank = ring.cp, ring.rank
    c = query.size(-2) // 2
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    q = query.float() * scale
    causal = torch.ones(c, c, dtype=torch.bool, device=query.device).tril()
    acc: List[Optional[tuple]] = [None, None]
    own = torch.stack([key, value]) if key.shape == value.shape else None
    blocks = _blocks(own, ring) if own is not None else _zip_blocks(key, value, ring)
    for source, block in blocks:
        k, v = block[0].float(), block[1].float()
        if enable_gqa and k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
        for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            keys, vals, masks = [], [], []
            for k_half, k_chunk in enumerate((source, 2 * cp - 1 - source)):
                if k_chunk > chunk:
                    continue
                keys.append(k[..., k_half * c : (k_half + 1) * c, :])
                vals.append(v[..., k_half * c : (k_half + 1) * c, :])
                masks.append(causal if k_chunk == chunk else torch.ones_like(causal))
            if not keys:
                continue
            scores = q[..., half * c : (half + 1) * c, :] @ torch.cat(keys, dim=-2).transpose(-1, -2)
            scores = scores.masked_fill(~torch.cat(masks, dim=-1), float("-inf"))
            acc[half] = _merge(acc[half], scores, torch.cat(vals, dim=-2), dropout_p)
    return torch.cat([o / norm for _, norm, o in acc], dim=-2).to(query.dtype)


def _zip_blocks(key: torch.Tensor, value: torch.Tensor, ring: Ring):
    """Like :func:`_blocks` for K and V of different shapes: two rings in step."""
    for (source, k), (_, v) in zip(_blocks(key, ring), _blocks(value, ring)):
        yield source, (k, v)
