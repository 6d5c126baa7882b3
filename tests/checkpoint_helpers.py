"""What tests/unit/apply/test_checkpoint.py (one process) and tests/distributed/apply/test_checkpoint_dist.py (gloo) share:
the model, a fixed batch per step, a trained or fresh model with AdamW, and exact comparison of
full (unsharded) parameters and optimizer state."""

from __future__ import annotations

import torch

from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_seeded

MODEL = "llama:hidden=32,layers=2,heads=4,seq=16,vocab=64"
BATCH, SEQ, LR = 8, 16, 1e-3


def fixed_batch(step: int, vocab: int = 64):
    """A fixed batch per step (for the tests that need no data position)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, vocab, (BATCH, SEQ), generator=gen), torch.randint(0, vocab, (BATCH, SEQ), generator=gen))


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


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"not bit-identical: {bad[:5]}"


def trained(steps: int = 1, spec: str = MODEL):
    """(model, AdamW) trained ``steps`` steps on one device in this process (no process group)."""
    model, cfg = build_seeded(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(steps):
        x, y = fixed_batch(s, cfg.vocab_size)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fresh_model():
    """(model, AdamW) of another seed, not trained: what a checkpoint is loaded into."""
    model, _ = build_seeded(MODEL, seed=7)
    return model, torch.optim.AdamW(model.parameters())


def model_layout_state_bytes(pm, optimizer) -> bytes:
    """This rank's full parameters and optimizer state of a ParallelModule, fused projections back in
    the model's own layout, keyed "<name>.param" / "<name>.<state key>" as :func:`plain_state`, as
    ``torch.save`` bytes (tensors leave a rank as bytes: shared memory would outlive the rank)."""
    import io

    from torch.distributed.tensor import DTensor

    from nest_fx.apply.fused_params import fused_layouts, original_layout

    layouts = fused_layouts(pm.chunks)
    out = {}
    for name, p in pm.named_parameters():
        for key, t in [("param", p.detach())] + list(optimizer.state[p].items()):
            full = t.full_tensor() if isinstance(t, DTensor) else t
            out[f"{name}.{key}"] = original_layout(full, layouts.get(name)) if full.shape == p.shape else full
    buf = io.BytesIO()
    torch.save({k: v.clone() for k, v in out.items()}, buf)
    return buf.getvalue()


def plain_state(model, optimizer) -> dict:
    """{"<name>.param" | "<name>.<state key>": tensor} of a one-device model and its optimizer."""
    return {
        f"{n}.{k}": t.detach().clone()
        for n, p in model.named_parameters()
        for k, t in [("param", p)] + list(optimizer.state[p].items())
    }
