"""Tensor parallelism on the layouts the ecosystem uses, and layers found in nn.Sequential models.

Single-process: what the tracer finds in tiny HuggingFace models built from configs (HF
``Conv1D``, fused qkv / gate_up, per-head norms, ALiBi, relative position bias, ``x @ W.T``,
3-D expert weights) and in flat ``nn.Sequential`` MLPs and CNNs; what the runtime refuses and
why; the fused-parameter layout; the profiler's one-rank model. The multi-process runs (gloo)
on these layouts are in tests/distributed/apply/test_tp_layouts_dist.py.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nest_fx.apply.fused_params import FusedLayout
from nest_fx.graph import trace
from nest_fx.graph.opgraph import HeadInput
from nest_fx.graph.stage_modules import arm_stages, rehearse_split, run_stages, split_stages
from nest_fx.graph.stand_in import SplitError, StandIn
from nest_fx.graph.tp_regions import slice_head_inputs
from nest_fx.plan.support import parallel_support
from nest_fx.workload.localise import localise_tp

from tiny_models import HF_FAMILIES, build_cnn, build_hf, build_mlp


@functools.lru_cache(maxsize=None)
def _traced_hf(family: str):
    model, cfg = build_hf(family, device="meta")
    graph = trace(model, (torch.empty(2, 32, dtype=torch.long, device="meta"),))
    return model, graph


def _pairs(graph, index: int = 1):
    """{(kind, row): pair} of the block at chain index ``index``."""
    return {(p.kind, p.row): p for p in graph.pattern_of(graph.blocks[index]).tp_pairs}


def _params(pair):
    return {p.name: (p.dim, p.parts, p.units) for p in pair.params}


# -- what the tracer finds -----------------------------------------------------------------------


@pytest.mark.hf
def test_gpt2_conv1d_fused_qkv_is_sharded_by_parts_along_its_columns():
    pytest.importorskip("transformers")
    model, graph = _traced_hf("gpt2")
    pairs = _pairs(graph)
    attn = pairs[("attention", "attn.c_proj")]
    # Conv1D weights are [in, out]: the column shards dim 1 in three parts of 4 heads x 16, the row dim 0
    assert _params(attn) == {
        "attn.c_attn.weight": (1, [64, 64, 64], [16, 16, 16]),
        "attn.c_attn.bias": (0, [64, 64, 64], [16, 16, 16]),
        "attn.c_proj.weight": (0, [], []),
    }
    assert _params(pairs[("mlp", "mlp.c_proj")])["mlp.c_fc.weight"] == (1, [], [1])
    assert not attn.problem and parallel_support(model, graph).tp_problem(2) == ""


@pytest.mark.hf
def test_phi3_fused_qkv_gqa_and_gate_up():
    pytest.importorskip("transformers")
    model, graph = _traced_hf("phi3")
    pairs = _pairs(graph)
    # 4 query heads and 2 key/value heads of 16: each part is sharded on its own
    assert _params(pairs[("attention", "self_attn.o_proj")])["self_attn.qkv_proj.weight"] == (
        0,
        [64, 32, 32],
        [16, 16, 16],
    )
    assert _params(pairs[("mlp", "mlp.down_proj")])["mlp.gate_up_proj.weight"] == (0, [128, 128], [1, 1])
    support = parallel_support(model, graph)
    assert support.tp_problem(2) == ""
    assert "2 key/value heads" in support.tp_problem(4)


@pytest.mark.hf
def test_qwen3_per_head_norms_are_part_of_the_attention_region():
    pytest.importorskip("transformers")
    _, graph = _traced_hf("qwen3")
    attn = _pairs(graph)[("attention", "self_attn.o_proj")]
    assert attn.column == ["self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj"]
    assert attn.head_norms == {"self_attn.q_norm": 2, "self_attn.k_norm": 2}  # input [batch, seq, heads, dim]


@pytest.mark.hf
def test_bloom_alibi_and_t5_relative_position_bias_go_with_their_heads():
    pytest.importorskip("transformers")
    _, bloom = _traced_hf("bloom")
    attn = _pairs(bloom)[("attention", "self_attention.dense")]
    # the fused qkv is [heads, 3, head_dim]: one part, sharded by heads of 3 x 16 features
    assert _params(attn)["self_attention.query_key_value.weight"] == (0, [], [48])
    assert attn.head_inputs == [HeadInput(shape=[8, 1, 32], dim=0, count=4, inner=1)]  # [batch * heads, 1, seq]
    _, t5 = _traced_hf("t5")
    first = _pairs(t5, 1)[("attention", "layer.0.SelfAttention.o")]
    later = _pairs(t5, 2)[("attention", "layer.0.SelfAttention.o")]
    assert first.head_tables == ["layer.0.SelfAttention.relative_attention_bias"]
    assert later.head_inputs == [HeadInput(shape=[1, 4, 32, 32], dim=1, count=4, inner=1)]


@pytest.mark.hf
def test_opt_learned_positions_stay_replicated_and_its_layer_wide_mlp_refuses_sequence_parallel():
    pytest.importorskip("transformers")
    from nest_fx.apply.tensor_parallel import vocab_parallel_modules

    model, graph = _traced_hf("opt")
    tf = pytest.importorskip("transformers")
    with torch.device("meta"):
        untied = tf.OPTForCausalLM(
            tf.OPTConfig(
                hidden_size=64,
                ffn_dim=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=32,
                word_embed_proj_dim=64,
                vocab_size=128,
                tie_word_embeddings=False,
                use_cache=False,
            )
        )
    untied_graph = trace(untied, (torch.empty(2, 32, dtype=torch.long, device="meta"),))
    # OPTLearnedPositionalEmbedding adds an offset in its own forward: not a plain lookup
    assert vocab_parallel_modules(untied, untied_graph, 0, len(untied_graph.blocks)) == {
        "model.decoder.embed_tokens": "rowwise",
        "lm_head": "colwise",
    }
    support = parallel_support(model, graph)
    assert support.tp_problem(2) == ""
    assert "fc2 and its columns ['fc1'] are direct children of the layer" in support.sp_problem()


@pytest.mark.hf
def test_falcon_matmul_without_linear_and_grouped_qkv():
    pytest.importorskip("transformers")
    model, graph = _traced_hf("falcon")
    attn = _pairs(graph)[("attention", "self_attention.dense")]
    # x @ weight.T: the weight is [out, in]; the qkv is [kv groups, 2 queries + key + value, head_dim]
    assert _params(attn) == {
        "self_attention.query_key_value.weight": (0, [], [64]),
        "self_attention.dense.weight": (1, [], []),
    }
    assert "2 heads" in parallel_support(model, graph).tp_problem(4)


@pytest.mark.hf
def test_qwen3_moe_3d_expert_weights_and_router():
    pytest.importorskip("transformers")
    _, graph = _traced_hf("qwen3_moe")
    pattern = graph.pattern_of(graph.blocks[1])
    experts = _pairs(graph)[("expert", "mlp.experts.down_proj")]
    assert pattern.routers == ["mlp.gate"]
    assert _params(experts) == {"mlp.experts.gate_up_proj": (1, [32, 32], [1, 1]), "mlp.experts.down_proj": (2, [], [])}


@pytest.mark.hf
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_one_rank_model_computes_half_of_every_layer(family):
    """The profiler's one-rank model (workload.localise) follows the same pairs: each layer's
    FLOPs halve at tp=2 (Qwen3-MoE: its replicated router keeps its FLOPs)."""
    pytest.importorskip("transformers")
    model, cfg = build_hf(family, device="meta")
    tokens = torch.empty(2, 32, dtype=torch.long, device="meta")
    graph = trace(model, (tokens,))
    local = trace(localise_tp(model, graph, 2, cfg.vocab_size), (tokens,))
    for block, shrunk in zip(graph.layer_blocks, local.layer_blocks):
        assert shrunk.flops / block.flops == pytest.approx(0.5, abs=0.01), block.name


@pytest.mark.hf
@pytest.mark.parametrize("family", ["gpt2", "phi3", "qwen3", "qwen3_moe", "falcon", "t5"])
def test_cost_model_shards_what_the_runtime_shards(family):
    """The traced cost source reads the same pairs: at tp=2 a layer keeps half of every parameter
    the pairs shard and all of the rest (norms, routers, a row's bias), and all-reduces once per
    pair in the forward."""
    pytest.importorskip("transformers")
    from nest_fx.workload.roofline import AnalyticalCompute
    from nest_fx.workload.traced_source import TracedSource, workload_from_graph
    from nest_fx.workload.types import ModelDims

    model, graph = _traced_hf(family)
    timing = AnalyticalCompute(peak_flops=1e12, mem_bandwidth=1e11)
    layers = workload_from_graph(graph, timing, ModelDims(seq_len=32)).layers
    source = TracedSource(graph, timing)
    for block in graph.layer_blocks:
        layer = next(layer for layer in layers if layer.name == block.name)
        whole, half = source.cost(layer, 1, 1, 2, False), source.cost(layer, 2, 1, 2, False)
        pairs = graph.pattern_of(block).tp_pairs
        sharded = {block.fqn(p.name) for pair in pairs for p in pair.params}
        sharded |= {block.fqn(t) + ".weight" for pair in pairs for t in pair.head_tables}
        assert whole.num_params == block.num_params
        assert whole.num_params - half.num_params == sum(model.get_parameter(n).numel() for n in sharded) / 2
        dense = [p for p in pairs if p.kind != "expert"]
        expected = len(dense) + (1 if len(dense) < len(pairs) else 0)
        assert sum(c.count for c in half.comms if c.kind == "all_reduce" and c.phase == "fwd") == expected


# -- refusals --------------------------------------------------------------------------------------


class ProjectionNormAttention(nn.Module):
    """Attention with a norm over the whole query projection (as OLMo-2 does): each TP rank would
    normalise its shard of the features alone."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))
        self.q_norm = nn.LayerNorm(hidden)

    def forward(self, x):
        b, s, h = x.shape
        q = self.q_norm(self.q_proj(x)).view(b, s, -1, h // self.heads).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, h // self.heads).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, h // self.heads).transpose(1, 2)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h))


class OwnProjectionNormAttention(ProjectionNormAttention):
    """The norm over the whole query in the attention's own forward, not a module of its own: no
    module for TP to run with gathered statistics (a ``q_norm`` module runs: test_tp_wide_norms.py)."""

    def forward(self, x):
        b, s, h = x.shape
        q = F.layer_norm(self.q_proj(x), (h,)).view(b, s, -1, h // self.heads).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, h // self.heads).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, h // self.heads).transpose(1, 2)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h))


class HeadScaledAttention(ProjectionNormAttention):
    """Attention with a learned per-head temperature applied to the scores."""

    def __init__(self, hidden=32, heads=4):
        super().__init__(hidden, heads)
        self.q_norm = nn.Identity()
        self.temperature = nn.Parameter(torch.ones(heads, 1, 1))

    def forward(self, x):
        b, s, h = x.shape
        q = self.q_proj(x).view(b, s, -1, h // self.heads).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, h // self.heads).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, h // self.heads).transpose(1, 2)
        probs = torch.softmax(q @ k.transpose(-1, -2) * self.temperature, dim=-1)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, s, h))


class LeakyAttention(HeadScaledAttention):
    """Attention whose block also adds the query projection to its output: that use would see one
    rank's shard of the queries."""

    def forward(self, x):
        b, s, h = x.shape
        q = self.q_proj(x)
        heads = [t.view(b, s, -1, h // self.heads).transpose(1, 2) for t in (q, self.k_proj(x), self.v_proj(x))]
        out = F.scaled_dot_product_attention(*heads).transpose(1, 2).reshape(b, s, h)
        return self.o_proj(out) + q


class Stack(nn.Module):
    def __init__(self, make, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize(
    "make,expected",
    [
        (
            OwnProjectionNormAttention,
            r"layers.0: attention pair .*takes its query through 'layers.0', a norm over all the "
            r"heads' 32 features",
        ),
        (HeadScaledAttention, r"parameter layers.0.temperature has one entry per sharded head"),
        (LeakyAttention, r"the sharded output of op 'linear' in module 'layers.0.q_proj' is also used by op 'add'"),
        (lambda: nn.Linear(32, 32), r"would shard nothing: no column->row linear pair"),
    ],
)
def test_layers_tensor_parallelism_cannot_shard_are_refused_with_the_reason(make, expected):
    model = Stack(make)
    problem = parallel_support(model, trace(model, (torch.randn(2, 8, 32),))).tp_problem(2)
    assert problem.startswith("tp=2") and "fix: use tp=1" in problem
    assert re.search(expected, problem), problem


@pytest.mark.hf
def test_a_projection_grouped_by_a_constant_of_the_module_is_refused():
    """CodeGen views its qkv as ``mp_num = 4`` groups, a constant of its forward: a rank's copy
    would regroup its shard into 4 again and mix queries with values. 16 heads: refused."""
    tf = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = tf.CodeGenForCausalLM(
            tf.CodeGenConfig(n_embd=256, n_layer=2, n_head=16, rotary_dim=8, vocab_size=128, use_cache=False)
        )
    graph = trace(model, (torch.empty(2, 32, dtype=torch.long, device="meta"),))
    assert "attn.qkv_proj.weight is viewed as 4 groups, which are not the model's heads ([16])" in parallel_support(
        model, graph
    ).tp_problem(2)


# -- nn.Sequential models ----------------------------------------------------------------------------


def test_sequential_mlp_layers_are_repeated_units_holding_a_pair():
    model, _ = build_mlp()
    graph = trace(model, (torch.randn(4, 16),))
    assert [(b.kind, b.name, b.members) for b in graph.blocks] == [
        ("head", "head", []),
        ("block", "2..5", ["2", "3", "4", "5"]),
        ("block", "6..9", ["6", "7", "8", "9"]),
        ("tail", "tail", []),
    ]
    assert graph.blocks[1].signature == graph.blocks[2].signature
    (pair,) = graph.pattern_of(graph.blocks[1]).tp_pairs
    assert (pair.column, pair.row) == (["0"], "2")  # child indices counted from the layer's first child
    assert graph.blocks[2].fqn(pair.row) == "8"
    support = parallel_support(model, graph)
    assert support.tp_problem(2) == "" and support.pp_problem(2) == ""
    assert "groups of nn.Sequential children" in support.sp_problem()


def test_sequential_cnn_pipelines_but_refuses_tp_naming_the_convolutions():
    model, _ = build_cnn()
    graph = trace(model, (torch.randn(4, 3, 8, 8),))
    assert [b.members for b in graph.layer_blocks] == [[str(i), str(i + 1), str(i + 2)] for i in (2, 5, 8, 11)]
    support = parallel_support(model, graph)
    assert support.pp_problem(2) == ""
    assert "convolutions (2, 5, 8)" in support.tp_problem(2)


def _stand_ins(stage: nn.Module):
    """Paths of the modules a stage does not own (stand-ins)."""
    return [path for path, module in stage.named_modules() if isinstance(module, StandIn)]


def test_sequential_pipeline_stages_compute_the_whole_model():
    model, _ = build_cnn()
    x = torch.randn(4, 3, 8, 8)
    graph = trace(model, (x,))
    with torch.no_grad():
        expected = model(x)
        stages = split_stages(model, graph, [(0, 3), (3, 6)])
        arm_stages(stages)
        # a stage owns its groups' children and the parameterised head/tail children; the
        # parameter-free ones (1: ReLU, 14: pool, 15: Flatten) run on every stage like root code
        assert [_stand_ins(s) for s in stages] == [
            [str(i) for i in range(8, 14)] + ["16"],
            ["0"] + [str(i) for i in range(2, 8)],
        ]
        assert torch.equal(run_stages(stages, (x,), {}), expected)


@pytest.mark.parametrize("build, shape", [(build_mlp, (4, 16)), (build_cnn, (4, 3, 8, 8))], ids=["mlp", "cnn"])
def test_sequential_stages_compose_at_every_cut(build, shape):
    """One-block stages (the activation enters at a group's first child and leaves before the next
    group's), a stage owning only the tail, and interleaved chunks (copies of the skeleton)."""
    model, _ = build()
    x = torch.randn(*shape)
    graph = trace(model, (x,))
    n = len(graph.blocks)
    with torch.no_grad():
        expected = model(x)
        for ranges in ([(b, b + 1) for b in range(n)], [(0, n - 1), (n - 1, n)]):
            rehearse_split(model, graph, ranges, (x,), {})
            stages = split_stages(copy.deepcopy(model), graph, ranges)
            arm_stages(stages)
            assert torch.equal(run_stages(stages, (x,), {}), expected), ranges


class DoubledSequential(nn.Sequential):
    """An nn.Sequential whose own forward does more than run its children in order."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_a_sequential_with_its_own_forward_is_not_pipelined():
    model, _ = build_mlp()
    custom = DoubledSequential(*model)
    graph = trace(custom, (torch.randn(4, 16),))
    assert (
        parallel_support(custom, graph)
        .pp_problem(2)
        .startswith("pp=2: the model is a DoubledSequential, an nn.Sequential with its own forward")
    )
    nested = TokenMLP()
    nested.body = DoubledSequential(*nested.body)
    graph = trace(nested, (torch.randint(0, 64, (2, 8)),))
    assert "body is a DoubledSequential, an nn.Sequential with its own forward" in parallel_support(
        nested, graph
    ).pp_problem(2)
    with pytest.raises(SplitError, match="DoubledSequential"):
        split_stages(nested, graph, [(0, 2), (2, 4)])


class TokenMLP(nn.Module):
    """An embedding, a flat nn.Sequential body it calls, and an LM head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 32)
        self.body = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
        self.head = nn.Linear(32, 64)

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def test_a_sequential_body_splits_into_callable_stages():
    model, tokens = TokenMLP(), torch.randint(0, 64, (2, 8))
    graph = trace(model, (tokens,))
    assert graph.block_container == "body"
    assert [b.members for b in graph.layer_blocks] == [
        ["body.0", "body.1", "body.2", "body.3"],
        ["body.4", "body.5", "body.6", "body.7"],
    ]
    assert parallel_support(model, graph).pp_problem(2) == ""
    with torch.no_grad():
        expected = model(tokens)
        first, second = split_stages(model, graph, [(0, 2), (2, 4)])
        arm_stages([first, second])
        assert isinstance(first.body, nn.Sequential) and _stand_ins(first) == [f"body.{i}" for i in range(4, 8)] + [
            "head"
        ]
        assert _stand_ins(second) == ["embed"] + [f"body.{i}" for i in range(4)]
        assert torch.equal(run_stages([first, second], (tokens,), {}), expected)


# -- the fused layout ----------------------------------------------------------------------------------


def test_fused_layout_keeps_whole_parts_per_rank_and_round_trips():
    layout = FusedLayout(dim=0, parts=(8, 4, 4), tp=2)  # q: 4 heads of 2, k/v: 2 heads of 2
    weight = torch.arange(16.0).unsqueeze(1).expand(16, 3).contiguous()
    assert layout.rank_rows(1) == [4, 5, 6, 7, 10, 11, 14, 15]
    locals_ = [layout.local(weight, r) for r in range(2)]
    assert torch.equal(locals_[1][:, 0], torch.tensor([4.0, 5, 6, 7, 10, 11, 14, 15]))
    assert torch.equal(layout.to_original(torch.cat(locals_)), weight)
    # rank 1's rows as runs of the original: (position in the sharded layout, original row, length)
    assert layout.runs(8, 8) == [(8, 4, 4), (12, 10, 2), (14, 14, 2)]


def test_per_head_inputs_are_sliced_to_the_rank_heads():
    alibi = torch.arange(3 * 4 * 5.0).reshape(3 * 4, 1, 5)  # [batch * heads, 1, seq]
    spec = HeadInput(shape=[8, 1, 32], dim=0, count=4, inner=1)
    hidden = torch.randn(3, 5, 16)
    (h, a), kw = slice_head_inputs((hidden, alibi), {"bias": alibi[:6]}, [spec], tp=2, rank=1)
    assert h is hidden and kw["bias"].shape == (6, 1, 5)  # already 2 heads of 3 sequences: untouched
    assert torch.equal(a, alibi.view(3, 4, 1, 5)[:, 2:].reshape(6, 1, 5))
