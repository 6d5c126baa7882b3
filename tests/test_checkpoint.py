"""Checkpoints (nest_fx/apply/checkpoint.py): save under one plan, load under another, exactly.

A phase (``_phase``, run on every rank of a launch) builds the model from a seed, optionally
loads a checkpoint, trains, saves mid-epoch and keeps training. Training uses AdamW, a warm-up
LR scheduler, an ``EpochBatches`` data position and random token noise from the global torch
generator, so a resume is exact only if the optimizer, scheduler, data position and RNG states
all come back. The full (unsharded) parameters and AdamW state right after a load must equal,
bit for bit, those the saving run had when it saved; the losses after the load must equal those
of the saving run, which kept training without interruption (fp32: 1e-6 relative), and those of
an uninterrupted single-device run (1e-5, the parity standard of tests/test_apply_parallel.py).
Then: verification (manifest, fingerprint, step), rotation, crash safety and the errors.
"""
from __future__ import annotations

import errno
import io
import json
import os
import shutil

import pytest
import torch

from nest_fx.apply.checkpoint import CheckpointError, load_checkpoint, resume_checkpoint, save_checkpoint
import nest_fx.apply.checkpoint_files as files
from nest_fx.apply.checkpoint_files import hash_file
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.train_state import EpochBatches
from nest_fx.models import build_seeded

MODEL = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"
MOE = "moe:hidden=32,layers=2,heads=4,seq=16,vocab=64,experts=4,top_k=2,capacity_factor=2.0"
BATCH, SEQ, LR, SAMPLES = 8, 16, 1e-3, 40  # 5 batches per epoch
LAUNCH_S = 90
LOSS_TOL = 1e-6
PARITY_TOL = 1e-5

# ZeRO-1 (FSDP2 over dp, 2-D DTensors with TP): its sharded parameters and optimizer state must
# reload into the replicated zero=0 pipeline
TP2_DP2_ZERO1 = {"tp": 2, "dp": 2, "zero": 1, "microbatch_size": 2, "num_microbatches": 2,
                 "sequence_parallel": True}
PP2_DP2 = {"pp": 2, "dp": 2, "microbatch_size": 1, "num_microbatches": 4, "schedule": "1f1b"}
SINGLE = {"microbatch_size": 4, "num_microbatches": 2}


def _dataset(vocab: int = 64):
    gen = torch.Generator().manual_seed(99)
    return torch.randint(0, vocab, (SAMPLES, SEQ + 1), generator=gen)


def _batch(step: int, vocab: int = 64):
    """A fixed batch per step (for the tests that need no data position)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
            torch.randint(0, vocab, (BATCH, SEQ), generator=gen))


class Trainer:
    """The training state the phases share: AdamW, a warm-up scheduler, the data position, and
    token noise drawn from the global generator (the same on every rank: same seed, same draws)."""

    def __init__(self, params, vocab: int, lr: float = LR):
        self.opt = torch.optim.AdamW(params, lr=lr)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.data = EpochBatches(SAMPLES, BATCH, seed=5)
        self.tokens, self.vocab = _dataset(vocab), vocab
        torch.manual_seed(123)

    def next_batch(self):
        rows = self.tokens[next(self.data)]
        x, y = rows[:, :-1].clone(), rows[:, 1:]
        noise = torch.rand(x.shape) < 0.25
        x[noise] = torch.randint(0, self.vocab, (int(noise.sum()),))
        return x, y

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()


def full_state(target, optimizer) -> dict:
    """{"model.<name>" | "optim.<name>.<key>": full tensor} of this rank (a collective over the
    stage for DTensors; every rank of the stage iterates the same names in the same order)."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for name, p in sorted(target.named_parameters(), key=lambda kv: kv[0]):
        out[f"model.{name}"] = full(p)
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            out[f"optim.{name}.{key}"] = full(value)
    return out


