"""Loss functions the runtime and its tests train with."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_PROBE_SHAPES = ((2, 3), (1, 5))  # [B, S] of the probes: a sum or a per-sequence mean tells itself apart


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross entropy of [B, S, V] logits against [B, S] targets."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def token_cross_entropy_problem(loss_fn: Callable, vocab: int) -> str:
    """ "" when ``loss_fn(logits [B, S, V], targets [B, S])`` is :func:`lm_loss` in value and
    gradient on random probes (e.g. ``F.cross_entropy(logits.flatten(0, 1), y.flatten())``): loss
    parallelism computes exactly that from vocabulary shards; else what differs."""
    if loss_fn is lm_loss:
        return ""
    gen = torch.Generator().manual_seed(0)
    for batch, seq in _PROBE_SHAPES:
        logits = torch.randn(batch, seq, vocab, generator=gen)
        targets = torch.randint(0, vocab, (batch, seq), generator=gen)
        mine, want = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        try:
            got = loss_fn(mine, targets)
            got.backward()
        except Exception as exc:  # noqa: BLE001 - any failure on the probe means it cannot be verified
            return f"failed on a probe of [{batch}, {seq}, {vocab}] logits ({type(exc).__name__}: {exc})"
        ref = lm_loss(want, targets)
        ref.backward()
        if got.numel() != 1 or not torch.allclose(got.detach().float(), ref.detach(), rtol=1e-5, atol=1e-6):
            return (
                f"is not the token-mean cross-entropy (on a probe it gives {got.detach().flatten()[0].item():.6g}, "
                f"the cross-entropy {ref.item():.6g})"
            )
        if mine.grad is None or not torch.allclose(mine.grad.float(), want.grad, rtol=1e-5, atol=1e-7):
            return "has another gradient than the token-mean cross-entropy"
    return ""
