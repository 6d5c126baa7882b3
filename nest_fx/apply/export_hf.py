"""Export to the HuggingFace format: ``ParallelModule.save_pretrained`` and ``nest-fx export``.

``save_pretrained(pm, DIR, max_shard_size="5GB")`` writes, under any plan, the files
:mod:`nest_fx.apply.hf_format` describes (safetensors shards, their index, ``config.json``).
It reuses the checkpoint's way of getting full tensors out of any plan, and holds no more than
one output file's tensors on any rank:

1. every rank plans the same files from the whole model's names and shapes (``model_specs``);
2. the files are written in rounds of ``world`` files. In a round every rank writes the
   tensors it holds of the round's files with ``torch.distributed.checkpoint``, exactly as a
   checkpoint does (TP / FSDP / EP shards as the chunks of the global tensor they are,
   fused projections in the model's own layout, replicated and tied copies once, each pipeline
   stage its own tensors), into a scratch directory inside the export's temporary directory;
   then rank ``i`` reads back the full tensors of the round's ``i``-th file (only those bytes),
   converts the names as HF saves them and writes the safetensors file, and the scratch
   directory is deleted. The scratch space is at most ``world`` files.
3. rank 0 writes the index and ``config.json`` and renames the temporary directory to ``DIR``.

Every failure is agreed on (:func:`nest_fx.apply.agreement.agree`): all ranks raise the same
:class:`~nest_fx.apply.hf_format.ExportError` and ``DIR`` is left as it was. ``DIR`` must be on
a filesystem every rank sees (as a checkpoint directory must).

``export_checkpoint(CKPT, DIR, model=...)`` does the same in one process from a nest-fx
checkpoint: the files are read straight from the checkpoint's DCP shards, one output file at a
time; the tensor names and shapes come from the checkpoint, the HF class and config from
``model`` (a ``transformers`` model, e.g. built on ``meta`` from the spec the plan recorded).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Dict, Iterable, List, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from nest_fx.apply.agreement import agree, distributed
from nest_fx.apply.checkpoint import FLAT, model_specs, read_meta, resolve, run_dcp, state_to_save
from nest_fx.apply.checkpoint_files import check_hashes, check_sizes
from nest_fx.apply.collective_errors import named_collective_failures
from nest_fx.apply.fingerprint import TensorSpec, difference, fingerprint, tensor_specs
from nest_fx.apply.hf_format import (
    DEFAULT_MAX_SHARD_SIZE,
    ExportError,
    ExportLayout,
    export_layout,
    hf_class_and_config,
    prepare_destination,
    publish_destination,
    write_config,
    write_file,
)

__all__ = ["save_pretrained", "export_checkpoint", "ExportError"]

SCRATCH = ".dcp-round-{:05d}"
MODEL_PREFIX = "model."


def read_full(directory: str, names: Iterable[str], specs: Mapping[str, TensorSpec]) -> Dict[str, torch.Tensor]:
    """The full tensors ``names`` (the model's own names) from the DCP files in ``directory``,
    read in this process alone (only the bytes of those tensors), in their saved dtype."""
    state = {f"{MODEL_PREFIX}{n}": torch.empty(tuple(specs[n][0]), dtype=getattr(torch, specs[n][1])) for n in names}
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(directory), planner=DefaultLoadPlanner(**FLAT), no_dist=True)
    return {n: state[f"{MODEL_PREFIX}{n}"] for n in names}


def _file_sources(layout: ExportLayout, file: str) -> List[str]:
    """The model's own names of the tensors one output file is made from."""
    return [layout.origin[s] for s in layout.file_sources(file)]


def _write_one(
    layout: ExportLayout, directory: str, file: str, source_dir: str, specs: Mapping[str, TensorSpec]
) -> int:
    tensors = read_full(source_dir, _file_sources(layout, file), specs)
    renamed = {s: tensors[layout.origin[s]] for s in layout.file_sources(file)}
    del tensors
    return write_file(layout, directory, file, renamed)


def _config_dtype(layout: ExportLayout, specs: Mapping[str, TensorSpec]) -> torch.dtype:
    """The dtype ``config.json`` names: the export's, or the first floating tensor's."""
    if layout.dtype is not None:
        return layout.dtype
    floating = [getattr(torch, d) for _, d in specs.values() if getattr(torch, d).is_floating_point]
    return floating[0] if floating else torch.float32


def _finish(layout: ExportLayout, tmp: str, final: str, hf_model) -> None:
    if hf_model is not None and hf_model[0] is not None:
        write_config(tmp, hf_model, _config_dtype(layout, layout.source_specs))
    publish_destination(tmp, final, layout.index())


def save_pretrained(
    target,
    directory: str,
    max_shard_size=DEFAULT_MAX_SHARD_SIZE,
    *,
    overwrite: bool = False,
    dtype: Optional[torch.dtype] = None,
) -> str:
    """Write ``target`` (a ParallelModule) to ``directory`` in the HuggingFace format; returns it.

    Collective: every rank calls it with the same arguments. ``max_shard_size``: bytes per
    safetensors file (``"5GB"``, ``"500MiB"`` or an int). ``overwrite``: replace an existing
    non-empty ``directory`` as a whole (otherwise refused). ``dtype``: write floating tensors in
    this dtype (default: the parameters' own). See the module docstring."""
    final = os.path.abspath(os.fspath(directory))
    rank = dist.get_rank() if distributed() else 0
    world = dist.get_world_size() if distributed() else 1
    specs = model_specs(target)
    hf_model = hf_class_and_config(getattr(target, "chunks", [target])[0])
    layout, tmp, error = None, None, None
    fields = {
        "export directory": final,
        "max_shard_size": str(max_shard_size),
        "overwrite": overwrite,
        "dtype": str(dtype),
        "model fingerprint": fingerprint(specs),
    }
    try:
        layout = export_layout(specs, max_shard_size, hf_model, dtype=dtype)
        if rank == 0:
            tmp = prepare_destination(final, overwrite)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    tmp = agree(fields, what=f"exporting to {final}", error=error, error_cls=ExportError, shared=tmp)[0]
    try:
        with named_collective_failures(f"exporting to {final}"):
            _write_rounds(target, layout, tmp, specs, rank, world)
            error = None
            if rank == 0:
                try:
                    _finish(layout, tmp, final, hf_model)
                except Exception as e:  # noqa: BLE001 - agreed on below
                    error = ExportError(
                        f"exporting to {final}: putting the files in place failed ({e}); {final} is as it was"
                    )
            agree({}, what=f"exporting to {final}", error=error, error_cls=ExportError)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_rounds(
    target, layout: ExportLayout, tmp: str, specs: Mapping[str, TensorSpec], rank: int, world: int
) -> None:
    """Step 2 of the module docstring: ``world`` files per round, file ``i`` of a round by rank ``i``."""
    files = list(layout.files)
    held = state_to_save(target, None)  # {"model.<name>": local tensor or shard view}; nothing is copied
    for k, first in enumerate(range(0, len(files), world)):
        batch = files[first : first + world]
        scratch = os.path.join(tmp, SCRATCH.format(k))
        wanted = {f"{MODEL_PREFIX}{n}" for f in batch for n in _file_sources(layout, f)}
        state = {key: value for key, value in held.items() if key in wanted}
        run_dcp(dcp.save, state, storage_writer=FileSystemWriter(scratch), planner=DefaultSavePlanner(**FLAT))
        error = None
        if rank < len(batch):
            try:
                _write_one(layout, tmp, batch[rank], scratch, specs)
            except Exception as e:  # noqa: BLE001 - agreed on below
                error = ExportError(f"writing {batch[rank]} failed ({type(e).__name__}: {e}); nothing was exported")
        agree({}, what=f"writing {', '.join(batch)}", error=error, error_cls=ExportError)
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)


