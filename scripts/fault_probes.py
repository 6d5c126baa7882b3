"""Probes of scripts/bench_faults.py that need no process group: damaged, incomplete and other-model
checkpoints, a load after a save that filled the disk; and the helpers every probe uses (``row``,
``timed``, ``trained``). Run them through ``python scripts/bench_faults.py``."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.distributed.checkpoint import FileSystemWriter

import nest_fx.apply.checkpoint_files as checkpoint_files
from nest_fx.apply import CheckpointError
from nest_fx.apply.checkpoint import load_checkpoint, save_checkpoint
from nest_fx.apply.losses import lm_loss
from nest_fx.common.errors import NestFxError
from nest_fx.models import build_seeded
from nest_fx.testing import FAULT_MODEL

MEDIUM = "llama:hidden=512,layers=4,heads=8,seq=64,vocab=8000"  # ~21M parameters: a 250 MB checkpoint with AdamW


def row(probe: str, fault: str, outcome: str, detect_s: Optional[float], ok: bool, **details) -> Dict[str, Any]:
    return {"probe": probe, "fault": fault, "outcome": outcome, "detect_s": detect_s, "ok": bool(ok), **details}


def timed(fn: Callable[[], Any]):
    """(seconds, the NestFxError raised or None)."""
    start = time.perf_counter()
    try:
        fn()
    except NestFxError as e:
        return time.perf_counter() - start, e
    return time.perf_counter() - start, None


def trained(spec: str, steps: int = 1):
    model, cfg = build_seeded(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def probe_fallback(work: str) -> List[Dict[str, Any]]:
    path = os.path.join(work, "fallback")
    model, opt = trained(FAULT_MODEL)
    for step in (1, 2, 3):
        save_checkpoint(model, path, opt, step=step, keep=None)
    newest = os.path.join(path, "step-00000003")
    os.remove(os.path.join(newest, checkpoint_files.MANIFEST_FILE))
    fresh, _ = build_seeded(FAULT_MODEL, seed=7)
    detect, error = timed(lambda: load_checkpoint(fresh, path))
    ok = (
        isinstance(error, CheckpointError)
        and f"newest checkpoint {newest}" in str(error)
        and "newest complete checkpoint is" in str(error)
        and "step-00000002" in str(error)
    )
    rows = [
        row(
            "fallback",
            "newest step directory lost its MANIFEST.json",
            f"refused: '{str(error).split('; fix')[0]}'",
            detect,
            ok,
        )
    ]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        took = load_checkpoint(fresh, path, fallback=True)["step"]
    said = err.getvalue().strip()
    rows.append(
        row(
            "fallback",
            "the same, load(..., fallback=True)",
            f"loaded step {took}; said: '{said}'",
            None,
            took == 2 and said.count("\n") == 0 and "not loading" in said,
        )
    )
    return rows


def probe_load_after_full(work: str) -> Dict[str, Any]:
    """A save fails with ENOSPC; a restarted job loads while the disk is still full."""
    ckpt = os.path.join(work, "ckpt")
    model, opt = trained(FAULT_MODEL)
    save_checkpoint(model, ckpt, opt, step=1)
    real_write, real_usage = FileSystemWriter.write_data, checkpoint_files.shutil.disk_usage

    def enospc(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    FileSystemWriter.write_data = enospc
    try:
        timed(lambda: save_checkpoint(model, ckpt, opt, step=2))
    finally:
        FileSystemWriter.write_data = real_write
    checkpoint_files.shutil.disk_usage = lambda p: shutil._ntuple_diskusage(1 << 30, (1 << 30) - 4096, 4096)
    try:
        detect, error = timed(lambda: load_checkpoint(model, ckpt, opt))
    finally:
        checkpoint_files.shutil.disk_usage = real_usage
    ok = isinstance(error, CheckpointError) and "would fail again at the same save" in str(error)
    return row(
        "load-after-full",
        "load after a save that filled the disk (disk still full)",
        f"refused before training: '{str(error).split('; fix')[0]}'",
        detect,
        ok,
    )


def probe_corrupt(work: str) -> Dict[str, Any]:
    path = os.path.join(work, "corrupt")
    model, opt = trained(MEDIUM)
    directory = save_checkpoint(model, path, opt, step=1)
    size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    fresh, _ = build_seeded(MEDIUM, seed=7)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    manifest = checkpoint_files.read_manifest(directory)
    # the check alone (what verify=True adds to a load), best of 3: the machine is shared
    hashing = min(
        timed(lambda: checkpoint_files.check_hashes(directory, manifest, sorted(manifest["files"])))[0]
        for _ in range(3)
    )
    unverified = min(timed(lambda: load_checkpoint(fresh, path, fresh_opt, verify=False))[0] for _ in range(3))
    shard = os.path.join(directory, "__0_0.distcp")
    with open(shard, "r+b") as fh:
        fh.seek(os.path.getsize(shard) // 2)
        fh.write(os.urandom(1024))
    detect, error = timed(lambda: load_checkpoint(fresh, path, fresh_opt))
    ok = isinstance(error, CheckpointError) and f"{shard} is damaged" in str(error)
    outcome = (
        f"refused: '{str(error).split(';')[0]}' (checking {size / 2**20:.0f} MiB: {hashing:.2f} s of sha256; "
        f"a load without the check {unverified:.2f} s)"
    )
    return row(
        "corrupt",
        "1 KiB of garbage in a tensor's bytes",
        outcome,
        detect,
        ok,
        checkpoint_mib=size / 2**20,
        sha256_s=hashing,
        load_unverified_s=unverified,
        sha256_mib_per_s=size / 2**20 / hashing,
    )


def probe_wrong_model(work: str) -> Dict[str, Any]:
    path = os.path.join(work, "wrong-model")
    six, _ = build_seeded(FAULT_MODEL.replace("layers=2", "layers=6"))
    save_checkpoint(six, path, step=0)
    four, _ = build_seeded(FAULT_MODEL.replace("layers=2", "layers=4"))
    detect, error = timed(lambda: load_checkpoint(four, path))
    ok = isinstance(error, CheckpointError) and "holds another model" in str(error)
    return row(
        "wrong-model",
        "6-layer checkpoint into a 4-layer model",
        f"refused: '{str(error).split('; fix')[0]}'",
        detect,
        ok,
    )
