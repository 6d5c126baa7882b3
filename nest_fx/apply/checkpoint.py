"""Checkpoints of training state that load under any plan and world size, verified and kept.

``save_checkpoint(target, path, optimizer, step=..., scheduler=..., data=..., scaler=...)`` writes
a new step directory under the checkpoint directory ``path`` (layout and rotation:
:mod:`nest_fx.apply.checkpoint_files`; what goes in: :mod:`nest_fx.apply.checkpoint_state`);
``load_checkpoint(target, path, ...)`` (:mod:`nest_fx.apply.checkpoint_load`) loads the newest
one, or the step directory named, and never another one by itself; ``resume_checkpoint`` checks
the directory before training and loads the newest checkpoint if there is one (falling back to
the newest complete one, and saying so, when the newest is damaged). The tensors are written with
``torch.distributed.checkpoint`` (DCP), every rank its own shards.

Keys do not depend on the plan: ``model.<fqn>`` (parameters and persistent buffers under the
original model's names), ``optim.state.<fqn>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``step``, ...)
and ``optim.group.<fqn>`` (the hyperparameters of the parameter's group: ``lr``, ``betas``, ...),
``train.scheduler``, ``train.data``, ``train.scaler``, ``train.rng.<rank>`` and
``train.dtensor_rng.<rank>`` (:mod:`nest_fx.apply.train_state`).
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
import shutil
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from nest_fx.apply.agreement import agree, distributed
from nest_fx.apply.checkpoint_files import (
    META_FILE,
    TMP_PREFIX,
    CheckpointDamaged,
    CheckpointError,
    check_room,
    clean_stale,
    complete_checkpoints,
    directory_bytes,
    hash_file,
    incomplete_steps,
    is_checkpoint_root,
    next_sequence,
    note_failed_save,
    publish,
    step_name,
    write_json,
    write_manifest,
)
from nest_fx.apply.checkpoint_load import checkpoint_choices, load_checkpoint, resolve
from nest_fx.apply.checkpoint_state import (
    DCP_META_FILE,
    FLAT,
    FORMAT,
    LEGACY_FORMAT,
    checkpoint_meta,
    dcp_failures,
    low_space,
    model_specs,
    model_tensors,
    read_meta,
    run_dcp,
    state_to_save,
    train_state_to_save,
)
from nest_fx.apply.collective_errors import named_collective_failures
from nest_fx.apply.fingerprint import state_bytes
from nest_fx.apply.train_state import stateful

DEFAULT_KEEP = 3
OPTIMIZER_STATE_FACTOR = 2  # AdamW's two moments per parameter: the room check's estimate before a first save

__all__ = [
    "CheckpointError",
    "CheckpointDamaged",
    "save_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "resolve",
    "checkpoint_choices",
    "model_tensors",
    "model_specs",
    "read_meta",
    "FORMAT",
    "LEGACY_FORMAT",
    "DCP_META_FILE",
]


# -- save -------------------------------------------------------------------------------------


def _valid_step(step) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _check_save_args(step, keep, scheduler, data, scaler) -> None:
    if step is not None and not _valid_step(step):
        raise CheckpointError(
            f"step={step!r}: a checkpoint's step must be a non-negative integer (the optimizer steps "
            "taken); fix: pass step=<int>"
        )
    if keep is not None and not (_valid_step(keep) and keep >= 1):
        raise CheckpointError(
            f"keep={keep!r}: the number of checkpoints to keep must be an integer >= 1, or None to keep all"
        )
    if scheduler is not None:
        stateful(scheduler, "scheduler")
    if data is not None:
        stateful(data, "data")
    if scaler is not None:
        stateful(scaler, "scaler")


def _check_finite(target, loss) -> None:
    """CheckpointError when ``loss`` or a parameter of this rank is NaN or infinite."""
    if loss is not None and not math.isfinite(float(loss)):
        raise CheckpointError(
            f"not saving: the loss is {float(loss)} (training diverged?); the previous checkpoints "
            "are kept; fix: resume from the latest one with a lower learning rate, or pass "
            "require_finite=False"
        )
    for name, p in target.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.numel() and not bool(torch.isfinite(local.detach()).all()):
            raise CheckpointError(
                f"not saving: parameter {name} holds NaN or infinite values (training diverged?); "
                "the previous checkpoints are kept; fix: resume from the latest one with a lower "
                "learning rate, or pass require_finite=False"
            )


def _digest(blob: Optional[bytes]) -> Optional[str]:
    return None if blob is None else hashlib.sha256(blob).hexdigest()[:16]


def _prepare_directory(root: str) -> None:
    """Rank 0, before a save or a resume: make the checkpoint directory, refuse one that is not
    ours, and delete what interrupted saves left in it."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"cannot save to {root}: it is a file; fix: pass a directory path")
    if os.path.isfile(os.path.join(root, META_FILE)):
        raise CheckpointError(
            f"cannot save into {root}: it is a single checkpoint (a step directory, or written by an "
            "older nest-fx); fix: pass a new directory: checkpoints are kept in its step-* "
            "subdirectories"
        )
    if (
        os.path.isdir(root)
        and not is_checkpoint_root(root)
        and any(not name.startswith(TMP_PREFIX) for name in os.listdir(root))
    ):
        raise CheckpointError(
            f"refusing to save into {root}: it is a non-empty directory that holds no nest-fx "
            "checkpoints; fix: choose a new or empty directory"
        )
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create the checkpoint directory {root} ({e.strerror or e}); fix: pass a "
            "directory this job can write"
        ) from None
    clean_stale(root)


