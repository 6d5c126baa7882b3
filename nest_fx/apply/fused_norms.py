"""``plan.norm_kernel``: the model's RMSNorms run as PyTorch's fused ``F.rms_norm``.

A module :func:`nest_fx.graph.rms_norms.rms_norm_kind` recognises as the model's own code for
``F.rms_norm`` (HF's ``LlamaRMSNorm``, Meta's reference, the zoo's: fp32 op by op) gets, with
``norm_kernel`` '' or ``fused`` (the default), a forward that calls ``F.rms_norm(x, (d,), weight,
eps)`` (:func:`fused_rms_norm`): one kernel forward and one backward on CUDA (``aten._fused_rms_norm``), keeping the input
and an fp32 statistic per row for backward instead of fp32 copies. ``norm_kernel=model`` runs the
model's code as written. ``norm_kernel=memory-efficient`` swaps those and ``torch.nn.RMSNorm``
modules to the RMSNorm of ``apply/output_saving_norm.py``, which keeps its output instead of its
input for backward (the output is kept anyway by the projections reading it) and refuses a norm
whose weight has zero entries (:class:`~nest_fx.apply.output_saving_norm.ZeroNormWeightError`:
the values it starts from are checked on every rank before the first collective,
``apply/norm_weights.py``; :func:`use_fused_norms` called on its own checks the values it finds). Only the forward
changes: the parameter, its name, the state dict and checkpoints stay the model's.

Off CUDA ``F.rms_norm`` has no fused kernel: it decomposes into ops, some of them in place
(``add_``, ``rsqrt_`` on the mean), and selective activation checkpointing (``recompute``
``selective``) refuses a cached tensor mutated later. There the swapped forward runs the same
fp32 formula out of place (:func:`fused_rms_norm`; equal to ``F.rms_norm`` bitwise on CPU).

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
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from nest_fx.apply.output_saving_norm import (
    ZeroNormWeightError,
    output_saving_rms_norm,
    require_last_dim,
    rms_norm_out_of_place,
    zero_weight_problem,
)
from nest_fx.graph.rms_norms import MODEL, NATIVE, module_eps, rms_norm_kind


def fused_rms_norm(
    x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor], eps: Optional[float] = None
) -> torch.Tensor:
    """``F.rms_norm(x, normalized_shape, weight, eps)`` over the last dimension: ``F.rms_norm``
    itself on CUDA (one fused kernel each way), elsewhere the same fp32 formula out of place under
    autograd (``output_saving_norm.rms_norm_out_of_place``: ``F.rms_norm`` decomposes there into
    ops some of which are in place, which selective activation checkpointing refuses)."""
    if x.device.type == "cuda":
        return F.rms_norm(x, normalized_shape, weight, eps)
    require_last_dim("fused_rms_norm", normalized_shape, x)
    return rms_norm_out_of_place(x, weight, eps)[0]


class OutOfPlaceRMSNorms(TorchFunctionMode):
    """Under it, ``F.rms_norm`` / ``torch.rms_norm`` over the last dimension of a tensor off CUDA
    (a DTensor's local device included) run :func:`fused_rms_norm`'s out-of-place formula; every
    other call runs as written. Selective activation checkpointing enters it around the blocks it
    recomputes off CUDA (``apply/activation_checkpoint.py``): the norms this module does not swap
    (``torch.nn.RMSNorm``, a norm sharded by sequence parallelism, ``F.rms_norm`` in the model's
    own forward) would otherwise decompose into in-place ops it refuses."""

    _NAMES = ("input", "normalized_shape", "weight", "eps")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm or func is torch.rms_norm:
            bound = {**dict(zip(self._NAMES, args)), **kwargs}
            x, shape = bound.get("input"), bound.get("normalized_shape")
            last_dim = isinstance(shape, (tuple, list)) and len(shape) == 1  # else F.rms_norm's own handling
            if isinstance(x, torch.Tensor) and x.device.type != "cuda" and last_dim and shape[0] == x.shape[-1]:
                return rms_norm_out_of_place(x, bound.get("weight"), bound.get("eps"))[0]
        return func(*args, **kwargs)


FUSED_NORM_KERNELS = ("", "fused")  # plan.norm_kernel values that swap the recognised norms to fused_rms_norm
MEMORY_EFFICIENT = "memory-efficient"  # ... to the output-saving RMSNorm (apply/output_saving_norm.py)
# per swapping norm_kernel: (the rms_norm_kind values swapped, the function the swapped forward calls)
_SWAPS: Dict[str, Tuple[Tuple[str, ...], Callable]] = {
    **{k: ((MODEL,), fused_rms_norm) for k in FUSED_NORM_KERNELS},
    MEMORY_EFFICIENT: ((MODEL, NATIVE), output_saving_rms_norm),
}


def _fused_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    weight = self.weight
    if args or kwargs or isinstance(x, DTensor) or isinstance(weight, DTensor) or x.dtype != weight.dtype:
        return self._nest_fx_model_forward(x, *args, **kwargs)
    return self._nest_fx_norm_fn(x, self._nest_fx_norm_shape, weight, self._nest_fx_norm_eps)


def _swappable(module: nn.Module, kinds: Tuple[str, ...]) -> Iterator[Tuple[str, nn.Module]]:
    """(name, module) of the norms of ``kinds`` in ``module`` not swapped before and whose weight
    is not a DTensor (not sharded by tensor parallelism), in ``module``'s order."""
    for name, sub in module.named_modules():
        if "_nest_fx_model_forward" in sub.__dict__ or isinstance(getattr(sub, "weight", None), DTensor):
            continue
        if rms_norm_kind(sub) in kinds:
            yield name, sub


def _refuse_zero_weights(found: Iterable[Tuple[str, nn.Module]]) -> None:
    """:class:`ZeroNormWeightError` for the first norm in ``found`` whose weight has zero entries
    (its output cannot give back its input: ``output_saving_norm.zero_weight_problem``)."""
    for name, sub in found:
        problem = zero_weight_problem(name, sub.weight)
        if problem:
            raise ZeroNormWeightError(problem)


def memory_efficient_norms(module: nn.Module, norm_kernel: str) -> List[Tuple[str, nn.Module]]:
    """(name, module) of the norms in ``module`` that ``norm_kernel`` would swap to the
    output-saving norm and that have a weight ([] unless ``memory-efficient``), in ``module``'s order."""
    if (norm_kernel or "") != MEMORY_EFFICIENT:
        return []
    return [
        (name, sub)
        for name, sub in _swappable(module, _SWAPS[MEMORY_EFFICIENT][0])
        if getattr(sub, "weight", None) is not None
    ]


def check_norm_weights(module: nn.Module, norm_kernel: str) -> None:
    """Under ``memory-efficient``, :class:`ZeroNormWeightError` naming the first norm the swap
    would take whose weight (as it is now) has zero entries; nothing under the other values.
    Weights on ``meta`` have no values yet: ``apply/norm_weights.py`` checks the values they will
    get (``weights=``, the model's initialisation, a checkpoint)."""
    _refuse_zero_weights(memory_efficient_norms(module, norm_kernel))


def output_saving_norms(module: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """(name, module) of the norms in ``module`` swapped to the output-saving norm."""
    for name, sub in module.named_modules():
        if sub.__dict__.get("_nest_fx_norm_fn") is output_saving_rms_norm:
            yield name, sub


def use_fused_norms(module: nn.Module, norm_kernel: str = "", check_weights: bool = True) -> List[str]:
    """Swap the forward of the recognised RMSNorms in ``module`` whose weight is not a DTensor
    (not sharded by tensor parallelism); their names, in ``module``'s order. ``norm_kernel`` ''
    or ``fused``: the model's own code (``MODEL``) to ``F.rms_norm``; ``memory-efficient``: those
    and ``torch.nn.RMSNorm`` (``NATIVE``) to the output-saving norm, after refusing (a
    :class:`ZeroNormWeightError` naming the first, nothing swapped) any whose weight has zero
    entries, unless ``check_weights`` is False (the runtime: ``prepare`` checked the values the
    norms start from on every rank, which may not be the values they hold now). A module swapped
    before is left as it is."""
    if not swaps_norms(norm_kernel):
        raise ValueError(f"norm_kernel={norm_kernel!r} swaps no norm (one of {sorted(_SWAPS)})")
    kinds, fn = _SWAPS[norm_kernel or ""]
    found = list(_swappable(module, kinds))
    if check_weights and (norm_kernel or "") == MEMORY_EFFICIENT:
        _refuse_zero_weights(found)
    for _, sub in found:
        sub._nest_fx_model_forward = sub.forward
        sub._nest_fx_norm_shape = tuple(sub.weight.shape)
        sub._nest_fx_norm_eps = module_eps(sub)
        sub._nest_fx_norm_fn = fn
        sub.forward = types.MethodType(_fused_forward, sub)
    return [name for name, _ in found]


def swaps_norms(norm_kernel: str) -> bool:
    """Whether a plan with ``norm_kernel`` swaps the recognised norms' forward (to ``F.rms_norm``
    or, ``memory-efficient``, to the output-saving norm)."""
    return (norm_kernel or "") in _SWAPS
