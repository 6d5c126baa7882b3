"""One entry point for every model name the command line and the runtime take.

``build_any`` builds a zoo name (``llama2-7b``), a spec (``gpt:hidden=..,layers=..``) or a
HuggingFace model from its config (``hf:...``) and an example input for it;
``build_seeded`` builds one on the CPU in fp32 from a seed, the reference a parallel run is
compared with.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from nest_fx.common.errors import ModelError
from nest_fx.models.config import TransformerConfig
from nest_fx.models.hf import build_hf_model
from nest_fx.models.zoo import build_model, example_tokens


def build_any(name: str, *, batch: int = 1, seq: Optional[int] = None, device: str | torch.device = "meta",
              dtype: Optional[torch.dtype] = None,
              layers: Optional[int] = None) -> Tuple[torch.nn.Module, TransformerConfig, tuple, Dict[str, Any]]:
    """Model, config and example inputs for a zoo name, a spec, or ``hf:...``.

    Returns ``(model, config, args, kwargs)``; HF models take ``input_ids`` as a keyword.
    ``layers`` overrides the depth (the profiler builds one instance of each distinct block).
    """
    depth = {"layers": layers} if layers is not None else {}
    if name.startswith("hf:"):
        model, cfg = build_hf_model(name, device=device, dtype=dtype, **depth)
        if seq and seq > cfg.seq_len:
            raise ModelError(f"seq={seq} exceeds {name}'s {cfg.seq_len} positions: use --seq <= {cfg.seq_len} "
                             "or a larger seq= in the spec")
        tokens = example_tokens(batch, seq or cfg.seq_len, cfg.vocab_size, device)
        return model, cfg, (), {"input_ids": tokens}
    model, cfg = build_model(name, device=device, dtype=dtype, **depth)
    seq = seq or cfg.seq_len
    if seq > cfg.seq_len and cfg.position == "learned":
        raise ModelError(f"seq={seq} exceeds {cfg.name}'s {cfg.seq_len} learned positions: use --seq <= {cfg.seq_len}")
    if seq > cfg.seq_len:
        model, cfg = build_model(name, device=device, dtype=dtype, seq_len=seq, **depth)
    return model, cfg, (example_tokens(batch, seq, cfg.vocab_size, device),), {}


def build_seeded(name: str, seed: int = 0) -> Tuple[torch.nn.Module, TransformerConfig]:
    """(model, config) of a zoo spec or ``hf:`` name on the CPU in fp32, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    if name.startswith("hf:"):
        model, cfg = build_hf_model(name, device="cpu", dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
    else:
        model, cfg = build_model(name, device="cpu", dtype=torch.float32)
    return model, cfg
