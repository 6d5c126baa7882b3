"""One entry point for every model name the command line and the runtime take.

``build_any`` builds a zoo name (``llama2-7b``), a spec (``gpt:hidden=..,layers=..``), a plain
PyTorch model (``mlp:...``, ``cnn:...``) or a HuggingFace model from its config (``hf:...``,
``hf-config:PATH``) and example inputs for it; ``model_example`` says what the model takes and
how it is trained (``nest_fx.models.inputs``); ``build_seeded`` builds one on the CPU in fp32
from a seed, the reference a parallel run is compared with.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch

from nest_fx.common.errors import ModelError
from nest_fx.models.config import TransformerConfig
from nest_fx.models.hf import build_hf_model
from nest_fx.models.inputs import Example, call_args, hf_example, make_tensor, token_example
from nest_fx.models.plain import KINDS as PLAIN_KINDS, build_plain, parse_plain, plain_example
from nest_fx.models.zoo import build_model as build_zoo_model, default_dtype


def is_hf_name(name: str) -> bool:
    return name.startswith(("hf:", "hf-config:"))


def is_plain_name(name: str) -> bool:
    return name.partition(":")[0] in PLAIN_KINDS


def model_example(
    name: str,
    model: torch.nn.Module,
    cfg: Any,
    *,
    batch: int = 1,
    seq: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    seq_cap: Optional[int] = None,
) -> Example:
    """What ``model`` (built from ``name``) takes and how it trains, for ``batch`` rows of ``seq``
    tokens (default: the config's sequence length; for HF models with longer contexts 32, or with
    ``seq_cap`` the config's positions up to ``seq_cap``: ``inputs.hf_example``)."""
    if is_plain_name(name):
        return plain_example(cfg, batch, dtype or torch.float32)
    if is_hf_name(name):
        seq_len = getattr(cfg, "seq_len", None)
        if seq and seq_len and seq > seq_len:
            raise ModelError(
                f"seq={seq} exceeds {name}'s {seq_len} positions: use --seq <= {seq_len} or a larger seq= in the spec"
            )
        example = hf_example(model, batch, seq or seq_len, seq_cap=seq_cap)
        if dtype is not None:  # image inputs in the model's dtype
            example.inputs = [s if s.high else replace(s, dtype=dtype) for s in example.inputs]
        return example
    return token_example(batch, seq or cfg.seq_len, cfg.vocab_size)


def build_any(
    name: str,
    *,
    batch: int = 1,
    seq: Optional[int] = None,
    device: str | torch.device = "meta",
    dtype: Optional[torch.dtype] = None,
    layers: Optional[int] = None,
    seq_cap: Optional[int] = None,
) -> Tuple[torch.nn.Module, Any, tuple, Dict[str, Any]]:
    """Model, config and example inputs (no labels) for a zoo name, a spec, a plain model or ``hf:...``.

    Returns ``(model, config, args, kwargs)``; HF models take their inputs (``input_ids``, ...) as
    keywords. ``layers`` overrides the depth (the profiler builds one instance of each distinct block);
    ``seq_cap``: see :func:`model_example`.
    """
    depth = {"layers": layers} if layers is not None else {}
    if is_plain_name(name):
        cfg: Any = parse_plain(name)
        with torch.device(device), default_dtype(dtype):
            model = build_plain(cfg)
    elif is_hf_name(name):
        model, cfg = build_hf_model(name, device=device, dtype=dtype, **depth)
    else:
        model, cfg = build_zoo_model(name, device=device, dtype=dtype, **depth)
        seq = seq or cfg.seq_len
        if seq > cfg.seq_len and cfg.position == "learned":
            raise ModelError(
                f"seq={seq} exceeds {cfg.name}'s {cfg.seq_len} learned positions: use --seq <= {cfg.seq_len}"
            )
        if seq > cfg.seq_len:
            model, cfg = build_zoo_model(name, device=device, dtype=dtype, seq_len=seq, **depth)
    example = model_example(name, model, cfg, batch=batch, seq=seq, dtype=dtype, seq_cap=seq_cap)
    args, kwargs = call_args(example, {s.name: make_tensor(s, device) for s in example.inputs})
    return model, cfg, args, kwargs


def build_seeded(name: str, seed: int = 0) -> Tuple[torch.nn.Module, Any]:
    """(model, config) of any name ``build_any`` takes, on the CPU in fp32, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    if is_plain_name(name):
        cfg: Any = parse_plain(name)
        return build_plain(cfg), cfg
    if is_hf_name(name):
        model, cfg = build_hf_model(name, device="cpu", dtype=torch.float32)
        if isinstance(cfg, TransformerConfig):  # the nest-fx-shaped families: one attention kernel
            model.config._attn_implementation = "sdpa"
        return model, cfg
    return build_zoo_model(name, device="cpu", dtype=torch.float32)


def build_model(
    name: str, *, device: str | torch.device = "meta", dtype: Optional[torch.dtype] = None, **overrides
) -> Tuple[torch.nn.Module, Any]:
    """``(model, config)`` of any name the command line takes: a zoo name or ``gpt:`` spec, a plain
    model (``mlp:``, ``cnn:``), ``hf:<model_type>[:...]`` or ``hf-config:PATH``. On ``meta`` (the
    default) nothing is allocated: ``auto_parallelize(model, ..., weights=...)`` then materialises
    each rank's part (docs/runtime.md, "Start on meta, load pretrained weights"). ``overrides``:
    config fields of a zoo model (``seq_len=...``) or ``layers`` for any transformer."""
    if is_hf_name(name) or is_plain_name(name):
        unknown = sorted(set(overrides) - {"layers"})
        if unknown:
            raise ModelError(
                f"build_model({name!r}): {unknown} apply to zoo models only; put config fields in the "
                "name instead (hf:qwen2:hidden_size=128)"
            )
        if is_plain_name(name):
            cfg: Any = parse_plain(name)
            with torch.device(device), default_dtype(dtype):
                return build_plain(cfg), cfg
        return build_hf_model(name, device=device, dtype=dtype, layers=overrides.get("layers"))
    return build_zoo_model(name, device=device, dtype=dtype, **overrides)
