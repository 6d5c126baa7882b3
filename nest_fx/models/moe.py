"""Mixtral-style mixture of experts with static shapes (traceable on meta tensors).

Routing is top-k over a softmax router (``gate``), with the top-k weights renormalised as in
Mixtral (Jiang et al. 2024). Tokens are dispatched per sequence into a fixed-capacity buffer
``[batch, experts, capacity, hidden]`` (GShard-style capacity, Lepikhin et al. 2021):

    capacity = ceil(capacity_factor * seq * top_k / experts)

Tokens past an expert's capacity are dropped (they pass through the residual). Because the
capacity is per sequence, splitting the batch over data- or expert-parallel ranks does not
change which tokens are dropped, so a parallel run computes exactly the single-device model.
The buffer's expert dimension is what expert parallelism exchanges with all_to_all.
``shared_experts > 0`` adds one always-on MLP of ``shared_experts x moe_ffn_hidden`` (DeepSeek-V2/V3,
Qwen-MoE: the shared experts fused into one), a dense module that stays replicated under EP.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.models.config import TransformerConfig
from nest_fx.models.layers import make_mlp

# Capacity factor as an integer ratio, so capacity is integer arithmetic that fx can trace.
_CF_SCALE = 1000


def expert_capacity(seq: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """Slots per expert per sequence: ceil(capacity_factor * seq * top_k / experts)."""
    cf = round(capacity_factor * _CF_SCALE)
    return (seq * top_k * cf + experts * _CF_SCALE - 1) // (experts * _CF_SCALE)


class MoE(nn.Module):
    """Router ``gate`` + ``experts.{e}`` FFNs (``gate``/``up`` column, ``down`` row) (+ ``shared``)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.gate = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(make_mlp(cfg, cfg.moe_ffn_hidden) for _ in range(cfg.num_experts))
        if cfg.shared_experts:
            self.shared = make_mlp(cfg, cfg.shared_experts * cfg.moe_ffn_hidden)

    def route(self, x: torch.Tensor):
        """Return (slot index [B, S*k], combine weight [B, S*k, 1], capacity)."""
        bsz, seq = x.size(0), x.size(1)
        experts, k = self.num_experts, self.top_k
        capacity = expert_capacity(seq, k, experts, self.capacity_factor)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top_w, top_e = probs.topk(k, dim=-1)  # [B, S, k]
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        # Position of each (token, choice) in its expert's queue, in token order.
        onehot = probs.new_zeros(bsz, seq * k, experts).scatter_(-1, top_e.reshape(bsz, seq * k, 1), 1.0)
        position = (onehot.cumsum(dim=1) * onehot).sum(-1).long() - 1  # [B, S*k]
        expert = top_e.reshape(bsz, seq * k)
        kept = position < capacity
        # Dropped choices go to one spare slot at the end, which is never computed.
        slot = torch.where(kept, expert * capacity + position, experts * capacity)
        weight = (top_w.reshape(bsz, seq * k) * kept).to(x.dtype).unsqueeze(-1)
        return slot, weight, capacity

    def dispatch(self, x: torch.Tensor, slot: torch.Tensor, capacity: int) -> torch.Tensor:
        """Scatter token copies into the expert buffer [B, E, capacity, H]."""
        bsz, seq, hidden = x.size(0), x.size(1), x.size(2)
        tokens = x.unsqueeze(2).expand(bsz, seq, self.top_k, hidden).reshape(bsz, seq * self.top_k, hidden)
        buffer = x.new_zeros(bsz, self.num_experts * capacity + 1, hidden)
        buffer = buffer.scatter_add(1, slot.unsqueeze(-1).expand(bsz, seq * self.top_k, hidden), tokens)
        return buffer[:, :-1].reshape(bsz, self.num_experts, capacity, hidden)

    def run_experts(self, buffer: torch.Tensor) -> torch.Tensor:
        """Apply expert e to buffer[:, e]; expert parallelism replaces this step."""
        return torch.stack([expert(buffer[:, e]) for e, expert in enumerate(self.experts)], dim=1)

    def combine(self, out: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, seq: int) -> torch.Tensor:
        """Gather expert outputs back to token order and sum the k weighted choices.

        The rows are picked with ``index_select`` (its backward keeps only the index), not
        ``gather``, whose backward keeps its whole input: the ``[B, E x C + 1, H]`` expert outputs,
        as many bytes as the dispatched tokens (``k`` rows of ``H`` per token)."""
        bsz, hidden = out.size(0), out.size(-1)
        flat = torch.cat([out.reshape(bsz, -1, hidden), out.new_zeros(bsz, 1, hidden)], dim=1)
        rows = flat.size(1)
        index = (slot + torch.arange(bsz, device=slot.device).unsqueeze(-1) * rows).reshape(-1)
        picked = flat.reshape(bsz * rows, hidden).index_select(0, index).reshape(bsz, seq * self.top_k, hidden)
        return (picked * weight).reshape(bsz, seq, self.top_k, hidden).sum(dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slot, weight, capacity = self.route(x)
        out = self.run_experts(self.dispatch(x, slot, capacity))
        routed = self.combine(out, slot, weight, x.size(1))
        return routed + self.shared(x) if hasattr(self, "shared") else routed
