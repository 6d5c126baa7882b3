"""Loss functions the runtime and its tests train with."""
from __future__ import annotations

import torch
import torch.nn.functional as F

def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross entropy of [B, S, V] logits against [B, S] targets."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
