"""Checkpoints (nest_fx/apply/checkpoint.py): save under one plan, load under another.

A phase (``_phase``, run on every rank of a launch) builds the model from a seed, optionally
loads a checkpoint, trains, saves and keeps training. The full (unsharded) parameters and
AdamW state right after a load must equal, bit for bit, those the saving run had when it
saved; the losses of the steps after the load must equal those of the saving run, which kept
training without interruption (fp32: 1e-6 relative). Crash safety: a rank killed halfway through
a save, a failed write, a crash between the two directory renames; and the error messages.
"""
from __future__ import annotations

import io
import json
import os

import pytest
import torch

from nest_fx.apply.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_seeded

MODEL = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"
MOE = "moe:hidden=32,layers=2,heads=4,seq=16,vocab=64,experts=4,top_k=2,capacity_factor=2.0"
BATCH, SEQ, LR = 8, 16, 1e-3
LAUNCH_S = 90
LOSS_TOL = 1e-6

# ZeRO-1 (FSDP2 over dp, 2-D DTensors with TP): its sharded parameters and optimizer state must
# reload into the replicated zero=0 pipeline
TP2_DP2_ZERO1 = {"tp": 2, "dp": 2, "zero": 1, "microbatch_size": 2, "num_microbatches": 2,
                 "sequence_parallel": True}
PP2_DP2 = {"pp": 2, "dp": 2, "microbatch_size": 1, "num_microbatches": 4, "schedule": "1f1b"}
SINGLE = {"microbatch_size": 4, "num_microbatches": 2}


def _batch(step: int, vocab: int = 64):
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
            torch.randint(0, vocab, (BATCH, SEQ), generator=gen))


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
    opt = torch.optim.AdamW(pm.parameters(), lr=0.5 if spec.get("load") else LR)
    out = {"step": 0}
    if spec.get("load"):
        out["step"] = pm.load(spec["load"], opt)["step"]
        out["loaded"] = _portable(full_state(pm, opt))
        out["lr"] = opt.param_groups[0]["lr"]

    def train(steps: int):
        losses = []
        for _ in range(steps):
            losses.append(float(pm.train_step(*_batch(out["step"], cfg.vocab_size))))
            opt.step()
            opt.zero_grad()
            out["step"] += 1
        return losses

    out["losses"] = train(spec["train"])
    if spec.get("save"):
        pm.save(spec["save"], opt, step=out["step"])
        out["saved"] = _portable(full_state(pm, opt))
        out["after"] = train(spec.get("after", 0))
    return out


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


def assert_losses(got, want) -> None:
    """Equal to fp32 precision: 1e-6 relative (a loss near ln(64) has a 4.8e-7 spacing)."""
    assert len(got) == len(want) > 0
    assert all(abs(a - b) <= LOSS_TOL * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)


