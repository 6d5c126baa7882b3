"""Shared by the RMSNorm-kernel tests (plan.norm_kernel; nest_fx/apply/fused_norms.py,
nest_fx/apply/output_saving_norm.py): the tiny Llamas, a counter of the norm calls made, a
model's loss and gradients, and the bytes autograd saves in a forward."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from nest_fx.apply.output_saving_norm import OutputSavingRMSNorm

LLAMA = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"
HF_LLAMA = "hf:llama:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=128"


class NormCalls(TorchFunctionMode):
    """Counts, under it, the ``F.rms_norm`` calls made with autograd on (not the recognizer's
    probe, which runs without gradients) and the forwards of the output-saving norm
    (``OutputSavingRMSNorm.forward``, wrapped while the counter is entered)."""

    def __init__(self):
        super().__init__()
        self.rms_norm = 0
        self.output_saving = 0
        self._forward = None

    def __enter__(self):
        self._forward = forward = OutputSavingRMSNorm.forward

        def counted(ctx, *args):
            self.output_saving += 1
            return forward(ctx, *args)

        OutputSavingRMSNorm.forward = staticmethod(counted)
        return super().__enter__()

    def __exit__(self, *exc):
        OutputSavingRMSNorm.forward = staticmethod(self._forward)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.rms_norm, torch.rms_norm) and torch.is_grad_enabled():
            self.rms_norm += 1
        return func(*args, **(kwargs or {}))


def loss_and_grads(model: nn.Module, tokens: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The mean square of the model's logits (in fp32) and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    out = model(tokens)
    logits = out.logits if hasattr(out, "logits") else out
    loss = logits.float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def saved_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """The bytes of the activations autograd saves in a forward of ``model`` on ``tokens``: every
    storage a saved tensor lives in, counted once (views share their base's storage), parameters
    left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    del out  # the storages stay alive until here: no data_ptr is reused within the forward
    return sum(storages.values())
