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
    layers.{i}.attn.{q_a,q_b,kv_a,kv_b,o}_proj   multi-head latent attention (``mla.py``)
    layers.{i}.{norm,mixer}         a ``layer_pattern`` layer: one sublayer (Mamba-2 ``mamba.py``,
                                    attention, MLP or MoE) behind its norm
    norm, lm_head                   final norm and output projection
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nest_fx.models.config import TransformerConfig
from nest_fx.models.layers import Attention, make_mlp, make_norm
from nest_fx.models.mamba import Mamba2
from nest_fx.models.mla import LatentAttention
from nest_fx.models.moe import MoE

__all__ = ["Block", "Embedding", "MixerBlock", "Transformer", "TransformerConfig"]


def make_attention(cfg: TransformerConfig, index: int) -> nn.Module:
    """Layer ``index``'s attention: MLA or multi-head/grouped-query, over its sliding window if any."""
    window = cfg.window_of(index)
    return LatentAttention(cfg, window) if cfg.mla else Attention(cfg, window)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: TransformerConfig, index: int):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = make_attention(cfg, index)
        self.mlp_norm = make_norm(cfg)
        if cfg.is_moe_layer(index):
            self.moe = MoE(cfg)
        else:
            self.mlp = make_mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + ffn(self.mlp_norm(x))


class MixerBlock(nn.Module):
    """One ``layer_pattern`` layer (Nemotron-H): x + mixer(norm(x)), the mixer Mamba-2, attention,
    an MLP or an MoE."""

    def __init__(self, cfg: TransformerConfig, index: int):
        super().__init__()
        kind = cfg.layer_kinds(index)[0]
        self.norm = make_norm(cfg)
        if kind == "mamba":
            self.mixer = Mamba2(cfg)
        elif kind == "attention":
            self.mixer = make_attention(cfg, index)
        elif kind == "moe":
            self.mixer = MoE(cfg)
        else:
            self.mixer = make_mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class Embedding(nn.Module):
    """Token embedding plus, for GPT/BERT, a learned position embedding."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.padded_vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.position == "learned" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            positions = torch.arange(tokens.size(1), device=tokens.device)
            x = x + self.pos(positions)
        return x


class Transformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, padded vocab] (``cfg.padded_vocab``)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        block = MixerBlock if cfg.layer_pattern else Block
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.padded_vocab, bias=False)
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
