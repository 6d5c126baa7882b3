"""Any ``transformers`` architecture by name: its config (default, shrunk, or a file) and its model class.

``hf:<model_type>[:key=value,...]`` builds the model type's default config with its sizes shrunk
to a tiny model (:data:`SMALL`: 2 layers, hidden 64, 4 heads, vocabulary 128, 4 experts, 32x32
images, ...), then applies the ``key=value`` overrides on config fields (``hidden_size=256``;
the nest-fx spec keys ``hidden``, ``layers``, ``heads``, ``kv``, ``ffn``, ``seq``, ``vocab``,
``experts``, ``top_k`` are accepted as aliases). ``shrink=false`` keeps the default sizes and
``class=<Name>`` picks another head (``class=BertForSequenceClassification``).
``hf-config:PATH[:key=value,...]`` reads a local ``config.json`` as given.

The model class is the first of: sequence-to-sequence LM, masked LM, causal LM, image
classification, sequence classification, the base model (so BERT trains as a masked LM, T5 as
a sequence-to-sequence LM, Llama as a causal LM, ViT as an image classifier).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

from nest_fx.common.errors import MissingDependency, ModelError
from nest_fx.common.fileio import read_json
from nest_fx.common.limits import MAX_LAYERS
from nest_fx.common.names import close_matches
from nest_fx.models.zoo import coerce_value

# Tiny sizes, by the standard config names (translated through each config's attribute_map).
# Applied only to fields the model type's config has; experts only when it has experts.
SMALL: Dict[str, int] = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "dim": 64,
    "embed_dim": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "head_dim": 16,
    "d_kv": 16,
    "kv_channels": 16,
    "intermediate_size": 128,
    "d_ff": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "hidden_dim": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "expert_intermediate_size": 32,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "max_seq_len": 64,
    "image_size": 32,
    "patch_size": 8,
    "num_labels": 4,
    "rotary_dim": 8,
    "window_size": 4,
    # multi-head latent attention (DeepSeek-V2/V3)
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 24,
}
SHRUNK_IMAGE = 64  # example image side of a shrunk convolutional net with no image_size field
# hierarchical vision backbones (a ``depths`` list per stage) count stages with these: kept
STAGE_KEEP = ("num_layers", "num_stages", "hidden_size", "patch_size")
EXPERT_FIELDS = {
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}
KV_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
TOKEN_ID_FIELDS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
)
# list-valued stage sizes of vision backbones (ResNet, ConvNeXt, Swin, ...): shrunk per stage
STAGE_LISTS = {"hidden_sizes": lambda i: 16 * 2**i, "depths": lambda i: 1, "num_heads": lambda i: 2}

# nest-fx spec keys (``hf:llama:hidden=..``) as config fields
ALIASES = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv": "num_key_value_heads",
    "kv_heads": "num_key_value_heads",
    "ffn": "intermediate_size",
    "ffn_hidden": "intermediate_size",
    "seq": "max_position_embeddings",
    "seq_len": "max_position_embeddings",
    "vocab": "vocab_size",
    "top_k": "num_experts_per_tok",
    "topk": "num_experts_per_tok",
}

TASK_MAPPINGS = (
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)
SPECIAL_KEYS = ("shrink", "class")
DEPTH_FIELDS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)


def require_transformers():
    """The ``transformers`` module, or MissingDependency naming the extra to install."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise MissingDependency("HuggingFace models need the 'hf' extra: pip install -e '.[hf]'") from exc
    return transformers


