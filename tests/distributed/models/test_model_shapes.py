"""Shapes people train (issue 26, item 4): head size, multi-head latent attention, shared experts,
sliding windows, hybrid Mamba-2 / attention stacks, gated and ungated MLPs, vocabulary padding.

Parameter counts from ``models.counts`` against published totals and the built modules; the new
layers against naive references; the cost model's sliding-window attention share."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from nest_fx.common.errors import ModelError
from nest_fx.models import NAMED_CONFIGS, build_any, build_model, get_config, parse_spec
from nest_fx.models.counts import attention_params, mamba_params, param_counts
from nest_fx.models.layers import sliding_window_mask
from nest_fx.models.mamba import ssd_scan
from nest_fx.workload.attention_share import window_share
from nest_fx.workload.types import dims_from_config
from parity_helpers import run as parity_run  # the parity harness: launch + fp32 tolerances

# (name, published total, published active or None, relative tolerance)
PUBLISHED = [
    ("llama3-8b", 8.03e9, None, 0.01),  # Llama 3 model card: 8.03B
    ("llama3-70b", 70.6e9, None, 0.01),  # 70.6B
    ("llama3-405b", 405.9e9, None, 0.01),  # Llama 3 report: 405B (HF card 405.9B)
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),  # Jiang et al. 2024: 46.7B total, 12.9B active
    ("mistral-7b", 7.24e9, None, 0.01),  # Mistral 7B: 7.24B
    ("gemma2-9b", 9.24e9, None, 0.01),  # Gemma 2 9B: 9.24B
    ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9, 0.01),  # Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B active
]


@pytest.mark.parametrize("name,total,active,rel", PUBLISHED)
def test_published_parameter_counts(name, total, active, rel):
    got_total, got_active = param_counts(NAMED_CONFIGS[name])
    assert got_total == pytest.approx(total, rel=rel)
    if active is not None:
        assert got_active == pytest.approx(active, rel=rel)


def test_deepseek_v3_671b_total_37b_active():
    total, active = param_counts(NAMED_CONFIGS["deepseek-v3"])
    assert total == pytest.approx(671e9, rel=0.01)
    # "37B activated": two significant digits, i.e. 36.5B..37.5B; ours counts the embedding and the
    # LM head (0.93B each) as active, giving 37.55B: inside 1.5% of the rounded figure
    assert active == pytest.approx(37e9, rel=0.015)


def test_nemotron_h_matches_transformers_implementation():
    """The Mamba-2 formula against transformers' own NemotronH model with the same pattern (meta)."""
    tf = pytest.importorskip("transformers")
    cfg = NAMED_CONFIGS["nemotron-h-8b"]
    hf_cfg = tf.NemotronHConfig(
        hybrid_override_pattern=cfg.layer_pattern,
        num_hidden_layers=cfg.layers,
        hidden_size=cfg.hidden,
        vocab_size=cfg.vocab_size,
        intermediate_size=cfg.ffn_hidden,
        mamba_num_heads=cfg.mamba_heads,
        mamba_head_dim=cfg.mamba_head_dim,
        ssm_state_size=cfg.mamba_state,
        n_groups=cfg.mamba_groups,
        conv_kernel=cfg.mamba_conv,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        hf_model = tf.AutoModelForCausalLM.from_config(hf_cfg)
    assert param_counts(cfg)[0] == sum(p.numel() for p in hf_model.parameters())
    assert param_counts(cfg)[0] == pytest.approx(8.1e9, rel=0.01)  # "Nemotron-H-8B"


TINY = "hidden=64,layers=4,heads=4,seq=40,vocab=100"
SHAPES = {
    "head_dim": f"llama:{TINY},head_dim=24,kv=2",
    "mla": f"llama:{TINY},kv_lora=16,q_lora=24,rope_head_dim=8,head_dim=16,v_head_dim=12",
    "mla_full_q": f"llama:{TINY},kv_lora=16,rope_head_dim=8,head_dim=16",
    "shared_experts": f"moe:{TINY},experts=4,shared=2,moe_ffn=32,dense_layers=1,moe_every=2",
    "window": f"llama:{TINY},window=8,global_every=2",
    "hybrid": f"llama:{TINY},pattern=M-*E,experts=4,mamba_head_dim=16,mamba_groups=2,mamba_state=8,"
    "mamba_chunk=16,activation=relu2",
    "geglu_padded": f"gpt:{TINY},activation=geglu,vocab_multiple=128,vocab_tp=2",
    "relu2_tied": f"gpt:{TINY},activation=relu2,tie_embeddings=true",
    "partial_rope": f"llama:{TINY},rotary_pct=0.25,kv=2",
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_formula_matches_the_built_module_and_it_trains(shape):
    model, cfg = build_model(SHAPES[shape], device="cpu")
    assert param_counts(cfg)[0] == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    logits = model(tokens)
    assert logits.shape == (2, cfg.seq_len, cfg.padded_vocab)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_active_parameters_count_top_k_and_shared_experts():
    cfg = parse_spec(SHAPES["shared_experts"])
    total, active = param_counts(cfg)
    expert = 3 * 64 * 32
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.layers))
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, False]  # dense_layers=1, moe_every=2
    assert total - active == moe_layers * (4 - 2) * expert


