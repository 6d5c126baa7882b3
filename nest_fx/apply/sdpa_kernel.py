"""``plan.attention_kernel``: the fused attention kernel PyTorch's SDPA runs on CUDA, pinned.

The cost model prices fused attention at the measured rate of one kernel (``workload/roofline.py``,
``SDPA_ATTENTION``: cuDNN's attention at about twice FlashAttention-2's rate on Hopper). Which kernel
``F.scaled_dot_product_attention`` picks depends on the installed torch and the cuDNN it bundles
(cuDNN first on Hopper/Blackwell from torch 2.11, FlashAttention-2 before), so the runtime does not
leave it to chance: forward and backward of every training step run under the plan's kernel as
SDPA's first choice (``torch.nn.attention.sdpa_kernel(..., set_priority=True)`` over the backends
:func:`sdpa_order` allows); a backward runs the kernel its forward ran, and a recomputed forward runs
inside the step. A call the kernel cannot run (fp32 inputs, an arbitrary mask, a head size it lacks)
falls back to the next allowed kernel. On CPU nothing changes (SDPA has its own CPU kernels; no CUDA rate is priced there).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, List

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from nest_fx.workload.roofline import DEFAULT_ATTENTION_KERNEL

_FIRST = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
_UNFUSED = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_order(kernel: str) -> List[SDPBackend]:
    """SDPA's backends a plan with ``attention_kernel=kernel`` lets run, first choice first ('' = the
    default kernel): cudnn, then flash and the unfused kernels for calls cuDNN cannot run; flash, then
    the unfused kernels only. cuDNN is left out of flash's list because torch >= 2.11 on Hopper picks
    it ahead of any priority order when it is allowed (measured on an H200: the backward node of an
    SDPA call under ``sdpa_kernel([FLASH, CUDNN, ...], set_priority=True)`` was cuDNN's)."""
    first = _FIRST[kernel or DEFAULT_ATTENTION_KERNEL]
    fallbacks = [SDPBackend.FLASH_ATTENTION] if first == SDPBackend.CUDNN_ATTENTION else []
    return [first] + fallbacks + list(_UNFUSED)


def pinned_attention(kernel: str, device: torch.device) -> ContextManager:
    """A context in which SDPA on ``device`` runs ``kernel`` first (no-op off CUDA)."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(sdpa_order(kernel), set_priority=True)
