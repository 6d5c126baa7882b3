"""Loading a checkpoint: which step directory, checked before anything is read, on every rank.

``load_checkpoint(target, path)`` loads the step directory ``path`` names, or the newest
checkpoint of the checkpoint directory ``path``. It never loads another step than that one by
itself: when the newest step directory (the one ``latest`` names, or a damaged one saved later
than every complete one) is incomplete or damaged, the load is refused with a
:class:`~nest_fx.apply.checkpoint_files.CheckpointDamaged` naming it and the newest complete one.
``fallback=True`` (which ``resume`` passes) takes the newest complete one instead and every rank
says so in one line on stderr. Saving: :mod:`nest_fx.apply.checkpoint`.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from nest_fx.apply.agreement import agree, distributed, gather
from nest_fx.apply.checkpoint_files import (
    MANIFEST_FILE,
    META_FILE,
    CheckpointDamaged,
    CheckpointError,
    check_failed_save,
    check_hashes,
    check_sizes,
    complete_checkpoints,
    is_checkpoint_root,
    is_step_directory,
    newest_incomplete,
    read_manifest,
    reason,
)
from nest_fx.apply.checkpoint_state import (
    DCP_META_FILE,
    FLAT,
    check_model,
    dcp_failures,
    install_optimizer_state,
    read_meta,
    restore_train_state,
    run_dcp,
    state_to_load,
    train_state_to_load,
)
from nest_fx.apply.collective_errors import named_collective_failures
from nest_fx.apply.norm_weights import check_loaded_weights
from nest_fx.common.fileio import one_line

Choice = Tuple[str, Optional[dict], Optional[str]]  # (directory, manifest, why it cannot be loaded)


def checkpoint_choices(path: str) -> List[Choice]:
    """The checkpoints ``path`` names, in the order a load may take them: a step directory alone;
    for a checkpoint directory its newest step directory first (with why it cannot be loaded when
    it is incomplete or damaged), then the complete ones, newest first; a legacy single
    checkpoint (manifest None). CheckpointError when there is none."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; fix: pass the directory given to save()")
    if os.path.isfile(os.path.join(path, MANIFEST_FILE)) or (is_step_directory(path) and os.path.isdir(path)):
        return [(path, read_manifest(path), None)]
    complete = complete_checkpoints(path)
    newer = newest_incomplete(path, complete)
    out: List[Choice] = [(newer[0], None, newer[1])] if newer else []
    out += [(directory, manifest, None) for _, directory, manifest in reversed(complete)]
    if out:
        return out
    if os.path.isfile(os.path.join(path, META_FILE)) and os.path.isfile(os.path.join(path, DCP_META_FILE)):
        return [(path, None, None)]
    hint = " (it holds step directories, none complete)" if is_checkpoint_root(path) else ""
    raise CheckpointError(
        f"no checkpoint at {path}{hint}; fix: check the path, or save one first with pm.save(path, optimizer)"
    )


def _refusal(root: str, choices: List[Choice], why: str) -> CheckpointError:
    """The error for a newest checkpoint that cannot be loaded: naming the newest complete one."""
    source = choices[0][0]
    older = next((d for d, _, bad in choices[1:] if bad is None), None)
    if older is None:
        return CheckpointDamaged(
            f"{why}; {root} holds no complete checkpoint before {os.path.basename(source)}; fix: "
            "restore the files, or remove that step directory to start afresh"
        )
    return CheckpointDamaged(
        f"{root}: its newest checkpoint {source} cannot be loaded ({why}); the newest complete "
        f"checkpoint is {older}; fix: load it on purpose (pm.load('{older}')), or pass "
        "fallback=True (pm.resume does) to take it"
    )


def resolve(path: str) -> Tuple[str, Optional[dict]]:
    """(directory, manifest) of the checkpoint ``path`` names: a step directory, or the newest
    checkpoint of a checkpoint directory (manifest None: a legacy single checkpoint).
    :class:`CheckpointDamaged` when that newest one is incomplete or damaged."""
    choices = checkpoint_choices(path)
    directory, manifest, why = choices[0]
    if why is not None:
        raise _refusal(path, choices, why)
    return directory, manifest


def _verify(source: str, manifest: Optional[dict], verify: bool, rank: int, world: int) -> None:
    """Sizes of every file on every rank; the small files' hashes on every rank (they are read
    first), the shards' hashes split over the ranks."""
    if manifest is None:
        warnings.warn(
            f"{source} was written by an older nest-fx without a manifest: loaded without checking its "
            "files; save again to get a verified checkpoint",
            RuntimeWarning,
            stacklevel=5,
        )
        return
    check_sizes(source, manifest)
    if not verify:
        return
    small = [n for n in (DCP_META_FILE, META_FILE) if n in manifest["files"]]
    shards = sorted(set(manifest["files"]) - set(small))
    check_hashes(source, manifest, small + shards[rank::world])


