"""Shared by the RMSNorm-kernel tests (plan.norm_kernel; nest_fx/apply/fused_norms.py,
nest_fx/apply/output_saving_norm.py, nest_fx/workload/fused_norms.py): the tiny Llamas, the
workload at Llama 3 8B's shape ratios the norm-cost tests price (and a block's norm facts), a
counter of the norm calls made (and the parity run counting them per rank), a model's loss and
gradients, and the bytes autograd saves in a forward."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from nest_fx.apply import fused_norms
from nest_fx.apply.output_saving_norm import OutputSavingRMSNorm
from nest_fx.models import build_seeded
from nest_fx.models.layers import RMSNorm
from nest_fx.cluster import load_cluster
from nest_fx.testing import equivalence
from nest_fx.workload import workload_for_model

LLAMA = "llama:hidden=64,layers=2,heads=4,seq=32,vocab=128"
HF_LLAMA = "hf:llama:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=128"
COST_LLAMA = "llama:hidden=64,layers=4,heads=4,seq=32,vocab=128"  # the norm-cost tests' small model
# Llama 3 8B's shape ratios (ffn 3.5 h, 4 query heads per key/value head), small enough to trace fast
LLAMA_SHAPED = "llama:hidden=512,layers=2,heads=8,kv=2,ffn=1792,vocab=1024,seq=1024"
SHAPED_S, SHAPED_H = 1024, 512  # its sequence length and hidden size


def shaped_workload():
    """The workload of :data:`LLAMA_SHAPED` on 8 H100s (bf16)."""
    return workload_for_model(LLAMA_SHAPED, load_cluster("dgx-h100:8"))


def block_norms(work):
    """(the traced source, its first transformer block, that block's facts) of ``work``."""
    src = work.source
    block = next(b for b in src.graph.blocks if b.kind == "block")
    return src, block, src.facts(block.index)


class NormCalls(TorchFunctionMode):
    """Counts, under it, the ``F.rms_norm`` calls made with autograd on (``rms_norm``; not the
    recognizer's probe, which runs without gradients), the swapped fused norms' out-of-place
    formula calls (``out_of_place``: what ``fused_norms.fused_rms_norm`` runs off CUDA instead of
    ``F.rms_norm``; ``fused`` = both) and the forwards of the output-saving norm
    (``OutputSavingRMSNorm.forward``). The last two are wrapped while the counter is entered."""

    def __init__(self):
        super().__init__()
        self.rms_norm = 0
        self.out_of_place = 0
        self.output_saving = 0
        self._forward = self._out_of_place = None

    @property
    def fused(self) -> int:
        """The norms run as ``F.rms_norm`` or as its out-of-place formula by the fused swap."""
        return self.rms_norm + self.out_of_place

    def __enter__(self):
        self._forward = forward = OutputSavingRMSNorm.forward
        self._out_of_place = out_of_place = fused_norms.rms_norm_out_of_place

        def counted(ctx, *args):
            self.output_saving += 1
            return forward(ctx, *args)

        def counted_out_of_place(*args, **kwargs):
            self.out_of_place += 1
            return out_of_place(*args, **kwargs)

        OutputSavingRMSNorm.forward = staticmethod(counted)
        fused_norms.rms_norm_out_of_place = counted_out_of_place  # fused_rms_norm looks it up per call
        return super().__enter__()

    def __exit__(self, *exc):
        OutputSavingRMSNorm.forward = staticmethod(self._forward)
        fused_norms.rms_norm_out_of_place = self._out_of_place
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.rms_norm, torch.rms_norm) and torch.is_grad_enabled():
            self.rms_norm += 1
        return func(*args, **(kwargs or {}))


def build_torch_norm_llama(seed: int = 0) -> Tuple[nn.Module, Any]:
    """A picklable ``build(seed)`` for ``equivalence``: the zoo :data:`LLAMA` with every RMSNorm
    replaced by ``torch.nn.RMSNorm`` (not swapped by ``norm_kernel`` ''/fused: it calls
    ``F.rms_norm`` itself), weights drawn around 1 so the norms' gradients show."""
    model, cfg = build_seeded(LLAMA, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, module in list(model.named_modules()):
        if isinstance(module, RMSNorm):
            norm = nn.RMSNorm(module.weight.shape[0], eps=module.eps)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=gen))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, norm)
    return model, cfg


def fused_counted(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``equivalence(spec)`` with the number of fused norm calls this rank made (``rms_norm_calls``:
    ``F.rms_norm``, off CUDA its out-of-place formula: ``NormCalls.fused``; the single-device
    reference runs the model's own code: it makes none unless that is ``torch.nn.RMSNorm``) and of
    out-of-place ones alone (``out_of_place_calls``)."""
    calls = NormCalls()
    with calls:
        out = equivalence(spec)
    out["rms_norm_calls"] = calls.fused
    out["out_of_place_calls"] = calls.out_of_place
    return out


def check_fused_calls(results: List[Dict[str, Any]], calls: Optional[int]) -> None:
    """Every rank of ``fused_counted`` made ``calls`` fused norm calls (None: some)."""
    for r in results:
        if calls is None:
            assert r["rms_norm_calls"] > 0, r["rms_norm_calls"]
        else:
            assert r["rms_norm_calls"] == calls, r["rms_norm_calls"]


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
