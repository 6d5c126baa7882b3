"""The checkpoint directory on disk: step directories, their manifests, the ``latest`` pointer,
rotation, stale temporaries and the pre-flight check. Plain files, no process group: the
collective side (who writes, who hashes, who publishes) is :mod:`nest_fx.apply.checkpoint`.

Layout of a checkpoint directory (the path given to ``save``/``load``/``resume``)::

    ckpt/latest                      "step-00000012": the newest complete checkpoint (replaced atomically)
    ckpt/step-00000012/              one checkpoint
        .metadata, __<rank>_0.distcp   DCP: tensors, optimizer state, train state (every rank its shards)
        nest_fx_checkpoint.json        format, step, sequence, model fingerprint, plan, ...
        MANIFEST.json                  size and sha256 of every other file; written last
    ckpt/.tmp-step-00000016-<token>/ a save in progress (removed when it fails, or at the next start)

A step directory is *complete* when its ``MANIFEST.json`` parses; it appears under its final
name by one rename after the manifest is on disk, so a crash leaves either the complete
directory or a temporary one. ``sequence`` (1, 2, 3, ... in the order of saves) decides which
checkpoint is the newest, so a run that went back to an older step and saved again is ordered
correctly; keep-last-N deletes the oldest complete ones by sequence and never touches a directory
without a nest-fx manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

from nest_fx.common.errors import NestFxError

MANIFEST_FILE = "MANIFEST.json"
META_FILE = "nest_fx_checkpoint.json"
LATEST_FILE = "latest"
SAVE_FAILED_FILE = "SAVE_FAILED.json"  # why the last save failed for lack of space (removed by the next save)
MANIFEST_FORMAT = "nest-fx-manifest/1"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
HASH_CHUNK = 8 << 20


class CheckpointError(NestFxError, ValueError):
    """A checkpoint cannot be written or read; the message names the path and the fix."""


class CheckpointDamaged(CheckpointError):
    """A step directory is incomplete or its files are damaged (missing, truncated, altered):
    the cases where ``load(..., fallback=True)`` may take the checkpoint before it."""


def step_name(step: int) -> str:
    """``step-00000012``: the directory of a step (sorted by name in step order)."""
    return f"step-{step:08d}"


def fsync_dir(directory: str) -> None:
    """Make a rename or a new entry in ``directory`` durable (where the filesystem supports it)."""
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


def write_json(path: str, data: Any) -> None:
    """Write JSON durably: a temporary name, fsync, rename over ``path``, fsync the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(path))


def hash_file(path: str) -> Tuple[int, str]:
    """(bytes, sha256 hex) of a file."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(HASH_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def write_manifest(directory: str, files: Dict[str, Dict[str, Any]], step: int, sequence: int) -> None:
    """The manifest of ``directory``: ``files`` is {name: {"bytes", "sha256"}} of every other file."""
    write_json(
        os.path.join(directory, MANIFEST_FILE),
        {"format": MANIFEST_FORMAT, "step": step, "sequence": sequence, "files": files},
    )


def load_json(path: str, missing: str) -> Any:
    """A checkpoint's JSON file; CheckpointError ``missing`` when absent, naming it when unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise CheckpointDamaged(missing) from None
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"{path} is damaged ({e}); fix: load another checkpoint") from None


