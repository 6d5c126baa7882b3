"""Reference autograd functions the kernel-backend tests compare the cost model's saved bytes
with (helpers on pytest's pythonpath, not tests themselves)."""

from __future__ import annotations

import torch


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
