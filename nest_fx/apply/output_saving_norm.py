"""``plan.norm_kernel=memory-efficient``: an RMSNorm that keeps its output for backward, not its input.

``F.rms_norm``'s autograd keeps the input, the weight and one fp32 ``rstd`` per row. In a pre-norm
transformer the norm's output is kept anyway by the projections that read it (the q/k/v or
gate/up linears save their input), so a norm that recovers its normalised input from its output,
``xhat = y / weight``, costs only its ``rstd`` (4 bytes per row) beyond what is saved already:
one copy of its input less, 2 bytes per token per hidden unit per norm in bf16. NVIDIA apex's
``FusedRMSNorm(memory_efficient=True)`` and Megatron-LM's ``--memory-efficient-layer-norm`` keep
the output the same way.

:class:`OutputSavingRMSNorm` computes ``y`` and ``rstd`` with ``aten._fused_rms_norm`` on CUDA
(the op ``F.rms_norm`` runs there: one kernel), elsewhere with the same fp32 formula op by op
(``y`` equals ``F.rms_norm``'s bitwise on CPU), and saves only ``(y, rstd, weight)``. Backward,
in fp32 (fp64 for fp64 inputs), op by op: ``xhat = y / w``, ``g = dy * w``, ``c = mean(dy * y)``
over the row (``= mean(g * xhat)``), ``dx = rstd * (g - xhat * c)`` and ``dw = sum over rows of
dy * xhat = (sum over rows of dy * y) / w``. It is not one fused kernel (apex's is): on CUDA it
makes about 8 elementwise passes over the rows where ``F.rms_norm``'s backward makes one.

A weight entry that is exactly 0 makes its output column 0 whatever the input, so ``xhat``
cannot be recovered there: the runtime refuses such a norm on every rank, checking the weight
it starts training from (``apply/norm_weights.py``: the model's, the ``weights=`` file's, the
initialisation's of a model started on meta, before the first collective; a checkpoint's, after
the load) with :func:`zero_weight_problem`, :class:`ZeroNormWeightError`. A weight that becomes exactly 0
during training (an optimizer step landing on 0.0) is not checked on every call (that would be a
host synchronisation per norm): its backward divides 0 by 0 and the gradients of that norm's
input and weight turn NaN. nest-fx's training loop has no per-step non-finite check of its own:
the loss turns NaN with them, and ``ParallelModule.save_checkpoint`` refuses to save a NaN loss
or parameter (``require_finite``, ``apply/checkpoint.py``), so the previous checkpoint is kept.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from nest_fx.apply.checks import ApplyError

FIX = "fix: norm_kernel '' (fused)"


class ZeroNormWeightError(ApplyError):
    """An RMSNorm's weight has zero entries: ``norm_kernel=memory-efficient`` cannot recover its
    input from its output there."""


def _rms_norm_and_rstd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: Optional[float]):
    """(``F.rms_norm(x, (d,), weight, eps)``, its rstd (fp32; fp64 for fp64) shaped ``x.shape[:-1] + (1,)``).
    On CUDA one kernel, ``aten._fused_rms_norm`` (what ``F.rms_norm`` runs there); elsewhere
    :func:`rms_norm_out_of_place`."""
    if x.device.type == "cuda":
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        return y, rstd.to(_opmath(x.dtype)).reshape(*x.shape[:-1], 1)
    return rms_norm_out_of_place(x, weight, eps)


def rms_norm_out_of_place(x: torch.Tensor, weight: Optional[torch.Tensor], eps: Optional[float] = None):
    """(``F.rms_norm(x, (d,), weight, eps)``, its rstd shaped ``x.shape[:-1] + (1,)``) computed op
    by op, out of place, in the opmath dtype (fp32; fp64 for fp64), under autograd when called
    with it. Off CUDA ``F.rms_norm`` has no fused kernel and decomposes into ops, some in place
    (``add_``, ``rsqrt_`` on the mean), which selective activation checkpointing refuses ("Tensor
    cached during selective activation checkpoint has been mutated"); this is the same fp32
    formula without them (its output equals ``F.rms_norm``'s bitwise on CPU:
    ``tests/unit/apply/test_output_saving_norm.py``)."""
    acc = _opmath(x.dtype)
    if eps is None:
        eps = torch.finfo(acc).eps  # F.rms_norm's default: its opmath type's epsilon
    xa = x.to(acc)
    rstd = torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    y = xa * rstd
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype), rstd


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype F.rms_norm computes in for ``dtype`` (PyTorch's opmath type): fp64 stays fp64,
    every other floating dtype computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class OutputSavingRMSNorm(torch.autograd.Function):
    """RMSNorm over the last dimension that saves its output, its fp32 ``rstd`` and its weight
    (not its input) for backward. ``weight`` may be None (no elementwise affine)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], eps: Optional[float]) -> torch.Tensor:
        y, rstd = _rms_norm_and_rstd(x, weight, eps)
        ctx.save_for_backward(y, rstd, weight)
        return y

    @staticmethod
    @once_differentiable  # training needs no double backward (its dx is written with out=)
    def backward(ctx, dy: torch.Tensor):
        # dx = rstd (g - xhat c) with xhat = y / w, g = dy w, c = mean(dy y); dw = sum_rows(dy y) / w.
        # Op by op in the opmath dtype, each elementwise pass reading the bf16 tensors directly
        # (type promotion) and the product dy * y shared by c and dw: 8 passes over the rows.
        y, rstd, weight = ctx.saved_tensors
        acc = _opmath(y.dtype)
        d = y.shape[-1]
        dyf = dy.to(acc)
        p = dyf * y  # dy * y: the rows' c and, summed over rows, dw * w
        dx = dw = None
        if ctx.needs_input_grad[0]:
            c = p.mean(-1, keepdim=True)
            if weight is None:
                q = dyf - y * c
            else:
                wf = weight.to(acc)
                q = (dyf * wf).addcmul_(y / wf, c, value=-1)
            dx = torch.mul(q, rstd, out=torch.empty_like(y))  # cast to the input's dtype as it is written
        if weight is not None and ctx.needs_input_grad[1]:
            dw = (p.reshape(-1, d).sum(0) / weight.to(acc)).to(weight.dtype)
        return dx, dw, None


