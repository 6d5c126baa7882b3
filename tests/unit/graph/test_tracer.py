"""Tracer on the model zoo: totals against FlopCounterMode, blocks, TP pairs, node attributes,
saved-for-backward bytes against a real autograd run, fx graph == eager, and error messages."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from nest_fx.graph import TraceError, trace
from nest_fx.graph.capture import symbolic
from nest_fx.models import build_model, example_tokens

SMALL_LLAMA = "llama:hidden=128,layers=3,heads=4,kv=2,seq=64,vocab=256"
SMALL_GPT = "gpt:hidden=128,layers=2,heads=4,seq=64,vocab=256"
SMALL_MOE = "moe:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=100,experts=4"
MIXED_MOE = "moe:hidden=64,layers=4,heads=4,seq=32,vocab=100,experts=4,moe_every=2"


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# FlopCounterMode counts SDPA only for the CUDA kernels (which meta tensors also dispatch to);
# on CPU tensors give the CPU kernel the same formula, or attention counts as 0 FLOPs.
CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa}


def reference_flops(model, args, kwargs=None) -> int:
    counter = FlopCounterMode(display=False, custom_mapping=CPU_SDPA)
    with counter, torch.no_grad():
        model(*args, **(kwargs or {}))
    return counter.get_total_flops()


def param_totals(model):
    params = list(model.parameters())  # deduplicated: tied weights count once
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


# -- totals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,seq",
    [
        ("gpt2-small", 128),
        ("bert-large", 128),
        ("llama2-7b", 128),
        # the largest zoo models: the flop counter runs for a minute on a loaded box
        pytest.param("mixtral-8x7b", 128, marks=pytest.mark.slow),
        pytest.param("gpt3-175b", 128, marks=pytest.mark.slow),
        (MIXED_MOE, 32),
    ],
)
def test_zoo_totals_match_flop_counter_and_parameters(zoo, name, seq):
    model, _, args, graph = zoo(name, seq=seq)
    ref = reference_flops(model, args)  # zoo models run on meta
    assert ref > 0
    assert graph.total_flops == pytest.approx(ref, rel=1e-2)
    assert graph.total_flops == ref, "per-node FLOPs should add up to FlopCounterMode's total exactly"
    num, nbytes = param_totals(model)
    assert graph.num_params == num
    assert graph.total_param_bytes == nbytes
    # blocks partition the totals
    assert sum(b.flops for b in graph.blocks) == graph.total_flops
    assert sum(b.param_bytes for b in graph.blocks) == nbytes


@pytest.mark.parametrize("spec", [SMALL_LLAMA, SMALL_GPT, SMALL_MOE])
def test_totals_on_cpu_tensors(spec):
    torch.manual_seed(0)
    model, cfg = build_model(spec, device="cpu")
    tokens = example_tokens(2, cfg.seq_len, cfg.vocab_size, "cpu")
    graph = trace(model, (tokens,))
    assert graph.total_flops == reference_flops(model, (tokens,))
    assert graph.num_params == param_totals(model)[0]
    # FLOPs depend on shapes only: the same model on meta counts the same (attention included)
    meta_model, _ = build_model(spec, device="meta")
    assert trace(meta_model, (example_tokens(2, cfg.seq_len, cfg.vocab_size),)).total_flops == graph.total_flops
    attention = [d for d in graph.nodes() if d["op"] == "scaled_dot_product_attention"]
    assert len(attention) == cfg.layers and all(d["flops"] > 0 for d in attention)


def test_llama_flops_by_hand():
    """Forward FLOPs of a small GQA llama, written out: 2*m*n*k per matmul, SDPA as two bmms."""
    model, cfg = build_model(SMALL_LLAMA, device="cpu")
    b, s, h, f, v = 2, cfg.seq_len, cfg.hidden, cfg.ffn_hidden, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    tokens = b * s
    per_layer = 2 * tokens * h * (2 * h + 2 * kv)  # q, o + k, v
    per_layer += 2 * 2 * b * cfg.heads * s * s * cfg.head_dim  # q @ k^T and p @ v (full square)
    per_layer += 2 * tokens * 3 * h * f  # gate, up, down
    expected = cfg.layers * per_layer + 2 * tokens * h * v  # + lm_head
    graph = trace(model, (example_tokens(b, s, v, "cpu"),))
    assert graph.total_flops == expected


# -- blocks ------------------------------------------------------------------------------------
def test_llama2_7b_has_32_identical_blocks(zoo):
    model, cfg, _, graph = zoo("llama2-7b")
    assert graph.method == "fx"
    assert graph.block_container == "layers"
    assert [b.kind for b in graph.blocks] == ["head"] + ["block"] * 32 + ["tail"]
    assert [b.name for b in graph.layer_blocks] == [f"layers.{i}" for i in range(32)]
    assert [b.index for b in graph.blocks] == list(range(34))
    sigs = graph.distinct_blocks()
    assert len(sigs) == 1 and list(sigs.values())[0] == list(range(1, 33))
    head, tail = graph.blocks[0], graph.blocks[-1]
    block_sig = graph.layer_blocks[0].signature
    assert len({head.signature, tail.signature, block_sig}) == 3
    # per-layer parameters: q,k,v,o + gate,up,down + two RMSNorm weights
    h, f = cfg.hidden, cfg.ffn_hidden
    per_layer = 4 * h * h + 3 * h * f + 2 * h
    assert all(b.num_params == per_layer for b in graph.layer_blocks)
    assert head.num_params == cfg.vocab_size * h  # token embedding
    assert tail.num_params == h + h * cfg.vocab_size  # final norm + lm_head
    assert len({b.flops for b in graph.layer_blocks}) == 1
    assert not any(b.is_moe for b in graph.blocks)
    # every node is in exactly one block, and blocks follow graph order
    assigned = [n for b in graph.blocks for n in b.nodes]
    assert sorted(assigned) == sorted(graph.graph.nodes)
    assert assigned == list(graph.graph.nodes)
    assert all(graph.graph.nodes[n]["block"] == b.index for b in graph.blocks for n in b.nodes)


@pytest.mark.parametrize(
    "name,layers,moe",
    [
        # the 96- and 80-layer traces take 4-9 s on the 2-core box; gpt2-small and llama2-7b
        # (test_llama2_7b_has_32_identical_blocks) trace the same builders in CI
        pytest.param("gpt3-175b", 96, False, marks=pytest.mark.slow),
        ("mixtral-8x7b", 32, True),
        pytest.param("llama3-70b", 80, False, marks=pytest.mark.slow),
        ("gpt2-small", 12, False),
        ("bert-large", 24, False),
    ],
)
def test_zoo_block_counts(zoo, name, layers, moe):
    _, _, _, graph = zoo(name)
    assert len(graph.layer_blocks) == layers
    assert len(graph.distinct_blocks()) == 1
    assert graph.blocks[0].kind == "head" and graph.blocks[-1].kind == "tail"
    assert len(graph.blocks) == layers + 2
    assert all(b.is_moe == moe for b in graph.layer_blocks)
    assert not graph.blocks[0].is_moe and not graph.blocks[-1].is_moe


def test_mixed_dense_and_moe_layers_give_two_signatures(zoo):
    _, cfg, _, graph = zoo(MIXED_MOE, seq=32)
    assert [b.is_moe for b in graph.layer_blocks] == [cfg.is_moe_layer(i) for i in range(4)] == [False, True] * 2
    sigs = graph.distinct_blocks()
    assert len(sigs) == 2
    assert sorted(sigs.values()) == [[1, 3], [2, 4]]
    dense, moe = graph.pattern_of(graph.blocks[1]), graph.pattern_of(graph.blocks[2])
    assert [(p.kind, p.column, p.row) for p in dense.tp_pairs if p.kind == "mlp"] == [
        ("mlp", ["mlp.gate", "mlp.up"], "mlp.down")
    ]
    assert not dense.routers and moe.routers == ["moe.gate"]


# -- tensor-parallel pairs ---------------------------------------------------------------------
def _pairs(graph, block_index=1):
    pattern = graph.pattern_of(graph.blocks[block_index])
    return {(p.kind, tuple(p.column), p.row) for p in pattern.tp_pairs}, pattern.routers


def test_tp_pairs_llama(zoo):
    _, _, _, graph = zoo("llama2-7b")
    pairs, routers = _pairs(graph)
    assert pairs == {
        ("attention", ("attn.k_proj", "attn.q_proj", "attn.v_proj"), "attn.o_proj"),
        ("mlp", ("mlp.gate", "mlp.up"), "mlp.down"),
    }
    assert routers == []
    assert len(graph.patterns) == 1  # one pattern per distinct block


@pytest.mark.parametrize("name", ["gpt2-small", pytest.param("gpt3-175b", marks=pytest.mark.slow)])
def test_tp_pairs_gpt(zoo, name):
    pairs, routers = _pairs(zoo(name)[3])
    assert pairs == {
        ("attention", ("attn.k_proj", "attn.q_proj", "attn.v_proj"), "attn.o_proj"),
        ("mlp", ("mlp.fc",), "mlp.proj"),
    }
    assert routers == []


def test_tp_pairs_mixtral_experts_and_router(zoo):
    _, cfg, _, graph = zoo("mixtral-8x7b")
    pairs, routers = _pairs(graph)
    expected = {("attention", ("attn.k_proj", "attn.q_proj", "attn.v_proj"), "attn.o_proj")}
    expected |= {
        ("expert", (f"moe.experts.{e}.gate", f"moe.experts.{e}.up"), f"moe.experts.{e}.down")
        for e in range(cfg.num_experts)
    }
    assert pairs == expected
    assert routers == ["moe.gate"]


# -- per-node attributes -----------------------------------------------------------------------
def test_node_attributes(zoo):
    model, cfg, _, graph = zoo("llama2-7b")
    params = dict(model.named_parameters())
    linear_weights = []
    for d in graph.nodes():
        assert d["op"] and isinstance(d["module"], str)
        assert isinstance(d["out_shapes"], list) and len(d["out_shapes"]) == len(d["out_dtypes"])
        assert all(isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s) for s in d["out_shapes"])
        assert len(d["in_shapes"]) == len(d["in_dtypes"])
        assert d["flops"] >= 0 and d["saved_bytes"] >= 0 and d["param_bytes"] >= 0 and d["out_bytes"] >= 0
        assert all(p in params for p in d["params"])
        if d["op"] == "linear":
            assert d["weight"] in params, d
            assert d["flops"] > 0
            linear_weights.append(d["weight"])
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert len(linear_weights) == len(set(linear_weights)) == n_linear
    assert sum(d["param_bytes"] for d in graph.nodes()) == sum(p.numel() * p.element_size() for p in params.values())
    # every parameter is attributed to exactly one node
    owned = [p for d in graph.nodes() for p in d["params"]]
    assert sorted(owned) == sorted(params)
    # lm_head produces the logits
    lm_head = next(d for d in graph.nodes() if d.get("weight") == "lm_head.weight")
    assert lm_head["out_shapes"] == [[1, 128, cfg.vocab_size]]
    assert lm_head["flops"] == 2 * 128 * cfg.hidden * cfg.vocab_size
    # edges follow data flow, i.e. graph order
    order = {n: i for i, n in enumerate(graph.graph.nodes)}
    assert all(order[u] < order[v] for u, v in graph.graph.edges)
    assert graph.graph.number_of_edges() > len(graph)  # more edges than nodes: residuals, q/k/v fan-out


def test_node_dtypes_follow_model_dtype():
    model, cfg = build_model(SMALL_LLAMA, device="meta", dtype=torch.bfloat16)
    graph = trace(model, (example_tokens(1, 16, cfg.vocab_size),))
    linear = [d for d in graph.nodes() if d["op"] == "linear"]
    assert linear and all(d["out_dtypes"] == ["bfloat16"] for d in linear)
    assert graph.total_param_bytes == 2 * graph.num_params
    # the RMSNorm computes in float32 (x.float()) and the token ids are int64
    assert any(d["out_dtypes"] == ["float32"] and d["module"].endswith("attn_norm") for d in graph.nodes())
    assert graph.nodes().__next__()["out_dtypes"] == ["int64"]


def test_identical_block_signatures_and_different_head_tail(zoo):
    _, _, _, graph = zoo("gpt2-small")
    sigs = {b.signature for b in graph.layer_blocks}
    assert len(sigs) == 1
    assert graph.blocks[0].signature not in sigs and graph.blocks[-1].signature not in sigs
    # a different sequence length changes the block signature (shapes are part of it)
    other = zoo("gpt2-small", seq=64)[3]
    assert other.layer_blocks[0].signature != graph.layer_blocks[0].signature


# -- saved-for-backward bytes ------------------------------------------------------------------
def measured_saved_bytes(model, tokens):
    """Bytes autograd saves per top-level block in a real CPU forward (dedupe by storage, no params)."""
    state = {p.untyped_storage().data_ptr() for p in model.parameters()}
    state |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen, per_block, current = set(), {}, ["head"]

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in state and key not in seen:
            seen.add(key)
            per_block[current[0]] = per_block.get(current[0], 0) + storage.nbytes()
        return t

    def enter(name):
        def hook(module, args):
            current[0] = name

        return hook

    handles = [
        model.embed.register_forward_pre_hook(enter("head")),
        model.norm.register_forward_pre_hook(enter("tail")),
    ]
    handles += [layer.register_forward_pre_hook(enter(f"layers.{i}")) for i, layer in enumerate(model.layers)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens)
    finally:
        for h in handles:
            h.remove()
    assert out.requires_grad
    return per_block


@pytest.mark.parametrize(
    "spec,dtype",
    [
        (SMALL_LLAMA, torch.float32),
        (SMALL_LLAMA, torch.bfloat16),
        (SMALL_GPT, torch.float32),
        (SMALL_MOE, torch.float32),
    ],
)
def test_saved_bytes_match_real_autograd(spec, dtype):
    torch.manual_seed(0)
    model, cfg = build_model(spec, device="cpu", dtype=dtype)
    tokens = example_tokens(2, cfg.seq_len, cfg.vocab_size, "cpu")
    real = measured_saved_bytes(model, tokens)
    graph = trace(model, (tokens,))
    fake = {b.name: b.saved_bytes for b in graph.blocks}
    assert set(fake) == set(real)
    for name, expected in real.items():
        assert expected > 0
        assert fake[name] == pytest.approx(expected, rel=0.02), name
    # identical layers save identical bytes
    assert len({b.saved_bytes for b in graph.layer_blocks}) == 1


# -- traced graph computes the model -----------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [SMALL_LLAMA, SMALL_GPT, SMALL_MOE, MIXED_MOE, "gpt:hidden=64,layers=2,heads=4,seq=32,vocab=100,causal=false"],
)
def test_fx_graph_matches_eager(spec):
    torch.manual_seed(0)
    model, cfg = build_model(spec, device="cpu")
    tokens = example_tokens(2, cfg.seq_len, cfg.vocab_size, "cpu")
    gm = symbolic(model)
    assert any(n.op == "call_module" and n.target == "layers.0.attn.q_proj" for n in gm.graph.nodes)
    with torch.no_grad():
        expected = model(tokens)
        torch.testing.assert_close(gm(tokens), expected, rtol=0, atol=0)
        # also at a shorter sequence: nothing about the length was baked in
        short = tokens[:, : cfg.seq_len // 2]
        torch.testing.assert_close(gm(short), model(short), rtol=0, atol=0)
    assert trace(model, (tokens,), method="fx").method == "fx"


# -- errors and leaf modules -------------------------------------------------------------------
class DataDependent(nn.Module):
    """Branches on a tensor value and uses .item() as a shape: neither fx nor export can trace it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            rows = int(y.abs().max().item()) + 1
            return y.new_zeros(rows, 8)
        return y


