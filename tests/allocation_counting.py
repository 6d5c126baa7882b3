"""Counting the memory a piece of code allocates on CPU, where no allocator statistics exist."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class FreshBytes(TorchDispatchMode):
    """Bytes of the new storages the ops run under it allocate: outputs sharing no input's storage
    (an in-place op or a view allocates nothing). ``with FreshBytes() as count: ...; count.bytes``."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out