def output_saving_rms_norm(
    x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor], eps: Optional[float] = None
) -> torch.Tensor:
    """``F.rms_norm(x, normalized_shape, weight, eps)`` (the same values) through
    :class:`OutputSavingRMSNorm`; only a normalised shape of the last dimension alone."""
    require_last_dim("output_saving_rms_norm", normalized_shape, x)
    return OutputSavingRMSNorm.apply(x, weight, eps)


def require_last_dim(fn: str, normalized_shape: Sequence[int], x: torch.Tensor) -> None:
    """ValueError unless ``normalized_shape`` is ``x``'s last dimension alone (what ``fn``, an
    RMSNorm of this package, normalises)."""
    if len(normalized_shape) != 1 or int(normalized_shape[0]) != x.shape[-1]:
        raise ValueError(
            f"{fn} normalises the last dimension only: normalized_shape={tuple(normalized_shape)} "
            f"for an input of shape {tuple(x.shape)}"
        )


def zero_weight_problem(name: str, weight: Optional[torch.Tensor], where: str = "") -> str:
    """Why the norm ``name`` cannot keep its output instead of its input ('' when it can): its
    weight has entries exactly 0. ``where`` says where the values come from (`` in weights=PATH``);
    a DTensor is checked on this rank's shard. A weight on ``meta`` has no values yet: ''."""
    if weight is None or weight.is_meta:
        return ""
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    zeros = int((local.detach() == 0).sum())  # one host sync per norm, once, before training
    if not zeros:
        return ""
    of = f"{local.numel()} in this rank's shard" if isinstance(weight, DTensor) else f"{weight.numel()}"
    return (
        f"{name}: norm_kernel=memory-efficient recovers the norm's input from its output divided by the "
        f"weight, and the weight{where} has zero entries ({zeros} of {of}); {FIX}"
    )
