"""Checkpoints of training state (model + optimizer) that load under any plan and world size.

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP)::

    path/.metadata, path/__<rank>_0.distcp   DCP: each tensor's global shape and the chunks each
                                            file holds (every rank writes its own shards)
    path/nest_fx_checkpoint.json             {"format": "nest-fx-ckpt/1", "step", "plan", ...}

Keys do not depend on the plan: ``model.<fqn>`` (parameters and persistent buffers under the
original model's names), ``optim.state.<fqn>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``step``, ...)
and ``optim.group.<fqn>`` (the hyperparameters of the parameter's group: ``lr``, ``betas``, ...).
A DTensor (TP or FSDP shard) is stored as its global tensor cut into the chunks the saving
ranks held, and a loading rank asks DCP for the chunks it holds now, so a checkpoint reshards
to any plan; replicated copies are written once. A pipeline stage saves and loads only its own
keys. Expert-parallel ranks hold their experts under the global indices
(``layers.1.moe.experts.5.w1.weight``), so experts reshard across ``ep`` without a special case.

Crash safety: every rank writes into ``path.tmp-<token>``; once DCP has finished (its metadata
is the last file) rank 0 writes the nest-fx metadata, renames the old ``path`` aside
(``path.old-<token>``), renames the new directory to ``path`` and deletes the old one. A crash
before the switch leaves ``path`` untouched; a crash between the two renames leaves no ``path``
but two complete siblings, and :func:`load_checkpoint` then takes the newest complete one.

Every error that only some ranks could see (a key missing on one stage) is agreed on with one
small all-gather first, so all ranks raise the same :class:`CheckpointError` instead of some of
them waiting in a collective.
"""
from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import time
import uuid
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from nest_fx.apply.fused_params import FusedCheckpointTensor, checkpoint_view, fused_layouts
from nest_fx.common.errors import NestFxError
from nest_fx.plan.summary import plan_summary

FORMAT = "nest-fx-ckpt/1"
META_FILE = "nest_fx_checkpoint.json"
DCP_META_FILE = ".metadata"


class CheckpointError(NestFxError, ValueError):
    """A checkpoint cannot be written or read; the message names the path and the fix."""


# -- what is saved ----------------------------------------------------------------------------

def _chunks(target) -> List[nn.Module]:
    """The modules holding this rank's state: a ParallelModule's stage chunks, or the module."""
    return list(getattr(target, "chunks", None) or [target])


def _persistent_buffers(module: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    for path, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{path}.{name}" if path else name), buf


def model_tensors(target) -> Dict[str, torch.Tensor]:
    """{original name: parameter or persistent buffer} this rank holds (DTensors where sharded)."""
    out: Dict[str, torch.Tensor] = {}
    for name, p in target.named_parameters():
        out.setdefault(name, p.detach())
    for chunk in _chunks(target):
        for name, buf in _persistent_buffers(chunk):
            out.setdefault(name, buf)
    return out


def _param_names(target, optimizer) -> Dict[int, str]:
    """id(parameter) -> name, for every parameter of ``optimizer`` (which must all be the target's)."""
    names = {id(p): name for name, p in target.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the module's; "
                    "fix: build the optimizer from pm.parameters() (after auto_parallelize)")
    return names


def _group_hparams(group: dict) -> bytes:
    return pickle.dumps({k: v for k, v in group.items() if k != "params"})


def _fused_views(target, state: Dict[str, Any]) -> Dict[str, Any]:
    """Fused projections sharded by heads (and their optimizer state) go to DCP as the runs of the
    original tensor this rank holds, so the files hold the model's own layout (apply/fused_params.py)."""
    layouts = fused_layouts(_chunks(target))
    for key, value in state.items():
        if key.startswith("model."):
            name = key[len("model."):]
        elif key.startswith("optim.state."):
            name = key[len("optim.state."):].rpartition(".")[0]
        else:
            continue
        if name in layouts and isinstance(value, DTensor):
            state[key] = checkpoint_view(value, layouts[name])
    return state


def _state_to_save(target, optimizer) -> Dict[str, Any]:
    return _fused_views(target, _state_dict_to_save(target, optimizer))


def _state_dict_to_save(target, optimizer) -> Dict[str, Any]:
    state: Dict[str, Any] = {f"model.{k}": v for k, v in model_tensors(target).items()}
    if optimizer is None:
        return state
    names = _param_names(target, optimizer)
    for group in optimizer.param_groups:
        hparams = _group_hparams(group)
        for p in group["params"]:
            name = names[id(p)]
            state[f"optim.group.{name}"] = hparams
            for key, value in optimizer.state.get(p, {}).items():
                if "." in key:
                    raise CheckpointError(f"optimizer state key {key!r} contains a '.'; it cannot be saved")
                state[f"optim.state.{name}.{key}"] = value
    return state


# -- what is loaded ---------------------------------------------------------------------------

def _check_shape(key: str, tensor: torch.Tensor, md, path: str) -> None:
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"{path}: {key} is not a tensor in the checkpoint; fix: load a checkpoint of this model")
    if tuple(md.size) != tuple(tensor.shape):
        raise CheckpointError(
            f"{path}: {key} has shape {tuple(md.size)} in the checkpoint but {tuple(tensor.shape)} in the model; "
            "fix: load a checkpoint saved from the same model configuration")