def checkpoint_specs(meta: dict, source: str) -> Dict[str, TensorSpec]:
    """{name: (shape, dtype)} of the model a checkpoint holds (its recorded tensors)."""
    tensors = (meta.get("model") or {}).get("tensors")
    if not tensors:
        raise ExportError(
            f"{source} does not record its model's tensors (an older nest-fx checkpoint); fix: load it "
            "into the model and call pm.save_pretrained(DIR)"
        )
    return {n: (tuple(int(d) for d in s), d_) for n, (s, d_) in tensors.items()}


def export_checkpoint(
    path: str,
    directory: str,
    model: Optional[nn.Module] = None,
    max_shard_size=DEFAULT_MAX_SHARD_SIZE,
    *,
    overwrite: bool = False,
    dtype: Optional[torch.dtype] = None,
    verify: bool = True,
) -> str:
    """Write the model of the nest-fx checkpoint ``path`` (a checkpoint directory: its newest
    complete checkpoint; or a step directory) to ``directory`` in the HuggingFace format, in this
    process, one output file at a time. ``model``: the model (any device, ``meta`` is enough) whose
    class and config name the files and give ``config.json``; None keeps the checkpoint's names
    and writes no config. The checkpoint's files are checked against its manifest first
    (sizes; hashes when ``verify``). Returns ``directory``."""
    final = os.path.abspath(os.fspath(directory))
    source, manifest = resolve(os.path.abspath(os.fspath(path)))
    if manifest is not None:  # None: a legacy checkpoint without one (nothing to check against)
        check_sizes(source, manifest)
        if verify:
            check_hashes(source, manifest, sorted(manifest["files"]))
    meta = read_meta(source)
    specs = checkpoint_specs(meta, source)
    hf_model = hf_class_and_config(model) if model is not None else None
    if model is not None:
        own = tensor_specs(model)
        if fingerprint(own) != fingerprint(specs):
            raise ExportError(
                f"{source} holds another model than the one given ({difference(specs, own)}); fix: "
                "pass the model the checkpoint was trained with (--model SPEC)"
            )
    layout = export_layout(specs, max_shard_size, hf_model, dtype=dtype)
    tmp = prepare_destination(final, overwrite)
    try:
        for file in layout.files:
            _write_one(layout, tmp, file, source, specs)
        _finish(layout, tmp, final, hf_model)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
