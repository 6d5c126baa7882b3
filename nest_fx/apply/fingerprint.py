"""What a model is, as far as its saved state goes: the names, shapes and dtypes of its
parameters and persistent buffers under the original model's names, and a digest of them.

``auto_parallelize`` records it from the whole model before cutting it into stages and shards,
so every rank knows the model it trains (its own stage holds only part of it). Checkpoints
store it and refuse to load into another model (a 6-layer checkpoint into a 4-layer model), and
the ranks compare the digest before the first collective of the mesh.
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, Iterator, List, Mapping, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

TensorSpec = Tuple[Tuple[int, ...], str]  # (global shape, dtype name)


def persistent_buffers(module: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, buffer) of every persistent buffer (those a state dict holds)."""
    for path, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{path}.{name}" if path else name), buf


def tensor_specs(module: nn.Module) -> Dict[str, TensorSpec]:
    """{name: (global shape, dtype)} of the module's parameters and persistent buffers."""
    out: Dict[str, TensorSpec] = {}
    tensors = list(module.named_parameters()) + list(persistent_buffers(module))
    for name, t in tensors:
        shape = tuple(t.shape)  # a DTensor's shape is the global one
        dtype = (t.to_local() if isinstance(t, DTensor) else t).dtype
        out.setdefault(name, (tuple(int(d) for d in shape), str(dtype).replace("torch.", "")))
    return out


def fingerprint(specs: Mapping[str, TensorSpec]) -> str:
    """A digest of the names and shapes (not dtypes: a checkpoint loads into another precision)."""
    text = json.dumps(sorted((name, list(shape)) for name, (shape, _) in specs.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def state_bytes(specs: Mapping[str, TensorSpec]) -> int:
    """Bytes of the whole model's parameters and buffers."""
    total = 0
    for shape, dtype in specs.values():
        numel = 1
        for d in shape:
            numel *= d
        total += numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return total


def _names(names: List[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" (and {len(names) - most} more)" if len(names) > most else "")


def difference(saved: Mapping[str, TensorSpec], current: Mapping[str, TensorSpec]) -> str:
    """What differs between two models' tensors, for an error message ("" when they match)."""
    only_saved = sorted(set(saved) - set(current))
    only_current = sorted(set(current) - set(saved))
    reshaped = sorted(n for n in set(saved) & set(current) if tuple(saved[n][0]) != tuple(current[n][0]))
    parts = []
    if only_saved:
        parts.append(f"only in the checkpoint: {_names(only_saved)}")
    if only_current:
        parts.append(f"only in this model: {_names(only_current)}")
    if reshaped:
        n = reshaped[0]
        parts.append(f"other shapes: {_names(reshaped)} ({n}: {tuple(saved[n][0])} saved, {tuple(current[n][0])} now)")
    return "; ".join(parts)