def _empty_state_tensor(param: torch.Tensor, md: TensorStorageMetadata, group: dict) -> torch.Tensor:
    """A tensor to load an optimizer state entry into: laid out like the parameter (same DTensor
    placements) when it has the parameter's shape, else a plain tensor (e.g. Adam's ``step``)."""
    if tuple(md.size) == tuple(param.shape):
        return torch.zeros_like(param.detach(), dtype=md.properties.dtype)
    on_device = group.get("capturable") or group.get("fused")
    device = param.device if on_device else torch.device("cpu")
    return torch.zeros(tuple(md.size), dtype=md.properties.dtype, device=device)


def _state_to_load(target, optimizer, metadata: Dict[str, Any], path: str) -> Dict[str, Any]:
    """The state dict DCP loads into: the model's own tensors (loaded in place) and fresh tensors
    for the optimizer state found in the checkpoint. Raises CheckpointError on a missing key."""
    return _fused_views(target, _state_dict_to_load(target, optimizer, metadata, path))


def _state_dict_to_load(target, optimizer, metadata: Dict[str, Any], path: str) -> Dict[str, Any]:
    state: Dict[str, Any] = {}
    missing: List[str] = []
    for name, tensor in model_tensors(target).items():
        key = f"model.{name}"
        if key not in metadata:
            missing.append(key)
            continue
        _check_shape(key, tensor, metadata[key], path)
        state[key] = tensor
    if missing:
        raise CheckpointError(
            f"{path} has no {', '.join(missing[:3])}{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}; "
            "fix: load a checkpoint of this model (keys are the original parameter names)")
    if optimizer is None:
        return state
    if not any(k.startswith("optim.") for k in metadata):
        raise CheckpointError(f"{path} holds no optimizer state (it was saved without optimizer=); fix: "
                              "load(path) without an optimizer, or save with save(path, optimizer)")
    saved: Dict[str, List[str]] = {}
    for key in metadata:
        if key.startswith("optim.state."):
            name, _, entry = key[len("optim.state."):].rpartition(".")
            saved.setdefault(name, []).append(entry)
    names = _param_names(target, optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if f"optim.group.{name}" in metadata:
                state[f"optim.group.{name}"] = b""  # replaced by the saved object
            current = optimizer.state.get(p, {})
            for entry in saved.get(name, []):
                key, md = f"optim.state.{name}.{entry}", metadata[f"optim.state.{name}.{entry}"]
                old = current.get(entry)
                if isinstance(old, torch.Tensor) and tuple(old.shape) == tuple(md.size) \
                        and old.dtype == md.properties.dtype:
                    state[key] = old
                elif isinstance(md, TensorStorageMetadata):
                    state[key] = _empty_state_tensor(p, md, group)
                else:
                    state[key] = None  # a non-tensor entry, replaced by the saved object
    return state


def _install_optimizer_state(target, optimizer, state: Dict[str, Any]) -> None:
    per_param: Dict[str, Dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith("optim.state."):
            name, _, entry = key[len("optim.state."):].rpartition(".")
            per_param.setdefault(name, {})[entry] = value.source if isinstance(value, FusedCheckpointTensor) else value
    names = _param_names(target, optimizer)
    for group in optimizer.param_groups:
        restored = None
        for p in group["params"]:
            name = names[id(p)]
            if name in per_param:
                optimizer.state[p] = per_param[name]
            else:
                optimizer.state.pop(p, None)  # no state was saved for it (never stepped)
            blob = state.get(f"optim.group.{name}")
            if restored is None and blob:
                restored = pickle.loads(blob)
        if restored:
            group.update({k: v for k, v in restored.items() if k != "params"})


# -- directories ------------------------------------------------------------------------------

def _read_meta(directory: str) -> dict:
    meta_path = os.path.join(directory, META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} is not a complete nest-fx checkpoint (no {META_FILE}: the save did not finish or this "
            "is another kind of directory); fix: load the previous checkpoint or save again") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e}); fix: load another checkpoint or save again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{meta_path}: format is {found!r}, this version reads {FORMAT!r}; fix: load it "
                              "with the nest-fx version that wrote it")
    if not os.path.isfile(os.path.join(directory, DCP_META_FILE)):
        raise CheckpointError(f"{directory} has no DCP {DCP_META_FILE} file (corrupt or partly deleted); fix: "
                              "load another checkpoint or save again")
    return meta