def _portable(state: dict) -> bytes:
    """Tensors leave a rank as bytes: torch.multiprocessing would share their memory with the
    parent through a file descriptor the exiting rank no longer serves."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _phase(spec: dict) -> dict:
    """One training run on this rank: [load] -> train -> [save -> train]."""
    from nest_fx.apply import auto_parallelize
    from nest_fx.plan import uniform_plan

    model, cfg = build_seeded(spec["model"], seed=spec.get("seed", 0))
    plan = uniform_plan(cfg.layers + 2, **spec["plan"])
    pm = auto_parallelize(model, _batch(0)[0], global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    # a wrong lr on purpose when loading: the checkpoint restores the group's hyperparameters
    run = Trainer(pm.parameters(), cfg.vocab_size, lr=0.5 if spec.get("load") else LR)
    out = {}
    if spec.get("load"):
        meta = pm.load(spec["load"], run.opt, scheduler=run.sched, data=run.data)
        out["loaded"] = _portable(full_state(pm, run.opt))
        out["lr"] = run.opt.param_groups[0]["lr"]
        out["position"] = (meta["step"], pm.step, run.data.epoch, run.data.batch)

    def train(steps: int):
        losses = []
        for _ in range(steps):
            losses.append(float(pm.train_step(*run.next_batch())))
            run.step()
        return losses

    out["losses"] = train(spec["train"])
    if spec.get("save"):
        out["saved_to"] = pm.save(spec["save"], run.opt, scheduler=run.sched, data=run.data)
        out["saved"] = _portable(full_state(pm, run.opt))
        out["after"] = train(spec.get("after", 0))
    return out


def train_plain(model, run: Trainer, steps: int):
    """``steps`` steps of a plain module in this process; the losses."""
    losses = []
    for _ in range(steps):
        x, y = run.next_batch()
        loss = lm_loss(model(x), y)
        loss.backward()
        run.step()
        losses.append(float(loss.detach()))
    return losses


def uninterrupted(spec: str, steps: int):
    """The same training on one device in this process, without stopping."""
    model, cfg = build_seeded(spec)
    return train_plain(model, Trainer(model.parameters(), cfg.vocab_size), steps)


def merge(results, key: str) -> dict:
    """Union of the ranks' full states; ranks that share a key must agree exactly."""
    merged = {}
    for r in results:
        for name, t in torch.load(io.BytesIO(r[key])).items():
            if name in merged:
                assert torch.equal(merged[name], t), f"ranks disagree on {name}"
            merged[name] = t
    return merged


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"not bit-identical: {bad[:5]}"


def assert_losses(got, want, tol: float = LOSS_TOL) -> None:
    """Equal to fp32 precision: 1e-6 relative (a loss near ln(64) has a 4.8e-7 spacing)."""
    assert len(got) == len(want) > 0
    assert all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)


