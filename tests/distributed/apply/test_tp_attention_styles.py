"""Attention modules tensor parallelism used to leave whole under a TP plan, sharded by heads:
``nn.MultiheadAttention`` (torchvision's ViT, user code; ``graph.tp_mha``) and Swin's window
attention with its per-head ``relative_position_bias_table`` (``graph.tp_flow``).

In one process: the head-sharded MHA forward equals torch's (the ranks' partial outputs sum to
it, in every layout and mask kind), the pairs the tracer finds, what stays whole and why (and is
priced whole), what the cost model prices sharded, the profiler's one-rank copy, and the per-head
tables refused when used beyond their heads' lookup. On gloo ranks: TP2xDP2 parity with one device
(torchvision's ViT, Swin in timm's spelling, a sequence-first causal MHA), the parameters the
runtime shards exactly those the cost model prices as sharded, and a TP2 checkpoint in torch's
layout.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from nest_fx.apply import auto_parallelize
from nest_fx.apply.checkpoint import load_checkpoint
from nest_fx.apply.launch import launch
from nest_fx.graph import trace
from nest_fx.graph.tp_mha import MHA_OP, local_forward
from nest_fx.graph.tp_regions import unsharded_attention
from nest_fx.plan import uniform_plan
from nest_fx.plan.support import parallel_support
from nest_fx.report.tables import trace_table
from nest_fx.testing import COVERAGE_PLANS, equivalence
from nest_fx.testing_styles import STYLE_MODELS, StyleConfig, build_style, image_data, style_spec
from nest_fx.testing_vision_styles import WindowAttention
from nest_fx.workload.block_facts import block_facts
from nest_fx.workload.localise import localise_tp

BATCH, WORLD, LAUNCH_S, TOL = 8, 4, 300, 1e-5


def _traced(name: str):
    model, _ = build_style(name)
    x, _ = image_data(torch.Generator().manual_seed(0), BATCH)
    return model, trace(model, (x,), name=name)


def _rank_copy(mha: nn.MultiheadAttention, rank: int, tp: int) -> nn.MultiheadAttention:
    """``mha`` as TP rank ``rank`` holds it (q, k, v each cut by heads, out_proj by input features),
    running the head-sharded forward without collectives."""
    local = copy.deepcopy(mha)
    parts = lambda t: torch.cat([p.chunk(tp)[rank] for p in t.detach().split(mha.embed_dim)])  # noqa: E731
    local.in_proj_weight = nn.Parameter(parts(mha.in_proj_weight))
    local.in_proj_bias = nn.Parameter(parts(mha.in_proj_bias))
    local.out_proj.weight = nn.Parameter(mha.out_proj.weight.detach().chunk(tp, 1)[rank].contiguous())
    local.forward = local_forward(local, rank, tp)
    return local


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("masks", ["none", "causal-bool", "per-head-float", "padding", "both"])
def test_head_sharded_multihead_forward_equals_torchs(batch_first, batched, masks):
    """What each TP rank computes on its heads, summed over the ranks as the row's all-reduce
    sums it (``out_proj.bias`` added once), is torch's own ``nn.MultiheadAttention`` output."""
    torch.manual_seed(0)
    heads, width, length, batch, tp = 4, 16, 5, 3, 2
    mha = nn.MultiheadAttention(width, heads, batch_first=batch_first)
    shape = (batch, length, width) if batch_first else (length, batch, width)
    x = torch.randn(shape if batched else (length, width))
    n = batch if batched else 1
    kwargs = {}
    if masks in ("causal-bool", "both"):
        kwargs["attn_mask"] = torch.ones(length, length, dtype=torch.bool).triu(1)
    if masks == "per-head-float":
        kwargs["attn_mask"] = torch.randn(n * heads, length, length)
    if masks in ("padding", "both"):
        padding = torch.zeros(n, length, dtype=torch.bool)
        padding[:, -2:] = True
        kwargs["key_padding_mask"] = padding if batched else padding[0]
    ref, _ = mha(x, x, x, need_weights=False, **kwargs)
    bias = mha.out_proj.bias
    outs = [_rank_copy(mha, r, tp)(x, x, x, need_weights=False, **kwargs) for r in range(tp)]
    assert all(w is None for _, w in outs)
    total = sum(out - bias for out, _ in outs) + bias
    assert total.shape == ref.shape
    assert torch.allclose(total, ref, atol=1e-6, rtol=1e-5), float((total - ref).abs().max())


