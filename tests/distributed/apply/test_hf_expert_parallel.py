"""Expert parallelism on HuggingFace stacked experts with FSDP, and its checkpoints (4 gloo ranks)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from nest_fx.apply.checkpoint import load_checkpoint
from nest_fx.apply.launch import launch
from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_seeded

pytestmark = [pytest.mark.hf, pytest.mark.dist, pytest.mark.slow]
pytest.importorskip("transformers")
MODEL, BATCH, SEQ = "hf:mixtral", 8, 16


def _data():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (BATCH, SEQ), generator=gen), torch.randint(0, 128, (BATCH, SEQ), generator=gen)


def _train_and_save(path: str) -> bytes:
    from torch.distributed.tensor import DTensor

    from nest_fx.apply import auto_parallelize
    from nest_fx.plan import uniform_plan

    model, _ = build_seeded(MODEL, seed=3)
    x, y = _data()
    pm = auto_parallelize(
        model,
        {"input_ids": x},
        global_batch_size=BATCH,
        loss_fn=lm_loss,
        verbose=False,
        plan=uniform_plan(4, dp=4, ep=2, zero=1, microbatch_size=2),
    )
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    loss = pm.train_step({"input_ids": x}, y)
    grads = pm.full_tensors(grads=True)
    opt.step()
    pm.save(path, step=1)
    experts = dict(pm.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    local = experts.to_local() if isinstance(experts, DTensor) else experts
    out = {
        "loss": float(loss),
        "grads": grads,
        "params": pm.full_tensors(),
        "local_experts": local.shape[0],
        "global_experts": experts.shape[0],
    }
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def test_ep2_zero1_on_hf_mixtral_matches_one_device_and_checkpoints_every_expert_once(tmp_path):
    path = str(tmp_path / "ckpt")
    results = [torch.load(io.BytesIO(r)) for r in launch(_train_and_save, 4, path, timeout=240)]
    model, _ = build_seeded(MODEL, seed=3)
    reference = copy.deepcopy(model)
    x, y = _data()
    ref_loss = lm_loss(reference(input_ids=x).logits, y)
    ref_loss.backward()
    for r in results:
        # 4 experts: 2 per expert-parallel rank, which ZeRO-1 shards again over its edp=2 replicas
        assert (r["global_experts"], r["local_experts"]) == (4, 1)
        assert abs(r["loss"] - float(ref_loss.detach())) < 1e-5
        for name, p in reference.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=0, atol=1e-6)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    # the checkpoint holds all 4 experts: a single-device model loads exactly the trained weights
    fresh, _ = build_seeded(MODEL, seed=9)
    assert load_checkpoint(fresh, path)["step"] == 1
    trained = results[0]["params"]
    for name, p in fresh.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
        torch.testing.assert_close(p.detach(), dict(reference.named_parameters())[name].detach(), rtol=0, atol=1e-6)
