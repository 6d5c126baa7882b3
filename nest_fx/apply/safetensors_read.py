"""Read boxes of tensors out of a safetensors file straight into the tensors that keep them.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets
relative to the end of the header) and the tensors' bytes, row-major and little-endian. A box
``[offsets, offsets + sizes)`` of a tensor is a set of contiguous runs in the file (one per
index of the leading dimensions the box does not cover whole). :class:`SafetensorsFile` reads
each run with ``os.preadv`` into the destination itself when it is contiguous and of the
file's dtype, or else into one staging buffer of at most :data:`STAGING_BYTES` per piece of
rows, copied (and converted) into the destination. Nothing is memory-mapped: the pages read are
page cache, not the rank's resident set, and each piece's file range is dropped from the page
cache after it is copied (``posix_fadvise(DONTNEED)``), so under a memory limit that counts page
cache (a cgroup, a container) a rank's load holds its own shards plus one staging buffer.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

STAGING_BYTES = 16 * 2**20  # the largest piece read through the staging buffer at a time
_MAX_HEADER = 100 * 2**20

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class Entry:
    """One tensor of a safetensors file: its dtype name, shape and absolute byte offset."""

    __slots__ = ("dtype_name", "shape", "start")

    def __init__(self, dtype_name: str, shape: Tuple[int, ...], start: int):
        self.dtype_name, self.shape, self.start = dtype_name, shape, start

    @property
    def dtype(self) -> Optional[torch.dtype]:
        return DTYPES.get(self.dtype_name)


def read_header(path: str) -> Dict[str, Entry]:
    """{name: :class:`Entry`} of the safetensors file ``path`` (ValueError when it is not one)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise ValueError(f"header of {length} bytes (not a safetensors file?)")
        header = json.loads(fh.read(length))
        size = os.fstat(fh.fileno()).st_size
    data = 8 + length
    entries: Dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        entry = Entry(info["dtype"], shape, data + int(begin))
        dtype = entry.dtype
        if dtype is not None and (end - begin != math.prod(shape) * dtype.itemsize or data + end > size):
            raise ValueError(
                f"tensor {name}: data_offsets {info['data_offsets']} do not hold {info['dtype']} "
                f"{list(shape)} within the file's {size} bytes"
            )
        entries[name] = entry
    return entries


def box_runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> Tuple[int, Iterator[int]]:
    """(elements per run, the first element of each run in row-major order) of the box
    ``[offsets, offsets + sizes)`` of a row-major tensor of ``shape``: the trailing dimensions
    the box covers whole merge into one run with the last one it does not."""
    nd = len(shape)
    if nd == 0:
        return 1, iter([0])
    k = nd - 1
    while k > 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    run = sizes[k] * strides[k]
    base = offsets[k] * strides[k]
    leading = [range(o, o + s) for o, s in zip(offsets[:k], sizes[:k])]
    starts = (base + sum(i * st for i, st in zip(index, strides)) for index in itertools.product(*leading))
    return run, starts


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of the contiguous tensor ``t``'s storage."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class SafetensorsFile:
    """One safetensors file opened for box reads (module docstring)."""

    def __init__(self, path: str, entries: Dict[str, Entry], drop_cache: bool = True):
        self.path, self.entries, self.drop_cache = path, entries, drop_cache
        self._fd: Optional[int] = None
        self.bytes_read = 0

    def _handle(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        """Close the file (a later read opens it again)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _pread(self, view: memoryview, at: int) -> None:
        fd, done = self._handle(), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], at + done)
            if n <= 0:
                raise OSError(f"{self.path}: unexpected end of file at byte {at + done}")
            done += n
        self.bytes_read += len(view)

    def read_into(
        self,
        name: str,
        offsets: Sequence[int],
        sizes: Sequence[int],
        out: torch.Tensor,
        staging: List[Optional[torch.Tensor]],
    ) -> None:
        """Fill ``out`` (shape ``sizes``, any dtype and strides, on the CPU) with the box
        ``[offsets, offsets + sizes)`` of tensor ``name``. ``staging``: a one-element list
        holding the caller's reusable staging buffer (uint8, grown on demand)."""
        entry = self.entries[name]
        dtype, shape = entry.dtype, entry.shape
        if (
            list(out.shape) != list(sizes)
            or len(sizes) != len(shape)
            or any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape))
        ):
            raise ValueError(f"{name}: box {list(offsets)}+{list(sizes)} of {list(shape)} into {list(out.shape)}")
        if out.numel() == 0:
            return
        item = dtype.itemsize
        rows, row_elems = (sizes[0], math.prod(sizes[1:])) if sizes else (1, 1)  # () : a 0-d tensor
        per_piece = max(1, STAGING_BYTES // max(1, row_elems * item))
        for r0 in range(0, rows, per_piece):
            r = min(per_piece, rows - r0)
            piece_off = list(offsets)
            piece_sizes = list(sizes)
            if sizes:
                piece_off[0], piece_sizes[0] = offsets[0] + r0, r
                target = out.narrow(0, r0, r)
            else:
                target = out
            direct = target.is_contiguous() and target.dtype == dtype and target.device.type == "cpu"
            if direct:
                buffer = target
            else:
                need = target.numel() * item
                if staging[0] is None or staging[0].numel() < need:
                    staging[0] = torch.empty(max(need, min(STAGING_BYTES, 1 << 20)), dtype=torch.uint8)
                buffer = staging[0][:need].view(dtype).view(target.shape)
            view = _bytes_of(buffer)
            run, starts = box_runs(shape, piece_off, piece_sizes) if sizes else (1, iter([0]))
            run_bytes = run * item
            lo = hi = None
            for i, start in enumerate(starts):
                at = entry.start + start * item
                self._pread(view[i * run_bytes : (i + 1) * run_bytes], at)
                lo = at if lo is None else lo
                hi = at + run_bytes
            if not direct:
                target.copy_(buffer)
            if self.drop_cache and lo is not None:
                os.posix_fadvise(self._handle(), lo, hi - lo, os.POSIX_FADV_DONTNEED)
