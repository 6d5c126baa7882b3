"""``plan.norm_kernel``: the model's RMSNorms run as PyTorch's fused ``F.rms_norm``.

A module :func:`nest_fx.graph.rms_norms.rms_norm_kind` recognises as the model's own code for
``F.rms_norm`` (HF's ``LlamaRMSNorm``, Meta's reference, the zoo's: fp32 op by op) gets, with
``norm_kernel`` '' or ``fused`` (the default), a forward that calls ``F.rms_norm(x, (d,), weight,
eps)``: one kernel forward and one backward on CUDA (``aten._fused_rms_norm``), keeping the input
and an fp32 statistic per row for backward instead of fp32 copies. ``norm_kernel=model`` runs the
model's code as written. Only the forward changes: the parameter, its name, the state dict and
checkpoints stay the model's.

The swapped forward runs the model's own forward instead where ``F.rms_norm`` would compute
something else or where nest-fx shards the norm:

* the input and the weight differ in dtype (HF's ``weight * x.to(input_dtype)`` promotes a bf16
  input times an fp32 weight to fp32; ``F.rms_norm`` would return bf16);
* the input or the weight is a DTensor: norms under sequence parallelism (``SequenceParallel``:
  the input sharded on the sequence, the weight replicated, its gradient a partial sum the TP
  style all-reduces) and per-head norms inside a TP region. These are not swapped at all
  (:func:`use_fused_norms` skips a module whose weight is already a DTensor) and the cost model
  prices them as the model's ops (``workload/fused_norms.py``).
"""

from __future__ import annotations

import types
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from nest_fx.graph.rms_norms import MODEL, module_eps, rms_norm_kind

FUSED_NORM_KERNELS = ("", "fused")  # plan.norm_kernel values that swap the recognised norms


def _fused_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    weight = self.weight
    if args or kwargs or isinstance(x, DTensor) or isinstance(weight, DTensor) or x.dtype != weight.dtype:
        return self._nest_fx_model_forward(x, *args, **kwargs)
    return F.rms_norm(x, self._nest_fx_norm_shape, weight, self._nest_fx_norm_eps)


def use_fused_norms(module: nn.Module) -> List[str]:
    """Swap the forward of every recognised RMSNorm of the model's own code in ``module`` (those
    whose weight is not a DTensor, i.e. not sharded by tensor parallelism) to ``F.rms_norm``;
    their names, in ``module``'s order. A module swapped before is left as it is."""
    swapped = []
    for name, sub in module.named_modules():
        if "_nest_fx_model_forward" in sub.__dict__ or isinstance(getattr(sub, "weight", None), DTensor):
            continue
        if rms_norm_kind(sub) != MODEL:
            continue
        sub._nest_fx_model_forward = sub.forward
        sub._nest_fx_norm_shape = tuple(sub.weight.shape)
        sub._nest_fx_norm_eps = module_eps(sub)
        sub.forward = types.MethodType(_fused_forward, sub)
        swapped.append(name)
    return swapped


def swaps_norms(norm_kernel: str) -> bool:
    """Whether a plan with ``norm_kernel`` runs the recognised norms as ``F.rms_norm``."""
    return (norm_kernel or "") in FUSED_NORM_KERNELS
