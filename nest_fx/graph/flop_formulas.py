"""FLOP formulas ``torch.utils.flop_counter.FlopCounterMode`` lacks (the CPU SDPA kernel, grouped
matmuls), so a trace counts every op's FLOPs whatever device its parameters are on."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import sdpa_flop_count


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# FlopCounterMode has formulas for the CUDA attention kernels but not for the one SDPA picks for
# CPU tensors, which would count attention as 0 FLOPs when the model's parameters are on CPU
# (on meta or CUDA the same model counts them). Same formula as the CUDA kernels.
EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop}


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A grouped matmul of ``a [S, K]`` with ``b [G, K, N]`` (row groups by offsets; each row meets
    one group's matrix): 2*S*K*N. Other operand ranks (3-D x 3-D batched groups): 2 * the output
    numel * K."""
    k = a_shape[-1]
    out = 1
    for d in out_shape or [a_shape[0], b_shape[-1]]:
        out *= d
    return 2 * out * k


def flop_formulas() -> dict:
    """FLOP formulas FlopCounterMode lacks: the CPU SDPA kernel, grouped matmuls (``aten._grouped_mm``;
    HuggingFace MoE experts' ``transformers::grouped_mm_fallback``, registered once transformers'
    MoE integration is imported), so experts count the FLOPs of the tokens they really compute."""
    formulas = dict(EXTRA_FLOP_FORMULAS)
    formulas[torch.ops.aten._grouped_mm] = _grouped_mm_flop
    fallback = getattr(getattr(torch.ops, "transformers"), "grouped_mm_fallback", None)
    if fallback is not None:
        formulas[fallback] = _grouped_mm_flop
    return formulas
