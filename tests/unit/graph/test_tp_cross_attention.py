"""Cross-attention under tensor parallelism, single process: T5's decoder cross-attention (query
from the decoder's state, key and value from the encoder's output, whole on every rank) is one
pair sharded by heads; the first decoder layer's zero position bias, built inside the attention
from its head count, is built per rank from the localised count (``tp_flow_attention.local_fill``);
a per-head fill built from a count nest-fx does not localise, or read outside copies of its
module, is refused before training; the profiler's one-rank model and the cost model shard the
same pairs. The 4-rank run: tests/distributed/apply/test_tp_cross_attention_dist.py."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.graph import trace
from nest_fx.graph.opgraph import HeadInput
from nest_fx.graph.tp_rehearsal import tp_rehearsal_problem
from nest_fx.graph.tp_regions import slice_head_inputs
from nest_fx.plan.support import parallel_support
from nest_fx.workload.localise import localise_tp

SEQ = 16
CROSS = ("attention", "layer.1.EncDecAttention.o")


@functools.lru_cache(maxsize=None)
def _t5():
    tf = pytest.importorskip("transformers")
    config = tf.T5Config(vocab_size=128, d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, dropout_rate=0.0)
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    model.train()
    ids = torch.randint(0, 128, (2, SEQ))
    kwargs = {"input_ids": ids, "decoder_input_ids": ids}
    return model, kwargs, trace(model, (), kwargs, name="t5")


def _decoder_pairs(graph):
    blocks = [b for b in graph.layer_blocks if b.name.startswith("decoder.block.")]
    return [{(p.kind, p.row): p for p in graph.pattern_of(b).tp_pairs} for b in blocks]


@pytest.mark.hf
def test_t5_cross_attention_is_one_pair_sharded_by_heads():
    model, _, graph = _t5()
    first, later = _decoder_pairs(graph)
    for pairs in (first, later):
        cross = pairs[CROSS]
        assert cross.problem == ""
        assert cross.column == [f"layer.1.EncDecAttention.{p}" for p in "kqv"]
        assert {p.name: p.dim for p in cross.params} == {
            "layer.1.EncDecAttention.k.weight": 0,
            "layer.1.EncDecAttention.q.weight": 0,
            "layer.1.EncDecAttention.v.weight": 0,
            "layer.1.EncDecAttention.o.weight": 1,
        }
        assert cross.head_tables == []  # has_relative_attention_bias is False for cross-attention
    # the first layer builds its zero bias itself (nothing to slice); the later ones receive it
    assert first[CROSS].head_inputs == []
    assert later[CROSS].head_inputs == [HeadInput(shape=[1, 4, SEQ, SEQ], dim=1, count=4, inner=1)]
    support = parallel_support(model, graph)
    assert support.tp_problem(2) == "" and support.tp_problem(4) == ""
    assert tp_rehearsal_problem(model, graph, 2) == ""


@pytest.mark.hf
def test_a_bias_built_by_a_rank_passes_through_later_layers_unsliced():
    """The zero bias the first layer's rank builds has ``heads / tp`` heads; the later layers'
    entry hook leaves such a tensor alone (and slices a whole one)."""
    spec = HeadInput(shape=[1, 4, SEQ, SEQ], dim=1, count=4, inner=1)
    local, whole = torch.zeros(1, 2, SEQ, SEQ), torch.arange(4.0).view(1, 4, 1, 1).expand(1, 4, SEQ, SEQ)
    (kept, sliced), _ = slice_head_inputs((local, whole), {}, [spec], 2, 1)
    assert kept is local
    assert sliced[0, :, 0, 0].tolist() == [2.0, 3.0]


def _flops(graph, module: str) -> float:
    return sum(
        d.get("flops") or 0 for _, d in graph.graph.nodes(data=True) if d.get("module", "").startswith(module + ".")
    )


@pytest.mark.hf
def test_t5_one_rank_model_and_cost_model_shard_the_cross_attention():
    """The profiler's one-rank copy computes half of every decoder layer; the cost model drops half
    of the cross-attention's parameters and all-reduces once per pair (self, cross, MLP)."""
    from nest_fx.workload.roofline import AnalyticalCompute
    from nest_fx.workload.traced_source import TracedSource, workload_from_graph
    from nest_fx.workload.types import ModelDims

    model, kwargs, graph = _t5()
    shrunk = localise_tp(copy.deepcopy(model), graph, 2, model.config.vocab_size)  # shrinks in place
    local = trace(shrunk, (), kwargs, name="t5-local")
    for layer in ("decoder.block.0", "decoder.block.1"):  # by module: the two traces may chain other blocks
        assert _flops(local, layer) / _flops(graph, layer) == pytest.approx(0.5, abs=0.01), layer
    timing = AnalyticalCompute(peak_flops=1e12, mem_bandwidth=1e11)
    layers = workload_from_graph(graph, timing, ModelDims(seq_len=SEQ)).layers
    source = TracedSource(graph, timing)
    for block in graph.layer_blocks:
        if not block.name.startswith("decoder.block."):
            continue
        layer = next(layer for layer in layers if layer.name == block.name)
        whole, half = source.cost(layer, 1, 1, 2, False), source.cost(layer, 2, 1, 2, False)
        pairs = graph.pattern_of(block).tp_pairs
        sharded = {block.fqn(p.name) for pair in pairs for p in pair.params}
        sharded |= {block.fqn(t) + ".weight" for pair in pairs for t in pair.head_tables}
        assert {block.fqn(f"layer.1.EncDecAttention.{p}.weight") for p in "qkvo"} <= sharded
        assert whole.num_params - half.num_params == sum(model.get_parameter(n).numel() for n in sharded) / 2
        assert sum(c.count for c in half.comms if c.kind == "all_reduce" and c.phase == "fwd") == 3


