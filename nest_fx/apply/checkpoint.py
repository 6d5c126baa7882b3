"""Checkpoints of training state that load under any plan and world size, verified and kept.

``save_checkpoint(target, path, optimizer, step=..., scheduler=..., data=...)`` writes a new step
directory under the checkpoint directory ``path`` (layout and rotation:
:mod:`nest_fx.apply.checkpoint_files`); ``load_checkpoint(target, path, ...)`` loads the newest
complete one (or the step directory named); ``resume_checkpoint`` checks the directory before
training and loads the newest checkpoint if there is one. The tensors are written with
``torch.distributed.checkpoint`` (DCP), every rank its own shards.

Keys do not depend on the plan: ``model.<fqn>`` (parameters and persistent buffers under the
original model's names), ``optim.state.<fqn>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``step``, ...)
and ``optim.group.<fqn>`` (the hyperparameters of the parameter's group: ``lr``, ``betas``, ...),
``train.scheduler``, ``train.data`` and ``train.rng.<rank>`` (:mod:`nest_fx.apply.train_state`).
A DTensor (TP or FSDP shard) is stored as its global tensor cut into the chunks the saving
ranks held, and a loading rank asks DCP for the chunks it holds now, so a checkpoint reshards
to any plan; replicated copies are written once. A pipeline stage saves and loads only its own
keys. Expert-parallel ranks hold their experts under the global indices
(``layers.1.moe.experts.5.w1.weight``), so experts reshard across ``ep`` without a special case.

What protects the run:

* every file's size and sha256 go into ``MANIFEST.json``, written last; loading checks sizes
  on every rank and the hashes split over the ranks, and a damaged or missing file is a
  :class:`CheckpointError` naming it, before anything is loaded;
* the model's fingerprint (names and shapes of every tensor), the plan, the step and a format
  version are inside; a checkpoint of another model is refused with what differs;
* a save writes into a temporary directory and appears under its step name by one rename; a
  save that fails removes it on every rank's agreement and leaves the previous checkpoints as
  they were; ``keep`` complete checkpoints are kept; leftovers of a crash are cleaned at the
  next save or resume;
* ``require_finite``: a state whose parameters (or ``loss``) are not finite is not saved;
* every error one rank could see alone is agreed on first (:func:`nest_fx.apply.agreement.agree`),
  so all ranks raise the same :class:`CheckpointError` instead of some waiting in a collective.
"""
from __future__ import annotations

import hashlib
import math
import os
import pickle
import shutil
import time
import uuid
import warnings
from typing import Any, Dict, List, Optional, Tuple

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
from nest_fx.apply.agreement import agree, distributed
from nest_fx.apply.checkpoint_files import (META_FILE, MANIFEST_FILE, TMP_PREFIX, CheckpointError, check_hashes,
                                            check_room, check_sizes, clean_stale, complete_checkpoints, hash_file,
                                            is_checkpoint_root, load_json, publish, read_manifest, step_name, write_json,
                                            write_manifest)
from nest_fx.apply.collective_errors import named_collective_failures
from nest_fx.apply.fingerprint import TensorSpec, difference, fingerprint, persistent_buffers, state_bytes, tensor_specs
from nest_fx.apply.train_state import pack, rng_state, set_rng_state, stateful, unpack
from nest_fx.plan.summary import plan_summary

FORMAT = "nest-fx-ckpt/2"
LEGACY_FORMAT = "nest-fx-ckpt/1"  # one directory, no manifest: still loaded (unverified, with a warning)
DCP_META_FILE = ".metadata"
DEFAULT_KEEP = 3
OPTIMIZER_STATE_FACTOR = 2  # AdamW's two moments per parameter: the room check's estimate before a first save

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resume_checkpoint", "model_tensors", "FORMAT"]


# -- what is saved ----------------------------------------------------------------------------

def _chunks(target) -> List[nn.Module]:
    """The modules holding this rank's state: a ParallelModule's stage chunks, or the module."""
    return list(getattr(target, "chunks", None) or [target])


def model_tensors(target) -> Dict[str, torch.Tensor]:
    """{original name: parameter or persistent buffer} this rank holds (DTensors where sharded)."""
    out: Dict[str, torch.Tensor] = {}
    for name, p in target.named_parameters():
        out.setdefault(name, p.detach())
    for chunk in _chunks(target):
        for name, buf in persistent_buffers(chunk):
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