def _plain_resume(spec: str, path: str, want: dict, want_losses, steps: int) -> None:
    """Load into an unwrapped single-device model in this process (no process group)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    model, cfg = build_seeded(spec, seed=7)
    run = Trainer(model.parameters(), cfg.vocab_size, lr=0.5)
    load_checkpoint(model, path, run.opt, scheduler=run.sched, data=run.data)
    assert_same(full_state(model, run.opt), want)
    assert_losses(train_plain(model, run, steps), want_losses)


# -- exact resume under other plans ----------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_S)
def test_resume_mid_epoch_under_other_plans_continues_exactly(tmp_path):
    ck_a, ck_b = str(tmp_path / "a"), str(tmp_path / "b")
    want = uninterrupted(MODEL, 10)
    # TP2 x DP2 (ZeRO-1, SP): 3 steps (mid-epoch), save, and go on without stopping
    first = launch(_phase, 4, {"model": MODEL, "plan": TP2_DP2_ZERO1, "train": 3, "save": ck_a, "after": 4},
                   timeout=LAUNCH_S)
    assert first[0]["saved_to"] == os.path.join(ck_a, "step-00000003")
    with open(os.path.join(first[0]["saved_to"], "nest_fx_checkpoint.json")) as fh:
        meta = json.load(fh)
    assert meta["format"] == "nest-fx-ckpt/2" and meta["step"] == 3 and "tp2" in meta["plan_summary"]
    assert_losses(first[0]["losses"] + first[0]["after"], want[:7], PARITY_TOL)

    # PP2 x DP2 resumes from step 3: the same losses as the run that did not stop
    second = launch(_phase, 4, {"model": MODEL, "plan": PP2_DP2, "seed": 3, "load": ck_a, "train": 4,
                                "save": ck_b, "after": 3}, timeout=LAUNCH_S)
    assert_same(merge(second, "loaded"), merge(first, "saved"))
    assert all(r["lr"] == LR for r in second)  # warm-up over after 3 steps; not the 0.5 the phase passed
    assert all(r["position"] == (3, 3, 0, 3) for r in second)  # step 3 = batch 3 of epoch 0
    assert_losses(second[0]["losses"], first[0]["after"])
    assert_losses(second[0]["losses"] + second[0]["after"], want[3:10], PARITY_TOL)  # across the epoch end

    # one device (a one-rank group, then a plain module without a process group) from step 7
    third = launch(_phase, 1, {"model": MODEL, "plan": SINGLE, "seed": 5, "load": ck_b, "train": 3},
                   timeout=LAUNCH_S)
    assert_same(merge(third, "loaded"), merge(second, "saved"))
    assert_losses(third[0]["losses"], second[0]["after"])
    _plain_resume(MODEL, ck_b, merge(second, "saved"), second[0]["after"], 3)


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 30)
def test_expert_parallel_to_single_device(tmp_path):
    """Each EP rank saves its experts under their global indices; one device loads all of them."""
    ck = str(tmp_path / "ep")
    first = launch(_phase, 2, {"model": MOE, "plan": {"dp": 2, "ep": 2, "microbatch_size": 4},
                               "train": 2, "save": ck, "after": 2}, timeout=LAUNCH_S)
    saved = merge(first, "saved")
    experts = [{k for k in merge([r], "saved") if ".experts." in k} for r in first]
    assert experts[0] and experts[1] and not experts[0] & experts[1]
    _plain_resume(MOE, ck, saved, first[0]["after"], 2)


# -- verification across ranks ---------------------------------------------------------------------

def _save_then_load_damaged(path: str) -> dict:
    """DP2: save; rank 0 then writes 1 KiB of garbage into rank 1's shard (which rank 1 hashes
    when loading); both ranks load."""
    import torch.distributed as dist

    from nest_fx.apply import auto_parallelize
    from nest_fx.plan import uniform_plan

    model, cfg = build_seeded(MODEL)
    plan = uniform_plan(cfg.layers + 2, dp=2, microbatch_size=4)
    pm = auto_parallelize(model, _batch(0)[0], global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    pm.train_step(*_batch(0))
    opt.step()
    directory = pm.save(path, opt)
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    shards = sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))
    if dist.get_rank() == 0:
        target = os.path.join(directory, shards[1])
        with open(target, "r+b") as fh:
            fh.seek(os.path.getsize(target) // 2)
            fh.write(os.urandom(1024))
    dist.barrier()
    try:
        pm.load(path, opt)
        return {"error": None}
    except CheckpointError as e:
        return {"error": str(e), "shard": shards[1], "unchanged": all(torch.equal(p, before[n])
                                                                       for n, p in pm.named_parameters())}


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 30)
def test_a_damaged_shard_that_one_rank_checks_fails_every_rank(tmp_path):
    results = launch(_save_then_load_damaged, 2, str(tmp_path / "ck"), timeout=LAUNCH_S)
    shard = results[0]["shard"]
    assert results[1]["error"].startswith(str(tmp_path / "ck" / "step-00000001" / shard) + " is damaged: its sha256")
    assert results[0]["error"] == results[1]["error"]  # the same refusal on every rank
    assert "holds no complete checkpoint before step-00000001" in results[0]["error"]
    assert all(r["unchanged"] for r in results)  # refused before anything was loaded


# -- crash safety --------------------------------------------------------------------------------

def _killed_during_save(path: str) -> None:
    """DP2: save at step 1 (and write its full state next to it), train a step, then rank 1 dies
    halfway through writing the next checkpoint, like a process killed by the scheduler."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from nest_fx.apply import auto_parallelize
    from nest_fx.plan import uniform_plan

    model, cfg = build_seeded(MODEL)
    plan = uniform_plan(cfg.layers + 2, dp=2, microbatch_size=4)
    pm = auto_parallelize(model, _batch(0)[0], global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    for step in range(2):
        pm.train_step(*_batch(step))
        opt.step()
        opt.zero_grad()
        if step == 0:
            pm.save(path, opt)
            state = full_state(pm, opt)
            if dist.get_rank() == 0:
                torch.save(state, path + ".expected")

    def dying_write(self, plan, planner):
        with open(os.path.join(self.path, "__1_0.distcp"), "wb") as fh:
            fh.write(b"half a shard")
        os._exit(1)

    if dist.get_rank() == 1:
        FileSystemWriter.write_data = dying_write
    pm.save(path, opt)


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 30)
def test_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    # the dead rank fails the launch; nobody waits out a timeout (the launch's lies beyond the test's)
    with pytest.raises(RuntimeError, match="rank"):
        launch(_killed_during_save, 2, path, timeout=LAUNCH_S + 300)  # the test times out at LAUNCH_S + 30
    assert sorted(os.listdir(path)) == ["latest", "step-00000001"]  # rank 0 removed the temporary
    want = torch.load(path + ".expected")
    model, _ = build_seeded(MODEL, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    assert load_checkpoint(model, path, opt)["step"] == 1
    assert_same(full_state(model, opt), want)


def _trained(steps: int = 1, spec: str = MODEL):
    """(model, AdamW) trained ``steps`` steps on one device in this process (no process group)."""
    model, cfg = build_seeded(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(steps):
        x, y = _batch(s, cfg.vocab_size)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh():
    model, _ = build_seeded(MODEL, seed=7)
    return model, torch.optim.AdamW(model.parameters())


def test_a_full_disk_leaves_nothing_behind_and_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    """A writer that fails with ENOSPC stands in for a full disk (tests cannot mount a small
    tmpfs everywhere; scripts/bench_faults.py does where it can)."""
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ck")
    model, opt = _trained(1)
    save_checkpoint(model, path, opt, step=1)
    want = full_state(model, opt)
    model, opt = _trained(2)

    def full_disk(self, plan, planner):
        with open(os.path.join(self.path, "__0_0.distcp"), "wb") as fh:
            fh.write(b"half a shard")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    with pytest.raises(CheckpointError, match="(?s)step-00000002.*failed; nothing was left behind and the previous "
                                              "checkpoints are intact.*No space left on device"):
        save_checkpoint(model, path, opt, step=2)
    monkeypatch.undo()
    # nothing of the failed save; a note of the room it needed, for the next load
    assert sorted(os.listdir(path)) == ["SAVE_FAILED.json", "latest", "step-00000001"]
    fresh, fresh_opt = _fresh()
    assert load_checkpoint(fresh, path, fresh_opt)["step"] == 1  # this disk has room again: the load goes on
    assert_same(full_state(fresh, fresh_opt), want)
    # while the disk is still full, a (re)started job's load stops before training towards the same failure
    need = json.load(open(os.path.join(path, "SAVE_FAILED.json")))["need_bytes"]
    assert need >= sum(os.path.getsize(os.path.join(path, "step-00000001", n))
                       for n in os.listdir(os.path.join(path, "step-00000001")) if n != "MANIFEST.json")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, (1 << 30) - 4096, 4096))
    with pytest.raises(CheckpointError, match=r"the last save into .*ck \(step 2\) failed for lack of space and its "
                                              r"filesystem still has 0.0 MiB free.*would fail again at the same save"):
        load_checkpoint(fresh, path, fresh_opt)
    assert load_checkpoint(fresh, os.path.join(path, "step-00000001"), fresh_opt)["step"] == 1  # reading: allowed
    monkeypatch.undo()
    save_checkpoint(model, path, opt, step=2)  # a save that succeeds removes the note
    assert sorted(os.listdir(path)) == ["latest", "step-00000001", "step-00000002"]


