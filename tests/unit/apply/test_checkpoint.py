"""Checkpoints in one process (nest_fx/apply/checkpoint.py): verification (manifest,
fingerprint, step), rotation, crash safety, the data position and the errors. Saving under one
plan and loading under another, across processes, is tested in tests/distributed/apply/test_checkpoint_dist.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

from nest_fx.apply.checkpoint import CheckpointError, load_checkpoint, resume_checkpoint, save_checkpoint
import nest_fx.apply.checkpoint_files as files
from nest_fx.apply.checkpoint_files import hash_file
from nest_fx.apply.train_state import EpochBatches
from nest_fx.models import build_seeded

from checkpoint_helpers import MODEL, assert_same, fresh_model, full_state, trained


def test_a_full_disk_leaves_nothing_behind_and_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    """A writer that fails with ENOSPC stands in for a full disk (tests cannot mount a small
    tmpfs everywhere; scripts/bench_faults.py does where it can)."""
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ck")
    model, opt = trained(1)
    save_checkpoint(model, path, opt, step=1)
    want = full_state(model, opt)
    model, opt = trained(2)

    def full_disk(self, plan, planner):
        with open(os.path.join(self.path, "__0_0.distcp"), "wb") as fh:
            fh.write(b"half a shard")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    with pytest.raises(
        CheckpointError,
        match="(?s)step-00000002.*failed; nothing was left behind and the previous "
        "checkpoints are intact.*No space left on device",
    ):
        save_checkpoint(model, path, opt, step=2)
    monkeypatch.undo()
    # nothing of the failed save; a note of the room it needed, for the next load
    assert sorted(os.listdir(path)) == ["SAVE_FAILED.json", "latest", "step-00000001"]
    fresh, fresh_opt = fresh_model()
    assert load_checkpoint(fresh, path, fresh_opt)["step"] == 1  # this disk has room again: the load goes on
    assert_same(full_state(fresh, fresh_opt), want)
    # while the disk is still full, a (re)started job's load stops before training towards the same failure
    need = json.load(open(os.path.join(path, "SAVE_FAILED.json")))["need_bytes"]
    assert need >= sum(
        os.path.getsize(os.path.join(path, "step-00000001", n))
        for n in os.listdir(os.path.join(path, "step-00000001"))
        if n != "MANIFEST.json"
    )
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, (1 << 30) - 4096, 4096))
    with pytest.raises(
        CheckpointError,
        match=r"the last save into .*ck \(step 2\) failed for lack of space and its "
        r"filesystem still has 0.0 MiB free.*would fail again at the same save",
    ):
        load_checkpoint(fresh, path, fresh_opt)
    assert load_checkpoint(fresh, os.path.join(path, "step-00000001"), fresh_opt)["step"] == 1  # reading: allowed
    monkeypatch.undo()
    save_checkpoint(model, path, opt, step=2)  # a save that succeeds removes the note
    assert sorted(os.listdir(path)) == ["latest", "step-00000001", "step-00000002"]


def test_keep_last_n_with_a_latest_pointer(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = trained(1)
    states = {}
    for step in range(1, 6):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # a different state per step
        save_checkpoint(model, path, opt, step=step, keep=3)
        states[step] = full_state(model, opt)
    assert sorted(os.listdir(path)) == ["latest", "step-00000003", "step-00000004", "step-00000005"]
    assert open(os.path.join(path, "latest")).read() == "step-00000005\n"
    fresh, fresh_opt = fresh_model()
    assert load_checkpoint(fresh, path, fresh_opt)["step"] == 5
    assert_same(full_state(fresh, fresh_opt), states[5])
    meta = load_checkpoint(fresh, os.path.join(path, "step-00000003"), fresh_opt)  # a step directory itself
    assert meta["step"] == 3 and meta["directory"].endswith("step-00000003")
    assert_same(full_state(fresh, fresh_opt), states[3])
    # step None: one past the newest; keep=None keeps everything
    assert save_checkpoint(fresh, path, fresh_opt, keep=None).endswith("step-00000006")
    assert len([n for n in os.listdir(path) if n.startswith("step-")]) == 4
    # going back to step 3 and saving again: order of saves, not step numbers, decides the newest
    save_checkpoint(fresh, path, fresh_opt, step=4, keep=2)
    assert sorted(n for n in os.listdir(path) if n.startswith("step-")) == ["step-00000004", "step-00000006"]
    assert load_checkpoint(fresh, path, fresh_opt)["step"] == 4


def test_damaged_files_are_refused_by_name(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = trained(1)
    directory = save_checkpoint(model, path, opt, step=1)
    shard = os.path.join(directory, "__0_0.distcp")
    pristine = open(shard, "rb").read()
    # 1 KiB of garbage inside one tensor's bytes: same size, another hash
    with open(shard, "r+b") as fh:
        fh.seek(len(pristine) // 2)
        fh.write(os.urandom(1024))
    fresh, fresh_opt = fresh_model()
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    with pytest.raises(CheckpointError, match=f"{shard} is damaged: its sha256 differs"):
        load_checkpoint(fresh, path, fresh_opt)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())
    load_checkpoint(fresh, path, fresh_opt, verify=False)  # sizes only: the caller's choice
    with open(shard, "wb") as fh:
        fh.write(pristine[:100])
    with pytest.raises(CheckpointError, match=f"{shard} has 100 bytes, its manifest says {len(pristine)}"):
        load_checkpoint(fresh, path, fresh_opt)
    os.remove(shard)
    with pytest.raises(CheckpointError, match=f"{shard} is missing"):
        load_checkpoint(fresh, path, fresh_opt)
    with open(shard, "wb") as fh:
        fh.write(pristine)
    meta = os.path.join(directory, "nest_fx_checkpoint.json")
    with open(meta, "r+b") as fh:
        fh.seek(10)
        fh.write(b"X")
    with pytest.raises(CheckpointError, match="nest_fx_checkpoint.json is damaged"):
        load_checkpoint(fresh, directory, fresh_opt)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    six, _ = build_seeded(MODEL.replace("layers=2", "layers=6"))
    save_checkpoint(six, path, step=0)
    four, _ = build_seeded(MODEL.replace("layers=2", "layers=4"))
    with pytest.raises(
        CheckpointError,
        match=r"holds another model \(\d+ tensors, this model has \d+; only in the "
        r"checkpoint: layers\.4\..*; fix: load a checkpoint of this model",
    ):
        load_checkpoint(four, path)
    wider, _ = build_seeded(MODEL.replace("layers=2", "layers=6").replace("hidden=32", "hidden=48"))
    with pytest.raises(CheckpointError, match=r"other shapes: .*\(64, 32\) saved, \(64, 48\) now"):
        load_checkpoint(wider, path)


def test_step_and_keep_are_validated(tmp_path):
    model, _ = trained(1)
    for bad in (-1, True, "3", 2.5):
        with pytest.raises(CheckpointError, match="step must be a non-negative integer"):
            save_checkpoint(model, str(tmp_path / "ck"), step=bad)
    with pytest.raises(CheckpointError, match="keep=0"):
        save_checkpoint(model, str(tmp_path / "ck"), step=1, keep=0)
    assert not os.path.exists(tmp_path / "ck")  # refused before anything was written
    directory = save_checkpoint(model, str(tmp_path / "ck"), step=1)
    meta_path = os.path.join(directory, "nest_fx_checkpoint.json")
    meta = json.load(open(meta_path))
    meta["step"] = -4
    json.dump(meta, open(meta_path, "w"))
    # a consistent manifest (as a faulty writer would leave): the step itself is checked
    manifest_path = os.path.join(directory, "MANIFEST.json")
    manifest = json.load(open(manifest_path))
    size, digest = hash_file(meta_path)
    manifest["files"]["nest_fx_checkpoint.json"] = {"bytes": size, "sha256": digest}
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(CheckpointError, match="step -4 is not a non-negative integer"):
        load_checkpoint(model, directory)


def test_non_finite_state_is_not_saved(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = trained(1)
    save_checkpoint(model, path, opt, step=1)
    with pytest.raises(CheckpointError, match="loss is inf"):
        save_checkpoint(model, path, opt, step=2, loss=float("inf"))
    with torch.no_grad():
        model.layers[1].mlp.up.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="parameter layers.1.mlp.up.weight holds NaN"):
        save_checkpoint(model, path, opt, step=2)
    assert sorted(os.listdir(path)) == ["latest", "step-00000001"]
    save_checkpoint(model, path, opt, step=2, require_finite=False)  # the caller's choice
    assert load_checkpoint(model, path, opt)["step"] == 2


def test_crash_while_replacing_a_step_loads_the_newest_complete_copy(tmp_path, monkeypatch):

    path = str(tmp_path / "ck")
    model, opt = trained(1)
    save_checkpoint(model, path, opt, step=1)
    model, opt = trained(2)
    want = full_state(model, opt)
    real_rename = os.rename

    def crash_on_second_rename(src, dst):
        if os.path.basename(str(src)).startswith(".tmp-step-"):  # the new copy: after the old one moved aside
            raise OSError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", crash_on_second_rename)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # the crash: nobody cleans up
    with pytest.raises(CheckpointError, match="power cut"):
        save_checkpoint(model, path, opt, step=1)
    monkeypatch.undo()
    names = sorted(os.listdir(path))
    assert "step-00000001" not in names and any(n.startswith(".old-step-00000001") for n in names)
    fresh, fresh_opt = fresh_model()
    assert load_checkpoint(fresh, path, fresh_opt)["step"] == 1  # the set-aside copy is complete
    tmp = next(os.path.join(path, n) for n in names if n.startswith(".tmp-step-"))
    os.rename(tmp, os.path.join(path, "step-00000001"))  # a crash after the rename, before `latest`
    assert load_checkpoint(fresh, path, fresh_opt)["sequence"] == 2  # the newest by the order of saves
    assert_same(full_state(fresh, fresh_opt), want)
    resume_checkpoint(fresh, path, fresh_opt)  # cleans what the crash left
    assert sorted(os.listdir(path)) == ["latest", "step-00000001"]


def test_resume_checks_the_directory_before_training(tmp_path, monkeypatch):

    model, opt = trained(1)
    path = str(tmp_path / "new")
    assert resume_checkpoint(model, path, opt) is None and os.path.isdir(path)  # a fresh start
    os.makedirs(os.path.join(path, ".tmp-step-00000009-abc"))  # left by a save that crashed
    save_checkpoint(model, path, opt, step=2)
    assert sorted(os.listdir(path)) == ["latest", "step-00000002"]
    assert resume_checkpoint(model, path, opt)["step"] == 2
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="cannot create the checkpoint directory .*a-file/ck"):
        resume_checkpoint(model, str(blocker / "ck"), opt)
    with pytest.raises(CheckpointError, match="cannot save to .*a-file: it is a file"):
        resume_checkpoint(model, str(blocker), opt)
    free = shutil.disk_usage(path).free
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10 - 1000, 1000))
    with pytest.raises(CheckpointError, match=r"has 0.0 MiB free, two checkpoints need about"):
        resume_checkpoint(model, path, opt)
    assert free > 1000


def test_clear_errors(tmp_path):
    model, opt = trained(1)
    missing = str(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=f"no checkpoint at {missing}; fix"):
        load_checkpoint(model, missing)
    path = str(tmp_path / "ck")
    save_checkpoint(model, path, step=1)
    with pytest.raises(CheckpointError, match="saved without optimizer"):
        load_checkpoint(model, path, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(CheckpointError, match="holds no scheduler state"):
        load_checkpoint(model, path, scheduler=sched)
    with pytest.raises(ValueError, match="data= needs an object with state_dict"):
        save_checkpoint(model, path, step=2, data=[1, 2])
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_text("meow")
    with pytest.raises(CheckpointError, match="refusing to save into .*photos: it is a non-empty directory"):
        save_checkpoint(model, str(foreign), step=1)
    assert os.listdir(foreign) == ["cat.jpg"]
    with pytest.raises(CheckpointError, match="it is a single checkpoint"):
        save_checkpoint(model, os.path.join(path, "step-00000001"), step=2)
    assert issubclass(CheckpointError, ValueError)


def test_epoch_batches_resume_mid_epoch():
    a = EpochBatches(10, 3, seed=1)
    seen = [next(a) for _ in range(4)]  # 3 batches per epoch: the 4th starts epoch 1
    assert (a.epoch, a.batch) == (1, 1) and len(a) == 3
    assert len(set(torch.cat(seen[:3]).tolist())) == 9  # one epoch: 9 distinct samples of 10
    state = a.state_dict()
    following = [next(a) for _ in range(5)]
    b = EpochBatches(10, 3, seed=1)
    b.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(following, [next(b) for _ in range(5)]))
    assert not torch.equal(seen[0], seen[3])  # another permutation per epoch
    with pytest.raises(ValueError, match="batch_size=3, this run has 4"):
        EpochBatches(10, 4, seed=1).load_state_dict(state)


def test_a_checkpoint_of_the_earlier_one_directory_format_still_loads(tmp_path):
    """nest-fx-ckpt/1: DCP files and nest_fx_checkpoint.json in the directory itself, no manifest."""
    model, opt = trained(1)
    want = full_state(model, opt)
    directory = save_checkpoint(model, str(tmp_path / "ck"), opt, step=1)
    legacy = str(tmp_path / "legacy")
    shutil.copytree(directory, legacy)
    os.remove(os.path.join(legacy, "MANIFEST.json"))
    meta_path = os.path.join(legacy, "nest_fx_checkpoint.json")
    meta = json.load(open(meta_path))
    json.dump(
        {k: meta[k] for k in ("step", "optimizer", "world_size", "plan")} | {"format": "nest-fx-ckpt/1"},
        open(meta_path, "w"),
    )
    fresh, fresh_opt = fresh_model()
    with pytest.warns(RuntimeWarning, match="without a manifest"):
        assert load_checkpoint(fresh, legacy, fresh_opt)["step"] == 1
    assert_same(full_state(fresh, fresh_opt), want)
    with pytest.raises(CheckpointError, match="it is a single checkpoint"):
        save_checkpoint(fresh, legacy, step=2)