# The keys are flat already. Unflattened, DCP also writes the non-tensor values it loads (the
# group hyperparameters) into the very dict passed to dcp.load, where they are picked up.
_FLAT = {"flatten_state_dict": False, "flatten_sharded_tensors": False}


def _dcp(fn, state: Dict[str, Any], **kwargs) -> None:
    """``dcp.save``/``dcp.load`` over the default group, or in this process alone without one."""
    if distributed():
        fn(state, **kwargs)
        return
    with warnings.catch_warnings():  # DCP warns that it runs in one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, no_dist=True, **kwargs)


LOW_SPACE_BYTES = 64 << 20


def _low_space(root: str) -> str:
    """`` (... disk full?)`` when the checkpoint filesystem is nearly full: PyTorch's writer does not
    always say so (``unexpected pos 704 vs 598``)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    return f" (its filesystem has {free / 2**20:.1f} MiB free: disk full?)" if free < LOW_SPACE_BYTES else ""


def _dcp_failures(exc: CheckpointException) -> str:
    """``rank 1: OSError: [Errno 28] No space left on device; ...``: DCP's failures, one line each."""
    return "; ".join(f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())}"
                     for rank, (e, _) in sorted(exc.failures.items()))


# -- what the checkpoint says about itself ----------------------------------------------------

def model_specs(target) -> Dict[str, TensorSpec]:
    """The whole model's tensors: recorded by ``auto_parallelize`` before the split, or the module's."""
    specs = getattr(target, "model_specs", None)
    return specs if specs is not None else tensor_specs(target)


def _meta(target, step: int, sequence: int, optimizer, scheduler, data) -> dict:
    plan = getattr(target, "plan", None)
    summary = plan_summary(plan, getattr(target, "num_microbatches", plan.num_microbatches)) if plan else None
    specs = model_specs(target)
    return {"format": FORMAT, "step": step, "sequence": sequence, "saved_at": time.time(),
            "world_size": dist.get_world_size() if distributed() else 1,
            "model": {"fingerprint": fingerprint(specs), "tensors": {n: [list(s), d] for n, (s, d) in specs.items()}},
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "scheduler": scheduler is not None, "data": data is not None,
            "plan_summary": summary, "plan": plan.to_dict() if plan is not None else None, "torch": torch.__version__}


def _read_meta(directory: str) -> dict:
    meta_path = os.path.join(directory, META_FILE)
    meta = load_json(meta_path, f"{directory} has no {META_FILE}; fix: load another checkpoint")
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt not in (FORMAT, LEGACY_FORMAT):
        raise CheckpointError(f"{meta_path}: format is {fmt!r}, this version reads {FORMAT!r}; fix: load it with the "
                              "nest-fx version that wrote it")
    step = meta.get("step")
    if fmt == FORMAT and not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise CheckpointError(f"{meta_path}: step {step!r} is not a non-negative integer; the file is damaged")
    return meta


def _check_model(target, meta: dict, source: str) -> None:
    """CheckpointError when the checkpoint holds another model (names or shapes differ)."""
    saved = (meta.get("model") or {}).get("tensors")
    if saved is None:
        return  # a legacy checkpoint: the per-key shape checks below still apply
    saved = {n: (tuple(s), d) for n, (s, d) in saved.items()}
    current = model_specs(target)
    if fingerprint(saved) != fingerprint(current):
        raise CheckpointError(f"{source} holds another model ({len(saved)} tensors, this model has {len(current)}; "
                              f"{difference(saved, current)}); fix: load a checkpoint of this model, or build the "
                              "model with the checkpoint's configuration")


