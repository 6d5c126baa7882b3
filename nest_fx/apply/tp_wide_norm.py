"""Whole-width norms under tensor parallelism: a norm over all of a projection's features (OLMo2's
``q_norm = RMSNorm(heads * head_dim)`` on ``q_proj``'s output), run on one rank's features.

The column linear before it leaves each rank ``1/tp`` of the features (whole heads); the norm's
statistic needs all of them. :class:`WholeWidthNorm` shards the norm's parameters like the
projection's columns (found by ``graph.tp_wide_norms``) and runs the module's *own* forward on
the local features and weight slice, with each statistic over the features made global: a mean
over the last dim becomes the all-reduced sum of the ranks' partial sums divided by the full
width (``F.rms_norm`` and ``F.layer_norm`` are computed from such means). Why the statistic and
not the features (an all-gather, normalise, re-slice): the sum of squares is a sum, so the
all-reduced partial sums are the full-width sum (exact up to the order of the fp32 additions),
the message is one fp32 value per token instead of ``(tp-1)/tp`` of the projection, and no rank
computes the norm on features it then discards. The gradient of the statistic is all-reduced
back (each rank's is the part its own features contribute), the same size. The cost model
prices both all-reduces (``workload.block_facts``: ``tokens x 4`` bytes per statistic and
direction).
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.overrides import TorchFunctionMode

from nest_fx.apply.tp_styles import local_parameters, shard_parameter
from nest_fx.graph.opgraph import TPParam
from nest_fx.graph.tp_regions import localise_normalized_shape, localise_wide_norm


class _SumOverTP(torch.autograd.Function):
    """Sum of the TP ranks' partial statistics; the gradient (each rank's share of it) is summed back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def _last_dim_only(dim, ndim: int) -> bool:
    dims = [dim] if isinstance(dim, int) else list(dim) if dim is not None else list(range(ndim))
    return [d % ndim for d in dims] == [ndim - 1]


class _GlobalStatistics(TorchFunctionMode):
    """Inside a whole-width norm's forward: means over the last dim of a tensor of the rank's
    ``local`` features, and ``F.rms_norm`` / ``F.layer_norm`` over it, computed over all ``tp``
    ranks' features; every other call runs as written."""

    _MEANS = (torch.mean, torch.Tensor.mean)
    # norm functions -> their parameters in order (bound from positional and keyword arguments)
    _NORMS = {
        F.rms_norm: ("input", "normalized_shape", "weight", "eps"),
        torch.rms_norm: ("input", "normalized_shape", "weight", "eps"),
        F.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps"),
        torch.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps"),
    }

    def __init__(self, group, tp: int, local: int):
        super().__init__()
        self.group, self.tp, self.local = group, tp, local

    def mean(self, x: torch.Tensor, keepdim: bool = True, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        total = _SumOverTP.apply(x.sum(-1, keepdim=True, dtype=dtype), self.group)
        out = total / (x.shape[-1] * self.tp)
        return out if keepdim else out.squeeze(-1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.local:
            return func(*args, **kwargs)
        if func in self._MEANS:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if not _last_dim_only(dim, x.dim()):
                raise RuntimeError(
                    f"a whole-width norm under tensor parallelism takes a mean over dims {dim}; "
                    "nest-fx gathers means over the last dim only"
                )
            keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            return self.mean(x, keepdim, kwargs.get("dtype"))
        if func in self._NORMS:
            bound = {**dict(zip(self._NORMS[func], args)), **kwargs}
            shape = bound.get("normalized_shape")
            if len(shape) != 1:
                raise RuntimeError(
                    f"a whole-width norm under tensor parallelism normalises over {list(shape)}; "
                    "nest-fx gathers statistics over the last dim only"
                )
            return self.norm(
                x,
                bound.get("weight"),
                bound.get("bias"),
                bound.get("eps"),
                layer=func in (F.layer_norm, torch.layer_norm),
            )
        return func(*args, **kwargs)

    def norm(self, x: torch.Tensor, weight, bias, eps, layer: bool) -> torch.Tensor:
        """``F.layer_norm`` (``layer``: mean and variance) or ``F.rms_norm`` over all ranks' features."""
        if layer:
            x = x - self.mean(x)
            eps = 1e-5 if eps is None else eps
        elif eps is None:
            eps = torch.finfo(x.dtype).eps
        out = x * torch.rsqrt(self.mean(x * x) + eps)
        out = out * weight if weight is not None else out
        return out + bias if bias is not None else out


class WholeWidthNorm(ParallelStyle):
    """Shard a whole-width norm's parameters (``params``: {name: TPParam}) like the projection
    it normalises and run its forward on the local features with global statistics (module
    docstring). Its input and output are the rank's local features (plain tensors)."""

    def __init__(self, params: Dict[str, TPParam]):
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, spec in self.params.items():
            shard_parameter(module, name, spec, device_mesh)
        # nn.LayerNorm / nn.RMSNorm: the rank's features, as the TP rehearsal's and the profiler's copies
        if "weight" in self.params:
            localise_normalized_shape(module, module.weight.to_local().shape[-1])
        else:
            localise_wide_norm(module, device_mesh.size())
        names: Sequence[str] = list(self.params)
        tp, group = device_mesh.size(), device_mesh.get_group()
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            # its input is the rank's features of the projection: their count is the local width
            with local_parameters(module, names), _GlobalStatistics(group, tp, x.shape[-1]):
                return inner(*args, **kwargs)

        module.forward = forward
        return module
