"""HuggingFace models built from a config (no download), through the ``hf`` extra.

Names (``nest-fx plan|trace --model ...``, ``build_any``):

* ``hf:<model_type>[:field=value,...]``: any architecture transformers ships, from its default
  config shrunk to a tiny model, with overrides on config fields (``nest_fx.models.hf_config``),
  e.g. ``hf:qwen2:hidden_size=64,num_hidden_layers=2``, ``hf:t5``, ``hf:vit``, ``hf:qwen3_moe``.
* ``hf-config:PATH[:field=value,...]``: a local ``config.json`` as given.
* The nest-fx shapes of four families (kept from the first versions): ``hf:gpt2``, ``hf:llama``,
  ``hf:mixtral``, ``hf:bert`` with no key or the ``gpt:`` spec keys (``hf:llama:hidden=..,layers=..``)
  build their config from a ``TransformerConfig``; named zoo configs map onto HF configs too:
  ``hf:llama2-7b`` builds ``LlamaForCausalLM`` with Llama-2-7B shapes.

``build_hf_model`` returns ``(model, config)``: the ``TransformerConfig`` for the nest-fx shapes,
the transformers config otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch

from nest_fx.common.errors import ModelError
from nest_fx.common.names import close_matches
from nest_fx.models.config import TransformerConfig
from nest_fx.models.hf_config import (
    config_from_file,
    config_from_type,
    model_class,
    require_transformers,
    split_file_name,
    split_name,
)
from nest_fx.models.zoo import SPEC_ALIASES, NAMED_CONFIGS, default_dtype, parse_spec

FAMILIES = ("gpt2", "llama", "mixtral", "bert")
_SMALL = "hidden=64,layers=2,heads=4,seq=32,vocab=128"


def hf_config(family: str, cfg: TransformerConfig):
    """The ``transformers`` config of ``family`` with the shapes of ``cfg``."""
    unmapped = cfg.zoo_only_fields()
    if unmapped:
        raise ModelError(
            f"hf:{cfg.name}: {', '.join(unmapped)} have no equivalent in the HuggingFace {family} config "
            "nest-fx maps zoo shapes onto; use the zoo name without hf: (the nest-fx module builds it), "
            "or hf:<model_type> of an architecture transformers ships (e.g. hf:deepseek_v3)"
        )
    tf = require_transformers()
    common: Dict[str, Any] = dict(vocab_size=cfg.vocab_size, use_cache=False)
    if family == "gpt2":
        return tf.GPT2Config(
            n_embd=cfg.hidden,
            n_layer=cfg.layers,
            n_head=cfg.heads,
            n_positions=cfg.seq_len,
            n_inner=cfg.ffn_hidden if cfg.activation == "gelu" else None,
            bos_token_id=0,
            eos_token_id=0,
            **common,
        )
    if family == "bert":
        return tf.BertConfig(
            hidden_size=cfg.hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            intermediate_size=cfg.ffn_hidden,
            max_position_embeddings=cfg.seq_len,
            pad_token_id=0,
            **common,
        )
    llama_like = dict(
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **common,
    )
    if family == "llama":
        return tf.LlamaConfig(**llama_like)
    if family == "mixtral":
        # transformers' default experts implementation (grouped_mm): it traces with static shapes
        return tf.MixtralConfig(num_local_experts=cfg.num_experts or 8, num_experts_per_tok=cfg.top_k, **llama_like)
    raise ModelError(f"unknown HuggingFace family {family!r}{close_matches(family, FAMILIES)}: use one of {FAMILIES}")


def _model_class(family: str):
    tf = require_transformers()
    return {
        "gpt2": tf.GPT2LMHeadModel,
        "llama": tf.LlamaForCausalLM,
        "mixtral": tf.MixtralForCausalLM,
        "bert": tf.BertForMaskedLM,
    }[family]


def is_zoo_shaped(name: str) -> bool:
    """Whether ``name`` is a named zoo config or one of :data:`FAMILIES` with only ``gpt:`` spec keys
    (built from a ``TransformerConfig``), rather than a transformers model type with config fields."""
    body = name[len("hf:") :] if name.startswith("hf:") else name
    if body in NAMED_CONFIGS:
        return True
    family, _, spec = body.partition(":")
    zoo_keys = {f for f in TransformerConfig.__dataclass_fields__} | set(SPEC_ALIASES)
    keys = [item.partition("=")[0].strip() for item in spec.split(",") if item.strip()]
    return family in FAMILIES and all(k in zoo_keys for k in keys)


def parse_hf_name(name: str) -> Tuple[str, TransformerConfig]:
    """``hf:FAMILY[:spec]`` or ``hf:NAMED`` (the nest-fx shapes, :func:`is_zoo_shaped`) -> (family, shapes)."""
    body = name[len("hf:") :] if name.startswith("hf:") else name
    if body in NAMED_CONFIGS:
        cfg = NAMED_CONFIGS[body]
        family = (
            "mixtral"
            if cfg.num_experts
            else ("bert" if not cfg.causal else ("llama" if cfg.activation == "swiglu" else "gpt2"))
        )
        return family, cfg
    family, _, spec = body.partition(":")
    if family not in FAMILIES:
        raise ModelError(
            f"{name!r} is not one of the nest-fx-shaped HuggingFace names hf:{{{','.join(FAMILIES)}}}"
            f"[:key=value,...] or hf:<named config> with one of {sorted(NAMED_CONFIGS)}"
        )
    base = "gpt" if family in ("gpt2", "bert") else ("moe" if family == "mixtral" else "llama")
    cfg = parse_spec(f"{base}:{spec or _SMALL}")
    if family == "mixtral" and not spec:
        cfg = parse_spec(f"moe:{_SMALL},experts=4,kv=2")
    return family, cfg


def hf_config_for(name: str, layers: Optional[int] = None):
    """(transformers config, model class) of ``hf:<model_type>[:...]`` or ``hf-config:PATH[:...]``."""
    if name.startswith("hf-config:"):
        path, overrides = split_file_name(name[len("hf-config:") :])
        config = config_from_file(path, overrides, name)
    else:
        model_type, overrides = split_name(name[len("hf:") :])
        config = config_from_type(model_type, overrides, name)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for part in {id(config): config, id(text): text}.values():  # training: no key/value cache returned
        if hasattr(part, "use_cache"):
            part.use_cache = False
    if layers is not None:
        text.num_hidden_layers = layers
    return config, model_class(config, overrides.get("class"))


def build_hf_model(
    name: str, *, device: str | torch.device = "meta", dtype=None, layers: Optional[int] = None
) -> Tuple[torch.nn.Module, Any]:
    """Build a HuggingFace model from a config alone (weights random, or none on meta);
    ``layers`` overrides the depth. Returns (model, config): see the module docstring."""
    if name.startswith("hf:") and is_zoo_shaped(name):
        family, cfg = parse_hf_name(name)
        if layers is not None:
            cfg = replace(cfg, layers=layers)
        hf_cfg = hf_config(family, cfg)
        with torch.device(device), default_dtype(dtype):
            model = _model_class(family)(hf_cfg)
        return model, cfg
    config, cls = hf_config_for(name, layers)
    try:
        with torch.device(device), default_dtype(dtype):
            model = cls(config)
    except (ValueError, TypeError, KeyError, AttributeError, AssertionError, RuntimeError) as exc:
        raise ModelError(
            f"{name}: transformers could not build {cls.__name__} from this config: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    return model, config
