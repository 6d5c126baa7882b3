"""Fused projections under tensor parallelism: how a rank's shard maps to the original tensor.

A fused projection stores several projections along one dim: HF Phi-3's ``qkv_proj`` is
``[q; k; v]`` (with fewer key/value heads than query heads under GQA), ``gate_up_proj`` is
``[gate; up]``, GPT-2's ``c_attn`` is ``[q | k | v]`` along the columns of its ``Conv1D``
weight, Qwen3-MoE's experts fuse ``[gate; up]`` in a 3-D tensor. Tensor parallelism must give
each rank whole heads of *every* part, so rank ``r`` keeps chunk ``r`` of each part, in part
order: ``[q_r; k_r; v_r]``. That is not a contiguous slice of the tensor.

Representation (decided here, documented in docs/runtime.md): the parameter is a DTensor
``Shard(dim)`` whose *global* tensor is the rank-major concatenation of the local shards, i.e.
the original tensor with its rows along ``dim`` permuted by :meth:`FusedLayout.order`. Every
DTensor operation that does not care about the order (optimizer steps, gradient clipping,
FSDP on top, DP gradient reduction) works unchanged. The two places that expose the global
tensor under the original name undo the permutation: ``ParallelModule.full_tensors`` and the
checkpoint, which writes and reads the rank's rows as the runs of the *original* tensor they
are (:class:`FusedCheckpointTensor`), so checkpoints hold plan-independent tensors in the
model's own layout and load under any plan or on one device. The permutation depends only on
the part sizes and ``tp``, recorded per parameter in :func:`register_layout`.

A multi-query projection (Falcon's ``query_key_value``: query heads, then one key and one value
head all query heads share) keeps its shared parts *whole* on every rank (``FusedLayout.whole``):
rank ``r`` holds ``[q_r; k; v]``, the global tensor holds the shared rows ``tp`` times, and the
two places above write each shared part once, at its original offset (:func:`saved_shape` gives
the original shape the checkpoint compares against).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

LAYOUT_ATTR = "_nest_fx_fused_layouts"


@dataclass(frozen=True)
class FusedLayout:
    """Parts of sizes ``parts`` along ``dim``, each cut into ``tp`` contiguous chunks, except the
    parts listed in ``whole``, which every rank holds entirely (a multi-query projection's shared
    key/value heads: ``graph/tp_multi_query.py``). With whole parts the DTensor's global tensor
    holds those rows ``tp`` times (once per rank), so it is longer than the original along ``dim``;
    every rank's copy is the same (their gradient is summed over the TP group)."""

    dim: int
    parts: Tuple[int, ...]
    tp: int
    whole: Tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """Entries along ``dim`` of the original tensor."""
        return sum(self.parts)

    def original_shape(self, shape) -> torch.Size:
        """The original tensor's shape from the DTensor's (global) ``shape``."""
        out = list(shape)
        out[self.dim] = self.size
        return torch.Size(out)

    def rank_rows(self, rank: int) -> List[int]:
        """Original indices (along ``dim``) of rank ``rank``'s shard, in its local order."""
        rows, base = [], 0
        for k, size in enumerate(self.parts):
            if k in self.whole:
                rows.extend(range(base, base + size))
            else:
                per = size // self.tp
                rows.extend(range(base + rank * per, base + (rank + 1) * per))
            base += size
        return rows

    def whole_rows(self) -> List[int]:
        """Positions in a rank's local shard (along ``dim``) of the rows every rank holds whole."""
        rows, pos = [], 0
        for k, size in enumerate(self.parts):
            n = size if k in self.whole else size // self.tp
            if k in self.whole:
                rows.extend(range(pos, pos + n))
            pos += n
        return rows

    def order(self) -> torch.Tensor:
        """Original index of each position of the sharded (rank-major) layout."""
        return torch.tensor([i for r in range(self.tp) for i in self.rank_rows(r)], dtype=torch.long)

    def to_original(self, sharded_full: torch.Tensor) -> torch.Tensor:
        """The full tensor in the model's own layout from the full tensor of the DTensor."""
        order = self.order().to(sharded_full.device)
        out = sharded_full.new_empty(self.original_shape(sharded_full.shape))
        out.index_copy_(self.dim, order, sharded_full)
        return out

    def local(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of an original (unsharded) tensor."""
        chunks = [
            part if k in self.whole else part.chunk(self.tp, self.dim)[rank]
            for k, part in enumerate(tensor.split(list(self.parts), self.dim))
        ]
        return torch.cat(chunks, self.dim).contiguous()

    def runs(self, start: int, length: int) -> List[Tuple[int, int, int]]:
        """(offset in the sharded layout, offset in the original, length) of the contiguous runs
        covering sharded positions ``[start, start + length)``."""
        order = self.order().tolist()
        # a whole part is a run of its own, so every rank names its copy by the same offset (the
        # checkpoint writes it once: DCP drops identical write items)
        bounds = [0]
        for size in self.parts:
            bounds.append(bounds[-1] + size)
        starts = {bounds[k] for k in self.whole} | {bounds[k + 1] for k in self.whole}
        out: List[Tuple[int, int, int]] = []
        for pos in range(start, start + length):
            if out and out[-1][1] + out[-1][2] == order[pos] and order[pos] not in starts:
                s, o, n = out[-1]
                out[-1] = (s, o, n + 1)
            else:
                out.append((pos, order[pos], 1))
        return out


def register_layout(module: nn.Module, param_name: str, layout: FusedLayout) -> None:
    """Record that ``module.<param_name>`` is stored in the sharded layout ``layout``."""
    layouts = module.__dict__.setdefault(LAYOUT_ATTR, {})
    layouts[param_name] = layout


def fused_layouts(modules: Iterable[nn.Module]) -> Dict[str, FusedLayout]:
    """{parameter FQN: layout} of the fused parameters under ``modules`` (stage chunks)."""
    found: Dict[str, FusedLayout] = {}
    for root in modules:
        for path, sub in root.named_modules():
            for name, layout in sub.__dict__.get(LAYOUT_ATTR, {}).items():
                found[f"{path}.{name}" if path else name] = layout
    return found


def original_layout(tensor: torch.Tensor, layout: Optional[FusedLayout]) -> torch.Tensor:
    """``tensor`` (an unsharded value of a parameter) in the model's own layout."""
    return tensor if layout is None else layout.to_original(tensor)


def original_boxes(tensor: DTensor, layout: Optional[FusedLayout]) -> List[Tuple[List[int], List[int], int]]:
    """The boxes of the original (unsharded, model-layout) tensor that this rank's local shard of
    ``tensor`` holds: ``(offsets, sizes, start)`` each, ``start`` being where the box begins in
    the local shard along ``layout.dim`` (one box at 0 for a plain slice, ``layout`` None).
    Used by the checkpoint and by the weights reader (``apply/materialize.py``)."""
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if list(tensor.to_local().shape) != list(local_shape):
        raise ValueError(
            f"unexpected local shape {tuple(tensor.to_local().shape)} of a sharded parameter "
            f"(expected {tuple(local_shape)})"
        )
    if layout is None:
        return [(list(offset), list(local_shape), 0)]
    dim = layout.dim
    boxes: List[Tuple[List[int], List[int], int]] = []
    for sharded, original, length in layout.runs(offset[dim], local_shape[dim]):
        offsets, sizes = list(offset), list(local_shape)
        offsets[dim], sizes[dim] = original, length
        boxes.append((offsets, sizes, sharded - offset[dim]))
    return boxes


class FusedCheckpointTensor(torch.Tensor):
    """A fused DTensor as DCP sees it: the original tensor, of which this rank holds the runs
    :meth:`FusedLayout.runs` names (DCP's ``__create_write_items__`` / ``__create_chunk_list__`` /
    ``__get_tensor_shard__`` protocol). Reads land in the DTensor's local storage. A tensor
    subclass without storage of the original's shape (DCP looks shards up on tensors only); it
    takes part in checkpoints only: any other operation on it raises."""

    source: DTensor
    fused_layout: FusedLayout

    @staticmethod
    def __new__(cls, tensor: DTensor, layout: FusedLayout):
        return torch.Tensor._make_wrapper_subclass(
            cls, layout.original_shape(tensor.shape), dtype=tensor.dtype, device=tensor.device
        )

    def __init__(self, tensor: DTensor, layout: FusedLayout):
        super().__init__()
        self.source = tensor  # the parameter or optimizer state (DTensor) this view reads and writes
        self.fused_layout = layout
        self._local = tensor.to_local()
        self._boxes = original_boxes(tensor, layout)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func}: a fused parameter's checkpoint view takes part in checkpoints only")

    def _chunk(self, offsets, sizes) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        props = TensorProperties.create_from_tensor(self._local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=self._chunk(offsets, sizes), properties=props, size=self.shape),
            )
            for offsets, sizes, _ in self._boxes
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [self._chunk(offsets, sizes) for offsets, sizes, _ in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, sizes, local_start in self._boxes:
            if index.offset is None or list(index.offset) == offsets:
                return self._local.narrow(self.fused_layout.dim, local_start, sizes[self.fused_layout.dim])
        raise ValueError(f"no shard at offset {index.offset} of fused parameter {index.fqn}")


def saved_shape(tensor: torch.Tensor, layout: Optional[FusedLayout]) -> torch.Size:
    """The shape ``tensor`` (a parameter or optimizer state of its shape) has in a checkpoint: the
    original tensor's (a DTensor holding whole parts is longer along ``layout.dim``)."""
    if layout is None or not isinstance(tensor, DTensor):
        return tensor.shape
    return layout.original_shape(tensor.shape)


def checkpoint_view(tensor, layout: Optional[FusedLayout]):
    """What the checkpoint hands DCP for a parameter (or optimizer state of its shape): the
    tensor itself, or a :class:`FusedCheckpointTensor` when it is stored fused."""
    if layout is None or not isinstance(tensor, DTensor):
        return tensor
    return FusedCheckpointTensor(tensor, layout)