def read_manifest(directory: str) -> dict:
    """The manifest of a complete checkpoint, validated; CheckpointError naming the problem."""
    path = os.path.join(directory, MANIFEST_FILE)
    manifest = load_json(
        path,
        f"{directory} is not a complete nest-fx checkpoint (no {MANIFEST_FILE}: the save did "
        "not finish, or this is another kind of directory); fix: load another checkpoint",
    )
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(
            f"{path}: not a {MANIFEST_FORMAT} manifest; fix: load it with the nest-fx version that wrote it"
        )
    files, step, sequence = manifest.get("files"), manifest.get("step"), manifest.get("sequence")
    if not (
        isinstance(files, dict)
        and _natural(step)
        and _natural(sequence)
        and all(
            isinstance(v, dict) and _natural(v.get("bytes")) and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
    ):
        raise CheckpointDamaged(
            f"{path} is damaged (fields missing or of the wrong type); fix: load another checkpoint"
        )
    return manifest


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_sizes(directory: str, manifest: dict) -> None:
    """CheckpointError naming the first file of the manifest that is missing or of another size."""
    for name, entry in sorted(manifest["files"].items()):
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointDamaged(
                f"{path} is missing (listed in {MANIFEST_FILE}); the checkpoint is damaged; "
                "fix: load another checkpoint"
            ) from None
        if size != entry["bytes"]:
            raise CheckpointDamaged(
                f"{path} has {size} bytes, its manifest says {entry['bytes']}: the checkpoint is "
                "damaged (truncated?); fix: load another checkpoint"
            )


def check_hashes(directory: str, manifest: dict, names: List[str]) -> None:
    """CheckpointError naming the first of ``names`` whose sha256 differs from the manifest."""
    for name in names:
        path = os.path.join(directory, name)
        try:
            _, digest = hash_file(path)
        except OSError as e:
            raise CheckpointDamaged(
                f"{path} cannot be read ({e.strerror or e}); fix: load another checkpoint"
            ) from None
        if digest != manifest["files"][name]["sha256"]:
            raise CheckpointDamaged(
                f"{path} is damaged: its sha256 differs from the one in {MANIFEST_FILE} (bytes changed "
                "after the save); fix: load another checkpoint, e.g. the previous step"
            )


def complete_checkpoints(root: str) -> List[Tuple[int, str, dict]]:
    """(sequence, directory, manifest) of every complete checkpoint under ``root``, oldest first:
    step directories and copies set aside by an interrupted replacement (``.old-step-*``)."""
    found = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if not (_STEP_RE.match(name) or name.startswith(OLD_PREFIX + "step-")):
            continue
        directory = os.path.join(root, name)
        try:
            manifest = read_manifest(directory)
        except CheckpointError:
            continue
        found.append((manifest["sequence"], directory, manifest))
    return sorted(found, key=lambda t: (t[0], not os.path.basename(t[1]).startswith(OLD_PREFIX)))


def is_checkpoint_root(root: str) -> bool:
    """Whether ``root`` holds nest-fx step directories, a ``latest`` pointer or a failed save's note."""
    try:
        names = os.listdir(root)
    except OSError:
        return False
    return LATEST_FILE in names or SAVE_FAILED_FILE in names or any(_STEP_RE.match(n) for n in names)


def is_step_directory(path: str) -> bool:
    """Whether ``path`` is named like a step directory (``.../step-00000012``)."""
    return bool(_STEP_RE.match(os.path.basename(os.path.normpath(path))))


def reason(error: Exception) -> str:
    """An error's message without its ``; fix: ...`` part."""
    return " ".join(str(error).split()).split("; fix:")[0]


def incomplete_steps(root: str) -> List[Tuple[str, Optional[int], int, str]]:
    """(directory, sequence or None, step, why) of every step directory under ``root`` whose
    manifest is missing or damaged; the sequence comes from its metadata file when that is readable."""
    out = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        match = _STEP_RE.match(name)
        directory = os.path.join(root, name)
        if not match or not os.path.isdir(directory):
            continue
        try:
            read_manifest(directory)
            continue
        except CheckpointError as e:
            why = reason(e)
        try:
            with open(os.path.join(directory, META_FILE), encoding="utf-8") as fh:
                sequence = json.load(fh).get("sequence")
        except (OSError, ValueError, AttributeError):
            sequence = None
        out.append((directory, sequence if _natural(sequence) else None, int(match.group(1)), why))
    return out


def newest_incomplete(root: str, complete: List[Tuple[int, str, dict]]) -> Optional[Tuple[str, str]]:
    """(directory, why) of a step directory that is newer than the newest complete checkpoint
    but not complete itself, or None. ``latest`` decides first: it only ever names a published
    step, so a ``latest`` whose directory is missing or damaged is the newest checkpoint (unless a
    set-aside copy of the same step, left by a crash while replacing it, is complete). Then a
    damaged step directory whose metadata says it was saved later, or (without ``latest``) one of
    a higher step whose metadata is unreadable."""
    latest = read_latest(root)
    if latest is not None and latest not in {d for _, d, _ in complete}:
        name = os.path.basename(latest)
        aside = any(os.path.basename(d).startswith(f"{OLD_PREFIX}{name}-") for _, d, _ in complete)
        if not os.path.exists(latest) and not aside:
            return latest, f"{latest} is missing (named by {os.path.join(root, LATEST_FILE)})"
        known = {d: sequence for d, sequence, _, _ in incomplete_steps(root)}
        older = known.get(latest) is not None and complete and known[latest] < complete[-1][0]
        if os.path.exists(latest) and not older:  # older: a crash after a later step was published
            try:
                read_manifest(latest)
            except CheckpointError as e:
                return latest, reason(e)
    top_sequence = complete[-1][0] if complete else 0
    top_step = complete[-1][2]["step"] if complete else -1
    newer = [
        (sequence if sequence is not None else step, directory, why)
        for directory, sequence, step, why in incomplete_steps(root)
        if (sequence is not None and sequence > top_sequence)
        or (sequence is None and latest is None and step > top_step)
    ]
    return max(newer)[1:] if newer else None


def next_sequence(root: str) -> int:
    """One past the highest sequence of any step directory (complete, or damaged with readable metadata)."""
    known = [s for s, _, _ in complete_checkpoints(root)] + [
        s for _, s, _, _ in incomplete_steps(root) if s is not None
    ]
    return max(known, default=0) + 1


def read_latest(root: str) -> Optional[str]:
    """The directory ``latest`` names, or None."""
    try:
        with open(os.path.join(root, LATEST_FILE), encoding="utf-8") as fh:
            name = fh.read().strip()
    except OSError:
        return None
    return os.path.join(root, name) if _STEP_RE.match(name) else None


def clean_stale(root: str) -> List[str]:
    """Delete what interrupted saves left in ``root`` (a job owns its checkpoint directory):
    temporaries, and set-aside copies whose step directory is complete. Returns what was removed."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        stale = name.startswith(TMP_PREFIX)
        if name.startswith(OLD_PREFIX):
            step = name[len(OLD_PREFIX) :].rsplit("-", 1)[0]
            try:
                read_manifest(os.path.join(root, step))
                stale = True
            except CheckpointError:
                stale = False  # the only copy of that step: keep it (it is loadable)
        if stale:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            removed.append(path)
    return removed


def publish(tmp: str, root: str, step: int, token: str, keep: Optional[int]) -> str:
    """Rename the finished ``tmp`` to its step directory (setting aside an older copy of the same
    step first), point ``latest`` at it and delete the oldest complete checkpoints beyond ``keep``.
    Returns the step directory."""
    final = os.path.join(root, step_name(step))
    aside = None
    if os.path.isdir(final):
        aside = os.path.join(root, f"{OLD_PREFIX}{step_name(step)}-{token}")
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(root)
    latest_tmp = os.path.join(root, f"{TMP_PREFIX}{LATEST_FILE}-{token}")
    with open(latest_tmp, "w", encoding="utf-8") as fh:
        fh.write(step_name(step) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(latest_tmp, os.path.join(root, LATEST_FILE))
    fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if keep is not None:
        for _, directory, _ in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(directory, ignore_errors=True)
    if os.path.exists(os.path.join(root, SAVE_FAILED_FILE)):
        os.remove(os.path.join(root, SAVE_FAILED_FILE))
    return final


def directory_bytes(directory: str) -> int:
    """Bytes of the files under ``directory`` (0 when it is gone)."""
    total = 0
    for parent, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(parent, name))
            except OSError:
                pass
    return total


def note_failed_save(root: str, step: int, need_bytes: int, error: str) -> None:
    """Record in ``root`` that a save failed for lack of space, so that a restarted job's
    ``load`` refuses to train towards the same failure (:func:`check_failed_save`)."""
    try:
        write_json(
            os.path.join(root, SAVE_FAILED_FILE),
            {"step": step, "need_bytes": need_bytes, "error": error, "time": time.time()},
        )
    except OSError:
        pass  # no room even for the note: the save's own error still says what happened


def check_failed_save(root: str) -> None:
    """CheckpointError when the last save into ``root`` failed for lack of space and the disk
    still has less free than that save needed: loading and training again would fail at the
    same save (and loop under ``torchrun --max_restarts``)."""
    path = os.path.join(root, SAVE_FAILED_FILE)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as fh:
            note = json.load(fh)
        need, step = int(note["need_bytes"]), note.get("step")
    except (OSError, ValueError, KeyError, TypeError):
        return  # an unreadable note says nothing: the room check of the next save still runs
    free = shutil.disk_usage(root).free
    if free < need:
        raise CheckpointError(
            f"the last save into {root} (step {step}) failed for lack of space and its filesystem still has "
            f"{free / 2**20:.1f} MiB free, a checkpoint needs about {need / 2**20:.1f} MiB: training from here would "
            "fail again at the same save; fix: free space or move the checkpoint directory, then start again (to "
            "read a checkpoint without saving, load its step directory)"
        )


def check_room(root: str, need_bytes: int) -> None:
    """CheckpointError unless ``root`` can be created, written and has ``need_bytes`` free."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f"{TMP_PREFIX}probe-{os.getpid()}-{time.time_ns()}")
        with open(probe, "wb") as fh:
            fh.write(b"nest-fx")
            fh.flush()
            os.fsync(fh.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint directory {root} is not writable ({e.strerror or e}); fix: pass a directory "
            "this job can write (on a filesystem every node sees)"
        ) from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise CheckpointError(
            f"checkpoint directory {root} has {free / 2**20:.1f} MiB free, two checkpoints need about "
            f"{need_bytes / 2**20:.1f} MiB (the new one is written before the old one is deleted); "
            "fix: free space, use another directory, or lower keep"
        )
