"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024; DeepSeek-V3 2024).

Queries go through a low-rank bottleneck (``q_a_proj`` -> RMSNorm -> ``q_b_proj``; a full-rank
``q_proj`` when ``q_lora_rank`` is 0); keys and values come from one compressed latent
(``kv_a_proj``: hidden -> kv_lora_rank + rope_head_dim, RMSNorm on the latent, ``kv_b_proj``:
latent -> heads x (head_dim + v_head_dim)). Each head's query/key is ``head_dim`` features without
positions and ``rope_head_dim`` rotary ones; the rotary key part is one per token, shared by all
heads. Training runs the uncompressed form (the latent absorbed into the projections is an
inference trick), so attention is ordinary SDPA with q.k width head_dim + rope_head_dim and value
width v_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nest_fx.models.config import TransformerConfig
from nest_fx.models.layers import RMSNorm, Rotary, attend


class LatentAttention(nn.Module):
    """DeepSeek MLA (module names as in DeepSeek's checkpoints, ``kv_a_proj_with_mqa`` shortened)."""

    def __init__(self, cfg: TransformerConfig, window: int = 0):
        super().__init__()
        self.heads, self.nope, self.rope_dim, self.v_dim = cfg.heads, cfg.head_dim, cfg.rope_head_dim, cfg.v_head_dim
        self.kv_rank, self.causal, self.window = cfg.kv_lora_rank, cfg.causal, window
        qk = cfg.head_dim + cfg.rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden, cfg.heads * qk, bias=False)
        self.kv_a_proj = nn.Linear(cfg.hidden, cfg.kv_lora_rank + cfg.rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.heads * (cfg.head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.v_head_dim, cfg.hidden, bias=False)
        self.rotary = Rotary(cfg.rope_head_dim, cfg.seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq = x.size(0), x.size(1)
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        # -1 for the head count keeps the module correct when tensor parallelism shards it.
        q = q.view(bsz, seq, -1, self.nope + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(latent)).view(bsz, seq, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = self.rotary(k_rope.unsqueeze(1))  # [B, 1, S, rope]: one rotary key per token
        q = torch.cat([q_nope, self.rotary(q_rope)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.size(1), -1, -1)], dim=-1)
        out = attend(q, k, v, self.causal, self.window, False)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
