"""Reference autograd functions the kernel-backend tests compare the cost model's saved bytes
with (helpers on pytest's pythonpath, not tests themselves)."""

from __future__ import annotations

import dataclasses

import torch

from nest_fx.workload.kernels import KERNEL_BACKENDS


class FusedRMSNormFn(torch.autograd.Function):
    """RMSNorm keeping what a fused kernel keeps (CUDA's ``_fused_rms_norm``): its input, the
    weight and the fp32 per-row 1/rms."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = x.float().pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xf, g = x.float(), (dy * weight).float()
        dx = rstd * g - xf * rstd.pow(3) * (g * xf).mean(-1, keepdim=True)
        dw = (dy.float() * xf * rstd).reshape(-1, x.shape[-1]).sum(0)
        return dx.type_as(x), dw.type_as(weight), None


def full_fusion_block_seconds(work) -> float:
    """Forward + backward seconds of ``work``'s first block (microbatch 1, no TP) with every
    elementwise region fully fused (the compile backend at fusion 1): what compile's measured
    share is a part of."""
    src = work.source.for_runtime(kernels="compile")
    src.runtime = dataclasses.replace(src.runtime, backend=dataclasses.replace(KERNEL_BACKENDS["compile"], fusion=1.0))
    block = next(b for b in src.graph.blocks if b.kind == "block")
    return sum(f + b for f, b in src.variant_times(block, 1, 1, False, 1))
