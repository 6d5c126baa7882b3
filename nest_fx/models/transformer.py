"""A readable decoder/encoder transformer covering GPT-2, GPT-3, BERT and Llama shapes.

One config class describes every model in the zoo. The code is written so that
``torch.fx.symbolic_trace`` can trace it (no data-dependent Python control flow), so the
tracer, the pipeline splitter and the tensor-parallel rewriter all see module-level nodes
with readable fully-qualified names:

    embed.tok, embed.pos            token / learned position embeddings
    layers.{i}.attn_norm            pre-attention norm
    layers.{i}.attn.{q,k,v,o}_proj  attention projections (q/k/v column-, o row-parallel)
    layers.{i}.mlp_norm             pre-MLP norm
    layers.{i}.mlp.{gate,up,down}   SwiGLU MLP (gate/up column-, down row-parallel)
    layers.{i}.mlp.{fc,proj}        GELU MLP (fc column-, proj row-parallel)
    layers.{i}.moe                  mixture-of-experts MLP (see ``moe.py``)
    norm, lm_head                   final norm and output projection
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TransformerConfig:
    """Shape and flavour of a transformer; every zoo model is one of these.

    ``ffn_hidden`` defaults to 4*hidden (GELU) or the Llama rule 8/3*hidden rounded up to a
    multiple of 256 (SwiGLU). ``num_experts > 0`` turns every ``moe_every``-th MLP into a
    mixture of experts with ``top_k`` routing.
    """

    vocab_size: int = 32000
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    seq_len: int = 2048
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    activation: str = "swiglu"  # "swiglu" | "gelu"
    position: str = "rope"  # "rope" | "learned"
    bias: bool = False
    tie_embeddings: bool = False
    causal: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    num_experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 1.0
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.ffn_hidden is None:
            if self.activation == "swiglu":
                self.ffn_hidden = 256 * math.ceil(int(8 * self.hidden / 3) / 256)
            else:
                self.ffn_hidden = 4 * self.hidden
        problems = []
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "seq_len", "top_k",
                     "moe_every"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_experts < 0:
            problems.append(f"num_experts must be >= 0 (0 = dense), got {self.num_experts}")
        if not 0 <= self.norm_eps < math.inf:
            problems.append(f"norm_eps must be a finite number >= 0, got {self.norm_eps}")
        for name in ("rope_theta", "capacity_factor"):
            if not 0 < getattr(self, name) < math.inf:
                problems.append(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.heads > 0 and self.hidden % self.heads:
            problems.append(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.kv_heads > 0 and self.heads % self.kv_heads:
            problems.append(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.norm not in ("rmsnorm", "layernorm"):
            problems.append(f"norm={self.norm!r}: use 'rmsnorm' or 'layernorm'")
        if self.activation not in ("swiglu", "gelu"):
            problems.append(f"activation={self.activation!r}: use 'swiglu' or 'gelu'")
        if self.position not in ("rope", "learned"):
            problems.append(f"position={self.position!r}: use 'rope' or 'learned'")
        if self.num_experts > 0 and not 0 < self.top_k <= self.num_experts:
            problems.append(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if problems:
            raise ValueError("invalid TransformerConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index % self.moe_every == self.moe_every - 1

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), as used by Llama."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (x.float() * norm).type_as(x) * self.weight


def make_norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


@torch.fx.wrap
def rope_tables(cos: torch.Tensor, sin: torch.Tensor, seq: int, dtype: torch.dtype):
    """First ``seq`` rows of the cos/sin tables (a leaf for fx: ``seq`` may be symbolic)."""
    return cos[:seq].to(dtype), sin[:seq].to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021) with precomputed cos/sin tables."""

    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [batch, heads, seq, head_dim]
        cos, sin = rope_tables(self.cos, self.sin, x.size(2), x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.flatten(-2)


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention with fused SDPA."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.causal = cfg.causal
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.rotary = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta) if cfg.position == "rope" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq = x.size(0), x.size(1)
        # -1 for the head count keeps the module correct when tensor parallelism shards it.
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class SwiGLU(nn.Module):
    """Gated MLP of Llama: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.up = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.down = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    """GPT-2/BERT MLP: proj(gelu(fc(x)))."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.proj = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def make_mlp(cfg: TransformerConfig) -> nn.Module:
    if cfg.activation == "swiglu":
        return SwiGLU(cfg.hidden, cfg.ffn_hidden, cfg.bias)
    return GeluMLP(cfg.hidden, cfg.ffn_hidden, cfg.bias)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: TransformerConfig, index: int):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        if cfg.is_moe_layer(index):
            from nest_fx.models.moe import MoE

            self.moe = MoE(cfg)
        else:
            self.mlp = make_mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(self.mlp_norm(x))


class Embedding(nn.Module):
    """Token embedding plus, for GPT/BERT, a learned position embedding."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.position == "learned" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            positions = torch.arange(tokens.size(1), device=tokens.device)
            x = x + self.pos(positions)
        return x


class Transformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.device.type != "meta":
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))
