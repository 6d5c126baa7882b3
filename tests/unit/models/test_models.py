"""Model zoo: named configs, the spec parser, the transformer on CPU and the MoE layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nest_fx.models import NAMED_CONFIGS, TransformerConfig, build_any, build_model, get_config, parse_spec
from nest_fx.models.moe import MoE, expert_capacity


# -- named configs -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,expected",
    [
        ("gpt2-small", 124e6),
        ("llama2-7b", 6.74e9),
        ("llama3-70b", 70.6e9),
        ("mixtral-8x7b", 46.7e9),
        ("gpt3-175b", 175e9),
    ],
)
def test_named_parameter_counts(name, expected):
    model, cfg = build_model(name, device="meta")
    assert cfg.name == name
    assert all(p.device.type == "meta" for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert n == pytest.approx(expected, rel=0.01)


def test_named_config_shapes():
    llama = NAMED_CONFIGS["llama2-7b"]
    assert (llama.hidden, llama.layers, llama.heads, llama.kv_heads, llama.ffn_hidden) == (4096, 32, 32, 32, 11008)
    l3 = NAMED_CONFIGS["llama3-70b"]
    assert (l3.kv_heads, l3.head_dim, l3.vocab_size) == (8, 128, 128256)
    mix = NAMED_CONFIGS["mixtral-8x7b"]
    assert (mix.num_experts, mix.top_k, mix.ffn_hidden) == (8, 2, 14336)
    assert all(mix.is_moe_layer(i) for i in range(mix.layers))
    assert not NAMED_CONFIGS["bert-large"].causal


def test_tied_embeddings_share_storage():
    model, _ = build_model("gpt2-small", device="meta")
    assert model.lm_head.weight is model.embed.tok.weight
    untied, _ = build_model("llama2-7b", device="meta")
    assert untied.lm_head.weight is not untied.embed.tok.weight


def test_build_model_dtype_and_overrides():
    model, cfg = build_model("llama2-7b", device="meta", dtype=torch.bfloat16, layers=2)
    assert cfg.layers == 2 and len(model.layers) == 2
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored


# -- spec parser -------------------------------------------------------------------------------
def test_parse_spec_families_and_aliases():
    cfg = parse_spec("gpt:hidden=64,layers=2,heads=4,seq=32,vocab=100")
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.seq_len, cfg.vocab_size) == (64, 2, 4, 32, 100)
    assert (cfg.norm, cfg.activation, cfg.position, cfg.bias, cfg.ffn_hidden) == (
        "layernorm",
        "gelu",
        "learned",
        True,
        256,
    )
    cfg = parse_spec("llama:hidden=96,heads=4,kv=2,ffn=200,rope_theta=5e5")
    assert (cfg.norm, cfg.activation, cfg.kv_heads, cfg.ffn_hidden, cfg.rope_theta) == (
        "rmsnorm",
        "swiglu",
        2,
        200,
        5e5,
    )
    cfg = parse_spec("moe:experts=4,topk=1,capacity_factor=1.5,moe_every=2,causal=false")
    assert (cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.moe_every, cfg.causal) == (4, 1, 1.5, 2, False)
    assert parse_spec("moe:").num_experts == 8
    assert get_config("llama2-7b", layers=3).layers == 3


def test_swiglu_ffn_default_rule():
    assert TransformerConfig(hidden=4096).ffn_hidden == 11008
    assert TransformerConfig(hidden=768, heads=12, activation="gelu").ffn_hidden == 3072


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("gpt:hidden=abc", "'hidden=abc'"),
        ("gpt:hiden=64", "'hiden=64'"),
        ("gpt:hidden", "'hidden'"),
        ("gpt:name=foo", "'name=foo'"),
        ("llama:bias=maybe", "'bias=maybe'"),
        ("moe:capacity_factor=lots", "'capacity_factor=lots'"),
        ("gpt:hidden=100,heads=3", "hidden=100 is not divisible by heads=3"),
        ("llama:heads=32,kv=5", "heads=32 is not divisible by kv_heads=5"),
        ("llama:norm=batchnorm", "norm='batchnorm'"),
        ("gpt:activation=relu", "activation='relu'"),
        ("moe:experts=4,topk=5", "top_k=5"),
        ("gpt:layers=0", "layers must be positive"),
        ("bloom:hidden=64", "unknown model family 'bloom'"),
    ],
)
def test_bad_specs_name_the_field(spec, needle):
    with pytest.raises(ValueError) as info:
        parse_spec(spec)
    assert needle in str(info.value)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'llama9'"):
        get_config("llama9")


def test_build_any_sequence_checks():
    with pytest.raises(ValueError, match="learned positions"):
        build_any("gpt2-small", seq=2048)
    model, cfg, args, kwargs = build_any("llama2-7b", batch=2, seq=8192)  # RoPE: tables grow
    assert cfg.seq_len == 8192 and model.layers[0].attn.rotary.cos.shape[0] == 8192
    assert args[0].shape == (2, 8192) and args[0].dtype == torch.long and kwargs == {}


# -- transformer on CPU ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,causal",
    [
        ("llama:hidden=64,layers=2,heads=4,kv=2,seq=16,vocab=50", True),
        ("gpt:hidden=64,layers=2,heads=4,seq=16,vocab=50,causal=false", False),
    ],
)
def test_transformer_forward_and_causality(spec, causal):
    torch.manual_seed(0)
    model, cfg = build_model(spec, device="cpu")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab_size
    with torch.no_grad():
        out, out2 = model(tokens), model(changed)
    assert out.shape == (2, cfg.seq_len, cfg.vocab_size) and torch.isfinite(out).all()
    prefix_same = torch.equal(out[:, :-1], out2[:, :-1])
    assert prefix_same == causal
    assert not torch.equal(out[:, -1], out2[:, -1])


# -- mixture of experts ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seq,top_k,experts,cf,expected",
    [
        (32, 2, 4, 1.0, 16),  # 32*2/4
        (10, 2, 8, 1.25, 4),  # ceil(3.125)
        (4096, 2, 8, 1.0, 1024),
        (7, 1, 2, 1.0, 4),  # ceil(3.5)
        (100, 2, 8, 1.1, 28),  # ceil(27.5); 1.1 is not exact in binary
        (16, 2, 8, 4.0, 16),  # cf = experts / top_k: every token fits
        (3, 1, 4, 0.1, 1),  # ceil(0.075): at least one slot
    ],
)
def test_expert_capacity(seq, top_k, experts, cf, expected):
    assert expert_capacity(seq, top_k, experts, cf) == expected


def _moe(experts=4, top_k=2, cf=1.0, hidden=32):
    cfg = parse_spec(f"moe:hidden={hidden},heads=4,ffn=48,experts={experts},topk={top_k},capacity_factor={cf}")
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.gate.weight.normal_(std=1.0)  # spread the routing so experts see different loads
    return moe


def _dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through its top-k experts, no capacity limit."""
    probs = F.softmax(moe.gate(x), dim=-1, dtype=torch.float32)
    w, e = probs.topk(moe.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for b in range(x.size(0)):
        for s in range(x.size(1)):
            for j in range(moe.top_k):
                out[b, s] += w[b, s, j] * moe.experts[int(e[b, s, j])](x[b, s])
    return out


@pytest.mark.parametrize("experts,top_k", [(4, 2), (8, 2), (4, 1)])
def test_moe_no_token_dropped_when_capacity_covers_all(experts, top_k):
    moe = _moe(experts, top_k, cf=experts / top_k)
    x = torch.randn(2, 12, 32)
    slot, weight, capacity = moe.route(x)
    assert capacity == x.size(1)  # an expert can take every token of the sequence
    per_token = weight.reshape(2, 12, top_k).sum(-1)
    torch.testing.assert_close(per_token, torch.ones_like(per_token))
    assert (slot < experts * capacity).all()  # nothing sent to the spare (dropped) slot
    for b in range(2):
        assert slot[b].unique().numel() == slot[b].numel()  # distinct slots per sequence
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _dense_reference(moe, x), rtol=1e-5, atol=1e-5)