def test_multihead_attention_is_a_pair_sharded_by_heads_and_priced_so():
    """torchvision's ViT: each ``nn.MultiheadAttention`` becomes an attention pair (q, k and v of
    ``in_proj_*`` cut by heads, ``out_proj`` the row), nothing is left whole, and the cost model
    prices the call as sharded: its q/k/v and output weights (not ``out_proj.bias``), one more
    all-reduce per layer, its input saved whole on every rank."""
    model, graph = _traced("tv-vit")
    assert unsharded_attention(graph) == [] and graph.replicated_attention == {}
    block = graph.layer_blocks[0]
    pair = next(p for p in graph.pattern_of(block).tp_pairs if p.leaf)
    assert pair.leaf == "self_attention" and pair.row == "self_attention.out_proj" and not pair.problem
    qkv = next(p for p in pair.params if p.name == "self_attention.in_proj_weight")
    assert (qkv.dim, qkv.parts, qkv.units) == (0, [32, 32, 32], [8, 8, 8])
    assert parallel_support(model, graph).tp_problem(2) == ""  # the TP rehearsal runs the sharded forward
    assert "does not divide" in parallel_support(model, graph).tp_problem(8)  # 4 heads
    assert "nn.MultiheadAttention" in parallel_support(model, graph).sp_problem()
    facts = block_facts(graph, block)
    call = next(f for n, f in zip(block.nodes, facts.nodes) if graph.graph.nodes[n].get("op") == MHA_OP)
    mha = model.get_submodule(block.fqn("self_attention"))
    assert call.tp and not call.column and call.matmul
    assert call.tp_params == mha.in_proj_weight.numel() + mha.in_proj_bias.numel() + mha.out_proj.weight.numel()
    assert call.params - call.tp_params == mha.out_proj.bias.numel()
    assert call.saved_whole == 8 * 17 * 32 * 4  # its input [batch, tokens, width] in fp32
    assert facts.tp_allreduces == 2  # the attention's output and the MLP's


def test_the_profilers_one_rank_copy_runs_the_head_sharded_attention():
    """``workload.localise`` (what ``nest-fx profile --tp 2`` times): each ``nn.MultiheadAttention``
    keeps rank 0's heads and runs the head-sharded forward on them."""
    model, graph = _traced("tv-vit")
    x, _ = image_data(torch.Generator().manual_seed(0), BATCH)
    local = localise_tp(model, graph, 2, vocab_size=-1)
    mha = local.get_submodule("encoder.layers.encoder_layer_0.self_attention")
    assert tuple(mha.in_proj_weight.shape) == (48, 32) and tuple(mha.out_proj.weight.shape) == (32, 16)
    assert tuple(local(x).shape) == (BATCH, 10)


class _Custom(nn.Module):
    """User layers around an ``nn.MultiheadAttention``: ``reads_weights``: the model uses the
    attention weights it returns; ``kdim``: keys and values of their own width (the first ``kdim``
    features)."""

    def __init__(self, reads_weights: bool = False, kdim: int = 16):
        super().__init__()
        self.reads_weights, self.kdim = reads_weights, kdim
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "attn": nn.MultiheadAttention(16, 4, kdim=kdim, vdim=kdim, batch_first=True),
                    "fc1": nn.Linear(16, 32),
                    "fc2": nn.Linear(32, 16),
                }
            )
            for _ in range(2)
        )

    def forward(self, x):
        for layer in self.layers:
            memory = x[..., : self.kdim]
            out, weights = layer["attn"](x, memory, memory)  # need_weights=True, torch's default
            x = x + out + (weights.mean() if self.reads_weights else 0)
            x = x + layer["fc2"](torch.relu(layer["fc1"](x)))
        return x


