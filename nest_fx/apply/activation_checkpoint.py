"""Activation checkpointing per stage: ``none``, ``full`` or ``selective``.

``full`` wraps each block's forward in ``torch.utils.checkpoint`` (non-reentrant): only the
block input is kept and the block is recomputed in backward. ``selective`` (Korthikanti et al.
2022) recomputes only the attention core: the block runs under checkpoint with a
selective-checkpoint policy that marks the attention ops (SDPA kernels, softmax, the
attention batched matmuls), tensor factories and in-place ops ``PREFER_RECOMPUTE`` (a saved
tensor must not be mutated later) and every other op ``MUST_SAVE``, so the big
``[batch, heads, seq, seq]`` intermediates are dropped and the linears are never recomputed.

The block's ``forward`` is replaced on the instance (no wrapper module), so parameter names do
not change and hooks put on the block by TP/FSDP stay outside the checkpointed region.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")


ATTENTION_OPS = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_attention_math", "_softmax", "bmm", "baddbmm"]
# Fresh buffers are free to recreate, and a saved one would break if the model fills it in place
# (the MoE router does ``new_zeros(...).scatter_(...)``): recompute them too.
FACTORY_OPS = ["zeros", "zeros_like", "new_zeros", "new_empty", "new_full", "new_ones", "empty", "empty_like",
               "empty_strided", "full", "full_like", "ones", "ones_like", "arange", "scalar_tensor"]


def _attention_ops():
    aten = torch.ops.aten
    names = ATTENTION_OPS + FACTORY_OPS
    ops = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return ops


_ATTENTION_OPS = None


def _policy(ctx, op, *args, **kwargs):
    global _ATTENTION_OPS
    if _ATTENTION_OPS is None:
        _ATTENTION_OPS = _attention_ops()
    if op in _ATTENTION_OPS or getattr(getattr(op, "_schema", None), "is_mutable", False):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def checkpoint_module(module: nn.Module, mode: str) -> None:
    """Make ``module``'s forward recompute in backward according to ``mode``."""
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r}: use one of {MODES}")
    if mode == "none" or getattr(module, "_nest_fx_recompute", None):
        return
    inner = module.forward
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, **kw, **kwargs)

    module.forward = forward
    module._nest_fx_recompute = mode


def apply_checkpointing(module: nn.Module, block_names: Sequence[str], mode: str) -> int:
    """Checkpoint each named block of ``module``; returns how many were wrapped."""
    if mode == "none":
        return 0
    for name in block_names:
        checkpoint_module(module.get_submodule(name), mode)
    return len(block_names)