def _siblings(path: str) -> List[str]:
    """Leftovers of interrupted saves of ``path``: ``path.tmp-*`` and ``path.old-*``."""
    base = glob.escape(path)
    return sorted(glob.glob(f"{base}.tmp-*") + glob.glob(f"{base}.old-*"))


def resolve(path: str) -> Tuple[str, dict]:
    """(directory, metadata) of the checkpoint at ``path``. When ``path`` is missing because a save
    was interrupted between its two renames, the newest complete sibling is used (with a warning)."""
    if os.path.isdir(path):
        return path, _read_meta(path)
    if os.path.exists(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; fix: pass the directory given to save()")
    complete = []
    for candidate in _siblings(path):
        try:
            complete.append((_read_meta(candidate).get("saved_at", 0.0), candidate))
        except CheckpointError:
            continue
    if not complete:
        raise CheckpointError(f"no checkpoint at {path}; fix: check the path, or save one first with "
                              "pm.save(path, optimizer)")
    _, chosen = max(complete)
    warnings.warn(f"{path} is missing (a save was interrupted while switching directories); loading the "
                  f"complete checkpoint {chosen}", RuntimeWarning, stacklevel=3)
    return chosen, _read_meta(chosen)


def _check_destination(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"cannot save to {path}: it is a file; fix: pass a directory path")
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, META_FILE)):
        raise CheckpointError(f"refusing to replace {path}: it is a non-empty directory that is not a nest-fx "
                              "checkpoint; fix: choose a new path")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not supported on every filesystem; the rename itself is still atomic
    finally:
        os.close(fd)


def _publish(tmp: str, path: str, token: str, meta: dict) -> None:
    """Rank 0, after every rank has written: make ``tmp`` the checkpoint at ``path``."""
    with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    old = f"{path}.old-{token}"
    if os.path.isdir(path):
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    for stale in _siblings(path):  # the old checkpoint and leftovers of crashed saves
        shutil.rmtree(stale, ignore_errors=True)


# -- cross-rank agreement ---------------------------------------------------------------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _agree(error: Optional[BaseException]) -> None:
    """Raise on every rank if any rank failed (one all-gather), so no rank waits in a collective."""
    messages = [None if error is None else f"{type(error).__name__}: {error}"]
    if _distributed() and dist.get_world_size() > 1:
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(str(messages[dist.get_rank() if _distributed() else 0])) from error
    for rank, message in enumerate(messages):
        if message is not None:
            raise CheckpointError(f"rank {rank} failed: {message}")