def _prepare(target, optimizer, scheduler, data, scaler, choice: Choice, verify: bool, rank: int, world: int):
    """(metadata, state to load into) of one candidate; raises what is wrong with it."""
    source, manifest, why = choice
    if why is not None:
        raise CheckpointDamaged(why)
    _verify(source, manifest, verify, rank, world)
    meta = read_meta(source)
    check_model(target, meta, source)
    try:
        metadata = FileSystemReader(source).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a corrupt checkpoint
        raise CheckpointDamaged(
            f"{source}/{DCP_META_FILE} cannot be read ({type(e).__name__}: {e}); fix: load another checkpoint"
        ) from e
    state = state_to_load(target, optimizer, metadata, source)
    state.update(train_state_to_load(scheduler, data, scaler, metadata, meta, rank, source))
    return meta, state


def load_checkpoint(
    target,
    path: str,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    scheduler=None,
    data=None,
    scaler=None,
    verify: bool = True,
    fallback: bool = False,
) -> dict:
    """Load the checkpoint ``path`` names (a step directory, or the newest checkpoint of a
    checkpoint directory), saved under any plan, into ``target`` and ``optimizer`` (whose
    state is replaced), ``scheduler``, ``data`` and ``scaler`` (a gradient scaler), and restore
    the random generators (and DTensor's RNG tracker).

    Parameters are overwritten in place, so an optimizer built before loading keeps working.
    Collective. Before anything is read, every file is checked against the manifest (sizes; and
    the sha256 when ``verify``) and the model fingerprint is compared; any failure is a
    :class:`CheckpointError` on every rank. When the newest step directory is incomplete or
    damaged the load is refused naming it and the newest complete one; ``fallback=True`` loads
    that one instead and says so on every rank. Under ``norm_kernel=memory-efficient`` a loaded
    norm weight with zero entries is a ``ZeroNormWeightError`` on every rank after the load
    (``norm_weights.check_loaded_weights``). Returns the checkpoint's metadata (``step``,
    ``directory``, ...).
    """
    root = os.path.abspath(os.fspath(path))
    rank = dist.get_rank() if distributed() else 0
    world = dist.get_world_size() if distributed() else 1
    choices, error = [], None
    try:
        if not is_step_directory(root):
            check_failed_save(root)
        choices = checkpoint_choices(root)
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
        error = e
    agree({"checkpoints": [c[0] for c in choices]}, what=f"loading {root}", error=error, error_cls=CheckpointError)
    meta, state = None, None
    explicit = len(choices) == 1 and choices[0][0] == root  # a step directory (or legacy checkpoint) named
    for i, choice in enumerate(choices):
        error = None
        try:
            meta, state = _prepare(target, optimizer, scheduler, data, scaler, choice, verify, rank, world)
        except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
            error = e
        failures = [
            (r, f)
            for r, f in enumerate(
                gather(
                    None
                    if error is None
                    else (
                        isinstance(error, CheckpointDamaged),
                        f"{type(error).__name__}: {one_line(error)}",
                        reason(error),
                    )
                )
            )
            if f is not None
        ]
        if not failures:
            break
        why = failures[0][1][2]
        if not explicit and all(f[0] for _, f in failures):
            older = next((c for c in choices[i + 1 :] if c[2] is None), None)
            if fallback and older is not None:
                print(
                    f"nest-fx rank {rank}: not loading {choice[0]} ({why}); loading {older[0]}, the newest complete "
                    "checkpoint before it",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            if i == 0:
                raise _refusal(root, choices, why)
        if error is not None:
            raise error
        first, (was_damage, message, _) = failures[0]
        raise (CheckpointDamaged if was_damage else CheckpointError)(f"rank {first} failed: {message}")
    source = choices[i][0]
    with named_collective_failures(f"loading {source}"):
        try:
            run_dcp(dcp.load, state, storage_reader=FileSystemReader(source), planner=DefaultLoadPlanner(**FLAT))
        except CheckpointException as e:
            raise CheckpointError(f"reading {source} failed: {dcp_failures(e)}; fix: load another checkpoint") from e
    if optimizer is not None:
        install_optimizer_state(target, optimizer, state)
    restore_train_state(target, state, scheduler, data, scaler)
    check_loaded_weights(target, source)  # memory-efficient norms: no zero weight entries loaded
    return dict(meta, directory=source)
