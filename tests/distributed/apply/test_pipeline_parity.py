"""Pipeline parallelism computes exactly what the whole model computes (multi-process, gloo, CPU).

The models have what a per-stage copy of the model gets wrong: layers of different types picked
by their index (Qwen2 with sliding-window and full attention alternating; a stage's layer list
would restart at 0), post-processing after the LM head in the root forward (Gemma2's final logit
soft-capping; it would also run on the first stage's output), and input and output embeddings
tied into one weight (the zoo GPT and HF GPT-2), which the first and the last stage both hold.
Each runs 3 SGD steps under a plan and on one device; losses of every step, full gradients of
every step and parameters after the last step must agree within 1e-5 (``test_apply_parallel``).
"""

from __future__ import annotations

import pytest

from nest_fx.apply.launch import launch
from nest_fx.testing import equivalence

TOL = 1e-5
LAUNCH_S = 150

# 6 layers: PP2 cuts the chain [head, 6 layers, tail] after layer 2, so a stage whose layer list
# restarted at 0 would swap the sliding and full layers of the second stage
QWEN2_SLIDING = {
    "model_type": "qwen2",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "use_sliding_window": True,
    "sliding_window": 6,
    "max_window_layers": 0,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
    "tie_word_embeddings": False,
    "use_cache": False,
}
GEMMA2_SOFTCAP = {
    "model_type": "gemma2",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "sliding_window": 6,
    "final_logit_softcapping": 2.0,
    "tie_word_embeddings": False,
    "use_cache": False,
    "attn_implementation": "eager",
}
GPT2_TIED = {
    "model_type": "gpt2",
    "vocab_size": 128,
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_positions": 32,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "use_cache": False,
}
ZOO_TIED = "gpt:hidden=64,layers=4,heads=4,seq=32,vocab=128,tie_embeddings=true"

PP2_DP2 = {"pp": 2, "dp": 2, "microbatch_size": 1, "num_microbatches": 4, "schedule": "1f1b"}
PP2 = {"pp": 2, "microbatch_size": 2, "num_microbatches": 4, "schedule": "1f1b"}

# one cell per kind of parallelism runs by default; the other cells are `slow` (pytest -m "")
pytestmark = pytest.mark.dist


def run(world: int, plan: dict, *, model: str = "", hf_config: dict = None, batch: int = 8, seq: int = 16):
    spec = {"model": model or hf_config["model_type"], "plan": plan, "batch": batch, "seq": seq, "steps": 3, "lr": 0.5}
    if hf_config is not None:
        spec["hf_config"] = hf_config
    results = launch(equivalence, world, spec, timeout=LAUNCH_S)
    worst = {k: max(r[k] for r in results) for k in ("loss_diff", "grad_diff", "param_diff")}
    print(f"\n{spec['model']} {plan}: " + ", ".join(f"{k}={v:.2e}" for k, v in worst.items()))
    for key, value in worst.items():
        assert value < TOL, (key, worst)
    for r in results:
        assert r["num_grads"] > 0 and r["num_params"] > 0 and len(r["losses"]) == 3, r
    assert len({tuple(round(v, 6) for v in r["losses"]) for r in results}) == 1  # one global loss
    return results


def _stage_names(results, stage):
    return set(next(r["param_names"] for r in results if r["stage"] == stage))


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.timeout(LAUNCH_S + 30)
@pytest.mark.parametrize(
    "config, tied",
    [(QWEN2_SLIDING, ""), (GEMMA2_SOFTCAP, ""), (GPT2_TIED, "transformer.wte.weight")],
    ids=["qwen2-sliding-layers", "gemma2-softcap", "gpt2-tied"],
)
@pytest.mark.parametrize("world, plan", [(4, PP2_DP2), (2, PP2)], ids=["pp2_dp2", "pp2"])
def test_hf_models(config, tied, world, plan):
    pytest.importorskip("transformers")
    results = run(world, plan, hf_config=config)
    if tied:  # the tied weight is on both stages, under the whole model's name (lm_head.weight is its alias)
        assert tied in _stage_names(results, 0) & _stage_names(results, 1)
        assert not any("lm_head" in n for r in results for n in r["param_names"])


@pytest.mark.timeout(LAUNCH_S + 30)
@pytest.mark.parametrize(
    "world, plan",
    [
        (4, {**PP2_DP2, "zero": 2}),  # FSDP: each rank sums its shard of the tied gradient with its twin's
        (2, {**PP2, "schedule": "interleaved", "virtual_stages": 2}),  # the first and last of 4 chunks
    ],
    ids=["pp2_dp2_zero2", "pp2_interleaved"],
)
def test_zoo_tied_embeddings(world, plan):
    results = run(world, plan, model=ZOO_TIED)
    assert "embed.tok.weight" in _stage_names(results, 0) & _stage_names(results, 1)


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_zoo_tied_embeddings_pp2_tp2_sequence_parallel():
    run(4, {"pp": 2, "tp": 2, "microbatch_size": 2, "num_microbatches": 4, "sequence_parallel": True}, model=ZOO_TIED)


def _train_and_save(path: str) -> bytes:
    """Two AdamW steps of the tied zoo GPT under PP2, then a checkpoint; returns this rank's full
    parameters (as bytes: tensors must not leave a rank through shared memory)."""
    import io

    import torch

    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.losses import lm_loss
    from nest_fx.models import build_seeded
    from nest_fx.plan import uniform_plan

    model, cfg = build_seeded(ZOO_TIED)
    gen = torch.Generator().manual_seed(5)
    data = [
        (torch.randint(0, 128, (8, 16), generator=gen), torch.randint(0, 128, (8, 16), generator=gen)) for _ in range(2)
    ]
    pm = auto_parallelize(
        model, data[0][0], global_batch_size=8, loss_fn=lm_loss, plan=uniform_plan(cfg.layers + 2, **PP2), verbose=False
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for x, y in data:
        pm.train_step(x, y)
        opt.step()
        opt.zero_grad()
    pm.save(path, opt, step=2)
    buf = io.BytesIO()
    torch.save(pm.full_tensors(), buf)
    return buf.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 30)
def test_tied_embeddings_checkpoint_keeps_one_copy(tmp_path):
    """Both stages hold the tied weight under its one name: the checkpoint stores it (and its
    optimizer state) once, and a single-device model loads it into its tied pair."""
    import io

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from nest_fx.apply.checkpoint import load_checkpoint, resolve
    from nest_fx.models import build_seeded

    path = str(tmp_path / "tied")
    saved = [torch.load(io.BytesIO(b)) for b in launch(_train_and_save, 2, path, timeout=LAUNCH_S)]
    assert torch.equal(saved[0]["embed.tok.weight"], saved[1]["embed.tok.weight"])  # the twins agree
    keys = set(FileSystemReader(resolve(path)[0]).read_metadata().state_dict_metadata)
    assert "model.embed.tok.weight" in keys and "optim.state.embed.tok.weight.exp_avg" in keys
    assert not any("lm_head" in k for k in keys), sorted(k for k in keys if "lm_head" in k)
    model, _ = build_seeded(ZOO_TIED, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load_checkpoint(model, path, opt)["step"] == 2
    assert model.lm_head.weight is model.embed.tok.weight
    full = {**saved[0], **saved[1]}
    assert sorted(full) == sorted(n for n, _ in model.named_parameters())
    assert all(torch.equal(p.detach(), full[n]) for n, p in model.named_parameters())
