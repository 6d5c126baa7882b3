"""Tiny models for the tensor-parallel layout tests: HuggingFace families built from a config (no
download) and plain ``nn.Sequential`` MLPs and CNNs.

Every builder is a module-level function (picklable, so ``nest_fx.testing.equivalence`` can run it
on every rank) returning ``(model, config)`` with the ``vocab_size``, ``seq_len`` and ``layers``
the harness reads.
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.models.config import TransformerConfig

VOCAB, SEQ, HIDDEN, LAYERS = 128, 32, 64, 2


def _hf_configs():
    import transformers as tf

    small = dict(vocab_size=VOCAB, use_cache=False)
    llama_like = dict(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        **small,
    )
    return {
        "gpt2": (
            tf.GPT2LMHeadModel,
            lambda: tf.GPT2Config(
                n_embd=HIDDEN,
                n_layer=LAYERS,
                n_head=4,
                n_positions=SEQ,
                bos_token_id=0,
                eos_token_id=0,
                attn_pdrop=0.0,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                **small,
            ),
        ),
        "phi3": (
            tf.Phi3ForCausalLM,
            lambda: tf.Phi3Config(pad_token_id=0, bos_token_id=0, eos_token_id=0, **llama_like),
        ),
        "qwen3": (tf.Qwen3ForCausalLM, lambda: tf.Qwen3Config(head_dim=16, **llama_like)),
        "qwen3_moe": (
            tf.Qwen3MoeForCausalLM,
            lambda: tf.Qwen3MoeConfig(
                head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **llama_like
            ),
        ),
        "bloom": (tf.BloomForCausalLM, lambda: tf.BloomConfig(hidden_size=HIDDEN, n_layer=LAYERS, n_head=4, **small)),
        "opt": (
            tf.OPTForCausalLM,
            lambda: tf.OPTConfig(
                hidden_size=HIDDEN,
                ffn_dim=128,
                num_hidden_layers=LAYERS,
                num_attention_heads=4,
                max_position_embeddings=SEQ,
                word_embed_proj_dim=HIDDEN,
                pad_token_id=0,
                dropout=0.0,
                attention_dropout=0.0,
                **small,
            ),
        ),
        "falcon": (
            tf.FalconForCausalLM,
            lambda: tf.FalconConfig(
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=4,
                new_decoder_architecture=True,
                num_kv_heads=2,
                max_position_embeddings=SEQ,
                **small,
            ),
        ),
        "t5": (
            T5EncoderLM,
            lambda: tf.T5Config(
                d_model=HIDDEN, d_ff=128, d_kv=16, num_heads=4, num_layers=LAYERS, dropout_rate=0.0, **small
            ),
        ),
    }


class T5EncoderLM(nn.Module):
    """T5's encoder (relative position bias, computed by its first block and passed on) with an LM
    head: a language model of the relative-position-bias family that takes token ids alone."""

    def __init__(self, config):
        super().__init__()
        import transformers as tf

        self.config = config
        self.encoder = tf.T5EncoderModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.encoder(input_ids=input_ids).last_hidden_state)


def build_hf(family: str, seed: int = 0, device: str = "cpu") -> Tuple[nn.Module, TransformerConfig]:
    """A tiny HuggingFace model of ``family`` (fp32, SDPA attention) and its shapes."""
    cls, make = _hf_configs()[family]
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(make())
    model.config._attn_implementation = "sdpa"
    model.train()  # dropout is 0 in every config: training mode computes what eval mode does
    return model, TransformerConfig(
        name=f"tiny-{family}", vocab_size=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=4, seq_len=SEQ
    )


def hf_builder(family: str):
    """A picklable ``build(seed)`` for ``equivalence``."""
    return functools.partial(build_hf, family)


HF_FAMILIES = tuple(["gpt2", "phi3", "qwen3", "qwen3_moe", "bloom", "opt", "falcon", "t5"])


# -- nn.Sequential models ------------------------------------------------------------------------

IN_FEATURES, MLP_WIDTH, CLASSES = 16, 64, 10


def build_mlp(seed: int = 0, depth: int = 4) -> Tuple[nn.Module, TransformerConfig]:
    """A flat ``nn.Sequential`` MLP: Linear-GELU x ``depth`` between an input and an output linear."""
    torch.manual_seed(seed)
    body = [m for _ in range(depth) for m in (nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.GELU())]
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, MLP_WIDTH), nn.GELU(), *body, nn.LayerNorm(MLP_WIDTH), nn.Linear(MLP_WIDTH, CLASSES)
    )
    return model, TransformerConfig(
        name="seq-mlp", vocab_size=CLASSES, hidden=MLP_WIDTH, layers=depth, heads=1, seq_len=1
    )


def build_cnn(seed: int = 0, depth: int = 4) -> Tuple[nn.Module, TransformerConfig]:
    """A flat ``nn.Sequential`` CNN: a stem, ``depth`` Conv-GroupNorm-ReLU units and a classifier."""
    torch.manual_seed(seed)
    body = [m for _ in range(depth) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU())]
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), *body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, CLASSES)
    )
    return model, TransformerConfig(name="seq-cnn", vocab_size=CLASSES, hidden=16, layers=depth, heads=1, seq_len=1)


def mlp_data(gen: torch.Generator, batch: int):
    return torch.randn(batch, IN_FEATURES, generator=gen), torch.randint(0, CLASSES, (batch,), generator=gen)


def image_data(gen: torch.Generator, batch: int):
    return torch.randn(batch, 3, 8, 8, generator=gen), torch.randint(0, CLASSES, (batch,), generator=gen)


def class_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the batch (the harness's loss for classifiers)."""
    return F.cross_entropy(output, target)
