"""Tensor parallelism on the layouts the ecosystem uses, across processes (gloo).

The parallel runs of tiny HuggingFace models built from configs and of flat ``nn.Sequential``
models equal the single-device runs (``nest_fx.testing.equivalence``, several models per
launch); a fused projection sharded by heads checkpoints in the model's own layout; TP ranks
draw the same dropout masks outside the regions. What the tracer finds in these models and what
the runtime refuses are tested in one process in tests/unit/graph/test_tp_layouts.py.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from nest_fx.apply.launch import launch
from nest_fx.testing import equivalence

from tiny_models import build_cnn, build_hf, build_mlp, class_loss, hf_builder, image_data, mlp_data
from checkpoint_helpers import model_layout_state_bytes, plain_state

TOL = 1e-5
LAUNCH_S = 420


def _many(specs):
    """Several equivalence runs in one launch (the process group is made once)."""
    return [equivalence(spec) for spec in specs]


def _spec(name: str, plan: dict, **extra) -> dict:
    return {"model": name, "plan": plan, "batch": 8, "seq": 32, "steps": 3, "lr": 0.5, **extra}


def _check(results, names):
    for i, name in enumerate(names):
        ranks = [r[i] for r in results]
        worst = {k: max(r[k] for r in ranks) for k in ("loss_diff", "grad_diff", "param_diff")}
        print(f"{name}: " + ", ".join(f"{k}={v:.1e}" for k, v in worst.items()))
        assert all(v < TOL for v in worst.values()), (name, worst)
        assert all(r["num_grads"] > 0 for r in ranks)
    return [[r[i] for r in results] for i in range(len(names))]


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
def test_tp2_equals_one_device_on_every_layout():
    pytest.importorskip("transformers")
    plan = {"tp": 2, "microbatch_size": 4, "num_microbatches": 2}
    families = ["gpt2", "phi3", "qwen3", "qwen3_moe", "bloom", "opt", "falcon", "t5"]
    specs = [_spec(f, plan, build=hf_builder(f)) for f in families]
    specs.append(_spec("seq-mlp", dict(plan, num_layers=4), build=build_mlp, data=mlp_data, loss=class_loss))
    runs = _check(launch(_many, 2, specs, timeout=LAUNCH_S), families + ["seq-mlp"])
    sharded = {name: set(ranks[0]["sharded"]) for name, ranks in zip(families + ["seq-mlp"], runs)}
    # the layouts that used to crash or shard nothing are sharded now
    assert "transformer.h.0.attn.c_attn.weight" in sharded["gpt2"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in sharded["phi3"]
    assert "model.layers.1.mlp.experts.gate_up_proj" in sharded["qwen3_moe"]
    assert "transformer.h.1.self_attention.query_key_value.weight" in sharded["falcon"]
    assert "encoder.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in sharded["t5"]
    assert {"2.weight", "4.weight", "6.weight", "8.weight"} <= sharded["seq-mlp"]


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
def test_tp2_dp2_sequence_parallel_and_zero1_recompute_on_four_ranks():
    pytest.importorskip("transformers")
    sp = {"tp": 2, "dp": 2, "microbatch_size": 2, "num_microbatches": 2, "sequence_parallel": True}
    zero = {"tp": 2, "dp": 2, "microbatch_size": 2, "num_microbatches": 2, "zero": 1, "recompute": "full"}
    specs = [
        _spec("gpt2", sp, build=hf_builder("gpt2")),
        _spec("bloom", sp, build=hf_builder("bloom")),
        _spec("phi3", zero, build=hf_builder("phi3")),
        _spec("qwen3_moe", zero, build=hf_builder("qwen3_moe")),
    ]
    _check(launch(_many, 4, specs, timeout=LAUNCH_S), ["gpt2 sp", "bloom sp", "phi3 zero1", "qwen3_moe zero1"])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_S + 60)
def test_pipelines_of_sequential_models():
    pp = {"pp": 2, "microbatch_size": 2, "num_microbatches": 4, "schedule": "1f1b"}
    specs = [
        _spec("seq-mlp", dict(pp, num_layers=4), build=build_mlp, data=mlp_data, loss=class_loss),
        _spec("seq-cnn", dict(pp, num_layers=6), build=build_cnn, data=image_data, loss=class_loss),
    ]
    mlp, cnn = _check(launch(_many, 2, specs, timeout=LAUNCH_S), ["seq-mlp pp2", "seq-cnn pp2"])
    assert [r["stage"] for r in cnn] == [0, 1]


def _fused_checkpoint(spec):
    """TP2 save of Phi-3 (fused qkv / gate_up) with AdamW state; returns the full state in the
    model's own layout. Or, with ``load``: load a one-device checkpoint and return the same."""
    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.fused_params import fused_layouts
    from nest_fx.apply.losses import lm_loss
    from nest_fx.plan import uniform_plan

    model, cfg = build_hf("phi3", seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    pm = auto_parallelize(
        model,
        tokens,
        global_batch_size=4,
        loss_fn=lm_loss,
        verbose=False,
        plan=uniform_plan(4, tp=2, microbatch_size=4),
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    if spec.get("load"):
        pm.load(spec["load"], opt)
    else:
        pm.train_step(tokens, tokens)
        opt.step()
        pm.save(spec["save"], opt, step=1)
    return model_layout_state_bytes(pm, opt), sorted(fused_layouts(pm.chunks))


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(2 * LAUNCH_S)
def test_fused_projections_checkpoint_in_the_model_layout(tmp_path):
    """TP2 -> one device and one device -> TP2: bit-identical parameters and AdamW state."""
    pytest.importorskip("transformers")
    from nest_fx.apply.checkpoint import load_checkpoint, save_checkpoint

    saved = launch(_fused_checkpoint, 2, {"save": str(tmp_path / "tp2")}, timeout=LAUNCH_S)
    state, fused = torch.load(io.BytesIO(saved[0][0])), saved[0][1]
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused and "model.layers.1.mlp.gate_up_proj.weight" in fused
    model, _ = build_hf("phi3", seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(model, str(tmp_path / "tp2"), opt)
    plain = plain_state(model, opt)
    assert sorted(plain) == sorted(state)
    assert not [k for k in state if not torch.equal(plain[k], state[k])]

    opt.step()  # a different state, saved on one device and loaded under TP2
    save_checkpoint(model, str(tmp_path / "one"), opt, step=2)
    loaded = launch(_fused_checkpoint, 2, {"load": str(tmp_path / "one")}, timeout=LAUNCH_S)
    want = plain_state(model, opt)
    for blob, _ in loaded:
        got = torch.load(io.BytesIO(blob))
        assert sorted(got) == sorted(want) and not [k for k in want if not torch.equal(got[k], want[k])]


def _dropout_replicas(_):
    """GPT-2 with dropout 0.1 under TP2, each rank seeded differently after the model is built:
    the replicated LayerNorm weights after two steps, as bytes."""
    import torch.distributed as dist
    import transformers as tf

    from nest_fx.apply import auto_parallelize
    from nest_fx.apply.losses import lm_loss
    from nest_fx.plan import uniform_plan

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(
        tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=64, use_cache=False)
    )
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(100 + int(os.environ["RANK"]))
    pm = auto_parallelize(
        model,
        tokens,
        global_batch_size=4,
        loss_fn=lm_loss,
        verbose=False,
        plan=uniform_plan(4, tp=2, microbatch_size=4),
    )
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    for _ in range(2):
        pm.train_step(tokens, tokens)
        opt.step()
        opt.zero_grad()
    dist.barrier()
    weight = dict(pm.named_parameters())["transformer.ln_f.weight"]
    return (weight.to_local() if hasattr(weight, "to_local") else weight).detach().numpy().tobytes()


@pytest.mark.hf
@pytest.mark.dist
@pytest.mark.timeout(LAUNCH_S)
def test_tp_ranks_draw_the_same_dropout_masks_outside_the_regions():
    pytest.importorskip("transformers")
    first, second = launch(_dropout_replicas, 2, None, timeout=LAUNCH_S)
    assert first == second  # the replicas of a replicated weight did not drift apart
