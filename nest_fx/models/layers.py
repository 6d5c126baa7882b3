"""The layers of the zoo transformer: norms, rotary positions, attention and the MLPs
(multi-head latent attention: ``mla.py``; Mamba-2: ``mamba.py``).

Written so that ``torch.fx.symbolic_trace`` traces them (no data-dependent Python control
flow); see ``transformer.py`` for the module names they get in a model.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.models.config import TransformerConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), as used by Llama."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Scale of one (what a model started on ``meta`` gets when materialised)."""
        self.weight.fill_(1.0)

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
    """Rotary position embedding (Su et al. 2021) with precomputed cos/sin tables, on the first
    ``rotary_dim`` dims of each head (all of them by default; fewer: partial RoPE, the rest pass
    through unchanged)."""

    def __init__(self, head_dim: int, max_len: int, theta: float, rotary_dim: Optional[int] = None):
        super().__init__()
        self.head_dim, self.max_len, self.theta = head_dim, max_len, theta
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim  # the tables and frequencies span these
        half = (self.rotary_dim + 1) // 2
        self.register_buffer("cos", torch.empty(max_len, half, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, half, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute the cos/sin tables on the buffers' device (a model started on ``meta``
        gets them when the runtime materialises it)."""
        if self.cos.device.type == "meta":
            return
        device = self.cos.device
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim)
        )
        angles = torch.outer(torch.arange(self.max_len, dtype=torch.float32, device=device), inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [batch, heads, seq, head_dim]
        cos, sin = rope_tables(self.cos, self.sin, x.size(2), x.dtype)
        passed = self.head_dim - self.rotary_dim  # left unrotated (partial RoPE)
        rot, rest = x.split([self.rotary_dim, passed], -1) if passed else (x, None)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return rotated if rest is None else torch.cat((rotated, rest), dim=-1)


@torch.fx.wrap
def sliding_window_mask(q_len: int, k_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [q_len, k_len] mask of causal attention over the last ``window`` keys (query i sees
    keys i - window + 1 .. i). A leaf for fx taking sizes only (so tensor parallelism follows the
    heads past it); the cost model reads ``window`` from this call's literal argument
    (``workload.attention_share``)."""
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    return (cols <= rows) & (rows - cols < window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int, gqa: bool) -> torch.Tensor:
    """SDPA, causal or over a sliding window (an explicit band mask)."""
    if window:
        mask = sliding_window_mask(q.size(-2), k.size(-2), window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention with fused SDPA; ``window > 0``: over a sliding window."""

    def __init__(self, cfg: TransformerConfig, window: int = 0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.causal, self.window = cfg.causal, window
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.hidden, kv_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=cfg.bias)
        self.rotary = (
            Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta, cfg.rotary_dim) if cfg.position == "rope" else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq = x.size(0), x.size(1)
        # -1 for the head count keeps the module correct when tensor parallelism shards it.
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        out = attend(q, k, v, self.causal, self.window, self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class SwiGLU(nn.Module):
    """Gated MLP of Llama: down(silu(gate(x)) * up(x)); ``act="gelu"``: GeGLU (Gemma, Shazeer 2020)."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.act = F.silu if act == "silu" else _gelu
        self.gate = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.up = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.down = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    """GPT-2/BERT MLP: proj(gelu(fc(x))); ``act="relu2"``: squared ReLU (Primer, Nemotron)."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True, act: str = "gelu"):
        super().__init__()
        self.act = _gelu if act == "gelu" else _relu2
        self.fc = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.proj = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


def make_mlp(cfg: TransformerConfig, ffn_hidden: int = 0) -> nn.Module:
    """The config's MLP (``ffn_hidden`` wide, default the config's)."""
    width = ffn_hidden or cfg.ffn_hidden
    if cfg.activation in ("swiglu", "geglu"):
        return SwiGLU(cfg.hidden, width, cfg.bias, act="silu" if cfg.activation == "swiglu" else "gelu")
    return GeluMLP(cfg.hidden, width, cfg.bias, act=cfg.activation)