@pytest.mark.parametrize(
    "reads_weights,kdim,why", [(True, 16, "need_weights=False"), (False, 8, "kdim/vdim"), (False, 16, "")]
)
def test_multihead_attention_it_cannot_shard_stays_whole_reported_and_priced_whole(reads_weights, kdim, why):
    """A call whose attention weights the model reads (the default ``need_weights=True``, used), or
    with keys and values of their own width, stays whole on every rank: named with the reason, and
    priced whole. Weights returned but never read do not stop it (cross-attention included)."""
    model = _Custom(reads_weights, kdim)
    graph = trace(model, (torch.randn(2, 6, 16),))
    block = graph.layer_blocks[0]
    facts = block_facts(graph, block)
    call = next(f for n, f in zip(block.nodes, facts.nodes) if graph.graph.nodes[n].get("op") == MHA_OP)
    if not why:
        assert unsharded_attention(graph) == [] and graph.replicated_attention == {}
        assert call.tp and facts.tp_allreduces == 2
        assert parallel_support(model, graph).tp_problem(2) == ""
        return
    assert unsharded_attention(graph) == ["layers.0.attn", "layers.1.attn"]
    assert why in graph.replicated_attention["layers.0.attn"]
    assert "whole under TP: attn" in trace_table(graph, 0.0)  # `nest-fx trace` names it per layer
    assert not call.tp and call.tp_params == 0 and call.saved_whole == 0
    assert facts.tp_allreduces == 1  # the MLP's only


def test_swin_bias_table_is_sharded_with_the_heads():
    """Swin's ``relative_position_bias_table[relative_position_index]`` ([entries, heads]) is a
    per-head table: sharded along its heads dim with the qkv/proj pair, its lookup priced sharded.
    The original Swin's ``reshape(B_, N, 3, heads, C // heads)`` reads the input's width: refused by
    the TP rehearsal with the fix; timm's ``-1`` spelling shards."""
    model, graph = _traced("swin-views")
    block = graph.layer_blocks[0]
    pair = next(p for p in graph.pattern_of(block).tp_pairs if p.kind == "attention")
    table = next(p for p in pair.params if p.name.endswith("relative_position_bias_table"))
    assert (table.name, table.dim) == ("blocks.0.attn.relative_position_bias_table", 1) and not pair.problem
    assert parallel_support(model, graph).tp_problem(2) == ""
    assert "does not divide" in parallel_support(model, graph).tp_problem(4)  # the first stage has 2 heads
    facts = dict(zip(block.nodes, block_facts(graph, block).nodes))
    lookup = [
        n for n in block.nodes if (graph.graph.nodes[n].get("input_params") or [None])[0] == block.fqn(table.name)
    ]
    assert lookup and all(facts[n].tp for n in lookup)  # the gather of the table and its views
    assert facts[lookup[0]].tp_params == model.get_parameter(block.fqn(table.name)).numel()
    original, graph = _traced("swin")
    problem = parallel_support(original, graph).tp_problem(2)
    assert "cannot shard layers.0.blocks.0.attn (WindowAttention)" in problem and "-1" in problem


def _priced_sharded(name: str) -> float:
    """Parameters the cost model prices as TP-sharded (every block's facts), summed."""
    _, graph = _traced(name)
    return sum(n.tp_params for block in graph.blocks for n in block_facts(graph, block).nodes)


@pytest.mark.dist
@pytest.mark.timeout(2 * LAUNCH_S)
@pytest.mark.parametrize(
    "name,sharded,recompute",
    [
        ("tv-vit", "encoder.layers.encoder_layer_1.self_attention.in_proj_weight", False),
        # the same bias-table shard swap as the recompute cell below, which also swaps it in again
        pytest.param(
            "swin-views", "layers.1.blocks.1.attn.relative_position_bias_table", False, marks=pytest.mark.slow
        ),
        ("swin-views", "layers.0.blocks.0.attn.relative_position_bias_table", True),
    ],
)
def test_tp2_dp2_parity_and_the_priced_shards_are_the_run_ones(name, sharded, recompute):
    """TP2xDP2 on 4 gloo ranks: loss, gradients and parameters equal one device's, the attention is
    sharded, and the parameters the runtime shards are, to the element, those the cost model
    prices as sharded. ``recompute``: two microbatches, each layer recomputed in the backward (the
    bias table's shard swapped in again while its forward reruns)."""
    plan = dict(COVERAGE_PLANS["TP2xDP2"])
    if recompute:
        plan.update(microbatch_size=2, num_microbatches=2, recompute="full")
    spec = style_spec(name, plan, batch=BATCH)
    ranks = launch(equivalence, WORLD, spec, timeout=LAUNCH_S)
    worst = {k: max(r[k] for r in ranks) for k in ("loss_diff", "grad_excess", "param_excess")}
    print(
        name,
        {k: f"{v:.1e}" for k, v in worst.items()},
        f"grad_diff={max(r['grad_diff'] for r in ranks):.1e} param_diff={max(r['param_diff'] for r in ranks):.1e}",
    )
    assert all(v < TOL for v in worst.values()), worst
    run = set(ranks[0]["sharded"])
    assert sharded in run
    assert ranks[0]["plan"]["stages"][0]["recompute"] == ("full" if recompute else "none")
    model, _ = build_style(name)
    assert sum(model.get_parameter(p).numel() for p in run) == _priced_sharded(name)
    assert STYLE_MODELS[name][0] == "vision"


