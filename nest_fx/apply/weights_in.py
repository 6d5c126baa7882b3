"""Readers of pretrained weights that read only the slices a rank asks for.

``open_weights(path)`` opens one of

* a safetensors file, or a directory of them: HF's sharded layout with
  ``model.safetensors.index.json`` (its ``weight_map`` names the file of each tensor), a single
  ``model.safetensors``, or any ``*.safetensors`` files in the directory;
* a torch state-dict file (``torch.save(model.state_dict(), PATH)``; a dict holding one under
  ``"state_dict"`` or ``"model"`` is accepted), memory-mapped, so slicing reads only the pages of
  the slice.

Every reader lists ``{name: (shape, dtype)}`` from the file headers alone (``specs``), reads a
box ``read(name, offsets, sizes)`` of a tensor, or fills a tensor with one
(``read_into(name, offsets, sizes, out)``, converting to ``out``'s dtype: what
``apply/materialize.py`` uses, so a rank's shard is written in place with no whole-box copy).
Safetensors files are not memory-mapped: each box is read with ``os.preadv``, only its bytes,
and dropped from the page cache after (:mod:`nest_fx.apply.safetensors_read`).
``bytes_read`` counts what a rank read (tests and ``scripts/bench_*`` compare it with the rank's
share). A nest-fx checkpoint directory is not read here: the runtime loads it through
:func:`nest_fx.apply.checkpoint.load_checkpoint` (:func:`is_nest_fx_checkpoint`).
"""

from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from nest_fx.apply.checkpoint_files import META_FILE, is_checkpoint_root
from nest_fx.apply.checks import ApplyError
from nest_fx.apply.safetensors_read import SafetensorsFile, read_header
from nest_fx.common.fileio import read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

Spec = Tuple[Tuple[int, ...], torch.dtype]


def is_nest_fx_checkpoint(path: str) -> bool:
    """Whether ``path`` is a nest-fx checkpoint directory (a root of step directories or one step)."""
    return os.path.isdir(path) and (is_checkpoint_root(path) or os.path.exists(os.path.join(path, META_FILE)))


def _box(offsets: Sequence[int], sizes: Sequence[int]) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


