"""``TransformerConfig``: shape and flavour of every model in the zoo (GPT-2/3, BERT, Llama, MoE)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from nest_fx.common.errors import ModelError
from nest_fx.common.limits import MAX_LAYERS


@dataclass
class TransformerConfig:
    """Shape and flavour of a transformer; every zoo model is one of these.

    ``ffn_hidden`` defaults to 4*hidden (GELU) or the Llama rule 8/3*hidden rounded up to a
    multiple of 256 (SwiGLU). ``num_experts > 0`` turns every ``moe_every``-th MLP into a
    mixture of experts with ``top_k`` routing.
    """

    vocab_size: int = 32000
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    seq_len: int = 2048
    norm: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    activation: str = "swiglu"  # "swiglu" | "gelu"
    position: str = "rope"  # "rope" | "learned"
    bias: bool = False
    tie_embeddings: bool = False
    causal: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    num_experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 1.0
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.ffn_hidden is None:
            if self.activation == "swiglu":
                self.ffn_hidden = 256 * math.ceil(int(8 * self.hidden / 3) / 256)
            else:
                self.ffn_hidden = 4 * self.hidden
        problems = []
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "seq_len", "top_k",
                     "moe_every"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.layers > MAX_LAYERS:
            problems.append(f"layers={self.layers} is above the limit of {MAX_LAYERS} (nest_fx.common.limits."
                            "MAX_LAYERS: tracing takes about 20 ms per layer; is it a typo?)")
        if self.num_experts < 0:
            problems.append(f"num_experts must be >= 0 (0 = dense), got {self.num_experts}")
        if not 0 <= self.norm_eps < math.inf:
            problems.append(f"norm_eps must be a finite number >= 0, got {self.norm_eps}")
        for name in ("rope_theta", "capacity_factor"):
            if not 0 < getattr(self, name) < math.inf:
                problems.append(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.heads > 0 and self.hidden % self.heads:
            problems.append(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.kv_heads > 0 and self.heads % self.kv_heads:
            problems.append(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.norm not in ("rmsnorm", "layernorm"):
            problems.append(f"norm={self.norm!r}: use 'rmsnorm' or 'layernorm'")
        if self.activation not in ("swiglu", "gelu"):
            problems.append(f"activation={self.activation!r}: use 'swiglu' or 'gelu'")
        if self.position not in ("rope", "learned"):
            problems.append(f"position={self.position!r}: use 'rope' or 'learned'")
        if self.num_experts > 0 and not 0 < self.top_k <= self.num_experts:
            problems.append(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if problems:
            raise ModelError("invalid TransformerConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index % self.moe_every == self.moe_every - 1

    def to_dict(self) -> dict:
        return asdict(self)