def test_vocabulary_padding_megatron_rule():
    cfg = parse_spec("gpt:vocab=50257,vocab_multiple=128,vocab_tp=8")
    assert cfg.padded_vocab == 51200 and cfg.padded_vocab % (128 * 8) == 0
    assert parse_spec("gpt:vocab=50257").padded_vocab == 50257
    assert dims_from_config(cfg, seq_len=8).vocab_size == 51200  # TP degrees must divide the padded rows


def test_head_dim_apart_from_hidden():
    cfg = NAMED_CONFIGS["gemma2-9b"]
    assert cfg.head_dim * cfg.heads == 4096 != cfg.hidden
    assert attention_params(cfg) == 3584 * 4096 * 2 + 2 * 3584 * 2048
    with pytest.raises(ModelError, match="hidden=100 is not divisible by heads=3"):
        parse_spec("gpt:hidden=100,heads=3")
    assert parse_spec("gpt:hidden=100,heads=3,head_dim=32").head_dim == 32


def test_sliding_window_attention_equals_naive_band():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    mask = sliding_window_mask(12, 12, 4, q.device)
    assert mask.sum().item() == sum(min(i + 1, 4) for i in range(12))
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    i, j = torch.arange(12).unsqueeze(1), torch.arange(12).unsqueeze(0)
    scores = scores.masked_fill(~((j <= i) & (i - j < 4)), float("-inf"))
    expected = scores.softmax(-1) @ v
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, expected)
    cfg = NAMED_CONFIGS["gemma2-9b"]
    assert [cfg.window_of(i) for i in range(4)] == [4096, 0, 4096, 0]


@pytest.mark.parametrize("seq,window", [(8192, 4096), (4096, 4096), (100, 1), (16, 64)])
def test_window_share_counts_the_band(seq, window):
    band = sum(min(i + 1, window) for i in range(seq))
    assert window_share(seq, window) == pytest.approx(band / seq**2)


def test_traced_cost_prices_the_window(tmp_path):
    """A windowed layer's attention core costs its band; the global layer's the causal triangle."""
    from nest_fx.cluster import load_cluster
    from nest_fx.workload import workload_for_model
    from nest_fx.workload.attention_share import attention_length_share

    work = workload_for_model(
        # heads enough that both attention calls run near the GEMM curve's top (the measured ramp,
        # roofline.GEMM_RAMP_S, slows small calls): the ratio of times is then the ratio of FLOPs priced
        "llama:hidden=2048,layers=2,heads=16,seq=8192,vocab=128,window=1024,global_every=2",
        load_cluster("h100-spine-leaf:8"),
    )
    src = work.source
    found = {}
    for block in src.graph.layer_blocks:
        nodes = src.facts(block.index).nodes
        times = src.node_times(block, 1, 1, False)
        att = [(n, t) for n, (t, _) in zip(nodes, times) if n.attention]
        assert len(att) == 1
        found[att[0][0].window] = att[0]
    assert set(found) == {1024, 0}
    windowed, full = found[1024], found[0]
    assert windowed[0].flops == full[0].flops  # the trace counts the whole masked matrix ...
    # ... the cost its band: 0.12 of the matrix vs 0.5, each call at its length's rate (a window of
    # 1,024 keys runs at the 2K floor's share, attention_share.attention_length_share)
    rate = attention_length_share(1024) / attention_length_share(8192)
    assert rate < 1 and windowed[1] * rate < 0.3 * full[1]
    assert windowed[0].saved_flash <= full[0].saved_flash  # no mask kept


def _naive_ssm(x, dt, a, b, c):
    """h_t = exp(dt_t a) h_{t-1} + dt_t B_t x_t; y_t = C_t h_t, token by token (float64)."""
    bsz, seq, heads, p = x.shape
    rep = heads // b.size(2)
    b, c = b.repeat_interleave(rep, 2), c.repeat_interleave(rep, 2)
    h = torch.zeros(bsz, heads, p, b.size(-1), dtype=x.dtype)
    out = []
    for t in range(seq):
        decay = torch.exp(dt[:, t] * a)[..., None, None]
        h = decay * h + (dt[:, t, :, None, None] * x[:, t, :, :, None] * b[:, t, :, None, :])
        out.append((h * c[:, t, :, None, :]).sum(-1))
    return torch.stack(out, 1)


@pytest.mark.parametrize("seq,chunk", [(16, 4), (13, 4), (5, 8)])
def test_ssd_scan_equals_the_recurrence(seq, chunk):
    torch.manual_seed(0)
    x = torch.randn(2, seq, 4, 3, dtype=torch.float64)
    dt = F.softplus(torch.randn(2, seq, 4, dtype=torch.float64))
    a = -torch.rand(4, dtype=torch.float64) - 0.1
    b, c = torch.randn(2, seq, 2, 5, dtype=torch.float64), torch.randn(2, seq, 2, 5, dtype=torch.float64)
    torch.testing.assert_close(ssd_scan(x, dt, a, b, c, chunk), _naive_ssm(x, dt, a, b, c))


