"""Checkpoints across processes (gloo; nest_fx/apply/checkpoint.py): save under one plan, load
under another, exactly.

A phase (``_phase``, run on every rank of a launch) builds the model from a seed, optionally
loads a checkpoint, trains, saves mid-epoch and keeps training. Training uses AdamW, a warm-up
LR scheduler, an ``EpochBatches`` data position and random token noise from the global torch
generator, so a resume is exact only if the optimizer, scheduler, data position and RNG states
all come back. The full (unsharded) parameters and AdamW state right after a load must equal,
bit for bit, those the saving run had when it saved; the losses after the load must equal those
of the saving run, which kept training without interruption (fp32: 1e-6 relative), and those of
an uninterrupted single-device run (1e-5, the parity standard of tests/distributed/apply/test_apply_parallel.py).
Then: a damaged shard one rank checks, and a rank killed during a save. The single-process
checks (verification, rotation, crash safety, errors) are in tests/unit/apply/test_checkpoint.py.
"""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from nest_fx.apply.checkpoint import CheckpointError, load_checkpoint
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.train_state import EpochBatches
from nest_fx.models import build_seeded

from checkpoint_helpers import BATCH, LR, MODEL, SEQ, assert_same, fixed_batch, full_state

MOE = "moe:hidden=32,layers=2,heads=4,seq=16,vocab=64,experts=4,top_k=2,capacity_factor=2.0"
SAMPLES = 40  # 5 batches per epoch
LAUNCH_S = 90
LOSS_TOL = 1e-6
PARITY_TOL = 1e-5

# ZeRO-1 (FSDP2 over dp, 2-D DTensors with TP): its sharded parameters and optimizer state must
# reload into the replicated zero=0 pipeline
TP2_DP2_ZERO1 = {"tp": 2, "dp": 2, "zero": 1, "microbatch_size": 2, "num_microbatches": 2, "sequence_parallel": True}
PP2_DP2 = {"pp": 2, "dp": 2, "microbatch_size": 1, "num_microbatches": 4, "schedule": "1f1b"}
SINGLE = {"microbatch_size": 4, "num_microbatches": 2}


def _dataset(vocab: int = 64):
    gen = torch.Generator().manual_seed(99)
    return torch.randint(0, vocab, (SAMPLES, SEQ + 1), generator=gen)


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
    pm = auto_parallelize(model, fixed_batch(0)[0], global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
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
    first = launch(
        _phase, 4, {"model": MODEL, "plan": TP2_DP2_ZERO1, "train": 3, "save": ck_a, "after": 4}, timeout=LAUNCH_S
    )
    assert first[0]["saved_to"] == os.path.join(ck_a, "step-00000003")
    with open(os.path.join(first[0]["saved_to"], "nest_fx_checkpoint.json")) as fh:
        meta = json.load(fh)
    assert meta["format"] == "nest-fx-ckpt/2" and meta["step"] == 3 and "tp2" in meta["plan_summary"]
    assert_losses(first[0]["losses"] + first[0]["after"], want[:7], PARITY_TOL)

    # PP2 x DP2 resumes from step 3: the same losses as the run that did not stop
    second = launch(
        _phase,
        4,
        {"model": MODEL, "plan": PP2_DP2, "seed": 3, "load": ck_a, "train": 4, "save": ck_b, "after": 3},
        timeout=LAUNCH_S,
    )
    assert_same(merge(second, "loaded"), merge(first, "saved"))
    assert all(r["lr"] == LR for r in second)  # warm-up over after 3 steps; not the 0.5 the phase passed
    assert all(r["position"] == (3, 3, 0, 3) for r in second)  # step 3 = batch 3 of epoch 0
    assert_losses(second[0]["losses"], first[0]["after"])
    assert_losses(second[0]["losses"] + second[0]["after"], want[3:10], PARITY_TOL)  # across the epoch end

    # one device (a one-rank group, then a plain module without a process group) from step 7
    third = launch(_phase, 1, {"model": MODEL, "plan": SINGLE, "seed": 5, "load": ck_b, "train": 3}, timeout=LAUNCH_S)
    assert_same(merge(third, "loaded"), merge(second, "saved"))
    assert_losses(third[0]["losses"], second[0]["after"])
    _plain_resume(MODEL, ck_b, merge(second, "saved"), second[0]["after"], 3)


@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S + 30)
def test_expert_parallel_to_single_device(tmp_path):
    """Each EP rank saves its experts under their global indices; one device loads all of them."""
    ck = str(tmp_path / "ep")
    first = launch(
        _phase,
        2,
        {"model": MOE, "plan": {"dp": 2, "ep": 2, "microbatch_size": 4}, "train": 2, "save": ck, "after": 2},
        timeout=LAUNCH_S,
    )
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
    pm = auto_parallelize(model, fixed_batch(0)[0], global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    pm.train_step(*fixed_batch(0))
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
        return {
            "error": str(e),
            "shard": shards[1],
            "unchanged": all(torch.equal(p, before[n]) for n, p in pm.named_parameters()),
        }


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
    pm = auto_parallelize(model, fixed_batch(0)[0], global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    for step in range(2):
        pm.train_step(*fixed_batch(step))
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