class CrossAttention(nn.Module):
    """Cross-attention of the decoder's state over a memory, with a zero per-head bias built inside
    from ``self.heads`` (localised under TP) or, with ``literal``, from a fixed 4."""

    def __init__(self, dim: int = 32, heads: int = 4, literal: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.literal = heads, dim // heads, literal
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, memory):
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, y.shape[1], -1, self.head_dim).transpose(1, 2)

        bias = torch.zeros(1, 4 if self.literal else self.heads, t, memory.shape[1], device=x.device, dtype=x.dtype)
        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(memory)), heads(self.v(memory)), bias)
        return self.o(out.transpose(1, 2).reshape(b, t, -1)), bias


class Layer(nn.Module):
    def __init__(self, literal: bool = False, leak: bool = False):
        super().__init__()
        self.norm, self.attn, self.leak = nn.LayerNorm(32), CrossAttention(literal=literal), leak

    def forward(self, x, memory):
        out, bias = self.attn(self.norm(x), memory)
        return x + out + (bias.sum() if self.leak else 0)  # leak: the layer itself reads the per-head bias


class Decoder(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.embed, self.layers = nn.Linear(32, 32), nn.ModuleList(Layer(**kw) for _ in range(2))

    def forward(self, x, memory):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, memory)
        return x


def _own(**kw):
    torch.manual_seed(0)
    model = Decoder(**kw)
    graph = trace(model, (torch.randn(2, 8, 32), torch.randn(2, 6, 32)))
    pair = {(p.kind, p.row): p for p in graph.pattern_of(graph.layer_blocks[0]).tp_pairs}[("attention", "attn.o")]
    return model, graph, pair


def test_a_zero_bias_built_from_the_head_count_attribute_is_followed():
    model, graph, pair = _own()
    assert pair.problem == "" and pair.head_inputs == []
    assert pair.column == ["attn.k", "attn.q", "attn.v"]
    assert parallel_support(model, graph).tp_problem(2) == ""


def test_a_zero_bias_built_from_a_literal_head_count_is_refused_by_the_rehearsal():
    """The graph cannot tell ``self.heads`` from a literal 4; the rank's copy of the region can."""
    model, graph, pair = _own(literal=True)
    assert pair.problem == ""
    problem = parallel_support(model, graph).tp_problem(2)
    assert "layers.0.attn" in problem, problem


def test_a_per_head_bias_read_outside_its_module_is_refused():
    _, _, pair = _own(leak=True)
    assert "builds a per-head tensor from the global head count inside the region" in pair.problem
