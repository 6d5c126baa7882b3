"""Parameter counts of a ``TransformerConfig`` from closed formulas (``docs/cost_model.md``,
"Model shapes"): total and active (per token: top-k routed experts + shared ones), without
building the model. ``tests/distributed/models/test_model_shapes.py`` checks them against the built modules' numel and
against published totals (Llama 3, Mixtral, DeepSeek-V3, Mistral, Gemma 2, Nemotron-H).
"""

from __future__ import annotations

from typing import Tuple

from nest_fx.models.config import GATED, TransformerConfig


def norm_params(cfg: TransformerConfig, width: int) -> int:
    """RMSNorm: a scale; LayerNorm: scale and (with ``bias``) shift."""
    return width * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def attention_params(cfg: TransformerConfig) -> int:
    """Multi-head / grouped-query: q (heads x head_dim), k and v (kv_heads x head_dim), o; MLA:
    q (through the q_lora_rank bottleneck and its norm, or full rank), the kv latent + shared rotary
    key, its norm, the latent's up-projection to keys and values, o."""
    h, heads = cfg.hidden, cfg.heads
    if cfg.mla:
        qk = cfg.head_dim + cfg.rope_head_dim
        q = (
            (h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * qk)
            if cfg.q_lora_rank
            else h * heads * qk
        )
        kv = (
            h * (cfg.kv_lora_rank + cfg.rope_head_dim)
            + cfg.kv_lora_rank
            + cfg.kv_lora_rank * heads * (cfg.head_dim + cfg.v_head_dim)
        )
        return q + kv + heads * cfg.v_head_dim * h
    q_out, kv_out = heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    weights = h * q_out + 2 * h * kv_out + q_out * h
    return weights + ((q_out + 2 * kv_out + h) if cfg.bias else 0)


def mlp_params(cfg: TransformerConfig, width: int) -> int:
    """Gated (SwiGLU, GeGLU): gate, up, down = 3 h f; ungated (GELU, squared ReLU): 2 h f (+ biases)."""
    h = cfg.hidden
    if cfg.activation in GATED:
        return 3 * h * width + ((2 * width + h) if cfg.bias else 0)
    return 2 * h * width + ((width + h) if cfg.bias else 0)


def moe_params(cfg: TransformerConfig) -> Tuple[int, int]:
    """(total, active) of a mixture-of-experts layer: router h x E, E experts of moe_ffn_hidden, the
    shared experts as one MLP of shared_experts x moe_ffn_hidden; active: top_k experts."""
    router = cfg.hidden * cfg.num_experts
    expert = mlp_params(cfg, cfg.moe_ffn_hidden)
    shared = mlp_params(cfg, cfg.shared_experts * cfg.moe_ffn_hidden) if cfg.shared_experts else 0
    return router + cfg.num_experts * expert + shared, router + cfg.top_k * expert + shared


def mamba_params(cfg: TransformerConfig) -> int:
    """Mamba-2 (``models/mamba.py``): in_proj h x (2 d_inner + 2 groups state + heads), depthwise
    conv (d_inner + 2 groups state) x (conv + 1), dt_bias / A_log / D per head, the gated norm's
    d_inner scale, out_proj d_inner x h (+ biases)."""
    h, inner, heads = cfg.hidden, cfg.mamba_inner, cfg.mamba_heads
    conv_dim = inner + 2 * cfg.mamba_groups * cfg.mamba_state
    in_out = inner + conv_dim + heads
    return (
        h * in_out + conv_dim * (cfg.mamba_conv + 1) + 3 * heads + inner + inner * h + ((in_out + h) if cfg.bias else 0)
    )


def sublayer_params(cfg: TransformerConfig, kind: str) -> Tuple[int, int]:
    """(total, active) of one residual sublayer (its norm included)."""
    norm = norm_params(cfg, cfg.hidden)
    if kind == "attention":
        n = attention_params(cfg)
    elif kind == "mamba":
        n = mamba_params(cfg)
    elif kind == "moe":
        total, active = moe_params(cfg)
        return norm + total, norm + active
    else:
        n = mlp_params(cfg, cfg.ffn_hidden)
    return norm + n, norm + n


def param_counts(cfg: TransformerConfig) -> Tuple[int, int]:
    """(total, active per token) parameters of the model ``cfg`` builds: embeddings (padded
    vocabulary, learned positions), every layer's sublayers, the final norm and an untied LM head."""
    h = cfg.hidden
    total = cfg.padded_vocab * h + (cfg.seq_len * h if cfg.position == "learned" else 0)
    total += norm_params(cfg, h) + (0 if cfg.tie_embeddings else cfg.padded_vocab * h)
    active = total
    for i in range(cfg.layers):
        for kind in cfg.layer_kinds(i):
            t, a = sublayer_params(cfg, kind)
            total, active = total + t, active + a
    return total, active
