"""Tiny layer stacks whose TP regions read their inputs in different ways (tests/unit/graph/test_tp_inputs.py,
tests/distributed/apply/test_tp_input_once.py): q/k/v and gate/up reading the region's input
(prepared once), keys and values reading a norm taken inside the region, an MLP adding its own
input (each column then all-reduces its own input's gradient)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.models.config import TransformerConfig

HIDDEN, HEADS = 32, 4


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, _ = t.shape
    return t.view(b, s, heads, -1).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS  # divided by tp on each rank (graph.tp_regions.localise_head_counts)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x):
        y = F.scaled_dot_product_attention(
            _heads(self.q_proj(x), self.heads), _heads(self.k_proj(x), self.heads), _heads(self.v_proj(x), self.heads)
        )
        return self.o_proj(y.transpose(1, 2).flatten(2))


class NormedKeyAttention(Attention):
    """Keys and values read a norm of the input taken inside the region, the query the input."""

    def __init__(self):
        super().__init__()
        self.kv_norm = nn.LayerNorm(HIDDEN)

    def forward(self, x):
        kv = self.kv_norm(x)
        y = F.scaled_dot_product_attention(
            _heads(self.q_proj(x), self.heads), _heads(self.k_proj(kv), self.heads), _heads(self.v_proj(kv), self.heads)
        )
        return self.o_proj(y.transpose(1, 2).flatten(2))


class AttentionCore(Attention):
    """q/k/v and the attention, without the output projection."""

    def __init__(self):
        super().__init__()
        del self.o_proj

    def forward(self, x):
        y = F.scaled_dot_product_attention(
            _heads(self.q_proj(x), self.heads), _heads(self.k_proj(x), self.heads), _heads(self.v_proj(x), self.heads)
        )
        return y.transpose(1, 2).flatten(2)


class PostNormOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.o_proj, self.norm = nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN)

    def forward(self, h, x):
        return self.norm(self.o_proj(h) + x)


class PostNormAttention(nn.Module):
    """BERT's layout: the region adds its own input after the output projection (post-norm), so
    only the columns' own module (``core``) takes its input once."""

    def __init__(self):
        super().__init__()
        self.core, self.out = AttentionCore(), PostNormOutput()

    def forward(self, x):
        return self.out(self.core(x), x)


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(HIDDEN, 64), nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class InnerResidualSwiGLU(SwiGLU):
    """Adds its own input to its output: that reader's gradient is whole on every rank."""

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)) + x


class Layer(nn.Module):
    def __init__(self, attn, mlp):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(HIDDEN), attn(), nn.LayerNorm(HIDDEN), mlp()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    def __init__(self, attn, mlp, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(Layer(attn, mlp) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


MODELS = {
    "llama-like": (Attention, SwiGLU),
    "normed-kv": (NormedKeyAttention, SwiGLU),
    "inner-residual": (Attention, InnerResidualSwiGLU),
    "post-norm": (PostNormAttention, SwiGLU),
}
SEQ = 8


def build_stack(name: str, seed: int = 0):
    """(model, config) of :data:`MODELS` ``name`` for the parity harness (``nest_fx.testing``)."""
    torch.manual_seed(seed)
    attn, mlp = MODELS[name]
    return Stack(attn, mlp), TransformerConfig(
        name=name, vocab_size=1, hidden=HIDDEN, layers=2, heads=HEADS, seq_len=SEQ
    )


def stack_data(gen: torch.Generator, batch: int):
    return torch.randn(batch, SEQ, HIDDEN, generator=gen), torch.randn(batch, SEQ, HIDDEN, generator=gen)


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