def test_moe_drops_overflow_in_token_order():
    moe = _moe(experts=4, top_k=2, cf=0.5)
    x = torch.randn(2, 16, 32)
    slot, weight, capacity = moe.route(x)
    assert capacity == expert_capacity(16, 2, 4, 0.5) == 4
    spare = moe.num_experts * capacity
    dropped = slot == spare
    assert dropped.any()  # 32 choices into 4 experts x 4 slots: at least half are dropped
    assert (weight.squeeze(-1)[dropped] == 0).all()
    per_token = weight.reshape(2, 16, 2).sum(-1)
    assert (per_token < 1 - 1e-6).any() and (per_token <= 1 + 1e-6).all()
    # first come, first served: each expert keeps its earliest `capacity` choices
    probs = F.softmax(moe.gate(x), dim=-1, dtype=torch.float32)
    experts = probs.topk(2, dim=-1).indices.reshape(2, 32)
    for b in range(2):
        for e in range(4):
            choices = (experts[b] == e).nonzero().flatten()
            kept = choices[:capacity]
            assert (~dropped[b, kept]).all() and dropped[b, choices[capacity:]].all()
            assert sorted(slot[b, kept].tolist()) == list(range(e * capacity, e * capacity + len(kept)))


def test_moe_model_forward_backward_on_cpu():
    torch.manual_seed(0)
    model, cfg = build_model("moe:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=100,experts=4", device="cpu")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens.roll(-1, dims=1).reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.layers[0].moe.gate.weight.grad.abs().sum() > 0  # the router learns
    assert all(e.down.weight.grad.abs().sum() > 0 for e in model.layers[0].moe.experts)


def test_moe_combine_keeps_only_its_index_for_backward():
    """combine picks the expert rows with index_select, whose backward keeps the index, not the
    expert outputs (gather's backward keeps its whole input: k rows of H per token, as many bytes
    as the dispatch buffer). Same values and gradients as the gather it replaced, dropped slots
    included."""
    moe = _moe(experts=4, top_k=2, cf=0.5)  # half the choices dropped to the spare slot
    x = torch.randn(2, 16, 32)
    slot, weight, capacity = moe.route(x)
    out = torch.randn(2, moe.num_experts, capacity, 32, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = moe.combine(out, slot, weight, 16)
    rows = moe.num_experts * capacity + 1
    assert not {(2, rows, 32), (2 * rows, 32)} & set(saved), saved
    flat = torch.cat([out.reshape(2, -1, 32), out.new_zeros(2, 1, 32)], dim=1)
    gathered = flat.gather(1, slot.unsqueeze(-1).expand(2, 32, 32)) * weight  # the former combine
    expected = gathered.reshape(2, 16, 2, 32).sum(dim=2)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    grad = torch.randn_like(got)
    (new,) = torch.autograd.grad(got, out, grad)
    (old,) = torch.autograd.grad(expected, out, grad)
    torch.testing.assert_close(new, old, rtol=0, atol=0)
