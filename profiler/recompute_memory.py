"""Bytes a recompute policy keeps for backward per block, measured with autograd on CPU.

:func:`kept_bytes` runs one block's forward with gradients under the runtime's own checkpoint
wrapping (``nest_fx.apply.activation_checkpoint``) and returns the bytes of the tensors the
forward created that are still alive when it returns, apart from its output: what autograd's
saved tensors, the selective-checkpoint cache and the checkpoint's holders keep for backward.
The block's input and parameters existed before and are not counted (a block input is kept by
every policy; the cost model counts it at the previous block's boundary).

How: a ``TorchDispatchMode`` sees every aten op of the forward (also the ones a
selective-checkpoint policy runs inside), records a weak reference to each output's storage,
and after the forward the live storages are summed once each. With ``recompute="none"`` this
equals what ``torch.autograd.graph.saved_tensors_hooks`` sees being packed
(:func:`packed_bytes`), the check that the two measurements agree. The cost model's
prediction of the same number is compared with it (see docs/runtime.md, Activation
checkpointing).
"""

from __future__ import annotations

import copy
import gc
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nest_fx.apply.activation_checkpoint import checkpoint_module


def _tensors(value: Any):
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor):
    return t.untyped_storage()


class _StorageRecorder(TorchDispatchMode):
    """A weak reference to the storage of every op output (an address freed during the forward
    may be reused by a later storage, so every output is recorded, not one per address)."""

    def __init__(self):
        super().__init__()
        self.storages: List[Tuple[StorageWeakRef, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            s = _storage(t)
            if s.device.type != "meta":
                self.storages.append((StorageWeakRef(s), s.data_ptr(), s.nbytes()))
        return out


def kept_bytes(block: nn.Module, inputs: Sequence[torch.Tensor], recompute: str = "none") -> int:
    """Bytes the forward of ``block`` (a copy, checkpointed per ``recompute``: none, full,
    selective, op, op:<policy>) keeps alive for backward, apart from its output (see the module
    docstring). ``inputs``: the block's positional inputs; floating ones require grad."""
    module = copy.deepcopy(block)
    checkpoint_module(module, recompute)
    args = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    before = {_storage(t).data_ptr() for t in list(module.parameters()) + list(module.buffers()) + args}
    recorder = _StorageRecorder()
    with torch.enable_grad(), recorder:
        out = module(*args)
    gc.collect()
    outputs = {_storage(t).data_ptr() for t in _tensors(out)}
    alive = {ref.cdata: (ptr, nbytes) for ref, ptr, nbytes in recorder.storages if not ref.expired()}
    del out
    return sum(nbytes for ptr, nbytes in alive.values() if ptr not in before and ptr not in outputs)


def packed_bytes(block: nn.Module, inputs: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter, non-input storages autograd packs for backward in a
    plain (un-checkpointed) forward of ``block``: ``saved_tensors_hooks``' view of ``none``."""
    args = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    skip = {_storage(t).data_ptr() for t in list(block.parameters()) + list(block.buffers()) + args}
    packed: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = _storage(t)
        if s.data_ptr() not in skip:
            packed[s.data_ptr()] = s.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(*args)
    for t in _tensors(out):
        packed.pop(_storage(t).data_ptr(), None)
    return sum(packed.values())
