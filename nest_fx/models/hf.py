"""HuggingFace models built from a config (no download), through the ``hf`` extra.

``hf:gpt2``, ``hf:llama``, ``hf:mixtral`` and ``hf:bert`` build a small model of that family;
``hf:llama:hidden=..,layers=..`` (same keys as the ``gpt:`` spec) sets its size. Named zoo
configs map onto HF configs too: ``hf:llama2-7b`` builds ``LlamaForCausalLM`` with Llama-2-7B
shapes on the meta device.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch

from nest_fx.common.errors import MissingDependency, ModelError
from nest_fx.models.config import TransformerConfig
from nest_fx.models.zoo import NAMED_CONFIGS, default_dtype, parse_spec

FAMILIES = ("gpt2", "llama", "mixtral", "bert")
_SMALL = "hidden=64,layers=2,heads=4,seq=32,vocab=128"


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise MissingDependency("HuggingFace models need the 'hf' extra: pip install -e '.[hf]'") from exc
    return transformers


def hf_config(family: str, cfg: TransformerConfig):
    """The ``transformers`` config of ``family`` with the shapes of ``cfg``."""
    tf = _require_transformers()
    common: Dict[str, Any] = dict(vocab_size=cfg.vocab_size, use_cache=False)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads, n_positions=cfg.seq_len,
                             n_inner=cfg.ffn_hidden if cfg.activation == "gelu" else None,
                             bos_token_id=0, eos_token_id=0, **common)
    if family == "bert":
        return tf.BertConfig(hidden_size=cfg.hidden, num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                             intermediate_size=cfg.ffn_hidden, max_position_embeddings=cfg.seq_len,
                             pad_token_id=0, **common)
    llama_like = dict(hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden, num_hidden_layers=cfg.layers,
                      num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                      max_position_embeddings=cfg.seq_len, tie_word_embeddings=cfg.tie_embeddings,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
    if family == "llama":
        return tf.LlamaConfig(**llama_like)
    if family == "mixtral":
        # batched_mm keeps shapes static (the eager expert loop branches on data), so it traces.
        return tf.MixtralConfig(num_local_experts=cfg.num_experts or 8, num_experts_per_tok=cfg.top_k,
                                experts_implementation="batched_mm", **llama_like)
    raise ModelError(f"unknown HuggingFace family {family!r}: use one of {FAMILIES}")


def _model_class(family: str):
    tf = _require_transformers()
    return {"gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM, "mixtral": tf.MixtralForCausalLM,
            "bert": tf.BertForMaskedLM}[family]


def parse_hf_name(name: str) -> Tuple[str, TransformerConfig]:
    """``hf:FAMILY[:spec]`` or ``hf:NAMED`` -> (family, shapes)."""
    body = name[len("hf:"):] if name.startswith("hf:") else name
    if body in NAMED_CONFIGS:
        cfg = NAMED_CONFIGS[body]
        family = "mixtral" if cfg.num_experts else ("bert" if not cfg.causal else
                                                     ("llama" if cfg.activation == "swiglu" else "gpt2"))
        return family, cfg
    family, _, spec = body.partition(":")
    if family not in FAMILIES:
        raise ModelError(f"unknown HuggingFace model {name!r}: use hf:{{{','.join(FAMILIES)}}}[:key=value,...] "
                         f"or hf:<named config> with one of {sorted(NAMED_CONFIGS)}")
    base = "gpt" if family in ("gpt2", "bert") else ("moe" if family == "mixtral" else "llama")
    cfg = parse_spec(f"{base}:{spec or _SMALL}")
    if family == "mixtral" and not spec:
        cfg = parse_spec(f"moe:{_SMALL},experts=4,kv=2")
    return family, cfg


def build_hf_model(name: str, *, device: str | torch.device = "meta", dtype=None,
                   layers: Optional[int] = None) -> Tuple[torch.nn.Module, TransformerConfig]:
    """Build a HuggingFace model from a config alone (weights random, or none on meta);
    ``layers`` overrides the depth."""
    family, cfg = parse_hf_name(name)
    if layers is not None:
        cfg = replace(cfg, layers=layers)
    hf_cfg = hf_config(family, cfg)
    with torch.device(device), default_dtype(dtype):
        model = _model_class(family)(hf_cfg)
    return model, cfg
