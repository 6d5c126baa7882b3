"""HuggingFace models (``hf:`` names) through the tracer: totals against FlopCounterMode on real
CPU tensors, blocks, and tensor-parallel pairs. HF forwards call ``.item()``, so the reference
runs on CPU with tiny configs rather than on meta."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nest_fx.graph import trace
from nest_fx.graph.capture import export
from nest_fx.graph.flop_formulas import flop_formulas
from nest_fx.models import build_any
from nest_fx.models.hf import parse_hf_name

pytestmark = pytest.mark.hf

FAMILIES = ["hf:gpt2", "hf:llama", "hf:mixtral", "hf:bert"]
CONTAINERS = {
    "hf:gpt2": "transformer.h",
    "hf:llama": "model.layers",
    "hf:mixtral": "model.layers",
    "hf:bert": "bert.encoder.layer",
}


# FlopCounterMode has no formula for the SDPA kernel CPU tensors dispatch to (it counts only the
# CUDA ones) nor for grouped matmuls (HF MoE experts): the reference gets the tracer's formulas for
# them (nest_fx.graph.flop_formulas.flop_formulas), else it counts them as 0 FLOPs.


@functools.lru_cache(maxsize=None)
def traced_hf(name: str, batch: int = 2, seq: int = 16):
    """(model, kwargs, OpGraph, reference FLOPs) of a tiny HF model on CPU."""
    torch.manual_seed(0)
    model, cfg, args, kwargs = build_any(name, batch=batch, seq=seq, device="cpu")
    model.eval()
    counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
    with counter, torch.no_grad():
        model(*args, **kwargs, use_cache=False)
    graph = trace(model, args, kwargs, name=name)
    return model, cfg, kwargs, graph, counter.get_total_flops()


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_totals_match_flop_counter_and_parameters(name):
    model, _, _, graph, ref = traced_hf(name)
    assert graph.method == "export"  # input_ids is a keyword: fx is skipped
    assert ref > 0
    assert graph.total_flops == pytest.approx(ref, rel=1e-2)
    assert graph.total_flops == ref
    params = list(model.parameters())
    assert graph.num_params == sum(p.numel() for p in params)
    assert graph.total_param_bytes == sum(p.numel() * p.element_size() for p in params)
    assert sum(d["param_bytes"] for d in graph.nodes()) == graph.total_param_bytes


@pytest.mark.parametrize("name", ["hf:llama", "hf:gpt2"])
def test_hf_flops_same_on_meta(name):
    """Tracing runs on fake tensors, so an HF model built on meta (whose eager forward fails) traces
    to the same FLOPs and parameters as on CPU, attention included."""
    _, _, _, cpu_graph, _ = traced_hf(name)
    model, _, args, kwargs = build_any(name, batch=2, seq=16, device="meta")
    model.eval()
    graph = trace(model, args, kwargs)
    assert graph.total_flops == cpu_graph.total_flops
    assert graph.num_params == cpu_graph.num_params
    attention = [d for d in cpu_graph.nodes() if d["op"] == "scaled_dot_product_attention"]
    assert len(attention) == 2 and all(d["flops"] == 2 * 2 * 2 * 4 * 16 * 16 * 16 for d in attention)


def test_hf_mixtral_flops_by_hand():
    """Attention, router and top-2 experts of the tiny Mixtral, written out (2*m*n*k per matmul)."""
    _, cfg, _, graph, _ = traced_hf("hf:mixtral")
    tokens, h, f, v = 2 * 16, cfg.hidden, cfg.ffn_hidden, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    per_layer = 2 * tokens * h * (2 * h + 2 * kv) + 2 * 2 * 2 * cfg.heads * 16 * 16 * cfg.head_dim
    per_layer += 2 * tokens * h * cfg.num_experts  # router
    per_layer += tokens * cfg.top_k * 2 * 3 * h * f  # each token through top_k SwiGLU experts
    assert graph.total_flops == cfg.layers * per_layer + 2 * tokens * h * v


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_blocks(name):
    _, cfg, _, graph, _ = traced_hf(name)
    container = CONTAINERS[name]
    assert graph.block_container == container
    assert [b.name for b in graph.layer_blocks] == [f"{container}.{i}" for i in range(cfg.layers)]
    assert graph.blocks[0].kind == "head" and graph.blocks[-1].kind == "tail"
    assert graph.blocks[0].num_params > 0 and graph.blocks[-1].flops > 0  # embeddings / LM head
    sigs = graph.distinct_blocks()
    assert len(sigs) == 1
    assert graph.blocks[0].signature not in sigs and graph.blocks[-1].signature not in sigs
    assert all(b.is_moe == (name == "hf:mixtral") for b in graph.layer_blocks)
    for d in graph.nodes():
        assert d["flops"] >= 0 and d["saved_bytes"] >= 0 and len(d["out_shapes"]) == len(d["out_dtypes"])


def test_hf_llama_blocks_at_other_sizes():
    _, cfg, _, graph, _ = traced_hf("hf:llama:hidden=64,layers=3,heads=4,kv=2,seq=32,vocab=128", 1, 8)
    assert [b.name for b in graph.layer_blocks] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    k_proj = next(d for d in graph.nodes() if d.get("weight") == "model.layers.0.self_attn.k_proj.weight")
    assert k_proj["out_shapes"] == [[1, 8, cfg.kv_heads * cfg.head_dim]] == [[1, 8, 32]]


def _pairs(graph):
    pattern = graph.pattern_of(graph.layer_blocks[0])
    return {(p.kind, tuple(p.column), p.row) for p in pattern.tp_pairs}, pattern.routers


def test_hf_llama_tp_pairs():
    pairs, routers = _pairs(traced_hf("hf:llama")[3])
    assert pairs == {
        ("attention", ("self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"), "self_attn.o_proj"),
        ("mlp", ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
    }
    assert routers == []


def test_hf_gpt2_tp_pairs():
    # GPT-2 uses Conv1D (x @ W + b, an addmm): the fused c_attn feeds c_proj through attention.
    pairs, routers = _pairs(traced_hf("hf:gpt2")[3])
    assert pairs == {("attention", ("attn.c_attn",), "attn.c_proj"), ("mlp", ("mlp.c_fc",), "mlp.c_proj")}
    assert routers == []


def test_hf_bert_tp_pairs():
    pairs, routers = _pairs(traced_hf("hf:bert")[3])
    assert pairs == {
        ("attention", ("attention.self.key", "attention.self.query", "attention.self.value"), "attention.output.dense"),
        ("mlp", ("intermediate.dense",), "output.dense"),
    }
    assert routers == []


def test_hf_mixtral_router_and_experts():
    pairs, routers = _pairs(traced_hf("hf:mixtral")[3])
    assert routers == ["mlp.gate"]
    assert ("expert", ("mlp.experts.gate_up_proj",), "mlp.experts.down_proj") in pairs
    assert ("attention", ("self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"), "self_attn.o_proj") in pairs
    assert len(pairs) == 2
    assert not any("mlp.gate" in (p[2], *p[1]) for p in pairs)  # the router is never a TP pair


def test_hf_exported_graph_matches_eager():
    model, _, kwargs, _, _ = traced_hf("hf:llama")
    gm = export(model, (), dict(kwargs))
    with torch.no_grad():
        expected = model(**kwargs, use_cache=False).logits
        got = gm(**kwargs).logits  # the unlifted module keeps HF's output dataclass
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "name,family",
    [
        ("hf:llama2-7b", "llama"),
        ("hf:mixtral-8x7b", "mixtral"),
        ("hf:gpt2-small", "gpt2"),
        ("hf:bert-large", "bert"),
        ("hf:llama:hidden=32,heads=2", "llama"),
    ],
)
def test_parse_hf_name(name, family):
    assert parse_hf_name(name)[0] == family


@pytest.mark.parametrize(
    "name,expected", [("hf:llama2-7b", 6.74e9), ("hf:mixtral-8x7b", 46.7e9), ("hf:gpt2-small", 124e6)]
)
def test_hf_named_parameter_counts_on_meta(name, expected):
    model, cfg, _, kwargs = build_any(name, seq=16)
    assert kwargs["input_ids"].device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(expected, rel=0.01)


def test_hf_errors():
    with pytest.raises(ValueError, match="'hf:t5' is not one of the nest-fx-shaped HuggingFace names"):
        parse_hf_name("hf:t5")
    with pytest.raises(ValueError, match="exceeds"):
        build_any("hf:gpt2", seq=64)  # the small default has 32 positions