class ShapeBranch(nn.Module):
    """Python ``if`` on a shape: fx cannot trace it, but it runs fine on fake tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] > 1:
            return self.lin(x).relu()
        return self.lin(x)


class Outer(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.stack = nn.Sequential(nn.Identity(), inner)
        self.post = nn.Linear(8, 8)

    def forward(self, x):
        return self.post(self.stack(self.pre(x)))


def test_untraceable_module_error_names_fqn_and_fix():
    with pytest.raises(TraceError) as info:
        trace(Outer(DataDependent()), (torch.randn(4, 8),))
    msg = str(info.value)
    assert "torch.fx.symbolic_trace" in msg and "torch.export" in msg  # both tracers were tried
    assert "could not trace module 'stack.1'" in msg
    assert "leaf_modules=['stack.1']" in msg and "--leaf stack.1" in msg


def test_export_only_error_names_fqn():
    with pytest.raises(TraceError, match=r"torch\.export .*'stack\.1'"):
        trace(Outer(DataDependent()), (torch.randn(4, 8),), method="export")


def test_leaf_module_makes_fx_succeed():
    model, x = Outer(ShapeBranch()), torch.randn(4, 8)
    with pytest.raises(TraceError, match=r"torch\.fx\.symbolic_trace could not trace module 'stack\.1'"):
        trace(model, (x,), method="fx")
    for leaf in (["stack.1"], [ShapeBranch]):
        graph = trace(model, (x,), method="fx", leaf_modules=leaf)
        assert graph.method == "fx"
        leaf_nodes = [d for d in graph.nodes() if d["module"] == "stack.1"]
        assert [d["op"] for d in leaf_nodes] == ["shapebranch"]
        assert leaf_nodes[0]["flops"] == 2 * 4 * 8 * 8
        assert sorted(leaf_nodes[0]["params"]) == ["stack.1.lin.bias", "stack.1.lin.weight"]
        assert graph.total_flops == reference_flops(model, (x,)) == 3 * 2 * 4 * 8 * 8
        assert graph.num_params == param_totals(model)[0]
    # auto falls back to torch.export, which traces the shape branch
    assert trace(model, (x,)).method == "export"


def test_leaf_that_fails_on_fake_tensors_raises_trace_error():
    with pytest.raises(TraceError, match="fake tensors"):
        trace(Outer(DataDependent()), (torch.randn(4, 8),), leaf_modules=["stack.1"])


def test_bad_method():
    with pytest.raises(ValueError, match="trace method"):
        trace(Outer(ShapeBranch()), (torch.randn(4, 8),), method="jit")


def test_tracing_holds_no_reference_to_the_model():
    """The trace's saved-tensor hook must not keep the traced module (and the parameters it shares
    with the model) alive once the caller drops them: before the fix a GPU run leaked the whole
    model per auto_parallelize call (a cycle through the C++ autograd graph)."""
    import gc
    import weakref

    model, cfg = build_model(SMALL_LLAMA, device="cpu")
    params = [weakref.ref(p) for p in model.parameters()]
    graph = trace(model, (example_tokens(2, cfg.seq_len, cfg.vocab_size, "cpu"),))
    assert graph.num_params > 0
    del model, graph
    gc.collect()
    assert sum(r() is not None for r in params) == 0