class _CausalLayer(nn.Module):
    """A decoder layer around a sequence-first ``nn.MultiheadAttention`` under a boolean causal
    mask, called with torch's defaults (``need_weights=True``, the weights left unread)."""

    def __init__(self, width: int = 32, heads: int = 4, seq: int = 16):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), nn.MultiheadAttention(width, heads)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x):
        h = self.ln1(x).transpose(0, 1)  # [seq, batch, width]
        out, _ = self.attn(h, h, h, attn_mask=self.mask)
        x = x + out.transpose(0, 1)
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class _CausalLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_CausalLayer(width) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_causal_lm(seed: int = 0):
    """The harness's ``build(seed) -> (model, config)`` of :class:`_CausalLM`."""
    torch.manual_seed(seed)
    return _CausalLM(), StyleConfig(vocab_size=64, seq_len=16)


@pytest.mark.dist
@pytest.mark.timeout(2 * LAUNCH_S)
def test_sequence_first_masked_multihead_attention_tp2_dp2_parity():
    """A sequence-first ``nn.MultiheadAttention`` under a boolean causal mask, its weights returned
    and unread: sharded by heads, at parity with one device on 4 gloo ranks (TP2xDP2)."""
    spec = {
        "model": "causal-mha",
        "build": build_causal_lm,
        "plan": COVERAGE_PLANS["TP2xDP2"],
        "batch": BATCH,
        "seq": 16,
        "steps": 3,
        "lr": 0.5,
    }
    ranks = launch(equivalence, WORLD, spec, timeout=LAUNCH_S)
    worst = {k: max(r[k] for r in ranks) for k in ("loss_diff", "grad_excess", "param_excess")}
    print(
        {k: f"{v:.1e}" for k, v in worst.items()},
        f"grad_diff={max(r['grad_diff'] for r in ranks):.1e} param_diff={max(r['param_diff'] for r in ranks):.1e}",
    )
    assert all(v < TOL for v in worst.values()), worst
    assert "layers.1.attn.in_proj_weight" in ranks[0]["sharded"]
    assert ranks[0]["plan"]["stages"][0]["tp"] == 2


class _TableRegularised(WindowAttention):
    """Reads its bias table a second time, outside the attention (a penalty on the whole table)."""

    def forward(self, x):
        return super().forward(x) + self.relative_position_bias_table.sum()


class _TableReadByParent(nn.Module):
    """Its parent reads the child's bias table, outside the child's forward."""

    def __init__(self):
        super().__init__()
        self.attn = WindowAttention(16, 4, 2, local_views=True)

    def forward(self, x):
        return self.attn(x) + self.attn.relative_position_bias_table.mean()


class _Windows(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize(
    "layer,says",
    [
        (lambda: _TableRegularised(16, 4, 2, local_views=True), "also used by op 'sum'"),
        (_TableReadByParent, "is read outside the forward of its module 'layers.0.attn'"),
    ],
)
def test_a_bias_table_used_beyond_its_heads_lookup_is_refused(layer, says):
    """A per-head table is sharded only when all its uses carry its heads to the pair, inside its
    own module's forward (where the runtime swaps in the shard): otherwise tp is refused, naming it."""
    model = _Windows(layer)
    graph = trace(model, (torch.randn(2, 16, 16),))
    problem = parallel_support(model, graph).tp_problem(2)
    assert "relative_position_bias_table" in problem and says in problem and "fix:" in problem
    plain = _Windows(lambda: WindowAttention(16, 4, 2, local_views=True))  # the table read once, by its lookup
    assert parallel_support(plain, trace(plain, (torch.randn(2, 16, 16),))).tp_problem(2) == ""


def _save_tv_vit_tp2(path: str):
    """One SGD step of torchvision's ViT under TP2 (2 ranks), saved; its parameters in the model's
    layout (``full_tensors``), as bytes."""
    model, _ = build_style("tv-vit", seed=1)
    x, y = image_data(torch.Generator().manual_seed(0), 4)
    pm = auto_parallelize(
        model,
        x,
        global_batch_size=4,
        loss_fn=nn.functional.cross_entropy,
        verbose=False,
        plan=uniform_plan(4, tp=2, microbatch_size=4),
    )
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    pm.train_step(x, y)
    opt.step()
    pm.save(path, opt, step=1)
    buf = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in pm.full_tensors().items()}, buf)
    return buf.getvalue()


