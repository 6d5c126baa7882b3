"""Model zoo: a readable transformer and MoE, named configs, and HuggingFace builders."""

from nest_fx.models.build import build_any, build_model, build_seeded
from nest_fx.models.config import TransformerConfig
from nest_fx.models.transformer import Transformer
from nest_fx.models.zoo import NAMED_CONFIGS, example_tokens, get_config, parse_spec

__all__ = [
    "Transformer",
    "TransformerConfig",
    "NAMED_CONFIGS",
    "build_any",
    "build_model",
    "build_seeded",
    "example_tokens",
    "get_config",
    "parse_spec",
]
