"""``TransformerConfig``: shape and flavour of every model in the zoo (GPT-2/3, BERT, Llama, MoE,
DeepSeek MLA + shared experts, sliding-window attention, hybrid Mamba-2 / attention stacks)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from nest_fx.common.errors import ModelError
from nest_fx.common.limits import MAX_LAYERS

ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu2")  # gated: swiglu, geglu; ungated: gelu, relu2 (squared ReLU)
GATED = ("swiglu", "geglu")
# layer_pattern characters (Nemotron-H's hybrid_override_pattern): one residual sublayer each
PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


@dataclass
class TransformerConfig:
    """Shape and flavour of a transformer; every zoo model is one of these.

    ``ffn_hidden`` defaults to 4*hidden (ungated MLPs) or the Llama rule 8/3*hidden rounded up to a
    multiple of 256 (gated: SwiGLU, GeGLU). ``num_experts > 0`` turns every ``moe_every``-th MLP
    (after the first ``dense_layers``) into a mixture of experts with ``top_k`` routing, experts of
    ``moe_ffn_hidden`` (default ``ffn_hidden``) and ``shared_experts`` always-on experts of that width.

    ``head_dim`` (default hidden/heads) sets the attention head size on its own. ``kv_lora_rank > 0``
    makes attention multi-head latent attention (DeepSeek-V2/V3): queries through a ``q_lora_rank``
    bottleneck (0: a full-rank projection), keys and values from a ``kv_lora_rank`` latent, heads of
    ``head_dim`` (no position) + ``rope_head_dim`` (rotary, shared across heads) for q.k and
    ``v_head_dim`` for values. ``sliding_window > 0``: causal attention over the last
    ``sliding_window`` keys, on every layer or (``global_every = k``) all but every k-th layer.
    ``rope_fraction < 1``: partial RoPE, rotary positions on the first ``rotary_dim`` dims of each
    head only (GPT-NeoX / Pythia 0.25, Phi-2 0.4, ChatGLM 0.5).
    ``layer_pattern`` (Nemotron-H's hybrid pattern, repeated to ``layers``): one residual sublayer per
    character, ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` mixture of experts; empty: every
    layer is attention + MLP. ``vocab_multiple`` / ``vocab_tp``: pad the vocabulary to a multiple of
    ``vocab_multiple * vocab_tp`` (Megatron's ``--make-vocab-size-divisible-by`` times its TP degree).
    """

    vocab_size: int = 32000
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    seq_len: int = 2048
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    activation: str = "swiglu"  # one of ACTIVATIONS
    position: str = "rope"  # "rope" | "learned"
    bias: bool = False
    tie_embeddings: bool = False
    causal: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0  # share of each head's dims rotary positions rotate (partial RoPE)
    num_experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 1.0
    head_dim: Optional[int] = None
    moe_ffn_hidden: Optional[int] = None
    shared_experts: int = 0
    dense_layers: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 64
    v_head_dim: Optional[int] = None
    sliding_window: int = 0
    global_every: int = 0
    layer_pattern: str = ""
    mamba_heads: int = 0  # 0: 2 * hidden / mamba_head_dim (expand 2)
    mamba_head_dim: int = 64
    mamba_state: int = 128
    mamba_groups: int = 8
    mamba_conv: int = 4
    mamba_chunk: int = 128
    vocab_multiple: int = 1
    vocab_tp: int = 1
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.ffn_hidden is None:
            if self.activation in GATED:
                self.ffn_hidden = 256 * math.ceil(int(8 * self.hidden / 3) / 256)
            else:
                self.ffn_hidden = 4 * self.hidden
        uneven_heads = self.head_dim is None and self.heads > 0 and self.hidden % self.heads
        if self.head_dim is None:
            self.head_dim = self.hidden // self.heads if self.heads > 0 else 0
        if self.moe_ffn_hidden is None:
            self.moe_ffn_hidden = self.ffn_hidden
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        if self.mamba_heads == 0 and self.mamba_head_dim > 0:
            self.mamba_heads = max(1, 2 * self.hidden // self.mamba_head_dim)
        problems = self._problems()
        if uneven_heads:
            problems.append(f"hidden={self.hidden} is not divisible by heads={self.heads} (or set head_dim)")
        if problems:
            raise ModelError("invalid TransformerConfig: " + "; ".join(problems))

    def _problems(self) -> List[str]:
        problems = []
        for name in (
            "vocab_size",
            "hidden",
            "layers",
            "heads",
            "kv_heads",
            "ffn_hidden",
            "seq_len",
            "top_k",
            "moe_every",
            "head_dim",
            "moe_ffn_hidden",
            "v_head_dim",
            "vocab_multiple",
            "vocab_tp",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "shared_experts",
            "dense_layers",
            "q_lora_rank",
            "kv_lora_rank",
            "sliding_window",
            "global_every",
            "num_experts",
        ):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.layers > MAX_LAYERS:
            problems.append(
                f"layers={self.layers} is above the limit of {MAX_LAYERS} (nest_fx.common.limits."
                "MAX_LAYERS: tracing takes about 20 ms per layer; is it a typo?)"
            )
        if not 0 <= self.norm_eps < math.inf:
            problems.append(f"norm_eps must be a finite number >= 0, got {self.norm_eps}")
        for name in ("rope_theta", "capacity_factor"):
            if not 0 < getattr(self, name) < math.inf:
                problems.append(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.kv_heads > 0 and self.heads % self.kv_heads:
            problems.append(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.norm not in ("rmsnorm", "layernorm"):
            problems.append(f"norm={self.norm!r}: use 'rmsnorm' or 'layernorm'")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r}: use one of {', '.join(ACTIVATIONS)}")
        if self.position not in ("rope", "learned"):
            problems.append(f"position={self.position!r}: use 'rope' or 'learned'")
        if self.num_experts > 0 and not 0 < self.top_k <= self.num_experts:
            problems.append(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.position == "rope" and not self.mla and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary positions")
        if not 0 < self.rope_fraction <= 1:
            problems.append(
                f"rope_fraction must be in (0, 1] (the share of each head rotated), got {self.rope_fraction}"
            )
        elif self.position == "rope" and not self.mla and self.head_dim > 0 and self.rotary_dim < 2:
            problems.append(f"rope_fraction={self.rope_fraction} rotates no pair of head_dim={self.head_dim}")
        if self.mla and (self.rope_head_dim <= 0 or self.rope_head_dim % 2):
            problems.append(f"rope_head_dim={self.rope_head_dim} must be a positive even number with kv_lora_rank > 0")
        if self.q_lora_rank and not self.mla:
            problems.append("q_lora_rank > 0 needs kv_lora_rank > 0 (multi-head latent attention)")
        if self.sliding_window and not self.causal:
            problems.append("sliding_window needs causal attention (causal=true)")
        bad = sorted(set(self.layer_pattern) - set(PATTERN_KINDS))
        if bad:
            problems.append(
                f"layer_pattern={self.layer_pattern!r}: unknown {bad}; use M (Mamba-2), * (attention), "
                "- (MLP), E (mixture of experts)"
            )
        if "E" in self.layer_pattern and self.num_experts <= 0:
            problems.append("layer_pattern has E (mixture of experts) but num_experts=0")
        if "M" in self.layer_pattern:
            inner = self.mamba_heads * self.mamba_head_dim
            for name in ("mamba_head_dim", "mamba_state", "mamba_groups", "mamba_conv", "mamba_chunk"):
                if getattr(self, name) <= 0:
                    problems.append(f"{name} must be positive, got {getattr(self, name)}")
            if self.mamba_groups > 0 and self.mamba_heads % self.mamba_groups:
                problems.append(f"mamba_heads={self.mamba_heads} is not divisible by mamba_groups={self.mamba_groups}")
            if inner <= 0:
                problems.append("mamba_heads * mamba_head_dim must be positive")
        return problems

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def mamba_inner(self) -> int:
        """Width of a Mamba-2 layer's SSM (heads x head size: Mamba's ``d_inner``, expand x hidden)."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the LM head: ``vocab_size`` rounded up to a multiple of
        ``vocab_multiple * vocab_tp`` (Megatron-LM's rule; 1 x 1 = no padding)."""
        step = self.vocab_multiple * self.vocab_tp
        return step * math.ceil(self.vocab_size / step)

    def layer_kinds(self, index: int) -> List[str]:
        """The residual sublayers of layer ``index`` in order: ``["attention", "mlp"]`` (or ``"moe"``)
        for a transformer layer, one of ``PATTERN_KINDS``' values per ``layer_pattern`` character."""
        if self.layer_pattern:
            return [PATTERN_KINDS[self.layer_pattern[index % len(self.layer_pattern)]]]
        return ["attention", "moe" if self.is_moe_layer(index) else "mlp"]

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.num_experts > 0
            and index >= self.dense_layers
            and (index - self.dense_layers) % self.moe_every == self.moe_every - 1
        )

    @property
    def rotary_dim(self) -> int:
        """Dims of each head rotary positions rotate: ``rope_fraction`` of ``head_dim``, rounded
        down to an even number (GPT-NeoX's ``rotary_pct``, Phi's ``partial_rotary_factor``)."""
        return 2 * int(self.head_dim * self.rope_fraction // 2)

    def window_of(self, index: int) -> int:
        """Sliding window of layer ``index``'s attention (0: full causal attention)."""
        if not self.sliding_window or (self.global_every and index % self.global_every == self.global_every - 1):
            return 0
        return self.sliding_window

    def zoo_only_fields(self) -> List[str]:
        """The shapes set here that the four HuggingFace families nest-fx maps zoo configs onto
        (``models.hf.hf_config``: GPT-2, BERT, Llama, Mixtral) cannot express."""
        checks = {
            "head_dim": self.heads > 0 and self.head_dim * self.heads != self.hidden,
            "kv_lora_rank (multi-head latent attention)": self.mla,
            "shared_experts": self.shared_experts > 0,
            "moe_ffn_hidden": self.num_experts > 0 and self.moe_ffn_hidden != self.ffn_hidden,
            "dense_layers": self.dense_layers > 0,
            "sliding_window": self.sliding_window > 0,
            "layer_pattern": bool(self.layer_pattern),
            f"activation={self.activation}": self.activation in ("geglu", "relu2"),
            "vocab_multiple/vocab_tp (vocabulary padding)": self.padded_vocab != self.vocab_size,
            "rope_fraction (partial RoPE)": self.rope_fraction < 1,
        }
        return [name for name, used in checks.items() if used]

    def to_dict(self) -> dict:
        return asdict(self)