def _next_from_directory(root: str) -> Tuple[int, int]:
    """(next sequence number, one past the newest complete checkpoint's step) of a checkpoint
    directory; the sequence also counts damaged step directories, so a new save is newer than them."""
    found = complete_checkpoints(root)
    return next_sequence(root), (found[-1][2]["step"] + 1 if found else 0)


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


def _note_if_disk_full(root: str, tmp: str, step: int, error: BaseException) -> None:
    """Rank 0, after a failed save: when the disk was full, leave a note for the next ``load``
    (:func:`~nest_fx.apply.checkpoint_files.check_failed_save`) of the room a checkpoint needs."""
    text = " ".join(str(error).split())
    if "No space left on device" not in text and "disk full?" not in text:
        return
    newest = complete_checkpoints(root)
    need = max(directory_bytes(tmp), sum(f["bytes"] for f in newest[-1][2]["files"].values()) if newest else 0)
    note_failed_save(root, step, need, text[:500])


def save_checkpoint(
    target,
    path: str,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    step: Optional[int] = None,
    scheduler=None,
    data=None,
    keep: Optional[int] = DEFAULT_KEEP,
    require_finite: bool = True,
    loss=None,
    scaler=None,
) -> str:
    """Write the model (and ``optimizer``, ``scheduler``, ``data`` position, gradient ``scaler``, RNG) state of
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
    fields: Dict[str, Any] = {
        "checkpoint directory": root,
        "step": step,
        "keep": keep,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
    }
    try:
        _check_save_args(step, keep, scheduler, data, scaler)
        if require_finite:
            _check_finite(target, loss)
        state = state_to_save(target, optimizer)
        state.update(train_state_to_save(rank, scheduler, data, scaler))
        fields["scheduler state"] = _digest(state.get("train.scheduler"))
        fields["data position"] = _digest(state.get("train.data"))
        fields["gradient scaler state"] = _digest(state.get("train.scaler"))
        if rank == 0:
            _prepare_directory(root)
            proposal = {"token": uuid.uuid4().hex[:12], "next": _next_from_directory(root)}
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    proposal = agree(
        fields, what=f"saving a checkpoint to {root}", error=error, error_cls=CheckpointError, shared=proposal
    )[0]
    sequence, default_step = proposal["next"]
    step = default_step if step is None else step
    tmp = os.path.join(root, f"{TMP_PREFIX}{step_name(step)}-{proposal['token']}")
    what = f"saving {step_name(step)} to {root}"
    try:
        with named_collective_failures(what):
            try:
                run_dcp(dcp.save, state, storage_writer=FileSystemWriter(tmp), planner=DefaultSavePlanner(**FLAT))
            except CheckpointException as e:  # DCP gathers every rank's failure and raises it everywhere
                raise CheckpointError(
                    f"{what} failed{low_space(root)}; nothing was left behind and the previous "
                    f"checkpoints are intact: {dcp_failures(e)}"
                ) from e
            files, error = None, None
            try:
                if rank == 0:
                    write_json(
                        os.path.join(tmp, META_FILE),
                        checkpoint_meta(target, step, sequence, optimizer, scheduler, data),
                    )
                files = _own_files(tmp, rank)
            except Exception as e:  # noqa: BLE001 - agreed on below
                error = CheckpointError(
                    f"{what}: writing the manifest failed ({e}); the previous checkpoints are intact"
                )
            parts = agree({}, what=what, error=error, error_cls=CheckpointError, shared=files)
            final, error = None, None
            if rank == 0:
                try:
                    _write_manifest(tmp, parts, step, sequence)
                    final = publish(tmp, root, step, proposal["token"], keep)
                except Exception as e:  # noqa: BLE001 - agreed on below: the other ranks wait for rank 0
                    error = CheckpointError(
                        f"{what}: putting the checkpoint in place failed ({e}); the previous checkpoints are intact"
                    )
            agree({}, what=what, error=error, error_cls=CheckpointError)  # nobody returns before it is in place
    except BaseException as e:
        if rank == 0:
            _note_if_disk_full(root, tmp, step, e)
        # every rank: the first to fail may be the last to run (torchrun stops the others)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final or os.path.join(root, step_name(step))


# -- resume -----------------------------------------------------------------------------------


def resume_checkpoint(
    target, path: str, optimizer: Optional[torch.optim.Optimizer] = None, *, scheduler=None, data=None, scaler=None
) -> Optional[dict]:
    """Before training: make the checkpoint directory ``path`` if needed, delete leftovers of
    interrupted saves, check that it is writable and has room for two checkpoints (the size of
    the newest one, or the model's bytes times 1 + 2 for AdamW's moments before the first save),
    then load its newest checkpoint (:func:`load_checkpoint` with ``fallback=True``: when the
    newest step directory is incomplete or damaged the newest complete one is loaded and every
    rank says so). Returns the loaded metadata, or None when the directory holds no step
    directory yet. Collective."""
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
            found = bool(newest) or bool(incomplete_steps(root))
    except Exception as e:  # noqa: BLE001 - agreed on below
        error = e
    found = agree(
        {"checkpoint directory": root},
        what=f"resuming from {root}",
        error=error,
        error_cls=CheckpointError,
        shared=found,
    )[0]
    if not found:
        return None
    return load_checkpoint(target, root, optimizer, scheduler=scheduler, data=data, scaler=scaler, fallback=True)