def _plain_resume(spec: str, path: str, want: dict, want_losses, steps: int) -> None:
    """Load into an unwrapped single-device model in this process (no process group)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    model, cfg = build_seeded(spec, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    step = load_checkpoint(model, path, opt)["step"]
    assert_same(full_state(model, opt), want)
    losses = []
    for s in range(step, step + steps):
        x, y = _batch(s, cfg.vocab_size)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert_losses(losses, want_losses)


# -- resharding ----------------------------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.timeout(3 * LAUNCH_S)
def test_tp2_dp2_zero1_to_pp2_dp2_to_single_device(tmp_path):
    ck_a, ck_b = str(tmp_path / "a"), str(tmp_path / "b")
    first = launch(_phase, 4, {"model": MODEL, "plan": TP2_DP2_ZERO1, "train": 2, "save": ck_a, "after": 2},
                   timeout=LAUNCH_S)
    with open(os.path.join(ck_a, "nest_fx_checkpoint.json")) as fh:
        meta = json.load(fh)
    assert meta["format"] == "nest-fx-ckpt/1" and meta["step"] == 2 and "tp2" in meta["plan_summary"]

    second = launch(_phase, 4, {"model": MODEL, "plan": PP2_DP2, "seed": 3, "load": ck_a, "train": 2,
                                "save": ck_b, "after": 2}, timeout=LAUNCH_S)
    assert_same(merge(second, "loaded"), merge(first, "saved"))
    assert all(r["lr"] == LR for r in second)
    assert_losses(second[0]["losses"], first[0]["after"])

    third = launch(_phase, 1, {"model": MODEL, "plan": SINGLE, "seed": 5, "load": ck_b, "train": 2},
                   timeout=LAUNCH_S)
    assert_same(merge(third, "loaded"), merge(second, "saved"))
    assert_losses(third[0]["losses"], second[0]["after"])
    _plain_resume(MODEL, ck_b, merge(second, "saved"), second[0]["after"], 2)


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


def _load_deeper_model(path: str) -> str:
    """PP2 of a 4-layer model loading a 2-layer checkpoint: stage 0 (embedding, layers 0-1) finds
    all its keys, stage 1 (layers 2-3, norm, head) does not."""
    from nest_fx.apply import auto_parallelize
    from nest_fx.plan import uniform_plan

    model, cfg = build_seeded(MODEL.replace("layers=2", "layers=4"))
    plan = uniform_plan(cfg.layers + 2, pp=2, microbatch_size=2, num_microbatches=4)
    pm = auto_parallelize(model, _batch(0)[0], global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    try:
        pm.load(path)
    except CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 30)
def test_a_key_missing_on_one_stage_fails_every_rank(tmp_path):
    model, _ = build_seeded(MODEL)
    path = save_checkpoint(model, str(tmp_path / "ck"))
    errors = launch(_load_deeper_model, 2, path, timeout=LAUNCH_S)
    assert errors[0].startswith("rank 1 failed: CheckpointError: ") and errors[0].endswith(errors[1])
    assert "has no model.layers.2." in errors[1] and "fix:" in errors[1]


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
            pm.save(path, opt, step=1)
            state = full_state(pm, opt)
            if dist.get_rank() == 0:
                torch.save(state, path + ".expected")

    def dying_write(self, plan, planner):
        with open(os.path.join(self.path, "__1_0.distcp"), "wb") as fh:
            fh.write(b"half a shard")
        os._exit(1)

    if dist.get_rank() == 1:
        FileSystemWriter.write_data = dying_write
    pm.save(path, opt, step=2)


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 30)
def test_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path):
    import time

    path = str(tmp_path / "ck")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank"):
        launch(_killed_during_save, 2, path, timeout=LAUNCH_S)
    assert time.monotonic() - start < 30  # the dead rank fails the launch; nobody waits out a timeout
    leftovers = [d for d in os.listdir(tmp_path) if ".tmp-" in d]
    assert len(leftovers) == 1 and "__1_0.distcp" in os.listdir(tmp_path / leftovers[0])
    want = torch.load(path + ".expected")
    model, _ = build_seeded(MODEL, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    assert load_checkpoint(model, path, opt)["step"] == 1
    assert_same(full_state(model, opt), want)
    save_checkpoint(model, path, opt, step=1)  # the next successful save removes the leftover
    assert not [d for d in os.listdir(tmp_path) if ".tmp-" in d]


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


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    path = str(tmp_path / "ck")
    model, opt = _trained(1)
    save_checkpoint(model, path, opt, step=1)
    want = full_state(model, opt)
    model, opt = _trained(2)
    original = FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        with open(os.path.join(self.path, "__0_0.distcp"), "wb") as fh:
            fh.write(b"half a shard")
        raise OSError("disk full")

    monkeypatch.setattr(FileSystemWriter, "write_data", failing_write)
    with pytest.raises(CheckpointError, match="(?s)previous checkpoint there.*untouched.*disk full"):
        save_checkpoint(model, path, opt, step=2)
    monkeypatch.setattr(FileSystemWriter, "write_data", original)
    fresh, _ = build_seeded(MODEL, seed=7)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    assert load_checkpoint(fresh, path, fresh_opt)["step"] == 1
    assert_same(full_state(fresh, fresh_opt), want)


def test_crash_between_the_two_renames_loads_the_newest_complete_copy(tmp_path, monkeypatch):
    import nest_fx.apply.checkpoint as ckpt

    path = str(tmp_path / "ck")
    model, opt = _trained(1)
    save_checkpoint(model, path, opt, step=1)
    model, opt = _trained(2)
    want = full_state(model, opt)
    real_rename = os.rename

    def crash_on_second_rename(src, dst):
        if os.path.basename(str(src)).startswith("ck.tmp-"):  # not DCP's own renames inside it
            raise OSError("power cut")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", crash_on_second_rename)
    with pytest.raises(CheckpointError, match="power cut"):
        save_checkpoint(model, path, opt, step=2)
    monkeypatch.undo()
    assert not os.path.exists(path) and len(os.listdir(tmp_path)) == 2  # path.old-* and path.tmp-*
    fresh, _ = build_seeded(MODEL, seed=7)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with pytest.warns(RuntimeWarning, match="interrupted"):
        assert load_checkpoint(fresh, path, fresh_opt)["step"] == 2
    assert_same(full_state(fresh, fresh_opt), want)
    save_checkpoint(fresh, path, fresh_opt, step=2)
    assert os.listdir(tmp_path) == ["ck"]


def test_clear_errors(tmp_path):
    model, opt = _trained(1)
    missing = str(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=f"no checkpoint at {missing}; fix"):
        load_checkpoint(model, missing)
    path = save_checkpoint(model, str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match="saved without optimizer"):
        load_checkpoint(model, path, opt)
    other, _ = build_seeded("llama:hidden=48,layers=2,heads=4,seq=16,vocab=64")
    shape = r"model.embed.tok.weight has shape \(64, 32\) in the checkpoint but \(64, 48\) in the model; fix"
    with pytest.raises(CheckpointError, match=shape):
        load_checkpoint(other, path)
    with open(os.path.join(path, "nest_fx_checkpoint.json"), "w") as fh:
        fh.write("{truncated")
    with pytest.raises(CheckpointError, match="nest_fx_checkpoint.json is corrupt"):
        load_checkpoint(model, path)
    os.remove(os.path.join(path, "nest_fx_checkpoint.json"))
    with pytest.raises(CheckpointError, match="not a complete nest-fx checkpoint"):
        load_checkpoint(model, path)
    with pytest.raises(CheckpointError, match="refusing to replace"):
        save_checkpoint(model, path)  # a non-empty directory that is not (any more) a checkpoint
    assert issubclass(CheckpointError, ValueError)
