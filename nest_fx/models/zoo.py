"""Named model configs from the literature and the ``gpt:key=value,...`` spec parser.

Sources for the shapes:
    gpt2-small    Radford et al. 2019 (124M): 12 layers, 768 hidden, 12 heads, 1024 ctx
    bert-large    Devlin et al. 2019 (340M): 24 layers, 1024 hidden, 16 heads, 512 ctx
                  (modelled as a pre-norm bidirectional encoder with an LM head)
    llama2-7b     Touvron et al. 2023: 32 layers, 4096 hidden, 32 heads, FFN 11008, 4096 ctx
    llama3-70b    Llama 3 report 2024: 80 layers, 8192 hidden, 64 heads / 8 KV, FFN 28672
    mixtral-8x7b  Jiang et al. 2024: 32 layers, 4096 hidden, 32/8 heads, 8 experts top-2
    gpt3-175b     Brown et al. 2020: 96 layers, 12288 hidden, 96 heads, 2048 ctx
    llama3-8b     Llama 3 report 2024: 32 layers, 4096 hidden, 32 heads / 8 KV, FFN 14336, 128256 vocab
    llama3-405b   Llama 3 report 2024: 126 layers, 16384 hidden, 128 heads / 8 KV, FFN 53248
    mistral-7b    Jiang et al. 2023 (v0.1): Llama-like 32 layers, 4096 hidden, 32/8 heads, FFN 14336,
                  sliding-window attention over 4096 tokens on every layer, 8192 ctx
    gemma2-9b     Gemma 2 report 2024: 42 layers, 3584 hidden, 16/8 heads of 256 (head size apart
                  from hidden / heads), GeGLU FFN 14336, 256000 vocab (tied), sliding window 4096
                  on alternate layers (the others global), 8192 ctx (logit soft-capping and the
                  extra post-norms are not modelled)
    deepseek-v3   DeepSeek-V3 report 2024: 61 layers, 7168 hidden, MLA (128 heads, q rank 1536, kv
                  rank 512, 128 + 64 rotary q.k, 128 v), first 3 layers dense (FFN 18432), then 256
                  routed experts (top-8, FFN 2048) + 1 shared; 129280 vocab (the MTP module is not built)
    qwen1.5-moe-a2.7b  Qwen1.5-MoE-A2.7B (Qwen team 2024): 24 layers, 2048 hidden, 16 heads, 60
                  experts top-4 of FFN 1408 + a shared expert of 5632 (4 x 1408), 151936 vocab (its
                  shared expert's sigmoid gate and the q/k/v biases are not modelled)
    nemotron-h-8b Nemotron-H report 2025: 52 sublayers, 24 Mamba-2 (128 heads of 64, state 128, 8
                  groups), 4 attention (32/8 heads of 128), 24 squared-ReLU FFN 21504, 4096 hidden,
                  131072 vocab; the pattern places the 4 attention layers evenly (reconstructed from
                  the report's counts, see docs/cost_model.md)
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import fields, replace
from typing import Dict, Optional, Tuple

import torch

from nest_fx.common.errors import ModelError
from nest_fx.common.names import close_matches
from nest_fx.models.config import TransformerConfig
from nest_fx.models.transformer import Transformer

_GPT = dict(norm="layernorm", activation="gelu", position="learned", bias=True)
_LLAMA = dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False)

NAMED_CONFIGS: Dict[str, TransformerConfig] = {
    "gpt2-small": TransformerConfig(
        name="gpt2-small", vocab_size=50257, hidden=768, layers=12, heads=12, seq_len=1024, tie_embeddings=True, **_GPT
    ),
    "bert-large": TransformerConfig(
        name="bert-large",
        vocab_size=30522,
        hidden=1024,
        layers=24,
        heads=16,
        seq_len=512,
        causal=False,
        tie_embeddings=True,
        norm_eps=1e-12,
        **_GPT,
    ),
    "llama2-7b": TransformerConfig(
        name="llama2-7b", vocab_size=32000, hidden=4096, layers=32, heads=32, ffn_hidden=11008, seq_len=4096, **_LLAMA
    ),
    "llama3-70b": TransformerConfig(
        name="llama3-70b",
        vocab_size=128256,
        hidden=8192,
        layers=80,
        heads=64,
        kv_heads=8,
        ffn_hidden=28672,
        seq_len=8192,
        rope_theta=500000.0,
        **_LLAMA,
    ),
    "mixtral-8x7b": TransformerConfig(
        name="mixtral-8x7b",
        vocab_size=32000,
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        seq_len=4096,
        num_experts=8,
        top_k=2,
        rope_theta=1e6,
        **_LLAMA,
    ),
    "gpt3-175b": TransformerConfig(
        name="gpt3-175b", vocab_size=50257, hidden=12288, layers=96, heads=96, seq_len=2048, **_GPT
    ),
    "llama3-8b": TransformerConfig(
        name="llama3-8b",
        vocab_size=128256,
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        seq_len=8192,
        rope_theta=500000.0,
        **_LLAMA,
    ),
    "llama3-405b": TransformerConfig(
        name="llama3-405b",
        vocab_size=128256,
        hidden=16384,
        layers=126,
        heads=128,
        kv_heads=8,
        ffn_hidden=53248,
        seq_len=8192,
        rope_theta=500000.0,
        **_LLAMA,
    ),
    "mistral-7b": TransformerConfig(
        name="mistral-7b",
        vocab_size=32000,
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        seq_len=8192,
        sliding_window=4096,
        **_LLAMA,
    ),
    "gemma2-9b": TransformerConfig(
        name="gemma2-9b",
        vocab_size=256000,
        hidden=3584,
        layers=42,
        heads=16,
        kv_heads=8,
        head_dim=256,
        ffn_hidden=14336,
        seq_len=8192,
        sliding_window=4096,
        global_every=2,
        tie_embeddings=True,
        norm_eps=1e-6,
        **dict(_LLAMA, activation="geglu"),
    ),
    "deepseek-v3": TransformerConfig(
        name="deepseek-v3",
        vocab_size=129280,
        hidden=7168,
        layers=61,
        heads=128,
        ffn_hidden=18432,
        seq_len=4096,
        num_experts=256,
        top_k=8,
        moe_ffn_hidden=2048,
        shared_experts=1,
        dense_layers=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        rope_head_dim=64,
        head_dim=128,
        v_head_dim=128,
        norm_eps=1e-6,
        **_LLAMA,
    ),
    "qwen1.5-moe-a2.7b": TransformerConfig(
        name="qwen1.5-moe-a2.7b",
        vocab_size=151936,
        hidden=2048,
        layers=24,
        heads=16,
        ffn_hidden=5632,
        seq_len=8192,
        num_experts=60,
        top_k=4,
        moe_ffn_hidden=1408,
        shared_experts=4,
        norm_eps=1e-6,
        rope_theta=1e6,
        **_LLAMA,
    ),
    "nemotron-h-8b": TransformerConfig(
        name="nemotron-h-8b",
        vocab_size=131072,
        hidden=4096,
        layers=52,
        heads=32,
        kv_heads=8,
        head_dim=128,
        ffn_hidden=21504,
        seq_len=8192,
        layer_pattern="M-M-M-M*-" * 4 + "M-M-M-M-" * 2,
        mamba_heads=128,
        mamba_head_dim=64,
        mamba_state=128,
        mamba_groups=8,
        mamba_conv=4,
        **dict(_LLAMA, activation="relu2"),
    ),
}

SPEC_ALIASES = {
    "vocab": "vocab_size",
    "seq": "seq_len",
    "ffn": "ffn_hidden",
    "experts": "num_experts",
    "kv": "kv_heads",
    "topk": "top_k",
    "window": "sliding_window",
    "pattern": "layer_pattern",
    "shared": "shared_experts",
    "moe_ffn": "moe_ffn_hidden",
    "q_lora": "q_lora_rank",
    "kv_lora": "kv_lora_rank",
    "rotary_pct": "rope_fraction",
}


def parse_spec(spec: str) -> TransformerConfig:
    """Parse ``gpt:hidden=..,layers=..,heads=..,seq=..,vocab=..`` (or ``llama:``/``moe:``).

    ``gpt:`` starts from GPT-2 style defaults (LayerNorm, GELU, learned positions), ``llama:``
    from Llama defaults (RMSNorm, SwiGLU, RoPE), ``moe:`` from Llama defaults with 8 experts.
    Any ``TransformerConfig`` field may be given; short aliases: vocab, seq, ffn, experts, kv, topk,
    window, pattern, shared, moe_ffn, q_lora, kv_lora, rotary_pct (``llama:...,pattern=M-M*-,...`` builds a hybrid
    Mamba-2 / attention stack, ``kv_lora=512`` multi-head latent attention, ``window=4096`` sliding windows).
    """
    family, _, body = spec.partition(":")
    base = {"gpt": _GPT, "llama": _LLAMA, "moe": dict(_LLAMA, num_experts=8, top_k=2)}.get(family)
    if base is None:
        raise ModelError(
            f"unknown model family {family!r} in {spec!r}{close_matches(family, ('gpt', 'llama', 'moe'))}: "
            "use gpt:, llama: or moe:"
        )
    valid = {f.name: f.type for f in fields(TransformerConfig)}
    kwargs = dict(base)
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, value = item.partition("=")
        key = SPEC_ALIASES.get(key.strip(), key.strip())
        if not eq or key not in valid or key == "name":
            raise ModelError(
                f"bad field {item!r} in model spec {spec!r}: expected key=value with key one of "
                f"{sorted(set(valid) - {'name'} | set(SPEC_ALIASES))}"
            )
        kwargs[key] = coerce_value(value.strip(), kwargs.get(key, getattr(TransformerConfig, key, None)), item)
    return TransformerConfig(name=spec, **kwargs)


_KINDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a JSON list",
    dict: "a JSON object",
}


def coerce_value(value: str, default, item: str):
    """``value`` (text) as the type of ``default``: bool, float, str, a JSON list or dict, else int;
    ModelError naming ``item`` and the expected kind otherwise."""
    try:
        if isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if isinstance(default, float):
            return float(value)
        if isinstance(default, str):
            return value
        if isinstance(default, (list, dict)):
            return json.loads(value)
        return int(value)
    except ValueError:
        kind = _KINDS.get(type(default), "an integer")
        raise ModelError(f"cannot parse {item!r}: {value!r} is not {kind} like its default {default!r}") from None


def get_config(name: str, **overrides) -> TransformerConfig:
    """A named config (see ``NAMED_CONFIGS``) or a ``gpt:...`` spec, with field overrides."""
    if name in NAMED_CONFIGS:
        cfg = NAMED_CONFIGS[name]
    elif ":" in name and not name.startswith("hf:"):
        cfg = parse_spec(name)
    else:
        raise ModelError(
            f"unknown model {name!r}{close_matches(name, NAMED_CONFIGS)}: use one of {sorted(NAMED_CONFIGS)}, a "
            "spec like 'gpt:hidden=768,layers=12,heads=12,seq=1024,vocab=50257' (or llama:, moe:), a plain model "
            "(mlp:..., cnn:...), hf:<model_type> for any architecture transformers ships (e.g. hf:llama, hf:qwen2) "
            "or hf-config:PATH"
        )
    return replace(cfg, **overrides) if overrides else cfg


def build_model(
    name: str, *, device: str | torch.device = "meta", dtype: Optional[torch.dtype] = None, **overrides
) -> Tuple[torch.nn.Module, TransformerConfig]:
    """Build a zoo model; on ``meta`` no memory is allocated (a 175B model builds in seconds)."""
    cfg = get_config(name, **overrides)
    with torch.device(device), default_dtype(dtype):
        model = Transformer(cfg)
    return model, cfg


@contextlib.contextmanager
def default_dtype(dtype: Optional[torch.dtype]):
    """Make ``dtype`` the default for tensors created inside (no change for None)."""
    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def example_tokens(batch: int, seq: int, vocab: int, device: str | torch.device = "meta") -> torch.Tensor:
    """Token ids of shape [batch, seq] (random on real devices, uninitialised on meta)."""
    if torch.device(device).type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    return torch.randint(0, vocab, (batch, seq), device=device)