def test_keep_last_n_with_a_latest_pointer(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = _trained(1)
    states = {}
    for step in range(1, 6):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # a different state per step
        save_checkpoint(model, path, opt, step=step, keep=3)
        states[step] = full_state(model, opt)
    assert sorted(os.listdir(path)) == ["latest", "step-00000003", "step-00000004", "step-00000005"]
    assert open(os.path.join(path, "latest")).read() == "step-00000005\n"
    fresh, fresh_opt = _fresh()
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
    model, opt = _trained(1)
    directory = save_checkpoint(model, path, opt, step=1)
    shard = os.path.join(directory, "__0_0.distcp")
    pristine = open(shard, "rb").read()
    # 1 KiB of garbage inside one tensor's bytes: same size, another hash
    with open(shard, "r+b") as fh:
        fh.seek(len(pristine) // 2)
        fh.write(os.urandom(1024))
    fresh, fresh_opt = _fresh()
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
    with pytest.raises(CheckpointError, match=r"holds another model \(\d+ tensors, this model has \d+; only in the "
                                              r"checkpoint: layers\.4\..*; fix: load a checkpoint of this model"):
        load_checkpoint(four, path)
    wider, _ = build_seeded(MODEL.replace("layers=2", "layers=6").replace("hidden=32", "hidden=48"))
    with pytest.raises(CheckpointError, match=r"other shapes: .*\(64, 32\) saved, \(64, 48\) now"):
        load_checkpoint(wider, path)


def test_step_and_keep_are_validated(tmp_path):
    model, _ = _trained(1)
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
    model, opt = _trained(1)
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
    model, opt = _trained(1)
    save_checkpoint(model, path, opt, step=1)
    model, opt = _trained(2)
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
    fresh, fresh_opt = _fresh()
    assert load_checkpoint(fresh, path, fresh_opt)["step"] == 1  # the set-aside copy is complete
    tmp = next(os.path.join(path, n) for n in names if n.startswith(".tmp-step-"))
    os.rename(tmp, os.path.join(path, "step-00000001"))  # a crash after the rename, before `latest`
    assert load_checkpoint(fresh, path, fresh_opt)["sequence"] == 2  # the newest by the order of saves
    assert_same(full_state(fresh, fresh_opt), want)
    resume_checkpoint(fresh, path, fresh_opt)  # cleans what the crash left
    assert sorted(os.listdir(path)) == ["latest", "step-00000001"]


def test_resume_checks_the_directory_before_training(tmp_path, monkeypatch):

    model, opt = _trained(1)
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
    model, opt = _trained(1)
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
    model, opt = _trained(1)
    want = full_state(model, opt)
    directory = save_checkpoint(model, str(tmp_path / "ck"), opt, step=1)
    legacy = str(tmp_path / "legacy")
    shutil.copytree(directory, legacy)
    os.remove(os.path.join(legacy, "MANIFEST.json"))
    meta_path = os.path.join(legacy, "nest_fx_checkpoint.json")
    meta = json.load(open(meta_path))
    json.dump({k: meta[k] for k in ("step", "optimizer", "world_size", "plan")} | {"format": "nest-fx-ckpt/1"},
              open(meta_path, "w"))
    fresh, fresh_opt = _fresh()
    with pytest.warns(RuntimeWarning, match="without a manifest"):
        assert load_checkpoint(fresh, legacy, fresh_opt)["step"] == 1
    assert_same(full_state(fresh, fresh_opt), want)
    with pytest.raises(CheckpointError, match="it is a single checkpoint"):
        save_checkpoint(fresh, legacy, step=2)