# The keys are flat already. Unflattened, DCP also writes the non-tensor values it loads (the
# group hyperparameters) into the very dict passed to dcp.load, where they are picked up.
_FLAT = {"flatten_state_dict": False, "flatten_sharded_tensors": False}


def _dcp(fn, state: Dict[str, Any], **kwargs) -> None:
    """``dcp.save``/``dcp.load`` over the default group, or in this process alone without one."""
    if _distributed():
        fn(state, **kwargs)
        return
    with warnings.catch_warnings():  # DCP warns that it runs in one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, no_dist=True, **kwargs)


def _broadcast_token() -> str:
    token = [uuid.uuid4().hex[:12]]
    if _distributed() and dist.get_world_size() > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


# -- public -----------------------------------------------------------------------------------

def _meta(target, step: Optional[int], has_optimizer: bool) -> dict:
    plan = getattr(target, "plan", None)
    summary = None
    if plan is not None:

        summary = plan_summary(plan, getattr(target, "num_microbatches", plan.num_microbatches))
    return {"format": FORMAT, "step": None if step is None else int(step), "saved_at": time.time(), "optimizer": has_optimizer,
            "world_size": dist.get_world_size() if _distributed() else 1, "plan_summary": summary,
            "plan": plan.to_dict() if plan is not None else None, "torch": torch.__version__}


def save_checkpoint(target, path: str, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    step: Optional[int] = None) -> str:
    """Write the model (and ``optimizer``) state of ``target`` to the directory ``path``.

    ``target``: a ParallelModule or a plain ``nn.Module``. Collective: every rank calls it with
    the same ``path``. The previous checkpoint at ``path`` is replaced only once the new one is
    complete. Returns the absolute path.
    """
    path = os.path.abspath(os.fspath(path))
    rank = dist.get_rank() if _distributed() else 0
    state, error = None, None
    try:
        if rank == 0:
            _check_destination(path)
        state = _state_to_save(target, optimizer)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    _agree(error)
    token = _broadcast_token()
    tmp = f"{path}.tmp-{token}"
    try:
        _dcp(dcp.save, state, storage_writer=FileSystemWriter(tmp), planner=DefaultSavePlanner(**_FLAT))
    except CheckpointException as e:  # DCP gathers every rank's failure and raises it everywhere
        raise CheckpointError(f"saving {path} failed; the previous checkpoint there (if any) is untouched and "
                              f"{tmp} is left over (deleted by the next successful save): {e}") from e
    error = None
    if rank == 0:
        try:
            _publish(tmp, path, token, _meta(target, step, optimizer is not None))
        except Exception as e:  # noqa: BLE001 - agreed on below: the other ranks wait for rank 0
            error = CheckpointError(f"saving {path}: switching {tmp} into place failed ({e}); fix: check the "
                                    f"filesystem; the previous checkpoint is at {path} or {path}.old-*")
    _agree(error)  # also the barrier: nobody returns before the checkpoint is in place
    return path


def load_checkpoint(target, path: str, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` under any plan into ``target`` (and
    ``optimizer``, whose state is replaced). Parameters are overwritten in place, so an optimizer
    built before loading keeps working. Collective. Returns the checkpoint's metadata (``step``,
    ``plan_summary``, ...)."""
    path = os.path.abspath(os.fspath(path))
    state, meta, source, error = None, None, None, None
    try:
        source, meta = resolve(path)
        try:
            metadata = FileSystemReader(source).read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 - any unreadable metadata is a corrupt checkpoint
            raise CheckpointError(f"{source}/{DCP_META_FILE} cannot be read ({type(e).__name__}: {e}); fix: load "
                                  "another checkpoint or save again") from e
        state = _state_to_load(target, optimizer, metadata, source)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    _agree(error)
    try:
        _dcp(dcp.load, state, storage_reader=FileSystemReader(source), planner=DefaultLoadPlanner(**_FLAT))
    except CheckpointException as e:
        raise CheckpointError(f"reading {source} failed (a data file is missing or truncated?); fix: load "
                              f"another checkpoint or save again: {e}") from e
    if optimizer is not None:
        _install_optimizer_state(target, optimizer, state)
    return meta
