"""Exact resume with random draws inside the model (dropout under TP) and a gradient scaler
(docs/runtime.md, "Exact resume"): the random generators of every rank, DTensor's RNG tracker and
the scaler's state are in the checkpoint."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.tensor._random as dtensor_random
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from nest_fx.apply import auto_parallelize
from nest_fx.apply.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.apply.train_state import dtensor_rng_state, set_dtensor_rng_state
from nest_fx.models import build_seeded
from nest_fx.plan import uniform_plan

MODEL = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"
BATCH = 8


DROPOUT = 0.3


def _batch(step: int):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 64, (BATCH, 16), generator=gen), torch.randint(0, 64, (BATCH, 16), generator=gen)


def _tp_dropout_run(spec: dict) -> dict:
    """TP2 with dropout after every attention and MLP block; steps ``spec["steps"]``; optionally
    loads before and saves after. Every rank seeds its generator alike (as DTensor requires: the
    TP ranks must draw the same masks for replicated activations); a resumed run that did not
    restore the generators would draw the masks of step 0 again."""
    model, cfg = build_seeded(MODEL)
    plan = uniform_plan(cfg.layers + 2, tp=2, microbatch_size=4, num_microbatches=2)
    pm = auto_parallelize(model, _batch(0)[0], global_batch_size=BATCH, loss_fn=lm_loss, plan=plan, verbose=False)
    p = spec.get("dropout", DROPOUT)
    for layer in pm.module.layers:
        for block in (layer.attn, layer.mlp):
            block.register_forward_hook(lambda module, inputs, output: F.dropout(output, p=p, training=True))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    torch.manual_seed(100)
    first = 0
    if spec.get("load"):
        first = pm.load(spec["load"], opt)["step"]
    losses = []
    for step in range(first, spec["steps"]):
        losses.append(float(pm.train_step(*_batch(step))))
        opt.step()
        opt.zero_grad()
    if spec.get("save"):
        pm.save(spec["save"], opt)
    buf = io.BytesIO()
    torch.save(
        {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in pm.named_parameters()}, buf
    )
    return {"losses": losses, "params": buf.getvalue()}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dropout_under_tp_resumes_bit_for_bit(tmp_path):
    ckpt = str(tmp_path / "ck")
    whole = launch(_tp_dropout_run, 2, {"steps": 4}, timeout=120)
    launch(_tp_dropout_run, 2, {"steps": 2, "save": ckpt}, timeout=120)
    resumed = launch(_tp_dropout_run, 2, {"steps": 4, "load": ckpt}, timeout=120)
    for rank in range(2):
        assert resumed[rank]["losses"] == whole[rank]["losses"][2:]  # bit for bit
        got, want = (torch.load(io.BytesIO(r[rank]["params"])) for r in (resumed, whole))
        assert all(torch.equal(got[n], want[n]) for n in want)
    assert len(set(whole[0]["losses"])) == 4  # dropout draws differ per step (the test can fail)


def test_the_gradient_scaler_state_is_saved_and_restored(tmp_path):
    model, _ = build_seeded(MODEL)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    scaler.scale(torch.ones(()))  # creates its state
    scaler.update(new_scale=96.0)
    scaler._growth_tracker.fill_(2)
    save_checkpoint(model, str(tmp_path / "ck"), step=1, scaler=scaler)
    fresh = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    load_checkpoint(model, str(tmp_path / "ck"), scaler=fresh)
    assert fresh.state_dict() == scaler.state_dict() and fresh.get_scale() == 96.0
    save_checkpoint(model, str(tmp_path / "plain"), step=1)
    with pytest.raises(CheckpointError, match="holds no scaler state \\(it was saved without scaler=\\)"):
        load_checkpoint(model, str(tmp_path / "plain"), scaler=fresh)


class _Tracker(dtensor_random._RNGStateTracker):
    """A stand-in for DTensor's tracker where there is no CUDA device (the CUDA one needs it)."""

    def __init__(self):  # noqa: D107 - no device to check
        self._device, self._use_distribute_region = torch.device("cpu"), True


def test_the_dtensor_rng_tracker_switch_is_saved_and_restored(tmp_path, monkeypatch):
    """On CPU DTensor draws from the CPU generator (saved per rank); with CUDA the tracker's
    device state and its switch are saved too. Here: the switch, through a checkpoint."""
    model, _ = build_seeded(MODEL)
    tracker = _Tracker()
    tracker.distribute_region_enabled = False
    monkeypatch.setattr(dtensor_random, "_rng_tracker", tracker)
    assert dtensor_rng_state() == {"enabled": False, "device": "cpu"}
    save_checkpoint(model, str(tmp_path / "ck"), step=1)
    tracker.distribute_region_enabled = True
    load_checkpoint(model, str(tmp_path / "ck"))
    assert tracker.distribute_region_enabled is False
    set_dtensor_rng_state(None, None)  # nothing saved: nothing changed
    assert tracker.distribute_region_enabled is False
