"""A Mamba-2 mixer layer (Dao & Gu 2024, "Transformers are SSMs"), as Nemotron-H and Jamba-style
hybrid stacks use it, in plain PyTorch (no custom kernels, traceable on meta tensors).

One input projection gives the gate ``z``, the SSM input ``x``, the shared ``B``/``C`` (``groups`` of
``state`` each) and one step size per head ``dt``; ``x, B, C`` pass a causal depthwise convolution
and SiLU; the selective state-space recurrence runs per head with a scalar decay
``A = -exp(A_log)``, computed chunk by chunk with the SSD algorithm (quadratic inside a chunk of
``chunk`` tokens, a linear scan of the states across chunks); then a skip ``D x``, a gated
RMSNorm per group and the output projection. Parameters (``docs/cost_model.md``, "Mamba-2"):
``in_proj`` hidden x (2 d_inner + 2 groups state + heads), ``conv`` (d_inner + 2 groups state) x
(conv + 1), ``dt_bias``/``A_log``/``D`` one per head, ``norm`` d_inner, ``out_proj`` d_inner x hidden.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.models.config import TransformerConfig


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = x[j+1] + ... + x[i] for j <= i, -inf above the diagonal."""
    t = x.size(-1)
    x = x.unsqueeze(-1).expand(*x.shape, t)
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~keep, -math.inf)


@torch.fx.wrap
def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk: int
) -> torch.Tensor:
    """The SSD recurrence h_t = exp(dt_t a) h_{t-1} + dt_t B_t x_t, y_t = C_t h_t from a zero state.

    x [batch, seq, heads, p], dt [batch, seq, heads], a [heads], b/c [batch, seq, groups, n] ->
    y [batch, seq, heads, p]. The sequence is zero-padded to a multiple of ``chunk`` (padding at the
    end changes no earlier output). A leaf for fx: shapes are plain ints inside."""
    bsz, seq, heads, _ = x.shape
    rep = heads // b.size(2)
    pad = (-seq) % chunk
    if pad:
        x, dt = F.pad(x, (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
        b, c = F.pad(b, (0, 0, 0, 0, 0, pad)), F.pad(c, (0, 0, 0, 0, 0, pad))
    n_chunks = (seq + pad) // chunk
    b = b.repeat_interleave(rep, dim=2).view(bsz, n_chunks, chunk, heads, -1)
    c = c.repeat_interleave(rep, dim=2).view(bsz, n_chunks, chunk, heads, -1)
    xs = (x * dt.unsqueeze(-1)).view(bsz, n_chunks, chunk, heads, -1)
    decay = (dt * a).view(bsz, n_chunks, chunk, heads).permute(0, 3, 1, 2)  # [b, h, c, l]
    cum = torch.cumsum(decay, dim=-1)
    within = torch.exp(_segsum(decay))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", c, b) * within
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, xs)
    to_end = torch.exp(cum[..., -1:] - cum)  # [b, h, c, l]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, to_end, xs)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    across = torch.exp(_segsum(F.pad(cum[..., -1], (1, 0))))  # [b, h, c+1, c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(cum))
    return (y_diag + y_off).reshape(bsz, n_chunks * chunk, heads, -1)[:, :seq]


class Mamba2(nn.Module):
    """Mamba-2 mixer: in_proj -> causal conv + SiLU -> SSD scan (+ D skip) -> gated RMSNorm -> out_proj."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.heads, self.head_dim, self.groups, self.state = (
            cfg.mamba_heads,
            cfg.mamba_head_dim,
            cfg.mamba_groups,
            cfg.mamba_state,
        )
        self.inner, self.chunk, self.eps = cfg.mamba_inner, cfg.mamba_chunk, cfg.norm_eps
        self.conv_dim = self.inner + 2 * self.groups * self.state
        self.in_proj = nn.Linear(cfg.hidden, self.inner + self.conv_dim + self.heads, bias=cfg.bias)
        self.conv = nn.Conv1d(
            self.conv_dim, self.conv_dim, cfg.mamba_conv, groups=self.conv_dim, padding=cfg.mamba_conv - 1
        )
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm_weight = nn.Parameter(torch.empty(self.inner))
        self.out_proj = nn.Linear(self.inner, cfg.hidden, bias=cfg.bias)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Mamba-2's initialisation: decays A in [1, 16], step sizes in [0.001, 0.1], D = 1."""
        if self.A_log.device.type == "meta":
            return
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.D.fill_(1.0)
        self.norm_weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq = x.size(0), x.size(1)
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :seq].transpose(1, 2))
        xs, b, c = xbc.split([self.inner, self.groups * self.state, self.groups * self.state], dim=-1)
        xs = xs.view(bsz, seq, self.heads, self.head_dim)
        dt = F.softplus(dt + self.dt_bias)
        y = ssd_scan(
            xs,
            dt,
            -torch.exp(self.A_log.float()).to(x.dtype),
            b.view(bsz, seq, self.groups, self.state),
            c.view(bsz, seq, self.groups, self.state),
            self.chunk,
        )
        y = (y + xs * self.D.unsqueeze(-1)).view(bsz, seq, self.groups, -1)
        gated = (y * F.silu(z.view(bsz, seq, self.groups, -1))).float()
        normed = gated * gated.pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return self.out_proj(normed.type_as(x).reshape(bsz, seq, self.inner) * self.norm_weight)