def test_mamba_parameter_formula():
    cfg = parse_spec(SHAPES["hybrid"])
    model, _ = build_model(SHAPES["hybrid"], device="meta")
    assert mamba_params(cfg) == sum(p.numel() for p in model.layers[0].mixer.parameters())
    assert cfg.layer_kinds(0) == ["mamba"] and cfg.layer_kinds(2) == ["attention"] and cfg.layer_kinds(3) == ["moe"]


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("llama:layer_pattern=MX", "unknown ['X']"),
        ("llama:layer_pattern=ME", "num_experts=0"),
        ("llama:q_lora_rank=8", "needs kv_lora_rank"),
        ("llama:kv_lora_rank=8,rope_head_dim=7", "rope_head_dim=7"),
        ("gpt:sliding_window=8,causal=false", "needs causal"),
        ("llama:activation=relu", "activation='relu'"),
        ("llama:rotary_pct=0", "rope_fraction must be in (0, 1]"),
        ("llama:hidden=64,heads=16,rotary_pct=0.2", "rope_fraction=0.2 rotates no pair of head_dim=4"),
        ("llama:pattern=M,mamba_heads=6,mamba_groups=4", "mamba_heads=6 is not divisible"),
    ],
)
def test_bad_shapes_refused(spec, needle):
    with pytest.raises(ModelError, match=re.escape(needle)):
        parse_spec(spec)


@pytest.mark.parametrize("name", ["hf:deepseek-v3", "hf:nemotron-h-8b", "hf:gemma2-9b", "hf:mistral-7b"])
def test_hf_mapping_refuses_shapes_it_cannot_express(name):
    pytest.importorskip("transformers")
    with pytest.raises(ModelError, match="no equivalent in the HuggingFace"):
        build_any(name)


def test_named_shapes_build_on_meta():
    for name in ("deepseek-v3", "nemotron-h-8b", "gemma2-9b", "mistral-7b"):
        model, cfg = build_model(name, layers=4)
        assert param_counts(cfg)[0] == sum(p.numel() for p in model.parameters())
    assert get_config("deepseek-v3").is_moe_layer(3) and not get_config("deepseek-v3").is_moe_layer(2)


def test_partial_rope_rotates_the_first_dims_and_passes_the_rest():
    """rope_fraction=0.25 of a 16-dim head: the first 4 dims rotated exactly as a 4-dim rotary
    would (its own frequencies, GPT-NeoX's rotary_pct), the other 12 unchanged."""
    from nest_fx.models.layers import Rotary

    torch.manual_seed(0)
    cfg = parse_spec("llama:hidden=64,heads=4,seq=10,rotary_pct=0.25")
    assert cfg.rotary_dim == 4 and "rope_fraction (partial RoPE)" in cfg.zoo_only_fields()
    x = torch.randn(2, 4, 10, 16)
    partial, whole = Rotary(16, 10, cfg.rope_theta, cfg.rotary_dim), Rotary(4, 10, cfg.rope_theta)
    out = partial(x)
    torch.testing.assert_close(out[..., :4], whole(x[..., :4]))
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert not torch.allclose(out[..., :4], x[..., :4])


# -- the runtime runs them: parallel == single device (fp32, gloo) -----------------------------
SHARED_MOE = "moe:hidden=64,layers=2,heads=4,seq=32,vocab=128,experts=4,top_k=2,capacity_factor=2.0,shared=1,moe_ffn=32"
HYBRID = (
    "llama:hidden=64,layers=4,heads=4,kv=2,seq=32,vocab=128,pattern=M-*-,mamba_head_dim=16,mamba_groups=2,"
    "mamba_state=8,mamba_chunk=8,activation=relu2"
)
WINDOWED = "llama:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=128,window=8,head_dim=24,activation=geglu"
PARTIAL_ROPE = "llama:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=128,rotary_pct=0.5"


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_shared_experts_under_expert_parallelism():
    parity_run(2, SHARED_MOE, {"dp": 2, "ep": 2, "microbatch_size": 2})


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "model,plan",
    [
        (HYBRID, {"pp": 2, "microbatch_size": 2, "num_microbatches": 2, "schedule": "1f1b"}),
        (WINDOWED, {"tp": 2, "microbatch_size": 2, "sequence_parallel": True}),
    ],
)
def test_hybrid_and_windowed_models_in_parallel(model, plan):
    parity_run(2, model, plan)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "plan",
    [{"tp": 2, "microbatch_size": 2, "sequence_parallel": True}, {"cp": 2, "microbatch_size": 2}],
    ids=["tp2-sp", "cp2"],
)
def test_partial_rope_in_parallel(plan):
    """Partial RoPE under TP (heads split, each rotating its first dims) and CP (each rank's
    positions' rows of the tables): the single-device run's loss and parameters."""
    parity_run(2, PARTIAL_ROPE, plan)
