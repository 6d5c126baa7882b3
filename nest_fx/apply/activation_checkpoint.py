"""Activation checkpointing per stage, exactly as the plan's ``recompute`` names it.

The policies (which blocks, which op kinds keep their outputs) are defined once in
:mod:`nest_fx.graph.recompute_policies`, where the cost model reads them too. This module applies
them with non-reentrant ``torch.utils.checkpoint``:

* ``full``: each block's forward runs under checkpoint: only the block input is kept;
* ``every:<k>``: the same for every k-th block of the stage (``Recompute.recomputed_blocks``);
* ``selective`` and ``op`` / ``op:<policy>``: the block runs under checkpoint with a
  ``create_selective_checkpoint_contexts`` policy deciding per aten op whether its output is
  kept (``MUST_SAVE``) or recomputed (``PREFER_RECOMPUTE``). Off CUDA the block runs (and
  re-runs) under ``fused_norms.OutOfPlaceRMSNorms``: there ``F.rms_norm`` decomposes into ops
  some of which are in place (``add_``, ``rsqrt_`` on the mean) and selective checkpointing
  refuses a tensor it cached being mutated.

The block's ``forward`` is replaced on the instance (no wrapper module), so parameter names do
not change and hooks put on the block by TP/FSDP stay outside the checkpointed region.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from nest_fx.apply.fused_norms import OutOfPlaceRMSNorms
from nest_fx.graph.recompute_policies import op_policy_fn, parse_recompute, selective_policy_fn


def _context_fn(mode: str, policy) -> Callable:
    """``context_fn`` for ``checkpoint``: a fresh selective-checkpoint context per forward."""
    if mode == "selective":
        return lambda: create_selective_checkpoint_contexts(selective_policy_fn())
    return lambda: create_selective_checkpoint_contexts(op_policy_fn(policy))


def _rms_norms_out_of_place_off_cuda(fn: Callable) -> Callable:
    """``fn`` run under :class:`OutOfPlaceRMSNorms` unless its first tensor argument is on CUDA
    (where ``F.rms_norm`` is one kernel: no mode, no per-call cost). The checkpoint re-runs the
    same function in backward, so the forward and its recompute make the same ops."""

    @functools.wraps(fn)
    def run(*args, **kw):
        first = next((a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.device.type == "cuda":
            return fn(*args, **kw)
        with OutOfPlaceRMSNorms():
            return fn(*args, **kw)

    return run


def checkpoint_module(module: nn.Module, recompute: str) -> None:
    """Make ``module``'s forward recompute in backward according to ``recompute`` (a block-level
    form: ``full``, ``selective``, ``op`` or ``op:<policy>``; ``none`` leaves it alone)."""
    spec = parse_recompute(recompute)
    if spec.kind == "every":
        raise ValueError(f"recompute={recompute!r} chooses blocks of a stage: use apply_checkpointing")
    if spec.kind == "none" or getattr(module, "_nest_fx_recompute", None):
        return
    inner = module.forward
    kwargs = {"use_reentrant": False}
    if spec.kind in ("selective", "op"):
        kwargs["context_fn"] = _context_fn(spec.kind, spec.policy)
        inner = _rms_norms_out_of_place_off_cuda(inner)

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, **kw, **kwargs)

    module.forward = forward
    module._nest_fx_recompute = recompute


def apply_checkpointing(
    module: nn.Module, blocks: Sequence[Union[str, Sequence[str]]], recompute: str, first_index: int = 0
) -> int:
    """Checkpoint the blocks of ``module`` that ``recompute`` selects; returns how many blocks.

    Each entry of ``blocks`` is one layer block: its module path, or the paths of the children a
    block groups (a layer of an ``nn.Sequential`` model; each child is checkpointed, and the
    block counts once for ``every:<k>``). ``first_index``: the position of ``blocks[0]`` among
    the stage's blocks (its earlier chunks' blocks under the interleaved schedule), so
    ``every:<k>`` counts through the stage.
    """
    spec = parse_recompute(recompute)
    chosen = set(spec.recomputed_blocks(first_index + len(blocks)))
    mode = recompute if spec.kind != "every" else "full"
    wrapped = 0
    for index, block in enumerate(blocks, start=first_index):
        if index in chosen:
            for name in [block] if isinstance(block, str) else block:
                checkpoint_module(module.get_submodule(name), mode)
            wrapped += 1
    return wrapped