class SafetensorsWeights:
    """A safetensors file or directory (see the module docstring), read box by box with
    ``os.preadv`` straight into the destination (:mod:`nest_fx.apply.safetensors_read`)."""

    def __init__(self, path: str):
        self.path = path
        self._files: Dict[str, SafetensorsFile] = {}
        self._where: Dict[str, SafetensorsFile] = {}
        self._specs: Dict[str, Spec] = {}
        self._staging: List[Optional[torch.Tensor]] = [None]
        for file in self._paths(path):
            try:
                entries = read_header(file)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ApplyError(
                    f"weights={path}: {os.path.basename(file)} is not a readable safetensors file "
                    f"({type(exc).__name__}: {exc}); fix: write it again with save_pretrained or "
                    "safetensors.torch.save_file"
                ) from None
            handle = self._files[file] = SafetensorsFile(file, entries)
            for name, entry in entries.items():
                if entry.dtype is None:
                    raise ApplyError(
                        f"weights={path}: tensor {name} in {os.path.basename(file)} has dtype "
                        f"{entry.dtype_name}, which nest-fx does not read; fix: convert the file to "
                        "a floating-point dtype"
                    )
                self._specs[name] = (entry.shape, entry.dtype)
                self._where[name] = handle

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data read so far (each box's own bytes)."""
        return sum(f.bytes_read for f in self._files.values())

    @staticmethod
    def _paths(path: str) -> List[str]:
        if os.path.isfile(path):
            return [path]
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            weight_map = read_json(index, ApplyError, "safetensors index").get("weight_map") or {}
            files = sorted({os.path.join(path, f) for f in weight_map.values()})
            missing = [f for f in files if not os.path.exists(f)]
            if missing:
                raise ApplyError(
                    f"weights={path}: {INDEX_FILE} names {len(missing)} file(s) that are not there "
                    f"({', '.join(os.path.basename(f) for f in missing[:3])}); fix: copy the whole "
                    "directory"
                )
            return files
        single = os.path.join(path, SINGLE_FILE)
        return [single] if os.path.exists(single) else sorted(glob.glob(os.path.join(path, "*.safetensors")))

    def specs(self) -> Dict[str, Spec]:
        """{name: (shape, dtype)} of every tensor, from the headers."""
        return dict(self._specs)

    def file_of(self, name: str) -> str:
        """The file holding tensor ``name``."""
        return self._where[name].path

    def read_into(self, name: str, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor) -> None:
        """Fill ``out`` (shape ``sizes``; converted to its dtype) with the box ``[offsets, offsets +
        sizes)`` of tensor ``name``, reading only the box's bytes and no whole-box copy."""
        self._where[name].read_into(name, offsets, sizes, out, self._staging)

    def read(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of tensor ``name`` (only its bytes are read)."""
        out = torch.empty(list(sizes), dtype=self._specs[name][1])
        self.read_into(name, offsets, sizes, out)
        return out

    def close(self) -> None:
        """Close the files and free the staging buffer (a later read opens them again)."""
        for f in self._files.values():
            f.close()
        self._staging[0] = None


class StateDictWeights:
    """A torch state-dict file, memory-mapped."""

    def __init__(self, path: str):
        self.path = path
        self.bytes_read = 0
        try:
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # torch raises many types for a file it cannot read
            raise ApplyError(
                f"weights={path}: not a safetensors file, a directory of them, a torch state dict "
                f"or a nest-fx checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                "fix: pass a model directory written by save_pretrained or a torch.save'd "
                "state_dict"
            ) from None
        for key in ("state_dict", "model"):
            if isinstance(obj, dict) and isinstance(obj.get(key), dict):
                obj = obj[key]
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise ApplyError(
                f"weights={path}: the file holds a {type(obj).__name__}, not a state dict of tensors; "
                "fix: torch.save(model.state_dict(), PATH)"
            )
        self._tensors: Dict[str, torch.Tensor] = obj

    def specs(self) -> Dict[str, Spec]:
        return {name: (tuple(t.shape), t.dtype) for name, t in self._tensors.items()}

    def file_of(self, name: str) -> str:
        """The file holding tensor ``name``: the state-dict file."""
        return self.path

    def read(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        t = self._tensors[name]
        out = t[_box(offsets, sizes)] if sizes else t
        self.bytes_read += out.numel() * out.element_size()
        return out.clone()

    def read_into(self, name: str, offsets: Sequence[int], sizes: Sequence[int], out: torch.Tensor) -> None:
        """Copy the box into ``out`` (converted to its dtype) with no intermediate tensor."""
        t = self._tensors[name]
        box = t[_box(offsets, sizes)] if sizes else t
        self.bytes_read += box.numel() * box.element_size()
        out.copy_(box.reshape(out.shape))

    def close(self) -> None:
        """Nothing to close (the mapping goes with the reader)."""


def open_weights(path: str):
    """A reader for ``path``: safetensors (file or directory) or a torch state-dict file."""
    if not os.path.exists(path):
        raise ApplyError(
            f"weights={path}: no such file or directory; fix: pass the directory save_pretrained "
            "wrote, a .safetensors file or a torch state-dict file"
        )
    if os.path.isdir(path):
        reader = SafetensorsWeights(path)
        if not reader.specs():
            raise ApplyError(
                f"weights={path}: the directory holds no *.safetensors file and is not a nest-fx "
                "checkpoint; fix: pass the directory save_pretrained wrote"
            )
        return reader
    if path.endswith(".safetensors"):
        return SafetensorsWeights(path)
    try:
        return StateDictWeights(path)
    except ApplyError:
        try:  # a safetensors file under another name
            return SafetensorsWeights(path)
        except Exception:
            pass
        raise