def model_types() -> List[str]:
    """Every model type the installed transformers knows (``CONFIG_MAPPING``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # optional extra

    return list(CONFIG_MAPPING_NAMES)


def parse_overrides(text: str, where: str) -> Dict[str, str]:
    """``"a=1,b=x"`` -> ``{"a": "1", "b": "x"}``; ModelError for an item without ``=``."""
    out: Dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ModelError(f"bad override {item!r} in {where!r}: expected key=value (e.g. hidden_size=64)")
        out[key.strip()] = value.strip()
    return out


def _fields(config) -> Dict[str, Any]:
    """Config fields with their current values (attribute_map names resolve to their targets)."""
    return config.to_dict()


def _native(config, name: str) -> str:
    return getattr(config, "attribute_map", {}).get(name, name)


def _coerce(raw: str, default: Any, key: str, where: str) -> Any:
    """A ``key=value`` string as the type of the field's default value; with no default (None) the
    most specific form that parses (int, float, JSON, true/false/none, else the text)."""
    text = raw.strip()
    if default is not None:
        return coerce_value(text, default, f"{where}: {key}={raw}")
    for parse in (int, float, json.loads):
        try:
            return parse(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def shrunk_fields(config) -> Dict[str, Any]:
    """Keyword arguments that shrink ``config`` (a default config) to a tiny model of the same shape
    (see :data:`SMALL`); fields the config lacks are left out."""
    have = _fields(config)
    out: Dict[str, Any] = {}
    staged = isinstance(have.get("depths"), list)

    def put(name: str, value: Any, unset_too: bool = False) -> None:
        native = _native(config, name)
        current = have.get(native, False)
        if (isinstance(current, int) and not isinstance(current, bool)) or (unset_too and current is None):
            if native not in out and not (staged and native in STAGE_KEEP):
                out[native] = value

    for name, value in SMALL.items():
        if not (staged and name in STAGE_KEEP):
            put(name, value)
    if isinstance(have.get("qk_rope_head_dim"), int):  # MLA: the rotary part is the head_dim
        out["head_dim"] = SMALL["qk_rope_head_dim"]
    heads = next(
        (
            have[_native(config, n)]
            for n in ("num_attention_heads", "n_head", "num_heads")
            if isinstance(have.get(_native(config, n)), int)
        ),
        None,
    )
    for name in KV_FIELDS:
        kv = have.get(name)
        if isinstance(kv, int) and kv > 0:
            out[name] = 2 if heads and kv < heads else 4  # keep grouped-query attention grouped
    if any(
        isinstance(have.get(n), int) and have.get(n) > 0
        for n in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    ):
        for name, value in EXPERT_FIELDS.items():
            put(name, value, unset_too=True)  # some defaults leave top-k unset (DeepSeek-V2)
    for name, rule in STAGE_LISTS.items():
        value = have.get(name)
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[name] = [rule(i) for i in range(len(value))]
    vocab = out.get(_native(config, "vocab_size"))
    if vocab:
        for name in TOKEN_ID_FIELDS:  # special token ids must fit the small vocabulary
            if isinstance(have.get(name), int) and have[name] >= vocab:
                out[name] = min(TOKEN_ID_FIELDS.index(name), vocab - 1)  # pad 0, bos 1, eos 2, ...
    return out


def config_from_type(model_type: str, overrides: Dict[str, str], where: str):
    """The config of ``model_type``: its default, shrunk unless ``shrink=false``, with ``overrides``."""
    tf = require_transformers()
    known = model_types()
    if model_type not in known:
        raise ModelError(
            f"unknown HuggingFace model type {model_type!r} in {where!r}{close_matches(model_type, known)}; "
            "use one of transformers' model types (transformers.CONFIG_MAPPING), e.g. hf:llama, "
            "hf:qwen2, hf:t5, hf:vit"
        )
    default = tf.AutoConfig.for_model(model_type)
    shrink = _coerce(overrides.get("shrink", "true"), True, "shrink", where)
    kwargs = shrunk_fields(default) if shrink else {}
    kwargs.update(_typed_overrides(default, overrides, where))
    config = _make(lambda: tf.AutoConfig.for_model(model_type, **kwargs), where)
    if shrink and isinstance(getattr(config, "num_channels", None), int) and not hasattr(config, "image_size"):
        # a convolutional net takes any image size: a tiny model gets small examples (64x64; at
        # ImageNet's 224 its fp32 weight gradients, sums over 50k positions, carry 1e-3 rounding)
        config.image_size = SHRUNK_IMAGE
    return config


def config_from_file(path: str, overrides: Dict[str, str], where: str):
    """A local ``config.json`` (a file or a directory holding one) as given, with ``overrides``."""
    tf = require_transformers()
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    data = read_json(file, ModelError, "HuggingFace config")
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelError(f'{file}: a HuggingFace config.json needs a "model_type" string (e.g. "llama")')
    model_type = data.pop("model_type")
    known = model_types()
    if model_type not in known:
        raise ModelError(f"{file}: unknown model_type {model_type!r}{close_matches(model_type, known)}")
    base = _make(lambda: tf.AutoConfig.for_model(model_type, **data), file)
    data.update(_typed_overrides(base, overrides, where))
    return _make(lambda: tf.AutoConfig.for_model(model_type, **data), file)


def _typed_overrides(config, overrides: Dict[str, str], where: str) -> Dict[str, Any]:
    have = _fields(config)
    accepted = set(have) | set(getattr(config, "attribute_map", {}))
    out: Dict[str, Any] = {}
    for key, raw in overrides.items():
        if key in SPECIAL_KEYS:
            continue
        name = _native(config, ALIASES.get(key, key) if key not in accepted else key)
        if name not in have:
            raise ModelError(
                f"{where}: {type(config).__name__} has no field {key!r}"
                f"{close_matches(key, sorted(accepted | set(ALIASES)))}; fix: use one of its config "
                "fields (see its config.json)"
            )
        out[name] = _coerce(raw, have[name], key, where)
        if name in DEPTH_FIELDS and isinstance(out[name], int) and out[name] > MAX_LAYERS:
            raise ModelError(
                f"{where}: {key}={out[name]} is above the limit of {MAX_LAYERS} layers "
                "(nest_fx.common.limits.MAX_LAYERS: tracing takes about 20 ms per layer; is it a typo?)"
            )
    return out


def _make(build, where: str):
    try:
        return build()
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        raise ModelError(
            f"{where}: transformers refused the config: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from None


def model_class(config, class_name: Optional[str] = None):
    """The class to build for ``config`` (see the module docstring), or ``class_name`` from transformers."""
    tf = require_transformers()
    if class_name:
        cls = getattr(tf, class_name, None)
        if cls is None or not hasattr(cls, "_from_config"):
            raise ModelError(
                f"class={class_name}: transformers has no model class of that name"
                f"{close_matches(class_name, [n for n in dir(tf) if n[:1].isupper()])}"
            )
        return cls
    from transformers.models.auto import modeling_auto  # optional extra

    for mapping in TASK_MAPPINGS:
        name = getattr(modeling_auto, mapping).get(config.model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name and hasattr(tf, name):
            return getattr(tf, name)
    raise ModelError(
        f"hf:{config.model_type}: transformers has no model class for this config (a part of "
        "another model, e.g. a vision tower); use the parent model's type"
    )


def split_name(body: str) -> Tuple[str, Dict[str, str]]:
    """``"qwen2:hidden_size=64,x=1"`` -> ``("qwen2", {"hidden_size": "64", "x": "1"})``."""
    kind, _, spec = body.partition(":")
    return kind, parse_overrides(spec, body)


def split_file_name(body: str) -> Tuple[str, Dict[str, str]]:
    """``"PATH[:k=v,...]"`` -> (path, overrides); a ``:`` belongs to the path unless ``=`` follows."""
    path, sep, spec = body.rpartition(":")
    if sep and "=" in spec:
        return path, parse_overrides(spec, body)
    return body, {}