@pytest.mark.dist
@pytest.mark.timeout(2 * LAUNCH_S)
def test_a_head_sharded_multihead_attention_checkpoints_in_the_models_layout(tmp_path):
    """``in_proj_weight`` sharded by q/k/v heads is saved in torch's own layout: loaded on one
    device, every parameter equals the TP2 run's, bit for bit."""
    blobs = launch(_save_tv_vit_tp2, 2, str(tmp_path / "tp2"), timeout=LAUNCH_S)
    run = torch.load(io.BytesIO(blobs[0]))
    model, _ = build_style("tv-vit", seed=7)
    load_checkpoint(model, str(tmp_path / "tp2"))
    loaded = dict(model.named_parameters())
    assert sorted(run) == sorted(loaded)
    assert not [k for k in run if not torch.equal(run[k], loaded[k].detach())]
    assert not torch.equal(
        run["encoder.layers.encoder_layer_0.self_attention.in_proj_weight"],
        build_style("tv-vit", seed=1)[0].encoder.layers.encoder_layer_0.self_attention.in_proj_weight,
    )


class _FunctionalProjections(nn.Module):
    """torchvision's Swin style: ``F.linear(x, self.qkv.weight, self.qkv.bias)`` in the attention's
    forward, the ``qkv``/``proj`` modules never called."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.num_heads = nn.Linear(32, 96), nn.Linear(32, 32), 4

    def forward(self, x):
        B, N, _ = x.shape
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias).reshape(B, N, 3, self.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, -1)
        return F.linear(y, self.proj.weight, self.proj.bias)


def test_a_linears_weight_read_outside_its_own_forward_is_refused():
    """The runtime shards a linear module through its own forward; a weight another module's forward
    reads (``F.linear(x, self.qkv.weight)``) would meet the input as a DTensor and crash in training
    (it did: ``aten.addmm.default got mixed torch.Tensor and DTensor``): refused, naming it."""
    model = _Windows(_FunctionalProjections)
    graph = trace(model, (torch.randn(2, 8, 32),))
    problem = parallel_support(model, graph).tp_problem(2)
    assert "the weight of module layers.0.qkv is used by op 'linear' in the forward of 'layers.0'" in problem
    assert "`self.qkv(x)`" in problem and "fix:" in problem


@pytest.mark.parametrize("reads_weights", [True, False])
def test_the_setup_names_attention_left_whole_with_its_reason(reads_weights):
    """On the fake process group (one process, no data): a TP2xDP2 setup warns, naming the
    ``nn.MultiheadAttention`` it leaves whole and why (its ``in_proj_weight`` whole: 48 x 16 on
    the rank); with the weights unread it shards it (24 rows: q, k, v each 16 / 2) and says nothing."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = auto_parallelize(
                _Custom(reads_weights),
                torch.randn(4, 6, 16),
                global_batch_size=4,
                loss_fn=lambda out, _: out.mean(),
                verbose=False,
                plan=uniform_plan(4, tp=2, dp=2, microbatch_size=2),
            )
    finally:
        dist.destroy_process_group()
    said = [str(w.message) for w in caught if "runs whole on every TP rank" in str(w.message)]
    if reads_weights:
        assert len(said) == 1 and "['layers.0.attn', 'layers.1.attn']" in said[0] and "need_weights=False" in said[0]
    else:
        assert said == []
    weight = dict(pm.named_parameters())["layers.0.attn.in_proj_weight"]
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    assert tuple(local.shape) == ((48, 16) if reads_weights else (24, 16))