def resolve(path: str) -> Tuple[str, Optional[dict]]:
    """(directory, manifest) of the checkpoint ``path`` names: a step directory, or the newest
    complete checkpoint of a checkpoint directory (manifest None: a legacy single checkpoint)."""
    if os.path.isfile(os.path.join(path, MANIFEST_FILE)):
        return path, read_manifest(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; fix: pass the directory given to save()")
    found = complete_checkpoints(path)
    if found:
        _, directory, manifest = found[-1]
        return directory, manifest
    if os.path.isfile(os.path.join(path, META_FILE)) and os.path.isfile(os.path.join(path, DCP_META_FILE)):
        return path, None
    hint = " (it holds step directories, none complete)" if is_checkpoint_root(path) else ""
    raise CheckpointError(f"no checkpoint at {path}{hint}; fix: check the path, or save one first with "
                          "pm.save(path, optimizer)")


# -- save -------------------------------------------------------------------------------------

def _valid_step(step) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _check_save_args(step, keep, scheduler, data) -> None:
    if step is not None and not _valid_step(step):
        raise CheckpointError(f"step={step!r}: a checkpoint's step must be a non-negative integer (the optimizer steps "
                              "taken); fix: pass step=<int>")
    if keep is not None and not (_valid_step(keep) and keep >= 1):
        raise CheckpointError(f"keep={keep!r}: the number of checkpoints to keep must be an integer >= 1, or None to "
                              "keep all")
    if scheduler is not None:
        stateful(scheduler, "scheduler")
    if data is not None:
        stateful(data, "data")


def _check_finite(target, loss) -> None:
    """CheckpointError when ``loss`` or a parameter of this rank is NaN or infinite."""
    if loss is not None and not math.isfinite(float(loss)):
        raise CheckpointError(f"not saving: the loss is {float(loss)} (training diverged?); the previous checkpoints "
                              "are kept; fix: resume from the latest one with a lower learning rate, or pass "
                              "require_finite=False")
    for name, p in target.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.numel() and not bool(torch.isfinite(local.detach()).all()):
            raise CheckpointError(f"not saving: parameter {name} holds NaN or infinite values (training diverged?); "
                                  "the previous checkpoints are kept; fix: resume from the latest one with a lower "
                                  "learning rate, or pass require_finite=False")


def _train_state_to_save(rank: int, scheduler, data) -> Dict[str, bytes]:
    state = {f"train.rng.{rank}": pack(rng_state())}
    if scheduler is not None:
        state["train.scheduler"] = pack(scheduler.state_dict())
    if data is not None:
        state["train.data"] = pack(data.state_dict())
    return state


def _digest(blob: Optional[bytes]) -> Optional[str]:
    return None if blob is None else hashlib.sha256(blob).hexdigest()[:16]


def _prepare_directory(root: str) -> None:
    """Rank 0, before a save or a resume: make the checkpoint directory, refuse one that is not
    ours, and delete what interrupted saves left in it."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"cannot save to {root}: it is a file; fix: pass a directory path")
    if os.path.isfile(os.path.join(root, META_FILE)):
        raise CheckpointError(f"cannot save into {root}: it is a single checkpoint (a step directory, or written by an "
                              "older nest-fx); fix: pass a new directory: checkpoints are kept in its step-* "
                              "subdirectories")
    if os.path.isdir(root) and not is_checkpoint_root(root) and \
            any(not name.startswith(TMP_PREFIX) for name in os.listdir(root)):
        raise CheckpointError(f"refusing to save into {root}: it is a non-empty directory that holds no nest-fx "
                              "checkpoints; fix: choose a new or empty directory")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint directory {root} ({e.strerror or e}); fix: pass a "
                              "directory this job can write") from None
    clean_stale(root)


def _next_from_directory(root: str) -> Tuple[int, int]:
    """(next sequence number, one past the newest checkpoint's step) of a checkpoint directory."""
    found = complete_checkpoints(root)
    if not found:
        return 1, 0
    return found[-1][0] + 1, found[-1][2]["step"] + 1


def _own_files(tmp: str, rank: int) -> Dict[str, Dict[str, Any]]:
    """{name: {bytes, sha256}} of the files this rank wrote (its DCP shards; rank 0 also the
    DCP metadata and the nest-fx metadata)."""
    names = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")]
    if rank == 0:
        names += [DCP_META_FILE, META_FILE]
    out = {}
    for name in names:
        size, digest = hash_file(os.path.join(tmp, name))
        out[name] = {"bytes": size, "sha256": digest}
    return out


def _write_manifest(tmp: str, parts: List[Dict[str, Dict[str, Any]]], step: int, sequence: int) -> None:
    """Rank 0: the manifest from every rank's file hashes; every file in ``tmp`` must be listed."""
    files: Dict[str, Dict[str, Any]] = {}
    for part in parts:
        files.update(part)
    unlisted = sorted(set(os.listdir(tmp)) - set(files))
    if unlisted:
        raise CheckpointError(f"{tmp}: files no rank accounts for: {unlisted[:3]}")
    write_manifest(tmp, files, step, sequence)


def save_checkpoint(target, path: str, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    step: Optional[int] = None, scheduler=None, data=None, keep: Optional[int] = DEFAULT_KEEP,
                    require_finite: bool = True, loss=None) -> str:
    """Write the model (and ``optimizer``, ``scheduler``, ``data`` position, RNG) state of
    ``target`` as a new step directory of the checkpoint directory ``path``; returns it.

    ``target``: a ParallelModule or a plain ``nn.Module``. Collective: every rank calls it with
    the same arguments. ``step``: a non-negative int (default: one past the newest checkpoint
    in ``path``). ``keep``: complete checkpoints kept (the oldest are deleted once the new one is
    in place; None keeps all). ``require_finite``: refuse to save when a parameter or ``loss`` is
    NaN or infinite. A failed save leaves nothing behind and the previous checkpoints intact.
    """
    root = os.path.abspath(os.fspath(path))
    rank = dist.get_rank() if distributed() else 0
    state, error, proposal = None, None, None
    fields: Dict[str, Any] = {"checkpoint directory": root, "step": step, "keep": keep,
                              "optimizer": type(optimizer).__name__ if optimizer is not None else None}
    try:
        _check_save_args(step, keep, scheduler, data)
        if require_finite:
            _check_finite(target, loss)
        state = _state_to_save(target, optimizer)
        state.update(_train_state_to_save(rank, scheduler, data))
        fields["scheduler state"] = _digest(state.get("train.scheduler"))
        fields["data position"] = _digest(state.get("train.data"))
        if rank == 0:
            _prepare_directory(root)
            proposal = {"token": uuid.uuid4().hex[:12], "next": _next_from_directory(root)}
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    proposal = agree(fields, what=f"saving a checkpoint to {root}", error=error, error_cls=CheckpointError,
                     shared=proposal)[0]
    sequence, default_step = proposal["next"]
    step = default_step if step is None else step
    tmp = os.path.join(root, f"{TMP_PREFIX}{step_name(step)}-{proposal['token']}")
    what = f"saving {step_name(step)} to {root}"
    try:
        with named_collective_failures(what):
            try:
                _dcp(dcp.save, state, storage_writer=FileSystemWriter(tmp), planner=DefaultSavePlanner(**_FLAT))
            except CheckpointException as e:  # DCP gathers every rank's failure and raises it everywhere
                raise CheckpointError(f"{what} failed{_low_space(root)}; nothing was left behind and the previous "
                                      f"checkpoints are intact: {_dcp_failures(e)}") from e
            files, error = None, None
            try:
                if rank == 0:
                    write_json(os.path.join(tmp, META_FILE), _meta(target, step, sequence, optimizer, scheduler, data))
                files = _own_files(tmp, rank)
            except Exception as e:  # noqa: BLE001 - agreed on below
                error = CheckpointError(f"{what}: writing the manifest failed ({e}); the previous checkpoints are intact")
            parts = agree({}, what=what, error=error, error_cls=CheckpointError, shared=files)
            final, error = None, None
            if rank == 0:
                try:
                    _write_manifest(tmp, parts, step, sequence)
                    final = publish(tmp, root, step, proposal["token"], keep)
                except Exception as e:  # noqa: BLE001 - agreed on below: the other ranks wait for rank 0
                    error = CheckpointError(f"{what}: putting the checkpoint in place failed ({e}); the previous "
                                            "checkpoints are intact")
            agree({}, what=what, error=error, error_cls=CheckpointError)  # nobody returns before it is in place
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final or os.path.join(root, step_name(step))


# -- load -------------------------------------------------------------------------------------

def _train_state_to_load(scheduler, data, metadata, meta: dict, rank: int, source: str) -> Dict[str, Any]:
    state: Dict[str, Any] = {}
    for obj, key, what in ((scheduler, "train.scheduler", "scheduler"), (data, "train.data", "data")):
        if obj is None:
            continue
        stateful(obj, what)
        if key not in metadata:
            raise CheckpointError(f"{source} holds no {what} state (it was saved without {what}=); fix: load without "
                                  f"{what}=, or save with save(path, optimizer, {what}=...)")
        state[key] = b""  # replaced by the saved object
    saved_world = int(meta.get("world_size") or 1)
    key = f"train.rng.{rank % saved_world}"
    if key in metadata:
        state[key] = b""
    return state


def _verify(source: str, manifest: Optional[dict], verify: bool, rank: int, world: int) -> None:
    """Sizes of every file on every rank; the small files' hashes on every rank (they are read
    first), the shards' hashes split over the ranks."""
    if manifest is None:
        warnings.warn(f"{source} was written by an older nest-fx without a manifest: loaded without checking its "
                      "files; save again to get a verified checkpoint", RuntimeWarning, stacklevel=4)
        return
    check_sizes(source, manifest)
    if not verify:
        return
    small = [n for n in (DCP_META_FILE, META_FILE) if n in manifest["files"]]
    shards = sorted(set(manifest["files"]) - set(small))
    check_hashes(source, manifest, small + shards[rank::world])


def load_checkpoint(target, path: str, optimizer: Optional[torch.optim.Optimizer] = None, *, scheduler=None,
                    data=None, verify: bool = True) -> dict:
    """Load the newest complete checkpoint of the checkpoint directory ``path`` (or the step
    directory ``path`` names), saved under any plan, into ``target`` and ``optimizer`` (whose
    state is replaced), ``scheduler`` and ``data``, and restore the random generators.

    Parameters are overwritten in place, so an optimizer built before loading keeps working.
    Collective. Before anything is read, every file is checked against the manifest (sizes; and
    the sha256 when ``verify``) and the model fingerprint is compared; any failure is a
    :class:`CheckpointError` on every rank. Returns the checkpoint's metadata (``step``, ...).
    """
    root = os.path.abspath(os.fspath(path))
    rank = dist.get_rank() if distributed() else 0
    world = dist.get_world_size() if distributed() else 1
    state, meta, source, error = None, None, None, None
    try:
        source, manifest = resolve(root)
        _verify(source, manifest, verify, rank, world)
        meta = _read_meta(source)
        _check_model(target, meta, source)
        try:
            metadata = FileSystemReader(source).read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 - any unreadable metadata is a corrupt checkpoint
            raise CheckpointError(f"{source}/{DCP_META_FILE} cannot be read ({type(e).__name__}: {e}); fix: load "
                                  "another checkpoint") from e
        state = _state_to_load(target, optimizer, metadata, source)
        state.update(_train_state_to_load(scheduler, data, metadata, meta, rank, source))
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    agree({"checkpoint": source}, what=f"loading {root}", error=error, error_cls=CheckpointError)
    with named_collective_failures(f"loading {source}"):
        try:
            _dcp(dcp.load, state, storage_reader=FileSystemReader(source), planner=DefaultLoadPlanner(**_FLAT))
        except CheckpointException as e:
            raise CheckpointError(f"reading {source} failed: {_dcp_failures(e)}; fix: load another checkpoint") from e
    if optimizer is not None:
        _install_optimizer_state(target, optimizer, state)
    if scheduler is not None:
        scheduler.load_state_dict(unpack(state["train.scheduler"]))
    if data is not None:
        data.load_state_dict(unpack(state["train.data"]))
    rng = [v for k, v in state.items() if k.startswith("train.rng.")]
    if rng:
        set_rng_state(unpack(rng[0]))
    return dict(meta, directory=source)


def resume_checkpoint(target, path: str, optimizer: Optional[torch.optim.Optimizer] = None, *, scheduler=None,
                      data=None) -> Optional[dict]:
    """Before training: make the checkpoint directory ``path`` if needed, delete leftovers of
    interrupted saves, check that it is writable and has room for two checkpoints (the size of
    the newest one, or the model's bytes times 1 + 2 for AdamW's moments before the first save),
    then load its newest complete checkpoint (:func:`load_checkpoint`). Returns the loaded
    metadata, or None when the directory holds no checkpoint yet. Collective."""
    root = os.path.abspath(os.fspath(path))
    rank = dist.get_rank() if distributed() else 0
    error, found = None, None
    try:
        if rank == 0:
            _prepare_directory(root)
            newest = complete_checkpoints(root)
            if newest:
                one = sum(f["bytes"] for f in newest[-1][2]["files"].values())
            else:
                one = state_bytes(model_specs(target)) * (1 + (OPTIMIZER_STATE_FACTOR if optimizer is not None else 0))
            check_room(root, 2 * one)
            found = bool(newest)
    except Exception as e:  # noqa: BLE001 - agreed on below
        error = e
    found = agree({"checkpoint directory": root}, what=f"resuming from {root}", error=error,
                  error_cls=CheckpointError, shared=found)[0]
    if not found:
        return None
    return load_checkpoint(target, root, optimizer, scheduler=scheduler, data=data)


# Public names of the pieces the HuggingFace export reuses (apply/export_hf.py): the same names
# the checkpoint_state / checkpoint_load split of this module exports.
FLAT, run_dcp, read_meta, state_to_save = _FLAT, _dcp, _read_meta, _state_to_save
